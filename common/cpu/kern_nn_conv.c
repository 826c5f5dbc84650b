/* conv2d and its two backward ops as im2col + gemm (OpenBLAS).
 *
 * For one sample, col is the [C*KH*KW, OH*OW] matrix whose column p holds
 * the receptive field of output pixel p (zeros where it reads padding), so
 *   forward          y_n  = W [O, CK] @ col_n
 *   backward input   dx_n = col2im(W^T @ dy_n)
 *   backward weight  dW  += dy_n @ col_n^T    (samples summed in order)
 * A 1x1 kernel with stride 1 and no padding needs no col: x_n already is
 * that matrix. col is built for a block of output pixels at a time (see
 * COL_BLOCK_BYTES); its buffer is allocated once per call and reused. */
#include <cblas.h>
#include <string.h>

#include "dsp_internal.h"
#include "kern_nn.h"

/* im2col / col2im restricted to output pixels p0 .. p0+np-1: col is the
 * [C*KH*KW, np] block of the full matrix's columns p0.. */
#define DEF_IM2COL(T, SFX)                                                   \
  static void im2col_##SFX(const dsp_conv_geo *g, const T *x, T *col,        \
                           int64_t p0, int64_t np) {                         \
    for (int64_t c = 0; c < g->C; c++)                                       \
      for (int64_t i = 0; i < g->KH; i++)                                    \
        for (int64_t j = 0; j < g->KW; j++) {                                \
          T *row = col + ((c * g->KH + i) * g->KW + j) * np;                 \
          for (int64_t p = p0, end = p0 + np; p < end;) {                    \
            int64_t oh = p / g->OW, ow0 = p % g->OW;                         \
            int64_t n = g->OW - ow0 < end - p ? g->OW - ow0 : end - p;       \
            int64_t h = oh * g->sh - g->ph + i * g->dh;                      \
            T *dst = row + (p - p0);                                         \
            p += n;                                                          \
            if (h < 0 || h >= g->H) {                                        \
              memset(dst, 0, sizeof(T) * (size_t)n);                         \
              continue;                                                      \
            }                                                                \
            const T *src = x + (c * g->H + h) * g->W;                        \
            for (int64_t k = 0; k < n; k++) {                                \
              int64_t w = (ow0 + k) * g->sw - g->pw + j * g->dw;             \
              dst[k] = (w >= 0 && w < g->W) ? src[w] : (T)0;                 \
            }                                                                \
          }                                                                  \
        }                                                                    \
  }                                                                          \
  static void col2im_##SFX(const dsp_conv_geo *g, const T *col, T *x,        \
                           int64_t p0, int64_t np) {                         \
    for (int64_t c = 0; c < g->C; c++)                                       \
      for (int64_t i = 0; i < g->KH; i++)                                    \
        for (int64_t j = 0; j < g->KW; j++) {                                \
          const T *row = col + ((c * g->KH + i) * g->KW + j) * np;           \
          for (int64_t p = p0, end = p0 + np; p < end;) {                    \
            int64_t oh = p / g->OW, ow0 = p % g->OW;                         \
            int64_t n = g->OW - ow0 < end - p ? g->OW - ow0 : end - p;       \
            int64_t h = oh * g->sh - g->ph + i * g->dh;                      \
            const T *s = row + (p - p0);                                     \
            p += n;                                                          \
            if (h < 0 || h >= g->H) continue;                                \
            T *dst = x + (c * g->H + h) * g->W;                              \
            for (int64_t k = 0; k < n; k++) {                                \
              int64_t w = (ow0 + k) * g->sw - g->pw + j * g->dw;             \
              if (w >= 0 && w < g->W) dst[w] += s[k];                        \
            }                                                                \
          }                                                                  \
        }                                                                    \
  }

DEF_IM2COL(float, f32)
DEF_IM2COL(double, f64)

static void im2col(int f64, const dsp_conv_geo *g, const void *x, void *col,
                   int64_t p0, int64_t np) {
  if (f64)
    im2col_f64(g, x, col, p0, np);
  else
    im2col_f32(g, x, col, p0, np);
}

static void col2im(int f64, const dsp_conv_geo *g, const void *col, void *x,
                   int64_t p0, int64_t np) {
  if (f64)
    col2im_f64(g, col, x, p0, np);
  else
    col2im_f32(g, col, x, p0, np);
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

/* The col block holds at most this many bytes (or one column, when a
 * single receptive field is larger: then it is no larger than the weight,
 * which the session holds already), whatever the image size: a 1024x1024
 * input with a 64x64 kernel would need a 15 GiB col matrix at once. */
#define COL_BLOCK_BYTES (4u << 20)

/* Runs op over the samples, each in blocks of output pixels; the scratch
 * is charged to ctx's budget. Results do not depend on the block size
 * beyond float summation order within gemm. */
int dsp__kern_conv2d(dsp_ctx *ctx, dsp_opcode op, const dsp_conv_geo *g,
                     int f64, const void *a, const void *b, void *out) {
  int64_t ck = g->C * g->KH * g->KW, ohw = g->OH * g->OW;
  /* an empty sum or an empty output: the zeroed output is the answer */
  if (g->N == 0 || g->O == 0 || ck == 0 || ohw == 0) return 0;
  size_t es = f64 ? sizeof(double) : sizeof(float);
  int direct = g->KH == 1 && g->KW == 1 && g->sh == 1 && g->sw == 1 &&
               g->ph == 0 && g->pw == 0;
  int64_t blk = ohw;
  void *col = NULL;
  size_t col_bytes = 0;
  if (!direct) {
    int64_t per = (int64_t)(COL_BLOCK_BYTES / es) / ck;
    blk = per < 1 ? 1 : per < ohw ? per : ohw;
    col_bytes = (size_t)(ck * blk) * es;
    int rc = dsp__scratch_alloc(ctx, col_bytes, "conv2d: im2col scratch",
                                &col);
    if (rc < 0) return rc;
  }
  size_t xstride = (size_t)(g->C * g->H * g->W) * es;
  size_t ystride = (size_t)(g->O * ohw) * es;
  int stop = 0;
  for (int64_t n = 0; n < g->N && !stop; n++) {
    for (int64_t p0 = 0; p0 < ohw && !stop; p0 += blk) {
      int64_t np = ohw - p0 < blk ? ohw - p0 : blk;
      size_t po = (size_t)p0 * es; /* column offset in a [rows, ohw] matrix */
      if (op == DSP_OP_CONV2D) {
        const char *xn = (const char *)a + (size_t)n * xstride;
        if (!direct) im2col(f64, g, xn, col, p0, np);
        stop = gemm(ctx, f64, 0, 0, g->O, np, ck, b, ck,
                    direct ? xn + po : col, direct ? ohw : np, 0.0,
                    (char *)out + (size_t)n * ystride + po, ohw);
      } else if (op == DSP_OP_CONV2D_BACKWARD_INPUT) {
        const char *gn = (const char *)a + (size_t)n * ystride;
        char *xn = (char *)out + (size_t)n * xstride;
        stop = gemm(ctx, f64, 1, 0, ck, np, g->O, b, ck, gn + po, ohw, 0.0,
                    direct ? xn + po : col, direct ? ohw : np);
        if (!direct && !stop) col2im(f64, g, col, xn, p0, np);
      } else {
        const char *gn = (const char *)a + (size_t)n * ystride;
        const char *xn = (const char *)b + (size_t)n * xstride;
        if (!direct) im2col(f64, g, xn, col, p0, np);
        stop = gemm(ctx, f64, 0, 1, g->O, ck, np, gn + po, ohw,
                    direct ? xn + po : col, direct ? ohw : np, 1.0, out, ck);
      }
    }
  }
  dsp__scratch_free(ctx, col, col_bytes);
  return stop ? dsp__cancelled_err(ctx, op) : 0;
}
