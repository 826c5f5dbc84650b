/* Test tensor helpers; see tensor_util.h. */
#include "tensor_util.h"

#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

/* Builds a tensor of dtype dt from a host array of numel elements. */
static dsp_tensor *tu_make(dsp_ctx *ctx, dsp_dtype dt, int ndim,
                           const int64_t *shape, const void *data) {
  if (ndim < 0 || ndim > DSP_MAX_DIMS) return NULL;
  dsp_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = dt;
  m.ndim = ndim;
  for (int i = 0; i < ndim; i++) m.shape[i] = shape[i];
  int64_t n;
  if (dsp_meta_numel(ctx, &m, &n) < 0) return NULL;
  dsp_tensor *t = NULL;
  size_t nbytes = (size_t)n * dsp_dtype_size(dt);
  if (dsp_tensor_from_data(ctx, &m, data, nbytes, &t) < 0) return NULL;
  return t;
}

dsp_tensor *tu_f32(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const float *data) {
  return tu_make(ctx, DSP_F32, ndim, shape, data);
}
dsp_tensor *tu_f64(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const double *data) {
  return tu_make(ctx, DSP_F64, ndim, shape, data);
}
dsp_tensor *tu_i64(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const int64_t *data) {
  return tu_make(ctx, DSP_I64, ndim, shape, data);
}
dsp_tensor *tu_bool(dsp_ctx *ctx, int ndim, const int64_t *shape,
                    const uint8_t *data) {
  return tu_make(ctx, DSP_BOOL, ndim, shape, data);
}

static void tu_check(const dsp_tensor *t, dsp_dtype dt, int n) {
  cr_assert_not_null(t, "tensor is NULL");
  cr_assert_eq(t->meta.dtype, dt, "dtype %s, expected %s",
               dsp_dtype_name(t->meta.dtype), dsp_dtype_name(dt));
  cr_assert_eq(t->numel, (int64_t)n, "numel %lld, expected %d",
               (long long)t->numel, n);
}

void tu_assert_f32(const dsp_tensor *t, const float *expect, int n,
                   float tol) {
  tu_check(t, DSP_F32, n);
  const float *g = dsp_tensor_data(t);
  for (int i = 0; i < n; i++) {
    if (isnan(expect[i]) && isnan(g[i])) continue;
    cr_assert(fabsf(g[i] - expect[i]) <= tol || g[i] == expect[i],
              "element %d: got %.9g, expected %.9g", i, (double)g[i],
              (double)expect[i]);
  }
}

void tu_assert_f64(const dsp_tensor *t, const double *expect, int n,
                   double tol) {
  tu_check(t, DSP_F64, n);
  const double *g = dsp_tensor_data(t);
  for (int i = 0; i < n; i++) {
    if (isnan(expect[i]) && isnan(g[i])) continue;
    cr_assert(fabs(g[i] - expect[i]) <= tol || g[i] == expect[i],
              "element %d: got %.17g, expected %.17g", i, g[i], expect[i]);
  }
}

void tu_assert_i64(const dsp_tensor *t, const int64_t *expect, int n) {
  tu_check(t, DSP_I64, n);
  const int64_t *g = dsp_tensor_data(t);
  for (int i = 0; i < n; i++)
    cr_assert_eq(g[i], expect[i], "element %d: got %lld, expected %lld", i,
                 (long long)g[i], (long long)expect[i]);
}

void tu_assert_bool(const dsp_tensor *t, const uint8_t *expect, int n) {
  tu_check(t, DSP_BOOL, n);
  const uint8_t *g = dsp_tensor_data(t);
  for (int i = 0; i < n; i++)
    cr_assert_eq(g[i], expect[i], "element %d: got %d, expected %d", i,
                 (int)g[i], (int)expect[i]);
}

void tu_assert_shape(const dsp_tensor *t, int ndim, const int64_t *shape) {
  cr_assert_not_null(t, "tensor is NULL");
  cr_assert_eq(t->meta.ndim, ndim, "rank %d, expected %d", t->meta.ndim,
               ndim);
  for (int i = 0; i < ndim; i++)
    cr_assert_eq(t->meta.shape[i], shape[i], "dim %d: %lld, expected %lld",
                 i, (long long)t->meta.shape[i], (long long)shape[i]);
}

dsp_tensor *tu_run(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n_in,
                   dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2) {
  dsp_tensor *in[3] = {x0, x1, x2};
  dsp_tensor *out = NULL;
  int rc = dsp_op(ctx, op, in, n_in, a, &out);
  cr_assert_eq(rc, 0, "op %d failed: %s (%s)", (int)op,
               dispatch_err_name(rc), dsp_ctx_errmsg(ctx));
  return out;
}

void tu_assert_err(dsp_ctx *ctx, int rc, int code, const char *substr) {
  cr_assert_eq(rc, code, "rc %s, expected %s (message: %s)",
               dispatch_err_name(rc), dispatch_err_name(code),
               dsp_ctx_errmsg(ctx));
  cr_assert(strstr(dsp_ctx_errmsg(ctx), substr) != NULL,
            "message \"%s\" lacks \"%s\"", dsp_ctx_errmsg(ctx), substr);
}

void tu_run_fail(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n_in,
                 dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2, int code,
                 const char *substr) {
  dsp_tensor *in[3] = {x0, x1, x2};
  dsp_tensor *out = NULL;
  int rc = dsp_op(ctx, op, in, n_in, a, &out);
  cr_assert_null(out, "op %d returned a tensor on failure", (int)op);
  tu_assert_err(ctx, rc, code, substr);
}

double tu_at(const dsp_tensor *t, int64_t i) {
  return t->meta.dtype == DSP_F32 ? ((const float *)dsp_tensor_data(t))[i]
                                  : ((const double *)dsp_tensor_data(t))[i];
}

void tu_set(dsp_tensor *t, int64_t i, double v) {
  if (t->meta.dtype == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)v;
  else ((double *)dsp_tensor_data(t))[i] = v;
}

dsp_tensor *tu_grad(dsp_ctx *ctx, const dsp_grads *g, const dsp_tensor *t) {
  dsp_tensor *out = NULL;
  int rc = dsp_grads_get(ctx, g, t, &out);
  cr_assert_eq(rc, 0, "grads_get: %s (%s)", dispatch_err_name(rc),
               dsp_ctx_errmsg(ctx));
  return out;
}

dsp_attrs tu_attn_attrs(int causal, int has_mask, double scale) {
  dsp_attrs a = dsp_attrs_f1(scale);
  a.ints[0] = causal;
  a.ints[1] = has_mask;
  a.n_ints = 2;
  return a;
}
