/* bench peer: a 256 MiB f32 tensor moved between two dispatch-servers
 * (BENCH_QUICK: 4 MiB) three ways, in the same repetitions:
 *
 * peer     = dispatch_to_device from a device of server A to one of
 *            server B, which pulls the bytes from A itself (protocol 1.7:
 *            a grant round trip to A, then B connects to A, fetches, and
 *            answers when the tensor is whole); the time is the call's
 *            return, a fresh tensor on B each repetition
 * bounced  = the same move through this process: dispatch_tensor_read
 *            from A, dispatch_tensor_from_data onto B, dispatch_device_sync
 *            of B (what dispatch_to_device did before 1.7)
 * raw      = one GET of the same bytes from bench/raw_server over a plain
 *            loopback socket with blocking reads: the limit any
 *            socket transfer of these bytes has here
 *
 * The servers are A and B of scripts/bench.sh (DISPATCH_BENCH_PEER_A,
 * DISPATCH_BENCH_PEER_B; B started with --peer a=A's address). Goal
 * (issue 25): the server-to-server move at least 0.7 of the raw socket.
 * The bounced row is reported against the same reference, without a
 * goal, so the two moves read side by side. */
#include "bench.h"

#define PEER_GOAL 0.7
#define MAX_REPS 15
#define MIN_REPS 5

static dispatch_device *open_env(const char *var, char *why, size_t len) {
  const char *s = getenv(var);
  if (!s || !*s) {
    snprintf(why, len, "no peer servers (%s unset)", var);
    return NULL;
  }
  return bench_open(s, why, len);
}

int main(void) {
  size_t bytes = bench_quick() ? (4u << 20) : (256u << 20);
  const char *size_name = bench_quick() ? "4 MiB" : "256 MiB";
  double budget = bench_quick() ? 0 : 40.0;
  int max_reps = bench_quick() ? 2 : MAX_REPS;
  int min_reps = bench_quick() ? 2 : MIN_REPS;
  char why[512] = "", m_peer[96], m_bounce[96];
  snprintf(m_peer, sizeof m_peer, "server to server %s", size_name);
  snprintf(m_bounce, sizeof m_bounce, "bounced through the client %s",
           size_name);
  bench_def d_peer = {"peer", m_peer, "MB/s", 0, "raw socket GET", 1,
                      BENCH_GOAL_RATIO_GE, PEER_GOAL};
  bench_def d_bounce = {"peer", m_bounce, "MB/s", 0, "raw socket GET", 1,
                        BENCH_GOAL_NONE, 0};
  double peer[MAX_REPS], bounce[MAX_REPS], raw[MAX_REPS];
  int n = 0;
  dispatch_device *a = open_env("DISPATCH_BENCH_PEER_A", why, sizeof why);
  dispatch_device *b = a ? open_env("DISPATCH_BENCH_PEER_B", why, sizeof why)
                         : NULL;
  int fd = b ? bench_raw_connect(why, sizeof why) : -1;
  float *host = malloc(bytes);
  dispatch_tensor *src = NULL;
  int64_t shape[1] = {(int64_t)(bytes / sizeof(float))};
  if (fd >= 0 && host) {
    for (size_t i = 0; i < bytes / sizeof(float); i++)
      host[i] = (float)(i % 1021) * 0.5f;
    int rc = dispatch_tensor_from_data(a, DISPATCH_F32, 1, shape, host, bytes,
                                       &src);
    if (rc == 0) rc = dispatch_device_sync(a);
    if (rc < 0)
      snprintf(why, sizeof why, "upload to A: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(a));
  }
  /* one untimed move each way first: connections, pages and caches warm */
  if (src) {
    dispatch_tensor *t = NULL;
    int rc = dispatch_to_device(src, b, &t);
    if (rc < 0)
      snprintf(why, sizeof why, "to_device A -> B: %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
    dispatch_tensor_free(t);
    if (rc < 0 || bench_raw_call(fd, BENCH_RAW_GET, host, bytes,
                                 BENCH_WAIT_BLOCK) < 0) {
      if (rc == 0) snprintf(why, sizeof why, "raw GET failed");
      dispatch_tensor_free(src);
      src = NULL;
    }
  }
  double t0 = bench_now();
  while (src && bench_more(n, min_reps, max_reps, bench_now() - t0, budget,
                           bench_unsettled(&d_peer, peer, raw, n))) {
    peer[n] = bounce[n] = raw[n] = NAN;
    for (int k = 0; k < 3; k++) {
      int v = bench_turn(n, k, 3);
      double s = bench_now();
      if (v == 0) {
        dispatch_tensor *t = NULL;
        int rc = dispatch_to_device(src, b, &t);
        if (rc == 0) peer[n] = bench_mbps(bytes, bench_now() - s);
        else
          snprintf(why, sizeof why, "to_device: %s: %s",
                   dispatch_err_name(rc), dispatch_device_errmsg(b));
        dispatch_tensor_free(t);
        dispatch_device_sync(b);
      } else if (v == 1) {
        dispatch_tensor *t = NULL;
        int rc = dispatch_tensor_read(src, host, bytes);
        if (rc == 0)
          rc = dispatch_tensor_from_data(b, DISPATCH_F32, 1, shape, host,
                                         bytes, &t);
        if (rc == 0) rc = dispatch_device_sync(b);
        if (rc == 0) bounce[n] = bench_mbps(bytes, bench_now() - s);
        dispatch_tensor_free(t);
        dispatch_device_sync(b);
      } else if (bench_raw_call(fd, BENCH_RAW_GET, host, bytes,
                                BENCH_WAIT_BLOCK) == 0) {
        raw[n] = bench_mbps(bytes, bench_now() - s);
      }
    }
    n++;
  }
  const char *note = src ? NULL : why;
  bench_emit(&d_peer, peer, raw, n, note ? "%s" : NULL, note);
  bench_emit(&d_bounce, bounce, raw, n, note ? "%s" : NULL, note);
  dispatch_tensor_free(src);
  if (fd >= 0) close(fd);
  free(host);
  if (b) dispatch_device_close(b);
  if (a) dispatch_device_close(a);
  return 0;
}
