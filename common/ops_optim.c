/* optim family, validation: in-place sgd (momentum, weight decay) and
 * adam steps (CPU kernels: common/cpu/optim.c). */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

int dsp__infer_optim(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                     int n_in, const dsp_attrs *a, dsp_meta *out) {
  static const char *sgd_names[3] = {"lr", "momentum", "weight_decay"};
  static const char *adam_names[4] = {"lr", "beta1", "beta2", "eps"};
  static const char *adam_in[4] = {"param", "grad", "m", "v"};
  static const char *sgd_in[3] = {"param", "grad", "velocity"};
  int is_sgd = op == DSP_OP_SGD_STEP;
  if (op != DSP_OP_SGD_STEP && op != DSP_OP_ADAM_STEP)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "optim: op %d unknown",
                      (int)op);
  int want_f = is_sgd ? 3 : 4, want_i = is_sgd ? 0 : 1;
  if (a->n_floats != want_f || a->n_ints != want_i)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d float and %d int attributes, got %d and %d",
                      opname(op), want_f, want_i, a->n_floats, a->n_ints);
  for (int i = 0; i < want_f; i++)
    if (!isfinite(a->floats[i]))
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %g is not finite",
                        opname(op), is_sgd ? sgd_names[i] : adam_names[i],
                        a->floats[i]);
  if (!is_sgd) {
    for (int i = 1; i <= 2; i++)
      if (!(a->floats[i] >= 0.0 && a->floats[i] < 1.0))
        return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: %s = %g outside [0, 1)",
                          adam_names[i], a->floats[i]);
    if (a->floats[3] < 0.0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: eps = %g is negative",
                        a->floats[3]);
    if (a->ints[0] < 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: step t = %lld must be >= 1",
                        (long long)a->ints[0]);
  }
  if (!dsp_dtype_is_float(in[0].dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: param must be f32 or f64, got %s",
                      opname(op), dsp_dtype_name(in[0].dtype));
  for (int i = 1; i < n_in; i++) {
    if (in[i].dtype != in[0].dtype)
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s is %s but param is %s",
                        opname(op), is_sgd ? sgd_in[i] : adam_in[i],
                        dsp_dtype_name(in[i].dtype), dsp_dtype_name(in[0].dtype));
    if (!dsp_meta_equal(&in[i], &in[0])) {
      char s1[128], s2[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: %s is %s but param is %s",
                        opname(op), is_sgd ? sgd_in[i] : adam_in[i],
                        dsp_shape_str(&in[i], s1, sizeof s1),
                        dsp_shape_str(&in[0], s2, sizeof s2));
    }
  }
  *out = in[0];
  return 0;
}
