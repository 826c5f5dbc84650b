/* nn family: shape inference for fused scaled dot-product attention and
 * its backward op (CPU kernels: common/cpu/attn.c; CUDA:
 * common/cuda/attn.c). The checks name the operand and both shapes, so a
 * caller who swapped k and v or forgot the head dim sees which. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

static int bad_shape(dsp_ctx *ctx, dsp_opcode op, const char *what,
                     const dsp_meta *m, const char *want) {
  char s[128];
  return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: %s is %s, want %s", opname(op),
                    what, dsp_shape_str(m, s, sizeof s), want);
}

/* q, k, v (and the grad, for the backward op): float, one dtype, rank 4,
 * batch and heads agreeing, k and v the same length, q and k the same
 * head size. */
static int check_qkv(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *q,
                     const dsp_meta *k, const dsp_meta *v, dsp_attn_geo *g) {
  const dsp_meta *m[3] = {q, k, v};
  static const char *const names[3] = {"q", "k", "v"};
  static const char *const layout[3] = {"[B, H, Tq, d]", "[B, H, Tk, d]",
                                        "[B, H, Tk, dv]"};
  for (int i = 0; i < 3; i++) {
    if (!dsp_dtype_is_float(m[i]->dtype))
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s must be f32 or f64, got %s",
                        opname(op), names[i], dsp_dtype_name(m[i]->dtype));
    if (m[i]->dtype != q->dtype)
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: q is %s but %s is %s",
                        opname(op), dsp_dtype_name(q->dtype), names[i],
                        dsp_dtype_name(m[i]->dtype));
    if (m[i]->ndim != 4) return bad_shape(ctx, op, names[i], m[i], layout[i]);
    for (int d = 0; d < 4; d++)
      if (m[i]->shape[d] > INT_MAX)
        return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                          "%s: %s's dim %d (%lld) is over %d", opname(op),
                          names[i], d, (long long)m[i]->shape[d], INT_MAX);
  }
  char s1[128], s2[128], s3[128];
  if (k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] ||
      k->shape[1] != q->shape[1] || v->shape[1] != q->shape[1] ||
      k->shape[2] != v->shape[2] || k->shape[3] != q->shape[3])
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: q %s, k %s, v %s do not fit q [B, H, Tq, d], "
                      "k [B, H, Tk, d], v [B, H, Tk, dv]",
                      opname(op), dsp_shape_str(q, s1, sizeof s1),
                      dsp_shape_str(k, s2, sizeof s2),
                      dsp_shape_str(v, s3, sizeof s3));
  g->B = q->shape[0], g->H = q->shape[1], g->Tq = q->shape[2];
  g->d = q->shape[3], g->Tk = k->shape[2], g->dv = v->shape[3];
  return 0;
}

/* ints {causal, has_mask} each 0 or 1, has_mask matching the inputs;
 * floats {scale}, finite (0 picks 1/sqrt(d)). */
static int check_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                       int n_tensors, dsp_attn_geo *g) {
  int rc = dsp__want_attrs(ctx, op, a, 2, 1);
  if (rc < 0) return rc;
  for (int i = 0; i < 2; i++)
    if (a->ints[i] != 0 && a->ints[i] != 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %lld, want 0 or 1",
                        opname(op), i ? "has_mask" : "causal",
                        (long long)a->ints[i]);
  if (n_tensors != 3 + (int)a->ints[1])
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: has_mask = %lld but %d tensor inputs after the "
                      "grad (want q, k, v%s)",
                      opname(op), (long long)a->ints[1], n_tensors,
                      a->ints[1] ? ", key_mask" : "");
  double s = a->floats[0];
  if (!isfinite(s))
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: scale %g is not finite",
                      opname(op), s);
  g->causal = (int)a->ints[0];
  g->has_mask = (int)a->ints[1];
  g->scale = s;
  return 0;
}

int dsp__attn_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                   const dsp_attrs *a, dsp_meta *out, dsp_attn_geo *g) {
  const int bw = op == DSP_OP_ATTENTION_BACKWARD;
  if (op != DSP_OP_ATTENTION && !bw)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL, "attention plan: op %s",
                      opname(op));
  const dsp_meta *t = in + bw; /* q, k, v, [mask] */
  int nt = n_in - bw;
  if (nt != 3 && nt != 4)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes %s3 or 4 inputs "
                      "(q, k, v, [key_mask]), got %d",
                      opname(op), bw ? "the grad and " : "", nt < 0 ? 0 : nt);
  int rc = check_attrs(ctx, op, a, nt, g);
  if (rc < 0) return rc;
  if ((rc = check_qkv(ctx, op, &t[0], &t[1], &t[2], g)) < 0) return rc;
  if (g->has_mask) {
    const dsp_meta *m = &t[3];
    if (m->dtype != DSP_BOOL)
      return dsp_seterr(ctx, DISPATCH_EDTYPE,
                        "%s: key_mask must be bool, got %s", opname(op),
                        dsp_dtype_name(m->dtype));
    if (m->ndim != 2 || m->shape[0] != g->B || m->shape[1] != g->Tk) {
      char want[96];
      snprintf(want, sizeof want, "[B, Tk] = [%lld, %lld]", (long long)g->B,
               (long long)g->Tk);
      return bad_shape(ctx, op, "key_mask", m, want);
    }
  }
  if (g->scale == 0.0) g->scale = g->d > 0 ? 1.0 / sqrt((double)g->d) : 1.0;
  dsp_meta o = {t[0].dtype, 4, {g->B, g->H, g->Tq, g->dv}};
  if (!bw) {
    *out = o;
    return 0;
  }
  if (in[0].dtype != o.dtype || !dsp_meta_equal(&in[0], &o)) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, in[0].dtype != o.dtype ? DISPATCH_EDTYPE
                                                  : DISPATCH_ESHAPE,
                      "%s: grad is %s %s but the attention output is %s %s",
                      opname(op), dsp_dtype_name(in[0].dtype),
                      dsp_shape_str(&in[0], s1, sizeof s1),
                      dsp_dtype_name(o.dtype), dsp_shape_str(&o, s2, sizeof s2));
  }
  /* one flat result of every input gradient: its length is checked here
   * and its byte size by dsp_meta_check after inference */
  int64_t n = 0, part;
  for (int i = 1; i <= 3; i++) {
    if (dsp_meta_numel(ctx, &in[i], &part) < 0 ||
        __builtin_add_overflow(n, part, &n))
      return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                        "%s: dq, dk and dv together overflow", opname(op));
  }
  *out = (dsp_meta){o.dtype, 1, {n}};
  return 0;
}
