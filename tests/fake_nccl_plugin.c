/* NCCL plugins for tests/test_nccl_plugin.c, no NCCL inside.
 * Built with -DFAKE_NCCL_STALE=1 (fake-nccl-plugin.so): a table of
 * another ABI number, as a plugin left from an older build would hold;
 * the group's loader must refuse it before calling anything in it (every
 * function pointer is NULL). Without it (fake-nccl-host.so): a table of
 * this ABI whose communicators never start, for the mixed group whose
 * all-reduces must take the host path without calling NCCL at all. */
#include <stdio.h>

#include "group_nccl.h"

#if FAKE_NCCL_STALE
static const sv_nccl_api g_table = {.abi = SV_NCCL_ABI + 1};
#else
static const char *describe(void) { return "fake NCCL"; }
static int unique_id(void *id, char *why, size_t len) {
  (void)id;
  snprintf(why, len, "fake NCCL: no communicator");
  return -1;
}
static int comm_init(void **comm, int device, int nranks, int rank,
                     const void *id, int timeout_s, char *why, size_t len) {
  (void)device, (void)nranks, (void)rank, (void)id, (void)timeout_s;
  *comm = NULL;
  snprintf(why, len, "fake NCCL: no communicator");
  return -1;
}
static const sv_nccl_api g_table = {
    .abi = SV_NCCL_ABI,
    .describe = describe,
    .unique_id = unique_id,
    .comm_init = comm_init,
};
#endif

__attribute__((visibility("default"))) const sv_nccl_api *
dispatch_nccl_engine_v1(void) {
  return &g_table;
}
