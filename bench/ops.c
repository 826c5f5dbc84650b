/* bench ops: pipelined small ops per second. The op is add on two
 * 16-element f32 tensors whose output is freed at once (a Free queued
 * behind the op), repeated, then one sync; the rate is ops over the time
 * to the end of that sync. One client, then 8 concurrent clients (threads,
 * one device each). The reference is the same loop on the LOCAL kind
 * (the in-process CPU backend, no wire), in the same run: a limit the
 * wire cannot beat. One repetition runs the four loops once, in an order
 * that rotates every repetition; rows are medians with their spread, and
 * repetitions go on while the goal is neither met nor missed (bench.h).
 * Goal: at least 250,000 ops/s from one REMOTE client.
 */
#include "bench.h"

#define CHUNK 5000           /* ops between two looks at the clock */
#define MAX_OPS 400000       /* per client per repetition */
#define BUDGET 0.6           /* seconds per client per repetition */
#define MIN_REPS 5
#define MAX_REPS 11
#define TOTAL_BUDGET 30.0    /* seconds for all repetitions */
#define NTHREADS 8

typedef struct worker {
  const char *spec;
  pthread_barrier_t *bar;
  double ops_per_s; /* out */
  long ops;         /* out */
  double t0, t1;    /* out: when its loop started and ended */
  char err[256];    /* out */
} worker;

/* Runs the pipelined loop on an open device; returns ops/s or NAN with
 * err set. */
static double run_loop(dispatch_device *dev, pthread_barrier_t *bar,
                       long *ops_out, double *t0_out, double *t1_out,
                       char *err, size_t errlen) {
  float a_data[16], b_data[16];
  for (int i = 0; i < 16; i++) {
    a_data[i] = (float)i;
    b_data[i] = 1.0f;
  }
  int64_t shape[1] = {16};
  dispatch_tensor *a = NULL, *b = NULL;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, a_data,
                                     sizeof a_data, &a);
  if (rc == 0)
    rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, b_data,
                                   sizeof b_data, &b);
  if (rc == 0) rc = dispatch_device_sync(dev);
  double rate = NAN;
  long ops = 0;
  if (bar) pthread_barrier_wait(bar);
  if (rc == 0) {
    double t0 = bench_now();
    long max_ops = bench_quick() ? 2 * CHUNK / 10 : MAX_OPS;
    int chunk = bench_quick() ? CHUNK / 10 : CHUNK;
    while (ops < max_ops && bench_now() - t0 < BUDGET && rc == 0) {
      for (int i = 0; i < chunk; i++) {
        dispatch_tensor *c = NULL;
        rc = dispatch_add(a, b, &c);
        if (rc < 0) break;
        dispatch_tensor_free(c);
      }
      ops += chunk;
    }
    if (rc == 0) rc = dispatch_device_sync(dev);
    *t0_out = t0;
    *t1_out = bench_now();
    if (rc == 0) rate = (double)ops / (*t1_out - t0);
  }
  if (rc == 0) {
    /* the last add must really have run: check one result */
    dispatch_tensor *c = NULL;
    float out[16];
    rc = dispatch_add(a, b, &c);
    if (rc == 0) rc = dispatch_tensor_read(c, out, sizeof out);
    if (rc == 0 && out[15] != 16.0f) {
      snprintf(err, errlen, "add gave %g, expected 16", (double)out[15]);
      rate = NAN;
    }
    dispatch_tensor_free(c);
  }
  if (rc < 0) {
    snprintf(err, errlen, "%s: %s", dispatch_err_name(rc),
             dispatch_device_errmsg(dev));
    rate = NAN;
  }
  dispatch_tensor_free(a);
  dispatch_tensor_free(b);
  *ops_out = ops;
  return rate;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  dispatch_device *dev = bench_open(w->spec, w->err, sizeof w->err);
  if (!dev) {
    pthread_barrier_wait(w->bar);
    w->ops_per_s = NAN;
    return NULL;
  }
  w->ops_per_s =
      run_loop(dev, w->bar, &w->ops, &w->t0, &w->t1, w->err, sizeof w->err);
  dispatch_device_close(dev);
  return NULL;
}

/* n threads, each on its own device; returns total ops/s over the wall
 * time from the first loop's start to the last one's end (each worker
 * takes its own times: this thread may be scheduled after a short loop
 * is over), or NAN. */
static double run_clients(const char *spec, int n, char *err,
                          size_t errlen) {
  worker w[NTHREADS];
  pthread_t th[NTHREADS];
  pthread_barrier_t bar;
  /* n workers plus this thread: the loops start together */
  pthread_barrier_init(&bar, NULL, (unsigned)n + 1);
  for (int i = 0; i < n; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].spec = spec;
    w[i].bar = &bar;
    if (pthread_create(&th[i], NULL, worker_main, &w[i]) != 0) {
      fprintf(stderr, "ops: pthread_create failed\n");
      exit(1);
    }
  }
  pthread_barrier_wait(&bar);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&bar);
  long total = 0;
  double first = INFINITY, last = -INFINITY;
  for (int i = 0; i < n; i++) {
    if (isnan(w[i].ops_per_s)) {
      snprintf(err, errlen, "client %d: %s", i, w[i].err);
      return NAN;
    }
    total += w[i].ops;
    if (w[i].t0 < first) first = w[i].t0;
    if (w[i].t1 > last) last = w[i].t1;
  }
  return (double)total / (last - first);
}

int main(void) {
  const char *remote = bench_remote_spec();
  int quick = bench_quick();
  enum { L1, R1, L8, R8, NVAR };
  double v[NVAR][MAX_REPS];
  char err[NVAR][512] = {"", "", "", ""};
  if (!remote) {
    snprintf(err[R1], sizeof err[R1], "no server (DISPATCH_BENCH_REMOTE)");
    snprintf(err[R8], sizeof err[R8], "no server (DISPATCH_BENCH_REMOTE)");
  }
  bench_def d1 = {"ops", "pipelined add 16xf32 remote: 1 client", "ops/s", 0,
                  "same loop LOCAL", 1, BENCH_GOAL_OURS_GE, 250000};
  bench_def d8 = {"ops", "pipelined add 16xf32 remote: 8 clients total",
                  "ops/s", 0, "same loop LOCAL 8 threads", 1, BENCH_GOAL_NONE,
                  0};
  int reps = 0;
  double start = bench_now();
  for (int r = 0;; r++) {
    if (!bench_more(reps, quick ? 1 : MIN_REPS, quick ? 1 : MAX_REPS,
                    bench_now() - start, TOTAL_BUDGET,
                    bench_unsettled(&d1, v[R1], v[L1], reps)))
      break;
    for (int k = 0; k < NVAR; k++) {
      int i = bench_turn(r, k, NVAR);
      const char *spec = i == L1 || i == L8 ? "local" : remote;
      int n = i == L1 || i == R1 ? 1 : NTHREADS;
      v[i][reps] = spec && !err[i][0]
                       ? run_clients(spec, n, err[i], sizeof err[i])
                       : NAN;
    }
    reps++;
  }
  for (int i = 0; i < NVAR; i++)
    if (err[i][0]) fprintf(stderr, "ops: %s\n", err[i]);
  char n1[1100], n8[1100];
  snprintf(n1, sizeof n1, "%s%s%s", err[R1], err[R1][0] && err[L1][0] ? "; " : "",
           err[L1]);
  snprintf(n8, sizeof n8, "%s%s%s", err[R8], err[R8][0] && err[L8][0] ? "; " : "",
           err[L8]);
  bench_emit(&d1, v[R1], v[L1], reps, n1[0] ? "%s" : NULL, n1);
  bench_emit(&d8, v[R8], v[L8], reps, n8[0] ? "%s" : NULL, n8);
  return 0;
}
