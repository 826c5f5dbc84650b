/* nn family, issue 23: shape inference and plans of embedding, layer_norm,
 * rms_norm and their backward ops (CPU kernels: common/cpu/norm.c, CUDA:
 * common/cuda/norm.c). ops_nn.c hands these ops here. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

static int need_float(dsp_ctx *ctx, dsp_opcode op, const char *what,
                      const dsp_meta *m) {
  if (!dsp_dtype_is_float(m->dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s must be f32 or f64, got %s",
                      opname(op), what, dsp_dtype_name(m->dtype));
  return 0;
}

static int need_i64(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *m) {
  if (m->dtype != DSP_I64)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: indices must be i64, got %s",
                      opname(op), dsp_dtype_name(m->dtype));
  return 0;
}

/* b has a's dtype and the shape of a's last n dims. */
static int same_tail(dsp_ctx *ctx, dsp_opcode op, const char *what,
                     const dsp_meta *b, const dsp_meta *a, int n) {
  if (b->dtype != a->dtype)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s is %s but x is %s",
                      opname(op), what, dsp_dtype_name(b->dtype),
                      dsp_dtype_name(a->dtype));
  if (b->ndim != n || memcmp(b->shape, a->shape + a->ndim - n,
                             sizeof(int64_t) * (size_t)n) != 0) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: %s has shape %s, want the last %d dims of x %s",
                      opname(op), what, dsp_shape_str(b, s1, sizeof s1), n,
                      dsp_shape_str(a, s2, sizeof s2));
  }
  return 0;
}

/* padding_idx against a table of V rows: INT64_MIN is none (-1 in the
 * plan), else it must lie in [-V, V) and negative counts from the end. */
static int pad_index(dsp_ctx *ctx, dsp_opcode op, int64_t p, int64_t V,
                     int64_t *pad) {
  if (p == INT64_MIN) {
    *pad = -1;
    return 0;
  }
  if (p < -V || p >= V)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: padding_idx %lld outside [-%lld, %lld) for %lld "
                      "rows",
                      opname(op), (long long)p, (long long)V, (long long)V,
                      (long long)V);
  *pad = p < 0 ? p + V : p;
  return 0;
}

/* embedding(weight [V,D], idx) and embedding_backward(grad, idx). */
static int plan_embedding(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                          const dsp_attrs *a, dsp_meta *out,
                          dsp_norm_geo *g) {
  const int bw = op == DSP_OP_EMBEDDING_BACKWARD;
  int rc = dsp__want_attrs(ctx, op, a, bw ? 2 : 1, 0);
  if (rc < 0) return rc;
  const dsp_meta *t = &in[0], *ix = &in[1];
  if ((rc = need_float(ctx, op, bw ? "grad" : "weight", t)) < 0) return rc;
  if ((rc = need_i64(ctx, op, ix)) < 0) return rc;
  if (ix->ndim + 1 > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: indices of rank %d give a result of rank %d, over "
                      "%d",
                      opname(op), ix->ndim, ix->ndim + 1, DSP_MAX_DIMS);
  memset(g, 0, sizeof *g);
  if ((rc = dsp_meta_numel(ctx, ix, &g->rows)) < 0) return rc;
  if (!bw) {
    if (t->ndim != 2) {
      char s[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "embedding: weight must be 2-D [V, D], got %s",
                        dsp_shape_str(t, s, sizeof s));
    }
    g->V = t->shape[0], g->D = t->shape[1];
    if ((rc = pad_index(ctx, op, a->ints[0], g->V, &g->pad)) < 0) return rc;
    *out = *ix;
    out->dtype = t->dtype;
    out->shape[out->ndim++] = g->D;
    return 0;
  }
  if (t->ndim != ix->ndim + 1 ||
      memcmp(t->shape, ix->shape, sizeof(int64_t) * (size_t)ix->ndim) != 0) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "embedding_backward: grad %s is not indices %s + [D]",
                      dsp_shape_str(t, s1, sizeof s1),
                      dsp_shape_str(ix, s2, sizeof s2));
  }
  g->V = a->ints[0], g->D = t->shape[t->ndim - 1];
  if (g->V < 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "embedding_backward: %lld rows is negative",
                      (long long)g->V);
  if ((rc = pad_index(ctx, op, a->ints[1], g->V, &g->pad)) < 0) return rc;
  *out = (dsp_meta){t->dtype, 2, {g->V, g->D}};
  return 0;
}

/* layer_norm / rms_norm and their backward ops: ints {nlast, has_weight
 * [, has_bias]}, floats {eps}; inputs (x[, w][, b]) forward, (grad, x[,
 * w]) backward. */
static int plan_norm(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                     int n_in, const dsp_attrs *a, dsp_meta *out,
                     dsp_norm_geo *g) {
  const int ln = op == DSP_OP_LAYER_NORM || op == DSP_OP_LAYER_NORM_BACKWARD;
  const int bw = op == DSP_OP_LAYER_NORM_BACKWARD ||
                 op == DSP_OP_RMS_NORM_BACKWARD;
  int rc = dsp__want_attrs(ctx, op, a, ln ? 3 : 2, 1);
  if (rc < 0) return rc;
  memset(g, 0, sizeof *g);
  g->pad = -1;
  g->centered = ln;
  for (int i = 1; i < a->n_ints; i++)
    if (a->ints[i] != 0 && a->ints[i] != 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s flag is %lld, not 0 or 1",
                        opname(op), i == 1 ? "has_weight" : "has_bias",
                        (long long)a->ints[i]);
  g->has_w = (int)a->ints[1];
  g->has_b = ln ? (int)a->ints[2] : 0;
  const int want = bw + 1 + g->has_w + (bw ? 0 : g->has_b);
  if (n_in != want)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d inputs with these flags (has_weight %d, "
                      "has_bias %d), got %d",
                      opname(op), want, g->has_w, g->has_b, n_in);
  g->eps = a->floats[0];
  if (!(g->eps >= 0.0) || isinf(g->eps))
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: eps = %g must be finite and >= 0",
                      opname(op), g->eps);
  const dsp_meta *x = &in[bw];
  if ((rc = need_float(ctx, op, "x", x)) < 0) return rc;
  const int64_t nlast = a->ints[0];
  if (nlast < 1 || nlast > x->ndim)
    return dsp_seterr(ctx, DISPATCH_EDIM,
                      "%s: nlast = %lld outside [1, %d] for x of rank %d",
                      opname(op), (long long)nlast, x->ndim, x->ndim);
  const int nl = (int)nlast;
  if (g->has_w && (rc = same_tail(ctx, op, "weight", &in[bw + 1], x, nl)) < 0)
    return rc;
  if (!bw && g->has_b &&
      (rc = same_tail(ctx, op, "bias", &in[1 + g->has_w], x, nl)) < 0)
    return rc;
  g->rows = 1, g->D = 1;
  for (int i = 0; i < x->ndim; i++) {
    if (i < x->ndim - nl) g->rows *= x->shape[i];
    else g->D *= x->shape[i];
  }
  if (!bw) {
    *out = *x;
    return 0;
  }
  if (!dsp_meta_equal(&in[0], x)) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: grad %s differs from x %s",
                      opname(op), dsp_shape_str(&in[0], s1, sizeof s1),
                      dsp_shape_str(x, s2, sizeof s2));
  }
  /* dx, then dweight and dbias of D elements each: x's numel fits (a
   * valid meta), and D <= numel unless numel is 0 */
  int64_t n = g->rows * g->D, extra;
  if (dsp_mul_overflow(g->D, g->has_w + g->has_b, &extra) ||
      __builtin_add_overflow(n, extra, &n))
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "%s: result size overflows",
                      opname(op));
  *out = (dsp_meta){x->dtype, 1, {n}};
  return 0;
}

int dsp__norm_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                   const dsp_attrs *a, dsp_meta *out, dsp_norm_geo *g) {
  switch (op) {
    case DSP_OP_EMBEDDING:
    case DSP_OP_EMBEDDING_BACKWARD:
      return plan_embedding(ctx, op, in, a, out, g);
    case DSP_OP_LAYER_NORM:
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM:
    case DSP_OP_RMS_NORM_BACKWARD:
      return plan_norm(ctx, op, in, n_in, a, out, g);
    default:
      return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "norm: op %s unknown",
                        opname(op));
  }
}
