/* nn family, shape inference and the conv/pool geometry for softmax,
 * log_softmax, cross entropy, mse, conv2d, pooling, dropout and their
 * backward ops (CPU kernels: common/cpu/nn.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

/* ------------------------------------------------------------------ */
/* small checks shared by the ops                                      */

#define opname dsp__opname

static int need_float(dsp_ctx *ctx, dsp_opcode op, const char *what,
                      const dsp_meta *m) {
  if (!dsp_dtype_is_float(m->dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s must be f32 or f64, got %s",
                      opname(op), what, dsp_dtype_name(m->dtype));
  return 0;
}

static int same_dtype(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *a,
                      const dsp_meta *b) {
  if (a->dtype != b->dtype)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: dtypes %s and %s differ",
                      opname(op), dsp_dtype_name(a->dtype),
                      dsp_dtype_name(b->dtype));
  return 0;
}

static int same_shape(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *a,
                      const dsp_meta *b) {
  if (a->ndim != b->ndim || memcmp(a->shape, b->shape,
                                   sizeof(int64_t) * (size_t)a->ndim) != 0) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: shapes %s and %s differ",
                      opname(op), dsp_shape_str(a, s1, sizeof s1),
                      dsp_shape_str(b, s2, sizeof s2));
  }
  return 0;
}

static int need_rank(dsp_ctx *ctx, dsp_opcode op, const char *what,
                     const dsp_meta *m, int rank, const char *layout) {
  if (m->ndim != rank) {
    char s[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: %s must be %d-D %s, got %s",
                      opname(op), what, rank, layout,
                      dsp_shape_str(m, s, sizeof s));
  }
  return 0;
}

/* ------------------------------------------------------------------ */
/* conv / pool geometry                                                */

/* One spatial axis: out = (in + 2p - d(k-1) - 1) / s + 1, all checked. An
 * empty or negative output is a shape error that names every number. */
static int axis_out(dsp_ctx *ctx, dsp_opcode op, const char *axis, int64_t in,
                    int64_t k, int64_t s, int64_t p, int64_t d, int64_t *out) {
  int64_t eff, span;
  if (dsp_mul_overflow(d, k - 1, &eff) || __builtin_add_overflow(eff, 1, &eff) ||
      dsp_mul_overflow(p, 2, &span) || __builtin_add_overflow(span, in, &span))
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "%s: %s geometry overflows",
                      opname(op), axis);
  if (span < eff)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: output %s <= 0 (input %lld, kernel %lld, stride "
                      "%lld, padding %lld, dilation %lld)",
                      opname(op), axis, (long long)in, (long long)k,
                      (long long)s, (long long)p, (long long)d);
  *out = (span - eff) / s + 1;
  return 0;
}

/* Reads the conv ints {sh, sw, ph, pw, dh, dw} (a prefix; the rest take
 * 1,1,0,0,1,1) and checks their ranges. */
static int conv_attrs(dsp_ctx *ctx, dsp_opcode op, const int64_t *v, int n,
                      dsp_conv_geo *g) {
  static const int64_t defaults[6] = {1, 1, 0, 0, 1, 1};
  static const char *names[6] = {"stride_h", "stride_w", "pad_h",
                                 "pad_w", "dil_h", "dil_w"};
  if (n < 0 || n > 6)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes at most 6 conv ints {stride_h, stride_w, "
                      "pad_h, pad_w, dil_h, dil_w}, got %d",
                      opname(op), n);
  int64_t r[6];
  for (int i = 0; i < 6; i++) {
    r[i] = i < n ? v[i] : defaults[i];
    int64_t lo = (i == 2 || i == 3) ? 0 : 1;
    if (r[i] < lo || r[i] > INT32_MAX)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %lld outside [%lld, %d]",
                        opname(op), names[i], (long long)r[i], (long long)lo,
                        INT32_MAX);
  }
  g->sh = r[0], g->sw = r[1], g->ph = r[2], g->pw = r[3], g->dh = r[4],
  g->dw = r[5];
  return 0;
}

/* Fills the geometry of conv2d(x, w) from the two 4-D shapes (and the conv
 * attrs already in g); checks channels, kernel sizes, output sizes, and that
 * every gemm dimension fits BLAS's int. */
static int conv_geo(dsp_ctx *ctx, dsp_opcode op, const int64_t *xs,
                    const int64_t *ws, dsp_conv_geo *g) {
  for (int i = 0; i < 4; i++)
    if (xs[i] < 0 || ws[i] < 0)
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: negative size in conv dims",
                        opname(op));
  g->N = xs[0], g->C = xs[1], g->H = xs[2], g->W = xs[3];
  g->O = ws[0], g->KH = ws[2], g->KW = ws[3];
  if (ws[1] != g->C)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: input has %lld channels but weight expects %lld",
                      opname(op), (long long)g->C, (long long)ws[1]);
  if (g->KH < 1 || g->KW < 1)
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: kernel size %lldx%lld is empty",
                      opname(op), (long long)g->KH, (long long)g->KW);
  int rc = axis_out(ctx, op, "height", g->H, g->KH, g->sh, g->ph, g->dh, &g->OH);
  if (rc < 0) return rc;
  rc = axis_out(ctx, op, "width", g->W, g->KW, g->sw, g->pw, g->dw, &g->OW);
  if (rc < 0) return rc;
  int64_t ck, ohw, col;
  if (dsp_mul_overflow(g->C, g->KH, &ck) || dsp_mul_overflow(ck, g->KW, &ck) ||
      dsp_mul_overflow(g->OH, g->OW, &ohw) || dsp_mul_overflow(ck, ohw, &col) ||
      dsp_mul_overflow(col, 8, &col) || dsp_mul_overflow(g->N, g->O, &col) ||
      ck > INT32_MAX || ohw > INT32_MAX || g->O > INT32_MAX)
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                      "%s: sizes exceed the BLAS int range", opname(op));
  return 0;
}

/* Reads the pool ints {kh, kw, stride_h, stride_w, pad_h, pad_w}; a missing
 * stride equals the kernel size, a missing pad is 0. Padding is limited to
 * half the kernel so every window holds at least one input element. */
static int pool_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                      dsp_pool_geo *g) {
  if (a->n_ints < 2 || a->n_ints > 6 || a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes 2..6 ints {kh, kw, stride_h, stride_w, "
                      "pad_h, pad_w} and no floats, got %d ints and %d floats",
                      opname(op), a->n_ints, a->n_floats);
  const int64_t *v = a->ints;
  int n = a->n_ints;
  g->KH = v[0], g->KW = v[1];
  g->sh = n > 2 ? v[2] : g->KH;
  g->sw = n > 3 ? v[3] : g->KW;
  g->ph = n > 4 ? v[4] : 0;
  g->pw = n > 5 ? v[5] : 0;
  if (g->KH < 1 || g->KW < 1 || g->KH > INT32_MAX || g->KW > INT32_MAX)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: kernel %lldx%lld must be >= 1",
                      opname(op), (long long)g->KH, (long long)g->KW);
  if (g->sh < 1 || g->sw < 1 || g->sh > INT32_MAX || g->sw > INT32_MAX)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: stride %lldx%lld must be >= 1",
                      opname(op), (long long)g->sh, (long long)g->sw);
  if (g->ph < 0 || g->pw < 0 || g->ph > g->KH / 2 || g->pw > g->KW / 2)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: padding %lldx%lld must be in [0, kernel/2] for "
                      "kernel %lldx%lld",
                      opname(op), (long long)g->ph, (long long)g->pw,
                      (long long)g->KH, (long long)g->KW);
  return 0;
}

/* Pool geometry of a 4-D float input x. */
static int pool_geo(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
                    const dsp_attrs *a, dsp_pool_geo *g) {
  int rc = need_rank(ctx, op, "input", x, 4, "[N, C, H, W]");
  if (rc < 0) return rc;
  if ((rc = need_float(ctx, op, "input", x)) < 0) return rc;
  if ((rc = pool_attrs(ctx, op, a, g)) < 0) return rc;
  g->N = x->shape[0], g->C = x->shape[1], g->H = x->shape[2],
  g->W = x->shape[3];
  if (g->H == 0 || g->W == 0)
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: input spatial size %lldx%lld is empty",
                      opname(op), (long long)g->H, (long long)g->W);
  rc = axis_out(ctx, op, "height", g->H, g->KH, g->sh, g->ph, 1, &g->OH);
  if (rc < 0) return rc;
  return axis_out(ctx, op, "width", g->W, g->KW, g->sw, g->pw, 1, &g->OW);
}

/* ------------------------------------------------------------------ */
/* inference per op                                                    */

static int infer_softmax(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                         int n_in, const dsp_attrs *a, dsp_meta *out) {
  int rc = dsp__want_attrs(ctx, op, a, 1, 0);
  if (rc < 0) return rc;
  if ((rc = need_float(ctx, op, "input", &in[0])) < 0) return rc;
  if (n_in == 2) {
    if ((rc = same_dtype(ctx, op, &in[0], &in[1])) < 0) return rc;
    if ((rc = same_shape(ctx, op, &in[0], &in[1])) < 0) return rc;
  }
  int d;
  if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], in[0].ndim, &d)) < 0)
    return rc;
  *out = in[0];
  return 0;
}

static int infer_ce(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                    const dsp_attrs *a, dsp_meta *out) {
  int rc = dsp__want_attrs(ctx, op, a, 0, 0);
  if (rc < 0) return rc;
  const dsp_meta *g = n_in == 3 ? &in[0] : NULL;
  const dsp_meta *x = &in[n_in - 2], *lab = &in[n_in - 1];
  if ((rc = need_float(ctx, op, "logits", x)) < 0) return rc;
  if ((rc = need_rank(ctx, op, "logits", x, 2, "[N, C]")) < 0) return rc;
  if (lab->dtype != DSP_I64)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: labels must be i64, got %s",
                      opname(op), dsp_dtype_name(lab->dtype));
  if ((rc = need_rank(ctx, op, "labels", lab, 1, "[N]")) < 0) return rc;
  if (lab->shape[0] != x->shape[0])
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: %lld labels for %lld rows of logits", opname(op),
                      (long long)lab->shape[0], (long long)x->shape[0]);
  if (x->shape[0] == 0 || x->shape[1] == 0)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: logits [%lld, %lld] are empty", opname(op),
                      (long long)x->shape[0], (long long)x->shape[1]);
  if (g) {
    if ((rc = same_dtype(ctx, op, g, x)) < 0) return rc;
    int64_t n;
    if ((rc = dsp_meta_numel(ctx, g, &n)) < 0) return rc;
    if (n != 1)
      return dsp_seterr(ctx, DISPATCH_ESHAPE,
                        "%s: grad must have one element, has %lld", opname(op),
                        (long long)n);
    *out = *x;
  } else {
    out->dtype = x->dtype;
    out->ndim = 0;
  }
  return 0;
}

static int infer_conv(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                      const dsp_attrs *a, dsp_meta *out, dsp_conv_geo *g) {
  int rc;
  if (a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes no float attributes",
                      opname(op));
  if ((rc = need_float(ctx, op, "input", &in[0])) < 0) return rc;
  if ((rc = same_dtype(ctx, op, &in[0], &in[1])) < 0) return rc;
  if (op == DSP_OP_CONV2D) {
    if ((rc = need_rank(ctx, op, "input", &in[0], 4, "[N, C, H, W]")) < 0)
      return rc;
    if ((rc = need_rank(ctx, op, "weight", &in[1], 4, "[O, C, kh, kw]")) < 0)
      return rc;
    if ((rc = conv_attrs(ctx, op, a->ints, a->n_ints, g)) < 0) return rc;
    if ((rc = conv_geo(ctx, op, in[0].shape, in[1].shape, g)) < 0) return rc;
    *out = (dsp_meta){in[0].dtype, 4, {g->N, g->O, g->OH, g->OW}};
    return 0;
  }
  /* backward ops: (grad_out, w) or (grad_out, x), ints end with the 4 dims
   * of the tensor being differentiated */
  int is_input = op == DSP_OP_CONV2D_BACKWARD_INPUT;
  if ((rc = need_rank(ctx, op, "grad", &in[0], 4, "[N, O, OH, OW]")) < 0)
    return rc;
  if ((rc = need_rank(ctx, op, is_input ? "weight" : "input", &in[1], 4,
                      is_input ? "[O, C, kh, kw]" : "[N, C, H, W]")) < 0)
    return rc;
  if (a->n_ints < 4)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: ints must end with the 4 dims of the %s, got %d ints",
                      opname(op), is_input ? "input" : "weight", a->n_ints);
  int nconv = a->n_ints - 4;
  const int64_t *dims = a->ints + nconv;
  for (int i = 0; i < 4; i++)
    if (dims[i] < 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: target dim %d is %lld",
                        opname(op), i, (long long)dims[i]);
  if ((rc = conv_attrs(ctx, op, a->ints, nconv, g)) < 0) return rc;
  const int64_t *xs = is_input ? dims : in[1].shape;
  const int64_t *ws = is_input ? in[1].shape : dims;
  if ((rc = conv_geo(ctx, op, xs, ws, g)) < 0) return rc;
  dsp_meta want = {in[0].dtype, 4, {g->N, g->O, g->OH, g->OW}};
  if (!dsp_meta_equal(&want, &in[0])) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: grad is %s but the conv output is %s", opname(op),
                      dsp_shape_str(&in[0], s1, sizeof s1),
                      dsp_shape_str(&want, s2, sizeof s2));
  }
  *out = (dsp_meta){in[0].dtype, 4, {dims[0], dims[1], dims[2], dims[3]}};
  return 0;
}

static int infer_pool(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                      int n_in, const dsp_attrs *a, dsp_meta *out,
                      dsp_pool_geo *g) {
  const dsp_meta *x = &in[n_in - 1];
  int rc = pool_geo(ctx, op, x, a, g);
  if (rc < 0) return rc;
  dsp_meta y = {x->dtype, 4, {g->N, g->C, g->OH, g->OW}};
  if (n_in == 1) {
    *out = y;
    return 0;
  }
  if ((rc = same_dtype(ctx, op, &in[0], x)) < 0) return rc;
  if (!dsp_meta_equal(&in[0], &y)) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: grad is %s but the pool output is %s", opname(op),
                      dsp_shape_str(&in[0], s1, sizeof s1),
                      dsp_shape_str(&y, s2, sizeof s2));
  }
  *out = *x;
  return 0;
}

/* Validates every input and attribute of an nn op and computes its output
 * meta; the conv and pool geometry come back for the kernels to reuse. */
int dsp__nn_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                 const dsp_attrs *a, dsp_meta *out, dsp_conv_geo *cg,
                 dsp_pool_geo *pg) {
  int rc;
  switch (op) {
    case DSP_OP_SOFTMAX:
    case DSP_OP_LOG_SOFTMAX:
    case DSP_OP_SOFTMAX_BACKWARD:
    case DSP_OP_LOG_SOFTMAX_BACKWARD:
      return infer_softmax(ctx, op, in, n_in, a, out);
    case DSP_OP_CROSS_ENTROPY:
    case DSP_OP_CROSS_ENTROPY_BACKWARD:
      return infer_ce(ctx, op, in, n_in, a, out);
    case DSP_OP_MSE:
      if ((rc = dsp__want_attrs(ctx, op, a, 0, 0)) < 0) return rc;
      if ((rc = need_float(ctx, op, "input", &in[0])) < 0) return rc;
      if ((rc = same_dtype(ctx, op, &in[0], &in[1])) < 0) return rc;
      if ((rc = same_shape(ctx, op, &in[0], &in[1])) < 0) return rc;
      for (int i = 0; i < in[0].ndim; i++)
        if (in[0].shape[i] == 0)
          return dsp_seterr(ctx, DISPATCH_ESHAPE, "mse: inputs are empty");
      out->dtype = in[0].dtype;
      out->ndim = 0;
      return 0;
    case DSP_OP_CONV2D:
    case DSP_OP_CONV2D_BACKWARD_INPUT:
    case DSP_OP_CONV2D_BACKWARD_WEIGHT:
      return infer_conv(ctx, op, in, a, out, cg);
    case DSP_OP_MAX_POOL2D:
    case DSP_OP_AVG_POOL2D:
    case DSP_OP_MAX_POOL2D_BACKWARD:
    case DSP_OP_AVG_POOL2D_BACKWARD:
      return infer_pool(ctx, op, in, n_in, a, out, pg);
    case DSP_OP_ATTENTION:
    case DSP_OP_ATTENTION_BACKWARD: {
      dsp_attn_geo ag;
      return dsp__attn_plan(ctx, op, in, n_in, a, out, &ag);
    }
    case DSP_OP_DROPOUT: {
      if ((rc = dsp__want_attrs(ctx, op, a, 1, 1)) < 0) return rc;
      if ((rc = need_float(ctx, op, "input", &in[0])) < 0) return rc;
      double p = a->floats[0];
      if (!(p >= 0.0 && p < 1.0))
        return dsp_seterr(ctx, DISPATCH_EINVAL, "dropout: p = %g outside [0, 1)",
                          p);
      *out = in[0];
      return 0;
    }
    default:
      return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "nn: op %s unknown",
                        opname(op));
  }
}

int dsp__infer_nn(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                  const dsp_attrs *a, dsp_meta *out) {
  dsp_conv_geo cg;
  dsp_pool_geo pg;
  if (dsp__is_norm_op(op)) {
    dsp_norm_geo ng;
    return dsp__norm_plan(ctx, op, in, n_in, a, out, &ng);
  }
  return dsp__nn_plan(ctx, op, in, n_in, a, out, &cg, &pg);
}
