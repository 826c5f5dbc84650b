/* attention and attention_backward on CUDA, host side: the plan of
 * common/ops_attn.c, then the kernels of attn.cu on the backend's stream
 * (the backward's per-row log-sum-exp and D, 16 bytes a query row, are
 * device scratch charged to the budgets). */
#include "attn_kern.h"
#include "cuda_be.h"

int dsp__cu_run_attn(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out) {
  dsp_meta ms[DSP_MAX_INPUTS], om;
  dsp_attn_geo ag;
  if (n_in < 1 || n_in > 5) return dsp__cu_no_kernel(b, ctx, op);
  for (int i = 0; i < n_in; i++) ms[i] = in[i]->meta;
  int rc = dsp__attn_plan(ctx, op, ms, n_in, a, &om, &ag);
  if (rc < 0) return rc;
  const int bw = op == DSP_OP_ATTENTION_BACKWARD;
  const dsp__cu_attn_geo g = {ag.B, ag.H, ag.Tq, ag.Tk, ag.d, ag.dv,
                              ag.causal, ag.scale};
  const int f64 = in[bw]->meta.dtype == DSP_F64;
  const void *Q = dsp_tensor_data(in[bw]), *K = dsp_tensor_data(in[bw + 1]),
             *V = dsp_tensor_data(in[bw + 2]);
  const uint8_t *M = ag.has_mask ? dsp_tensor_data(in[bw + 3]) : NULL;
  int e;
  if (!bw) {
    e = dsp__cuk_attention(b->stream, &g, f64, Q, K, V, M,
                           dsp_tensor_data(out));
    return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
  }
  const size_t es = f64 ? 8 : 4, sn = (size_t)(2 * g.B * g.H * g.Tq) * sizeof(double);
  void *scratch = NULL;
  if (sn && (rc = dsp__cu_scratch_get(b, ctx, op, sn, &scratch)) < 0) return rc;
  char *dq = dsp_tensor_data(out);
  char *dk = dq + (size_t)(g.B * g.H * g.Tq * g.d) * es;
  char *dv = dk + (size_t)(g.B * g.H * g.Tk * g.d) * es;
  e = dsp__cuk_attention_backward(b->stream, &g, f64, dsp_tensor_data(in[0]),
                                  Q, K, V, M, scratch, dq, dk, dv);
  dsp__cu_scratch_put(b, ctx, sn, scratch);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
