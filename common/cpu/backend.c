/* The CPU backend: host memory, the table of what its kernels implement,
 * and the dispatch to the family kernels of common/cpu/. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"

/* Storage cache: a server that frees a large tensor and soon allocates
 * one of about the same size (uploads, step-by-step training) would
 * otherwise get fresh pages from the kernel each time (glibc mmaps large
 * blocks and unmaps them on free), and the page faults cost more than the
 * copy itself. Freed blocks of at least CACHE_MIN bytes are kept, up to
 * g_cache_limit bytes in all (0, the library default, keeps none: only
 * dispatch-server turns it on). Each block carries a HDR-byte header with
 * its size, as the backend's free is not told the size. */
#define HDR 16 /* keeps malloc's 16-byte alignment */
#define CACHE_MIN (1u << 20)
#define CACHE_SLOTS 8

static pthread_mutex_t g_cache_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t g_cache_limit;
static size_t g_cache_bytes;
static int g_cache_n;
static void *g_cache[CACHE_SLOTS]; /* oldest first */

void dsp_cpu_cache_set_limit(size_t bytes) {
  void *drop[CACHE_SLOTS];
  int n = 0;
  pthread_mutex_lock(&g_cache_mu);
  g_cache_limit = bytes;
  while (g_cache_n > 0 && g_cache_bytes > bytes) {
    void *b = g_cache[0];
    g_cache_bytes -= *(size_t *)b;
    memmove(g_cache, g_cache + 1, (size_t)--g_cache_n * sizeof *g_cache);
    drop[n++] = b;
  }
  pthread_mutex_unlock(&g_cache_mu);
  for (int i = 0; i < n; i++) dsp_free(drop[i]);
}

size_t dsp_cpu_cache_bytes(void) {
  pthread_mutex_lock(&g_cache_mu);
  size_t b = g_cache_bytes;
  pthread_mutex_unlock(&g_cache_mu);
  return b;
}

/* A cached block of nbytes..nbytes*9/8 (the smallest), or NULL. */
static void *cache_take(size_t nbytes) {
  void *b = NULL;
  pthread_mutex_lock(&g_cache_mu);
  int best = -1;
  for (int i = 0; i < g_cache_n; i++) {
    size_t sz = *(size_t *)g_cache[i];
    if (sz >= nbytes && sz - nbytes <= nbytes / 8 &&
        (best < 0 || sz < *(size_t *)g_cache[best]))
      best = i;
  }
  if (best >= 0) {
    b = g_cache[best];
    g_cache_bytes -= *(size_t *)b;
    memmove(g_cache + best, g_cache + best + 1,
            (size_t)(--g_cache_n - best) * sizeof *g_cache);
  }
  pthread_mutex_unlock(&g_cache_mu);
  return b;
}

/* Keeps block b (returns 1) or leaves it to the caller (0); the oldest
 * blocks make room. */
static int cache_put(void *b) {
  size_t sz = *(size_t *)b;
  void *drop[CACHE_SLOTS];
  int n = 0, kept = 0;
  pthread_mutex_lock(&g_cache_mu);
  if (sz >= CACHE_MIN && sz <= g_cache_limit) {
    while (g_cache_n > 0 && (g_cache_n == CACHE_SLOTS ||
                             g_cache_bytes + sz > g_cache_limit)) {
      drop[n++] = g_cache[0];
      g_cache_bytes -= *(size_t *)g_cache[0];
      memmove(g_cache, g_cache + 1, (size_t)--g_cache_n * sizeof *g_cache);
    }
    g_cache[g_cache_n++] = b;
    g_cache_bytes += sz;
    kept = 1;
  }
  pthread_mutex_unlock(&g_cache_mu);
  for (int i = 0; i < n; i++) dsp_free(drop[i]);
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
    {DSP_OP_NEG, FDI_}, {DSP_OP_EXP, FD_}, {DSP_OP_LOG, FD_},
    {DSP_OP_SQRT, FD_}, {DSP_OP_ABS, FDI_}, {DSP_OP_SIGN, FDI_},
    {DSP_OP_RELU, FDI_}, {DSP_OP_SIGMOID, FD_}, {DSP_OP_TANH, FD_},
    {DSP_OP_GELU, FD_}, {DSP_OP_RELU_BACKWARD, FDI_},
    {DSP_OP_GELU_BACKWARD, FD_},
    {DSP_OP_SUM, FDI_}, {DSP_OP_MEAN, FD_}, {DSP_OP_MAX, FDI_},
    {DSP_OP_ARGMAX, FDI_},
    {DSP_OP_RESHAPE, ALL_}, {DSP_OP_PERMUTE, ALL_}, {DSP_OP_TRANSPOSE, ALL_},
    {DSP_OP_SLICE, ALL_}, {DSP_OP_CAT, ALL_}, {DSP_OP_STACK, ALL_},
    {DSP_OP_BROADCAST_TO, ALL_}, {DSP_OP_INDEX_SELECT, ALL_},
    {DSP_OP_CAST, ALL_}, {DSP_OP_SLICE_BACKWARD, ALL_},
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
    {DSP_OP_ZEROS, ALL_}, {DSP_OP_ONES, ALL_}, {DSP_OP_FULL, ALL_},
    {DSP_OP_ARANGE, FDI_}, {DSP_OP_UNIFORM, FD_}, {DSP_OP_NORMAL, FD_},
    {DSP_OP_SGD_STEP, FD_}, {DSP_OP_ADAM_STEP, FD_},
};
_Static_assert(sizeof g_cpu_ops / sizeof g_cpu_ops[0] == DSP__OP_COUNT,
               "every op in DSP_OP_MAP needs a row in the CPU support table");

int dsp__cpu_has_kernel(dsp_opcode op, dsp_dtype key) {
  if (!dsp_dtype_valid((int)key)) return 0;
  for (size_t i = 0; i < sizeof g_cpu_ops / sizeof g_cpu_ops[0]; i++)
    if (g_cpu_ops[i].op == op) return (g_cpu_ops[i].dtypes >> key) & 1u;
  return 0;
}

static int cpu_supports(void *bctx, dsp_opcode op, const dsp_meta *in,
                        int n_in, const dsp_meta *out) {
  (void)bctx;
  return dsp__cpu_has_kernel(op, dsp__op_key_dtype(op, in, n_in, out));
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
    .host_shared = 1,
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
