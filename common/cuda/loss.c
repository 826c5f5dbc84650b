/* issue 23: loss. cross_entropy_ex and its backward op on CUDA: the shared
 * plan (common/ops_loss.c), the labels checked on the device before
 * anything is written, then the kernels of loss.cu. */
#include "cuda_be.h"
#include "loss_kern.h"

int dsp__cu_run_ce_ex(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                      dsp_tensor *out) {
  dsp_ce_geo g;
  int rc = dsp__ce_ex_kernel_plan(ctx, op, in, n_in, a, &g);
  if (rc < 0) return rc;
  const int bw = op == DSP_OP_CROSS_ENTROPY_EX_BACKWARD;
  const int64_t *lab = dsp_tensor_data(in[bw + 1]);
  const int64_t n = g.outer * g.inner;
  int64_t pos, v;
  int e = dsp__cuk_ce_ex_bad(b->stream, lab, n, g.C, g.ignore, &pos);
  if (e) return dsp__cu_err(ctx, e, op, "label check");
  if (pos >= 0) {
    if ((e = dsp__cu_peek_i64(b, lab + pos, &v)))
      return dsp__cu_err(ctx, e, op, "label read");
    return dsp__ce_ex_label_err(ctx, op, &g, pos, v);
  }
  /* forward sum/mean: the per-position losses; backward mean: the count */
  size_t sn = 0;
  if (!bw && g.reduction != DSP_REDUCE_NONE) sn = (size_t)n * sizeof(double);
  if (bw && g.reduction == DSP_REDUCE_MEAN) sn = sizeof(double);
  void *scratch = NULL;
  if (sn && (rc = dsp__cu_scratch_get(b, ctx, op, sn, &scratch)) < 0) return rc;
  e = dsp__cuk_ce_ex(b->stream, (int)out->meta.dtype, g.outer, g.C, g.inner,
                     g.ignore, g.reduction, g.smoothing,
                     bw ? dsp_tensor_data(in[0]) : NULL,
                     dsp_tensor_data(in[bw]), lab, scratch,
                     dsp_tensor_data(out));
  dsp__cu_scratch_put(b, ctx, sn, scratch);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
