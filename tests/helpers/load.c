/* The load driver (see load.h): one thread per client, each with its own
 * device (session), and one thread sampling the server's VmRSS. */
#include "load.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"

#define ROUND_OPS 10 /* library calls of one small-client round */
#define ROUND_WAITS 4
#define VEC 64       /* elements of a small client's vectors */
#define TAIL 1024    /* elements of a big tensor read back */

long long load_rss(long pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%ld/status", pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  long long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %lld kB", &kb) == 1) break;
  fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct shared {
  const load_cfg *cfg;
  const int64_t *big_data; /* the big clients' upload, shared read-only */
  int64_t big_sum;
  int64_t big_n;
  pthread_mutex_t mu;
  char first_error[256];
  atomic_int stop_sampler;
  long long rss_peak;
} shared;

typedef struct worker {
  shared *sh;
  int index;
  int big;
  pthread_t th;
  long long ops, waits, errors, mismatches;
  double *lat; /* seconds of each waiting call */
  long long n_lat, cap_lat;
} worker;

static void fail(worker *w, dispatch_device *dev, const char *what, int rc) {
  w->errors++;
  pthread_mutex_lock(&w->sh->mu);
  if (!w->sh->first_error[0])
    snprintf(w->sh->first_error, sizeof w->sh->first_error,
             "client %d%s: %s: %s (%s)", w->index, w->big ? " (big)" : "",
             what, dispatch_err_name(rc),
             dev ? dispatch_device_errmsg(dev) : "");
  pthread_mutex_unlock(&w->sh->mu);
}

static void mismatch(worker *w, const char *what, long long round, int k,
                     double got, double want) {
  w->mismatches++;
  pthread_mutex_lock(&w->sh->mu);
  if (!w->sh->first_error[0])
    snprintf(w->sh->first_error, sizeof w->sh->first_error,
             "client %d round %lld: %s[%d] = %g, expected %g", w->index,
             round, what, k, got, want);
  pthread_mutex_unlock(&w->sh->mu);
}

/* One library call; a failure is recorded and ends the round. */
#define STEP(w, dev, what, expr)                                            \
  do {                                                                      \
    int rc_ = (expr);                                                       \
    if (rc_ != 0) {                                                         \
      fail((w), (dev), (what), rc_);                                        \
      goto out;                                                             \
    }                                                                       \
    (w)->ops++;                                                             \
  } while (0)

/* The same for a call that waits for the server, timed into w->lat. */
#define WAIT_STEP(w, dev, what, expr)                                       \
  do {                                                                      \
    double t0_ = now_s();                                                   \
    STEP(w, dev, what, expr);                                               \
    if ((w)->n_lat < (w)->cap_lat) (w)->lat[(w)->n_lat++] = now_s() - t0_;  \
    (w)->waits++;                                                           \
  } while (0)

/* One round of a small client; 0, or -1 after recording a failure. */
static int small_round(worker *w, dispatch_device *dev, long long r) {
  float x[VEC], wv[VEC], y[VEC], g[VEC], s, want_s = 0;
  for (int k = 0; k < VEC; k++) {
    x[k] = (float)((w->index * 7 + r * 3 + k) % 17) - 8.0f;
    wv[k] = (float)((w->index * 5 + r + 2 * k) % 9) - 4.0f;
    want_s += x[k] * wv[k];
  }
  int64_t shape[1] = {VEC};
  int ret = -1;
  dispatch_tensor *tx, *tw, *a, *ty, *ts, *tg;
  dispatch_grads *grads = NULL;
  if (dispatch_scope_begin(dev) != 0) {
    fail(w, dev, "scope_begin", -1);
    return -1;
  }
  STEP(w, dev, "upload x",
       dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, x, sizeof x,
                                 &tx));
  STEP(w, dev, "upload w",
       dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, wv, sizeof wv,
                                 &tw));
  STEP(w, dev, "autodiff", dispatch_autodiff(tw, &a));
  STEP(w, dev, "mul", dispatch_mul(a, tx, &ty));
  STEP(w, dev, "sum", dispatch_sum(ty, 0, NULL, 0, &ts));
  WAIT_STEP(w, dev, "backward", dispatch_backward(ts, &grads));
  STEP(w, dev, "grad", dispatch_grad(grads, a, &tg));
  WAIT_STEP(w, dev, "read grad", dispatch_tensor_read(tg, g, sizeof g));
  WAIT_STEP(w, dev, "read y", dispatch_tensor_read(ty, y, sizeof y));
  WAIT_STEP(w, dev, "read sum", dispatch_tensor_read(ts, &s, sizeof s));
  for (int k = 0; k < VEC; k++) {
    if (g[k] != x[k]) mismatch(w, "grad", r, k, g[k], x[k]);
    if (y[k] != x[k] * wv[k]) mismatch(w, "y", r, k, y[k], x[k] * wv[k]);
  }
  if (s != want_s) mismatch(w, "sum", r, 0, s, want_s);
  ret = 0;
out:
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  return ret;
}

/* One round of a big client: upload, sum, tail. */
static int big_round(worker *w, dispatch_device *dev, long long r) {
  const shared *sh = w->sh;
  int64_t n = sh->big_n, tail_n = n < TAIL ? n : TAIL;
  int64_t shape[1] = {n}, sum = 0, tail[TAIL];
  int ret = -1;
  dispatch_tensor *t, *ts, *tt;
  if (dispatch_scope_begin(dev) != 0) {
    fail(w, dev, "scope_begin", -1);
    return -1;
  }
  STEP(w, dev, "big upload",
       dispatch_tensor_from_data(dev, DISPATCH_I64, 1, shape, sh->big_data,
                                 (size_t)n * sizeof(int64_t), &t));
  STEP(w, dev, "big sum", dispatch_sum(t, 0, NULL, 0, &ts));
  WAIT_STEP(w, dev, "read big sum",
            dispatch_tensor_read(ts, &sum, sizeof sum));
  STEP(w, dev, "slice", dispatch_slice(t, 0, n - tail_n, n, 1, &tt));
  WAIT_STEP(w, dev, "read tail",
            dispatch_tensor_read(tt, tail, (size_t)tail_n * sizeof(int64_t)));
  if (sum != sh->big_sum)
    mismatch(w, "big sum", r, 0, (double)sum, (double)sh->big_sum);
  for (int64_t k = 0; k < tail_n; k++)
    if (tail[k] != sh->big_data[n - tail_n + k]) {
      mismatch(w, "big tail", r, (int)k, (double)tail[k],
               (double)sh->big_data[n - tail_n + k]);
      break;
    }
  ret = 0;
out:
  dispatch_scope_end(dev);
  return ret;
}

static void *client_main(void *arg) {
  worker *w = arg;
  const load_cfg *cfg = w->sh->cfg;
  char msg[256] = "";
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(cfg->spec, NULL, &dev, msg, sizeof msg);
  if (rc != 0) {
    w->errors++;
    pthread_mutex_lock(&w->sh->mu);
    if (!w->sh->first_error[0])
      snprintf(w->sh->first_error, sizeof w->sh->first_error,
               "client %d: open %.64s: %.160s", w->index, cfg->spec, msg);
    pthread_mutex_unlock(&w->sh->mu);
    return NULL;
  }
  long long rounds = w->big ? cfg->big_rounds : cfg->ops / ROUND_OPS;
  for (long long r = 0; r < rounds; r++)
    if ((w->big ? big_round(w, dev, r) : small_round(w, dev, r)) < 0) break;
  dispatch_device_close(dev);
  return NULL;
}

static void *sampler_main(void *arg) {
  shared *sh = arg;
  while (!atomic_load(&sh->stop_sampler)) {
    long long v = load_rss(sh->cfg->server_pid);
    if (v > sh->rss_peak) sh->rss_peak = v;
    usleep(5000);
  }
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int load_run(const load_cfg *cfg, load_result *out) {
  memset(out, 0, sizeof *out);
  shared sh;
  memset(&sh, 0, sizeof sh);
  sh.cfg = cfg;
  pthread_mutex_init(&sh.mu, NULL);
  int64_t *big = NULL;
  if (cfg->big_clients > 0) {
    sh.big_n = (int64_t)(cfg->big_bytes / sizeof(int64_t));
    big = malloc((size_t)sh.big_n * sizeof *big);
    if (!big) {
      snprintf(out->first_error, sizeof out->first_error,
               "out of memory for the big upload");
      return -1;
    }
    for (int64_t k = 0; k < sh.big_n; k++) {
      big[k] = (k * 7919) % 100003 - 50000;
      sh.big_sum += big[k];
    }
    sh.big_data = big;
  }
  int n = cfg->clients + cfg->big_clients;
  worker *ws = calloc((size_t)n, sizeof *ws);
  if (!ws) {
    free(big);
    return -1;
  }
  out->rss_before = cfg->server_pid ? load_rss(cfg->server_pid) : -1;
  sh.rss_peak = out->rss_before;
  pthread_t sampler;
  int sampling = cfg->server_pid &&
                 pthread_create(&sampler, NULL, sampler_main, &sh) == 0;
  double t0 = now_s();
  int started = 0;
  for (int i = 0; i < n; i++) {
    worker *w = &ws[i];
    w->sh = &sh;
    w->index = i;
    w->big = i >= cfg->clients;
    w->cap_lat = w->big ? 2LL * cfg->big_rounds
                        : (long long)(cfg->ops / ROUND_OPS) * ROUND_WAITS;
    w->lat = malloc((size_t)(w->cap_lat ? w->cap_lat : 1) * sizeof(double));
    if (!w->lat || pthread_create(&w->th, NULL, client_main, w) != 0) {
      w->errors++;
      snprintf(sh.first_error, sizeof sh.first_error,
               "cannot start client thread %d", i);
      break;
    }
    started++;
  }
  for (int i = 0; i < started; i++) pthread_join(ws[i].th, NULL);
  out->seconds = now_s() - t0;
  if (sampling) {
    atomic_store(&sh.stop_sampler, 1);
    pthread_join(sampler, NULL);
  }
  out->rss_peak = sh.rss_peak;
  long long n_lat = 0;
  for (int i = 0; i < n; i++) {
    out->ops += ws[i].ops;
    out->waits += ws[i].waits;
    out->errors += ws[i].errors;
    out->mismatches += ws[i].mismatches;
    n_lat += ws[i].n_lat;
  }
  double *all = malloc((size_t)(n_lat ? n_lat : 1) * sizeof *all);
  if (all) {
    long long k = 0;
    for (int i = 0; i < n; i++) {
      memcpy(all + k, ws[i].lat, (size_t)ws[i].n_lat * sizeof *all);
      k += ws[i].n_lat;
    }
    qsort(all, (size_t)n_lat, sizeof *all, cmp_double);
    if (n_lat > 0) {
      out->p50_us = all[(long long)ceil(0.50 * n_lat) - 1] * 1e6;
      out->p99_us = all[(long long)ceil(0.99 * n_lat) - 1] * 1e6;
    }
    free(all);
  }
  out->ops_per_s = out->seconds > 0 ? (double)out->ops / out->seconds : 0;
  snprintf(out->first_error, sizeof out->first_error, "%s", sh.first_error);
  for (int i = 0; i < n; i++) free(ws[i].lat);
  free(ws);
  free(big);
  pthread_mutex_destroy(&sh.mu);
  return out->errors == 0 && out->mismatches == 0 ? 0 : -1;
}
