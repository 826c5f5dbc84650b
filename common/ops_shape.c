/* shape family, shape inference: reshape, permute, transpose, slice, cat, stack,
 * broadcast_to, index_select, cast, and the backward helpers slice_backward
 * and index_select_backward.
 *
 * All of these move bytes without arithmetic (except cast and the
 * scatter-add of index_select_backward), so they work on every dtype
 * (index_select_backward: not bool). CPU kernels: common/cpu/shape.c; they
 * re-derive their parameters from the attributes with the same helpers
 * (dsp__slice_params, dsp__perm_params) inference uses. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

static int want_ints(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n) {
  if (a->n_ints != n || a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d int and 0 float attributes, got %d and %d",
                      opname(op), n, a->n_ints, a->n_floats);
  return 0;
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
int dsp__slice_params(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
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
int dsp__perm_params(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
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
      if ((rc = dsp__perm_params(ctx, op, a, x->ndim, perm)) < 0) return rc;
      o = *x;
      for (int d = 0; d < x->ndim; d++) o.shape[d] = x->shape[perm[d]];
      break;
    }
    case DSP_OP_SLICE: {
      int64_t s0, len;
      if ((rc = want_ints(ctx, op, a, 4)) < 0) return rc;
      if ((rc = dsp__slice_params(ctx, op, x, a->ints, &dim, &s0, &len)) < 0) return rc;
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
      if ((rc = dsp__slice_params(ctx, op, &o, a->ints, &dim, &s0, &len)) < 0) return rc;
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
