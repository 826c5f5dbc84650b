/* bench/checkpoint.c: a checkpoint of REMOTE tensors written and read by
 * the server itself (dispatch_save_on_server / dispatch_load_on_server
 * into its --checkpoint-dir) beside the same through the client
 * (dispatch_save / dispatch_load: every byte crosses the connection and
 * this process writes or reads the file).
 *
 * The model is 16 f32 tensors of 64 MiB (1 GiB; BENCH_QUICK: 4 x 1 MiB;
 * env DISPATCH_BENCH_CKPT_MIB sets another total, in MiB, a multiple of
 * 16), made on the server. Each repetition saves it both ways and loads
 * both files both ways, the order of the two variants rotating; a save
 * includes its fsync and rename, a load ends when the tensors are usable
 * (the client's ends with its sync). Both files live in the server's
 * directory (scripts/bench.sh exports it as DISPATCH_BENCH_CKPT_DIR), so
 * both go to the same file system; a just-written file is usually still
 * in the page cache when it is loaded, on both sides alike. One tensor of
 * each load is compared with the original once, outside the timing.
 *
 * Env DISPATCH_BENCH_REMOTE: the server's spec; without it, or without
 * the directory, every row is n/a with the reason. */
#include <sys/stat.h>

#include "bench.h"

#define N_TENSORS 16
#define FULL_MIB 1024
#define QUICK_MIB 4
#define REPS 3

static bench_def d_save = {"checkpoint", NULL, "MB/s", 0,
                           "dispatch_save through the client", 0,
                           BENCH_GOAL_NONE, 0};
static bench_def d_load = {"checkpoint", NULL, "MB/s", 0,
                           "dispatch_load through the client", 0,
                           BENCH_GOAL_NONE, 0};
static char m_save[96], m_load[96];

static void na(const char *why) {
  double nan = NAN;
  bench_emit(&d_save, &nan, &nan, 1, "%s", why);
  bench_emit(&d_load, &nan, &nan, 1, "%s", why);
}


/* 1 when a and b hold the same bytes (both REMOTE, n bytes each). */
static int same(dispatch_tensor *a, dispatch_tensor *b, size_t n) {
  char *pa = malloc(n), *pb = malloc(n);
  int ok = pa && pb && a && b && dispatch_tensor_read(a, pa, n) == 0 &&
           dispatch_tensor_read(b, pb, n) == 0 && memcmp(pa, pb, n) == 0;
  free(pa);
  free(pb);
  return ok;
}

int main(void) {
  size_t mib = bench_quick() ? QUICK_MIB : FULL_MIB;
  const char *e = getenv("DISPATCH_BENCH_CKPT_MIB");
  if (e && atoi(e) >= N_TENSORS) mib = (size_t)atoi(e) / N_TENSORS * N_TENSORS;
  size_t total = mib << 20, each = total / N_TENSORS;
  int reps_max = bench_quick() ? 2 : REPS;
  snprintf(m_save, sizeof m_save, "save %zu MiB on the server", mib);
  snprintf(m_load, sizeof m_load, "load %zu MiB on the server", mib);
  d_save.metric = m_save;
  d_load.metric = m_load;
  const char *remote = getenv("DISPATCH_BENCH_REMOTE");
  const char *dir = getenv("DISPATCH_BENCH_CKPT_DIR");
  if (!remote || !*remote || !dir || !*dir) {
    na("no server or no directory (DISPATCH_BENCH_REMOTE, "
       "DISPATCH_BENCH_CKPT_DIR)");
    return 0;
  }
  char msg[512], cpath[512];
  snprintf(cpath, sizeof cpath, "%s/client.safetensors", dir);
  dispatch_device *dev = NULL;
  if (dispatch_device_open(remote, NULL, &dev, msg, sizeof msg) < 0) {
    na(msg);
    return 0;
  }
  dispatch_tensor *t[N_TENSORS] = {0};
  char names_buf[N_TENSORS][16];
  const char *names[N_TENSORS];
  int64_t shape[1] = {(int64_t)(each / sizeof(float))};
  int rc = 0;
  for (int i = 0; i < N_TENSORS && rc == 0; i++) {
    snprintf(names_buf[i], sizeof names_buf[i], "layer.%d.w", i);
    names[i] = names_buf[i];
    rc = dispatch_uniform(dev, DISPATCH_F32, 1, shape, -1, 1, (uint64_t)i + 1,
                          &t[i]);
  }
  if (rc == 0) rc = dispatch_device_sync(dev);
  char fail[600] = "";
  if (rc < 0)
    snprintf(fail, sizeof fail, "model: %s", dispatch_device_errmsg(dev));

  double ss[REPS], sc[REPS], ls[REPS], lc[REPS];
  int reps = 0;
  for (int r = 0; r < reps_max && !fail[0]; r++) {
    double tv[4] = {NAN, NAN, NAN, NAN};
    for (int k = 0; k < 2 && !fail[0]; k++) { /* saves */
      int v = bench_turn(r, k, 2);
      double t0 = bench_now();
      rc = v == 0 ? dispatch_save_on_server(dev, "server.safetensors", names,
                                            t, N_TENSORS, NULL)
                  : dispatch_save(dev, cpath, names, t, N_TENSORS, NULL);
      tv[v] = bench_now() - t0;
      if (rc < 0)
        snprintf(fail, sizeof fail, "save (%s): %s: %s",
                 v ? "client" : "server", dispatch_err_name(rc),
                 dispatch_device_errmsg(dev));
    }
    for (int k = 0; k < 2 && !fail[0]; k++) { /* loads */
      int v = bench_turn(r, k, 2);
      dispatch_checkpoint *ck = NULL;
      double t0 = bench_now();
      rc = v == 0 ? dispatch_load_on_server(dev, "server.safetensors", &ck)
                  : dispatch_load(dev, cpath, &ck);
      tv[2 + v] = bench_now() - t0;
      if (rc < 0)
        snprintf(fail, sizeof fail, "load (%s): %s: %s",
                 v ? "client" : "server", dispatch_err_name(rc),
                 dispatch_device_errmsg(dev));
      else if (r == 0 && !same(t[N_TENSORS - 1],
                               dispatch_checkpoint_get(ck, names[N_TENSORS - 1]),
                               each))
        snprintf(fail, sizeof fail, "load (%s): the bytes differ",
                 v ? "client" : "server");
      dispatch_checkpoint_free(ck);
    }
    ss[reps] = bench_mbps(total, tv[0]);
    sc[reps] = bench_mbps(total, tv[1]);
    ls[reps] = bench_mbps(total, tv[2]);
    lc[reps] = bench_mbps(total, tv[3]);
    reps++;
  }
  if (fail[0]) {
    na(fail);
  } else {
    bench_emit(&d_save, ss, sc, reps,
               "%d x %zu %s f32; fsync and rename included; the client "
               "reads 1 MiB pieces",
               N_TENSORS, each >= (1u << 20) ? each >> 20 : each >> 10,
               each >= (1u << 20) ? "MiB" : "KiB");
    bench_emit(&d_load, ls, lc, reps,
               "%d x %zu %s f32 in the server's page cache; the client "
               "uploads each and syncs",
               N_TENSORS, each >= (1u << 20) ? each >> 20 : each >> 10,
               each >= (1u << 20) ? "MiB" : "KiB");
  }
  for (int i = 0; i < N_TENSORS; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
  unlink(cpath);
  char spath[512];
  snprintf(spath, sizeof spath, "%s/server.safetensors", dir);
  unlink(spath);
  return 0;
}
