/* red family on CUDA: sum, mean, max, argmax, min, argmin, var and std as
 * split row reductions (cuda_plan.h) with the combine steps of
 * cuda_math.h; var and std take two of them (the means, then the squared
 * deviations). */
#include "cuda_be.h"

int dsp__cu_run_red(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                    dsp_tensor *const *in, const dsp_attrs *a,
                    dsp_tensor *out) {
  const dsp_meta *x = &in[0]->meta;
  int red[DSP_MAX_DIMS];
  int rc = dsp__red_dims(ctx, op, a, x->ndim, red);
  if (rc < 0) return rc;
  dsp__cu_index outer, inner;
  int64_t R;
  dsp__cu_plan_red(x, red, &outer, &inner, &R);
  const int64_t S = dsp__cu_red_split(out->numel, R);
  void *part = NULL;
  size_t pn = S > 1 ? (size_t)(out->numel * S) * DSP__CU_RED_PART_BYTES : 0;
  if (op == DSP_OP_VAR || op == DSP_OP_STD) {
    /* the means first in the scratch, then the partials */
    size_t mn = ((size_t)out->numel * sizeof(double) + 15) & ~(size_t)15;
    if ((rc = dsp__cu_scratch_get(b, ctx, op, mn + pn, &part)) < 0) return rc;
    double corr = a->n_floats > 1 ? a->floats[1] : 1.0;
    int e = dsp__cuk_var(b->stream, (int)x->dtype, op == DSP_OP_STD, corr,
                         out->numel, S, &outer, &inner, R,
                         dsp_tensor_data(in[0]), (double *)part,
                         dsp_tensor_data(out),
                         pn ? (char *)part + mn : NULL);
    dsp__cu_scratch_put(b, ctx, mn + pn, part);
    return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
  }
  if (pn && (rc = dsp__cu_scratch_get(b, ctx, op, pn, &part)) < 0) return rc;
  int e = dsp__cuk_reduce(b->stream, (int)op, (int)x->dtype, out->numel, S,
                          &outer, &inner, R, dsp_tensor_data(in[0]),
                          dsp_tensor_data(out), part);
  dsp__cu_scratch_put(b, ctx, pn, part);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
