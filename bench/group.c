/* bench/group: a 2-rank MPI group of dispatch-servers on loopback (started
 * here with mpirun, as tests/test_group.c starts it), two rows:
 *
 * step     one data-parallel step of an MLP 784-256-10 (SGD) on a batch
 *          of 128 random images: each member takes 64 rows, forward,
 *          backward and the grouped step (dispatch_group_step, the
 *          gradients averaged through MPI), against the same step of the
 *          whole batch on one server (rank 0's, through a connection of
 *          its own). ms, lower is better; no goal: on a host of two cores
 *          two servers share the cores one server has.
 * allreduce the all-reduce (sum) of 16 MiB of f32 per member, from the
 *          request to both members' answers, as MB/s of one member's
 *          bytes, against a raw loopback socket moving the same bytes
 *          once (bench/raw_server, DISPATCH_BENCH_RAW): an all-reduce of
 *          two ranks moves each byte at least once each way, so the raw
 *          socket is a limit.
 * allreduce vs MPI the same all-reduce against Open MPI alone: MPI_Allreduce
 *          of the same bytes between two ranks of a job of its own
 *          (bench/mpi/allreduce.c, started per repetition under the
 *          servers' mpirun options), the fair limit: the group runs that
 *          very call, plus copying the tensors out and back and the
 *          requests and answers.
 *
 * BENCH_QUICK: batch 16, 1 MiB, a rep or two. */
#include "bench.h"

#include "../tests/helpers/group_proc.c"

#include <libgen.h>
#include <limits.h>

#define HIDDEN 256

/* One MPI_Allreduce of bytes between 2 ranks of a job of its own
 * (bench/mpi/allreduce.c beside this program): MB/s, or NAN with why. */
static double mpi_alone(size_t bytes, char *why, size_t len) {
  char exe[PATH_MAX];
  ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (k <= 0) return snprintf(why, len, "no /proc/self/exe"), NAN;
  exe[k] = '\0';
  char cmd[PATH_MAX + 512];
  const char *mpirun = getenv("MPIRUN");
  int at = snprintf(cmd, sizeof cmd, "%s", mpirun && *mpirun ? mpirun : "mpirun");
  for (int i = 0; gp_mpirun_opts[i]; i++)
    at += snprintf(cmd + at, sizeof cmd - (size_t)at, " %s", gp_mpirun_opts[i]);
  snprintf(cmd + at, sizeof cmd - (size_t)at, " -np 2 %s/mpi_allreduce %zu 1 2>&1",
           dirname(exe), bytes);
  FILE *p = popen(cmd, "r");
  if (!p) return snprintf(why, len, "cannot run mpirun"), NAN;
  char line[256];
  double v = NAN;
  while (fgets(line, sizeof line, p))
    if (sscanf(line, "mbps %lf", &v) == 1) break;
  while (fgets(line, sizeof line, p)) {
  }
  if (pclose(p) != 0 || !isfinite(v)) {
    snprintf(why, len, "the Open MPI reference (mpi_allreduce) failed");
    return NAN;
  }
  return v;
}

typedef struct member {
  dispatch_device *dev;
  dispatch_tensor *p[4]; /* w1, b1, w2, b2: AUTODIFF leaves */
  dispatch_optim *opt;
} member;

static int model(member *m, dispatch_device *dev) {
  const int64_t s[4][2] = {{784, HIDDEN}, {HIDDEN, 0}, {HIDDEN, 10}, {10, 0}};
  m->dev = dev;
  for (int i = 0; i < 4; i++) {
    dispatch_tensor *t;
    if (dispatch_uniform(dev, DISPATCH_F32, s[i][1] ? 2 : 1, s[i], -0.05, 0.05,
                         (uint64_t)i + 1, &t) < 0 ||
        dispatch_autodiff(t, &m->p[i]) < 0)
      return -1;
    dispatch_tensor_free(t);
  }
  return dispatch_sgd_new(m->p, 4, 0.01, 0, 0, &m->opt);
}

/* forward and backward of b rows of x/y on m, in m's open scope */
static void fwd_bwd(member *m, const float *x, const int64_t *y, int64_t b,
                    dispatch_grads **g, dispatch_tensor **loss) {
  dispatch_tensor *xt, *yt, *h, *o;
  const int64_t xs[2] = {b, 784};
  dispatch_tensor_from_data(m->dev, DISPATCH_F32, 2, xs, x,
                            (size_t)b * 784 * sizeof *x, &xt);
  dispatch_tensor_from_data(m->dev, DISPATCH_I64, 1, &b, y,
                            (size_t)b * sizeof *y, &yt);
  dispatch_matmul(xt, m->p[0], &h);
  dispatch_add(h, m->p[1], &h);
  dispatch_relu(h, &h);
  dispatch_matmul(h, m->p[2], &o);
  dispatch_add(o, m->p[3], &o);
  dispatch_cross_entropy(o, yt, loss);
  dispatch_backward(*loss, g);
}

int main(void) {
  int quick = bench_quick();
  int batch = quick ? 16 : 128;
  size_t mib = quick ? 1 : 16;
  char note[512] = "";
  char stepm[96], arm[96];
  snprintf(stepm, sizeof stepm,
           "data-parallel MLP step 2 servers (%d each) vs 1 server (%d)",
           batch / 2, batch);
  snprintf(arm, sizeof arm, "all-reduce %zu MiB f32 on 2 servers", mib);
  bench_def dstep = {"group", stepm, "ms", 1, "1 server", 0, BENCH_GOAL_NONE, 0};
  bench_def dar = {"group", arm, "MB/s", 0, "raw socket", 1, BENCH_GOAL_NONE, 0};
  char mpim[112];
  snprintf(mpim, sizeof mpim, "%s vs MPI alone", arm);
  bench_def dmpi = {"group", mpim, "MB/s", 0, "MPI_Allreduce", 1, BENCH_GOAL_NONE, 0};
  enum { MAXR = 30 };
  double ours[MAXR], ref[MAXR], aours[MAXR], aref[MAXR], mref[MAXR];
  int n = 0, an = 0;
  gp_group gp;
  const char *extra[] = {"--log-level", "warn", NULL};
  dispatch_group *g = NULL;
  dispatch_device *solo = NULL;
  char err[256] = "";
  if (gp_start(&gp, 2, extra) < 0) {
    snprintf(note, sizeof note, "mpirun did not start 2 ranks");
  } else {
    const char *specs[2] = {gp.specs[0], gp.specs[1]};
    if (dispatch_group_open(specs, 2, NULL, &g, err, sizeof err) < 0)
      snprintf(note, sizeof note, "group_open: %s", err);
    else if (dispatch_device_open(gp.specs[0], NULL, &solo, err, sizeof err) < 0)
      snprintf(note, sizeof note, "open: %s", err);
  }
  if (g && solo) {
    member m[2], s;
    float *x = malloc((size_t)batch * 784 * sizeof *x);
    int64_t *y = malloc((size_t)batch * sizeof *y);
    for (int i = 0; i < batch * 784; i++) x[i] = (float)((i * 7919) % 256) / 255.0f;
    for (int i = 0; i < batch; i++) y[i] = i % 10;
    int ok = model(&m[0], dispatch_group_device(g, 0)) == 0 &&
             model(&m[1], dispatch_group_device(g, 1)) == 0 &&
             model(&s, solo) == 0;
    double t0 = bench_now();
    int reps = quick ? 2 : 10;
    for (int r = 0; ok && r < reps + 1; r++) {
      double tv[2] = {0, 0};
      for (int k = 0; k < 2; k++) {
        int v = bench_turn(r, k, 2);
        double a = bench_now();
        float l;
        if (v == 0) {
          dispatch_grads *gr[2];
          dispatch_tensor *loss[2];
          dispatch_optim *opts[2] = {m[0].opt, m[1].opt};
          for (int i = 0; i < 2; i++) {
            dispatch_scope_begin(m[i].dev);
            fwd_bwd(&m[i], x + (size_t)i * (batch / 2) * 784,
                    y + i * (batch / 2), batch / 2, &gr[i], &loss[i]);
          }
          dispatch_group_step(g, opts, gr, DISPATCH_REDUCE_MEAN);
          for (int i = 0; i < 2; i++) {
            if (dispatch_tensor_read(loss[i], &l, sizeof l) < 0) ok = 0;
            dispatch_grads_free(gr[i]);
            dispatch_scope_end(m[i].dev);
          }
        } else {
          dispatch_grads *gr;
          dispatch_tensor *loss;
          dispatch_scope_begin(solo);
          fwd_bwd(&s, x, y, batch, &gr, &loss);
          dispatch_optim_step(s.opt, gr);
          if (dispatch_tensor_read(loss, &l, sizeof l) < 0) ok = 0;
          dispatch_grads_free(gr);
          dispatch_scope_end(solo);
        }
        tv[v] = (bench_now() - a) * 1e3;
      }
      if (r > 0 && n < MAXR) { /* the first is a warm-up */
        ours[n] = tv[0];
        ref[n] = tv[1];
        n++;
      }
    }
    if (!ok) snprintf(note, sizeof note, "a step failed: %s / %s",
                      dispatch_device_errmsg(dispatch_group_device(g, 0)),
                      dispatch_device_errmsg(solo));
    (void)t0;
    /* the all-reduce against the raw socket */
    size_t bytes = mib << 20;
    int64_t cnt = (int64_t)(bytes / 4);
    float *buf = calloc((size_t)cnt, sizeof *buf);
    char rwhy[256] = "";
    int fd = bench_raw_connect(rwhy, sizeof rwhy);
    dispatch_tensor *t[2] = {NULL, NULL};
    for (int i = 0; ok && i < 2; i++)
      if (dispatch_tensor_from_data(dispatch_group_device(g, i), DISPATCH_F32,
                                    1, &cnt, buf, bytes, &t[i]) < 0)
        ok = 0;
    for (int r = 0; ok && r < reps + 1; r++) {
      double a = bench_now();
      dispatch_group_allreduce(g, t, 1, DISPATCH_REDUCE_SUM);
      if (dispatch_device_sync(dispatch_group_device(g, 0)) < 0 ||
          dispatch_device_sync(dispatch_group_device(g, 1)) < 0) {
        ok = 0;
        snprintf(note, sizeof note, "all-reduce failed: %s",
                 dispatch_device_errmsg(dispatch_group_device(g, 0)));
      }
      double ta = bench_now() - a;
      double tr = NAN;
      if (fd >= 0) {
        a = bench_now();
        if (bench_raw_call(fd, BENCH_RAW_PUT, buf, bytes, BENCH_WAIT_BLOCK) == 0)
          tr = bench_now() - a;
      }
      char mwhy[128] = "";
      double tm = r > 0 ? mpi_alone(bytes, mwhy, sizeof mwhy) : NAN;
      if (r > 0 && !isfinite(tm) && !note[0])
        snprintf(note, sizeof note, "%s", mwhy);
      if (r > 0 && an < MAXR) {
        aours[an] = bench_mbps(bytes, ta);
        aref[an] = bench_mbps(bytes, tr);
        mref[an] = tm;
        an++;
      }
    }
    if (fd < 0 && !note[0]) snprintf(note, sizeof note, "%s", rwhy);
    if (fd >= 0) close(fd);
    free(buf);
    free(x);
    free(y);
  }
  if (n == 0) {
    ours[0] = ref[0] = NAN;
    n = 1;
  }
  if (an == 0) {
    aours[0] = aref[0] = mref[0] = NAN;
    an = 1;
  }
  bench_emit(&dstep, ours, ref, n, "%s", note);
  bench_emit(&dar, aours, aref, an, "%s", note);
  bench_emit(&dmpi, aours, mref, an, "%s", note);
  dispatch_device_close(solo);
  dispatch_group_close(g);
  if (gp.pid) gp_stop(&gp);
  return 0;
}
