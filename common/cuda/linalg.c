/* linalg family on CUDA: matmul on cuBLAS (strided-batched gemm). */
#include "cuda_be.h"

/* One strided-batched product on cuBLAS in the operands' dtype: S/Dgemm
 * for f32 / f64; for f16 and bf16 GemmEx with f32 compute (CUBLAS_COMPUTE_32F:
 * the products and their sums in f32 on the tensor cores, the output
 * rounded to half once; the handle refuses half-precision split-K
 * reductions, see queue_open in device.c). Column-major arguments as
 * cublas<t>gemmStridedBatched takes them. */
static cublasStatus_t gemm_batched(cublasHandle_t h, dsp_dtype dt,
                                   cublasOperation_t ob, cublasOperation_t oa,
                                   int n, int m, int k, const void *B, int ldb,
                                   long long sb, const void *A, int lda,
                                   long long sa, void *C, long long sc,
                                   int cnt) {
  if (dt == DSP_F64) {
    const double one = 1.0, zero = 0.0;
    return cublasDgemmStridedBatched(h, ob, oa, n, m, k, &one, B, ldb, sb, A,
                                     lda, sa, &zero, C, n, sc, cnt);
  }
  const float one = 1.0f, zero = 0.0f;
  if (dt == DSP_F32)
    return cublasSgemmStridedBatched(h, ob, oa, n, m, k, &one, B, ldb, sb, A,
                                     lda, sa, &zero, C, n, sc, cnt);
  const cudaDataType_t t = dt == DSP_F16 ? CUDA_R_16F : CUDA_R_16BF;
  return cublasGemmStridedBatchedEx(h, ob, oa, n, m, k, &one, B, t, ldb, sb,
                                    A, t, lda, sa, &zero, C, t, n, sc, cnt,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* numpy.matmul on cuBLAS. Row-major C[m,n] = A[m,k] B[k,n] is column-major
 * C^T = B^T A^T, so each product is one column-major gemm with the
 * operands swapped and no transposing copy. The broadcast batch dims are
 * walked with a two-operand iterator: its innermost (merged) dim becomes
 * one strided-batched call (stride 0 for a broadcast operand), the outer
 * rows, usually none, one call each. Transposed operands (the attributes
 * {ta, tb}, dsp__mm_attrs) are cuBLAS's own transpose flags: a stored
 * [k, m] row-major is column-major m x k, so op(a)^T = that view with
 * CUBLAS_OP_T (leading dim m), and likewise b (leading dim k). */
int dsp__cu_run_matmul(cu_be *b, dsp_ctx *ctx, dsp_tensor *const *in,
                       const dsp_attrs *at, dsp_tensor *out) {
  const dsp_meta ms[2] = {in[0]->meta, in[1]->meta};
  dsp_meta eff[2];
  int ta, tb;
  int rc = dsp__mm_attrs(ctx, at, ms, &ta, &tb, eff);
  if (rc < 0) return rc;
  const dsp_meta *ma = &eff[0], *mb = &eff[1];
  int64_t m, k, n;
  dsp__cu_index ix;
  dsp__cu_plan_matmul(ma, mb, &m, &k, &n, &ix);
  const cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                          ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int lda = (int)(ta ? m : k), ldb = (int)(tb ? k : n);
  if (k == 0 || m == 0 || n == 0) return 0; /* out is zeroed already */
  /* rows of the (merged) batch walk, each one strided-batched call */
  int64_t inner = ix.shape[ix.nd - 1], rows = 1;
  for (int d = 0; d < ix.nd - 1; d++) rows *= ix.shape[d];
  const int64_t la = ix.st[0][ix.nd - 1], lb = ix.st[1][ix.nd - 1];
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  const char *A = dsp_tensor_data(in[0]), *B = dsp_tensor_data(in[1]);
  char *C = dsp_tensor_data(out);
  const size_t es = dsp_dtype_size(ma->dtype);
  for (int64_t r = 0; r < rows && s == CUBLAS_STATUS_SUCCESS; r++) {
    int64_t off[3];
    dsp__cu_offsets(&ix, r * inner, off); /* first batch entry of row r */
    for (int64_t b0 = 0; b0 < inner && s == CUBLAS_STATUS_SUCCESS; b0 += INT_MAX) {
      int cnt = (int)(inner - b0 < INT_MAX ? inner - b0 : INT_MAX);
      const char *pa = A + (size_t)((off[0] + b0 * la) * m * k) * es;
      const char *pb = B + (size_t)((off[1] + b0 * lb) * k * n) * es;
      char *pc = C + (size_t)((r * inner + b0) * m * n) * es;
      s = gemm_batched(b->blas, ma->dtype, ob, oa, (int)n, (int)m, (int)k, pb,
                       ldb, lb * k * n, pa, lda, la * m * k, pc, m * n, cnt);
    }
  }
  return s == CUBLAS_STATUS_SUCCESS ? 0 : dsp__cu_blas_err(ctx, s, DSP_OP_MATMUL);
}
