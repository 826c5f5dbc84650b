/* linalg family, shape inference: matmul with numpy.matmul semantics
 * (CPU kernel on OpenBLAS: common/cpu/linalg.c), of op(a) and op(b) when
 * its attributes ask for transposed operands (dsp__mm_attrs).
 *
 * A 1-D left operand is promoted to a [1, K] row and a 1-D right operand to
 * a [K, 1] column; the promoted dim is dropped from the result. Every dim
 * before the last two is a batch dim and the two operands' batch dims
 * broadcast like numpy. */
#include <limits.h>

#include "dsp_internal.h"
#include "ops_plan.h"

typedef dsp_mm_view mm_view;

static void mm_split(const dsp_meta *m, int is_left, mm_view *v) {
  if (m->ndim == 1) {
    v->nbatch = 0;
    v->rows = is_left ? 1 : m->shape[0];
    v->cols = is_left ? m->shape[0] : 1;
    return;
  }
  v->nbatch = m->ndim - 2;
  for (int i = 0; i < v->nbatch; i++) v->batch[i] = m->shape[i];
  v->rows = m->shape[m->ndim - 2];
  v->cols = m->shape[m->ndim - 1];
}

/* Validates a matmul and computes its output meta; also hands back the
 * operand views and the broadcast batch shape so the kernel and inference
 * agree by construction. */
int dsp__mm_plan(dsp_ctx *ctx, const dsp_meta *a, const dsp_meta *b,
                   mm_view *va, mm_view *vb, dsp_meta *bshape,
                   dsp_meta *out) {
  if (a->dtype != b->dtype)
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "matmul: dtypes %s and %s differ",
                      dsp_dtype_name(a->dtype), dsp_dtype_name(b->dtype));
  if (!dsp_dtype_is_float(a->dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "matmul: needs f32 or f64 operands, got %s",
                      dsp_dtype_name(a->dtype));
  if (a->ndim < 1 || b->ndim < 1)
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "matmul: operands need rank >= 1, got ranks %d and %d",
                      a->ndim, b->ndim);
  mm_split(a, 1, va);
  mm_split(b, 0, vb);
  if (va->cols != vb->rows)
    return dsp_seterr(ctx, DISPATCH_ESHAPE, "matmul: inner dims %lld and %lld differ",
                      (long long)va->cols, (long long)vb->rows);
  dsp_meta ba = {a->dtype, va->nbatch, {0}}, bb = {a->dtype, vb->nbatch, {0}};
  for (int i = 0; i < va->nbatch; i++) ba.shape[i] = va->batch[i];
  for (int i = 0; i < vb->nbatch; i++) bb.shape[i] = vb->batch[i];
  int rc = dsp_broadcast_shapes(ctx, "matmul", &ba, &bb, bshape);
  if (rc < 0) {
    char s1[128], s2[128];
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "matmul: batch dims of %s and %s do not broadcast",
                      dsp_shape_str(a, s1, sizeof s1),
                      dsp_shape_str(b, s2, sizeof s2));
  }
  /* BLAS takes int sizes and leading dims */
  if (va->rows > INT_MAX || va->cols > INT_MAX || vb->cols > INT_MAX)
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                      "matmul: matrix dims %lld x %lld x %lld exceed BLAS int range",
                      (long long)va->rows, (long long)va->cols,
                      (long long)vb->cols);
  int nd = bshape->ndim;
  if (a->ndim > 1) nd++;
  if (b->ndim > 1) nd++;
  if (nd > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EDIM, "matmul: result rank %d exceeds %d",
                      nd, DSP_MAX_DIMS);
  out->dtype = a->dtype;
  out->ndim = 0;
  for (int i = 0; i < bshape->ndim; i++) out->shape[out->ndim++] = bshape->shape[i];
  if (a->ndim > 1) out->shape[out->ndim++] = va->rows;
  if (b->ndim > 1) out->shape[out->ndim++] = vb->cols;
  return 0;
}

int dsp__mm_attrs(dsp_ctx *ctx, const dsp_attrs *a, const dsp_meta *in,
                  int *ta, int *tb, dsp_meta eff[2]) {
  *ta = *tb = 0;
  if ((a->n_ints != 0 && a->n_ints != 2) || a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "matmul: takes no attributes or 2 int attributes "
                      "(transpose a, transpose b), got %d int and %d float",
                      a->n_ints, a->n_floats);
  for (int i = 0; i < 2; i++) {
    eff[i] = in[i];
    int64_t t = a->n_ints == 2 ? a->ints[i] : 0;
    if (t != 0 && t != 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "matmul: transpose flag %d is %lld, not 0 or 1", i,
                        (long long)t);
    if (!t) continue;
    int nd = in[i].ndim;
    if (nd < 2)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "matmul: transposing operand %d needs rank >= 2, "
                        "got rank %d",
                        i, nd);
    eff[i].shape[nd - 2] = in[i].shape[nd - 1];
    eff[i].shape[nd - 1] = in[i].shape[nd - 2];
  }
  *ta = a->n_ints == 2 && a->ints[0] == 1;
  *tb = a->n_ints == 2 && a->ints[1] == 1;
  return 0;
}

int dsp__infer_linalg(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                      int n_in, const dsp_attrs *a, dsp_meta *out) {
  (void)n_in;
  if (op != DSP_OP_MATMUL)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "linalg: op %d unknown",
                      (int)op);
  int ta, tb;
  dsp_meta eff[2];
  int rc = dsp__mm_attrs(ctx, a, in, &ta, &tb, eff);
  if (rc < 0) return rc;
  mm_view va, vb;
  dsp_meta bshape;
  return dsp__mm_plan(ctx, &eff[0], &eff[1], &va, &vb, &bshape, out);
}
