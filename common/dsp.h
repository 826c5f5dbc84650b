/* common/: the core both dispatch-server and libdispatch-client link.
 *
 * Tensors, dtypes, the allocator, the error/detail context, the op table
 * (codes shared with the wire protocol), shape inference, the backend
 * interface with its CPU implementation (common/cpu/), and the
 * reverse-mode autodiff engine.
 *
 * Conventions
 * - Every function that can fail returns 0 or a negative DISPATCH_E* code
 *   and, when it has a ctx, writes a specific message into the ctx's detail
 *   buffer (dsp_ctx_errmsg). Nothing here aborts on a caller's mistake.
 * - Tensors are reference counted. A function that gives back a tensor
 *   through `dsp_tensor **out` hands the caller one reference, which the
 *   caller drops with dsp_tensor_unref. Inputs are borrowed.
 * - Storage is contiguous and row-major. Reshape shares storage; other
 *   ops write a fresh tensor. Nothing here is thread-safe per ctx; distinct
 *   ctxs may be used from distinct threads.
 */
#ifndef DSP_H
#define DSP_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch_errors.h"

#define DSP_MAX_DIMS 8
#define DSP_MAX_INPUTS 64      /* cat/stack take up to this many inputs */
#define DSP_MAX_ATTR_INTS 16
/* 8 since wire 1.5 (adamw with a clip scale takes 6); a peer that sends
 * at most 4 is unaffected */
#define DSP_MAX_ATTR_FLOATS 8

/* ------------------------------------------------------------------ */
/* allocator                                                           */

/* All memory common/, server/ and client/ take goes through these, so a
 * test can fail the N-th allocation. */
typedef struct dsp_allocator {
  void *(*malloc_fn)(size_t size, void *ud);
  void *(*realloc_fn)(void *ptr, size_t size, void *ud);
  void (*free_fn)(void *ptr, void *ud);
  void *ud;
} dsp_allocator;

/* Replaces the process-wide allocator; NULL restores malloc/realloc/free.
 * Call only while no dsp memory is live, or with an allocator compatible
 * with the previous one (a counting wrapper around malloc is). */
void dsp_set_allocator(const dsp_allocator *a);
void *dsp_malloc(size_t size);                 /* NULL on failure */
void *dsp_calloc(size_t n, size_t size);       /* overflow-checked, zeroed */
void *dsp_realloc(void *ptr, size_t size);
void dsp_free(void *ptr);
char *dsp_strdup(const char *s);

/* ------------------------------------------------------------------ */
/* dtypes                                                              */

typedef enum dsp_dtype {
  DSP_F32 = 0,
  DSP_F64 = 1,
  DSP_I64 = 2,
  DSP_BOOL = 3, /* one byte per element, 0 or 1 */
  DSP_F16 = 4,  /* IEEE binary16; stored in 2 bytes, computed in f32 */
  DSP_BF16 = 5, /* bfloat16 (f32's top half); computed in f32 */
  DSP_NDTYPES
} dsp_dtype;

size_t dsp_dtype_size(dsp_dtype dt);      /* 0 for an invalid dtype */
const char *dsp_dtype_name(dsp_dtype dt); /* "f32", ..., "invalid" */
int dsp_dtype_valid(int dt);
int dsp_dtype_is_float(dsp_dtype dt);

/* ------------------------------------------------------------------ */
/* context: error detail + grad mode                                   */

typedef struct dsp_ctx dsp_ctx;
typedef struct dsp_backend dsp_backend; /* the backend interface, below */

/* Creates a context whose creation ops and new tensors use backend be
 * (dsp_ctx_set_backend); the caller names it (dsp_cpu_backend() for the
 * CPU), as common/ picks none. Returns NULL when be is NULL or out of
 * memory. The caller owns the ctx and frees it with dsp_ctx_free after
 * every tensor made through it has been released. */
dsp_ctx *dsp_ctx_new(const dsp_backend *be);
void dsp_ctx_free(dsp_ctx *ctx);

/* The detail message of the last error set on ctx ("" if none). Valid
 * until the next call that fails on the same ctx. */
const char *dsp_ctx_errmsg(const dsp_ctx *ctx);

/* Formats a detail message into ctx and returns `code`, so a failing path
 * reads `return dsp_seterr(ctx, DISPATCH_ESHAPE, "matmul: ...", ...)`.
 * ctx may be NULL (the message is dropped). */
int dsp_seterr(dsp_ctx *ctx, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void dsp_clearerr(dsp_ctx *ctx);

/* While grad mode is off, ops record nothing on the tape. Returns the
 * previous mode. The autodiff engine turns it off while running backward. */
int dsp_set_grad_enabled(dsp_ctx *ctx, int enabled);
int dsp_grad_enabled(const dsp_ctx *ctx);

/* Every op result made through ctx (also the intermediates of a backward
 * pass) whose span (dsp_meta_span) passes n fails with DISPATCH_ELIMIT.
 * 0, the default, sets no limit beyond the span's own int64/size_t
 * bound. dispatch-server sets its --max-elements here. */
void dsp_ctx_set_max_elements(dsp_ctx *ctx, int64_t n);

/* ------------------------------------------------------------------ */
/* memory budgets                                                      */

/* A count of bytes with a limit, optionally nested in a parent budget
 * whose limit also applies (a server session inside the whole server).
 * A ctx that carries a budget charges it for every allocation it makes:
 * tensor storage and headers, autodiff nodes, gradient containers, kernel
 * scratch; each object uncharges itself when freed, on whatever thread.
 * A ctx without a budget (the default) is unlimited. Thread-safe. */
typedef struct dsp_budget dsp_budget;

/* New budget of `limit` bytes inside parent (may be NULL; the new budget
 * holds a reference to it). who ("session") and flag ("--max-session-bytes")
 * name it in error messages. The caller owns one reference; NULL when out
 * of memory. */
dsp_budget *dsp_budget_new(uint64_t limit, dsp_budget *parent,
                           const char *who, const char *flag);
dsp_budget *dsp_budget_ref(dsp_budget *b); /* +1, returns b; NULL ok */
void dsp_budget_unref(dsp_budget *b);      /* NULL ok */
/* Adds n bytes to b and its parents, or changes nothing and returns
 * DISPATCH_EQUOTA with "WHAT: session holds H bytes; N more would pass its
 * limit of L bytes (FLAG)" in ctx (may be NULL) when any limit would be
 * passed. A successful charge holds a reference on b until the matching
 * dsp_budget_uncharge. b NULL: always 0. */
int dsp_budget_charge(dsp_budget *b, dsp_ctx *ctx, uint64_t n,
                      const char *what);
/* The same, with the message written to why (may be NULL). */
int dsp_budget_charge_why(dsp_budget *b, uint64_t n, const char *what,
                          char *why, size_t why_len);
/* dsp_budget_charge_why without the reference, for an owner that holds
 * one of its own for longer than the charge (a server session's table
 * entries): undone with dsp_budget_uncharge_part. Saves two atomic
 * operations a charge on the path of every small op. */
int dsp_budget_charge_held(dsp_budget *b, uint64_t n, const char *what,
                           char *why, size_t why_len);
void dsp_budget_uncharge(dsp_budget *b, uint64_t n);
/* Gives back n bytes of a larger charge of b, whose rest (and reference)
 * stays until its own dsp_budget_uncharge; or the whole of a
 * dsp_budget_charge_held. */
void dsp_budget_uncharge_part(dsp_budget *b, uint64_t n);
/* 1 when n more bytes would fit b and every parent now (a hint only: other
 * threads may charge in between). */
int dsp_budget_fits(const dsp_budget *b, uint64_t n);
uint64_t dsp_budget_used(const dsp_budget *b);  /* 0 for NULL */
uint64_t dsp_budget_limit(const dsp_budget *b); /* UINT64_MAX for NULL */
/* The budget ctx charges (the ctx keeps a reference); NULL: unlimited. */
void dsp_ctx_set_budget(dsp_ctx *ctx, dsp_budget *b);
dsp_budget *dsp_ctx_budget(const dsp_ctx *ctx);
/* Free lists of a budget: freed tensor storage (host memory only) and
 * tensor headers are kept in lists by size class for the next allocation
 * charged to b, up to max_bytes of their charge in all; the oldest go
 * first when a new one does not fit. What sits there stays charged to b
 * and its parents (not to a device budget, which counts live tensors
 * only), so it counts toward b's quota, but a charge that b or a parent
 * would refuse first gets cached bytes back: b's own, then, when a parent
 * is the one that would refuse, those of every budget under that parent
 * (a server's other sessions). 0 turns the
 * lists off and frees what they hold (the owner calls that before its
 * last unref: a cached object holds a reference on b). 0, or
 * DISPATCH_ENOMEM when the lists cannot be made (b has none then).
 * Thread-safe. */
int dsp_budget_set_cache(dsp_budget *b, uint64_t max_bytes);
typedef struct dsp_cache_stats {
  uint64_t hits;      /* allocations served from the lists */
  uint64_t misses;    /* allocations the lists could not serve */
  uint64_t bytes;     /* charge of what the lists hold now */
  uint64_t max_bytes; /* their bound */
  uint64_t evicted;   /* bytes freed to make room for newer blocks */
  uint64_t released;  /* bytes given back to a charge that needed them */
} dsp_cache_stats;
/* b's counters (all zero without lists). */
void dsp_budget_cache_stats(const dsp_budget *b, dsp_cache_stats *out);
/* Frees up to want bytes (charge) of b's lists, oldest first; returns
 * what it freed. */
uint64_t dsp_budget_release_cached(dsp_budget *b, uint64_t want);
/* What one heap object of n bytes is charged: n plus the allocator's own
 * bookkeeping, so many small objects cannot hide under the limit. */
#define DSP_BUDGET_COST(n) ((uint64_t)(n) + 32u)
/* Cancellation: dsp_ctx_cancel may be called from any thread while another
 * thread runs ops on ctx. The running op stops at its next block boundary
 * and every later dsp_op on ctx fails at once, with DISPATCH_ECANCELED and
 * nothing leaked. The flag is never cleared (a cancelled ctx is on its way
 * out: dispatch-server cancels a session's ctx when its client goes away or
 * the server stops). */
void dsp_ctx_cancel(dsp_ctx *ctx);
int dsp_ctx_cancelled(const dsp_ctx *ctx);
/* Every dsp_op on ctx whose dsp_op_cost is over max_cost fails with
 * DISPATCH_ELIMIT before anything is allocated, the backward helper ops
 * of dsp_backward included; 0 (the default) admits any cost. */
void dsp_ctx_set_max_op_cost(dsp_ctx *ctx, uint64_t max_cost);
/* The dsp_op_cost of every op ctx has run (or begun: a refused or failed
 * op counts too), plus DSP_WORK_PER_OP for each, summed and saturating;
 * differences measure a stretch of work, such as one graph replay with its
 * backward and optimizer ops. */
uint64_t dsp_ctx_work(const dsp_ctx *ctx);
/* What every op costs whatever its size, in dsp_op_cost units: inference,
 * the admission checks, the result's header and storage, its tape node,
 * its release (0.12 us alone, about 0.5 us inside a graph replay here;
 * the server's loop allowance, 2^20 units, is about a millisecond, so
 * 512 units is that half microsecond). dsp_op_cost leaves it out (an
 * empty result costs 0 there), dsp_ctx_work counts it, so a stretch of
 * ops on empty tensors is not measured as no work. 1024 sent the replay
 * of a chain of 1000 adds of 16 floats (0.5 ms) to a worker, and the
 * graph bench's chain row from 0.74-0.96 of LOCAL to 0.72-0.75. */
#define DSP_WORK_PER_OP 512u

/* ------------------------------------------------------------------ */
/* shapes                                                              */

typedef struct dsp_meta {
  dsp_dtype dtype;
  int ndim;
  int64_t shape[DSP_MAX_DIMS];
} dsp_meta;

/* a*b into *out; returns DISPATCH_EOVERFLOW instead of wrapping. */
int dsp_mul_overflow(int64_t a, int64_t b, int64_t *out);
/* Number of elements of a shape; checks 0 <= ndim <= 8, every size >= 0,
 * and that the span (below) times the dtype size fits in int64 and size_t
 * (DISPATCH_EOVERFLOW), so no stride or loop bound of the shape overflows
 * even when numel is 0. */
int dsp_meta_numel(dsp_ctx *ctx, const dsp_meta *m, int64_t *numel);
/* The same checks; also gives the span, the product of every size with
 * zero sizes counted as 1 (equal to numel for a non-empty shape). A limit
 * on tensor size should bound the span: [2^40, 0] has no elements but
 * 2^40 rows. numel and span may be NULL. */
int dsp_meta_span(dsp_ctx *ctx, const dsp_meta *m, int64_t *numel,
                  int64_t *span);
/* Validates a meta (dtype, rank, sizes, span and byte size overflow). */
int dsp_meta_check(dsp_ctx *ctx, const dsp_meta *m);
/* Numpy broadcast of two shapes; DISPATCH_ESHAPE names both shapes. */
int dsp_broadcast_shapes(dsp_ctx *ctx, const char *opname, const dsp_meta *a,
                         const dsp_meta *b, dsp_meta *out);
/* Maps a possibly negative dim into [0, ndim); DISPATCH_EDIM otherwise. */
int dsp_norm_dim(dsp_ctx *ctx, const char *opname, int64_t dim, int ndim,
                 int *out);
/* Writes "[2, 3, 4]" into buf; returns buf. */
char *dsp_shape_str(const dsp_meta *m, char *buf, size_t len);
int dsp_meta_equal(const dsp_meta *a, const dsp_meta *b);
/* Checks that every one of n bool bytes is 0 or 1; DISPATCH_EINVAL names
 * the first other byte's offset and value. Every path that takes bool
 * bytes from a caller or a client runs it. */
int dsp_check_bool_bytes(dsp_ctx *ctx, const void *data, size_t n);

/* ------------------------------------------------------------------ */
/* tensors                                                             */

typedef struct dsp_storage {
  long refcount;
  void *data;
  size_t nbytes;
  const struct dsp_backend *backend; /* frees data */
  dsp_budget *budget; /* charged `charged` bytes until freed; may be NULL */
  uint64_t charged;
  dsp_budget *dev_budget; /* the backend's device budget (its
                             dsp_backend_device_budget), charged `charged`
                             bytes too; NULL: none */
  size_t cap; /* bytes data can hold (>= nbytes: a reused block) */
  /* while in its budget's free lists (common/cache.c): its size class's
   * list and the lists' age order */
  struct dsp_storage *cprev, *cnext, *lprev, *lnext;
} dsp_storage;

struct dsp_node;

typedef struct dsp_tensor {
  long refcount;
  dsp_meta meta;
  int64_t numel;
  dsp_storage *storage; /* data = storage->data, contiguous row-major */
  struct dsp_node *node; /* autodiff: non-NULL when the tensor is tracked */
  dsp_budget *budget;    /* charged for this header until freed, or NULL */
} dsp_tensor;

/* New tensor with zeroed storage. Caller owns the returned reference. */
int dsp_tensor_new(dsp_ctx *ctx, const dsp_meta *m, dsp_tensor **out);
/* New tensor whose storage is NOT zeroed: for a caller that writes every
 * byte itself (an upload landing straight in storage), so the bytes are not
 * touched twice. */
int dsp_tensor_new_uninit(dsp_ctx *ctx, const dsp_meta *m, dsp_tensor **out);
/* New tensor with a copy of `nbytes` bytes of data; nbytes must equal the
 * tensor's byte size. */
int dsp_tensor_from_data(dsp_ctx *ctx, const dsp_meta *m, const void *data,
                         size_t nbytes, dsp_tensor **out);
/* New untracked tensor sharing t's storage, with another shape of the same
 * numel (used by reshape and to save outputs without a cycle). */
int dsp_tensor_alias(dsp_ctx *ctx, const dsp_tensor *t, const dsp_meta *m,
                     dsp_tensor **out);
dsp_tensor *dsp_tensor_ref(dsp_tensor *t); /* +1, returns t */
void dsp_tensor_unref(dsp_tensor *t);      /* -1, frees at 0; NULL ok */
static inline void *dsp_tensor_data(const dsp_tensor *t) {
  return t->storage->data;
}
size_t dsp_tensor_nbytes(const dsp_tensor *t);

/* Staging, the one way the network layer moves tensor bytes (the backend
 * table's stage_in/commit_in; reads use dsp_tensor_pin below). */
typedef struct dsp_stage {
  void *host;    /* nbytes of host memory to fill with every byte of t */
  size_t nbytes; /* dsp_tensor_nbytes(t) */
  dsp_tensor *t; /* a reference, dropped by dsp_stage_release */
  void *token;   /* the backend's */
  size_t chunk;  /* dsp_stage_progress hands bytes over in parts of this
                    size (DSP_STAGE_CHUNK unless a caller sets another) */
  size_t committed; /* bytes handed to the backend's commit_part so far */
  int err;          /* the first commit_part failure, reported by commit */
} dsp_stage;
/* Parts of an upload a backend with commit_part copies while the next
 * part is still being read from the socket. */
#define DSP_STAGE_CHUNK ((size_t)4 << 20)
/* Stages t (as a whole) for writing: 0 with st filled, or a DISPATCH_E*
 * code with st zeroed. On the CPU st->host is t's storage (no copy). */
int dsp_tensor_stage_in(dsp_ctx *ctx, dsp_tensor *t, dsp_stage *st);
/* The first `filled` bytes of st->host now hold their final values (the
 * socket has delivered them): every whole part of st->chunk bytes among
 * them, and at filled == nbytes the last short one, that the backend has
 * not been given yet goes to its commit_part now, in order, so its copy
 * into t runs while the caller reads the next part. Does nothing on a
 * backend without commit_part (the CPU: the staging is the storage). Never
 * waits; a failure is kept in st->err for dsp_stage_commit. */
void dsp_stage_progress(dsp_stage *st, size_t filled);
/* Moves the staged bytes into t (what dsp_stage_progress has not handed
 * over yet) and waits until all of them are there; the staging stays
 * until released. */
int dsp_stage_commit(dsp_ctx *ctx, dsp_stage *st);
/* Ends a staging, committed or not; a zeroed or released st is fine. */
void dsp_stage_release(dsp_stage *st);
/* Copies all of t's bytes to host memory dst (nbytes must be its byte
 * size) through its backend's copy_out. */
int dsp_tensor_read(dsp_ctx *ctx, const dsp_tensor *t, void *dst,
                    size_t nbytes);
/* The other way: overwrites all of t's bytes with host memory src (nbytes
 * must be its byte size), in place on its backend, after
 * dsp__storage_prepare_write (a reader still sending the old value, or an
 * alias, keeps its own copy). */
int dsp_tensor_write(dsp_ctx *ctx, dsp_tensor *t, const void *src,
                     size_t nbytes);

/* Read snapshots (pin.c). A pin holds t's bytes as they are when it is
 * taken, for a reader on another thread (a server's Read reply leaving
 * the socket): an in-place writer that finds the storage pinned moves the
 * storage to a fresh copy first (dsp__storage_prepare_write), so aliases
 * of the tensor see the update and the pin keeps the old bytes, freed
 * when its last pin is released. Pin and release from any thread. */
typedef struct dsp_pin dsp_pin;
/* 0 with *out owned by the caller (dsp_pin_release), or DISPATCH_ENOMEM. */
int dsp_tensor_pin(dsp_ctx *ctx, dsp_tensor *t, dsp_pin **out);
const void *dsp_pin_data(const dsp_pin *p);
/* How many of the `want` bytes of the pin's data from byte `off` on may be
 * sent now (at least 1 when want > 0): a backend that copies a read out
 * in parts (stage_out_wait) is waited for up to the part holding byte
 * off only, so the first parts leave while the later ones still cross
 * the bus. `want` itself everywhere else. */
size_t dsp_pin_avail(const dsp_pin *p, size_t off, size_t want);
size_t dsp_pin_nbytes(const dsp_pin *p);
/* One more holder of p (the same snapshot, no copy): p itself, which
 * each holder gives back with dsp_pin_release. NULL ok. */
dsp_pin *dsp_pin_retain(dsp_pin *p);
void dsp_pin_release(dsp_pin *p); /* NULL ok; the last release frees */
/* Called before a kernel writes t's storage in place; 0 or
 * DISPATCH_ENOMEM (t unchanged). */
int dsp__storage_prepare_write(dsp_ctx *ctx, dsp_tensor *t);

/* ------------------------------------------------------------------ */
/* ops                                                                 */

/* The op table. Codes travel on the wire: never renumber, only append.
 * Columns: NAME, code, name, number of inputs (-1: 1..DSP_MAX_INPUTS),
 * family, signature, surface. Attribute conventions (a.ints / a.floats)
 * are given per op; every dim attribute may be negative (counted from the
 * end).
 *
 * name is the op's lower-case identifier: #name is its string (in error
 * messages and the server's logs), dispatch_##name its client function. The last two
 * columns are the op's client surface, and this row is the only place it
 * is written: client/run.c expands the table into the function of every
 * row whose signature is not HAND, the build lists every API row in the
 * version script and the exported-symbol list, and the Python package
 * makes its functions and Tensor methods from the same rows
 * (docs/architecture.md, "One op, one row"). Only the declaration with its
 * doc comment in client/include/dispatch_client.h is written by hand, and
 * the ABI check fails until it is there.
 *
 * Surface: API    exported (declared DISPATCH_API in dispatch_client.h)
 *          BWD    internal backward helper (client/dispatch_backward.h,
 *                 not exported; in the static archive for the tests)
 *          NONE   no client function (the optimizer steps: client/optim.c
 *                 runs them through dispatch__run)
 * Signatures (C parameters before the trailing dispatch_tensor **out):
 *   UNARY    (x)                  BINARY  (a, b)     TERNARY (a, b, c)
 *   SCALAR   (x, double s): floats = {s}
 *   RED      (x, int ndims, const int64_t *dims, int keepdim)
 *   SHAPEV   (x, int ndim, const int64_t *v): ints = v
 *   DIM      (x, int64_t dim)     BINARY_DIM (a, b, int64_t dim)
 *   MANY     (dispatch_tensor *const *xs, int n, int64_t dim)
 *   POOL     (x, kh, kw, stride_h, stride_w, pad_h, pad_w)   (int64_t each)
 *   POOL_BWD (grad, x, then POOL's six)
 *   CONV_BWD (grad, t, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
 *            const int64_t shape[4])
 *   CREATE   (dispatch_device *dev, dispatch_dtype dtype, int ndim,
 *            const int64_t *shape)
 *   RANDOM   (dev, dtype, ndim, shape, double f0, double f1, uint64_t seed)
 *   HAND     irregular: written out in client/run.c (transpose, slice,
 *            index_select, cast, conv2d, dropout, full, arange and the
 *            backward helpers slice_backward, index_select_backward)
 *   NONE     no function
 * Consumers that need fewer columns name those and take the rest as `...`.
 *
 * Families group ops whose infer/kernel/backward live together:
 *   EW     elementwise, activations, comparisons, where
 *   RED    reductions
 *   SHAPE  reshape, permute, slice, cat, stack, broadcast, index, cast
 *   LINALG matmul
 *   NN     softmax, losses, conv, pooling, dropout (+ their backward ops)
 *   CREATE zeros, ones, full, arange, random
 *   OPTIM  in-place optimizer updates
 */
#define DSP_OP_MAP(X)                                                        \
  /* elementwise binary with broadcasting; same dtype on both sides */       \
  X(ADD, 1, add, 2, EW, BINARY, API)                                         \
  X(SUB, 2, sub, 2, EW, BINARY, API)                                         \
  X(MUL, 3, mul, 2, EW, BINARY, API)                                         \
  X(DIV, 4, div, 2, EW, BINARY, API)                                         \
  X(MAXIMUM, 5, maximum, 2, EW, BINARY, API)                                 \
  X(MINIMUM, 6, minimum, 2, EW, BINARY, API)                                 \
  /* comparisons: same dtype on both sides, result bool, broadcasting */     \
  X(EQ, 7, eq, 2, EW, BINARY, API)                                           \
  X(NE, 8, ne, 2, EW, BINARY, API)                                           \
  X(LT, 9, lt, 2, EW, BINARY, API)                                           \
  X(LE, 10, le, 2, EW, BINARY, API)                                          \
  X(GT, 11, gt, 2, EW, BINARY, API)                                          \
  X(GE, 12, ge, 2, EW, BINARY, API)                                          \
  /* where(mask bool, a, b): three-way broadcast, a and b same dtype */      \
  X(WHERE, 13, where, 3, EW, TERNARY, API)                                   \
  /* scalar forms: floats[0] is the scalar s. x+s, x-s, x*s, x/s, x^s,       \
   * s-x (rsub), s/x (rdiv) */                                               \
  X(ADD_SCALAR, 14, add_scalar, 1, EW, SCALAR, API)                          \
  X(SUB_SCALAR, 15, sub_scalar, 1, EW, SCALAR, API)                          \
  X(MUL_SCALAR, 16, mul_scalar, 1, EW, SCALAR, API)                          \
  X(DIV_SCALAR, 17, div_scalar, 1, EW, SCALAR, API)                          \
  X(POW_SCALAR, 18, pow_scalar, 1, EW, SCALAR, API)                          \
  X(RSUB_SCALAR, 19, rsub_scalar, 1, EW, SCALAR, API)                        \
  X(RDIV_SCALAR, 20, rdiv_scalar, 1, EW, SCALAR, API)                        \
  /* unary */                                                                \
  X(NEG, 21, neg, 1, EW, UNARY, API)                                         \
  X(EXP, 22, exp, 1, EW, UNARY, API)                                         \
  X(LOG, 23, log, 1, EW, UNARY, API)                                         \
  X(SQRT, 24, sqrt, 1, EW, UNARY, API)                                       \
  X(ABS, 25, abs, 1, EW, UNARY, API)                                         \
  X(SIGN, 26, sign, 1, EW, UNARY, API)                                       \
  X(RELU, 27, relu, 1, EW, UNARY, API)                                       \
  X(SIGMOID, 28, sigmoid, 1, EW, UNARY, API)                                 \
  X(TANH, 29, tanh, 1, EW, UNARY, API)                                       \
  X(GELU, 30, gelu, 1, EW, UNARY, API) /* exact erf form */                  \
  X(SILU, 33, silu, 1, EW, UNARY, API) /* x sigmoid(x) */                    \
  /* issue 23 elementwise rows (codes 34-39) go here */                      \
  /* softplus: log(1 + e^x), x itself where x > 20 (PyTorch's beta 1,      \
   * threshold 20); gelu_tanh: gelu's tanh approximation */                \
  X(SOFTPLUS, 34, softplus, 1, EW, UNARY, API)                               \
  X(GELU_TANH, 35, gelu_tanh, 1, EW, UNARY, API)                             \
  /* clamp(x): floats = {lo, hi}: min(max(x, lo), hi) */                    \
  X(CLAMP, 36, clamp, 1, EW, HAND, API)                                      \
  /* masked_fill(x, mask bool broadcastable to x): floats = {value};        \
   * x's shape */                                                           \
  X(MASKED_FILL, 37, masked_fill, 2, EW, HAND, API)                          \
  /* (grad, x) -> grad * f'(x), same shape */                               \
  X(SOFTPLUS_BACKWARD, 38, softplus_backward, 2, EW, BINARY, BWD)            \
  X(GELU_TANH_BACKWARD, 39, gelu_tanh_backward, 2, EW, BINARY, BWD)          \
  /* backward helpers: (grad, x) -> grad * f'(x), same shape */              \
  X(RELU_BACKWARD, 31, relu_backward, 2, EW, BINARY, BWD)                    \
  X(GELU_BACKWARD, 32, gelu_backward, 2, EW, BINARY, BWD)                    \
  /* reductions: ints = dims to reduce (none: all dims); floats[0] != 0      \
   * means keepdim. argmax takes exactly one dim or none (flattened) and     \
   * gives i64; ties pick the first index. */                                \
  X(SUM, 40, sum, 1, RED, RED, API)                                          \
  X(MEAN, 41, mean, 1, RED, RED, API)                                        \
  X(MAX, 42, max, 1, RED, RED, API)                                          \
  X(ARGMAX, 43, argmax, 1, RED, RED, API)                                    \
  /* issue 23 reduction rows (codes 44-49) go here */                        \
  /* min/argmin as max/argmax (ties: the first index) */                    \
  X(MIN, 44, min, 1, RED, RED, API)                                          \
  X(ARGMIN, 45, argmin, 1, RED, RED, API)                                    \
  /* var/std: ints = dims (none: all); floats = {keepdim, correction}:       \
   * sum (x - mean)^2 / max(0, N - correction); f32/f64 */                  \
  X(VAR, 46, var, 1, RED, HAND, API)                                         \
  X(STD, 47, std, 1, RED, HAND, API)                                         \
  /* shape ops */                                                            \
  /* ints = new shape, one -1 ok */                                          \
  X(RESHAPE, 50, reshape, 1, SHAPE, SHAPEV, API)                             \
  /* ints = permutation */                                                   \
  X(PERMUTE, 51, permute, 1, SHAPE, SHAPEV, API)                             \
  X(TRANSPOSE, 52, transpose, 1, SHAPE, HAND, API) /* ints = {dim0, dim1} */ \
  /* ints = {dim, start, end, step>0}, python-style clamping of              \
   * start/end */                                                            \
  X(SLICE, 53, slice, 1, SHAPE, HAND, API)                                   \
  X(CAT, 54, cat, -1, SHAPE, MANY, API) /* ints = {dim} */                   \
  /* ints = {dim} (new dim) */                                               \
  X(STACK, 55, stack, -1, SHAPE, MANY, API)                                  \
  /* ints = target shape */                                                  \
  X(BROADCAST_TO, 56, broadcast_to, 1, SHAPE, SHAPEV, API)                   \
  /* index_select(x, index i64 1-D): ints = {dim} */                         \
  X(INDEX_SELECT, 57, index_select, 2, SHAPE, HAND, API)                     \
  X(CAST, 58, cast, 1, SHAPE, HAND, API) /* ints = {dtype} */                \
  /* slice_backward(grad): ints = {dim, start, end, step, then the input     \
   * shape}; zeros of the input shape with grad placed at the slice */       \
  X(SLICE_BACKWARD, 59, slice_backward, 1, SHAPE, HAND, BWD)                 \
  /* index_select_backward(grad, index): ints = {dim, size of that dim in    \
   * the input}; scatter-adds grad rows into zeros */                        \
  X(INDEX_SELECT_BACKWARD, 60, index_select_backward, 2, SHAPE, HAND, BWD)   \
  /* matmul(a, b): 1-D..N-D like numpy.matmul, batch dims broadcast;       \
   * ints = {ta, tb} (none: 0, 0): 1 uses that operand's last two dims     \
   * swapped (rank >= 2), as the gradient rule asks */                      \
  X(MATMUL, 70, matmul, 2, LINALG, BINARY, API)                              \
  /* nn; ints[0] = dim for softmax/log_softmax */                            \
  X(SOFTMAX, 80, softmax, 1, NN, DIM, API)                                   \
  X(LOG_SOFTMAX, 81, log_softmax, 1, NN, DIM, API)                           \
  /* (grad, y) */                                                            \
  X(SOFTMAX_BACKWARD, 82, softmax_backward, 2, NN, BINARY_DIM, BWD)          \
  /* (grad, y) */                                                            \
  X(LOG_SOFTMAX_BACKWARD, 83, log_softmax_backward, 2, NN, BINARY_DIM, BWD)  \
  /* cross_entropy(logits [N,C] float, labels [N] i64): mean over N */       \
  X(CROSS_ENTROPY, 84, cross_entropy, 2, NN, BINARY, API)                    \
  /* (grad scalar, logits, labels) -> d loss / d logits */                   \
  X(CROSS_ENTROPY_BACKWARD, 85, cross_entropy_backward, 3, NN, TERNARY, BWD) \
  /* mean((a-b)^2), same shape, scalar result */                             \
  X(MSE, 86, mse, 2, NN, BINARY, API)                                        \
  /* issue 23 attention rows (codes 130-139) go here */                      \
  /* attention(q [B,H,Tq,d], k [B,H,Tk,d], v [B,H,Tk,dv], then key_mask    \
   * bool [B,Tk] (true = attend) when ints[1] = 1): softmax(scale q k^T +   \
   * mask) v -> [B,H,Tq,dv]; ints = {causal, has_mask}, floats = {scale}    \
   * (0: 1/sqrt(d)). causal: query i sees keys j <= i (top-left). A query   \
   * that sees no key gives 0 (common/cpu/attn.c) */                        \
  X(ATTENTION, 130, attention, -1, NN, HAND, API)                            \
  /* (grad [B,H,Tq,dv], q, k, v, [key_mask]), attention's attributes ->     \
   * 1-D [dq | dk | dv], each flattened */                                  \
  X(ATTENTION_BACKWARD, 131, attention_backward, -1, NN, NONE, NONE)         \
  /* conv2d(x [N,C,H,W], w [O,C,kh,kw]): ints = {stride_h, stride_w,         \
   * pad_h, pad_w, dil_h, dil_w} (missing: 1,1,0,0,1,1); no bias */          \
  X(CONV2D, 87, conv2d, 2, NN, HAND, API)                                    \
  /* (grad_out, w): ints = conv ints then the 4 dims of x */                 \
  X(CONV2D_BACKWARD_INPUT, 88, conv2d_backward_input, 2, NN, CONV_BWD, BWD)  \
  /* (grad_out, x): ints = conv ints then the 4 dims of w */                 \
  X(CONV2D_BACKWARD_WEIGHT, 89, conv2d_backward_weight, 2, NN, CONV_BWD,     \
    BWD)                                                                     \
  /* pools on [N,C,H,W]: ints = {kh, kw, stride_h, stride_w, pad_h, pad_w}   \
   * (stride missing or 0: = kernel; pad missing: 0). avg counts padding. */ \
  X(MAX_POOL2D, 90, max_pool2d, 1, NN, POOL, API)                            \
  X(AVG_POOL2D, 91, avg_pool2d, 1, NN, POOL, API)                            \
  /* (grad, x) */                                                            \
  X(MAX_POOL2D_BACKWARD, 92, max_pool2d_backward, 2, NN, POOL_BWD, BWD)      \
  /* (grad, x); a 7th int as avg_pool2d_ex's */                              \
  X(AVG_POOL2D_BACKWARD, 93, avg_pool2d_backward, 2, NN, POOL_BWD, BWD)      \
  /* dropout(x): floats[0] = p in [0,1), ints[0] = seed (as uint64); keeps   \
   * element i iff uniform(seed)[i] >= p and scales kept ones by 1/(1-p) */  \
  X(DROPOUT, 94, dropout, 1, NN, HAND, API)                                  \
  /* issue 23 conv/pool/loss rows (95-99, 140-149) */                        \
  /* cross_entropy_ex(logits [N,C,d1..] (or [C]) float, labels [N,d1..]      \
   * (or []) i64) as torch's cross_entropy: ints = {ignore_index,            \
   * reduction 0 none / 1 sum / 2 mean}, floats = {label_smoothing in        \
   * [0,1]}; none gives the labels' shape (0 where ignored), mean divides    \
   * by the non-ignored count (all ignored: NaN) */                          \
  X(CROSS_ENTROPY_EX, 95, cross_entropy_ex, 2, NN, HAND, API)                \
  /* (grad: the forward output's shape, logits, labels), same attrs */       \
  X(CROSS_ENTROPY_EX_BACKWARD, 96, cross_entropy_ex_backward, 3, NN, HAND,   \
    BWD)                                                                     \
  /* avg_pool2d_ex(x): ints = the 6 pool ints then count_include_pad (0 or   \
   * 1, all 7 given); 0 divides by the window's non-padding elements */      \
  X(AVG_POOL2D_EX, 97, avg_pool2d_ex, 1, NN, HAND, API)                      \
  /* conv2d_bias(x [N,C,H,W], w [O,C,kh,kw], bias [O]): conv2d plus bias[o]  \
   * on output channel o; ints as conv2d's. Gradients: conv2d's backward     \
   * ops and the sum of grad over N, H, W */                                 \
  X(CONV2D_BIAS, 98, conv2d_bias, 3, NN, HAND, API)                          \
  /* creation: ints[0] = dtype, ints[1..] = shape */                         \
  X(ZEROS, 100, zeros, 0, CREATE, CREATE, API)                               \
  X(ONES, 101, ones, 0, CREATE, CREATE, API)                                 \
  X(FULL, 102, full, 0, CREATE, HAND, API) /* floats[0] = value */           \
  /* arange: ints[0] = dtype; floats = {start, end, step}: 1-D */            \
  X(ARANGE, 103, arange, 0, CREATE, HAND, API)                               \
  /* uniform in [floats[0], floats[1]); normal with mean floats[0], std      \
   * floats[1]; ints = {dtype, seed, shape...}; float dtypes only */         \
  X(UNIFORM, 104, uniform, 0, CREATE, RANDOM, API)                           \
  X(NORMAL, 105, normal, 0, CREATE, RANDOM, API)                             \
  /* issue 23 embedding/norm rows (codes 120-129) */                         \
  /* embedding(weight [V,D] float, idx i64 any shape) -> idx.shape + [D]:    \
   * ints = {padding_idx} (INT64_MIN: none; negative counts from V). The     \
   * padding row is looked up as any other; it only gets no gradient */     \
  X(EMBEDDING, 120, embedding, 2, NN, HAND, API)                             \
  /* (grad idx.shape+[D], idx): ints = {V, padding_idx}; zeros [V,D] with    \
   * grad rows added at their indices in index order, padding row 0 */       \
  X(EMBEDDING_BACKWARD, 121, embedding_backward, 2, NN, NONE, NONE)          \
  /* layer_norm(x[, weight][, bias]) over the last nlast dims: ints =        \
   * {nlast, has_weight, has_bias}, floats = {eps}; weight and bias have     \
   * shape x.shape[-nlast:]; biased variance, as PyTorch */                  \
  X(LAYER_NORM, 122, layer_norm, -1, NN, HAND, API)                          \
  /* (grad, x[, weight]), the forward's attrs: one flat tensor dx, then      \
   * dweight, then dbias (each present when the forward had it) */           \
  X(LAYER_NORM_BACKWARD, 123, layer_norm_backward, -1, NN, NONE, NONE)       \
  /* rms_norm(x[, weight]) = x / sqrt(mean(x^2) + eps) * weight over the     \
   * last nlast dims: ints = {nlast, has_weight}, floats = {eps} */          \
  X(RMS_NORM, 124, rms_norm, -1, NN, HAND, API)                              \
  /* (grad, x[, weight]), the forward's attrs: flat dx then dweight */       \
  X(RMS_NORM_BACKWARD, 125, rms_norm_backward, -1, NN, NONE, NONE)           \
  /* batch_norm(x [N,C,...][, running_mean, running_var][, weight][, bias])  \
   * per channel over N and the trailing dims: ints = {training,             \
   * has_running, has_weight, has_bias}, floats = {momentum, eps}; all [C].  \
   * training: batch statistics (biased variance) normalise, and the        \
   * running ones, when given, are updated IN PLACE (r = (1 - momentum) r   \
   * + momentum * batch stat, unbiased variance); else the running ones     \
   * normalise */                                                            \
  X(BATCH_NORM, 126, batch_norm, -1, NN, HAND, API)                          \
  /* (grad, x[, running_mean, running_var: evaluation only][, weight]),     \
   * the forward's attrs: flat dx, then dweight, then dbias */               \
  X(BATCH_NORM_BACKWARD, 127, batch_norm_backward, -1, NN, NONE, NONE)       \
  /* in-place optimizer updates: inputs[0] is the parameter, updated in      \
   * place and also returned as the output (a new reference to it) */        \
  /* sgd(param, grad, velocity): floats = {lr, momentum, weight_decay} */    \
  X(SGD_STEP, 110, sgd_step, 3, OPTIM, NONE, NONE)                           \
  /* adam(param, grad, m, v): floats = {lr, beta1, beta2, eps},              \
   * ints[0] = step t (>= 1) */                                              \
  X(ADAM_STEP, 111, adam_step, 4, OPTIM, NONE, NONE)                         \
  /* adamw(param, grad, m, v): floats = {lr, beta1, beta2, eps,              \
   * weight_decay}, ints[0] = step t (>= 1); p *= 1 - lr*wd, then adam's     \
   * update (torch.optim.AdamW). Every step op takes one more optional       \
   * float, the gradient scale in [0, 1] a global-norm clip computed (g is   \
   * read as g*scale; absent: 1) */                                          \
  X(ADAMW_STEP, 112, adamw_step, 4, OPTIM, NONE, NONE)

typedef enum dsp_opcode {
#define DSP_OP_ENUM_(NAME, code, ...) DSP_OP_##NAME = (code),
  DSP_OP_MAP(DSP_OP_ENUM_)
#undef DSP_OP_ENUM_
} dsp_opcode;

typedef enum dsp_op_family {
  DSP_FAM_EW,
  DSP_FAM_RED,
  DSP_FAM_SHAPE,
  DSP_FAM_LINALG,
  DSP_FAM_NN,
  DSP_FAM_CREATE,
  DSP_FAM_OPTIM
} dsp_op_family;

typedef struct dsp_attrs {
  int n_ints;
  int64_t ints[DSP_MAX_ATTR_INTS];
  int n_floats;
  double floats[DSP_MAX_ATTR_FLOATS];
} dsp_attrs;

typedef struct dsp_op_info {
  dsp_opcode code;
  const char *name;
  int n_inputs; /* -1: variadic */
  dsp_op_family family;
} dsp_op_info;

/* Table row of an op code, or NULL for a code that is not an op (any int
 * is safe to pass, including one read from the network). */
const dsp_op_info *dsp_op_lookup(int code);

/* Validates inputs and attributes of an op given only the inputs' metas
 * and computes the output's meta. Used by the client (remote tensors know
 * their shapes without a round trip), by the server before anything runs,
 * and by dsp_op. Errors name the op and the offending values. */
int dsp_op_infer(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                 const dsp_attrs *a, dsp_meta *out);

/* Estimated work of an op whose inputs and output meta dsp_op_infer has
 * just accepted, in elementary operations (one load-combine-store of an
 * element, one multiply-add of a product): elementwise and shape ops count
 * their output elements, reductions and softmax their input elements,
 * matmul batch*m*n*k, conv2d (and both backward ops) output elements *
 * C*kh*kw, pooling output elements * kh*kw; every op also counts the
 * output it writes. Saturates at UINT64_MAX instead of wrapping. Cheap: no
 * allocation, no ctx. */
uint64_t dsp_op_cost(dsp_opcode op, const dsp_meta *in, int n_in,
                     const dsp_attrs *a, const dsp_meta *out);

/* Runs an op: infer, allocate the output, run the backend kernel (not for
 * an empty output, which stays as allocated; index ops still check their
 * index values), and, if grad mode is on and any input is tracked, record
 * the op on the tape so the output is tracked. The caller owns *out. On
 * failure *out is NULL and nothing leaks.
 *
 * Half dtypes (f16, bf16): an op the backend does not run natively on
 * them (supports_op says) but runs on f32 is widened: its half inputs are
 * cast to f32 temporaries, the f32 kernel runs, and a half result is
 * rounded once into the output; the tape records the op on the half
 * tensors, so their gradients are half too. The temporaries cost, while
 * the op runs, twice the bytes of each half input and of a half result,
 * charged to ctx's budget like any tensor (an op that would not fit fails
 * with DISPATCH_ENOMEM as any other). */
int dsp_op(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
           const dsp_attrs *a, dsp_tensor **out);
/* dsp_op after its caller's own dsp_op_infer: *om is what that inference
 * gave for these inputs and attributes (a not NULL, in[0..n_in-1] not
 * NULL), cost its dsp_op_cost or UINT64_MAX to have it computed when a
 * limit needs it. Same checks after inference, same result. */
int dsp_op_inferred(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, const dsp_meta *om,
                    uint64_t cost, dsp_tensor **out);

/* Attribute builders (no allocation). dsp_attrs_ints keeps a count n
 * outside 0..DSP_MAX_ATTR_INTS as it is, so the op refuses it. */
dsp_attrs dsp_attrs_none(void);
dsp_attrs dsp_attrs_ints(int n, const int64_t *v);
dsp_attrs dsp_attrs_f1(double f0);

/* ------------------------------------------------------------------ */
/* backend interface                                                   */

/* A backend is a table of functions plus a context pointer (the CPU
 * backend, common/cpu/; a CUDA one, common/cuda/). The table itself is
 * private to the backends and the storage code (common/backend.h);
 * everything else holds an opaque pointer and asks through the functions
 * below. */
typedef struct dsp_backend dsp_backend;

/* What a backend's memory and kernels are like (dsp_backend_caps), so a
 * caller asks for the property it needs, never for a particular backend.
 * DSP_CAP_HOST_MEMORY: storage is host memory that staging hands out
 *   itself (stage_in and stage_out cost no copy; a reader keeps the bytes
 *   still with a pin, common/pin.c), so a storage may wait in a budget's
 *   free lists without holding device memory.
 * DSP_CAP_INLINE: kernels run to completion on the calling thread on host
 *   memory, so an op's work is what dsp_op_cost counts and a cheap one
 *   may run where it is asked for (a server's loop thread, server/inline.c)
 *   instead of being handed to a worker. */
#define DSP_CAP_HOST_MEMORY (1u << 0)
#define DSP_CAP_INLINE (1u << 1)
unsigned dsp_backend_caps(const dsp_backend *be);
/* The backend's name ("cpu", "cuda:0") and its human description ("host
 * CPU (OpenBLAS)"), both living as long as the backend. */
const char *dsp_backend_name(const dsp_backend *be);
const char *dsp_backend_description(const dsp_backend *be);
/* Makes be one device of a server: id names it in messages (NULL: its
 * name; not copied, it must live as long as be) and mem is its own memory
 * budget (NULL: none), charged for every storage made on it beside the
 * creating ctx's budget; storages charge it without a reference, so it
 * must live as long as be. */
void dsp_backend_set_device(dsp_backend *be, const char *id, dsp_budget *mem);
dsp_budget *dsp_backend_device_budget(const dsp_backend *be);

const dsp_backend *dsp_cpu_backend(void);
/* A CPU backend instance of its own, named id ("cpu:1": a server's second
 * CPU device), with no device budget (dsp_backend_set_device gives it
 * one, which must stay alive while the instance lives). Kernels, cache and memory
 * are the CPU's; only the identity differs, so tensors of two instances
 * are two devices' tensors. NULL when out of memory. Freed with
 * dsp_cpu_backend_free after every storage made on it is gone. */
dsp_backend *dsp_cpu_backend_new(const char *id);
void dsp_cpu_backend_free(dsp_backend *be); /* NULL ok */
/* The device name of a backend in messages: id, else name. */
const char *dsp_backend_id(const dsp_backend *be);
/* The CPU backend keeps freed storage blocks of 1 MiB and more for reuse,
 * in lists by size class, up to `bytes` in all, the oldest going first
 * when a new one does not fit (0, the default, keeps none and frees what
 * it kept); dsp_cpu_cache_bytes says how much it holds now. These blocks
 * are charged to no budget. Thread-safe. */
void dsp_cpu_cache_set_limit(size_t bytes);
size_t dsp_cpu_cache_bytes(void);
void dsp_cpu_cache_stats(dsp_cache_stats *out); /* hits, misses: >= 1 MiB */
const dsp_backend *dsp_ctx_backend(const dsp_ctx *ctx);
/* The backend creation ops and new tensors of ctx use (the ctx's device);
 * an op on inputs runs on their device, which must be the same for all of
 * them (dsp_op). be must outlive every tensor made on it; NULL returns to
 * the backend the ctx was made with (dsp_ctx_new). */
void dsp_ctx_set_backend(dsp_ctx *ctx, const dsp_backend *be);
/* A new untracked tensor on backend be with t's bytes (a move between two
 * devices: t's backend stages its bytes out, be stages them in, so no
 * third copy is made), charged to ctx's budget and be's device budget.
 * 0, or DISPATCH_EQUOTA / DISPATCH_ENOMEM / a backend's error with the
 * detail in ctx and *out NULL. */
int dsp_tensor_to_backend(dsp_ctx *ctx, const dsp_tensor *t,
                          const dsp_backend *be, dsp_tensor **out);

/* ------------------------------------------------------------------ */
/* autodiff                                                            */

/* Makes t a tracked leaf. A tensor already tracked (a leaf or an op's
 * output) gives DISPATCH_EDOUBLEWRAP: autodiff never wraps an autodiff
 * tensor. Only float tensors can be tracked (DISPATCH_EDTYPE). */
int dsp_track(dsp_ctx *ctx, dsp_tensor *t);
int dsp_is_tracked(const dsp_tensor *t);
/* An upper bound on the tape nodes that dropping the last reference of t
 * frees: t's node and every node it keeps alive, a node reached along two
 * paths counted twice (saturating); 0 for an untracked tensor. O(1): for a
 * caller that judges the cost of a free before it runs it. */
uint64_t dsp_tape_size(const dsp_tensor *t);

/* Gradients of one backward pass: a container the caller owns. */
typedef struct dsp_grads dsp_grads;

/* Computes d loss / d leaf for every tracked leaf reachable from loss.
 * loss must be tracked (DISPATCH_ENOTTRACKED) and have one element
 * (DISPATCH_ENOTSCALAR). Unless retain is set the graph's saved tensors are
 * released afterwards and a second backward through any of its nodes gives
 * DISPATCH_EGRAPHFREED. The caller owns *out (dsp_grads_free). */
int dsp_backward(dsp_ctx *ctx, dsp_tensor *loss, int retain,
                 dsp_grads **out);
/* New reference to the gradient of tracked leaf t; DISPATCH_ENOGRAD if
 * backward did not reach t, DISPATCH_ENOTTRACKED if t is not tracked. */
int dsp_grads_get(dsp_ctx *ctx, const dsp_grads *g, const dsp_tensor *t,
                  dsp_tensor **out);
int dsp_grads_count(const dsp_grads *g);
void dsp_grads_free(dsp_grads *g); /* NULL ok */

/* Returns a new untracked reference sharing t's storage (detach). */
int dsp_detach(dsp_ctx *ctx, dsp_tensor *t, dsp_tensor **out);

/* ------------------------------------------------------------------ */
/* family entry points (internal to common/)                           */

/* shape inference per family (common/ops_<family>.c); each backend's
 * kernels live in its own folder (CPU: common/cpu/) */
/* ------------------------------------------------------------------ */
/* optimizer steps (common/optim_step.c)                               */

/* What the three runners of a step share (the LOCAL device, the server's
 * Step, a replayed graph's STEP node), so that they agree bit for bit.
 * A step over n parameters: every gradient is fetched, then (max_norm > 0)
 * the global norm is taken over all of them, then each parameter runs its
 * op with its own attributes (dsp_step_param_attrs). */

/* State tensors per parameter of step op `op` (1 sgd, 2 adam and adamw),
 * 0 when op is not a step op (any int is safe). */
int dsp_step_states(int op);

/* *sq = sum over g[0..n-1] of the sum of their squared elements, in double
 * accumulation, tensor by tensor in order (f32 or f64; any backend: the
 * bytes are read through a pin, no copy on host memory). 0, or
 * DISPATCH_EDTYPE / ENOMEM. */
int dsp_grads_sqnorm(dsp_ctx *ctx, dsp_tensor *const *g, size_t n, double *sq);

/* torch.nn.utils.clip_grad_norm_'s scale: max_norm / (norm + 1e-6) when
 * that is below 1, else 1. A NaN norm gives NaN and an infinite one 0
 * (PyTorch without error_if_nonfinite: nothing is skipped, the non-finite
 * value propagates into the parameters). */
double dsp_clip_scale(double max_norm, double norm);

/* Writes norm into t, an f64 tensor of one element, in place on its
 * backend (the last step's global norm, for dispatch_optim_last_norm). 0,
 * or DISPATCH_EDTYPE / ESHAPE (t unchanged) / a backend's error. */
int dsp_step_store_norm(dsp_ctx *ctx, dsp_tensor *t, double norm);

/* The attributes parameter i's op runs with: the step's own `base` (lr,
 * betas, ..., the step count), then adamw's weight decay wd[i] (wd NULL:
 * 0), then, when clip is set, the gradient scale. */
void dsp_step_param_attrs(int op, const dsp_attrs *base, const double *wd,
                          size_t i, int clip, double scale, dsp_attrs *out);

/* Dynamic loss scaling inside a step (protocol 1.7), as
 * torch.cuda.amp.GradScaler's unscale_, step and update in one: the
 * gradients come from a loss multiplied by the scale. A gradient with an
 * inf or NaN skips every update (no parameter or state changes) and
 * multiplies the scale by backoff; otherwise each gradient is read as
 * g / scale (times the clip's factor, taken on the unscaled norm), the
 * updates run, and after `interval` such steps in a row the scale is
 * multiplied by growth (kept when that is not finite in f32). Adam's step
 * count skips the skipped steps (torch's optimizer never saw them). */
typedef struct dsp_step_scaler {
  dsp_tensor *scale;  /* f32, one element: the loss scale, > 0 */
  dsp_tensor *counts; /* i64, two elements: clean steps since the scale
                         last changed, steps skipped so far */
  double growth;      /* >= 1 */
  double backoff;     /* in (0, 1] */
  int64_t interval;   /* >= 1 */
} dsp_step_scaler;

/* What a step decided before its first update. */
typedef struct dsp_step_plan {
  int extra;      /* the ops take a gradient factor (a clip or a scaler) */
  double factor;  /* each gradient is read as g * factor (1: as is) */
  int skip;       /* a non-finite gradient under a scaler: no update */
  double scale;   /* the scaler's scale as read (1 without one) */
  int64_t counts[2]; /* the scaler's counts as read */
} dsp_step_plan;

/* Checks a scaler's tensors (dtype, element count) and hyperparameters
 * before anything changes. 0, or DISPATCH_EDTYPE / ESHAPE / EINVAL. */
int dsp_step_check_scaler(dsp_ctx *ctx, const dsp_step_scaler *sc);

/* The part of a step between fetching the gradients g[0..n-1] and the
 * first update, shared by its three runners: sets p->extra (clip or sc),
 * and, when there is a clip, a norm tensor or a scaler, takes the global
 * norm (dsp_grads_sqnorm; under a scaler, of the unscaled gradients),
 * stores it in norm_t (NULL: none), and decides p->factor and p->skip;
 * Adam's step count, base->ints[0] (base may be NULL for a check alone),
 * goes back by the steps the scaler has skipped. sc NULL: no scaler, and
 * the step is what it was before 1.7. 0, or a DISPATCH_E* code. */
int dsp_step_prepare(dsp_ctx *ctx, dsp_tensor *const *g, size_t n,
                     double max_norm, dsp_tensor *norm_t,
                     const dsp_step_scaler *sc, dsp_attrs *base,
                     dsp_step_plan *p);

/* After a step's updates ran (or were skipped: p->skip): the scaler's new
 * scale and counts, written in place. sc NULL: nothing. */
int dsp_step_finish(dsp_ctx *ctx, const dsp_step_scaler *sc,
                    const dsp_step_plan *p);

#define DSP_FAMILY_DECL_(fam)                                                \
  int dsp__infer_##fam(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,      \
                       int n_in, const dsp_attrs *a, dsp_meta *out);
DSP_FAMILY_DECL_(ew)
DSP_FAMILY_DECL_(red)
DSP_FAMILY_DECL_(shape)
DSP_FAMILY_DECL_(linalg)
DSP_FAMILY_DECL_(nn)
DSP_FAMILY_DECL_(create)
DSP_FAMILY_DECL_(optim)
#undef DSP_FAMILY_DECL_

#endif
