/* create family on CUDA: zeros, ones, full, arange and the random
 * fills. */
#include "cuda_be.h"

int dsp__cu_run_create(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                       const dsp_attrs *a, dsp_tensor *out) {
  const int dt = (int)out->meta.dtype;
  const int64_t n = out->numel;
  int e = 0;
  switch (op) {
    case DSP_OP_ZEROS: return 0; /* dsp_op hands over zeroed storage */
    case DSP_OP_ONES: e = dsp__cuk_fill(b->stream, dt, n, 1.0, dsp_tensor_data(out)); break;
    case DSP_OP_FULL: e = dsp__cuk_fill(b->stream, dt, n, a->floats[0], dsp_tensor_data(out)); break;
    case DSP_OP_ARANGE:
      if (dt == DSP_BOOL) break; /* infer refuses it */
      e = dsp__cuk_arange(b->stream, dt, n, a->floats[0], a->floats[2],
                          dsp_tensor_data(out));
      break;
    case DSP_OP_UNIFORM:
    case DSP_OP_NORMAL:
      if (!dsp_dtype_is_float(out->meta.dtype)) break; /* infer refuses it */
      e = dsp__cuk_random(b->stream, (int)op, dt, n, (uint64_t)a->ints[1],
                          a->floats[0], a->floats[1], dsp_tensor_data(out));
      break;
    default:
      return dsp__cu_no_kernel(b, ctx, op);
  }
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
