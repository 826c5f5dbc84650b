/* bench matmul: f32 n x n by n x n for n = 512, 1024, 2048 in GFLOP/s
 * (2 n^3 flops per product), on the LOCAL kind, on the REMOTE kind, and
 * with OpenBLAS called directly (cblas_sgemm), in the same run.
 *
 * REMOTE: the inputs are already on the server; one sample is the matmul
 * request plus a sync (the wait that tells the product was computed),
 * without moving the n x n result. LOCAL: the call itself (it computes
 * before returning). Variants interleave per repetition; each figure is
 * the median, with a pause between variants (GAP_US). Goal: REMOTE
 * within 1.1x of OpenBLAS for n >= 1024.
 */
#include <cblas.h>

#include "bench.h"

#define MAX_REPS 11
/* OpenBLAS worker threads spin (sched_yield) for a while after a call
 * returns; on 2 cores the spinning threads of the process that ran the
 * last product would steal time from the next variant (the server's or
 * ours). A pause between variants lets them park, as they would in a
 * program that only uses the REMOTE kind. */
#define GAP_US 150000

static float *rand_matrix(int n, unsigned seed) {
  float *m = malloc((size_t)n * (size_t)n * sizeof *m);
  if (!m) {
    fprintf(stderr, "matmul: out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < (size_t)n * (size_t)n; i++) {
    seed = seed * 1103515245u + 12345u;
    m[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
  }
  return m;
}

/* Uploads a and b to dev; returns 0 or an error code. */
static int put_pair(dispatch_device *dev, int n, const float *a,
                    const float *b, dispatch_tensor **ta,
                    dispatch_tensor **tb) {
  int64_t shape[2] = {n, n};
  size_t nb = (size_t)n * (size_t)n * sizeof(float);
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, a, nb, ta);
  if (rc == 0)
    rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, b, nb, tb);
  if (rc == 0) rc = dispatch_device_sync(dev);
  return rc;
}

/* One product on dev, waited for; returns seconds or NAN (err set). */
static double one_product(dispatch_device *dev, dispatch_tensor *a,
                          dispatch_tensor *b, char *err, size_t errlen) {
  dispatch_tensor *c = NULL;
  double t0 = bench_now();
  int rc = dispatch_matmul(a, b, &c);
  if (rc == 0) rc = dispatch_device_sync(dev);
  double t = bench_now() - t0;
  dispatch_tensor_free(c);
  if (rc < 0) {
    snprintf(err, errlen, "matmul on %s: %s: %s", dispatch_device_spec(dev),
             dispatch_err_name(rc), dispatch_device_errmsg(dev));
    return NAN;
  }
  return t;
}

int main(void) {
  static const int NS[] = {512, 1024, 2048};
  static const double BUDGET[] = {3.0, 6.0, 15.0};
  char rwhy[512] = "", lwhy[512] = "";
  dispatch_device *local = bench_open("local", lwhy, sizeof lwhy);
  dispatch_device *remote = bench_open(bench_remote_spec(), rwhy, sizeof rwhy);
  if (!local) {
    fprintf(stderr, "matmul: %s\n", lwhy);
    return 1;
  }
  for (int k = 0; k < 3; k++) {
    int n = NS[k];
    float *a = rand_matrix(n, 1u + (unsigned)k), *b = rand_matrix(n, 7u);
    float *c = rand_matrix(n, 3u), *check = rand_matrix(n, 4u);
    dispatch_tensor *la = NULL, *lb = NULL, *ra = NULL, *rb = NULL;
    char rerr[512] = "", lerr[512] = "";
    int rc = put_pair(local, n, a, b, &la, &lb);
    if (rc < 0)
      snprintf(lerr, sizeof lerr, "local upload: %s", dispatch_err_name(rc));
    if (remote) {
      rc = put_pair(remote, n, a, b, &ra, &rb);
      if (rc < 0)
        snprintf(rerr, sizeof rerr, "remote upload: %s: %s",
                 dispatch_err_name(rc), dispatch_device_errmsg(remote));
    } else {
      snprintf(rerr, sizeof rerr, "%s", rwhy);
    }

    /* the remote product must be the real one: compare a corner once */
    if (!rerr[0]) {
      dispatch_tensor *rc_t = NULL;
      size_t nb = (size_t)n * (size_t)n * sizeof(float);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a,
                  n, b, n, 0.0f, c, n);
      rc = dispatch_matmul(ra, rb, &rc_t);
      if (rc == 0) rc = dispatch_tensor_read(rc_t, check, nb);
      dispatch_tensor_free(rc_t);
      if (rc < 0)
        snprintf(rerr, sizeof rerr, "remote matmul: %s: %s",
                 dispatch_err_name(rc), dispatch_device_errmsg(remote));
      else if (fabsf(check[0] - c[0]) > 1e-3f * (1 + fabsf(c[0])) ||
               fabsf(check[(size_t)n * n - 1] - c[(size_t)n * n - 1]) >
                   1e-3f * (1 + fabsf(c[(size_t)n * n - 1])))
        snprintf(rerr, sizeof rerr, "remote matmul result differs from sgemm");
    }

    double tb[MAX_REPS], tl[MAX_REPS], tr[MAX_REPS];
    int reps = 0;
    double start = bench_now();
    for (int r = -1; r < MAX_REPS; r++) {
      if (r >= 3 && bench_now() - start > BUDGET[k]) break;
      usleep(GAP_US);
      double t0 = bench_now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a,
                  n, b, n, 0.0f, c, n);
      double t_blas = bench_now() - t0;
      usleep(GAP_US);
      double t_loc = lerr[0] ? NAN
                             : one_product(local, la, lb, lerr, sizeof lerr);
      usleep(GAP_US);
      double t_rem = rerr[0] ? NAN
                             : one_product(remote, ra, rb, rerr, sizeof rerr);
      if (r < 0) continue; /* warm-up: threads, caches, first faults */
      tb[reps] = t_blas;
      tl[reps] = t_loc;
      tr[reps] = t_rem;
      reps++;
    }
    double flops = 2.0 * n * (double)n * n;
    double g_blas = flops / bench_median(tb, reps) / 1e9;
    double g_loc = lerr[0] ? NAN : flops / bench_median(tl, reps) / 1e9;
    double g_rem = rerr[0] ? NAN : flops / bench_median(tr, reps) / 1e9;
    char m[64];
    snprintf(m, sizeof m, "matmul %d local", n);
    bench_row("matmul", m, g_loc, "GFLOP/s", "cblas_sgemm", g_blas,
              BENCH_GOAL_NONE, 0, lerr[0] ? lerr : NULL);
    snprintf(m, sizeof m, "matmul %d remote (op+sync)", n);
    /* within 1.1x in time = at least 1/1.1 of the rate */
    bench_row("matmul", m, g_rem, "GFLOP/s", "cblas_sgemm", g_blas,
              n >= 1024 ? BENCH_GOAL_RATIO_GE : BENCH_GOAL_NONE, 1 / 1.1,
              rerr[0] ? rerr : NULL);
    if (rerr[0]) fprintf(stderr, "matmul: %s\n", rerr);
    dispatch_tensor_free(la);
    dispatch_tensor_free(lb);
    dispatch_tensor_free(ra);
    dispatch_tensor_free(rb);
    free(a);
    free(b);
    free(c);
    free(check);
  }
  dispatch_device_close(remote);
  dispatch_device_close(local);
  return 0;
}
