/* shape family: reshape, permute, transpose, slice, cat, stack,
 * broadcast_to, index_select, cast, and the backward helpers slice_backward
 * and index_select_backward.
 *
 * All of these move bytes without arithmetic (except cast and the
 * scatter-add of index_select_backward), so they work on every dtype.
 * The output arrives allocated and zeroed by dsp_op; reshape copies rather
 * than aliasing for that reason. Kernels re-derive their parameters from
 * the attributes with the same helpers infer used. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "kern_iter.h"

static const char *opname(dsp_opcode op) { return dsp_op_lookup((int)op)->name; }

static int want_ints(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n) {
  if (a->n_ints != n || a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d int and 0 float attributes, got %d and %d",
                      opname(op), n, a->n_ints, a->n_floats);
  return 0;
}

static int64_t prod(const int64_t *s, int from, int to) {
  int64_t p = 1;
  for (int i = from; i < to; i++) p *= s[i];
  return p;
}

/* Python-style slice of a dim of `size`: clamps start/end into [0, size]
 * after adding size to negative ones. step > 0 (checked by the caller). */
static void slice_range(int64_t size, int64_t start, int64_t end,
                        int64_t step, int64_t *s0, int64_t *len) {
  if (start < 0) start = start + size < 0 ? 0 : start + size;
  else if (start > size) start = size;
  if (end < 0) end = end + size < 0 ? 0 : end + size;
  else if (end > size) end = size;
  *s0 = start;
  *len = end > start ? (end - start - 1) / step + 1 : 0;
}

/* Validates {dim, start, end, step} against x and gives the normalised
 * dim, first index and length. */
static int slice_params(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
                        const int64_t *ints, int *dim, int64_t *s0,
                        int64_t *len) {
  int rc = dsp_norm_dim(ctx, opname(op), ints[0], x->ndim, dim);
  if (rc < 0) return rc;
  if (ints[3] <= 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: step must be > 0, got %lld",
                      opname(op), (long long)ints[3]);
  slice_range(x->shape[*dim], ints[1], ints[2], ints[3], s0, len);
  return 0;
}

static int check_index(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *ix) {
  if (ix->dtype != DSP_I64)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: index must be i64, got %s",
                      opname(op), dsp_dtype_name(ix->dtype));
  if (ix->ndim != 1)
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: index must be 1-D, got rank %d",
                      opname(op), ix->ndim);
  return 0;
}

/* Fills perm[] for permute/transpose of a rank-nd tensor. */
static int perm_params(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                       int nd, int *perm) {
  int seen[DSP_MAX_DIMS] = {0}, rc;
  if (op == DSP_OP_TRANSPOSE) {
    int d0, d1;
    if ((rc = want_ints(ctx, op, a, 2)) < 0) return rc;
    if ((rc = dsp_norm_dim(ctx, "transpose", a->ints[0], nd, &d0)) < 0) return rc;
    if ((rc = dsp_norm_dim(ctx, "transpose", a->ints[1], nd, &d1)) < 0) return rc;
    for (int d = 0; d < nd; d++) perm[d] = d;
    perm[d0] = d1;
    perm[d1] = d0;
    return 0;
  }
  if ((rc = want_ints(ctx, op, a, nd)) < 0) return rc;
  for (int d = 0; d < nd; d++) {
    if ((rc = dsp_norm_dim(ctx, "permute", a->ints[d], nd, &perm[d])) < 0)
      return rc;
    if (seen[perm[d]])
      return dsp_seterr(ctx, DISPATCH_EDIM, "permute: dim %lld repeated",
                        (long long)a->ints[d]);
    seen[perm[d]] = 1;
  }
  return 0;
}

static int infer_reshape(dsp_ctx *ctx, const dsp_meta *x, const dsp_attrs *a,
                         dsp_meta *o) {
  if (a->n_floats != 0 || a->n_ints > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "reshape: takes up to %d ints and no floats, got %d and %d",
                      DSP_MAX_DIMS, a->n_ints, a->n_floats);
  int64_t numel, known = 1;
  int rc = dsp_meta_numel(ctx, x, &numel), infer_at = -1;
  if (rc < 0) return rc;
  o->dtype = x->dtype;
  o->ndim = a->n_ints;
  for (int i = 0; i < a->n_ints; i++) {
    int64_t s = a->ints[i];
    if (s == -1) {
      if (infer_at >= 0)
        return dsp_seterr(ctx, DISPATCH_ESHAPE, "reshape: more than one -1");
      infer_at = i;
      continue;
    }
    if (s < 0)
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "reshape: bad size %lld at %d",
                        (long long)s, i);
    if (dsp_mul_overflow(known, s, &known))
      return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "reshape: size overflows");
    o->shape[i] = s;
  }
  char s1[128];
  if (infer_at >= 0) {
    if (known == 0 || numel % known != 0)
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "reshape: cannot infer -1 for %lld elements of %s",
                        (long long)numel, dsp_shape_str(x, s1, sizeof s1));
    o->shape[infer_at] = numel / known;
    known = numel;
  }
  if (known != numel)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "reshape: %lld elements of %s do not fit %lld",
                      (long long)numel, dsp_shape_str(x, s1, sizeof s1),
                      (long long)known);
  return 0;
}

static int infer_cat_stack(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                           int n_in, const dsp_attrs *a, dsp_meta *o) {
  int rc = want_ints(ctx, op, a, 1), dim;
  if (rc < 0) return rc;
  const dsp_meta *x = &in[0];
  int stack = op == DSP_OP_STACK;
  if (stack && x->ndim + 1 > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EDIM, "stack: rank %d leaves no room",
                      x->ndim);
  if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->ndim + stack, &dim)) < 0)
    return rc;
  int64_t total = 0;
  for (int i = 0; i < n_in; i++) {
    const dsp_meta *y = &in[i];
    char s1[128], s2[128];
    if (y->dtype != x->dtype)
      return dsp_seterr(ctx, DISPATCH_EDTYPE,
                        "%s: input %d has dtype %s, input 0 has %s", opname(op),
                        i, dsp_dtype_name(y->dtype), dsp_dtype_name(x->dtype));
    int ok = y->ndim == x->ndim;
    for (int d = 0; ok && d < x->ndim; d++)
      ok = y->shape[d] == x->shape[d] || (!stack && d == dim);
    if (!ok)
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "%s: input %d has shape %s, input 0 has %s", opname(op),
                        i, dsp_shape_str(y, s1, sizeof s1),
                        dsp_shape_str(x, s2, sizeof s2));
    if (!stack && __builtin_add_overflow(total, y->shape[dim], &total))
      return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "cat: size overflows");
  }
  o->dtype = x->dtype;
  if (stack) {
    o->ndim = x->ndim + 1;
    for (int d = 0, s = 0; d < o->ndim; d++)
      o->shape[d] = d == dim ? n_in : x->shape[s++];
  } else {
    *o = *x;
    o->shape[dim] = total;
  }
  return 0;
}

int dsp__infer_shape(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                     const dsp_attrs *a, dsp_meta *out) {
  const dsp_meta *x = &in[0];
  dsp_meta o;
  memset(&o, 0, sizeof o);
  int rc, dim;
  char s1[128], s2[128];
  switch (op) {
    case DSP_OP_RESHAPE:
      if ((rc = infer_reshape(ctx, x, a, &o)) < 0) return rc;
      break;
    case DSP_OP_PERMUTE:
    case DSP_OP_TRANSPOSE: {
      int perm[DSP_MAX_DIMS];
      if ((rc = perm_params(ctx, op, a, x->ndim, perm)) < 0) return rc;
      o = *x;
      for (int d = 0; d < x->ndim; d++) o.shape[d] = x->shape[perm[d]];
      break;
    }
    case DSP_OP_SLICE: {
      int64_t s0, len;
      if ((rc = want_ints(ctx, op, a, 4)) < 0) return rc;
      if ((rc = slice_params(ctx, op, x, a->ints, &dim, &s0, &len)) < 0) return rc;
      o = *x;
      o.shape[dim] = len;
      break;
    }
    case DSP_OP_CAT:
    case DSP_OP_STACK:
      if ((rc = infer_cat_stack(ctx, op, in, n_in, a, &o)) < 0) return rc;
      break;
    case DSP_OP_BROADCAST_TO:
      if (a->n_floats != 0 || a->n_ints < x->ndim || a->n_ints > DSP_MAX_DIMS)
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "broadcast_to: target rank %d must be in %d..%d "
                          "(and no floats)",
                          a->n_ints, x->ndim, DSP_MAX_DIMS);
      o.dtype = x->dtype;
      o.ndim = a->n_ints;
      for (int d = 0; d < o.ndim; d++) {
        o.shape[d] = a->ints[d];
        if (o.shape[d] < 0)
          return dsp_seterr(ctx, DISPATCH_ESHAPE,
                            "broadcast_to: negative target size %lld",
                            (long long)o.shape[d]);
      }
      for (int d = 0; d < x->ndim; d++) {
        int od = o.ndim - x->ndim + d;
        if (x->shape[d] != 1 && x->shape[d] != o.shape[od])
          return dsp_seterr(ctx, DISPATCH_ESHAPE,
                            "broadcast_to: %s does not broadcast to %s",
                            dsp_shape_str(x, s1, sizeof s1),
                            dsp_shape_str(&o, s2, sizeof s2));
      }
      break;
    case DSP_OP_INDEX_SELECT:
      if ((rc = want_ints(ctx, op, a, 1)) < 0) return rc;
      if ((rc = check_index(ctx, op, &in[1])) < 0) return rc;
      if ((rc = dsp_norm_dim(ctx, "index_select", a->ints[0], x->ndim, &dim)) < 0)
        return rc;
      o = *x;
      o.shape[dim] = in[1].shape[0];
      break;
    case DSP_OP_CAST:
      if ((rc = want_ints(ctx, op, a, 1)) < 0) return rc;
      if (a->ints[0] < 0 || a->ints[0] >= DSP_NDTYPES)
        return dsp_seterr(ctx, DISPATCH_EDTYPE, "cast: invalid target dtype %lld",
                          (long long)a->ints[0]);
      o = *x;
      o.dtype = (dsp_dtype)a->ints[0];
      break;
    case DSP_OP_SLICE_BACKWARD: {
      int r = a->n_ints - 4;
      int64_t s0, len;
      if (a->n_floats != 0 || r < 1 || r > DSP_MAX_DIMS)
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "slice_backward: takes 4 ints plus the input shape "
                          "(rank 1..%d) and no floats, got %d ints and %d floats",
                          DSP_MAX_DIMS, a->n_ints, a->n_floats);
      o.dtype = x->dtype;
      o.ndim = r;
      for (int d = 0; d < r; d++) o.shape[d] = a->ints[4 + d];
      if ((rc = dsp_meta_check(ctx, &o)) < 0) return rc;
      if ((rc = slice_params(ctx, op, &o, a->ints, &dim, &s0, &len)) < 0) return rc;
      dsp_meta want = o;
      want.shape[dim] = len;
      if (!dsp_meta_equal(&want, x))
        return dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "slice_backward: grad shape %s, slice shape %s",
                          dsp_shape_str(x, s1, sizeof s1),
                          dsp_shape_str(&want, s2, sizeof s2));
      break;
    }
    case DSP_OP_INDEX_SELECT_BACKWARD:
      if ((rc = want_ints(ctx, op, a, 2)) < 0) return rc;
      if ((rc = check_index(ctx, op, &in[1])) < 0) return rc;
      if (x->dtype == DSP_BOOL)
        return dsp_seterr(ctx, DISPATCH_EDTYPE,
                          "index_select_backward: dtype bool not supported");
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->ndim, &dim)) < 0)
        return rc;
      if (a->ints[1] < 0)
        return dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "index_select_backward: negative input size %lld",
                          (long long)a->ints[1]);
      if (in[1].shape[0] != x->shape[dim])
        return dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "index_select_backward: %lld indices for grad size "
                          "%lld at dim %d",
                          (long long)in[1].shape[0], (long long)x->shape[dim], dim);
      o = *x;
      o.shape[dim] = a->ints[1];
      break;
    default:
      return dsp_seterr(ctx, DISPATCH_EINTERNAL, "shape: op %d is not a shape op",
                        (int)op);
  }
  *out = o;
  return 0;
}

/* ------------------------------------------------------------------ */
/* kernels                                                             */

/* Copies out->numel elements of size es from src, visiting src through a
 * strided iterator in output order; 1 when ctx was cancelled between rows
 * (dst partly written), else 0. */
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
    case 4: SC_T(uint32_t); break;
    default: SC_T(uint64_t); break;
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

static void run_cast(const dsp_tensor *x, dsp_tensor *out) {
  const int64_t n = x->numel;
  const void *px = dsp_tensor_data(x);
  void *po = dsp_tensor_data(out);
  dsp_dtype from = x->meta.dtype, to = out->meta.dtype;
  if (from == to) {
    memcpy(po, px, (size_t)n * dsp_dtype_size(from));
    return;
  }
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
    default: break;                                                          \
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
    default: break;
  }
#undef CV_FROM
#undef CV
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
 * between rows, else 0. */
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
    default: break;
  }
#undef SA_T
  return stop;
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
        return strided_copy(ctx, &it, px, po, es) ? dsp__cancelled_err(ctx, op)
                                                  : 0;
      }
      int perm[DSP_MAX_DIMS];
      if ((rc = perm_params(ctx, op, a, x->meta.ndim, perm)) < 0) return rc;
      for (int d = 0; d < x->meta.ndim; d++) st[0][d] = cs[perm[d]];
      dsp_iter it;
      dsp__iter_strided(&it, out->meta.ndim, out->meta.shape, st, 1);
      return strided_copy(ctx, &it, px, po, es) ? dsp__cancelled_err(ctx, op)
                                                : 0;
    }
    case DSP_OP_SLICE:
    case DSP_OP_SLICE_BACKWARD: {
      /* big: the un-sliced tensor (x for slice, out for the backward) */
      int bw = op == DSP_OP_SLICE_BACKWARD;
      const dsp_meta *big = bw ? &out->meta : &x->meta;
      int64_t s0, len;
      if ((rc = slice_params(ctx, op, big, a->ints, &dim, &s0, &len)) < 0) return rc;
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
      run_cast(x, out);
      return 0;
    case DSP_OP_INDEX_SELECT_BACKWARD:
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim, &dim)) < 0)
        return rc;
      if ((rc = check_index_values(ctx, op, in[1], dim, a->ints[1])) < 0) return rc;
      if (out->numel == 0) return 0;
      if (scatter_add(ctx, x, dsp_tensor_data(in[1]), dim, out))
        return dsp__cancelled_err(ctx, op);
      return 0;
    default:
      return dsp_seterr(ctx, DISPATCH_EINTERNAL, "shape: op %d is not a shape op",
                        (int)op);
  }
}
