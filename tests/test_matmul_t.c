/* dsp__cpu_matmul_t: the CPU's matmul of transposed operands (one gemm
 * with BLAS's transpose flags) that the matmul backward rule uses instead
 * of copying a transpose. It must agree with transpose + matmul through
 * dsp_op, pass the same limits, and decline what it does not handle. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "cpu/cpu.h"
#include "dsp.h"

static uint64_t g_rng = 88172645463325252ull;
static double urand(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static dsp_tensor *mk(dsp_ctx *ctx, dsp_dtype dt, int64_t r, int64_t c) {
  dsp_meta m = {dt, 2, {r, c}};
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int64_t i = 0; i < t->numel; i++) {
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)urand();
    else ((double *)dsp_tensor_data(t))[i] = urand();
  }
  return t;
}

static double at(const dsp_tensor *t, int64_t i) {
  return t->meta.dtype == DSP_F32 ? ((const float *)dsp_tensor_data(t))[i]
                                  : ((const double *)dsp_tensor_data(t))[i];
}

static dsp_tensor *tr(dsp_ctx *ctx, dsp_tensor *x) {
  int64_t v[2] = {-2, -1};
  dsp_attrs a = dsp_attrs_ints(2, v);
  dsp_tensor *in[1] = {x}, *out = NULL;
  cr_assert_eq(dsp_op(ctx, DSP_OP_TRANSPOSE, in, 1, &a, &out), 0, "%s",
               dsp_ctx_errmsg(ctx));
  return out;
}

Test(matmul_t, agrees_with_transpose_then_matmul) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_set_grad_enabled(ctx, 0);
  const int64_t sizes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 1, 9}, {64, 33, 10}};
  for (int d = 0; d < 2; d++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      for (int f = 0; f < 4; f++) {
        dsp_dtype dt = d ? DSP_F64 : DSP_F32;
        int ta = f & 1, tb = f >> 1;
        int64_t M = sizes[s][0], K = sizes[s][1], N = sizes[s][2];
        dsp_tensor *a = ta ? mk(ctx, dt, K, M) : mk(ctx, dt, M, K);
        dsp_tensor *b = tb ? mk(ctx, dt, N, K) : mk(ctx, dt, K, N);
        dsp_tensor *out = NULL, *ref = NULL;
        cr_assert_eq(dsp__cpu_matmul_t(ctx, a, ta, b, tb, &out), 0, "%s",
                     dsp_ctx_errmsg(ctx));
        dsp_tensor *in[2] = {ta ? tr(ctx, a) : dsp_tensor_ref(a),
                             tb ? tr(ctx, b) : dsp_tensor_ref(b)};
        cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, NULL, &ref), 0);
        cr_assert_eq(out->meta.ndim, 2);
        cr_assert_eq(out->meta.shape[0], M);
        cr_assert_eq(out->meta.shape[1], N);
        double tol = d ? 1e-12 : 1e-5;
        for (int64_t i = 0; i < M * N; i++)
          cr_assert(fabs(at(out, i) - at(ref, i)) <= tol * (1 + fabs(at(ref, i))),
                    "%s %lldx%lldx%lld ta=%d tb=%d [%lld]: %g vs %g",
                    d ? "f64" : "f32", (long long)M, (long long)K,
                    (long long)N, ta, tb, (long long)i, at(out, i), at(ref, i));
        dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
        dsp_tensor_unref(out), dsp_tensor_unref(ref);
        dsp_tensor_unref(a), dsp_tensor_unref(b);
      }
  dsp_ctx_free(ctx);
}

Test(matmul_t, empty_inner_dim_gives_zeros) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_set_grad_enabled(ctx, 0);
  dsp_tensor *a = mk(ctx, DSP_F32, 0, 3), *b = mk(ctx, DSP_F32, 0, 4), *out;
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 1, b, 0, &out), 0);
  cr_assert_eq(out->numel, 12);
  for (int i = 0; i < 12; i++) cr_assert(at(out, i) == 0.0);
  dsp_tensor_unref(out), dsp_tensor_unref(a), dsp_tensor_unref(b);
  dsp_ctx_free(ctx);
}

Test(matmul_t, refusals_and_limits) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *a = mk(ctx, DSP_F32, 4, 3), *b = mk(ctx, DSP_F32, 4, 5), *out;
  /* grad mode on: it would record nothing, so it declines */
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 1, b, 0, &out), 1);
  cr_assert_null(out);
  dsp_set_grad_enabled(ctx, 0);
  /* inner dims that do not match: the matmul's own error */
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 0, b, 0, &out), DISPATCH_ESHAPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "inner dims"), "%s",
            dsp_ctx_errmsg(ctx));
  /* a dtype mix or a 1-D operand: left to transpose + matmul */
  dsp_tensor *d = NULL;
  dsp_meta md = {DSP_F64, 2, {4, 5}}, m1 = {DSP_F32, 1, {4}};
  cr_assert_eq(dsp_tensor_new(ctx, &md, &d), 0);
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 1, d, 0, &out), 1);
  dsp_tensor_unref(d);
  cr_assert_eq(dsp_tensor_new(ctx, &m1, &d), 0);
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 1, d, 0, &out), 1);
  dsp_tensor_unref(d);
  /* the per-op cost limit applies as it does to dsp_op */
  dsp_ctx_set_max_op_cost(ctx, 10);
  cr_assert_eq(dsp__cpu_matmul_t(ctx, a, 1, b, 0, &out), DISPATCH_ELIMIT);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "max-op-cost"), "%s",
            dsp_ctx_errmsg(ctx));
  dsp_ctx_set_max_op_cost(ctx, 0);
  /* so does cancellation */
  dsp_ctx_cancel(ctx);
  cr_assert_lt(dsp__cpu_matmul_t(ctx, a, 1, b, 0, &out), 0);
  cr_assert_null(out);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
  dsp_ctx_free(ctx);
}
