/* Checkpoints in the safetensors format: an 8-byte little-endian header
 * length N, N bytes of JSON naming each tensor's dtype, shape and
 * [begin, end) offsets into the data section, then the raw little-endian
 * bytes. The JSON is written and parsed by cJSON (Debian's libcjson).
 *
 * Memory: a save reads each tensor in pieces of at most CKPT_CHUNK bytes
 * (one row of dim 0 when a row is larger), so saving a REMOTE model never
 * holds a second copy of it here; a load holds one tensor's bytes at a
 * time. A load validates the whole header against the file size before it
 * creates the first tensor, and frees every tensor it made on any failure,
 * so a refused file leaves nothing behind. */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
/* tensor bytes go to the file as they are in memory; safetensors wants
 * little-endian, so a big-endian port needs a byte swap here first */
#error "checkpoint.c assumes a little-endian host"
#endif

#define CKPT_MAX_HEADER ((uint64_t)100 << 20) /* as the reference reader */
#define CKPT_CHUNK ((size_t)1 << 20)          /* bytes per read in a save */
#define CKPT_MAX_EXACT 9007199254740992.0     /* 2^53: exact in a JSON number */

struct dispatch_checkpoint {
  dispatch_device *dev;
  int n;
  char **names;              /* in data order */
  dispatch_tensor **tensors; /* one reference each, unscoped */
  int *by_name;              /* indices sorted by name (lookups) */
  int n_meta;
  char **meta_keys, **meta_vals;
};

static const char *const k_st_dtype[] = {"F32", "F64", "I64", "BOOL"};

/* Puts a prefix before the message ctx holds: dsp_seterr formats into
 * the ctx's own buffer, so the old message is copied out first. */
static int prefix_err(dsp_ctx *ctx, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int prefix_err(dsp_ctx *ctx, int rc, const char *fmt, ...) {
  char pre[512], old[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pre, sizeof pre, fmt, ap);
  va_end(ap);
  snprintf(old, sizeof old, "%s", dsp_ctx_errmsg(ctx));
  return dsp_seterr(ctx, rc, "%s: %s", pre, old);
}

/* 1 when s is well-formed UTF-8 (no overlongs, surrogates or code points
 * past U+10FFFF): the header is JSON text, which other readers decode
 * strictly. */
static int utf8_ok(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    size_t len;
    unsigned cp;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return 0;
    }
    if (n - i < len) return 0;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
        (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return 0;
    i += len;
  }
  return 1;
}

/* ------------------------------------------------------------------ */
/* file helpers                                                        */

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* 0, or -1 with errno set (0 for a short file). */
static int pread_all(int fd, void *p, size_t n, uint64_t off) {
  uint8_t *b = p;
  while (n) {
    ssize_t r = pread(fd, b, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) {
      errno = 0;
      return -1;
    }
    b += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

/* ------------------------------------------------------------------ */
/* save                                                                */

/* One tensor of the file: a tensor to read, or (the Adam step count)
 * eight inline bytes. */
typedef struct ck_entry {
  char *name;
  dispatch_tensor *t; /* borrowed, LOCAL or REMOTE */
  dsp_meta meta;
  uint64_t nbytes, begin;
  int64_t inline_i64;
} ck_entry;

static int cmp_entry_name(const void *a, const void *b) {
  return strcmp(((const ck_entry *)a)->name, ((const ck_entry *)b)->name);
}

/* Streams t's bytes to fd: whole when it fits CKPT_CHUNK, else as slices
 * of whole rows of dim 0 (at least one row), each read and freed before
 * the next. Row-major slices of dim 0 are contiguous, so the pieces
 * concatenate to the tensor's bytes. */
static int stream_tensor(dispatch_device *dev, int fd, ck_entry *e,
                         uint8_t **buf, size_t *cap, const char *path) {
  dispatch_tensor *t = e->t;
  size_t nb = (size_t)e->nbytes;
  if (!nb) return 0;
  int64_t rows = e->meta.ndim ? e->meta.shape[0] : 1;
  size_t row_bytes = nb / (size_t)rows;
  int64_t step = rows;
  if (nb > CKPT_CHUNK && e->meta.ndim > 0) {
    step = (int64_t)(CKPT_CHUNK / row_bytes);
    if (step < 1) step = 1;
  }
  size_t want = (size_t)step * row_bytes;
  if (want > *cap) {
    uint8_t *nbuf = dsp_realloc(*buf, want);
    if (!nbuf)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "save \"%s\": out of memory (%zu bytes for tensor "
                        "\"%s\")",
                        path, want, e->name);
    *buf = nbuf;
    *cap = want;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    int64_t r1 = r0 + step < rows ? r0 + step : rows;
    size_t len = (size_t)(r1 - r0) * row_bytes;
    int rc;
    if (r0 == 0 && r1 == rows) {
      rc = dispatch_tensor_read(t, *buf, len);
    } else {
      dispatch_tensor *s = NULL;
      rc = dispatch_slice(t, 0, r0, r1, 1, &s);
      if (rc == 0) rc = dispatch_tensor_read(s, *buf, len);
      dispatch_tensor_free(s);
    }
    if (rc < 0)
      return prefix_err(dev->ctx, rc, "save \"%s\": reading tensor \"%s\"",
                        path, e->name);
    if (write_all(fd, *buf, len) < 0)
      return dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                        strerror(errno));
  }
  return 0;
}

/* The metadata "dispatch.optim" names the optimizer; Adam and AdamW keep
 * m, v and the step count t, SGD its velocity. */
static const char *optim_kind(const dispatch_optim *o) {
  return o->op == DSP_OP_SGD_STEP    ? "sgd"
         : o->op == DSP_OP_ADAM_STEP ? "adam"
                                     : "adamw";
}
static int optim_has_t(const dispatch_optim *o) {
  return o->op != DSP_OP_SGD_STEP;
}

/* The header: {"__metadata__": {...}, name: {dtype, shape, data_offsets},
 * ...} in data order, padded with spaces so the data starts 8-aligned. */
static char *build_header(const ck_entry *es, int n, const dispatch_optim *opt,
                          size_t *len) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return NULL;
  cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
  int ok = meta && cJSON_AddStringToObject(meta, "format", "dispatch");
  if (ok && opt) {
    char nb[32];
    snprintf(nb, sizeof nb, "%d", opt->n);
    ok = cJSON_AddStringToObject(meta, "dispatch.optim", optim_kind(opt)) &&
         cJSON_AddStringToObject(meta, "dispatch.optim.params", nb);
  }
  for (int i = 0; ok && i < n; i++) {
    cJSON *o = cJSON_AddObjectToObject(root, es[i].name);
    cJSON *shape = o ? cJSON_AddArrayToObject(o, "shape") : NULL;
    ok = o && shape &&
         cJSON_AddStringToObject(o, "dtype", k_st_dtype[es[i].meta.dtype]);
    for (int d = 0; ok && d < es[i].meta.ndim; d++) {
      cJSON *v = cJSON_CreateNumber((double)es[i].meta.shape[d]);
      ok = v && cJSON_AddItemToArray(shape, v);
    }
    cJSON *off = ok ? cJSON_AddArrayToObject(o, "data_offsets") : NULL;
    cJSON *b = cJSON_CreateNumber((double)es[i].begin);
    cJSON *e = cJSON_CreateNumber((double)(es[i].begin + es[i].nbytes));
    ok = off && b && e;
    if (ok) {
      cJSON_AddItemToArray(off, b);
      cJSON_AddItemToArray(off, e);
    } else {
      cJSON_Delete(b);
      cJSON_Delete(e);
    }
  }
  char *js = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (!js) return NULL;
  size_t jl = strlen(js), padded = (jl + 7) & ~(size_t)7;
  char *out = dsp_malloc(padded ? padded : 1);
  if (out) {
    memcpy(out, js, jl);
    memset(out + jl, ' ', padded - jl);
    *len = padded;
  }
  cJSON_free(js);
  return out;
}

/* Best effort: makes the rename itself durable. */
static void fsync_dir_of(const char *path) {
  const char *slash = strrchr(path, '/');
  char dir[4096];
  if (!slash) {
    snprintf(dir, sizeof dir, ".");
  } else if (slash == path) {
    snprintf(dir, sizeof dir, "/");
  } else {
    size_t l = (size_t)(slash - path);
    if (l >= sizeof dir) return;
    memcpy(dir, path, l);
    dir[l] = 0;
  }
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

/* Validates every name and tensor, lays out the data section, writes
 * header and data to PATH.tmp.PID.N, fsyncs it and renames it over path:
 * a reader sees the old file or the whole new one, never a part. */
int dispatch_save(dispatch_device *dev, const char *path,
                  const char *const *names, dispatch_tensor *const *tensors,
                  int n, const dispatch_optim *opt) {
  if (!dev) return DISPATCH_EINVAL;
  if (!path || !*path || n < 0 || (n > 0 && (!names || !tensors)))
    return dispatch__ret(
        dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "save: needs a path and n >= 0 names and tensors"));
  if (opt && opt->dev != dev)
    return dispatch__ret(
        dev,
        dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                   "save \"%s\": the optimizer lives on \"%s\", not \"%s\"",
                   path, opt->dev->spec, dev->spec));
  int per = opt ? opt->k : 0;
  int64_t total64 =
      (int64_t)n +
      (opt ? (int64_t)opt->n * per + optim_has_t(opt) : 0);
  if (total64 > INT32_MAX)
    return dispatch__ret(dev,
                         dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                    "save \"%s\": too many tensors", path));
  int total = (int)total64, rc = 0;
  ck_entry *es = dsp_calloc(total ? (size_t)total : 1, sizeof *es);
  if (!es)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "save \"%s\": out of memory", path));
  int ne = 0;
  for (int i = 0; i < n && rc == 0; i++) {
    if (!names[i] || !tensors[i]) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save \"%s\": name or tensor %d is NULL", path, i);
    } else if (!*names[i] || strcmp(names[i], "__metadata__") == 0) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save \"%s\": tensor %d: the name \"%s\" is reserved or "
                      "empty",
                      path, i, names[i]);
    } else if (!utf8_ok((const unsigned char *)names[i], strlen(names[i]))) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save \"%s\": tensor %d: the name is not valid UTF-8",
                      path, i);
    } else if (tensors[i]->dev != dev) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                      "save \"%s\": tensor \"%s\" lives on \"%s\", not \"%s\"",
                      path, names[i], tensors[i]->dev->spec, dev->spec);
    } else {
      es[ne].name = dsp_strdup(names[i]);
      es[ne].t = dispatch_inner(tensors[i]);
      if (!es[ne].name)
        rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
      ne++;
    }
  }
  /* documented names: optim.<i>.momentum (SGD), optim.<i>.m and
   * optim.<i>.v (Adam, AdamW) for parameter i, and optim.step (their t) */
  static const char *const sgd_names[] = {"momentum"};
  static const char *const adam_names[] = {"m", "v"};
  for (int i = 0; opt && rc == 0 && i < opt->n * per; i++) {
    char nb[64];
    snprintf(nb, sizeof nb, "optim.%d.%s", i / per,
             opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % per]);
    es[ne].name = dsp_strdup(nb);
    es[ne].t = opt->states[i];
    if (!es[ne].name)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
    ne++;
  }
  if (opt && rc == 0 && optim_has_t(opt)) {
    es[ne].name = dsp_strdup("optim.step");
    es[ne].meta.dtype = DSP_I64;
    es[ne].inline_i64 = opt->t;
    if (!es[ne].name)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
    ne++;
  }
  uint64_t off = 0;
  for (int i = 0; i < ne && rc == 0; i++) {
    if (es[i].t) {
      es[i].meta = es[i].t->meta;
      es[i].nbytes = dispatch_tensor_nbytes(es[i].t);
    } else {
      es[i].nbytes = 8;
    }
    es[i].begin = off;
    off += es[i].nbytes;
    if ((double)off > CKPT_MAX_EXACT)
      rc = dsp_seterr(dev->ctx, DISPATCH_EOVERFLOW,
                      "save \"%s\": data passes 2^53 bytes", path);
  }
  if (rc == 0 && ne > 1) {
    ck_entry *sorted = dsp_malloc((size_t)ne * sizeof *sorted);
    if (!sorted) {
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
    } else {
      memcpy(sorted, es, (size_t)ne * sizeof *sorted);
      qsort(sorted, (size_t)ne, sizeof *sorted, cmp_entry_name);
      for (int i = 1; i < ne && rc == 0; i++)
        if (strcmp(sorted[i - 1].name, sorted[i].name) == 0)
          rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                          "save \"%s\": the name \"%s\" appears twice", path,
                          sorted[i].name);
      dsp_free(sorted);
    }
  }
  size_t hlen = 0;
  char *hdr = NULL;
  if (rc == 0 && !(hdr = build_header(es, ne, opt, &hlen)))
    rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                    "save \"%s\": out of memory (header)", path);
  if (rc == 0 && hlen > CKPT_MAX_HEADER)
    rc = dsp_seterr(dev->ctx, DISPATCH_ETOOLARGE,
                    "save \"%s\": header of %zu bytes passes the %llu-byte "
                    "limit of a load",
                    path, hlen, (unsigned long long)CKPT_MAX_HEADER);

  char *tmp = NULL;
  int fd = -1;
  if (rc == 0) {
    static unsigned long counter; /* devices may save from distinct threads */
    size_t tl = strlen(path) + 64;
    tmp = dsp_malloc(tl);
    for (int tries = 0; tmp && fd < 0 && tries < 16; tries++) {
      snprintf(tmp, tl, "%s.tmp.%ld.%lu", path, (long)getpid(),
               __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
      fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno != EEXIST) break;
    }
    if (!tmp)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
    else if (fd < 0)
      rc = dsp_seterr(dev->ctx, DISPATCH_EIO,
                      "save \"%s\": cannot create %s: %s", path, tmp,
                      strerror(errno));
  }
  if (rc == 0) {
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    if (write_all(fd, lenb, 8) < 0 || write_all(fd, hdr, hlen) < 0)
      rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                      strerror(errno));
  }
  uint8_t *buf = NULL;
  size_t cap = 0;
  for (int i = 0; i < ne && rc == 0; i++) {
    if (es[i].t) {
      rc = stream_tensor(dev, fd, &es[i], &buf, &cap, path);
    } else if (write_all(fd, &es[i].inline_i64, 8) < 0) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                      strerror(errno));
    }
  }
  dsp_free(buf);
  if (rc == 0 && fsync(fd) < 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": fsync: %s", path,
                    strerror(errno));
  if (fd >= 0 && close(fd) < 0 && rc == 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": close: %s", path,
                    strerror(errno));
  if (rc == 0 && rename(tmp, path) < 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": rename from %s: %s",
                    path, tmp, strerror(errno));
  if (rc == 0)
    fsync_dir_of(path);
  else if (fd >= 0)
    unlink(tmp);
  dsp_free(tmp);
  dsp_free(hdr);
  for (int i = 0; i < ne; i++) dsp_free(es[i].name);
  dsp_free(es);
  return dispatch__ret(dev, rc);
}

/* ------------------------------------------------------------------ */
/* load                                                                */

typedef struct ld_entry {
  const char *name; /* points into the parsed JSON */
  dsp_meta meta;
  uint64_t begin, end;
} ld_entry;

static int cmp_ld_offset(const void *a, const void *b) {
  const ld_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static int cmp_ld_name(const void *a, const void *b) {
  return strcmp(((const ld_entry *)a)->name, ((const ld_entry *)b)->name);
}

/* A JSON number that is a whole number in [0, 2^53]. */
static int json_count(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return -1;
  double d = v->valuedouble;
  if (!(d >= 0) || d > CKPT_MAX_EXACT || d != floor(d)) return -1;
  *out = (uint64_t)d;
  return 0;
}

/* One tensor's entry: {"dtype": ..., "shape": [...], "data_offsets":
 * [begin, end]} with end - begin the shape's byte size. */
static int parse_entry(dsp_ctx *ctx, const char *path, const cJSON *o,
                       ld_entry *e) {
  const char *nm = o->string;
  if (!cJSON_IsObject(o))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": entry is not a JSON object",
                      path, nm);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(o, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(o, "shape");
  const cJSON *of = cJSON_GetObjectItemCaseSensitive(o, "data_offsets");
  if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(of))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": needs a string \"dtype\", "
                      "an array \"shape\" and an array \"data_offsets\"",
                      path, nm);
  int dtype = -1;
  for (int i = 0; i < 4; i++)
    if (strcmp(dt->valuestring, k_st_dtype[i]) == 0) dtype = i;
  if (dtype < 0)
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "load \"%s\": tensor \"%s\": dtype \"%.32s\" is not "
                      "supported (F32, F64, I64, BOOL)",
                      path, nm, dt->valuestring);
  memset(&e->meta, 0, sizeof e->meta);
  e->meta.dtype = (dsp_dtype)dtype;
  int nd = cJSON_GetArraySize(sh);
  if (nd > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EDIM,
                      "load \"%s\": tensor \"%s\": rank %d passes %d", path, nm,
                      nd, DSP_MAX_DIMS);
  e->meta.ndim = nd;
  int d = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, sh) {
    uint64_t s;
    if (json_count(v, &s) < 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": tensor \"%s\": shape[%d] is not a whole "
                        "number in [0, 2^53]",
                        path, nm, d);
    e->meta.shape[d++] = (int64_t)s;
  }
  if (cJSON_GetArraySize(of) != 2 ||
      json_count(cJSON_GetArrayItem(of, 0), &e->begin) < 0 ||
      json_count(cJSON_GetArrayItem(of, 1), &e->end) < 0 || e->end < e->begin)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": data_offsets must be "
                      "[begin, end], whole numbers with begin <= end",
                      path, nm);
  int64_t numel;
  int rc = dsp_meta_numel(ctx, &e->meta, &numel);
  if (rc < 0)
    return prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path, nm);
  uint64_t need = (uint64_t)numel * dsp_dtype_size(e->meta.dtype);
  if (need != e->end - e->begin) {
    char sb[160];
    return dsp_seterr(
        ctx, DISPATCH_ESHAPE,
        "load \"%s\": tensor \"%s\": %s %s needs %llu bytes, "
        "data_offsets [%llu, %llu] hold %llu",
        path, nm, k_st_dtype[dtype], dsp_shape_str(&e->meta, sb, sizeof sb),
        (unsigned long long)need, (unsigned long long)e->begin,
        (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
  }
  e->name = nm;
  return 0;
}

void dispatch_checkpoint_free(dispatch_checkpoint *ck) {
  if (!ck) return;
  for (int i = 0; i < ck->n; i++) {
    dispatch_tensor_free(ck->tensors ? ck->tensors[i] : NULL);
    dsp_free(ck->names ? ck->names[i] : NULL);
  }
  for (int i = 0; i < ck->n_meta; i++) {
    dsp_free(ck->meta_keys[i]);
    dsp_free(ck->meta_vals[i]);
  }
  dsp_free(ck->meta_keys);
  dsp_free(ck->meta_vals);
  dsp_free(ck->names);
  dsp_free(ck->tensors);
  dsp_free(ck->by_name);
  dsp_free(ck);
}

/* Checks the parsed header against the file (every tensor's entry, the
 * metadata, unique names, contiguous offsets covering the data section
 * exactly), then makes ck's names, metadata and empty tensor slots. */
static int load_header(dsp_ctx *ctx, const char *path, const cJSON *root,
                       uint64_t data_len, dispatch_checkpoint *ck,
                       ld_entry **out_es) {
  *out_es = NULL;
  if (!cJSON_IsObject(root))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the header is not a JSON object", path);
  int n = 0, n_meta_objs = 0;
  const cJSON *c, *meta = NULL;
  cJSON_ArrayForEach(c, root) {
    if (strcmp(c->string, "__metadata__") == 0) {
      meta = c;
      n_meta_objs++;
    } else {
      n++;
    }
  }
  if (n_meta_objs > 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the name \"__metadata__\" appears twice",
                      path);
  if (meta) {
    if (!cJSON_IsObject(meta))
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": __metadata__ is not a JSON object", path);
    int nm = cJSON_GetArraySize(meta);
    ck->meta_keys = dsp_calloc(nm ? (size_t)nm : 1, sizeof(char *));
    ck->meta_vals = dsp_calloc(nm ? (size_t)nm : 1, sizeof(char *));
    if (!ck->meta_keys || !ck->meta_vals)
      return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
    cJSON_ArrayForEach(c, meta) {
      if (!cJSON_IsString(c))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "load \"%s\": __metadata__ \"%s\" is not a string",
                          path, c->string);
      ck->meta_keys[ck->n_meta] = dsp_strdup(c->string);
      ck->meta_vals[ck->n_meta] = dsp_strdup(c->valuestring);
      ck->n_meta++;
      if (!ck->meta_keys[ck->n_meta - 1] || !ck->meta_vals[ck->n_meta - 1])
        return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
    }
  }
  ld_entry *es = dsp_calloc(n ? (size_t)n : 1, sizeof *es);
  if (!es) return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  *out_es = es;
  int i = 0, rc;
  cJSON_ArrayForEach(c, root) {
    if (c == meta) continue;
    if ((rc = parse_entry(ctx, path, c, &es[i++])) < 0) return rc;
  }
  qsort(es, (size_t)n, sizeof *es, cmp_ld_name);
  for (i = 1; i < n; i++)
    if (strcmp(es[i - 1].name, es[i].name) == 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": the name \"%s\" appears twice", path,
                        es[i].name);
  qsort(es, (size_t)n, sizeof *es, cmp_ld_offset);
  uint64_t at = 0;
  for (i = 0; i < n; i++) {
    if (es[i].begin != at)
      return dsp_seterr(
          ctx, DISPATCH_EINVAL,
          "load \"%s\": tensor \"%s\" starts at %llu, %s %llu (offsets must "
          "be contiguous)",
          path, es[i].name, (unsigned long long)es[i].begin,
          es[i].begin < at ? "overlapping data that runs to"
                           : "leaving a gap after data that ends at",
          (unsigned long long)at);
    at = es[i].end;
  }
  if (at > data_len)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": truncated: the offsets need %llu data "
                      "bytes, the file has %llu",
                      path, (unsigned long long)at,
                      (unsigned long long)data_len);
  if (at < data_len)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": %llu bytes after the last tensor's data "
                      "(the offsets cover %llu of %llu)",
                      path, (unsigned long long)(data_len - at),
                      (unsigned long long)at, (unsigned long long)data_len);
  ck->names = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->names);
  ck->tensors = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->tensors);
  ck->by_name = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->by_name);
  if (!ck->names || !ck->tensors || !ck->by_name)
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  ck->n = n;
  for (i = 0; i < n; i++)
    if (!(ck->names[i] = dsp_strdup(es[i].name)))
      return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  /* by_name lists data-order indices in name order: a copy of es, each
   * entry carrying its index in begin, sorted by name */
  ld_entry *tmp = dsp_malloc((n ? (size_t)n : 1) * sizeof *tmp);
  if (!tmp) return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  for (i = 0; i < n; i++) {
    tmp[i] = es[i];
    tmp[i].begin = (uint64_t)i; /* carries the data-order index */
  }
  qsort(tmp, (size_t)n, sizeof *tmp, cmp_ld_name);
  for (i = 0; i < n; i++) ck->by_name[i] = (int)tmp[i].begin;
  dsp_free(tmp);
  return 0;
}

/* Reads and validates the header, then makes one tensor per entry in data
 * order, holding one tensor's bytes at a time; REMOTE ends with a sync so
 * that a refused upload fails the load. Any failure frees everything. */
int dispatch_load(dispatch_device *dev, const char *path,
                  dispatch_checkpoint **out) {
  if (out) *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  if (!path || !out)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "load: needs a path and an out"));
  dsp_ctx *ctx = dev->ctx;
  int rc = 0;
  char *hdr = NULL;
  cJSON *root = NULL;
  ld_entry *es = NULL;
  uint8_t *buf = NULL;
  dispatch_checkpoint *ck = dsp_calloc(1, sizeof *ck);
  /* non-blocking until it is known to be a regular file: a blocking open
   * of a FIFO waits for a writer, forever if none comes */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  struct stat st;
  if (!ck) {
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  } else if (fd < 0 || fstat(fd, &st) < 0) {
    rc =
        dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": %s", path, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = dsp_seterr(ctx, DISPATCH_EINVAL, "load \"%s\": not a regular file",
                    path);
  }
  if (rc == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0)
    rc = dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": %s", path,
                    strerror(errno));
  uint64_t size = rc == 0 ? (uint64_t)st.st_size : 0, hlen = 0;
  if (rc == 0) {
    ck->dev = dev;
    uint8_t lenb[8];
    if (size < 8 || pread_all(fd, lenb, 8, 0) < 0)
      rc = dsp_seterr(ctx, size < 8 ? DISPATCH_EINVAL : DISPATCH_EIO,
                      "load \"%s\": truncated: %llu bytes, shorter than the "
                      "8-byte header length",
                      path, (unsigned long long)size);
    for (int i = 0; rc == 0 && i < 8; i++) hlen |= (uint64_t)lenb[i] << (8 * i);
  }
  if (rc == 0 && hlen > CKPT_MAX_HEADER)
    rc = dsp_seterr(ctx, DISPATCH_ETOOLARGE,
                    "load \"%s\": header length %llu passes the limit of %llu "
                    "bytes",
                    path, (unsigned long long)hlen,
                    (unsigned long long)CKPT_MAX_HEADER);
  if (rc == 0 && hlen > size - 8)
    rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                    "load \"%s\": truncated: header length %llu, %llu bytes "
                    "follow it",
                    path, (unsigned long long)hlen,
                    (unsigned long long)(size - 8));
  if (rc == 0 && !(hdr = dsp_malloc((size_t)hlen + 1)))
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM,
                    "load \"%s\": out of memory (header of %llu bytes)", path,
                    (unsigned long long)hlen);
  if (rc == 0 && pread_all(fd, hdr, (size_t)hlen, 8) < 0)
    rc = dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": reading the header: %s",
                    path, errno ? strerror(errno) : "file shrank");
  if (rc == 0 && !utf8_ok((const unsigned char *)hdr, (size_t)hlen))
    rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                    "load \"%s\": the header is not valid UTF-8", path);
  if (rc == 0) {
    hdr[hlen] = 0;
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the header is not valid JSON (at byte "
                      "%lld of %llu)",
                      path, end ? (long long)(end - hdr) : -1LL,
                      (unsigned long long)hlen);
    } else {
      while (end && end < hdr + hlen &&
             (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
      if (end != hdr + hlen)
        rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": the header has bytes after its JSON "
                        "value (at byte %lld)",
                        path, end ? (long long)(end - hdr) : -1LL);
    }
  }
  if (rc == 0) rc = load_header(ctx, path, root, size - 8 - hlen, ck, &es);
  size_t maxb = 0;
  for (int i = 0; rc == 0 && i < ck->n; i++)
    if (es[i].end - es[i].begin > maxb)
      maxb = (size_t)(es[i].end - es[i].begin);
  if (rc == 0 && maxb && !(buf = dsp_malloc(maxb)))
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM,
                    "load \"%s\": out of memory (%zu bytes for one tensor)",
                    path, maxb);
  for (int i = 0; rc == 0 && i < ck->n; i++) {
    size_t nb = (size_t)(es[i].end - es[i].begin);
    if (nb && pread_all(fd, buf, nb, 8 + hlen + es[i].begin) < 0)
      rc =
          dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": reading \"%s\": %s", path,
                     ck->names[i], errno ? strerror(errno) : "file shrank");
    if (rc == 0 && es[i].meta.dtype == DSP_BOOL &&
        (rc = dsp_check_bool_bytes(ctx, buf, nb)) < 0)
      rc =
          prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path, ck->names[i]);
    if (rc == 0 && (rc = dev->ops->upload(dev, &es[i].meta, buf, nb,
                                          &ck->tensors[i])) < 0)
      rc =
          prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path, ck->names[i]);
  }
  /* REMOTE: the uploads' errors come back here */
  if (rc == 0 && ck->n && (rc = dev->ops->sync(dev)) < 0)
    rc = prefix_err(ctx, rc, "load \"%s\"", path);
  if (fd >= 0) close(fd);
  dsp_free(buf);
  dsp_free(es);
  cJSON_Delete(root);
  dsp_free(hdr);
  if (rc < 0) {
    dispatch_checkpoint_free(ck);
    return dispatch__ret(dev, rc);
  }
  *out = ck;
  return 0;
}

int dispatch_checkpoint_count(const dispatch_checkpoint *ck) {
  return ck ? ck->n : 0;
}

const char *dispatch_checkpoint_name(const dispatch_checkpoint *ck, int i) {
  return ck && i >= 0 && i < ck->n ? ck->names[i] : NULL;
}

dispatch_tensor *dispatch_checkpoint_tensor(const dispatch_checkpoint *ck,
                                            int i) {
  return ck && i >= 0 && i < ck->n ? ck->tensors[i] : NULL;
}

dispatch_tensor *dispatch_checkpoint_get(const dispatch_checkpoint *ck,
                                         const char *name) {
  if (!ck || !name) return NULL;
  int lo = 0, hi = ck->n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2, j = ck->by_name[mid];
    int c = strcmp(name, ck->names[j]);
    if (c == 0) return ck->tensors[j];
    if (c < 0)
      hi = mid - 1;
    else
      lo = mid + 1;
  }
  return NULL;
}

const char *dispatch_checkpoint_meta(const dispatch_checkpoint *ck,
                                     const char *key) {
  for (int i = 0; ck && key && i < ck->n_meta; i++)
    if (strcmp(ck->meta_keys[i], key) == 0) return ck->meta_vals[i];
  return NULL;
}

/* ------------------------------------------------------------------ */
/* optimizer state                                                     */

/* Checks every state tensor (and Adam's or AdamW's step count) before it changes
 * anything, then swaps the optimizer's state tensors for the checkpoint's. */
int dispatch_optim_load(dispatch_optim *opt, const dispatch_checkpoint *ck) {
  if (!opt) return DISPATCH_EINVAL;
  dispatch_device *dev = opt->dev;
  dsp_ctx *ctx = dev->ctx;
  if (!ck)
    return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                                         "optim_load: checkpoint is NULL"));
  if (ck->dev != dev)
    return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EDEVICE,
                                         "optim_load: checkpoint lives on "
                                         "\"%s\", optimizer on \"%s\"",
                                         ck->dev->spec, dev->spec));
  const char *kind = optim_kind(opt);
  const char *mk = dispatch_checkpoint_meta(ck, "dispatch.optim");
  const char *mn = dispatch_checkpoint_meta(ck, "dispatch.optim.params");
  char nb[32];
  snprintf(nb, sizeof nb, "%d", opt->n);
  if (!mk || !mn || strcmp(mk, kind) != 0 || strcmp(mn, nb) != 0)
    return dispatch__ret(
        dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                        "optim_load: the checkpoint holds %s%s%s state for %s "
                        "parameters; this optimizer is %s over %d",
                        mk ? "\"" : "", mk ? mk : "no optimizer",
                        mk ? "\"" : "", mn ? mn : "no", kind, opt->n));
  static const char *const sgd_names[] = {"momentum"};
  static const char *const adam_names[] = {"m", "v"};
  int total = opt->n * opt->k;
  for (int i = 0; i < total; i++) {
    char name[64];
    snprintf(
        name, sizeof name, "optim.%d.%s", i / opt->k,
        opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % opt->k]);
    dispatch_tensor *t = dispatch_checkpoint_get(ck, name);
    const dsp_meta *want = &opt->params[i / opt->k]->inner->meta;
    if (!t)
      return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                                           "optim_load: no tensor \"%s\" in "
                                           "the checkpoint",
                                           name));
    if (!dsp_meta_equal(&t->meta, want)) {
      char a[128], b[128];
      return dispatch__ret(
          dev, dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "optim_load: \"%s\" is %s %s, parameter %d is %s %s",
                          name, dsp_dtype_name(t->meta.dtype),
                          dsp_shape_str(&t->meta, a, sizeof a), i / opt->k,
                          dsp_dtype_name(want->dtype),
                          dsp_shape_str(want, b, sizeof b)));
    }
  }
  int64_t step = opt->t;
  if (optim_has_t(opt)) {
    dispatch_tensor *t = dispatch_checkpoint_get(ck, "optim.step");
    int rc = 0;
    if (!t || t->meta.dtype != DSP_I64 || t->meta.ndim != 0)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "optim_load: \"optim.step\" is missing or not an i64 "
                      "scalar");
    else if ((rc = dispatch_tensor_read(t, &step, sizeof step)) == 0 &&
             step < 0)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "optim_load: \"optim.step\" is negative (%lld)",
                      (long long)step);
    if (rc < 0) return dispatch__ret(dev, rc);
  }
  for (int i = 0; i < total; i++) {
    char name[64];
    snprintf(
        name, sizeof name, "optim.%d.%s", i / opt->k,
        opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % opt->k]);
    dispatch_tensor *t = dispatch_tensor_ref(dispatch_checkpoint_get(ck, name));
    dispatch_tensor_free(opt->states[i]);
    opt->states[i] = t;
  }
  opt->t = step;
  return 0;
}
