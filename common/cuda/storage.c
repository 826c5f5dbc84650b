/* The CUDA backend's memory: storage in the device's stream-ordered pool,
 * copies, the pinned staging the network layer fills and drains, kernel
 * scratch, and the one-element reads the checks of index values need. */
#include "cuda_be.h"

static int cu_alloc(void *bctx, size_t nbytes, int zero, void **data) {
  cu_be *b = bctx;
  void *p = NULL;
  *data = NULL;
  if (cudaSetDevice(b->device) != cudaSuccess) return DISPATCH_EINTERNAL;
  /* an empty tensor still gets a distinct block (never a NULL data) */
  cudaError_t e = cudaMallocAsync(&p, nbytes ? nbytes : 1, b->stream);
  if (e != cudaSuccess) return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_ENOMEM;
  if (zero && nbytes && (e = cudaMemsetAsync(p, 0, nbytes, b->stream)) != cudaSuccess) {
    cudaFreeAsync(p, b->stream);
    return dsp__cu_code(e);
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
  return dsp__cu_code(e);
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
      return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_ENOMEM;
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
  return dsp__cu_code(e);
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
    return dsp__cu_code(e) ? dsp__cu_code(e) : DISPATCH_EINTERNAL;
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

void dsp__cu_storage_fill(dsp_backend *t) {
  t->alloc = cu_alloc;
  t->free = cu_free;
  t->copy_in = cu_copy_in;
  t->copy_out = cu_copy_out;
  t->stage_in = cu_stage_in;
  t->commit_in = cu_commit_in;
  t->stage_out = cu_stage_out;
  t->stage_release = cu_stage_release;
  t->commit_part = cu_commit_part;
  t->stage_out_wait = cu_stage_out_wait;
}

/* Device scratch charged to the device's budget (the backend's mem, as
 * storage is) and to ctx's, so a kernel's workspace counts where its
 * bytes live. */
int dsp__cu_scratch_get(cu_be *b, dsp_ctx *ctx, dsp_opcode op, size_t n,
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
    return dsp__cu_err(ctx, e, op, "cudaMallocAsync (scratch)");
  }
  return 0;
}
void dsp__cu_scratch_put(cu_be *b, dsp_ctx *ctx, size_t n, void *p) {
  if (!p) return;
  cudaFreeAsync(p, b->stream);
  dsp_budget_uncharge(dsp_ctx_budget(ctx), DSP_BUDGET_COST(n));
  dsp_budget_uncharge(b->table.mem, DSP_BUDGET_COST(n));
}


/* Copies one i64 element of device memory to the host (synchronous). */
int dsp__cu_peek_i64(cu_be *b, const int64_t *p, int64_t *v) {
  cudaError_t e = cudaMemcpyAsync(v, p, sizeof *v, cudaMemcpyDeviceToHost, b->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(b->stream);
  return (int)e;
}
