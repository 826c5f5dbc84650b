/* issue 23: loss. Inference and the shared plan of cross_entropy_ex and
 * its backward op (CPU kernels: common/cpu/loss.c; CUDA: common/cuda/
 * loss.c). The semantics are torch.nn.functional.cross_entropy's (1.13):
 * class dim 1 (0 for 1-D logits), ignore_index, label smoothing, and the
 * three reductions, mean dividing by the number of non-ignored labels. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"
#include "ops_plan.h"

#define opname dsp__opname

/* The attributes: ints {ignore_index, reduction}, floats {smoothing}. */
static int ce_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                    dsp_ce_geo *g) {
  if (a->n_ints != 2 || a->n_floats != 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes ints {ignore_index, reduction} and floats "
                      "{label_smoothing}, got %d ints and %d floats",
                      opname(op), a->n_ints, a->n_floats);
  g->ignore = a->ints[0];
  if (a->ints[1] < DSP_REDUCE_NONE || a->ints[1] > DSP_REDUCE_MEAN)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: reduction %lld is not 0 (none), 1 (sum) or 2 "
                      "(mean)",
                      opname(op), (long long)a->ints[1]);
  g->reduction = (int)a->ints[1];
  g->smoothing = a->floats[0];
  if (!(g->smoothing >= 0.0 && g->smoothing <= 1.0))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: label_smoothing %g outside [0, 1]", opname(op),
                      g->smoothing);
  return 0;
}

/* logits [N, C, d1..] with labels [N, d1..], or logits [C] with a 0-D
 * label: the [outer, C, inner] view and the forward output's meta. */
static int ce_layout(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
                     const dsp_meta *lab, dsp_ce_geo *g, dsp_meta *y) {
  char s1[128], s2[128];
  if (!dsp_dtype_is_float(x->dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "%s: logits must be f32 or f64, got %s", opname(op),
                      dsp_dtype_name(x->dtype));
  if (lab->dtype != DSP_I64)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: labels must be i64, got %s",
                      opname(op), dsp_dtype_name(lab->dtype));
  if (x->ndim < 1)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: logits must be [N, C, d1, ...] or [C], got a "
                      "scalar",
                      opname(op));
  int cdim = x->ndim == 1 ? 0 : 1;
  int ok = lab->ndim == x->ndim - 1;
  for (int i = 0, j = 0; ok && i < x->ndim; i++)
    if (i != cdim) ok = x->shape[i] == lab->shape[j++];
  if (!ok)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "%s: labels %s do not match logits %s (want the "
                      "logits' shape without dim %d)",
                      opname(op), dsp_shape_str(lab, s1, sizeof s1),
                      dsp_shape_str(x, s2, sizeof s2), cdim);
  g->C = x->shape[cdim];
  if (g->C < 1)
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: logits %s have no classes",
                      opname(op), dsp_shape_str(x, s1, sizeof s1));
  g->outer = cdim ? x->shape[0] : 1;
  g->inner = 1;
  for (int i = 2; i < x->ndim; i++) g->inner *= x->shape[i];
  if (g->reduction == DSP_REDUCE_NONE) {
    *y = *lab;
    y->dtype = x->dtype;
  } else {
    memset(y, 0, sizeof *y);
    y->dtype = x->dtype;
  }
  return 0;
}

int dsp__ce_ex_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                    int n_in, const dsp_attrs *a, dsp_meta *out,
                    dsp_ce_geo *g) {
  memset(g, 0, sizeof *g);
  int bw = op == DSP_OP_CROSS_ENTROPY_EX_BACKWARD;
  if (n_in != (bw ? 3 : 2))
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes %d inputs, got %d",
                      opname(op), bw ? 3 : 2, n_in);
  int rc = ce_attrs(ctx, op, a, g);
  if (rc < 0) return rc;
  dsp_meta y;
  if ((rc = ce_layout(ctx, op, &in[bw], &in[bw + 1], g, &y)) < 0) return rc;
  if (!bw) {
    *out = y;
    return 0;
  }
  if (in[0].dtype != y.dtype)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: grad is %s but logits are %s",
                      opname(op), dsp_dtype_name(in[0].dtype),
                      dsp_dtype_name(y.dtype));
  if ((rc = dsp__grad_shape(ctx, op, &in[0], &y, "loss")) < 0) return rc;
  *out = in[1];
  return 0;
}

/* A kernel's plan from its input tensors (the CPU and CUDA kernels
 * re-derive it rather than trust inference's). */
int dsp__ce_ex_kernel_plan(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                           int n_in, const dsp_attrs *a, dsp_ce_geo *g) {
  dsp_meta ms[3], om;
  if (n_in < 2 || n_in > 3)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL, "%s: bad input count %d",
                      opname(op), n_in);
  for (int i = 0; i < n_in; i++) ms[i] = in[i]->meta;
  return dsp__ce_ex_plan(ctx, op, ms, n_in, a, &om, g);
}

/* The first label that is neither ignore_index nor a class, as its flat
 * position, or -1. */
int64_t dsp__ce_ex_bad_label(const dsp_ce_geo *g, const int64_t *lab) {
  int64_t n = g->outer * g->inner;
  for (int64_t i = 0; i < n; i++)
    if (lab[i] != g->ignore && (lab[i] < 0 || lab[i] >= g->C)) return i;
  return -1;
}

int dsp__ce_ex_label_err(dsp_ctx *ctx, dsp_opcode op, const dsp_ce_geo *g,
                         int64_t pos, int64_t v) {
  return dsp_seterr(ctx, DISPATCH_EINDEX,
                    "%s: label %lld at position %lld out of range for %lld "
                    "classes (ignore_index %lld)",
                    opname(op), (long long)v, (long long)pos, (long long)g->C,
                    (long long)g->ignore);
}
