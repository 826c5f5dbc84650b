/* dispatch_convert: element conversions between the float dtypes in the
 * caller's memory, with the rounding dispatch_cast uses (common/half.h:
 * once, to nearest even, straight from the source value), so bytes made
 * here and bytes a LOCAL or REMOTE cast makes are the same. */
#include <string.h>

#include "client_internal.h"
#include "half.h"

/* f32 staging for the half <-> f32 / half <-> half paths: the array
 * converters take the processor's instructions where it has them */
#define CONVERT_CHUNK 1024

static int is_float(dispatch_dtype dt) {
  return dt == DISPATCH_F32 || dt == DISPATCH_F64 || dt == DISPATCH_F16 ||
         dt == DISPATCH_BF16;
}

/* Element i of src (a float dtype) as a double: exact for every one. */
static double load_f64(dispatch_dtype dt, const void *src, size_t i) {
  switch (dt) {
    case DISPATCH_F32: return ((const float *)src)[i];
    case DISPATCH_F64: return ((const double *)src)[i];
    case DISPATCH_F16: return dsp_f16_to_f32(((const uint16_t *)src)[i]);
    default: return dsp_bf16_to_f32(((const uint16_t *)src)[i]);
  }
}

int dispatch_convert(void *dst, dispatch_dtype dst_dtype, const void *src,
                     dispatch_dtype src_dtype, size_t n) {
  if (!is_float(dst_dtype) || !is_float(src_dtype)) return DISPATCH_EDTYPE;
  if (n == 0) return 0;
  if (!dst || !src) return DISPATCH_EINVAL;
  size_t ds = dsp_dtype_size((dsp_dtype)dst_dtype);
  if (n > SIZE_MAX / 8) return DISPATCH_EOVERFLOW;
  if (dst_dtype == src_dtype) {
    memmove(dst, src, n * ds);
    return 0;
  }
  int dh = dst_dtype == DISPATCH_F16 || dst_dtype == DISPATCH_BF16;
  int sh = src_dtype == DISPATCH_F16 || src_dtype == DISPATCH_BF16;
  if (src_dtype == DISPATCH_F64 && dh) { /* rounded once, from the f64 */
    const double *s = src;
    uint16_t *d = dst;
    for (size_t i = 0; i < n; i++)
      d[i] = dst_dtype == DISPATCH_F16 ? dsp_f64_to_f16(s[i])
                                       : dsp_f64_to_bf16(s[i]);
    return 0;
  }
  if (!dh && !sh) { /* f32 <-> f64: C's conversions round to nearest even */
    for (size_t i = 0; i < n; i++) {
      if (dst_dtype == DISPATCH_F32)
        ((float *)dst)[i] = (float)((const double *)src)[i];
      else
        ((double *)dst)[i] = ((const float *)src)[i];
    }
    return 0;
  }
  if (dst_dtype == DISPATCH_F64) { /* a half widened: exact */
    for (size_t i = 0; i < n; i++)
      ((double *)dst)[i] = load_f64(src_dtype, src, i);
    return 0;
  }
  /* half -> f32, f32 -> half, half -> the other half: through f32, which
   * holds every half value exactly, so the one rounding is the last step */
  float buf[CONVERT_CHUNK];
  for (size_t at = 0; at < n; at += CONVERT_CHUNK) {
    size_t k = n - at < CONVERT_CHUNK ? n - at : CONVERT_CHUNK;
    const uint16_t *hs = (const uint16_t *)src + at;
    if (!dh) { /* half -> f32 */
      dsp_half_to_f32_n((dsp_dtype)src_dtype, hs, (float *)dst + at, k);
      continue;
    }
    const float *f = (const float *)src + at;
    if (sh) { /* the other half: widened first */
      dsp_half_to_f32_n((dsp_dtype)src_dtype, hs, buf, k);
      f = buf;
    }
    dsp_f32_to_half_n((dsp_dtype)dst_dtype, f, (uint16_t *)dst + at, k);
  }
  return 0;
}
