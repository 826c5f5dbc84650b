/* A one-rank stand-in for the MPI plugin (dispatch-mpi.so), for the GPU
 * bundle: DISPATCH_MPI_PLUGIN=build/tests/gpu/mpi-single.so dispatch-server
 * --mpi runs a group of one without Open MPI, whose runtime (mpirun, orted,
 * its component and PMIx plugins, help files, all found through the
 * prefix Debian compiled in) the bundle does not carry. Every collective
 * of one rank is a copy or nothing, so the server's own group code (the
 * rounds, the headers, the NCCL communicator's bootstrap and the NCCL
 * all-reduce of dispatch-nccl.so) runs as it would in a real job.
 *
 * DISPATCH_MPI_SINGLE_SPOIL_NCCL_ID=1 zeroes the NCCL id the group
 * broadcasts (the one broadcast larger than a round's key), so the
 * communicator's init fails as it would on a rank that received garbage:
 * the GPU check then sees that all-reduce refused, and the later ones
 * over that device take the host path (CUDA tensors staged by their
 * worker). */
#include <stdlib.h>
#include <string.h>

#include "group_mpi.h"
#include "group_nccl.h"

static int s_init(int *rank, int *size, char *why, size_t len) {
  (void)why, (void)len;
  *rank = 0;
  *size = 1;
  return 0;
}
static int s_bcast(void *buf, size_t bytes, int (*hurry)(void), char *why,
                   size_t len) {
  (void)hurry, (void)why, (void)len;
  const char *spoil = getenv("DISPATCH_MPI_SINGLE_SPOIL_NCCL_ID");
  if (spoil && *spoil == '1' && bytes > SV_NCCL_ID_BYTES)
    memset(buf, 0, SV_NCCL_ID_BYTES);
  return 0;
}
static int s_allgather(const void *mine, void *all, size_t bytes, char *why,
                       size_t len) {
  (void)why, (void)len;
  memmove(all, mine, bytes);
  return 0;
}
static int s_allreduce_sum(void *buf, size_t count, int type, int same_bits,
                           char *why, size_t len) {
  (void)buf, (void)count, (void)type, (void)same_bits, (void)why, (void)len;
  return 0;
}
static void s_finalize(void) {}

/* one rank: the root's bytes are already everyone's */
static int s_bcast_from(void *buf, size_t bytes, int root, char *why,
                        size_t len) {
  (void)buf, (void)bytes, (void)root, (void)why, (void)len;
  return 0;
}

static const sv_mpi_api g_api = {
    .abi = SV_MPI_ABI,
    .init = s_init,
    .bcast = s_bcast,
    .allgather = s_allgather,
    .allreduce_sum = s_allreduce_sum,
    .bcast_from = s_bcast_from,
    .finalize = s_finalize,
};

__attribute__((visibility("default"))) const sv_mpi_api *
dispatch_mpi_engine_v1(void) {
  return &g_api;
}
