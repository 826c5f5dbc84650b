/* Array conversions between the half dtypes and f32 (common/half.h):
 * the processor's instructions where the compiler offers them and the
 * processor has them, the portable loops of half.h elsewhere, with the
 * same bits either way.
 *
 * - f16 <-> f32: F16C (vcvtph2ps / vcvtps2ph, 8 lanes; rounding to
 *   nearest even from the immediate, not MXCSR). It keeps subnormals both
 *   ways and quiets NaNs keeping the payload's top bits, as half.h does.
 * - f32 -> bf16: AVX-512 BF16 (vcvtneps2bf16, 16 lanes), which rounds to
 *   nearest even and quiets NaNs as half.h does, but treats subnormal
 *   inputs as zero: a block of 16 that holds an f32 subnormal goes
 *   through the portable loop instead, so bf16 keeps f32's subnormals.
 * - bf16 -> f32 has no instruction before AVX-NE-CONVERT: it is a shift
 *   (and a NaN's quiet bit), which the compiler vectorizes from the
 *   portable loop. */
#include "half.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HALF_X86 1
/* AVX-512 BF16 intrinsics: GCC 10+ and clang 9+ */
#if defined(__clang__) ? (__clang_major__ >= 9) : (__GNUC__ >= 10)
#define HALF_AVX512BF16 1
#endif
#endif

static void f16_to_f32_portable(const uint16_t *s, float *d, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = dsp_f16_to_f32(s[i]);
}
static void f32_to_f16_portable(const float *s, uint16_t *d, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = dsp_f32_to_f16(s[i]);
}
static void bf16_to_f32_portable(const uint16_t *s, float *d, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = dsp_bf16_to_f32(s[i]);
}
static void f32_to_bf16_portable(const float *s, uint16_t *d, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = dsp_f32_to_bf16(s[i]);
}

#ifdef HALF_X86
__attribute__((target("avx,f16c"))) static void f16_to_f32_f16c(
    const uint16_t *s, float *d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
  f16_to_f32_portable(s + i, d + i, n - i);
}

__attribute__((target("avx,f16c"))) static void f32_to_f16_f16c(
    const float *s, uint16_t *d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  f32_to_f16_portable(s + i, d + i, n - i);
}

#ifdef HALF_AVX512BF16
__attribute__((target("avx512f,avx512bf16"))) static void f32_to_bf16_avx512(
    const float *s, uint16_t *d, size_t n) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), frac = _mm512_set1_epi32(0x7fffff);
  const __m512i zero = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_loadu_ps(s + i);
    __m512i b = _mm512_castps_si512(x);
    /* the instruction flushes subnormal inputs: those blocks go portable */
    __mmask16 sub = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, expo), zero) &
                    _mm512_cmpneq_epi32_mask(_mm512_and_si512(b, frac), zero);
    if (sub) {
      f32_to_bf16_portable(s + i, d + i, 16);
    } else {
      __m256bh h = _mm512_cvtneps_pbh(x);
      _mm256_storeu_si256((__m256i *)(d + i), (__m256i)h);
    }
  }
  f32_to_bf16_portable(s + i, d + i, n - i);
}
#endif
#endif

/* Which paths this processor runs, asked once with cpuid (clang's
 * __builtin_cpu_supports knows neither "f16c" nor "avx512bf16"); the OS
 * must save the wide registers too (xgetbv). A race between two first
 * callers stores the same answer. */
enum { HW_F16C = 1, HW_BF16 = 2, HW_ASKED = 4 };
static int hw_caps(void) {
  static int caps;
  int v = __atomic_load_n(&caps, __ATOMIC_RELAXED);
  if (v) return v;
  v = HW_ASKED;
#ifdef HALF_X86
  unsigned a, b, c, d;
  if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27))) { /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    int ymm = (lo & 6u) == 6u, zmm = (lo & 0xe6u) == 0xe6u;
    if (ymm && (c & (1u << 28)) && (c & (1u << 29))) v |= HW_F16C; /* AVX, F16C */
#ifdef HALF_AVX512BF16
    unsigned b7 = 0;
    if (__get_cpuid_count(7, 0, &a, &b7, &c, &d) && (b7 & (1u << 16)) && /* AVX-512F */
        __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) && zmm) /* BF16 */
      v |= HW_BF16;
#endif
  }
#endif
  __atomic_store_n(&caps, v, __ATOMIC_RELAXED);
  return v;
}

int dsp__half_cvt_path(int kind, int hw, const void *src, void *dst, size_t n) {
  int caps = hw ? hw_caps() : 0;
  switch (kind) {
    case 0:
      if (!hw) { f16_to_f32_portable(src, dst, n); return 0; }
#ifdef HALF_X86
      if (caps & HW_F16C) { f16_to_f32_f16c(src, dst, n); return 0; }
#endif
      return -1;
    case 1:
      if (!hw) { f32_to_f16_portable(src, dst, n); return 0; }
#ifdef HALF_X86
      if (caps & HW_F16C) { f32_to_f16_f16c(src, dst, n); return 0; }
#endif
      return -1;
    case 2:
      if (!hw) { bf16_to_f32_portable(src, dst, n); return 0; }
      return -1; /* no instruction: the portable loop is the path */
    case 3:
      if (!hw) { f32_to_bf16_portable(src, dst, n); return 0; }
#ifdef HALF_AVX512BF16
      if (caps & HW_BF16) { f32_to_bf16_avx512(src, dst, n); return 0; }
#endif
      return -1;
    default:
      return -1;
  }
}

void dsp_half_to_f32_n(dsp_dtype dt, const void *src, float *dst, size_t n) {
  if (dt == DSP_F16) {
    if (dsp__half_cvt_path(0, 1, src, dst, n) < 0) f16_to_f32_portable(src, dst, n);
  } else if (dt == DSP_BF16) {
    bf16_to_f32_portable(src, dst, n);
  }
}

void dsp_f32_to_half_n(dsp_dtype dt, const float *src, void *dst, size_t n) {
  if (dt == DSP_F16) {
    if (dsp__half_cvt_path(1, 1, src, dst, n) < 0) f32_to_f16_portable(src, dst, n);
  } else if (dt == DSP_BF16) {
    if (dsp__half_cvt_path(3, 1, src, dst, n) < 0) f32_to_bf16_portable(src, dst, n);
  }
}
