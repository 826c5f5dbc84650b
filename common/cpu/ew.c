/* ew family, CPU kernels (inference and the dtype rules: common/ops_ew.c).
 *
 * Every kernel is a plain loop over its elements, each computed alone, so
 * results are bit-identical from run to run and whichever of the
 * backend's threads (par.h) runs which chunk. The scalar math inside the loops is that of
 * common/scalar_math.h, which the CUDA kernels share: one function per op
 * and dtype, inlined into the op's own loop (the switch on the op stays
 * outside the loop). Every dispatch switch ends in a default that refuses
 * the op with DISPATCH_EUNSUPPORTED: an op x dtype without a kernel never
 * "succeeds" with the zeroed output. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "kern_iter.h"
#include "ops_plan.h"
#include "par.h"
#include "scalar_math.h"

#define opname dsp__opname
#define is_arith dsp__ew_is_arith
#define is_cmp dsp__ew_is_cmp
#define is_scalar dsp__ew_is_scalar

/* the float-only unary ops come from scalar_math.h's rows; the others
 * are written out below */
_Static_assert(DSP__OPS_IN_FAMILY(EW) - DSP_SM_N_FLOAT_UNARY == 30,
               "a new elementwise op that is not a row of "
               "DSP_SM_FLOAT_UNARY (common/scalar_math.h) needs a case in "
               "dsp__cpu_ew's loops and a row in the CPU support table "
               "(common/cpu/backend.c)");

/* ------------------------------------------------------------------ */
/* binary kernels                                                      */

/* The fast paths (same shape, either side one element) are plain loops the
 * compiler vectorises; everything else walks rows with dsp_iter. */
enum { BC_SAME, BC_ASCALAR, BC_BSCALAR, BC_GENERAL };

#define BIN_LOOP(TA, TO, EXPR)                                               \
  do {                                                                       \
    const TA *restrict A_ = (const TA *)pa;                                  \
    const TA *restrict B_ = (const TA *)pb;                                  \
    TO *restrict O_ = (TO *)po;                                              \
    if (mode == BC_SAME) {                                                   \
      for (int64_t i = 0; i < n; i++) {                                      \
        TA x = A_[i], y = B_[i];                                             \
        O_[i] = (EXPR);                                                      \
      }                                                                      \
    } else if (mode == BC_ASCALAR) {                                         \
      const TA x = A_[0];                                                    \
      for (int64_t i = 0; i < n; i++) {                                      \
        TA y = B_[i];                                                        \
        O_[i] = (EXPR);                                                      \
      }                                                                      \
    } else if (mode == BC_BSCALAR) {                                         \
      const TA y = B_[0];                                                    \
      for (int64_t i = 0; i < n; i++) {                                      \
        TA x = A_[i];                                                        \
        O_[i] = (EXPR);                                                      \
      }                                                                      \
    } else {                                                                 \
      int64_t idx_[DSP_MAX_DIMS] = {0}, off_[3] = {0, 0, 0};                 \
      const int64_t in_ = it.inner, sa_ = it.st[0][it.nd - 1],               \
                    sb_ = it.st[1][it.nd - 1];                               \
      int64_t pw_ = 0;                                                       \
      dsp__iter_seek(&it, r0, idx_, off_);                                   \
      for (int64_t r = r0; r < r1 && !stop; r++) {                           \
        const TA *a_ = A_ + off_[0], *b_ = B_ + off_[1];                     \
        TO *o_ = O_ + r * in_;                                               \
        if (sa_ == 1 && sb_ == 1) {                                          \
          for (int64_t j = 0; j < in_; j++) {                                \
            TA x = a_[j], y = b_[j];                                         \
            o_[j] = (EXPR);                                                  \
          }                                                                  \
        } else if (sa_ == 0 && sb_ == 1) {                                   \
          const TA x = a_[0];                                                \
          for (int64_t j = 0; j < in_; j++) {                                \
            TA y = b_[j];                                                    \
            o_[j] = (EXPR);                                                  \
          }                                                                  \
        } else if (sa_ == 1 && sb_ == 0) {                                   \
          const TA y = b_[0];                                                \
          for (int64_t j = 0; j < in_; j++) {                                \
            TA x = a_[j];                                                    \
            o_[j] = (EXPR);                                                  \
          }                                                                  \
        } else {                                                             \
          for (int64_t j = 0; j < in_; j++) {                                \
            TA x = a_[j * sa_], y = b_[j * sb_];                             \
            o_[j] = (EXPR);                                                  \
          }                                                                  \
        }                                                                    \
        dsp__iter_step(&it, idx_, off_);                                     \
        stop = dsp__poll(ctx, &pw_, in_);                                    \
      }                                                                      \
    }                                                                        \
  } while (0)

/* add..minimum of dtype suffix S (scalar_math.h: wrapping i64, NaN-first
 * maximum/minimum; the caller has refused a zero i64 divisor) */
#define ARITH_CASES(T, S)                                                    \
  switch (op) {                                                              \
    case DSP_OP_ADD: BIN_LOOP(T, T, dsp__sm_add_##S(x, y)); break;           \
    case DSP_OP_SUB: BIN_LOOP(T, T, dsp__sm_sub_##S(x, y)); break;           \
    case DSP_OP_MUL: BIN_LOOP(T, T, dsp__sm_mul_##S(x, y)); break;           \
    case DSP_OP_DIV: BIN_LOOP(T, T, dsp__sm_div_##S(x, y)); break;           \
    case DSP_OP_MAXIMUM: BIN_LOOP(T, T, dsp__sm_max_##S(x, y)); break;       \
    case DSP_OP_MINIMUM: BIN_LOOP(T, T, dsp__sm_min_##S(x, y)); break;       \
    default: return -1;                                                      \
  }

#define CMP_CASES(T)                                                         \
  switch (op) {                                                              \
    case DSP_OP_EQ: BIN_LOOP(T, uint8_t, x == y); break;                     \
    case DSP_OP_NE: BIN_LOOP(T, uint8_t, x != y); break;                     \
    case DSP_OP_LT: BIN_LOOP(T, uint8_t, x < y); break;                      \
    case DSP_OP_LE: BIN_LOOP(T, uint8_t, x <= y); break;                     \
    case DSP_OP_GT: BIN_LOOP(T, uint8_t, x > y); break;                      \
    case DSP_OP_GE: BIN_LOOP(T, uint8_t, x >= y); break;                     \
    default: return -1;                                                      \
  }

/* One block of a binary op: n elements in a flat mode, or the rows
 * [r0, r1) of the output in BC_GENERAL (which polls the cancel flag
 * between rows itself). Returns 1 when cancelled, -1 (nothing written)
 * when there is no kernel for op on dt. */
static int bin_block(dsp_ctx *ctx, dsp_opcode op, dsp_dtype dt, int mode,
                     const dsp_iter *itp, const void *pa, const void *pb,
                     void *po, int64_t n, int64_t r0, int64_t r1) {
  const dsp_iter it = *itp;
  int stop = 0;
  if (is_cmp(op)) {
    switch (dt) {
      case DSP_F32: CMP_CASES(float) break;
      case DSP_F64: CMP_CASES(double) break;
      case DSP_I64: CMP_CASES(int64_t) break;
      case DSP_BOOL: /* bools have equality, no order */
        if (op != DSP_OP_EQ && op != DSP_OP_NE) return -1;
        CMP_CASES(uint8_t) break;
      default: return -1;
    }
    return stop;
  }
  switch (dt) {
    case DSP_F32: ARITH_CASES(float, f32) break;
    case DSP_F64: ARITH_CASES(double, f64) break;
    case DSP_I64: ARITH_CASES(int64_t, i64) break;
    default: return -1;
  }
  return stop;
}

/* Elementwise work is cut into chunks of EW_GRAIN elements (a broadcast
 * op: of whole rows, about EW_GRAIN elements) that the backend's threads
 * share (par.h); every element is computed by the same expression
 * whichever thread runs its chunk, so the bits do not depend on the
 * thread count. */
#define EW_GRAIN ((int64_t)1 << 14)

typedef struct ew_job {
  dsp_ctx *ctx;
  dsp_opcode op;
  dsp_dtype dt;
  int mode;
  const dsp_iter *it;
  const char *p0, *p1;
  char *po;
  size_t ei, eo;
  const dsp_attrs *a;
} ew_job;

static int bin_chunk(void *arg, int64_t lo, int64_t hi, int lane) {
  const ew_job *j = arg;
  (void)lane;
  if (j->mode == BC_GENERAL)
    return bin_block(j->ctx, j->op, j->dt, j->mode, j->it, j->p0, j->p1,
                     j->po, 0, lo, hi) != 0;
  const char *a0 = j->p0 + (j->mode == BC_ASCALAR ? 0 : (size_t)lo * j->ei);
  const char *b0 = j->p1 + (j->mode == BC_BSCALAR ? 0 : (size_t)lo * j->ei);
  return bin_block(j->ctx, j->op, j->dt, j->mode, j->it, a0, b0,
                   j->po + (size_t)lo * j->eo, hi - lo, 0, 0) != 0;
}

/* Binary op or comparison over broadcast inputs into out, in chunks with
 * a look at the cancel flag before each. */
static int run_binary(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                      dsp_tensor *out) {
  const dsp_tensor *ta = in[0], *tb = in[1];
  const int64_t n = out->numel;
  if (n == 0) return 0;
  const void *pa = dsp_tensor_data(ta), *pb = dsp_tensor_data(tb);
  void *po = dsp_tensor_data(out);
  dsp_iter it;
  int mode;
  if (ta->numel == n && tb->numel == n) mode = BC_SAME;
  else if (ta->numel == 1 && tb->numel == n) mode = BC_ASCALAR;
  else if (tb->numel == 1 && ta->numel == n) mode = BC_BSCALAR;
  else {
    const dsp_meta *ms[2] = {&ta->meta, &tb->meta};
    dsp__iter_bcast(&it, &out->meta, ms, 2);
    mode = BC_GENERAL;
  }
  if (mode != BC_GENERAL) memset(&it, 0, sizeof it);
  dsp_dtype dt = ta->meta.dtype;
  if (op == DSP_OP_DIV && dt == DSP_I64) {
    /* every divisor element is used when the output is non-empty */
    const int64_t *b = pb;
    for (int64_t i = 0; i < tb->numel; i++)
      if (b[i] == 0)
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "div: integer division by zero (divisor element %lld)",
                          (long long)i);
  }
  /* an empty block finds a missing kernel before anything is written */
  if (bin_block(ctx, op, dt, BC_SAME, &it, pa, pb, po, 0, 0, 0) < 0)
    return dsp__no_kernel(ctx, op, in, 2, out);
  ew_job j = {.ctx = ctx, .op = op, .dt = dt, .mode = mode, .it = &it,
              .p0 = pa, .p1 = pb, .po = po, .ei = dsp_dtype_size(dt),
              .eo = dsp_dtype_size(out->meta.dtype)};
  int64_t total = n, grain = EW_GRAIN;
  if (mode == BC_GENERAL) {
    total = it.rows;
    grain = it.inner >= EW_GRAIN || it.inner < 1 ? 1 : EW_GRAIN / it.inner;
  }
  return dsp__par_for(ctx, total, grain, bin_chunk, &j)
             ? dsp__cancelled_err(ctx, op)
             : 0;
}

/* where(mask, a, b) with a three-way broadcast. */
static int run_where(dsp_ctx *ctx, dsp_tensor *const *in, dsp_tensor *out) {
  const int64_t n = out->numel;
  if (n == 0) return 0;
  const uint8_t *m = dsp_tensor_data(in[0]);
  const char *pa = dsp_tensor_data(in[1]), *pb = dsp_tensor_data(in[2]);
  char *po = dsp_tensor_data(out);
  const size_t es = dsp_dtype_size(out->meta.dtype);
  int stop = 0;
#define WHERE_T(T)                                                           \
  do {                                                                       \
    const T *a_ = (const T *)pa, *b_ = (const T *)pb;                        \
    T *o_ = (T *)po;                                                         \
    if (in[0]->numel == n && in[1]->numel == n && in[2]->numel == n) {       \
      for (int64_t i0 = 0; i0 < n && !stop; i0 += DSP_POLL_WORK) {           \
        int64_t i1 = n - i0 < DSP_POLL_WORK ? n : i0 + DSP_POLL_WORK;        \
        for (int64_t i = i0; i < i1; i++) o_[i] = m[i] ? a_[i] : b_[i];      \
        stop = dsp_ctx_cancelled(ctx);                                       \
      }                                                                      \
    } else {                                                                 \
      const dsp_meta *ms[3] = {&in[0]->meta, &in[1]->meta, &in[2]->meta};    \
      dsp_iter it;                                                           \
      dsp__iter_bcast(&it, &out->meta, ms, 3);                               \
      int64_t idx[DSP_MAX_DIMS] = {0}, off[3] = {0, 0, 0};                   \
      const int64_t sm = it.st[0][it.nd - 1], sa = it.st[1][it.nd - 1],      \
                    sb = it.st[2][it.nd - 1];                                \
      int64_t pw = 0;                                                        \
      for (int64_t r = 0; r < it.rows && !stop; r++) {                       \
        const uint8_t *mr = m + off[0];                                      \
        const T *ar = a_ + off[1], *br = b_ + off[2];                        \
        T *orow = o_ + r * it.inner;                                         \
        for (int64_t j = 0; j < it.inner; j++)                               \
          orow[j] = mr[j * sm] ? ar[j * sa] : br[j * sb];                    \
        dsp__iter_step(&it, idx, off);                                       \
        stop = dsp__poll(ctx, &pw, it.inner);                                \
      }                                                                      \
    }                                                                        \
  } while (0)
  switch (es) {
    case 1: WHERE_T(uint8_t); break;
    case 4: WHERE_T(uint32_t); break; /* bit copies: NaN payloads survive */
    case 8: WHERE_T(uint64_t); break;
    default: return dsp__no_kernel(ctx, DSP_OP_WHERE, in, 3, out);
  }
#undef WHERE_T
  return stop ? dsp__cancelled_err(ctx, DSP_OP_WHERE) : 0;
}

/* ------------------------------------------------------------------ */
/* scalar forms and unary ops                                          */

#define UN_LOOP(TI, TO, EXPR)                                                \
  do {                                                                       \
    const TI *restrict X_ = (const TI *)px;                                  \
    TO *restrict O_ = (TO *)po;                                              \
    for (int64_t i = 0; i < n; i++) {                                        \
      TI x = X_[i];                                                          \
      O_[i] = (EXPR);                                                        \
    }                                                                        \
  } while (0)

/* n elements of a scalar form, unary op or activation backward; one block
 * of the chunked loop in dsp__cpu_ew. These return 0, or -1 (nothing
 * written) when there is no kernel for op on dt. */
static int run_scalar(dsp_opcode op, dsp_dtype dt, const void *px, double s,
                      void *po, int64_t n) {
  switch (dt) {
    case DSP_F32: {
      const float c = (float)s;
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(float, float, dsp__sm_add_f32(x, c)); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(float, float, dsp__sm_sub_f32(x, c)); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(float, float, dsp__sm_mul_f32(x, c)); break;
        case DSP_OP_DIV_SCALAR: UN_LOOP(float, float, dsp__sm_div_f32(x, c)); break;
        case DSP_OP_POW_SCALAR: /* the square's test out of the loop */
          if (c == 2.0f) UN_LOOP(float, float, dsp__sm_pow_f32(x, 2.0f));
          else UN_LOOP(float, float, dsp__sm_pow_f32(x, c));
          break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(float, float, dsp__sm_sub_f32(c, x)); break;
        case DSP_OP_RDIV_SCALAR: UN_LOOP(float, float, dsp__sm_div_f32(c, x)); break;
        default: return -1;
      }
      break;
    }
    case DSP_F64:
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(double, double, dsp__sm_add_f64(x, s)); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(double, double, dsp__sm_sub_f64(x, s)); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(double, double, dsp__sm_mul_f64(x, s)); break;
        case DSP_OP_DIV_SCALAR: UN_LOOP(double, double, dsp__sm_div_f64(x, s)); break;
        case DSP_OP_POW_SCALAR:
          if (s == 2.0) UN_LOOP(double, double, dsp__sm_pow_f64(x, 2.0));
          else UN_LOOP(double, double, dsp__sm_pow_f64(x, s));
          break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(double, double, dsp__sm_sub_f64(s, x)); break;
        case DSP_OP_RDIV_SCALAR: UN_LOOP(double, double, dsp__sm_div_f64(s, x)); break;
        default: return -1;
      }
      break;
    case DSP_I64: {
      const int64_t c = (int64_t)s; /* infer checked it is an exact int64 */
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(int64_t, int64_t, dsp__sm_add_i64(x, c)); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(int64_t, int64_t, dsp__sm_sub_i64(x, c)); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(int64_t, int64_t, dsp__sm_mul_i64(x, c)); break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(int64_t, int64_t, dsp__sm_sub_i64(c, x)); break;
        default: return -1;
      }
      break;
    }
    default: return -1;
  }
  return 0;
}

/* the float-only unary ops of common/scalar_math.h, one loop each */
#define UNARY_CASE_f32(OP, f)                                                \
  case DSP_OP_##OP: UN_LOOP(float, float, dsp__sm_##f##_f32(x)); break;
#define UNARY_CASE_f64(OP, f)                                                \
  case DSP_OP_##OP: UN_LOOP(double, double, dsp__sm_##f##_f64(x)); break;

static int run_unary(dsp_opcode op, dsp_dtype dt, const void *px, void *po,
                     int64_t n) {
  switch (dt) {
    case DSP_F32:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(float, float, -x); break;
        case DSP_OP_ABS: UN_LOOP(float, float, fabsf(x)); break;
        case DSP_OP_SIGN: UN_LOOP(float, float, dsp__sm_sign_f32(x)); break;
        case DSP_OP_RELU: UN_LOOP(float, float, dsp__sm_relu_f32(x)); break;
        DSP_SM_FLOAT_UNARY(UNARY_CASE_f32)
        default: return -1;
      }
      break;
    case DSP_F64:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(double, double, -x); break;
        case DSP_OP_ABS: UN_LOOP(double, double, fabs(x)); break;
        case DSP_OP_SIGN: UN_LOOP(double, double, dsp__sm_sign_f64(x)); break;
        case DSP_OP_RELU: UN_LOOP(double, double, dsp__sm_relu_f64(x)); break;
        DSP_SM_FLOAT_UNARY(UNARY_CASE_f64)
        default: return -1;
      }
      break;
    case DSP_I64:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(int64_t, int64_t, dsp__sm_neg_i64(x)); break;
        case DSP_OP_ABS: UN_LOOP(int64_t, int64_t, dsp__sm_abs_i64(x)); break;
        case DSP_OP_SIGN: UN_LOOP(int64_t, int64_t, dsp__sm_sign_i64(x)); break;
        case DSP_OP_RELU: UN_LOOP(int64_t, int64_t, dsp__sm_relu_i64(x)); break;
        default: return -1;
      }
      break;
    default: return -1;
  }
  return 0;
}

/* (grad, x) -> grad * f'(x); shapes are equal (checked by infer). */
#define ACT_BW(T, EXPR)                                                      \
  do {                                                                       \
    const T *restrict G_ = pg, *restrict X_ = px;                            \
    T *restrict O_ = po;                                                     \
    for (int64_t i = 0; i < n; i++) {                                        \
      T gv = G_[i], x = X_[i];                                               \
      O_[i] = (EXPR);                                                        \
    }                                                                        \
  } while (0)
#define ACT_BW_CASES(T, S)                                                   \
  switch (op) {                                                              \
    case DSP_OP_RELU_BACKWARD: ACT_BW(T, dsp__sm_relu_bw_##S(gv, x)); break; \
    case DSP_OP_GELU_BACKWARD: ACT_BW(T, dsp__sm_gelu_bw_##S(gv, x)); break; \
    case DSP_OP_SOFTPLUS_BACKWARD:                                           \
      ACT_BW(T, dsp__sm_softplus_bw_##S(gv, x));                             \
      break;                                                                 \
    case DSP_OP_GELU_TANH_BACKWARD:                                          \
      ACT_BW(T, dsp__sm_gelu_tanh_bw_##S(gv, x));                            \
      break;                                                                 \
    default: return -1;                                                      \
  }
static int run_act_backward(dsp_opcode op, dsp_dtype dt, const void *pg,
                            const void *px, void *po, int64_t n) {
  switch (dt) {
    case DSP_F32: ACT_BW_CASES(float, f32) break;
    case DSP_F64: ACT_BW_CASES(double, f64) break;
    case DSP_I64:
      if (op != DSP_OP_RELU_BACKWARD) return -1;
      ACT_BW(int64_t, dsp__sm_relu_bw_i64(gv, x));
      break;
    default: return -1;
  }
  return 0;
}
#undef ACT_BW_CASES
#undef ACT_BW

/* clamp(x) to floats {lo, hi}, converted to x's dtype (inference checked
 * that an i64 tensor's bounds are integers or infinite) */
static int64_t bound_i64(double v) {
  return v <= -0x1p63 ? INT64_MIN : v >= 0x1p63 ? INT64_MAX : (int64_t)v;
}
static int run_clamp(dsp_dtype dt, const void *px, double lo, double hi,
                     void *po, int64_t n) {
  switch (dt) {
    case DSP_F32: {
      const float l = (float)lo, h = (float)hi;
      UN_LOOP(float, float, dsp__sm_clamp_f32(x, l, h));
      break;
    }
    case DSP_F64: UN_LOOP(double, double, dsp__sm_clamp_f64(x, lo, hi)); break;
    case DSP_I64: {
      const int64_t l = bound_i64(lo), h = bound_i64(hi);
      UN_LOOP(int64_t, int64_t, dsp__sm_clamp_i64(x, l, h));
      break;
    }
    default: return -1;
  }
  return 0;
}

/* masked_fill(x, mask, value): x's shape, the mask broadcast to it. The
 * value is stored in x's dtype (an i64 one is an exact integer: infer). */
static int run_masked_fill(dsp_ctx *ctx, dsp_tensor *const *in, double v,
                           dsp_tensor *out) {
  const int64_t n = out->numel;
  if (n == 0) return 0;
  const uint8_t *m = dsp_tensor_data(in[1]);
  const void *px = dsp_tensor_data(in[0]);
  void *po = dsp_tensor_data(out);
  const dsp_meta *ms[2] = {&in[1]->meta, &in[0]->meta};
  dsp_iter it;
  dsp__iter_bcast(&it, &out->meta, ms, 2);
  int stop = 0;
#define FILL_T(T, VAL)                                                       \
  do {                                                                       \
    const T *x_ = px;                                                        \
    T *o_ = po;                                                              \
    const T val = (VAL);                                                     \
    int64_t idx[DSP_MAX_DIMS] = {0}, off[3] = {0, 0, 0}, pw = 0;             \
    const int64_t sm = it.st[0][it.nd - 1], sx = it.st[1][it.nd - 1];        \
    for (int64_t r = 0; r < it.rows && !stop; r++) {                         \
      const uint8_t *mr = m + off[0];                                        \
      const T *xr = x_ + off[1];                                             \
      T *orow = o_ + r * it.inner;                                           \
      for (int64_t j = 0; j < it.inner; j++)                                 \
        orow[j] = mr[j * sm] ? val : xr[j * sx];                             \
      dsp__iter_step(&it, idx, off);                                         \
      stop = dsp__poll(ctx, &pw, it.inner);                                  \
    }                                                                        \
  } while (0)
  switch (in[0]->meta.dtype) {
    case DSP_F32: FILL_T(float, (float)v); break;
    case DSP_F64: FILL_T(double, v); break;
    case DSP_I64: FILL_T(int64_t, (int64_t)v); break;
    default: return dsp__no_kernel(ctx, DSP_OP_MASKED_FILL, in, 2, out);
  }
#undef FILL_T
  return stop ? dsp__cancelled_err(ctx, DSP_OP_MASKED_FILL) : 0;
}

/* Elements [lo, hi) of a scalar form, activation backward, clamp or
 * unary op: 0, or -1 (nothing written) when there is no kernel. */
static int un_block(const ew_job *j, int64_t lo, int64_t hi) {
  const dsp_opcode op = j->op;
  const dsp_dtype dt = j->dt;
  const size_t off = (size_t)lo * j->ei;
  const int64_t nb = hi - lo;
  if (is_scalar(op))
    return run_scalar(op, dt, j->p0 + off, j->a->floats[0], j->po + off, nb);
  if (dsp__sm_is_act_bw(op))
    return run_act_backward(op, dt, j->p0 + off, j->p1 + off, j->po + off, nb);
  if (op == DSP_OP_CLAMP)
    return run_clamp(dt, j->p0 + off, j->a->floats[0], j->a->floats[1],
                     j->po + off, nb);
  return run_unary(op, dt, j->p0 + off, j->po + off, nb);
}

static int un_chunk(void *arg, int64_t lo, int64_t hi, int lane) {
  (void)lane;
  return un_block(arg, lo, hi) != 0;
}

int dsp__cpu_ew(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
                const dsp_attrs *a, dsp_tensor *out) {
  if (is_arith(op) || is_cmp(op)) return run_binary(ctx, op, in, out);
  if (op == DSP_OP_WHERE) return run_where(ctx, in, out);
  if (op == DSP_OP_MASKED_FILL) return run_masked_fill(ctx, in, a->floats[0], out);
  /* the rest map element i to element i: chunks of EW_GRAIN elements
   * with a look at the cancel flag before each */
  ew_job j = {.ctx = ctx, .op = op, .dt = in[0]->meta.dtype,
              .p0 = dsp_tensor_data(in[0]),
              .p1 = n_in > 1 ? dsp_tensor_data(in[1]) : NULL,
              .po = dsp_tensor_data(out), .ei = dsp_dtype_size(in[0]->meta.dtype),
              .a = a};
  /* an empty block finds a missing kernel before anything is written */
  if (un_block(&j, 0, 0) < 0) return dsp__no_kernel(ctx, op, in, n_in, out);
  return dsp__par_for(ctx, out->numel, EW_GRAIN, un_chunk, &j)
             ? dsp__cancelled_err(ctx, op)
             : 0;
}
