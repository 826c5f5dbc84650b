/* Groups (protocol 1.7) against real dispatch-servers started as one MPI
 * job under mpirun, every channel on loopback (tests/helpers/group_proc.h):
 * an all-reduce sum and mean of several f32 and f64 tensors lands on every
 * member, bit for bit the sum a local loop computes; members holding other
 * shapes all refuse with DISPATCH_EGROUP and keep their tensors; a
 * data-parallel step leaves the parameters identical on both members and
 * equal to the update with the averaged gradients; a rank killed while the
 * group works gives the client an error, never a hang; a server without
 * --mpi refuses a group; a rank that would listen beyond loopback does
 * not start without --mpi-insecure. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/group_proc.h"
#include "helpers/server_proc.h"

static gp_group g_grp;
static sp_server g_one;

static void stop(void) {
  if (g_grp.pid) gp_stop(&g_grp);
  if (g_one.pid) sp_stop(&g_one);
}

TestSuite(group, .fini = stop, .timeout = 120);

static dispatch_group *open_group(const char *timeout) {
  const char *extra[] = {"--mpi-timeout", timeout, NULL};
  cr_assert_eq(gp_start(&g_grp, 2, extra), 0, "mpirun did not start 2 ranks");
  const char *specs[2] = {g_grp.specs[1], g_grp.specs[0]}; /* any order */
  dispatch_group *grp;
  char err[256] = "";
  int rc = dispatch_group_open(specs, 2, NULL, &grp, err, sizeof err);
  cr_assert_eq(rc, 0, "group_open: %d %s", rc, err);
  cr_assert_eq(dispatch_group_size(grp), 2);
  return grp;
}

/* rank r's device dev fails its next wait with code (the message holding
 * needle when not NULL); the error is cleared after */
static void refused_here(dispatch_device *dev, int r, int code,
                         const char *needle) {
  int rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, code, "rank %d: %d %s", r, rc, dispatch_device_errmsg(dev));
  if (needle)
    cr_assert_not_null(strstr(dispatch_device_errmsg(dev), needle),
                       "rank %d: %s", r, dispatch_device_errmsg(dev));
  dispatch_device_clear_error(dev);
}

static void fill(float *v, size_t n, unsigned seed) {
  srand(seed);
  for (size_t i = 0; i < n; i++)
    v[i] = (float)rand() / (float)RAND_MAX * 2.0f - 1.0f + (float)i * 1e-3f;
}

static void check_reduced(int reduce) {
  dispatch_group *grp = open_group("5");
  enum { N0 = 12, N1 = 5 };
  int64_t s0[2] = {3, 4}, s1[1] = {N1};
  float a[2][N0], b[2][N1];
  double c[2][3] = {{0.1, 1e16, -2.5}, {0.2, 1.0, 7.25}};
  dispatch_tensor *t[4], *d[2];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    cr_assert_not_null(dev);
    fill(a[r], N0, 10 + (unsigned)r);
    fill(b[r], N1, 20 + (unsigned)r);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, s0, a[r],
                                           sizeof a[r], &t[r * 2]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s1, b[r],
                                           sizeof b[r], &t[r * 2 + 1]), 0);
    int64_t s2[1] = {3};
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 1, s2, c[r],
                                           sizeof c[r], &d[r]), 0);
  }
  cr_assert_eq(dispatch_group_allreduce(grp, t, 2, reduce), 0);
  cr_assert_eq(dispatch_group_allreduce(grp, d, 1, reduce), 0);
  for (int r = 0; r < 2; r++) {
    float ga[N0], gb[N1], wa[N0], wb[N1];
    double gd[3], wd[3];
    for (int i = 0; i < N0; i++) {
      wa[i] = a[0][i] + a[1][i];
      if (reduce == DISPATCH_REDUCE_MEAN) wa[i] /= 2.0f;
    }
    for (int i = 0; i < N1; i++) {
      wb[i] = b[0][i] + b[1][i];
      if (reduce == DISPATCH_REDUCE_MEAN) wb[i] /= 2.0f;
    }
    for (int i = 0; i < 3; i++) {
      wd[i] = c[0][i] + c[1][i];
      if (reduce == DISPATCH_REDUCE_MEAN) wd[i] /= 2.0;
    }
    cr_assert_eq(dispatch_tensor_read(t[r * 2], ga, sizeof ga), 0,
                 "rank %d: %s", r,
                 dispatch_device_errmsg(dispatch_group_device(grp, r)));
    cr_assert_eq(dispatch_tensor_read(t[r * 2 + 1], gb, sizeof gb), 0);
    cr_assert_eq(dispatch_tensor_read(d[r], gd, sizeof gd), 0);
    cr_assert_eq(memcmp(ga, wa, sizeof ga), 0, "rank %d: tensor 0 differs", r);
    cr_assert_eq(memcmp(gb, wb, sizeof gb), 0, "rank %d: tensor 1 differs", r);
    cr_assert_eq(memcmp(gd, wd, sizeof gd), 0, "rank %d: f64 differs", r);
  }
  dispatch_group_close(grp);
}

Test(group, allreduce_sum_is_the_local_sum_bit_for_bit) {
  check_reduced(DISPATCH_REDUCE_SUM);
}

Test(group, allreduce_mean_is_the_local_sum_halved_bit_for_bit) {
  check_reduced(DISPATCH_REDUCE_MEAN);
}

Test(group, members_with_other_shapes_all_refuse_and_keep_their_tensors) {
  dispatch_group *grp = open_group("5");
  float v[12];
  fill(v, 12, 3);
  int64_t sa[2] = {3, 4}, sb[2] = {4, 3};
  dispatch_tensor *t[2];
  cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, 0),
                                         DISPATCH_F32, 2, sa, v, sizeof v,
                                         &t[0]), 0);
  cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, 1),
                                         DISPATCH_F32, 2, sb, v, sizeof v,
                                         &t[1]), 0);
  cr_assert_eq(dispatch_group_allreduce(grp, t, 1, DISPATCH_REDUCE_SUM), 0);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    refused_here(dev, r, DISPATCH_EGROUP, "disagree");
    float got[12];
    cr_assert_eq(dispatch_tensor_read(t[r], got, sizeof got), 0);
    cr_assert_eq(memcmp(got, v, sizeof v), 0, "rank %d changed", r);
  }
  /* the group goes on: the next all-reduce of equal shapes works */
  dispatch_tensor *u[2];
  for (int r = 0; r < 2; r++)
    cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, r),
                                           DISPATCH_F32, 2, sa, v, sizeof v,
                                           &u[r]), 0);
  cr_assert_eq(dispatch_group_allreduce(grp, u, 1, DISPATCH_REDUCE_SUM), 0);
  float got[12];
  cr_assert_eq(dispatch_tensor_read(u[1], got, sizeof got), 0);
  for (int i = 0; i < 12; i++) cr_assert_eq(got[i], v[i] + v[i]);
  dispatch_group_close(grp);
}

/* dispatch_group_broadcast: rank 1's f32, i64 and f16 tensors land on
 * rank 0 bit for bit and rank 1's stay; a root out of range is refused
 * here; other shapes are refused by both members, which keep theirs. */
Test(group, broadcast_gives_every_member_the_roots_bits) {
  dispatch_group *grp = open_group("5");
  float a[2][12];
  int64_t b[2][5];
  uint16_t h[2][3] = {{0x3c00, 0xc000, 0x7bff}, {0x0001, 0x8400, 0x3555}};
  int64_t sa[2] = {3, 4}, sb[1] = {5}, sh[1] = {3};
  dispatch_tensor *t[6];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    fill(a[r], 12, 30 + (unsigned)r);
    for (int i = 0; i < 5; i++) b[r][i] = (int64_t)(r + 1) * 1000003 * (i - 2);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sa, a[r],
                                           sizeof a[r], &t[r * 3]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_I64, 1, sb, b[r],
                                           sizeof b[r], &t[r * 3 + 1]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F16, 1, sh, h[r],
                                           sizeof h[r], &t[r * 3 + 2]), 0);
  }
  cr_assert_eq(dispatch_group_broadcast(grp, t, 3, 2), DISPATCH_EINVAL);
  cr_assert_eq(dispatch_group_broadcast(grp, t, 3, -1), DISPATCH_EINVAL);
  dispatch_device_clear_error(dispatch_group_device(grp, 0));
  /* only f32 and i64 first (two tensors per member), then the f16 */
  dispatch_tensor *two[4] = {t[0], t[1], t[3], t[4]};
  cr_assert_eq(dispatch_group_broadcast(grp, two, 2, 1), 0);
  dispatch_tensor *halfs[2] = {t[2], t[5]};
  cr_assert_eq(dispatch_group_broadcast(grp, halfs, 1, 1), 0);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    float ga[12];
    int64_t gb[5];
    uint16_t gh[3];
    cr_assert_eq(dispatch_tensor_read(t[r * 3], ga, sizeof ga), 0, "rank %d: %s",
                 r, dispatch_device_errmsg(dev));
    cr_assert_eq(dispatch_tensor_read(t[r * 3 + 1], gb, sizeof gb), 0);
    cr_assert_eq(dispatch_tensor_read(t[r * 3 + 2], gh, sizeof gh), 0);
    cr_assert_eq(memcmp(ga, a[1], sizeof ga), 0, "rank %d: f32 differs", r);
    cr_assert_eq(memcmp(gb, b[1], sizeof gb), 0, "rank %d: i64 differs", r);
    cr_assert_eq(memcmp(gh, h[1], sizeof gh), 0, "rank %d: f16 differs", r);
  }
  /* rank 0 holds [3,4], rank 1 a [4,3]: both refuse, both keep theirs */
  int64_t st[2] = {4, 3};
  dispatch_tensor *u[2];
  cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, 0),
                                         DISPATCH_F32, 2, sa, a[0],
                                         sizeof a[0], &u[0]), 0);
  cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, 1),
                                         DISPATCH_F32, 2, st, a[1],
                                         sizeof a[1], &u[1]), 0);
  cr_assert_eq(dispatch_group_broadcast(grp, u, 1, 0), 0);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    refused_here(dev, r, DISPATCH_EGROUP, "broadcast from rank 0");
    float got[12];
    cr_assert_eq(dispatch_tensor_read(u[r], got, sizeof got), 0);
    cr_assert_eq(memcmp(got, a[r], sizeof got), 0, "rank %d changed", r);
  }
  dispatch_group_close(grp);
}

/* A call the library refuses for one member sends nothing to any: rank 1's
 * tensor is NULL, and rank 0 is left with no request its group waits
 * --mpi-timeout for (it failed with that timeout's EGROUP, and the next
 * all-reduce behind it, when rank 0's part went out first). */
Test(group, a_refused_member_sends_nothing_to_the_others) {
  dispatch_group *grp = open_group("3");
  float v[4] = {1, 2, 3, 4};
  int64_t sh[1] = {4};
  dispatch_tensor *t[2];
  for (int r = 0; r < 2; r++)
    cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, r),
                                           DISPATCH_F32, 1, sh, v, sizeof v,
                                           &t[r]), 0);
  dispatch_tensor *bad[2] = {t[0], NULL};
  cr_assert_eq(dispatch_group_allreduce(grp, bad, 1, DISPATCH_REDUCE_SUM),
               DISPATCH_EINVAL);
  dispatch_device_clear_error(dispatch_group_device(grp, 1));
  cr_assert_eq(dispatch_group_allreduce(grp, t, 1, DISPATCH_REDUCE_SUM), 0);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    int rc = dispatch_device_sync(dev);
    cr_assert_eq(rc, 0, "rank %d: %d %s", r, rc, dispatch_device_errmsg(dev));
    float got[4];
    cr_assert_eq(dispatch_tensor_read(t[r], got, sizeof got), 0);
    for (int i = 0; i < 4; i++) cr_assert_eq(got[i], 2 * v[i], "rank %d", r);
  }
  dispatch_group_close(grp);
}

/* loss_r = sum((x_r @ w)^2) on each member; one grouped SGD step with the
 * mean of the two gradients */
Test(group, a_data_parallel_step_leaves_identical_parameters) {
  dispatch_group *grp = open_group("5");
  float w0[6] = {0.5f, -1.0f, 0.25f, 2.0f, -0.75f, 1.5f};
  float x[2][6];
  fill(x[0], 6, 7);
  fill(x[1], 6, 8);
  int64_t ws[2] = {3, 2}, xs[2] = {2, 3};
  dispatch_tensor *w[2], *xt[2];
  dispatch_grads *gr[2];
  dispatch_optim *opt[2];
  float g[2][6];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    dispatch_tensor *y, *loss, *gt;
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, ws, w0,
                                           sizeof w0, &w[r]), 0);
    cr_assert_eq(dispatch_autodiff(w[r], &w[r]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, x[r],
                                           sizeof x[r], &xt[r]), 0);
    cr_assert_eq(dispatch_matmul(xt[r], w[r], &y), 0);
    cr_assert_eq(dispatch_mul(y, y, &y), 0);
    cr_assert_eq(dispatch_sum(y, 0, NULL, 0, &loss), 0);
    cr_assert_eq(dispatch_backward(loss, &gr[r]), 0);
    cr_assert_eq(dispatch_grad(gr[r], w[r], &gt), 0);
    cr_assert_eq(dispatch_tensor_read(gt, g[r], sizeof g[r]), 0);
    cr_assert_eq(dispatch_sgd_new(&w[r], 1, 0.125, 0.0, 0.0, &opt[r]), 0);
  }
  cr_assert_eq(dispatch_group_step(grp, opt, gr, DISPATCH_REDUCE_MEAN), 0);
  float p[2][6];
  for (int r = 0; r < 2; r++)
    cr_assert_eq(dispatch_tensor_read(w[r], p[r], sizeof p[r]), 0, "rank %d: %s",
                 r, dispatch_device_errmsg(dispatch_group_device(grp, r)));
  cr_assert_eq(memcmp(p[0], p[1], sizeof p[0]), 0, "members differ");
  for (int i = 0; i < 6; i++) {
    float mean = (g[0][i] + g[1][i]) / 2.0f;
    double want = (double)w0[i] - 0.125 * (double)mean;
    cr_assert(fabs((double)p[0][i] - want) <= 1e-6 * (1.0 + fabs(want)),
              "w[%d] = %.9g, want %.9g", i, p[0][i], want);
    /* and not the step of rank 0's gradient alone */
    cr_assert(g[0][i] == g[1][i] ||
              fabs((double)p[0][i] - ((double)w0[i] - 0.125 * g[0][i])) > 0);
  }
  dispatch_group_close(grp);
}

/* t[r]: [1, 2, 3, 4] f32 on rank r */
static void four_each(dispatch_group *grp, dispatch_tensor **t) {
  float v[4] = {1, 2, 3, 4};
  int64_t s[1] = {4};
  for (int r = 0; r < 2; r++)
    cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, r),
                                           DISPATCH_F32, 1, s, v, sizeof v,
                                           &t[r]), 0);
}

/* Open MPI 4.1 ends the job when a rank dies: the survivor gets SIGTERM
 * from mpirun, so its client sees the connection end (or, had the
 * survivor stayed up, DISPATCH_EGROUP after the timeout): an error, not a
 * hang (the suite's timeout would catch one). */
Test(group, a_killed_rank_gives_the_client_an_error) {
  dispatch_group *grp = open_group("2");
  dispatch_tensor *t[2];
  four_each(grp, t);
  cr_assert_eq(dispatch_device_sync(dispatch_group_device(grp, 0)), 0);
  cr_assert_eq(kill(g_grp.rank_pid[1], SIGKILL), 0);
  /* the request to rank 1 may or may not find its socket closed yet */
  dispatch_group_allreduce(grp, t, 1, DISPATCH_REDUCE_SUM);
  dispatch_device *dev0 = dispatch_group_device(grp, 0);
  float got[4];
  int rc = dispatch_tensor_read(t[0], got, sizeof got);
  cr_assert(rc == DISPATCH_ECONN || rc == DISPATCH_EGROUP ||
                rc == DISPATCH_ESHUTDOWN,
            "rank 0 after rank 1 died: %d %s", rc,
            dispatch_device_errmsg(dev0));
  dispatch_group_close(grp);
}

Test(group, a_server_without_mpi_refuses_a_group) {
  cr_assert_eq(sp_start(&g_one, NULL), 0);
  char spec[64], err[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_one.port);
  const char *specs[1] = {spec};
  dispatch_group *grp = (dispatch_group *)1;
  int rc = dispatch_group_open(specs, 1, NULL, &grp, err, sizeof err);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%d %s", rc, err);
  cr_assert_null(grp);
  cr_assert_not_null(strstr(err, "--mpi"), "%s", err);
}

Test(group, a_group_of_the_wrong_size_is_refused) {
  const char *extra[] = {NULL};
  cr_assert_eq(gp_start(&g_grp, 2, extra), 0);
  const char *specs[1] = {g_grp.specs[0]};
  dispatch_group *grp;
  char err[256] = "";
  int rc = dispatch_group_open(specs, 1, NULL, &grp, err, sizeof err);
  cr_assert_eq(rc, DISPATCH_EGROUP, "%d %s", rc, err);
  cr_assert_not_null(strstr(err, "2 ranks"), "%s", err);
}

/* one rank listening on every address: MPI traffic would not stay on
 * this host's loopback, so the rank refuses to start without the flag */
Test(group, ranks_beyond_loopback_need_mpi_insecure) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  cr_assert_not_null(bin);
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "timeout 60 mpirun --allow-run-as-root --oversubscribe --mca btl "
           "self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo "
           "-np 1 %s --mpi --listen 0.0.0.0:0 --insecure 2>&1",
           bin);
  gp_rank_env();
  FILE *f = popen(cmd, "r");
  cr_assert_not_null(f);
  char out[8192];
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  int st = pclose(f);
  cr_assert_neq(st, 0, "the rank started: %s", out);
  cr_assert_not_null(strstr(out, "--mpi-insecure"), "%s", out);
  cr_assert_null(strstr(out, "dispatch-server listening on"), "%s", out);
}

/* examples/train_mlp_dp.c on a 2-rank group: 3 steps, members identical
 * after each and within the derived bound of a local whole-batch run (the
 * program checks both and fails otherwise) */
Test(group, the_data_parallel_example_passes_its_checks) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  cr_assert_not_null(bin);
  const char *extra[] = {NULL};
  cr_assert_eq(gp_start(&g_grp, 2, extra), 0);
  char dir[512], cmd[1400];
  snprintf(dir, sizeof dir, "%s", bin);
  char *slash = strrchr(dir, '/');
  cr_assert_not_null(slash);
  *slash = '\0';
  snprintf(cmd, sizeof cmd,
           "%s/examples/train_mlp_dp --group %s,%s --steps 3 --log-every 1 "
           "2>&1",
           dir, g_grp.specs[0], g_grp.specs[1]);
  FILE *f = popen(cmd, "r");
  cr_assert_not_null(f);
  char out[8192];
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = '\0';
  cr_assert_eq(pclose(f), 0, "%s", out);
  cr_assert_not_null(strstr(out, "step   3: "), "%s", out);
  cr_assert_not_null(strstr(out, "members identical after every step"), "%s",
                     out);
}

/* A member that stalls inside MPI (stopped with SIGSTOP mid-group): the
 * other's client gets DISPATCH_EGROUP after at most 3 x --mpi-timeout,
 * and the group is then broken: the next all-reduce fails at once. */
Test(group, a_stalled_rank_gives_egroup_within_the_timeout) {
  dispatch_group *grp = open_group("1");
  dispatch_tensor *t[2];
  four_each(grp, t);
  cr_assert_eq(dispatch_device_sync(dispatch_group_device(grp, 1)), 0);
  cr_assert_eq(kill(g_grp.rank_pid[1], SIGSTOP), 0);
  cr_assert_eq(dispatch_group_allreduce(grp, t, 1, DISPATCH_REDUCE_SUM), 0);
  dispatch_device *dev0 = dispatch_group_device(grp, 0);
  float got[4];
  int rc = dispatch_tensor_read(t[0], got, sizeof got);
  const char *msg = dispatch_device_errmsg(dev0);
  cr_assert_eq(rc, DISPATCH_EGROUP, "%d %s", rc, msg);
  cr_assert_not_null(strstr(msg, "within"), "%s", msg);
  dispatch_device_clear_error(dev0);
  /* broken now: refused at once, the same way */
  dispatch_tensor *u[2] = {t[0], t[1]};
  kill(g_grp.rank_pid[1], SIGCONT);
  cr_assert_eq(dispatch_group_allreduce(grp, u, 1, DISPATCH_REDUCE_SUM), 0);
  rc = dispatch_device_sync(dev0);
  cr_assert_eq(rc, DISPATCH_EGROUP, "%d %s", rc, dispatch_device_errmsg(dev0));
  cr_assert_not_null(strstr(dispatch_device_errmsg(dev0), "restart"), "%s",
                     dispatch_device_errmsg(dev0));
  dispatch_group_close(grp);
}

/* the host copy an all-reduce makes is charged to the session: tensors
 * that fit --max-session-bytes but not twice are refused (DISPATCH_EQUOTA)
 * and stay as they were */
Test(group, the_all_reduce_copy_counts_against_the_session_quota) {
  const char *extra[] = {"--mpi-timeout", "2", "--max-session-bytes", "1600K",
                         NULL};
  cr_assert_eq(gp_start(&g_grp, 2, extra), 0);
  const char *specs[2] = {g_grp.specs[0], g_grp.specs[1]};
  dispatch_group *grp;
  char err[256] = "";
  cr_assert_eq(dispatch_group_open(specs, 2, NULL, &grp, err, sizeof err), 0,
               "%s", err);
  int64_t n = 1 << 18; /* 1 MiB of f32 */
  float *v = calloc((size_t)n, sizeof *v);
  cr_assert_not_null(v);
  v[7] = 3.0f;
  dispatch_tensor *t[2];
  for (int r = 0; r < 2; r++)
    cr_assert_eq(dispatch_tensor_from_data(dispatch_group_device(grp, r),
                                           DISPATCH_F32, 1, &n, v,
                                           (size_t)n * sizeof *v, &t[r]), 0);
  cr_assert_eq(dispatch_group_allreduce(grp, t, 1, DISPATCH_REDUCE_SUM), 0);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    refused_here(dev, r, DISPATCH_EQUOTA, NULL);
    float got[8];
    float *all = calloc((size_t)n, sizeof *all);
    cr_assert_eq(dispatch_tensor_read(t[r], all, (size_t)n * sizeof *all), 0);
    memcpy(got, all, sizeof got);
    free(all);
    cr_assert_eq(got[7], 3.0f, "rank %d changed", r);
  }
  free(v);
  dispatch_group_close(grp);
}
