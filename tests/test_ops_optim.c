/* optimizer steps: sgd and adam against hand-computed updates, in place on
 * the parameter and the optimizer state, plus attribute validation. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_tensor *mk(dsp_ctx *ctx, dsp_dtype dt, int n, const double *v) {
  dsp_meta m = {dt, 1, {n}};
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int i = 0; i < n; i++) {
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)v[i];
    else if (dt == DSP_F64) ((double *)dsp_tensor_data(t))[i] = v[i];
    else ((int64_t *)dsp_tensor_data(t))[i] = (int64_t)v[i];
  }
  return t;
}

static dsp_attrs floats(int n, const double *f, int n_ints, int64_t i0) {
  dsp_attrs a = dsp_attrs_none();
  for (int i = 0; i < n; i++) a.floats[i] = f[i];
  a.n_floats = n;
  a.n_ints = n_ints;
  a.ints[0] = i0;
  return a;
}

static int step(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n,
                dsp_tensor *p, dsp_tensor *g, dsp_tensor *s1, dsp_tensor *s2,
                dsp_tensor **out) {
  dsp_tensor *in[4] = {p, g, s1, s2};
  return dsp_op(ctx, op, in, n, a, out);
}

Test(sgd, momentum_and_weight_decay_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double pv[2] = {1, 2}, gv[2] = {0.5, -1}, vv[2] = {0.1, 0.2};
    dsp_tensor *p = mk(ctx, dt, 2, pv), *g = mk(ctx, dt, 2, gv),
               *v = mk(ctx, dt, 2, vv), *out = NULL;
    double f[3] = {0.1, 0.9, 0.01};
    dsp_attrs a = floats(3, f, 0, 0);
    cr_assert_eq(step(ctx, DSP_OP_SGD_STEP, &a, 3, p, g, v, NULL, &out), 0, "%s",
                 dsp_ctx_errmsg(ctx));
    cr_assert_eq(out, p, "the output is the parameter itself");
    double tol = d ? 1e-15 : 1e-7;
    /* v = 0.9*0.1 + 0.5 + 0.01*1 = 0.6;  p = 1 - 0.1*0.6 = 0.94
     * v = 0.9*0.2 - 1 + 0.01*2 = -0.8;  p = 2 + 0.08 = 2.08 */
    cr_assert_float_eq(tu_at(v, 0), 0.6, tol);
    cr_assert_float_eq(tu_at(v, 1), -0.8, tol);
    cr_assert_float_eq(tu_at(p, 0), 0.94, tol);
    cr_assert_float_eq(tu_at(p, 1), 2.08, tol);
    cr_assert_float_eq(tu_at(g, 0), 0.5, 0, "grad untouched");
    /* a second step keeps the velocity: v = 0.9*0.6 + 0.5 + 0.0094 */
    dsp_tensor_unref(out);
    cr_assert_eq(step(ctx, DSP_OP_SGD_STEP, &a, 3, p, g, v, NULL, &out), 0);
    cr_assert_float_eq(tu_at(v, 0), 0.54 + 0.5 + 0.0094, tol);
    cr_assert_float_eq(tu_at(p, 0), 0.94 - 0.1 * (0.54 + 0.5 + 0.0094), tol);
    dsp_tensor_unref(out);
    dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(v);
  }
  dsp_ctx_free(ctx);
}

/* momentum 0 and weight decay 0 (the plain step, which has its own loop):
 * p - lr * g computed in double and rounded once, the velocity left equal
 * to the gradient, on a length that is no multiple of any vector width */
Test(sgd, plain_step_is_p_minus_lr_g_rounded_once) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  enum { N = 1037 };
  static double pv[N], gv[N], vv[N];
  for (int i = 0; i < N; i++) {
    pv[i] = sin(0.37 * i) * 3.0;
    gv[i] = cos(1.3 * i) / (1.0 + i % 7);
    vv[i] = 0.25 * i;
  }
  const double lr = 0.05;
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    dsp_tensor *p = mk(ctx, dt, N, pv), *g = mk(ctx, dt, N, gv),
               *v = mk(ctx, dt, N, vv), *out = NULL;
    double f[3] = {lr, 0.0, 0.0};
    dsp_attrs a = floats(3, f, 0, 0);
    for (int s = 0; s < 2; s++) {
      double want[N];
      for (int i = 0; i < N; i++)
        want[i] = d ? tu_at(p, i) - lr * tu_at(g, i)
                    : (double)(float)(tu_at(p, i) - lr * tu_at(g, i));
      cr_assert_eq(step(ctx, DSP_OP_SGD_STEP, &a, 3, p, g, v, NULL, &out), 0,
                   "%s", dsp_ctx_errmsg(ctx));
      for (int i = 0; i < N; i++) {
        cr_assert(tu_at(p, i) == want[i], "%s step %d p[%d] = %.17g, want %.17g",
                  d ? "f64" : "f32", s, i, tu_at(p, i), want[i]);
        cr_assert(tu_at(v, i) == tu_at(g, i), "velocity[%d] is the gradient", i);
      }
      dsp_tensor_unref(out);
    }
    dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(v);
  }
  dsp_ctx_free(ctx);
}

/* reference adam step, written out as in the paper */
static void adam_ref(double *p, double g, double *m, double *v, double lr,
                     double b1, double b2, double eps, int t) {
  *m = b1 * *m + (1 - b1) * g;
  *v = b2 * *v + (1 - b2) * g * g;
  double mh = *m / (1 - pow(b1, t)), vh = *v / (1 - pow(b2, t));
  *p -= lr * mh / (sqrt(vh) + eps);
}

Test(adam, bias_corrected_steps_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double pv[3] = {1, -2, 0.5}, gv[3] = {0.5, -2, 0}, zero[3] = {0, 0, 0};
    dsp_tensor *p = mk(ctx, dt, 3, pv), *g = mk(ctx, dt, 3, gv),
               *m = mk(ctx, dt, 3, zero), *v = mk(ctx, dt, 3, zero), *out;
    double f[4] = {0.1, 0.9, 0.999, 1e-8};
    dsp_attrs a = floats(4, f, 1, 1);
    cr_assert_eq(step(ctx, DSP_OP_ADAM_STEP, &a, 4, p, g, m, v, &out), 0, "%s",
                 dsp_ctx_errmsg(ctx));
    cr_assert_eq(out, p);
    dsp_tensor_unref(out);
    /* t = 1: the corrected moments are g and g^2, so p -= lr * sign(g) */
    double tol = d ? 1e-12 : 1e-6;
    cr_assert_float_eq(tu_at(p, 0), 1 - 0.1 * 0.5 / (0.5 + 1e-8), tol);
    cr_assert_float_eq(tu_at(p, 1), -2 + 0.1 * 2 / (2 + 1e-8), tol);
    cr_assert_float_eq(tu_at(p, 2), 0.5, 0);
    cr_assert_float_eq(tu_at(m, 0), 0.05, tol);
    cr_assert_float_eq(tu_at(v, 1), 0.004, tol);
    /* t = 2 with a new grad, against the reference formula */
    double rp[3], rm[3], rv[3], g2[3] = {-1, 0.25, 3};
    for (int i = 0; i < 3; i++) {
      rp[i] = pv[i], rm[i] = 0, rv[i] = 0;
      adam_ref(&rp[i], gv[i], &rm[i], &rv[i], 0.1, 0.9, 0.999, 1e-8, 1);
      adam_ref(&rp[i], g2[i], &rm[i], &rv[i], 0.1, 0.9, 0.999, 1e-8, 2);
    }
    dsp_tensor *gg = mk(ctx, dt, 3, g2);
    a.ints[0] = 2;
    cr_assert_eq(step(ctx, DSP_OP_ADAM_STEP, &a, 4, p, gg, m, v, &out), 0);
    dsp_tensor_unref(out);
    for (int i = 0; i < 3; i++) {
      cr_assert_float_eq(tu_at(p, i), rp[i], tol, "p[%d]", i);
      cr_assert_float_eq(tu_at(m, i), rm[i], tol, "m[%d]", i);
      cr_assert_float_eq(tu_at(v, i), rv[i], tol, "v[%d]", i);
    }
    dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(m),
        dsp_tensor_unref(v), dsp_tensor_unref(gg);
  }
  dsp_ctx_free(ctx);
}

static void expect(dsp_ctx *ctx, int rc, int code, const char *sub) {
  cr_assert_eq(rc, code, "rc %s, want %s (%s)", dispatch_err_name(rc),
               dispatch_err_name(code), dsp_ctx_errmsg(ctx));
  cr_assert(strstr(dsp_ctx_errmsg(ctx), sub), "message '%s' lacks '%s'",
            dsp_ctx_errmsg(ctx), sub);
}

Test(optim_errors, attrs_shapes_and_dtypes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double z[3] = {0, 0, 0};
  dsp_tensor *p = mk(ctx, DSP_F32, 3, z), *g = mk(ctx, DSP_F32, 3, z),
             *v = mk(ctx, DSP_F32, 3, z), *v2 = mk(ctx, DSP_F32, 2, z),
             *gd = mk(ctx, DSP_F64, 3, z), *pi = mk(ctx, DSP_I64, 3, z),
             *out = NULL;
  double sf[3] = {0.1, 0.9, 0}, af[4] = {0.1, 0.9, 0.999, 1e-8};
  dsp_attrs s = floats(3, sf, 0, 0), ad = floats(4, af, 1, 1), bad;
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &s, 3, p, g, v2, NULL, &out),
         DISPATCH_ESHAPE, "velocity is [2] but param is [3]");
  cr_assert_null(out);
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &s, 3, p, gd, v, NULL, &out),
         DISPATCH_EDTYPE, "grad is f64 but param is f32");
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &s, 3, p, g, gd, NULL, &out),
         DISPATCH_EDTYPE, "velocity is f64 but param is f32");
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &ad, 4, p, g, v, gd, &out),
         DISPATCH_EDTYPE, "v is f64 but param is f32");
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &s, 3, pi, pi, pi, NULL, &out),
         DISPATCH_EDTYPE, "param must be f32 or f64");
  bad = floats(2, sf, 0, 0);
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &bad, 3, p, g, v, NULL, &out),
         DISPATCH_EINVAL, "takes 3 float and 0 int");
  bad = s;
  bad.floats[0] = INFINITY;
  expect(ctx, step(ctx, DSP_OP_SGD_STEP, &bad, 3, p, g, v, NULL, &out),
         DISPATCH_EINVAL, "lr = inf is not finite");
  bad = ad;
  bad.ints[0] = 0;
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &bad, 4, p, g, v, v, &out),
         DISPATCH_EINVAL, "step t = 0");
  bad = ad;
  bad.floats[1] = 1.0;
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &bad, 4, p, g, v, v, &out),
         DISPATCH_EINVAL, "beta1 = 1 outside [0, 1)");
  bad = ad;
  bad.floats[3] = -1;
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &bad, 4, p, g, v, v, &out),
         DISPATCH_EINVAL, "eps = -1");
  bad = ad;
  bad.n_ints = 0;
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &bad, 4, p, g, v, v, &out),
         DISPATCH_EINVAL, "takes 4 float and 1 int");
  expect(ctx, step(ctx, DSP_OP_ADAM_STEP, &ad, 4, p, g, v2, v, &out),
         DISPATCH_ESHAPE, "m is [2] but param is [3]");
  /* nothing was touched by the failed calls */
  for (int i = 0; i < 3; i++) cr_assert_eq(tu_at(p, i), 0.0);
  dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(v),
      dsp_tensor_unref(v2), dsp_tensor_unref(gd), dsp_tensor_unref(pi);
  dsp_ctx_free(ctx);
}
