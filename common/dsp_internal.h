/* Internal to common/: the ctx layout and hooks between the op runner and
 * the autodiff engine. server/ and client/ include dsp.h only. */
#ifndef DSP_INTERNAL_H
#define DSP_INTERNAL_H

#include <stdatomic.h>

#include "dsp.h"

struct dsp_ctx {
  const dsp_backend *backend;
  const dsp_backend *home; /* dsp_ctx_new's; dsp_ctx_set_backend(NULL) */
  dsp_budget *budget; /* NULL: unlimited */
  int grad_enabled;
  int64_t max_span; /* dsp_ctx_set_max_elements; 0: no limit */
  char err[512];
  /* set from any thread by dsp_ctx_cancel; kernels poll it between blocks */
  atomic_int cancel;
  uint64_t max_op_cost; /* 0: no limit (dsp_ctx_set_max_op_cost) */
  uint64_t work;        /* dsp_ctx_work */
  /* 0: none; else an op that takes work past it is refused with
   * DISPATCH_ELIMIT before it runs (dsp_graph_run: a replay's bound) */
  uint64_t work_limit;
  uint64_t work_cap; /* what the run that set work_limit may do, for the
                        message */
};

/* A new tensor on backend be (zeroed when zero != 0), charged like
 * dsp_tensor_new; dsp_op puts an op's result on its inputs' device. */
int dsp__tensor_new_on(dsp_ctx *ctx, const dsp_backend *be, const dsp_meta *m,
                       int zero, dsp_tensor **out);

/* What dsp_op asks of a tensor's backend (common/backend.c, which alone of
 * the op runner sees the table): 1 when be
 * claims op on these inputs and this output (a backend without the hook
 * claims nothing), and the kernel into the allocated out. */
int dsp__backend_supports(const dsp_backend *be, dsp_opcode op,
                          const dsp_meta *in, int n_in, const dsp_meta *out);
/* 1 when be's kernels of the op family fam write every element of their
 * result (struct dsp_backend's writes_every_element), so the result need
 * not be zeroed first. Takes the family, not the op, so that the backend
 * code needs nothing of the op table. */
int dsp__backend_writes_every_element(const dsp_backend *be,
                                      dsp_op_family fam);
int dsp__backend_run(const dsp_backend *be, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out);

/* DISPATCH_ELIMIT for a run past ctx->work_limit, naming what would have
 * passed it */
int dsp__work_limit_err(dsp_ctx *ctx, const char *what);

/* What every op passes after inference and before its output is
 * allocated: the result's span within the ctx's element limit, its cost
 * (UINT64_MAX: computed here) within the per-op limit and added to
 * dsp_ctx_work (with DSP_WORK_PER_OP), that work within the ctx's
 * work_limit, and no cancellation. 0 or the refusal's code. */
int dsp__op_admit(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                  const dsp_attrs *a, const dsp_meta *om, uint64_t cost);

/* Size classes of the free lists (common/cache.c and the CPU backend's
 * block cache): 0 for up to 64 bytes, then four classes per power of two,
 * so two blocks of one class differ by less than a quarter of the
 * smaller. */
#define DSP__NCLASS 236
static inline int dsp__size_class(size_t n) {
  if (n <= 64) return 0;
  unsigned long long m = (unsigned long long)n - 1;
  int p = 63 - __builtin_clzll(m); /* 2^p <= m < 2^(p+1), p >= 6 */
  return 1 + (p - 6) * 4 + (int)((m >> (p - 2)) & 3);
}

/* A budget's free lists (dsp_budget_set_cache); NULL: none. The lists
 * hold storages with their data and tensor headers, each still charged
 * to that budget. */
typedef struct dsp__cache dsp__cache;
dsp__cache *dsp__budget_cache(const dsp_budget *b);
dsp__cache *dsp__cache_new(void);
/* Frees what c holds and c itself (the budget's last reference went). */
void dsp__cache_free(dsp__cache *c);
void dsp__cache_set_max(dsp__cache *c, uint64_t max_bytes);
/* Keeps s (1) or leaves it to the caller to free (0). */
int dsp__cache_put_storage(dsp__cache *c, dsp_storage *s);
dsp_tensor *dsp__cache_take_header(dsp__cache *c); /* NULL: none kept */
int dsp__cache_put_header(dsp__cache *c, dsp_tensor *t);
/* A header and (be not NULL) a storage of backend be whose block holds
 * nbytes (refcount, nbytes and the rest as it was freed) at once, under
 * one lock: what a new tensor takes. Either may come back NULL. */
void dsp__cache_take_both(dsp__cache *c, const dsp_backend *be,
                          size_t nbytes, dsp_tensor **t, dsp_storage **s);
/* A dead tensor's header and its storage (its last reference) at once;
 * what is not kept is the caller's to free. */
void dsp__cache_put_both(dsp__cache *c, dsp_tensor *t, dsp_storage *s,
                         int *t_kept, int *s_kept);
/* Frees up to want bytes of charge, oldest first; returns what it freed. */
uint64_t dsp__cache_release(dsp__cache *c, uint64_t want);
/* The same in two steps: takes them out of the lists onto *out (a caller
 * holding a lock that freeing may need), then frees them. */
typedef struct dsp__cache_out {
  dsp_storage *storages;
  dsp_tensor *headers;
} dsp__cache_out;
uint64_t dsp__cache_detach(dsp__cache *c, uint64_t want, dsp__cache_out *out);
void dsp__cache_out_free(dsp__cache_out *out);
void dsp__cache_stats(dsp__cache *c, dsp_cache_stats *out);
/* The frees the lists do (common/tensor.c): data to its backend, the
 * struct to the allocator, the charge back to its budgets. */
void dsp__storage_destroy(dsp_storage *s);
void dsp__header_destroy(dsp_tensor *t);
/* Gets cached bytes back for a charge of b that a budget refused: b's
 * own lists and those of every budget under each of b's ancestors up to
 * stop (NULL: the root), until want bytes came back; returns what did. */
uint64_t dsp__budget_relieve(dsp_budget *b, const dsp_budget *stop,
                             uint64_t want);

/* Kernel scratch of n bytes charged to ctx's budget: 0, or
 * DISPATCH_EQUOTA / DISPATCH_ENOMEM with the detail in ctx and *out NULL.
 * Free with the same n on the same ctx. */
int dsp__scratch_alloc(dsp_ctx *ctx, size_t n, const char *what, void **out);
void dsp__scratch_free(dsp_ctx *ctx, void *p, size_t n);
/* Cancellation polling for kernels. A kernel adds the elementary
 * operations of each block it finished to *acc; about every
 * DSP_POLL_WORK of them the ctx's cancel flag is read (one relaxed atomic
 * load), so the check costs nothing next to the work and a cancelled op
 * stops within a few milliseconds of work. 1: stop now (the kernel frees
 * its scratch and returns dsp__cancelled_err). */
#define DSP_POLL_WORK ((int64_t)1 << 20)
/* kernels step through flat loops in blocks of DSP_POLL_WORK elements and
 * mask indexes with DSP_POLL_WORK - 1; normal's pairs need even blocks */
_Static_assert(DSP_POLL_WORK >= 2 && (DSP_POLL_WORK & (DSP_POLL_WORK - 1)) == 0,
               "DSP_POLL_WORK must be a power of two");
static inline int dsp__poll(dsp_ctx *ctx, int64_t *acc, int64_t work) {
  *acc += work;
  if (*acc < DSP_POLL_WORK) return 0;
  *acc = 0;
  return atomic_load_explicit(&ctx->cancel, memory_order_relaxed) != 0;
}
/* Sets DISPATCH_ECANCELED with a message naming the op; returns the code. */
int dsp__cancelled_err(dsp_ctx *ctx, dsp_opcode op);

/* DISPATCH_EUNSUPPORTED with "OP: backend B has no kernel for inputs
 * (f32, i64) -> f32", for dsp_op when a backend's supports_op says no and
 * for a backend's kernels that reach an op x dtype they have no loop for. */
int dsp__unsupported(dsp_ctx *ctx, const char *backend, dsp_opcode op,
                     const dsp_meta *in, int n_in, const dsp_meta *out);

/* Called by dsp_op after a successful kernel when grad mode is on and at
 * least one input is tracked: records the op so `out` becomes tracked.
 * On failure out is left untouched (the caller drops it). */
int dsp__autodiff_record(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                         int n_in, const dsp_attrs *a, dsp_tensor *out);
/* What freeing a tracked tensor does with its tape node (t->node): drop
 * the tensor's reference. The tensor code holds the node as an opaque
 * pointer and calls this hook, which the autodiff engine sets
 * (common/autodiff.c, before it makes a node), so common/tensor.c calls
 * nothing of autodiff's; a tensor with a node always finds it set. */
typedef void (*dsp__node_release_fn)(struct dsp_node *n);
void dsp__tensor_set_node_release(dsp__node_release_fn fn);

/* Infer helper of the op families: exactly n_ints int and n_floats float
 * attributes, else DISPATCH_EINVAL naming the op and all four counts. */
int dsp__want_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                    int n_ints, int n_floats);

/* Element i of a float buffer (f64 != 0: double, else float) as double,
 * and the store back; for kernels that compute in double for both. */
static inline double dsp__ld(const void *p, int f64, int64_t i) {
  return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
static inline void dsp__st(void *p, int f64, int64_t i, double v) {
  if (f64)
    ((double *)p)[i] = v;
  else
    ((float *)p)[i] = (float)v;
}

/* Memory kept for reuse (free lists, the CPU block cache) is poisoned
 * under AddressSanitizer while it waits, so a use after free still
 * reports. gcc says __SANITIZE_ADDRESS__; clang (the fuzzers) has the
 * feature. */
#if defined(__SANITIZE_ADDRESS__)
#define DSP_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSP_ASAN 1
#endif
#endif
#if defined(DSP_ASAN)
#include <sanitizer/asan_interface.h>
#define DSP_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define DSP_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define DSP_POISON(p, n) ((void)(p), (void)(n))
#define DSP_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#endif
