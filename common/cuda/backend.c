/* The CUDA backend's host side: the dsp_backend table, the stream and pool
 * of a session, error mapping, cuBLAS matmul, and the plans (index maps,
 * reduction splits) that the kernels of kernels.cu walk. Compiled by gcc
 * with the project's warnings; only the kernels go through nvcc. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "cuda_kern.h"
#include "cuda_plan.h"
#include "dsp_cuda.h"
#include "dsp_internal.h"
#include "ops_plan.h"

/* dsp_backend first, so the table's address is the backend's */
typedef struct cu_be {
  dsp_backend table;
  int device;
  cudaStream_t stream;
  cublasHandle_t blas;
  cudaMemPool_t pool;
  char name[24];
  char desc[352];
  uint64_t total_mem; /* the GPU's memory (cudaDeviceProp.totalGlobalMem) */
  /* a session view (dsp_cuda_session_open): its device's backend, and its
   * link in that device's list of every view it made; NULL/unused on a
   * device backend */
  struct cu_be *parent;
  struct cu_be *next_view;
  int in_use; /* guarded by the parent's mu */
  /* a device backend: its session views, each with a stream and cuBLAS
   * handle of its own, kept until the device closes; and the pinned host
   * blocks staging gave back, kept for the next upload or read (mu
   * guards both) */
  pthread_mutex_t mu;
  struct cu_be *views;
  struct pin_blk *pins;
  uint64_t pins_bytes;
  int pins_n;
} cu_be;

typedef struct pin_blk {
  struct pin_blk *next;
  void *p;
  size_t cap;
} pin_blk;

static const char *opname(dsp_opcode op) { return dsp_op_lookup((int)op)->name; }

/* ------------------------------------------------------------------ */
/* errors                                                              */

static int cuda_code(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return 0;
    case cudaErrorMemoryAllocation: return DISPATCH_ENOMEM;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorNotSupported:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return DISPATCH_EUNSUPPORTED;
    case cudaErrorInvalidValue: return DISPATCH_EINVAL;
    default: return DISPATCH_EINTERNAL;
  }
}

int dsp_cuda_error(int cuda_error, const char *what, char *buf, size_t len) {
  cudaError_t e = (cudaError_t)cuda_error;
  if (buf && len)
    snprintf(buf, len, "%s: %s (%s)", what, cudaGetErrorString(e),
             cudaGetErrorName(e));
  return cuda_code(e);
}

int dsp_cuda_blas_error(int cublas_status, const char *what, char *buf,
                        size_t len) {
  cublasStatus_t s = (cublasStatus_t)cublas_status;
  if (buf && len)
    snprintf(buf, len, "%s: %s (%s)", what, cublasGetStatusString(s),
             cublasGetStatusName(s));
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return 0;
    case CUBLAS_STATUS_ALLOC_FAILED: return DISPATCH_ENOMEM;
    case CUBLAS_STATUS_INVALID_VALUE: return DISPATCH_EINVAL;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: return DISPATCH_EUNSUPPORTED;
    default: return DISPATCH_EINTERNAL;
  }
}

/* A failed CUDA call as the op's error, "cuda OP: CALL: message (name)". */
static int cu_err(dsp_ctx *ctx, int e, dsp_opcode op, const char *call) {
  char what[96], msg[400];
  snprintf(what, sizeof what, "cuda %s: %s", opname(op), call);
  int code = dsp_cuda_error(e, what, msg, sizeof msg);
  return dsp_seterr(ctx, code, "%s", msg);
}
static int blas_err(dsp_ctx *ctx, cublasStatus_t s, dsp_opcode op) {
  char what[96], msg[400];
  snprintf(what, sizeof what, "cuda %s: cublas gemm", opname(op));
  int code = dsp_cuda_blas_error((int)s, what, msg, sizeof msg);
  return dsp_seterr(ctx, code, "%s", msg);
}

/* ------------------------------------------------------------------ */
/* storage                                                             */

static int cu_alloc(void *bctx, size_t nbytes, int zero, void **data) {
  cu_be *b = bctx;
  void *p = NULL;
  *data = NULL;
  if (cudaSetDevice(b->device) != cudaSuccess) return DISPATCH_EINTERNAL;
  /* an empty tensor still gets a distinct block (never a NULL data) */
  cudaError_t e = cudaMallocAsync(&p, nbytes ? nbytes : 1, b->stream);
  if (e != cudaSuccess) return cuda_code(e) ? cuda_code(e) : DISPATCH_ENOMEM;
  if (zero && nbytes && (e = cudaMemsetAsync(p, 0, nbytes, b->stream)) != cudaSuccess) {
    cudaFreeAsync(p, b->stream);
    return cuda_code(e);
  }
  *data = p;
  return 0;
}

/* stream-ordered: the block returns to the pool after the session's
 * earlier work on it, never under a running kernel */
static void cu_free(void *bctx, void *data) {
  cu_be *b = bctx;
  if (!data) return;
  cudaSetDevice(b->device);
  cudaFreeAsync(data, b->stream);
}

/* The caller's host buffer is only borrowed: both copies wait for the
 * stream before returning. */
static int cu_copy(cu_be *b, void *dst, const void *src, size_t n,
                   enum cudaMemcpyKind kind) {
  if (!n) return 0;
  cudaError_t e = cudaSetDevice(b->device);
  if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, n, kind, b->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(b->stream);
  return cuda_code(e);
}
static int cu_copy_in(void *bctx, void *dst, const void *src, size_t n) {
  return cu_copy(bctx, dst, src, n, cudaMemcpyHostToDevice);
}
static int cu_copy_out(void *bctx, void *dst, const void *src, size_t n) {
  return cu_copy(bctx, dst, src, n, cudaMemcpyDeviceToHost);
}

/* Staging: pinned host memory, so the network layer's bytes cross the
 * bus by DMA with no pageable bounce, in parts of DSP_STAGE_CHUNK that
 * overlap the socket.
 *   upload: stage_in hands out a pinned block the reader fills;
 *     commit_part enqueues each part's H2D copy on the session's stream as
 *     soon as the socket has delivered it (the loop thread; the storage
 *     was allocated on the same stream, and nobody can name the tensor
 *     before its upload runs), and the last call waits for all of them.
 *   read: stage_out enqueues every part's D2H copy with an event behind
 *     it and returns once the first part has landed (so the session's
 *     earlier work is done); the writer waits per part (stage_out_wait),
 *     sending part k while part k+1 still crosses the bus.
 * The block stays the caller's until stage_release, which first waits
 * for any copy still using it. */
typedef struct cu_stage {
  void *host;
  size_t nbytes, cap; /* cap: the pinned block's size */
  cu_be *root;        /* the device whose cache the block goes back to */
  int copying;    /* upload: `done` marks the last part enqueued */
  cudaEvent_t done;
  int n_ev;       /* read: parts, each with its event */
  cudaEvent_t ev[];
} cu_stage;

/* Pinned blocks given back are kept, up to PIN_KEEP bytes and PIN_MAX
 * blocks per device, because pinning is slow (page-locking every page:
 * tens of ms for 256 MiB) and stage_in runs on the server's loop. Sizes
 * are rounded up to a quarter of their power of two (at most 25% more),
 * so a tensor of the same size finds its block again. The cache is host
 * memory outside every budget, hence the bound. */
#define PIN_KEEP ((uint64_t)512 << 20)
#define PIN_MAX 64
#define PIN_MIN ((size_t)64 << 10)

static size_t pin_cap(size_t n) {
  if (n <= PIN_MIN) return PIN_MIN;
  size_t top = (size_t)1 << (63 - __builtin_clzll((unsigned long long)(n - 1)));
  size_t step = top / 4;
  return (n + step - 1) / step * step;
}
static void *pin_take(cu_be *root, size_t cap) {
  void *p = NULL;
  pthread_mutex_lock(&root->mu);
  for (pin_blk **pp = &root->pins; *pp; pp = &(*pp)->next)
    if ((*pp)->cap == cap) {
      pin_blk *k = *pp;
      *pp = k->next;
      root->pins_bytes -= cap;
      root->pins_n--;
      p = k->p;
      dsp_free(k);
      break;
    }
  pthread_mutex_unlock(&root->mu);
  return p;
}
static void pin_give(cu_be *root, void *p, size_t cap) {
  pin_blk *k = dsp_malloc(sizeof *k);
  if (k) {
    pthread_mutex_lock(&root->mu);
    if (root->pins_n < PIN_MAX && root->pins_bytes + cap <= PIN_KEEP) {
      *k = (pin_blk){root->pins, p, cap};
      root->pins = k;
      root->pins_bytes += cap;
      root->pins_n++;
      p = NULL, k = NULL;
    }
    pthread_mutex_unlock(&root->mu);
  }
  dsp_free(k);
  if (p) cudaFreeHost(p);
}

static int pinned_get(cu_be *b, size_t nbytes, int parts, cu_stage **out) {
  *out = NULL;
  if (cudaSetDevice(b->device) != cudaSuccess) return DISPATCH_EINTERNAL;
  cu_stage *st = dsp_calloc(1, sizeof *st + (size_t)parts * sizeof(cudaEvent_t));
  if (!st) return DISPATCH_ENOMEM;
  st->root = b->parent ? b->parent : b;
  st->cap = pin_cap(nbytes);
  st->host = pin_take(st->root, st->cap);
  if (!st->host) {
    cudaError_t e = cudaHostAlloc(&st->host, st->cap, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      dsp_free(st);
      return cuda_code(e) ? cuda_code(e) : DISPATCH_ENOMEM;
    }
  }
  st->nbytes = nbytes;
  *out = st;
  return 0;
}
static void pinned_put(cu_stage *st) {
  if (!st) return;
  if (st->copying) {
    cudaEventSynchronize(st->done);
    cudaEventDestroy(st->done);
  }
  for (int i = 0; i < st->n_ev; i++) {
    cudaEventSynchronize(st->ev[i]);
    cudaEventDestroy(st->ev[i]);
  }
  pin_give(st->root, st->host, st->cap);
  dsp_free(st);
}
static int cu_stage_in(void *bctx, void *data, size_t nbytes, void **host,
                       void **token) {
  (void)data;
  cu_stage *st;
  *host = *token = NULL;
  int rc = pinned_get(bctx, nbytes, 0, &st);
  if (rc < 0) return rc;
  *host = st->host;
  *token = st;
  return 0;
}
static int cu_commit_in(void *bctx, void *data, const void *host,
                        size_t nbytes, void *token) {
  (void)token;
  return cu_copy(bctx, data, host, nbytes, cudaMemcpyHostToDevice);
}
static int cu_commit_part(void *bctx, void *data, const void *host,
                          size_t off, size_t n, int last, void *token) {
  cu_be *b = bctx;
  cu_stage *st = token;
  cudaError_t e = cudaSetDevice(b->device);
  if (e == cudaSuccess && n) {
    e = cudaMemcpyAsync((char *)data + off, (const char *)host + off, n,
                        cudaMemcpyHostToDevice, b->stream);
    if (e == cudaSuccess && !st->copying) {
      e = cudaEventCreateWithFlags(&st->done, cudaEventDisableTiming);
      if (e == cudaSuccess) st->copying = 1;
    }
    if (e == cudaSuccess) e = cudaEventRecord(st->done, b->stream);
  }
  if (e == cudaSuccess && last && st->copying)
    e = cudaEventSynchronize(st->done);
  return cuda_code(e);
}
static int cu_stage_out(void *bctx, const void *data, size_t nbytes,
                        const void **host, void **token) {
  cu_be *b = bctx;
  const size_t C = DSP_STAGE_CHUNK;
  const int parts = (int)((nbytes + C - 1) / C);
  cu_stage *st;
  *host = NULL, *token = NULL;
  int rc = pinned_get(b, nbytes, parts, &st);
  if (rc < 0) return rc;
  cudaError_t e = cudaSuccess;
  for (int i = 0; i < parts && e == cudaSuccess; i++) {
    size_t off = (size_t)i * C, n = nbytes - off < C ? nbytes - off : C;
    e = cudaMemcpyAsync((char *)st->host + off, (const char *)data + off, n,
                        cudaMemcpyDeviceToHost, b->stream);
    if (e == cudaSuccess)
      e = cudaEventCreateWithFlags(&st->ev[i], cudaEventDisableTiming);
    if (e == cudaSuccess) {
      st->n_ev = i + 1;
      e = cudaEventRecord(st->ev[i], b->stream);
    }
  }
  if (e == cudaSuccess && parts) e = cudaEventSynchronize(st->ev[0]);
  if (e != cudaSuccess) {
    cudaStreamSynchronize(b->stream);
    pinned_put(st);
    return cuda_code(e) ? cuda_code(e) : DISPATCH_EINTERNAL;
  }
  *host = st->host, *token = st;
  return 0;
}
/* Also reports every later part that has landed meanwhile, so the writer
 * hands the socket as much as it can in one go. */
static size_t cu_stage_out_wait(void *bctx, void *token, size_t off) {
  (void)bctx;
  cu_stage *st = token;
  const size_t C = DSP_STAGE_CHUNK;
  size_t k = off / C;
  if (!st || k >= (size_t)st->n_ev) return st ? st->nbytes : 0;
  if (cudaEventSynchronize(st->ev[k]) != cudaSuccess) return 0;
  while (k + 1 < (size_t)st->n_ev && cudaEventQuery(st->ev[k + 1]) == cudaSuccess)
    k++;
  size_t end = (k + 1) * C;
  return end < st->nbytes ? end : st->nbytes;
}
static void cu_stage_release(void *bctx, void *token) {
  (void)bctx;
  pinned_put(token);
}

/* Device scratch charged to the device's budget (the backend's mem, as
 * storage is) and to ctx's, so a kernel's workspace counts where its
 * bytes live. */
static int scratch_get(cu_be *b, dsp_ctx *ctx, dsp_opcode op, size_t n,
                       void **p) {
  *p = NULL;
  const uint64_t cost = DSP_BUDGET_COST(n);
  int rc = dsp_budget_charge(b->table.mem, ctx, cost, "cuda kernel scratch");
  if (rc < 0) return rc;
  rc = dsp_budget_charge(dsp_ctx_budget(ctx), ctx, cost, "cuda kernel scratch");
  if (rc < 0) {
    dsp_budget_uncharge(b->table.mem, cost);
    return rc;
  }
  cudaError_t e = cudaMallocAsync(p, n ? n : 1, b->stream);
  if (e != cudaSuccess) {
    dsp_budget_uncharge(dsp_ctx_budget(ctx), cost);
    dsp_budget_uncharge(b->table.mem, cost);
    *p = NULL;
    return cu_err(ctx, e, op, "cudaMallocAsync (scratch)");
  }
  return 0;
}
static void scratch_put(cu_be *b, dsp_ctx *ctx, size_t n, void *p) {
  if (!p) return;
  cudaFreeAsync(p, b->stream);
  dsp_budget_uncharge(dsp_ctx_budget(ctx), DSP_BUDGET_COST(n));
  dsp_budget_uncharge(b->table.mem, DSP_BUDGET_COST(n));
}

/* ------------------------------------------------------------------ */
/* what this backend runs                                              */

/* The CUDA kernels' own op x key dtype table (common/cuda/supports.c);
 * an op added to DSP_OP_MAP breaks the build there until it has a row. */
static int cu_supports(void *bctx, dsp_opcode op, const dsp_meta *in, int n,
                       const dsp_meta *out) {
  (void)bctx;
  return dsp__cuda_has_kernel(op, dsp__op_key_dtype(op, in, n, out));
}

/* ------------------------------------------------------------------ */
/* families                                                            */

static int run_ew(cu_be *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out) {
  const dsp_dtype dt = in[0]->meta.dtype;
  const int64_t n = out->numel;
  int e;
  if ((op >= DSP_OP_ADD && op <= DSP_OP_GE) || op == DSP_OP_WHERE) {
    const dsp_meta *ms[3];
    for (int i = 0; i < n_in; i++) ms[i] = &in[i]->meta;
    dsp__cu_index ix;
    dsp__cu_plan_bcast(&ix, &out->meta, ms, n_in);
    if (op == DSP_OP_WHERE)
      e = dsp__cuk_where(b->stream, (int)dsp_dtype_size(out->meta.dtype), n, &ix,
                         dsp_tensor_data(in[0]), dsp_tensor_data(in[1]),
                         dsp_tensor_data(in[2]), dsp_tensor_data(out));
    else {
      if (op == DSP_OP_DIV && dt == DSP_I64) {
        int64_t pos;
        e = dsp__cuk_first_bad(b->stream, dsp_tensor_data(in[1]), in[1]->numel,
                               0, 0, 1, &pos);
        if (e) return cu_err(ctx, e, op, "divisor check");
        if (pos >= 0)
          return dsp_seterr(ctx, DISPATCH_EINVAL,
                            "div: integer division by zero (divisor element %lld)",
                            (long long)pos);
      }
      e = dsp__cuk_binary(b->stream, (int)op, (int)dt, n, &ix,
                          dsp_tensor_data(in[0]), dsp_tensor_data(in[1]),
                          dsp_tensor_data(out));
    }
  } else {
    e = dsp__cuk_map(b->stream, (int)op, (int)dt, n, dsp_tensor_data(in[0]),
                     n_in > 1 ? dsp_tensor_data(in[1]) : NULL,
                     a->n_floats > 0 ? a->floats[0] : 0.0, dsp_tensor_data(out));
  }
  return e ? cu_err(ctx, e, op, "kernel launch") : 0;
}

static int run_red(cu_be *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   const dsp_attrs *a, dsp_tensor *out) {
  const dsp_meta *x = &in[0]->meta;
  int red[DSP_MAX_DIMS];
  int rc = dsp__red_dims(ctx, op, a, x->ndim, red);
  if (rc < 0) return rc;
  dsp__cu_index outer, inner;
  int64_t R;
  dsp__cu_plan_red(x, red, &outer, &inner, &R);
  const int64_t S = dsp__cu_red_split(out->numel, R);
  void *part = NULL;
  size_t pn = S > 1 ? (size_t)(out->numel * S) * DSP__CU_RED_PART_BYTES : 0;
  if (pn && (rc = scratch_get(b, ctx, op, pn, &part)) < 0) return rc;
  int e = dsp__cuk_reduce(b->stream, (int)op, (int)x->dtype, out->numel, S,
                          &outer, &inner, R, dsp_tensor_data(in[0]),
                          dsp_tensor_data(out), part);
  scratch_put(b, ctx, pn, part);
  return e ? cu_err(ctx, e, op, "kernel launch") : 0;
}

/* Copies one i64 element of device memory to the host (synchronous). */
static int peek_i64(cu_be *b, const int64_t *p, int64_t *v) {
  cudaError_t e = cudaMemcpyAsync(v, p, sizeof *v, cudaMemcpyDeviceToHost, b->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(b->stream);
  return (int)e;
}

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
  rc = scratch_get(b, ctx, op, col_bytes, &col);
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
  scratch_put(b, ctx, col_bytes, col);
  if (e) return cu_err(ctx, e, op, "kernel launch");
  return s == CUBLAS_STATUS_SUCCESS ? 0 : blas_err(ctx, s, op);
}

static int run_nn(cu_be *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out) {
  const int dt = (int)out->meta.dtype;
  int e = 0;
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
      if (e) return cu_err(ctx, e, op, "label check");
      if (pos >= 0) {
        if ((e = peek_i64(b, (const int64_t *)dsp_tensor_data(lab) + pos, &v)))
          return cu_err(ctx, e, op, "label read");
        return dsp_seterr(ctx, DISPATCH_EINDEX,
                          "%s: label %lld at row %lld out of range for %lld classes",
                          opname(op), (long long)v, (long long)pos, (long long)C);
      }
      void *scratch = NULL;
      size_t sn = bw ? 0 : (size_t)N * sizeof(double);
      if (!bw) {
        int rc = scratch_get(b, ctx, op, sn, &scratch);
        if (rc < 0) return rc;
      }
      e = dsp__cuk_cross_entropy(b->stream, dt, N, C,
                                 bw ? dsp_tensor_data(in[0]) : NULL,
                                 dsp_tensor_data(x), dsp_tensor_data(lab),
                                 scratch, dsp_tensor_data(out));
      scratch_put(b, ctx, sn, scratch);
      break;
    }
    case DSP_OP_MSE: {
      const int64_t n = in[0]->numel, S = dsp__cu_red_split(1, n);
      size_t pn = S > 1 ? (size_t)S * DSP__CU_RED_PART_BYTES : 0;
      void *part = NULL;
      if (pn) {
        int rc = scratch_get(b, ctx, op, pn, &part);
        if (rc < 0) return rc;
      }
      e = dsp__cuk_mse(b->stream, dt, n, S, dsp_tensor_data(in[0]),
                       dsp_tensor_data(in[1]), dsp_tensor_data(out), part);
      scratch_put(b, ctx, pn, part);
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
      return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                        "%s: no CUDA kernel (backend %s)", opname(op),
                        b->table.name);
  }
  return e ? cu_err(ctx, e, op, "kernel launch") : 0;
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
static int run_matmul(cu_be *b, dsp_ctx *ctx, dsp_tensor *const *in,
                      const dsp_attrs *at, dsp_tensor *out) {
  const dsp_meta ms[2] = {in[0]->meta, in[1]->meta};
  dsp_meta eff[2];
  int ta, tb;
  int rc = dsp__mm_attrs(ctx, at, ms, &ta, &tb, eff);
  if (rc < 0) return rc;
  const dsp_meta *ma = &eff[0], *mb = &eff[1];
  const int f64 = ma->dtype == DSP_F64;
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
  const size_t es = f64 ? 8 : 4;
  for (int64_t r = 0; r < rows && s == CUBLAS_STATUS_SUCCESS; r++) {
    int64_t off[3];
    dsp__cu_offsets(&ix, r * inner, off); /* first batch entry of row r */
    for (int64_t b0 = 0; b0 < inner && s == CUBLAS_STATUS_SUCCESS; b0 += INT_MAX) {
      int cnt = (int)(inner - b0 < INT_MAX ? inner - b0 : INT_MAX);
      const char *pa = A + (size_t)((off[0] + b0 * la) * m * k) * es;
      const char *pb = B + (size_t)((off[1] + b0 * lb) * k * n) * es;
      char *pc = C + (size_t)((r * inner + b0) * m * n) * es;
      if (f64) {
        const double one = 1.0, zero = 0.0;
        s = cublasDgemmStridedBatched(b->blas, ob, oa, (int)n, (int)m, (int)k,
                                      &one, (const double *)pb, ldb,
                                      lb * k * n, (const double *)pa, lda,
                                      la * m * k, &zero, (double *)pc,
                                      (int)n, m * n, cnt);
      } else {
        const float one = 1.0f, zero = 0.0f;
        s = cublasSgemmStridedBatched(b->blas, ob, oa, (int)n, (int)m, (int)k,
                                      &one, (const float *)pb, ldb,
                                      lb * k * n, (const float *)pa, lda,
                                      la * m * k, &zero, (float *)pc,
                                      (int)n, m * n, cnt);
      }
    }
  }
  return s == CUBLAS_STATUS_SUCCESS ? 0 : blas_err(ctx, s, DSP_OP_MATMUL);
}

static int index_check(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                       const dsp_tensor *ix, int dim, int64_t size) {
  int64_t pos, v;
  int e = dsp__cuk_first_bad(b->stream, dsp_tensor_data(ix), ix->numel, 0, size,
                             0, &pos);
  if (e) return cu_err(ctx, e, op, "index check");
  if (pos < 0) return 0;
  if ((e = peek_i64(b, (const int64_t *)dsp_tensor_data(ix) + pos, &v)))
    return cu_err(ctx, e, op, "index read");
  return dsp_seterr(ctx, DISPATCH_EINDEX,
                    "%s: index %lld (position %lld) out of range for dim %d of "
                    "size %lld",
                    opname(op), (long long)v, (long long)pos, dim, (long long)size);
}

/* index_select_backward: the (already checked) indices come to the host,
 * are sorted by destination row (dsp__cu_csr_build) and go back as a CSR,
 * so each output element gathers its rows in increasing k: the CPU's sum
 * order, no atomics, and work proportional to the grad, not to S * L.
 * Host and device scratch are charged to the ctx's budget. */
static int index_select_bw(cu_be *b, dsp_ctx *ctx, dsp_tensor *const *in,
                           int64_t outer, int64_t L, int64_t S, int64_t blk,
                           dsp_tensor *out) {
  const dsp_opcode op = DSP_OP_INDEX_SELECT_BACKWARD;
  const size_t hn = (size_t)(L + S + 1 + L) * sizeof(int64_t);
  const size_t dn = (size_t)(S + 1 + L) * sizeof(int64_t);
  int64_t *h = NULL;
  void *d = NULL;
  int rc = dsp__scratch_alloc(ctx, hn, "index_select_backward: row lists", (void **)&h);
  if (rc < 0) return rc;
  int64_t *hix = h, *start = h + L, *ks = start + S + 1;
  cudaError_t e = cudaSuccess;
  if (L > 0 && ((e = cudaMemcpyAsync(hix, dsp_tensor_data(in[1]), (size_t)L * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, b->stream)) != cudaSuccess ||
                (e = cudaStreamSynchronize(b->stream)) != cudaSuccess)) {
    dsp__scratch_free(ctx, h, hn);
    return cu_err(ctx, e, op, "index read");
  }
  dsp__cu_csr_build(hix, L, S, start, ks);
  if ((rc = scratch_get(b, ctx, op, dn, &d)) < 0) {
    dsp__scratch_free(ctx, h, hn);
    return rc;
  }
  /* start and ks are adjacent on the host: one copy; the host buffer is
   * only freed once the copy has landed */
  int ke = 0;
  if ((e = cudaMemcpyAsync(d, start, dn, cudaMemcpyHostToDevice, b->stream)) == cudaSuccess)
    ke = dsp__cuk_index_select_bw(b->stream, (int)in[0]->meta.dtype, outer, L, S, blk,
                                  (const int64_t *)d, (const int64_t *)d + S + 1,
                                  dsp_tensor_data(in[0]), dsp_tensor_data(out));
  cudaError_t se = cudaStreamSynchronize(b->stream);
  scratch_put(b, ctx, dn, d);
  dsp__scratch_free(ctx, h, hn);
  if (e != cudaSuccess) return cu_err(ctx, e, op, "cudaMemcpyAsync");
  if (ke) return cu_err(ctx, ke, op, "kernel launch");
  return se == cudaSuccess ? 0 : cu_err(ctx, se, op, "cudaStreamSynchronize");
}

static int run_shape(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out) {
  const dsp_tensor *x = in[0];
  const int es = (int)dsp_dtype_size(x->meta.dtype);
  const dsp_meta *big;
  dsp__cu_index ix;
  int64_t base;
  int e = 0, rc, dim, perm[DSP_MAX_DIMS];
  switch (op) {
    case DSP_OP_RESHAPE:
      e = cudaMemcpyAsync(dsp_tensor_data(out), dsp_tensor_data(x),
                          dsp_tensor_nbytes(out), cudaMemcpyDeviceToDevice, b->stream);
      return e ? cu_err(ctx, e, op, "cudaMemcpyAsync") : 0;
    case DSP_OP_CAST:
      if (x->meta.dtype == out->meta.dtype)
        e = cudaMemcpyAsync(dsp_tensor_data(out), dsp_tensor_data(x),
                            dsp_tensor_nbytes(out), cudaMemcpyDeviceToDevice,
                            b->stream);
      else
        e = dsp__cuk_cast(b->stream, (int)x->meta.dtype, (int)out->meta.dtype,
                          out->numel, dsp_tensor_data(x), dsp_tensor_data(out));
      return e ? cu_err(ctx, e, op, "cast") : 0;
    case DSP_OP_BROADCAST_TO: {
      const dsp_meta *ms[1] = {&x->meta};
      dsp__cu_plan_bcast(&ix, &out->meta, ms, 1);
      e = dsp__cuk_gather(b->stream, es, out->numel, &ix, 0, dsp_tensor_data(x),
                          dsp_tensor_data(out));
      return e ? cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_PERMUTE:
    case DSP_OP_TRANSPOSE: {
      if ((rc = dsp__perm_params(ctx, op, a, x->meta.ndim, perm)) < 0) return rc;
      dsp__cu_plan_perm(&ix, &x->meta, perm, &out->meta);
      e = dsp__cuk_gather(b->stream, es, out->numel, &ix, 0, dsp_tensor_data(x),
                          dsp_tensor_data(out));
      return e ? cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_SLICE:
    case DSP_OP_SLICE_BACKWARD: {
      /* big: the un-sliced tensor (x for slice, out for the backward) */
      const int bw = op == DSP_OP_SLICE_BACKWARD;
      big = bw ? &out->meta : &x->meta;
      const dsp_meta *small = bw ? &x->meta : &out->meta;
      int64_t s0, len;
      if ((rc = dsp__slice_params(ctx, op, big, a->ints, &dim, &s0, &len)) < 0)
        return rc;
      dsp__cu_plan_slice(&ix, big, small, dim, s0, a->ints[3], &base);
      int64_t cnt = bw ? x->numel : out->numel;
      if (bw)
        e = dsp__cuk_scatter(b->stream, es, cnt, &ix, base,
                             dsp_tensor_data(x), dsp_tensor_data(out));
      else
        e = dsp__cuk_gather(b->stream, es, cnt, &ix, base,
                            dsp_tensor_data(x), dsp_tensor_data(out));
      return e ? cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_CAT:
    case DSP_OP_STACK: {
      const int stack = op == DSP_OP_STACK;
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim + stack,
                             &dim)) < 0)
        return rc;
      int64_t pos = 0;
      for (int i = 0; i < n_in && !e; i++) {
        const dsp_meta *mi = &in[i]->meta;
        dsp__cu_plan_cat(&ix, &out->meta, mi, dim, stack, pos, &base);
        e = dsp__cuk_scatter(b->stream, es, in[i]->numel, &ix, base,
                             dsp_tensor_data(in[i]), dsp_tensor_data(out));
        pos += stack ? 1 : mi->shape[dim];
      }
      return e ? cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_INDEX_SELECT:
    case DSP_OP_INDEX_SELECT_BACKWARD: {
      const int bw = op == DSP_OP_INDEX_SELECT_BACKWARD;
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim, &dim)) < 0)
        return rc;
      const int64_t S = bw ? a->ints[1] : x->meta.shape[dim], L = in[1]->numel;
      if ((rc = index_check(b, ctx, op, in[1], dim, S)) < 0) return rc;
      if (out->numel == 0) return 0;
      const int64_t outer = dsp__cu_prod(x->meta.shape, 0, dim);
      const int64_t blk = dsp__cu_prod(x->meta.shape, dim + 1, x->meta.ndim);
      if (bw) return index_select_bw(b, ctx, in, outer, L, S, blk, out);
      e = dsp__cuk_index_select(b->stream, es, outer, L, S, blk,
                                dsp_tensor_data(in[1]), dsp_tensor_data(x),
                                dsp_tensor_data(out));
      return e ? cu_err(ctx, e, op, "kernel launch") : 0;
    }
    default:
      return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                        "%s: no CUDA kernel (backend %s)", opname(op),
                        b->table.name);
  }
}

static int run_create(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      const dsp_attrs *a, dsp_tensor *out) {
  const int dt = (int)out->meta.dtype;
  const int64_t n = out->numel;
  int e = 0;
  switch (op) {
    case DSP_OP_ZEROS: return 0; /* dsp_op hands over zeroed storage */
    case DSP_OP_ONES: e = dsp__cuk_fill(b->stream, dt, n, 1.0, dsp_tensor_data(out)); break;
    case DSP_OP_FULL: e = dsp__cuk_fill(b->stream, dt, n, a->floats[0], dsp_tensor_data(out)); break;
    case DSP_OP_ARANGE:
      if (dt == DSP_BOOL) break; /* infer refuses it */
      e = dsp__cuk_arange(b->stream, dt, n, a->floats[0], a->floats[2],
                          dsp_tensor_data(out));
      break;
    case DSP_OP_UNIFORM:
    case DSP_OP_NORMAL:
      if (!dsp_dtype_is_float(out->meta.dtype)) break; /* infer refuses it */
      e = dsp__cuk_random(b->stream, (int)op, dt, n, (uint64_t)a->ints[1],
                          a->floats[0], a->floats[1], dsp_tensor_data(out));
      break;
    default:
      return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                        "%s: no CUDA kernel (backend %s)", opname(op),
                        b->table.name);
  }
  return e ? cu_err(ctx, e, op, "kernel launch") : 0;
}

static int run_optim(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, const dsp_attrs *a,
                     dsp_tensor *out) {
  const int dt = (int)in[0]->meta.dtype;
  const int64_t n = in[0]->numel;
  void *p = dsp_tensor_data(in[0]);
  int e;
  if (op == DSP_OP_SGD_STEP) {
    e = dsp__cuk_sgd(b->stream, dt, n, p, dsp_tensor_data(in[1]),
                     dsp_tensor_data(in[2]), a->floats[0], a->floats[1],
                     a->floats[2]);
  } else {
    double t = (double)a->ints[0];
    e = dsp__cuk_adam(b->stream, dt, n, p, dsp_tensor_data(in[1]),
                      dsp_tensor_data(in[2]), dsp_tensor_data(in[3]),
                      a->floats[0], a->floats[1], a->floats[2], a->floats[3],
                      1.0 - pow(a->floats[1], t), 1.0 - pow(a->floats[2], t));
  }
  if (!e && dsp_tensor_data(out) != p)
    e = cudaMemcpyAsync(dsp_tensor_data(out), p, dsp_tensor_nbytes(in[0]),
                        cudaMemcpyDeviceToDevice, b->stream);
  return e ? cu_err(ctx, e, op, "kernel launch") : 0;
}

/* Enqueues the op's kernels on the backend's stream. Only ops that
 * cu_supports accepts reach here (dsp_op asks first); anything else is
 * refused with DISPATCH_EUNSUPPORTED, never left as zeros. */
static int cu_run(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                  dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                  dsp_tensor *out) {
  cu_be *b = bctx;
  dsp_meta ms[DSP_MAX_INPUTS];
  if (n_in < 0 || n_in > DSP_MAX_INPUTS || !dsp_op_lookup((int)op))
    return dsp__unsupported(ctx, b->table.name, op, ms, 0, &out->meta);
  for (int i = 0; i < n_in; i++) ms[i] = in[i]->meta;
  if (!cu_supports(bctx, op, ms, n_in, &out->meta))
    return dsp__unsupported(ctx, b->table.name, op, ms, n_in, &out->meta);
  if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
  cudaError_t e = cudaSetDevice(b->device);
  if (e != cudaSuccess) return cu_err(ctx, e, op, "cudaSetDevice");
  switch (dsp_op_lookup((int)op)->family) {
    case DSP_FAM_EW: return run_ew(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_RED: return run_red(b, ctx, op, in, a, out);
    case DSP_FAM_SHAPE: return run_shape(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_LINALG: return run_matmul(b, ctx, in, a, out);
    case DSP_FAM_NN: return run_nn(b, ctx, op, in, n_in, a, out);
    case DSP_FAM_CREATE: return run_create(b, ctx, op, a, out);
    case DSP_FAM_OPTIM: return run_optim(b, ctx, op, in, a, out);
  }
  return dsp_seterr(ctx, DISPATCH_EINTERNAL, "cuda: bad family");
}

/* ------------------------------------------------------------------ */
/* open / close                                                        */

/* Freed pool blocks up to this many bytes stay reserved for the next
 * allocation instead of going back to the driver. */
#define POOL_KEEP ((uint64_t)1 << 30)

static void why_set(char *why, size_t len, const char *fmt, const char *a,
                    cudaError_t e) {
  if (!why || !len) return;
  if (e == cudaSuccess) snprintf(why, len, fmt, a);
  else snprintf(why, len, "%s: %s: %s (%s)", fmt, a, cudaGetErrorString(e),
                cudaGetErrorName(e));
}

/* Gives b (device, pool, name and desc set) its stream, its cuBLAS
 * handle on that stream and the backend table: what one ordered queue of
 * work on the device needs. 0, or a code with the reason in why and
 * nothing left open. */
static int queue_open(cu_be *b, char *why, size_t why_len) {
  cudaError_t e = cudaSetDevice(b->device);
  if (e == cudaSuccess)
    e = cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    why_set(why, why_len, "CUDA device unusable", "cudaStreamCreate", e);
    return cuda_code(e) ? cuda_code(e) : DISPATCH_EUNSUPPORTED;
  }
  cublasStatus_t s = cublasCreate(&b->blas);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(b->blas, b->stream);
  if (s != CUBLAS_STATUS_SUCCESS) {
    int code = dsp_cuda_blas_error((int)s, "cublasCreate", why, why_len);
    if (b->blas) cublasDestroy(b->blas);
    cudaStreamDestroy(b->stream);
    return code;
  }
  b->table.name = b->name;
  b->table.device = b->desc;
  b->table.bctx = b;
  b->table.alloc = cu_alloc;
  b->table.free = cu_free;
  b->table.copy_in = cu_copy_in;
  b->table.copy_out = cu_copy_out;
  b->table.stage_in = cu_stage_in;
  b->table.commit_in = cu_commit_in;
  b->table.stage_out = cu_stage_out;
  b->table.stage_release = cu_stage_release;
  b->table.commit_part = cu_commit_part;
  b->table.stage_out_wait = cu_stage_out_wait;
  b->table.caps = 0; /* device memory; kernels run on the GPU's stream */
  b->table.writes_every_element = 0; /* results are zeroed first */
  b->table.supports_op = cu_supports;
  b->table.run_op = cu_run;
  return 0;
}

int dsp_cuda_backend_open(int device, dsp_backend **out, char *why,
                          size_t why_len) {
  *out = NULL;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why_set(why, why_len, "no CUDA device", "cudaGetDeviceCount", e);
    return DISPATCH_EUNSUPPORTED;
  }
  if (n <= 0) {
    why_set(why, why_len, "no CUDA device: cudaGetDeviceCount found %s", "none",
            cudaSuccess);
    return DISPATCH_EUNSUPPORTED;
  }
  if (device < 0 || device >= n) {
    if (why) snprintf(why, why_len, "no CUDA device %d: this host has %d (cuda:0..cuda:%d)",
                      device, n, n - 1);
    return DISPATCH_EINVAL;
  }
  struct cudaDeviceProp prop;
  int pools = 0;
  if ((e = cudaSetDevice(device)) != cudaSuccess ||
      (e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported,
                                  device)) != cudaSuccess) {
    why_set(why, why_len, "CUDA device unusable", "cudaGetDeviceProperties", e);
    return cuda_code(e) ? cuda_code(e) : DISPATCH_EUNSUPPORTED;
  }
  if (!pools) {
    if (why) snprintf(why, why_len, "CUDA device %d (%s) has no stream-ordered memory pools",
                      device, prop.name);
    return DISPATCH_EUNSUPPORTED;
  }
  cu_be *b = dsp_calloc(1, sizeof *b);
  if (!b) {
    if (why) snprintf(why, why_len, "out of memory opening cuda:%d", device);
    return DISPATCH_ENOMEM;
  }
  b->device = device;
  uint64_t keep = POOL_KEEP;
  if ((e = cudaDeviceGetDefaultMemPool(&b->pool, device)) != cudaSuccess ||
      (e = cudaMemPoolSetAttribute(b->pool, cudaMemPoolAttrReleaseThreshold,
                                   &keep)) != cudaSuccess) {
    why_set(why, why_len, "CUDA device unusable", "pool setup", e);
    dsp_free(b);
    return cuda_code(e) ? cuda_code(e) : DISPATCH_EUNSUPPORTED;
  }
  b->total_mem = (uint64_t)prop.totalGlobalMem;
  snprintf(b->name, sizeof b->name, "cuda:%d", device);
  snprintf(b->desc, sizeof b->desc, "cuda:%d %s (sm_%d%d, %zu MiB)", device,
           prop.name, prop.major, prop.minor, prop.totalGlobalMem >> 20);
  int rc = queue_open(b, why, why_len);
  if (rc < 0) {
    dsp_free(b);
    return rc;
  }
  pthread_mutex_init(&b->mu, NULL);
  *out = &b->table;
  return 0;
}

static cu_be *as_cuda(const dsp_backend *be) {
  return be && be->alloc == cu_alloc ? (cu_be *)be->bctx : NULL;
}

/* Waits for the queue's work, then destroys its stream and handle. */
static void queue_close(cu_be *b) {
  cudaSetDevice(b->device);
  cudaStreamSynchronize(b->stream);
  cublasDestroy(b->blas);
  cudaStreamDestroy(b->stream);
}

void dsp_cuda_backend_close(dsp_backend *be) {
  cu_be *b = as_cuda(be);
  if (!b) return;
  if (b->parent) { /* a session view: the device closes it */
    dsp_cuda_session_close(be);
    return;
  }
  for (cu_be *v = b->views, *nx; v; v = nx) {
    nx = v->next_view;
    queue_close(v);
    dsp_free(v);
  }
  queue_close(b);
  for (pin_blk *k = b->pins, *nx; k; k = nx) {
    nx = k->next;
    cudaFreeHost(k->p);
    dsp_free(k);
  }
  pthread_mutex_destroy(&b->mu);
  dsp_free(b);
}

/* A view is never destroyed before its device: a storage it made may be
 * freed after its session has gone (a Read reply's pin still sending),
 * and that free is enqueued on the view's stream, which then runs it
 * after whatever the view's next session has queued -- still in order for
 * the block, since nobody else holds it. Handing a returned view to the
 * next session also spares a stream and a cuBLAS handle per connection. */
int dsp_cuda_session_open(dsp_backend *device, dsp_backend **out, char *why,
                          size_t why_len) {
  *out = NULL;
  cu_be *d = as_cuda(device);
  if (!d || d->parent) {
    if (why) snprintf(why, why_len, "dsp_cuda_session_open: not a CUDA "
                      "device backend");
    return DISPATCH_EINVAL;
  }
  pthread_mutex_lock(&d->mu);
  cu_be *v = d->views;
  while (v && v->in_use) v = v->next_view;
  if (v) v->in_use = 1;
  pthread_mutex_unlock(&d->mu);
  if (!v) {
    v = dsp_calloc(1, sizeof *v);
    if (!v) {
      if (why) snprintf(why, why_len, "out of memory opening a session on %s",
                        d->name);
      return DISPATCH_ENOMEM;
    }
    v->device = d->device;
    v->pool = d->pool;
    v->parent = d;
    memcpy(v->name, d->name, sizeof v->name);
    memcpy(v->desc, d->desc, sizeof v->desc);
    int rc = queue_open(v, why, why_len);
    if (rc < 0) {
      dsp_free(v);
      return rc;
    }
    v->in_use = 1;
    pthread_mutex_lock(&d->mu);
    v->next_view = d->views;
    d->views = v;
    pthread_mutex_unlock(&d->mu);
  }
  /* the device's identity and budget, as set by whoever opened it */
  v->table.id = device->id;
  v->table.mem = device->mem;
  *out = &v->table;
  return 0;
}

void dsp_cuda_session_close(dsp_backend *session) {
  cu_be *v = as_cuda(session);
  if (!v || !v->parent) return;
  pthread_mutex_lock(&v->parent->mu);
  v->in_use = 0;
  pthread_mutex_unlock(&v->parent->mu);
}

uint64_t dsp_cuda_total_memory(const dsp_backend *be) {
  cu_be *b = as_cuda(be);
  if (b && b->parent) b = b->parent;
  return b ? b->total_mem : 0;
}

int dsp_cuda_device_count(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? n : 0;
}

void dsp_cuda_ctx_use(dsp_ctx *ctx, const dsp_backend *be) {
  if (ctx && as_cuda(be)) ctx->backend = be;
}

uint64_t dsp_cuda_pool_used(const dsp_backend *be) {
  cu_be *b = as_cuda(be);
  uint64_t v = 0; /* cuuint64_t */
  if (!b || cudaMemPoolGetAttribute(b->pool, cudaMemPoolAttrUsedMemCurrent, &v) !=
                cudaSuccess)
    return 0;
  return (uint64_t)v;
}

int dsp_cuda_sync(const dsp_backend *be, dsp_ctx *ctx) {
  cu_be *b = as_cuda(be);
  if (!b) return dsp_seterr(ctx, DISPATCH_EINVAL, "dsp_cuda_sync: not a CUDA backend");
  cudaError_t e = cudaSetDevice(b->device);
  if (e == cudaSuccess) e = cudaStreamSynchronize(b->stream);
  if (e == cudaSuccess) return 0;
  char msg[400];
  int code = dsp_cuda_error(e, "cuda: cudaStreamSynchronize", msg, sizeof msg);
  return dsp_seterr(ctx, code, "%s", msg);
}
