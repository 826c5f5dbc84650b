/* Launchers of the CUDA attention kernels (common/cuda/attn.cu), called by
 * common/cuda/attn.c. Each enqueues on st and returns the launch's
 * cudaError_t as an int (0: enqueued); pointers are device pointers. */
#ifndef DSP_CUDA_ATTN_KERN_H
#define DSP_CUDA_ATTN_KERN_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "attn_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [B, H, Tq, dv] = softmax(scale q k^T + mask) v; mask [B, Tk] or
 * NULL */
int dsp__cuk_attention(cudaStream_t st, const dsp__cu_attn_geo *g, int f64,
                       const void *q, const void *k, const void *v,
                       const uint8_t *mask, void *out);
/* dq, dk, dv of attention for the output's gradient dout; scratch holds
 * 2 * B*H*Tq doubles (each query row's log-sum-exp and D) */
int dsp__cuk_attention_backward(cudaStream_t st, const dsp__cu_attn_geo *g,
                                int f64, const void *dout, const void *q,
                                const void *k, const void *v,
                                const uint8_t *mask, double *scratch,
                                void *dq, void *dk, void *dv);

#ifdef __cplusplus
}
#endif

#endif
