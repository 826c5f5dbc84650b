/* A stand-in CUDA plugin for tests/test_nccl_plugin.c's mixed group: no
 * GPU and no kernels, but on MPI rank 0 (OMPI_COMM_WORLD_RANK) it calls
 * every tensor a CUDA tensor of device 0 (tensor_place), so that rank
 * declares its all-reduces as held on CUDA while rank 1 declares the CPU:
 * the group takes the host path and rank 0's worker stages its "CUDA"
 * tensors on the group thread's request (GOP_STAGE), the path a mixed
 * group of GPU and CPU servers takes. Its bytes are CPU storage, so the
 * staging and the write-back through the backend's copies really run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda_plugin.h"
#include "dsp_internal.h"

static void attach(const dsp_cuda_host *host) { (void)host; }

static int device_count(char *why, size_t why_len) {
  snprintf(why, why_len, "fake CUDA plugin: no device");
  return 0;
}

static int on_rank0(void) {
  const char *r = getenv("OMPI_COMM_WORLD_RANK");
  return r && strcmp(r, "0") == 0;
}

static int tensor_place(const dsp_tensor *t, int *device, void **data,
                        void **stream) {
  if (!on_rank0() || !t || !t->storage) return 0;
  *device = 0;
  *data = t->storage->data;
  *stream = NULL;
  return 1;
}

static int sync_be(const dsp_backend *be, dsp_ctx *ctx) {
  (void)be, (void)ctx;
  return 0;
}

static const dsp_cuda_plugin g_table = {
    .abi = DSP_CUDA_PLUGIN_ABI,
    .version = DISPATCH_VERSION_STRING,
    .layout = DSP_CUDA_PLUGIN_LAYOUT,
    .attach = attach,
    .device_count = device_count,
    .sync = sync_be,
    .tensor_place = tensor_place,
};

__attribute__((visibility("default"))) const dsp_cuda_plugin *
dispatch_cuda_plugin_v1(void) {
  return &g_table;
}
