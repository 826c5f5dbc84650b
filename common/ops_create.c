/* create family, shape inference: zeros, ones, full, arange, uniform, normal.
 *
 * Attributes: ints[0] = dtype, then (zeros/ones/full) the shape, or
 * (uniform/normal) the seed (as uint64) and the shape; full's value is
 * floats[0]; arange's floats are {start, end, step}; uniform's floats are
 * {low, high}, normal's {mean, std}.
 *
 * Random values come from the counter-based generator in rng.h: element i
 * of a uniform tensor is low + (high - low) * dsp_rng_uniform01(seed, i)
 * computed in double (then rounded once to f32 for an f32 tensor, and
 * nudged below high if rounding reached it); element i of a normal tensor
 * is mean + std * dsp_rng_normal(seed, i). So a seed gives the same tensor
 * on every machine regardless of how it is computed (CPU kernels:
 * common/cpu/create.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

/* Reads dtype and the shape that starts at ints[shape_at]. */
static int create_meta(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                       int shape_at, int n_floats, dsp_meta *o) {
  const char *name = opname(op);
  if (a->n_ints < shape_at || a->n_ints - shape_at > DSP_MAX_DIMS ||
      a->n_floats != n_floats)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d leading ints, a shape of rank <= %d and %d "
                      "floats, got %d ints and %d floats",
                      name, shape_at, DSP_MAX_DIMS, n_floats, a->n_ints,
                      a->n_floats);
  if (!dsp_dtype_valid((int)(a->ints[0] < 0 || a->ints[0] > 255 ? -1 : a->ints[0])))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: invalid dtype %lld", name,
                      (long long)a->ints[0]);
  memset(o, 0, sizeof *o);
  o->dtype = (dsp_dtype)a->ints[0];
  o->ndim = a->n_ints - shape_at;
  for (int d = 0; d < o->ndim; d++) {
    o->shape[d] = a->ints[shape_at + d];
    if (o->shape[d] < 0)
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: negative size %lld at dim %d",
                        name, (long long)o->shape[d], d);
  }
  /* the same span bound as every other meta, named after the op */
  int rc = dsp_meta_check(ctx, o);
  if (rc < 0) {
    char why[400];
    snprintf(why, sizeof why, "%s", dsp_ctx_errmsg(ctx));
    return dsp_seterr(ctx, rc, "%s: %s", name, why);
  }
  return 0;
}

static int is_i64_value(double v) {
  return isfinite(v) && v == trunc(v) && v >= -0x1p63 && v < 0x1p63;
}

/* arange length: ceil((end - start) / step), at least 0. */
static int arange_len(dsp_ctx *ctx, const dsp_attrs *a, int64_t *len) {
  double s = a->floats[0], e = a->floats[1], st = a->floats[2];
  if (!isfinite(s) || !isfinite(e) || !isfinite(st) || st == 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "arange: start %g, end %g, step %g must be finite with "
                      "step != 0", s, e, st);
  double q = ceil((e - s) / st);
  if (!(q < 0x1p62))
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "arange: %g elements is too many",
                      q);
  *len = q > 0 ? (int64_t)q : 0;
  return 0;
}

int dsp__infer_create(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                      int n_in, const dsp_attrs *a, dsp_meta *out) {
  (void)in, (void)n_in;
  int rc;
  switch (op) {
    case DSP_OP_ZEROS:
    case DSP_OP_ONES:
      return create_meta(ctx, op, a, 1, 0, out);
    case DSP_OP_FULL:
      if ((rc = create_meta(ctx, op, a, 1, 1, out)) < 0) return rc;
      if (out->dtype == DSP_I64 && !is_i64_value(a->floats[0]))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "full: value %g is not an i64 integer", a->floats[0]);
      return 0;
    case DSP_OP_ARANGE: {
      if ((rc = create_meta(ctx, op, a, 1, 3, out)) < 0) return rc;
      if (out->ndim != 0)
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "arange: takes only the dtype int, got %d ints",
                          a->n_ints);
      if (out->dtype == DSP_BOOL)
        return dsp_seterr(ctx, DISPATCH_EDTYPE, "arange: dtype bool not supported");
      int64_t len = 0;
      if ((rc = arange_len(ctx, a, &len)) < 0) return rc;
      if (out->dtype == DSP_I64 &&
          !(is_i64_value(a->floats[0]) && is_i64_value(a->floats[2]) &&
            fabs(a->floats[1]) < 0x1p63))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "arange: i64 needs integer start and step, got %g and %g",
                          a->floats[0], a->floats[2]);
      out->ndim = 1;
      out->shape[0] = len;
      return 0;
    }
    case DSP_OP_UNIFORM:
    case DSP_OP_NORMAL: {
      if ((rc = create_meta(ctx, op, a, 2, 2, out)) < 0) return rc;
      if (!dsp_dtype_is_float(out->dtype))
        return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtype %s not supported",
                          opname(op), dsp_dtype_name(out->dtype));
      double p0 = a->floats[0], p1 = a->floats[1];
      if (op == DSP_OP_UNIFORM && !(isfinite(p0) && isfinite(p1) && p0 <= p1))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "uniform: need finite low <= high, got %g and %g", p0, p1);
      if (op == DSP_OP_NORMAL && !(isfinite(p0) && isfinite(p1) && p1 >= 0))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "normal: need finite mean and std >= 0, got %g and %g",
                          p0, p1);
      return 0;
    }
    default:
      return dsp_seterr(ctx, DISPATCH_EINTERNAL, "create: op %d is not a creation op",
                        (int)op);
  }
}
