/* linalg family, CPU kernel: matmul on OpenBLAS (inference:
 * common/ops_linalg.c).
 *
 * Each batch entry is one product straight on the tensors' storage (no
 * copies), cut into single-threaded cblas_?gemm calls the backend's
 * threads share (mm_gemm_t), with BLAS's transpose flags where the attributes
 * ask for op(a) = a^T or op(b) = b^T (the matmul backward's g b^T and
 * a^T g, without copying a transpose first); when the right operand has
 * no batch (or only size-1 batch dims) and the left one is not
 * transposed, the left operand's batch folds into M and the whole product
 * is a single product. */
#include <cblas.h>
#include <limits.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"
#include "par.h"

_Static_assert(DSP__OPS_IN_FAMILY(LINALG) == 1,
               "a new linalg op needs a case in dsp__cpu_linalg and a row in "
               "the CPU support table (common/cpu/backend.c)");

/* One product C[m,n] = op(A) @ op(B), cut into chunks that the backend's
 * threads share (par.h), each chunk one single-threaded BLAS call on its
 * rows of C (MM_ROWS of them; fewer when a row is more than MM_BLOCK_WORK
 * multiply-adds / MM_ROWS, so a huge product still looks at the cancel
 * flag between chunks), or, for a product with few rows and enough
 * columns (the weight gradient a^T g), on its MM_COLS columns of C. The
 * cut depends only on m, n and k, never on the thread count, so the bits
 * are the same for any number of threads (OpenBLAS's own threads would
 * cut the product by their number, which changes the rounding: the pool
 * runs it single-threaded). 1 when ctx was cancelled (C partly written),
 * else 0. */
#define MM_BLOCK_WORK ((int64_t)1 << 33)
#define MM_ROWS 64
#define MM_COLS 32

typedef struct mm_job {
  dsp_dtype dt;
  int ta, tb, m, n, k, by_cols;
  const char *a, *b;
  char *c;
} mm_job;

static int mm_chunk(void *arg, int64_t lo, int64_t hi, int lane) {
  const mm_job *j = arg;
  (void)lane;
  const size_t es = dsp_dtype_size(j->dt);
  const int r0 = j->by_cols ? 0 : (int)lo, mb = j->by_cols ? j->m : (int)(hi - lo);
  const int c0 = j->by_cols ? (int)lo : 0, nb = j->by_cols ? (int)(hi - lo) : j->n;
  /* op(A) = A [m,k] (lda k) or A^T with A stored [k,m] (lda m); op(B) = B
   * [k,n] (ldb n) or B^T with B stored [n,k] (ldb k) */
  const int lda = j->ta ? j->m : j->k, ldb = j->tb ? j->k : j->n;
  const CBLAS_TRANSPOSE oa = j->ta ? CblasTrans : CblasNoTrans,
                        ob = j->tb ? CblasTrans : CblasNoTrans;
  const char *ar = j->a + (size_t)(j->ta ? r0 : (int64_t)r0 * j->k) * es;
  const char *bc = j->b + (size_t)(j->tb ? (int64_t)c0 * j->k : c0) * es;
  char *cr = j->c + (size_t)((int64_t)r0 * j->n + c0) * es;
  if (j->dt == DSP_F32)
    cblas_sgemm(CblasRowMajor, oa, ob, mb, nb, j->k, 1.0f, (const float *)ar,
                lda, (const float *)bc, ldb, 0.0f, (float *)cr, j->n);
  else
    cblas_dgemm(CblasRowMajor, oa, ob, mb, nb, j->k, 1.0, (const double *)ar,
                lda, (const double *)bc, ldb, 0.0, (double *)cr, j->n);
  return 0;
}

static int mm_gemm_t(dsp_ctx *ctx, dsp_dtype dt, int ta, int tb, int m, int n,
                     int k, const char *a, const char *b, char *c) {
  dsp__par_blas_single();
  mm_job j = {.dt = dt, .ta = ta, .tb = tb, .m = m, .n = n, .k = k,
              .a = a, .b = b, .c = c};
  int64_t total = m, grain = MM_BLOCK_WORK / ((int64_t)n * k);
  if (grain > MM_ROWS) grain = MM_ROWS;
  if (grain < 1) grain = 1;
  if (m < 4 * MM_ROWS && n >= 2 * MM_COLS &&
      (int64_t)m * MM_COLS * k <= MM_BLOCK_WORK) {
    j.by_cols = 1;
    total = n, grain = MM_COLS;
  }
  return dsp__par_for(ctx, total, grain, mm_chunk, &j);
}

/* Runs the product: results only depend on the operands (each output
 * element comes from one gemm call of a fixed cut, with a fixed K order),
 * so repeated runs are bit-identical, whatever the thread count. An empty
 * product (M, N or batch 0) writes nothing; an empty K writes the
 * all-zero result (the output arrives unzeroed: backend.c). */
int dsp__cpu_linalg(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, dsp_tensor *out) {
  if (op != DSP_OP_MATMUL ||
      (in[0]->meta.dtype != DSP_F32 && in[0]->meta.dtype != DSP_F64))
    return dsp__no_kernel(ctx, op, in, n_in, out);
  const dsp_meta ms[2] = {in[0]->meta, in[1]->meta};
  dsp_meta eff[2];
  int ta, tb;
  int rc = dsp__mm_attrs(ctx, a, ms, &ta, &tb, eff);
  if (rc < 0) return rc;
  dsp_mm_view va, vb;
  dsp_meta bshape, om;
  rc = dsp__mm_plan(ctx, &eff[0], &eff[1], &va, &vb, &bshape, &om);
  if (rc < 0) return rc;
  int64_t M = va.rows, K = va.cols, N = vb.cols;
  if (out->numel == 0) return 0;
  if (K == 0) { /* the sum of no products; the output is not zeroed */
    memset(dsp_tensor_data(out), 0,
           (size_t)out->numel * dsp_dtype_size(out->meta.dtype));
    return 0;
  }
  dsp_dtype dt = in[0]->meta.dtype;
  size_t es = dsp_dtype_size(dt);
  const char *pa = dsp_tensor_data(in[0]), *pb = dsp_tensor_data(in[1]);
  char *pc = dsp_tensor_data(out);

  int b_batched = 0;
  for (int i = 0; i < vb.nbatch; i++) b_batched |= vb.batch[i] != 1;
  int64_t nbat = out->numel / (M * N);
  /* b shared by every batch entry: the output batch equals a's batch (b's
   * size-1 dims only add leading 1s), a's entries are contiguous, so the
   * batch folds into M and the whole product is one gemm (not when a is
   * transposed: its entries' rows of op(a) are not one [nbat*M, K]) */
  if (!b_batched && !ta && nbat * M <= INT_MAX) {
    if (mm_gemm_t(ctx, dt, 0, tb, (int)(nbat * M), (int)N, (int)K, pa, pb, pc))
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
    if (mm_gemm_t(ctx, dt, ta, tb, (int)M, (int)N, (int)K,
                  pa + (size_t)offa * es, pb + (size_t)offb * es,
                  pc + (size_t)(e * M * N) * es))
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
