/* ew family: elementwise binary ops with numpy broadcasting, comparisons,
 * where, scalar forms, unary math, activations and their backward helpers.
 *
 * dtypes: float math on f32 and f64 (f32 is computed in float with the
 * float libm functions); i64 for add/sub/mul/div/maximum/minimum, the
 * comparisons, neg/abs/sign/relu(+backward) and the integral scalar forms
 * add/sub/mul/rsub; bool for eq/ne and as where's mask. i64 arithmetic
 * wraps modulo 2^64 (never undefined behaviour); i64 div truncates toward
 * zero, INT64_MIN / -1 wraps to INT64_MIN, and a zero divisor is
 * DISPATCH_EINVAL. maximum/minimum/relu/sign propagate NaN.
 *
 * Every kernel is a plain sequential loop, so results are bit-identical
 * from run to run. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "kern_iter.h"

static const char *opname(dsp_opcode op) { return dsp_op_lookup((int)op)->name; }

static int is_arith(dsp_opcode op) {
  return op >= DSP_OP_ADD && op <= DSP_OP_MINIMUM;
}
static int is_cmp(dsp_opcode op) { return op >= DSP_OP_EQ && op <= DSP_OP_GE; }
static int is_scalar(dsp_opcode op) {
  return op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR;
}

static int same_dtype(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
                      const dsp_meta *y) {
  if (x->dtype != y->dtype)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtypes %s and %s differ",
                      opname(op), dsp_dtype_name(x->dtype),
                      dsp_dtype_name(y->dtype));
  return 0;
}

static int bad_dtype(dsp_ctx *ctx, dsp_opcode op, dsp_dtype dt) {
  return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtype %s not supported",
                    opname(op), dsp_dtype_name(dt));
}

/* An i64 scalar form needs a scalar that is an exact int64. */
static int scalar_is_i64(double s) {
  return isfinite(s) && s == trunc(s) && s >= -0x1p63 && s < 0x1p63;
}

int dsp__infer_ew(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                  const dsp_attrs *a, dsp_meta *out) {
  (void)n_in; /* op.c checked it against the table */
  int rc;
  dsp_dtype dt = in[0].dtype;
  if (is_arith(op) || is_cmp(op)) {
    if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
    if ((rc = same_dtype(ctx, op, &in[0], &in[1])) < 0) return rc;
    if (dt == DSP_BOOL && !(op == DSP_OP_EQ || op == DSP_OP_NE))
      return bad_dtype(ctx, op, dt);
    if ((rc = dsp_broadcast_shapes(ctx, opname(op), &in[0], &in[1], out)) < 0)
      return rc;
    out->dtype = is_cmp(op) ? DSP_BOOL : dt;
    return 0;
  }
  if (op == DSP_OP_WHERE) {
    if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
    if (in[0].dtype != DSP_BOOL)
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "where: mask must be bool, got %s",
                        dsp_dtype_name(in[0].dtype));
    if ((rc = same_dtype(ctx, op, &in[1], &in[2])) < 0) return rc;
    dsp_meta ab;
    if ((rc = dsp_broadcast_shapes(ctx, "where", &in[1], &in[2], &ab)) < 0)
      return rc;
    if ((rc = dsp_broadcast_shapes(ctx, "where", &in[0], &ab, out)) < 0)
      return rc;
    out->dtype = in[1].dtype;
    return 0;
  }
  if (is_scalar(op)) {
    if ((rc = dsp__want_attrs(ctx, op, a, 0, 1)) < 0) return rc;
    if (dt == DSP_I64) {
      if (op == DSP_OP_DIV_SCALAR || op == DSP_OP_RDIV_SCALAR ||
          op == DSP_OP_POW_SCALAR)
        return bad_dtype(ctx, op, dt);
      if (!scalar_is_i64(a->floats[0]))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "%s: scalar %g is not an integer for an i64 tensor",
                          opname(op), a->floats[0]);
    } else if (!dsp_dtype_is_float(dt)) {
      return bad_dtype(ctx, op, dt);
    }
    *out = in[0];
    return 0;
  }
  if (op == DSP_OP_RELU_BACKWARD || op == DSP_OP_GELU_BACKWARD) {
    if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
    if ((rc = same_dtype(ctx, op, &in[0], &in[1])) < 0) return rc;
    if (!dsp_dtype_is_float(dt) && !(dt == DSP_I64 && op == DSP_OP_RELU_BACKWARD))
      return bad_dtype(ctx, op, dt);
    if (!dsp_meta_equal(&in[0], &in[1])) {
      char s1[128], s2[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "%s: grad shape %s differs from input shape %s",
                        opname(op), dsp_shape_str(&in[0], s1, sizeof s1),
                        dsp_shape_str(&in[1], s2, sizeof s2));
    }
    *out = in[0];
    return 0;
  }
  switch (op) {
    case DSP_OP_NEG: case DSP_OP_ABS: case DSP_OP_SIGN: case DSP_OP_RELU:
      if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
      if (!dsp_dtype_is_float(dt) && dt != DSP_I64) return bad_dtype(ctx, op, dt);
      *out = in[0];
      return 0;
    case DSP_OP_EXP: case DSP_OP_LOG: case DSP_OP_SQRT: case DSP_OP_SIGMOID:
    case DSP_OP_TANH: case DSP_OP_GELU:
      if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
      if (!dsp_dtype_is_float(dt)) return bad_dtype(ctx, op, dt);
      *out = in[0];
      return 0;
    default:
      return dsp_seterr(ctx, DISPATCH_EINTERNAL, "ew: op %d is not elementwise",
                        (int)op);
  }
}

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
      for (int64_t r = 0; r < it.rows && !stop; r++) {                       \
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

/* wrapping i64 arithmetic without signed-overflow UB */
#define I64_ADD(x, y) ((int64_t)((uint64_t)(x) + (uint64_t)(y)))
#define I64_SUB(x, y) ((int64_t)((uint64_t)(x) - (uint64_t)(y)))
#define I64_MUL(x, y) ((int64_t)((uint64_t)(x) * (uint64_t)(y)))
/* caller guarantees y != 0 */
#define I64_DIV(x, y) (((y) == -1) ? I64_SUB(0, (x)) : (x) / (y))
#define F_MAX(x, y) (((x) > (y) || (x) != (x)) ? (x) : (y))
#define F_MIN(x, y) (((x) < (y) || (x) != (x)) ? (x) : (y))
#define I_MAX(x, y) ((x) > (y) ? (x) : (y))
#define I_MIN(x, y) ((x) < (y) ? (x) : (y))

#define ARITH_CASES(T, ADD, SUB, MUL, DIV, MAX, MIN)                         \
  switch (op) {                                                              \
    case DSP_OP_ADD: BIN_LOOP(T, T, ADD(x, y)); break;                       \
    case DSP_OP_SUB: BIN_LOOP(T, T, SUB(x, y)); break;                       \
    case DSP_OP_MUL: BIN_LOOP(T, T, MUL(x, y)); break;                       \
    case DSP_OP_DIV: BIN_LOOP(T, T, DIV(x, y)); break;                       \
    case DSP_OP_MAXIMUM: BIN_LOOP(T, T, MAX(x, y)); break;                   \
    case DSP_OP_MINIMUM: BIN_LOOP(T, T, MIN(x, y)); break;                   \
    default: break;                                                          \
  }

#define CMP_CASES(T)                                                         \
  switch (op) {                                                              \
    case DSP_OP_EQ: BIN_LOOP(T, uint8_t, x == y); break;                     \
    case DSP_OP_NE: BIN_LOOP(T, uint8_t, x != y); break;                     \
    case DSP_OP_LT: BIN_LOOP(T, uint8_t, x < y); break;                      \
    case DSP_OP_LE: BIN_LOOP(T, uint8_t, x <= y); break;                     \
    case DSP_OP_GT: BIN_LOOP(T, uint8_t, x > y); break;                      \
    case DSP_OP_GE: BIN_LOOP(T, uint8_t, x >= y); break;                     \
    default: break;                                                          \
  }

#define F_ADD(x, y) ((x) + (y))
#define F_SUB(x, y) ((x) - (y))
#define F_MUL(x, y) ((x) * (y))
#define F_DIV(x, y) ((x) / (y))

/* One block of a binary op: n elements in a flat mode, or the whole
 * output in BC_GENERAL (which polls the cancel flag between rows itself).
 * Returns 1 when cancelled. */
static int bin_block(dsp_ctx *ctx, dsp_opcode op, dsp_dtype dt, int mode,
                     dsp_iter it, const void *pa, const void *pb, void *po,
                     int64_t n) {
  int stop = 0;
  if (is_cmp(op)) {
    switch (dt) {
      case DSP_F32: CMP_CASES(float) break;
      case DSP_F64: CMP_CASES(double) break;
      case DSP_I64: CMP_CASES(int64_t) break;
      case DSP_BOOL: CMP_CASES(uint8_t) break;
      default: break;
    }
    return stop;
  }
  switch (dt) {
    case DSP_F32: ARITH_CASES(float, F_ADD, F_SUB, F_MUL, F_DIV, F_MAX, F_MIN) break;
    case DSP_F64: ARITH_CASES(double, F_ADD, F_SUB, F_MUL, F_DIV, F_MAX, F_MIN) break;
    case DSP_I64:
      ARITH_CASES(int64_t, I64_ADD, I64_SUB, I64_MUL, I64_DIV, I_MAX, I_MIN) break;
    default: break;
  }
  return stop;
}

/* Binary op or comparison over broadcast inputs into out. The flat modes
 * run in blocks of DSP_POLL_WORK elements with a look at the cancel flag
 * before each. */
static int run_binary(dsp_ctx *ctx, dsp_opcode op, const dsp_tensor *ta,
                      const dsp_tensor *tb, dsp_tensor *out) {
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
  if (dt != DSP_F32 && dt != DSP_F64 && dt != DSP_I64 &&
      !(dt == DSP_BOOL && is_cmp(op)))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtype %s not supported",
                      opname(op), dsp_dtype_name(dt));
  if (mode == BC_GENERAL)
    return bin_block(ctx, op, dt, mode, it, pa, pb, po, n)
               ? dsp__cancelled_err(ctx, op)
               : 0;
  const size_t ei = dsp_dtype_size(dt), eo = dsp_dtype_size(out->meta.dtype);
  for (int64_t i0 = 0; i0 < n; i0 += DSP_POLL_WORK) {
    if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
    int64_t nb = n - i0 < DSP_POLL_WORK ? n - i0 : DSP_POLL_WORK;
    const char *a0 = (const char *)pa + (mode == BC_ASCALAR ? 0 : i0 * ei);
    const char *b0 = (const char *)pb + (mode == BC_BSCALAR ? 0 : i0 * ei);
    bin_block(ctx, op, dt, mode, it, a0, b0, (char *)po + i0 * eo, nb);
  }
  return 0;
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
    default: WHERE_T(uint64_t); break;
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

static inline float sigmoidf_(float x) {
  if (x >= 0) return 1.0f / (1.0f + expf(-x));
  float e = expf(x);
  return e / (1.0f + e);
}
static inline double sigmoid_(double x) {
  if (x >= 0) return 1.0 / (1.0 + exp(-x));
  double e = exp(x);
  return e / (1.0 + e);
}
#define SQRT1_2 0.70710678118654752440
#define INV_SQRT_2PI 0.39894228040143267794
static inline float geluf_(float x) {
  return 0.5f * x * (1.0f + erff(x * (float)SQRT1_2));
}
static inline double gelu_(double x) { return 0.5 * x * (1.0 + erf(x * SQRT1_2)); }
/* d gelu / dx = Phi(x) + x phi(x) */
static inline float gelu_gradf_(float x) {
  return 0.5f * (1.0f + erff(x * (float)SQRT1_2)) +
         x * (float)INV_SQRT_2PI * expf(-0.5f * x * x);
}
static inline double gelu_grad_(double x) {
  return 0.5 * (1.0 + erf(x * SQRT1_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x);
}
#define SIGN_F(x) ((x) > 0 ? 1 : (x) < 0 ? -1 : (x))
#define SIGN_I(x) ((int64_t)((x) > 0) - (int64_t)((x) < 0))
#define RELU_F(x) ((x) < 0 ? 0 : (x))

/* n elements of a scalar form, unary op or activation backward; one block
 * of the chunked loop in dsp__cpu_ew. */
static int run_scalar(dsp_opcode op, dsp_dtype dt, const void *px, double s,
                      void *po, int64_t n) {
  switch (dt) {
    case DSP_F32: {
      const float c = (float)s;
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(float, float, x + c); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(float, float, x - c); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(float, float, x * c); break;
        case DSP_OP_DIV_SCALAR: UN_LOOP(float, float, x / c); break;
        case DSP_OP_POW_SCALAR:
          if (c == 2.0f) UN_LOOP(float, float, x * x);
          else UN_LOOP(float, float, powf(x, c));
          break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(float, float, c - x); break;
        case DSP_OP_RDIV_SCALAR: UN_LOOP(float, float, c / x); break;
        default: break;
      }
      break;
    }
    case DSP_F64:
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(double, double, x + s); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(double, double, x - s); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(double, double, x * s); break;
        case DSP_OP_DIV_SCALAR: UN_LOOP(double, double, x / s); break;
        case DSP_OP_POW_SCALAR:
          if (s == 2.0) UN_LOOP(double, double, x * x);
          else UN_LOOP(double, double, pow(x, s));
          break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(double, double, s - x); break;
        case DSP_OP_RDIV_SCALAR: UN_LOOP(double, double, s / x); break;
        default: break;
      }
      break;
    case DSP_I64: {
      const int64_t c = (int64_t)s; /* infer checked it is an exact int64 */
      switch (op) {
        case DSP_OP_ADD_SCALAR: UN_LOOP(int64_t, int64_t, I64_ADD(x, c)); break;
        case DSP_OP_SUB_SCALAR: UN_LOOP(int64_t, int64_t, I64_SUB(x, c)); break;
        case DSP_OP_MUL_SCALAR: UN_LOOP(int64_t, int64_t, I64_MUL(x, c)); break;
        case DSP_OP_RSUB_SCALAR: UN_LOOP(int64_t, int64_t, I64_SUB(c, x)); break;
        default: break;
      }
      break;
    }
    default: break;
  }
  return 0;
}

static int run_unary(dsp_opcode op, dsp_dtype dt, const void *px, void *po,
                     int64_t n) {
  switch (dt) {
    case DSP_F32:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(float, float, -x); break;
        case DSP_OP_EXP: UN_LOOP(float, float, expf(x)); break;
        case DSP_OP_LOG: UN_LOOP(float, float, logf(x)); break;
        case DSP_OP_SQRT: UN_LOOP(float, float, sqrtf(x)); break;
        case DSP_OP_ABS: UN_LOOP(float, float, fabsf(x)); break;
        case DSP_OP_SIGN: UN_LOOP(float, float, SIGN_F(x)); break;
        case DSP_OP_RELU: UN_LOOP(float, float, RELU_F(x)); break;
        case DSP_OP_SIGMOID: UN_LOOP(float, float, sigmoidf_(x)); break;
        case DSP_OP_TANH: UN_LOOP(float, float, tanhf(x)); break;
        case DSP_OP_GELU: UN_LOOP(float, float, geluf_(x)); break;
        default: break;
      }
      break;
    case DSP_F64:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(double, double, -x); break;
        case DSP_OP_EXP: UN_LOOP(double, double, exp(x)); break;
        case DSP_OP_LOG: UN_LOOP(double, double, log(x)); break;
        case DSP_OP_SQRT: UN_LOOP(double, double, sqrt(x)); break;
        case DSP_OP_ABS: UN_LOOP(double, double, fabs(x)); break;
        case DSP_OP_SIGN: UN_LOOP(double, double, SIGN_F(x)); break;
        case DSP_OP_RELU: UN_LOOP(double, double, RELU_F(x)); break;
        case DSP_OP_SIGMOID: UN_LOOP(double, double, sigmoid_(x)); break;
        case DSP_OP_TANH: UN_LOOP(double, double, tanh(x)); break;
        case DSP_OP_GELU: UN_LOOP(double, double, gelu_(x)); break;
        default: break;
      }
      break;
    case DSP_I64:
      switch (op) {
        case DSP_OP_NEG: UN_LOOP(int64_t, int64_t, I64_SUB(0, x)); break;
        case DSP_OP_ABS: UN_LOOP(int64_t, int64_t, x < 0 ? I64_SUB(0, x) : x); break;
        case DSP_OP_SIGN: UN_LOOP(int64_t, int64_t, SIGN_I(x)); break;
        case DSP_OP_RELU: UN_LOOP(int64_t, int64_t, x < 0 ? 0 : x); break;
        default: break;
      }
      break;
    default: break;
  }
  return 0;
}

/* (grad, x) -> grad * f'(x); shapes are equal (checked by infer). */
static int run_act_backward(dsp_opcode op, dsp_dtype dt, const void *pg,
                            const void *px, void *po, int64_t n) {
#define ACT_BW(T, EXPR)                                                      \
  do {                                                                       \
    const T *restrict G_ = pg, *restrict X_ = px;                            \
    T *restrict O_ = po;                                                     \
    for (int64_t i = 0; i < n; i++) {                                        \
      T gv = G_[i], x = X_[i];                                               \
      O_[i] = (EXPR);                                                        \
    }                                                                        \
  } while (0)
  int relu = op == DSP_OP_RELU_BACKWARD;
  switch (dt) {
    case DSP_F32:
      if (relu) ACT_BW(float, x > 0 ? gv : 0.0f);
      else ACT_BW(float, gv * gelu_gradf_(x));
      break;
    case DSP_F64:
      if (relu) ACT_BW(double, x > 0 ? gv : 0.0);
      else ACT_BW(double, gv * gelu_grad_(x));
      break;
    case DSP_I64:
      ACT_BW(int64_t, x > 0 ? gv : 0);
      break;
    default: break;
  }
#undef ACT_BW
  return 0;
}

int dsp__cpu_ew(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
                const dsp_attrs *a, dsp_tensor *out) {
  if (is_arith(op) || is_cmp(op)) return run_binary(ctx, op, in[0], in[1], out);
  if (op == DSP_OP_WHERE) return run_where(ctx, in, out);
  /* the rest map element i to element i: blocks of DSP_POLL_WORK
   * elements with a look at the cancel flag before each */
  const dsp_dtype dt = in[0]->meta.dtype;
  const size_t es = dsp_dtype_size(dt);
  const char *p0 = dsp_tensor_data(in[0]);
  const char *p1 = n_in > 1 ? dsp_tensor_data(in[1]) : NULL;
  char *po = dsp_tensor_data(out);
  const int64_t n = out->numel;
  for (int64_t i0 = 0; i0 < n; i0 += DSP_POLL_WORK) {
    if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
    int64_t nb = n - i0 < DSP_POLL_WORK ? n - i0 : DSP_POLL_WORK;
    size_t off = (size_t)i0 * es;
    if (is_scalar(op))
      run_scalar(op, dt, p0 + off, a->floats[0], po + off, nb);
    else if (op == DSP_OP_RELU_BACKWARD || op == DSP_OP_GELU_BACKWARD)
      run_act_backward(op, dt, p0 + off, p1 + off, po + off, nb);
    else
      run_unary(op, dt, p0 + off, po + off, nb);
  }
  return 0;
}
