/* nn family, CPU kernels (inference and geometry: common/ops_nn.c).
 *
 * Kernels are written once over f32 and f64: values are loaded into double,
 * combined in double and rounded once when stored, so f32 results are as
 * accurate as the f32 format allows. conv2d and its backward ops are
 * im2col + gemm (common/cpu/kern_nn_conv.c). Every loop runs in a fixed
 * order, so results are bit-identical run to run. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "kern_nn.h"
#include "ops_plan.h"
#include "rng.h"

#define opname dsp__opname

_Static_assert(DSP__OPS_IN_FAMILY(NN) - DSP__N_NORM_OPS == 17,
               "a new nn op needs a case in dsp__cpu_nn and a row in the CPU "
               "support table (common/cpu/backend.c)");

/* Splits a shape around `dim` into outer x len x inner. */
static void split_dim(const dsp_meta *m, int dim, int64_t *outer,
                      int64_t *len, int64_t *inner) {
  *outer = 1, *inner = 1;
  for (int i = 0; i < dim; i++) *outer *= m->shape[i];
  for (int i = dim + 1; i < m->ndim; i++) *inner *= m->shape[i];
  *len = m->shape[dim];
}

/* softmax / log_softmax and their backward ops along one dim; each row is
 * the `len` elements at stride `inner`. Forward subtracts the row max so no
 * exp overflows. Stops between rows when ctx is cancelled (returns 1). */
static int k_softmax(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *m, int dim,
                     const void *x, const void *y, void *o) {
  int f = m->dtype == DSP_F64;
  int64_t outer, len, inner, pw = 0;
  split_dim(m, dim, &outer, &len, &inner);
  for (int64_t a = 0; a < outer; a++)
    for (int64_t b = 0; b < inner; b++) {
      if (dsp__poll(ctx, &pw, 3 * len)) return 1;
      int64_t base = a * len * inner + b;
      if (op == DSP_OP_SOFTMAX || op == DSP_OP_LOG_SOFTMAX) {
        double mx = -INFINITY, s = 0.0;
        for (int64_t j = 0; j < len; j++) {
          double v = dsp__ld(x, f, base + j * inner);
          if (v > mx || isnan(v)) mx = v;
          if (isnan(mx)) break;
        }
        if (isinf(mx) && mx < 0) mx = 0.0; /* whole row -inf: keep exp defined */
        for (int64_t j = 0; j < len; j++) s += exp(dsp__ld(x, f, base + j * inner) - mx);
        double ls = log(s);
        for (int64_t j = 0; j < len; j++) {
          double v = dsp__ld(x, f, base + j * inner) - mx;
          dsp__st(o, f, base + j * inner, op == DSP_OP_SOFTMAX ? exp(v) / s : v - ls);
        }
      } else {
        /* x is the incoming grad, y the forward output */
        double s = 0.0;
        for (int64_t j = 0; j < len; j++) {
          double g = dsp__ld(x, f, base + j * inner);
          s += op == DSP_OP_SOFTMAX_BACKWARD ? g * dsp__ld(y, f, base + j * inner) : g;
        }
        for (int64_t j = 0; j < len; j++) {
          int64_t i = base + j * inner;
          double g = dsp__ld(x, f, i), yy = dsp__ld(y, f, i);
          dsp__st(o, f, i, op == DSP_OP_SOFTMAX_BACKWARD ? yy * (g - s)
                                                    : g - exp(yy) * s);
        }
      }
    }
  return 0;
}

/* cross entropy (mean over rows) or its gradient w.r.t. the logits. Labels
 * are checked before anything is written. */
static int k_cross_entropy(dsp_ctx *ctx, dsp_opcode op, const dsp_tensor *g,
                           const dsp_tensor *x, const dsp_tensor *lab,
                           dsp_tensor *out) {
  int f = x->meta.dtype == DSP_F64;
  int64_t N = x->meta.shape[0], C = x->meta.shape[1];
  const int64_t *l = dsp_tensor_data(lab);
  const void *px = dsp_tensor_data(x);
  for (int64_t i = 0; i < N; i++)
    if (l[i] < 0 || l[i] >= C)
      return dsp_seterr(ctx, DISPATCH_EINDEX,
                        "%s: label %lld at row %lld out of range for %lld classes",
                        opname(op), (long long)l[i], (long long)i, (long long)C);
  double scale = g ? dsp__ld(dsp_tensor_data(g), f, 0) / (double)N : 0.0;
  double total = 0.0;
  int64_t pw = 0;
  for (int64_t i = 0; i < N; i++) {
    if (dsp__poll(ctx, &pw, 3 * C)) return dsp__cancelled_err(ctx, op);
    int64_t row = i * C;
    double mx = -INFINITY, s = 0.0;
    for (int64_t c = 0; c < C; c++) {
      double v = dsp__ld(px, f, row + c);
      if (v > mx || isnan(v)) mx = v;
      if (isnan(mx)) break;
    }
    if (isinf(mx) && mx < 0) mx = 0.0;
    for (int64_t c = 0; c < C; c++) s += exp(dsp__ld(px, f, row + c) - mx);
    double lse = mx + log(s);
    if (!g) {
      total += lse - dsp__ld(px, f, row + l[i]);
      continue;
    }
    for (int64_t c = 0; c < C; c++) {
      double p = exp(dsp__ld(px, f, row + c) - lse);
      dsp__st(dsp_tensor_data(out), f, row + c,
         scale * (p - (c == l[i] ? 1.0 : 0.0)));
    }
  }
  if (!g) dsp__st(dsp_tensor_data(out), f, 0, total / (double)N);
  return 0;
}

/* max/avg pool forward and backward. The max picks the first largest
 * element of a window in row-major order (a NaN wins), and its backward
 * routes the grad to that same element. A window may be large, so the
 * cancel flag is polled after every window (returns 1 when cancelled). */
static int k_pool(dsp_ctx *ctx, dsp_opcode op, const dsp_pool_geo *g, int f,
                  const void *grad, const void *x, void *o) {
  int is_max = op == DSP_OP_MAX_POOL2D || op == DSP_OP_MAX_POOL2D_BACKWARD;
  int fwd = op == DSP_OP_MAX_POOL2D || op == DSP_OP_AVG_POOL2D;
  double area = (double)g->KH * (double)g->KW;
  int64_t pw = 0;
  for (int64_t nc = 0; nc < g->N * g->C; nc++) {
    int64_t xb = nc * g->H * g->W, yb = nc * g->OH * g->OW;
    for (int64_t oh = 0; oh < g->OH; oh++)
      for (int64_t ow = 0; ow < g->OW; ow++) {
        int64_t h0 = oh * g->sh - g->ph, w0 = ow * g->sw - g->pw;
        int64_t h1 = h0 + g->KH, w1 = w0 + g->KW;
        if (h0 < 0) h0 = 0;
        if (w0 < 0) w0 = 0;
        if (h1 > g->H) h1 = g->H;
        if (w1 > g->W) w1 = g->W;
        if (dsp__poll(ctx, &pw, (h1 - h0) * (w1 - w0) + 1)) return 1;
        int64_t yi = yb + oh * g->OW + ow;
        if (is_max) {
          int64_t best_i = xb + h0 * g->W + w0;
          double best = dsp__ld(x, f, best_i);
          for (int64_t h = h0; h < h1 && !isnan(best); h++)
            for (int64_t w = w0; w < w1; w++) {
              int64_t i = xb + h * g->W + w;
              double v = dsp__ld(x, f, i);
              if (v > best || isnan(v)) {
                best = v, best_i = i;
                if (isnan(v)) break;
              }
            }
          if (fwd)
            dsp__st(o, f, yi, best);
          else
            dsp__st(o, f, best_i, dsp__ld(o, f, best_i) + dsp__ld(grad, f, yi));
        } else if (fwd) {
          double s = 0.0;
          for (int64_t h = h0; h < h1; h++)
            for (int64_t w = w0; w < w1; w++) s += dsp__ld(x, f, xb + h * g->W + w);
          dsp__st(o, f, yi, s / area);
        } else {
          double gv = dsp__ld(grad, f, yi) / area;
          for (int64_t h = h0; h < h1; h++)
            for (int64_t w = w0; w < w1; w++) {
              int64_t i = xb + h * g->W + w;
              dsp__st(o, f, i, dsp__ld(o, f, i) + gv);
            }
        }
      }
  }
  return 0;
}

int dsp__cpu_nn(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
                const dsp_attrs *a, dsp_tensor *out) {
  dsp_meta metas[3], om;
  dsp_conv_geo cg;
  dsp_pool_geo pg;
  if (dsp__is_norm_op(op)) return dsp__cpu_norm(ctx, op, in, n_in, a, out);
  /* attention takes up to 5 inputs and has a file of its own */
  if (op == DSP_OP_ATTENTION || op == DSP_OP_ATTENTION_BACKWARD)
    return dsp__cpu_attn(ctx, op, in, n_in, a, out);
  if (n_in < 1 || n_in > 3)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL, "%s: bad input count %d",
                      opname(op), n_in);
  for (int i = 0; i < n_in; i++) metas[i] = in[i]->meta;
  int rc = dsp__nn_plan(ctx, op, metas, n_in, a, &om, &cg, &pg);
  if (rc < 0) return rc;
  /* every nn kernel computes on f32 or f64 (cross entropy's labels are
   * i64, checked by the plan) */
  const dsp_dtype fdt = in[op == DSP_OP_CROSS_ENTROPY_BACKWARD ? 1 : 0]->meta.dtype;
  if (fdt != DSP_F32 && fdt != DSP_F64)
    return dsp__no_kernel(ctx, op, in, n_in, out);
  int f = fdt == DSP_F64;
  void *o = dsp_tensor_data(out);
  switch (op) {
    case DSP_OP_SOFTMAX:
    case DSP_OP_LOG_SOFTMAX:
    case DSP_OP_SOFTMAX_BACKWARD:
    case DSP_OP_LOG_SOFTMAX_BACKWARD: {
      int d;
      dsp_norm_dim(ctx, opname(op), a->ints[0], metas[0].ndim, &d);
      if (k_softmax(ctx, op, &metas[0], d, dsp_tensor_data(in[0]),
                    n_in == 2 ? dsp_tensor_data(in[1]) : NULL, o))
        return dsp__cancelled_err(ctx, op);
      return 0;
    }
    case DSP_OP_CROSS_ENTROPY:
      return k_cross_entropy(ctx, op, NULL, in[0], in[1], out);
    case DSP_OP_CROSS_ENTROPY_BACKWARD:
      return k_cross_entropy(ctx, op, in[0], in[1], in[2], out);
    case DSP_OP_MSE: {
      const void *pa = dsp_tensor_data(in[0]), *pb = dsp_tensor_data(in[1]);
      double s = 0.0;
      for (int64_t i = 0; i < in[0]->numel; i++) {
        if ((i & (DSP_POLL_WORK - 1)) == 0 && dsp_ctx_cancelled(ctx))
          return dsp__cancelled_err(ctx, op);
        double d = dsp__ld(pa, f, i) - dsp__ld(pb, f, i);
        s += d * d;
      }
      dsp__st(o, f, 0, s / (double)in[0]->numel);
      return 0;
    }
    case DSP_OP_CONV2D:
    case DSP_OP_CONV2D_BACKWARD_INPUT:
    case DSP_OP_CONV2D_BACKWARD_WEIGHT:
      return dsp__kern_conv2d(ctx, op, &cg, f, dsp_tensor_data(in[0]),
                              dsp_tensor_data(in[1]), o);
    case DSP_OP_MAX_POOL2D:
    case DSP_OP_AVG_POOL2D:
      if (k_pool(ctx, op, &pg, f, NULL, dsp_tensor_data(in[0]), o))
        return dsp__cancelled_err(ctx, op);
      return 0;
    case DSP_OP_MAX_POOL2D_BACKWARD:
    case DSP_OP_AVG_POOL2D_BACKWARD:
      if (k_pool(ctx, op, &pg, f, dsp_tensor_data(in[0]),
                 dsp_tensor_data(in[1]), o))
        return dsp__cancelled_err(ctx, op);
      return 0;
    case DSP_OP_DROPOUT: {
      /* element i is kept iff uniform01(seed, i) >= p: a pure function of
       * (seed, i), so the same seed applied to a grad gives the same mask */
      double p = a->floats[0], scale = 1.0 / (1.0 - p);
      uint64_t seed = (uint64_t)a->ints[0];
      const void *px = dsp_tensor_data(in[0]);
      for (int64_t i = 0; i < in[0]->numel; i++) {
        if ((i & (DSP_POLL_WORK - 1)) == 0 && dsp_ctx_cancelled(ctx))
          return dsp__cancelled_err(ctx, op);
        dsp__st(o, f, i,
           dsp_rng_uniform01(seed, (uint64_t)i) >= p ? dsp__ld(px, f, i) * scale
                                                     : 0.0);
      }
      return 0;
    }
    default:
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
}
