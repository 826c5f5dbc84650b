/* ew family on CUDA: broadcast binary ops and comparisons, where,
 * masked_fill, clamp, and the element maps (scalar forms, unary ops,
 * activation backward) of
 * kernels.cu over the scalar math of common/scalar_math.h. */
#include "cuda_be.h"

int dsp__cu_run_ew(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out) {
  const dsp_dtype dt = in[0]->meta.dtype;
  const int64_t n = out->numel;
  int e;
  if ((op >= DSP_OP_ADD && op <= DSP_OP_GE) || op == DSP_OP_WHERE) {
    const dsp_meta *ms[3];
    for (int i = 0; i < n_in; i++) ms[i] = &in[i]->meta;
    dsp__cu_index ix;
    dsp__cu_plan_bcast(&ix, &out->meta, ms, n_in);
    if (op == DSP_OP_WHERE)
      e = dsp__cuk_where(b->stream, (int)dsp_dtype_size(out->meta.dtype), n, &ix,
                         dsp_tensor_data(in[0]), dsp_tensor_data(in[1]),
                         dsp_tensor_data(in[2]), dsp_tensor_data(out));
    else {
      if (op == DSP_OP_DIV && dt == DSP_I64) {
        int64_t pos;
        e = dsp__cuk_first_bad(b->stream, dsp_tensor_data(in[1]), in[1]->numel,
                               0, 0, 1, &pos);
        if (e) return dsp__cu_err(ctx, e, op, "divisor check");
        if (pos >= 0)
          return dsp_seterr(ctx, DISPATCH_EINVAL,
                            "div: integer division by zero (divisor element %lld)",
                            (long long)pos);
      }
      e = dsp__cuk_binary(b->stream, (int)op, (int)dt, n, &ix,
                          dsp_tensor_data(in[0]), dsp_tensor_data(in[1]),
                          dsp_tensor_data(out));
    }
  } else if (op == DSP_OP_MASKED_FILL) {
    const dsp_meta *ms[2] = {&in[1]->meta, &in[0]->meta};
    dsp__cu_index ix;
    dsp__cu_plan_bcast(&ix, &out->meta, ms, 2);
    e = dsp__cuk_masked_fill(b->stream, (int)dt, n, &ix, dsp_tensor_data(in[1]),
                             dsp_tensor_data(in[0]), a->floats[0],
                             dsp_tensor_data(out));
  } else if (op == DSP_OP_CLAMP) {
    e = dsp__cuk_clamp(b->stream, (int)dt, n, dsp_tensor_data(in[0]),
                       a->floats[0], a->floats[1], dsp_tensor_data(out));
  } else {
    e = dsp__cuk_map(b->stream, (int)op, (int)dt, n, dsp_tensor_data(in[0]),
                     n_in > 1 ? dsp_tensor_data(in[1]) : NULL,
                     a->n_floats > 0 ? a->floats[0] : 0.0, dsp_tensor_data(out));
  }
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
