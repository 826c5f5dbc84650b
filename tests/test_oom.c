/* Out of memory on every allocation of a training step: a 2-layer MLP
 * forward (matmul, add, relu, cross_entropy), backward, grads_get and an
 * sgd_step per parameter. Failing allocation N, for every N the step
 * makes, must come back as DISPATCH_ENOMEM and leave nothing allocated. */
#include <criterion/criterion.h>

#include "dsp.h"
#include "helpers/failalloc.h"

#define NP 4

static int from(dsp_ctx *ctx, dsp_dtype dt, int ndim, const int64_t *shape,
                const void *data, dsp_tensor **out) {
  dsp_meta m = {dt, ndim, {0}};
  size_t n = dsp_dtype_size(dt);
  for (int i = 0; i < ndim; i++) {
    m.shape[i] = shape[i];
    n *= (size_t)shape[i];
  }
  return dsp_tensor_from_data(ctx, &m, data, n, out);
}

static int op2(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *a, dsp_tensor *b,
               dsp_tensor **out) {
  dsp_tensor *in[2] = {a, b};
  return dsp_op(ctx, op, in, b ? 2 : 1, NULL, out);
}

/* One whole training step from an empty heap back to an empty heap;
 * returns the first error. */
static int train_step(void) {
  static const float x[16] = {0.1f, 0.2f, -0.3f, 0.4f, 0.5f, -0.6f, 0.7f, 0.8f,
                              -0.9f, 1.0f, 0.2f, -0.1f, 0.3f, 0.3f, -0.5f, 0.6f};
  static const int64_t y[8] = {0, 1, 2, 1, 0, 2, 1, 0};
  static const float w1[12] = {0.5f, -0.4f, 0.3f, 0.2f, -0.1f, 0.6f,
                               -0.2f, 0.1f, 0.4f, -0.5f, 0.3f, 0.2f};
  static const float b1[6] = {0.1f, -0.1f, 0.05f, 0, 0.2f, -0.05f};
  static const float w2[18] = {0.3f, -0.2f, 0.1f, 0.4f, 0.2f, -0.3f,
                               -0.1f, 0.5f, 0.2f, 0.3f, -0.4f, 0.1f,
                               0.2f, 0.1f, -0.2f, -0.3f, 0.2f, 0.4f};
  static const float b2[3] = {0, 0.1f, -0.1f};
  const void *pdata[NP] = {w1, b1, w2, b2};
  static const int64_t pshape[NP][2] = {{2, 6}, {6, 0}, {6, 3}, {3, 0}};
  static const int pnd[NP] = {2, 1, 2, 1};

  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  if (!ctx) return DISPATCH_ENOMEM;
  dsp_tensor *X = NULL, *Y = NULL, *P[NP] = {0}, *V[NP] = {0}, *t[6] = {0};
  dsp_grads *g = NULL;
  int rc;
#define TRY(e) \
  if ((rc = (e)) < 0) goto out
  TRY(from(ctx, DSP_F32, 2, (int64_t[]){8, 2}, x, &X));
  TRY(from(ctx, DSP_I64, 1, (int64_t[]){8}, y, &Y));
  for (int i = 0; i < NP; i++) {
    TRY(from(ctx, DSP_F32, pnd[i], pshape[i], pdata[i], &P[i]));
    TRY(dsp_tensor_new(ctx, &P[i]->meta, &V[i]));
    TRY(dsp_track(ctx, P[i]));
  }
  TRY(op2(ctx, DSP_OP_MATMUL, X, P[0], &t[0]));
  TRY(op2(ctx, DSP_OP_ADD, t[0], P[1], &t[1]));
  TRY(op2(ctx, DSP_OP_RELU, t[1], NULL, &t[2]));
  TRY(op2(ctx, DSP_OP_MATMUL, t[2], P[2], &t[3]));
  TRY(op2(ctx, DSP_OP_ADD, t[3], P[3], &t[4]));
  TRY(op2(ctx, DSP_OP_CROSS_ENTROPY, t[4], Y, &t[5]));
  TRY(dsp_backward(ctx, t[5], 0, &g));
  for (int i = 0; i < NP; i++) {
    dsp_tensor *gi, *upd;
    TRY(dsp_grads_get(ctx, g, P[i], &gi));
    dsp_attrs a = dsp_attrs_none();
    a.floats[0] = 0.1; /* lr, momentum, weight decay */
    a.floats[1] = 0.9;
    a.floats[2] = 1e-4;
    a.n_floats = 3;
    dsp_tensor *in[3] = {P[i], gi, V[i]};
    rc = dsp_op(ctx, DSP_OP_SGD_STEP, in, 3, &a, &upd);
    dsp_tensor_unref(gi);
    dsp_tensor_unref(upd);
    if (rc < 0) goto out;
  }
#undef TRY
out:
  dsp_grads_free(g);
  for (int i = 0; i < 6; i++) dsp_tensor_unref(t[i]);
  for (int i = 0; i < NP; i++) {
    dsp_tensor_unref(P[i]);
    dsp_tensor_unref(V[i]);
  }
  dsp_tensor_unref(X);
  dsp_tensor_unref(Y);
  dsp_ctx_free(ctx);
  return rc;
}

Test(oom, every_allocation_of_a_training_step_fails_cleanly) {
  failalloc_install(0);
  int rc = train_step();
  long total = failalloc_count();
  long live = failalloc_live();
  failalloc_remove();
  cr_assert_eq(rc, 0, "unfailed step: %s", dispatch_err_name(rc));
  cr_assert_eq(live, 0, "unfailed step leaked %ld blocks", live);
  cr_assert_gt(total, 30, "a training step makes only %ld allocations?", total);
  for (long n = 1; n <= total + 1; n++) {
    failalloc_install(n);
    rc = train_step();
    long failed = failalloc_failed();
    live = failalloc_live();
    failalloc_remove();
    if (n <= total) {
      cr_assert_eq(failed, 1);
      cr_assert_eq(rc, DISPATCH_ENOMEM, "failing allocation %ld of %ld gave %s",
                   n, total, dispatch_err_name(rc));
    } else {
      cr_assert_eq(failed, 0);
      cr_assert_eq(rc, 0, "allocation %ld is past the step's %ld", n, total);
    }
    cr_assert_eq(live, 0, "failing allocation %ld of %ld leaked %ld blocks", n,
                 total, live);
  }
}

Test(oom, backward_failure_keeps_the_graph_usable) {
  /* a backward that runs out of memory releases nothing: the same graph
   * can be walked again once memory is back, and gives the right grads */
  failalloc_install(0);
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  float v[3] = {1, 2, 3};
  dsp_tensor *x, *y, *s;
  cr_assert_eq(from(ctx, DSP_F32, 1, (int64_t[]){3}, v, &x), 0);
  cr_assert_eq(dsp_track(ctx, x), 0);
  cr_assert_eq(op2(ctx, DSP_OP_MUL, x, x, &y), 0);
  cr_assert_eq(op2(ctx, DSP_OP_SUM, y, NULL, &s), 0);
  long before = failalloc_count();
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 1, &g), 0);
  dsp_grads_free(g);
  long per_pass = failalloc_count() - before;
  failalloc_remove();
  for (long k = 1; k <= per_pass; k++) {
    failalloc_install(k);
    cr_assert_eq(dsp_backward(ctx, s, 0, &g), DISPATCH_ENOMEM);
    cr_assert_null(g);
    failalloc_remove();
  }
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *gx;
  cr_assert_eq(dsp_grads_get(ctx, g, x, &gx), 0);
  const float *d = dsp_tensor_data(gx);
  cr_assert(d[0] == 2 && d[1] == 4 && d[2] == 6);
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
  dsp_ctx_free(ctx);
}
