/* optim family on CUDA: the in-place sgd, adam and adamw steps (adamw is
 * adam's kernel with a decay factor other than 1), each reading the clip's
 * gradient scale as the CPU does. */
#include "cuda_be.h"

/* the float after the op's own, 1 when absent */
static double grad_scale(const dsp_attrs *a, int n_own) {
  return a->n_floats > n_own ? a->floats[n_own] : 1.0;
}

int dsp__cu_run_optim(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, const dsp_attrs *a,
                      dsp_tensor *out) {
  const int dt = (int)in[0]->meta.dtype;
  const int64_t n = in[0]->numel;
  void *p = dsp_tensor_data(in[0]);
  int e;
  if (op == DSP_OP_SGD_STEP) {
    e = dsp__cuk_sgd(b->stream, dt, n, p, dsp_tensor_data(in[1]),
                     dsp_tensor_data(in[2]), a->floats[0], a->floats[1],
                     a->floats[2], grad_scale(a, 3));
  } else {
    int w = op == DSP_OP_ADAMW_STEP;
    double t = (double)a->ints[0];
    double dk = w ? 1.0 - a->floats[0] * a->floats[4] : 1.0;
    e = dsp__cuk_adam(b->stream, dt, n, p, dsp_tensor_data(in[1]),
                      dsp_tensor_data(in[2]), dsp_tensor_data(in[3]),
                      a->floats[0], a->floats[1], a->floats[2], a->floats[3],
                      1.0 - pow(a->floats[1], t), 1.0 - pow(a->floats[2], t),
                      dk, grad_scale(a, 4 + w));
  }
  if (!e && dsp_tensor_data(out) != p)
    e = cudaMemcpyAsync(dsp_tensor_data(out), p, dsp_tensor_nbytes(in[0]),
                        cudaMemcpyDeviceToDevice, b->stream);
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
