/* The math of the CUDA attention kernels (common/cuda/attn.cu), written
 * once for host and device like cuda_math.h, so tests/test_cuda_host.c
 * replays the kernels on the host with these very functions.
 *
 * The kernels give each query row (forward, and the dq pass of the
 * backward) or key row (the dk/dv pass) to one warp of 32 lanes. A dot
 * product over a head dim is the lane partials (lane l sums the elements
 * l, l+32, ... in order, in double) combined by a xor butterfly
 * (dsp__cu_attn_butterfly), which leaves every lane with the same sum.
 * The softmax over keys is online (dsp__cu_osm): the running max and sum
 * of one row, and the factor by which the accumulated output is rescaled
 * when the max grows. Everything is computed in double and rounded once
 * when stored, as the CPU's softmax. Each lane holds DSP__CU_ATTN_REG
 * output dims (256 per warp); a wider dv is done in further passes over
 * the keys. */
#ifndef DSP_CUDA_ATTN_MATH_H
#define DSP_CUDA_ATTN_MATH_H

#include "cuda_math.h"

#define DSP__CU_ATTN_LANES 32
#define DSP__CU_ATTN_REG 8
#define DSP__CU_ATTN_CHUNK (DSP__CU_ATTN_LANES * DSP__CU_ATTN_REG)
#define DSP__CU_ATTN_WARPS 4 /* rows per block: 128 threads */

/* The geometry the kernels take by value (dsp_attn_geo's sizes). */
typedef struct dsp__cu_attn_geo {
  int64_t B, H, Tq, Tk, d, dv;
  int causal;
  double scale;
} dsp__cu_attn_geo;

DSP_HD double dsp__cu_attn_ld(const void *p, int f64, int64_t i) {
  return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
DSP_HD void dsp__cu_attn_st(void *p, int f64, int64_t i, double v) {
  if (f64)
    ((double *)p)[i] = v;
  else
    ((float *)p)[i] = (float)v;
}

/* Keys query i sees before the key mask: j < this (top-left causal). */
DSP_HD int64_t dsp__cu_attn_nkeys(const dsp__cu_attn_geo *g, int64_t i) {
  return g->causal && i + 1 < g->Tk ? i + 1 : g->Tk;
}

/* Lane `lane`'s partial of a . b over n elements. */
DSP_HD double dsp__cu_attn_lane_dot(const void *a, const void *b, int f64,
                                    int64_t n, int lane) {
  double s = 0.0;
  for (int64_t c = lane; c < n; c += DSP__CU_ATTN_LANES)
    s += dsp__cu_attn_ld(a, f64, c) * dsp__cu_attn_ld(b, f64, c);
  return s;
}

/* The host replay of the warp's butterfly: v[32] lane partials become
 * their sum in every lane, lane l adding lane l^off's value at each step
 * (own value first, as __shfl_xor_sync in the kernels). */
DSP_HD double dsp__cu_attn_butterfly(double *v) {
  for (int off = DSP__CU_ATTN_LANES / 2; off > 0; off >>= 1) {
    double t[DSP__CU_ATTN_LANES];
    for (int l = 0; l < DSP__CU_ATTN_LANES; l++) t[l] = v[l] + v[l ^ off];
    for (int l = 0; l < DSP__CU_ATTN_LANES; l++) v[l] = t[l];
  }
  return v[0];
}

/* Online softmax of one row. */
typedef struct dsp__cu_osm {
  double m, l;
  int any;
} dsp__cu_osm;

DSP_HD dsp__cu_osm dsp__cu_osm_init(void) {
  dsp__cu_osm o;
  o.m = 0.0, o.l = 0.0, o.any = 0;
  return o;
}

/* Takes score s: *corr is the factor on what was accumulated so far, *p
 * the weight of the new key (both relative to the new max). */
DSP_HD void dsp__cu_osm_add(dsp__cu_osm *o, double s, double *corr,
                            double *p) {
  if (!o->any) {
    o->m = s, o->l = 1.0, o->any = 1;
    *corr = 0.0, *p = 1.0;
    return;
  }
  double mn = s > o->m || isnan(s) ? s : o->m;
  *corr = exp(o->m - mn);
  *p = exp(s - mn);
  o->l = o->l * *corr + *p;
  o->m = mn;
}

/* The factor on the accumulated row at the end: 1/sum, or 0 for a row
 * that saw no key (its output is 0). */
DSP_HD double dsp__cu_osm_inv(const dsp__cu_osm *o) {
  return o->any ? 1.0 / o->l : 0.0;
}

/* The row's log-sum-exp for the backward, +inf for a row that saw no key,
 * so every p = exp(s - lse) of it is 0. */
DSP_HD double dsp__cu_osm_lse(const dsp__cu_osm *o) {
  return o->any ? o->m + log(o->l) : INFINITY;
}

#endif
