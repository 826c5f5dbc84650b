/* The CPU backend: host memory, the table of what its kernels implement,
 * and the dispatch to the family kernels of common/cpu/. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"
#include "scalar_math.h"

/* Storage cache: a server that frees a large tensor and soon allocates
 * one of about the same size (uploads, step-by-step training) would
 * otherwise get fresh pages from the kernel each time (glibc mmaps large
 * blocks and unmaps them on free), and the page faults cost more than the
 * copy itself. Freed blocks of at least CACHE_MIN bytes are kept in one
 * list per size class (dsp__size_class), up to g_cache_limit bytes in all
 * (0, the library default, keeps none: only dispatch-server turns it on);
 * a block that does not fit makes room by freeing the oldest kept ones,
 * whatever their class, so the bound is in bytes, not blocks. Each block
 * carries a HDR-byte header with its size, as the backend's free is not
 * told the size; while kept, its first bytes hold its list links (the
 * rest is poisoned under AddressSanitizer). These blocks are charged to
 * no budget: a session's own free lists (common/cache.c) are, and what
 * they let go of lands here. */
#define HDR 16 /* keeps malloc's 16-byte alignment */
#define CACHE_MIN (1u << 20)

typedef struct blk_links {
  uint8_t *cprev, *cnext; /* its size class's list, newest first */
  uint8_t *lprev, *lnext; /* all kept blocks, oldest first */
} blk_links;

static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t g_cache_limit;
static size_t g_cache_bytes;
static uint8_t *g_cls[DSP__NCLASS];
static uint8_t *g_oldest, *g_newest;
static uint64_t g_hits, g_misses, g_evicted;

static size_t blk_size(const uint8_t *b) { return *(const size_t *)b; }
static blk_links *blk_l(uint8_t *b) { return (blk_links *)(b + HDR); }

static void blk_unlink(uint8_t *b) {
  blk_links *l = blk_l(b);
  if (l->cprev) blk_l(l->cprev)->cnext = l->cnext;
  else g_cls[dsp__size_class(blk_size(b))] = l->cnext;
  if (l->cnext) blk_l(l->cnext)->cprev = l->cprev;
  if (l->lprev) blk_l(l->lprev)->lnext = l->lnext;
  else g_oldest = l->lnext;
  if (l->lnext) blk_l(l->lnext)->lprev = l->lprev;
  else g_newest = l->lprev;
  g_cache_bytes -= blk_size(b);
  DSP_UNPOISON(b + HDR, blk_size(b));
}

/* Unlinks the oldest blocks until the kept bytes are at most `keep`;
 * returns them linked through their first pointer. */
static uint8_t *evict_to(size_t keep) {
  uint8_t *drop = NULL;
  while (g_oldest && g_cache_bytes > keep) {
    uint8_t *b = g_oldest;
    blk_unlink(b);
    g_evicted += blk_size(b);
    memcpy(b + HDR, &drop, sizeof drop);
    drop = b;
  }
  return drop;
}

static void free_evicted(uint8_t *b) {
  while (b) {
    uint8_t *n;
    memcpy(&n, b + HDR, sizeof n);
    dsp_free(b);
    b = n;
  }
}

void dsp_cpu_cache_set_limit(size_t bytes) {
  pthread_mutex_lock(&g_cache_mu);
  g_cache_limit = bytes;
  uint8_t *drop = evict_to(bytes);
  pthread_mutex_unlock(&g_cache_mu);
  free_evicted(drop);
}

size_t dsp_cpu_cache_bytes(void) {
  pthread_mutex_lock(&g_cache_mu);
  size_t b = g_cache_bytes;
  pthread_mutex_unlock(&g_cache_mu);
  return b;
}

void dsp_cpu_cache_stats(dsp_cache_stats *out) {
  pthread_mutex_lock(&g_cache_mu);
  *out = (dsp_cache_stats){g_hits,    g_misses, g_cache_bytes,
                           g_cache_limit, g_evicted, 0};
  pthread_mutex_unlock(&g_cache_mu);
}

/* A kept block of nbytes' size class that holds nbytes (the newest such),
 * or NULL. */
static void *cache_take(size_t nbytes) {
  uint8_t *b;
  pthread_mutex_lock(&g_cache_mu);
  for (b = g_cls[dsp__size_class(nbytes)]; b && blk_size(b) < nbytes;
       b = blk_l(b)->cnext) {
  }
  if (b) {
    blk_unlink(b);
    g_hits++;
  } else if (g_cache_limit) {
    g_misses++;
  }
  pthread_mutex_unlock(&g_cache_mu);
  return b;
}

/* Keeps block b (returns 1) or leaves it to the caller (0); the oldest
 * blocks make room. */
static int cache_put(uint8_t *b) {
  size_t sz = blk_size(b);
  uint8_t *drop = NULL;
  int kept = 0;
  pthread_mutex_lock(&g_cache_mu);
  if (sz >= CACHE_MIN && sz <= g_cache_limit) {
    drop = evict_to(g_cache_limit - sz);
    blk_links *l = blk_l(b);
    int k = dsp__size_class(sz);
    l->cprev = NULL;
    l->cnext = g_cls[k];
    if (l->cnext) blk_l(l->cnext)->cprev = b;
    g_cls[k] = b;
    l->lnext = NULL;
    l->lprev = g_newest;
    if (g_newest) blk_l(g_newest)->lnext = b;
    else g_oldest = b;
    g_newest = b;
    g_cache_bytes += sz;
    DSP_POISON(b + HDR + sizeof *l, sz - sizeof *l);
    kept = 1;
  }
  pthread_mutex_unlock(&g_cache_mu);
  free_evicted(drop);
  return kept;
}

static int cpu_alloc(void *bctx, size_t nbytes, int zero, void **data) {
  (void)bctx;
  *data = NULL;
  if (nbytes > SIZE_MAX - HDR) return DISPATCH_ENOMEM;
  uint8_t *b = nbytes >= CACHE_MIN ? cache_take(nbytes) : NULL;
  if (b) {
    if (zero) memset(b + HDR, 0, nbytes);
  } else {
    b = zero ? dsp_calloc(1, HDR + nbytes) : dsp_malloc(HDR + nbytes);
    if (!b) return DISPATCH_ENOMEM;
    *(size_t *)b = nbytes;
  }
  *data = b + HDR;
  return 0;
}

static void cpu_free(void *bctx, void *data) {
  (void)bctx;
  if (!data) return;
  uint8_t *b = (uint8_t *)data - HDR;
  if (!cache_put(b)) dsp_free(b);
}

static int cpu_copy(void *bctx, void *dst, const void *src, size_t n) {
  (void)bctx;
  if (n) memcpy(dst, src, n);
  return 0;
}

/* Host memory is the storage: the network layer reads into and sends from
 * it directly, so staging costs no copy and bulk speed stays what it was. */
static int cpu_stage_in(void *bctx, void *data, size_t nbytes, void **host,
                        void **token) {
  (void)bctx, (void)nbytes;
  *host = data;
  *token = NULL;
  return 0;
}

static int cpu_commit_in(void *bctx, void *data, const void *host,
                         size_t nbytes, void *token) {
  (void)bctx, (void)token;
  if (host != data && nbytes) memcpy(data, host, nbytes);
  return 0;
}

static int cpu_stage_out(void *bctx, const void *data, size_t nbytes,
                         const void **host, void **token) {
  (void)bctx, (void)nbytes;
  *host = data;
  *token = NULL;
  return 0;
}

static void cpu_stage_release(void *bctx, void *token) {
  (void)bctx, (void)token;
}

/* What the CPU kernels implement: per op, the set of key dtypes
 * (dsp__op_key_dtype) they have a loop for. The other operands' dtypes are
 * fixed by inference (same dtype, i64 labels and indexes, bool masks);
 * cast converts every source dtype to every target dtype. One row per op:
 * a new op in DSP_OP_MAP breaks the build here until it has a row, and
 * tests/test_backend_ops.c runs every pair a row claims. */
#define F_ (1u << DSP_F32)
#define D_ (1u << DSP_F64)
#define I_ (1u << DSP_I64)
#define B_ (1u << DSP_BOOL)
#define FD_ (F_ | D_)
#define FDI_ (F_ | D_ | I_)
#define ALL_ (F_ | D_ | I_ | B_)
/* The half dtypes: claimed only where a kernel has a half loop of its own
 * (the copies of the shape family, cast, the constant fills, matmul).
 * Every other op reaches half through dsp_op_inferred's widening
 * (common/op.c), which asks this table for the f32 op and the casts. */
#define H_ ((1u << DSP_F16) | (1u << DSP_BF16))
#define FLOAT_UNARY_ROW_(OP, f) {DSP_OP_##OP, FD_},
static const struct cpu_row {
  dsp_opcode op;
  unsigned dtypes;
} g_cpu_ops[] = {
    {DSP_OP_ADD, FDI_}, {DSP_OP_SUB, FDI_}, {DSP_OP_MUL, FDI_},
    {DSP_OP_DIV, FDI_}, {DSP_OP_MAXIMUM, FDI_}, {DSP_OP_MINIMUM, FDI_},
    {DSP_OP_EQ, ALL_}, {DSP_OP_NE, ALL_}, {DSP_OP_LT, FDI_},
    {DSP_OP_LE, FDI_}, {DSP_OP_GT, FDI_}, {DSP_OP_GE, FDI_},
    {DSP_OP_WHERE, ALL_},
    {DSP_OP_ADD_SCALAR, FDI_}, {DSP_OP_SUB_SCALAR, FDI_},
    {DSP_OP_MUL_SCALAR, FDI_}, {DSP_OP_DIV_SCALAR, FD_},
    {DSP_OP_POW_SCALAR, FD_}, {DSP_OP_RSUB_SCALAR, FDI_},
    {DSP_OP_RDIV_SCALAR, FD_},
    {DSP_OP_NEG, FDI_}, {DSP_OP_ABS, FDI_}, {DSP_OP_SIGN, FDI_},
    {DSP_OP_RELU, FDI_},
    /* run_unary: every float-only unary op of scalar_math.h */
    DSP_SM_FLOAT_UNARY(FLOAT_UNARY_ROW_)
    {DSP_OP_RELU_BACKWARD, FDI_}, {DSP_OP_GELU_BACKWARD, FD_},
    {DSP_OP_CLAMP, FDI_}, {DSP_OP_MASKED_FILL, FDI_},
    {DSP_OP_SOFTPLUS_BACKWARD, FD_}, {DSP_OP_GELU_TANH_BACKWARD, FD_},
    {DSP_OP_SUM, FDI_}, {DSP_OP_MEAN, FD_}, {DSP_OP_MAX, FDI_},
    {DSP_OP_ARGMAX, FDI_}, {DSP_OP_MIN, FDI_}, {DSP_OP_ARGMIN, FDI_},
    {DSP_OP_VAR, FD_}, {DSP_OP_STD, FD_},
    {DSP_OP_RESHAPE, ALL_ | H_}, {DSP_OP_PERMUTE, ALL_ | H_},
    {DSP_OP_TRANSPOSE, ALL_ | H_}, {DSP_OP_SLICE, ALL_ | H_},
    {DSP_OP_CAT, ALL_ | H_}, {DSP_OP_STACK, ALL_ | H_},
    {DSP_OP_BROADCAST_TO, ALL_ | H_}, {DSP_OP_INDEX_SELECT, ALL_ | H_},
    {DSP_OP_CAST, ALL_ | H_}, {DSP_OP_SLICE_BACKWARD, ALL_ | H_},
    {DSP_OP_INDEX_SELECT_BACKWARD, FDI_},
    {DSP_OP_MATMUL, FD_},
    {DSP_OP_SOFTMAX, FD_}, {DSP_OP_LOG_SOFTMAX, FD_},
    {DSP_OP_SOFTMAX_BACKWARD, FD_}, {DSP_OP_LOG_SOFTMAX_BACKWARD, FD_},
    {DSP_OP_CROSS_ENTROPY, FD_}, {DSP_OP_CROSS_ENTROPY_BACKWARD, FD_},
    {DSP_OP_MSE, FD_}, {DSP_OP_CONV2D, FD_},
    {DSP_OP_CONV2D_BACKWARD_INPUT, FD_}, {DSP_OP_CONV2D_BACKWARD_WEIGHT, FD_},
    {DSP_OP_MAX_POOL2D, FD_}, {DSP_OP_AVG_POOL2D, FD_},
    {DSP_OP_MAX_POOL2D_BACKWARD, FD_}, {DSP_OP_AVG_POOL2D_BACKWARD, FD_},
    {DSP_OP_DROPOUT, FD_},
    /* issue 23 embedding/norm (cpu/norm.c) */
    {DSP_OP_EMBEDDING, FD_}, {DSP_OP_EMBEDDING_BACKWARD, FD_},
    {DSP_OP_LAYER_NORM, FD_}, {DSP_OP_LAYER_NORM_BACKWARD, FD_},
    {DSP_OP_RMS_NORM, FD_}, {DSP_OP_RMS_NORM_BACKWARD, FD_},
    {DSP_OP_BATCH_NORM, FD_}, {DSP_OP_BATCH_NORM_BACKWARD, FD_},
    /* issue 23: attention (common/cpu/attn.c) */
    {DSP_OP_ATTENTION, FD_}, {DSP_OP_ATTENTION_BACKWARD, FD_},
    /* issue 23: loss */
    {DSP_OP_CROSS_ENTROPY_EX, FD_}, {DSP_OP_CROSS_ENTROPY_EX_BACKWARD, FD_},
    {DSP_OP_AVG_POOL2D_EX, FD_}, {DSP_OP_CONV2D_BIAS, FD_},
    {DSP_OP_ZEROS, ALL_ | H_}, {DSP_OP_ONES, ALL_ | H_}, {DSP_OP_FULL, ALL_ | H_},
    {DSP_OP_ARANGE, FDI_}, {DSP_OP_UNIFORM, FD_}, {DSP_OP_NORMAL, FD_},
    {DSP_OP_SGD_STEP, FD_}, {DSP_OP_ADAM_STEP, FD_}, {DSP_OP_ADAMW_STEP, FD_},
};
_Static_assert(sizeof g_cpu_ops / sizeof g_cpu_ops[0] == DSP__OP_COUNT,
               "every op in DSP_OP_MAP needs a row in the CPU support table");

static int cpu_has_kernel(dsp_opcode op, dsp_dtype key) {
  if (!dsp_dtype_valid((int)key)) return 0;
  for (size_t i = 0; i < sizeof g_cpu_ops / sizeof g_cpu_ops[0]; i++)
    if (g_cpu_ops[i].op == op) return (g_cpu_ops[i].dtypes >> key) & 1u;
  return 0;
}

static int cpu_supports(void *bctx, dsp_opcode op, const dsp_meta *in,
                        int n_in, const dsp_meta *out) {
  (void)bctx;
  return cpu_has_kernel(op, dsp__op_key_dtype(op, in, n_in, out));
}

int dsp__no_kernel(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   int n_in, const dsp_tensor *out) {
  dsp_meta m[DSP_MAX_INPUTS];
  if (n_in < 0) n_in = 0;
  if (n_in > DSP_MAX_INPUTS) n_in = DSP_MAX_INPUTS;
  for (int i = 0; i < n_in; i++) m[i] = in[i]->meta;
  return dsp__unsupported(ctx, "cpu", op, m, n_in, out ? &out->meta : NULL);
}

static int cpu_run(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out) {
  (void)bctx;
  const dsp_op_info *info = dsp_op_lookup((int)op);
  if (!info) return dsp__no_kernel(ctx, op, in, n_in, out);
  switch (info->family) {
    case DSP_FAM_EW: return dsp__cpu_ew(ctx, op, in, n_in, a, out);
    case DSP_FAM_RED: return dsp__cpu_red(ctx, op, in, n_in, a, out);
    case DSP_FAM_SHAPE: return dsp__cpu_shape(ctx, op, in, n_in, a, out);
    case DSP_FAM_LINALG: return dsp__cpu_linalg(ctx, op, in, n_in, a, out);
    case DSP_FAM_NN: return dsp__cpu_nn(ctx, op, in, n_in, a, out);
    case DSP_FAM_CREATE: return dsp__cpu_create(ctx, op, in, n_in, a, out);
    case DSP_FAM_OPTIM: return dsp__cpu_optim(ctx, op, in, n_in, a, out);
  }
  return dsp__no_kernel(ctx, op, in, n_in, out);
}

static const dsp_backend g_cpu = {
    .name = "cpu",
    .device = "host CPU (OpenBLAS)",
    .bctx = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .stage_in = cpu_stage_in,
    .commit_in = cpu_commit_in,
    .stage_out = cpu_stage_out,
    .stage_release = cpu_stage_release,
    .caps = DSP_CAP_HOST_MEMORY | DSP_CAP_INLINE,
    /* the elementwise loops (common/cpu/ew.c) store every element */
    .writes_every_element = 1u << DSP_FAM_EW,
    .supports_op = cpu_supports,
    .run_op = cpu_run,
};

const dsp_backend *dsp_cpu_backend(void) { return &g_cpu; }

dsp_backend *dsp_cpu_backend_new(const char *id) {
  size_t n = strlen(id ? id : "cpu") + 1;
  dsp_backend *be = dsp_malloc(sizeof *be + n);
  if (!be) return NULL;
  *be = g_cpu;
  char *name = (char *)(be + 1);
  memcpy(name, id ? id : "cpu", n);
  be->id = name;
  return be;
}

void dsp_cpu_backend_free(dsp_backend *be) { dsp_free(be); }
