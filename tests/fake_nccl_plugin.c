/* A stale NCCL plugin for tests/test_nccl_plugin.c: the entry point of
 * dispatch-nccl.so returning a table of another ABI number, as a plugin
 * left from an older build would. The group's loader must refuse it
 * before calling anything in it (every function pointer is NULL). */
#include "group_nccl.h"

static const sv_nccl_api g_table = {.abi = SV_NCCL_ABI + 1};

__attribute__((visibility("default"))) const sv_nccl_api *
dispatch_nccl_engine_v1(void) {
  return &g_table;
}
