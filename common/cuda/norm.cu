/* CUDA kernels of layer_norm, rms_norm and their fused backward (issue
 * 23): grid loops around the math of norm_math.h. Each row is one block
 * of DSP__CU_TPB threads; its sums are compensated sums (dsp__cu_ksum) of
 * the threads' strided partials merged in a fixed tree, so a row's result
 * does not depend on the grid. The weight/bias column sums are one thread
 * per column walking the rows in order. */
#include <stdint.h>

#include "cu_block.h"
#include "norm_kern.h"
#include "norm_math.h"

/* the block's partials merged in a tree (the host test replays it); every
 * thread gets the value */
__device__ double block_ksum(dsp__cu_ksum v) {
  return dsp__cu_ksum_value(block_reduce(v, ksum_merge()));
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

/* ------------------------------------------------------------------ */
/* batch_norm: x [N, C, S], one block per channel over its N * S elements */

template <typename T>
__device__ void chan_stats(int training, int64_t N, int64_t C, int64_t S,
                           int64_t c, double eps, const T *x, const T *rm,
                           const T *rv, double *mean, double *rstd,
                           double *sq) {
  if (!training) {
    *mean = (double)rm[c];
    *rstd = 1.0 / sqrt((double)rv[c] + eps);
    *sq = 0.0;
    return;
  }
  const int64_t cnt = N * S;
  dsp__cu_ksum a = dsp__cu_ksum_zero();
  for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x)
    dsp__cu_ksum_add(&a, (double)x[((j / S) * C + c) * S + j % S]);
  const double m = block_ksum(a) / (double)cnt;
  dsp__cu_ksum q = dsp__cu_ksum_zero();
  for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x) {
    double d = (double)x[((j / S) * C + c) * S + j % S] - m;
    dsp__cu_ksum_add(&q, d * d);
  }
  *sq = block_ksum(q);
  *mean = m;
  *rstd = dsp__cu_norm_rstd(*sq, cnt, eps);
}

template <typename T>
__global__ void k_bn_fwd(int training, int64_t N, int64_t C, int64_t S,
                         double eps, double mom, const T *x, T *rm, T *rv,
                         const T *w, const T *b, T *y) {
  const int f64 = sizeof(T) == 8;
  const int64_t cnt = N * S;
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    double mean, rstd, sq;
    chan_stats(training, N, C, S, c, eps, x, rm, rv, &mean, &rstd, &sq);
    if (training && rm && threadIdx.x == 0) {
      rm[c] = (T)((1.0 - mom) * (double)rm[c] + mom * mean);
      rv[c] = (T)((1.0 - mom) * (double)rv[c] + mom * (sq / ((double)cnt - 1.0)));
    }
    for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x) {
      const int64_t i = ((j / S) * C + c) * S + j % S;
      y[i] = (T)dsp__cu_norm_y((double)x[i], mean, rstd, w, b, f64, c);
    }
  }
}

template <typename T>
__global__ void k_bn_bw(int training, int64_t N, int64_t C, int64_t S,
                        double eps, const T *g, const T *x, const T *rm,
                        const T *rv, const T *w, T *dx, T *dw, T *db) {
  const int64_t cnt = N * S;
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    double mean, rstd, sq;
    chan_stats(training, N, C, S, c, eps, x, rm, rv, &mean, &rstd, &sq);
    dsp__cu_ksum ag = dsp__cu_ksum_zero(), ax = dsp__cu_ksum_zero();
    for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x) {
      const int64_t i = ((j / S) * C + c) * S + j % S;
      dsp__cu_ksum_add(&ag, (double)g[i]);
      dsp__cu_ksum_add(&ax, (double)g[i] * (((double)x[i] - mean) * rstd));
    }
    const double G = block_ksum(ag), X = block_ksum(ax);
    const double wc = w ? (double)w[c] : 1.0;
    const double s1 = training ? wc * G / (double)cnt : 0.0;
    const double s2 = training ? wc * X / (double)cnt : 0.0;
    for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x) {
      const int64_t i = ((j / S) * C + c) * S + j % S;
      double xh = ((double)x[i] - mean) * rstd;
      dx[i] = (T)dsp__cu_norm_dx((double)g[i] * wc, xh, rstd, s1, s2);
    }
    if (threadIdx.x == 0) {
      if (dw) dw[c] = (T)X;
      if (db) db[c] = (T)G;
    }
  }
}

extern "C" int dsp__cuk_bn_fwd(cudaStream_t st, int dt, int training,
                               int64_t N, int64_t C, int64_t S, double eps,
                               double mom, const void *x, void *rm, void *rv,
                               const void *w, const void *b, void *y) {
  if (C <= 0 || N * S <= 0) return 0;
  unsigned gr = grid_rows(C);
  if (dt == DSP_F32)
    k_bn_fwd<float><<<gr, TPB, 0, st>>>(training, N, C, S, eps, mom, (const float *)x,
                                        (float *)rm, (float *)rv, (const float *)w,
                                        (const float *)b, (float *)y);
  else
    k_bn_fwd<double><<<gr, TPB, 0, st>>>(training, N, C, S, eps, mom, (const double *)x,
                                         (double *)rm, (double *)rv, (const double *)w,
                                         (const double *)b, (double *)y);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_bn_bw(cudaStream_t st, int dt, int training, int64_t N,
                              int64_t C, int64_t S, double eps, const void *g,
                              const void *x, const void *rm, const void *rv,
                              const void *w, void *dx, void *dw, void *db) {
  if (C <= 0) return 0;
  unsigned gr = grid_rows(C);
  if (dt == DSP_F32)
    k_bn_bw<float><<<gr, TPB, 0, st>>>(training, N, C, S, eps, (const float *)g,
                                       (const float *)x, (const float *)rm,
                                       (const float *)rv, (const float *)w,
                                       (float *)dx, (float *)dw, (float *)db);
  else
    k_bn_bw<double><<<gr, TPB, 0, st>>>(training, N, C, S, eps, (const double *)g,
                                        (const double *)x, (const double *)rm,
                                        (const double *)rv, (const double *)w,
                                        (double *)dx, (double *)dw, (double *)db);
  return (int)cudaGetLastError();
}
