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
#define REPS 7

static void na(const char *why) {
  bench_row("devices", "move 64 MiB cpu:0 -> cpu:1 (in server)", NAN, "MB/s",
            "memcpy", NAN, BENCH_GOAL_NONE, 0, "%s", why);
  bench_row("devices", "move 64 MiB cpu:0 -> cpu:1 (through the client)", NAN,
            "MB/s", "memcpy", NAN, BENCH_GOAL_NONE, 0, "%s", why);
}

static double mbps(size_t n, double s) { return (double)n / s / 1e6; }

int main(void) {
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

  size_t n = MOVE_BYTES;
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
  int kin = 0, kcl = 0, kmem = 0;
  /* one warm-up repetition (r = -1) is measured and dropped */
  for (int r = -1; r < REPS && !fail[0]; r++) {
    double t = bench_now();
    memcpy(dst, src, n);
    __asm__ volatile("" : : "r"(dst) : "memory");
    t = bench_now() - t;
    if (r >= 0) tmem[kmem++] = t;

    dispatch_tensor *t1 = NULL;
    t = bench_now();
    rc = dispatch_to_device(t0, d1, &t1);
    if (rc == 0) rc = dispatch_device_sync(d1);
    t = bench_now() - t;
    if (rc < 0) {
      snprintf(fail, sizeof fail, "in server: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(d1));
      break;
    }
    if (r >= 0) tin[kin++] = t;
    dispatch_tensor_free(t1);

    if (other) {
      t = bench_now();
      rc = dispatch_to_device(t0, other, &t1);
      if (rc == 0) rc = dispatch_device_sync(other);
      t = bench_now() - t;
      if (rc == 0 && r >= 0) tcl[kcl++] = t;
      dispatch_tensor_free(t1);
    }
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
  double mem = kmem ? mbps(n, bench_median(tmem, kmem)) : NAN;
  if (fail[0]) {
    na(fail);
  } else {
    bench_row("devices", "move 64 MiB cpu:0 -> cpu:1 (in server)",
              mbps(n, bench_median(tin, kin)), "MB/s", "memcpy", mem,
              BENCH_GOAL_NONE, 0,
              "one ToDevice + Sync; median of %d; memcpy between warm "
              "buffers",
              kin);
    bench_row("devices", "move 64 MiB cpu:0 -> cpu:1 (through the client)",
              kcl ? mbps(n, bench_median(tcl, kcl)) : NAN, "MB/s", "memcpy",
              mem, BENCH_GOAL_NONE, 0,
              kcl ? "two sessions: read to this process and upload again; "
                    "median of %d"
                  : "second session did not open",
              kcl);
  }
  dispatch_tensor_free(t0);
  dispatch_device_close(d1);
  dispatch_device_close(d0);
  dispatch_device_close(other);
  free(src);
  free(dst);
  return 0;
}
