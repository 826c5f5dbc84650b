/* The half types' conversions as the CUDA kernels do them, written once for
 * host and device (cuda_math.h's DSP_HD): f32 and f64 to f16 and bf16,
 * each rounded once to nearest even (f64 directly, never through f32, so
 * no double rounding), and f16 / bf16 back to f32 (exact). Pure integer
 * work on the bits: no dependence on the GPU's rounding mode, flush-to-zero
 * or its canonical NaN, so the device gives the bits the host gives.
 * tests/test_cuda_host.c checks every function here against the CPU's
 * converters (common/half.h) over all 65536 half patterns and f32 / f64
 * patterns around every rounding boundary, and tests/gpu/cuda_ops.c the
 * device's cast kernel against the CPU's cast on a GPU.
 *
 * The rules (IEEE 754, as numpy and PyTorch): overflow goes to an
 * infinity of the value's sign (f16: |x| >= 65520, the midpoint above
 * 65504, rounds up); subnormal halves are produced and read exactly;
 * a NaN stays a NaN of the same sign, quiet, with the payload's top bits
 * kept. Included by cuda_math.h. */
#ifndef DSP_CUDA_HALF_MATH_H
#define DSP_CUDA_HALF_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef DSP_HD
#ifdef __CUDACC__
#define DSP_HD static inline __host__ __device__
#else
#define DSP_HD static inline
#endif
#endif

DSP_HD uint32_t dsp__cu_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
DSP_HD float dsp__cu_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
DSP_HD uint64_t dsp__cu_f64_bits(double d) {
  uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

/* v >> sh (1 <= sh <= 63) rounded to nearest, ties to even */
DSP_HD uint64_t dsp__cu_rne_shift(uint64_t v, int sh) {
  uint64_t r = v >> sh, rem = v & ((UINT64_C(1) << sh) - 1),
           half = UINT64_C(1) << (sh - 1);
  return r + (rem > half || (rem == half && (r & 1)));
}

/* The magnitude bits ax of a finite f64 (sign cleared) narrowed to a
 * format of `mb` stored mantissa bits and exponent bias `bias` whose
 * largest finite magnitude rounds to infinity from `inf_from` (the f64
 * bits of the midpoint above it) and whose infinity's bits are `inf`.
 * Below the smallest normal the result is a subnormal (or zero) of unit
 * 2^(1 - bias - mb). One rounding in every range. */
DSP_HD uint32_t dsp__cu_narrow_f64(uint64_t ax, int mb, int bias,
                                   uint64_t inf_from, uint32_t inf) {
  if (ax >= inf_from) return inf;
  const int e = (int)(ax >> 52);
  const int min_e = 1023 + 1 - bias; /* f64 exponent of the smallest normal */
  if (e >= min_e) { /* normal: rebias the exponent, round the mantissa */
    const uint64_t rebias = (uint64_t)(1023 - bias) << 52;
    return (uint32_t)dsp__cu_rne_shift(ax - rebias, 52 - mb);
  }
  /* subnormal result: value = m * 2^(e - 1075) in units of
   * 2^(1 - bias - mb), i.e. m >> (1075 - (bias - 1 + mb) - e) */
  const int sh = 1075 - (bias - 1 + mb) - e;
  if (e == 0 || sh > 63) return 0; /* far below half the unit */
  const uint64_t m = (ax & ((UINT64_C(1) << 52) - 1)) | (UINT64_C(1) << 52);
  return (uint32_t)dsp__cu_rne_shift(m, sh);
}

/* f64 -> f16: bias 15, 10 mantissa bits; 65520 (0x40EFFE...) and above
 * round to infinity */
DSP_HD uint16_t dsp__cu_f64_to_f16(double d) {
  const uint64_t x = dsp__cu_f64_bits(d), ax = x & ~(UINT64_C(1) << 63);
  const uint16_t s = (uint16_t)((x >> 48) & 0x8000u);
  if (ax > UINT64_C(0x7FF0000000000000)) /* NaN: quiet, top payload */
    return (uint16_t)(s | 0x7E00u | ((ax >> 42) & 0x3FFu));
  return (uint16_t)(s | dsp__cu_narrow_f64(ax, 10, 15,
                                           UINT64_C(0x40EFFE0000000000),
                                           0x7C00u));
}
/* f64 -> bf16: bias 127, 7 mantissa bits; (2 - 2^-8) * 2^127 and above
 * round to infinity */
DSP_HD uint16_t dsp__cu_f64_to_bf16(double d) {
  const uint64_t x = dsp__cu_f64_bits(d), ax = x & ~(UINT64_C(1) << 63);
  const uint16_t s = (uint16_t)((x >> 48) & 0x8000u);
  if (ax > UINT64_C(0x7FF0000000000000))
    return (uint16_t)(s | 0x7FC0u | ((ax >> 45) & 0x7Fu));
  return (uint16_t)(s | dsp__cu_narrow_f64(ax, 7, 127,
                                           UINT64_C(0x47EFF00000000000),
                                           0x7F80u));
}
/* f32 -> f16 and f32 -> bf16. An f32 is exactly an f64, so the one
 * rounding of the f64 path is the one rounding of f32 -> half; the f32
 * NaN's payload is placed as the f64 path places it. */
DSP_HD uint16_t dsp__cu_f32_to_f16(float f) {
  const uint32_t x = dsp__cu_f32_bits(f), ax = x & 0x7FFFFFFFu;
  const uint16_t s = (uint16_t)((x >> 16) & 0x8000u);
  if (ax > 0x7F800000u) return (uint16_t)(s | 0x7E00u | ((ax >> 13) & 0x3FFu));
  if (ax >= 0x477FF000u) return (uint16_t)(s | 0x7C00u); /* >= 65520 */
  if (ax >= 0x38800000u) /* normal half: rebias 127 -> 15 */
    return (uint16_t)(s | dsp__cu_rne_shift(ax - 0x38000000u, 13));
  return (uint16_t)(s | dsp__cu_narrow_f64(dsp__cu_f64_bits((double)f) &
                                               ~(UINT64_C(1) << 63),
                                           10, 15,
                                           UINT64_C(0x40EFFE0000000000),
                                           0x7C00u));
}
DSP_HD uint16_t dsp__cu_f32_to_bf16(float f) {
  const uint32_t x = dsp__cu_f32_bits(f), ax = x & 0x7FFFFFFFu;
  const uint16_t s = (uint16_t)((x >> 16) & 0x8000u);
  if (ax > 0x7F800000u) return (uint16_t)(s | 0x7FC0u | ((ax >> 16) & 0x7Fu));
  /* same exponent range: round the low 16 bits away; a carry out of the
   * largest finite value gives exactly the infinity's bits */
  return (uint16_t)(s | dsp__cu_rne_shift(ax, 16));
}

/* f16 -> f32 and bf16 -> f32: exact; a NaN comes back quiet with its
 * payload */
DSP_HD float dsp__cu_f16_to_f32(uint16_t h) {
  const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu,
                 m = h & 0x3FFu;
  if (e == 0x1F)
    return dsp__cu_bits_f32(s | 0x7F800000u | (m ? 0x00400000u | (m << 13) : 0));
  if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
    const float v = (float)m * 5.9604644775390625e-8f;
    return s ? -v : v;
  }
  return dsp__cu_bits_f32(s | ((e + 112) << 23) | (m << 13));
}
DSP_HD float dsp__cu_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) u |= 0x00400000u; /* quiet NaN */
  return dsp__cu_bits_f32(u);
}

/* i64 -> half, rounded once: v's p leading significant bits (p = 11 for
 * f16, 8 for bf16) rounded to nearest even in integers, as the f32 of that
 * value (exact: fewer than 24 bits), which the f32 converter then narrows
 * without a second rounding (or to infinity past f16's range). Going
 * through (double)v would round twice above 2^53. */
DSP_HD float dsp__cu_i64_round(int64_t v, int p) {
  const uint64_t a = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
  int sh = 0;
  while ((a >> sh) >> p) sh++;
  const float f = ldexpf((float)(sh ? dsp__cu_rne_shift(a, sh) : a), sh);
  return v < 0 ? -f : f;
}
DSP_HD uint16_t dsp__cu_i64_to_f16(int64_t v) { return dsp__cu_f32_to_f16(dsp__cu_i64_round(v, 11)); }
DSP_HD uint16_t dsp__cu_i64_to_bf16(int64_t v) { return dsp__cu_f32_to_bf16(dsp__cu_i64_round(v, 8)); }

/* The kernels' storage types of the half dtypes: two bytes, distinct types
 * so that templates pick the conversions above (wide() in kernels.cu) */
typedef struct dsp__cu_f16 {
  uint16_t v;
} dsp__cu_f16;
typedef struct dsp__cu_bf16 {
  uint16_t v;
} dsp__cu_bf16;

#endif
