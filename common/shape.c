/* dtypes and shape arithmetic: every size is overflow-checked. */
#include <stdio.h>
#include <string.h>

#include "dsp.h"

size_t dsp_dtype_size(dsp_dtype dt) {
  switch (dt) {
    case DSP_F32: return 4;
    case DSP_F64: return 8;
    case DSP_I64: return 8;
    case DSP_BOOL: return 1;
    case DSP_F16: return 2;
    case DSP_BF16: return 2;
    default: return 0;
  }
}

const char *dsp_dtype_name(dsp_dtype dt) {
  switch (dt) {
    case DSP_F32: return "f32";
    case DSP_F64: return "f64";
    case DSP_I64: return "i64";
    case DSP_BOOL: return "bool";
    case DSP_F16: return "f16";
    case DSP_BF16: return "bf16";
    default: return "invalid";
  }
}

int dsp_dtype_valid(int dt) { return dt >= 0 && dt < DSP_NDTYPES; }

int dsp_dtype_is_float(dsp_dtype dt) {
  return dt == DSP_F32 || dt == DSP_F64 || dt == DSP_F16 || dt == DSP_BF16;
}

/* A bool is stored as one byte that every kernel reads as 0 or 1; any
 * other byte would make `where` and `eq` disagree, so it never gets in. */
int dsp_check_bool_bytes(dsp_ctx *ctx, const void *data, size_t n) {
  const uint8_t *p = data;
  for (size_t i = 0; i < n; i++)
    if (p[i] > 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "bool byte %zu is %u, must be 0 or 1", i,
                        (unsigned)p[i]);
  return 0;
}

int dsp_mul_overflow(int64_t a, int64_t b, int64_t *out) {
  if (__builtin_mul_overflow(a, b, out)) return DISPATCH_EOVERFLOW;
  return 0;
}

int dsp_meta_check(dsp_ctx *ctx, const dsp_meta *m) {
  int64_t n;
  return dsp_meta_numel(ctx, m, &n);
}

/* Checks dtype, rank and sizes, then bounds the span, the product of every
 * size with zeros counted as 1. The span bounds every contiguous stride,
 * every partial product of sizes a kernel computes, and every loop bound,
 * also when the element count is 0: without it an empty [2^62, 0] would
 * admit a 2^62-trip loop, and [0, 2^63-1, 2] a stride past int64. So the
 * span times the element size must fit int64 and size_t. */
int dsp_meta_span(dsp_ctx *ctx, const dsp_meta *m, int64_t *numel,
                  int64_t *span) {
  if (!dsp_dtype_valid((int)m->dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "invalid dtype %d", (int)m->dtype);
  if (m->ndim < 0 || m->ndim > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EDIM, "rank %d outside 0..%d", m->ndim,
                      DSP_MAX_DIMS);
  int64_t n = 1, sp = 1;
  for (int i = 0; i < m->ndim; i++) {
    if (m->shape[i] < 0)
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "negative size %lld at dim %d",
                        (long long)m->shape[i], i);
    if (m->shape[i] > 0 && dsp_mul_overflow(sp, m->shape[i], &sp)) {
      char s[160];
      return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                        "shape %s: its span (the product of its sizes, zero "
                        "sizes counted as 1) overflows int64",
                        dsp_shape_str(m, s, sizeof s));
    }
    n *= m->shape[i]; /* cannot overflow: n <= sp, checked just above */
  }
  int64_t bytes;
  if (dsp_mul_overflow(sp, (int64_t)dsp_dtype_size(m->dtype), &bytes) ||
      (uint64_t)bytes > (uint64_t)SIZE_MAX) {
    char s[160];
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                      "%s shape %s: its span of %lld elements (zero sizes "
                      "counted as 1) overflows the byte range",
                      dsp_dtype_name(m->dtype), dsp_shape_str(m, s, sizeof s),
                      (long long)sp);
  }
  if (numel) *numel = n;
  if (span) *span = sp;
  return 0;
}

int dsp_meta_numel(dsp_ctx *ctx, const dsp_meta *m, int64_t *numel) {
  return dsp_meta_span(ctx, m, numel, NULL);
}

char *dsp_shape_str(const dsp_meta *m, char *buf, size_t len) {
  size_t off = 0;
  if (len == 0) return buf;
  buf[0] = '\0';
  off += (size_t)snprintf(buf + off, len - off, "[");
  for (int i = 0; i < m->ndim && off < len; i++)
    off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld",
                            (long long)m->shape[i]);
  if (off < len) snprintf(buf + off, len - off, "]");
  return buf;
}

int dsp_meta_equal(const dsp_meta *a, const dsp_meta *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

int dsp_broadcast_shapes(dsp_ctx *ctx, const char *opname, const dsp_meta *a,
                         const dsp_meta *b, dsp_meta *out) {
  int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
  dsp_meta r = {.dtype = a->dtype, .ndim = nd};
  for (int i = 0; i < nd; i++) {
    int ia = a->ndim - nd + i, ib = b->ndim - nd + i;
    int64_t sa = ia >= 0 ? a->shape[ia] : 1;
    int64_t sb = ib >= 0 ? b->shape[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      char s1[128], s2[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "%s: shapes %s and %s do not broadcast", opname,
                        dsp_shape_str(a, s1, sizeof s1),
                        dsp_shape_str(b, s2, sizeof s2));
    }
    r.shape[i] = sa == 1 ? sb : sa;
  }
  *out = r;
  return 0;
}

int dsp_norm_dim(dsp_ctx *ctx, const char *opname, int64_t dim, int ndim,
                 int *out) {
  int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim || ndim == 0)
    return dsp_seterr(ctx, DISPATCH_EDIM, "%s: dim %lld out of range for rank %d",
                      opname, (long long)dim, ndim);
  *out = (int)d;
  return 0;
}
