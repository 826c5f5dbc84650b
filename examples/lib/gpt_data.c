/* The GPT recipe's data, random streams, initialisation and baselines;
 * the rules are stated in gpt_data.h. No dispatch calls here. */
#include "gpt_data.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int gr_cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int gr_has_suffix(const char *s, const char *suf) {
  size_t n = strlen(s), m = strlen(suf);
  return n >= m && !strcmp(s + n - m, suf);
}

/* The sorted corpus file names of folder (each malloc'd); count or -1. */
static int gr_list(const char *folder, char ***names, char *err, size_t len) {
  DIR *d = opendir(folder);
  int n = 0, cap = 0;
  char **v = NULL;
  if (!d) {
    snprintf(err, len, "%s: cannot open (install fortunes fortunes-min)",
             folder);
    return -1;
  }
  for (struct dirent *e; (e = readdir(d));) {
    char path[4096];
    struct stat st;
    if (e->d_name[0] == '.' || gr_has_suffix(e->d_name, ".dat") ||
        gr_has_suffix(e->d_name, ".u8"))
      continue;
    snprintf(path, sizeof path, "%s/%s", folder, e->d_name);
    if (lstat(path, &st) < 0 || !S_ISREG(st.st_mode)) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      char **nv = realloc(v, (size_t)cap * sizeof *v);
      if (!nv) break;
      v = nv;
    }
    if (!(v[n] = strdup(e->d_name))) break;
    n++;
  }
  closedir(d);
  qsort(v, (size_t)n, sizeof *v, gr_cmp_names);
  *names = v;
  if (n == 0) snprintf(err, len, "%s: no corpus files", folder);
  return n;
}

/* Appends the whole file to buf (grown as needed); 0 or -1. */
static int gr_append(const char *path, uint8_t **buf, size_t *n, size_t *cap,
                     char *err, size_t len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, len, "%s: cannot open", path);
    return -1;
  }
  for (;;) {
    if (*cap - *n < 65536) {
      size_t nc = *cap ? 2 * *cap : 1 << 20;
      uint8_t *nb = realloc(*buf, nc);
      if (!nb) {
        fclose(f);
        snprintf(err, len, "out of memory reading %s", path);
        return -1;
      }
      *buf = nb;
      *cap = nc;
    }
    size_t r = fread(*buf + *n, 1, *cap - *n, f);
    *n += r;
    if (r == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) snprintf(err, len, "%s: read error", path);
  return bad ? -1 : 0;
}

/* Bytes to ranks in the sorted set of bytes present. */
static void gr_tokenize(gr_corpus *c) {
  int present[256] = {0}, rank[256];
  for (size_t i = 0; i < c->n; i++) present[c->tok[i]] = 1;
  c->nvocab = 0;
  for (int b = 0; b < 256; b++)
    if (present[b]) {
      rank[b] = c->nvocab;
      c->vocab[c->nvocab++] = (uint8_t)b;
    }
  for (size_t i = 0; i < c->n; i++) c->tok[i] = (uint8_t)rank[c->tok[i]];
}

int gr_corpus_load(const char *folder, gr_corpus *c, char *err, size_t len) {
  char **names = NULL;
  size_t cap = 0;
  int rc = 0;
  memset(c, 0, sizeof *c);
  if (!folder) folder = getenv("GPT_CORPUS_DIR");
  if (!folder || !*folder) folder = GR_CORPUS_DIR;
  int n = gr_list(folder, &names, err, len);
  if (n <= 0) rc = -1;
  for (int i = 0; i < n && rc == 0; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", folder, names[i]);
    rc = gr_append(path, &c->tok, &c->n, &cap, err, len);
  }
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
  if (rc == 0 && c->n < 20 * (GR_CTX + 1) * 10) {
    snprintf(err, len, "%s: corpus of %zu bytes is too small", folder, c->n);
    rc = -1;
  }
  if (rc < 0) {
    gr_corpus_free(c);
    return -1;
  }
  gr_tokenize(c);
  c->n_train = c->n - c->n / 10;
  return 0;
}

void gr_corpus_free(gr_corpus *c) {
  free(c->tok);
  memset(c, 0, sizeof *c);
}

uint64_t gr_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double gr_uniform(uint64_t *state) {
  return (double)(gr_next(state) >> 11) * (1.0 / 9007199254740992.0);
}

void gr_batch_offsets(uint64_t *state, const gr_corpus *c, size_t *off) {
  for (int i = 0; i < GR_BATCH; i++)
    off[i] = (size_t)(gr_next(state) % (uint64_t)(c->n_train - GR_CTX));
}

void gr_windows(const gr_corpus *c, size_t base, const size_t *off, int nwin,
                int64_t *x, int64_t *y) {
  for (int i = 0; i < nwin; i++)
    for (int t = 0; t < GR_CTX; t++) {
      x[i * GR_CTX + t] = c->tok[base + off[i] + (size_t)t];
      y[i * GR_CTX + t] = c->tok[base + off[i] + (size_t)t + 1];
    }
}

void gr_val_offsets(const gr_corpus *c, size_t *off) {
  size_t step = (c->n - c->n_train - GR_CTX - 1) / (GR_VAL_WINDOWS - 1);
  for (int i = 0; i < GR_VAL_WINDOWS; i++) off[i] = (size_t)i * step;
}

static void gr_spec(gr_param_spec *s, const char *name, int ndim, int64_t d0,
                    int64_t d1, enum gr_init init) {
  snprintf(s->name, sizeof s->name, "%s", name);
  s->ndim = ndim;
  s->shape[0] = d0;
  s->shape[1] = d1;
  s->init = init;
}

void gr_param_specs(int nvocab, gr_param_spec *s) {
  const int64_t D = GR_D_MODEL, V = nvocab, M = GR_D_MLP;
  static const char mats[4] = {'q', 'k', 'v', 'o'};
  char nm[32]; /* "h%d.ln2.w" for any int l */
  int i = 0;
  gr_spec(&s[i++], "wte", 2, V, D, GR_NORMAL);
  gr_spec(&s[i++], "wpe", 2, GR_CTX, D, GR_NORMAL);
  for (int l = 0; l < GR_N_LAYER; l++) {
    snprintf(nm, sizeof nm, "h%d.ln1.w", l);
    gr_spec(&s[i++], nm, 1, D, 0, GR_ONES);
    snprintf(nm, sizeof nm, "h%d.ln1.b", l);
    gr_spec(&s[i++], nm, 1, D, 0, GR_ZEROS);
    for (int m = 0; m < 4; m++) {
      snprintf(nm, sizeof nm, "h%d.w%c", l, mats[m]);
      gr_spec(&s[i++], nm, 2, D, D, GR_NORMAL);
      snprintf(nm, sizeof nm, "h%d.b%c", l, mats[m]);
      gr_spec(&s[i++], nm, 1, D, 0, GR_ZEROS);
    }
    snprintf(nm, sizeof nm, "h%d.ln2.w", l);
    gr_spec(&s[i++], nm, 1, D, 0, GR_ONES);
    snprintf(nm, sizeof nm, "h%d.ln2.b", l);
    gr_spec(&s[i++], nm, 1, D, 0, GR_ZEROS);
    snprintf(nm, sizeof nm, "h%d.w1", l);
    gr_spec(&s[i++], nm, 2, D, M, GR_NORMAL);
    snprintf(nm, sizeof nm, "h%d.b1", l);
    gr_spec(&s[i++], nm, 1, M, 0, GR_ZEROS);
    snprintf(nm, sizeof nm, "h%d.w2", l);
    gr_spec(&s[i++], nm, 2, M, D, GR_NORMAL);
    snprintf(nm, sizeof nm, "h%d.b2", l);
    gr_spec(&s[i++], nm, 1, D, 0, GR_ZEROS);
  }
  gr_spec(&s[i++], "lnf.w", 1, D, 0, GR_ONES);
  gr_spec(&s[i++], "lnf.b", 1, D, 0, GR_ZEROS);
  gr_spec(&s[i++], "wout", 2, D, V, GR_NORMAL);
  gr_spec(&s[i++], "bout", 1, V, 0, GR_ZEROS);
}

void gr_param_fill(const gr_param_spec *s, uint64_t *state, float *out) {
  int64_t n = s->shape[0] * (s->ndim == 2 ? s->shape[1] : 1);
  for (int64_t i = 0; i < n; i++) {
    if (s->init != GR_NORMAL) {
      out[i] = s->init == GR_ONES ? 1.0f : 0.0f;
      continue;
    }
    double u1 = (double)((gr_next(state) >> 11) + 1) *
                (1.0 / 9007199254740992.0);
    double u2 = (double)(gr_next(state) >> 11) * (1.0 / 9007199254740992.0);
    double z = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
    out[i] = (float)(GR_INIT_STD * z);
  }
}

int gr_baselines(const gr_corpus *c, double *bigram, double *unigram) {
  const int V = c->nvocab;
  double *big = calloc((size_t)V * (size_t)V, sizeof *big);
  double uni[256] = {0}, row[256] = {0};
  size_t off[GR_VAL_WINDOWS];
  if (!big) return -1;
  for (size_t i = 0; i < c->n_train; i++) uni[c->tok[i]] += 1;
  for (size_t i = 0; i + 1 < c->n_train; i++) {
    big[c->tok[i] * V + c->tok[i + 1]] += 1;
    row[c->tok[i]] += 1;
  }
  gr_val_offsets(c, off);
  double sb = 0, su = 0;
  for (int w = 0; w < GR_VAL_WINDOWS; w++)
    for (int t = 0; t < GR_CTX; t++) {
      size_t p = c->n_train + off[w] + (size_t)t;
      int a = c->tok[p], b = c->tok[p + 1];
      sb -= log((big[a * V + b] + 1.0) / (row[a] + V));
      su -= log((uni[b] + 1.0) / ((double)c->n_train + V));
    }
  free(big);
  *bigram = sb / (GR_VAL_WINDOWS * GR_CTX);
  *unigram = su / (GR_VAL_WINDOWS * GR_CTX);
  return 0;
}

int gr_sample_pick(uint64_t *state, const double *probs, int n) {
  double u = gr_uniform(state), acc = 0;
  for (int i = 0; i < n; i++) {
    acc += probs[i];
    if (u < acc) return i;
  }
  return n - 1;
}
