/* The per-element math of the CUDA norm kernels (common/cuda/norm.cu),
 * written once for host and device as cuda_math.h is, so that
 * tests/test_cuda_host.c replays the kernels on the host with these very
 * functions and compares them with the CPU kernels (common/cpu/norm.c).
 * A row's sums are compensated sums (dsp__cu_ksum) over a block's
 * strided partials; everything is in double, rounded once on store. */
#ifndef DSP_CUDA_NORM_MATH_H
#define DSP_CUDA_NORM_MATH_H

#include "cuda_math.h"

/* 1 / sqrt(sq / D + eps): sq is the row's sum of squared deviations from
 * its mean (layer_norm) or of squares (rms_norm, mean 0) */
DSP_HD double dsp__cu_norm_rstd(double sq, int64_t D, double eps) {
  return 1.0 / sqrt(sq / (double)D + eps);
}

/* element j of the forward result; w and b are NULL when absent */
DSP_HD double dsp__cu_norm_y(double x, double mean, double rstd,
                             const void *w, const void *b, int f64,
                             int64_t j) {
  double v = (x - mean) * rstd;
  if (w) v *= dsp__cu_ld(w, f64, j);
  if (b) v += dsp__cu_ld(b, f64, j);
  return v;
}

/* dx of one element: gw = grad * w, s1 = mean(gw) (0 for rms_norm), s2 =
 * mean(gw * xhat) over the row */
DSP_HD double dsp__cu_norm_dx(double gw, double xhat, double rstd, double s1,
                              double s2) {
  return rstd * (gw - s1 - xhat * s2);
}

#endif
