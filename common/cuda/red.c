/* red family on CUDA: sum, mean, max and argmax as split row reductions
 * (cuda_plan.h) with the combine steps of cuda_math.h. */
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
  if (pn && (rc = dsp__cu_scratch_get(b, ctx, op, pn, &part)) < 0) return rc;
  int e = dsp__cuk_reduce(b->stream, (int)op, (int)x->dtype, out->numel, S,
                          &outer, &inner, R, dsp_tensor_data(in[0]),
                          dsp_tensor_data(out), part);
  dsp__cu_scratch_put(b, ctx, pn, part);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
