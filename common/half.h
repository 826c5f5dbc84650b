/* The half dtypes' bits: conversions between f16 (IEEE binary16), bf16
 * (f32's top 16 bits) and f32 / f64 / i64, one element at a time (these
 * inline functions, the portable reference, also usable from CUDA code)
 * and whole arrays (common/half.c: the processor's conversion
 * instructions where present, this portable code elsewhere).
 *
 * Every narrowing rounds once, to nearest with ties to even, straight
 * from the source value: f64 -> f16 is not f64 -> f32 -> f16, whose two
 * roundings can land on the other neighbour of a tie. Values past the
 * largest finite half round to infinity as IEEE says (f16: |x| >= 65520;
 * bf16: |x| >= 0x1.ffp127); subnormals are kept, never flushed (f16's
 * down to 2^-24; bf16's are f32's, down to 2^-133); a NaN stays a NaN of
 * the same sign, made quiet, with the top bits of its payload (what F16C
 * does: f32 -> f16 keeps the payload's top 9 bits under the quiet bit).
 * Widening (f16 -> f32, bf16 -> f32) is exact, and quiets a NaN too.
 *
 * The header needs nothing but <stdint.h> and <string.h>; the array
 * converters below the scalar ones need dsp.h's dtype. */
#ifndef DSP_HALF_H
#define DSP_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DSP_HALF_FN static inline __host__ __device__
#else
#define DSP_HALF_FN static inline
#endif

DSP_HALF_FN uint32_t dsp__f32_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}
DSP_HALF_FN float dsp__bits_f32(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* Rounds the magnitude sig * 2^(e - src_mb) (sig holds the implicit bit,
 * if any, at bit src_mb; e is the unbiased exponent, at least 1 - bias for
 * a value the target holds as a subnormal) to a format with mb fraction
 * bits and exponent bias `bias`, to nearest even. Returns the magnitude's
 * bits: an exponent field that a rounding carries into is right by
 * construction (a subnormal becoming the smallest normal, the largest
 * binade becoming infinity). */
DSP_HALF_FN uint32_t dsp__half_round(uint64_t sig, int e, int src_mb, int mb,
                                     int bias) {
  if (e > bias) return (uint32_t)(2 * bias + 1) << mb; /* infinity */
  int drop = src_mb - mb;
  uint32_t base = 0;
  if (e >= 1 - bias) base = (uint32_t)(e + bias - 1) << mb;
  else drop += 1 - bias - e; /* a subnormal of the target: fewer bits */
  if (drop <= 0) return base + (uint32_t)(sig << -drop); /* exact */
  if (drop > src_mb + 1) return 0; /* under half the smallest subnormal */
  uint64_t q = sig >> drop, rem = sig & ((UINT64_C(1) << drop) - 1),
           tie = UINT64_C(1) << (drop - 1);
  if (rem > tie || (rem == tie && (q & 1))) q++;
  return base + (uint32_t)q;
}

/* f16 -> f32, exact. */
DSP_HALF_FN float dsp_f16_to_f32(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu,
           m = h & 0x3ffu;
  if (ex == 0x1f) /* inf, or a NaN made quiet */
    return dsp__bits_f32(s | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0));
  if (ex == 0) { /* zero or a subnormal: m * 2^-24, exact in f32 */
    float f = (float)m * 0x1p-24f;
    return s ? -f : f;
  }
  return dsp__bits_f32(s | ((ex + 112u) << 23) | (m << 13));
}

/* bf16 -> f32, exact (a NaN made quiet). */
DSP_HALF_FN float dsp_bf16_to_f32(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  if ((b & 0x7fffffffu) > 0x7f800000u) b |= 0x400000u;
  return dsp__bits_f32(b);
}

/* f32 -> f16, rounded once. */
DSP_HALF_FN uint16_t dsp_f32_to_f16(float f) {
  uint32_t b = dsp__f32_bits(f), ex = (b >> 23) & 0xffu, m = b & 0x7fffffu;
  uint16_t s = (uint16_t)((b >> 16) & 0x8000u);
  if (ex == 0xff) return (uint16_t)(s | 0x7c00u | (m ? 0x200u | (m >> 13) : 0));
  if (ex == 0 && m == 0) return s;
  return (uint16_t)(s | dsp__half_round(ex ? m | 0x800000u : m,
                                        ex ? (int)ex - 127 : -126, 23, 10, 15));
}

/* f32 -> bf16, rounded once (f32's subnormals are bf16's, so the integer
 * rounding of the low 16 bits is the IEEE one for every finite value). */
DSP_HALF_FN uint16_t dsp_f32_to_bf16(float f) {
  uint32_t b = dsp__f32_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* f64 -> f16 and f64 -> bf16, rounded once (mb: 10 or 7 fraction bits,
 * bias 15 or 127). */
DSP_HALF_FN uint16_t dsp__f64_to_small(double d, int mb, int bias) {
  uint64_t b;
  memcpy(&b, &d, sizeof b);
  uint16_t s = (uint16_t)((b >> 48) & 0x8000u);
  uint32_t ex = (uint32_t)(b >> 52) & 0x7ffu;
  uint64_t m = b & ((UINT64_C(1) << 52) - 1);
  uint32_t inf = (uint32_t)(2 * bias + 1) << mb;
  if (ex == 0x7ff)
    return (uint16_t)(s | inf |
                      (m ? (1u << (mb - 1)) | (uint32_t)(m >> (52 - mb)) : 0));
  if (ex == 0 && m == 0) return s;
  return (uint16_t)(s | dsp__half_round(ex ? m | (UINT64_C(1) << 52) : m,
                                        ex ? (int)ex - 1023 : -1022, 52, mb,
                                        bias));
}
DSP_HALF_FN uint16_t dsp_f64_to_f16(double d) { return dsp__f64_to_small(d, 10, 15); }
DSP_HALF_FN uint16_t dsp_f64_to_bf16(double d) { return dsp__f64_to_small(d, 7, 127); }

/* i64 -> f16 / bf16, rounded once from the integer itself (through f32 or
 * f64 a large integer would be rounded twice). */
DSP_HALF_FN uint16_t dsp__i64_to_small(int64_t v, int mb, int bias) {
  if (v == 0) return 0;
  uint16_t s = v < 0 ? 0x8000u : 0; /* the sign bit of both formats */
  uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
  int p = 0;
  for (int k = 32; k > 0; k >>= 1)
    if (u >> (p + k)) p += k;
  return (uint16_t)(s | dsp__half_round(u, p, p, mb, bias));
}
DSP_HALF_FN uint16_t dsp_i64_to_f16(int64_t v) { return dsp__i64_to_small(v, 10, 15); }
DSP_HALF_FN uint16_t dsp_i64_to_bf16(int64_t v) { return dsp__i64_to_small(v, 7, 127); }

#ifndef __CUDACC__
#include "dsp.h"

/* dt is DSP_F16 or DSP_BF16: whether it is. */
static inline int dsp_dtype_is_half(dsp_dtype dt) {
  return dt == DSP_F16 || dt == DSP_BF16;
}

/* Array converters between a half dtype (dt: DSP_F16 or DSP_BF16; any
 * other dtype converts nothing) and f32: n elements, src and dst not
 * overlapping. They take the fastest path the processor has (F16C for
 * f16, AVX-512 BF16 for f32 -> bf16) and give the same bits as the
 * scalar functions above on every input (tests/test_half.c checks). */
void dsp_half_to_f32_n(dsp_dtype dt, const void *src, float *dst, size_t n);
void dsp_f32_to_half_n(dsp_dtype dt, const float *src, void *dst, size_t n);

/* For the tests: one path of one converter. kind: 0 f16 -> f32, 1 f32 ->
 * f16, 2 bf16 -> f32, 3 f32 -> bf16; hw 0 the portable loop, 1 the
 * processor's instructions. Returns 0, or -1 when this build or processor
 * has no such path (nothing written). */
int dsp__half_cvt_path(int kind, int hw, const void *src, void *dst, size_t n);
#endif

#endif
