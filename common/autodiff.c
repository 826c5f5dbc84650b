/* Reverse-mode autodiff engine (to be implemented). */
#include "dsp_internal.h"

int dsp__autodiff_record(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                         int n_in, const dsp_attrs *a, dsp_tensor *out) {
  (void)in, (void)n_in, (void)a, (void)out;
  return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "%s: autodiff not implemented",
                    dsp_op_lookup((int)op)->name);
}

void dsp__node_unref(struct dsp_node *n) { (void)n; }
