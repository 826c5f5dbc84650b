/* Autodiff engine: the one-wrap rule, error codes of backward and
 * grads_get, graph release and retain, what gets recorded, and gradient
 * accumulation checked against hand-computed values. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(autodiff, .init = setup, .fini = teardown);

static dsp_tensor *vec(const double *v, int64_t n) {
  return tu_f64(ctx, 1, &n, v);
}

static dsp_tensor *sum_all(dsp_tensor *x) {
  return tu_run(ctx, DSP_OP_SUM, NULL, 1, x, NULL, NULL);
}

Test(autodiff, tracking_twice_is_a_double_wrap) {
  double v[3] = {1, 2, 3};
  dsp_tensor *x = vec(v, 3);
  cr_assert_not(dsp_is_tracked(x));
  cr_assert_eq(dsp_track(ctx, x), 0);
  cr_assert(dsp_is_tracked(x));
  cr_assert_eq(dsp_track(ctx, x), DISPATCH_EDOUBLEWRAP);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx),
                            "autodiff should not wrap an autodiff tensor"));
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  cr_assert(dsp_is_tracked(y));
  cr_assert_eq(dsp_track(ctx, y), DISPATCH_EDOUBLEWRAP);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx),
                            "autodiff should not wrap an autodiff tensor"));
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "mul"));
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
}

Test(autodiff, only_float_tensors_can_be_tracked) {
  int64_t n = 2, iv[2] = {1, 2};
  dsp_tensor *i = tu_i64(ctx, 1, &n, iv);
  cr_assert_eq(dsp_track(ctx, i), DISPATCH_EDTYPE);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "i64"));
  cr_assert_not(dsp_is_tracked(i));
  dsp_tensor_unref(i);
}

Test(autodiff, backward_needs_a_tracked_scalar) {
  double v[3] = {1, 2, 3};
  dsp_tensor *x = vec(v, 3), *s = sum_all(x);
  dsp_grads *g = (dsp_grads *)&g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), DISPATCH_ENOTTRACKED);
  cr_assert_null(g);
  dsp_tensor_unref(s);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  cr_assert_eq(dsp_backward(ctx, y, 0, &g), DISPATCH_ENOTSCALAR);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "[3]"));
  cr_assert_null(g);
  /* the failed call released nothing: a proper loss still works */
  s = sum_all(y);
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_grads_free(g);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
}

Test(autodiff, grads_get_reports_unreached_and_untracked) {
  double v[2] = {1, 2};
  dsp_tensor *x = vec(v, 2), *w = vec(v, 2), *u = vec(v, 2);
  cr_assert_eq(dsp_track(ctx, x), 0);
  cr_assert_eq(dsp_track(ctx, w), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_EXP, NULL, 1, x, NULL, NULL);
  dsp_tensor *s = sum_all(y);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  cr_assert_eq(dsp_grads_count(g), 1);
  dsp_tensor *out = (dsp_tensor *)&out;
  cr_assert_eq(dsp_grads_get(ctx, g, w, &out), DISPATCH_ENOGRAD);
  cr_assert_null(out);
  cr_assert_eq(dsp_grads_get(ctx, g, u, &out), DISPATCH_ENOTTRACKED);
  cr_assert_eq(dsp_grads_get(ctx, g, y, &out), DISPATCH_ENOGRAD);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "leaves"));
  dsp_tensor *gx = tu_grad(ctx, g, x);
  double e[2] = {2.718281828459045, 7.38905609893065};
  tu_assert_f64(gx, e, 2, 1e-12);
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
  dsp_tensor_unref(w);
  dsp_tensor_unref(u);
}

Test(autodiff, second_backward_needs_retain) {
  double v[3] = {0.5, -1, 2};
  dsp_tensor *x = vec(v, 3);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_TANH, NULL, 1, x, NULL, NULL);
  dsp_tensor *s = sum_all(y);
  dsp_grads *g1, *g2, *g3;
  cr_assert_eq(dsp_backward(ctx, s, 1, &g1), 0);
  cr_assert_eq(dsp_backward(ctx, s, 0, &g2), 0); /* retained: works again */
  dsp_tensor *a = tu_grad(ctx, g1, x), *b = tu_grad(ctx, g2, x);
  double e[3];
  for (int i = 0; i < 3; i++) e[i] = 1 - tanh(v[i]) * tanh(v[i]);
  tu_assert_f64(a, e, 3, 1e-12);
  tu_assert_f64(b, e, 3, 0);
  g3 = (dsp_grads *)&g3;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g3), DISPATCH_EGRAPHFREED);
  cr_assert_null(g3);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "released"));
  /* a new loss built on the released part is refused too */
  dsp_tensor *s2 = sum_all(y);
  cr_assert_eq(dsp_backward(ctx, s2, 0, &g3), DISPATCH_EGRAPHFREED);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "tanh"));
  /* the leaf is still tracked and serves a fresh forward */
  cr_assert(dsp_is_tracked(x));
  dsp_tensor *y2 = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  dsp_tensor *s3 = sum_all(y2);
  cr_assert_eq(dsp_backward(ctx, s3, 0, &g3), 0);
  dsp_tensor *c = tu_grad(ctx, g3, x);
  double e2[3] = {1, -2, 4};
  tu_assert_f64(c, e2, 3, 0);
  dsp_tensor_unref(a);
  dsp_tensor_unref(b);
  dsp_tensor_unref(c);
  dsp_grads_free(g1);
  dsp_grads_free(g2);
  dsp_grads_free(g3);
  dsp_tensor_unref(s);
  dsp_tensor_unref(s2);
  dsp_tensor_unref(s3);
  dsp_tensor_unref(y);
  dsp_tensor_unref(y2);
  dsp_tensor_unref(x);
}

Test(autodiff, untracked_and_nonfloat_ops_record_nothing) {
  double v[3] = {1, 5, 3};
  dsp_tensor *a = vec(v, 3), *b = vec(v, 3);
  dsp_tensor *c = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  cr_assert_null(c->node);
  cr_assert_eq(dsp_track(ctx, a), 0);
  dsp_tensor *gt = tu_run(ctx, DSP_OP_GT, NULL, 2, a, b, NULL);
  cr_assert_null(gt->node);
  dsp_tensor *am = tu_run(ctx, DSP_OP_ARGMAX, NULL, 1, a, NULL, NULL);
  cr_assert_null(am->node);
  int64_t dt = DSP_I64;
  dsp_attrs ca = dsp_attrs_ints(1, &dt);
  dsp_tensor *ci = tu_run(ctx, DSP_OP_CAST, &ca, 1, a, NULL, NULL);
  cr_assert_null(ci->node);
  dsp_tensor *d = NULL;
  cr_assert_eq(dsp_detach(ctx, a, &d), 0);
  cr_assert_null(d->node);
  cr_assert_eq(dsp_tensor_data(d), dsp_tensor_data(a));
  dsp_tensor *e = tu_run(ctx, DSP_OP_ADD, NULL, 2, d, b, NULL);
  cr_assert_null(e->node);
  dsp_tensor *f = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  cr_assert_not_null(f->node);
  dsp_tensor *list[] = {a, b, c, gt, am, ci, d, e, f};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
}

Test(autodiff, grad_mode_off_records_nothing) {
  double v[2] = {1, 2};
  dsp_tensor *x = vec(v, 2);
  cr_assert_eq(dsp_track(ctx, x), 0);
  cr_assert_eq(dsp_set_grad_enabled(ctx, 0), 1);
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  cr_assert_null(y->node);
  cr_assert_eq(dsp_set_grad_enabled(ctx, 1), 0);
  dsp_tensor *z = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  cr_assert_not_null(z->node);
  dsp_tensor_unref(x);
  dsp_tensor_unref(y);
  dsp_tensor_unref(z);
}

Test(autodiff, x_times_x_accumulates_both_uses) {
  double v[3] = {1, -2, 3.5};
  dsp_tensor *x = vec(v, 3);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  dsp_tensor *s = sum_all(y);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  double e[3] = {2, -4, 7};
  tu_assert_f64(gx, e, 3, 0);
  cr_assert(!dsp_is_tracked(gx));
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
}

Test(autodiff, diamond_sums_the_paths) {
  /* a = 2x, b = 3x, c = a*b = 6x^2, d = c + a: dd/dx = 12x + 2; w is a
   * second leaf on one branch only: e = d * w, loss = sum(e) */
  double v[2] = {0.5, -1.5}, wv[2] = {2, 3};
  dsp_tensor *x = vec(v, 2), *w = vec(wv, 2);
  cr_assert_eq(dsp_track(ctx, x), 0);
  cr_assert_eq(dsp_track(ctx, w), 0);
  dsp_attrs two = dsp_attrs_f1(2), three = dsp_attrs_f1(3);
  dsp_tensor *a = tu_run(ctx, DSP_OP_MUL_SCALAR, &two, 1, x, NULL, NULL);
  dsp_tensor *b = tu_run(ctx, DSP_OP_MUL_SCALAR, &three, 1, x, NULL, NULL);
  dsp_tensor *c = tu_run(ctx, DSP_OP_MUL, NULL, 2, a, b, NULL);
  dsp_tensor *d = tu_run(ctx, DSP_OP_ADD, NULL, 2, c, a, NULL);
  dsp_tensor *e = tu_run(ctx, DSP_OP_MUL, NULL, 2, d, w, NULL);
  dsp_tensor *s = sum_all(e);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  cr_assert_eq(dsp_grads_count(g), 2);
  dsp_tensor *gx = tu_grad(ctx, g, x), *gw = tu_grad(ctx, g, w);
  double ex[2], ew[2];
  for (int i = 0; i < 2; i++) {
    ex[i] = (12 * v[i] + 2) * wv[i];
    ew[i] = 6 * v[i] * v[i] + 2 * v[i];
  }
  tu_assert_f64(gx, ex, 2, 1e-12);
  tu_assert_f64(gw, ew, 2, 1e-12);
  dsp_tensor *list[] = {gx, gw, s, e, d, c, b, a, x, w};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
  dsp_grads_free(g);
}

Test(autodiff, broadcast_input_gets_summed_gradient) {
  double xv[3] = {1, 2, 3}, bv[6] = {1, 2, 3, 4, 5, 6};
  int64_t bs[2] = {2, 3};
  dsp_tensor *x = vec(xv, 3), *b = tu_f64(ctx, 2, bs, bv);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, b, NULL);
  dsp_tensor *s = sum_all(y);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  double e[3] = {5, 7, 9};
  tu_assert_shape(gx, 1, (int64_t[]){3});
  tu_assert_f64(gx, e, 3, 0);
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
  dsp_tensor_unref(b);
}

Test(autodiff, cast_between_floats_returns_leaf_dtype) {
  float xv[3] = {1, 2, 3};
  double wv[3] = {0.25, -1, 4};
  int64_t n = 3;
  dsp_tensor *x = tu_f32(ctx, 1, &n, xv), *w = vec(wv, 3);
  cr_assert_eq(dsp_track(ctx, x), 0);
  int64_t dt = DSP_F64;
  dsp_attrs ca = dsp_attrs_ints(1, &dt);
  dsp_tensor *y = tu_run(ctx, DSP_OP_CAST, &ca, 1, x, NULL, NULL);
  dsp_tensor *z = tu_run(ctx, DSP_OP_MUL, NULL, 2, y, w, NULL);
  dsp_tensor *s = sum_all(z);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  float e[3] = {0.25f, -1, 4};
  tu_assert_f32(gx, e, 3, 0);
  dsp_tensor *list[] = {gx, s, z, y, x, w};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
  dsp_grads_free(g);
}

Test(autodiff, scalar_leaf_is_its_own_loss) {
  double v = 4;
  dsp_tensor *x = tu_f64(ctx, 0, NULL, &v);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, x, 0, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  double one = 1;
  tu_assert_f64(gx, &one, 1, 0);
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(x);
}

Test(autodiff, grads_outlive_the_graph) {
  double v[2] = {3, 4};
  dsp_tensor *x = vec(v, 2);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, x, NULL);
  dsp_tensor *s = sum_all(y);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 1, &g), 0);
  dsp_tensor_unref(s);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x); /* the container keeps the key alive */
  cr_assert_eq(dsp_grads_count(g), 1);
  dsp_grads_free(g);
}

Test(autodiff, deep_chain_sorts_and_frees_without_recursion) {
  /* 200000 ops deep: a recursive sort or free would overflow the stack */
  double v = 1;
  dsp_tensor *x = tu_f64(ctx, 0, NULL, &v);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_attrs a = dsp_attrs_f1(1.0);
  dsp_tensor *y = dsp_tensor_ref(x);
  for (int i = 0; i < 200000; i++) {
    dsp_tensor *z = tu_run(ctx, DSP_OP_ADD_SCALAR, &a, 1, y, NULL, NULL);
    dsp_tensor_unref(y);
    y = z;
  }
  cr_assert_float_eq(((double *)dsp_tensor_data(y))[0], 200001.0, 0);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, y, 1, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  cr_assert_float_eq(((double *)dsp_tensor_data(gx))[0], 1.0, 0);
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(y); /* frees the whole retained chain */
  dsp_tensor_unref(x);
}

Test(autodiff, ties_follow_the_documented_rules) {
  /* maximum/minimum split a tie's gradient evenly between the inputs (as
   * PyTorch); max over a dim splits it evenly between tied maxima */
  double av[3] = {1, 2, 3}, bv[3] = {1, 5, 0};
  dsp_tensor *a = vec(av, 3), *b = vec(bv, 3);
  cr_assert_eq(dsp_track(ctx, a), 0);
  cr_assert_eq(dsp_track(ctx, b), 0);
  dsp_tensor *m = tu_run(ctx, DSP_OP_MAXIMUM, NULL, 2, a, b, NULL);
  dsp_tensor *s = sum_all(m);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), 0);
  dsp_tensor *ga = tu_grad(ctx, g, a), *gb = tu_grad(ctx, g, b);
  tu_assert_f64(ga, (double[]){0.5, 0, 1}, 3, 0);
  tu_assert_f64(gb, (double[]){0.5, 1, 0}, 3, 0);
  dsp_tensor *list[] = {ga, gb, s, m};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
  dsp_grads_free(g);

  double xv[6] = {4, 1, 4, 2, 7, 3};
  dsp_tensor *x = tu_f64(ctx, 2, (int64_t[]){2, 3}, xv);
  cr_assert_eq(dsp_track(ctx, x), 0);
  int64_t d = 1;
  dsp_attrs ra = dsp_attrs_ints(1, &d);
  dsp_tensor *mx = tu_run(ctx, DSP_OP_MAX, &ra, 1, x, NULL, NULL);
  dsp_tensor *s2 = sum_all(mx);
  cr_assert_eq(dsp_backward(ctx, s2, 0, &g), 0);
  dsp_tensor *gx = tu_grad(ctx, g, x);
  tu_assert_f64(gx, (double[]){0.5, 0, 0.5, 0, 1, 0}, 6, 0);
  dsp_tensor *list2[] = {gx, s2, mx, x, a, b};
  for (size_t i = 0; i < sizeof list2 / sizeof list2[0]; i++)
    dsp_tensor_unref(list2[i]);
  dsp_grads_free(g);
}

Test(autodiff, backward_helper_ops_have_no_second_order_rule) {
  double v[2] = {-1, 2}, gv[2] = {1, 1};
  dsp_tensor *x = vec(v, 2), *go = vec(gv, 2);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_RELU_BACKWARD, NULL, 2, go, x, NULL);
  cr_assert(dsp_is_tracked(y));
  dsp_tensor *s = sum_all(y);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, s, 0, &g), DISPATCH_EUNSUPPORTED);
  cr_assert_not_null(strstr(dsp_ctx_errmsg(ctx), "relu_backward"));
  cr_assert_null(g);
  dsp_tensor *list[] = {s, y, go, x};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
    dsp_tensor_unref(list[i]);
}
