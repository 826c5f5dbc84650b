/* nn family on CUDA: softmax and its backward ops, cross entropy, mse,
 * dropout, conv2d (im2col + cuBLAS) and pooling. */
#include "cuda_be.h"

/* Bytes of one im2col block: bounded whatever the image and kernel (a
 * 1024x1024 input with a 64x64 kernel would need a 15 GiB col matrix), or
 * one column when a single receptive field is larger. */
#define COL_BLOCK_BYTES ((size_t)64 << 20)

/* One column-major cuBLAS gemm C = op(A) op(B) + beta C (sizes fit int:
 * infer checked C*KH*KW, OH*OW and O). */
static cublasStatus_t gemm(cu_be *b, int f64, cublasOperation_t ta,
                           cublasOperation_t tb, int64_t m, int64_t n,
                           int64_t k, const void *A, int64_t lda, const void *B,
                           int64_t ldb, double beta, void *C, int64_t ldc) {
  if (f64) {
    const double one = 1.0;
    return cublasDgemm(b->blas, ta, tb, (int)m, (int)n, (int)k, &one, A, (int)lda,
                       B, (int)ldb, &beta, C, (int)ldc);
  }
  const float one = 1.0f, fb = (float)beta;
  return cublasSgemm(b->blas, ta, tb, (int)m, (int)n, (int)k, &one, A, (int)lda,
                     B, (int)ldb, &fb, C, (int)ldc);
}

/* conv2d and its backward ops as im2col + cuBLAS over blocks of output
 * pixels, sample by sample, with the same products as the CPU kernel
 * (kern_nn_conv.c) written column-major (row-major M^T):
 *   forward          y_n[:, blk]  = W [O, CK] @ col       (C^T = col^T W^T)
 *   backward input   col = W^T @ dy_n[:, blk], col2im-gathered into dx_n
 *   backward weight  dW += dy_n[:, blk] @ col^T
 * The col scratch (<= COL_BLOCK_BYTES) is charged to the ctx's budget. */
static int run_conv(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                    dsp_tensor *const *in, const dsp_attrs *a,
                    dsp_tensor *out) {
  dsp__cu_geo g;
  const dsp_meta ms[2] = {in[0]->meta, in[1]->meta};
  int rc = dsp__cu_plan_nn(ctx, op, ms, 2, a, &g);
  if (rc < 0) return rc;
  const int64_t ck = g.C * g.KH * g.KW, ohw = g.OH * g.OW;
  if (g.N == 0 || g.O == 0 || ck == 0 || ohw == 0) return 0; /* zeroed out */
  const int f64 = out->meta.dtype == DSP_F64;
  const size_t es = f64 ? 8 : 4;
  int64_t per = (int64_t)(COL_BLOCK_BYTES / es) / ck;
  const int64_t blk = per < 1 ? 1 : per < ohw ? per : ohw;
  const size_t col_bytes = (size_t)(ck * blk) * es;
  void *col = NULL;
  rc = dsp__cu_scratch_get(b, ctx, op, col_bytes, &col);
  if (rc < 0) return rc;
  const size_t xs = (size_t)(g.C * g.H * g.W) * es, ys = (size_t)(g.O * ohw) * es;
  const char *A = dsp_tensor_data(in[0]), *B = dsp_tensor_data(in[1]);
  char *O = dsp_tensor_data(out);
  int e = 0;
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  for (int64_t n = 0; n < g.N && !e && s == CUBLAS_STATUS_SUCCESS; n++)
    for (int64_t p0 = 0; p0 < ohw && !e && s == CUBLAS_STATUS_SUCCESS; p0 += blk) {
      const int64_t np = ohw - p0 < blk ? ohw - p0 : blk;
      const size_t po = (size_t)p0 * es;
      if (op == DSP_OP_CONV2D) {
        if ((e = dsp__cuk_im2col(b->stream, f64, &g, A + n * xs, col, p0, np))) break;
        s = gemm(b, f64, CUBLAS_OP_N, CUBLAS_OP_N, np, g.O, ck, col, np, B, ck,
                 0.0, O + n * ys + po, ohw);
      } else if (op == DSP_OP_CONV2D_BACKWARD_INPUT) {
        s = gemm(b, f64, CUBLAS_OP_N, CUBLAS_OP_T, np, ck, g.O, A + n * ys + po,
                 ohw, B, ck, 0.0, col, np);
        if (s == CUBLAS_STATUS_SUCCESS)
          e = dsp__cuk_col2im(b->stream, f64, &g, col, p0, np, O + n * xs);
      } else {
        if ((e = dsp__cuk_im2col(b->stream, f64, &g, B + n * xs, col, p0, np))) break;
        s = gemm(b, f64, CUBLAS_OP_T, CUBLAS_OP_N, ck, g.O, np, col, np,
                 A + n * ys + po, ohw, 1.0, O, ck);
      }
    }
  dsp__cu_scratch_put(b, ctx, col_bytes, col);
  if (e) return dsp__cu_err(ctx, e, op, "kernel launch");
  return s == CUBLAS_STATUS_SUCCESS ? 0 : dsp__cu_blas_err(ctx, s, op);
}

int dsp__cu_run_nn(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out) {
  const int dt = (int)out->meta.dtype;
  int e = 0;
  if (dsp__is_norm_op(op)) return dsp__cu_run_norm(b, ctx, op, in, n_in, a, out);
  switch (op) {
    case DSP_OP_SOFTMAX:
    case DSP_OP_LOG_SOFTMAX:
    case DSP_OP_SOFTMAX_BACKWARD:
    case DSP_OP_LOG_SOFTMAX_BACKWARD: {
      const dsp_meta *m = &in[0]->meta;
      int d;
      int rc = dsp_norm_dim(ctx, opname(op), a->ints[0], m->ndim, &d);
      if (rc < 0) return rc;
      e = dsp__cuk_softmax(b->stream, (int)op, dt, dsp__cu_prod(m->shape, 0, d),
                           m->shape[d], dsp__cu_prod(m->shape, d + 1, m->ndim),
                           dsp_tensor_data(in[0]),
                           n_in == 2 ? dsp_tensor_data(in[1]) : NULL,
                           dsp_tensor_data(out));
      break;
    }
    case DSP_OP_CROSS_ENTROPY:
    case DSP_OP_CROSS_ENTROPY_BACKWARD: {
      int bw = op == DSP_OP_CROSS_ENTROPY_BACKWARD;
      const dsp_tensor *x = in[bw], *lab = in[bw + 1];
      int64_t N = x->meta.shape[0], C = x->meta.shape[1], pos, v;
      e = dsp__cuk_first_bad(b->stream, dsp_tensor_data(lab), N, 0, C, 0, &pos);
      if (e) return dsp__cu_err(ctx, e, op, "label check");
      if (pos >= 0) {
        if ((e = dsp__cu_peek_i64(b, (const int64_t *)dsp_tensor_data(lab) + pos, &v)))
          return dsp__cu_err(ctx, e, op, "label read");
        return dsp_seterr(ctx, DISPATCH_EINDEX,
                          "%s: label %lld at row %lld out of range for %lld classes",
                          opname(op), (long long)v, (long long)pos, (long long)C);
      }
      void *scratch = NULL;
      size_t sn = bw ? 0 : (size_t)N * sizeof(double);
      if (!bw) {
        int rc = dsp__cu_scratch_get(b, ctx, op, sn, &scratch);
        if (rc < 0) return rc;
      }
      e = dsp__cuk_cross_entropy(b->stream, dt, N, C,
                                 bw ? dsp_tensor_data(in[0]) : NULL,
                                 dsp_tensor_data(x), dsp_tensor_data(lab),
                                 scratch, dsp_tensor_data(out));
      dsp__cu_scratch_put(b, ctx, sn, scratch);
      break;
    }
    case DSP_OP_MSE: {
      const int64_t n = in[0]->numel, S = dsp__cu_red_split(1, n);
      size_t pn = S > 1 ? (size_t)S * DSP__CU_RED_PART_BYTES : 0;
      void *part = NULL;
      if (pn) {
        int rc = dsp__cu_scratch_get(b, ctx, op, pn, &part);
        if (rc < 0) return rc;
      }
      e = dsp__cuk_mse(b->stream, dt, n, S, dsp_tensor_data(in[0]),
                       dsp_tensor_data(in[1]), dsp_tensor_data(out), part);
      dsp__cu_scratch_put(b, ctx, pn, part);
      break;
    }
    case DSP_OP_DROPOUT:
      e = dsp__cuk_dropout(b->stream, dt, out->numel, (uint64_t)a->ints[0],
                           a->floats[0], dsp_tensor_data(in[0]),
                           dsp_tensor_data(out));
      break;
    case DSP_OP_CONV2D:
    case DSP_OP_CONV2D_BACKWARD_INPUT:
    case DSP_OP_CONV2D_BACKWARD_WEIGHT:
      return run_conv(b, ctx, op, in, a, out);
    case DSP_OP_MAX_POOL2D:
    case DSP_OP_AVG_POOL2D:
    case DSP_OP_MAX_POOL2D_BACKWARD:
    case DSP_OP_AVG_POOL2D_BACKWARD: {
      int fwd = op == DSP_OP_MAX_POOL2D || op == DSP_OP_AVG_POOL2D;
      dsp__cu_geo g;
      const dsp_meta ms[2] = {in[0]->meta, n_in > 1 ? in[1]->meta : in[0]->meta};
      int rc = dsp__cu_plan_nn(ctx, op, ms, n_in, a, &g);
      if (rc < 0) return rc;
      e = dsp__cuk_pool(b->stream, (int)op, dt == DSP_F64, &g,
                        fwd ? NULL : dsp_tensor_data(in[0]),
                        dsp_tensor_data(in[fwd ? 0 : 1]), dsp_tensor_data(out));
      break;
    }
    default:
      return dsp__cu_no_kernel(b, ctx, op);
  }
  return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
}
