/* Fused attention on CUDA: the forward and the two backward passes
 * (host side: common/cuda/attn.c; the math: attn_math.h). A block is a
 * tile of DSP__CU_ATTN_WARPS consecutive query rows (key rows for the dk/dv
 * pass), one warp per row, in a grid-stride loop over all B*H*T rows; no
 * atomics, so every run gives the same bits. Nothing of size Tq x Tk is
 * stored: the forward keeps one row's running max, sum and DSP__CU_ATTN_REG
 * output dims per lane in registers; the backward keeps each query row's
 * log-sum-exp and D = dO . O (two doubles a row, scratch) between its
 * passes. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "attn_kern.h"

#define FULL_MASK 0xffffffffu
#define TPB_ATTN (DSP__CU_ATTN_LANES * DSP__CU_ATTN_WARPS)

/* a . b over n elements, the same value in every lane */
__device__ static double warp_dot(const void *a, const void *b, int f64,
                                  int64_t n, int lane) {
  double s = dsp__cu_attn_lane_dot(a, b, f64, n, lane);
  for (int off = DSP__CU_ATTN_LANES / 2; off > 0; off >>= 1)
    s += __shfl_xor_sync(FULL_MASK, s, off);
  return s;
}

__device__ static int sees(const uint8_t *mask, int64_t j) {
  return !mask || mask[j];
}

/* The first warp row of this thread and the stride between them. */
__device__ static int64_t warp_row0(void) {
  return (int64_t)blockIdx.x * DSP__CU_ATTN_WARPS + threadIdx.x / DSP__CU_ATTN_LANES;
}
__device__ static int64_t warp_rows_stride(void) {
  return (int64_t)gridDim.x * DSP__CU_ATTN_WARPS;
}

/* A query row's view: the keys it may see (causal), its batch entry's
 * key mask (NULL: none), its q row and its head's k and v, for the
 * forward and the first backward pass alike. */
struct qrow {
  int64_t ni;
  const uint8_t *mb;
  const char *qr, *kh, *vh;
};
__device__ static qrow qrow_at(const dsp__cu_attn_geo &g, size_t es, int64_t r,
                               const void *q, const void *k, const void *v,
                               const uint8_t *mask) {
  const int64_t bh = r / g.Tq, i = r % g.Tq;
  qrow w;
  w.ni = dsp__cu_attn_nkeys(&g, i);
  w.mb = mask ? mask + (bh / g.H) * g.Tk : NULL;
  w.qr = (const char *)q + (size_t)(r * g.d) * es;
  w.kh = (const char *)k + (size_t)(bh * g.Tk * g.d) * es;
  w.vh = (const char *)v + (size_t)(bh * g.Tk * g.dv) * es;
  return w;
}

__global__ void k_attn_fwd(dsp__cu_attn_geo g, int f64, const void *q,
                           const void *k, const void *v, const uint8_t *mask,
                           void *out) {
  const int lane = threadIdx.x % DSP__CU_ATTN_LANES;
  const size_t es = f64 ? 8 : 4;
  for (int64_t r = warp_row0(); r < g.B * g.H * g.Tq; r += warp_rows_stride()) {
    const qrow w = qrow_at(g, es, r, q, k, v, mask);
    for (int64_t c0 = 0; c0 < g.dv; c0 += DSP__CU_ATTN_CHUNK) {
      double acc[DSP__CU_ATTN_REG];
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) acc[t] = 0.0;
      dsp__cu_osm o = dsp__cu_osm_init();
      for (int64_t j = 0; j < w.ni; j++) {
        if (!sees(w.mb, j)) continue;
        double s = warp_dot(w.qr, w.kh + (size_t)(j * g.d) * es, f64, g.d, lane) * g.scale;
        double corr, p;
        dsp__cu_osm_add(&o, s, &corr, &p);
        for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
          int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
          if (c < g.dv)
            acc[t] = acc[t] * corr + p * dsp__cu_attn_ld(w.vh, f64, j * g.dv + c);
        }
      }
      const double inv = dsp__cu_osm_inv(&o);
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
        int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
        if (c < g.dv) dsp__cu_attn_st(out, f64, r * g.dv + c, acc[t] * inv);
      }
    }
  }
}

/* Backward pass 1, one warp per query row: its log-sum-exp, D = sum_j
 * p_j (dO . v_j), and dq = scale sum_j p_j (dO . v_j - D) k_j. */
__global__ void k_attn_bwd_q(dsp__cu_attn_geo g, int f64, const void *dout,
                             const void *q, const void *k, const void *v,
                             const uint8_t *mask, double *lse, double *D,
                             void *dq) {
  const int lane = threadIdx.x % DSP__CU_ATTN_LANES;
  const size_t es = f64 ? 8 : 4;
  for (int64_t r = warp_row0(); r < g.B * g.H * g.Tq; r += warp_rows_stride()) {
    const qrow w = qrow_at(g, es, r, q, k, v, mask);
    const char *gr = (const char *)dout + (size_t)(r * g.dv) * es;
    dsp__cu_osm o = dsp__cu_osm_init();
    for (int64_t j = 0; j < w.ni; j++) {
      if (!sees(w.mb, j)) continue;
      double corr, p;
      dsp__cu_osm_add(&o, warp_dot(w.qr, w.kh + (size_t)(j * g.d) * es, f64, g.d, lane) * g.scale,
                      &corr, &p);
    }
    const double L = dsp__cu_osm_lse(&o);
    double Dr = 0.0;
    for (int64_t j = 0; j < w.ni; j++) {
      if (!sees(w.mb, j)) continue;
      double s = warp_dot(w.qr, w.kh + (size_t)(j * g.d) * es, f64, g.d, lane) * g.scale;
      Dr += exp(s - L) * warp_dot(gr, w.vh + (size_t)(j * g.dv) * es, f64, g.dv, lane);
    }
    if (lane == 0) lse[r] = L, D[r] = Dr;
    for (int64_t c0 = 0; c0 < g.d; c0 += DSP__CU_ATTN_CHUNK) {
      double acc[DSP__CU_ATTN_REG];
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) acc[t] = 0.0;
      for (int64_t j = 0; j < w.ni; j++) {
        if (!sees(w.mb, j)) continue;
        const char *kj = w.kh + (size_t)(j * g.d) * es;
        double s = warp_dot(w.qr, kj, f64, g.d, lane) * g.scale;
        double dp = warp_dot(gr, w.vh + (size_t)(j * g.dv) * es, f64, g.dv, lane);
        double ds = exp(s - L) * (dp - Dr);
        for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
          int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
          if (c < g.d) acc[t] += ds * dsp__cu_attn_ld(kj, f64, c);
        }
      }
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
        int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
        if (c < g.d) dsp__cu_attn_st(dq, f64, r * g.d + c, acc[t] * g.scale);
      }
    }
  }
}

/* Backward pass 2, one warp per key row j: over the queries that see it,
 * dv_j = sum_i p_ij dO_i and dk_j = scale sum_i p_ij (dO_i . v_j - D_i) q_i
 * (0 for a masked key). */
__global__ void k_attn_bwd_kv(dsp__cu_attn_geo g, int f64, const void *dout,
                              const void *q, const void *k, const void *v,
                              const uint8_t *mask, const double *lse,
                              const double *D, void *dk, void *dv) {
  const int lane = threadIdx.x % DSP__CU_ATTN_LANES;
  const size_t es = f64 ? 8 : 4;
  const int64_t wide = g.d > g.dv ? g.d : g.dv;
  for (int64_t r = warp_row0(); r < g.B * g.H * g.Tk; r += warp_rows_stride()) {
    const int64_t bh = r / g.Tk, j = r % g.Tk;
    const int on = !mask || mask[(bh / g.H) * g.Tk + j];
    const char *kj = (const char *)k + (size_t)(r * g.d) * es;
    const char *vj = (const char *)v + (size_t)(r * g.dv) * es;
    const char *qh = (const char *)q + (size_t)(bh * g.Tq * g.d) * es;
    const char *gh = (const char *)dout + (size_t)(bh * g.Tq * g.dv) * es;
    for (int64_t c0 = 0; c0 < wide; c0 += DSP__CU_ATTN_CHUNK) {
      double ak[DSP__CU_ATTN_REG], av[DSP__CU_ATTN_REG];
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) ak[t] = 0.0, av[t] = 0.0;
      for (int64_t i = g.causal ? j : 0; on && i < g.Tq; i++) {
        const char *qi = qh + (size_t)(i * g.d) * es, *gi = gh + (size_t)(i * g.dv) * es;
        const int64_t row = bh * g.Tq + i;
        double p = exp(warp_dot(qi, kj, f64, g.d, lane) * g.scale - lse[row]);
        double ds = p * (warp_dot(gi, vj, f64, g.dv, lane) - D[row]);
        for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
          int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
          if (c < g.d) ak[t] += ds * dsp__cu_attn_ld(qi, f64, c);
          if (c < g.dv) av[t] += p * dsp__cu_attn_ld(gi, f64, c);
        }
      }
      for (int t = 0; t < DSP__CU_ATTN_REG; t++) {
        int64_t c = c0 + lane + t * DSP__CU_ATTN_LANES;
        if (c < g.d) dsp__cu_attn_st(dk, f64, r * g.d + c, ak[t] * g.scale);
        if (c < g.dv) dsp__cu_attn_st(dv, f64, r * g.dv + c, av[t]);
      }
    }
  }
}

static unsigned attn_grid(int64_t rows) {
  int64_t b = (rows + DSP__CU_ATTN_WARPS - 1) / DSP__CU_ATTN_WARPS;
  return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

extern "C" int dsp__cuk_attention(cudaStream_t st, const dsp__cu_attn_geo *g,
                                  int f64, const void *q, const void *k,
                                  const void *v, const uint8_t *mask,
                                  void *out) {
  const int64_t rows = g->B * g->H * g->Tq;
  if (rows <= 0 || g->dv <= 0) return 0;
  k_attn_fwd<<<attn_grid(rows), TPB_ATTN, 0, st>>>(*g, f64, q, k, v, mask, out);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_attention_backward(
    cudaStream_t st, const dsp__cu_attn_geo *g, int f64, const void *dout,
    const void *q, const void *k, const void *v, const uint8_t *mask,
    double *scratch, void *dq, void *dk, void *dv) {
  const int64_t qrows = g->B * g->H * g->Tq, krows = g->B * g->H * g->Tk;
  if (qrows > 0) {
    k_attn_bwd_q<<<attn_grid(qrows), TPB_ATTN, 0, st>>>(
        *g, f64, dout, q, k, v, mask, scratch, scratch + qrows, dq);
    int e = (int)cudaGetLastError();
    if (e) return e;
  }
  if (krows > 0)
    k_attn_bwd_kv<<<attn_grid(krows), TPB_ATTN, 0, st>>>(
        *g, f64, dout, q, k, v, mask, scratch, scratch + qrows, dk, dv);
  return (int)cudaGetLastError();
}
