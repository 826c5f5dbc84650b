/* The math of the CUDA backend's kernels, written once for host and device
 * (the elementwise ops' scalar math is common/scalar_math.h, which the CPU
 * loops share).
 *
 * Under nvcc every function here is __host__ __device__; under gcc it is a
 * plain static inline C function. The .cu kernels are grid loops that call
 * these, and tests/test_cuda_host.c (gcc, no GPU needed) checks the very
 * same functions against the CPU kernels of common/ on random inputs. So
 * what the host test proves about indexing, broadcasting, the scalar
 * functions and the combine steps of reductions holds for the device code.
 *
 * Semantics follow the CPU kernels (common/ops_*.c): f32 math in float
 * with the float functions, i64 arithmetic wrapping mod 2^64, NaN
 * propagating through maximum/minimum/relu/sign/max/argmax, ties of argmax
 * to the first index. Reductions are parallel, so their order differs from
 * the CPU's sequential one; the combine steps below are chosen so that the
 * result does not depend on how the elements are split (up to rounding,
 * which the compensated sum keeps at about one ulp of the result). */
#ifndef DSP_CUDA_MATH_H
#define DSP_CUDA_MATH_H

#include <math.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "dsp.h"
#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#define DSP_HD static inline __host__ __device__
#else
#define DSP_HD static inline
#endif

#include "scalar_math.h"
/* the half dtypes' conversions, the CPU's own (host and device) */
#include "half.h"

/* ------------------------------------------------------------------ */
/* indexing                                                            */

/* Up to three operands walked in the row-major order of an iteration
 * shape; st[k][d] is operand k's element stride along dim d (0 on a
 * broadcast dim). Built on the host from a dsp_iter (size-1 dims dropped,
 * contiguous dims merged), so nd is usually 1 or 2. */
typedef struct dsp__cu_index {
  int nd, n;
  int64_t shape[DSP_MAX_DIMS];
  int64_t st[3][DSP_MAX_DIMS];
} dsp__cu_index;

/* Element offsets of flat iteration index i for every operand. */
DSP_HD void dsp__cu_offsets(const dsp__cu_index *ix, int64_t i, int64_t *off) {
  if (ix->nd == 1) { /* merged to one dim: no division needed */
    for (int k = 0; k < ix->n; k++) off[k] = i * ix->st[k][0];
    return;
  }
  for (int k = 0; k < ix->n; k++) off[k] = 0;
  for (int d = ix->nd - 1; d >= 0; d--) {
    int64_t sz = ix->shape[d], c = i % sz;
    i /= sz;
    for (int k = 0; k < ix->n; k++) off[k] += c * ix->st[k][d];
  }
}

/* ------------------------------------------------------------------ */
/* elementwise: the scalar math is common/scalar_math.h (dsp__sm_*),     */
/* shared with the CPU loops                                           */

/* The kernels' storage types of the half dtypes: two bytes each, distinct
 * types so that templates pick half.h's conversions (wide() and convert()
 * in kernels.cu) */
typedef struct dsp__cu_f16 {
  uint16_t v;
} dsp__cu_f16;
typedef struct dsp__cu_bf16 {
  uint16_t v;
} dsp__cu_bf16;

/* float -> i64 for cast: truncates, saturates, NaN gives 0 */
DSP_HD int64_t dsp__cu_f2i64(double v) {
  if (v != v) return 0;
  if (v >= 0x1p63) return INT64_MAX;
  if (v < -0x1p63) return INT64_MIN;
  return (int64_t)v;
}

/* ------------------------------------------------------------------ */
/* reductions: combine steps                                           */

/* Compensated (Neumaier) sum in double: each partial carries its rounding
 * error, so merging partials in any tree shape loses about one rounding of
 * the result, not one per element. Once a partial is infinite or NaN the
 * compensation is dropped (inf - inf would turn an exact inf into NaN). */
typedef struct dsp__cu_ksum {
  double s, c;
} dsp__cu_ksum;

DSP_HD dsp__cu_ksum dsp__cu_ksum_zero(void) {
  dsp__cu_ksum z;
  z.s = 0.0, z.c = 0.0;
  return z;
}
DSP_HD void dsp__cu_ksum_add(dsp__cu_ksum *a, double v) {
  double t = a->s + v;
  if (t - t != 0.0) { /* inf or NaN */
    a->s = t, a->c = 0.0;
    return;
  }
  if (fabs(a->s) >= fabs(v)) a->c += (a->s - t) + v;
  else a->c += (v - t) + a->s;
  a->s = t;
}
DSP_HD dsp__cu_ksum dsp__cu_ksum_merge(dsp__cu_ksum a, dsp__cu_ksum b) {
  dsp__cu_ksum_add(&a, b.s);
  if (a.s - a.s == 0.0) a.c += b.c;
  return a;
}
DSP_HD double dsp__cu_ksum_value(dsp__cu_ksum a) {
  return a.s - a.s != 0.0 ? a.s : a.s + a.c;
}

/* max/argmax candidates: a value and its row-major index in the reduced
 * dims. b beats a when it is larger, when it is the only NaN, or when the
 * two tie (equal, or both NaN) and b comes first. That order is total, so
 * merging in any tree shape picks what the CPU's sequential scan picks:
 * the first NaN if any, else the first maximum. The identity is
 * (-inf or INT64_MIN, index INT64_MAX): any real element beats it. */
typedef struct dsp__cu_amax_f {
  double v;
  int64_t i;
} dsp__cu_amax_f;
typedef struct dsp__cu_amax_i {
  int64_t v;
  int64_t i;
} dsp__cu_amax_i;

DSP_HD int dsp__cu_amax_f_beats(dsp__cu_amax_f b, dsp__cu_amax_f a) {
  int an = a.v != a.v, bn = b.v != b.v;
  if (an || bn) return (an && bn) ? b.i < a.i : bn;
  if (b.v != a.v) return b.v > a.v;
  return b.i < a.i;
}
DSP_HD dsp__cu_amax_f dsp__cu_amax_f_merge(dsp__cu_amax_f a, dsp__cu_amax_f b) {
  return dsp__cu_amax_f_beats(b, a) ? b : a;
}
DSP_HD dsp__cu_amax_f dsp__cu_amax_f_id(void) {
  dsp__cu_amax_f z;
  z.v = -INFINITY, z.i = INT64_MAX;
  return z;
}
DSP_HD dsp__cu_amax_i dsp__cu_amax_i_merge(dsp__cu_amax_i a, dsp__cu_amax_i b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}
DSP_HD dsp__cu_amax_i dsp__cu_amax_i_id(void) {
  dsp__cu_amax_i z;
  z.v = INT64_MIN, z.i = INT64_MAX;
  return z;
}

/* min/argmin: the same order with smaller values beating larger ones (a
 * NaN still beats every number, ties still go to the first index), so the
 * CPU's sequential min scan and any merge tree agree. Identity: (+inf or
 * INT64_MAX, index INT64_MAX). */
DSP_HD int dsp__cu_amin_f_beats(dsp__cu_amax_f b, dsp__cu_amax_f a) {
  int an = a.v != a.v, bn = b.v != b.v;
  if (an || bn) return (an && bn) ? b.i < a.i : bn;
  if (b.v != a.v) return b.v < a.v;
  return b.i < a.i;
}
DSP_HD dsp__cu_amax_f dsp__cu_amin_f_merge(dsp__cu_amax_f a, dsp__cu_amax_f b) {
  return dsp__cu_amin_f_beats(b, a) ? b : a;
}
DSP_HD dsp__cu_amax_f dsp__cu_amin_f_id(void) {
  dsp__cu_amax_f z;
  z.v = INFINITY, z.i = INT64_MAX;
  return z;
}
DSP_HD dsp__cu_amax_i dsp__cu_amin_i_merge(dsp__cu_amax_i a, dsp__cu_amax_i b) {
  return (b.v < a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}
DSP_HD dsp__cu_amax_i dsp__cu_amin_i_id(void) {
  dsp__cu_amax_i z;
  z.v = INT64_MAX, z.i = INT64_MAX;
  return z;
}

/* var/std of one output from the compensated sum of its squared
 * deviations: over max(0, N - correction), as the CPU (common/cpu/red.c);
 * std is the root */
DSP_HD double dsp__cu_var_final(double ss, double n, double corr, int sq) {
  double den = n - corr > 0 ? n - corr : 0.0;
  double v = ss / den;
  return sq ? sqrt(v) : v;
}

/* Reductions run one block of DSP__CU_TPB threads per output, thread t
 * taking elements t, t + TPB, ... and the block merging its partials in a
 * halving tree. Few outputs over long rows would leave the device idle, so
 * then each output is split into S contiguous chunks of r, one block each,
 * and a second pass merges the S partials the same way. Both the backend
 * and the host test take S from here. */
#define DSP__CU_TPB 256
#define DSP__CU_RED_PART_BYTES 16 /* the largest partial: ksum / amax */
DSP_HD int64_t dsp__cu_red_split(int64_t n_out, int64_t R) {
  if (n_out >= DSP__CU_TPB || R < 64 * DSP__CU_TPB) return 1;
  int64_t s = R / (16 * DSP__CU_TPB), cap = 1024 / n_out;
  if (cap < 1) cap = 1;
  return s < cap ? s : cap;
}
/* chunk s of S over [0, R): [lo, hi) */
DSP_HD void dsp__cu_red_chunk(int64_t R, int64_t S, int64_t s, int64_t *lo,
                              int64_t *hi) {
  int64_t c = (R + S - 1) / S;
  *lo = s * c < R ? s * c : R;
  *hi = *lo + c < R ? *lo + c : R;
}

/* Log-sum-exp of a row in one pass: m is the running max and s the sum of
 * exp(x - m). Merging rescales the smaller side, so no exp ever sees a
 * positive argument (no overflow). A NaN or +inf anywhere makes the row
 * NaN, as on the CPU. A -inf element adds nothing; a row of only -inf ends as
 * (m = -inf, s = 0), which dsp__cu_lse_final turns into the CPU's answer
 * (max taken as 0, so softmax is 0/0 = NaN). Identity: (-inf, 0). */
typedef struct dsp__cu_lse {
  double m, s;
} dsp__cu_lse;

DSP_HD dsp__cu_lse dsp__cu_lse_id(void) {
  dsp__cu_lse z;
  z.m = -INFINITY, z.s = 0.0;
  return z;
}
/* +inf contributes exp(inf - inf) = NaN to its row's sum, as in the CPU's
 * two-pass form, so a row holding +inf is NaN throughout */
DSP_HD dsp__cu_lse dsp__cu_lse_elem(double v) {
  dsp__cu_lse z;
  z.m = v, z.s = v == -INFINITY ? 0.0 : v == INFINITY ? NAN : 1.0;
  return z;
}
DSP_HD dsp__cu_lse dsp__cu_lse_merge(dsp__cu_lse a, dsp__cu_lse b) {
  if (a.m != a.m || b.m != b.m) {
    a.m = NAN, a.s = NAN;
    return a;
  }
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  if (a.m >= b.m) {
    a.s += b.s * exp(b.m - a.m);
    return a;
  }
  b.s += a.s * exp(a.m - b.m);
  return b;
}
/* The row's (max, sum) as the CPU kernels use them: max 0 for an all -inf
 * row. */
DSP_HD dsp__cu_lse dsp__cu_lse_final(dsp__cu_lse a) {
  if (a.m == -INFINITY) a.m = 0.0;
  return a;
}

/* ------------------------------------------------------------------ */
/* conv2d (im2col) and pooling                                         */

/* x [N,C,H,W], w [O,C,KH,KW], y [N,O,OH,OW]; the same fields as the CPU's
 * dsp_conv_geo / dsp_pool_geo (kern_nn.h) */
typedef struct dsp__cu_geo {
  int64_t N, C, H, W, O, KH, KW, OH, OW;
  int64_t sh, sw, ph, pw, dh, dw;
  int64_t exclude_pad; /* avg pool: count_include_pad = 0 */
} dsp__cu_geo;

DSP_HD double dsp__cu_ld(const void *p, int f64, int64_t i) {
  return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

/* Element (r, p) of one sample's im2col matrix [C*KH*KW, OH*OW]: row
 * r = (c, i, j) of the kernel, column p = output pixel; 0 in padding. */
DSP_HD double dsp__cu_im2col_at(const dsp__cu_geo *g, const void *xn, int f64,
                                int64_t r, int64_t p) {
  int64_t j = r % g->KW, i = (r / g->KW) % g->KH, c = r / (g->KW * g->KH);
  int64_t h = (p / g->OW) * g->sh - g->ph + i * g->dh;
  int64_t w = (p % g->OW) * g->sw - g->pw + j * g->dw;
  if (h < 0 || h >= g->H || w < 0 || w >= g->W) return 0.0;
  return dsp__cu_ld(xn, f64, (c * g->H + h) * g->W + w);
}

/* col2im as a gather: the sum, over kernel taps (i, j) in increasing
 * order, of the entries of the column block [C*KH*KW, np] (output pixels
 * p0..p0+np-1) that im2col took from input element (c, h, w). One thread
 * per input element, so no two threads add into the same place. */
DSP_HD double dsp__cu_col2im_at(const dsp__cu_geo *g, const void *col, int f64,
                                int64_t p0, int64_t np, int64_t c, int64_t h,
                                int64_t w) {
  double acc = 0.0;
  for (int64_t i = 0; i < g->KH; i++) {
    int64_t th = h + g->ph - i * g->dh;
    if (th < 0 || th % g->sh) continue;
    int64_t oh = th / g->sh;
    if (oh >= g->OH) continue;
    for (int64_t j = 0; j < g->KW; j++) {
      int64_t tw = w + g->pw - j * g->dw;
      if (tw < 0 || tw % g->sw) continue;
      int64_t ow = tw / g->sw;
      if (ow >= g->OW) continue;
      int64_t p = oh * g->OW + ow;
      if (p < p0 || p >= p0 + np) continue;
      acc += dsp__cu_ld(col, f64, ((c * g->KH + i) * g->KW + j) * np + (p - p0));
    }
  }
  return acc;
}

/* The window of pool output (oh, ow), clamped to the input. */
DSP_HD void dsp__cu_pool_window(const dsp__cu_geo *g, int64_t oh, int64_t ow,
                                int64_t *h0, int64_t *h1, int64_t *w0,
                                int64_t *w1) {
  *h0 = oh * g->sh - g->ph, *w0 = ow * g->sw - g->pw;
  *h1 = *h0 + g->KH, *w1 = *w0 + g->KW;
  if (*h0 < 0) *h0 = 0;
  if (*w0 < 0) *w0 = 0;
  if (*h1 > g->H) *h1 = g->H;
  if (*w1 > g->W) *w1 = g->W;
}

/* Max of window (oh, ow) of plane xp [H, W] and the index in the plane of
 * the element it came from: the first largest in row-major order, a NaN
 * winning (the CPU's scan). */
DSP_HD double dsp__cu_pool_max(const dsp__cu_geo *g, const void *xp, int f64,
                               int64_t oh, int64_t ow, int64_t *at) {
  int64_t h0, h1, w0, w1;
  dsp__cu_pool_window(g, oh, ow, &h0, &h1, &w0, &w1);
  int64_t bi = h0 * g->W + w0;
  double best = dsp__cu_ld(xp, f64, bi);
  for (int64_t h = h0; h < h1 && best == best; h++)
    for (int64_t w = w0; w < w1; w++) {
      double v = dsp__cu_ld(xp, f64, h * g->W + w);
      if (v > best || v != v) {
        best = v, bi = h * g->W + w;
        if (v != v) break;
      }
    }
  *at = bi;
  return best;
}

/* The divisor of avg window (oh, ow): the kernel area (padding counts),
 * or with exclude_pad its elements inside the input (the CPU's). */
DSP_HD double dsp__cu_pool_div(const dsp__cu_geo *g, int64_t oh, int64_t ow) {
  int64_t h0, h1, w0, w1;
  if (!g->exclude_pad) return (double)g->KH * (double)g->KW;
  dsp__cu_pool_window(g, oh, ow, &h0, &h1, &w0, &w1);
  return (double)((h1 - h0) * (w1 - w0));
}

/* Average of window (oh, ow). */
DSP_HD double dsp__cu_pool_avg(const dsp__cu_geo *g, const void *xp, int f64,
                               int64_t oh, int64_t ow) {
  int64_t h0, h1, w0, w1;
  dsp__cu_pool_window(g, oh, ow, &h0, &h1, &w0, &w1);
  double s = 0.0;
  for (int64_t h = h0; h < h1; h++)
    for (int64_t w = w0; w < w1; w++) s += dsp__cu_ld(xp, f64, h * g->W + w);
  return s / dsp__cu_pool_div(g, oh, ow);
}

/* Pool backward as a gather for input element (h, w) of one plane: the
 * grads of every window that routes to it (max: the window's chosen
 * element; avg: every window holding it, grad/area), added in increasing
 * output order and rounded to the dtype after each add, as the CPU's
 * accumulation into the output does. */
DSP_HD double dsp__cu_pool_bw_at(const dsp__cu_geo *g, int is_max,
                                 const void *gp, const void *xp, int f64,
                                 int64_t h, int64_t w) {
  double acc = 0.0;
  int64_t oh_lo = h + g->ph - g->KH + 1, ow_lo = w + g->pw - g->KW + 1;
  oh_lo = oh_lo <= 0 ? 0 : (oh_lo + g->sh - 1) / g->sh;
  ow_lo = ow_lo <= 0 ? 0 : (ow_lo + g->sw - 1) / g->sw;
  int64_t oh_hi = (h + g->ph) / g->sh, ow_hi = (w + g->pw) / g->sw;
  if (oh_hi >= g->OH) oh_hi = g->OH - 1;
  if (ow_hi >= g->OW) ow_hi = g->OW - 1;
  for (int64_t oh = oh_lo; oh <= oh_hi; oh++)
    for (int64_t ow = ow_lo; ow <= ow_hi; ow++) {
      double gv = dsp__cu_ld(gp, f64, oh * g->OW + ow);
      if (is_max) {
        int64_t at;
        dsp__cu_pool_max(g, xp, f64, oh, ow, &at);
        if (at != h * g->W + w) continue;
      } else {
        gv /= dsp__cu_pool_div(g, oh, ow);
      }
      acc = f64 ? acc + gv : (double)(float)(acc + gv);
    }
  return acc;
}

/* ------------------------------------------------------------------ */
/* random numbers: the formulas of common/rng.h, bit for bit             */

DSP_HD uint64_t dsp__cu_rng_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}
DSP_HD uint64_t dsp__cu_rng_u64(uint64_t seed, uint64_t i) {
  const uint64_t g = UINT64_C(0x9E3779B97F4A7C15);
  return dsp__cu_rng_mix(dsp__cu_rng_mix(seed + g) + (i + 1) * g);
}
DSP_HD double dsp__cu_rng_uniform01(uint64_t seed, uint64_t i) {
  return (double)(dsp__cu_rng_u64(seed, i) >> 11) * 0x1.0p-53;
}
/* normal element i (pair i/2 of Box-Muller); equal to the CPU's up to the
 * last bits of the device's log/sqrt/cos/sin */
DSP_HD double dsp__cu_rng_normal(uint64_t seed, uint64_t i) {
  uint64_t k = i / 2;
  double u1 = dsp__cu_rng_uniform01(seed, 2 * k);
  double u2 = dsp__cu_rng_uniform01(seed, 2 * k + 1);
  double r = sqrt(-2.0 * log(1.0 - u1));
  double th = 6.283185307179586476925286766559 * u2;
  return (i & 1) ? r * sin(th) : r * cos(th);
}
/* uniform in [lo, hi): a value rounded up to hi is moved just below it */
DSP_HD double dsp__cu_uniform_f64(uint64_t seed, uint64_t i, double lo,
                                  double hi) {
  double v = lo + (hi - lo) * dsp__cu_rng_uniform01(seed, i);
  return (v >= hi && hi > lo) ? nextafter(hi, lo) : v;
}
DSP_HD float dsp__cu_uniform_f32(uint64_t seed, uint64_t i, double lo,
                                 double hi) {
  float v = (float)(lo + (hi - lo) * dsp__cu_rng_uniform01(seed, i));
  float fhi = (float)hi, flo = (float)lo;
  return (v >= fhi && fhi > flo) ? nextafterf(fhi, flo) : v;
}

/* ------------------------------------------------------------------ */
/* optimizer steps (in double for both float dtypes, as on the CPU)     */

DSP_HD void dsp__cu_sgd(double *p, double *v, double g, double lr, double mom,
                        double wd) {
  *v = mom * *v + g + wd * *p;
  *p = *p - lr * *v;
}
/* bc1 = 1 - b1^t, bc2 = 1 - b2^t, computed once on the host */
DSP_HD void dsp__cu_adam(double *p, double *m, double *v, double g, double lr,
                         double b1, double b2, double eps, double bc1,
                         double bc2) {
  *m = b1 * *m + (1.0 - b1) * g;
  *v = b2 * *v + (1.0 - b2) * g * g;
  *p = *p - lr * (*m / bc1) / (sqrt(*v / bc2) + eps);
}
/* adam and adamw as the CPU runs them: p *= dk (adamw's decoupled decay
 * 1 - lr*wd, computed once on the host; 1 for adam, which leaves p as it
 * is), g read as g * gs (the clip's gradient scale; 1 when none), then
 * adam's update */
DSP_HD void dsp__cu_adamw(double *p, double *m, double *v, double g, double lr,
                          double b1, double b2, double eps, double bc1,
                          double bc2, double dk, double gs) {
  *p = *p * dk;
  dsp__cu_adam(p, m, v, g * gs, lr, b1, b2, eps, bc1, bc2);
}

#endif
