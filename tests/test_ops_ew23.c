/* Issue 23's elementwise ops and reductions through dsp_op: softplus,
 * gelu_tanh (and their backward helpers), clamp, masked_fill, min, argmin,
 * var and std. Hand-computed values (f64 figures from Python's math and
 * statistics modules), dtype refusals, bad shapes and attributes, and the
 * gradient conventions (clamp's inclusive bounds, masked_fill's mask,
 * maximum/minimum/min ties split evenly, var/std's formulas). */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(ew23, .init = setup, .fini = teardown);

static const int64_t S6[] = {6}, S23[] = {2, 3}, S24[] = {2, 4};

static dsp_attrs bounds(double lo, double hi) {
  dsp_attrs a = dsp_attrs_none();
  a.floats[0] = lo, a.floats[1] = hi;
  a.n_floats = 2;
  return a;
}

/* reduction attrs: dims, keepdim and (nf == 2) a correction */
static dsp_attrs red(int n, const int64_t *d, int keepdim, int nf,
                     double corr) {
  dsp_attrs a = dsp_attrs_ints(n, d);
  a.floats[0] = keepdim;
  a.floats[1] = corr;
  a.n_floats = nf;
  return a;
}

/* d sum(y) / d x, where y = op(x, extra) with attrs a */
static dsp_tensor *grad_sum(dsp_opcode op, const dsp_attrs *a, dsp_tensor *x,
                            dsp_tensor *extra) {
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, op, a, extra ? 2 : 1, x, extra, NULL);
  dsp_tensor *s = tu_run(ctx, DSP_OP_SUM, NULL, 1, y, NULL, NULL);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0, "backward: %s",
               dsp_ctx_errmsg(ctx));
  dsp_tensor *gx = tu_grad(ctx, g, x);
  dsp_grads_free(g);
  dsp_tensor_unref(s), dsp_tensor_unref(y);
  return gx;
}

/* ------------------------------------------------------------ softplus */

Test(ew23, softplus_hand_values_and_threshold) {
  dsp_tensor *x = tu_f64(ctx, 1, S6, (double[]){-30, -1, 0, 1, 20, 21});
  dsp_tensor *o = tu_run(ctx, DSP_OP_SOFTPLUS, NULL, 1, x, NULL, NULL);
  /* 21 > 20 is x itself; 20 is not above the threshold */
  tu_assert_f64(o, (double[]){9.357622968839737e-14, 0.31326168751822286,
                              0.6931471805599453, 1.3132616875182228,
                              20.000000002061153, 21},
                6, 1e-15);
  dsp_tensor_unref(o);
  dsp_tensor *g = tu_f64(ctx, 1, S6, (double[]){1, 1, 1, 1, 1, 2});
  o = tu_run(ctx, DSP_OP_SOFTPLUS_BACKWARD, NULL, 2, g, x, NULL);
  tu_assert_f64(o, (double[]){9.3576229688393e-14, 0.2689414213699951, 0.5,
                              0.7310585786300049, 0.9999999979388464, 2},
                6, 1e-15);
  dsp_tensor_unref(o), dsp_tensor_unref(g), dsp_tensor_unref(x);
  /* f32 keeps large inputs finite: 100 > 20 is 100, -100 underflows to 0 */
  dsp_tensor *f = tu_f32(ctx, 1, (int64_t[]){3}, (float[]){-100, 0, 100});
  o = tu_run(ctx, DSP_OP_SOFTPLUS, NULL, 1, f, NULL, NULL);
  tu_assert_f32(o, (float[]){0, 0.69314718f, 100}, 3, 1e-7f);
  dsp_tensor_unref(o), dsp_tensor_unref(f);
}

Test(ew23, gelu_tanh_hand_values) {
  dsp_tensor *x = tu_f64(ctx, 1, (int64_t[]){5}, (double[]){-3, -1, 0, 0.5, 2});
  dsp_tensor *o = tu_run(ctx, DSP_OP_GELU_TANH, NULL, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){-0.0036373920817729943, -0.15880800939172324, 0,
                              0.34571400982514394, 1.954597694087775},
                5, 1e-15);
  dsp_tensor_unref(o);
  /* differs from the exact erf form (gelu(-1) = -0.15865525393145707) */
  o = tu_run(ctx, DSP_OP_GELU, NULL, 1, x, NULL, NULL);
  cr_assert_gt(fabs(((double *)dsp_tensor_data(o))[1] + 0.15880800939172324),
               1e-4);
  dsp_tensor_unref(o);
  dsp_tensor *g = tu_f64(ctx, 1, (int64_t[]){5}, (double[]){1, 1, 1, 1, -1});
  o = tu_run(ctx, DSP_OP_GELU_TANH_BACKWARD, NULL, 2, g, x, NULL);
  tu_assert_f64(o, (double[]){-0.011584166630969516, -0.08296408384578255, 0.5,
                              0.8673699035346424, -1.0860992566236183},
                5, 1e-14);
  dsp_tensor_unref(o), dsp_tensor_unref(g), dsp_tensor_unref(x);
}

Test(ew23, softplus_gelu_tanh_dtype_errors) {
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 2});
  tu_run_fail(ctx, DSP_OP_SOFTPLUS, NULL, 1, i, NULL, NULL, DISPATCH_EDTYPE,
              "softplus: dtype i64 not supported");
  tu_run_fail(ctx, DSP_OP_GELU_TANH, NULL, 1, i, NULL, NULL, DISPATCH_EDTYPE,
              "gelu_tanh: dtype i64 not supported");
  tu_run_fail(ctx, DSP_OP_SOFTPLUS_BACKWARD, NULL, 2, i, i, NULL,
              DISPATCH_EDTYPE, "softplus_backward: dtype i64");
  dsp_tensor *a = tu_f32(ctx, 1, (int64_t[]){2}, (float[]){1, 2});
  dsp_tensor *b = tu_f32(ctx, 1, (int64_t[]){3}, (float[]){1, 2, 3});
  tu_run_fail(ctx, DSP_OP_GELU_TANH_BACKWARD, NULL, 2, a, b, NULL,
              DISPATCH_ESHAPE, "grad shape [2] differs from input shape [3]");
  dsp_tensor_unref(i), dsp_tensor_unref(a), dsp_tensor_unref(b);
}

/* ------------------------------------------------------------ clamp */

Test(ew23, clamp_values_nan_and_open_sides) {
  dsp_tensor *x = tu_f32(ctx, 1, S6, (float[]){-2, -1, 0, 0.5f, 1, NAN});
  dsp_attrs a = bounds(-1, 0.5);
  dsp_tensor *o = tu_run(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-1, -1, 0, 0.5f, 0.5f, NAN}, 6, 0);
  dsp_tensor_unref(o);
  a = bounds(-INFINITY, 0);
  o = tu_run(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-2, -1, 0, 0, 0, NAN}, 6, 0);
  dsp_tensor_unref(o);
  /* lo > hi: hi everywhere, as PyTorch (NaN still NaN) */
  a = bounds(1, -1);
  o = tu_run(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-1, -1, -1, -1, -1, NAN}, 6, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x);

  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){4},
                         (int64_t[]){INT64_MIN, -5, 3, INT64_MAX});
  a = bounds(-4, INFINITY);
  o = tu_run(ctx, DSP_OP_CLAMP, &a, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){-4, -4, 3, INT64_MAX}, 4);
  dsp_tensor_unref(o);
  a = bounds(-INFINITY, 2);
  o = tu_run(ctx, DSP_OP_CLAMP, &a, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){INT64_MIN, -5, 2, 2}, 4);
  dsp_tensor_unref(o), dsp_tensor_unref(i);
}

Test(ew23, clamp_errors) {
  dsp_tensor *x = tu_f64(ctx, 1, (int64_t[]){2}, (double[]){1, 2});
  dsp_attrs a = bounds(NAN, 1);
  tu_run_fail(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "clamp: lower bound is NaN");
  a = bounds(0, NAN);
  tu_run_fail(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "clamp: upper bound is NaN");
  a = dsp_attrs_f1(1);
  tu_run_fail(ctx, DSP_OP_CLAMP, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "clamp: takes 0 int and 2 float attributes, got 0 and 1");
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 2});
  a = bounds(0.5, 3);
  tu_run_fail(ctx, DSP_OP_CLAMP, &a, 1, i, NULL, NULL, DISPATCH_EINVAL,
              "clamp: bound 0.5 is not an integer for an i64 tensor");
  dsp_tensor *b = tu_bool(ctx, 1, (int64_t[]){2}, (uint8_t[]){0, 1});
  a = bounds(0, 1);
  tu_run_fail(ctx, DSP_OP_CLAMP, &a, 1, b, NULL, NULL, DISPATCH_EDTYPE,
              "clamp: dtype bool not supported");
  dsp_tensor_unref(x), dsp_tensor_unref(i), dsp_tensor_unref(b);
}

Test(ew23, clamp_gradient_is_one_on_the_closed_interval) {
  /* both bounds themselves pass the gradient, as PyTorch */
  dsp_tensor *x = tu_f64(ctx, 1, S6, (double[]){-2, -1, 0, 0.5, 1, 3});
  dsp_attrs a = bounds(-1, 1);
  dsp_tensor *gx = grad_sum(DSP_OP_CLAMP, &a, x, NULL);
  tu_assert_f64(gx, (double[]){0, 1, 1, 1, 1, 0}, 6, 0);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
  /* lo > hi: the output is constant, no gradient anywhere */
  x = tu_f64(ctx, 1, (int64_t[]){3}, (double[]){-1, 0, 1});
  a = bounds(1, -1);
  gx = grad_sum(DSP_OP_CLAMP, &a, x, NULL);
  tu_assert_f64(gx, (double[]){0, 0, 0}, 3, 0);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
}

/* ------------------------------------------------------------ masked_fill */

Test(ew23, masked_fill_broadcasts_the_mask) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *m = tu_bool(ctx, 2, (int64_t[]){2, 1}, (uint8_t[]){0, 1});
  dsp_attrs a = dsp_attrs_f1(-INFINITY);
  dsp_tensor *o = tu_run(ctx, DSP_OP_MASKED_FILL, &a, 2, x, m, NULL);
  tu_assert_shape(o, 2, S23);
  tu_assert_f32(o, (float[]){1, 2, 3, -INFINITY, -INFINITY, -INFINITY}, 6, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(m);
  m = tu_bool(ctx, 1, (int64_t[]){3}, (uint8_t[]){1, 0, 1});
  a = dsp_attrs_f1(0.25);
  o = tu_run(ctx, DSP_OP_MASKED_FILL, &a, 2, x, m, NULL);
  tu_assert_f32(o, (float[]){0.25f, 2, 0.25f, 0.25f, 5, 0.25f}, 6, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  /* a scalar mask and an i64 tensor */
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){3}, (int64_t[]){7, 8, 9});
  dsp_tensor *one = tu_bool(ctx, 0, NULL, (uint8_t[]){1});
  a = dsp_attrs_f1(-3);
  o = tu_run(ctx, DSP_OP_MASKED_FILL, &a, 2, i, one, NULL);
  tu_assert_i64(o, (int64_t[]){-3, -3, -3}, 3);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MASKED_FILL, &a, 2, i, m, NULL);
  tu_assert_i64(o, (int64_t[]){-3, 8, -3}, 3);
  dsp_tensor_unref(o), dsp_tensor_unref(i), dsp_tensor_unref(one),
      dsp_tensor_unref(m);
}

Test(ew23, masked_fill_errors) {
  dsp_tensor *x = tu_f32(ctx, 2, (int64_t[]){2, 1}, (float[]){1, 2});
  dsp_tensor *m3 = tu_bool(ctx, 1, (int64_t[]){3}, (uint8_t[]){1, 0, 1});
  dsp_attrs a = dsp_attrs_f1(0);
  /* [3] broadcasts with [2,1] to [2,3], which is not x's shape */
  tu_run_fail(ctx, DSP_OP_MASKED_FILL, &a, 2, x, m3, NULL, DISPATCH_ESHAPE,
              "masked_fill: mask shape [3] does not broadcast to input shape "
              "[2, 1]");
  dsp_tensor *f = tu_f32(ctx, 1, (int64_t[]){1}, (float[]){1});
  tu_run_fail(ctx, DSP_OP_MASKED_FILL, &a, 2, x, f, NULL, DISPATCH_EDTYPE,
              "masked_fill: mask must be bool, got f32");
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){3}, (int64_t[]){1, 2, 3});
  a = dsp_attrs_f1(1.5);
  tu_run_fail(ctx, DSP_OP_MASKED_FILL, &a, 2, i, m3, NULL, DISPATCH_EINVAL,
              "masked_fill: value 1.5 is not an integer");
  tu_run_fail(ctx, DSP_OP_MASKED_FILL, &a, 2, m3, m3, NULL, DISPATCH_EDTYPE,
              "masked_fill: dtype bool not supported");
  dsp_attrs none = dsp_attrs_none();
  tu_run_fail(ctx, DSP_OP_MASKED_FILL, &none, 2, i, m3, NULL,
              DISPATCH_EINVAL, "takes 0 int and 1 float attributes");
  dsp_tensor_unref(x), dsp_tensor_unref(m3), dsp_tensor_unref(f),
      dsp_tensor_unref(i);
}

Test(ew23, masked_fill_gradient_skips_filled_positions) {
  dsp_tensor *x = tu_f64(ctx, 2, S23, (double[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *m = tu_bool(ctx, 1, (int64_t[]){3}, (uint8_t[]){0, 1, 0});
  dsp_attrs a = dsp_attrs_f1(9);
  dsp_tensor *gx = grad_sum(DSP_OP_MASKED_FILL, &a, x, m);
  tu_assert_shape(gx, 2, S23);
  tu_assert_f64(gx, (double[]){1, 0, 1, 1, 0, 1}, 6, 0);
  dsp_tensor_unref(gx), dsp_tensor_unref(x), dsp_tensor_unref(m);
}

/* ------------------------------------------------------------ ties */

Test(ew23, maximum_minimum_split_ties_evenly) {
  /* the old convention gave a tie's whole gradient to a: {1, 0, 1} */
  static const dsp_opcode ops[] = {DSP_OP_MAXIMUM, DSP_OP_MINIMUM};
  static const double ga_want[2][3] = {{0.5, 0, 1}, {0.5, 1, 0}};
  static const double gb_want[2][3] = {{0.5, 1, 0}, {0.5, 0, 1}};
  for (int k = 0; k < 2; k++) {
    dsp_tensor *a = tu_f64(ctx, 1, (int64_t[]){3}, (double[]){1, 2, 3});
    dsp_tensor *b = tu_f64(ctx, 1, (int64_t[]){3}, (double[]){1, 5, 0});
    cr_assert_eq(dsp_track(ctx, a), 0);
    cr_assert_eq(dsp_track(ctx, b), 0);
    dsp_tensor *m = tu_run(ctx, ops[k], NULL, 2, a, b, NULL);
    dsp_tensor *s = tu_run(ctx, DSP_OP_SUM, NULL, 1, m, NULL, NULL);
    dsp_grads *g;
    cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
    dsp_tensor *ga = tu_grad(ctx, g, a), *gb = tu_grad(ctx, g, b);
    tu_assert_f64(ga, ga_want[k], 3, 0);
    tu_assert_f64(gb, gb_want[k], 3, 0);
    dsp_tensor *list[] = {ga, gb, s, m, a, b};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
      dsp_tensor_unref(list[i]);
    dsp_grads_free(g);
  }
  /* broadcast b: its gradient sums the halves of every tie */
  dsp_tensor *a = tu_f64(ctx, 2, (int64_t[]){2, 2}, (double[]){2, 2, 2, 0});
  dsp_tensor *b = tu_f64(ctx, 0, NULL, (double[]){2});
  cr_assert_eq(dsp_track(ctx, b), 0);
  dsp_tensor *m = tu_run(ctx, DSP_OP_MAXIMUM, NULL, 2, a, b, NULL);
  dsp_tensor *s = tu_run(ctx, DSP_OP_SUM, NULL, 1, m, NULL, NULL);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *gb = tu_grad(ctx, g, b);
  tu_assert_f64(gb, (double[]){2.5}, 1, 0);
  dsp_tensor *list[] = {gb, s, m, a, b};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
  dsp_grads_free(g);
}

/* ------------------------------------------------------------ min, argmin */

Test(ew23, min_argmin_per_dim_nan_and_ties) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){3, 1, 1, 2, NAN, -5});
  dsp_attrs a = red(1, (int64_t[]){1}, 0, 1, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_MIN, &a, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){1, NAN}, 2, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_ARGMIN, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, 1}, 2); /* the first tie; the NaN */
  dsp_tensor_unref(o);
  a = red(1, (int64_t[]){0}, 1, 1, 0);
  o = tu_run(ctx, DSP_OP_MIN, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){1, 3});
  tu_assert_f32(o, (float[]){2, NAN, -5}, 3, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){5},
                         (int64_t[]){4, INT64_MIN, 0, INT64_MIN, 9});
  o = tu_run(ctx, DSP_OP_MIN, NULL, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){INT64_MIN}, 1);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_ARGMIN, NULL, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1}, 1);
  dsp_tensor_unref(o), dsp_tensor_unref(i);
  /* the blocked path ([P][R][Q] with R reduced) agrees */
  dsp_tensor *w = tu_f64(ctx, 3, (int64_t[]){1, 3, 2},
                         (double[]){5, 0, -1, 0, 7, -3});
  a = red(1, (int64_t[]){1}, 0, 1, 0);
  o = tu_run(ctx, DSP_OP_ARGMIN, &a, 1, w, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, 2}, 2);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MIN, &a, 1, w, NULL, NULL);
  tu_assert_f64(o, (double[]){-1, -3}, 2, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(w);
}

Test(ew23, min_argmin_errors) {
  dsp_tensor *e = tu_f32(ctx, 2, (int64_t[]){0, 3}, NULL);
  dsp_attrs a = red(1, (int64_t[]){0}, 0, 1, 0);
  tu_run_fail(ctx, DSP_OP_MIN, &a, 1, e, NULL, NULL, DISPATCH_ESHAPE,
              "min: cannot reduce over empty dim 0");
  tu_run_fail(ctx, DSP_OP_ARGMIN, NULL, 1, e, NULL, NULL, DISPATCH_ESHAPE,
              "argmin: cannot reduce over empty dim");
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  a = red(2, (int64_t[]){0, 1}, 0, 1, 0);
  tu_run_fail(ctx, DSP_OP_ARGMIN, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "argmin: takes one dim or none, got 2");
  dsp_tensor *b = tu_bool(ctx, 1, (int64_t[]){2}, (uint8_t[]){0, 1});
  tu_run_fail(ctx, DSP_OP_MIN, NULL, 1, b, NULL, NULL, DISPATCH_EDTYPE,
              "min: dtype bool");
  dsp_tensor_unref(e), dsp_tensor_unref(x), dsp_tensor_unref(b);
}

Test(ew23, min_gradient_splits_between_tied_minima) {
  dsp_tensor *x = tu_f64(ctx, 2, S23, (double[]){1, 4, 1, 2, 0, 3});
  dsp_attrs a = red(1, (int64_t[]){1}, 0, 1, 0);
  dsp_tensor *gx = grad_sum(DSP_OP_MIN, &a, x, NULL);
  tu_assert_f64(gx, (double[]){0.5, 0, 0.5, 0, 1, 0}, 6, 0);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
}

/* ------------------------------------------------------------ var, std */

Test(ew23, var_std_hand_values) {
  dsp_tensor *x = tu_f64(ctx, 2, S24, (double[]){1, 2, 3, 4, 2, 2, 2, 2});
  dsp_attrs a = red(1, (int64_t[]){1}, 0, 2, 1);
  dsp_tensor *o = tu_run(ctx, DSP_OP_VAR, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){1.6666666666666667, 0}, 2, 1e-15);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_STD, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){1.2909944487358056, 0}, 2, 1e-15);
  dsp_tensor_unref(o);
  a = red(1, (int64_t[]){-1}, 1, 2, 0); /* population variance, keepdim */
  o = tu_run(ctx, DSP_OP_VAR, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){2, 1});
  tu_assert_f64(o, (double[]){1.25, 0}, 2, 1e-15);
  dsp_tensor_unref(o);
  /* every dim; no floats at all means correction 1, no keepdim */
  o = tu_run(ctx, DSP_OP_VAR, NULL, 1, x, NULL, NULL);
  tu_assert_shape(o, 0, NULL);
  tu_assert_f64(o, (double[]){0.7857142857142857}, 1, 1e-15);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  /* f32 is computed in double and rounded once */
  dsp_tensor *f = tu_f32(ctx, 1, (int64_t[]){4}, (float[]){1, 2, 3, 4});
  o = tu_run(ctx, DSP_OP_STD, NULL, 1, f, NULL, NULL);
  tu_assert_f32(o, (float[]){(float)1.2909944487358056}, 1, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(f);
}

Test(ew23, var_with_no_degrees_of_freedom_is_inf_or_nan) {
  /* N - correction <= 0 divides by 0, as PyTorch */
  dsp_tensor *one = tu_f64(ctx, 1, (int64_t[]){1}, (double[]){5});
  dsp_tensor *o = tu_run(ctx, DSP_OP_VAR, NULL, 1, one, NULL, NULL);
  cr_assert(isnan(((double *)dsp_tensor_data(o))[0]));
  dsp_tensor_unref(o), dsp_tensor_unref(one);
  dsp_tensor *two = tu_f64(ctx, 1, (int64_t[]){2}, (double[]){1, 3});
  dsp_attrs a = red(0, NULL, 0, 2, 3);
  o = tu_run(ctx, DSP_OP_VAR, &a, 1, two, NULL, NULL);
  cr_assert(isinf(((double *)dsp_tensor_data(o))[0]));
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_STD, &a, 1, two, NULL, NULL);
  cr_assert(isinf(((double *)dsp_tensor_data(o))[0]));
  dsp_tensor_unref(o), dsp_tensor_unref(two);
  /* an empty reduction is NaN */
  dsp_tensor *e = tu_f32(ctx, 2, (int64_t[]){2, 0}, NULL);
  a = red(1, (int64_t[]){1}, 0, 2, 0);
  o = tu_run(ctx, DSP_OP_VAR, &a, 1, e, NULL, NULL);
  tu_assert_f32(o, (float[]){NAN, NAN}, 2, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(e);
}

Test(ew23, var_std_errors) {
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 2});
  tu_run_fail(ctx, DSP_OP_VAR, NULL, 1, i, NULL, NULL, DISPATCH_EDTYPE,
              "var: dtype i64 not supported (cast to a float dtype first)");
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_attrs a = red(1, (int64_t[]){0}, 0, 2, 0.5);
  tu_run_fail(ctx, DSP_OP_STD, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "std: correction 0.5 is not an integer");
  a.n_floats = 3;
  tu_run_fail(ctx, DSP_OP_VAR, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "var: takes at most 2 float attributes (keepdim, correction)");
  a = red(1, (int64_t[]){2}, 0, 2, 1);
  tu_run_fail(ctx, DSP_OP_VAR, &a, 1, x, NULL, NULL, DISPATCH_EDIM,
              "var: dim 2 out of range for rank 2");
  dsp_tensor_unref(i), dsp_tensor_unref(x);
}

Test(ew23, var_std_gradients_by_hand) {
  /* x = {1, 2, 3, 4}, mean 2.5, correction 1: d var / dx = 2 (x - 2.5) / 3;
   * d std / dx = (x - 2.5) / (3 std), std = 1.2909944487358056 */
  dsp_tensor *x = tu_f64(ctx, 1, (int64_t[]){4}, (double[]){1, 2, 3, 4});
  dsp_attrs a = red(0, NULL, 0, 2, 1);
  dsp_tensor *gx = grad_sum(DSP_OP_VAR, &a, x, NULL);
  tu_assert_f64(gx, (double[]){-1, -1.0 / 3, 1.0 / 3, 1}, 4, 1e-15);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
  x = tu_f64(ctx, 1, (int64_t[]){4}, (double[]){1, 2, 3, 4});
  gx = grad_sum(DSP_OP_STD, &a, x, NULL);
  const double s = 1.2909944487358056;
  tu_assert_f64(gx, (double[]){-1.5 / (3 * s), -0.5 / (3 * s), 0.5 / (3 * s),
                               1.5 / (3 * s)},
                4, 1e-15);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
  /* correction 0 over dim 1 of [2, 2]: 2 (x - mean) / 2 */
  x = tu_f64(ctx, 2, (int64_t[]){2, 2}, (double[]){0, 4, 1, 1});
  a = red(1, (int64_t[]){1}, 1, 2, 0);
  gx = grad_sum(DSP_OP_VAR, &a, x, NULL);
  tu_assert_f64(gx, (double[]){-2, 2, 0, 0}, 4, 0);
  dsp_tensor_unref(gx), dsp_tensor_unref(x);
}
