/* linalg family: matmul with numpy.matmul semantics, on OpenBLAS.
 *
 * A 1-D left operand is promoted to a [1, K] row and a 1-D right operand to
 * a [K, 1] column; the promoted dim is dropped from the result. Every dim
 * before the last two is a batch dim and the two operands' batch dims
 * broadcast like numpy. Each batch entry is one cblas_?gemm call straight
 * on the tensors' storage (no copies); when the right operand has no batch
 * (or only size-1 batch dims) the left operand's batch folds into M and the
 * whole product is a single gemm. */
#include <cblas.h>
#include <limits.h>

#include "dsp_internal.h"

/* The matrix view of one operand: its batch dims and its [rows, cols]. */
typedef struct mm_view {
  int nbatch;
  int64_t batch[DSP_MAX_DIMS];
  int64_t rows, cols;
} mm_view;

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
static int mm_plan(dsp_ctx *ctx, const dsp_meta *a, const dsp_meta *b,
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

int dsp__infer_linalg(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                      int n_in, const dsp_attrs *a, dsp_meta *out) {
  (void)n_in;
  if (op != DSP_OP_MATMUL)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "linalg: op %d unknown",
                      (int)op);
  if (a->n_ints != 0 || a->n_floats != 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "matmul: takes no attributes");
  mm_view va, vb;
  dsp_meta bshape;
  return mm_plan(ctx, &in[0], &in[1], &va, &vb, &bshape, out);
}

/* One product C[m,n] = A[m,k] @ B[k,n], in blocks of A's rows so that a
 * huge product looks at the cancel flag every ~2^33 multiply-adds. Each
 * block makes BLAS pack all of B again, so blocks stay large: every
 * product make bench runs (up to 2048^3 = 2^33) is still one call, and a
 * block is a fraction of a second at BLAS speed. 1 when ctx was cancelled
 * (C partly written), else 0. */
#define MM_BLOCK_WORK ((int64_t)1 << 33)
static int mm_gemm(dsp_ctx *ctx, dsp_dtype dt, int m, int n, int k,
                   const char *a, const char *b, char *c) {
  size_t es = dsp_dtype_size(dt);
  int64_t bm = MM_BLOCK_WORK / ((int64_t)n * k);
  if (bm < 1) bm = 1;
  for (int64_t r = 0; r < m; r += bm) {
    if (dsp_ctx_cancelled(ctx)) return 1;
    int mb = (int)(m - r < bm ? m - r : bm);
    const char *ar = a + (size_t)(r * k) * es;
    char *cr = c + (size_t)(r * n) * es;
    if (dt == DSP_F32)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, n, k, 1.0f,
                  (const float *)ar, k, (const float *)b, n, 0.0f,
                  (float *)cr, n);
    else
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mb, n, k, 1.0,
                  (const double *)ar, k, (const double *)b, n, 0.0,
                  (double *)cr, n);
  }
  return 0;
}

/* Runs the product: results only depend on the operands (each output
 * element comes from one gemm call with a fixed K order), so repeated runs
 * are bit-identical. An empty product (M, N or batch 0) writes nothing; an
 * empty K leaves the zeroed output as the correct all-zero result. */
int dsp__cpu_linalg(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, dsp_tensor *out) {
  (void)n_in, (void)a;
  if (op != DSP_OP_MATMUL)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "linalg: op %d unknown",
                      (int)op);
  mm_view va, vb;
  dsp_meta bshape, om;
  int rc = mm_plan(ctx, &in[0]->meta, &in[1]->meta, &va, &vb, &bshape, &om);
  if (rc < 0) return rc;
  int64_t M = va.rows, K = va.cols, N = vb.cols;
  if (out->numel == 0 || K == 0) return 0;
  dsp_dtype dt = in[0]->meta.dtype;
  size_t es = dsp_dtype_size(dt);
  const char *pa = dsp_tensor_data(in[0]), *pb = dsp_tensor_data(in[1]);
  char *pc = dsp_tensor_data(out);

  int b_batched = 0;
  for (int i = 0; i < vb.nbatch; i++) b_batched |= vb.batch[i] != 1;
  int64_t nbat = out->numel / (M * N);
  /* b shared by every batch entry: the output batch equals a's batch (b's
   * size-1 dims only add leading 1s), a's entries are contiguous, so the
   * batch folds into M and the whole product is one gemm */
  if (!b_batched && nbat * M <= INT_MAX) {
    if (mm_gemm(ctx, dt, (int)(nbat * M), (int)N, (int)K, pa, pb, pc))
      return dsp__cancelled_err(ctx, op);
    return 0;
  }
  /* general case: walk the broadcast batch index, one gemm per entry */
  int nd = bshape.ndim;
  int64_t sa[DSP_MAX_DIMS], sb[DSP_MAX_DIMS], idx[DSP_MAX_DIMS] = {0};
  int64_t acc_a = M * K, acc_b = K * N;
  for (int i = nd - 1; i >= 0; i--) {
    int ia = va.nbatch - nd + i, ib = vb.nbatch - nd + i;
    int64_t da = ia >= 0 ? va.batch[ia] : 1, db = ib >= 0 ? vb.batch[ib] : 1;
    sa[i] = da == 1 ? 0 : acc_a;
    sb[i] = db == 1 ? 0 : acc_b;
    acc_a *= da;
    acc_b *= db;
  }
  int64_t offa = 0, offb = 0;
  for (int64_t e = 0; e < nbat; e++) {
    if (mm_gemm(ctx, dt, (int)M, (int)N, (int)K, pa + (size_t)offa * es,
                pb + (size_t)offb * es, pc + (size_t)(e * M * N) * es))
      return dsp__cancelled_err(ctx, op);
    for (int i = nd - 1; i >= 0; i--) {
      offa += sa[i];
      offb += sb[i];
      if (++idx[i] < bshape.shape[i]) break;
      offa -= sa[i] * idx[i];
      offb -= sb[i] * idx[i];
      idx[i] = 0;
    }
  }
  return 0;
}
