/* conv2d and its two backward ops as im2col + gemm (OpenBLAS).
 *
 * For one sample, col is the [C*KH*KW, OH*OW] matrix whose column p holds
 * the receptive field of output pixel p (zeros where it reads padding), so
 *   forward          y_n  = W [O, CK] @ col_n
 *   backward input   dx_n = col2im(W^T @ dy_n)
 *   backward weight  dW  += dy_n @ col_n^T    (samples summed in order)
 * A 1x1 kernel with stride 1 and no padding needs no col: x_n already is
 * that matrix. The col buffer is allocated once per call and reused. */
#include <cblas.h>
#include <string.h>

#include "dsp_internal.h"
#include "kern_nn.h"

#define DEF_IM2COL(T, SFX)                                                   \
  static void im2col_##SFX(const dsp_conv_geo *g, const T *x, T *col) {      \
    int64_t ohw = g->OH * g->OW;                                             \
    for (int64_t c = 0; c < g->C; c++)                                       \
      for (int64_t i = 0; i < g->KH; i++)                                    \
        for (int64_t j = 0; j < g->KW; j++) {                                \
          T *row = col + ((c * g->KH + i) * g->KW + j) * ohw;                \
          for (int64_t oh = 0; oh < g->OH; oh++) {                           \
            int64_t h = oh * g->sh - g->ph + i * g->dh;                      \
            T *dst = row + oh * g->OW;                                       \
            if (h < 0 || h >= g->H) {                                        \
              memset(dst, 0, sizeof(T) * (size_t)g->OW);                     \
              continue;                                                      \
            }                                                                \
            const T *src = x + (c * g->H + h) * g->W;                        \
            for (int64_t ow = 0; ow < g->OW; ow++) {                         \
              int64_t w = ow * g->sw - g->pw + j * g->dw;                    \
              dst[ow] = (w >= 0 && w < g->W) ? src[w] : (T)0;                \
            }                                                                \
          }                                                                  \
        }                                                                    \
  }                                                                          \
  static void col2im_##SFX(const dsp_conv_geo *g, const T *col, T *x) {      \
    int64_t ohw = g->OH * g->OW;                                             \
    for (int64_t c = 0; c < g->C; c++)                                       \
      for (int64_t i = 0; i < g->KH; i++)                                    \
        for (int64_t j = 0; j < g->KW; j++) {                                \
          const T *row = col + ((c * g->KH + i) * g->KW + j) * ohw;          \
          for (int64_t oh = 0; oh < g->OH; oh++) {                           \
            int64_t h = oh * g->sh - g->ph + i * g->dh;                      \
            if (h < 0 || h >= g->H) continue;                                \
            const T *s = row + oh * g->OW;                                   \
            T *dst = x + (c * g->H + h) * g->W;                              \
            for (int64_t ow = 0; ow < g->OW; ow++) {                         \
              int64_t w = ow * g->sw - g->pw + j * g->dw;                    \
              if (w >= 0 && w < g->W) dst[w] += s[ow];                       \
            }                                                                \
          }                                                                  \
        }                                                                    \
  }

DEF_IM2COL(float, f32)
DEF_IM2COL(double, f64)

static void im2col(int f64, const dsp_conv_geo *g, const void *x, void *col) {
  if (f64)
    im2col_f64(g, x, col);
  else
    im2col_f32(g, x, col);
}

static void col2im(int f64, const dsp_conv_geo *g, const void *col, void *x) {
  if (f64)
    col2im_f64(g, col, x);
  else
    col2im_f32(g, col, x);
}

/* Row-major C = op(A) @ op(B) + beta*C; sizes are > 0 and fit an int.
 * One sample's product can be most of an op's work, so it runs in blocks
 * of C's rows with a look at the cancel flag between blocks: 1 when
 * cancelled (C partly written), else 0. Blocks are ~2^33 multiply-adds,
 * as in matmul: each block repacks op(B), so smaller ones would cost
 * speed on products that are big but realistic. */
#define GEMM_BLOCK_WORK ((int64_t)1 << 33)
static int gemm(dsp_ctx *ctx, int f64, int ta, int tb, int64_t m, int64_t n,
                int64_t k, const void *a, int64_t lda, const void *b,
                int64_t ldb, double beta, void *c, int64_t ldc) {
  enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans;
  enum CBLAS_TRANSPOSE TB = tb ? CblasTrans : CblasNoTrans;
  size_t es = f64 ? sizeof(double) : sizeof(float);
  int64_t bm = GEMM_BLOCK_WORK / (n * k);
  if (bm < 1) bm = 1;
  for (int64_t r = 0; r < m; r += bm) {
    if (dsp_ctx_cancelled(ctx)) return 1;
    int64_t mb = m - r < bm ? m - r : bm;
    /* rows r.. of op(A): rows of A, or columns of a transposed A */
    const char *ar = (const char *)a + (size_t)(ta ? r : r * lda) * es;
    char *cr = (char *)c + (size_t)(r * ldc) * es;
    if (f64)
      cblas_dgemm(CblasRowMajor, TA, TB, (int)mb, (int)n, (int)k, 1.0,
                  (const double *)ar, (int)lda, b, (int)ldb, beta,
                  (double *)cr, (int)ldc);
    else
      cblas_sgemm(CblasRowMajor, TA, TB, (int)mb, (int)n, (int)k, 1.0f,
                  (const float *)ar, (int)lda, b, (int)ldb, (float)beta,
                  (float *)cr, (int)ldc);
  }
  return 0;
}

int dsp__kern_conv2d(dsp_ctx *ctx, dsp_opcode op, const dsp_conv_geo *g,
                     int f64, const void *a, const void *b, void *out) {
  int64_t ck = g->C * g->KH * g->KW, ohw = g->OH * g->OW;
  /* an empty sum or an empty output: the zeroed output is the answer */
  if (g->N == 0 || g->O == 0 || ck == 0 || ohw == 0) return 0;
  size_t es = f64 ? sizeof(double) : sizeof(float);
  int direct = g->KH == 1 && g->KW == 1 && g->sh == 1 && g->sw == 1 &&
               g->ph == 0 && g->pw == 0;
  void *col = NULL;
  if (!direct) {
    col = dsp_malloc((size_t)(ck * ohw) * es);
    if (!col)
      return dsp_seterr(ctx, DISPATCH_ENOMEM,
                        "conv2d: out of memory for a %lld x %lld im2col buffer",
                        (long long)ck, (long long)ohw);
  }
  size_t xstride = (size_t)(g->C * g->H * g->W) * es;
  size_t ystride = (size_t)(g->O * ohw) * es;
  int stop = 0;
  for (int64_t n = 0; n < g->N && !stop; n++) {
    if (op == DSP_OP_CONV2D) {
      const char *xn = (const char *)a + (size_t)n * xstride;
      if (!direct) im2col(f64, g, xn, col);
      stop = gemm(ctx, f64, 0, 0, g->O, ohw, ck, b, ck, direct ? xn : col,
                  ohw, 0.0, (char *)out + (size_t)n * ystride, ohw);
    } else if (op == DSP_OP_CONV2D_BACKWARD_INPUT) {
      const char *gn = (const char *)a + (size_t)n * ystride;
      char *xn = (char *)out + (size_t)n * xstride;
      stop = gemm(ctx, f64, 1, 0, ck, ohw, g->O, b, ck, gn, ohw, 0.0,
                  direct ? xn : col, ohw);
      if (!direct && !stop) col2im(f64, g, col, xn);
    } else {
      const char *gn = (const char *)a + (size_t)n * ystride;
      const char *xn = (const char *)b + (size_t)n * xstride;
      if (!direct) im2col(f64, g, xn, col);
      stop = gemm(ctx, f64, 0, 1, g->O, ck, ohw, gn, ohw, direct ? xn : col,
                  ohw, 1.0, out, ck);
    }
  }
  dsp_free(col);
  return stop ? dsp__cancelled_err(ctx, op) : 0;
}
