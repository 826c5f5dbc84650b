/* red family, shape inference: sum, mean, max, argmax, min, argmin, var,
 * std over a set of dims or over all (CPU kernels: common/cpu/red.c).
 * min/argmin mirror max/argmax. var/std (f32/f64) take floats {keepdim,
 * correction} (correction an integer, 1 when missing) and divide the
 * squared deviations from the mean by max(0, N - correction): 0 there
 * gives inf or NaN, as PyTorch does.
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
  const int float_only =
      op == DSP_OP_MEAN || op == DSP_OP_VAR || op == DSP_OP_STD;
  const int moments = op == DSP_OP_VAR || op == DSP_OP_STD;
  const int arg = op == DSP_OP_ARGMAX || op == DSP_OP_ARGMIN;
  if (x->dtype == DSP_BOOL || (float_only && x->dtype == DSP_I64))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtype %s not supported%s",
                      name, dsp_dtype_name(x->dtype),
                      float_only ? " (cast to a float dtype first)" : "");
  if (a->n_floats > 1 + moments)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes at most %d float attribute%s (%s), got %d",
                      name, 1 + moments, moments ? "s" : "",
                      moments ? "keepdim, correction" : "keepdim",
                      a->n_floats);
  if (moments && a->n_floats == 2 &&
      !(isfinite(a->floats[1]) && a->floats[1] == trunc(a->floats[1])))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: correction %g is not an integer", name,
                      a->floats[1]);
  if (arg && a->n_ints > 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes one dim or none, got %d", name, a->n_ints);
  if (a->n_ints > x->ndim)
    return dsp_seterr(ctx, DISPATCH_EDIM, "%s: %d dims given for rank %d",
                      name, a->n_ints, x->ndim);
  int red[DSP_MAX_DIMS];
  int rc = dsp__red_dims(ctx, op, a, x->ndim, red);
  if (rc < 0) return rc;
  int keep = a->n_floats >= 1 && a->floats[0] != 0;
  if (op == DSP_OP_MAX || op == DSP_OP_MIN || arg) {
    for (int d = 0; d < x->ndim; d++)
      if (red[d] && x->shape[d] == 0)
        return dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "%s: cannot reduce over empty dim %d", name, d);
  }
  dsp_meta o;
  memset(&o, 0, sizeof o);
  o.dtype = arg ? DSP_I64 : x->dtype;
  for (int d = 0; d < x->ndim; d++) {
    if (!red[d]) o.shape[o.ndim++] = x->shape[d];
    else if (keep) o.shape[o.ndim++] = 1;
  }
  *out = o;
  return 0;
}
