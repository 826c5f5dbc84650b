/* End to end: a 2-32-3 tanh MLP trained with autodiff and the sgd_step op
 * on three interleaved spiral arms in the plane (fixed seed: noise from
 * common/rng) must drive the cross-entropy under a fixed threshold and
 * classify the training points. A linear model cannot separate spirals,
 * so this needs the gradients of both layers to be right.
 *
 * Threshold: loss < 0.1 after 400 full-batch steps (lr 0.1, momentum 0.9),
 * from about 1.5 at the start; observed about 0.02. */
#include <criterion/criterion.h>
#include <math.h>

#include "dsp.h"
#include "helpers/tensor_util.h"
#include "rng.h"

#define NPC 40 /* points per class */
#define NC 3
#define N (NPC * NC)
#define H 32
#define STEPS 400
#define LOSS_MAX 0.1

static dsp_ctx *ctx;

static dsp_tensor *op(dsp_opcode o, const dsp_attrs *a, dsp_tensor *x,
                      dsp_tensor *y) {
  return tu_run(ctx, o, a, y ? 2 : 1, x, y, NULL);
}

static dsp_tensor *normal_param(int ndim, const int64_t *shape, double std,
                                uint64_t seed) {
  dsp_attrs a = dsp_attrs_none();
  a.ints[0] = DSP_F32;
  a.ints[1] = (int64_t)seed;
  for (int i = 0; i < ndim; i++) a.ints[2 + i] = shape[i];
  a.n_ints = 2 + ndim;
  a.floats[0] = 0;
  a.floats[1] = std;
  a.n_floats = 2;
  dsp_tensor *t = tu_run(ctx, DSP_OP_NORMAL, &a, 0, NULL, NULL, NULL);
  cr_assert_eq(dsp_track(ctx, t), 0);
  return t;
}

Test(mlp, spirals_train_below_threshold) {
  ctx = dsp_ctx_new(dsp_cpu_backend());
  float xs[N * 2];
  int64_t ys[N];
  for (int c = 0; c < NC; c++)
    for (int i = 0; i < NPC; i++) {
      /* arm c of the spiral: radius r, angle 4r plus the arm's offset */
      int k = c * NPC + i;
      double r = 0.1 + 0.9 * i / (NPC - 1);
      double ang = 4 * r + c * 2 * M_PI / NC +
                   0.15 * dsp_rng_normal(7, (uint64_t)k);
      xs[2 * k] = (float)(r * cos(ang));
      xs[2 * k + 1] = (float)(r * sin(ang));
      ys[k] = c;
    }
  dsp_tensor *X = tu_f32(ctx, 2, (int64_t[]){N, 2}, xs);
  dsp_tensor *Y = tu_i64(ctx, 1, (int64_t[]){N}, ys);
  dsp_tensor *P[4] = {
      normal_param(2, (int64_t[]){2, H}, 2.0, 11),
      normal_param(1, (int64_t[]){H}, 0.1, 12),
      normal_param(2, (int64_t[]){H, NC}, 0.25, 13),
      normal_param(1, (int64_t[]){NC}, 0.1, 14),
  };
  dsp_tensor *V[4];
  for (int i = 0; i < 4; i++) cr_assert_eq(dsp_tensor_new(ctx, &P[i]->meta, &V[i]), 0);
  dsp_attrs sgd = dsp_attrs_none();
  sgd.floats[0] = 0.1;
  sgd.floats[1] = 0.9;
  sgd.n_floats = 3;
  double first = 0, last = 0;
  dsp_tensor *logits = NULL;
  for (int step = 0; step < STEPS; step++) {
    dsp_tensor *h0 = op(DSP_OP_MATMUL, NULL, X, P[0]);
    dsp_tensor *h1 = op(DSP_OP_ADD, NULL, h0, P[1]);
    dsp_tensor *h2 = op(DSP_OP_TANH, NULL, h1, NULL);
    dsp_tensor *o0 = op(DSP_OP_MATMUL, NULL, h2, P[2]);
    dsp_tensor_unref(logits);
    logits = op(DSP_OP_ADD, NULL, o0, P[3]);
    dsp_tensor *loss = op(DSP_OP_CROSS_ENTROPY, NULL, logits, Y);
    last = ((float *)dsp_tensor_data(loss))[0];
    if (step == 0) first = last;
    dsp_grads *g;
    cr_assert_eq(dsp_backward(ctx, loss, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
    cr_assert_eq(dsp_grads_count(g), 4);
    for (int i = 0; i < 4; i++) {
      dsp_tensor *gi, *in[3];
      cr_assert_eq(dsp_grads_get(ctx, g, P[i], &gi), 0);
      in[0] = P[i], in[1] = gi, in[2] = V[i];
      dsp_tensor *upd = tu_run(ctx, DSP_OP_SGD_STEP, &sgd, 3, in[0], in[1],
                               in[2]);
      cr_assert_eq(upd, P[i]); /* in place */
      dsp_tensor_unref(upd);
      dsp_tensor_unref(gi);
    }
    dsp_grads_free(g);
    dsp_tensor *list[] = {h0, h1, h2, o0, loss};
    for (int i = 0; i < 5; i++) dsp_tensor_unref(list[i]);
  }
  cr_assert(first > 0.5, "initial loss %g is suspiciously low", first);
  cr_assert(last < LOSS_MAX, "loss %g after %d steps (started at %g), want < %g",
            last, STEPS, first, LOSS_MAX);
  /* the logits of the last forward (before its update) classify the data */
  int64_t dim = 1;
  dsp_attrs am = dsp_attrs_ints(1, &dim);
  dsp_tensor *pred = op(DSP_OP_ARGMAX, &am, logits, NULL);
  const int64_t *pd = dsp_tensor_data(pred);
  int right = 0;
  for (int k = 0; k < N; k++) right += pd[k] == ys[k];
  cr_assert(right >= N * 95 / 100, "only %d of %d points classified right",
            right, N);
  dsp_tensor_unref(pred);
  dsp_tensor_unref(logits);
  for (int i = 0; i < 4; i++) {
    dsp_tensor_unref(P[i]);
    dsp_tensor_unref(V[i]);
  }
  dsp_tensor_unref(X);
  dsp_tensor_unref(Y);
  dsp_ctx_free(ctx);
}
