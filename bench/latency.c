/* bench latency: the time of one waiting request (dispatch_device_sync,
 * and dispatch_tensor_read of a 1-element tensor) on a REMOTE device,
 * against a raw TCP ping-pong of 16-byte messages (the frame header size)
 * on loopback with TCP_NODELAY, measured in the same run. Also an add of
 * two 16-float tensors followed by a read of its result, against an empty
 * sync, each with the client's default wait (the environment as given)
 * and on a second session opened with DISPATCH_SPIN_US=0 (issue 11: at
 * most 1.3x in both).
 *
 * The raw echo server is bench/raw_server, exec'd and placed by
 * scripts/bench.sh like dispatch-server. The raw client runs twice: with
 * blocking write/read, and waiting the way libdispatch-client does
 * (spinning DISPATCH_SPIN_US on poll before sleeping); the reference of
 * each row is the better of the two, so it is the fastest round trip a
 * plain socket makes here, whichever way of waiting suits the machine.
 *
 * One round runs a block of PER_BLOCK requests of each variant, in an
 * order that rotates every round, so noise from the shared machine falls
 * on all of them alike; each round gives one median and one p99 per
 * variant, and the rows are the medians over rounds with their spread.
 * Rounds go on (MIN_ROUNDS to MAX_ROUNDS, within BUDGET) while the goal
 * is neither met nor missed. Goal: within 1.3x of the raw round trip.
 */
#include "bench.h"

#define MAX_ROUNDS 40
#define MIN_ROUNDS 10
#define PER_BLOCK 300
#define WARMUP 200
#define BUDGET 20.0
#define GOAL 1.3
#define GOAL_ADD_READ 1.3

enum {
  V_RAW_BLOCK, V_RAW_CLIENT, V_SYNC, V_READ, /* default wait */
  V_ADD_READ, V_SYNC0, V_ADD_READ0,          /* ...0: DISPATCH_SPIN_US=0 */
  NVAR
};

/* The second session: DISPATCH_SPIN_US is read when a device connects,
 * so it is set around this open only. */
static dispatch_device *open_spin_off(const char *spec, char *why,
                                      size_t len) {
  const char *old = getenv("DISPATCH_SPIN_US");
  char *keep = old ? strdup(old) : NULL;
  setenv("DISPATCH_SPIN_US", "0", 1);
  dispatch_device *d = bench_open(spec, why, len);
  if (keep) setenv("DISPATCH_SPIN_US", keep, 1);
  else unsetenv("DISPATCH_SPIN_US");
  free(keep);
  return d;
}

/* Two 16-float operands on dev, uploaded and synced; 0 or the error. */
static int operands(dispatch_device *dev, dispatch_tensor **a,
                    dispatch_tensor **b) {
  float av[16], bv[16];
  for (int i = 0; i < 16; i++) {
    av[i] = (float)i;
    bv[i] = 1.0f;
  }
  int64_t shape[1] = {16};
  *a = *b = NULL;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, av,
                                     sizeof av, a);
  if (rc == 0)
    rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, bv,
                                   sizeof bv, b);
  if (rc == 0) rc = dispatch_device_sync(dev);
  return rc;
}

/* c = a + b, read back and checked, c freed (its Free goes out with the
 * next request, as in a training loop). */
static int add_read(dispatch_tensor *a, dispatch_tensor *b, char *why,
                    size_t len) {
  dispatch_tensor *c = NULL;
  float out[16];
  int rc = dispatch_add(a, b, &c);
  if (rc == 0) rc = dispatch_tensor_read(c, out, sizeof out);
  if (rc == 0 && out[15] != 16.0f) {
    snprintf(why, len, "add + read gave %g, not 16", (double)out[15]);
    rc = -1;
  }
  dispatch_tensor_free(c);
  return rc;
}

static double block[PER_BLOCK];

int main(void) {
  int quick = bench_quick();
  int per_block = quick ? 20 : PER_BLOCK, warmup = quick ? 10 : WARMUP;
  int min_rounds = quick ? 2 : MIN_ROUNDS, max_rounds = quick ? 2 : MAX_ROUNDS;
  char rwhy[512] = "";
  int fd = bench_raw_connect(rwhy, sizeof rwhy);
  if (fd < 0) fprintf(stderr, "latency: %s\n", rwhy);
  char why[512] = "";
  dispatch_device *dev = bench_open(bench_remote_spec(), why, sizeof why);
  dispatch_tensor *one = NULL;
  float val = 1.5f, got = 0;
  if (dev) {
    int64_t shape[1] = {1};
    int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, &val,
                                       sizeof val, &one);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (rc < 0) {
      snprintf(why, sizeof why, "upload: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
      dispatch_tensor_free(one);
      dispatch_device_close(dev);
      dev = NULL;
      one = NULL;
    }
  }

  dispatch_tensor *a = NULL, *b = NULL, *a0 = NULL, *b0 = NULL;
  char why0[512] = "";
  dispatch_device *dev0 = dev ? open_spin_off(bench_remote_spec(), why0,
                                              sizeof why0)
                              : NULL;
  if (dev && operands(dev, &a, &b) < 0)
    snprintf(why0, sizeof why0, "add operands: %s",
             dispatch_device_errmsg(dev));
  if (dev0 && !why0[0] && operands(dev0, &a0, &b0) < 0)
    snprintf(why0, sizeof why0, "add operands (spin off): %s",
             dispatch_device_errmsg(dev0));

  /* med[v][round], p99[v][round] in us; NAN where v could not run */
  static double med[NVAR][MAX_ROUNDS], p99[NVAR][MAX_ROUNDS];
  int no_add = !dev || !dev0 || why0[0];
  int rounds = 0, bad[NVAR] = {fd < 0, fd < 0, !dev, !dev, no_add, no_add,
                               no_add};
  for (int i = 0; i < warmup; i++) {
    if (!bad[V_RAW_BLOCK] &&
        bench_raw_call(fd, BENCH_RAW_ECHO, NULL, 0, BENCH_WAIT_BLOCK) < 0)
      bad[V_RAW_BLOCK] = bad[V_RAW_CLIENT] = 1;
    if (dev) {
      dispatch_device_sync(dev);
      dispatch_tensor_read(one, &got, sizeof got);
    }
    if (!no_add) {
      add_read(a, b, why0, sizeof why0);
      add_read(a0, b0, why0, sizeof why0);
      dispatch_device_sync(dev0);
    }
  }
  bench_def d_add = {"latency", "add + read vs sync (default wait)", "us", 1,
                     "empty sync", 1, BENCH_GOAL_RATIO_LE, GOAL_ADD_READ};
  bench_def d_add0 = d_add;
  d_add0.metric = "add + read vs sync (DISPATCH_SPIN_US=0)";
  bench_def d_sync = {"latency", "sync median", "us", 1,
                      "raw TCP ping-pong 16 B", 1, BENCH_GOAL_RATIO_LE, GOAL};
  bench_def d_read = d_sync;
  d_read.metric = "read 1-elem f32 median";
  bench_def d_p99 = {"latency", "sync p99", "us", 1, "raw TCP ping-pong 16 B",
                     1, BENCH_GOAL_NONE, 0};
  double start = bench_now();
  for (int r = 0;; r++) {
    if (rounds > 0) {
      double *rv[2] = {med[V_RAW_BLOCK], med[V_RAW_CLIENT]};
      double *rp[2] = {p99[V_RAW_BLOCK], p99[V_RAW_CLIENT]};
      int b = bench_best_variant(rv, 2, rounds);
      int bp = bench_best_variant(rp, 2, rounds);
      int unsettled = bench_unsettled(&d_sync, med[V_SYNC], rv[b], rounds) ||
                      bench_unsettled(&d_read, med[V_READ], rv[b], rounds) ||
                      bench_unsettled(&d_p99, p99[V_SYNC], rp[bp], rounds) ||
                      bench_unsettled(&d_p99, p99[V_READ], rp[bp], rounds) ||
                      bench_unsettled(&d_add, med[V_ADD_READ], med[V_SYNC],
                                      rounds) ||
                      bench_unsettled(&d_add0, med[V_ADD_READ0],
                                      med[V_SYNC0], rounds);
      if (!bench_more(rounds, min_rounds, max_rounds, bench_now() - start,
                      BUDGET, unsettled))
        break;
    }
    for (int k = 0; k < NVAR; k++) {
      int v = bench_turn(r, k, NVAR);
      int n = 0;
      for (int i = 0; i < per_block && !bad[v]; i++) {
        double t0 = bench_now();
        int rc = 0;
        if (v == V_RAW_BLOCK || v == V_RAW_CLIENT) {
          rc = bench_raw_call(fd, BENCH_RAW_ECHO, NULL, 0,
                              v == V_RAW_BLOCK ? BENCH_WAIT_BLOCK
                                               : BENCH_WAIT_CLIENT);
          if (rc < 0) snprintf(rwhy, sizeof rwhy, "raw ping-pong failed");
        } else if (v == V_SYNC) {
          rc = dispatch_device_sync(dev);
        } else if (v == V_SYNC0) {
          rc = dispatch_device_sync(dev0);
        } else if (v == V_ADD_READ || v == V_ADD_READ0) {
          rc = v == V_ADD_READ ? add_read(a, b, why0, sizeof why0)
                               : add_read(a0, b0, why0, sizeof why0);
        } else {
          rc = dispatch_tensor_read(one, &got, sizeof got);
          if (rc == 0 && got != val) {
            snprintf(why, sizeof why, "read gave %g, not %g", (double)got,
                     (double)val);
            rc = -1;
          }
        }
        double dt = (bench_now() - t0) * 1e6;
        if (rc < 0 && v >= V_ADD_READ) {
          if (!why0[0])
            snprintf(why0, sizeof why0, "%s: %s", dispatch_err_name(rc),
                     dispatch_device_errmsg(v == V_ADD_READ ? dev : dev0));
          bad[v] = 1;
          break;
        }
        if (rc < 0) {
          if (v >= V_SYNC && !why[0])
            snprintf(why, sizeof why, "%s: %s: %s",
                     v == V_SYNC ? "sync" : "read", dispatch_err_name(rc),
                     dispatch_device_errmsg(dev));
          bad[v] = 1;
          break;
        }
        block[n++] = dt;
      }
      med[v][rounds] = bad[v] ? NAN : bench_median(block, n);
      p99[v][rounds] = bad[v] ? NAN : bench_quantile(block, n, 0.99);
    }
    rounds++;
  }
  if (why[0]) fprintf(stderr, "latency: %s\n", why);

  double *rv[2] = {med[V_RAW_BLOCK], med[V_RAW_CLIENT]};
  double *rp[2] = {p99[V_RAW_BLOCK], p99[V_RAW_CLIENT]};
  int bm = bench_best_variant(rv, 2, rounds);
  int bp = bench_best_variant(rp, 2, rounds);
  char note[1200];
  snprintf(note, sizeof note,
           "%s%s%s%sraw reference: %s wait; %d rounds of %d", why,
           why[0] ? "; " : "", rwhy, rwhy[0] ? "; " : "", bench_wait_name[bm],
           rounds, per_block);
  bench_emit(&d_sync, med[V_SYNC], rv[bm], rounds, "%s", note);
  snprintf(note, sizeof note, "%s%sraw reference: %s wait", why,
           why[0] ? "; " : "", bench_wait_name[bp]);
  bench_emit(&d_p99, p99[V_SYNC], rp[bp], rounds, "%s", note);
  snprintf(note, sizeof note, "%s%sraw reference: %s wait", why,
           why[0] ? "; " : "", bench_wait_name[bm]);
  bench_emit(&d_read, med[V_READ], rv[bm], rounds, "%s", note);
  d_p99.metric = "read 1-elem f32 p99";
  snprintf(note, sizeof note, "%s%sraw reference: %s wait", why,
           why[0] ? "; " : "", bench_wait_name[bp]);
  bench_emit(&d_p99, p99[V_READ], rp[bp], rounds, "%s", note);

  snprintf(note, sizeof note,
           "%s%sround medians, the same session's sync as reference; "
           "default wait: DISPATCH_SPIN_US %s",
           why0, why0[0] ? "; " : "",
           getenv("DISPATCH_SPIN_US") ? getenv("DISPATCH_SPIN_US")
                                       : "unset (adaptive, client/wait.c)");
  bench_emit(&d_add, med[V_ADD_READ], med[V_SYNC], rounds, "%s", note);
  snprintf(note, sizeof note,
           "%s%sround medians; a second session opened with "
           "DISPATCH_SPIN_US=0",
           why0, why0[0] ? "; " : "");
  bench_emit(&d_add0, med[V_ADD_READ0], med[V_SYNC0], rounds, "%s", note);

  dispatch_tensor_free(a);
  dispatch_tensor_free(b);
  dispatch_tensor_free(a0);
  dispatch_tensor_free(b0);
  dispatch_device_close(dev0);
  dispatch_tensor_free(one);
  dispatch_device_close(dev);
  if (fd >= 0) close(fd);
  return bad[V_SYNC] && dev ? 1 : 0;
}
