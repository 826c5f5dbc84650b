/* The plugin's one entry point (common/cuda_plugin.h): the table of the
 * backend's functions, with the ABI, version and structure sizes of this
 * build for the loader to check, and the host's allocator taken over so
 * that memory crosses between the host and the plugin's copy of the
 * common code. */
#include "backend.h"
#include "cuda_be.h"
#include "cuda_plugin.h"
#include "dsp_internal.h"

static const dsp_cuda_host *g_host;

static void *host_malloc(size_t n, void *ud) {
  (void)ud;
  return g_host->malloc_fn(n);
}
static void *host_realloc(void *p, size_t n, void *ud) {
  (void)ud;
  return g_host->realloc_fn(p, n);
}
static void host_free(void *p, void *ud) {
  (void)ud;
  g_host->free_fn(p);
}

static void attach(const dsp_cuda_host *host) {
  g_host = host;
  const dsp_allocator a = {host_malloc, host_realloc, host_free, NULL};
  dsp_set_allocator(&a);
}

static int device_count(char *why, size_t why_len) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    dsp_cuda_error(e, "no CUDA device: cudaGetDeviceCount", why, why_len);
    return 0;
  }
  if (n <= 0 && why && why_len)
    snprintf(why, why_len, "no CUDA device: cudaGetDeviceCount found none");
  return n > 0 ? n : 0;
}

/* where a CUDA tensor's bytes are (cuda_plugin.h, ABI 2: for NCCL) */
static int tensor_place(const dsp_tensor *t, int *device, void **data,
                        void **stream) {
  if (!t || !t->storage || !dsp__cu_is(t->storage->backend)) return 0;
  const cu_be *b = t->storage->backend->bctx;
  *device = b->device;
  *data = t->storage->data;
  *stream = (void *)b->stream;
  return 1;
}

static const dsp_cuda_plugin g_table = {
    .abi = DSP_CUDA_PLUGIN_ABI,
    .version = DISPATCH_VERSION_STRING,
    .layout = DSP_CUDA_PLUGIN_LAYOUT,
    .cudart_version = CUDART_VERSION,
    .attach = attach,
    .backend_open = dsp_cuda_backend_open,
    .backend_close = dsp_cuda_backend_close,
    .total_memory = dsp_cuda_total_memory,
    .device_count = device_count,
    .session_open = dsp_cuda_session_open,
    .session_close = dsp_cuda_session_close,
    .ctx_use = dsp_cuda_ctx_use,
    .pool_used = dsp_cuda_pool_used,
    .sync = dsp_cuda_sync,
    .has_kernel = dsp__cuda_has_kernel,
    .tensor_place = tensor_place,
};

__attribute__((visibility("default"))) const dsp_cuda_plugin *
dispatch_cuda_plugin_v1(void) {
  return &g_table;
}
