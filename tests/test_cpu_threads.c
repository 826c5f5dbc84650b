/* The CPU backend's thread pool (common/cpu/par.c): a transformer block's
 * forward and backward on a LOCAL device, with the pool capped at 1, 2, 3
 * and 4 threads, gives the same bits every time: every kernel the pool
 * runs cuts its work by fixed chunk sizes, never by the thread count.
 * The sizes make each parallel kernel run several chunks: matmul split by
 * rows (256 rows) and by columns (the weight gradients, 64 rows),
 * elementwise and broadcast ops over 64K elements, the permute copies,
 * layer_norm forward and backward (the column sums), 16 attention heads
 * forward and backward, and the bias gradients' blocked sums. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/par.h"
#include "dispatch_client.h"
#include "helpers/client_check.h"

enum { B = 4, T = 64, D = 64, H = 4, F = 256 };
enum { P_W1, P_B1, P_W2, P_LW, P_LB, P_WQ, P_WK, P_WV, P_WO, NP };
static const int64_t g_pshape[NP][2] = {
    {D, F}, {F, 1}, {F, D}, {D, 1}, {D, 1}, {D, D}, {D, D}, {D, D}, {D, D}};
static const int g_pdims[NP] = {2, 1, 2, 1, 1, 2, 2, 2, 2};

/* the loss and every gradient, as bytes */
typedef struct result {
  float loss;
  float gx[B * T * D];
  float gp[NP][D * F];
} result;

static uint64_t g_rng;
static float urand(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

static dispatch_tensor *leaf(dispatch_device *dev, int nd,
                             const int64_t *shape, float scale) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  float *v = malloc((size_t)n * sizeof *v);
  cr_assert_not_null(v);
  for (int64_t i = 0; i < n; i++) v[i] = urand() * scale;
  dispatch_tensor *t, *a;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, nd, shape, v,
                                    (size_t)n * sizeof *v, &t));
  free(v);
  OK(dev, dispatch_autodiff(t, &a));
  dispatch_tensor_free(t);
  return a;
}

/* [B*T, D] @ w -> [B, H, T, D/H] */
static dispatch_tensor *heads(dispatch_tensor *h, dispatch_tensor *w) {
  const int64_t split[4] = {B, T, H, D / H}, perm[4] = {0, 2, 1, 3};
  dispatch_tensor *y;
  dispatch_matmul(h, w, &y);
  dispatch_reshape(y, 4, split, &y);
  dispatch_permute(y, 4, perm, &y);
  return y;
}

/* One forward and backward with the pool capped at `threads`. */
static void run(int threads, result *r) {
  dispatch_device *dev;
  char err[256];
  dsp__par_set_threads(threads);
  cr_assert_eq(dispatch_device_open("local", NULL, &dev, err, sizeof err), 0,
               "%s", err);
  g_rng = 0x2545F4914F6CDD1Dull;
  const int64_t xs[2] = {B * T, D};
  dispatch_tensor *x = leaf(dev, 2, xs, 1.0f), *p[NP];
  for (int i = 0; i < NP; i++)
    p[i] = leaf(dev, g_pdims[i], g_pshape[i], 0.2f);
  dispatch_grads *grads = NULL;
  dispatch_tensor *h, *a, *y, *loss, *g;
  const int64_t merge[2] = {B * T, D}, perm[4] = {0, 2, 1, 3};
  OK(dev, dispatch_scope_begin(dev));
  dispatch_layer_norm(x, 1, p[P_LW], p[P_LB], 1e-5, &h);
  dispatch_attention(heads(h, p[P_WQ]), heads(h, p[P_WK]), heads(h, p[P_WV]),
                     NULL, 1, 0.0, &a);
  dispatch_permute(a, 4, perm, &a);
  dispatch_reshape(a, 2, merge, &a);
  dispatch_matmul(a, p[P_WO], &a);
  dispatch_add(x, a, &y);
  dispatch_matmul(y, p[P_W1], &h);
  dispatch_add(h, p[P_B1], &h); /* broadcast: the bias gradient is a sum */
  dispatch_gelu(h, &h);
  dispatch_matmul(h, p[P_W2], &h);
  dispatch_add(y, h, &y);
  dispatch_mul(y, y, &y);
  dispatch_sum(y, 0, NULL, 0, &loss);
  OK(dev, dispatch_backward(loss, &grads));
  OK(dev, dispatch_tensor_read(loss, &r->loss, sizeof r->loss));
  OK(dev, dispatch_grad(grads, x, &g));
  OK(dev, dispatch_tensor_read(g, r->gx, sizeof r->gx));
  for (int i = 0; i < NP; i++) {
    size_t n = (size_t)g_pshape[i][0] * (size_t)g_pshape[i][1];
    OK(dev, dispatch_grad(grads, p[i], &g));
    OK(dev, dispatch_tensor_read(g, r->gp[i], n * sizeof(float)));
  }
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  for (int i = 0; i < NP; i++) dispatch_tensor_free(p[i]);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  dsp__par_set_threads(0);
}

/* Four threads whatever this machine has (the pool reads it at its
 * start, which is in this test's process). */
static void four_threads(void) { setenv("DISPATCH_CPU_THREADS", "4", 1); }
TestSuite(cpu_threads, .init = four_threads);

Test(cpu_threads, a_training_step_gives_the_same_bits_on_1_to_4_threads) {
  cr_assert_eq(dsp__par_lanes(100), 4, "the pool did not start 4 threads");
  static result one, many;
  memset(&one, 0, sizeof one);
  run(1, &one);
  cr_assert(one.loss > 0.0f, "the loss should be a positive sum of squares");
  for (int t = 2; t <= 4; t++) {
    memset(&many, 0xA5, sizeof many); /* not zeros: every byte is read */
    run(t, &many);
    cr_assert_eq(memcmp(&one.loss, &many.loss, sizeof one.loss), 0,
                 "loss with %d threads: %.9g, with 1: %.9g", t,
                 (double)many.loss, (double)one.loss);
    cr_assert_eq(memcmp(one.gx, many.gx, sizeof one.gx), 0,
                 "dx with %d threads differs from 1 thread", t);
    for (int i = 0; i < NP; i++) {
      size_t n = (size_t)g_pshape[i][0] * (size_t)g_pshape[i][1];
      cr_assert_eq(memcmp(one.gp[i], many.gp[i], n * sizeof(float)), 0,
                   "gradient %d with %d threads differs from 1 thread", i,
                   t);
    }
  }
}

/* The cap limits the lanes of the jobs that follow; 0 lifts it. */
Test(cpu_threads, the_cap_limits_lanes_and_lifts) {
  cr_assert_eq(dsp__par_lanes(100), 4);
  cr_assert_eq(dsp__par_lanes(3), 3, "no more lanes than chunks");
  dsp__par_set_threads(2);
  cr_assert_eq(dsp__par_lanes(100), 2);
  dsp__par_set_threads(0);
  cr_assert_eq(dsp__par_lanes(100), 4);
}
