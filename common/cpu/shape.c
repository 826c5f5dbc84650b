/* shape family, CPU kernels (inference: common/ops_shape.c).
 *
 * The output arrives allocated and zeroed by dsp_op; reshape copies rather
 * than aliasing for that reason. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "half.h"
#include "kern_iter.h"
#include "ops_plan.h"

#define opname dsp__opname

_Static_assert(DSP__OPS_IN_FAMILY(SHAPE) == 11,
               "a new shape op needs a case in dsp__cpu_shape and a row in "
               "the CPU support table (common/cpu/backend.c)");

static int64_t prod(const int64_t *s, int from, int to) {
  int64_t p = 1;
  for (int i = from; i < to; i++) p *= s[i];
  return p;
}

/* Copies out->numel elements of size es from src, visiting src through a
 * strided iterator in output order; 1 when ctx was cancelled between rows
 * (dst partly written), -1 for an element size it has no loop for, else
 * 0. */
static int strided_copy(dsp_ctx *ctx, const dsp_iter *it, const char *src,
                        char *dst, size_t es) {
  int64_t idx[DSP_MAX_DIMS] = {0}, off[3] = {0, 0, 0}, pw = 0;
  int stop = 0;
  const int64_t s = it->st[0][it->nd - 1], inner = it->inner;
#define SC_T(T)                                                              \
  do {                                                                       \
    const T *S_ = (const T *)src;                                            \
    T *D_ = (T *)dst;                                                        \
    for (int64_t r = 0; r < it->rows && !stop; r++) {                        \
      const T *p = S_ + off[0];                                              \
      T *q = D_ + r * inner;                                                 \
      if (s == 1) memcpy(q, p, (size_t)inner * sizeof(T));                   \
      else if (s == 0) for (int64_t j = 0; j < inner; j++) q[j] = p[0];      \
      else for (int64_t j = 0; j < inner; j++) q[j] = p[j * s];              \
      dsp__iter_step(it, idx, off);                                          \
      stop = dsp__poll(ctx, &pw, inner);                                     \
    }                                                                        \
  } while (0)
  switch (es) {
    case 1: SC_T(uint8_t); break;
    case 2: SC_T(uint16_t); break;
    case 4: SC_T(uint32_t); break;
    case 8: SC_T(uint64_t); break;
    default: return -1;
  }
#undef SC_T
  return stop;
}

/* float -> i64 without undefined behaviour: truncates toward zero,
 * saturates out-of-range values, NaN gives 0. */
static inline int64_t f2i64(double v) {
  if (v != v) return 0;
  if (v >= 0x1p63) return INT64_MAX;
  if (v < -0x1p63) return INT64_MIN;
  return (int64_t)v;
}

/* cast to or from a half dtype (common/half.h), PyTorch's rules: every
 * narrowing to half rounds once from the source value (f64 and i64
 * included, never through f32), half -> i64 truncates toward zero as
 * f32 -> i64 does, anything -> bool is v != 0 (NaN is true), bool -> half
 * is 0 or 1. Half sources go through f32 (exact) in blocks. */
static int cast_half(const void *px, dsp_dtype from, void *po, dsp_dtype to,
                     int64_t n) {
  const int f16 = (dsp_dtype_is_half(to) ? to : from) == DSP_F16;
  if (!dsp_dtype_is_half(from)) { /* to a half dtype */
    uint16_t *o = po;
    switch (from) {
      case DSP_F32: dsp_f32_to_half_n(to, px, po, (size_t)n); break;
      case DSP_F64: {
        const double *v = px;
        for (int64_t i = 0; i < n; i++) o[i] = f16 ? dsp_f64_to_f16(v[i]) : dsp_f64_to_bf16(v[i]);
        break;
      }
      case DSP_I64: {
        const int64_t *v = px;
        for (int64_t i = 0; i < n; i++) o[i] = f16 ? dsp_i64_to_f16(v[i]) : dsp_i64_to_bf16(v[i]);
        break;
      }
      case DSP_BOOL: {
        const uint8_t *v = px;
        const uint16_t one = f16 ? 0x3c00u : 0x3f80u;
        for (int64_t i = 0; i < n; i++) o[i] = v[i] ? one : 0;
        break;
      }
      default: return -1;
    }
    return 0;
  }
  if (to == DSP_F32) {
    dsp_half_to_f32_n(from, px, po, (size_t)n);
    return 0;
  }
  if (!dsp_dtype_valid((int)to)) return -1;
  float buf[1024];
  const uint16_t *h = px;
  for (int64_t i0 = 0; i0 < n; i0 += 1024) {
    const size_t k = (size_t)(n - i0 < 1024 ? n - i0 : 1024);
    dsp_half_to_f32_n(from, h + i0, buf, k);
    switch (to) {
      case DSP_F64: for (size_t j = 0; j < k; j++) ((double *)po)[i0 + j] = buf[j]; break;
      case DSP_I64: for (size_t j = 0; j < k; j++) ((int64_t *)po)[i0 + j] = f2i64(buf[j]); break;
      case DSP_BOOL: for (size_t j = 0; j < k; j++) ((uint8_t *)po)[i0 + j] = buf[j] != 0; break;
      default: dsp_f32_to_half_n(to, buf, (uint16_t *)po + i0, k); break; /* the other half */
    }
  }
  return 0;
}

/* 0, or -1 (nothing written) for a dtype pair it has no loop for. */
static int run_cast(const dsp_tensor *x, dsp_tensor *out) {
  const int64_t n = x->numel;
  const void *px = dsp_tensor_data(x);
  void *po = dsp_tensor_data(out);
  dsp_dtype from = x->meta.dtype, to = out->meta.dtype;
  if (from == to) {
    memcpy(po, px, (size_t)n * dsp_dtype_size(from));
    return 0;
  }
  if (dsp_dtype_is_half(from) || dsp_dtype_is_half(to))
    return cast_half(px, from, po, to, n);
#define CV(TI, TO, EXPR)                                                     \
  do {                                                                       \
    const TI *I_ = px;                                                       \
    TO *O_ = po;                                                             \
    for (int64_t i = 0; i < n; i++) {                                        \
      TI v = I_[i];                                                          \
      O_[i] = (EXPR);                                                        \
    }                                                                        \
  } while (0)
#define CV_FROM(TI)                                                          \
  switch (to) {                                                              \
    case DSP_F32: CV(TI, float, (float)v); break;                            \
    case DSP_F64: CV(TI, double, (double)v); break;                          \
    case DSP_I64: CV(TI, int64_t, (int64_t)v); break;                        \
    case DSP_BOOL: CV(TI, uint8_t, v != 0); break;                           \
    default: return -1;                                                      \
  }
  switch (from) {
    case DSP_F32:
      if (to == DSP_I64) CV(float, int64_t, f2i64(v));
      else CV_FROM(float)
      break;
    case DSP_F64:
      if (to == DSP_I64) CV(double, int64_t, f2i64(v));
      else CV_FROM(double)
      break;
    case DSP_I64: CV_FROM(int64_t) break;
    case DSP_BOOL: CV_FROM(uint8_t) break;
    default: return -1;
  }
#undef CV_FROM
#undef CV
  return 0;
}

/* Fails with DISPATCH_EINDEX naming the first index outside [0, size). */
static int check_index_values(dsp_ctx *ctx, dsp_opcode op,
                              const dsp_tensor *ix, int dim, int64_t size) {
  const int64_t *v = dsp_tensor_data(ix);
  for (int64_t k = 0; k < ix->numel; k++)
    if (v[k] < 0 || v[k] >= size)
      return dsp_seterr(ctx, DISPATCH_EINDEX,
                        "%s: index %lld (position %lld) out of range for dim "
                        "%d of size %lld",
                        opname(op), (long long)v[k], (long long)k, dim,
                        (long long)size);
  return 0;
}

/* Adds grad rows into out at their indices; 1 when ctx was cancelled
 * between rows, -1 (nothing written) for a dtype without a loop, else 0. */
static int scatter_add(dsp_ctx *ctx, const dsp_tensor *g, const int64_t *ix,
                       int dim, dsp_tensor *out) {
  int stop = 0;
  int64_t pw = 0;
  const int64_t outer = prod(g->meta.shape, 0, dim);
  const int64_t inner = prod(g->meta.shape, dim + 1, g->meta.ndim);
  const int64_t L = g->meta.shape[dim], S = out->meta.shape[dim];
#define SA_T(T, ADD)                                                         \
  do {                                                                       \
    const T *G_ = dsp_tensor_data(g);                                        \
    T *O_ = dsp_tensor_data(out);                                            \
    for (int64_t o = 0; o < outer && !stop; o++)                             \
      for (int64_t k = 0; k < L && !stop; k++) {                             \
        const T *src = G_ + (o * L + k) * inner;                             \
        T *dst = O_ + (o * S + ix[k]) * inner;                               \
        for (int64_t j = 0; j < inner; j++) dst[j] = ADD(dst[j], src[j]);    \
        stop = dsp__poll(ctx, &pw, inner + 1);                               \
      }                                                                      \
  } while (0)
#define FADD_(x, y) ((x) + (y))
#define IADD_(x, y) ((int64_t)((uint64_t)(x) + (uint64_t)(y)))
  switch (g->meta.dtype) {
    case DSP_F32: SA_T(float, FADD_); break;
    case DSP_F64: SA_T(double, FADD_); break;
    case DSP_I64: SA_T(int64_t, IADD_); break;
    default: return -1;
  }
#undef SA_T
  return stop;
}

/* The result of a helper that returns 1 when cancelled and -1 when it has
 * no loop for the dtype. */
static int copy_result(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                       int n_in, dsp_tensor *out, int r) {
  if (r < 0) return dsp__no_kernel(ctx, op, in, n_in, out);
  return r ? dsp__cancelled_err(ctx, op) : 0;
}

int dsp__cpu_shape(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
                   const dsp_attrs *a, dsp_tensor *out) {
  const dsp_tensor *x = in[0];
  const size_t es = dsp_dtype_size(x->meta.dtype);
  const char *px = dsp_tensor_data(x);
  char *po = dsp_tensor_data(out);
  int rc, dim;
  switch (op) {
    case DSP_OP_RESHAPE:
      if (out->numel) memcpy(po, px, (size_t)out->numel * es);
      return 0;
    case DSP_OP_PERMUTE:
    case DSP_OP_TRANSPOSE:
    case DSP_OP_BROADCAST_TO: {
      if (out->numel == 0) return 0;
      int64_t cs[DSP_MAX_DIMS], st[1][DSP_MAX_DIMS];
      dsp__contig_strides(&x->meta, cs);
      if (op == DSP_OP_BROADCAST_TO) {
        const dsp_meta *ms[1] = {&x->meta};
        dsp_iter it;
        dsp__iter_bcast(&it, &out->meta, ms, 1);
        return copy_result(ctx, op, in, n_in, out,
                           strided_copy(ctx, &it, px, po, es));
      }
      int perm[DSP_MAX_DIMS];
      if ((rc = dsp__perm_params(ctx, op, a, x->meta.ndim, perm)) < 0) return rc;
      for (int d = 0; d < x->meta.ndim; d++) st[0][d] = cs[perm[d]];
      dsp_iter it;
      dsp__iter_strided(&it, out->meta.ndim, out->meta.shape, st, 1);
      return copy_result(ctx, op, in, n_in, out,
                         strided_copy(ctx, &it, px, po, es));
    }
    case DSP_OP_SLICE:
    case DSP_OP_SLICE_BACKWARD: {
      /* big: the un-sliced tensor (x for slice, out for the backward) */
      int bw = op == DSP_OP_SLICE_BACKWARD;
      const dsp_meta *big = bw ? &out->meta : &x->meta;
      int64_t s0, len;
      if ((rc = dsp__slice_params(ctx, op, big, a->ints, &dim, &s0, &len)) < 0) return rc;
      const int64_t step = a->ints[3], S = big->shape[dim];
      const int64_t outer = prod(big->shape, 0, dim);
      const size_t blk = (size_t)prod(big->shape, dim + 1, big->ndim) * es;
      if (blk == 0) return 0;
      int64_t pw = 0;
      for (int64_t o = 0; o < outer; o++)
        for (int64_t k = 0; k < len; k++) {
          if (dsp__poll(ctx, &pw, (int64_t)(blk / es) + 1))
            return dsp__cancelled_err(ctx, op);
          char *small = (bw ? (char *)px : po) + (size_t)(o * len + k) * blk;
          char *large = (bw ? po : (char *)px) + (size_t)(o * S + s0 + k * step) * blk;
          if (bw) memcpy(large, small, blk);
          else memcpy(small, large, blk);
        }
      return 0;
    }
    case DSP_OP_CAT:
    case DSP_OP_STACK: {
      int stack = op == DSP_OP_STACK;
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim + stack,
                             &dim)) < 0)
        return rc;
      const int64_t outer = prod(x->meta.shape, 0, dim);
      const size_t after = (size_t)prod(x->meta.shape, dim + !stack, x->meta.ndim) * es;
      size_t pos = 0;
      int64_t pw = 0;
      for (int64_t o = 0; o < outer; o++)
        for (int i = 0; i < n_in; i++) {
          size_t chunk = after * (size_t)(stack ? 1 : in[i]->meta.shape[dim]);
          if (dsp__poll(ctx, &pw, (int64_t)(chunk / es) + 1))
            return dsp__cancelled_err(ctx, op);
          if (chunk) memcpy(po + pos, (const char *)dsp_tensor_data(in[i]) + (size_t)o * chunk, chunk);
          pos += chunk;
        }
      return 0;
    }
    case DSP_OP_INDEX_SELECT: {
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim, &dim)) < 0)
        return rc;
      const int64_t S = x->meta.shape[dim], L = in[1]->numel;
      if ((rc = check_index_values(ctx, op, in[1], dim, S)) < 0) return rc;
      if (out->numel == 0) return 0;
      const int64_t *ix = dsp_tensor_data(in[1]);
      const int64_t outer = prod(x->meta.shape, 0, dim);
      const size_t blk = (size_t)prod(x->meta.shape, dim + 1, x->meta.ndim) * es;
      if (blk == 0) return 0;
      int64_t pw = 0;
      for (int64_t o = 0; o < outer; o++)
        for (int64_t k = 0; k < L; k++) {
          if (dsp__poll(ctx, &pw, (int64_t)(blk / es) + 1))
            return dsp__cancelled_err(ctx, op);
          memcpy(po + (size_t)(o * L + k) * blk, px + (size_t)(o * S + ix[k]) * blk,
                 blk);
        }
      return 0;
    }
    case DSP_OP_CAST:
      return run_cast(x, out) < 0 ? dsp__no_kernel(ctx, op, in, n_in, out) : 0;
    case DSP_OP_INDEX_SELECT_BACKWARD:
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim, &dim)) < 0)
        return rc;
      if ((rc = check_index_values(ctx, op, in[1], dim, a->ints[1])) < 0) return rc;
      if (out->numel == 0) return 0;
      return copy_result(ctx, op, in, n_in, out,
                         scatter_add(ctx, x, dsp_tensor_data(in[1]), dim, out));
    default:
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
}
