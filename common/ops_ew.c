/* ew family, shape inference: elementwise binary ops with numpy
 * broadcasting, comparisons, where, scalar forms, unary math, activations
 * and their backward helpers.
 *
 * dtypes: float math on f32 and f64 (f32 is computed in float with the
 * float libm functions); i64 for add/sub/mul/div/maximum/minimum, the
 * comparisons, neg/abs/sign/relu(+backward), clamp, masked_fill and the
 * integral scalar forms add/sub/mul/rsub; bool for eq/ne and as where's mask. i64 arithmetic
 * wraps modulo 2^64 (never undefined behaviour); i64 div truncates toward
 * zero, INT64_MIN / -1 wraps to INT64_MIN, and a zero divisor is
 * DISPATCH_EINVAL. maximum/minimum/relu/sign propagate NaN.
 *
 * The CPU kernels are in common/cpu/ew.c. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"
#include "scalar_math.h"

#define opname dsp__opname
#define is_arith dsp__ew_is_arith
#define is_cmp dsp__ew_is_cmp
#define is_scalar dsp__ew_is_scalar

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

/* clamp(x): floats {lo, hi}, neither NaN; an i64 tensor's bounds are
 * integers or infinite (no bound on that side). */
static int infer_clamp(dsp_ctx *ctx, const dsp_meta *in, const dsp_attrs *a,
                       dsp_meta *out) {
  int rc = dsp__want_attrs(ctx, DSP_OP_CLAMP, a, 0, 2);
  if (rc < 0) return rc;
  dsp_dtype dt = in[0].dtype;
  if (!dsp_dtype_is_float(dt) && dt != DSP_I64)
    return bad_dtype(ctx, DSP_OP_CLAMP, dt);
  for (int i = 0; i < 2; i++) {
    double b = a->floats[i];
    if (isnan(b))
      return dsp_seterr(ctx, DISPATCH_EINVAL, "clamp: %s bound is NaN",
                        i ? "upper" : "lower");
    if (dt == DSP_I64 && !isinf(b) && !scalar_is_i64(b))
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "clamp: bound %g is not an integer for an i64 tensor",
                        b);
  }
  *out = in[0];
  return 0;
}

/* masked_fill(x, mask): a bool mask that broadcasts to x's shape (the
 * output's), floats {value}; an i64 x takes an exact integer value. */
static int infer_masked_fill(dsp_ctx *ctx, const dsp_meta *in,
                             const dsp_attrs *a, dsp_meta *out) {
  int rc = dsp__want_attrs(ctx, DSP_OP_MASKED_FILL, a, 0, 1);
  if (rc < 0) return rc;
  dsp_dtype dt = in[0].dtype;
  if (!dsp_dtype_is_float(dt) && dt != DSP_I64)
    return bad_dtype(ctx, DSP_OP_MASKED_FILL, dt);
  if (in[1].dtype != DSP_BOOL)
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "masked_fill: mask must be bool, got %s",
                      dsp_dtype_name(in[1].dtype));
  if (dt == DSP_I64 && !scalar_is_i64(a->floats[0]))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "masked_fill: value %g is not an integer for an i64 "
                      "tensor", a->floats[0]);
  dsp_meta b;
  if ((rc = dsp_broadcast_shapes(ctx, "masked_fill", &in[0], &in[1], &b)) < 0)
    return rc;
  b.dtype = dt;
  if (!dsp_meta_equal(&b, &in[0])) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "masked_fill: mask shape %s does not broadcast to input "
                      "shape %s", dsp_shape_str(&in[1], s1, sizeof s1),
                      dsp_shape_str(&in[0], s2, sizeof s2));
  }
  *out = in[0];
  return 0;
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
  if (op == DSP_OP_CLAMP) return infer_clamp(ctx, in, a, out);
  if (op == DSP_OP_MASKED_FILL) return infer_masked_fill(ctx, in, a, out);
  if (dsp__sm_is_act_bw(op)) {
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
#define FLOAT_UNARY_CASE_(OP, f) case DSP_OP_##OP:
    DSP_SM_FLOAT_UNARY(FLOAT_UNARY_CASE_)
#undef FLOAT_UNARY_CASE_
      if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
      if (!dsp_dtype_is_float(dt)) return bad_dtype(ctx, op, dt);
      *out = in[0];
      return 0;
    default:
      return dsp_seterr(ctx, DISPATCH_EINTERNAL, "ew: op %d is not elementwise",
                        (int)op);
  }
}
