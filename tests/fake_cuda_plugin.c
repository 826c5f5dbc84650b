/* A stale CUDA plugin for tests/test_cuda_plugin.c: the entry point of
 * dispatch-cuda.so returning a table of another ABI number, as a plugin
 * left from an older build would. The loader must refuse it before
 * calling anything in it (every function pointer is NULL). */
#include "backend.h"
#include "cuda_plugin.h"
#include "dsp_internal.h"

static const dsp_cuda_plugin g_table = {
    .abi = DSP_CUDA_PLUGIN_ABI + 1,
    .version = DISPATCH_VERSION_STRING,
    .layout = DSP_CUDA_PLUGIN_LAYOUT,
};

__attribute__((visibility("default"))) const dsp_cuda_plugin *
dispatch_cuda_plugin_v1(void) {
  return &g_table;
}
