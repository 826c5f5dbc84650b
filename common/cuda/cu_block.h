/* Device-side helpers the .cu files share (C++, nvcc only): the launch
 * grid sizes and the block tree reduction. The tree is the one the host
 * tests replay (tests/test_cuda_host.c), so every kernel that merges its
 * partials through block_reduce gives the same bits for any grid. */
#ifndef DSP_CU_BLOCK_H
#define DSP_CU_BLOCK_H

#include <stdint.h>

#include "cuda_math.h"

#define TPB DSP__CU_TPB
#define MAX_GRID 65535

/* one thread per element, grid-stride past MAX_GRID blocks */
static inline unsigned grid_for(int64_t n) {
  int64_t g = (n + TPB - 1) / TPB;
  if (g < 1) g = 1;
  return (unsigned)(g > MAX_GRID ? MAX_GRID : g);
}
/* one block per row */
static inline unsigned grid_rows(int64_t rows) {
  return (unsigned)(rows < 1 ? 1 : rows > MAX_GRID ? MAX_GRID : rows);
}

/* One tree merge of a block's TPB partials; every thread gets the result. */
template <typename A, typename M>
__device__ A block_reduce(A v, M merge) {
  __shared__ A sh[TPB];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = TPB / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) sh[threadIdx.x] = merge(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  A r = sh[0];
  __syncthreads();
  return r;
}
struct ksum_merge {
  __device__ dsp__cu_ksum operator()(dsp__cu_ksum a, dsp__cu_ksum b) const {
    return dsp__cu_ksum_merge(a, b);
  }
};
struct lse_merge {
  __device__ dsp__cu_lse operator()(dsp__cu_lse a, dsp__cu_lse b) const {
    return dsp__cu_lse_merge(a, b);
  }
};

#endif
