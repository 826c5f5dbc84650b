/* The CUDA backend's devices: CUDA and cuBLAS errors as DISPATCH_E*
 * codes, opening a device (its stream, cuBLAS handle, pool and table) and
 * the session views made on it, and the public queries of dsp_cuda.h. */
#include "cuda_be.h"

int dsp__cu_code(cudaError_t e) {
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
  return dsp__cu_code(e);
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
int dsp__cu_err(dsp_ctx *ctx, int e, dsp_opcode op, const char *call) {
  char what[96], msg[400];
  snprintf(what, sizeof what, "cuda %s: %s", opname(op), call);
  int code = dsp_cuda_error(e, what, msg, sizeof msg);
  return dsp_seterr(ctx, code, "%s", msg);
}
int dsp__cu_no_kernel(const cu_be *b, dsp_ctx *ctx, dsp_opcode op) {
  return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                    "%s: no CUDA kernel (backend %s)", opname(op),
                    b->table.name);
}
int dsp__cu_blas_err(dsp_ctx *ctx, cublasStatus_t s, dsp_opcode op) {
  char what[96], msg[400];
  snprintf(what, sizeof what, "cuda %s: cublas gemm", opname(op));
  int code = dsp_cuda_blas_error((int)s, what, msg, sizeof msg);
  return dsp_seterr(ctx, code, "%s", msg);
}


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
    return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_EUNSUPPORTED;
  }
  cublasStatus_t s = cublasCreate(&b->blas);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(b->blas, b->stream);
  /* half matmuls accumulate in f32 all the way: without this flag cuBLAS
   * may sum split-K partials in the output's half type */
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasSetMathMode(b->blas,
                          (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                         CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  if (s != CUBLAS_STATUS_SUCCESS) {
    int code = dsp_cuda_blas_error((int)s, "cublasCreate", why, why_len);
    if (b->blas) cublasDestroy(b->blas);
    cudaStreamDestroy(b->stream);
    return code;
  }
  b->table.name = b->name;
  b->table.device = b->desc;
  b->table.bctx = b;
  dsp__cu_storage_fill(&b->table);
  dsp__cu_ops_fill(&b->table);
  b->table.caps = 0; /* device memory; kernels run on the GPU's stream */
  b->table.writes_every_element = 0; /* results are zeroed first */
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
    return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_EUNSUPPORTED;
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
    return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_EUNSUPPORTED;
  }
  b->total_mem = (uint64_t)prop.totalGlobalMem;
  b->cc_major = prop.major;
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
  return dsp__cu_is(be) ? (cu_be *)be->bctx : NULL;
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
    v->cc_major = d->cc_major;
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
