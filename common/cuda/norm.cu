/* CUDA kernels of layer_norm, rms_norm and their fused backward (issue
 * 23): grid loops around the math of norm_math.h. Each row is one block
 * of DSP__CU_TPB threads; its sums are compensated sums (dsp__cu_ksum) of
 * the threads' strided partials merged in a fixed tree, so a row's result
 * does not depend on the grid. The weight/bias column sums are one thread
 * per column walking the rows in order. */
#include <stdint.h>

#include "norm_kern.h"
#include "norm_math.h"

#define TPB DSP__CU_TPB
#define MAX_GRID 65535

static unsigned grid_rows(int64_t rows) {
  return (unsigned)(rows < 1 ? 1 : rows > MAX_GRID ? MAX_GRID : rows);
}
static unsigned grid_for(int64_t n) {
  int64_t g = (n + TPB - 1) / TPB;
  if (g < 1) g = 1;
  return (unsigned)(g > MAX_GRID ? MAX_GRID : g);
}

/* the block's partials merged in a tree (the host test replays it); every
 * thread gets the value */
__device__ double block_ksum(dsp__cu_ksum v) {
  __shared__ dsp__cu_ksum sh[TPB];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = TPB / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w)
      sh[threadIdx.x] = dsp__cu_ksum_merge(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  double r = dsp__cu_ksum_value(sh[0]);
  __syncthreads();
  return r;
}

/* the row's mean (0 unless centered) and rstd, two passes */
template <typename T>
__device__ void row_stats(const T *xr, int64_t D, int centered, double eps,
                          double *mean, double *rstd) {
  double m = 0.0;
  if (centered) {
    dsp__cu_ksum a = dsp__cu_ksum_zero();
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dsp__cu_ksum_add(&a, (double)xr[j]);
    m = block_ksum(a) / (double)D;
  }
  dsp__cu_ksum q = dsp__cu_ksum_zero();
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    double d = (double)xr[j] - m;
    dsp__cu_ksum_add(&q, d * d);
  }
  *mean = m;
  *rstd = dsp__cu_norm_rstd(block_ksum(q), D, eps);
}

template <typename T>
__global__ void k_norm_fwd(int centered, int64_t rows, int64_t D, double eps,
                           const T *x, const T *w, const T *b, T *y) {
  const int f64 = sizeof(T) == 8;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * D;
    double mean, rstd;
    row_stats(xr, D, centered, eps, &mean, &rstd);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
      y[r * D + j] = (T)dsp__cu_norm_y((double)xr[j], mean, rstd, w, b, f64, j);
  }
}

template <typename T>
__global__ void k_norm_bw(int centered, int64_t rows, int64_t D, double eps,
                          const T *g, const T *x, const T *w, double *stats,
                          T *dx) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * D, *gr = g + r * D;
    double mean, rstd;
    row_stats(xr, D, centered, eps, &mean, &rstd);
    dsp__cu_ksum a1 = dsp__cu_ksum_zero(), a2 = dsp__cu_ksum_zero();
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      double gw = (double)gr[j] * (w ? (double)w[j] : 1.0);
      dsp__cu_ksum_add(&a1, gw);
      dsp__cu_ksum_add(&a2, gw * (((double)xr[j] - mean) * rstd));
    }
    double s1 = centered ? block_ksum(a1) / (double)D : 0.0;
    double s2 = block_ksum(a2) / (double)D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      double gw = (double)gr[j] * (w ? (double)w[j] : 1.0);
      double xh = ((double)xr[j] - mean) * rstd;
      dx[r * D + j] = (T)dsp__cu_norm_dx(gw, xh, rstd, s1, s2);
    }
    if (stats && threadIdx.x == 0) stats[2 * r] = mean, stats[2 * r + 1] = rstd;
  }
}

template <typename T>
__global__ void k_norm_cols(int64_t rows, int64_t D, const T *g, const T *x,
                            const double *stats, T *dw, T *db) {
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < D;
       j += (int64_t)gridDim.x * blockDim.x) {
    double aw = 0.0, ab = 0.0;
    for (int64_t r = 0; r < rows; r++) {
      double gj = (double)g[r * D + j];
      aw += gj * (((double)x[r * D + j] - stats[2 * r]) * stats[2 * r + 1]);
      ab += gj;
    }
    if (dw) dw[j] = (T)aw;
    if (db) db[j] = (T)ab;
  }
}

extern "C" int dsp__cuk_norm_fwd(cudaStream_t st, int dt, int centered,
                                 int64_t rows, int64_t D, double eps,
                                 const void *x, const void *w, const void *b,
                                 void *y) {
  if (rows <= 0 || D <= 0) return 0;
  unsigned gr = grid_rows(rows);
  if (dt == DSP_F32)
    k_norm_fwd<float><<<gr, TPB, 0, st>>>(centered, rows, D, eps, (const float *)x,
                                          (const float *)w, (const float *)b, (float *)y);
  else
    k_norm_fwd<double><<<gr, TPB, 0, st>>>(centered, rows, D, eps, (const double *)x,
                                           (const double *)w, (const double *)b, (double *)y);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_norm_bw(cudaStream_t st, int dt, int centered,
                                int64_t rows, int64_t D, double eps,
                                const void *g, const void *x, const void *w,
                                double *stats, void *dx) {
  if (rows <= 0 || D <= 0) return 0;
  unsigned gr = grid_rows(rows);
  if (dt == DSP_F32)
    k_norm_bw<float><<<gr, TPB, 0, st>>>(centered, rows, D, eps, (const float *)g,
                                         (const float *)x, (const float *)w, stats, (float *)dx);
  else
    k_norm_bw<double><<<gr, TPB, 0, st>>>(centered, rows, D, eps, (const double *)g,
                                          (const double *)x, (const double *)w, stats, (double *)dx);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_norm_cols(cudaStream_t st, int dt, int64_t rows,
                                  int64_t D, const void *g, const void *x,
                                  const double *stats, void *dw, void *db) {
  if (D <= 0) return 0;
  unsigned gr = grid_for(D);
  if (dt == DSP_F32)
    k_norm_cols<float><<<gr, TPB, 0, st>>>(rows, D, (const float *)g, (const float *)x,
                                           stats, (float *)dw, (float *)db);
  else
    k_norm_cols<double><<<gr, TPB, 0, st>>>(rows, D, (const double *)g, (const double *)x,
                                            stats, (double *)dw, (double *)db);
  return (int)cudaGetLastError();
}
