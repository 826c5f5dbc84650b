/* issue 23: loss, and conv2d_bias's bias add (k_bias_add, at the end).
 * CUDA kernels of cross_entropy_ex and its backward op:
 * one block per label position (its C logits at stride inner), the row's
 * log-sum-exp and sum as block tree reductions, the per-position math of
 * loss_math.h; a one-block compensated sum for the sum and mean. */
#include <stdint.h>

#include "cu_block.h"
#include "cuda_kern.h"
#include "loss_kern.h"
#include "loss_math.h"

namespace {

struct count_merge {
  __device__ long long operator()(long long a, long long b) const { return a + b; }
};

__global__ void k_ce_ex_bad(const int64_t *lab, int64_t n, int64_t C,
                            int64_t ignore, unsigned long long *pos) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    if (lab[i] != ignore && (lab[i] < 0 || lab[i] >= C))
      atomicMin(pos, (unsigned long long)i);
}

/* the number of non-ignored labels, one block */
__device__ long long count_kept(const int64_t *lab, int64_t n, int64_t ignore) {
  long long k = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) k += lab[i] != ignore;
  return block_reduce(k, count_merge());
}

__global__ void k_ce_ex_count(const int64_t *lab, int64_t n, int64_t ignore,
                              double *cnt) {
  long long k = count_kept(lab, n, ignore);
  if (threadIdx.x == 0) cnt[0] = (double)k;
}

/* one block per position i: forward (g NULL) writes its loss to out[i]
 * (reduction none) or loss[i]; backward writes the C gradients */
template <typename T>
__global__ void k_ce_ex_rows(int64_t outer, int64_t C, int64_t inner,
                             int64_t ignore, int red, double eps, const T *g,
                             const double *cnt, const T *x, const int64_t *lab,
                             double *loss, T *out) {
  const int64_t n = outer * inner;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t o = i / inner, s = i % inner, base = o * C * inner + s;
    const int64_t y = lab[i];
    if (y == ignore) { /* the same branch for the whole block */
      if (g)
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[base + c * inner] = (T)0;
      else if (threadIdx.x == 0 && red == 0)
        out[i] = (T)0;
      else if (threadIdx.x == 0)
        loss[i] = 0.0;
      continue;
    }
    dsp__cu_lse l = dsp__cu_lse_id();
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      l = dsp__cu_lse_merge(l, dsp__cu_lse_elem((double)x[base + c * inner]));
    l = dsp__cu_lse_final(block_reduce(l, lse_merge()));
    const double lse = l.m + log(l.s);
    if (!g) {
      double sx = 0.0;
      if (eps > 0.0) {
        dsp__cu_ksum acc = dsp__cu_ksum_zero();
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
          dsp__cu_ksum_add(&acc, (double)x[base + c * inner]);
        sx = dsp__cu_ksum_value(block_reduce(acc, ksum_merge()));
      }
      if (threadIdx.x == 0) {
        double v = dsp__cu_ce_loss(lse, sx, (double)x[base + y * inner], C, eps);
        if (red == 0) out[i] = (T)v;
        else loss[i] = v;
      }
      continue;
    }
    const double w = red == 0 ? (double)g[i]
                     : red == 1 ? (double)g[0] : (double)g[0] / cnt[0];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      out[base + c * inner] =
          (T)dsp__cu_ce_grad((double)x[base + c * inner], lse, c == y, C, eps, w);
  }
}

/* out[0] = the sum of loss[0..n) (mean: over the non-ignored count; all
 * ignored: 0/0 = NaN), one block */
template <typename T>
__global__ void k_ce_ex_total(int64_t n, const double *loss, const int64_t *lab,
                              int64_t ignore, int mean, T *out) {
  dsp__cu_ksum acc = dsp__cu_ksum_zero();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dsp__cu_ksum_add(&acc, loss[i]);
  acc = block_reduce(acc, ksum_merge());
  long long k = mean ? count_kept(lab, n, ignore) : 0;
  if (threadIdx.x == 0) {
    double s = dsp__cu_ksum_value(acc);
    out[0] = (T)(mean ? s / (double)k : s);
  }
}

template <typename T>
void launch(cudaStream_t st, int64_t outer, int64_t C, int64_t inner,
            int64_t ignore, int red, double eps, const T *g, const T *x,
            const int64_t *lab, double *scratch, T *out) {
  const int64_t n = outer * inner;
  if (g) {
    if (red == 2) k_ce_ex_count<<<1, TPB, 0, st>>>(lab, n, ignore, scratch);
    if (n > 0)
      k_ce_ex_rows<T><<<grid_rows(n), TPB, 0, st>>>(outer, C, inner, ignore, red,
                                                    eps, g, scratch, x, lab, NULL, out);
    return;
  }
  if (n > 0)
    k_ce_ex_rows<T><<<grid_rows(n), TPB, 0, st>>>(outer, C, inner, ignore, red, eps,
                                                  NULL, NULL, x, lab, scratch, out);
  if (red != 0)
    k_ce_ex_total<T><<<1, TPB, 0, st>>>(n, scratch, lab, ignore, red == 2, out);
}

template <typename T>
__global__ void k_bias_add(int64_t n, int64_t O, int64_t hw, const T *b, T *out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = (T)dsp__cu_bias_add((double)out[i], (double)b[(i / hw) % O]);
}

}  // namespace

extern "C" int dsp__cuk_bias_add(cudaStream_t st, int dt, int64_t n, int64_t O,
                                 int64_t hw, const void *bias, void *out) {
  if (n <= 0 || hw <= 0) return 0;
  if (dt == DSP_F32)
    k_bias_add<float><<<grid_for(n), TPB, 0, st>>>(n, O, hw, (const float *)bias, (float *)out);
  else
    k_bias_add<double><<<grid_for(n), TPB, 0, st>>>(n, O, hw, (const double *)bias, (double *)out);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_ce_ex_bad(cudaStream_t st, const int64_t *lab, int64_t n,
                                  int64_t C, int64_t ignore, int64_t *host_pos) {
  *host_pos = -1;
  if (n <= 0) return 0;
  unsigned long long *d = NULL, h = ~0ull;
  cudaError_t e = cudaMallocAsync((void **)&d, sizeof *d, st);
  if (e != cudaSuccess) return (int)e;
  if ((e = cudaMemsetAsync(d, 0xff, sizeof *d, st)) == cudaSuccess) {
    k_ce_ex_bad<<<grid_for(n), TPB, 0, st>>>(lab, n, C, ignore, d);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, st);
  cudaFreeAsync(d, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e == cudaSuccess && h != ~0ull) *host_pos = (int64_t)h;
  return (int)e;
}

extern "C" int dsp__cuk_ce_ex(cudaStream_t st, int dt, int64_t outer, int64_t C,
                              int64_t inner, int64_t ignore, int reduction,
                              double eps, const void *g, const void *x,
                              const int64_t *lab, double *scratch, void *out) {
  if (dt == DSP_F32)
    launch<float>(st, outer, C, inner, ignore, reduction, eps, (const float *)g,
                  (const float *)x, lab, scratch, (float *)out);
  else
    launch<double>(st, outer, C, inner, ignore, reduction, eps, (const double *)g,
                   (const double *)x, lab, scratch, (double *)out);
  return (int)cudaGetLastError();
}
