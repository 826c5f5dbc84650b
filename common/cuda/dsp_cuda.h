/* The CUDA backend: a dsp_backend (common/dsp.h) whose storage lives in GPU
 * memory. Built whenever nvcc is found (make CUDA=0 skips it) into the
 * plugin build/dispatch-cuda.so (common/cuda_plugin.h), whose table holds
 * these functions; the server, the client library and the GPU programs
 * load it at run time and link no CUDA library. The objects are also
 * archived in build/libdspcuda.a for tests/test_cuda_host, which links
 * them directly with -lcublas -lcudart -lstdc++ (make's $(CUDA_LIBS)).
 *
 * One opened backend (the device) owns one CUDA stream, one cuBLAS handle
 * and uses the device's default memory pool (cudaMallocAsync). A server
 * gives each session a view of it (dsp_cuda_session_open): the same
 * device, pool, name and budget, with a stream and cuBLAS handle of its
 * own, so every op, upload, read and free of the session runs in the
 * order it was issued while distinct sessions overlap on the device; the
 * pool stays stream-ordered (a block freed on a view's stream is reused
 * after that stream's earlier work). Storage is charged to the ctx's
 * dsp_budget (the session) and the backend's mem (the device) like CPU
 * storage (tensor.c); the pool's bytes in use on the device are readable
 * with dsp_cuda_pool_used.
 *
 * Every CUDA and cuBLAS failure becomes a DISPATCH_E* code with the
 * library's message in the ctx (out of device memory: DISPATCH_ENOMEM);
 * nothing here aborts or exits. Kernels run asynchronously: an error of a
 * running kernel is reported by the next call that waits for the stream
 * (a read, or an op that checks index values). */
#ifndef DSP_CUDA_H
#define DSP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "dsp.h"

/* Opens device `device` (0-based). On success *out is a backend the caller
 * owns (dsp_cuda_backend_close). On failure *out is NULL, why (may be
 * NULL) holds one line such as "no CUDA device: cudaGetDeviceCount: CUDA
 * driver version is insufficient for CUDA runtime version
 * (cudaErrorInsufficientDriver)", and the code is DISPATCH_EUNSUPPORTED
 * (no usable device), DISPATCH_EINVAL (no such device number) or
 * DISPATCH_ENOMEM. */
int dsp_cuda_backend_open(int device, dsp_backend **out, char *why,
                          size_t why_len);
/* Closes a device backend and every session view it made, waiting for
 * their streams first; every tensor made on any of them must have been
 * released. Given a view, the same as dsp_cuda_session_close. NULL ok. */
void dsp_cuda_backend_close(dsp_backend *be);
/* The GPU's memory in bytes (of a device backend or a view of one); 0
 * when be is not a CUDA backend. */
uint64_t dsp_cuda_total_memory(const dsp_backend *be);
/* How many CUDA devices this host has; 0 when none is usable, whatever
 * the reason (dsp_cuda_backend_open says why). */
int dsp_cuda_device_count(void);
/* A session's view of device backend `device` (from dsp_cuda_backend_open,
 * not a view): its own stream and cuBLAS handle, the device's pool, name,
 * id and mem. A view closed earlier is handed out again before a new one
 * is made. 0 with *out, which the caller gives back with
 * dsp_cuda_session_close (the device still owns it); or DISPATCH_EINVAL /
 * DISPATCH_ENOMEM / a CUDA failure's code with why (may be NULL) set.
 * Thread-safe against other opens and closes of the same device. */
int dsp_cuda_session_open(dsp_backend *device, dsp_backend **out, char *why,
                          size_t why_len);
/* Gives a view back to its device. Storage made on it may still be freed
 * afterwards (on its stream, which lives until the device closes).
 * Anything but a view is ignored. */
void dsp_cuda_session_close(dsp_backend *session);
/* Makes ctx run its ops on be (a CUDA backend from dsp_cuda_backend_open,
 * which must outlive ctx). Only before ctx has made any tensor. */
void dsp_cuda_ctx_use(dsp_ctx *ctx, const dsp_backend *be);
/* Bytes the device's memory pool hands out now (all backends of that
 * device together); 0 when be is not a CUDA backend. */
uint64_t dsp_cuda_pool_used(const dsp_backend *be);
/* Waits for every op enqueued on be; a pending kernel error comes back as
 * its DISPATCH_E* code with the message in ctx (may be NULL). */
int dsp_cuda_sync(const dsp_backend *be, dsp_ctx *ctx);

/* 1 when the CUDA kernels implement op for key dtype `key`
 * (dsp__op_key_dtype): the backend's supports_op table
 * (common/cuda/supports.c). No GPU needed. */
int dsp__cuda_has_kernel(dsp_opcode op, dsp_dtype key);

/* The DISPATCH_E* code of a cudaError_t / cublasStatus_t value, and the
 * message "WHAT: LIBRARY MESSAGE (NAME)" written to buf. */
int dsp_cuda_error(int cuda_error, const char *what, char *buf, size_t len);
int dsp_cuda_blas_error(int cublas_status, const char *what, char *buf,
                        size_t len);

#endif
