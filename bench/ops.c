/* bench ops: pipelined small ops per second. The op is add on two
 * 16-element f32 tensors whose output is freed at once (a Free queued
 * behind the op), repeated, then one sync; the rate is ops over the time
 * to the end of that sync. One client, then 8 concurrent clients (threads,
 * one device each). The reference is the same loop on the LOCAL kind
 * (the in-process CPU backend, no wire), in the same run. Goal: at least
 * 250,000 ops/s from one REMOTE client.
 */
#include "bench.h"

#define CHUNK 5000           /* ops between two looks at the clock */
#define MAX_OPS 400000       /* per client per repetition */
#define BUDGET 1.5           /* seconds per client per repetition */
#define REPS 3
#define NTHREADS 8

typedef struct worker {
  const char *spec;
  pthread_barrier_t *bar;
  double ops_per_s; /* out */
  long ops;         /* out */
  char err[256];    /* out */
} worker;

/* Runs the pipelined loop on an open device; returns ops/s or NAN with
 * err set. */
static double run_loop(dispatch_device *dev, pthread_barrier_t *bar,
                       long *ops_out, char *err, size_t errlen) {
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
    while (ops < MAX_OPS && bench_now() - t0 < BUDGET && rc == 0) {
      for (int i = 0; i < CHUNK; i++) {
        dispatch_tensor *c = NULL;
        rc = dispatch_add(a, b, &c);
        if (rc < 0) break;
        dispatch_tensor_free(c);
      }
      ops += CHUNK;
    }
    if (rc == 0) rc = dispatch_device_sync(dev);
    double t = bench_now() - t0;
    if (rc == 0) rate = (double)ops / t;
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
  w->ops_per_s = run_loop(dev, w->bar, &w->ops, w->err, sizeof w->err);
  dispatch_device_close(dev);
  return NULL;
}

/* n threads, each on its own device; returns total ops/s over the wall
 * time from the common start to the last finish, or NAN. */
static double run_clients(const char *spec, int n, char *err,
                          size_t errlen) {
  worker w[NTHREADS];
  pthread_t th[NTHREADS];
  pthread_barrier_t bar;
  /* n workers plus this thread, which starts the clock after the barrier */
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
  double t0 = bench_now();
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  double t = bench_now() - t0;
  pthread_barrier_destroy(&bar);
  long total = 0;
  for (int i = 0; i < n; i++) {
    if (isnan(w[i].ops_per_s)) {
      snprintf(err, errlen, "client %d: %s", i, w[i].err);
      return NAN;
    }
    total += w[i].ops;
  }
  return (double)total / t;
}

static double median_clients(const char *spec, int n, char *err,
                             size_t errlen) {
  double v[REPS];
  for (int r = 0; r < REPS; r++) {
    v[r] = run_clients(spec, n, err, errlen);
    if (isnan(v[r])) return NAN;
  }
  return bench_median(v, REPS);
}

int main(void) {
  const char *remote = bench_remote_spec();
  char lerr[512] = "", rerr[512] = "";
  double l1 = median_clients("local", 1, lerr, sizeof lerr);
  double r1 = remote ? median_clients(remote, 1, rerr, sizeof rerr) : NAN;
  if (!remote) snprintf(rerr, sizeof rerr, "no server (DISPATCH_BENCH_REMOTE)");
  double l8 = median_clients("local", NTHREADS, lerr, sizeof lerr);
  double r8 = remote ? median_clients(remote, NTHREADS, rerr, sizeof rerr)
                     : NAN;
  if (lerr[0]) fprintf(stderr, "ops: local: %s\n", lerr);
  if (rerr[0]) fprintf(stderr, "ops: remote: %s\n", rerr);
  bench_row("ops", "pipelined add 16xf32 remote: 1 client", r1, "ops/s",
            "same loop LOCAL", l1, BENCH_GOAL_OURS_GE, 250000,
            rerr[0] ? rerr : NULL);
  bench_row("ops", "pipelined add 16xf32 remote: 8 clients total", r8,
            "ops/s", "same loop LOCAL 8 threads", l8, BENCH_GOAL_NONE, 0,
            rerr[0] ? rerr : NULL);
  return 0;
}
