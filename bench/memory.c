/* bench memory: the server's resident memory (VmRSS of
 * /proc/$DISPATCH_BENCH_SERVER_PID/status), best run on a fresh server.
 *   - bytes of overhead per held tensor: RSS before and after uploading
 *     100,000 one-element f32 tensors (and a sync), minus their payload,
 *     over the count; the reference is the payload itself (4 B);
 *   - RSS after freeing them again, and after one million small ops (add
 *     on 16-element tensors, each output freed), against the baseline.
 */
#include "bench.h"

#define FULL_HELD 100000
#define FULL_SMALL_OPS 1000000L
/* BENCH_QUICK: a hundredth of each */
#define HELD (bench_quick() ? FULL_HELD / 100 : FULL_HELD)
#define SMALL_OPS (bench_quick() ? FULL_SMALL_OPS / 100 : FULL_SMALL_OPS)
#define OPS_BUDGET 60.0 /* seconds; the row says how many ran if cut */

int main(void) {
  const char *pid_s = getenv("DISPATCH_BENCH_SERVER_PID");
  long pid = pid_s ? strtol(pid_s, NULL, 10) : 0;
  char why[512] = "";
  dispatch_device *dev = bench_open(bench_remote_spec(), why, sizeof why);
  if (dev && (pid <= 0 || bench_rss_bytes(pid) < 0)) {
    snprintf(why, sizeof why, "no server RSS (DISPATCH_BENCH_SERVER_PID %s)",
             pid_s ? pid_s : "unset");
    dispatch_device_close(dev);
    dev = NULL;
  }
  double per_tensor = NAN, base_mib = NAN, held_mib = NAN, freed_mib = NAN,
         ops_mib = NAN;
  long ops_done = 0;
  dispatch_tensor **held = calloc(HELD, sizeof *held);
  if (!held) {
    fprintf(stderr, "memory: out of memory\n");
    return 1;
  }
  int rc = 0;
  if (dev) {
    rc = dispatch_device_sync(dev);
    long long base = bench_rss_bytes(pid);
    int64_t shape[1] = {1};
    float v = 2.0f;
    for (int i = 0; i < HELD && rc == 0; i++)
      rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, &v,
                                     sizeof v, &held[i]);
    if (rc == 0) rc = dispatch_device_sync(dev);
    long long after = bench_rss_bytes(pid);
    if (rc == 0) {
      per_tensor =
          ((double)(after - base) - (double)HELD * sizeof v) / (double)HELD;
      base_mib = (double)base / 1048576.0;
      held_mib = (double)after / 1048576.0;
    }
    for (int i = 0; i < HELD; i++) dispatch_tensor_free(held[i]);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (rc == 0) freed_mib = (double)bench_rss_bytes(pid) / 1048576.0;

    float ad[16] = {0}, bd[16] = {0};
    int64_t s16[1] = {16};
    dispatch_tensor *a = NULL, *b = NULL;
    if (rc == 0)
      rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s16, ad, sizeof ad,
                                     &a);
    if (rc == 0)
      rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s16, bd, sizeof bd,
                                     &b);
    double t0 = bench_now();
    while (rc == 0 && ops_done < SMALL_OPS && bench_now() - t0 < OPS_BUDGET) {
      for (int i = 0; i < 10000 && rc == 0; i++) {
        dispatch_tensor *c = NULL;
        rc = dispatch_add(a, b, &c);
        dispatch_tensor_free(c);
      }
      ops_done += 10000;
      /* keep the client from running far ahead of the server */
      if (rc == 0 && ops_done % 100000 == 0) rc = dispatch_device_sync(dev);
    }
    dispatch_tensor_free(a);
    dispatch_tensor_free(b);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (rc == 0) ops_mib = (double)bench_rss_bytes(pid) / 1048576.0;
    if (rc < 0)
      snprintf(why, sizeof why, "%s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  }
  if (why[0]) fprintf(stderr, "memory: %s\n", why);
  const char *note = why[0] ? why : NULL;
  char m[96], n1[600];
  /* one measurement each: RSS of a server at one moment, no repetitions */
  bench_def d = {"memory", "server overhead per held 1-elem tensor", "B", 1,
                 "payload per tensor", 0, BENCH_GOAL_NONE, 0};
  snprintf(n1, sizeof n1, "%s", note ? note : "");
  if (!note)
    snprintf(n1, sizeof n1, "%d tensors held; RSS delta minus payload", HELD);
  bench_emit1(&d, per_tensor, 4.0, n1);
  snprintf(m, sizeof m, "server RSS holding %d tensors", HELD);
  d.metric = m;
  d.unit = "MiB";
  d.ref_name = "baseline RSS";
  bench_emit1(&d, held_mib, base_mib, note);
  d.metric = "server RSS after freeing them";
  bench_emit1(&d, freed_mib, base_mib, note);
  snprintf(m, sizeof m, "server RSS after %ld small ops + frees", ops_done);
  d.metric = m;
  bench_emit1(&d, ops_mib, base_mib, note);
  free(held);
  dispatch_device_close(dev);
  return 0;
}
