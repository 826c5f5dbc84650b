/* optim family, validation: in-place sgd (momentum, weight decay), adam
 * and adamw steps (CPU kernels: common/cpu/optim.c). */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

/* One row per step op: its float attributes (before the optional gradient
 * scale), whether ints[0] is the step count, and its input names. */
typedef struct optim_row {
  dsp_opcode op;
  int n_floats;
  const char *floats[5];
  int has_t;
  const char *in[4];
} optim_row;

static const optim_row g_rows[] = {
    {DSP_OP_SGD_STEP, 3, {"lr", "momentum", "weight_decay"}, 0,
     {"param", "grad", "velocity"}},
    {DSP_OP_ADAM_STEP, 4, {"lr", "beta1", "beta2", "eps"}, 1,
     {"param", "grad", "m", "v"}},
    {DSP_OP_ADAMW_STEP, 5, {"lr", "beta1", "beta2", "eps", "weight_decay"}, 1,
     {"param", "grad", "m", "v"}},
};
_Static_assert(sizeof g_rows / sizeof g_rows[0] == DSP__OPS_IN_FAMILY(OPTIM),
               "a new optimizer op needs its row in g_rows");

static const optim_row *row_of(dsp_opcode op) {
  for (size_t i = 0; i < sizeof g_rows / sizeof g_rows[0]; i++)
    if (g_rows[i].op == op) return &g_rows[i];
  return NULL;
}

/* lr, momentum, weight decay: any finite value (as torch); betas in
 * [0, 1); eps >= 0; the gradient factor finite and >= 0 (a clip's is at
 * most 1, a loss scaler's 1 / scale may be more), or NaN (a clip of a NaN
 * norm propagates, as PyTorch's does) */
static int check_floats(dsp_ctx *ctx, const optim_row *r, const dsp_attrs *a) {
  for (int i = 0; i < r->n_floats; i++)
    if (!isfinite(a->floats[i]))
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %g is not finite",
                        opname(r->op), r->floats[i], a->floats[i]);
  if (r->has_t) {
    for (int i = 1; i <= 2; i++)
      if (!(a->floats[i] >= 0.0 && a->floats[i] < 1.0))
        return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %g outside [0, 1)",
                          opname(r->op), r->floats[i], a->floats[i]);
    if (a->floats[3] < 0.0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: eps = %g is negative",
                        opname(r->op), a->floats[3]);
    if (a->ints[0] < 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "%s: step t = %lld must be >= 1", opname(r->op),
                        (long long)a->ints[0]);
  }
  if (a->n_floats > r->n_floats) {
    double s = a->floats[r->n_floats];
    if (!(s >= 0.0 && !isinf(s)) && !isnan(s))
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "%s: gradient scale = %g is not finite and >= 0",
                        opname(r->op), s);
  }
  return 0;
}

int dsp__infer_optim(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                     int n_in, const dsp_attrs *a, dsp_meta *out) {
  const optim_row *r = row_of(op);
  if (!r)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "optim: op %d unknown",
                      (int)op);
  if ((a->n_floats != r->n_floats && a->n_floats != r->n_floats + 1) ||
      a->n_ints != r->has_t)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d float and %d int attributes (%d floats "
                      "with a gradient scale), got %d and %d",
                      opname(op), r->n_floats, r->has_t, r->n_floats + 1,
                      a->n_floats, a->n_ints);
  int rc = check_floats(ctx, r, a);
  if (rc < 0) return rc;
  if (!dsp_dtype_is_float(in[0].dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: param must be f32 or f64, got %s",
                      opname(op), dsp_dtype_name(in[0].dtype));
  for (int i = 1; i < n_in; i++) {
    if (in[i].dtype != in[0].dtype)
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s is %s but param is %s",
                        opname(op), r->in[i], dsp_dtype_name(in[i].dtype),
                        dsp_dtype_name(in[0].dtype));
    if (!dsp_meta_equal(&in[i], &in[0])) {
      char s1[128], s2[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: %s is %s but param is %s",
                        opname(op), r->in[i], dsp_shape_str(&in[i], s1, sizeof s1),
                        dsp_shape_str(&in[0], s2, sizeof s2));
    }
  }
  *out = in[0];
  return 0;
}
