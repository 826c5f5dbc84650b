/* issue 23 nn ops: embedding, layer_norm, rms_norm and their backward ops
 * with hand-computed values, the packed layout of the fused backward,
 * f32 rows with a large common offset (the two-pass variance), and the
 * validation errors with their codes and messages. Gradients against
 * finite differences: test_gradcheck; LOCAL against REMOTE:
 * test_backend_ops. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(norm, .init = setup, .fini = teardown);

#define SH(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), \
                (int64_t[]){__VA_ARGS__}

/* zeros for tensors whose values do not matter */
static const double Z[16];
static const float ZF[16];
static const int64_t ZI[16];

static dsp_attrs ints(int n, const int64_t *v) { return dsp_attrs_ints(n, v); }

/* layer_norm / rms_norm attrs: ints {nlast, has_w[, has_b]}, floats {eps} */
static dsp_attrs norm_attrs(int ln, int64_t nlast, int hw, int hb, double eps) {
  int64_t v[3] = {nlast, hw, hb};
  dsp_attrs a = dsp_attrs_ints(ln ? 3 : 2, v);
  a.floats[0] = eps;
  a.n_floats = 1;
  return a;
}

/* ------------------------------------------------------------ embedding */

static const double W42[8] = {0, 1, 10, 11, 20, 21, 30, 31};

Test(norm, embedding_gathers_rows_into_idx_shape) {
  dsp_tensor *w = tu_f64(ctx, SH(4, 2), W42);
  dsp_tensor *ix = tu_i64(ctx, SH(2, 2), (int64_t[]){3, 0, 3, 1});
  int64_t none = INT64_MIN;
  dsp_attrs a = ints(1, &none);
  dsp_tensor *o = tu_run(ctx, DSP_OP_EMBEDDING, &a, 2, w, ix, NULL);
  tu_assert_shape(o, SH(2, 2, 2));
  tu_assert_f64(o, (double[]){30, 31, 0, 1, 30, 31, 10, 11}, 8, 0);
  dsp_tensor_unref(o);
  /* the padding row is looked up as any other */
  int64_t p = 3;
  a = ints(1, &p);
  o = tu_run(ctx, DSP_OP_EMBEDDING, &a, 2, w, ix, NULL);
  tu_assert_f64(o, (double[]){30, 31, 0, 1, 30, 31, 10, 11}, 8, 0);
  dsp_tensor_unref(o);
  /* a scalar index gives one row [D]; f32 tables */
  dsp_tensor *s = tu_i64(ctx, 0, NULL, (int64_t[]){2});
  dsp_tensor *wf = tu_f32(ctx, SH(4, 2), (float[]){0, 1, 10, 11, 20, 21, 30, 31});
  a = ints(1, &none);
  o = tu_run(ctx, DSP_OP_EMBEDDING, &a, 2, wf, s, NULL);
  tu_assert_shape(o, SH(2));
  tu_assert_f32(o, (float[]){20, 21}, 2, 0);
  dsp_tensor_unref(o);
  /* no indices: an empty result */
  dsp_tensor *e = tu_i64(ctx, SH(0), ZI);
  o = tu_run(ctx, DSP_OP_EMBEDDING, &a, 2, w, e, NULL);
  tu_assert_shape(o, SH(0, 2));
  dsp_tensor_unref(o);
  dsp_tensor_unref(e), dsp_tensor_unref(s), dsp_tensor_unref(wf);
  dsp_tensor_unref(ix), dsp_tensor_unref(w);
}

Test(norm, embedding_backward_accumulates_repeats_and_skips_padding) {
  dsp_tensor *g = tu_f64(ctx, SH(2, 2, 2), (double[]){1, 2, 3, 4, 5, 6, 7, 8});
  dsp_tensor *ix = tu_i64(ctx, SH(2, 2), (int64_t[]){3, 0, 3, 1});
  int64_t v[2] = {4, INT64_MIN};
  dsp_attrs a = ints(2, v);
  dsp_tensor *o = tu_run(ctx, DSP_OP_EMBEDDING_BACKWARD, &a, 2, g, ix, NULL);
  tu_assert_shape(o, SH(4, 2));
  tu_assert_f64(o, (double[]){3, 4, 7, 8, 0, 0, 6, 8}, 8, 0);
  dsp_tensor_unref(o);
  v[1] = -1; /* row 3, counted from the end */
  a = ints(2, v);
  o = tu_run(ctx, DSP_OP_EMBEDDING_BACKWARD, &a, 2, g, ix, NULL);
  tu_assert_f64(o, (double[]){3, 4, 7, 8, 0, 0, 0, 0}, 8, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(ix), dsp_tensor_unref(g);
}

Test(norm, embedding_gradient_through_autodiff_leaves_padding_row_zero) {
  dsp_tensor *w = tu_f64(ctx, SH(4, 2), W42);
  dsp_tensor *ix = tu_i64(ctx, SH(5), (int64_t[]){0, 2, 0, 0, 1});
  cr_assert_eq(dsp_track(ctx, w), 0);
  int64_t p = 0;
  dsp_attrs a = ints(1, &p);
  dsp_tensor *o = tu_run(ctx, DSP_OP_EMBEDDING, &a, 2, w, ix, NULL);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, o, NULL, NULL);
  dsp_grads *gr = NULL;
  cr_assert_eq(dsp_backward(ctx, l, 0, &gr), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *gw = NULL;
  cr_assert_eq(dsp_grads_get(ctx, gr, w, &gw), 0);
  tu_assert_f64(gw, (double[]){0, 0, 1, 1, 1, 1, 0, 0}, 8, 0);
  dsp_tensor_unref(gw);
  dsp_grads_free(gr);
  dsp_tensor_unref(l), dsp_tensor_unref(o), dsp_tensor_unref(ix);
  dsp_tensor_unref(w);
}

Test(norm, embedding_errors) {
  dsp_tensor *w = tu_f64(ctx, SH(4, 2), W42);
  int64_t none = INT64_MIN;
  dsp_attrs a = ints(1, &none);
  dsp_tensor *bad = tu_i64(ctx, SH(3), (int64_t[]){0, 4, 1});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w, bad, NULL, DISPATCH_EINDEX,
              "embedding: index 4 (position 1) out of range for dim 0 of "
              "size 4");
  dsp_tensor *neg = tu_i64(ctx, SH(1), (int64_t[]){-1});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w, neg, NULL, DISPATCH_EINDEX,
              "index -1 (position 0)");
  /* checked even when the rows are empty (D = 0) */
  dsp_tensor *w0 = tu_f64(ctx, SH(4, 0), Z);
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w0, bad, NULL, DISPATCH_EINDEX,
              "index 4");
  int64_t v2[2] = {4, INT64_MIN};
  dsp_attrs a2 = ints(2, v2);
  dsp_tensor *g = tu_f64(ctx, SH(3, 2), Z);
  tu_run_fail(ctx, DSP_OP_EMBEDDING_BACKWARD, &a2, 2, g, bad, NULL,
              DISPATCH_EINDEX, "embedding_backward: index 4");
  dsp_tensor *fi = tu_f64(ctx, SH(2), (double[]){0, 1});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w, fi, NULL, DISPATCH_EDTYPE,
              "embedding: indices must be i64, got f64");
  dsp_tensor *ok = tu_i64(ctx, SH(2), (int64_t[]){0, 1});
  dsp_tensor *wi = tu_i64(ctx, SH(2, 2), (int64_t[]){0, 1, 2, 3});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, wi, ok, NULL, DISPATCH_EDTYPE,
              "embedding: weight must be f32 or f64, got i64");
  dsp_tensor *w1 = tu_f64(ctx, SH(4), (double[]){0, 1, 2, 3});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w1, ok, NULL, DISPATCH_ESHAPE,
              "embedding: weight must be 2-D [V, D], got [4]");
  int64_t p = 4;
  dsp_attrs ap = ints(1, &p);
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &ap, 2, w, ok, NULL, DISPATCH_EINVAL,
              "embedding: padding_idx 4 outside [-4, 4) for 4 rows");
  p = -5;
  ap = ints(1, &p);
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &ap, 2, w, ok, NULL, DISPATCH_EINVAL,
              "padding_idx -5");
  tu_run_fail(ctx, DSP_OP_EMBEDDING, NULL, 2, w, ok, NULL, DISPATCH_EINVAL,
              "embedding");
  /* grad must be idx.shape + [D] */
  dsp_tensor *g2 = tu_f64(ctx, SH(3, 2), Z);
  tu_run_fail(ctx, DSP_OP_EMBEDDING_BACKWARD, &a2, 2, g2, ok, NULL,
              DISPATCH_ESHAPE, "embedding_backward: grad [3, 2] is not indices");
  dsp_tensor *deep = tu_i64(ctx, SH(1, 1, 1, 1, 1, 1, 1, 1),
                            (int64_t[]){0});
  tu_run_fail(ctx, DSP_OP_EMBEDDING, &a, 2, w, deep, NULL, DISPATCH_ESHAPE,
              "rank 8 give a result of rank 9");
  dsp_tensor_unref(deep), dsp_tensor_unref(g2), dsp_tensor_unref(w1);
  dsp_tensor_unref(wi), dsp_tensor_unref(ok), dsp_tensor_unref(fi);
  dsp_tensor_unref(g), dsp_tensor_unref(w0), dsp_tensor_unref(neg);
  dsp_tensor_unref(bad), dsp_tensor_unref(w);
}

/* ------------------------------------------------------------ layer_norm */

Test(norm, layer_norm_hand_values_with_affine) {
  /* row 0: mean 2, biased var 2/3; row 1: constant, var 0 -> 0 */
  dsp_tensor *x = tu_f64(ctx, SH(2, 3), (double[]){1, 2, 3, 4, 4, 4});
  dsp_tensor *w = tu_f64(ctx, SH(3), (double[]){1, 2, 3});
  dsp_tensor *b = tu_f64(ctx, SH(3), (double[]){0.5, 0, -0.5});
  const double eps = 1e-5, r = 1 / sqrt(2.0 / 3.0 + eps);
  dsp_attrs a = norm_attrs(1, 1, 0, 0, eps);
  dsp_tensor *o = tu_run(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){-r, 0, r, 0, 0, 0}, 6, 1e-15);
  dsp_tensor_unref(o);
  a = norm_attrs(1, 1, 1, 1, eps);
  o = tu_run(ctx, DSP_OP_LAYER_NORM, &a, 3, x, w, b);
  tu_assert_f64(o, (double[]){-r + 0.5, 0, 3 * r - 0.5, 0.5, 0, -0.5}, 6,
                1e-15);
  dsp_tensor_unref(o);
  /* bias only: the one affine input is the bias */
  a = norm_attrs(1, 1, 0, 1, eps);
  o = tu_run(ctx, DSP_OP_LAYER_NORM, &a, 2, x, b, NULL);
  tu_assert_f64(o, (double[]){-r + 0.5, 0, r - 0.5, 0.5, 0, -0.5}, 6, 1e-15);
  dsp_tensor_unref(o);
  dsp_tensor_unref(b), dsp_tensor_unref(w), dsp_tensor_unref(x);
}

Test(norm, layer_norm_over_two_dims_and_f32_with_large_offset) {
  /* nlast 2 over [2, 2, 2]: each group of 4 is normalised together */
  dsp_tensor *x = tu_f64(ctx, SH(2, 2, 2), (double[]){1, 2, 3, 4, 0, 0, 2, 2});
  dsp_attrs a = norm_attrs(1, 2, 0, 0, 0.0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL);
  const double r = 1 / sqrt(1.25);
  tu_assert_f64(o, (double[]){-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r, -1, -1, 1, 1},
                8, 1e-15);
  dsp_tensor_unref(o);
  /* f32 rows offset by 1e4: E[x^2] - E[x]^2 in f32 would lose the
   * variance; the two-pass variance keeps it */
  dsp_tensor *xf = tu_f32(ctx, SH(1, 3), (float[]){10001, 10002, 10003});
  a = norm_attrs(1, 1, 0, 0, 1e-5);
  o = tu_run(ctx, DSP_OP_LAYER_NORM, &a, 1, xf, NULL, NULL);
  const float rf = (float)(1 / sqrt(2.0 / 3.0 + 1e-5));
  tu_assert_f32(o, (float[]){-rf, 0, rf}, 3, 1e-6f);
  dsp_tensor_unref(o);
  dsp_tensor_unref(xf), dsp_tensor_unref(x);
}

Test(norm, layer_norm_backward_packs_dx_dweight_dbias) {
  /* grad of ones without weight: dx = 0 (the normalisation removes
   * every uniform shift), dweight = sum of xhat over rows, dbias = rows */
  dsp_tensor *x = tu_f64(ctx, SH(2, 3), (double[]){1, 2, 3, 0, 3, 6});
  dsp_tensor *w = tu_f64(ctx, SH(3), (double[]){1, 1, 1});
  dsp_tensor *g = tu_f64(ctx, SH(2, 3), (double[]){1, 1, 1, 1, 1, 1});
  dsp_attrs a = norm_attrs(1, 1, 1, 1, 0.0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_LAYER_NORM_BACKWARD, &a, 3, g, x, w);
  tu_assert_shape(o, SH(12));
  const double r = sqrt(1.5); /* both rows: xhat = -r, 0, r */
  tu_assert_f64(o, (double[]){0, 0, 0, 0, 0, 0, -2 * r, 0, 2 * r, 2, 2, 2}, 12,
                1e-12);
  dsp_tensor_unref(o);
  /* without affine parameters: dx only */
  a = norm_attrs(1, 1, 0, 0, 0.0);
  dsp_tensor *g2 = tu_f64(ctx, SH(2, 3), (double[]){1, 0, 0, 0, 0, 0});
  o = tu_run(ctx, DSP_OP_LAYER_NORM_BACKWARD, &a, 2, g2, x, NULL);
  tu_assert_shape(o, SH(6));
  /* d y0 / d x_j for x = (1, 2, 3): r (delta_0j - 1/3 - xhat_0 xhat_j / 3) */
  tu_assert_f64(o, (double[]){r * (1 - 1.0 / 3 - 0.5), r * (-1.0 / 3),
                              r * (-1.0 / 3 + 0.5), 0, 0, 0},
                6, 1e-12);
  dsp_tensor_unref(o);
  dsp_tensor_unref(g2), dsp_tensor_unref(g), dsp_tensor_unref(w);
  dsp_tensor_unref(x);
}

Test(norm, layer_norm_errors) {
  dsp_tensor *x = tu_f64(ctx, SH(2, 3), Z);
  dsp_tensor *w = tu_f64(ctx, SH(3), Z);
  dsp_tensor *w2 = tu_f64(ctx, SH(2, 3), Z);
  dsp_tensor *wf = tu_f32(ctx, SH(3), ZF);
  dsp_tensor *xi = tu_i64(ctx, SH(2, 3), ZI);
  dsp_attrs a = norm_attrs(1, 0, 0, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EDIM,
              "layer_norm: nlast = 0 outside [1, 2] for x of rank 2");
  a = norm_attrs(1, 3, 0, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EDIM,
              "nlast = 3");
  a = norm_attrs(1, 1, 1, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 2, x, w2, NULL, DISPATCH_ESHAPE,
              "layer_norm: weight has shape [2, 3], want the last 1 dims of "
              "x [2, 3]");
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 2, x, wf, NULL, DISPATCH_EDTYPE,
              "layer_norm: weight is f32 but x is f64");
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "layer_norm: takes 2 inputs with these flags");
  a = norm_attrs(1, 1, 2, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "has_weight flag is 2");
  a = norm_attrs(1, 1, 0, 0, -1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "eps = -1e-05 must be finite and >= 0");
  a = norm_attrs(1, 1, 0, 0, NAN);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "eps");
  a = norm_attrs(1, 1, 0, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, xi, NULL, NULL, DISPATCH_EDTYPE,
              "layer_norm: x must be f32 or f64, got i64");
  a = norm_attrs(0, 1, 0, 0, 1e-5); /* two ints: layer_norm wants three */
  tu_run_fail(ctx, DSP_OP_LAYER_NORM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "layer_norm");
  a = norm_attrs(1, 1, 0, 0, 1e-5);
  tu_run_fail(ctx, DSP_OP_LAYER_NORM_BACKWARD, &a, 2, w2, w, NULL,
              DISPATCH_ESHAPE, "layer_norm_backward: grad [2, 3] differs");
  dsp_tensor_unref(xi), dsp_tensor_unref(wf), dsp_tensor_unref(w2);
  dsp_tensor_unref(w), dsp_tensor_unref(x);
}

/* ------------------------------------------------------------ rms_norm */

Test(norm, rms_norm_hand_values_and_backward) {
  dsp_tensor *x = tu_f64(ctx, SH(2, 2), (double[]){3, 4, 0, 0});
  dsp_tensor *w = tu_f64(ctx, SH(2), (double[]){2, -1});
  /* row 0: mean square 12.5; row 1: 0 / sqrt(eps) = 0 */
  dsp_attrs a = norm_attrs(0, 1, 1, 0, 1e-6);
  dsp_tensor *o = tu_run(ctx, DSP_OP_RMS_NORM, &a, 2, x, w, NULL);
  const double r = 1 / sqrt(12.5 + 1e-6);
  tu_assert_f64(o, (double[]){6 * r, -4 * r, 0, 0}, 4, 1e-15);
  dsp_tensor_unref(o);
  a = norm_attrs(0, 1, 0, 0, 0.0);
  o = tu_run(ctx, DSP_OP_RMS_NORM, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){3 / sqrt(12.5), 4 / sqrt(12.5), NAN, NAN}, 4,
                1e-15);
  dsp_tensor_unref(o);
  /* backward: grad (1, 0) on row 0 without weight: r (e_0 - xhat xhat_0 / 2)
   * with xhat = x r; dweight follows after dx */
  dsp_tensor *g = tu_f64(ctx, SH(2, 2), (double[]){1, 0, 0, 0});
  dsp_tensor *x1 = tu_f64(ctx, SH(1, 2), (double[]){3, 4});
  dsp_tensor *g1 = tu_f64(ctx, SH(1, 2), (double[]){1, 0});
  const double q = 1 / sqrt(12.5), xh0 = 3 * q, xh1 = 4 * q;
  o = tu_run(ctx, DSP_OP_RMS_NORM_BACKWARD, &a, 2, g1, x1, NULL);
  tu_assert_f64(o, (double[]){q * (1 - xh0 * xh0 / 2), q * (-xh1 * xh0 / 2)}, 2,
                1e-15);
  dsp_tensor_unref(o);
  dsp_tensor *w1 = tu_f64(ctx, SH(2), (double[]){1, 1});
  a = norm_attrs(0, 1, 1, 0, 0.0);
  o = tu_run(ctx, DSP_OP_RMS_NORM_BACKWARD, &a, 3, g1, x1, w1);
  tu_assert_shape(o, SH(4));
  tu_assert_f64(o, (double[]){q * (1 - xh0 * xh0 / 2), q * (-xh1 * xh0 / 2),
                              xh0, 0},
                4, 1e-15);
  dsp_tensor_unref(o);
  /* rms_norm takes no bias flag */
  dsp_attrs a3 = norm_attrs(1, 1, 0, 0, 0.0);
  tu_run_fail(ctx, DSP_OP_RMS_NORM, &a3, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "rms_norm");
  dsp_tensor_unref(w1), dsp_tensor_unref(g1), dsp_tensor_unref(x1);
  dsp_tensor_unref(g), dsp_tensor_unref(w), dsp_tensor_unref(x);
}
