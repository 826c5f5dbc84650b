/* Private to the CUDA backend's host side (the .c files of common/cuda/):
 * the backend struct behind the dsp_backend table, and what its files
 * share. The files: device.c (errors, opening a device and its session
 * views, the public queries), storage.c (device memory, pinned staging,
 * kernel scratch), ops.c (what the backend runs and the dispatch to the
 * op families), and one file per op family (ew.c, red.c, shape.c,
 * linalg.c, nn.c, create.c, optim.c) enqueueing the kernels of
 * kernels.cu. All of them are compiled by gcc with the project's
 * warnings; only the kernels go through nvcc. */
#ifndef DSP_CUDA_BE_H
#define DSP_CUDA_BE_H

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
  int cc_major;       /* compute capability major (bf16 GEMMs need 8) */
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

static inline const char *opname(dsp_opcode op) {
  return dsp_op_lookup((int)op)->name;
}

/* device.c: the DISPATCH_E* code of a CUDA error; a failed CUDA call or
 * cuBLAS status as the op's error in ctx ("cuda OP: CALL: message
 * (name)") */
int dsp__cu_code(cudaError_t e);
int dsp__cu_err(dsp_ctx *ctx, int e, dsp_opcode op, const char *call);
int dsp__cu_blas_err(dsp_ctx *ctx, cublasStatus_t s, dsp_opcode op);
/* an op a family's dispatch has no kernel for: DISPATCH_EUNSUPPORTED,
 * "OP: no CUDA kernel (backend NAME)" (the support table keeps such an op
 * from getting here) */
int dsp__cu_no_kernel(const cu_be *b, dsp_ctx *ctx, dsp_opcode op);

/* storage.c: the table's storage and staging entries; device scratch of
 * n bytes charged to the device's and ctx's budgets; one i64 element of
 * device memory read to the host (synchronous) */
void dsp__cu_storage_fill(dsp_backend *t);
int dsp__cu_scratch_get(cu_be *b, dsp_ctx *ctx, dsp_opcode op, size_t n,
                        void **p);
void dsp__cu_scratch_put(cu_be *b, dsp_ctx *ctx, size_t n, void *p);
int dsp__cu_peek_i64(cu_be *b, const int64_t *p, int64_t *v);

/* ops.c: the table's supports_op and run_op entries; 1 when be is a CUDA
 * backend (a device or a view) */
void dsp__cu_ops_fill(dsp_backend *t);
int dsp__cu_is(const dsp_backend *be);

/* the op families: enqueue op's kernels on b's stream into out */
int dsp__cu_run_ew(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out);
int dsp__cu_run_red(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                    dsp_tensor *const *in, const dsp_attrs *a,
                    dsp_tensor *out);
int dsp__cu_run_shape(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                      dsp_tensor *out);
int dsp__cu_run_matmul(cu_be *b, dsp_ctx *ctx, dsp_tensor *const *in,
                       const dsp_attrs *at, dsp_tensor *out);
/* issue 23: loss (loss.c): cross_entropy_ex and its backward op */
int dsp__cu_run_ce_ex(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                      dsp_tensor *out);
int dsp__cu_run_nn(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out);
/* attention and its backward op (attn.c), reached through dsp__cu_run_nn */
int dsp__cu_run_attn(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out);
int dsp__cu_run_create(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                       const dsp_attrs *a, dsp_tensor *out);
int dsp__cu_run_optim(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, const dsp_attrs *a,
                      dsp_tensor *out);

/* shape.c, shared with embedding (norm.c): DISPATCH_EINDEX naming the
 * first index of ix outside [0, size) (synchronises); grad rows in[0]
 * [outer, L, blk] summed into out [outer, S, blk] at the indices in[1],
 * in index order (the CPU's), no atomics */
int dsp__cu_index_check(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                        const dsp_tensor *ix, int dim, int64_t size);
int dsp__cu_rows_scatter_add(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                             dsp_tensor *const *in, int64_t outer, int64_t L,
                             int64_t S, int64_t blk, dsp_tensor *out);
/* issue 23: embedding, layer_norm, rms_norm and their backward ops */
int dsp__cu_run_norm(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out);

#endif
