/* Kernel launchers of the CUDA backend (common/cuda/kernels.cu), called by
 * the op files (common/cuda/ew.c, ...). Each enqueues its kernels on
 * `st` and returns the cudaError_t of the launch as an int (0: enqueued);
 * none synchronises unless it says so. Pointers are device pointers unless
 * named host_*. n counts elements; dt is a dsp_dtype. A launcher never
 * writes outside the n (or n_out) elements it is given, and does nothing
 * for n == 0. */
#ifndef DSP_CUDA_KERN_H
#define DSP_CUDA_KERN_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "cuda_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = a[off0(i)] op b[off1(i)]; add..minimum give dt, eq..ge give
 * bool (the caller has refused i64 division by zero). */
int dsp__cuk_binary(cudaStream_t st, int op, int dt, int64_t n,
                    const dsp__cu_index *ix, const void *a, const void *b,
                    void *out);
/* out[i] = m[off0(i)] ? a[off1(i)] : b[off2(i)], elements of es bytes */
int dsp__cuk_where(cudaStream_t st, int es, int64_t n, const dsp__cu_index *ix,
                   const void *m, const void *a, const void *b, void *out);
/* same-shape maps: scalar forms (x, s), unary ops (x), activation
 * backward ops (x = grad, y = input) */
int dsp__cuk_map(cudaStream_t st, int op, int dt, int64_t n, const void *x,
                 const void *y, double s, void *out);
/* Smallest position k < n with v[k] outside [lo, hi) (zero_only: with
 * v[k] == 0), or -1, written to *host_pos; synchronises st. */
int dsp__cuk_first_bad(cudaStream_t st, const int64_t *v, int64_t n,
                       int64_t lo, int64_t hi, int zero_only,
                       int64_t *host_pos);
/* sum/mean/max/argmax: output element o reduces the R elements at
 * x[outer(o) + inner(r)], r in row-major order of the reduced dims, in
 * S = dsp__cu_red_split(n_out, R) chunks; part holds n_out * S partials
 * of DSP__CU_RED_PART_BYTES each when S > 1 (else it may be NULL). */
int dsp__cuk_reduce(cudaStream_t st, int op, int dt, int64_t n_out, int64_t S,
                    const dsp__cu_index *outer, const dsp__cu_index *inner,
                    int64_t R, const void *x, void *out, void *part);
/* softmax family along a dim split as [outer, len, inner]; y is the
 * forward output for the backward ops (x is then the grad) */
int dsp__cuk_softmax(cudaStream_t st, int op, int dt, int64_t outer,
                     int64_t len, int64_t inner, const void *x, const void *y,
                     void *out);
/* cross entropy of x [N, C] with checked labels: the mean loss (g NULL)
 * or its gradient scaled by g[0]; scratch holds N doubles */
int dsp__cuk_cross_entropy(cudaStream_t st, int dt, int64_t N, int64_t C,
                           const void *g, const void *x, const int64_t *lab,
                           double *scratch, void *out);
/* mean((a - b)^2) over n elements: a full reduction, S and part as for
 * dsp__cuk_reduce with one output */
int dsp__cuk_mse(cudaStream_t st, int dt, int64_t n, int64_t S, const void *a,
                 const void *b, void *out, void *part);
/* ones/full (v), arange (v = start, step), uniform/normal (seed, f0, f1) */
int dsp__cuk_fill(cudaStream_t st, int dt, int64_t n, double v, void *out);
int dsp__cuk_arange(cudaStream_t st, int dt, int64_t n, double start,
                    double step, void *out);
int dsp__cuk_random(cudaStream_t st, int op, int dt, int64_t n, uint64_t seed,
                    double f0, double f1, void *out);
int dsp__cuk_dropout(cudaStream_t st, int dt, int64_t n, uint64_t seed,
                     double p, const void *x, void *out);
/* dst[i] = src[base + off0(i)] (gather) or dst[base + off0(i)] = src[i]
 * (scatter), elements of es bytes */
int dsp__cuk_gather(cudaStream_t st, int es, int64_t n, const dsp__cu_index *ix,
                    int64_t base, const void *src, void *dst);
int dsp__cuk_scatter(cudaStream_t st, int es, int64_t n,
                     const dsp__cu_index *ix, int64_t base, const void *src,
                     void *dst);
int dsp__cuk_cast(cudaStream_t st, int from, int to, int64_t n, const void *x,
                  void *out);
/* x [outer, S, blk] -> out [outer, L, blk] rows ix[k] (checked) */
int dsp__cuk_index_select(cudaStream_t st, int es, int64_t outer, int64_t L,
                          int64_t S, int64_t blk, const int64_t *ix,
                          const void *x, void *out);
/* g [outer, L, blk] summed into out [outer, S, blk]: row s takes the
 * rows k listed in ks[start[s] .. start[s+1]) (dsp__cu_csr_build), in
 * that order, which is the CPU's */
int dsp__cuk_index_select_bw(cudaStream_t st, int dt, int64_t outer,
                             int64_t L, int64_t S, int64_t blk,
                             const int64_t *start, const int64_t *ks,
                             const void *g, void *out);
/* gs: the clip's gradient scale (1: none); dk: adamw's decay factor
 * 1 - lr*wd (1: adam) */
int dsp__cuk_sgd(cudaStream_t st, int dt, int64_t n, void *p, const void *g,
                 void *v, double lr, double mom, double wd, double gs);
int dsp__cuk_adam(cudaStream_t st, int dt, int64_t n, void *p, const void *g,
                  void *m, void *v, double lr, double b1, double b2,
                  double eps, double bc1, double bc2, double dk, double gs);
/* conv2d blocks: one sample's im2col columns p0..p0+np-1 into col
 * [C*KH*KW, np], and the col2im gather that adds such a block into the
 * sample's input gradient xn [C, H, W] */
int dsp__cuk_im2col(cudaStream_t st, int f64, const dsp__cu_geo *g,
                    const void *xn, void *col, int64_t p0, int64_t np);
int dsp__cuk_col2im(cudaStream_t st, int f64, const dsp__cu_geo *g,
                    const void *col, int64_t p0, int64_t np, void *xn);
/* max/avg pool forward (x -> out) or backward (grad, x -> out, every
 * element of out written) */
int dsp__cuk_pool(cudaStream_t st, int op, int f64, const dsp__cu_geo *g,
                  const void *grad, const void *x, void *out);

#ifdef __cplusplus
}
#endif

#endif
