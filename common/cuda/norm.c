/* issue 23 nn ops on CUDA: embedding (the index_select kernels of
 * shape.c / kernels.cu over the table's rows) and layer_norm / rms_norm
 * with their fused backward (norm.cu). Plans: common/ops_norm.c. */
#include "cuda_be.h"
#include "norm_kern.h"

/* embedding_backward: the rows summed in index order by the
 * index_select_backward gather (the CPU's order and element type, so
 * the bits match), then the padding row set to zero. */
static int embedding_bw(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                        dsp_tensor *const *in, const dsp_norm_geo *g,
                        dsp_tensor *out) {
  int rc = dsp__cu_rows_scatter_add(b, ctx, op, in, 1, g->rows, g->V, g->D, out);
  if (rc < 0 || g->pad < 0) return rc;
  const size_t row = (size_t)g->D * dsp_dtype_size(out->meta.dtype);
  cudaError_t e = cudaMemsetAsync((char *)dsp_tensor_data(out) + (size_t)g->pad * row,
                                  0, row, b->stream);
  return e == cudaSuccess ? 0 : dsp__cu_err(ctx, e, op, "cudaMemsetAsync");
}

/* dx, then the weight and bias column sums from each row's (mean, rstd),
 * which the dx kernel leaves in a device scratch of 2 rows doubles */
static int norm_bw(cu_be *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   const dsp_norm_geo *g, dsp_tensor *out) {
  const int dt = (int)out->meta.dtype;
  const size_t es = dsp_dtype_size(out->meta.dtype);
  const int cols = (g->has_w || g->has_b) && g->rows > 0;
  const size_t sn = cols ? (size_t)(2 * g->rows) * sizeof(double) : 0;
  double *stats = NULL;
  if (cols) {
    int rc = dsp__cu_scratch_get(b, ctx, op, sn, (void **)&stats);
    if (rc < 0) return rc;
  }
  char *o = dsp_tensor_data(out);
  const int64_t n = g->rows * g->D;
  int e = dsp__cuk_norm_bw(b->stream, dt, g->centered, g->rows, g->D, g->eps,
                           dsp_tensor_data(in[0]), dsp_tensor_data(in[1]),
                           g->has_w ? dsp_tensor_data(in[2]) : NULL, stats, o);
  if (!e && cols)
    e = dsp__cuk_norm_cols(b->stream, dt, g->rows, g->D, dsp_tensor_data(in[0]),
                           dsp_tensor_data(in[1]), stats,
                           g->has_w ? o + (size_t)n * es : NULL,
                           g->has_b ? o + (size_t)(n + g->has_w * g->D) * es : NULL);
  dsp__cu_scratch_put(b, ctx, sn, stats);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}

int dsp__cu_run_norm(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out) {
  dsp_meta ms[3], om;
  dsp_norm_geo g;
  if (n_in < 1 || n_in > 3) return dsp__cu_no_kernel(b, ctx, op);
  for (int i = 0; i < n_in; i++) ms[i] = in[i]->meta;
  int rc = dsp__norm_plan(ctx, op, ms, n_in, a, &om, &g);
  if (rc < 0) return rc;
  const int dt = (int)in[0]->meta.dtype;
  int e = 0;
  switch (op) {
    case DSP_OP_EMBEDDING:
    case DSP_OP_EMBEDDING_BACKWARD:
      if ((rc = dsp__cu_index_check(b, ctx, op, in[1], 0, g.V)) < 0) return rc;
      if (out->numel == 0) return 0;
      if (op == DSP_OP_EMBEDDING_BACKWARD) return embedding_bw(b, ctx, op, in, &g, out);
      e = dsp__cuk_index_select(b->stream, (int)dsp_dtype_size(in[0]->meta.dtype), 1,
                                g.rows, g.V, g.D, dsp_tensor_data(in[1]),
                                dsp_tensor_data(in[0]), dsp_tensor_data(out));
      break;
    case DSP_OP_LAYER_NORM:
    case DSP_OP_RMS_NORM:
      e = dsp__cuk_norm_fwd(b->stream, dt, g.centered, g.rows, g.D, g.eps,
                            dsp_tensor_data(in[0]),
                            g.has_w ? dsp_tensor_data(in[1]) : NULL,
                            g.has_b ? dsp_tensor_data(in[1 + g.has_w]) : NULL,
                            dsp_tensor_data(out));
      break;
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM_BACKWARD:
      return norm_bw(b, ctx, op, in, &g, out);
    default:
      return dsp__cu_no_kernel(b, ctx, op);
  }
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
