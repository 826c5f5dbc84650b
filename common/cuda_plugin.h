/* The CUDA backend as a plugin: common/cuda/ is built into the shared
 * object dispatch-cuda.so (with cuBLAS and the CUDA runtime), which
 * dispatch-server, libdispatch-client and the GPU test programs load at
 * run time when a CUDA device is asked for. None of them links CUDA at
 * build time, so one server binary serves CPU-only and GPU hosts alike.
 *
 * The plugin exports one symbol, DSP_CUDA_PLUGIN_ENTRY, a function that
 * returns its table (below). The plugin carries its own copy of the
 * common code its kernels call (shapes, budgets, errors), working on the
 * host's ctx, tensors and budgets: both sides must agree on those
 * structures, so the table states the ABI number, the version and the
 * sizes it was built with, and the loader refuses a plugin whose values
 * differ from its own ("stale plugin ... rebuild it with this tree").
 * The plugin's allocations go through the host's allocator (attach), so
 * memory made on one side may be freed on the other.
 *
 * Where the loader looks, first hit wins (dsp_cuda_plugin_load):
 *   1. $DISPATCH_CUDA_PLUGIN, when set and not empty (only that file);
 *   2. for D = the folder of the object that holds the loader (the
 *      libdispatch-client.so a program loaded, or the executable when
 *      the loader is linked in statically), then D = the folder of the
 *      executable (/proc/self/exe):
 *        D/dispatch-cuda.so                 (the build tree: build/)
 *        D/dispatch/dispatch-cuda.so        (PREFIX/lib/dispatch/ next
 *                                            to PREFIX/lib/libdispatch-client.so)
 *        D/../lib/dispatch/dispatch-cuda.so (PREFIX/bin/dispatch-server)
 * The plugin is loaded once per process and never unloaded; the outcome
 * (success or the reason) is kept. */
#ifndef DSP_CUDA_PLUGIN_H
#define DSP_CUDA_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "dsp.h"

/* Raised whenever the table below or a structure the plugin shares with
 * its host changes in a way the sizes do not show. */
#define DSP_CUDA_PLUGIN_ABI 2u
#define DSP_CUDA_PLUGIN_FILE "dispatch-cuda.so"
#define DSP_CUDA_PLUGIN_ENTRY "dispatch_cuda_plugin_v1"

/* What the host lends the plugin: its allocator (dsp_malloc & co of the
 * host's copy of common/alloc.c, honouring dsp_set_allocator there). */
typedef struct dsp_cuda_host {
  void *(*malloc_fn)(size_t size);
  void *(*realloc_fn)(void *p, size_t size);
  void (*free_fn)(void *p);
} dsp_cuda_host;

/* The sizes both sides must agree on (DSP_CUDA_PLUGIN_LAYOUT). */
typedef struct dsp_cuda_layout {
  uint32_t ctx, tensor, storage, meta, attrs, backend, n_ops;
} dsp_cuda_layout;

/* The table; every function is the one of common/cuda/dsp_cuda.h with the
 * same name (dsp_cuda_backend_open and so on), see that header. */
typedef struct dsp_cuda_plugin {
  uint32_t abi;        /* DSP_CUDA_PLUGIN_ABI of the plugin's build */
  const char *version; /* DISPATCH_VERSION_STRING of the plugin's build */
  dsp_cuda_layout layout;
  /* the CUDA runtime's version the plugin was built against (CUDART_VERSION) */
  int cudart_version;
  void (*attach)(const dsp_cuda_host *host);
  int (*backend_open)(int device, dsp_backend **out, char *why,
                      size_t why_len);
  void (*backend_close)(dsp_backend *be);
  uint64_t (*total_memory)(const dsp_backend *be);
  /* how many devices; 0 with the reason in why when none is usable */
  int (*device_count)(char *why, size_t why_len);
  int (*session_open)(dsp_backend *device, dsp_backend **out, char *why,
                      size_t why_len);
  void (*session_close)(dsp_backend *session);
  void (*ctx_use)(dsp_ctx *ctx, const dsp_backend *be);
  uint64_t (*pool_used)(const dsp_backend *be);
  int (*sync)(const dsp_backend *be, dsp_ctx *ctx);
  int (*has_kernel)(dsp_opcode op, dsp_dtype key);
  /* ABI 2 (the NCCL all-reduce of server/group.c): 1 when t's storage
   * lives on a CUDA backend, with the device's ordinal, the storage's
   * device pointer (t's bytes, contiguous) and the cudaStream_t the
   * backend's kernels run on; 0 when t is elsewhere (outputs untouched).
   * Borrowed: valid while t holds its storage; a caller that writes in
   * place calls dsp__storage_prepare_write first, then this. */
  int (*tensor_place)(const dsp_tensor *t, int *device, void **data,
                      void **stream);
} dsp_cuda_plugin;

/* The sizes of this build, an initializer of dsp_cuda_layout for the
 * plugin's table and the loader's check (needs dsp_internal.h and
 * backend.h for the two private structures). */
#define DSP_CUDA_N_OPS_ONE_(...) +1
#define DSP_CUDA_PLUGIN_LAYOUT                                              \
  {sizeof(struct dsp_ctx), sizeof(dsp_tensor), sizeof(dsp_storage),        \
   sizeof(dsp_meta), sizeof(dsp_attrs), sizeof(struct dsp_backend),         \
   0 DSP_OP_MAP(DSP_CUDA_N_OPS_ONE_)}

/* Loads the plugin (once per process; later calls return the first
 * outcome). 0 with *out, a table that lives until the process exits;
 * else DISPATCH_EUNSUPPORTED with one line in why naming the plugin and
 * every place it was looked for, or why dlopen or the check refused it. */
int dsp_cuda_plugin_load(const dsp_cuda_plugin **out, char *why,
                         size_t why_len);
/* The file the plugin was loaded from; "" before a successful load. */
const char *dsp_cuda_plugin_path(void);

/* Opens CUDA device `index` through the plugin: 0 with *out (close it with
 * (*plugin)->backend_close) and *plugin set; else a negative code and one
 * line in why: the plugin missing (and where it was looked for), or the
 * plugin loaded but no usable device or driver (libcuda.so.1 missing, or
 * the CUDA runtime's reason). */
int dsp_cuda_plugin_open(int index, const dsp_cuda_plugin **plugin,
                         dsp_backend **out, char *why, size_t why_len);

/* One line for logs: "cuda: plugin PATH loaded, N GPUs", "cuda: plugin
 * PATH loaded, 0 GPUs: REASON" or "cuda: REASON" (the plugin not
 * loaded). Returns the number of GPUs (0 when none or no plugin). */
int dsp_cuda_plugin_describe(char *buf, size_t len);

#endif
