/* nn ops: forward values by hand or against naive loops, every backward op
 * against central finite differences of its forward op (f64), and the
 * validation errors with their codes and messages. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/failalloc.h"
#include "helpers/tensor_util.h"
#include "rng.h"

/* ---- small local helpers ------------------------------------------ */

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static double urand(void) { /* xorshift64 in [-1, 1): deterministic data */
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static dsp_tensor *mk(dsp_ctx *ctx, dsp_dtype dt, int nd, const int64_t *shape,
                      const double *v) {
  dsp_meta m = {dt, nd, {0}};
  for (int i = 0; i < nd; i++) m.shape[i] = shape[i];
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int64_t i = 0; i < t->numel; i++) {
    double x = v ? v[i] : urand();
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)x;
    else if (dt == DSP_F64) ((double *)dsp_tensor_data(t))[i] = x;
    else if (dt == DSP_I64) ((int64_t *)dsp_tensor_data(t))[i] = (int64_t)x;
  }
  return t;
}

static int try_op(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                  dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2,
                  dsp_tensor **out) {
  dsp_tensor *in[3] = {x0, x1, x2};
  int n = x2 ? 3 : x1 ? 2 : 1;
  return dsp_op(ctx, op, in, n, a, out);
}

static dsp_tensor *run(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                       dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2) {
  dsp_tensor *out = NULL;
  int rc = try_op(ctx, op, a, x0, x1, x2, &out);
  cr_assert_eq(rc, 0, "%s failed: %s", dsp_op_lookup(op)->name,
               dsp_ctx_errmsg(ctx));
  return out;
}

static void expect_err(dsp_ctx *ctx, int code, const char *sub, dsp_opcode op,
                       const dsp_attrs *a, dsp_tensor *x0, dsp_tensor *x1,
                       dsp_tensor *x2) {
  dsp_tensor *out = (dsp_tensor *)1;
  int rc = try_op(ctx, op, a, x0, x1, x2, &out);
  cr_assert_eq(rc, code, "%s: rc %s, want %s (%s)", dsp_op_lookup(op)->name,
               dispatch_err_name(rc), dispatch_err_name(code),
               dsp_ctx_errmsg(ctx));
  cr_assert_null(out);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), sub), "message '%s' lacks '%s'",
            dsp_ctx_errmsg(ctx), sub);
}

static dsp_attrs ints(int n, const int64_t *v) { return dsp_attrs_ints(n, v); }
static dsp_attrs dim1(int64_t d) { return dsp_attrs_ints(1, &d); }

static void assert_close(const dsp_tensor *t, const double *want, int64_t n,
                         double tol) {
  cr_assert_eq(t->numel, n, "numel %lld, want %lld", (long long)t->numel,
               (long long)n);
  for (int64_t i = 0; i < n; i++)
    cr_assert(fabs(tu_at(t, i) - want[i]) <= tol, "element %lld: got %.10g want %.10g",
              (long long)i, tu_at(t, i), want[i]);
}

/* sum(f(x) * G) as a function of x, the scalar a finite difference needs */
typedef double (*scalar_fn)(dsp_ctx *ctx, void *ud);

/* Central differences of fn w.r.t. every element of x, against `grad`. */
static void fd_check(dsp_ctx *ctx, dsp_tensor *x, const dsp_tensor *grad,
                     scalar_fn fn, void *ud, double tol) {
  const double h = 1e-6;
  cr_assert_eq(x->numel, grad->numel);
  for (int64_t i = 0; i < x->numel; i++) {
    double x0 = tu_at(x, i);
    tu_set(x, i, x0 + h);
    double fp = fn(ctx, ud);
    tu_set(x, i, x0 - h);
    double fm = fn(ctx, ud);
    tu_set(x, i, x0);
    double num = (fp - fm) / (2 * h);
    cr_assert(fabs(num - tu_at(grad, i)) <= tol * (1 + fabs(num)),
              "element %lld: analytic %.10g numeric %.10g", (long long)i,
              tu_at(grad, i), num);
  }
}

/* sum(op(x0, x1) * G) for a forward op */
typedef struct fwd_ud {
  dsp_opcode op;
  dsp_attrs a;
  dsp_tensor *x0, *x1, *G;
} fwd_ud;

static double fwd_dot(dsp_ctx *ctx, void *p) {
  fwd_ud *u = p;
  dsp_tensor *y = run(ctx, u->op, &u->a, u->x0, u->x1, NULL);
  double s = 0;
  for (int64_t i = 0; i < y->numel; i++) s += tu_at(y, i) * (u->G ? tu_at(u->G, i) : 1.0);
  dsp_tensor_unref(y);
  return s;
}

/* ---- softmax family ------------------------------------------------ */

Test(softmax, rows_by_hand_and_stable_for_large_inputs) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double v[6] = {1, 2, 3, 1000, 1001, 1002};
  int64_t s[2] = {2, 3};
  dsp_tensor *x = mk(ctx, DSP_F32, 2, s, v);
  dsp_attrs a = dim1(-1);
  dsp_tensor *y = run(ctx, DSP_OP_SOFTMAX, &a, x, NULL, NULL);
  double want[6] = {0.09003057317038046, 0.24472847105479767, 0.6652409557748219,
                    0.09003057317038046, 0.24472847105479767, 0.6652409557748219};
  assert_close(y, want, 6, 1e-7);
  dsp_tensor *ly = run(ctx, DSP_OP_LOG_SOFTMAX, &a, x, NULL, NULL);
  for (int i = 0; i < 6; i++) want[i] = log(want[i]);
  assert_close(ly, want, 6, 1e-6);
  dsp_tensor_unref(x), dsp_tensor_unref(y), dsp_tensor_unref(ly);
  dsp_ctx_free(ctx);
}

Test(softmax, along_a_middle_dim_matches_naive) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[3] = {2, 3, 4};
  dsp_tensor *x = mk(ctx, DSP_F64, 3, s, NULL);
  dsp_attrs a = dim1(1);
  dsp_tensor *y = run(ctx, DSP_OP_SOFTMAX, &a, x, NULL, NULL);
  dsp_tensor *ly = run(ctx, DSP_OP_LOG_SOFTMAX, &a, x, NULL, NULL);
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 4; k++) {
      double z = 0;
      for (int j = 0; j < 3; j++) z += exp(tu_at(x, i * 12 + j * 4 + k));
      for (int j = 0; j < 3; j++) {
        int64_t e = i * 12 + j * 4 + k;
        cr_assert_float_eq(tu_at(y, e), exp(tu_at(x, e)) / z, 1e-14);
        cr_assert_float_eq(tu_at(ly, e), tu_at(x, e) - log(z), 1e-14);
      }
    }
  dsp_tensor_unref(x), dsp_tensor_unref(y), dsp_tensor_unref(ly);
  dsp_ctx_free(ctx);
}

typedef struct sm_ud {
  dsp_opcode op;
  int64_t dim;
  dsp_tensor *x, *G;
} sm_ud;

static double sm_dot(dsp_ctx *ctx, void *p) {
  sm_ud *u = p;
  fwd_ud f = {u->op, dim1(u->dim), u->x, NULL, u->G};
  return fwd_dot(ctx, &f);
}

Test(softmax, backward_ops_match_finite_differences) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[3] = {2, 4, 3};
  dsp_opcode fw[2] = {DSP_OP_SOFTMAX, DSP_OP_LOG_SOFTMAX};
  dsp_opcode bw[2] = {DSP_OP_SOFTMAX_BACKWARD, DSP_OP_LOG_SOFTMAX_BACKWARD};
  for (int k = 0; k < 2; k++)
    for (int64_t dim = -1; dim <= 1; dim++) {
      dsp_tensor *x = mk(ctx, DSP_F64, 3, s, NULL), *G = mk(ctx, DSP_F64, 3, s, NULL);
      dsp_attrs a = dim1(dim);
      dsp_tensor *y = run(ctx, fw[k], &a, x, NULL, NULL);
      dsp_tensor *gx = run(ctx, bw[k], &a, G, y, NULL);
      sm_ud u = {fw[k], dim, x, G};
      fd_check(ctx, x, gx, sm_dot, &u, 1e-7);
      dsp_tensor_unref(x), dsp_tensor_unref(G), dsp_tensor_unref(y),
          dsp_tensor_unref(gx);
    }
  dsp_ctx_free(ctx);
}

Test(softmax_errors, dims_attrs_dtypes_and_shapes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[2] = {2, 3}, s2[2] = {3, 2};
  dsp_tensor *x = mk(ctx, DSP_F32, 2, s, NULL), *xd = mk(ctx, DSP_F64, 2, s, NULL);
  dsp_tensor *xi = mk(ctx, DSP_I64, 2, s, NULL), *x2 = mk(ctx, DSP_F32, 2, s2, NULL);
  dsp_attrs bad = dim1(2), none = dsp_attrs_none(), ok = dim1(-1);
  expect_err(ctx, DISPATCH_EDIM, "dim 2 out of range", DSP_OP_SOFTMAX, &bad, x,
             NULL, NULL);
  expect_err(ctx, DISPATCH_EINVAL, "takes 1 int", DSP_OP_LOG_SOFTMAX, &none, x,
             NULL, NULL);
  expect_err(ctx, DISPATCH_EDTYPE, "i64", DSP_OP_SOFTMAX, &ok, xi, NULL, NULL);
  expect_err(ctx, DISPATCH_EDTYPE, "f32 and f64", DSP_OP_SOFTMAX_BACKWARD, &ok,
             x, xd, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "[2, 3] and [3, 2]",
             DSP_OP_LOG_SOFTMAX_BACKWARD, &ok, x, x2, NULL);
  dsp_tensor_unref(x), dsp_tensor_unref(xd), dsp_tensor_unref(xi),
      dsp_tensor_unref(x2);
  dsp_ctx_free(ctx);
}

/* ---- cross entropy and mse ----------------------------------------- */

Test(cross_entropy, mean_loss_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double v[6] = {1, 2, 3, 1, 1, 1}, l[2] = {2, 0};
  int64_t s[2] = {2, 3}, sl[1] = {2};
  dsp_attrs none = dsp_attrs_none();
  for (int d = 0; d < 2; d++) {
    dsp_tensor *x = mk(ctx, d ? DSP_F64 : DSP_F32, 2, s, v);
    dsp_tensor *lab = mk(ctx, DSP_I64, 1, sl, l);
    dsp_tensor *loss = run(ctx, DSP_OP_CROSS_ENTROPY, &none, x, lab, NULL);
    cr_assert_eq(loss->meta.ndim, 0);
    cr_assert_eq(loss->meta.dtype, x->meta.dtype);
    double want = (log(exp(1) + exp(2) + exp(3)) - 3 + log(3.0)) / 2;
    cr_assert_float_eq(tu_at(loss, 0), want, d ? 1e-14 : 1e-6);
    dsp_tensor_unref(x), dsp_tensor_unref(lab), dsp_tensor_unref(loss);
  }
  dsp_ctx_free(ctx);
}

typedef struct ce_ud {
  dsp_tensor *x, *lab;
} ce_ud;
static double ce_loss(dsp_ctx *ctx, void *p) {
  ce_ud *u = p;
  dsp_attrs none = dsp_attrs_none();
  dsp_tensor *y = run(ctx, DSP_OP_CROSS_ENTROPY, &none, u->x, u->lab, NULL);
  double v = tu_at(y, 0) * 1.7; /* the upstream grad below */
  dsp_tensor_unref(y);
  return v;
}

Test(cross_entropy, backward_matches_finite_differences) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[2] = {4, 5}, sl[1] = {4}, s0[1] = {1};
  double l[4] = {0, 4, 2, 2}, gv = 1.7;
  dsp_tensor *x = mk(ctx, DSP_F64, 2, s, NULL), *lab = mk(ctx, DSP_I64, 1, sl, l);
  dsp_tensor *g = mk(ctx, DSP_F64, 0, s0, &gv);
  dsp_attrs none = dsp_attrs_none();
  dsp_tensor *gx = run(ctx, DSP_OP_CROSS_ENTROPY_BACKWARD, &none, g, x, lab);
  cr_assert_eq(gx->meta.ndim, 2);
  ce_ud u = {x, lab};
  fd_check(ctx, x, gx, ce_loss, &u, 1e-7);
  /* a one-element grad of another rank is accepted too */
  dsp_tensor *g1 = mk(ctx, DSP_F64, 1, s0, &gv);
  dsp_tensor *gx1 = run(ctx, DSP_OP_CROSS_ENTROPY_BACKWARD, &none, g1, x, lab);
  cr_assert_eq(memcmp(dsp_tensor_data(gx), dsp_tensor_data(gx1),
                      dsp_tensor_nbytes(gx)), 0);
  dsp_tensor_unref(x), dsp_tensor_unref(lab), dsp_tensor_unref(g),
      dsp_tensor_unref(gx), dsp_tensor_unref(g1), dsp_tensor_unref(gx1);
  dsp_ctx_free(ctx);
}

Test(cross_entropy_errors, labels_shapes_and_dtypes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[2] = {2, 3}, sl[1] = {2}, sl3[1] = {3}, s0[1] = {2};
  double bad[2] = {1, 3}, neg[2] = {-1, 0}, gv[2] = {1, 1};
  dsp_tensor *x = mk(ctx, DSP_F32, 2, s, NULL);
  dsp_tensor *lb = mk(ctx, DSP_I64, 1, sl, bad), *ln = mk(ctx, DSP_I64, 1, sl, neg);
  dsp_tensor *l3 = mk(ctx, DSP_I64, 1, sl3, NULL), *lf = mk(ctx, DSP_F32, 1, sl, NULL);
  dsp_tensor *g2 = mk(ctx, DSP_F32, 1, s0, gv);
  dsp_attrs none = dsp_attrs_none();
  expect_err(ctx, DISPATCH_EINDEX, "label 3", DSP_OP_CROSS_ENTROPY, &none, x, lb,
             NULL);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "3 classes"), "%s", dsp_ctx_errmsg(ctx));
  expect_err(ctx, DISPATCH_EINDEX, "label -1", DSP_OP_CROSS_ENTROPY, &none, x,
             ln, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "3 labels for 2 rows", DSP_OP_CROSS_ENTROPY,
             &none, x, l3, NULL);
  expect_err(ctx, DISPATCH_EDTYPE, "labels must be i64", DSP_OP_CROSS_ENTROPY,
             &none, x, lf, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "logits must be 2-D", DSP_OP_CROSS_ENTROPY,
             &none, lf, ln, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "one element", DSP_OP_CROSS_ENTROPY_BACKWARD,
             &none, g2, x, ln);
  dsp_tensor *g1 = mk(ctx, DSP_F32, 0, s0, gv);
  expect_err(ctx, DISPATCH_EINDEX, "label 3", DSP_OP_CROSS_ENTROPY_BACKWARD,
             &none, g1, x, lb);
  dsp_tensor_unref(g1);
  dsp_attrs one = dim1(0);
  expect_err(ctx, DISPATCH_EINVAL, "attributes", DSP_OP_CROSS_ENTROPY, &one, x,
             ln, NULL);
  dsp_tensor_unref(x), dsp_tensor_unref(lb), dsp_tensor_unref(ln),
      dsp_tensor_unref(l3), dsp_tensor_unref(lf), dsp_tensor_unref(g2);
  dsp_ctx_free(ctx);
}

Test(mse, by_hand_and_errors) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double a[3] = {1, 2, 3}, b[3] = {1, 0, 0};
  int64_t s[1] = {3}, s2[2] = {3, 1};
  dsp_tensor *ta = mk(ctx, DSP_F32, 1, s, a), *tb = mk(ctx, DSP_F32, 1, s, b);
  dsp_attrs none = dsp_attrs_none();
  dsp_tensor *l = run(ctx, DSP_OP_MSE, &none, ta, tb, NULL);
  cr_assert_eq(l->meta.ndim, 0);
  cr_assert_float_eq(tu_at(l, 0), 13.0 / 3.0, 1e-6);
  dsp_tensor *tc = mk(ctx, DSP_F32, 2, s2, b), *td = mk(ctx, DSP_F64, 1, s, b);
  expect_err(ctx, DISPATCH_ESHAPE, "[3] and [3, 1]", DSP_OP_MSE, &none, ta, tc,
             NULL);
  expect_err(ctx, DISPATCH_EDTYPE, "f32 and f64", DSP_OP_MSE, &none, ta, td, NULL);
  dsp_tensor_unref(ta), dsp_tensor_unref(tb), dsp_tensor_unref(l),
      dsp_tensor_unref(tc), dsp_tensor_unref(td);
  dsp_ctx_free(ctx);
}

/* ---- conv2d -------------------------------------------------------- */

/* naive direct convolution, the reference for the im2col kernel */
static void conv_naive(const dsp_tensor *x, const dsp_tensor *w, const int64_t *p,
                       const dsp_tensor *y, double tol) {
  int64_t N = x->meta.shape[0], C = x->meta.shape[1], H = x->meta.shape[2],
          W = x->meta.shape[3];
  int64_t O = w->meta.shape[0], KH = w->meta.shape[2], KW = w->meta.shape[3];
  int64_t OH = y->meta.shape[2], OW = y->meta.shape[3];
  cr_assert_eq(y->meta.shape[0], N);
  cr_assert_eq(y->meta.shape[1], O);
  cr_assert_eq(OH, (H + 2 * p[2] - p[4] * (KH - 1) - 1) / p[0] + 1);
  cr_assert_eq(OW, (W + 2 * p[3] - p[5] * (KW - 1) - 1) / p[1] + 1);
  for (int64_t n = 0; n < N; n++)
    for (int64_t o = 0; o < O; o++)
      for (int64_t oh = 0; oh < OH; oh++)
        for (int64_t ow = 0; ow < OW; ow++) {
          double s = 0;
          for (int64_t c = 0; c < C; c++)
            for (int64_t i = 0; i < KH; i++)
              for (int64_t j = 0; j < KW; j++) {
                int64_t h = oh * p[0] - p[2] + i * p[4];
                int64_t ww = ow * p[1] - p[3] + j * p[5];
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                s += tu_at(x, ((n * C + c) * H + h) * W + ww) *
                     tu_at(w, ((o * C + c) * KH + i) * KW + j);
              }
          double got = tu_at(y, ((n * O + o) * OH + oh) * OW + ow);
          cr_assert(fabs(got - s) <= tol, "y[%lld,%lld,%lld,%lld] = %.9g, want %.9g",
                    (long long)n, (long long)o, (long long)oh, (long long)ow, got, s);
        }
}

Test(conv2d, small_case_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double xv[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, wv[4] = {1, 1, 1, 1};
  int64_t sx[4] = {1, 1, 3, 3}, sw[4] = {1, 1, 2, 2};
  dsp_tensor *x = mk(ctx, DSP_F32, 4, sx, xv), *w = mk(ctx, DSP_F32, 4, sw, wv);
  dsp_attrs none = dsp_attrs_none();
  dsp_tensor *y = run(ctx, DSP_OP_CONV2D, &none, x, w, NULL);
  double want[4] = {12, 16, 24, 28};
  assert_close(y, want, 4, 0);
  /* padding 1 on a 2x2 ones kernel: corners see one element */
  int64_t pv[4] = {1, 1, 1, 1};
  dsp_attrs pa = ints(4, pv);
  dsp_tensor *yp = run(ctx, DSP_OP_CONV2D, &pa, x, w, NULL);
  cr_assert_eq(yp->meta.shape[2], 4);
  cr_assert_eq(tu_at(yp, 0), 1.0);
  cr_assert_eq(tu_at(yp, 15), 9.0);
  cr_assert_eq(tu_at(yp, 5), 12.0);
  dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(y),
      dsp_tensor_unref(yp);
  dsp_ctx_free(ctx);
}

static const int64_t g_conv_cfgs[][6] = {
    {1, 1, 0, 0, 1, 1}, {2, 2, 1, 1, 1, 1}, {1, 2, 0, 1, 2, 1},
    {2, 1, 2, 0, 1, 2}, {3, 3, 1, 2, 2, 2},
};
static const int64_t g_conv_shapes[][8] = {
    /* x N,C,H,W then w O,C,kh,kw */
    {2, 3, 7, 6, 4, 3, 3, 2}, {1, 2, 5, 5, 3, 2, 1, 1}, {2, 1, 6, 8, 2, 1, 2, 3},
};

Test(conv2d, matches_naive_across_stride_padding_dilation) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  for (int d = 0; d < 2; d++)
    for (size_t c = 0; c < sizeof g_conv_cfgs / sizeof g_conv_cfgs[0]; c++)
      for (size_t s = 0; s < sizeof g_conv_shapes / sizeof g_conv_shapes[0]; s++) {
        dsp_dtype dt = d ? DSP_F64 : DSP_F32;
        dsp_tensor *x = mk(ctx, dt, 4, g_conv_shapes[s], NULL);
        dsp_tensor *w = mk(ctx, dt, 4, g_conv_shapes[s] + 4, NULL);
        dsp_attrs a = ints(6, g_conv_cfgs[c]);
        dsp_tensor *y = run(ctx, DSP_OP_CONV2D, &a, x, w, NULL);
        conv_naive(x, w, g_conv_cfgs[c], y, d ? 1e-12 : 1e-5);
        dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(y);
      }
  dsp_ctx_free(ctx);
}

Test(conv2d, missing_attrs_take_the_defaults) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sx[4] = {1, 2, 6, 6}, sw[4] = {2, 2, 3, 3};
  dsp_tensor *x = mk(ctx, DSP_F64, 4, sx, NULL), *w = mk(ctx, DSP_F64, 4, sw, NULL);
  int64_t full[6] = {2, 2, 1, 1, 1, 1}, part[4] = {2, 2, 1, 1};
  dsp_attrs af = ints(6, full), ap = ints(4, part);
  dsp_tensor *y1 = run(ctx, DSP_OP_CONV2D, &af, x, w, NULL);
  dsp_tensor *y2 = run(ctx, DSP_OP_CONV2D, &ap, x, w, NULL);
  cr_assert_eq(memcmp(dsp_tensor_data(y1), dsp_tensor_data(y2),
                      dsp_tensor_nbytes(y1)), 0);
  conv_naive(x, w, full, y1, 1e-12);
  dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(y1),
      dsp_tensor_unref(y2);
  dsp_ctx_free(ctx);
}

typedef struct conv_ud {
  dsp_attrs a;
  dsp_tensor *x, *w, *G;
} conv_ud;
static double conv_dot(dsp_ctx *ctx, void *p) {
  conv_ud *u = p;
  fwd_ud f = {DSP_OP_CONV2D, u->a, u->x, u->w, u->G};
  return fwd_dot(ctx, &f);
}

Test(conv2d, backward_ops_match_finite_differences) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  for (size_t c = 0; c < sizeof g_conv_cfgs / sizeof g_conv_cfgs[0]; c++)
    for (size_t s = 0; s < sizeof g_conv_shapes / sizeof g_conv_shapes[0]; s++) {
      const int64_t *sh = g_conv_shapes[s], *cf = g_conv_cfgs[c];
      dsp_tensor *x = mk(ctx, DSP_F64, 4, sh, NULL);
      dsp_tensor *w = mk(ctx, DSP_F64, 4, sh + 4, NULL);
      dsp_attrs a = ints(6, cf);
      dsp_tensor *y = run(ctx, DSP_OP_CONV2D, &a, x, w, NULL);
      dsp_tensor *G = mk(ctx, DSP_F64, 4, y->meta.shape, NULL);
      int64_t bi[10], bw[10];
      for (int i = 0; i < 6; i++) bi[i] = bw[i] = cf[i];
      for (int i = 0; i < 4; i++) bi[6 + i] = sh[i], bw[6 + i] = sh[4 + i];
      dsp_attrs ai = ints(10, bi), aw = ints(10, bw);
      dsp_tensor *gx = run(ctx, DSP_OP_CONV2D_BACKWARD_INPUT, &ai, G, w, NULL);
      dsp_tensor *gw = run(ctx, DSP_OP_CONV2D_BACKWARD_WEIGHT, &aw, G, x, NULL);
      for (int i = 0; i < 4; i++) {
        cr_assert_eq(gx->meta.shape[i], sh[i]);
        cr_assert_eq(gw->meta.shape[i], sh[4 + i]);
      }
      conv_ud u = {a, x, w, G};
      fd_check(ctx, x, gx, conv_dot, &u, 1e-7);
      fd_check(ctx, w, gw, conv_dot, &u, 1e-7);
      dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(y),
          dsp_tensor_unref(G), dsp_tensor_unref(gx), dsp_tensor_unref(gw);
    }
  dsp_ctx_free(ctx);
}

Test(conv2d, backward_ops_accept_defaulted_conv_ints) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sx[4] = {1, 2, 5, 5}, sw[4] = {3, 2, 3, 3}, sy[4] = {1, 3, 3, 3};
  dsp_tensor *w = mk(ctx, DSP_F64, 4, sw, NULL), *G = mk(ctx, DSP_F64, 4, sy, NULL);
  int64_t full[10] = {1, 1, 0, 0, 1, 1, 1, 2, 5, 5}, dims[4] = {1, 2, 5, 5};
  dsp_attrs af = ints(10, full), ad = ints(4, dims);
  dsp_tensor *g1 = run(ctx, DSP_OP_CONV2D_BACKWARD_INPUT, &af, G, w, NULL);
  dsp_tensor *g2 = run(ctx, DSP_OP_CONV2D_BACKWARD_INPUT, &ad, G, w, NULL);
  cr_assert_eq(memcmp(dsp_tensor_data(g1), dsp_tensor_data(g2),
                      dsp_tensor_nbytes(g1)), 0);
  (void)sx;
  dsp_tensor_unref(w), dsp_tensor_unref(G), dsp_tensor_unref(g1),
      dsp_tensor_unref(g2);
  dsp_ctx_free(ctx);
}

Test(conv2d_errors, shapes_attrs_and_dtypes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sx[4] = {1, 3, 5, 5}, sw[4] = {2, 4, 3, 3}, sw2[4] = {2, 3, 7, 3},
          sw3[4] = {2, 3, 3, 3}, s3[3] = {3, 5, 5};
  dsp_tensor *x = mk(ctx, DSP_F32, 4, sx, NULL), *w = mk(ctx, DSP_F32, 4, sw, NULL);
  dsp_tensor *wbig = mk(ctx, DSP_F32, 4, sw2, NULL), *wok = mk(ctx, DSP_F32, 4, sw3, NULL);
  dsp_tensor *wd = mk(ctx, DSP_F64, 4, sw3, NULL), *x3 = mk(ctx, DSP_F32, 3, s3, NULL);
  dsp_attrs none = dsp_attrs_none();
  expect_err(ctx, DISPATCH_ESHAPE, "input has 3 channels but weight expects 4",
             DSP_OP_CONV2D, &none, x, w, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "output height <= 0 (input 5, kernel 7",
             DSP_OP_CONV2D, &none, x, wbig, NULL);
  expect_err(ctx, DISPATCH_EDTYPE, "f32 and f64", DSP_OP_CONV2D, &none, x, wd,
             NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "input must be 4-D", DSP_OP_CONV2D, &none,
             x3, wok, NULL);
  int64_t s0[1] = {0}, pneg[3] = {1, 1, -1}, d0[6] = {1, 1, 0, 0, 1, 0};
  int64_t seven[7] = {1, 1, 0, 0, 1, 1, 1};
  dsp_attrs a;
  a = ints(1, s0);
  expect_err(ctx, DISPATCH_EINVAL, "stride_h = 0", DSP_OP_CONV2D, &a, x, wok, NULL);
  a = ints(3, pneg);
  expect_err(ctx, DISPATCH_EINVAL, "pad_h = -1", DSP_OP_CONV2D, &a, x, wok, NULL);
  a = ints(6, d0);
  expect_err(ctx, DISPATCH_EINVAL, "dil_w = 0", DSP_OP_CONV2D, &a, x, wok, NULL);
  a = ints(7, seven);
  expect_err(ctx, DISPATCH_EINVAL, "at most 6", DSP_OP_CONV2D, &a, x, wok, NULL);
  a = dsp_attrs_f1(1.0);
  expect_err(ctx, DISPATCH_EINVAL, "no float", DSP_OP_CONV2D, &a, x, wok, NULL);
  /* backward: the grad must be the conv output of the given dims */
  int64_t sg[4] = {1, 2, 4, 4};
  dsp_tensor *g = mk(ctx, DSP_F32, 4, sg, NULL);
  int64_t bi[4] = {1, 3, 5, 5};
  a = ints(4, bi);
  expect_err(ctx, DISPATCH_ESHAPE, "grad is [1, 2, 4, 4] but the conv output is [1, 2, 3, 3]",
             DSP_OP_CONV2D_BACKWARD_INPUT, &a, g, wok, NULL);
  a = ints(3, bi);
  expect_err(ctx, DISPATCH_EINVAL, "4 dims of the input",
             DSP_OP_CONV2D_BACKWARD_INPUT, &a, g, wok, NULL);
  int64_t huge[10] = {1, 1, INT64_MAX, 0, 1, 1, 1, 3, 5, 5};
  a = ints(10, huge);
  expect_err(ctx, DISPATCH_EINVAL, "pad_h = 9223372036854775807",
             DSP_OP_CONV2D_BACKWARD_INPUT, &a, g, wok, NULL);
  int64_t hugex[4] = {1, 3, INT64_MAX, 5};
  a = ints(4, hugex);
  expect_err(ctx, DISPATCH_EOVERFLOW, "exceed the BLAS int range",
             DSP_OP_CONV2D_BACKWARD_INPUT, &a, g, wok, NULL);
  int64_t bw[4] = {2, 3, 3, 3};
  a = ints(4, bw);
  expect_err(ctx, DISPATCH_ESHAPE, "conv output is [1, 2, 3, 3]",
             DSP_OP_CONV2D_BACKWARD_WEIGHT, &a, g, x, NULL);
  dsp_tensor_unref(x), dsp_tensor_unref(w), dsp_tensor_unref(wbig),
      dsp_tensor_unref(wok), dsp_tensor_unref(wd), dsp_tensor_unref(x3),
      dsp_tensor_unref(g);
  dsp_ctx_free(ctx);
}

/* ---- pooling ------------------------------------------------------- */

Test(pool, max_and_avg_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double v[16];
  for (int i = 0; i < 16; i++) v[i] = i;
  v[5] = 100;
  int64_t s[4] = {1, 1, 4, 4};
  dsp_tensor *x = mk(ctx, DSP_F32, 4, s, v);
  int64_t k2[2] = {2, 2};
  dsp_attrs a = ints(2, k2);
  dsp_tensor *mp = run(ctx, DSP_OP_MAX_POOL2D, &a, x, NULL, NULL);
  double wm[4] = {100, 7, 13, 15};
  assert_close(mp, wm, 4, 0);
  dsp_tensor *ap = run(ctx, DSP_OP_AVG_POOL2D, &a, x, NULL, NULL);
  double wa[4] = {(0 + 1 + 4 + 100) / 4.0, (2 + 3 + 6 + 7) / 4.0,
                  (8 + 9 + 12 + 13) / 4.0, (10 + 11 + 14 + 15) / 4.0};
  assert_close(ap, wa, 4, 1e-6);
  /* 3x3 window, stride 2, padding 1 on 0..15: avg counts the padding as
   * zeros (always divides by 9) */
  for (int i = 0; i < 16; i++) v[i] = i;
  dsp_tensor *x2 = mk(ctx, DSP_F64, 4, s, v);
  int64_t k3[6] = {3, 3, 2, 2, 1, 1};
  dsp_attrs a3 = ints(6, k3);
  dsp_tensor *ap3 = run(ctx, DSP_OP_AVG_POOL2D, &a3, x2, NULL, NULL);
  cr_assert_eq(ap3->meta.shape[2], 2);
  cr_assert_eq(ap3->meta.shape[3], 2);
  double wa3[4] = {(0 + 1 + 4 + 5) / 9.0, (1 + 2 + 3 + 5 + 6 + 7) / 9.0,
                   (4 + 5 + 8 + 9 + 12 + 13) / 9.0,
                   (5 + 6 + 7 + 9 + 10 + 11 + 13 + 14 + 15) / 9.0};
  assert_close(ap3, wa3, 4, 1e-14);
  dsp_tensor *mp3 = run(ctx, DSP_OP_MAX_POOL2D, &a3, x2, NULL, NULL);
  double wm3[4] = {5, 7, 13, 15};
  assert_close(mp3, wm3, 4, 0);
  dsp_tensor_unref(x2);
  dsp_tensor_unref(x), dsp_tensor_unref(mp), dsp_tensor_unref(ap),
      dsp_tensor_unref(ap3), dsp_tensor_unref(mp3);
  dsp_ctx_free(ctx);
}

typedef struct pool_ud {
  dsp_opcode op;
  dsp_attrs a;
  dsp_tensor *x, *G;
} pool_ud;
static double pool_dot(dsp_ctx *ctx, void *p) {
  pool_ud *u = p;
  fwd_ud f = {u->op, u->a, u->x, NULL, u->G};
  return fwd_dot(ctx, &f);
}

Test(pool, backward_ops_match_finite_differences) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  static const int64_t cfgs[][6] = {
      {2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 2, 1, 1, 1, 0}, {2, 3, 1, 2, 1, 1}};
  int64_t s[4] = {2, 2, 5, 6};
  dsp_opcode fw[2] = {DSP_OP_MAX_POOL2D, DSP_OP_AVG_POOL2D};
  dsp_opcode bw[2] = {DSP_OP_MAX_POOL2D_BACKWARD, DSP_OP_AVG_POOL2D_BACKWARD};
  for (int k = 0; k < 2; k++)
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
      dsp_tensor *x = mk(ctx, DSP_F64, 4, s, NULL); /* distinct values: no ties */
      dsp_attrs a = ints(6, cfgs[c]);
      dsp_tensor *y = run(ctx, fw[k], &a, x, NULL, NULL);
      dsp_tensor *G = mk(ctx, DSP_F64, 4, y->meta.shape, NULL);
      dsp_tensor *gx = run(ctx, bw[k], &a, G, x, NULL);
      pool_ud u = {fw[k], a, x, G};
      fd_check(ctx, x, gx, pool_dot, &u, 1e-7);
      dsp_tensor_unref(x), dsp_tensor_unref(y), dsp_tensor_unref(G),
          dsp_tensor_unref(gx);
    }
  dsp_ctx_free(ctx);
}

Test(pool_errors, attrs_and_shapes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[4] = {1, 1, 4, 4}, s3[3] = {1, 4, 4}, sg[4] = {1, 1, 3, 3};
  dsp_tensor *x = mk(ctx, DSP_F32, 4, s, NULL), *x3 = mk(ctx, DSP_F32, 3, s3, NULL);
  dsp_tensor *g = mk(ctx, DSP_F32, 4, sg, NULL);
  dsp_attrs a;
  int64_t k1[1] = {2}, k0[2] = {0, 2}, st0[3] = {2, 2, -1},
          pbig[6] = {2, 2, 2, 2, 2, 0}, kbig[2] = {5, 2}, ok[2] = {2, 2};
  a = ints(1, k1);
  expect_err(ctx, DISPATCH_EINVAL, "takes 2..6 ints", DSP_OP_MAX_POOL2D, &a, x,
             NULL, NULL);
  a = ints(2, k0);
  expect_err(ctx, DISPATCH_EINVAL, "kernel 0x2", DSP_OP_AVG_POOL2D, &a, x, NULL,
             NULL);
  a = ints(3, st0);
  expect_err(ctx, DISPATCH_EINVAL, "stride -1x2", DSP_OP_MAX_POOL2D, &a, x, NULL,
             NULL);
  a = ints(6, pbig);
  expect_err(ctx, DISPATCH_EINVAL, "padding 2x0", DSP_OP_MAX_POOL2D, &a, x, NULL,
             NULL);
  int64_t phuge[6] = {2, 2, 1, 1, INT64_MAX, 0};
  a = ints(6, phuge);
  expect_err(ctx, DISPATCH_EINVAL, "must be in [0, kernel/2]", DSP_OP_MAX_POOL2D,
             &a, x, NULL, NULL);
  a = ints(2, kbig);
  expect_err(ctx, DISPATCH_ESHAPE, "output height <= 0 (input 4, kernel 5",
             DSP_OP_MAX_POOL2D, &a, x, NULL, NULL);
  a = ints(2, ok);
  expect_err(ctx, DISPATCH_ESHAPE, "input must be 4-D", DSP_OP_MAX_POOL2D, &a, x3,
             NULL, NULL);
  expect_err(ctx, DISPATCH_ESHAPE, "grad is [1, 1, 3, 3] but the pool output is [1, 1, 2, 2]",
             DSP_OP_AVG_POOL2D_BACKWARD, &a, g, x, NULL);
  dsp_tensor_unref(x), dsp_tensor_unref(x3), dsp_tensor_unref(g);
  dsp_ctx_free(ctx);
}

/* ---- dropout ------------------------------------------------------- */

Test(dropout, mask_follows_the_counter_generator) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[2] = {50, 40};
  dsp_tensor *x = mk(ctx, DSP_F32, 2, s, NULL);
  dsp_attrs a = dsp_attrs_f1(0.3);
  a.n_ints = 1;
  a.ints[0] = 1234;
  dsp_tensor *y = run(ctx, DSP_OP_DROPOUT, &a, x, NULL, NULL);
  int kept = 0;
  for (int64_t i = 0; i < x->numel; i++) {
    int keep = dsp_rng_uniform01(1234, (uint64_t)i) >= 0.3;
    kept += keep;
    double want = keep ? (double)(float)(tu_at(x, i) / 0.7) : 0.0;
    cr_assert(fabs(tu_at(y, i) - want) <= 1e-6, "element %lld", (long long)i);
  }
  cr_assert(kept > 1300 && kept < 1500, "kept %d of 2000 at p = 0.3", kept);
  /* same seed: bit-identical; another seed: another mask */
  dsp_tensor *y2 = run(ctx, DSP_OP_DROPOUT, &a, x, NULL, NULL);
  cr_assert_eq(memcmp(dsp_tensor_data(y), dsp_tensor_data(y2),
                      dsp_tensor_nbytes(y)), 0);
  a.ints[0] = 1235;
  dsp_tensor *y3 = run(ctx, DSP_OP_DROPOUT, &a, x, NULL, NULL);
  cr_assert_neq(memcmp(dsp_tensor_data(y), dsp_tensor_data(y3),
                       dsp_tensor_nbytes(y)), 0);
  /* p = 0 is the identity */
  a.floats[0] = 0.0;
  dsp_tensor *y0 = run(ctx, DSP_OP_DROPOUT, &a, x, NULL, NULL);
  cr_assert_eq(memcmp(dsp_tensor_data(x), dsp_tensor_data(y0),
                      dsp_tensor_nbytes(x)), 0);
  dsp_tensor_unref(x), dsp_tensor_unref(y), dsp_tensor_unref(y2),
      dsp_tensor_unref(y3), dsp_tensor_unref(y0);
  dsp_ctx_free(ctx);
}

Test(dropout_errors, p_range_attr_counts_and_dtype) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t s[1] = {4};
  dsp_tensor *x = mk(ctx, DSP_F64, 1, s, NULL), *xi = mk(ctx, DSP_I64, 1, s, NULL);
  dsp_attrs a = dsp_attrs_f1(1.0);
  a.n_ints = 1;
  expect_err(ctx, DISPATCH_EINVAL, "p = 1 outside [0, 1)", DSP_OP_DROPOUT, &a, x,
             NULL, NULL);
  a.floats[0] = -0.1;
  expect_err(ctx, DISPATCH_EINVAL, "p = -0.1", DSP_OP_DROPOUT, &a, x, NULL, NULL);
  a.floats[0] = NAN;
  expect_err(ctx, DISPATCH_EINVAL, "outside [0, 1)", DSP_OP_DROPOUT, &a, x, NULL,
             NULL);
  a.floats[0] = 0.5;
  expect_err(ctx, DISPATCH_EDTYPE, "i64", DSP_OP_DROPOUT, &a, xi, NULL, NULL);
  a.n_ints = 0;
  expect_err(ctx, DISPATCH_EINVAL, "takes 1 int and 1 float", DSP_OP_DROPOUT, &a,
             x, NULL, NULL);
  dsp_tensor_unref(x), dsp_tensor_unref(xi);
  dsp_ctx_free(ctx);
}

/* ---- allocation failure in the conv scratch buffer ----------------- */

Test(conv2d, every_allocation_failure_is_enomem_without_leaks) {
  dsp_meta x = {DSP_F32, 4, {2, 2, 5, 5}}, w = {DSP_F32, 4, {3, 2, 3, 3}},
           g = {DSP_F32, 4, {2, 3, 3, 3}};
  int64_t bi[10] = {1, 1, 0, 0, 1, 1, 2, 2, 5, 5},
          bw[10] = {1, 1, 0, 0, 1, 1, 3, 2, 3, 3};
  dsp_attrs none = dsp_attrs_none(), ai = dsp_attrs_ints(10, bi),
            aw = dsp_attrs_ints(10, bw);
  dsp_meta fwd[2] = {x, w}, bin[2] = {g, w}, bwt[2] = {g, x};
  /* ctx, 2 inputs, the output and the col buffer each fail once */
  cr_assert(failalloc_walk_op(DSP_OP_CONV2D, 2, fwd, &none) >= 5);
  cr_assert(failalloc_walk_op(DSP_OP_CONV2D_BACKWARD_INPUT, 2, bin, &ai) >= 5);
  cr_assert(failalloc_walk_op(DSP_OP_CONV2D_BACKWARD_WEIGHT, 2, bwt, &aw) >= 5);
}
