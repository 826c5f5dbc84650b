/* issue 23: loss (and conv2d_bias's bias add). Launchers of
 * common/cuda/loss.cu (conventions of
 * cuda_kern.h: device pointers, the launch's cudaError_t as an int). */
#ifndef DSP_CUDA_LOSS_KERN_H
#define DSP_CUDA_LOSS_KERN_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Smallest position k < n whose label is neither ignore nor in [0, C), or
 * -1, written to *host_pos; synchronises st. */
int dsp__cuk_ce_ex_bad(cudaStream_t st, const int64_t *lab, int64_t n,
                       int64_t C, int64_t ignore, int64_t *host_pos);
/* cross_entropy_ex over x viewed [outer, C, inner] with checked labels
 * [outer, inner]: g NULL, the loss (reduction 0: per position into out;
 * 1 / 2: the sum / the mean over non-ignored positions into out[0], with
 * scratch holding outer*inner doubles); g set, the gradient into out
 * [outer, C, inner] (g per position for reduction 0, else g[0]; for the
 * mean scratch holds one double, the non-ignored count). */
int dsp__cuk_ce_ex(cudaStream_t st, int dt, int64_t outer, int64_t C,
                   int64_t inner, int64_t ignore, int reduction, double eps,
                   const void *g, const void *x, const int64_t *lab,
                   double *scratch, void *out);

/* issue 23: conv2d_bias. out [N, O, hw] (n elements) += bias[o]. */
int dsp__cuk_bias_add(cudaStream_t st, int dt, int64_t n, int64_t O,
                      int64_t hw, const void *bias, void *out);

#ifdef __cplusplus
}
#endif

#endif
