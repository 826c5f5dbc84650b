/* issue 23 nn ops on the CPU: embedding, layer_norm, rms_norm and their
 * backward ops (inference and plans: common/ops_norm.c).
 *
 * As the other nn kernels, values are loaded into double, combined in
 * double and rounded once when stored, for f32 as for f64. The norms take
 * each row's statistics in two passes (the mean, then the mean of squared
 * deviations from it), never E[x^2] - E[x]^2, so a row with a large
 * common offset keeps its variance. Every loop runs in a fixed order (rows
 * in order, each row left to right), so results are bit-identical run to
 * run and LOCAL to REMOTE. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"

#define opname dsp__opname

/* Every index in [0, V), else DISPATCH_EINDEX naming the first bad one
 * (the words of index_select's check, here and on CUDA). */
static int check_rows(dsp_ctx *ctx, dsp_opcode op, const dsp_tensor *ix,
                      int64_t V) {
  const int64_t *v = dsp_tensor_data(ix);
  for (int64_t k = 0; k < ix->numel; k++)
    if (v[k] < 0 || v[k] >= V)
      return dsp_seterr(ctx, DISPATCH_EINDEX,
                        "%s: index %lld (position %lld) out of range for dim "
                        "0 of size %lld",
                        opname(op), (long long)v[k], (long long)k,
                        (long long)V);
  return 0;
}

/* out[k, :] = weight[idx[k], :] */
static int k_embedding(dsp_ctx *ctx, const dsp_norm_geo *g,
                       const dsp_tensor *w, const int64_t *ix,
                       dsp_tensor *out) {
  const size_t row = (size_t)g->D * dsp_dtype_size(w->meta.dtype);
  const char *src = dsp_tensor_data(w);
  char *dst = dsp_tensor_data(out);
  int64_t pw = 0;
  for (int64_t k = 0; k < g->rows; k++) {
    if (dsp__poll(ctx, &pw, g->D + 1))
      return dsp__cancelled_err(ctx, DSP_OP_EMBEDDING);
    memcpy(dst + (size_t)k * row, src + (size_t)ix[k] * row, row);
  }
  return 0;
}

/* out = zeros [V, D]; out[idx[k], :] += grad[k, :] for k in increasing
 * order, in the element type (the order and type of the CUDA kernel's
 * gather), skipping the padding row. */
#define EMB_BW_(T)                                                           \
  static int emb_bw_##T(dsp_ctx *ctx, const dsp_norm_geo *g, const T *gr,   \
                        const int64_t *ix, T *o) {                          \
    int64_t pw = 0;                                                          \
    memset(o, 0, sizeof(T) * (size_t)(g->V * g->D));                         \
    for (int64_t k = 0; k < g->rows; k++) {                                  \
      if (dsp__poll(ctx, &pw, g->D + 1))                                     \
        return dsp__cancelled_err(ctx, DSP_OP_EMBEDDING_BACKWARD);           \
      if (ix[k] == g->pad) continue;                                         \
      T *dst = o + ix[k] * g->D;                                             \
      const T *src = gr + k * g->D;                                          \
      for (int64_t j = 0; j < g->D; j++) dst[j] = dst[j] + src[j];           \
    }                                                                        \
    return 0;                                                                \
  }
EMB_BW_(float)
EMB_BW_(double)
#undef EMB_BW_

/* A row's mean (0 when not centered) and 1 / sqrt(variance + eps), the
 * variance about that mean, biased (divided by D). */
static void row_stats(const void *x, int f, int64_t base, int64_t D,
                      int centered, double eps, double *mean, double *rstd) {
  double m = 0.0, v = 0.0;
  if (centered) {
    for (int64_t j = 0; j < D; j++) m += dsp__ld(x, f, base + j);
    m /= (double)D;
  }
  for (int64_t j = 0; j < D; j++) {
    double d = dsp__ld(x, f, base + j) - m;
    v += d * d;
  }
  *mean = m;
  *rstd = 1.0 / sqrt(v / (double)D + eps);
}

/* y = (x - mean) * rstd [* w] [+ b] per row */
static int k_norm_fwd(dsp_ctx *ctx, dsp_opcode op, const dsp_norm_geo *g,
                      int f, const void *x, const void *w, const void *b,
                      void *y) {
  int64_t pw = 0;
  for (int64_t r = 0; r < g->rows; r++) {
    if (dsp__poll(ctx, &pw, 3 * g->D)) return dsp__cancelled_err(ctx, op);
    const int64_t base = r * g->D;
    double mean, rstd;
    row_stats(x, f, base, g->D, g->centered, g->eps, &mean, &rstd);
    for (int64_t j = 0; j < g->D; j++) {
      double v = (dsp__ld(x, f, base + j) - mean) * rstd;
      if (w) v *= dsp__ld(w, f, j);
      if (b) v += dsp__ld(b, f, j);
      dsp__st(y, f, base + j, v);
    }
  }
  return 0;
}

/* The fused backward: with xhat = (x - mean) * rstd and gw = grad [* w],
 *   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))  (layer_norm)
 *   dx = rstd * (gw - xhat * mean(gw * xhat))             (rms_norm)
 *   dw = sum over rows of grad * xhat,  db = sum over rows of grad,
 * written flat as dx, then dw, then db. The column sums run in double
 * in a scratch of 2D doubles charged to the ctx's budget. */
static int k_norm_bw(dsp_ctx *ctx, dsp_opcode op, const dsp_norm_geo *g,
                     int f, const void *gr, const void *x, const void *w,
                     void *o) {
  const int64_t D = g->D, n = g->rows * D;
  const int cols = g->has_w || g->has_b;
  double *acc = NULL;
  const size_t an = (size_t)(2 * D) * sizeof(double);
  if (cols) {
    int rc = dsp__scratch_alloc(ctx, an, "norm backward: column sums",
                                (void **)&acc);
    if (rc < 0) return rc;
    memset(acc, 0, an);
  }
  int64_t pw = 0;
  for (int64_t r = 0; r < g->rows; r++) {
    if (dsp__poll(ctx, &pw, 5 * D)) {
      if (acc) dsp__scratch_free(ctx, acc, an);
      return dsp__cancelled_err(ctx, op);
    }
    const int64_t base = r * D;
    double mean, rstd, s1 = 0.0, s2 = 0.0;
    row_stats(x, f, base, D, g->centered, g->eps, &mean, &rstd);
    for (int64_t j = 0; j < D; j++) {
      double gw = dsp__ld(gr, f, base + j) * (w ? dsp__ld(w, f, j) : 1.0);
      s1 += gw;
      s2 += gw * ((dsp__ld(x, f, base + j) - mean) * rstd);
    }
    s1 = g->centered ? s1 / (double)D : 0.0;
    s2 /= (double)D;
    for (int64_t j = 0; j < D; j++) {
      double gj = dsp__ld(gr, f, base + j);
      double xh = (dsp__ld(x, f, base + j) - mean) * rstd;
      double gw = gj * (w ? dsp__ld(w, f, j) : 1.0);
      dsp__st(o, f, base + j, rstd * (gw - s1 - xh * s2));
      if (cols) {
        acc[j] += gj * xh;
        acc[D + j] += gj;
      }
    }
  }
  int64_t at = n;
  if (g->has_w) {
    for (int64_t j = 0; j < D; j++) dsp__st(o, f, at + j, acc[j]);
    at += D;
  }
  if (g->has_b)
    for (int64_t j = 0; j < D; j++) dsp__st(o, f, at + j, acc[D + j]);
  if (acc) dsp__scratch_free(ctx, acc, an);
  return 0;
}

int dsp__cpu_norm(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out) {
  dsp_meta metas[DSP_MAX_INPUTS], om;
  dsp_norm_geo g;
  if (n_in < 1 || n_in > 3)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL, "%s: bad input count %d",
                      opname(op), n_in);
  for (int i = 0; i < n_in; i++) metas[i] = in[i]->meta;
  int rc = dsp__norm_plan(ctx, op, metas, n_in, a, &om, &g);
  if (rc < 0) return rc;
  const dsp_dtype dt = in[0]->meta.dtype;
  if (dt != DSP_F32 && dt != DSP_F64)
    return dsp__no_kernel(ctx, op, in, n_in, out);
  const int f = dt == DSP_F64;
  void *o = dsp_tensor_data(out);
  const void *p1 = n_in > 1 ? dsp_tensor_data(in[1]) : NULL;
  const void *p2 = n_in > 2 ? dsp_tensor_data(in[2]) : NULL;
  switch (op) {
    case DSP_OP_EMBEDDING:
      if ((rc = check_rows(ctx, op, in[1], g.V)) < 0) return rc;
      return out->numel ? k_embedding(ctx, &g, in[0], p1, out) : 0;
    case DSP_OP_EMBEDDING_BACKWARD:
      if ((rc = check_rows(ctx, op, in[1], g.V)) < 0) return rc;
      if (out->numel == 0) return 0;
      return f ? emb_bw_double(ctx, &g, dsp_tensor_data(in[0]), p1, o)
               : emb_bw_float(ctx, &g, dsp_tensor_data(in[0]), p1, o);
    case DSP_OP_LAYER_NORM:
    case DSP_OP_RMS_NORM:
      return k_norm_fwd(ctx, op, &g, f, dsp_tensor_data(in[0]),
                        g.has_w ? p1 : NULL,
                        g.has_b ? (g.has_w ? p2 : p1) : NULL, o);
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM_BACKWARD:
      return k_norm_bw(ctx, op, &g, f, dsp_tensor_data(in[0]), p1,
                       g.has_w ? p2 : NULL, o);
    default:
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
}
