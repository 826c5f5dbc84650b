/* What the CUDA backend runs and the dispatch of an op to its family's
 * file (ew.c, red.c, shape.c, linalg.c, nn.c, create.c, optim.c). */
#include "cuda_be.h"

/* The CUDA kernels' own op x key dtype table (common/cuda/supports.c);
 * an op added to DSP_OP_MAP breaks the build there until it has a row.
 * One pair depends on the GPU: cuBLAS has bf16 GEMMs from sm_80 (Ampere)
 * on, so an older GPU (sm_75, T4) leaves bf16 matmul to the op runner's
 * widening (f32 Sgemm) rather than fail it. */
static int cu_supports(void *bctx, dsp_opcode op, const dsp_meta *in, int n,
                       const dsp_meta *out) {
  const cu_be *b = bctx;
  const dsp_dtype key = dsp__op_key_dtype(op, in, n, out);
  if (op == DSP_OP_MATMUL && key == DSP_BF16 && b->cc_major < 8) return 0;
  return dsp__cuda_has_kernel(op, key);
}

/* Enqueues the op's kernels on the backend's stream. Only ops that
 * cu_supports accepts reach here (dsp_op asks first); anything else is
 * refused with DISPATCH_EUNSUPPORTED, never left as zeros. */
static int cu_run(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                  dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                  dsp_tensor *out) {
  cu_be *b = bctx;
  dsp_meta ms[DSP_MAX_INPUTS];
  if (n_in < 0 || n_in > DSP_MAX_INPUTS || !dsp_op_lookup((int)op))
    return dsp__unsupported(ctx, b->table.name, op, ms, 0, &out->meta);
  for (int i = 0; i < n_in; i++) ms[i] = in[i]->meta;
  if (!cu_supports(bctx, op, ms, n_in, &out->meta))
    return dsp__unsupported(ctx, b->table.name, op, ms, n_in, &out->meta);
  if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
  cudaError_t e = cudaSetDevice(b->device);
  if (e != cudaSuccess) return dsp__cu_err(ctx, e, op, "cudaSetDevice");
  switch (dsp_op_lookup((int)op)->family) {
    case DSP_FAM_EW: return dsp__cu_run_ew(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_RED: return dsp__cu_run_red(b, ctx, op, in, a, out);
    case DSP_FAM_SHAPE: return dsp__cu_run_shape(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_LINALG: return dsp__cu_run_matmul(b, ctx, in, a, out);
    case DSP_FAM_NN: return dsp__cu_run_nn(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_CREATE: return dsp__cu_run_create(b, ctx, op, a, out);
    case DSP_FAM_OPTIM: return dsp__cu_run_optim(b, ctx, op, in, a, out);
  }
  return dsp_seterr(ctx, DISPATCH_EINTERNAL, "cuda: bad family");
}

void dsp__cu_ops_fill(dsp_backend *t) {
  t->supports_op = cu_supports;
  t->run_op = cu_run;
}

int dsp__cu_is(const dsp_backend *be) { return be && be->run_op == cu_run; }
