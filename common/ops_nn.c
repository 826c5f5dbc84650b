/* nn family: shape inference and CPU kernels (to be implemented). */
#include "dsp_internal.h"

int dsp__infer_nn(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                 const dsp_attrs *a, dsp_meta *out) {
  (void)in, (void)n_in, (void)a, (void)out;
  return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "%s: not implemented",
                    dsp_op_lookup((int)op)->name);
}

int dsp__cpu_nn(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
               const dsp_attrs *a, dsp_tensor *out) {
  (void)in, (void)n_in, (void)a, (void)out;
  return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "%s: not implemented",
                    dsp_op_lookup((int)op)->name);
}
