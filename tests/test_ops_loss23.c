/* issue 23: loss. cross_entropy_ex against values computed by hand and by
 * torch.nn.functional.cross_entropy (PyTorch 1.13, f64, numbers pasted
 * below), its fused backward op against torch's gradient and central
 * finite differences, the all-ignored batch, the 1-D form, bit-identity
 * with cross_entropy, the client function, and every validation error. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/tensor_util.h"
#include "ops_plan.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(loss23, .init = setup, .fini = teardown);

#define IGN (-100)

static dsp_attrs ce_attrs(int64_t ignore, double eps, int red) {
  int64_t v[2] = {ignore, red};
  dsp_attrs a = dsp_attrs_ints(2, v);
  a.floats[0] = eps;
  a.n_floats = 1;
  return a;
}

static dsp_tensor *blank(dsp_dtype dt, int nd, const int64_t *sh) {
  dsp_meta m = {dt, nd, {0}};
  for (int i = 0; i < nd; i++) m.shape[i] = sh[i];
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  return t;
}
static dsp_tensor *fl(dsp_dtype dt, int nd, const int64_t *sh, const double *v) {
  dsp_tensor *t = blank(dt, nd, sh);
  for (int64_t i = 0; i < t->numel; i++) tu_set(t, i, v[i]);
  return t;
}
/* the in-process device of the public API */
static dispatch_device *open_local(void) {
  dispatch_device *dev = NULL;
  char err[256];
  cr_assert_eq(dispatch_device_open("local", NULL, &dev, err, sizeof err), 0, "%s", err);
  return dev;
}

static dsp_tensor *ce(dsp_tensor *x, dsp_tensor *lab, int64_t ignore,
                      double eps, int red) {
  dsp_attrs a = ce_attrs(ignore, eps, red);
  return tu_run(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, x, lab, NULL);
}
static dsp_tensor *ce_bw(dsp_tensor *g, dsp_tensor *x, dsp_tensor *lab,
                         int64_t ignore, double eps, int red) {
  dsp_attrs a = ce_attrs(ignore, eps, red);
  return tu_run(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &a, 3, g, x, lab);
}

/* x [2,3,2,2] = ((7i mod 11) - 5) / 3, labels [2,2,2] with two ignored */
static const int64_t X4[4] = {2, 3, 2, 2}, L3[3] = {2, 2, 2};
static const int64_t LAB4[8] = {0, 2, IGN, 1, 1, IGN, 2, 0};
static void x4_values(double *v) {
  for (int i = 0; i < 24; i++) v[i] = (double)((i * 7) % 11 - 5) / 3.0;
}
/* torch 1.13: F.cross_entropy(x, lab, label_smoothing=0.1, reduction=...) */
static const double T_NONE[8] = {2.203038946565621,  0.6939718778275259,
                                 0.0,                1.8692397664699238,
                                 2.493971877827526,  0.0,
                                 3.369239766469924,  0.9939718778275258};
static const double T_SUM = 11.623434112988045, T_MEAN = 1.937239018831341;
static const double T_GRAD_MEAN[24] = {
    -0.1385221050858152,   0.05893174903473298,  0.0,
    0.13054890863758983,   0.1203055655237126,   0.006624522974304661,
    0.0,                   -0.12984874283219186, 0.018216539562102584,
    -0.06555627200903766,  0.0,                  -0.0007001658053979341,
    0.058931749034732986,  0.0,                  0.13054890863758983,
    -0.09106825096526701,  -0.14337547702569534, 0.0,
    0.020151257167808127,  0.006624522974304663, 0.08444372799096236,
    0.0,                   -0.15070016580539794, 0.08444372799096236};

Test(loss23, two_by_three_by_hand_with_an_ignored_class_index) {
  double v[6] = {1, 2, 3, 1, 1, 1};
  int64_t s[2] = {2, 3}, sl[1] = {2}, l[2] = {2, 0};
  double l0 = log(exp(1) + exp(2) + exp(3)) - 3, l1 = log(3.0);
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double tol = d ? 1e-14 : 1e-6;
    dsp_tensor *x = fl(dt, 2, s, v), *lab = tu_i64(ctx, 1, sl, l);
    dsp_tensor *y = ce(x, lab, IGN, 0, DSP_REDUCE_NONE);
    tu_assert_shape(y, 1, sl);
    cr_assert_eq(y->meta.dtype, dt);
    cr_assert_float_eq(tu_at(y, 0), l0, tol);
    cr_assert_float_eq(tu_at(y, 1), l1, tol);
    dsp_tensor_unref(y);
    y = ce(x, lab, IGN, 0, DSP_REDUCE_SUM);
    cr_assert_eq(y->meta.ndim, 0);
    cr_assert_float_eq(tu_at(y, 0), l0 + l1, tol);
    dsp_tensor_unref(y);
    /* ignore_index may be a class: label 0 of row 1 is ignored */
    y = ce(x, lab, 0, 0, DSP_REDUCE_NONE);
    cr_assert_float_eq(tu_at(y, 0), l0, tol);
    cr_assert_eq(tu_at(y, 1), 0.0);
    dsp_tensor_unref(y);
    y = ce(x, lab, 0, 0, DSP_REDUCE_MEAN); /* over 1 label, not 2 */
    cr_assert_float_eq(tu_at(y, 0), l0, tol);
    dsp_tensor_unref(y);
    /* smoothing 1: the mean over classes of -log p */
    y = ce(x, lab, IGN, 1.0, DSP_REDUCE_NONE);
    cr_assert_float_eq(tu_at(y, 0), l0 + 3 - 2, tol);
    cr_assert_float_eq(tu_at(y, 1), l1, tol);
    dsp_tensor_unref(y);
    dsp_tensor_unref(x), dsp_tensor_unref(lab);
  }
}

Test(loss23, spatial_logits_with_smoothing_match_torch) {
  double v[24];
  x4_values(v);
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double tol = d ? 1e-13 : 2e-6;
    dsp_tensor *x = fl(dt, 4, X4, v), *lab = tu_i64(ctx, 3, L3, LAB4);
    dsp_tensor *y = ce(x, lab, IGN, 0.1, DSP_REDUCE_NONE);
    tu_assert_shape(y, 3, L3);
    for (int i = 0; i < 8; i++) cr_assert_float_eq(tu_at(y, i), T_NONE[i], tol, "%d", i);
    dsp_tensor_unref(y);
    y = ce(x, lab, IGN, 0.1, DSP_REDUCE_SUM);
    cr_assert_float_eq(tu_at(y, 0), T_SUM, tol * 10);
    dsp_tensor_unref(y);
    y = ce(x, lab, IGN, 0.1, DSP_REDUCE_MEAN);
    cr_assert_float_eq(tu_at(y, 0), T_MEAN, tol);
    dsp_tensor_unref(y);
    double one = 1.0;
    dsp_tensor *g = fl(dt, 0, NULL, &one);
    dsp_tensor *gx = ce_bw(g, x, lab, IGN, 0.1, DSP_REDUCE_MEAN);
    tu_assert_shape(gx, 4, X4);
    for (int i = 0; i < 24; i++)
      cr_assert_float_eq(tu_at(gx, i), T_GRAD_MEAN[i], tol, "grad %d", i);
    dsp_tensor_unref(gx), dsp_tensor_unref(g);
    dsp_tensor_unref(x), dsp_tensor_unref(lab);
  }
}

/* sum(cross_entropy_ex(x) * G) for the finite differences */
typedef struct fd_ud {
  dsp_tensor *x, *lab, *G;
  int64_t ignore;
  double eps;
  int red;
} fd_ud;
static double fd_loss(fd_ud *u) {
  dsp_tensor *y = ce(u->x, u->lab, u->ignore, u->eps, u->red);
  double s = 0;
  for (int64_t i = 0; i < y->numel; i++) s += tu_at(y, i) * tu_at(u->G, i);
  dsp_tensor_unref(y);
  return s;
}

Test(loss23, backward_matches_finite_differences_for_every_reduction) {
  double v[24];
  x4_values(v);
  for (int red = 0; red < 3; red++)
    for (int e = 0; e < 2; e++) {
      dsp_tensor *x = fl(DSP_F64, 4, X4, v), *lab = tu_i64(ctx, 3, L3, LAB4);
      double gv[8] = {0.5, -1.25, 2.0, 0.75, 1.5, -0.5, 1.0, 0.25};
      dsp_tensor *G = fl(DSP_F64, red ? 0 : 3, L3, gv);
      fd_ud u = {x, lab, G, IGN, e ? 0.3 : 0.0, red};
      dsp_tensor *gx = ce_bw(G, x, lab, u.ignore, u.eps, red);
      const double h = 1e-6;
      for (int64_t i = 0; i < 24; i++) {
        double x0 = tu_at(x, i);
        tu_set(x, i, x0 + h);
        double fp = fd_loss(&u);
        tu_set(x, i, x0 - h);
        double fm = fd_loss(&u);
        tu_set(x, i, x0);
        double num = (fp - fm) / (2 * h);
        cr_assert(fabs(num - tu_at(gx, i)) <= 1e-7 * (1 + fabs(num)),
                  "red %d eps %g element %lld: analytic %.10g numeric %.10g",
                  red, u.eps, (long long)i, tu_at(gx, i), num);
      }
      dsp_tensor_unref(gx), dsp_tensor_unref(G);
      dsp_tensor_unref(x), dsp_tensor_unref(lab);
    }
}

Test(loss23, all_ignored_gives_nan_mean_zero_sum_and_zero_grad) {
  double v[24];
  x4_values(v);
  int64_t l[8];
  for (int i = 0; i < 8; i++) l[i] = IGN;
  dsp_tensor *x = fl(DSP_F32, 4, X4, v), *lab = tu_i64(ctx, 3, L3, l);
  dsp_tensor *y = ce(x, lab, IGN, 0.2, DSP_REDUCE_MEAN);
  cr_assert(isnan(tu_at(y, 0)), "mean of nothing is %g, want NaN", tu_at(y, 0));
  dsp_tensor_unref(y);
  y = ce(x, lab, IGN, 0.2, DSP_REDUCE_SUM);
  cr_assert_eq(tu_at(y, 0), 0.0);
  dsp_tensor_unref(y);
  y = ce(x, lab, IGN, 0.2, DSP_REDUCE_NONE);
  for (int i = 0; i < 8; i++) cr_assert_eq(tu_at(y, i), 0.0);
  dsp_tensor_unref(y);
  double one = 1.0;
  dsp_tensor *g = fl(DSP_F32, 0, NULL, &one);
  dsp_tensor *gx = ce_bw(g, x, lab, IGN, 0.2, DSP_REDUCE_MEAN);
  for (int i = 0; i < 24; i++) cr_assert_eq(tu_at(gx, i), 0.0, "grad %d", i);
  dsp_tensor_unref(gx), dsp_tensor_unref(g);
  dsp_tensor_unref(x), dsp_tensor_unref(lab);
}

Test(loss23, one_d_logits_and_an_empty_batch) {
  double v[3] = {1, 2, 3};
  int64_t c3[1] = {3}, one = 1;
  dsp_tensor *x = fl(DSP_F64, 1, c3, v), *lab = tu_i64(ctx, 0, NULL, &one);
  dsp_tensor *y = ce(x, lab, IGN, 0, DSP_REDUCE_MEAN);
  cr_assert_float_eq(tu_at(y, 0), 1.4076059644443804, 1e-14); /* torch */
  dsp_tensor_unref(y);
  y = ce(x, lab, IGN, 0, DSP_REDUCE_NONE);
  cr_assert_eq(y->meta.ndim, 0);
  dsp_tensor_unref(y), dsp_tensor_unref(x), dsp_tensor_unref(lab);
  /* N = 0: none is empty, sum 0, mean NaN (torch's answers) */
  int64_t s0[2] = {0, 4}, n0[1] = {0};
  dsp_tensor *xe = fl(DSP_F32, 2, s0, v), *le = tu_i64(ctx, 1, n0, NULL);
  y = ce(xe, le, IGN, 0, DSP_REDUCE_NONE);
  tu_assert_shape(y, 1, n0);
  dsp_tensor_unref(y);
  y = ce(xe, le, IGN, 0, DSP_REDUCE_SUM);
  cr_assert_eq(tu_at(y, 0), 0.0);
  dsp_tensor_unref(y);
  y = ce(xe, le, IGN, 0, DSP_REDUCE_MEAN);
  cr_assert(isnan(tu_at(y, 0)));
  dsp_tensor_unref(y), dsp_tensor_unref(xe), dsp_tensor_unref(le);
  /* [2^40, 3, 0]: no position, and the huge dim is never walked */
  int64_t sh[3] = {(int64_t)1 << 40, 3, 0}, lh[2] = {(int64_t)1 << 40, 0};
  xe = fl(DSP_F32, 3, sh, v), le = tu_i64(ctx, 2, lh, NULL);
  y = ce(xe, le, IGN, 0.5, DSP_REDUCE_SUM);
  cr_assert_eq(tu_at(y, 0), 0.0);
  dsp_tensor_unref(y), dsp_tensor_unref(xe), dsp_tensor_unref(le);
}

Test(loss23, defaults_give_cross_entropy_bit_for_bit) {
  int64_t s[2] = {7, 11}, sl[1] = {7}, l[7] = {0, 10, 3, 3, 5, 9, 1};
  double v[77];
  for (int i = 0; i < 77; i++) v[i] = sin(0.37 * i) * 4;
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    dsp_tensor *x = fl(dt, 2, s, v), *lab = tu_i64(ctx, 1, sl, l);
    dsp_attrs none = dsp_attrs_none();
    dsp_tensor *old = tu_run(ctx, DSP_OP_CROSS_ENTROPY, &none, 2, x, lab, NULL);
    dsp_tensor *y = ce(x, lab, IGN, 0, DSP_REDUCE_MEAN);
    cr_assert_eq(memcmp(dsp_tensor_data(old), dsp_tensor_data(y),
                        dsp_tensor_nbytes(y)), 0, "loss differs");
    double gv = 0.625;
    dsp_tensor *g = fl(dt, 0, NULL, &gv);
    dsp_tensor *gold = tu_run(ctx, DSP_OP_CROSS_ENTROPY_BACKWARD, &none, 3, g, x, lab);
    dsp_tensor *gnew = ce_bw(g, x, lab, IGN, 0, DSP_REDUCE_MEAN);
    cr_assert_eq(memcmp(dsp_tensor_data(gold), dsp_tensor_data(gnew),
                        dsp_tensor_nbytes(gnew)), 0, "gradient differs");
    dsp_tensor_unref(g), dsp_tensor_unref(gold), dsp_tensor_unref(gnew);
    dsp_tensor_unref(old), dsp_tensor_unref(y);
    dsp_tensor_unref(x), dsp_tensor_unref(lab);
  }
}

Test(loss23, autodiff_uses_the_fused_backward) {
  double v[24];
  x4_values(v);
  dsp_tensor *x = fl(DSP_F64, 4, X4, v), *lab = tu_i64(ctx, 3, L3, LAB4);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_tensor *y = ce(x, lab, IGN, 0.1, DSP_REDUCE_MEAN);
  dsp_grads *g = NULL;
  cr_assert_eq(dsp_backward(ctx, y, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *gx = NULL;
  cr_assert_eq(dsp_grads_get(ctx, g, x, &gx), 0);
  tu_assert_f64(gx, T_GRAD_MEAN, 24, 1e-13);
  dsp_tensor_unref(gx), dsp_grads_free(g), dsp_tensor_unref(y);
  dsp_tensor_unref(x), dsp_tensor_unref(lab);
}

Test(loss23, errors_name_the_problem) {
  double v[24];
  x4_values(v);
  int64_t s[2] = {2, 3}, sl[1] = {2}, sl3[1] = {3}, c0[2] = {2, 0};
  int64_t bad[2] = {1, 3}, neg[2] = {-1, 0}, ok[3] = {0, 1, 0}; /* l3 reads all 3 */
  dsp_tensor *x = fl(DSP_F32, 2, s, v), *lb = tu_i64(ctx, 1, sl, bad);
  dsp_tensor *ln = tu_i64(ctx, 1, sl, neg), *lok = tu_i64(ctx, 1, sl, ok);
  dsp_tensor *l3 = tu_i64(ctx, 1, sl3, ok), *lf = fl(DSP_F32, 1, sl, v);
  int64_t six[6] = {0};
  dsp_tensor *xi = tu_i64(ctx, 2, s, six), *xc0 = fl(DSP_F32, 2, c0, v);
  dsp_attrs a = ce_attrs(IGN, 0, DSP_REDUCE_MEAN);
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, x, lb, NULL, DISPATCH_EINDEX,
              "label 3 at position 1 out of range for 3 classes");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, x, ln, NULL, DISPATCH_EINDEX,
              "label -1 at position 0");
  /* -1 is fine when it is the ignore_index */
  dsp_attrs am1 = ce_attrs(-1, 0, DSP_REDUCE_NONE);
  dsp_tensor *y = tu_run(ctx, DSP_OP_CROSS_ENTROPY_EX, &am1, 2, x, ln, NULL);
  cr_assert_eq(tu_at(y, 0), 0.0);
  dsp_tensor_unref(y);
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, x, l3, NULL, DISPATCH_ESHAPE,
              "do not match logits");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, x, lf, NULL, DISPATCH_EDTYPE,
              "labels must be i64");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, xi, lok, NULL, DISPATCH_EDTYPE,
              "logits must be f32 or f64");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &a, 2, xc0, lok, NULL, DISPATCH_ESHAPE,
              "no classes");
  dsp_attrs r3 = ce_attrs(IGN, 0, 3), sm = ce_attrs(IGN, 1.5, 2),
            snan = ce_attrs(IGN, NAN, 2), few = dsp_attrs_ints(1, sl);
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &r3, 2, x, lok, NULL, DISPATCH_EINVAL,
              "reduction 3");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &sm, 2, x, lok, NULL, DISPATCH_EINVAL,
              "label_smoothing 1.5 outside [0, 1]");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &snan, 2, x, lok, NULL, DISPATCH_EINVAL,
              "label_smoothing");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX, &few, 2, x, lok, NULL, DISPATCH_EINVAL,
              "ignore_index, reduction");
  /* backward: the grad must have the forward output's shape and dtype */
  double gv[2] = {1, 1};
  dsp_tensor *g0 = fl(DSP_F32, 0, NULL, gv), *g2 = fl(DSP_F32, 1, sl, gv);
  dsp_tensor *g2d = fl(DSP_F64, 1, sl, gv);
  dsp_attrs an = ce_attrs(IGN, 0, DSP_REDUCE_NONE);
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &a, 3, g2, x, lok,
              DISPATCH_ESHAPE, "but the loss is");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &an, 3, g0, x, lok,
              DISPATCH_ESHAPE, "but the loss is");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &an, 3, g2d, x, lok,
              DISPATCH_EDTYPE, "grad is f64");
  tu_run_fail(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &a, 3, g0, x, lb,
              DISPATCH_EINDEX, "label 3");
  dsp_tensor *gx = tu_run(ctx, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &an, 3, g2, x, lok);
  tu_assert_shape(gx, 2, s);
  dsp_tensor_unref(gx);
  dsp_tensor_unref(g0), dsp_tensor_unref(g2), dsp_tensor_unref(g2d);
  dsp_tensor_unref(x), dsp_tensor_unref(lb), dsp_tensor_unref(ln);
  dsp_tensor_unref(lok), dsp_tensor_unref(l3), dsp_tensor_unref(lf);
  dsp_tensor_unref(xi), dsp_tensor_unref(xc0);
}

/* The public function packs the attributes the op reads. */
Test(loss23, client_function_local) {
  dispatch_device *dev = open_local();
  double v[24];
  x4_values(v);
  dispatch_tensor *x = NULL, *lab = NULL, *y = NULL;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 4, X4, v, sizeof v, &x), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_I64, 3, L3, LAB4, sizeof LAB4, &lab), 0);
  cr_assert_eq(dispatch_cross_entropy_ex(x, lab, IGN, 0.1, DISPATCH_REDUCE_NONE, &y), 0);
  double got[8];
  cr_assert_eq(dispatch_tensor_read(y, got, sizeof got), 0);
  for (int i = 0; i < 8; i++) cr_assert_float_eq(got[i], T_NONE[i], 1e-13);
  dispatch_tensor_free(y);
  cr_assert_eq(dispatch_cross_entropy_ex(x, lab, IGN, 0.1, 7, &y), DISPATCH_EINVAL);
  cr_assert_null(y);
  dispatch_tensor_free(x), dispatch_tensor_free(lab);
  dispatch_device_close(dev);
}

/* ---- pools: stride 0 = kernel, count_include_pad ------------------- */

static dsp_attrs pool7(int64_t k, int64_t s, int64_t p, int64_t cip) {
  int64_t v[7] = {k, k, s, s, p, p, cip};
  return dsp_attrs_ints(7, v);
}

/* torch 1.13: F.avg_pool2d(arange(20).reshape(1,1,4,5), 3, stride=2,
 * padding=1, count_include_pad=...), and the gradient of
 * sum(y * [1..6]) */
static const double T_AVG_INC[6] = {1.3333333333333333, 3.0, 2.6666666666666665,
                                    7.0, 12.0, 9.0};
static const double T_AVG_EXC[6] = {3.0, 4.5, 6.0, 10.5, 12.0, 13.5};
static const double T_AVG_EXC_GRAD[20] = {
    0.25, 0.5833333333333333, 0.3333333333333333, 1.0833333333333333, 0.75,
    0.9166666666666666, 1.8055555555555556, 0.8888888888888888,
    2.638888888888889, 1.75, 0.6666666666666666, 1.2222222222222223,
    0.5555555555555556, 1.5555555555555556, 1.0, 0.6666666666666666,
    1.2222222222222223, 0.5555555555555556, 1.5555555555555556, 1.0};

Test(loss23, avg_pool2d_ex_count_include_pad_matches_torch) {
  double v[20], gv[6] = {1, 2, 3, 4, 5, 6};
  for (int i = 0; i < 20; i++) v[i] = i;
  int64_t xs[4] = {1, 1, 4, 5}, ys[4] = {1, 1, 2, 3};
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double tol = d ? 1e-14 : 2e-6;
    dsp_tensor *x = fl(dt, 4, xs, v);
    for (int cip = 0; cip < 2; cip++) {
      dsp_attrs a = pool7(3, 2, 1, cip);
      dsp_tensor *y = tu_run(ctx, DSP_OP_AVG_POOL2D_EX, &a, 1, x, NULL, NULL);
      tu_assert_shape(y, 4, ys);
      for (int i = 0; i < 6; i++)
        cr_assert_float_eq(tu_at(y, i), cip ? T_AVG_INC[i] : T_AVG_EXC[i], tol,
                           "cip %d y[%d]", cip, i);
      if (cip) { /* the old op is the count_include_pad case, bit for bit */
        dsp_attrs a6 = dsp_attrs_ints(6, a.ints);
        dsp_tensor *y6 = tu_run(ctx, DSP_OP_AVG_POOL2D, &a6, 1, x, NULL, NULL);
        cr_assert_eq(memcmp(dsp_tensor_data(y6), dsp_tensor_data(y),
                            dsp_tensor_nbytes(y)), 0);
        dsp_tensor_unref(y6);
      } else {
        dsp_tensor *g = fl(dt, 4, ys, gv);
        dsp_tensor *gx = tu_run(ctx, DSP_OP_AVG_POOL2D_BACKWARD, &a, 2, g, x, NULL);
        for (int i = 0; i < 20; i++)
          cr_assert_float_eq(tu_at(gx, i), T_AVG_EXC_GRAD[i], tol, "grad %d", i);
        dsp_tensor_unref(gx), dsp_tensor_unref(g);
      }
      dsp_tensor_unref(y);
    }
    dsp_tensor_unref(x);
  }
}

Test(loss23, avg_pool2d_ex_autodiff_uses_the_divisor) {
  double v[20];
  for (int i = 0; i < 20; i++) v[i] = i;
  int64_t xs[4] = {1, 1, 4, 5}, ys[4] = {1, 1, 2, 3};
  dsp_tensor *x = fl(DSP_F64, 4, xs, v);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_attrs a = pool7(3, 2, 1, 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_AVG_POOL2D_EX, &a, 1, x, NULL, NULL);
  double wv[6] = {1, 2, 3, 4, 5, 6};
  dsp_tensor *w = fl(DSP_F64, 4, ys, wv);
  dsp_tensor *p = tu_run(ctx, DSP_OP_MUL, NULL, 2, y, w, NULL);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, p, NULL, NULL);
  dsp_grads *g = NULL;
  cr_assert_eq(dsp_backward(ctx, l, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *gx = NULL;
  cr_assert_eq(dsp_grads_get(ctx, g, x, &gx), 0);
  tu_assert_f64(gx, T_AVG_EXC_GRAD, 20, 1e-14);
  dsp_tensor_unref(gx), dsp_grads_free(g), dsp_tensor_unref(l);
  dsp_tensor_unref(p), dsp_tensor_unref(w), dsp_tensor_unref(y);
  dsp_tensor_unref(x);
}

Test(loss23, pool_stride_0_is_the_kernel) {
  double v[36];
  for (int i = 0; i < 36; i++) v[i] = sin(i * 0.7);
  int64_t xs[4] = {1, 1, 6, 6};
  dsp_tensor *x = fl(DSP_F32, 4, xs, v);
  int64_t z[6] = {3, 2, 0, 0, 1, 1}, k[6] = {3, 2, 3, 2, 1, 1};
  dsp_attrs az = dsp_attrs_ints(6, z), ak = dsp_attrs_ints(6, k);
  static const dsp_opcode ops[2] = {DSP_OP_MAX_POOL2D, DSP_OP_AVG_POOL2D};
  for (int o = 0; o < 2; o++) {
    dsp_tensor *y0 = tu_run(ctx, ops[o], &az, 1, x, NULL, NULL);
    dsp_tensor *yk = tu_run(ctx, ops[o], &ak, 1, x, NULL, NULL);
    int64_t ys[4] = {1, 1, 2, 4};
    tu_assert_shape(y0, 4, ys);
    cr_assert_eq(memcmp(dsp_tensor_data(y0), dsp_tensor_data(yk),
                        dsp_tensor_nbytes(yk)), 0);
    dsp_tensor_unref(y0), dsp_tensor_unref(yk);
  }
  dsp_tensor_unref(x);
}

Test(loss23, pool_ex_errors) {
  double v[16] = {0};
  int64_t xs[4] = {1, 1, 4, 4};
  dsp_tensor *x = fl(DSP_F32, 4, xs, v);
  dsp_attrs a2 = pool7(2, 2, 0, 2), a6 = dsp_attrs_ints(6, a2.ints);
  tu_run_fail(ctx, DSP_OP_AVG_POOL2D_EX, &a2, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "count_include_pad = 2 is not 0 or 1");
  tu_run_fail(ctx, DSP_OP_AVG_POOL2D_EX, &a6, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "takes 7..7 ints");
  dsp_attrs a7 = pool7(2, 2, 0, 0);
  tu_run_fail(ctx, DSP_OP_MAX_POOL2D, &a7, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "takes 2..6 ints");
  dsp_attrs neg = pool7(2, -1, 0, 1);
  tu_run_fail(ctx, DSP_OP_AVG_POOL2D_EX, &neg, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "stride -1x-1");
  dsp_tensor_unref(x);
}

Test(loss23, client_avg_pool2d_ex_local) {
  dispatch_device *dev = open_local();
  double v[20], got[6];
  for (int i = 0; i < 20; i++) v[i] = i;
  int64_t xs[4] = {1, 1, 4, 5};
  dispatch_tensor *x = NULL, *y = NULL;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 4, xs, v, sizeof v, &x), 0);
  cr_assert_eq(dispatch_avg_pool2d_ex(x, 3, 3, 2, 2, 1, 1, 0, &y), 0);
  cr_assert_eq(dispatch_tensor_read(y, got, sizeof got), 0);
  for (int i = 0; i < 6; i++) cr_assert_float_eq(got[i], T_AVG_EXC[i], 1e-14);
  dispatch_tensor_free(y);
  cr_assert_eq(dispatch_avg_pool2d_ex(x, 3, 3, 0, 0, 1, 1, 1, &y), 0);
  cr_assert_eq(dispatch_tensor_read(y, got, sizeof(double) * 4), 0); /* 2x2 */
  cr_assert_float_eq(got[0], 12.0 / 9.0, 1e-14); /* (0+1+5+6)/9 */
  dispatch_tensor_free(y), dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

/* ---- conv2d_bias ---------------------------------------------------- */

static void fill_sin(dsp_tensor *t, double k) {
  for (int64_t i = 0; i < t->numel; i++) tu_set(t, i, sin(k * (double)(i + 1)));
}

Test(loss23, conv2d_bias_is_conv2d_plus_bias_bit_for_bit) {
  int64_t xs[4] = {2, 3, 6, 5}, ws[4] = {4, 3, 3, 2}, bs[1] = {4}, b4[4] = {1, 4, 1, 1};
  int64_t ci[6] = {2, 1, 1, 0, 1, 2};
  dsp_attrs a = dsp_attrs_ints(6, ci), r = dsp_attrs_ints(4, b4);
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    dsp_tensor *x = blank(dt, 4, xs), *w = blank(dt, 4, ws), *b = blank(dt, 1, bs);
    fill_sin(x, 0.37), fill_sin(w, 1.3), fill_sin(b, 2.1);
    dsp_tensor *y = tu_run(ctx, DSP_OP_CONV2D_BIAS, &a, 3, x, w, b);
    dsp_tensor *c = tu_run(ctx, DSP_OP_CONV2D, &a, 2, x, w, NULL);
    dsp_tensor *br = tu_run(ctx, DSP_OP_RESHAPE, &r, 1, b, NULL, NULL);
    dsp_tensor *want = tu_run(ctx, DSP_OP_ADD, NULL, 2, c, br, NULL);
    cr_assert(dsp_meta_equal(&y->meta, &want->meta));
    cr_assert_eq(memcmp(dsp_tensor_data(y), dsp_tensor_data(want),
                        dsp_tensor_nbytes(y)), 0, "%s", dsp_dtype_name(dt));
    dsp_tensor_unref(y), dsp_tensor_unref(c), dsp_tensor_unref(br);
    dsp_tensor_unref(want), dsp_tensor_unref(x), dsp_tensor_unref(w);
    dsp_tensor_unref(b);
  }
}

Test(loss23, conv2d_bias_gradients) {
  int64_t xs[4] = {2, 2, 5, 4}, ws[4] = {3, 2, 2, 2}, bs[1] = {3};
  int64_t ci[6] = {1, 1, 1, 1, 1, 1};
  dsp_attrs a = dsp_attrs_ints(6, ci);
  dsp_tensor *x = blank(DSP_F64, 4, xs), *w = blank(DSP_F64, 4, ws),
             *b = blank(DSP_F64, 1, bs);
  fill_sin(x, 0.5), fill_sin(w, 0.9), fill_sin(b, 1.7);
  dsp_tensor *ts[3] = {x, w, b};
  for (int i = 0; i < 3; i++) cr_assert_eq(dsp_track(ctx, ts[i]), 0);
  dsp_tensor *y = tu_run(ctx, DSP_OP_CONV2D_BIAS, &a, 3, x, w, b);
  int64_t ys[4] = {2, 3, 6, 5};
  tu_assert_shape(y, 4, ys);
  dsp_tensor *G = blank(DSP_F64, 4, ys);
  fill_sin(G, 0.11);
  dsp_tensor *p = tu_run(ctx, DSP_OP_MUL, NULL, 2, y, G, NULL);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, p, NULL, NULL);
  dsp_grads *g = NULL;
  cr_assert_eq(dsp_backward(ctx, l, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *gb = NULL, *gw = NULL, *gx = NULL;
  cr_assert_eq(dsp_grads_get(ctx, g, b, &gb), 0);
  cr_assert_eq(dsp_grads_get(ctx, g, w, &gw), 0);
  cr_assert_eq(dsp_grads_get(ctx, g, x, &gx), 0);
  double want[3] = {0, 0, 0};
  for (int64_t i = 0; i < G->numel; i++) want[(i / 30) % 3] += tu_at(G, i);
  tu_assert_f64(gb, want, 3, 1e-12);
  /* x and w get conv2d's gradients, bit for bit */
  int64_t bi[10] = {1, 1, 1, 1, 1, 1, 2, 2, 5, 4}, bw[10] = {1, 1, 1, 1, 1, 1, 3, 2, 2, 2};
  dsp_attrs ai = dsp_attrs_ints(10, bi), aw = dsp_attrs_ints(10, bw);
  dsp_tensor *wx = tu_run(ctx, DSP_OP_CONV2D_BACKWARD_INPUT, &ai, 2, G, w, NULL);
  dsp_tensor *ww = tu_run(ctx, DSP_OP_CONV2D_BACKWARD_WEIGHT, &aw, 2, G, x, NULL);
  cr_assert_eq(memcmp(dsp_tensor_data(gx), dsp_tensor_data(wx), dsp_tensor_nbytes(wx)), 0);
  cr_assert_eq(memcmp(dsp_tensor_data(gw), dsp_tensor_data(ww), dsp_tensor_nbytes(ww)), 0);
  dsp_tensor_unref(wx), dsp_tensor_unref(ww);
  dsp_tensor_unref(gb), dsp_tensor_unref(gw), dsp_tensor_unref(gx);
  dsp_grads_free(g), dsp_tensor_unref(l), dsp_tensor_unref(p), dsp_tensor_unref(G);
  dsp_tensor_unref(y), dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(b);
}

Test(loss23, conv2d_bias_errors) {
  int64_t xs[4] = {1, 2, 4, 4}, ws[4] = {3, 2, 2, 2}, b2[1] = {2}, b3[1] = {3},
          b13[2] = {1, 3};
  dsp_tensor *x = blank(DSP_F32, 4, xs), *w = blank(DSP_F32, 4, ws);
  dsp_tensor *bs = blank(DSP_F32, 1, b2), *bm = blank(DSP_F32, 2, b13),
             *bd = blank(DSP_F64, 1, b3);
  fill_sin(x, 1), fill_sin(w, 1), fill_sin(bs, 1), fill_sin(bm, 1), fill_sin(bd, 1);
  dsp_attrs none = dsp_attrs_none();
  tu_run_fail(ctx, DSP_OP_CONV2D_BIAS, &none, 3, x, w, bs, DISPATCH_ESHAPE,
              "bias must be [3] (one per output channel), got [2]");
  tu_run_fail(ctx, DSP_OP_CONV2D_BIAS, &none, 3, x, w, bm, DISPATCH_ESHAPE,
              "bias must be [3]");
  tu_run_fail(ctx, DSP_OP_CONV2D_BIAS, &none, 3, x, w, bd, DISPATCH_EDTYPE,
              "dtypes f32 and f64 differ");
  dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(bs);
  dsp_tensor_unref(bm), dsp_tensor_unref(bd);
}

Test(loss23, client_conv2d_bias_local) {
  dispatch_device *dev = open_local();
  double xv[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, wv[4] = {1, 0, 0, 1}, bv[1] = {0.5};
  int64_t xs[4] = {1, 1, 3, 3}, ws[4] = {1, 1, 2, 2}, bs[1] = {1};
  dispatch_tensor *x = NULL, *w = NULL, *b = NULL, *y = NULL, *y0 = NULL;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 4, xs, xv, sizeof xv, &x), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 4, ws, wv, sizeof wv, &w), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F64, 1, bs, bv, sizeof bv, &b), 0);
  cr_assert_eq(dispatch_conv2d_bias(x, w, b, 1, 1, 0, 0, 1, 1, &y), 0);
  double got[4], want[4] = {1 + 5 + 0.5, 2 + 6 + 0.5, 4 + 8 + 0.5, 5 + 9 + 0.5};
  cr_assert_eq(dispatch_tensor_read(y, got, sizeof got), 0);
  for (int i = 0; i < 4; i++) cr_assert_eq(got[i], want[i]);
  cr_assert_eq(dispatch_conv2d_bias(x, w, NULL, 1, 1, 0, 0, 1, 1, &y0), 0);
  cr_assert_eq(dispatch_tensor_read(y0, got, sizeof got), 0);
  for (int i = 0; i < 4; i++) cr_assert_eq(got[i], want[i] - 0.5);
  dispatch_tensor_free(y), dispatch_tensor_free(y0), dispatch_tensor_free(b);
  dispatch_tensor_free(w), dispatch_tensor_free(x);
  dispatch_device_close(dev);
}
