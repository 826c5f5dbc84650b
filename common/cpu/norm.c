/* issue 23 nn ops on the CPU: embedding, layer_norm, rms_norm, batch_norm
 * and their backward ops (inference and plans: common/ops_norm.c).
 *
 * As the other nn kernels, values are loaded into double, combined in
 * double and rounded once when stored, for f32 as for f64. The norms take
 * each row's statistics in two passes (the mean, then the mean of squared
 * deviations from it), never E[x^2] - E[x]^2, so a row with a large
 * common offset keeps its variance. Every row, and every column sum, is
 * computed in a fixed order (a row left to right, a column top to
 * bottom), whichever of the backend's threads runs it, so results are
 * bit-identical run to run, LOCAL to REMOTE and for any thread count. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"
#include "par.h"

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

/* The rows of a norm are independent: chunks of about NORM_GRAIN
 * elements' worth of whole rows go to the backend's threads (par.h). The
 * backward's column sums (dw, db) are a second pass over chunks of
 * NORM_COLS columns, each column summed over the rows in row order as a
 * single thread would, so no result depends on the thread count. */
#define NORM_GRAIN ((int64_t)1 << 13)
#define NORM_COLS ((int64_t)16)

typedef struct norm_job {
  dsp_ctx *ctx;
  dsp_opcode op;
  const dsp_norm_geo *g;
  int f;
  const void *x, *w, *b, *gr;
  void *y;
  double *stats; /* backward: [rows][2] mean, rstd */
  double *acc;   /* backward: [2][D] column sums, or NULL */
} norm_job;

static int64_t norm_row_grain(int64_t D) {
  return D >= NORM_GRAIN ? 1 : NORM_GRAIN / (D > 0 ? D : 1);
}

/* y = (x - mean) * rstd [* w] [+ b] for rows [lo, hi) */
static int norm_fwd_rows(void *arg, int64_t lo, int64_t hi, int lane) {
  const norm_job *j = arg;
  const dsp_norm_geo *g = j->g;
  const int f = j->f;
  int64_t pw = 0;
  (void)lane;
  for (int64_t r = lo; r < hi; r++) {
    if (dsp__poll(j->ctx, &pw, 3 * g->D)) return 1;
    const int64_t base = r * g->D;
    double mean, rstd;
    row_stats(j->x, f, base, g->D, g->centered, g->eps, &mean, &rstd);
    for (int64_t jj = 0; jj < g->D; jj++) {
      double v = (dsp__ld(j->x, f, base + jj) - mean) * rstd;
      if (j->w) v *= dsp__ld(j->w, f, jj);
      if (j->b) v += dsp__ld(j->b, f, jj);
      dsp__st(j->y, f, base + jj, v);
    }
  }
  return 0;
}

static int k_norm_fwd(dsp_ctx *ctx, dsp_opcode op, const dsp_norm_geo *g,
                      int f, const void *x, const void *w, const void *b,
                      void *y) {
  norm_job j = {.ctx = ctx, .op = op, .g = g, .f = f, .x = x, .w = w,
                .b = b, .y = y};
  return dsp__par_for(ctx, g->rows, norm_row_grain(g->D), norm_fwd_rows, &j)
             ? dsp__cancelled_err(ctx, op)
             : 0;
}

/* dx for rows [lo, hi), their mean and rstd kept for the column pass */
static int norm_bw_rows(void *arg, int64_t lo, int64_t hi, int lane) {
  const norm_job *j = arg;
  const dsp_norm_geo *g = j->g;
  const int f = j->f;
  const int64_t D = g->D;
  const void *gr = j->gr, *x = j->x, *w = j->w;
  int64_t pw = 0;
  (void)lane;
  for (int64_t r = lo; r < hi; r++) {
    if (dsp__poll(j->ctx, &pw, 4 * D)) return 1;
    const int64_t base = r * D;
    double mean, rstd, s1 = 0.0, s2 = 0.0;
    row_stats(x, f, base, D, g->centered, g->eps, &mean, &rstd);
    j->stats[2 * r] = mean, j->stats[2 * r + 1] = rstd;
    for (int64_t c = 0; c < D; c++) {
      double gw = dsp__ld(gr, f, base + c) * (w ? dsp__ld(w, f, c) : 1.0);
      s1 += gw;
      s2 += gw * ((dsp__ld(x, f, base + c) - mean) * rstd);
    }
    s1 = g->centered ? s1 / (double)D : 0.0;
    s2 /= (double)D;
    for (int64_t c = 0; c < D; c++) {
      double gj = dsp__ld(gr, f, base + c);
      double xh = (dsp__ld(x, f, base + c) - mean) * rstd;
      double gw = gj * (w ? dsp__ld(w, f, c) : 1.0);
      dsp__st(j->y, f, base + c, rstd * (gw - s1 - xh * s2));
    }
  }
  return 0;
}

/* the column sums of grad * xhat and of grad for columns [lo, hi), in
 * local accumulators (the rows' loads then need no store between them) */
static int norm_bw_cols(void *arg, int64_t lo, int64_t hi, int lane) {
  const norm_job *j = arg;
  const dsp_norm_geo *g = j->g;
  const int f = j->f;
  const int64_t D = g->D, nc = hi - lo;
  double sx[NORM_COLS] = {0}, sg[NORM_COLS] = {0};
  int64_t pw = 0;
  (void)lane;
  for (int64_t r = 0; r < g->rows; r++) {
    if (dsp__poll(j->ctx, &pw, 2 * nc)) return 1;
    const int64_t base = r * D + lo;
    const double mean = j->stats[2 * r], rstd = j->stats[2 * r + 1];
    for (int64_t c = 0; c < nc; c++) {
      double gj = dsp__ld(j->gr, f, base + c);
      double xh = (dsp__ld(j->x, f, base + c) - mean) * rstd;
      sx[c] += gj * xh;
      sg[c] += gj;
    }
  }
  for (int64_t c = 0; c < nc; c++) {
    j->acc[lo + c] = sx[c];
    j->acc[D + lo + c] = sg[c];
  }
  return 0;
}

/* The fused backward: with xhat = (x - mean) * rstd and gw = grad [* w],
 *   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))  (layer_norm)
 *   dx = rstd * (gw - xhat * mean(gw * xhat))             (rms_norm)
 *   dw = sum over rows of grad * xhat,  db = sum over rows of grad,
 * written flat as dx, then dw, then db. The rows' statistics (2 doubles a
 * row) and the column sums (2D doubles, in double) are a scratch charged
 * to the ctx's budget. */
static int k_norm_bw(dsp_ctx *ctx, dsp_opcode op, const dsp_norm_geo *g,
                     int f, const void *gr, const void *x, const void *w,
                     void *o) {
  const int64_t D = g->D, n = g->rows * D;
  const int cols = g->has_w || g->has_b;
  const size_t sn = (size_t)(2 * g->rows) * sizeof(double),
               an = cols ? (size_t)(2 * D) * sizeof(double) : 0;
  double *scratch = NULL;
  if (sn + an == 0) return 0;
  int rc = dsp__scratch_alloc(ctx, sn + an, "norm backward: row statistics "
                              "and column sums", (void **)&scratch);
  if (rc < 0) return rc;
  norm_job j = {.ctx = ctx, .op = op, .g = g, .f = f, .x = x, .w = w,
                .gr = gr, .y = o, .stats = scratch,
                .acc = cols ? scratch + 2 * g->rows : NULL};
  int stop = dsp__par_for(ctx, g->rows, norm_row_grain(D), norm_bw_rows, &j);
  if (!stop && cols) stop = dsp__par_for(ctx, D, NORM_COLS, norm_bw_cols, &j);
  if (!stop) {
    int64_t at = n;
    if (g->has_w) {
      for (int64_t c = 0; c < D; c++) dsp__st(o, f, at + c, j.acc[c]);
      at += D;
    }
    if (g->has_b)
      for (int64_t c = 0; c < D; c++) dsp__st(o, f, at + c, j.acc[D + c]);
  }
  dsp__scratch_free(ctx, scratch, sn + an);
  return stop ? dsp__cancelled_err(ctx, op) : 0;
}

/* batch_norm: element (n, c, s) of x viewed as [rows, C, S] */
static int64_t bn_at(const dsp_norm_geo *g, int64_t n, int64_t c, int64_t s) {
  return (n * g->C + c) * g->S + s;
}

/* Channel c's mean and 1 / sqrt(var + eps): from the batch (two passes,
 * biased variance; *sq gets the sum of squared deviations for the
 * running update) in training, else from the running statistics. */
static void bn_stats(const dsp_norm_geo *g, int f, const void *x,
                     const void *rm, const void *rv, int64_t c, double *mean,
                     double *rstd, double *sq) {
  if (!g->training) {
    *mean = dsp__ld(rm, f, c);
    *rstd = 1.0 / sqrt(dsp__ld(rv, f, c) + g->eps);
    *sq = 0.0;
    return;
  }
  const double cnt = (double)(g->rows * g->S);
  double m = 0.0, v = 0.0;
  for (int64_t n = 0; n < g->rows; n++)
    for (int64_t s = 0; s < g->S; s++) m += dsp__ld(x, f, bn_at(g, n, c, s));
  m /= cnt;
  for (int64_t n = 0; n < g->rows; n++)
    for (int64_t s = 0; s < g->S; s++) {
      double d = dsp__ld(x, f, bn_at(g, n, c, s)) - m;
      v += d * d;
    }
  *mean = m, *sq = v;
  *rstd = 1.0 / sqrt(v / cnt + g->eps);
}

/* y = (x - mean) * rstd [* w] [+ b] per channel; in training with
 * running statistics, those are updated in place (unbiased variance, as
 * PyTorch), after dsp__storage_prepare_write so a read in flight keeps
 * the old bytes. */
static int k_batch_norm(dsp_ctx *ctx, const dsp_norm_geo *g, int f,
                        dsp_tensor *const *in, void *y) {
  const void *x = dsp_tensor_data(in[0]);
  void *rm = NULL, *rv = NULL;
  int k = 1;
  if (g->has_run) {
    if (g->training) {
      int rc = dsp__storage_prepare_write(ctx, in[1]);
      if (rc == 0) rc = dsp__storage_prepare_write(ctx, in[2]);
      if (rc < 0) return rc;
    }
    rm = dsp_tensor_data(in[1]), rv = dsp_tensor_data(in[2]);
    k = 3;
  }
  const void *w = g->has_w ? dsp_tensor_data(in[k++]) : NULL;
  const void *b = g->has_b ? dsp_tensor_data(in[k]) : NULL;
  const double cnt = (double)(g->rows * g->S), mom = g->momentum;
  int64_t pw = 0;
  for (int64_t c = 0; c < g->C; c++) {
    if (dsp__poll(ctx, &pw, 3 * g->rows * g->S + 1))
      return dsp__cancelled_err(ctx, DSP_OP_BATCH_NORM);
    double mean, rstd, sq;
    bn_stats(g, f, x, rm, rv, c, &mean, &rstd, &sq);
    if (g->training && rm) {
      dsp__st(rm, f, c, (1.0 - mom) * dsp__ld(rm, f, c) + mom * mean);
      dsp__st(rv, f, c, (1.0 - mom) * dsp__ld(rv, f, c) + mom * (sq / (cnt - 1.0)));
    }
    for (int64_t n = 0; n < g->rows; n++)
      for (int64_t s = 0; s < g->S; s++) {
        const int64_t i = bn_at(g, n, c, s);
        double v = (dsp__ld(x, f, i) - mean) * rstd;
        if (w) v *= dsp__ld(w, f, c);
        if (b) v += dsp__ld(b, f, c);
        dsp__st(y, f, i, v);
      }
  }
  return 0;
}

/* The fused backward per channel, with xhat = (x - mean) * rstd, the sums
 * G = sum grad and X = sum grad * xhat over the channel, and cnt its
 * elements:
 *   training:   dx = rstd * (grad w - w G / cnt - xhat w X / cnt)
 *   evaluation: dx = rstd * grad w (the statistics are constants)
 *   dweight = X, dbias = G; written flat as dx, dweight, dbias. */
static int k_batch_norm_bw(dsp_ctx *ctx, const dsp_norm_geo *g, int f,
                           dsp_tensor *const *in, void *o) {
  const void *gr = dsp_tensor_data(in[0]), *x = dsp_tensor_data(in[1]);
  const void *rm = NULL, *rv = NULL;
  int k = 2;
  if (g->has_run && !g->training) {
    rm = dsp_tensor_data(in[2]), rv = dsp_tensor_data(in[3]);
    k = 4;
  }
  const void *w = g->has_w ? dsp_tensor_data(in[k]) : NULL;
  const int64_t nx = g->rows * g->C * g->S;
  const double cnt = (double)(g->rows * g->S);
  int64_t pw = 0;
  for (int64_t c = 0; c < g->C; c++) {
    if (dsp__poll(ctx, &pw, 5 * g->rows * g->S + 1))
      return dsp__cancelled_err(ctx, DSP_OP_BATCH_NORM_BACKWARD);
    double mean, rstd, sq, G = 0.0, X = 0.0;
    bn_stats(g, f, x, rm, rv, c, &mean, &rstd, &sq);
    for (int64_t n = 0; n < g->rows; n++)
      for (int64_t s = 0; s < g->S; s++) {
        const int64_t i = bn_at(g, n, c, s);
        double gi = dsp__ld(gr, f, i);
        G += gi;
        X += gi * ((dsp__ld(x, f, i) - mean) * rstd);
      }
    const double wc = w ? dsp__ld(w, f, c) : 1.0;
    const double s1 = g->training ? wc * G / cnt : 0.0;
    const double s2 = g->training ? wc * X / cnt : 0.0;
    for (int64_t n = 0; n < g->rows; n++)
      for (int64_t s = 0; s < g->S; s++) {
        const int64_t i = bn_at(g, n, c, s);
        double xh = (dsp__ld(x, f, i) - mean) * rstd;
        dsp__st(o, f, i, rstd * (dsp__ld(gr, f, i) * wc - s1 - xh * s2));
      }
    if (g->has_w) dsp__st(o, f, nx + c, X);
    if (g->has_b) dsp__st(o, f, nx + g->has_w * g->C + c, G);
  }
  return 0;
}

int dsp__cpu_norm(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out) {
  dsp_meta metas[DSP_MAX_INPUTS], om;
  dsp_norm_geo g;
  if (n_in < 1 || n_in > 6)
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
    case DSP_OP_BATCH_NORM:
      return k_batch_norm(ctx, &g, f, in, o);
    case DSP_OP_BATCH_NORM_BACKWARD:
      return k_batch_norm_bw(ctx, &g, f, in, o);
    default:
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
}
