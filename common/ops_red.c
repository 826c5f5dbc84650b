/* red family, shape inference: sum, mean, max, argmax over a set of dims
 * or over all (CPU kernels: common/cpu/red.c).
 *
 * ints = dims to reduce (none: all), floats[0] != 0 keeps reduced dims as
 * size 1. sum works on f32/f64/i64 and gives the input dtype; an f32 sum
 * is accumulated in double and rounded to float once at the end, an f64
 * sum in double, an i64 sum wraps modulo 2^64. mean (f32/f64 only; i64 is
 * DISPATCH_EDTYPE) is that sum divided by the count, in double. max and
 * argmax propagate NaN (the first NaN wins), refuse an empty reduction
 * (DISPATCH_ESHAPE), and ties pick the first index in row-major order of
 * the reduced dims. Every output element is reduced sequentially in that
 * same order, whichever loop shape is used, so results are bit-identical
 * from run to run. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

int dsp__red_dims(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int nd,
                    int *red) {
  memset(red, 0, sizeof(int) * DSP_MAX_DIMS);
  if (a->n_ints == 0) {
    for (int d = 0; d < nd; d++) red[d] = 1;
    return nd;
  }
  for (int i = 0; i < a->n_ints; i++) {
    int d;
    int rc = dsp_norm_dim(ctx, opname(op), a->ints[i], nd, &d);
    if (rc < 0) return rc;
    if (red[d])
      return dsp_seterr(ctx, DISPATCH_EDIM, "%s: dim %lld repeated",
                        opname(op), (long long)a->ints[i]);
    red[d] = 1;
  }
  return a->n_ints;
}

int dsp__infer_red(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                   const dsp_attrs *a, dsp_meta *out) {
  (void)n_in;
  const dsp_meta *x = &in[0];
  const char *name = opname(op);
  if (x->dtype == DSP_BOOL || (op == DSP_OP_MEAN && x->dtype == DSP_I64))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtype %s not supported%s",
                      name, dsp_dtype_name(x->dtype),
                      op == DSP_OP_MEAN ? " (cast to a float dtype first)" : "");
  if (a->n_floats > 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes at most 1 float attribute (keepdim), got %d",
                      name, a->n_floats);
  if (op == DSP_OP_ARGMAX && a->n_ints > 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "argmax: takes one dim or none, got %d", a->n_ints);
  if (a->n_ints > x->ndim)
    return dsp_seterr(ctx, DISPATCH_EDIM, "%s: %d dims given for rank %d",
                      name, a->n_ints, x->ndim);
  int red[DSP_MAX_DIMS];
  int rc = dsp__red_dims(ctx, op, a, x->ndim, red);
  if (rc < 0) return rc;
  int keep = a->n_floats == 1 && a->floats[0] != 0;
  if (op == DSP_OP_MAX || op == DSP_OP_ARGMAX) {
    for (int d = 0; d < x->ndim; d++)
      if (red[d] && x->shape[d] == 0)
        return dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "%s: cannot reduce over empty dim %d", name, d);
  }
  dsp_meta o;
  memset(&o, 0, sizeof o);
  o.dtype = op == DSP_OP_ARGMAX ? DSP_I64 : x->dtype;
  for (int d = 0; d < x->ndim; d++) {
    if (!red[d]) o.shape[o.ndim++] = x->shape[d];
    else if (keep) o.shape[o.ndim++] = 1;
  }
  *out = o;
  return 0;
}
