/* matmul: numpy.matmul semantics (1-D promotion, batch broadcasting)
 * checked against a naive triple loop, plus every validation error. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/failalloc.h"
#include "helpers/tensor_util.h"

/* ---- small local helpers ------------------------------------------ */

static uint64_t g_rng = 88172645463325252ull;
static double urand(void) { /* xorshift64: deterministic test data */
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

static dsp_tensor *mm(dsp_ctx *ctx, dsp_tensor *a, dsp_tensor *b) {
  dsp_tensor *in[2] = {a, b}, *out = NULL;
  dsp_attrs at0 = dsp_attrs_none();
  int rc = dsp_op(ctx, DSP_OP_MATMUL, in, 2, &at0, &out);
  cr_assert_eq(rc, 0, "matmul failed: %s", dsp_ctx_errmsg(ctx));
  return out;
}

static void assert_shape(const dsp_tensor *t, int nd, const int64_t *s) {
  cr_assert_eq(t->meta.ndim, nd, "rank %d, expected %d", t->meta.ndim, nd);
  for (int i = 0; i < nd; i++)
    cr_assert_eq(t->meta.shape[i], s[i], "dim %d is %lld, expected %lld", i,
                 (long long)t->meta.shape[i], (long long)s[i]);
}

/* Naive numpy.matmul on already-promoted 2+-D shapes with broadcasting
 * batch dims: out[batch..., i, j] = sum_k a[..., i, k] b[..., k, j]. */
static void naive(const dsp_tensor *a, const dsp_tensor *b, int a1d, int b1d,
                  const dsp_tensor *out, double tol) {
  dsp_meta A = a->meta, B = b->meta;
  if (a1d) A = (dsp_meta){A.dtype, 2, {1, A.shape[0]}};
  if (b1d) B = (dsp_meta){B.dtype, 2, {B.shape[0], 1}};
  int64_t M = A.shape[A.ndim - 2], K = A.shape[A.ndim - 1],
          N = B.shape[B.ndim - 1];
  int nba = A.ndim - 2, nbb = B.ndim - 2, nb = nba > nbb ? nba : nbb;
  int64_t bs[DSP_MAX_DIMS], nbat = 1;
  for (int i = 0; i < nb; i++) {
    int ia = nba - nb + i, ib = nbb - nb + i;
    int64_t da = ia >= 0 ? A.shape[ia] : 1, db = ib >= 0 ? B.shape[ib] : 1;
    bs[i] = da > db ? da : db;
    nbat *= bs[i];
  }
  cr_assert_eq(out->numel, nbat * M * N);
  for (int64_t e = 0; e < nbat; e++) {
    int64_t rem = e, offa = 0, offb = 0, sa = 1, sb = 1;
    for (int i = nb - 1; i >= 0; i--) {
      int64_t idx = rem % bs[i];
      rem /= bs[i];
      int ia = nba - nb + i, ib = nbb - nb + i;
      if (ia >= 0) {
        offa += (A.shape[ia] == 1 ? 0 : idx) * sa;
        sa *= A.shape[ia];
      }
      if (ib >= 0) {
        offb += (B.shape[ib] == 1 ? 0 : idx) * sb;
        sb *= B.shape[ib];
      }
    }
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++)
          s += tu_at(a, offa * M * K + i * K + k) * tu_at(b, offb * K * N + k * N + j);
        double got = tu_at(out, e * M * N + i * N + j);
        cr_assert(fabs(got - s) <= tol, "batch %lld [%lld,%lld]: got %.9g want %.9g",
                  (long long)e, (long long)i, (long long)j, got, s);
      }
  }
}

/* ---- forward values ------------------------------------------------ */

Test(matmul, two_by_two_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {7, 8, 9, 10, 11, 12};
  int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
  dsp_tensor *a = mk(ctx, DSP_F32, 2, sa, av), *b = mk(ctx, DSP_F32, 2, sb, bv);
  dsp_tensor *c = mm(ctx, a, b);
  int64_t sc[2] = {2, 2};
  assert_shape(c, 2, sc);
  double want[4] = {58, 64, 139, 154};
  for (int i = 0; i < 4; i++) cr_assert_eq(tu_at(c, i), want[i]);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  dsp_ctx_free(ctx);
}

Test(matmul, two_d_matches_naive_f32_and_f64) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_dtype dts[2] = {DSP_F32, DSP_F64};
  for (int d = 0; d < 2; d++) {
    int64_t sa[2] = {17, 33}, sb[2] = {33, 9};
    dsp_tensor *a = mk(ctx, dts[d], 2, sa, NULL), *b = mk(ctx, dts[d], 2, sb, NULL);
    dsp_tensor *c = mm(ctx, a, b);
    cr_assert_eq(c->meta.dtype, dts[d]);
    naive(a, b, 0, 0, c, d ? 1e-12 : 1e-4);
    dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  }
  dsp_ctx_free(ctx);
}

Test(matmul, batch_dims_broadcast) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sa[4] = {2, 1, 3, 4}, sb[3] = {5, 4, 2};
  dsp_tensor *a = mk(ctx, DSP_F64, 4, sa, NULL), *b = mk(ctx, DSP_F64, 3, sb, NULL);
  dsp_tensor *c = mm(ctx, a, b);
  int64_t want[4] = {2, 5, 3, 2};
  assert_shape(c, 4, want);
  naive(a, b, 0, 0, c, 1e-12);
  dsp_tensor_unref(c);
  /* and the mirror: batched left, broadcast right with size-1 dims */
  int64_t sa2[3] = {3, 2, 4}, sb2[4] = {2, 1, 4, 5};
  dsp_tensor *a2 = mk(ctx, DSP_F32, 3, sa2, NULL), *b2 = mk(ctx, DSP_F32, 4, sb2, NULL);
  c = mm(ctx, a2, b2);
  int64_t want2[4] = {2, 3, 2, 5};
  assert_shape(c, 4, want2);
  naive(a2, b2, 0, 0, c, 1e-5);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  dsp_tensor_unref(a2), dsp_tensor_unref(b2);
  dsp_ctx_free(ctx);
}

Test(matmul, batched_left_with_shared_right_folds_into_one_product) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sa[3] = {3, 2, 4}, sb[2] = {4, 5}, sb1[3] = {1, 4, 5};
  dsp_tensor *a = mk(ctx, DSP_F64, 3, sa, NULL), *b = mk(ctx, DSP_F64, 2, sb, NULL);
  dsp_tensor *c = mm(ctx, a, b);
  int64_t want[3] = {3, 2, 5};
  assert_shape(c, 3, want);
  naive(a, b, 0, 0, c, 1e-12);
  dsp_tensor *b1 = mk(ctx, DSP_F64, 3, sb1, dsp_tensor_data(b));
  dsp_tensor *c1 = mm(ctx, a, b1);
  assert_shape(c1, 3, want);
  cr_assert_eq(memcmp(dsp_tensor_data(c), dsp_tensor_data(c1),
                      dsp_tensor_nbytes(c)), 0);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  dsp_tensor_unref(b1), dsp_tensor_unref(c1);
  dsp_ctx_free(ctx);
}

Test(matmul, one_d_operands_are_promoted_and_dropped) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double v[4] = {1, 2, 3, 4}, w[4] = {5, 6, 7, 8};
  int64_t s4[1] = {4};
  dsp_tensor *a = mk(ctx, DSP_F64, 1, s4, v), *b = mk(ctx, DSP_F64, 1, s4, w);
  dsp_tensor *dot = mm(ctx, a, b);
  cr_assert_eq(dot->meta.ndim, 0);
  cr_assert_eq(tu_at(dot, 0), 70.0);
  dsp_tensor_unref(dot);

  int64_t smat[2] = {4, 3}, sbat[3] = {2, 4, 3}, sl[3] = {3, 2, 4};
  dsp_tensor *m = mk(ctx, DSP_F64, 2, smat, NULL);
  dsp_tensor *r = mm(ctx, a, m); /* [4] @ [4,3] -> [3] */
  int64_t e3[1] = {3};
  assert_shape(r, 1, e3);
  naive(a, m, 1, 0, r, 1e-12);
  dsp_tensor_unref(r);

  dsp_tensor *mb = mk(ctx, DSP_F64, 3, sbat, NULL);
  r = mm(ctx, a, mb); /* [4] @ [2,4,3] -> [2,3] */
  int64_t e23[2] = {2, 3};
  assert_shape(r, 2, e23);
  naive(a, mb, 1, 0, r, 1e-12);
  dsp_tensor_unref(r);

  dsp_tensor *ml = mk(ctx, DSP_F64, 3, sl, NULL);
  r = mm(ctx, ml, b); /* [3,2,4] @ [4] -> [3,2] */
  int64_t e32[2] = {3, 2};
  assert_shape(r, 2, e32);
  naive(ml, b, 0, 1, r, 1e-12);
  dsp_tensor_unref(r);

  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(m);
  dsp_tensor_unref(mb), dsp_tensor_unref(ml);
  dsp_ctx_free(ctx);
}

Test(matmul, empty_inner_dim_gives_zeros_and_empty_rows_give_empty) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sa[2] = {2, 0}, sb[2] = {0, 3}, sz[2] = {0, 4}, sw[2] = {4, 3};
  dsp_tensor *a = mk(ctx, DSP_F32, 2, sa, NULL), *b = mk(ctx, DSP_F32, 2, sb, NULL);
  dsp_tensor *c = mm(ctx, a, b);
  int64_t e[2] = {2, 3};
  assert_shape(c, 2, e);
  for (int i = 0; i < 6; i++) cr_assert_eq(tu_at(c, i), 0.0);
  dsp_tensor *z = mk(ctx, DSP_F32, 2, sz, NULL), *w = mk(ctx, DSP_F32, 2, sw, NULL);
  dsp_tensor *c2 = mm(ctx, z, w);
  int64_t e2[2] = {0, 3};
  assert_shape(c2, 2, e2);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  dsp_tensor_unref(z), dsp_tensor_unref(w), dsp_tensor_unref(c2);
  dsp_ctx_free(ctx);
}

Test(matmul, repeated_runs_are_bit_identical) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t sa[3] = {3, 70, 90}, sb[3] = {3, 90, 50};
  dsp_tensor *a = mk(ctx, DSP_F32, 3, sa, NULL), *b = mk(ctx, DSP_F32, 3, sb, NULL);
  dsp_tensor *c1 = mm(ctx, a, b), *c2 = mm(ctx, a, b);
  cr_assert_eq(memcmp(dsp_tensor_data(c1), dsp_tensor_data(c2),
                      dsp_tensor_nbytes(c1)), 0);
  naive(a, b, 0, 0, c1, 1e-4);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c1),
      dsp_tensor_unref(c2);
  dsp_ctx_free(ctx);
}

/* ---- errors -------------------------------------------------------- */

static int infer2(dsp_ctx *ctx, dsp_meta a, dsp_meta b, dsp_meta *out) {
  dsp_meta in[2] = {a, b};
  dsp_attrs at0 = dsp_attrs_none();
  return dsp_op_infer(ctx, DSP_OP_MATMUL, in, 2, &at0, out);
}

Test(matmul_errors, inner_dim_mismatch_names_both) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta out;
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 2, {2, 3}},
                      (dsp_meta){DSP_F32, 2, {4, 5}}, &out),
               DISPATCH_ESHAPE);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "matmul: inner dims 3 and 4 differ");
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 1, {3}},
                      (dsp_meta){DSP_F32, 1, {4}}, &out),
               DISPATCH_ESHAPE);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "matmul: inner dims 3 and 4 differ");
  dsp_ctx_free(ctx);
}

Test(matmul_errors, batch_dims_that_do_not_broadcast) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta out;
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 3, {2, 3, 4}},
                      (dsp_meta){DSP_F32, 3, {3, 4, 5}}, &out),
               DISPATCH_ESHAPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "[2, 3, 4] and [3, 4, 5]"), "%s",
            dsp_ctx_errmsg(ctx));
  dsp_ctx_free(ctx);
}

Test(matmul_errors, dtypes_ranks_and_attrs) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta out;
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 2, {2, 3}},
                      (dsp_meta){DSP_F64, 2, {3, 2}}, &out),
               DISPATCH_EDTYPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "f32 and f64"), "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_I64, 2, {2, 3}},
                      (dsp_meta){DSP_I64, 2, {3, 2}}, &out),
               DISPATCH_EDTYPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "i64"), "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 0, {0}},
                      (dsp_meta){DSP_F32, 2, {3, 2}}, &out),
               DISPATCH_ESHAPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "rank"), "%s", dsp_ctx_errmsg(ctx));
  dsp_meta in[2] = {{DSP_F32, 2, {2, 3}}, {DSP_F32, 2, {3, 2}}};
  dsp_attrs a1 = dsp_attrs_f1(1.0);
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_MATMUL, in, 2, &a1, &out),
               DISPATCH_EINVAL);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "no attributes"));
  /* the result rank may not exceed 8 */
  dsp_meta big = {DSP_F32, 8, {1, 1, 1, 1, 1, 1, 2, 3}};
  cr_assert_eq(infer2(ctx, big, (dsp_meta){DSP_F32, 2, {3, 2}}, &out), 0);
  cr_assert_eq(out.ndim, 8);
  dsp_ctx_free(ctx);
}

Test(matmul_errors, dims_beyond_blas_int_are_refused) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta out;
  cr_assert_eq(infer2(ctx, (dsp_meta){DSP_F32, 2, {0, (int64_t)1 << 32}},
                      (dsp_meta){DSP_F32, 2, {(int64_t)1 << 32, 0}}, &out),
               DISPATCH_EOVERFLOW);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "BLAS"), "%s", dsp_ctx_errmsg(ctx));
  dsp_ctx_free(ctx);
}

/* ---- allocation failure ------------------------------------------- */

Test(matmul, every_allocation_failure_is_enomem_without_leaks) {
  dsp_meta in[2] = {{DSP_F32, 3, {2, 3, 4}}, {DSP_F32, 3, {2, 4, 5}}};
  cr_assert(failalloc_walk_op(DSP_OP_MATMUL, 2, in, NULL) >= 4,
            "ctx, 2 inputs and the output");
}
