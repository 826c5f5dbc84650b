/* bench/devices.c: moving a tensor between two devices of one server.
 *
 * The server (scripts/bench.sh starts it with --device cpu:0 --device
 * cpu:1) holds 64 MiB on cpu:0; dispatch_to_device to a peer on cpu:1
 * (dispatch_device_open_peer: the same session) is one ToDevice request,
 * and the server copies through the two backends' staging. Measured per
 * move: the request, the copy into fresh cpu:1 storage (the server's
 * storage cache hands back the block the previous move freed) and a Sync
 * round trip, beside memcpy of the same 64 MiB between two warm buffers in
 * this process, in the same run. For contrast, the same move between two
 * sessions (no shared session: the bytes are read into this process and
 * uploaded again).
 *
 * Env DISPATCH_BENCH_REMOTE: the server's spec; without it every row is
 * n/a with the reason. */
#include "bench.h"

#define MOVE_BYTES ((size_t)64 << 20)
#define QUICK_BYTES ((size_t)4 << 20)
#define REPS 7

/* in server: a limit (one copy, the same bytes memcpy moves); through
 * the client: two transfers over the wire, compared for scale only */
static bench_def d_in = {"devices", NULL, "MB/s", 0, "memcpy", 1,
                         BENCH_GOAL_NONE, 0};
static bench_def d_cl = {"devices", NULL, "MB/s", 0, "memcpy", 0,
                         BENCH_GOAL_NONE, 0};
static char m_in[96], m_cl[96];

static void na(const char *why) {
  double nan = NAN;
  bench_emit(&d_in, &nan, &nan, 1, "%s", why);
  bench_emit(&d_cl, &nan, &nan, 1, "%s", why);
}


int main(void) {
  int quick = bench_quick();
  size_t n = quick ? QUICK_BYTES : MOVE_BYTES;
  int reps_max = quick ? 2 : REPS;
  snprintf(m_in, sizeof m_in, "move %zu MiB cpu:0 -> cpu:1 (in server)",
           n >> 20);
  snprintf(m_cl, sizeof m_cl, "move %zu MiB cpu:0 -> cpu:1 (through the client)",
           n >> 20);
  d_in.metric = m_in;
  d_cl.metric = m_cl;
  const char *remote = getenv("DISPATCH_BENCH_REMOTE");
  if (!remote || !*remote) {
    na("no server (DISPATCH_BENCH_REMOTE unset)");
    return 0;
  }
  char spec[256], msg[512];
  dispatch_device *d0 = NULL, *d1 = NULL, *other = NULL;
  snprintf(spec, sizeof spec, "%s/cpu:0", remote);
  if (dispatch_device_open(spec, NULL, &d0, msg, sizeof msg) < 0) {
    na(msg);
    return 0;
  }
  if (dispatch_device_open_peer(d0, "cpu:1", &d1) < 0) {
    snprintf(msg, sizeof msg, "%s", dispatch_device_errmsg(d0));
    dispatch_device_close(d0);
    na(msg);
    return 0;
  }
  snprintf(spec, sizeof spec, "%s/cpu:1", remote);
  if (dispatch_device_open(spec, NULL, &other, msg, sizeof msg) < 0)
    other = NULL;

  float *src = malloc(n), *dst = malloc(n);
  if (!src || !dst) {
    na("out of memory");
    return 1;
  }
  for (size_t i = 0; i < n / sizeof *src; i++) src[i] = (float)i;
  memset(dst, 0, n);
  int64_t shape[1] = {(int64_t)(n / sizeof *src)};
  dispatch_tensor *t0 = NULL;
  int rc = dispatch_tensor_from_data(d0, DISPATCH_F32, 1, shape, src, n, &t0);
  if (rc == 0) rc = dispatch_device_sync(d0);
  char fail[512] = "";
  if (rc < 0)
    snprintf(fail, sizeof fail, "upload: %s", dispatch_device_errmsg(d0));

  double tin[REPS], tcl[REPS], tmem[REPS];
  int reps = 0;
  /* one warm-up repetition (r = -1) is measured and dropped; the order of
   * the three variants rotates every repetition */
  for (int r = -1; r < reps_max && !fail[0]; r++) {
    double tv[3] = {NAN, NAN, NAN};
    for (int k = 0; k < 3 && !fail[0]; k++) {
      int v = bench_turn(r, k, 3);
      dispatch_tensor *t1 = NULL;
      double t = bench_now();
      if (v == 0) {
        memcpy(dst, src, n);
        __asm__ volatile("" : : "r"(dst) : "memory");
        tv[0] = bench_now() - t;
      } else if (v == 1) {
        rc = dispatch_to_device(t0, d1, &t1);
        if (rc == 0) rc = dispatch_device_sync(d1);
        tv[1] = bench_now() - t;
        if (rc < 0)
          snprintf(fail, sizeof fail, "in server: %s: %s",
                   dispatch_err_name(rc), dispatch_device_errmsg(d1));
      } else if (other) {
        rc = dispatch_to_device(t0, other, &t1);
        if (rc == 0) rc = dispatch_device_sync(other);
        tv[2] = rc == 0 ? bench_now() - t : NAN;
      }
      dispatch_tensor_free(t1);
    }
    if (r < 0) continue;
    tmem[reps] = bench_mbps(n, tv[0]);
    tin[reps] = bench_mbps(n, tv[1]);
    tcl[reps] = bench_mbps(n, tv[2]);
    reps++;
  }
  /* the moved bytes are checked once, outside the timing */
  if (!fail[0]) {
    dispatch_tensor *t1 = NULL;
    rc = dispatch_to_device(t0, d1, &t1);
    if (rc == 0) rc = dispatch_tensor_read(t1, dst, n);
    if (rc < 0 || memcmp(src, dst, n) != 0)
      snprintf(fail, sizeof fail, "the moved bytes differ (%s)",
               dispatch_err_name(rc));
    dispatch_tensor_free(t1);
  }
  if (fail[0]) {
    na(fail);
  } else {
    bench_emit(&d_in, tin, tmem, reps,
               "one ToDevice + Sync; memcpy between warm buffers");
    bench_emit(&d_cl, tcl, tmem, reps,
               other ? "two sessions: read to this process and upload again"
                     : "second session did not open");
  }
  dispatch_tensor_free(t0);
  dispatch_device_close(d1);
  dispatch_device_close(d0);
  dispatch_device_close(other);
  free(src);
  free(dst);
  return 0;
}
