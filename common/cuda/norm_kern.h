/* Launchers of the CUDA norm kernels (common/cuda/norm.cu), called by
 * common/cuda/norm.c; conventions as cuda_kern.h (device pointers, the
 * launch's cudaError_t as an int, nothing for an empty problem). dt is
 * DSP_F32 or DSP_F64; x is [rows, D]; w and b are [D] or NULL. */
#ifndef DSP_CUDA_NORM_KERN_H
#define DSP_CUDA_NORM_KERN_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y = (x - mean) * rstd [* w] [+ b], one block per row; centered 0 takes
 * mean = 0 (rms_norm) */
int dsp__cuk_norm_fwd(cudaStream_t st, int dt, int centered, int64_t rows,
                      int64_t D, double eps, const void *x, const void *w,
                      const void *b, void *y);
/* dx [rows, D] into out, and each row's (mean, rstd) into stats [2 rows]
 * (doubles) when stats is not NULL */
int dsp__cuk_norm_bw(cudaStream_t st, int dt, int centered, int64_t rows,
                     int64_t D, double eps, const void *g, const void *x,
                     const void *w, double *stats, void *dx);
/* dw[j] = sum over rows of g * xhat, db[j] = sum of g (rows in order, in
 * double), one thread per column; dw or db NULL to skip it */
int dsp__cuk_norm_cols(cudaStream_t st, int dt, int64_t rows, int64_t D,
                       const void *g, const void *x, const double *stats,
                       void *dw, void *db);

#ifdef __cplusplus
}
#endif

#endif
