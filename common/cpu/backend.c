/* The CPU backend: host memory and the family kernels of common/. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsp_internal.h"

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

static int cpu_supports(void *bctx, dsp_opcode op, const dsp_meta *in, int n) {
  (void)bctx, (void)in, (void)n;
  return dsp_op_lookup((int)op) != NULL;
}

static int cpu_run(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out) {
  (void)bctx;
  switch (dsp_op_lookup((int)op)->family) {
    case DSP_FAM_EW: return dsp__cpu_ew(ctx, op, in, n_in, a, out);
    case DSP_FAM_RED: return dsp__cpu_red(ctx, op, in, n_in, a, out);
    case DSP_FAM_SHAPE: return dsp__cpu_shape(ctx, op, in, n_in, a, out);
    case DSP_FAM_LINALG: return dsp__cpu_linalg(ctx, op, in, n_in, a, out);
    case DSP_FAM_NN: return dsp__cpu_nn(ctx, op, in, n_in, a, out);
    case DSP_FAM_CREATE: return dsp__cpu_create(ctx, op, in, n_in, a, out);
    case DSP_FAM_OPTIM: return dsp__cpu_optim(ctx, op, in, n_in, a, out);
  }
  return dsp_seterr(ctx, DISPATCH_EINTERNAL, "cpu: bad family");
}

static const dsp_backend g_cpu = {
    .name = "cpu",
    .device = "host CPU (OpenBLAS)",
    .bctx = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .supports_op = cpu_supports,
    .run_op = cpu_run,
};

const dsp_backend *dsp_cpu_backend(void) { return &g_cpu; }
