/* The scalar math of the elementwise ops, written once for the CPU loops
 * (common/cpu/ew.c) and the CUDA kernels (common/cuda/kernels.cu).
 *
 * Under nvcc every function here is __host__ __device__ (DSP_HD); under
 * gcc it is a plain static inline C function, which the CPU loops inline
 * into their per-op loops exactly like the expressions they replace, so
 * the CPU's results keep their bits: f32 math stays in float with the
 * float libm functions (expf, logf, powf, erff, ...), f64 in double with
 * the double ones, and -std=c11 keeps gcc from contracting a * b + c into
 * a fused multiply-add. tests/test_cuda_host.c checks the op-switch forms
 * (dsp__sm_bin_f32, ...) the kernels call against the CPU kernels on the
 * host.
 *
 * Semantics: i64 arithmetic wraps mod 2^64 and i64 division truncates
 * (INT64_MIN / -1 wraps; a zero divisor is refused by the caller before a
 * loop or kernel runs and gives 0 here, never a trap); maximum/minimum
 * propagate a NaN of x first, then of y; relu and sign keep a NaN (and
 * sign keeps -0); sigmoid never overflows on either side. */
#ifndef DSP_SCALAR_MATH_H
#define DSP_SCALAR_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "dsp.h"
#ifdef __cplusplus
}
#endif

#ifndef DSP_HD
#ifdef __CUDACC__
#define DSP_HD static inline __host__ __device__
#else
#define DSP_HD static inline
#endif
#endif

#define DSP__SM_SQRT1_2 0.70710678118654752440
#define DSP__SM_INV_SQRT_2PI 0.39894228040143267794
#define DSP__SM_SQRT_2_PI 0.79788456080286535588 /* sqrt(2 / pi) */
#define DSP__SM_GELU_K 0.044715

/* ------------------------------------------------------------------ */
/* one function per op and dtype (what the CPU loops inline)           */

DSP_HD int64_t dsp__sm_add_i64(int64_t x, int64_t y) {
  return (int64_t)((uint64_t)x + (uint64_t)y);
}
DSP_HD int64_t dsp__sm_sub_i64(int64_t x, int64_t y) {
  return (int64_t)((uint64_t)x - (uint64_t)y);
}
DSP_HD int64_t dsp__sm_mul_i64(int64_t x, int64_t y) {
  return (int64_t)((uint64_t)x * (uint64_t)y);
}
DSP_HD int64_t dsp__sm_div_i64(int64_t x, int64_t y) {
  return y == 0 ? 0 : y == -1 ? dsp__sm_sub_i64(0, x) : x / y;
}
DSP_HD int64_t dsp__sm_max_i64(int64_t x, int64_t y) { return x > y ? x : y; }
DSP_HD int64_t dsp__sm_min_i64(int64_t x, int64_t y) { return x < y ? x : y; }
DSP_HD int64_t dsp__sm_neg_i64(int64_t x) { return dsp__sm_sub_i64(0, x); }
DSP_HD int64_t dsp__sm_abs_i64(int64_t x) {
  return x < 0 ? dsp__sm_sub_i64(0, x) : x;
}
DSP_HD int64_t dsp__sm_sign_i64(int64_t x) {
  return (int64_t)(x > 0) - (int64_t)(x < 0);
}
DSP_HD int64_t dsp__sm_relu_i64(int64_t x) { return x < 0 ? 0 : x; }
DSP_HD int64_t dsp__sm_relu_bw_i64(int64_t g, int64_t x) {
  return x > 0 ? g : 0;
}
DSP_HD int64_t dsp__sm_clamp_i64(int64_t x, int64_t lo, int64_t hi) {
  return dsp__sm_min_i64(dsp__sm_max_i64(x, lo), hi);
}

/* The float functions, once per float type: T the type, S its suffix,
 * L the libm suffix (f for float, none for double). */
#define DSP__SM_FLOAT(T, S, L)                                               \
  DSP_HD T dsp__sm_add_##S(T x, T y) { return x + y; }                       \
  DSP_HD T dsp__sm_sub_##S(T x, T y) { return x - y; }                       \
  DSP_HD T dsp__sm_mul_##S(T x, T y) { return x * y; }                       \
  DSP_HD T dsp__sm_div_##S(T x, T y) { return x / y; }                       \
  DSP_HD T dsp__sm_max_##S(T x, T y) { return (x > y || x != x) ? x : y; }   \
  DSP_HD T dsp__sm_min_##S(T x, T y) { return (x < y || x != x) ? x : y; }   \
  /* pow with s == 2 is x*x (exact, and what a square is everywhere) */     \
  DSP_HD T dsp__sm_pow_##S(T x, T c) {                                       \
    return c == (T)2 ? x * x : pow##L(x, c);                                 \
  }                                                                          \
  DSP_HD T dsp__sm_sign_##S(T x) {                                           \
    return x > 0 ? (T)1 : x < 0 ? (T)-1 : x;                                 \
  }                                                                          \
  DSP_HD T dsp__sm_relu_##S(T x) { return x < 0 ? (T)0 : x; }                \
  DSP_HD T dsp__sm_sigmoid_##S(T x) {                                        \
    if (x >= 0) return (T)1 / ((T)1 + exp##L(-x));                           \
    T e = exp##L(x);                                                         \
    return e / ((T)1 + e);                                                   \
  }                                                                          \
  DSP_HD T dsp__sm_gelu_##S(T x) {                                           \
    return (T)0.5 * x * ((T)1 + erf##L(x * (T)DSP__SM_SQRT1_2));             \
  }                                                                          \
  /* d gelu / dx = Phi(x) + x phi(x) */                                     \
  DSP_HD T dsp__sm_gelu_grad_##S(T x) {                                      \
    return (T)0.5 * ((T)1 + erf##L(x * (T)DSP__SM_SQRT1_2)) +                \
           x * (T)DSP__SM_INV_SQRT_2PI * exp##L((T)-0.5 * x * x);            \
  }                                                                          \
  DSP_HD T dsp__sm_relu_bw_##S(T g, T x) { return x > 0 ? g : (T)0; }        \
  DSP_HD T dsp__sm_gelu_bw_##S(T g, T x) { return g * dsp__sm_gelu_grad_##S(x); } \
  DSP_HD T dsp__sm_exp_##S(T x) { return exp##L(x); }                          \
  DSP_HD T dsp__sm_log_##S(T x) { return log##L(x); }                          \
  DSP_HD T dsp__sm_sqrt_##S(T x) { return sqrt##L(x); }                        \
  DSP_HD T dsp__sm_tanh_##S(T x) { return tanh##L(x); }                        \
  /* x sigmoid(x), through the sigmoid above: no e^-x = inf on the way */  \
  DSP_HD T dsp__sm_silu_##S(T x) { return x * dsp__sm_sigmoid_##S(x); }     \
  /* PyTorch's forms (beta 1, threshold 20): above 20, log1p(e^x) is x to  \
   * within f64's rounding, and e^x would soon overflow */                 \
  DSP_HD T dsp__sm_softplus_##S(T x) {                                       \
    return x > (T)20 ? x : log1p##L(exp##L(x));                              \
  }                                                                          \
  DSP_HD T dsp__sm_softplus_bw_##S(T g, T x) {                               \
    if (x > (T)20) return g;                                                 \
    T z = exp##L(x);                                                         \
    return g * z / (z + (T)1);                                               \
  }                                                                          \
  /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as PyTorch's         \
   * approximate='tanh' */                                                  \
  DSP_HD T dsp__sm_gelu_tanh_##S(T x) {                                      \
    T inner = (T)DSP__SM_SQRT_2_PI * (x + (T)DSP__SM_GELU_K * x * x * x);    \
    return (T)0.5 * x * ((T)1 + tanh##L(inner));                             \
  }                                                                          \
  DSP_HD T dsp__sm_gelu_tanh_bw_##S(T g, T x) {                              \
    T x2 = x * x;                                                            \
    T th = tanh##L((T)DSP__SM_SQRT_2_PI * (x + (T)DSP__SM_GELU_K * x2 * x)); \
    T left = (T)0.5 * ((T)1 + th);                                           \
    T right = (T)0.5 * x * ((T)1 - th * th) * (T)DSP__SM_SQRT_2_PI *         \
              ((T)1 + (T)3 * (T)DSP__SM_GELU_K * x2);                        \
    return g * (left + right);                                               \
  }                                                                          \
  /* min(max(x, lo), hi) with NaN-first max/min: a NaN x stays NaN, and    \
   * lo > hi gives hi everywhere (PyTorch's clamp) */                       \
  DSP_HD T dsp__sm_clamp_##S(T x, T lo, T hi) {                              \
    return dsp__sm_min_##S(dsp__sm_max_##S(x, lo), hi);                      \
  }
DSP__SM_FLOAT(float, f32, f)
DSP__SM_FLOAT(double, f64, )
#undef DSP__SM_FLOAT

/* The float-only unary ops, a row each: X(OP, f), where dsp__sm_f_f32 and
 * dsp__sm_f_f64 above compute it. Everything that knows such an op takes
 * it from here: the CPU loops (common/cpu/ew.c), the CUDA kernels (the op
 * switch below), the CPU's and the CUDA backend's op x dtype tables (f32
 * and f64: both run every row) and dsp_op_infer's dtype check
 * (common/ops_ew.c). A new one is its row of DSP_OP_MAP, a row here and
 * its function above; its gradient rule is in common/autodiff_rules.c. */
#define DSP_SM_FLOAT_UNARY(X)                                                \
  X(EXP, exp)                                                                \
  X(LOG, log)                                                                \
  X(SQRT, sqrt)                                                              \
  X(SIGMOID, sigmoid)                                                        \
  X(TANH, tanh)                                                              \
  X(GELU, gelu)                                                              \
  X(SILU, silu)                                                              \
  X(SOFTPLUS, softplus)                                                      \
  X(GELU_TANH, gelu_tanh)
#define DSP__SM_ROW_COUNT_(OP, f) +1
#define DSP_SM_N_FLOAT_UNARY (0 DSP_SM_FLOAT_UNARY(DSP__SM_ROW_COUNT_))

/* ------------------------------------------------------------------ */
/* op-switch forms (what a CUDA kernel calls per element)              */

/* add..minimum */
#define DSP__SM_BIN_BODY(S)                                                  \
  switch (op) {                                                              \
    case DSP_OP_ADD: return dsp__sm_add_##S(x, y);                           \
    case DSP_OP_SUB: return dsp__sm_sub_##S(x, y);                           \
    case DSP_OP_MUL: return dsp__sm_mul_##S(x, y);                           \
    case DSP_OP_DIV: return dsp__sm_div_##S(x, y);                           \
    case DSP_OP_MAXIMUM: return dsp__sm_max_##S(x, y);                       \
    case DSP_OP_MINIMUM: return dsp__sm_min_##S(x, y);                       \
    default: return 0;                                                       \
  }
DSP_HD float dsp__sm_bin_f32(int op, float x, float y) { DSP__SM_BIN_BODY(f32) }
DSP_HD double dsp__sm_bin_f64(int op, double x, double y) {
  DSP__SM_BIN_BODY(f64)
}
DSP_HD int64_t dsp__sm_bin_i64(int op, int64_t x, int64_t y) {
  DSP__SM_BIN_BODY(i64)
}
#undef DSP__SM_BIN_BODY

/* eq..ge as 0/1; one body for every dtype */
#define DSP__SM_CMP_BODY                                                     \
  switch (op) {                                                              \
    case DSP_OP_EQ: return x == y;                                           \
    case DSP_OP_NE: return x != y;                                           \
    case DSP_OP_LT: return x < y;                                            \
    case DSP_OP_LE: return x <= y;                                           \
    case DSP_OP_GT: return x > y;                                            \
    case DSP_OP_GE: return x >= y;                                           \
    default: return 0;                                                       \
  }
DSP_HD uint8_t dsp__sm_cmp_f32(int op, float x, float y) { DSP__SM_CMP_BODY }
DSP_HD uint8_t dsp__sm_cmp_f64(int op, double x, double y) { DSP__SM_CMP_BODY }
DSP_HD uint8_t dsp__sm_cmp_i64(int op, int64_t x, int64_t y) { DSP__SM_CMP_BODY }
DSP_HD uint8_t dsp__sm_cmp_u8(int op, uint8_t x, uint8_t y) { DSP__SM_CMP_BODY }
#undef DSP__SM_CMP_BODY

/* scalar forms x op c (c already in the tensor's type) */
#define DSP__SM_SCALAR_BODY(S)                                               \
  switch (op) {                                                              \
    case DSP_OP_ADD_SCALAR: return dsp__sm_add_##S(x, c);                    \
    case DSP_OP_SUB_SCALAR: return dsp__sm_sub_##S(x, c);                    \
    case DSP_OP_MUL_SCALAR: return dsp__sm_mul_##S(x, c);                    \
    case DSP_OP_DIV_SCALAR: return dsp__sm_div_##S(x, c);                    \
    case DSP_OP_POW_SCALAR: return dsp__sm_pow_##S(x, c);                    \
    case DSP_OP_RSUB_SCALAR: return dsp__sm_sub_##S(c, x);                   \
    case DSP_OP_RDIV_SCALAR: return dsp__sm_div_##S(c, x);                   \
    default: return 0;                                                       \
  }
DSP_HD float dsp__sm_scalar_f32(int op, float x, float c) {
  DSP__SM_SCALAR_BODY(f32)
}
DSP_HD double dsp__sm_scalar_f64(int op, double x, double c) {
  DSP__SM_SCALAR_BODY(f64)
}
#undef DSP__SM_SCALAR_BODY
/* i64 has add, sub, mul and rsub only */
DSP_HD int64_t dsp__sm_scalar_i64(int op, int64_t x, int64_t c) {
  switch (op) {
    case DSP_OP_ADD_SCALAR: return dsp__sm_add_i64(x, c);
    case DSP_OP_SUB_SCALAR: return dsp__sm_sub_i64(x, c);
    case DSP_OP_MUL_SCALAR: return dsp__sm_mul_i64(x, c);
    case DSP_OP_RSUB_SCALAR: return dsp__sm_sub_i64(c, x);
    default: return 0;
  }
}

/* unary ops */
#define DSP__SM_UNARY_BODY(S, L)                                             \
  switch (op) {                                                              \
    case DSP_OP_NEG: return -x;                                              \
    case DSP_OP_ABS: return fabs##L(x);                                      \
    case DSP_OP_SIGN: return dsp__sm_sign_##S(x);                            \
    case DSP_OP_RELU: return dsp__sm_relu_##S(x);                            \
    DSP_SM_FLOAT_UNARY(DSP__SM_UNARY_CASE_##S)                               \
    default: return 0;                                                       \
  }
#define DSP__SM_UNARY_CASE_f32(OP, f)                                        \
  case DSP_OP_##OP: return dsp__sm_##f##_f32(x);
#define DSP__SM_UNARY_CASE_f64(OP, f)                                        \
  case DSP_OP_##OP: return dsp__sm_##f##_f64(x);
DSP_HD float dsp__sm_unary_f32(int op, float x) { DSP__SM_UNARY_BODY(f32, f) }
DSP_HD double dsp__sm_unary_f64(int op, double x) { DSP__SM_UNARY_BODY(f64, ) }
#undef DSP__SM_UNARY_BODY
#undef DSP__SM_UNARY_CASE_f32
#undef DSP__SM_UNARY_CASE_f64
/* i64 has neg, abs, sign and relu */
DSP_HD int64_t dsp__sm_unary_i64(int op, int64_t x) {
  switch (op) {
    case DSP_OP_NEG: return dsp__sm_neg_i64(x);
    case DSP_OP_ABS: return dsp__sm_abs_i64(x);
    case DSP_OP_SIGN: return dsp__sm_sign_i64(x);
    case DSP_OP_RELU: return dsp__sm_relu_i64(x);
    default: return 0;
  }
}

/* The activation backward ops (grad, x) -> grad * f'(x); i64 has
 * relu_backward only. */
DSP_HD int dsp__sm_is_act_bw(int op) {
  return op == DSP_OP_RELU_BACKWARD || op == DSP_OP_GELU_BACKWARD ||
         op == DSP_OP_SOFTPLUS_BACKWARD || op == DSP_OP_GELU_TANH_BACKWARD;
}
#define DSP__SM_ACT_BW_BODY(S)                                               \
  switch (op) {                                                              \
    case DSP_OP_RELU_BACKWARD: return dsp__sm_relu_bw_##S(g, x);             \
    case DSP_OP_GELU_BACKWARD: return dsp__sm_gelu_bw_##S(g, x);             \
    case DSP_OP_SOFTPLUS_BACKWARD: return dsp__sm_softplus_bw_##S(g, x);     \
    case DSP_OP_GELU_TANH_BACKWARD: return dsp__sm_gelu_tanh_bw_##S(g, x);   \
    default: return 0;                                                       \
  }
DSP_HD float dsp__sm_act_bw_f32(int op, float g, float x) {
  DSP__SM_ACT_BW_BODY(f32)
}
DSP_HD double dsp__sm_act_bw_f64(int op, double g, double x) {
  DSP__SM_ACT_BW_BODY(f64)
}
#undef DSP__SM_ACT_BW_BODY
DSP_HD int64_t dsp__sm_act_bw_i64(int op, int64_t g, int64_t x) {
  (void)op;
  return dsp__sm_relu_bw_i64(g, x);
}

#endif
