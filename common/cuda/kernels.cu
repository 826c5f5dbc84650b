/* CUDA kernels: grid loops around the shared math of cuda_math.h. Every
 * launcher returns cudaGetLastError() of its launches (0 when enqueued);
 * errors of the running kernel surface at the stream's next
 * synchronisation, which the backend turns into a DISPATCH_E* code. */
#include <stdint.h>
#include <string.h>

#include "cu_block.h"
#include "cuda_kern.h"

#define GRID_LOOP(i, n)                                                      \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

/* typed fronts for the C functions of cuda_math.h */
__device__ inline float bin(int op, float x, float y) { return dsp__sm_bin_f32(op, x, y); }
__device__ inline double bin(int op, double x, double y) { return dsp__sm_bin_f64(op, x, y); }
__device__ inline int64_t bin(int op, int64_t x, int64_t y) { return dsp__sm_bin_i64(op, x, y); }
__device__ inline uint8_t bin(int, uint8_t, uint8_t) { return 0; }
__device__ inline uint8_t cmp(int op, float x, float y) { return dsp__sm_cmp_f32(op, x, y); }
__device__ inline uint8_t cmp(int op, double x, double y) { return dsp__sm_cmp_f64(op, x, y); }
__device__ inline uint8_t cmp(int op, int64_t x, int64_t y) { return dsp__sm_cmp_i64(op, x, y); }
__device__ inline uint8_t cmp(int op, uint8_t x, uint8_t y) { return dsp__sm_cmp_u8(op, x, y); }

__device__ inline float clampv(float x, float lo, float hi) { return dsp__sm_clamp_f32(x, lo, hi); }
__device__ inline double clampv(double x, double lo, double hi) { return dsp__sm_clamp_f64(x, lo, hi); }
__device__ inline int64_t clampv(int64_t x, int64_t lo, int64_t hi) { return dsp__sm_clamp_i64(x, lo, hi); }

__device__ inline float map1(int op, float x, float y, double s) {
  if (op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR)
    return dsp__sm_scalar_f32(op, x, (float)s);
  if (dsp__sm_is_act_bw(op)) return dsp__sm_act_bw_f32(op, x, y);
  return dsp__sm_unary_f32(op, x);
}
__device__ inline double map1(int op, double x, double y, double s) {
  if (op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR)
    return dsp__sm_scalar_f64(op, x, s);
  if (dsp__sm_is_act_bw(op)) return dsp__sm_act_bw_f64(op, x, y);
  return dsp__sm_unary_f64(op, x);
}
__device__ inline int64_t map1(int op, int64_t x, int64_t y, double s) {
  if (op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR)
    return dsp__sm_scalar_i64(op, x, (int64_t)s);
  if (op == DSP_OP_RELU_BACKWARD) return dsp__sm_act_bw_i64(op, x, y);
  return dsp__sm_unary_i64(op, x);
}

/* ------------------------------------------------------------------ */
/* the half types: stored in two bytes, computed in f32. wide() reads an
 * element as its compute type (a half as its exact f32), narrow<T>()
 * stores a compute-type value (a half rounded once to nearest even, with
 * common/half.h, the CPU's conversion); both are the identity for the
 * other types. A half kernel is therefore the f32 kernel between one
 * exact read and one rounding: what the op runner's widening computes on
 * the CPU, with no temporaries. */
template <typename T> struct acc_t { typedef T type; };
template <> struct acc_t<dsp__cu_f16> { typedef float type; };
template <> struct acc_t<dsp__cu_bf16> { typedef float type; };

template <typename T>
__device__ inline T wide(T v) { return v; }
__device__ inline float wide(dsp__cu_f16 v) { return dsp_f16_to_f32(v.v); }
__device__ inline float wide(dsp__cu_bf16 v) { return dsp_bf16_to_f32(v.v); }

template <typename T>
__host__ __device__ inline T narrow(typename acc_t<T>::type v) { return v; }
template <>
__host__ __device__ inline dsp__cu_f16 narrow<dsp__cu_f16>(float v) { return dsp__cu_f16{dsp_f32_to_f16(v)}; }
template <>
__host__ __device__ inline dsp__cu_bf16 narrow<dsp__cu_bf16>(float v) { return dsp__cu_bf16{dsp_f32_to_bf16(v)}; }
/* a double result stored as T: through the compute type, as the f32
 * kernel the widening runs would store it, then rounded once */
template <typename T>
__device__ inline T from_d(double v) { return narrow<T>((typename acc_t<T>::type)v); }

/* ------------------------------------------------------------------ */
/* elementwise                                                         */

template <typename T>
__global__ void k_binary(int op, int is_cmp, int64_t n, dsp__cu_index ix,
                         const T *a, const T *b, void *out) {
  GRID_LOOP(i, n) {
    int64_t off[3];
    dsp__cu_offsets(&ix, i, off);
    if (is_cmp) ((uint8_t *)out)[i] = cmp(op, wide(a[off[0]]), wide(b[off[1]]));
    else ((T *)out)[i] = narrow<T>(bin(op, wide(a[off[0]]), wide(b[off[1]])));
  }
}

extern "C" int dsp__cuk_binary(cudaStream_t st, int op, int dt, int64_t n,
                               const dsp__cu_index *ix, const void *a,
                               const void *b, void *out) {
  if (n <= 0) return 0;
  int c = op >= DSP_OP_EQ && op <= DSP_OP_GE;
  switch (dt) {
    case DSP_F32: k_binary<float><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const float *)a, (const float *)b, out); break;
    case DSP_F64: k_binary<double><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const double *)a, (const double *)b, out); break;
    case DSP_I64: k_binary<int64_t><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const int64_t *)a, (const int64_t *)b, out); break;
    case DSP_F16: k_binary<dsp__cu_f16><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const dsp__cu_f16 *)a, (const dsp__cu_f16 *)b, out); break;
    case DSP_BF16: k_binary<dsp__cu_bf16><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const dsp__cu_bf16 *)a, (const dsp__cu_bf16 *)b, out); break;
    default: k_binary<uint8_t><<<grid_for(n), TPB, 0, st>>>(op, c, n, *ix, (const uint8_t *)a, (const uint8_t *)b, out); break;
  }
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_where(int64_t n, dsp__cu_index ix, const uint8_t *m,
                        const T *a, const T *b, T *out) {
  GRID_LOOP(i, n) {
    int64_t off[3];
    dsp__cu_offsets(&ix, i, off);
    out[i] = m[off[0]] ? a[off[1]] : b[off[2]];
  }
}

extern "C" int dsp__cuk_where(cudaStream_t st, int es, int64_t n,
                              const dsp__cu_index *ix, const void *m,
                              const void *a, const void *b, void *out) {
  if (n <= 0) return 0;
  const uint8_t *mm = (const uint8_t *)m;
  /* bit copies, so NaN payloads survive */
  if (es == 1) k_where<uint8_t><<<grid_for(n), TPB, 0, st>>>(n, *ix, mm, (const uint8_t *)a, (const uint8_t *)b, (uint8_t *)out);
  else if (es == 2) k_where<uint16_t><<<grid_for(n), TPB, 0, st>>>(n, *ix, mm, (const uint16_t *)a, (const uint16_t *)b, (uint16_t *)out);
  else if (es == 4) k_where<uint32_t><<<grid_for(n), TPB, 0, st>>>(n, *ix, mm, (const uint32_t *)a, (const uint32_t *)b, (uint32_t *)out);
  else k_where<uint64_t><<<grid_for(n), TPB, 0, st>>>(n, *ix, mm, (const uint64_t *)a, (const uint64_t *)b, (uint64_t *)out);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_map(int op, int64_t n, const T *x, const T *y, double s, T *out) {
  typedef typename acc_t<T>::type A;
  GRID_LOOP(i, n) out[i] = narrow<T>(map1(op, wide(x[i]), y ? wide(y[i]) : (A)0, s));
}

extern "C" int dsp__cuk_map(cudaStream_t st, int op, int dt, int64_t n,
                            const void *x, const void *y, double s, void *out) {
  if (n <= 0) return 0;
  switch (dt) {
    case DSP_F32: k_map<float><<<grid_for(n), TPB, 0, st>>>(op, n, (const float *)x, (const float *)y, s, (float *)out); break;
    case DSP_F64: k_map<double><<<grid_for(n), TPB, 0, st>>>(op, n, (const double *)x, (const double *)y, s, (double *)out); break;
    case DSP_F16: k_map<dsp__cu_f16><<<grid_for(n), TPB, 0, st>>>(op, n, (const dsp__cu_f16 *)x, (const dsp__cu_f16 *)y, s, (dsp__cu_f16 *)out); break;
    case DSP_BF16: k_map<dsp__cu_bf16><<<grid_for(n), TPB, 0, st>>>(op, n, (const dsp__cu_bf16 *)x, (const dsp__cu_bf16 *)y, s, (dsp__cu_bf16 *)out); break;
    default: k_map<int64_t><<<grid_for(n), TPB, 0, st>>>(op, n, (const int64_t *)x, (const int64_t *)y, s, (int64_t *)out); break;
  }
  return (int)cudaGetLastError();
}

/* clamp: the bounds already in the tensor's compute type */
template <typename T>
__global__ void k_clamp(int64_t n, const T *x, typename acc_t<T>::type lo,
                        typename acc_t<T>::type hi, T *out) {
  GRID_LOOP(i, n) out[i] = narrow<T>(clampv(wide(x[i]), lo, hi));
}

static int64_t bound_i64(double v) {
  return v <= -0x1p63 ? INT64_MIN : v >= 0x1p63 ? INT64_MAX : (int64_t)v;
}

extern "C" int dsp__cuk_clamp(cudaStream_t st, int dt, int64_t n,
                              const void *x, double lo, double hi, void *out) {
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  switch (dt) {
    case DSP_F32: k_clamp<float><<<g, TPB, 0, st>>>(n, (const float *)x, (float)lo, (float)hi, (float *)out); break;
    case DSP_F64: k_clamp<double><<<g, TPB, 0, st>>>(n, (const double *)x, lo, hi, (double *)out); break;
    case DSP_F16: k_clamp<dsp__cu_f16><<<g, TPB, 0, st>>>(n, (const dsp__cu_f16 *)x, (float)lo, (float)hi, (dsp__cu_f16 *)out); break;
    case DSP_BF16: k_clamp<dsp__cu_bf16><<<g, TPB, 0, st>>>(n, (const dsp__cu_bf16 *)x, (float)lo, (float)hi, (dsp__cu_bf16 *)out); break;
    default: k_clamp<int64_t><<<g, TPB, 0, st>>>(n, (const int64_t *)x, bound_i64(lo), bound_i64(hi), (int64_t *)out); break;
  }
  return (int)cudaGetLastError();
}

/* masked_fill: operand 0 of ix is the mask, operand 1 x (x's shape is
 * the output's) */
template <typename T>
__global__ void k_masked_fill(int64_t n, dsp__cu_index ix, const uint8_t *m,
                              const T *x, T v, T *out) {
  GRID_LOOP(i, n) {
    int64_t off[3];
    dsp__cu_offsets(&ix, i, off);
    out[i] = m[off[0]] ? v : narrow<T>(wide(x[off[1]])); /* a half NaN quieted, as widened */
  }
}

extern "C" int dsp__cuk_masked_fill(cudaStream_t st, int dt, int64_t n,
                                    const dsp__cu_index *ix, const void *m,
                                    const void *x, double v, void *out) {
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  const uint8_t *mm = (const uint8_t *)m;
  switch (dt) {
    case DSP_F32: k_masked_fill<float><<<g, TPB, 0, st>>>(n, *ix, mm, (const float *)x, (float)v, (float *)out); break;
    case DSP_F64: k_masked_fill<double><<<g, TPB, 0, st>>>(n, *ix, mm, (const double *)x, v, (double *)out); break;
    /* the fill value as the widened op has it: the f32 of v, rounded */
    case DSP_F16: k_masked_fill<dsp__cu_f16><<<g, TPB, 0, st>>>(n, *ix, mm, (const dsp__cu_f16 *)x, narrow<dsp__cu_f16>((float)v), (dsp__cu_f16 *)out); break;
    case DSP_BF16: k_masked_fill<dsp__cu_bf16><<<g, TPB, 0, st>>>(n, *ix, mm, (const dsp__cu_bf16 *)x, narrow<dsp__cu_bf16>((float)v), (dsp__cu_bf16 *)out); break;
    default: k_masked_fill<int64_t><<<g, TPB, 0, st>>>(n, *ix, mm, (const int64_t *)x, (int64_t)v, (int64_t *)out); break;
  }
  return (int)cudaGetLastError();
}

__global__ void k_first_bad(const int64_t *v, int64_t n, int64_t lo, int64_t hi,
                            int zero_only, unsigned long long *pos) {
  GRID_LOOP(i, n) {
    int bad = zero_only ? v[i] == 0 : (v[i] < lo || v[i] >= hi);
    if (bad) atomicMin(pos, (unsigned long long)i);
  }
}

extern "C" int dsp__cuk_first_bad(cudaStream_t st, const int64_t *v, int64_t n,
                                  int64_t lo, int64_t hi, int zero_only,
                                  int64_t *host_pos) {
  *host_pos = -1;
  if (n <= 0) return 0;
  unsigned long long *d = NULL, h = ~0ull;
  cudaError_t e = cudaMallocAsync((void **)&d, sizeof *d, st);
  if (e != cudaSuccess) return (int)e;
  if ((e = cudaMemsetAsync(d, 0xff, sizeof *d, st)) == cudaSuccess) {
    k_first_bad<<<grid_for(n), TPB, 0, st>>>(v, n, lo, hi, zero_only, d);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, st);
  cudaFreeAsync(d, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e == cudaSuccess && h != ~0ull) *host_pos = (int64_t)h;
  return (int)e;
}

/* ------------------------------------------------------------------ */
/* reductions                                                          */

/* Reduction policies: the partial's type A, its identity, how an element
 * enters it, the merge (also the functor block_reduce calls), and the
 * store of the output element. */
template <typename T>
struct RSum {
  typedef dsp__cu_ksum A;
  int mean;
  __device__ A id() const { return dsp__cu_ksum_zero(); }
  template <typename V>
  __device__ void add(A &a, V v, int64_t) const { dsp__cu_ksum_add(&a, (double)v); }
  __device__ A operator()(A a, A b) const { return dsp__cu_ksum_merge(a, b); }
  __device__ void store(void *out, int64_t o, A a, int64_t R) const {
    double v = dsp__cu_ksum_value(a);
    ((T *)out)[o] = (T)(mean ? v / (double)R : v);
  }
};
struct RSumI {
  typedef uint64_t A;
  __device__ A id() const { return 0; }
  __device__ void add(A &a, int64_t v, int64_t) const { a += (uint64_t)v; }
  __device__ A operator()(A a, A b) const { return a + b; }
  __device__ void store(void *out, int64_t o, A a, int64_t) const {
    ((int64_t *)out)[o] = (int64_t)a;
  }
};
/* max/argmax, or min/argmin when mn is set */
template <typename T>
struct RMaxF {
  typedef dsp__cu_amax_f A;
  int arg, mn;
  __device__ A id() const { return mn ? dsp__cu_amin_f_id() : dsp__cu_amax_f_id(); }
  __device__ A operator()(A a, A b) const {
    return mn ? dsp__cu_amin_f_merge(a, b) : dsp__cu_amax_f_merge(a, b);
  }
  __device__ void add(A &a, T v, int64_t r) const {
    A c;
    c.v = (double)v, c.i = r;
    a = (*this)(a, c);
  }
  __device__ void store(void *out, int64_t o, A a, int64_t) const {
    if (arg) ((int64_t *)out)[o] = a.i;
    else ((T *)out)[o] = (T)a.v;
  }
};
struct RMaxI {
  typedef dsp__cu_amax_i A;
  int arg, mn;
  __device__ A id() const { return mn ? dsp__cu_amin_i_id() : dsp__cu_amax_i_id(); }
  __device__ A operator()(A a, A b) const {
    return mn ? dsp__cu_amin_i_merge(a, b) : dsp__cu_amax_i_merge(a, b);
  }
  __device__ void add(A &a, int64_t v, int64_t r) const {
    A c;
    c.v = v, c.i = r;
    a = (*this)(a, c);
  }
  __device__ void store(void *out, int64_t o, A a, int64_t) const {
    ((int64_t *)out)[o] = arg ? a.i : a.v;
  }
};

/* var/std's second pass: the compensated sum of the squared deviations,
 * stored through dsp__cu_var_final */
template <typename T>
struct RVar {
  typedef dsp__cu_ksum A;
  double corr;
  int sq;
  __device__ A id() const { return dsp__cu_ksum_zero(); }
  __device__ void add(A &a, double v, int64_t) const { dsp__cu_ksum_add(&a, v); }
  __device__ A operator()(A a, A b) const { return dsp__cu_ksum_merge(a, b); }
  __device__ void store(void *out, int64_t o, A a, int64_t R) const {
    ((T *)out)[o] = (T)dsp__cu_var_final(dsp__cu_ksum_value(a), (double)R, corr, sq);
  }
};

static_assert(sizeof(dsp__cu_ksum) <= DSP__CU_RED_PART_BYTES &&
                  sizeof(dsp__cu_amax_f) <= DSP__CU_RED_PART_BYTES &&
                  sizeof(dsp__cu_amax_i) <= DSP__CU_RED_PART_BYTES,
              "a reduction partial outgrew its scratch slot");

/* element loaders, given the output o and the element offset i: x[i],
 * mse's squared difference in double, or var's squared deviation from
 * the mean of output o */
template <typename T>
struct LoadX {
  const T *x;
  __device__ T operator()(int64_t, int64_t i) const { return x[i]; }
};
template <typename T>
struct LoadSqDiff {
  const T *a, *b;
  __device__ double operator()(int64_t, int64_t i) const {
    double d = (double)a[i] - (double)b[i];
    return d * d;
  }
};
template <typename T>
struct LoadSqDev {
  const T *x;
  const double *mean;
  __device__ double operator()(int64_t o, int64_t i) const {
    double d = (double)x[i] - mean[o];
    return d * d;
  }
};

/* Block b reduces chunk b % S of output b / S (dsp__cu_red_chunk): the
 * output itself when S == 1, else partial b for k_red_fin. */
template <typename L, typename P>
__global__ void k_red(P p, L ld, int64_t n_out, int64_t S, dsp__cu_index outer,
                      dsp__cu_index inner, int64_t R, void *out,
                      typename P::A *part) {
  for (int64_t b = blockIdx.x; b < n_out * S; b += gridDim.x) {
    int64_t o = b / S, lo, hi, oo[3];
    dsp__cu_red_chunk(R, S, b % S, &lo, &hi);
    dsp__cu_offsets(&outer, o, oo);
    typename P::A acc = p.id();
    for (int64_t r = lo + threadIdx.x; r < hi; r += blockDim.x) {
      int64_t io[3];
      dsp__cu_offsets(&inner, r, io);
      p.add(acc, ld(o, oo[0] + io[0]), r);
    }
    acc = block_reduce(acc, p);
    if (threadIdx.x == 0) {
      if (S == 1) p.store(out, o, acc, R);
      else part[b] = acc;
    }
  }
}

/* merges the S partials of each output, thread t taking t, t+TPB, ... */
template <typename P>
__global__ void k_red_fin(P p, int64_t n_out, int64_t S, int64_t R,
                          const typename P::A *part, void *out) {
  for (int64_t o = blockIdx.x; o < n_out; o += gridDim.x) {
    typename P::A acc = p.id();
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) acc = p(acc, part[o * S + s]);
    acc = block_reduce(acc, p);
    if (threadIdx.x == 0) p.store(out, o, acc, R);
  }
}

template <typename L, typename P>
static int red_launch(cudaStream_t st, P p, L ld, int64_t n_out, int64_t S,
                      const dsp__cu_index *outer, const dsp__cu_index *inner,
                      int64_t R, void *out, void *part) {
  typename P::A *pp = (typename P::A *)part;
  k_red<L, P><<<grid_rows(n_out * S), TPB, 0, st>>>(p, ld, n_out, S, *outer, *inner,
                                                     R, out, pp);
  if (S > 1) k_red_fin<P><<<grid_rows(n_out), TPB, 0, st>>>(p, n_out, S, R, pp, out);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_reduce(cudaStream_t st, int op, int dt, int64_t n_out,
                               int64_t S, const dsp__cu_index *outer,
                               const dsp__cu_index *inner, int64_t R,
                               const void *x, void *out, void *part) {
  if (n_out <= 0) return 0;
  const float *xf = (const float *)x;
  const double *xd = (const double *)x;
  const int64_t *xi = (const int64_t *)x;
  if (op == DSP_OP_SUM || op == DSP_OP_MEAN) {
    int mean = op == DSP_OP_MEAN;
    if (dt == DSP_F32) return red_launch(st, RSum<float>{mean}, LoadX<float>{xf}, n_out, S, outer, inner, R, out, part);
    if (dt == DSP_F64) return red_launch(st, RSum<double>{mean}, LoadX<double>{xd}, n_out, S, outer, inner, R, out, part);
    return red_launch(st, RSumI{}, LoadX<int64_t>{xi}, n_out, S, outer, inner, R, out, part);
  }
  int arg = op == DSP_OP_ARGMAX || op == DSP_OP_ARGMIN;
  int mn = op == DSP_OP_MIN || op == DSP_OP_ARGMIN;
  if (dt == DSP_F32) return red_launch(st, RMaxF<float>{arg, mn}, LoadX<float>{xf}, n_out, S, outer, inner, R, out, part);
  if (dt == DSP_F64) return red_launch(st, RMaxF<double>{arg, mn}, LoadX<double>{xd}, n_out, S, outer, inner, R, out, part);
  return red_launch(st, RMaxI{arg, mn}, LoadX<int64_t>{xi}, n_out, S, outer, inner, R, out, part);
}

/* var/std: the means (in double, into mean[n_out]) as a reduction, then
 * the squared deviations from them as a second one */
extern "C" int dsp__cuk_var(cudaStream_t st, int dt, int sq, double corr,
                            int64_t n_out, int64_t S, const dsp__cu_index *outer,
                            const dsp__cu_index *inner, int64_t R, const void *x,
                            double *mean, void *out, void *part) {
  if (n_out <= 0) return 0;
  int e;
  if (dt == DSP_F32) {
    const float *xf = (const float *)x;
    e = red_launch(st, RSum<double>{1}, LoadX<float>{xf}, n_out, S, outer, inner, R, mean, part);
    if (!e) e = red_launch(st, RVar<float>{corr, sq}, LoadSqDev<float>{xf, mean}, n_out, S, outer, inner, R, out, part);
  } else {
    const double *xd = (const double *)x;
    e = red_launch(st, RSum<double>{1}, LoadX<double>{xd}, n_out, S, outer, inner, R, mean, part);
    if (!e) e = red_launch(st, RVar<double>{corr, sq}, LoadSqDev<double>{xd, mean}, n_out, S, outer, inner, R, out, part);
  }
  return e;
}

/* mse: the mean of the n squared differences, one output reduced like a
 * full sum (split over blocks when n is long) */
extern "C" int dsp__cuk_mse(cudaStream_t st, int dt, int64_t n, int64_t S,
                            const void *a, const void *b, void *out, void *part) {
  if (n <= 0) return 0;
  dsp__cu_index one, all;
  memset(&one, 0, sizeof one), memset(&all, 0, sizeof all);
  one.nd = all.nd = 1, one.n = all.n = 1;
  one.shape[0] = 1, all.shape[0] = n, all.st[0][0] = 1;
  if (dt == DSP_F32)
    return red_launch(st, RSum<float>{1}, LoadSqDiff<float>{(const float *)a, (const float *)b},
                      1, S, &one, &all, n, out, part);
  return red_launch(st, RSum<double>{1}, LoadSqDiff<double>{(const double *)a, (const double *)b},
                    1, S, &one, &all, n, out, part);
}

/* ------------------------------------------------------------------ */
/* softmax family, cross entropy, mse                                  */

template <typename T>
__global__ void k_softmax(int op, int64_t outer, int64_t len, int64_t inner,
                          const T *x, const T *y, T *out) {
  for (int64_t row = blockIdx.x; row < outer * inner; row += gridDim.x) {
    int64_t base = (row / inner) * len * inner + row % inner;
    if (op == DSP_OP_SOFTMAX || op == DSP_OP_LOG_SOFTMAX) {
      dsp__cu_lse l = dsp__cu_lse_id();
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x)
        l = dsp__cu_lse_merge(l, dsp__cu_lse_elem((double)wide(x[base + j * inner])));
      l = dsp__cu_lse_final(block_reduce(l, lse_merge()));
      double ls = log(l.s);
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
        double v = (double)wide(x[base + j * inner]) - l.m;
        out[base + j * inner] = from_d<T>(op == DSP_OP_SOFTMAX ? exp(v) / l.s : v - ls);
      }
    } else {
      int sm = op == DSP_OP_SOFTMAX_BACKWARD;
      dsp__cu_ksum acc = dsp__cu_ksum_zero();
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
        double g = (double)wide(x[base + j * inner]);
        dsp__cu_ksum_add(&acc, sm ? g * (double)wide(y[base + j * inner]) : g);
      }
      double s = dsp__cu_ksum_value(block_reduce(acc, ksum_merge()));
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
        int64_t i = base + j * inner;
        double g = (double)wide(x[i]), yy = (double)wide(y[i]);
        out[i] = from_d<T>(sm ? yy * (g - s) : g - exp(yy) * s);
      }
    }
  }
}

extern "C" int dsp__cuk_softmax(cudaStream_t st, int op, int dt, int64_t outer,
                                int64_t len, int64_t inner, const void *x,
                                const void *y, void *out) {
  if (outer * inner <= 0 || len <= 0) return 0;
  unsigned g = grid_rows(outer * inner);
  if (dt == DSP_F32) k_softmax<float><<<g, TPB, 0, st>>>(op, outer, len, inner, (const float *)x, (const float *)y, (float *)out);
  else if (dt == DSP_F16) k_softmax<dsp__cu_f16><<<g, TPB, 0, st>>>(op, outer, len, inner, (const dsp__cu_f16 *)x, (const dsp__cu_f16 *)y, (dsp__cu_f16 *)out);
  else if (dt == DSP_BF16) k_softmax<dsp__cu_bf16><<<g, TPB, 0, st>>>(op, outer, len, inner, (const dsp__cu_bf16 *)x, (const dsp__cu_bf16 *)y, (dsp__cu_bf16 *)out);
  else k_softmax<double><<<g, TPB, 0, st>>>(op, outer, len, inner, (const double *)x, (const double *)y, (double *)out);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_ce_rows(int64_t N, int64_t C, const T *g, const T *x,
                          const int64_t *lab, double *scratch, T *out) {
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const T *row = x + i * C;
    dsp__cu_lse l = dsp__cu_lse_id();
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      l = dsp__cu_lse_merge(l, dsp__cu_lse_elem((double)row[c]));
    l = dsp__cu_lse_final(block_reduce(l, lse_merge()));
    double lse = l.m + log(l.s);
    if (!g) {
      if (threadIdx.x == 0) scratch[i] = lse - (double)row[lab[i]];
      continue;
    }
    double scale = (double)g[0] / (double)N;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      double p = exp((double)row[c] - lse);
      out[i * C + c] = (T)(scale * (p - (c == lab[i] ? 1.0 : 0.0)));
    }
  }
}

/* out[0] = (sum of v[0..n)) / div, one block */
template <typename T>
__global__ void k_mean_of(int64_t n, const double *v, double div, T *out) {
  dsp__cu_ksum acc = dsp__cu_ksum_zero();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dsp__cu_ksum_add(&acc, v[i]);
  acc = block_reduce(acc, ksum_merge());
  if (threadIdx.x == 0) out[0] = (T)(dsp__cu_ksum_value(acc) / div);
}

extern "C" int dsp__cuk_cross_entropy(cudaStream_t st, int dt, int64_t N,
                                      int64_t C, const void *g, const void *x,
                                      const int64_t *lab, double *scratch,
                                      void *out) {
  if (N <= 0) return 0;
  unsigned gr = grid_rows(N);
  if (dt == DSP_F32) {
    k_ce_rows<float><<<gr, TPB, 0, st>>>(N, C, (const float *)g, (const float *)x, lab, scratch, (float *)out);
    if (!g) k_mean_of<float><<<1, TPB, 0, st>>>(N, scratch, (double)N, (float *)out);
  } else {
    k_ce_rows<double><<<gr, TPB, 0, st>>>(N, C, (const double *)g, (const double *)x, lab, scratch, (double *)out);
    if (!g) k_mean_of<double><<<1, TPB, 0, st>>>(N, scratch, (double)N, (double *)out);
  }
  return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------ */
/* creation                                                            */

template <typename T>
__global__ void k_fill(int64_t n, T v, T *out) {
  GRID_LOOP(i, n) out[i] = v;
}

extern "C" int dsp__cuk_fill(cudaStream_t st, int dt, int64_t n, double v,
                             void *out) {
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  switch (dt) {
    case DSP_F32: k_fill<float><<<g, TPB, 0, st>>>(n, (float)v, (float *)out); break;
    case DSP_F64: k_fill<double><<<g, TPB, 0, st>>>(n, v, (double *)out); break;
    case DSP_I64: k_fill<int64_t><<<g, TPB, 0, st>>>(n, (int64_t)v, (int64_t *)out); break;
    case DSP_F16: k_fill<uint16_t><<<g, TPB, 0, st>>>(n, dsp_f64_to_f16(v), (uint16_t *)out); break;
    case DSP_BF16: k_fill<uint16_t><<<g, TPB, 0, st>>>(n, dsp_f64_to_bf16(v), (uint16_t *)out); break;
    default: k_fill<uint8_t><<<g, TPB, 0, st>>>(n, (uint8_t)(v != 0), (uint8_t *)out); break;
  }
  return (int)cudaGetLastError();
}

__global__ void k_arange_i64(int64_t n, int64_t s0, int64_t d, int64_t *out) {
  GRID_LOOP(i, n) out[i] = (int64_t)((uint64_t)s0 + (uint64_t)i * (uint64_t)d);
}
template <typename T>
__global__ void k_arange_f(int64_t n, double s, double step, T *out) {
  GRID_LOOP(i, n) out[i] = (T)(s + (double)i * step);
}

extern "C" int dsp__cuk_arange(cudaStream_t st, int dt, int64_t n, double start,
                               double step, void *out) {
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  if (dt == DSP_I64) k_arange_i64<<<g, TPB, 0, st>>>(n, (int64_t)start, (int64_t)step, (int64_t *)out);
  else if (dt == DSP_F32) k_arange_f<float><<<g, TPB, 0, st>>>(n, start, step, (float *)out);
  else k_arange_f<double><<<g, TPB, 0, st>>>(n, start, step, (double *)out);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_random(int normal, int64_t n, uint64_t seed, double f0,
                         double f1, T *out) {
  GRID_LOOP(i, n) {
    if (normal) out[i] = (T)(f0 + f1 * dsp__cu_rng_normal(seed, (uint64_t)i));
    else if (sizeof(T) == 4) out[i] = (T)dsp__cu_uniform_f32(seed, (uint64_t)i, f0, f1);
    else out[i] = (T)dsp__cu_uniform_f64(seed, (uint64_t)i, f0, f1);
  }
}

extern "C" int dsp__cuk_random(cudaStream_t st, int op, int dt, int64_t n,
                               uint64_t seed, double f0, double f1, void *out) {
  if (n <= 0) return 0;
  int normal = op == DSP_OP_NORMAL;
  if (dt == DSP_F32) k_random<float><<<grid_for(n), TPB, 0, st>>>(normal, n, seed, f0, f1, (float *)out);
  else k_random<double><<<grid_for(n), TPB, 0, st>>>(normal, n, seed, f0, f1, (double *)out);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_dropout(int64_t n, uint64_t seed, double p, const T *x, T *out) {
  double scale = 1.0 / (1.0 - p);
  GRID_LOOP(i, n)
    out[i] = (T)(dsp__cu_rng_uniform01(seed, (uint64_t)i) >= p ? (double)x[i] * scale : 0.0);
}

extern "C" int dsp__cuk_dropout(cudaStream_t st, int dt, int64_t n, uint64_t seed,
                                double p, const void *x, void *out) {
  if (n <= 0) return 0;
  if (dt == DSP_F32) k_dropout<float><<<grid_for(n), TPB, 0, st>>>(n, seed, p, (const float *)x, (float *)out);
  else k_dropout<double><<<grid_for(n), TPB, 0, st>>>(n, seed, p, (const double *)x, (double *)out);
  return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------ */
/* shape ops                                                           */

template <typename T>
__global__ void k_gather(int64_t n, dsp__cu_index ix, int64_t base, const T *src,
                         T *dst, int scatter) {
  GRID_LOOP(i, n) {
    int64_t off[3];
    dsp__cu_offsets(&ix, i, off);
    if (scatter) dst[base + off[0]] = src[i];
    else dst[i] = src[base + off[0]];
  }
}

static int gather_any(cudaStream_t st, int es, int64_t n, const dsp__cu_index *ix,
                      int64_t base, const void *src, void *dst, int scatter) {
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  if (es == 1) k_gather<uint8_t><<<g, TPB, 0, st>>>(n, *ix, base, (const uint8_t *)src, (uint8_t *)dst, scatter);
  else if (es == 2) k_gather<uint16_t><<<g, TPB, 0, st>>>(n, *ix, base, (const uint16_t *)src, (uint16_t *)dst, scatter);
  else if (es == 4) k_gather<uint32_t><<<g, TPB, 0, st>>>(n, *ix, base, (const uint32_t *)src, (uint32_t *)dst, scatter);
  else k_gather<uint64_t><<<g, TPB, 0, st>>>(n, *ix, base, (const uint64_t *)src, (uint64_t *)dst, scatter);
  return (int)cudaGetLastError();
}
extern "C" int dsp__cuk_gather(cudaStream_t st, int es, int64_t n,
                               const dsp__cu_index *ix, int64_t base,
                               const void *src, void *dst) {
  return gather_any(st, es, n, ix, base, src, dst, 0);
}
extern "C" int dsp__cuk_scatter(cudaStream_t st, int es, int64_t n,
                                const dsp__cu_index *ix, int64_t base,
                                const void *src, void *dst) {
  return gather_any(st, es, n, ix, base, src, dst, 1);
}

/* cast: every source x target pair, the CPU's rules (common/cpu/shape.c)
 * with the CPU's conversions (common/half.h, host and device). A source
 * is first read as its compute type (wide(): a half as its exact f32),
 * then converted once: to bool by != 0 (NaN is true), to i64 truncating
 * and saturating, to a half rounded once to nearest even (from an f64 or
 * an i64 directly, never through f32). */
template <typename TO, typename W>
__device__ inline TO convert(W v) {
  if (sizeof(TO) == 1) return (TO)(v != 0);
  return (TO)v;
}
template <> __device__ inline int64_t convert<int64_t, float>(float v) { return dsp__cu_f2i64(v); }
template <> __device__ inline int64_t convert<int64_t, double>(double v) { return dsp__cu_f2i64(v); }
template <> __device__ inline dsp__cu_f16 convert<dsp__cu_f16, float>(float v) { return dsp__cu_f16{dsp_f32_to_f16(v)}; }
template <> __device__ inline dsp__cu_f16 convert<dsp__cu_f16, double>(double v) { return dsp__cu_f16{dsp_f64_to_f16(v)}; }
template <> __device__ inline dsp__cu_f16 convert<dsp__cu_f16, int64_t>(int64_t v) { return dsp__cu_f16{dsp_i64_to_f16(v)}; }
template <> __device__ inline dsp__cu_f16 convert<dsp__cu_f16, uint8_t>(uint8_t v) { return dsp__cu_f16{(uint16_t)(v ? 0x3C00u : 0u)}; }
template <> __device__ inline dsp__cu_bf16 convert<dsp__cu_bf16, float>(float v) { return dsp__cu_bf16{dsp_f32_to_bf16(v)}; }
template <> __device__ inline dsp__cu_bf16 convert<dsp__cu_bf16, double>(double v) { return dsp__cu_bf16{dsp_f64_to_bf16(v)}; }
template <> __device__ inline dsp__cu_bf16 convert<dsp__cu_bf16, int64_t>(int64_t v) { return dsp__cu_bf16{dsp_i64_to_bf16(v)}; }
template <> __device__ inline dsp__cu_bf16 convert<dsp__cu_bf16, uint8_t>(uint8_t v) { return dsp__cu_bf16{(uint16_t)(v ? 0x3F80u : 0u)}; }

template <typename TI, typename TO>
__global__ void k_cast(int64_t n, const TI *x, TO *out) {
  GRID_LOOP(i, n) out[i] = convert<TO>(wide(x[i]));
}

template <typename TI>
static void cast_from(cudaStream_t st, int to, int64_t n, const TI *x, void *out) {
  unsigned g = grid_for(n);
  switch (to) {
    case DSP_F32: k_cast<TI, float><<<g, TPB, 0, st>>>(n, x, (float *)out); break;
    case DSP_F64: k_cast<TI, double><<<g, TPB, 0, st>>>(n, x, (double *)out); break;
    case DSP_I64: k_cast<TI, int64_t><<<g, TPB, 0, st>>>(n, x, (int64_t *)out); break;
    case DSP_F16: k_cast<TI, dsp__cu_f16><<<g, TPB, 0, st>>>(n, x, (dsp__cu_f16 *)out); break;
    case DSP_BF16: k_cast<TI, dsp__cu_bf16><<<g, TPB, 0, st>>>(n, x, (dsp__cu_bf16 *)out); break;
    default: k_cast<TI, uint8_t><<<g, TPB, 0, st>>>(n, x, (uint8_t *)out); break;
  }
}

extern "C" int dsp__cuk_cast(cudaStream_t st, int from, int to, int64_t n,
                             const void *x, void *out) {
  if (n <= 0) return 0;
  switch (from) {
    case DSP_F32: cast_from<float>(st, to, n, (const float *)x, out); break;
    case DSP_F64: cast_from<double>(st, to, n, (const double *)x, out); break;
    case DSP_I64: cast_from<int64_t>(st, to, n, (const int64_t *)x, out); break;
    case DSP_F16: cast_from<dsp__cu_f16>(st, to, n, (const dsp__cu_f16 *)x, out); break;
    case DSP_BF16: cast_from<dsp__cu_bf16>(st, to, n, (const dsp__cu_bf16 *)x, out); break;
    default: cast_from<uint8_t>(st, to, n, (const uint8_t *)x, out); break;
  }
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_index_select(int64_t n, int64_t L, int64_t S, int64_t blk,
                               const int64_t *ix, const T *x, T *out) {
  GRID_LOOP(e, n) {
    int64_t j = e % blk, k = (e / blk) % L, o = e / (blk * L);
    out[e] = x[(o * S + ix[k]) * blk + j];
  }
}

extern "C" int dsp__cuk_index_select(cudaStream_t st, int es, int64_t outer,
                                     int64_t L, int64_t S, int64_t blk,
                                     const int64_t *ix, const void *x,
                                     void *out) {
  int64_t n = outer * L * blk;
  if (n <= 0) return 0;
  unsigned g = grid_for(n);
  if (es == 1) k_index_select<uint8_t><<<g, TPB, 0, st>>>(n, L, S, blk, ix, (const uint8_t *)x, (uint8_t *)out);
  else if (es == 2) k_index_select<uint16_t><<<g, TPB, 0, st>>>(n, L, S, blk, ix, (const uint16_t *)x, (uint16_t *)out);
  else if (es == 4) k_index_select<uint32_t><<<g, TPB, 0, st>>>(n, L, S, blk, ix, (const uint32_t *)x, (uint32_t *)out);
  else k_index_select<uint64_t><<<g, TPB, 0, st>>>(n, L, S, blk, ix, (const uint64_t *)x, (uint64_t *)out);
  return (int)cudaGetLastError();
}

/* out element (o, s, j) adds the grad rows k listed for s in the CSR
 * (start[s] .. start[s+1] of ks, k increasing): one thread per output
 * element, so the sum has the CPU's order and no atomics */
template <typename T>
__global__ void k_index_select_bw(int64_t n, int64_t L, int64_t S, int64_t blk,
                                  const int64_t *start, const int64_t *ks,
                                  const T *g, T *out) {
  GRID_LOOP(e, n) {
    int64_t j = e % blk, s = (e / blk) % S, o = e / (blk * S);
    T acc = out[e];
    for (int64_t q = start[s]; q < start[s + 1]; q++)
      acc = bin(DSP_OP_ADD, acc, g[(o * L + ks[q]) * blk + j]);
    out[e] = acc;
  }
}

extern "C" int dsp__cuk_index_select_bw(cudaStream_t st, int dt, int64_t outer,
                                        int64_t L, int64_t S, int64_t blk,
                                        const int64_t *start, const int64_t *ks,
                                        const void *g, void *out) {
  int64_t n = outer * S * blk;
  if (n <= 0) return 0;
  unsigned gr = grid_for(n);
  if (dt == DSP_F32) k_index_select_bw<float><<<gr, TPB, 0, st>>>(n, L, S, blk, start, ks, (const float *)g, (float *)out);
  else if (dt == DSP_F64) k_index_select_bw<double><<<gr, TPB, 0, st>>>(n, L, S, blk, start, ks, (const double *)g, (double *)out);
  else k_index_select_bw<int64_t><<<gr, TPB, 0, st>>>(n, L, S, blk, start, ks, (const int64_t *)g, (int64_t *)out);
  return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------ */
/* optimizer steps                                                     */

template <typename T>
__global__ void k_sgd(int64_t n, T *p, const T *g, T *v, double lr, double mom,
                      double wd, double gs) {
  GRID_LOOP(i, n) {
    double pi = (double)p[i], vi = (double)v[i];
    dsp__cu_sgd(&pi, &vi, (double)g[i] * gs, lr, mom, wd);
    v[i] = (T)vi;
    p[i] = (T)pi;
  }
}

extern "C" int dsp__cuk_sgd(cudaStream_t st, int dt, int64_t n, void *p,
                            const void *g, void *v, double lr, double mom,
                            double wd, double gs) {
  if (n <= 0) return 0;
  if (dt == DSP_F32) k_sgd<float><<<grid_for(n), TPB, 0, st>>>(n, (float *)p, (const float *)g, (float *)v, lr, mom, wd, gs);
  else k_sgd<double><<<grid_for(n), TPB, 0, st>>>(n, (double *)p, (const double *)g, (double *)v, lr, mom, wd, gs);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_adam(int64_t n, T *p, const T *g, T *m, T *v, double lr,
                       double b1, double b2, double eps, double bc1, double bc2,
                       double dk, double gs) {
  GRID_LOOP(i, n) {
    double pi = (double)p[i], mi = (double)m[i], vi = (double)v[i];
    dsp__cu_adamw(&pi, &mi, &vi, (double)g[i], lr, b1, b2, eps, bc1, bc2, dk,
                  gs);
    m[i] = (T)mi;
    v[i] = (T)vi;
    p[i] = (T)pi;
  }
}

extern "C" int dsp__cuk_adam(cudaStream_t st, int dt, int64_t n, void *p,
                             const void *g, void *m, void *v, double lr,
                             double b1, double b2, double eps, double bc1,
                             double bc2, double dk, double gs) {
  if (n <= 0) return 0;
  if (dt == DSP_F32) k_adam<float><<<grid_for(n), TPB, 0, st>>>(n, (float *)p, (const float *)g, (float *)m, (float *)v, lr, b1, b2, eps, bc1, bc2, dk, gs);
  else k_adam<double><<<grid_for(n), TPB, 0, st>>>(n, (double *)p, (const double *)g, (double *)m, (double *)v, lr, b1, b2, eps, bc1, bc2, dk, gs);
  return (int)cudaGetLastError();
}

/* ------------------------------------------------------------------ */
/* conv2d blocks (im2col / col2im) and pooling                         */

template <typename T>
__global__ void k_im2col(int64_t n, dsp__cu_geo g, const T *xn, T *col,
                         int64_t p0, int64_t np) {
  const int f64 = sizeof(T) == 8;
  GRID_LOOP(e, n) col[e] = (T)dsp__cu_im2col_at(&g, xn, f64, e / np, p0 + e % np);
}

template <typename T>
__global__ void k_col2im(int64_t n, dsp__cu_geo g, const T *col, int64_t p0,
                         int64_t np, T *xn) {
  const int f64 = sizeof(T) == 8;
  GRID_LOOP(e, n) {
    int64_t w = e % g.W, h = (e / g.W) % g.H, c = e / (g.W * g.H);
    xn[e] = (T)((double)xn[e] + dsp__cu_col2im_at(&g, col, f64, p0, np, c, h, w));
  }
}

extern "C" int dsp__cuk_im2col(cudaStream_t st, int f64, const dsp__cu_geo *g,
                               const void *xn, void *col, int64_t p0,
                               int64_t np) {
  int64_t n = g->C * g->KH * g->KW * np;
  if (n <= 0) return 0;
  if (f64) k_im2col<double><<<grid_for(n), TPB, 0, st>>>(n, *g, (const double *)xn, (double *)col, p0, np);
  else k_im2col<float><<<grid_for(n), TPB, 0, st>>>(n, *g, (const float *)xn, (float *)col, p0, np);
  return (int)cudaGetLastError();
}

extern "C" int dsp__cuk_col2im(cudaStream_t st, int f64, const dsp__cu_geo *g,
                               const void *col, int64_t p0, int64_t np,
                               void *xn) {
  int64_t n = g->C * g->H * g->W;
  if (n <= 0) return 0;
  if (f64) k_col2im<double><<<grid_for(n), TPB, 0, st>>>(n, *g, (const double *)col, p0, np, (double *)xn);
  else k_col2im<float><<<grid_for(n), TPB, 0, st>>>(n, *g, (const float *)col, p0, np, (float *)xn);
  return (int)cudaGetLastError();
}

template <typename T>
__global__ void k_pool_fwd(int64_t n, dsp__cu_geo g, int is_max, const T *x, T *y) {
  const int f64 = sizeof(T) == 8;
  GRID_LOOP(e, n) {
    int64_t ow = e % g.OW, oh = (e / g.OW) % g.OH, nc = e / (g.OW * g.OH), at;
    const T *xp = x + nc * g.H * g.W;
    y[e] = (T)(is_max ? dsp__cu_pool_max(&g, xp, f64, oh, ow, &at)
                      : dsp__cu_pool_avg(&g, xp, f64, oh, ow));
  }
}

template <typename T>
__global__ void k_pool_bw(int64_t n, dsp__cu_geo g, int is_max, const T *grad,
                          const T *x, T *out) {
  const int f64 = sizeof(T) == 8;
  GRID_LOOP(e, n) {
    int64_t w = e % g.W, h = (e / g.W) % g.H, nc = e / (g.W * g.H);
    out[e] = (T)dsp__cu_pool_bw_at(&g, is_max, grad + nc * g.OH * g.OW,
                                   x + nc * g.H * g.W, f64, h, w);
  }
}

extern "C" int dsp__cuk_pool(cudaStream_t st, int op, int f64,
                             const dsp__cu_geo *g, const void *grad,
                             const void *x, void *out) {
  int is_max = op == DSP_OP_MAX_POOL2D || op == DSP_OP_MAX_POOL2D_BACKWARD;
  int fwd = op == DSP_OP_MAX_POOL2D || op == DSP_OP_AVG_POOL2D ||
            op == DSP_OP_AVG_POOL2D_EX;
  int64_t n = g->N * g->C * (fwd ? g->OH * g->OW : g->H * g->W);
  if (n <= 0) return 0;
  unsigned gr = grid_for(n);
  if (fwd && f64) k_pool_fwd<double><<<gr, TPB, 0, st>>>(n, *g, is_max, (const double *)x, (double *)out);
  else if (fwd) k_pool_fwd<float><<<gr, TPB, 0, st>>>(n, *g, is_max, (const float *)x, (float *)out);
  else if (f64) k_pool_bw<double><<<gr, TPB, 0, st>>>(n, *g, is_max, (const double *)grad, (const double *)x, (double *)out);
  else k_pool_bw<float><<<gr, TPB, 0, st>>>(n, *g, is_max, (const float *)grad, (const float *)x, (float *)out);
  return (int)cudaGetLastError();
}
