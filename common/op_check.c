/* Attribute-count check shared by the op families' infer functions. */
#include "dsp_internal.h"

int dsp__want_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                    int n_ints, int n_floats) {
  if (a->n_ints != n_ints || a->n_floats != n_floats)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d int and %d float attributes, got %d and %d",
                      dsp_op_lookup((int)op)->name, n_ints, n_floats,
                      a->n_ints, a->n_floats);
  return 0;
}
