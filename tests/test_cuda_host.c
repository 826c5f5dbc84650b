/* Host checks of the CUDA backend (no GPU needed).
 *
 * The kernels of common/cuda/kernels.cu are grid loops around the math of
 * cuda_math.h and the plans of cuda_plan.h. Here each kernel is replayed
 * on the host, with the same plans and the same functions (a "thread" is
 * one iteration; block reductions are replayed with the same 256 strided
 * partials and the same merge tree), on random inputs with broadcasting,
 * NaN, infinities and ties, and compared with the CPU backend's result of
 * the same op: bit for bit where the math is the same sequence of
 * operations (elementwise, max/argmax, shape ops, random numbers,
 * optimizer steps), within a rounding tolerance where the parallel order
 * differs (sums, softmax, cross entropy, matmul).
 *
 * With the backend built (DSP_CUDA_BUILT=1) it also opens the backend: on
 * a host without a GPU that must fail with a one-line reason, and no
 * crash. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn_math.h"
#include "half.h"
#include "cuda_math.h"
#include "cuda_plan.h"
#include "norm_math.h"
#include "loss_math.h"
#include "backend.h"
#include "dsp.h"
#include "helpers/tensor_util.h"
#include "rng.h"

#if DSP_CUDA_BUILT
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "dsp_cuda.h"
#endif

#define TPB DSP__CU_TPB /* threads per block of the reduction kernels */

static dsp_ctx *ctx;
static uint64_t g_seed = 12345;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(cuda_host, .init = setup, .fini = teardown);

static uint64_t rnd(void) { return dsp_rng_u64(0xC0DA, g_seed++); }
static double urnd(void) { return dsp_rng_uniform01(0xC0DA, g_seed++); }

/* A random value: small integers (ties), reals, and with `special` now
 * and then NaN, +-inf, -0 */
static double rval(int special) {
  uint64_t r = rnd() % 64;
  if (special && r == 0) return NAN;
  if (special && r == 1) return INFINITY;
  if (special && r == 2) return -INFINITY;
  if (special && r == 3) return -0.0;
  if (r < 24) return (double)((int64_t)(rnd() % 7) - 3);
  return (urnd() - 0.5) * 8.0;
}

static dsp_meta meta_of(dsp_dtype dt, int nd, const int64_t *sh) {
  dsp_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = dt, m.ndim = nd;
  for (int d = 0; d < nd; d++) m.shape[d] = sh[d];
  return m;
}

/* Random tensor; i64 values avoid 0 when nonzero is set (divisors). */
static dsp_tensor *mk(dsp_dtype dt, int nd, const int64_t *sh, int special,
                      int nonzero) {
  dsp_meta m = meta_of(dt, nd, sh);
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  void *p = dsp_tensor_data(t);
  for (int64_t i = 0; i < t->numel; i++) {
    double v = rval(special);
    switch (dt) {
      case DSP_F32: ((float *)p)[i] = (float)v; break;
      case DSP_F64: ((double *)p)[i] = v; break;
      case DSP_F16: ((uint16_t *)p)[i] = dsp_f64_to_f16(v); break;
      case DSP_BF16: ((uint16_t *)p)[i] = dsp_f64_to_bf16(v); break;
      case DSP_I64: {
        int64_t x = (int64_t)(rnd() % 9) - 4;
        if (rnd() % 16 == 0) x = (int64_t)rnd(); /* wrapping range */
        if (nonzero && x == 0) x = 3;
        ((int64_t *)p)[i] = x;
        break;
      }
      default: ((uint8_t *)p)[i] = (uint8_t)(rnd() & 1); break;
    }
  }
  return t;
}

static dsp_tensor *run(dsp_opcode op, const dsp_attrs *a, int n,
                       dsp_tensor *const *in) {
  dsp_tensor *o = NULL;
  int rc = dsp_op(ctx, op, in, n, a, &o);
  cr_assert_eq(rc, 0, "%s: %s", dsp_op_lookup((int)op)->name, dsp_ctx_errmsg(ctx));
  return o;
}

static dsp_tensor *empty_like(const dsp_tensor *t) {
  dsp_tensor *o = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &t->meta, &o), 0);
  return o;
}

static void assert_same_bytes(const dsp_tensor *got, const dsp_tensor *want,
                              const char *what) {
  cr_assert(dsp_meta_equal(&got->meta, &want->meta), "%s: meta differs", what);
  size_t es = dsp_dtype_size(want->meta.dtype);
  const uint8_t *g = dsp_tensor_data(got), *w = dsp_tensor_data(want);
  for (int64_t i = 0; i < want->numel; i++)
    cr_assert(memcmp(g + i * es, w + i * es, es) == 0,
              "%s: element %lld differs from the CPU kernel", what, (long long)i);
}

static double ld(const dsp_tensor *t, int64_t i);

/* |got - want| <= tol * scale, NaN matching NaN, inf matching inf */
static void assert_close(const dsp_tensor *got, const dsp_tensor *want,
                         double tol, const double *scale, const char *what) {
  for (int64_t i = 0; i < want->numel; i++) {
    double g = ld(got, i), w = ld(want, i);
    if (isnan(w) || isinf(w)) {
      cr_assert(isnan(w) ? isnan(g) : g == w, "%s: element %lld: %g vs CPU %g",
                what, (long long)i, g, w);
      continue;
    }
    double sc = scale ? scale[i] : fabs(w);
    if (sc < 1) sc = 1;
    cr_assert(fabs(g - w) <= tol * sc, "%s: element %lld: %.17g vs CPU %.17g",
              what, (long long)i, g, w);
  }
}

static double ld(const dsp_tensor *t, int64_t i) {
  switch (t->meta.dtype) {
    case DSP_F32: return ((float *)dsp_tensor_data(t))[i];
    case DSP_F64: return ((double *)dsp_tensor_data(t))[i];
    case DSP_I64: return (double)((int64_t *)dsp_tensor_data(t))[i];
    case DSP_F16: return dsp_f16_to_f32(((uint16_t *)dsp_tensor_data(t))[i]);
    case DSP_BF16: return dsp_bf16_to_f32(((uint16_t *)dsp_tensor_data(t))[i]);
    default: return ((uint8_t *)dsp_tensor_data(t))[i];
  }
}

/* ------------------------------------------------------------------ */
/* elementwise                                                         */

typedef struct shp {
  int nd;
  int64_t s[4];
} shp;

static const shp PAIRS[][2] = {
    {{2, {2, 3}}, {1, {3}}},          {{3, {4, 1, 3}}, {3, {1, 5, 1}}},
    {{1, {1}}, {2, {2, 2}}},          {{2, {3, 1}}, {3, {1, 1, 4}}},
    {{3, {2, 3, 4}}, {3, {2, 3, 4}}}, {{1, {5}}, {0, {0}}},
    {{4, {2, 1, 3, 2}}, {2, {3, 1}}}, {{2, {1, 7}}, {2, {6, 1}}},
};

/* the kernel k_binary, replayed */
static dsp_tensor *sim_binary(dsp_opcode op, dsp_tensor *a, dsp_tensor *b,
                              const dsp_tensor *like) {
  dsp_tensor *o = empty_like(like);
  const dsp_meta *ms[2] = {&a->meta, &b->meta};
  dsp__cu_index ix;
  dsp__cu_plan_bcast(&ix, &o->meta, ms, 2);
  int cmp = op >= DSP_OP_EQ && op <= DSP_OP_GE;
  void *A = dsp_tensor_data(a), *B = dsp_tensor_data(b), *O = dsp_tensor_data(o);
  for (int64_t i = 0; i < o->numel; i++) {
    int64_t off[3];
    dsp__cu_offsets(&ix, i, off);
    switch (a->meta.dtype) {
      case DSP_F32: {
        float x = ((float *)A)[off[0]], y = ((float *)B)[off[1]];
        if (cmp) ((uint8_t *)O)[i] = dsp__sm_cmp_f32(op, x, y);
        else ((float *)O)[i] = dsp__sm_bin_f32(op, x, y);
        break;
      }
      case DSP_F64: {
        double x = ((double *)A)[off[0]], y = ((double *)B)[off[1]];
        if (cmp) ((uint8_t *)O)[i] = dsp__sm_cmp_f64(op, x, y);
        else ((double *)O)[i] = dsp__sm_bin_f64(op, x, y);
        break;
      }
      case DSP_I64: {
        int64_t x = ((int64_t *)A)[off[0]], y = ((int64_t *)B)[off[1]];
        if (cmp) ((uint8_t *)O)[i] = dsp__sm_cmp_i64(op, x, y);
        else ((int64_t *)O)[i] = dsp__sm_bin_i64(op, x, y);
        break;
      }
      default:
        ((uint8_t *)O)[i] =
            dsp__sm_cmp_u8(op, ((uint8_t *)A)[off[0]], ((uint8_t *)B)[off[1]]);
    }
  }
  return o;
}

Test(cuda_host, binary_and_comparisons_with_broadcasting_match_cpu) {
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64, DSP_BOOL};
  int checked = 0;
  for (size_t p = 0; p < sizeof PAIRS / sizeof PAIRS[0]; p++)
    for (int swap = 0; swap < 2; swap++)
      for (int di = 0; di < 4; di++)
        for (int op = DSP_OP_ADD; op <= DSP_OP_GE; op++) {
          dsp_dtype dt = dts[di];
          if (dt == DSP_BOOL && op != DSP_OP_EQ && op != DSP_OP_NE) continue;
          const shp *sa = &PAIRS[p][swap], *sb = &PAIRS[p][!swap];
          dsp_tensor *in[2] = {mk(dt, sa->nd, sa->s, 1, 0),
                               mk(dt, sb->nd, sb->s, 1, op == DSP_OP_DIV)};
          dsp_tensor *want = run((dsp_opcode)op, NULL, 2, in);
          dsp_tensor *got = sim_binary((dsp_opcode)op, in[0], in[1], want);
          assert_same_bytes(got, want, dsp_op_lookup(op)->name);
          checked++;
          dsp_tensor_unref(got), dsp_tensor_unref(want);
          dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
        }
  cr_assert_gt(checked, 400);
}

Test(cuda_host, i64_edge_cases_wrap_like_cpu) {
  cr_assert_eq(dsp__sm_bin_i64(DSP_OP_DIV, INT64_MIN, -1), INT64_MIN);
  cr_assert_eq(dsp__sm_bin_i64(DSP_OP_DIV, -7, 2), -3);
  cr_assert_eq(dsp__sm_bin_i64(DSP_OP_ADD, INT64_MAX, 1), INT64_MIN);
  cr_assert_eq(dsp__sm_unary_i64(DSP_OP_NEG, INT64_MIN), INT64_MIN);
  cr_assert_eq(dsp__sm_unary_i64(DSP_OP_ABS, INT64_MIN), INT64_MIN);
  cr_assert_eq(dsp__cu_f2i64(NAN), 0);
  cr_assert_eq(dsp__cu_f2i64(1e300), INT64_MAX);
  cr_assert_eq(dsp__cu_f2i64(-1e300), INT64_MIN);
  cr_assert_eq(dsp__cu_f2i64(-2.9), -2);
}

Test(cuda_host, where_three_way_broadcast_matches_cpu) {
  static const shp T[][3] = {
      {{2, {2, 1}}, {1, {3}}, {2, {1, 1}}},
      {{1, {4}}, {3, {2, 3, 4}}, {2, {3, 1}}},
      {{3, {2, 3, 4}}, {3, {2, 3, 4}}, {3, {2, 3, 4}}},
  };
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64, DSP_BOOL};
  for (size_t t = 0; t < sizeof T / sizeof T[0]; t++)
    for (int di = 0; di < 4; di++) {
      dsp_tensor *in[3] = {mk(DSP_BOOL, T[t][0].nd, T[t][0].s, 0, 0),
                           mk(dts[di], T[t][1].nd, T[t][1].s, 1, 0),
                           mk(dts[di], T[t][2].nd, T[t][2].s, 1, 0)};
      dsp_tensor *want = run(DSP_OP_WHERE, NULL, 3, in);
      dsp_tensor *got = empty_like(want);
      const dsp_meta *ms[3] = {&in[0]->meta, &in[1]->meta, &in[2]->meta};
      dsp__cu_index ix;
      dsp__cu_plan_bcast(&ix, &got->meta, ms, 3);
      size_t es = dsp_dtype_size(dts[di]);
      for (int64_t i = 0; i < got->numel; i++) {
        int64_t off[3];
        dsp__cu_offsets(&ix, i, off);
        const uint8_t *m = dsp_tensor_data(in[0]);
        const char *src = m[off[0]] ? (char *)dsp_tensor_data(in[1]) + off[1] * es
                                    : (char *)dsp_tensor_data(in[2]) + off[2] * es;
        memcpy((char *)dsp_tensor_data(got) + i * es, src, es);
      }
      assert_same_bytes(got, want, "where");
      dsp_tensor_unref(got), dsp_tensor_unref(want);
      for (int k = 0; k < 3; k++) dsp_tensor_unref(in[k]);
    }
}

/* the kernel k_map, replayed */
static void sim_map(dsp_opcode op, const dsp_tensor *x, const dsp_tensor *y,
                    double s, dsp_tensor *o) {
  int sc = op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR;
  int bw = dsp__sm_is_act_bw(op);
  for (int64_t i = 0; i < o->numel; i++) {
    switch (x->meta.dtype) {
      case DSP_F32: {
        float v = ((float *)dsp_tensor_data(x))[i];
        float w = y ? ((float *)dsp_tensor_data(y))[i] : 0.0f;
        ((float *)dsp_tensor_data(o))[i] =
            sc ? dsp__sm_scalar_f32(op, v, (float)s)
               : bw ? dsp__sm_act_bw_f32(op, v, w) : dsp__sm_unary_f32(op, v);
        break;
      }
      case DSP_F64: {
        double v = ((double *)dsp_tensor_data(x))[i];
        double w = y ? ((double *)dsp_tensor_data(y))[i] : 0.0;
        ((double *)dsp_tensor_data(o))[i] =
            sc ? dsp__sm_scalar_f64(op, v, s)
               : bw ? dsp__sm_act_bw_f64(op, v, w) : dsp__sm_unary_f64(op, v);
        break;
      }
      default: {
        int64_t v = ((int64_t *)dsp_tensor_data(x))[i];
        int64_t w = y ? ((int64_t *)dsp_tensor_data(y))[i] : 0;
        ((int64_t *)dsp_tensor_data(o))[i] =
            sc ? dsp__sm_scalar_i64(op, v, (int64_t)s)
               : bw ? dsp__sm_act_bw_i64(op, v, w) : dsp__sm_unary_i64(op, v);
      }
    }
  }
}

Test(cuda_host, scalar_unary_and_activation_backward_match_cpu) {
  static const int64_t S[] = {3, 41};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64};
  static const double scal[] = {2.0, -3.0, 0.5, 0.0};
  int checked = 0;
  for (int di = 0; di < 3; di++)
    /* the scalar forms, unary ops (silu, softplus, gelu_tanh among them)
     * and the activation backward ops: codes 14..39 */
    for (int op = DSP_OP_ADD_SCALAR; op <= DSP_OP_GELU_TANH_BACKWARD; op++)
      for (int si = 0; si < 4; si++) {
        dsp_dtype dt = dts[di];
        int sc = op <= DSP_OP_RDIV_SCALAR;
        if (!sc && si > 0) continue;
        dsp_meta m = meta_of(dt, 2, S), om;
        int nin = dsp_op_lookup(op)->n_inputs;
        dsp_meta ms[2] = {m, m};
        dsp_attrs a = sc ? dsp_attrs_f1(scal[si]) : dsp_attrs_none();
        if (dsp_op_infer(ctx, (dsp_opcode)op, ms, nin, &a, &om) < 0) continue;
        dsp_tensor *in[2] = {mk(dt, 2, S, 1, 0), mk(dt, 2, S, 1, 0)};
        dsp_tensor *want = run((dsp_opcode)op, &a, nin, in);
        dsp_tensor *got = empty_like(want);
        sim_map((dsp_opcode)op, in[0], nin > 1 ? in[1] : NULL, scal[si], got);
        assert_same_bytes(got, want, dsp_op_lookup(op)->name);
        checked++;
        dsp_tensor_unref(got), dsp_tensor_unref(want);
        dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
      }
  cr_assert_gt(checked, 70);
}

/* k_clamp and k_masked_fill, replayed */
Test(cuda_host, clamp_and_masked_fill_match_cpu) {
  static const int64_t S[] = {3, 41}, M[] = {3, 1};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64};
  static const double B[][2] = {{-1, 2}, {-INFINITY, 0}, {3, -3}, {0, INFINITY}};
  for (int di = 0; di < 3; di++) {
    dsp_dtype dt = dts[di];
    for (int bi = 0; bi < 4; bi++) {
      dsp_tensor *x = mk(dt, 2, S, 1, 0);
      dsp_attrs a = dsp_attrs_none();
      a.floats[0] = B[bi][0], a.floats[1] = B[bi][1], a.n_floats = 2;
      dsp_tensor *want = run(DSP_OP_CLAMP, &a, 1, &x);
      dsp_tensor *got = empty_like(want);
      for (int64_t i = 0; i < x->numel; i++) {
        void *X = dsp_tensor_data(x), *G = dsp_tensor_data(got);
        if (dt == DSP_F32)
          ((float *)G)[i] = dsp__sm_clamp_f32(((float *)X)[i], (float)B[bi][0],
                                              (float)B[bi][1]);
        else if (dt == DSP_F64)
          ((double *)G)[i] = dsp__sm_clamp_f64(((double *)X)[i], B[bi][0], B[bi][1]);
        else {
          /* k_clamp's bound conversion: infinite is the i64 end */
          int64_t lo = B[bi][0] == -INFINITY ? INT64_MIN : (int64_t)B[bi][0];
          int64_t hi = B[bi][1] == INFINITY ? INT64_MAX : (int64_t)B[bi][1];
          ((int64_t *)G)[i] = dsp__sm_clamp_i64(((int64_t *)X)[i], lo, hi);
        }
      }
      assert_same_bytes(got, want, "clamp");
      dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(x);
    }
    dsp_tensor *in[2] = {mk(dt, 2, S, 1, 0), mk(DSP_BOOL, 2, M, 0, 0)};
    dsp_attrs a = dsp_attrs_f1(-5);
    dsp_tensor *want = run(DSP_OP_MASKED_FILL, &a, 2, in);
    dsp_tensor *got = empty_like(want);
    const dsp_meta *ms[2] = {&in[1]->meta, &in[0]->meta};
    dsp__cu_index ix;
    dsp__cu_plan_bcast(&ix, &got->meta, ms, 2);
    size_t es = dsp_dtype_size(dt);
    for (int64_t i = 0; i < got->numel; i++) {
      int64_t off[3];
      dsp__cu_offsets(&ix, i, off);
      char *g = (char *)dsp_tensor_data(got) + i * es;
      if (((uint8_t *)dsp_tensor_data(in[1]))[off[0]]) {
        if (dt == DSP_F32) *(float *)g = -5.0f;
        else if (dt == DSP_F64) *(double *)g = -5.0;
        else *(int64_t *)g = -5;
      } else {
        memcpy(g, (char *)dsp_tensor_data(in[0]) + off[1] * es, es);
      }
    }
    assert_same_bytes(got, want, "masked_fill");
    dsp_tensor_unref(got), dsp_tensor_unref(want);
    dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  }
}

/* ------------------------------------------------------------------ */
/* reductions                                                          */

/* k_red for one block: thread t folds elements lo + t, lo + t + TPB, ...
 * below hi, then the halving merge tree of block_reduce; k_red_fin: the
 * same over S partials. One macro per partial type. */
#define SIM_RED(NAME, A, ID, ADD, MERGE)                                     \
  static A NAME##_part(const dsp_tensor *x, const dsp__cu_index *inner,      \
                       int64_t base, int64_t lo, int64_t hi) {               \
    A p[TPB];                                                                \
    for (int t = 0; t < TPB; t++) {                                          \
      p[t] = ID;                                                             \
      for (int64_t r = lo + t; r < hi; r += TPB) {                           \
        int64_t io[3];                                                       \
        dsp__cu_offsets(inner, r, io);                                       \
        ADD(p[t], x, base + io[0], r);                                       \
      }                                                                      \
    }                                                                        \
    for (int w = TPB / 2; w > 0; w >>= 1)                                    \
      for (int t = 0; t < w; t++) p[t] = MERGE(p[t], p[t + w]);              \
    return p[0];                                                             \
  }                                                                          \
  static A NAME##_fin(const A *part, int64_t S) {                            \
    A p[TPB];                                                                \
    for (int t = 0; t < TPB; t++) {                                          \
      p[t] = ID;                                                             \
      for (int64_t k = t; k < S; k += TPB) p[t] = MERGE(p[t], part[k]);      \
    }                                                                        \
    for (int w = TPB / 2; w > 0; w >>= 1)                                    \
      for (int t = 0; t < w; t++) p[t] = MERGE(p[t], p[t + w]);              \
    return p[0];                                                             \
  }                                                                          \
  static A NAME(const dsp_tensor *x, const dsp__cu_index *inner,             \
                int64_t base, int64_t R, int64_t S) {                        \
    if (S == 1) return NAME##_part(x, inner, base, 0, R);                    \
    A part[1024];                                                            \
    for (int64_t k = 0; k < S; k++) {                                        \
      int64_t lo, hi;                                                        \
      dsp__cu_red_chunk(R, S, k, &lo, &hi);                                  \
      part[k] = NAME##_part(x, inner, base, lo, hi);                         \
    }                                                                        \
    return NAME##_fin(part, S);                                              \
  }

#define ADD_KSUM(a, x, i, r) dsp__cu_ksum_add(&(a), ld(x, i))
#define ADD_AMAXF(a, x, i, r) \
  ((a) = dsp__cu_amax_f_merge((a), (dsp__cu_amax_f){ld(x, i), (r)}))
#define ADD_AMAXI(a, x, i, r) \
  ((a) = dsp__cu_amax_i_merge((a), (dsp__cu_amax_i){((int64_t *)dsp_tensor_data(x))[i], (r)}))
#define ADD_AMINF(a, x, i, r) \
  ((a) = dsp__cu_amin_f_merge((a), (dsp__cu_amax_f){ld(x, i), (r)}))
#define ADD_AMINI(a, x, i, r) \
  ((a) = dsp__cu_amin_i_merge((a), (dsp__cu_amax_i){((int64_t *)dsp_tensor_data(x))[i], (r)}))
/* var's second pass: the deviation from the mean of the output at hand */
static double g_mean;
#define ADD_SQDEV(a, x, i, r) \
  dsp__cu_ksum_add(&(a), (ld(x, i) - g_mean) * (ld(x, i) - g_mean))
#define ADD_U64(a, x, i, r) ((a) += (uint64_t)((int64_t *)dsp_tensor_data(x))[i])
#define MERGE_U64(a, b) ((a) + (b))

SIM_RED(sim_sum, dsp__cu_ksum, dsp__cu_ksum_zero(), ADD_KSUM, dsp__cu_ksum_merge)
SIM_RED(sim_amax_f, dsp__cu_amax_f, dsp__cu_amax_f_id(), ADD_AMAXF, dsp__cu_amax_f_merge)
SIM_RED(sim_amax_i, dsp__cu_amax_i, dsp__cu_amax_i_id(), ADD_AMAXI, dsp__cu_amax_i_merge)
SIM_RED(sim_sum_i, uint64_t, 0, ADD_U64, MERGE_U64)
SIM_RED(sim_amin_f, dsp__cu_amax_f, dsp__cu_amin_f_id(), ADD_AMINF, dsp__cu_amin_f_merge)
SIM_RED(sim_amin_i, dsp__cu_amax_i, dsp__cu_amin_i_id(), ADD_AMINI, dsp__cu_amin_i_merge)
SIM_RED(sim_sqdev, dsp__cu_ksum, dsp__cu_ksum_zero(), ADD_SQDEV, dsp__cu_ksum_merge)

static void check_reduction(dsp_opcode op, dsp_dtype dt, int nd,
                            const int64_t *sh, int nred, const int64_t *dims,
                            int keep, int special, int *split_seen) {
  dsp_tensor *x = mk(dt, nd, sh, special, 0);
  dsp_attrs a = dsp_attrs_ints(nred, dims);
  if (keep) a.n_floats = 1, a.floats[0] = 1;
  dsp_tensor *want = run(op, &a, 1, &x);
  dsp_tensor *got = empty_like(want);
  int red[DSP_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) red[d] = nred == 0;
  for (int i = 0; i < nred; i++) red[dims[i] < 0 ? dims[i] + nd : dims[i]] = 1;
  dsp__cu_index outer, inner;
  int64_t R;
  dsp__cu_plan_red(&x->meta, red, &outer, &inner, &R);
  double *scale = calloc((size_t)want->numel + 1, sizeof *scale);
  const int64_t S = dsp__cu_red_split(got->numel, R);
  if (split_seen && S > 1) (*split_seen)++;
  for (int64_t o = 0; o < got->numel; o++) {
    int64_t oo[3];
    dsp__cu_offsets(&outer, o, oo);
    void *G = dsp_tensor_data(got);
    if (dt == DSP_I64) {
      if (op == DSP_OP_SUM) {
        ((int64_t *)G)[o] = (int64_t)sim_sum_i(x, &inner, oo[0], R, S);
      } else {
        int mn = op == DSP_OP_MIN || op == DSP_OP_ARGMIN;
        dsp__cu_amax_i b = mn ? sim_amin_i(x, &inner, oo[0], R, S)
                              : sim_amax_i(x, &inner, oo[0], R, S);
        ((int64_t *)G)[o] = (op == DSP_OP_MAX || op == DSP_OP_MIN) ? b.v : b.i;
      }
    } else if (op == DSP_OP_SUM || op == DSP_OP_MEAN) {
      double v = dsp__cu_ksum_value(sim_sum(x, &inner, oo[0], R, S));
      if (op == DSP_OP_MEAN) v /= (double)R;
      if (dt == DSP_F32) ((float *)G)[o] = (float)v;
      else ((double *)G)[o] = v;
      for (int64_t r = 0; r < R; r++) {
        int64_t io[3];
        dsp__cu_offsets(&inner, r, io);
        scale[o] += fabs(ld(x, oo[0] + io[0])) / (op == DSP_OP_MEAN ? (double)R : 1);
      }
    } else {
      int mn = op == DSP_OP_MIN || op == DSP_OP_ARGMIN;
      dsp__cu_amax_f b = mn ? sim_amin_f(x, &inner, oo[0], R, S)
                            : sim_amax_f(x, &inner, oo[0], R, S);
      if (op == DSP_OP_ARGMAX || op == DSP_OP_ARGMIN) ((int64_t *)G)[o] = b.i;
      else if (dt == DSP_F32) ((float *)G)[o] = (float)b.v;
      else ((double *)G)[o] = b.v;
    }
  }
  if ((op == DSP_OP_SUM || op == DSP_OP_MEAN) && dt != DSP_I64)
    /* the CPU's sequential double sum may be off by up to R roundings of
     * sum |x| (the compensated one by about one); f32 rounds both to float */
    assert_close(got, want, dt == DSP_F32 ? 2 * FLT_EPSILON : (double)(R + 4) * DBL_EPSILON,
                 scale, dsp_op_lookup(op)->name);
  else
    assert_same_bytes(got, want, dsp_op_lookup(op)->name);
  free(scale);
  dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(x);
}

Test(cuda_host, reductions_match_cpu_on_every_split) {
  static const int64_t S3[] = {3, 5, 7}, S2[] = {4, 700}, S1[] = {1000},
                       S4[] = {2, 1, 3, 4};
  static const int64_t D0[] = {0}, D1[] = {1}, D2[] = {2}, D02[] = {0, 2},
                       Dm1[] = {-1}, D13[] = {1, 3};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64};
  for (int op = DSP_OP_SUM; op <= DSP_OP_ARGMIN; op++)
    for (int di = 0; di < 3; di++) {
      dsp_dtype dt = dts[di];
      if (op == DSP_OP_MEAN && dt == DSP_I64) continue;
      for (int keep = 0; keep < 2; keep++)
        for (int sp = 0; sp < 2; sp++) {
          check_reduction(op, dt, 3, S3, 0, NULL, keep, sp, NULL);
          check_reduction(op, dt, 3, S3, 1, D1, keep, sp, NULL);
          check_reduction(op, dt, 3, S3, 1, D2, keep, sp, NULL);
          check_reduction(op, dt, 3, S3, 1, D0, keep, sp, NULL);
          if (op != DSP_OP_ARGMAX && op != DSP_OP_ARGMIN) {
            check_reduction(op, dt, 3, S3, 2, D02, keep, sp, NULL);
            check_reduction(op, dt, 4, S4, 2, D13, keep, sp, NULL);
          }
          check_reduction(op, dt, 2, S2, 1, Dm1, keep, sp, NULL);
          check_reduction(op, dt, 1, S1, 0, NULL, keep, sp, NULL);
        }
    }
}

Test(cuda_host, reductions_split_over_blocks_match_cpu) {
  /* few outputs over long rows: each output in S chunks, then a merge */
  static const int64_t L1[] = {70000}, L2[] = {3, 20000}, D1[] = {1};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64};
  int split = 0;
  for (int op = DSP_OP_SUM; op <= DSP_OP_ARGMIN; op++)
    for (int di = 0; di < 3; di++) {
      if (op == DSP_OP_MEAN && dts[di] == DSP_I64) continue;
      check_reduction(op, dts[di], 1, L1, 0, NULL, 0, 0, &split);
      check_reduction(op, dts[di], 2, L2, 1, D1, 1, 1, &split);
    }
  cr_assert_eq(split, 34, "every case took the split path (%d)", split);
  cr_assert_eq(dsp__cu_red_split(1, 70000), 17);
  cr_assert_eq(dsp__cu_red_split(300, 1 << 20), 1);
}

/* dsp__cuk_var replayed: the mean as a compensated sum over R (stored as
 * a double), then the squared deviations from it, through
 * dsp__cu_var_final; against the CPU's sequential double sums */
static void check_var(dsp_opcode op, dsp_dtype dt, int nd, const int64_t *sh,
                      int nred, const int64_t *dims, double corr,
                      int *split_seen) {
  dsp_tensor *x = mk(dt, nd, sh, 0, 0);
  dsp_attrs a = dsp_attrs_ints(nred, dims);
  a.floats[0] = 0, a.floats[1] = corr, a.n_floats = 2;
  dsp_tensor *want = run(op, &a, 1, &x);
  dsp_tensor *got = empty_like(want);
  int red[DSP_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) red[d] = nred == 0;
  for (int i = 0; i < nred; i++) red[dims[i] < 0 ? dims[i] + nd : dims[i]] = 1;
  dsp__cu_index outer, inner;
  int64_t R;
  dsp__cu_plan_red(&x->meta, red, &outer, &inner, &R);
  const int64_t S = dsp__cu_red_split(got->numel, R);
  if (split_seen && S > 1) (*split_seen)++;
  double *scale = calloc((size_t)want->numel + 1, sizeof *scale);
  for (int64_t o = 0; o < got->numel; o++) {
    int64_t oo[3];
    dsp__cu_offsets(&outer, o, oo);
    g_mean = dsp__cu_ksum_value(sim_sum(x, &inner, oo[0], R, S)) / (double)R;
    double v = dsp__cu_var_final(dsp__cu_ksum_value(sim_sqdev(x, &inner, oo[0], R, S)),
                                 (double)R, corr, op == DSP_OP_STD);
    if (dt == DSP_F32) ((float *)dsp_tensor_data(got))[o] = (float)v;
    else ((double *)dsp_tensor_data(got))[o] = v;
    scale[o] = fabs(v);
  }
  /* both sum in double: the CPU's plain sums drift by up to about R
   * roundings of the result, the compensated ones by about one */
  assert_close(got, want, dt == DSP_F32 ? 2 * FLT_EPSILON : (double)(2 * R + 8) * DBL_EPSILON,
               scale, dsp_op_lookup(op)->name);
  free(scale);
  dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(x);
}

Test(cuda_host, var_std_match_cpu_on_every_split) {
  static const int64_t S3[] = {3, 5, 7}, L1[] = {70000}, L2[] = {3, 20000};
  static const int64_t D1[] = {1}, D02[] = {0, 2}, Dm1[] = {-1};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64};
  int split = 0;
  for (int op = DSP_OP_VAR; op <= DSP_OP_STD; op++)
    for (int di = 0; di < 2; di++) {
      dsp_dtype dt = dts[di];
      check_var(op, dt, 3, S3, 0, NULL, 1, NULL);
      check_var(op, dt, 3, S3, 1, D1, 0, NULL);
      check_var(op, dt, 3, S3, 2, D02, 1, NULL);
      check_var(op, dt, 3, S3, 1, Dm1, 2, NULL);
      check_var(op, dt, 1, L1, 0, NULL, 1, &split);
      check_var(op, dt, 2, L2, 1, D1, 0, &split);
    }
  cr_assert_eq(split, 8, "the long cases took the split path (%d)", split);
  /* N - correction <= 0: inf, or NaN for a zero sum, as the CPU */
  cr_assert(isinf(dsp__cu_var_final(2.0, 2, 2, 0)));
  cr_assert(isnan(dsp__cu_var_final(0.0, 1, 1, 1)));
}

Test(cuda_host, argmin_merge_is_order_independent) {
  /* the first NaN wins, else the first minimum, in any merge order */
  static const double v[] = {3, -5, 1, -5, NAN, 0, NAN};
  static const double w[] = {3, -5, 1, -5, 2, 0, -5};
  for (uint64_t trial = 0; trial < 200; trial++) {
    int order[7] = {0, 1, 2, 3, 4, 5, 6};
    for (int i = 6; i > 0; i--) {
      int j = (int)(dsp_rng_u64(trial, (uint64_t)i) % (uint64_t)(i + 1));
      int t = order[i];
      order[i] = order[j], order[j] = t;
    }
    dsp__cu_amax_f acc = dsp__cu_amin_f_id(), acc2 = dsp__cu_amin_f_id();
    for (int i = 0; i < 7; i++) {
      dsp__cu_amax_f c = {v[order[i]], order[i]}, c2 = {w[order[i]], order[i]};
      acc = dsp__cu_amin_f_merge(acc, c);
      acc2 = dsp__cu_amin_f_merge(acc2, c2);
    }
    cr_assert_eq(acc.i, 4);
    cr_assert(isnan(acc.v));
    cr_assert_eq(acc2.i, 1);
    cr_assert_eq(acc2.v, -5);
  }
}

Test(cuda_host, compensated_sum_is_exact_where_the_naive_one_is_not) {
  static const double v[] = {1e16, 1.0, -1e16, 1.0};
  dsp__cu_ksum a = dsp__cu_ksum_zero(), b = dsp__cu_ksum_zero();
  for (int i = 0; i < 4; i++) dsp__cu_ksum_add(&a, v[i]);
  cr_assert_eq(dsp__cu_ksum_value(a), 2.0);
  /* split in two partials and merged: still exact */
  dsp__cu_ksum_add(&b, v[2]);
  dsp__cu_ksum_add(&b, v[3]);
  dsp__cu_ksum c = dsp__cu_ksum_zero();
  dsp__cu_ksum_add(&c, v[0]);
  dsp__cu_ksum_add(&c, v[1]);
  cr_assert_eq(dsp__cu_ksum_value(dsp__cu_ksum_merge(c, b)), 2.0);
  /* infinities stay exact, inf - inf is NaN */
  dsp__cu_ksum d = dsp__cu_ksum_zero();
  dsp__cu_ksum_add(&d, INFINITY);
  dsp__cu_ksum_add(&d, 1.0);
  cr_assert_eq(dsp__cu_ksum_value(d), INFINITY);
  dsp__cu_ksum_add(&d, -INFINITY);
  cr_assert(isnan(dsp__cu_ksum_value(d)));
}

Test(cuda_host, argmax_merge_is_order_independent) {
  /* ties and NaNs: any merge order gives the first NaN, else the first max */
  static const double v[] = {1, 5, 5, NAN, 2, NAN, 5};
  for (uint64_t trial = 0; trial < 200; trial++) {
    int order[7] = {0, 1, 2, 3, 4, 5, 6};
    for (int i = 6; i > 0; i--) {
      int j = (int)(dsp_rng_u64(trial, (uint64_t)i) % (uint64_t)(i + 1));
      int t = order[i];
      order[i] = order[j], order[j] = t;
    }
    dsp__cu_amax_f acc = dsp__cu_amax_f_id();
    for (int i = 0; i < 7; i++) {
      dsp__cu_amax_f c = {v[order[i]], order[i]};
      acc = dsp__cu_amax_f_merge(acc, c);
    }
    cr_assert_eq(acc.i, 3);
    cr_assert(isnan(acc.v));
  }
}

/* ------------------------------------------------------------------ */
/* softmax family, cross entropy, mse                                  */

static dsp__cu_lse sim_lse(const double *row, int64_t len, int64_t stride) {
  dsp__cu_lse p[TPB];
  for (int t = 0; t < TPB; t++) {
    p[t] = dsp__cu_lse_id();
    for (int64_t j = t; j < len; j += TPB)
      p[t] = dsp__cu_lse_merge(p[t], dsp__cu_lse_elem(row[j * stride]));
  }
  for (int w = TPB / 2; w > 0; w >>= 1)
    for (int t = 0; t < w; t++) p[t] = dsp__cu_lse_merge(p[t], p[t + w]);
  return dsp__cu_lse_final(p[0]);
}
static double sim_ksum_of(const double *v, int64_t len, int64_t stride) {
  dsp__cu_ksum p[TPB];
  for (int t = 0; t < TPB; t++) {
    p[t] = dsp__cu_ksum_zero();
    for (int64_t j = t; j < len; j += TPB) dsp__cu_ksum_add(&p[t], v[j * stride]);
  }
  for (int w = TPB / 2; w > 0; w >>= 1)
    for (int t = 0; t < w; t++) p[t] = dsp__cu_ksum_merge(p[t], p[t + w]);
  return dsp__cu_ksum_value(p[0]);
}

static double *as_f64(const dsp_tensor *t) {
  double *v = malloc(sizeof(double) * (size_t)(t->numel ? t->numel : 1));
  for (int64_t i = 0; i < t->numel; i++) v[i] = ld(t, i);
  return v;
}
/* a double result stored as t's dtype; a half through f32 and one
 * rounding, as the half kernels store it (from_d in kernels.cu) */
static void st_any(dsp_tensor *t, int64_t i, double v) {
  if (t->meta.dtype == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)v;
  else if (t->meta.dtype == DSP_F16) ((uint16_t *)dsp_tensor_data(t))[i] = dsp_f32_to_f16((float)v);
  else if (t->meta.dtype == DSP_BF16) ((uint16_t *)dsp_tensor_data(t))[i] = dsp_f32_to_bf16((float)v);
  else ((double *)dsp_tensor_data(t))[i] = v;
}

/* k_softmax replayed on one dim */
static void check_softmax(dsp_dtype dt, int nd, const int64_t *sh, int dim,
                          int special, int big) {
  dsp_tensor *x = mk(dt, nd, sh, special, 0);
  int64_t outer = dsp__cu_prod(sh, 0, dim), len = sh[dim],
          inner = dsp__cu_prod(sh, dim + 1, nd);
  if (big) /* exp would overflow without the max shift */
    for (int64_t i = 0; i < x->numel; i++)
      st_any(x, i, ld(x, i) * (dt == DSP_F32 || dt == DSP_BF16 ? 1e37 : dt == DSP_F16 ? 1e4 : 1e307) / 4);
  if (special > 1) /* one row all -inf */
    for (int64_t j = 0; j < len; j++) st_any(x, j * inner, -INFINITY);
  int64_t d64 = dim;
  dsp_attrs a = dsp_attrs_ints(1, &d64);
  for (int op = DSP_OP_SOFTMAX; op <= DSP_OP_LOG_SOFTMAX_BACKWARD; op++) {
    dsp_tensor *in[2] = {x, NULL};
    dsp_tensor *y = NULL, *g = NULL;
    if (op >= DSP_OP_SOFTMAX_BACKWARD) {
      dsp_tensor *xx = x;
      y = run(op == DSP_OP_SOFTMAX_BACKWARD ? DSP_OP_SOFTMAX : DSP_OP_LOG_SOFTMAX,
              &a, 1, &xx);
      g = mk(dt, nd, sh, 0, 0);
      in[0] = g, in[1] = y;
    }
    dsp_tensor *want = run((dsp_opcode)op, &a, op >= DSP_OP_SOFTMAX_BACKWARD ? 2 : 1, in);
    dsp_tensor *got = empty_like(want);
    double *X = as_f64(in[0]), *Y = y ? as_f64(y) : NULL;
    for (int64_t row = 0; row < outer * inner; row++) {
      int64_t base = (row / inner) * len * inner + row % inner;
      if (op <= DSP_OP_LOG_SOFTMAX) {
        dsp__cu_lse l = sim_lse(X + base, len, inner);
        double ls = log(l.s);
        for (int64_t j = 0; j < len; j++) {
          double v = X[base + j * inner] - l.m;
          st_any(got, base + j * inner, op == DSP_OP_SOFTMAX ? exp(v) / l.s : v - ls);
        }
      } else {
        int sm = op == DSP_OP_SOFTMAX_BACKWARD;
        double *prod = malloc(sizeof(double) * (size_t)len);
        for (int64_t j = 0; j < len; j++)
          prod[j] = sm ? X[base + j * inner] * Y[base + j * inner] : X[base + j * inner];
        double s = sim_ksum_of(prod, len, 1);
        free(prod);
        for (int64_t j = 0; j < len; j++) {
          int64_t i = base + j * inner;
          st_any(got, i, sm ? Y[i] * (X[i] - s) : X[i] - exp(Y[i]) * s);
        }
      }
    }
    /* a half result: the CPU's is its f32 kernel's rounded once, the
     * replay's the double result through f32 rounded once; the two before
     * rounding differ by the f32 bound, after it by at most one unit in
     * the last place of the half type more */
    const double tol = dt == DSP_F64 ? 64 * DBL_EPSILON
                       : dt == DSP_F16 ? 4 * FLT_EPSILON + 0x1p-10
                       : dt == DSP_BF16 ? 4 * FLT_EPSILON + 0x1p-7
                                        : 4 * FLT_EPSILON;
    assert_close(got, want, tol, NULL, dsp_op_lookup(op)->name);
    free(X), free(Y);
    dsp_tensor_unref(got), dsp_tensor_unref(want);
    dsp_tensor_unref(y), dsp_tensor_unref(g);
  }
  dsp_tensor_unref(x);
}

Test(cuda_host, softmax_family_is_stable_and_matches_cpu) {
  static const int64_t A[] = {3, 7}, B[] = {4, 5, 6}, C[] = {2, 600};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_F16, DSP_BF16};
  for (int f = 0; f < 4; f++) {
    dsp_dtype dt = dts[f];
    check_softmax(dt, 2, A, 1, 0, 0);
    check_softmax(dt, 2, A, 0, 0, 0);
    check_softmax(dt, 3, B, 1, 0, 0);
    check_softmax(dt, 3, B, 2, 1, 0);
    check_softmax(dt, 3, B, 0, 2, 0);
    check_softmax(dt, 2, C, 1, 0, 0);
    check_softmax(dt, 2, C, 1, 0, 1);
  }
}

static void check_ce(dsp_dtype dt, int64_t N, int64_t C, int big) {
  int64_t sh[2] = {N, C};
  dsp_tensor *x = mk(dt, 2, sh, 0, 0);
  if (big)
    for (int64_t i = 0; i < x->numel; i++) st_any(x, i, ld(x, i) * 1e30);
  dsp_meta lm = meta_of(DSP_I64, 1, &N);
  dsp_tensor *lab = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &lm, &lab), 0);
  for (int64_t i = 0; i < N; i++) ((int64_t *)dsp_tensor_data(lab))[i] = (int64_t)(rnd() % (uint64_t)C);
  dsp_tensor *in2[2] = {x, lab};
  dsp_tensor *loss = run(DSP_OP_CROSS_ENTROPY, NULL, 2, in2);
  dsp_tensor *g = mk(dt, 0, NULL, 0, 0);
  st_any(g, 0, 0.75);
  dsp_tensor *in3[3] = {g, x, lab};
  dsp_tensor *grad = run(DSP_OP_CROSS_ENTROPY_BACKWARD, NULL, 3, in3);
  /* k_ce_rows + k_mean_of replayed */
  double *X = as_f64(x), *rows = malloc(sizeof(double) * (size_t)N);
  const int64_t *L = dsp_tensor_data(lab);
  dsp_tensor *gloss = empty_like(loss), *ggrad = empty_like(grad);
  for (int64_t i = 0; i < N; i++) {
    dsp__cu_lse l = sim_lse(X + i * C, C, 1);
    double lse = l.m + log(l.s);
    rows[i] = lse - X[i * C + L[i]];
    for (int64_t c = 0; c < C; c++)
      st_any(ggrad, i * C + c,
             0.75 / (double)N * (exp(X[i * C + c] - lse) - (c == L[i] ? 1.0 : 0.0)));
  }
  st_any(gloss, 0, sim_ksum_of(rows, N, 1) / (double)N);
  assert_close(gloss, loss, dt == DSP_F32 ? 4 * FLT_EPSILON : 64 * DBL_EPSILON,
               NULL, "cross_entropy");
  assert_close(ggrad, grad, dt == DSP_F32 ? 4 * FLT_EPSILON : 64 * DBL_EPSILON,
               NULL, "cross_entropy_backward");
  free(X), free(rows);
  dsp_tensor_unref(gloss), dsp_tensor_unref(ggrad), dsp_tensor_unref(loss);
  dsp_tensor_unref(grad), dsp_tensor_unref(g), dsp_tensor_unref(lab);
  dsp_tensor_unref(x);
}

Test(cuda_host, cross_entropy_and_mse_match_cpu) {
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    check_ce(dt, 5, 7, 0);
    check_ce(dt, 3, 1000, 0);
    check_ce(dt, 4, 10, 1);
    for (int big = 0; big < 2; big++) { /* 900 elements, one block; 20000, split */
      int64_t sh[2] = {big ? 4 : 3, big ? 5000 : 300};
      dsp_tensor *in[2] = {mk(dt, 2, sh, 0, 0), mk(dt, 2, sh, 0, 0)};
      dsp_tensor *want = run(DSP_OP_MSE, NULL, 2, in), *got = empty_like(want);
      /* dsp__cuk_mse: a full sum of the squared differences */
      int64_t n = in[0]->numel;
      dsp_meta dm = meta_of(DSP_F64, 1, &n);
      dsp_tensor *d2 = NULL;
      cr_assert_eq(dsp_tensor_new(ctx, &dm, &d2), 0);
      for (int64_t i = 0; i < n; i++) {
        double d = ld(in[0], i) - ld(in[1], i);
        ((double *)dsp_tensor_data(d2))[i] = d * d;
      }
      int red[DSP_MAX_DIMS] = {1};
      dsp__cu_index outer, inner;
      int64_t R;
      dsp__cu_plan_red(&d2->meta, red, &outer, &inner, &R);
      int64_t S = dsp__cu_red_split(1, n);
      cr_assert_eq(S > 1, big);
      st_any(got, 0, dsp__cu_ksum_value(sim_sum(d2, &inner, 0, R, S)) / (double)n);
      assert_close(got, want, dt == DSP_F32 ? 2 * FLT_EPSILON : (double)(n + 8) * DBL_EPSILON,
                   NULL, "mse"); /* n roundings of the CPU's sequential sum */
      dsp_tensor_unref(d2), dsp_tensor_unref(got), dsp_tensor_unref(want);
      dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
    }
  }
}

/* ------------------------------------------------------------------ */
/* matmul plan                                                         */

Test(cuda_host, matmul_batch_plan_matches_cpu) {
  static const shp T[][2] = {
      {{3, {2, 3, 4}}, {2, {4, 5}}},       {{2, {3, 4}}, {3, {2, 4, 5}}},
      {{4, {2, 1, 3, 4}}, {4, {1, 5, 4, 2}}}, {{1, {4}}, {1, {4}}},
      {{1, {4}}, {2, {4, 3}}},             {{3, {2, 3, 4}}, {1, {4}}},
      {{3, {1, 3, 4}}, {3, {6, 4, 2}}},
  };
  for (size_t t = 0; t < sizeof T / sizeof T[0]; t++)
    for (int f = 0; f < 2; f++) {
      dsp_dtype dt = f ? DSP_F64 : DSP_F32;
      dsp_tensor *in[2] = {mk(dt, T[t][0].nd, T[t][0].s, 0, 0),
                           mk(dt, T[t][1].nd, T[t][1].s, 0, 0)};
      dsp_tensor *want = run(DSP_OP_MATMUL, NULL, 2, in), *got = empty_like(want);
      int64_t m, k, n;
      dsp__cu_index ix;
      dsp__cu_plan_matmul(&in[0]->meta, &in[1]->meta, &m, &k, &n, &ix);
      int64_t nb = want->numel / (m * n);
      /* the gemm of batch entry j, row-major C = A B */
      for (int64_t j = 0; j < nb; j++) {
        int64_t off[3];
        dsp__cu_offsets(&ix, j, off);
        for (int64_t r = 0; r < m; r++)
          for (int64_t c = 0; c < n; c++) {
            double s = 0;
            for (int64_t q = 0; q < k; q++)
              s += ld(in[0], off[0] * m * k + r * k + q) * ld(in[1], off[1] * k * n + q * n + c);
            st_any(got, j * m * n + r * n + c, s);
          }
      }
      assert_close(got, want, dt == DSP_F32 ? 64 * FLT_EPSILON : 64 * DBL_EPSILON,
                   NULL, "matmul");
      dsp_tensor_unref(got), dsp_tensor_unref(want);
      dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
    }
}

/* ------------------------------------------------------------------ */
/* shape ops                                                           */

static void sim_gather(const dsp__cu_index *ix, int64_t base, const dsp_tensor *src,
                       dsp_tensor *dst, int64_t n, int scatter) {
  size_t es = dsp_dtype_size(src->meta.dtype);
  for (int64_t i = 0; i < n; i++) {
    int64_t off[3];
    dsp__cu_offsets(ix, i, off);
    if (scatter)
      memcpy((char *)dsp_tensor_data(dst) + (base + off[0]) * es,
             (char *)dsp_tensor_data(src) + i * es, es);
    else
      memcpy((char *)dsp_tensor_data(dst) + i * es,
             (char *)dsp_tensor_data(src) + (base + off[0]) * es, es);
  }
}

Test(cuda_host, shape_op_plans_match_cpu) {
  static const int64_t S[] = {3, 4, 5}, S2[] = {1, 4, 1};
  static const dsp_dtype dts[] = {DSP_F32, DSP_F64, DSP_I64, DSP_BOOL};
  for (int di = 0; di < 4; di++) {
    dsp_dtype dt = dts[di];
    dsp_tensor *x = mk(dt, 3, S, 1, 0);
    /* permute and transpose */
    static const int64_t P[] = {2, 0, 1}, TR[] = {0, -1};
    static const int perm_p[] = {2, 0, 1}, perm_t[] = {2, 1, 0};
    for (int t = 0; t < 2; t++) {
      dsp_attrs a = t ? dsp_attrs_ints(2, TR) : dsp_attrs_ints(3, P);
      dsp_tensor *want = run(t ? DSP_OP_TRANSPOSE : DSP_OP_PERMUTE, &a, 1, &x);
      dsp_tensor *got = empty_like(want);
      dsp__cu_index ix;
      dsp__cu_plan_perm(&ix, &x->meta, t ? perm_t : perm_p, &got->meta);
      sim_gather(&ix, 0, x, got, got->numel, 0);
      assert_same_bytes(got, want, t ? "transpose" : "permute");
      dsp_tensor_unref(got), dsp_tensor_unref(want);
    }
    /* broadcast_to */
    {
      dsp_tensor *y = mk(dt, 3, S2, 1, 0);
      static const int64_t TO[] = {2, 3, 4, 5};
      dsp_attrs a = dsp_attrs_ints(4, TO);
      dsp_tensor *want = run(DSP_OP_BROADCAST_TO, &a, 1, &y), *got = empty_like(want);
      const dsp_meta *ms[1] = {&y->meta};
      dsp__cu_index ix;
      dsp__cu_plan_bcast(&ix, &got->meta, ms, 1);
      sim_gather(&ix, 0, y, got, got->numel, 0);
      assert_same_bytes(got, want, "broadcast_to");
      dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(y);
    }
    /* slice and its backward, with negative bounds and steps */
    static const int64_t SL[][4] = {{1, 1, 4, 2}, {-1, -4, 100, 3}, {0, -2, 3, 1}};
    for (int s = 0; s < 3; s++) {
      dsp_attrs a = dsp_attrs_ints(4, SL[s]);
      dsp_tensor *want = run(DSP_OP_SLICE, &a, 1, &x), *got = empty_like(want);
      int dim;
      int64_t s0, len, base;
      cr_assert_eq(dsp__slice_params(ctx, DSP_OP_SLICE, &x->meta, SL[s], &dim, &s0, &len), 0);
      dsp__cu_index ix;
      dsp__cu_plan_slice(&ix, &x->meta, &got->meta, dim, s0, SL[s][3], &base);
      sim_gather(&ix, base, x, got, got->numel, 0);
      assert_same_bytes(got, want, "slice");
      if (dt != DSP_BOOL) {
        int64_t bi[7] = {SL[s][0], SL[s][1], SL[s][2], SL[s][3], 3, 4, 5};
        dsp_attrs ab = dsp_attrs_ints(7, bi);
        dsp_tensor *wb = run(DSP_OP_SLICE_BACKWARD, &ab, 1, &want), *gb = empty_like(wb);
        sim_gather(&ix, base, want, gb, want->numel, 1);
        assert_same_bytes(gb, wb, "slice_backward");
        dsp_tensor_unref(gb), dsp_tensor_unref(wb);
      }
      dsp_tensor_unref(got), dsp_tensor_unref(want);
    }
    /* cat and stack */
    for (int stack = 0; stack < 2; stack++)
      for (int dim = 0; dim < 3 + stack; dim++) {
        dsp_tensor *in[3];
        for (int i = 0; i < 3; i++) {
          int64_t s[3] = {3, 4, 5};
          if (!stack) s[dim] = 1 + i;
          in[i] = mk(dt, 3, s, 1, 0);
        }
        int64_t d64 = dim;
        dsp_attrs a = dsp_attrs_ints(1, &d64);
        dsp_tensor *want = run(stack ? DSP_OP_STACK : DSP_OP_CAT, &a, 3, in);
        dsp_tensor *got = empty_like(want);
        int64_t pos = 0, base;
        for (int i = 0; i < 3; i++) {
          dsp__cu_index ix;
          dsp__cu_plan_cat(&ix, &got->meta, &in[i]->meta, dim, stack, pos, &base);
          sim_gather(&ix, base, in[i], got, in[i]->numel, 1);
          pos += stack ? 1 : in[i]->meta.shape[dim];
        }
        assert_same_bytes(got, want, stack ? "stack" : "cat");
        dsp_tensor_unref(got), dsp_tensor_unref(want);
        for (int i = 0; i < 3; i++) dsp_tensor_unref(in[i]);
      }
    dsp_tensor_unref(x);
  }
}

Test(cuda_host, index_select_and_backward_match_cpu) {
  static const int64_t S[] = {3, 4, 5}, L = 6;
  dsp_meta im = meta_of(DSP_I64, 1, &L);
  for (int f = 0; f < 2; f++)
    for (int dim = 0; dim < 3; dim++) {
      dsp_dtype dt = f ? DSP_F64 : DSP_F32;
      dsp_tensor *x = mk(dt, 3, S, 0, 0), *ix = NULL;
      cr_assert_eq(dsp_tensor_new(ctx, &im, &ix), 0);
      int64_t *I = dsp_tensor_data(ix);
      for (int k = 0; k < L; k++) I[k] = (int64_t)(rnd() % (uint64_t)S[dim]); /* repeats */
      int64_t d64 = dim;
      dsp_attrs a = dsp_attrs_ints(1, &d64);
      dsp_tensor *in[2] = {x, ix};
      dsp_tensor *want = run(DSP_OP_INDEX_SELECT, &a, 2, in), *got = empty_like(want);
      int64_t blk = dsp__cu_prod(S, dim + 1, 3);
      size_t es = dsp_dtype_size(dt);
      for (int64_t e = 0; e < got->numel; e++) { /* k_index_select */
        int64_t j = e % blk, k = (e / blk) % L, o = e / (blk * L);
        memcpy((char *)dsp_tensor_data(got) + e * es,
               (char *)dsp_tensor_data(x) + ((o * S[dim] + I[k]) * blk + j) * es, es);
      }
      assert_same_bytes(got, want, "index_select");
      int64_t bi[2] = {dim, S[dim]};
      dsp_attrs ab = dsp_attrs_ints(2, bi);
      dsp_tensor *bin2[2] = {want, ix};
      dsp_tensor *wb = run(DSP_OP_INDEX_SELECT_BACKWARD, &ab, 2, bin2), *gb = empty_like(wb);
      int64_t start[8], ks[6];
      dsp__cu_csr_build(I, L, S[dim], start, ks);
      for (int64_t e = 0; e < gb->numel; e++) { /* k_index_select_bw */
        int64_t j = e % blk, s = (e / blk) % S[dim], o = e / (blk * S[dim]);
        double acc = 0;
        for (int64_t q = start[s]; q < start[s + 1]; q++) {
          double gv = ld(want, (o * L + ks[q]) * blk + j);
          acc = f ? acc + gv : (double)((float)acc + (float)gv);
        }
        st_any(gb, e, acc);
      }
      for (int64_t q = 1; q < L; q++) /* rows of one s in increasing k */
        cr_assert(I[ks[q - 1]] < I[ks[q]] || (I[ks[q - 1]] == I[ks[q]] && ks[q - 1] < ks[q]));
      assert_same_bytes(gb, wb, "index_select_backward");
      dsp_tensor_unref(gb), dsp_tensor_unref(wb), dsp_tensor_unref(got);
      dsp_tensor_unref(want), dsp_tensor_unref(ix), dsp_tensor_unref(x);
    }
}

/* ------------------------------------------------------------------ */
/* issue 23: embedding, layer_norm, rms_norm (common/cuda/norm.c, .cu)  */

/* embedding is k_index_select over the table's rows (outer 1) and its
 * backward the index_select_backward CSR gather, then the padding row
 * zeroed: the CPU's bytes */
Test(cuda_host, embedding_and_backward_match_cpu) {
  static const int64_t V = 5, D = 3, IS[2] = {2, 4}, L = 8;
  for (int f = 0; f < 2; f++)
    for (int64_t pad = -1; pad < 2; pad++) {
      dsp_dtype dt = f ? DSP_F64 : DSP_F32;
      int64_t ws[2] = {V, D};
      dsp_tensor *w = mk(dt, 2, ws, 0, 0), *ix = NULL;
      dsp_meta im = meta_of(DSP_I64, 2, IS);
      cr_assert_eq(dsp_tensor_new(ctx, &im, &ix), 0);
      int64_t *I = dsp_tensor_data(ix);
      for (int k = 0; k < L; k++) I[k] = (int64_t)(rnd() % (uint64_t)V);
      I[1] = I[5] = 1; /* a repeat, and the padding row used */
      int64_t pv = pad < 0 ? INT64_MIN : pad;
      dsp_attrs a = dsp_attrs_ints(1, &pv);
      dsp_tensor *in[2] = {w, ix};
      dsp_tensor *want = run(DSP_OP_EMBEDDING, &a, 2, in), *got = empty_like(want);
      size_t es = dsp_dtype_size(dt);
      for (int64_t e = 0; e < got->numel; e++) { /* k_index_select */
        int64_t j = e % D, k = e / D;
        memcpy((char *)dsp_tensor_data(got) + e * es,
               (char *)dsp_tensor_data(w) + (I[k] * D + j) * es, es);
      }
      assert_same_bytes(got, want, "embedding");
      int64_t bv[2] = {V, pv};
      dsp_attrs ab = dsp_attrs_ints(2, bv);
      dsp_tensor *g = mk(dt, 3, (int64_t[]){2, 4, 3}, 0, 0);
      dsp_tensor *bin2[2] = {g, ix};
      dsp_tensor *wb = run(DSP_OP_EMBEDDING_BACKWARD, &ab, 2, bin2), *gb = empty_like(wb);
      int64_t start[6], ks[8];
      dsp__cu_csr_build(I, L, V, start, ks);
      for (int64_t e = 0; e < gb->numel; e++) { /* k_index_select_bw */
        int64_t j = e % D, r = e / D;
        double acc = 0;
        for (int64_t q = start[r]; q < start[r + 1]; q++) {
          double gv = ld(g, ks[q] * D + j);
          acc = f ? acc + gv : (double)((float)acc + (float)gv);
        }
        st_any(gb, e, r == pad ? 0.0 : acc); /* then the memset */
      }
      assert_same_bytes(gb, wb, "embedding_backward");
      dsp_tensor_unref(gb), dsp_tensor_unref(wb), dsp_tensor_unref(g);
      dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(ix);
      dsp_tensor_unref(w);
    }
}

/* k_norm_fwd / k_norm_bw / k_norm_cols replayed: the block sums of
 * row_stats and the dx pass as sim_ksum_of's strided partials and tree,
 * the per-element math from norm_math.h */
static void sim_row_stats(const double *xr, int64_t D, int centered,
                          double eps, double *mean, double *rstd) {
  double m = centered ? sim_ksum_of(xr, D, 1) / (double)D : 0.0;
  double *sq = malloc(sizeof(double) * (size_t)D);
  for (int64_t j = 0; j < D; j++) sq[j] = (xr[j] - m) * (xr[j] - m);
  *mean = m;
  *rstd = dsp__cu_norm_rstd(sim_ksum_of(sq, D, 1), D, eps);
  free(sq);
}

static void check_norm(dsp_dtype dt, int ln, int64_t rows, int64_t D, int hw,
                       int hb, double offset) {
  const int f = dt == DSP_F64;
  int64_t xs[2] = {rows, D};
  dsp_tensor *x = mk(dt, 2, xs, 0, 0), *w = mk(dt, 1, &D, 0, 0),
             *b = mk(dt, 1, &D, 0, 0), *g = mk(dt, 2, xs, 0, 0);
  for (int64_t i = 0; i < x->numel; i++) st_any(x, i, ld(x, i) + offset);
  int64_t v[3] = {1, hw, hb};
  dsp_attrs a = dsp_attrs_ints(ln ? 3 : 2, v);
  a.floats[0] = 1e-5, a.n_floats = 1;
  dsp_tensor *in[3] = {x, NULL, NULL};
  int n = 1;
  if (hw) in[n++] = w;
  if (hb) in[n++] = b;
  dsp_tensor *want = run(ln ? DSP_OP_LAYER_NORM : DSP_OP_RMS_NORM, &a, n, in);
  dsp_tensor *got = empty_like(want);
  double *X = as_f64(x), *G = as_f64(g);
  double *st = malloc(sizeof(double) * (size_t)(2 * rows));
  for (int64_t r = 0; r < rows; r++) {
    sim_row_stats(X + r * D, D, ln, 1e-5, &st[2 * r], &st[2 * r + 1]);
    for (int64_t j = 0; j < D; j++)
      st_any(got, r * D + j,
             dsp__cu_norm_y(X[r * D + j], st[2 * r], st[2 * r + 1],
                            hw ? dsp_tensor_data(w) : NULL,
                            hb ? dsp_tensor_data(b) : NULL, f, j));
  }
  const double tol = f ? 64 * DBL_EPSILON : 4 * FLT_EPSILON;
  assert_close(got, want, tol, NULL, ln ? "layer_norm" : "rms_norm");
  /* backward: (grad, x[, w]) */
  dsp_tensor *bin3[3] = {g, x, w};
  dsp_tensor *wb = run(ln ? DSP_OP_LAYER_NORM_BACKWARD : DSP_OP_RMS_NORM_BACKWARD,
                       &a, 2 + hw, bin3);
  dsp_tensor *gb = empty_like(wb);
  double *gw = malloc(sizeof(double) * (size_t)D), *p2 = malloc(sizeof(double) * (size_t)D);
  for (int64_t r = 0; r < rows; r++) {
    const double mean = st[2 * r], rstd = st[2 * r + 1];
    for (int64_t j = 0; j < D; j++) {
      gw[j] = G[r * D + j] * (hw ? ld(w, j) : 1.0);
      p2[j] = gw[j] * ((X[r * D + j] - mean) * rstd);
    }
    double s1 = ln ? sim_ksum_of(gw, D, 1) / (double)D : 0.0;
    double s2 = sim_ksum_of(p2, D, 1) / (double)D;
    for (int64_t j = 0; j < D; j++)
      st_any(gb, r * D + j,
             dsp__cu_norm_dx(gw[j], (X[r * D + j] - mean) * rstd, rstd, s1, s2));
  }
  for (int64_t j = 0; j < D; j++) { /* k_norm_cols */
    double aw = 0, ab = 0;
    for (int64_t r = 0; r < rows; r++) {
      aw += G[r * D + j] * ((X[r * D + j] - st[2 * r]) * st[2 * r + 1]);
      ab += G[r * D + j];
    }
    if (hw) st_any(gb, rows * D + j, aw);
    if (hb) st_any(gb, rows * D + hw * D + j, ab);
  }
  /* dx is a difference of terms of the size of gw: scaled by rstd * |gw| */
  double *scale = malloc(sizeof(double) * (size_t)wb->numel);
  for (int64_t i = 0; i < wb->numel; i++) {
    double sc = 0;
    if (i < rows * D)
      for (int64_t j = 0; j < D; j++)
        sc += fabs(G[(i / D) * D + j]) * st[2 * (i / D) + 1] * 4;
    else
      for (int64_t r = 0; r < rows; r++) sc += fabs(G[r * D + i % D]) * 4;
    scale[i] = sc;
  }
  assert_close(gb, wb, tol, scale, ln ? "layer_norm_backward" : "rms_norm_backward");
  free(scale), free(p2), free(gw), free(st), free(G), free(X);
  dsp_tensor_unref(gb), dsp_tensor_unref(wb), dsp_tensor_unref(got);
  dsp_tensor_unref(want), dsp_tensor_unref(g), dsp_tensor_unref(b);
  dsp_tensor_unref(w), dsp_tensor_unref(x);
}

Test(cuda_host, layer_norm_and_rms_norm_match_cpu) {
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    check_norm(dt, 1, 3, 7, 1, 1, 0);
    check_norm(dt, 1, 2, 600, 1, 0, 0);   /* rows longer than a block */
    check_norm(dt, 1, 4, 5, 0, 1, 100);   /* a large common offset */
    check_norm(dt, 1, 5, 3, 0, 0, 0);
    check_norm(dt, 0, 3, 7, 1, 0, 0);
    check_norm(dt, 0, 2, 700, 0, 0, 3);
  }
}

/* k_bn_fwd / k_bn_bw replayed: a channel's N * S elements in the
 * kernel's order j = n S + s, summed by sim_ksum_of */
static void check_bn(dsp_dtype dt, int train, int64_t N, int64_t C, int64_t S) {
  const int f = dt == DSP_F64;
  int64_t xs[3] = {N, C, S};
  dsp_tensor *x = mk(dt, 3, xs, 0, 0), *g = mk(dt, 3, xs, 0, 0);
  dsp_tensor *w = mk(dt, 1, &C, 0, 0), *b = mk(dt, 1, &C, 0, 0);
  dsp_tensor *rm = mk(dt, 1, &C, 0, 0), *rv = mk(dt, 1, &C, 0, 0);
  for (int64_t c = 0; c < C; c++) st_any(rv, c, fabs(ld(rv, c)) + 0.5);
  double *RM = as_f64(rm), *RV = as_f64(rv), *X = as_f64(x), *G = as_f64(g);
  int64_t v[4] = {train, 1, 1, 1};
  dsp_attrs a = dsp_attrs_ints(4, v);
  a.floats[0] = 0.1, a.floats[1] = 1e-5, a.n_floats = 2;
  dsp_tensor *in[5] = {x, rm, rv, w, b};
  dsp_tensor *want = run(DSP_OP_BATCH_NORM, &a, 5, in), *got = empty_like(want);
  const int64_t cnt = N * S;
  double *col = malloc(sizeof(double) * (size_t)cnt), *col2 = malloc(sizeof(double) * (size_t)cnt);
  double *mean = malloc(sizeof(double) * (size_t)C), *rstd = malloc(sizeof(double) * (size_t)C);
  for (int64_t c = 0; c < C; c++) {
    for (int64_t j = 0; j < cnt; j++) col[j] = X[((j / S) * C + c) * S + j % S];
    if (train) {
      mean[c] = sim_ksum_of(col, cnt, 1) / (double)cnt;
      for (int64_t j = 0; j < cnt; j++) col2[j] = (col[j] - mean[c]) * (col[j] - mean[c]);
      double sq = sim_ksum_of(col2, cnt, 1);
      rstd[c] = dsp__cu_norm_rstd(sq, cnt, 1e-5);
      RM[c] = 0.9 * RM[c] + 0.1 * mean[c];
      RV[c] = 0.9 * RV[c] + 0.1 * (sq / ((double)cnt - 1.0));
    } else {
      mean[c] = RM[c], rstd[c] = 1.0 / sqrt(RV[c] + 1e-5);
    }
    for (int64_t j = 0; j < cnt; j++)
      st_any(got, ((j / S) * C + c) * S + j % S,
             dsp__cu_norm_y(col[j], mean[c], rstd[c], dsp_tensor_data(w),
                            dsp_tensor_data(b), f, c));
  }
  const double tol = f ? 64 * DBL_EPSILON : 4 * FLT_EPSILON;
  assert_close(got, want, tol, NULL, "batch_norm");
  for (int64_t c = 0; c < C; c++) { /* the in-place running statistics */
    cr_assert(fabs(ld(rm, c) - RM[c]) <= tol * (1 + fabs(RM[c])), "running_mean %lld", (long long)c);
    cr_assert(fabs(ld(rv, c) - RV[c]) <= tol * (1 + fabs(RV[c])), "running_var %lld", (long long)c);
  }
  /* backward (grad, x[, rm, rv in evaluation], w); eval reads the
   * statistics the forward left, as the kernel would */
  dsp_tensor *bi[5] = {g, x, rm, rv, w};
  if (train) bi[2] = w;
  dsp_tensor *wb = run(DSP_OP_BATCH_NORM_BACKWARD, &a, train ? 3 : 5, bi);
  dsp_tensor *gb = empty_like(wb);
  double *scale = malloc(sizeof(double) * (size_t)wb->numel);
  const int64_t nx = N * C * S;
  for (int64_t c = 0; c < C; c++) {
    if (!train) mean[c] = ld(rm, c), rstd[c] = 1.0 / sqrt(ld(rv, c) + 1e-5);
    double sg = 0;
    for (int64_t j = 0; j < cnt; j++) {
      const int64_t i = ((j / S) * C + c) * S + j % S;
      col[j] = G[i];
      col2[j] = G[i] * ((X[i] - mean[c]) * rstd[c]);
      sg += fabs(G[i]);
    }
    const double Gs = sim_ksum_of(col, cnt, 1), Xs = sim_ksum_of(col2, cnt, 1);
    const double wc = ld(w, c);
    const double s1 = train ? wc * Gs / (double)cnt : 0, s2 = train ? wc * Xs / (double)cnt : 0;
    for (int64_t j = 0; j < cnt; j++) {
      const int64_t i = ((j / S) * C + c) * S + j % S;
      st_any(gb, i, dsp__cu_norm_dx(G[i] * wc, (X[i] - mean[c]) * rstd[c], rstd[c], s1, s2));
      scale[i] = 4 * rstd[c] * fabs(wc) * (fabs(G[i]) + sg / (double)cnt) + 1;
    }
    st_any(gb, nx + c, Xs), st_any(gb, nx + C + c, Gs);
    scale[nx + c] = scale[nx + C + c] = 4 * sg;
  }
  assert_close(gb, wb, tol, scale, "batch_norm_backward");
  free(scale), free(rstd), free(mean), free(col2), free(col);
  free(G), free(X), free(RV), free(RM);
  dsp_tensor_unref(gb), dsp_tensor_unref(wb), dsp_tensor_unref(got);
  dsp_tensor_unref(want), dsp_tensor_unref(rv), dsp_tensor_unref(rm);
  dsp_tensor_unref(b), dsp_tensor_unref(w), dsp_tensor_unref(g);
  dsp_tensor_unref(x);
}

Test(cuda_host, batch_norm_matches_cpu) {
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    check_bn(dt, 1, 4, 3, 5);
    check_bn(dt, 1, 30, 2, 20); /* channels longer than a block */
    check_bn(dt, 0, 4, 3, 5);
    check_bn(dt, 1, 6, 4, 1);
  }
}

/* ------------------------------------------------------------------ */
/* random numbers, dropout, optimizer steps                            */

Test(cuda_host, rng_creation_and_dropout_are_bit_identical_to_cpu) {
  for (uint64_t i = 0; i < 5000; i++) {
    uint64_t seed = i * 7919u + 3;
    cr_assert_eq(dsp__cu_rng_u64(seed, i), dsp_rng_u64(seed, i));
    cr_assert_eq(dsp__cu_rng_uniform01(seed, i), dsp_rng_uniform01(seed, i));
    double z = dsp_rng_normal(seed, i), c = dsp__cu_rng_normal(seed, i);
    cr_assert(memcmp(&z, &c, sizeof z) == 0, "normal %llu", (unsigned long long)i);
  }
  static const int64_t S[] = {7, 13};
  for (int f = 0; f < 2; f++)
    for (int op = DSP_OP_UNIFORM; op <= DSP_OP_NORMAL; op++) {
      dsp_dtype dt = f ? DSP_F64 : DSP_F32;
      int64_t ints[4] = {dt, 99, S[0], S[1]};
      dsp_attrs a = dsp_attrs_ints(4, ints);
      a.n_floats = 2, a.floats[0] = -1.5, a.floats[1] = 2.5;
      dsp_tensor *want = run((dsp_opcode)op, &a, 0, NULL), *got = empty_like(want);
      for (int64_t i = 0; i < got->numel; i++) { /* k_random */
        double v = op == DSP_OP_NORMAL ? -1.5 + 2.5 * dsp__cu_rng_normal(99, (uint64_t)i)
                   : f ? dsp__cu_uniform_f64(99, (uint64_t)i, -1.5, 2.5)
                       : dsp__cu_uniform_f32(99, (uint64_t)i, -1.5, 2.5);
        st_any(got, i, v);
      }
      assert_same_bytes(got, want, dsp_op_lookup(op)->name);
      /* dropout with the same counter stream */
      int64_t seed = 4242;
      dsp_attrs da = dsp_attrs_ints(1, &seed);
      da.n_floats = 1, da.floats[0] = 0.3;
      dsp_tensor *dw = run(DSP_OP_DROPOUT, &da, 1, &want), *dg = empty_like(dw);
      for (int64_t i = 0; i < dg->numel; i++) /* k_dropout */
        st_any(dg, i, dsp__cu_rng_uniform01(4242, (uint64_t)i) >= 0.3
                          ? ld(want, i) * (1.0 / (1.0 - 0.3)) : 0.0);
      assert_same_bytes(dg, dw, "dropout");
      dsp_tensor_unref(dg), dsp_tensor_unref(dw);
      dsp_tensor_unref(got), dsp_tensor_unref(want);
    }
}

Test(cuda_host, optimizer_steps_are_bit_identical_to_cpu) {
  static const int64_t S[] = {5, 9};
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    dsp_tensor *p = mk(dt, 2, S, 0, 0), *g = mk(dt, 2, S, 0, 0),
               *m = mk(dt, 2, S, 0, 0), *v = mk(dt, 2, S, 0, 0);
    for (int64_t i = 0; i < v->numel; i++) st_any(v, i, fabs(ld(v, i)));
    double *P = as_f64(p), *G = as_f64(g), *M = as_f64(m), *V = as_f64(v);
    /* sgd on (p, g, m as velocity) */
    dsp_attrs a = dsp_attrs_none();
    a.n_floats = 3, a.floats[0] = 0.1, a.floats[1] = 0.9, a.floats[2] = 1e-3;
    dsp_tensor *in3[3] = {p, g, m};
    dsp_tensor_unref(run(DSP_OP_SGD_STEP, &a, 3, in3));
    for (int64_t i = 0; i < p->numel; i++) {
      double pi = P[i], mi = M[i];
      dsp__cu_sgd(&pi, &mi, G[i], 0.1, 0.9, 1e-3);
      cr_assert(f ? pi == ld(p, i) && mi == ld(m, i)
                  : (float)pi == (float)ld(p, i) && (float)mi == (float)ld(m, i),
                "sgd element %lld", (long long)i);
      P[i] = ld(p, i), M[i] = ld(m, i);
    }
    /* adam step 3 */
    int64_t t = 3;
    dsp_attrs b = dsp_attrs_ints(1, &t);
    b.n_floats = 4, b.floats[0] = 1e-2, b.floats[1] = 0.9, b.floats[2] = 0.999,
    b.floats[3] = 1e-8;
    dsp_tensor *in4[4] = {p, g, m, v};
    dsp_tensor_unref(run(DSP_OP_ADAM_STEP, &b, 4, in4));
    for (int64_t i = 0; i < p->numel; i++) {
      double pi = P[i], mi = M[i], vi = V[i];
      dsp__cu_adam(&pi, &mi, &vi, G[i], 1e-2, 0.9, 0.999, 1e-8,
                   1.0 - pow(0.9, 3.0), 1.0 - pow(0.999, 3.0));
      cr_assert(f ? pi == ld(p, i) && vi == ld(v, i)
                  : (float)pi == (float)ld(p, i) && (float)vi == (float)ld(v, i),
                "adam element %lld", (long long)i);
      P[i] = ld(p, i), M[i] = ld(m, i), V[i] = ld(v, i);
    }
    /* adamw step 4 with decay 0.1 and a clip's gradient scale 0.375 */
    int64_t t4 = 4;
    dsp_attrs w = dsp_attrs_ints(1, &t4);
    w.n_floats = 6, w.floats[0] = 1e-2, w.floats[1] = 0.9,
    w.floats[2] = 0.999, w.floats[3] = 1e-8, w.floats[4] = 0.1,
    w.floats[5] = 0.375;
    dsp_tensor_unref(run(DSP_OP_ADAMW_STEP, &w, 4, in4));
    for (int64_t i = 0; i < p->numel; i++) {
      double pi = P[i], mi = M[i], vi = V[i];
      dsp__cu_adamw(&pi, &mi, &vi, G[i], 1e-2, 0.9, 0.999, 1e-8,
                    1.0 - pow(0.9, 4.0), 1.0 - pow(0.999, 4.0),
                    1.0 - 1e-2 * 0.1, 0.375);
      cr_assert(f ? pi == ld(p, i) && mi == ld(m, i) && vi == ld(v, i)
                  : (float)pi == (float)ld(p, i) &&
                        (float)mi == (float)ld(m, i) &&
                        (float)vi == (float)ld(v, i),
                "adamw element %lld", (long long)i);
    }
    free(P), free(G), free(M), free(V);
    dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(m), dsp_tensor_unref(v);
  }
}

/* issue 23: loss. k_ce_ex_rows + k_ce_ex_total (common/cuda/loss.cu)
 * replayed with the same block reductions and loss_math.h, against the CPU
 * kernel of cross_entropy_ex and of its backward op, on logits viewed
 * [outer, C, inner] with ignored labels (ignore may be a class). */
static void check_ce_ex(dsp_dtype dt, int nd, const int64_t *xs,
                        int64_t ignore, double eps, int red) {
  dsp_tensor *x = mk(dt, nd, xs, 0, 0);
  int64_t ls[DSP_MAX_DIMS], outer = nd > 1 ? xs[0] : 1, C = xs[nd > 1],
          inner = dsp__cu_prod(xs, 2, nd > 2 ? nd : 2);
  for (int d = 0, j = 0; d < nd; d++)
    if (d != (nd > 1)) ls[j++] = xs[d];
  dsp_meta lm = meta_of(DSP_I64, nd - 1, ls);
  dsp_tensor *lab = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &lm, &lab), 0);
  int64_t *L = dsp_tensor_data(lab), n = outer * inner, kept = 0;
  for (int64_t i = 0; i < n; i++) {
    L[i] = rnd() % 4 == 0 ? ignore : (int64_t)(rnd() % (uint64_t)C);
    kept += L[i] != ignore;
  }
  int64_t av[2] = {ignore, red};
  dsp_attrs a = dsp_attrs_ints(2, av);
  a.floats[0] = eps, a.n_floats = 1;
  dsp_tensor *in2[2] = {x, lab};
  dsp_tensor *loss = run(DSP_OP_CROSS_ENTROPY_EX, &a, 2, in2);
  dsp_tensor *g = red ? mk(dt, 0, NULL, 0, 0) : mk(dt, nd - 1, ls, 0, 0);
  if (red) st_any(g, 0, 0.75);
  dsp_tensor *in3[3] = {g, x, lab};
  dsp_tensor *grad = run(DSP_OP_CROSS_ENTROPY_EX_BACKWARD, &a, 3, in3);
  double *X = as_f64(x), *rows = calloc((size_t)(n ? n : 1), sizeof(double));
  dsp_tensor *gloss = empty_like(loss), *ggrad = empty_like(grad);
  for (int64_t i = 0; i < n; i++) {
    int64_t base = (i / inner) * C * inner + i % inner;
    if (L[i] == ignore) {
      if (!red) st_any(gloss, i, 0.0);
      for (int64_t c = 0; c < C; c++) st_any(ggrad, base + c * inner, 0.0);
      continue;
    }
    dsp__cu_lse l = sim_lse(X + base, C, inner);
    double lse = l.m + log(l.s);
    double sx = eps > 0 ? sim_ksum_of(X + base, C, inner) : 0.0;
    double v = dsp__cu_ce_loss(lse, sx, X[base + L[i] * inner], C, eps);
    if (red) rows[i] = v;
    else st_any(gloss, i, v);
    double w = red == 0 ? ld(g, i) : red == 1 ? ld(g, 0) : ld(g, 0) / (double)kept;
    for (int64_t c = 0; c < C; c++)
      st_any(ggrad, base + c * inner,
             dsp__cu_ce_grad(X[base + c * inner], lse, c == L[i], C, eps, w));
  }
  if (red) {
    double s = sim_ksum_of(rows, n, 1);
    st_any(gloss, 0, red == 2 ? s / (double)kept : s);
  }
  double tol = dt == DSP_F32 ? 4 * FLT_EPSILON : 64 * DBL_EPSILON;
  assert_close(gloss, loss, tol, NULL, "cross_entropy_ex");
  assert_close(ggrad, grad, tol, NULL, "cross_entropy_ex_backward");
  free(X), free(rows);
  dsp_tensor_unref(gloss), dsp_tensor_unref(ggrad), dsp_tensor_unref(loss);
  dsp_tensor_unref(grad), dsp_tensor_unref(g), dsp_tensor_unref(lab);
  dsp_tensor_unref(x);
}

Test(cuda_host, cross_entropy_ex_matches_cpu) {
  static const int64_t A[] = {6, 7}, B[] = {3, 5, 2, 4}, C1[] = {2, 700, 3},
                       D[] = {9};
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    for (int red = 0; red < 3; red++) {
      check_ce_ex(dt, 2, A, -100, 0.0, red);
      check_ce_ex(dt, 4, B, 1, 0.1, red);
      check_ce_ex(dt, 3, C1, -100, 0.25, red);
      check_ce_ex(dt, 1, D, -100, 0.5, red);
    }
  }
}

/* ------------------------------------------------------------------ */
/* conv2d (im2col blocks + gemm) and pooling                           */

/* run_conv replayed with blocks of `blk` output pixels and a naive gemm */
static void sim_conv(dsp_opcode op, const dsp__cu_geo *g, const dsp_tensor *A,
                     const dsp_tensor *B, dsp_tensor *O, int64_t blk) {
  int f = O->meta.dtype == DSP_F64;
  int64_t ck = g->C * g->KH * g->KW, ohw = g->OH * g->OW;
  size_t es = f ? 8 : 4;
  for (int64_t n = 0; n < g->N; n++)
    for (int64_t p0 = 0; p0 < ohw; p0 += blk) {
      int64_t np = ohw - p0 < blk ? ohw - p0 : blk;
      double *col = calloc((size_t)(ck * np), sizeof *col);
      void *colt = calloc((size_t)(ck * np), es); /* col in the dtype */
      if (op != DSP_OP_CONV2D_BACKWARD_INPUT) {
        const char *xn = (const char *)dsp_tensor_data(op == DSP_OP_CONV2D ? A : B) +
                         (size_t)(n * g->C * g->H * g->W) * es;
        for (int64_t r = 0; r < ck; r++)
          for (int64_t q = 0; q < np; q++)
            col[r * np + q] = dsp__cu_im2col_at(g, xn, f, r, p0 + q);
      }
      if (op == DSP_OP_CONV2D) {
        for (int64_t o = 0; o < g->O; o++)
          for (int64_t q = 0; q < np; q++) {
            double s = 0;
            for (int64_t r = 0; r < ck; r++) s += ld(B, o * ck + r) * col[r * np + q];
            st_any(O, (n * g->O + o) * ohw + p0 + q, s);
          }
      } else if (op == DSP_OP_CONV2D_BACKWARD_INPUT) {
        for (int64_t r = 0; r < ck; r++)
          for (int64_t q = 0; q < np; q++) {
            double s = 0;
            for (int64_t o = 0; o < g->O; o++)
              s += ld(B, o * ck + r) * ld(A, (n * g->O + o) * ohw + p0 + q);
            if (f) ((double *)colt)[r * np + q] = s;
            else ((float *)colt)[r * np + q] = (float)s;
          }
        int64_t xb = n * g->C * g->H * g->W;
        for (int64_t c = 0; c < g->C; c++)
          for (int64_t h = 0; h < g->H; h++)
            for (int64_t w = 0; w < g->W; w++) {
              int64_t i = xb + (c * g->H + h) * g->W + w;
              st_any(O, i, ld(O, i) + dsp__cu_col2im_at(g, colt, f, p0, np, c, h, w));
            }
      } else {
        for (int64_t o = 0; o < g->O; o++)
          for (int64_t r = 0; r < ck; r++) {
            double s = ld(O, o * ck + r);
            for (int64_t q = 0; q < np; q++)
              s += ld(A, (n * g->O + o) * ohw + p0 + q) * col[r * np + q];
            st_any(O, o * ck + r, s);
          }
      }
      free(col), free(colt);
    }
}

Test(cuda_host, conv2d_im2col_blocks_match_cpu) {
  static const int64_t X[] = {2, 3, 9, 8}, W[] = {4, 3, 3, 2};
  static const int64_t CI[][6] = {{1, 1, 0, 0, 1, 1}, {2, 1, 1, 1, 1, 1}, {1, 2, 1, 0, 2, 1}};
  for (int f = 0; f < 2; f++)
    for (int ci = 0; ci < 3; ci++) {
      dsp_dtype dt = f ? DSP_F64 : DSP_F32;
      dsp_tensor *x = mk(dt, 4, X, 0, 0), *w = mk(dt, 4, W, 0, 0);
      dsp_attrs a = dsp_attrs_ints(6, CI[ci]);
      dsp_tensor *in[2] = {x, w};
      dsp_tensor *y = run(DSP_OP_CONV2D, &a, 2, in);
      dsp__cu_geo g = {0};
      const dsp_meta fm[2] = {x->meta, w->meta};
      cr_assert_eq(dsp__cu_plan_nn(ctx, DSP_OP_CONV2D, fm, 2, &a, &g), 0);
      double tol = f ? 1e-12 : 1e-5;
      for (int64_t blk = 1; blk <= 64; blk *= 8) {
        dsp_tensor *gy = empty_like(y);
        sim_conv(DSP_OP_CONV2D, &g, x, w, gy, blk);
        assert_close(gy, y, tol, NULL, "conv2d");
        dsp_tensor_unref(gy);
      }
      { /* issue 23: conv2d_bias = the same conv, then k_bias_add */
        int64_t O = W[0];
        dsp_tensor *bias = mk(dt, 1, &O, 0, 0);
        dsp_tensor *in3[3] = {x, w, bias};
        dsp_tensor *yb = run(DSP_OP_CONV2D_BIAS, &a, 3, in3);
        dsp__cu_geo gb = {0};
        const dsp_meta bm[3] = {x->meta, w->meta, bias->meta};
        cr_assert_eq(dsp__cu_plan_nn(ctx, DSP_OP_CONV2D_BIAS, bm, 3, &a, &gb), 0);
        cr_assert(memcmp(&gb, &g, sizeof g) == 0, "conv2d_bias sees conv2d's geometry");
        dsp_tensor *gy = empty_like(yb);
        sim_conv(DSP_OP_CONV2D, &g, x, w, gy, 8);
        int64_t hw = g.OH * g.OW;
        for (int64_t i = 0; i < gy->numel; i++) /* k_bias_add */
          st_any(gy, i, dsp__cu_bias_add(ld(gy, i), ld(bias, (i / hw) % O)));
        assert_close(gy, yb, tol, NULL, "conv2d_bias");
        dsp_tensor_unref(gy), dsp_tensor_unref(yb), dsp_tensor_unref(bias);
      }
      /* both backward ops with a random upstream grad */
      dsp_tensor *dy = mk(dt, 4, y->meta.shape, 0, 0);
      int64_t bi[10], bw[10];
      memcpy(bi, CI[ci], sizeof CI[ci]), memcpy(bw, CI[ci], sizeof CI[ci]);
      memcpy(bi + 6, X, sizeof X), memcpy(bw + 6, W, sizeof W);
      dsp_attrs ai = dsp_attrs_ints(10, bi), aw = dsp_attrs_ints(10, bw);
      dsp_tensor *i2[2] = {dy, w}, *w2[2] = {dy, x};
      dsp_tensor *dx = run(DSP_OP_CONV2D_BACKWARD_INPUT, &ai, 2, i2);
      dsp_tensor *dw = run(DSP_OP_CONV2D_BACKWARD_WEIGHT, &aw, 2, w2);
      dsp__cu_geo gi = {0}, gw = {0};
      const dsp_meta im[2] = {dy->meta, w->meta}, wm[2] = {dy->meta, x->meta};
      cr_assert_eq(dsp__cu_plan_nn(ctx, DSP_OP_CONV2D_BACKWARD_INPUT, im, 2, &ai, &gi), 0);
      cr_assert_eq(dsp__cu_plan_nn(ctx, DSP_OP_CONV2D_BACKWARD_WEIGHT, wm, 2, &aw, &gw), 0);
      cr_assert(memcmp(&gi, &g, sizeof g) == 0 && memcmp(&gw, &g, sizeof g) == 0,
                "the three conv ops see one geometry");
      for (int64_t blk = 1; blk <= 64; blk *= 8) {
        dsp_tensor *gx = empty_like(dx), *gwt = empty_like(dw);
        sim_conv(DSP_OP_CONV2D_BACKWARD_INPUT, &g, dy, w, gx, blk);
        sim_conv(DSP_OP_CONV2D_BACKWARD_WEIGHT, &g, dy, x, gwt, blk);
        assert_close(gx, dx, f ? 1e-12 : 1e-5, NULL, "conv2d_backward_input");
        assert_close(gwt, dw, f ? 1e-12 : 1e-5, NULL, "conv2d_backward_weight");
        dsp_tensor_unref(gx), dsp_tensor_unref(gwt);
      }
      dsp_tensor_unref(dx), dsp_tensor_unref(dw), dsp_tensor_unref(dy);
      dsp_tensor_unref(y), dsp_tensor_unref(x), dsp_tensor_unref(w);
    }
}

Test(cuda_host, pooling_forward_and_backward_gathers_match_cpu) {
  static const int64_t X[] = {2, 3, 7, 9};
  /* the 7th int: count_include_pad, avg only (issue 23: 0 divides by the
   * window's elements inside the input; mx 2 is avg_pool2d_ex with it) */
  static const int64_t PI[][7] = {{2, 2, 2, 2, 0, 0, 1}, {3, 3, 2, 1, 1, 1, 1},
                                  {3, 2, 1, 2, 1, 0, 1}, {3, 3, 2, 1, 1, 1, 0},
                                  {3, 2, 0, 2, 1, 0, 0}};
  for (int f = 0; f < 2; f++)
    for (int pi = 0; pi < 5; pi++)
      for (int mx = 0; mx < 3; mx++) {
        if ((mx == 2) != (PI[pi][6] == 0)) continue;
        dsp_dtype dt = f ? DSP_F64 : DSP_F32;
        dsp_tensor *x = mk(dt, 4, X, 1, 0); /* ties, NaN, inf */
        dsp_attrs a = dsp_attrs_ints(mx == 2 ? 7 : 6, PI[pi]);
        dsp_opcode fop = mx == 2 ? DSP_OP_AVG_POOL2D_EX
                         : mx      ? DSP_OP_MAX_POOL2D : DSP_OP_AVG_POOL2D;
        dsp_tensor *y = run(fop, &a, 1, &x);
        dsp__cu_geo g = {0};
        cr_assert_eq(dsp__cu_plan_nn(ctx, fop, &x->meta, 1, &a, &g), 0);
        cr_assert_eq(g.exclude_pad, mx == 2);
        const int m = mx == 1; /* the replay below: max or avg */
        dsp_tensor *gy = empty_like(y);
        size_t es = f ? 8 : 4;
        for (int64_t e = 0; e < gy->numel; e++) { /* k_pool_fwd */
          int64_t ow = e % g.OW, oh = (e / g.OW) % g.OH, nc = e / (g.OW * g.OH), at;
          const char *xp = (const char *)dsp_tensor_data(x) + (size_t)(nc * g.H * g.W) * es;
          st_any(gy, e, m ? dsp__cu_pool_max(&g, xp, f, oh, ow, &at)
                           : dsp__cu_pool_avg(&g, xp, f, oh, ow));
        }
        assert_same_bytes(gy, y, m ? "max_pool2d" : "avg_pool2d");
        dsp_tensor *up = mk(dt, 4, y->meta.shape, 0, 0);
        dsp_tensor *in[2] = {up, x};
        dsp_tensor *dx = run(m ? DSP_OP_MAX_POOL2D_BACKWARD : DSP_OP_AVG_POOL2D_BACKWARD,
                             &a, 2, in);
        dsp_tensor *gx = empty_like(dx);
        for (int64_t e = 0; e < gx->numel; e++) { /* k_pool_bw */
          int64_t w = e % g.W, h = (e / g.W) % g.H, nc = e / (g.W * g.H);
          st_any(gx, e, dsp__cu_pool_bw_at(&g, m,
                        (const char *)dsp_tensor_data(up) + (size_t)(nc * g.OH * g.OW) * es,
                        (const char *)dsp_tensor_data(x) + (size_t)(nc * g.H * g.W) * es,
                        f, h, w));
        }
        assert_same_bytes(gx, dx, m ? "max_pool2d_backward" : "avg_pool2d_backward");
        dsp_tensor_unref(gx), dsp_tensor_unref(dx), dsp_tensor_unref(up);
        dsp_tensor_unref(gy), dsp_tensor_unref(y), dsp_tensor_unref(x);
      }
}


/* ------------------------------------------------------------------ */
/* issue 23: attention                                                 */

/* one warp's dot product: 32 lane partials, then the butterfly */
static double sim_warp_dot(const void *a, const void *b, int f64, int64_t n) {
  double v[DSP__CU_ATTN_LANES];
  for (int l = 0; l < DSP__CU_ATTN_LANES; l++)
    v[l] = dsp__cu_attn_lane_dot(a, b, f64, n, l);
  return dsp__cu_attn_butterfly(v);
}

static int sim_sees(const uint8_t *m, int64_t j) { return !m || m[j]; }

/* k_attn_fwd replayed row by row (each lane's acc[] is one output dim) */
static void sim_attn_fwd(const dsp__cu_attn_geo *g, int f64, const char *q,
                         const char *k, const char *v, const uint8_t *mask,
                         void *out) {
  const size_t es = f64 ? 8 : 4;
  for (int64_t r = 0; r < g->B * g->H * g->Tq; r++) {
    const int64_t bh = r / g->Tq, i = r % g->Tq, ni = dsp__cu_attn_nkeys(g, i);
    const uint8_t *mb = mask ? mask + (bh / g->H) * g->Tk : NULL;
    const char *kh = k + (size_t)(bh * g->Tk * g->d) * es;
    const char *vh = v + (size_t)(bh * g->Tk * g->dv) * es;
    for (int64_t c = 0; c < g->dv; c++) {
      double acc = 0.0, corr, p;
      dsp__cu_osm o = dsp__cu_osm_init();
      for (int64_t j = 0; j < ni; j++) {
        if (!sim_sees(mb, j)) continue;
        double s = sim_warp_dot(q + (size_t)(r * g->d) * es,
                                kh + (size_t)(j * g->d) * es, f64, g->d) * g->scale;
        dsp__cu_osm_add(&o, s, &corr, &p);
        acc = acc * corr + p * dsp__cu_attn_ld(vh, f64, j * g->dv + c);
      }
      dsp__cu_attn_st(out, f64, r * g->dv + c, acc * dsp__cu_osm_inv(&o));
    }
  }
}

/* k_attn_bwd_q then k_attn_bwd_kv replayed into the packed [dq|dk|dv] */
static void sim_attn_bwd(const dsp__cu_attn_geo *g, int f64, const char *go,
                         const char *q, const char *k, const char *v,
                         const uint8_t *mask, char *out) {
  const size_t es = f64 ? 8 : 4;
  const int64_t nq = g->B * g->H * g->Tq, nk = g->B * g->H * g->Tk;
  double *lse = malloc(sizeof(double) * (size_t)(nq ? nq : 1));
  double *D = malloc(sizeof(double) * (size_t)(nq ? nq : 1));
  char *dk = out + (size_t)(nq * g->d) * es, *dv = dk + (size_t)(nk * g->d) * es;
  for (int64_t r = 0; r < nq; r++) {
    const int64_t bh = r / g->Tq, i = r % g->Tq, ni = dsp__cu_attn_nkeys(g, i);
    const uint8_t *mb = mask ? mask + (bh / g->H) * g->Tk : NULL;
    const char *qr = q + (size_t)(r * g->d) * es, *gr = go + (size_t)(r * g->dv) * es;
    const char *kh = k + (size_t)(bh * g->Tk * g->d) * es;
    const char *vh = v + (size_t)(bh * g->Tk * g->dv) * es;
    dsp__cu_osm o = dsp__cu_osm_init();
    double corr, p;
    for (int64_t j = 0; j < ni; j++)
      if (sim_sees(mb, j))
        dsp__cu_osm_add(&o, sim_warp_dot(qr, kh + (size_t)(j * g->d) * es, f64, g->d) * g->scale,
                        &corr, &p);
    lse[r] = dsp__cu_osm_lse(&o), D[r] = 0.0;
    for (int64_t j = 0; j < ni; j++)
      if (sim_sees(mb, j))
        D[r] += exp(sim_warp_dot(qr, kh + (size_t)(j * g->d) * es, f64, g->d) * g->scale - lse[r]) *
                sim_warp_dot(gr, vh + (size_t)(j * g->dv) * es, f64, g->dv);
    for (int64_t c = 0; c < g->d; c++) {
      double acc = 0.0;
      for (int64_t j = 0; j < ni; j++) {
        if (!sim_sees(mb, j)) continue;
        const char *kj = kh + (size_t)(j * g->d) * es;
        double s = sim_warp_dot(qr, kj, f64, g->d) * g->scale;
        double dp = sim_warp_dot(gr, vh + (size_t)(j * g->dv) * es, f64, g->dv);
        acc += exp(s - lse[r]) * (dp - D[r]) * dsp__cu_attn_ld(kj, f64, c);
      }
      dsp__cu_attn_st(out, f64, r * g->d + c, acc * g->scale);
    }
  }
  for (int64_t r = 0; r < nk; r++) {
    const int64_t bh = r / g->Tk, j = r % g->Tk;
    const int on = !mask || mask[(bh / g->H) * g->Tk + j];
    const char *kj = k + (size_t)(r * g->d) * es, *vj = v + (size_t)(r * g->dv) * es;
    double *ak = calloc((size_t)(g->d + 1), sizeof(double));
    double *av = calloc((size_t)(g->dv + 1), sizeof(double));
    for (int64_t i = g->causal ? j : 0; on && i < g->Tq; i++) {
      const int64_t row = bh * g->Tq + i;
      const char *qi = q + (size_t)(row * g->d) * es, *gi = go + (size_t)(row * g->dv) * es;
      double p = exp(sim_warp_dot(qi, kj, f64, g->d) * g->scale - lse[row]);
      double ds = p * (sim_warp_dot(gi, vj, f64, g->dv) - D[row]);
      for (int64_t c = 0; c < g->d; c++) ak[c] += ds * dsp__cu_attn_ld(qi, f64, c);
      for (int64_t c = 0; c < g->dv; c++) av[c] += p * dsp__cu_attn_ld(gi, f64, c);
    }
    for (int64_t c = 0; c < g->d; c++) dsp__cu_attn_st(dk, f64, r * g->d + c, ak[c] * g->scale);
    for (int64_t c = 0; c < g->dv; c++) dsp__cu_attn_st(dv, f64, r * g->dv + c, av[c]);
    free(ak), free(av);
  }
  free(lse), free(D);
}

static void check_attn(dsp_dtype dt, int64_t B, int64_t H, int64_t Tq,
                       int64_t Tk, int64_t d, int64_t dv, int causal,
                       int masked, double scale) {
  int64_t sq[4] = {B, H, Tq, d}, sk[4] = {B, H, Tk, d}, sv[4] = {B, H, Tk, dv},
          so[4] = {B, H, Tq, dv}, sm[2] = {B, Tk};
  dsp_tensor *q = mk(dt, 4, sq, 0, 0), *k = mk(dt, 4, sk, 0, 0),
             *v = mk(dt, 4, sv, 0, 0), *go = mk(dt, 4, so, 0, 0), *m = NULL;
  if (masked) {
    dsp_meta mm = meta_of(DSP_BOOL, 2, sm);
    cr_assert_eq(dsp_tensor_new(ctx, &mm, &m), 0);
    uint8_t *mb = dsp_tensor_data(m);
    for (int64_t i = 0; i < B * Tk; i++) mb[i] = rnd() % 3 != 0;
    for (int64_t j = 0; j < Tk; j++) mb[j] = 0; /* entry 0 sees no key */
  }
  dsp_attrs a = dsp_attrs_f1(scale);
  a.ints[0] = causal, a.ints[1] = masked, a.n_ints = 2;
  dsp_tensor *in[5] = {q, k, v, m, NULL}, *bin[5] = {go, q, k, v, m};
  dsp_tensor *want = run(DSP_OP_ATTENTION, &a, 3 + masked, in);
  dsp_tensor *wantb = run(DSP_OP_ATTENTION_BACKWARD, &a, 4 + masked, bin);
  dsp_tensor *got = empty_like(want), *gotb = empty_like(wantb);
  const dsp__cu_attn_geo g = {B, H, Tq, Tk, d, dv, causal,
                              scale != 0.0 ? scale : 1.0 / sqrt((double)d)};
  const int f = dt == DSP_F64;
  const uint8_t *mb = m ? dsp_tensor_data(m) : NULL;
  sim_attn_fwd(&g, f, dsp_tensor_data(q), dsp_tensor_data(k),
               dsp_tensor_data(v), mb, dsp_tensor_data(got));
  sim_attn_bwd(&g, f, dsp_tensor_data(go), dsp_tensor_data(q),
               dsp_tensor_data(k), dsp_tensor_data(v), mb, dsp_tensor_data(gotb));
  /* the CPU runs gemm blocks in f32 for f32 and the exact max-then-sum
   * softmax; the kernels an online softmax in double */
  double tol = f ? 1e-11 : 2e-5;
  assert_close(got, want, tol, NULL, "attention");
  assert_close(gotb, wantb, tol, NULL, "attention_backward");
  if (masked) /* entry 0: output 0 and gradients 0, exactly */
    for (int64_t i = 0; i < H * Tq * dv; i++) cr_assert_eq(ld(got, i), 0.0);
  dsp_tensor *ts[] = {q, k, v, go, m, want, wantb, got, gotb};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

Test(cuda_host, attention_kernels_match_cpu) {
  for (int f = 0; f < 2; f++) {
    dsp_dtype dt = f ? DSP_F64 : DSP_F32;
    check_attn(dt, 2, 2, 5, 7, 3, 4, 0, 0, 0.0);
    check_attn(dt, 2, 1, 9, 4, 5, 2, 1, 0, 0.4); /* causal, Tq > Tk */
    check_attn(dt, 1, 2, 3, 8, 4, 3, 1, 1, 0.0); /* causal, Tq < Tk, mask */
    check_attn(dt, 2, 2, 6, 6, 40, 3, 0, 1, 0.0); /* d over 32: 2 lanes' dims */
    check_attn(dt, 1, 1, 2, 3, 2, 300, 0, 0, 0.0); /* dv over one 256 chunk */
    check_attn(dt, 1, 1, 3, 0, 2, 2, 1, 0, 0.0); /* no keys */
  }
}

/* ------------------------------------------------------------------ */
/* half types                                                          */

/* k_cast replayed: the source read as its compute type (wide(): a half
 * as its f32), then one conversion (convert<TO>()), with the functions
 * the kernel calls (common/half.h, dsp__cu_f2i64) */
static double sim_wide(dsp_dtype dt, const void *p, int64_t i, int64_t *iv) {
  switch (dt) {
    case DSP_F32: return ((const float *)p)[i];
    case DSP_F64: return ((const double *)p)[i];
    case DSP_I64: *iv = ((const int64_t *)p)[i]; return (double)*iv;
    case DSP_F16: return dsp_f16_to_f32(((const uint16_t *)p)[i]);
    case DSP_BF16: return dsp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const uint8_t *)p)[i];
  }
}
static void sim_cast(const dsp_tensor *x, dsp_tensor *o) {
  const dsp_dtype from = x->meta.dtype, to = o->meta.dtype;
  void *po = dsp_tensor_data(o);
  for (int64_t i = 0; i < x->numel; i++) {
    int64_t iv = 0;
    /* the compute type of the source: f32 for f32 and the halves */
    const double w = sim_wide(from, dsp_tensor_data(x), i, &iv);
    const int wf32 = from == DSP_F32 || dsp_dtype_is_half(from);
    switch (to) {
      case DSP_F32: ((float *)po)[i] = from == DSP_I64 ? (float)iv : (float)w; break;
      case DSP_F64: ((double *)po)[i] = w; break;
      case DSP_I64:
        ((int64_t *)po)[i] = from == DSP_I64 ? iv : from == DSP_BOOL ? (int64_t)w
                                                                      : dsp__cu_f2i64(w);
        break;
      case DSP_F16:
      case DSP_BF16: {
        const int f16 = to == DSP_F16;
        uint16_t h;
        if (from == DSP_I64) h = f16 ? dsp_i64_to_f16(iv) : dsp_i64_to_bf16(iv);
        else if (from == DSP_BOOL) h = w != 0 ? (f16 ? 0x3C00 : 0x3F80) : 0;
        else if (wf32) h = f16 ? dsp_f32_to_f16((float)w) : dsp_f32_to_bf16((float)w);
        else h = f16 ? dsp_f64_to_f16(w) : dsp_f64_to_bf16(w);
        ((uint16_t *)po)[i] = h;
        break;
      }
      default: ((uint8_t *)po)[i] = from == DSP_I64 ? iv != 0 : w != 0; break;
    }
  }
}

/* Fills t with the edges of every conversion to and from half: NaN,
 * infinities, signed zeros, f16's largest value and the midpoint above it,
 * subnormals and ties of both half types, f64 values just past a tie
 * (through f32 they would round twice), values past f16's range; i64:
 * integers around 2^53 and 2^62 where a detour through f64 rounds twice */
static void fill_edges(dsp_tensor *t) {
  static const double E[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0, 65504.0,
                             65520.0, -65519.0, 0x1p-24, 0x1p-25, 0x1.8p-24, 0x1p-14,
                             0x1p-133, 0x1p-149, 1.0 + 0x1p-11, 1.0 + 0x1p-8,
                             1.0 + 0x1.8p-8,
                             1.0 + 0x1p-11 + 0x1p-40, -1.0 - 0x1p-8 - 0x1p-40, 3e38, 1e39,
                             0.1, 2.5, -7.5, 1e5};
  const size_t ne = sizeof E / sizeof E[0];
  void *p = dsp_tensor_data(t);
  for (int64_t i = 0; i < t->numel; i++) {
    const double v = i % 2 ? E[(size_t)(i / 2) % ne] : (urnd() - 0.5) * 1e5 * urnd();
    switch (t->meta.dtype) {
      case DSP_F32: ((float *)p)[i] = (float)v; break;
      case DSP_F64: ((double *)p)[i] = v; break;
      case DSP_F16: ((uint16_t *)p)[i] = (uint16_t)rnd(); break; /* any pattern */
      case DSP_BF16: ((uint16_t *)p)[i] = (uint16_t)rnd(); break;
      case DSP_I64:
        ((int64_t *)p)[i] = (int64_t)((urnd() - 0.5) * 2e5) +
                            (i % 3 == 1 ? (INT64_C(1) << 53) + 1
                                        : i % 3 == 2 ? (INT64_C(1) << 62) + (INT64_C(1) << 54) + 1 : 0);
        break;
      default: ((uint8_t *)p)[i] = rnd() & 1; break;
    }
  }
}

/* Every cast to or from a half type, as the kernel computes it, against
 * the CPU's cast bit for bit. */
Test(cuda_host, half_casts_replayed_match_cpu_bit_for_bit) {
  const int64_t sh[1] = {4096};
  int pairs = 0;
  for (int from = 0; from < DSP_NDTYPES; from++)
    for (int to = 0; to < DSP_NDTYPES; to++) {
      if (from == to || !(dsp_dtype_is_half((dsp_dtype)from) || dsp_dtype_is_half((dsp_dtype)to)))
        continue;
      dsp_tensor *x = mk((dsp_dtype)from, 1, sh, 0, 0);
      fill_edges(x);
      int64_t t = to;
      dsp_attrs a = dsp_attrs_ints(1, &t);
      dsp_tensor *want = run(DSP_OP_CAST, &a, 1, &x);
      dsp_tensor *got = empty_like(want);
      sim_cast(x, got);
      char what[64];
      snprintf(what, sizeof what, "cast %s -> %s", dsp_dtype_name((dsp_dtype)from),
               dsp_dtype_name((dsp_dtype)to));
      assert_same_bytes(got, want, what);
      dsp_tensor_unref(x), dsp_tensor_unref(want), dsp_tensor_unref(got);
      pairs++;
    }
  cr_assert_eq(pairs, 18); /* 4 dtypes x 2 halves x 2 ways, and f16 <-> bf16 */
}

/* A half tensor's f32 copy (exact), and an f32 tensor rounded to dt: the
 * wide() and narrow() of the half kernels */
static dsp_tensor *widened(const dsp_tensor *h) {
  dsp_meta m = h->meta;
  m.dtype = DSP_F32;
  dsp_tensor *o = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &o), 0);
  dsp_half_to_f32_n(h->meta.dtype, dsp_tensor_data(h), dsp_tensor_data(o), (size_t)h->numel);
  return o;
}
static dsp_tensor *narrowed(dsp_tensor *f, dsp_dtype dt) {
  if (f->meta.dtype != DSP_F32) return f; /* a comparison's bools */
  dsp_meta m = f->meta;
  m.dtype = dt;
  dsp_tensor *o = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &o), 0);
  const float *v = dsp_tensor_data(f);
  for (int64_t i = 0; i < f->numel; i++)
    ((uint16_t *)dsp_tensor_data(o))[i] =
        dt == DSP_F16 ? dsp_f32_to_f16(v[i]) : dsp_f32_to_bf16(v[i]);
  dsp_tensor_unref(f);
  return o;
}
/* a random half tensor: rval's values (NaN, infinities, -0, ties) rounded */
static dsp_tensor *mk_half(dsp_dtype dt, int nd, const int64_t *sh) {
  dsp_meta m = meta_of(dt, nd, sh);
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0);
  for (int64_t i = 0; i < t->numel; i++) {
    double v = rval(1);
    ((uint16_t *)dsp_tensor_data(t))[i] = dt == DSP_F16 ? dsp_f64_to_f16(v) : dsp_f64_to_bf16(v);
  }
  return t;
}

/* The half instances of k_binary, k_map, k_clamp and k_masked_fill are
 * the f32 kernels between wide() and narrow(): replayed so (the f32
 * replays above on the widened inputs, each result rounded once), they
 * give the CPU's widened op bit for bit, for every elementwise op with
 * broadcasting; masked_fill's value is the f32 of v rounded (1 + 2^-11 +
 * 2^-40 rounds to 1 that way, to 1 + 2^-10 straight from the double). */
Test(cuda_host, half_elementwise_is_the_f32_kernel_rounded_once) {
  static const int64_t S[] = {3, 41}, M[] = {3, 1}, A[] = {4, 1, 3}, B[] = {5, 1};
  for (int dt = DSP_F16; dt <= DSP_BF16; dt++) {
    for (int op = DSP_OP_ADD; op <= DSP_OP_GE; op++) {
      dsp_tensor *in[2] = {mk_half((dsp_dtype)dt, 3, A), mk_half((dsp_dtype)dt, 2, B)};
      dsp_tensor *want = run((dsp_opcode)op, NULL, 2, in);
      dsp_tensor *w[2] = {widened(in[0]), widened(in[1])};
      dsp_tensor *like = run((dsp_opcode)op, NULL, 2, w);
      dsp_tensor *got = narrowed(sim_binary((dsp_opcode)op, w[0], w[1], like), (dsp_dtype)dt);
      assert_same_bytes(got, want, dsp_op_lookup(op)->name);
      dsp_tensor_unref(got), dsp_tensor_unref(like), dsp_tensor_unref(want);
      for (int k = 0; k < 2; k++) dsp_tensor_unref(in[k]), dsp_tensor_unref(w[k]);
    }
    for (int op = DSP_OP_ADD_SCALAR; op <= DSP_OP_GELU_TANH_BACKWARD; op++) {
      if (op == DSP_OP_CLAMP || op == DSP_OP_MASKED_FILL) continue;
      const int n_in = dsp_op_lookup(op)->n_inputs;
      dsp_tensor *in[2] = {mk_half((dsp_dtype)dt, 2, S), mk_half((dsp_dtype)dt, 2, S)};
      const int sc = op <= DSP_OP_RDIV_SCALAR;
      dsp_attrs a = sc ? dsp_attrs_f1(op == DSP_OP_POW_SCALAR ? 1.5 : 0.3) : dsp_attrs_none();
      dsp_tensor *want = run((dsp_opcode)op, &a, n_in, in);
      dsp_tensor *w[2] = {widened(in[0]), widened(in[1])};
      dsp_tensor *got = empty_like(w[0]);
      sim_map((dsp_opcode)op, w[0], n_in > 1 ? w[1] : NULL, sc ? a.floats[0] : 0.0, got);
      got = narrowed(got, (dsp_dtype)dt);
      assert_same_bytes(got, want, dsp_op_lookup(op)->name);
      dsp_tensor_unref(got), dsp_tensor_unref(want);
      for (int k = 0; k < 2; k++) dsp_tensor_unref(in[k]), dsp_tensor_unref(w[k]);
    }
    /* clamp to [-1, 2] */
    dsp_tensor *x = mk_half((dsp_dtype)dt, 2, S), *wx = widened(x);
    dsp_attrs ca = dsp_attrs_none();
    ca.floats[0] = -1, ca.floats[1] = 2, ca.n_floats = 2;
    dsp_tensor *want = run(DSP_OP_CLAMP, &ca, 1, &x), *got = empty_like(wx);
    for (int64_t i = 0; i < wx->numel; i++)
      ((float *)dsp_tensor_data(got))[i] =
          dsp__sm_clamp_f32(((float *)dsp_tensor_data(wx))[i], -1.0f, 2.0f);
    got = narrowed(got, (dsp_dtype)dt);
    assert_same_bytes(got, want, "clamp");
    dsp_tensor_unref(got), dsp_tensor_unref(want), dsp_tensor_unref(wx);
    /* masked_fill, the mask broadcast from [3, 1] */
    const double v = 1.0 + 0x1p-11 + 0x1p-40;
    dsp_tensor *in[2] = {x, mk(DSP_BOOL, 2, M, 0, 0)};
    dsp_attrs ma = dsp_attrs_f1(v);
    want = run(DSP_OP_MASKED_FILL, &ma, 2, in);
    got = empty_like(want);
    const dsp_meta *ms[2] = {&in[1]->meta, &in[0]->meta};
    dsp__cu_index ix;
    dsp__cu_plan_bcast(&ix, &got->meta, ms, 2);
    const uint16_t fill = dt == DSP_F16 ? dsp_f32_to_f16((float)v) : dsp_f32_to_bf16((float)v);
    for (int64_t i = 0; i < got->numel; i++) {
      int64_t off[3];
      dsp__cu_offsets(&ix, i, off);
      const uint16_t h = ((uint16_t *)dsp_tensor_data(x))[off[1]];
      ((uint16_t *)dsp_tensor_data(got))[i] =
          ((uint8_t *)dsp_tensor_data(in[1]))[off[0]]
              ? fill
              : dt == DSP_F16 ? dsp_f32_to_f16(dsp_f16_to_f32(h)) : dsp_f32_to_bf16(dsp_bf16_to_f32(h));
    }
    assert_same_bytes(got, want, "masked_fill");
    dsp_tensor_unref(got), dsp_tensor_unref(want);
    dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  }
}

#if DSP_CUDA_BUILT
/* The support table claims the half types only where a kernel handles
 * them itself: the elementwise family, the softmax family, the copies by
 * element size, the cast, matmul (GemmEx), zeros, ones and full; every other op is left to
 * the op runner's widening, so a claimed op with no half kernel (it would
 * read two-byte elements as another type) fails here. */
Test(cuda_host, half_claims_are_the_native_kernels_only) {
  static const dsp_opcode native[] = {
      DSP_OP_RESHAPE, DSP_OP_PERMUTE, DSP_OP_TRANSPOSE, DSP_OP_SLICE,
      DSP_OP_CAT, DSP_OP_STACK, DSP_OP_BROADCAST_TO, DSP_OP_INDEX_SELECT,
      DSP_OP_CAST, DSP_OP_SLICE_BACKWARD, DSP_OP_MATMUL, DSP_OP_ZEROS, DSP_OP_ONES,
      DSP_OP_FULL, DSP_OP_SOFTMAX, DSP_OP_LOG_SOFTMAX, DSP_OP_SOFTMAX_BACKWARD,
      DSP_OP_LOG_SOFTMAX_BACKWARD};
  int seen = 0;
  for (int op = 0; op < 1024; op++) {
    if (!dsp_op_lookup(op)) continue;
    seen++;
    int want = dsp_op_lookup(op)->family == DSP_FAM_EW;
    for (size_t i = 0; i < sizeof native / sizeof native[0]; i++) want |= (int)native[i] == op;
    for (int dt = DSP_F16; dt <= DSP_BF16; dt++)
      cr_assert_eq(dsp__cuda_has_kernel((dsp_opcode)op, (dsp_dtype)dt), want, "%s %s",
                   dsp_op_lookup(op)->name, dsp_dtype_name((dsp_dtype)dt));
  }
  cr_assert_eq(seen, DSP__OP_COUNT);
  /* a cast to a half type from every other dtype runs the cast kernel */
  for (int dt = 0; dt < DSP_NDTYPES; dt++)
    cr_assert(dsp__cuda_has_kernel(DSP_OP_CAST, (dsp_dtype)dt), "cast from %d", dt);
}
#endif

/* ------------------------------------------------------------------ */
/* the backend itself                                                  */

#if DSP_CUDA_BUILT
Test(cuda_host, errors_map_to_dispatch_codes_with_the_library_message) {
  char buf[256];
  cr_assert_eq(dsp_cuda_error(cudaErrorMemoryAllocation, "cuda add: cudaMallocAsync",
                              buf, sizeof buf),
               DISPATCH_ENOMEM);
  cr_assert(strstr(buf, "cuda add: cudaMallocAsync: out of memory"), "%s", buf);
  cr_assert(strstr(buf, "cudaErrorMemoryAllocation"), "%s", buf);
  cr_assert_eq(dsp_cuda_error(cudaErrorNoDevice, "x", buf, sizeof buf),
               DISPATCH_EUNSUPPORTED);
  cr_assert_eq(dsp_cuda_error(cudaErrorLaunchFailure, "x", buf, sizeof buf),
               DISPATCH_EINTERNAL);
  cr_assert_eq(dsp_cuda_blas_error(CUBLAS_STATUS_ALLOC_FAILED, "gemm", buf, sizeof buf),
               DISPATCH_ENOMEM);
  cr_assert(strstr(buf, "gemm: ") && strstr(buf, "CUBLAS_STATUS_ALLOC_FAILED"), "%s", buf);
  cr_assert_eq(dsp_cuda_blas_error(CUBLAS_STATUS_NOT_SUPPORTED, "gemm", buf, sizeof buf),
               DISPATCH_EUNSUPPORTED);
}

Test(cuda_host, open_without_a_gpu_fails_with_one_line) {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
    /* a GPU host: the backend opens, names itself and closes */
    dsp_backend *be = NULL;
    char why[256] = "";
    cr_assert_eq(dsp_cuda_backend_open(0, &be, why, sizeof why), 0, "%s", why);
    cr_assert(strncmp(be->name, "cuda:0", 6) == 0);
    dsp_cuda_backend_close(be);
    return;
  }
  for (int tries = 0; tries < 2; tries++) { /* twice: no state left behind */
    dsp_backend *be = (dsp_backend *)&be;
    char why[256] = "";
    int rc = dsp_cuda_backend_open(0, &be, why, sizeof why);
    cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "rc %d: %s", rc, why);
    cr_assert_null(be);
    cr_assert(strncmp(why, "no CUDA device: cudaGetDeviceCount: ", 36) == 0, "%s", why);
    cr_assert_null(strchr(why, '\n'));
    cr_assert_gt(strlen(why), 40);
  }
  dsp_cuda_backend_close(NULL);
  cr_assert_eq(dsp_cuda_pool_used(dsp_cpu_backend()), 0);
  cr_assert_eq(dsp_cuda_sync(dsp_cpu_backend(), ctx), DISPATCH_EINVAL);
}
#endif
