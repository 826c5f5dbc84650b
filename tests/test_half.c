/* The half dtypes' conversions (common/half.h, common/half.c), the CPU
 * cast kernel to and from f16 / bf16, and the widening that runs every
 * other op on half through its f32 kernel (common/op.c).
 *
 * The oracle of every narrowing is independent of the code under test:
 * it decodes all finite non-negative patterns of the format (a monotone
 * table of doubles), finds the two neighbours of |x| by binary search and
 * picks the nearer, the even one on a tie, infinity past the largest
 * finite value's half-ulp. The hardware paths (F16C, AVX-512 BF16) are
 * compared bit for bit with the portable loops on every f16 pattern and
 * on structured and random f32 patterns (NaNs, infinities, subnormals,
 * ties and their neighbours). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "dsp_internal.h"
#include "half.h"
#include "helpers/failalloc.h"
#include "helpers/tensor_util.h"

/* ---- the oracle ---------------------------------------------------- */

typedef struct fmt {
  int mb, eb; /* fraction and exponent bits */
  double *val; /* val[k]: the value of pattern k, k = 0 .. maxfin */
  int maxfin;
  double overflow; /* 2^(emax+1): the "next" value after the largest */
} fmt;

static double decode(const fmt *f, int k) {
  int bias = (1 << (f->eb - 1)) - 1;
  int ex = k >> f->mb, m = k & ((1 << f->mb) - 1);
  if (ex == 0) return ldexp(m, 1 - bias - f->mb);
  return ldexp(m + (1 << f->mb), ex - bias - f->mb);
}

static fmt make_fmt(int mb, int eb) {
  fmt f = {mb, eb, NULL, 0, 0};
  f.maxfin = (((1 << eb) - 1) << mb) - 1;
  f.val = malloc(sizeof(double) * (size_t)(f.maxfin + 1));
  for (int k = 0; k <= f.maxfin; k++) f.val[k] = decode(&f, k);
  f.overflow = ldexp(1, (1 << (eb - 1)));
  return f;
}

/* x's pattern in f (x not NaN; long double keeps i64 inputs exact) */
static uint16_t oracle(const fmt *f, long double x) {
  uint16_t s = signbit(x) ? 0x8000 : 0;
  long double a = fabsl(x);
  uint16_t inf = (uint16_t)((f->maxfin + 1));
  if (isinf(a)) return s | inf;
  int lo = 0, hi = f->maxfin; /* largest k with val[k] <= a */
  if (a >= f->val[hi]) {
    lo = hi;
  } else {
    while (hi - lo > 1) {
      int mid = (lo + hi) / 2;
      if (f->val[mid] <= a) lo = mid;
      else hi = mid;
    }
  }
  long double below = f->val[lo],
              above = lo == f->maxfin ? f->overflow : f->val[lo + 1];
  if (a == below) return s | (uint16_t)lo;
  long double d0 = a - below, d1 = above - a;
  int k = d0 < d1 ? lo : d1 < d0 ? lo + 1 : (lo & 1 ? lo + 1 : lo);
  return s | (uint16_t)k; /* lo + 1 == maxfin + 1 is infinity */
}

static fmt F16, BF16;
static void setup_fmts(void) {
  F16 = make_fmt(10, 5);
  BF16 = make_fmt(7, 8);
}
static void free_fmts(void) {
  free(F16.val);
  free(BF16.val);
}
TestSuite(half, .init = setup_fmts, .fini = free_fmts);

static uint32_t fbits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static float bitsf(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* The expected NaN of a narrowing: sign kept, quiet, the payload's top
 * bits (mb fraction bits) */
static uint16_t nan_of(uint32_t b, int mb, int eb) {
  uint16_t s = (uint16_t)((b >> 16) & 0x8000);
  uint32_t m = b & 0x7fffff;
  return (uint16_t)(s | (((1u << eb) - 1) << mb) | (1u << (mb - 1)) |
                    (m >> (23 - mb)));
}

/* f32 patterns: every exponent and sign with fractions at the rounding
 * points of both formats (ties, one below, one above, the extremes) and a
 * few thousand random ones; n written into out (at most cap). */
static size_t f32_patterns(uint32_t *out, size_t cap) {
  size_t n = 0;
  static const uint32_t fr[] = {0,        1,        2,        0x7fffff, 0x7ffffe,
                                0x400000, 0x3fffff, 0x400001, 0x1000,   0xfff,
                                0x1001,   0x3000,   0x2fff,   0x3001,   0x2000,
                                0x8000,   0x7fff,   0x8001,   0x18000,  0x17fff,
                                0x18001,  0x10000,  0x7fe000, 0x7ff000, 0x7fefff,
                                0x7ff001, 0x7f8000, 0x7f7fff, 0x7f8001, 0x7fc000};
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t e = 0; e < 256; e++)
      for (size_t k = 0; k < sizeof fr / sizeof fr[0] && n < cap; k++)
        out[n++] = (s << 31) | (e << 23) | fr[k];
  uint64_t st = 0x9e3779b97f4a7c15ull;
  while (n < cap) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    out[n++] = (uint32_t)(st >> 11);
  }
  return n;
}

/* ---- the two paths agree ------------------------------------------- */

Test(half, f16_to_f32_every_pattern_both_paths_exact) {
  static uint16_t h[65536];
  static float p[65536], hw[65536];
  for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  cr_assert_eq(dsp__half_cvt_path(0, 0, h, p, 65536), 0);
  for (int i = 0; i < 65536; i++) {
    uint32_t got = fbits(p[i]);
    int ex = (i >> 10) & 0x1f, m = i & 0x3ff;
    if (ex == 0x1f && m) { /* NaN: quiet, sign and payload kept */
      uint32_t want = ((uint32_t)(i & 0x8000) << 16) | 0x7fc00000u | ((uint32_t)m << 13);
      cr_assert_eq(got, want, "f16 %04x -> %08x, want %08x", i, got, want);
    } else {
      double v = ex == 0x1f ? INFINITY : decode(&F16, i & 0x7fff);
      if (i & 0x8000) v = -v;
      cr_assert_eq(got, fbits((float)v), "f16 %04x -> %08x (%g)", i, got, v);
    }
  }
  if (dsp__half_cvt_path(0, 1, h, hw, 65536) < 0) {
    cr_log_warn("no F16C here: only the portable f16 -> f32 path checked");
    return;
  }
  for (int i = 0; i < 65536; i++)
    cr_assert_eq(fbits(hw[i]), fbits(p[i]), "f16 %04x: F16C %08x, portable %08x", i,
                 fbits(hw[i]), fbits(p[i]));
}

/* kind 1 (f32 -> f16) or 3 (f32 -> bf16) against the oracle, portable and
 * hardware path */
static void check_narrow_f32(int kind, const fmt *f) {
  enum { N = 1 << 17 };
  static uint32_t b[N];
  static uint16_t p[N], hw[N];
  size_t n = f32_patterns(b, N);
  float *x = (float *)b;
  cr_assert_eq(dsp__half_cvt_path(kind, 0, x, p, n), 0);
  for (size_t i = 0; i < n; i++) {
    uint16_t want = isnan(x[i]) ? nan_of(b[i], f->mb, f->eb) : oracle(f, x[i]);
    cr_assert_eq(p[i], want, "kind %d: f32 %08x -> %04x, want %04x", kind, b[i],
                 p[i], want);
  }
  /* the hardware path on shifted windows too: its vector body and its
   * tail, and (bf16) blocks with and without subnormals */
  for (size_t off = 0; off < 3; off++) {
    if (dsp__half_cvt_path(kind, 1, x + off, hw, n - off) < 0) {
      cr_log_warn("no hardware path %d here: only the portable one checked", kind);
      return;
    }
    for (size_t i = 0; i + off < n; i++)
      cr_assert_eq(hw[i], p[i + off], "kind %d: f32 %08x: hardware %04x, portable %04x",
                   kind, b[i + off], hw[i], p[i + off]);
  }
}

Test(half, f32_to_f16_portable_and_f16c_match_the_oracle) { check_narrow_f32(1, &F16); }
Test(half, f32_to_bf16_portable_and_avx512_match_the_oracle) { check_narrow_f32(3, &BF16); }

Test(half, bf16_to_f32_every_pattern_exact) {
  static uint16_t h[65536];
  static float p[65536];
  for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  cr_assert_eq(dsp__half_cvt_path(2, 0, h, p, 65536), 0);
  for (int i = 0; i < 65536; i++) {
    uint32_t want = (uint32_t)i << 16;
    if ((want & 0x7fffffffu) > 0x7f800000u) want |= 0x400000u; /* quiet */
    cr_assert_eq(fbits(p[i]), want, "bf16 %04x -> %08x", i, fbits(p[i]));
  }
  /* the array converter is this path */
  static float q[65536];
  dsp_half_to_f32_n(DSP_BF16, h, q, 65536);
  cr_assert_eq(memcmp(p, q, sizeof p), 0);
}

/* ---- f64 and i64 sources: one rounding ----------------------------- */

Test(half, f64_to_half_rounds_once) {
  /* the f64 patterns: every f32 pattern widened, then with a low bit set
   * just above / below (what a second rounding through f32 loses) */
  enum { N = 1 << 16 };
  static uint32_t b[N];
  size_t n = f32_patterns(b, N);
  for (size_t i = 0; i < n; i++) {
    double base = bitsf(b[i]);
    if (isnan(base)) continue;
    double vs[3] = {base, nextafter(base, INFINITY), nextafter(base, -INFINITY)};
    for (int k = 0; k < 3; k++) {
      cr_assert_eq(dsp_f64_to_f16(vs[k]), oracle(&F16, vs[k]), "f64 %a -> f16 %04x want %04x",
                   vs[k], dsp_f64_to_f16(vs[k]), oracle(&F16, vs[k]));
      cr_assert_eq(dsp_f64_to_bf16(vs[k]), oracle(&BF16, vs[k]), "f64 %a -> bf16 %04x want %04x",
                   vs[k], dsp_f64_to_bf16(vs[k]), oracle(&BF16, vs[k]));
    }
  }
  /* through f32, 1 + 2^-11 + 2^-40 would be the tie 1 + 2^-11 and round
   * to 1.0; it is above the tie */
  cr_assert_eq(dsp_f64_to_f16(1 + 0x1p-11 + 0x1p-40), 0x3c01);
  cr_assert_eq(dsp_f64_to_bf16(1 + 0x1p-8 + 0x1p-40), 0x3f81);
  /* NaN: quiet, sign kept, payload's top bits */
  cr_assert_eq(dsp_f64_to_f16(-NAN) & 0xfe00, 0xfe00);
  cr_assert_eq(dsp_f64_to_bf16(NAN) & 0x7fc0, 0x7fc0);
  /* f64 subnormals and values far below either format: signed zero */
  cr_assert_eq(dsp_f64_to_f16(-0x1p-1070), 0x8000);
  cr_assert_eq(dsp_f64_to_bf16(0x1p-300), 0);
  /* overflow */
  cr_assert_eq(dsp_f64_to_f16(65519.99), 0x7bff);
  cr_assert_eq(dsp_f64_to_f16(65520), 0x7c00);
  cr_assert_eq(dsp_f64_to_bf16(-1e300), 0xff80);
}

Test(half, i64_to_half_rounds_once) {
  static const int64_t fixed[] = {0, 1, -1, 2047, 2049, 2051, 65504, 65519, 65520,
                                  -65536, (1ll << 30) + (1ll << 22) + 1, 257, 259,
                                  INT64_MAX, INT64_MIN, (1ll << 53) + 1, 123456789};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
    long double v = (long double)fixed[i];
    cr_assert_eq(dsp_i64_to_f16(fixed[i]), oracle(&F16, v), "%lld", (long long)fixed[i]);
    cr_assert_eq(dsp_i64_to_bf16(fixed[i]), oracle(&BF16, v), "%lld", (long long)fixed[i]);
  }
  /* 2^30 + 2^22 + 1 is past bf16's tie at 2^30 + 2^22: through f32 (which
   * drops the 1) it would tie and round down to 2^30 */
  cr_assert_eq(dsp_i64_to_bf16((1ll << 30) + (1ll << 22) + 1), 0x4e81);
  uint64_t st = 12345;
  for (int i = 0; i < 20000; i++) {
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    int64_t v = (int64_t)st >> (i % 63);
    cr_assert_eq(dsp_i64_to_f16(v), oracle(&F16, (long double)v), "%lld", (long long)v);
    cr_assert_eq(dsp_i64_to_bf16(v), oracle(&BF16, (long double)v), "%lld", (long long)v);
  }
}

Test(half, edge_values_by_hand) {
  /* f16 */
  cr_assert_eq(dsp_f32_to_f16(65504.f), 0x7bff);
  cr_assert_eq(dsp_f32_to_f16(65519.f), 0x7bff);
  cr_assert_eq(dsp_f32_to_f16(65520.f), 0x7c00); /* overflow to inf */
  cr_assert_eq(dsp_f32_to_f16(0x1p-24f), 0x0001); /* smallest subnormal */
  cr_assert_eq(dsp_f32_to_f16(0x1p-25f), 0x0000); /* tie: to even, zero */
  cr_assert_eq(dsp_f32_to_f16(0x1.000002p-25f), 0x0001);
  cr_assert_eq(dsp_f32_to_f16(0x3p-25f), 0x0002); /* tie: to even, up */
  cr_assert_eq(dsp_f32_to_f16(1 + 0x1p-11f), 0x3c00); /* tie, even below */
  cr_assert_eq(dsp_f32_to_f16(1 + 0x3p-11f), 0x3c02); /* tie, even above */
  cr_assert_eq(dsp_f32_to_f16(-0.f), 0x8000);
  cr_assert_eq(dsp_f32_to_f16(-INFINITY), 0xfc00);
  cr_assert_eq(dsp_f32_to_f16(NAN), 0x7e00);
  cr_assert_eq(dsp_f32_to_f16(0x1.ffcp-15f), 0x0400); /* rounds up to the smallest normal */
  cr_assert_eq(fbits(dsp_f16_to_f32(0x0001)), fbits(0x1p-24f));
  cr_assert_eq(fbits(dsp_f16_to_f32(0x7d00)), 0x7fe00000u); /* signalling -> quiet */
  /* bf16 */
  cr_assert_eq(dsp_f32_to_bf16(1 + 0x1p-8f), 0x3f80);
  cr_assert_eq(dsp_f32_to_bf16(1 + 0x3p-8f), 0x3f82);
  cr_assert_eq(dsp_f32_to_bf16(bitsf(0x7f7fffff)), 0x7f80); /* overflow */
  cr_assert_eq(dsp_f32_to_bf16(bitsf(0x00008000)), 0x0000); /* subnormal tie */
  cr_assert_eq(dsp_f32_to_bf16(bitsf(0x00018000)), 0x0002);
  cr_assert_eq(dsp_f32_to_bf16(bitsf(0x80010000)), 0x8001); /* kept, not flushed */
  cr_assert_eq(dsp_f32_to_bf16(bitsf(0x7f800001)), 0x7fc0); /* quieted */
  cr_assert_eq(fbits(dsp_bf16_to_f32(0xff81)), 0xffc10000u);
}

/* ---- the cast kernel ------------------------------------------------ */

static dsp_ctx *ctx;
static void setup_ctx(void) {
  setup_fmts();
  ctx = dsp_ctx_new(dsp_cpu_backend());
}
static void teardown_ctx(void) {
  dsp_ctx_free(ctx);
  free_fmts();
}
TestSuite(halfop, .init = setup_ctx, .fini = teardown_ctx);

static dsp_tensor *make(dsp_dtype dt, int64_t n, const void *data) {
  dsp_meta m = {dt, 1, {n}};
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0);
  memcpy(dsp_tensor_data(t), data, (size_t)n * dsp_dtype_size(dt));
  return t;
}

static dsp_tensor *cast(dsp_tensor *x, dsp_dtype to) {
  int64_t d = to;
  dsp_attrs a = dsp_attrs_ints(1, &d);
  return tu_run(ctx, DSP_OP_CAST, &a, 1, x, NULL, NULL);
}

static const double g_vals[] = {0.0, -0.0, 1.0, -1.5, 1 + 0x1p-11, 1 + 0x3p-11,
                                1 + 0x1p-8, 1 + 0x3p-8, 65504, 65520, 1e6, -3e38,
                                0x1p-24, 0x1p-25, 0x1p-130, 0x1.8p-134, 2.75, -7.5,
                                1e-3, 123.456, INFINITY, -INFINITY, NAN};
#define NV ((int64_t)(sizeof g_vals / sizeof g_vals[0]))

Test(halfop, cast_from_every_dtype_to_half_bit_for_bit) {
  float f[NV];
  int64_t iv[NV];
  uint8_t bv[NV];
  for (int64_t i = 0; i < NV; i++) {
    f[i] = (float)g_vals[i];
    iv[i] = isfinite(g_vals[i]) && fabs(g_vals[i]) < 1e18 ? (int64_t)g_vals[i] : -(1ll << 40) - i;
    bv[i] = g_vals[i] != 0;
  }
  dsp_dtype hd[2] = {DSP_F16, DSP_BF16};
  for (int h = 0; h < 2; h++) {
    const fmt *F = hd[h] == DSP_F16 ? &F16 : &BF16;
    int mb = F->mb, eb = F->eb;
    dsp_tensor *src[4] = {make(DSP_F32, NV, f), make(DSP_F64, NV, g_vals),
                          make(DSP_I64, NV, iv), make(DSP_BOOL, NV, bv)};
    for (int s = 0; s < 4; s++) {
      dsp_tensor *o = cast(src[s], hd[h]);
      cr_assert_eq(o->meta.dtype, hd[h]);
      const uint16_t *got = dsp_tensor_data(o);
      for (int64_t i = 0; i < NV; i++) {
        uint16_t want;
        if (s == 3) want = bv[i] ? (hd[h] == DSP_F16 ? 0x3c00 : 0x3f80) : 0;
        else if (s == 2) want = oracle(F, (long double)iv[i]);
        else if (isnan(g_vals[i])) want = nan_of(fbits(f[i]), mb, eb);
        else want = oracle(F, s == 0 ? (double)f[i] : g_vals[i]);
        cr_assert_eq(got[i], want, "%s -> %s: element %lld (%g): %04x, want %04x",
                     dsp_dtype_name(src[s]->meta.dtype), dsp_dtype_name(hd[h]),
                     (long long)i, g_vals[i], got[i], want);
      }
      dsp_tensor_unref(o);
    }
    for (int s = 0; s < 4; s++) dsp_tensor_unref(src[s]);
  }
}

Test(halfop, cast_from_half_to_every_dtype) {
  /* every f16 and bf16 pattern, in one tensor each */
  static uint16_t h[65536];
  for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  dsp_dtype hd[2] = {DSP_F16, DSP_BF16};
  for (int k = 0; k < 2; k++) {
    dsp_tensor *x = make(hd[k], 65536, h);
    dsp_tensor *of = cast(x, DSP_F32), *od = cast(x, DSP_F64), *oi = cast(x, DSP_I64),
               *ob = cast(x, DSP_BOOL), *oh = cast(x, hd[1 - k]);
    const float *pf = dsp_tensor_data(of);
    const double *pd = dsp_tensor_data(od);
    const int64_t *pi = dsp_tensor_data(oi);
    const uint8_t *pb = dsp_tensor_data(ob);
    const uint16_t *ph = dsp_tensor_data(oh);
    for (int i = 0; i < 65536; i++) {
      float v = hd[k] == DSP_F16 ? dsp_f16_to_f32(h[i]) : dsp_bf16_to_f32(h[i]);
      cr_assert_eq(fbits(pf[i]), fbits(v), "%s %04x -> f32", dsp_dtype_name(hd[k]), i);
      if (isnan(v)) {
        cr_assert(isnan(pd[i]) && !signbit(pd[i]) == !signbit(v));
        cr_assert_eq(pi[i], 0); /* NaN -> 0, as f32 -> i64 */
        cr_assert_eq(ph[i] & 0x7fff, hd[k] == DSP_F16 ? (nan_of(fbits(v), 7, 8) & 0x7fff)
                                                       : (nan_of(fbits(v), 10, 5) & 0x7fff));
      } else {
        cr_assert_eq(pd[i], (double)v);
        int64_t want = v >= 0x1p63f ? INT64_MAX : v < -0x1p63f ? INT64_MIN : (int64_t)v;
        cr_assert_eq(pi[i], want, "%s %04x -> i64 %lld", dsp_dtype_name(hd[k]), i, (long long)pi[i]);
        cr_assert_eq(ph[i], oracle(hd[k] == DSP_F16 ? &BF16 : &F16, v),
                     "%s %04x -> other half %04x", dsp_dtype_name(hd[k]), i, ph[i]);
      }
      cr_assert_eq(pb[i], v != 0, "%s %04x -> bool (NaN is true)", dsp_dtype_name(hd[k]), i);
    }
    dsp_tensor_unref(of), dsp_tensor_unref(od), dsp_tensor_unref(oi);
    dsp_tensor_unref(ob), dsp_tensor_unref(oh), dsp_tensor_unref(x);
  }
}

/* ---- widening: every other op on half through f32 ------------------- */

static dsp_tensor *halfs(dsp_dtype dt, int nd, const int64_t *shape, const double *v) {
  dsp_meta m = {dt, nd, {0}};
  int64_t n = 1;
  for (int i = 0; i < nd; i++) m.shape[i] = shape[i], n *= shape[i];
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0);
  uint16_t *p = dsp_tensor_data(t);
  for (int64_t i = 0; i < n; i++) p[i] = dt == DSP_F16 ? dsp_f64_to_f16(v[i]) : dsp_f64_to_bf16(v[i]);
  return t;
}
static double hat(const dsp_tensor *t, int64_t i) {
  uint16_t h = ((const uint16_t *)dsp_tensor_data(t))[i];
  return t->meta.dtype == DSP_F16 ? dsp_f16_to_f32(h) : dsp_bf16_to_f32(h);
}

Test(halfop, widened_ops_round_the_f32_result_once) {
  static const int64_t S[] = {2, 3};
  const double xv[] = {1.5, -2.25, 3.1, 0.1, 1000.7, -0.004},
               yv[] = {0.3, 7, -1.9, 2.2, 0.01, 5};
  dsp_dtype hd[2] = {DSP_F16, DSP_BF16};
  for (int k = 0; k < 2; k++) {
    dsp_tensor *x = halfs(hd[k], 2, S, xv), *y = halfs(hd[k], 2, S, yv);
    /* the CPU runs none of these natively on half: the widening does */
    dsp_meta mm[2] = {x->meta, y->meta};
    cr_assert(!dsp__backend_supports(dsp_cpu_backend(), DSP_OP_MUL, mm, 2, &x->meta));
    dsp_tensor *m = tu_run(ctx, DSP_OP_MUL, NULL, 2, x, y, NULL);
    dsp_tensor *e = tu_run(ctx, DSP_OP_EXP, NULL, 1, x, NULL, NULL);
    dsp_tensor *lt = tu_run(ctx, DSP_OP_LT, NULL, 2, x, y, NULL);
    cr_assert_eq(m->meta.dtype, hd[k]);
    cr_assert_eq(lt->meta.dtype, DSP_BOOL);
    for (int i = 0; i < 6; i++) {
      float a = (float)hat(x, i), b = (float)hat(y, i);
      uint16_t wm = hd[k] == DSP_F16 ? dsp_f32_to_f16(a * b) : dsp_f32_to_bf16(a * b);
      uint16_t we = hd[k] == DSP_F16 ? dsp_f32_to_f16(expf(a)) : dsp_f32_to_bf16(expf(a));
      cr_assert_eq(((uint16_t *)dsp_tensor_data(m))[i], wm, "%s mul %d", dsp_dtype_name(hd[k]), i);
      cr_assert_eq(((uint16_t *)dsp_tensor_data(e))[i], we, "%s exp %d", dsp_dtype_name(hd[k]), i);
      cr_assert_eq(((uint8_t *)dsp_tensor_data(lt))[i], a < b);
    }
    /* sum accumulates in f32 and rounds once: 2048 ones in f16 would
     * stop at 2048 + 1 = 2048 if accumulated in half; 4096 in f32 */
    dsp_tensor_unref(m), dsp_tensor_unref(e), dsp_tensor_unref(lt);
    dsp_tensor_unref(x), dsp_tensor_unref(y);
  }
}

Test(halfop, reductions_accumulate_in_f32) {
  enum { N = 4096 };
  static double ones[N];
  for (int i = 0; i < N; i++) ones[i] = 1;
  int64_t n = N;
  dsp_tensor *x = halfs(DSP_F16, 1, &n, ones);
  dsp_tensor *s = tu_run(ctx, DSP_OP_SUM, NULL, 1, x, NULL, NULL);
  cr_assert_eq(s->meta.dtype, DSP_F16);
  /* in half, 2048 + 1 rounds back to 2048 and the sum stops there */
  cr_assert_eq(hat(s, 0), 4096.0);
  dsp_tensor_unref(s), dsp_tensor_unref(x);
}

Test(halfop, backward_of_half_gives_half_gradients) {
  static const int64_t S[] = {2, 2};
  const double av[] = {0.5, -1, 2, 0.25}, bv[] = {1, 2, -0.5, 3};
  dsp_tensor *a = halfs(DSP_BF16, 2, S, av), *b = halfs(DSP_BF16, 2, S, bv);
  cr_assert_eq(dsp_track(ctx, a), 0);
  cr_assert_eq(dsp_track(ctx, b), 0);
  dsp_tensor *ta = a, *tb = b;
  dsp_tensor *p = tu_run(ctx, DSP_OP_MATMUL, NULL, 2, ta, tb, NULL);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, p, NULL, NULL);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, l, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *ga = tu_grad(ctx, g, ta), *gb = tu_grad(ctx, g, tb);
  cr_assert_eq(ga->meta.dtype, DSP_BF16);
  cr_assert_eq(gb->meta.dtype, DSP_BF16);
  /* d sum(a @ b) / da[i][k] = sum_j b[k][j]; / db[k][j] = sum_i a[i][k]
   * (small integers and halves: exact in bf16) */
  const double wa[] = {3, 2.5, 3, 2.5}, wb[] = {2.5, 2.5, -0.75, -0.75};
  for (int i = 0; i < 4; i++) {
    cr_assert_eq(hat(ga, i), wa[i], "grad a %d: %g", i, hat(ga, i));
    cr_assert_eq(hat(gb, i), wb[i], "grad b %d: %g", i, hat(gb, i));
  }
  dsp_tensor_unref(ga), dsp_tensor_unref(gb);
  dsp_grads_free(g);
  dsp_tensor_unref(l), dsp_tensor_unref(p);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(halfop, native_pairs_are_claimed_and_widened_ones_are_not) {
  const dsp_backend *be = dsp_cpu_backend();
  dsp_meta h = {DSP_F16, 1, {4}}, f = {DSP_F32, 1, {4}};
  cr_assert(dsp__backend_supports(be, DSP_OP_CAST, &h, 1, &f));
  cr_assert(dsp__backend_supports(be, DSP_OP_CAST, &f, 1, &h));
  cr_assert(dsp__backend_supports(be, DSP_OP_RESHAPE, &h, 1, &h));
  dsp_meta two[2] = {h, h};
  cr_assert(!dsp__backend_supports(be, DSP_OP_ADD, two, 2, &h));
  cr_assert(!dsp__backend_supports(be, DSP_OP_SOFTMAX, &h, 1, &h));
}

Test(halfop, widening_temporaries_are_charged_and_freed_on_failure) {
  dsp_meta in[2] = {{DSP_BF16, 2, {8, 16}}, {DSP_BF16, 2, {16, 4}}};
  dsp_attrs a = dsp_attrs_none();
  /* every allocation of a widened op (the two f32 copies, the f32 result,
   * the half result) fails cleanly with ENOMEM and leaks nothing */
  cr_assert_geq(failalloc_walk_op(DSP_OP_SOFTMAX, 1, in, &(dsp_attrs){.ints = {1}, .n_ints = 1}), 2);
  cr_assert_geq(failalloc_walk_op(DSP_OP_ADD, 2, (dsp_meta[]){in[0], in[0]}, &a), 3);
}
