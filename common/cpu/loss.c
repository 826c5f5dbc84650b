/* issue 23: loss. CPU kernels of cross_entropy_ex and its backward op
 * (inference and the [outer, C, inner] plan: common/ops_loss.c).
 *
 * Per non-ignored label y at position (o, s), over the C logits x_c at
 * stride inner: lse = log sum exp x_c (max-shifted), nll = lse - x_y, and
 * with smoothing eps > 0 loss = (1 - eps) nll + eps (lse - mean_c x_c),
 * torch's (1 - eps) nll + eps/C sum_c -log p_c. The gradient of one
 * position's loss is p_c - (1 - eps)[c == y] - eps/C. Everything is in
 * double, in a fixed order, rounded once when stored, so LOCAL and REMOTE
 * give the same bits. */
#include <math.h>
#include <stdint.h>

#include "cpu.h"
#include "ops_plan.h"

#define opname dsp__opname

/* log-sum-exp and plain sum of the C logits of one position */
static void ce_stats(const dsp_ce_geo *g, const void *x, int f, int64_t base,
                     double *lse, double *sum) {
  double mx = -INFINITY, s = 0.0, sx = 0.0;
  for (int64_t c = 0; c < g->C; c++) {
    double v = dsp__ld(x, f, base + c * g->inner);
    if (v > mx || isnan(v)) mx = v;
    if (isnan(mx)) break;
  }
  if (isinf(mx) && mx < 0) mx = 0.0; /* all -inf: keep exp defined */
  for (int64_t c = 0; c < g->C; c++) {
    double v = dsp__ld(x, f, base + c * g->inner);
    s += exp(v - mx);
    sx += v;
  }
  *lse = mx + log(s);
  *sum = sx;
}

/* The loss of one non-ignored position with label y. */
static double ce_loss(const dsp_ce_geo *g, const void *x, int f, int64_t base,
                      int64_t y) {
  double lse, sx;
  ce_stats(g, x, f, base, &lse, &sx);
  double nll = lse - dsp__ld(x, f, base + y * g->inner);
  if (g->smoothing > 0.0)
    return (1.0 - g->smoothing) * nll +
           g->smoothing * (lse - sx / (double)g->C);
  return nll;
}

static int64_t ce_count(const dsp_ce_geo *g, const int64_t *lab) {
  int64_t n = 0, np = g->outer * g->inner;
  for (int64_t i = 0; i < np; i++) n += lab[i] != g->ignore;
  return n;
}

static int ce_forward(dsp_ctx *ctx, dsp_opcode op, const dsp_ce_geo *g, int f,
                      const void *x, const int64_t *lab, void *out) {
  double total = 0.0;
  int64_t pw = 0, n = g->outer * g->inner;
  /* one flat loop over the positions: an empty inner dim under a huge
   * outer one costs nothing */
  for (int64_t pos = 0; pos < n; pos++) {
    if (dsp__poll(ctx, &pw, 3 * g->C)) return dsp__cancelled_err(ctx, op);
    int64_t o = pos / g->inner, s = pos % g->inner, y = lab[pos];
    double l = 0.0;
    if (y != g->ignore) l = ce_loss(g, x, f, o * g->C * g->inner + s, y);
    if (g->reduction == DSP_REDUCE_NONE)
      dsp__st(out, f, pos, l);
    else
      total += l;
  }
  if (g->reduction == DSP_REDUCE_SUM) dsp__st(out, f, 0, total);
  /* all ignored: 0/0, NaN, as torch */
  if (g->reduction == DSP_REDUCE_MEAN)
    dsp__st(out, f, 0, total / (double)ce_count(g, lab));
  return 0;
}

static int ce_backward(dsp_ctx *ctx, dsp_opcode op, const dsp_ce_geo *g,
                       int f, const void *gr, const void *x,
                       const int64_t *lab, void *out) {
  double w = 0.0, eps_c = g->smoothing / (double)g->C;
  if (g->reduction == DSP_REDUCE_SUM) w = dsp__ld(gr, f, 0);
  if (g->reduction == DSP_REDUCE_MEAN)
    w = dsp__ld(gr, f, 0) / (double)ce_count(g, lab);
  int64_t pw = 0, n = g->outer * g->inner;
  for (int64_t pos = 0; pos < n; pos++) {
    if (dsp__poll(ctx, &pw, 3 * g->C)) return dsp__cancelled_err(ctx, op);
    int64_t y = lab[pos];
    int64_t base = (pos / g->inner) * g->C * g->inner + pos % g->inner;
    if (y == g->ignore) {
      for (int64_t c = 0; c < g->C; c++) dsp__st(out, f, base + c * g->inner, 0.0);
      continue;
    }
    double lse, sx;
    ce_stats(g, x, f, base, &lse, &sx);
    double wp = g->reduction == DSP_REDUCE_NONE ? dsp__ld(gr, f, pos) : w;
    for (int64_t c = 0; c < g->C; c++) {
      int64_t i = base + c * g->inner;
      double p = exp(dsp__ld(x, f, i) - lse);
      double t = c == y ? 1.0 - g->smoothing : 0.0;
      dsp__st(out, f, i, wp * (p - t - eps_c));
    }
  }
  return 0;
}

int dsp__cpu_ce_ex(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   int n_in, const dsp_attrs *a, dsp_tensor *out) {
  dsp_ce_geo g;
  int rc = dsp__ce_ex_kernel_plan(ctx, op, in, n_in, a, &g);
  if (rc < 0) return rc;
  int bw = op == DSP_OP_CROSS_ENTROPY_EX_BACKWARD;
  const int64_t *lab = dsp_tensor_data(in[bw + 1]);
  int64_t bad = dsp__ce_ex_bad_label(&g, lab);
  if (bad >= 0) return dsp__ce_ex_label_err(ctx, op, &g, bad, lab[bad]);
  const dsp_dtype dt = in[bw]->meta.dtype;
  if (dt != DSP_F32 && dt != DSP_F64) /* half: reached only through f32 */
    return dsp__no_kernel(ctx, op, in, n_in, out);
  int f = dt == DSP_F64;
  if (bw)
    return ce_backward(ctx, op, &g, f, dsp_tensor_data(in[0]),
                       dsp_tensor_data(in[1]), lab, dsp_tensor_data(out));
  return ce_forward(ctx, op, &g, f, dsp_tensor_data(in[0]), lab,
                    dsp_tensor_data(out));
}
