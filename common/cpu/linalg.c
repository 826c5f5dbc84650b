/* linalg family, CPU kernel: matmul on OpenBLAS (inference:
 * common/ops_linalg.c).
 *
 * Each batch entry is one cblas_?gemm call straight on the tensors'
 * storage (no copies), with BLAS's transpose flags where the attributes
 * ask for op(a) = a^T or op(b) = b^T (the matmul backward's g b^T and
 * a^T g, without copying a transpose first); when the right operand has
 * no batch (or only size-1 batch dims) and the left one is not
 * transposed, the left operand's batch folds into M and the whole product
 * is a single gemm.
 *
 * f16 and bf16 (mm_half): sgemm on f32 copies, made block by block
 * (common/half.h's converters), accumulating in f32 and rounding each
 * result once. Debian's OpenBLAS 0.3.21 exports no sbgemm (nm -D shows
 * only support_avx512_bf16: it is built without BUILD_BFLOAT16), so
 * converting and calling sgemm is the one path here. Against dsp_op's
 * widening (whole f32 copies of both operands and of the result, as
 * tensors) it measured the same within the noise of a loaded 2-core host
 * (bf16 1024: 57-76 ms against 66-73 ms; 2048: 602-621 ms against 524-608
 * ms, f32 sgemm alone 553-611 ms in the same runs), and it holds only B's
 * copy and one block of A's rows and C's: it stays for the memory. The
 * bench row "matmul bf16 1024 local" (bench/matmul.c) keeps the figure
 * beside f32 sgemm. */
#include <cblas.h>
#include <limits.h>

#include "cpu.h"
#include "half.h"
#include "ops_plan.h"

_Static_assert(DSP__OPS_IN_FAMILY(LINALG) == 1,
               "a new linalg op needs a case in dsp__cpu_linalg and a row in "
               "the CPU support table (common/cpu/backend.c)");

/* A half product, C = op(A) @ op(B) as mm_gemm_t's arguments say, on f32
 * copies: B whole (K*N floats), then per block of R rows of op(A) the
 * block's f32 copy (R*K) and its f32 result (R*N), rounded into C. R keeps
 * a block's two buffers near HALF_BLOCK_BYTES but at least 64 rows (BLAS
 * wants a tall block), so a product up to ~2048 square is one sgemm. The
 * scratch is charged to ctx's budget. 1 when cancelled, 0, or < 0 (no
 * memory for the scratch). */
#define HALF_BLOCK_BYTES ((int64_t)16 << 20)
static int mm_half(dsp_ctx *ctx, const dsp_backend *be, dsp_dtype dt, int ta,
                   int tb, int m, int n, int k, const uint16_t *a,
                   const uint16_t *b, uint16_t *c) {
  int64_t R = HALF_BLOCK_BYTES / 4 / ((int64_t)k + n);
  if (R < 64) R = 64;
  if (R > m) R = m;
  const size_t nb = (size_t)k * (size_t)n, na = (size_t)R * (size_t)k,
               nc = (size_t)R * (size_t)n;
  /* the scratch is a tensor: its storage comes from (and goes back to) the
   * ctx's free lists, where a fresh malloc of tens of MB page-faulted on
   * every product (measured: 2048^2 bf16 took 1.6x the time it takes
   * through cached f32 tensors) */
  dsp_tensor *scratch;
  const dsp_meta sm = {DSP_F32, 1, {(int64_t)(nb + na + nc)}};
  int rc = dsp__tensor_new_on(ctx, be, &sm, 0, &scratch);
  if (rc < 0) return rc;
  float *fb = dsp_tensor_data(scratch), *fa = fb + nb, *fc = fa + na;
  dsp_half_to_f32_n(dt, b, fb, nb);
  const CBLAS_TRANSPOSE ob = tb ? CblasTrans : CblasNoTrans;
  int stop = 0;
  for (int64_t r = 0; r < m && !stop; r += R) {
    if (dsp_ctx_cancelled(ctx)) {
      stop = 1;
      break;
    }
    const int mb = (int)(m - r < R ? m - r : R);
    if (!ta) { /* rows r.. of A [m,k]: contiguous */
      dsp_half_to_f32_n(dt, a + (size_t)r * (size_t)k, fa, (size_t)mb * (size_t)k);
    } else { /* columns r.. of A stored [k,m]: a [k,mb] block */
      for (int64_t i = 0; i < k; i++)
        dsp_half_to_f32_n(dt, a + (size_t)i * (size_t)m + (size_t)r,
                          fa + (size_t)i * (size_t)mb, (size_t)mb);
    }
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, ob, mb, n, k,
                1.0f, fa, ta ? mb : k, fb, tb ? k : n, 0.0f, fc, n);
    dsp_f32_to_half_n(dt, fc, c + (size_t)r * (size_t)n, (size_t)mb * (size_t)n);
  }
  dsp_tensor_unref(scratch);
  return stop;
}

/* One product C[m,n] = A[m,k] @ B[k,n], in blocks of A's rows so that a
 * huge product looks at the cancel flag every ~2^33 multiply-adds. Each
 * block makes BLAS pack all of B again, so blocks stay large: every
 * product make bench runs (up to 2048^3 = 2^33) is still one call, and a
 * block is a fraction of a second at BLAS speed. 1 when ctx was cancelled
 * (C partly written), else 0; a half product (mm_half) can also fail
 * (< 0) for its scratch. */
#define MM_BLOCK_WORK ((int64_t)1 << 33)
static int mm_gemm_t(dsp_ctx *ctx, const dsp_backend *be, dsp_dtype dt, int ta,
                     int tb, int m, int n, int k, const char *a, const char *b,
                     char *c) {
  size_t es = dsp_dtype_size(dt);
  if (dt == DSP_F16 || dt == DSP_BF16)
    return mm_half(ctx, be, dt, ta, tb, m, n, k, (const uint16_t *)a,
                   (const uint16_t *)b, (uint16_t *)c);
  int64_t bm = MM_BLOCK_WORK / ((int64_t)n * k);
  if (bm < 1) bm = 1;
  /* op(A) = A [m,k] (lda k) or A^T with A stored [k,m] (lda m); op(B) = B
   * [k,n] (ldb n) or B^T with B stored [n,k] (ldb k) */
  const int lda = ta ? m : k, ldb = tb ? k : n;
  const CBLAS_TRANSPOSE oa = ta ? CblasTrans : CblasNoTrans,
                        ob = tb ? CblasTrans : CblasNoTrans;
  for (int64_t r = 0; r < m; r += bm) {
    if (dsp_ctx_cancelled(ctx)) return 1;
    int mb = (int)(m - r < bm ? m - r : bm);
    const char *ar = a + (size_t)(ta ? r : r * k) * es;
    char *cr = c + (size_t)(r * n) * es;
    if (dt == DSP_F32)
      cblas_sgemm(CblasRowMajor, oa, ob, mb, n, k, 1.0f, (const float *)ar,
                  lda, (const float *)b, ldb, 0.0f, (float *)cr, n);
    else
      cblas_dgemm(CblasRowMajor, oa, ob, mb, n, k, 1.0, (const double *)ar,
                  lda, (const double *)b, ldb, 0.0, (double *)cr, n);
  }
  return 0;
}

/* Runs the product: results only depend on the operands (each output
 * element comes from one gemm call with a fixed K order), so repeated runs
 * are bit-identical. An empty product (M, N or batch 0) writes nothing; an
 * empty K leaves the zeroed output as the correct all-zero result. */
int dsp__cpu_linalg(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, dsp_tensor *out) {
  const dsp_dtype kt = in[0]->meta.dtype;
  if (op != DSP_OP_MATMUL || (kt != DSP_F32 && kt != DSP_F64 &&
                              kt != DSP_F16 && kt != DSP_BF16))
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
  if (out->numel == 0 || K == 0) return 0;
  dsp_dtype dt = in[0]->meta.dtype;
  const dsp_backend *be = in[0]->storage->backend;
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
    rc = mm_gemm_t(ctx, be, dt, 0, tb, (int)(nbat * M), (int)N, (int)K, pa, pb, pc);
    return rc > 0 ? dsp__cancelled_err(ctx, op) : rc;
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
    rc = mm_gemm_t(ctx, be, dt, ta, tb, (int)M, (int)N, (int)K,
                   pa + (size_t)offa * es, pb + (size_t)offb * es,
                   pc + (size_t)(e * M * N) * es);
    if (rc) return rc > 0 ? dsp__cancelled_err(ctx, op) : rc;
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
