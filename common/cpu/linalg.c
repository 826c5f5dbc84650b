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
 * is a single product.
 *
 * f16 and bf16 (mm_half): sgemm on f32 copies, made block by block
 * (common/half.h's converters), accumulating in f32 and rounding each
 * result once; each block's product is the f32 one below, so it shares
 * the backend's threads the same way. Debian's OpenBLAS 0.3.21 exports no sbgemm (nm -D shows
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
#include <string.h>

#include "cpu.h"
#include "half.h"
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

static int mm_par(dsp_ctx *ctx, dsp_dtype dt, int ta, int tb, int m, int n,
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

/* A half product, C = op(A) @ op(B) as mm_gemm_t's arguments say, on f32
 * copies: B whole (K*N floats), then per block of R rows of op(A) the
 * block's f32 copy (R*K) and its f32 result (R*N, mm_par's product, which
 * the backend's threads share), rounded into C. R keeps a block's two
 * buffers near HALF_BLOCK_BYTES but at least 64 rows, so a product up to
 * ~2048 square is one block. The scratch is charged to ctx's budget. 1
 * when cancelled, 0, or < 0 (no memory for the scratch). */
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
    stop = mm_par(ctx, DSP_F32, ta, tb, mb, n, k, (const char *)fa,
                  (const char *)fb, (char *)fc);
    if (stop) break;
    dsp_f32_to_half_n(dt, fc, c + (size_t)r * (size_t)n, (size_t)mb * (size_t)n);
  }
  dsp_tensor_unref(scratch);
  return stop;
}

/* One product of dtype dt: f16 and bf16 through mm_half, f32 and f64
 * straight (mm_par). 1 when cancelled, 0, or < 0 (mm_half's scratch). */
static int mm_gemm_t(dsp_ctx *ctx, const dsp_backend *be, dsp_dtype dt, int ta,
                     int tb, int m, int n, int k, const char *a, const char *b,
                     char *c) {
  if (dt == DSP_F16 || dt == DSP_BF16)
    return mm_half(ctx, be, dt, ta, tb, m, n, k, (const uint16_t *)a,
                   (const uint16_t *)b, (uint16_t *)c);
  return mm_par(ctx, dt, ta, tb, m, n, k, a, b, c);
}

/* Runs the product: results only depend on the operands (each output
 * element comes from one gemm call of a fixed cut, with a fixed K order),
 * so repeated runs are bit-identical, whatever the thread count. An empty
 * product (M, N or batch 0) writes nothing; an empty K writes the
 * all-zero result (the output arrives unzeroed: backend.c). */
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
  if (out->numel == 0) return 0;
  if (K == 0) { /* the sum of no products; the output is not zeroed */
    memset(dsp_tensor_data(out), 0,
           (size_t)out->numel * dsp_dtype_size(out->meta.dtype));
    return 0;
  }
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
