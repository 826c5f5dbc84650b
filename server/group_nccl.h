/* The table the NCCL plugin (build/dispatch-nccl.so, server/nccl/engine.c)
 * hands the group (group.c): the few NCCL calls an all-reduce of CUDA
 * tensors needs, so dispatch-server itself links neither NCCL nor the
 * CUDA runtime. Every call is made from the group's thread, in the same
 * order on every rank (the rounds of group.c). Each returns 0, or -1 with
 * one line in why[0..len-1] naming the NCCL or CUDA call and its error
 * string. Waits are bounded: a call that would wait on a peer past
 * timeout_s aborts the communicator (ncclCommAbort) and fails. */
#ifndef SV_GROUP_NCCL_H
#define SV_GROUP_NCCL_H

#include <stddef.h>

#define SV_NCCL_ABI 1
#define SV_NCCL_ENTRY "dispatch_nccl_engine_v1"
#define SV_NCCL_FILE "dispatch-nccl.so"
/* ncclUniqueId's size (NCCL_UNIQUE_ID_BYTES) */
#define SV_NCCL_ID_BYTES 128

/* element types: SV_MPI_F32, SV_MPI_F64, SV_MPI_I64 (group_mpi.h) and
 * the two half types only the NCCL path reduces */
enum { SV_NCCL_F16 = 3, SV_NCCL_BF16 = 4 };

typedef struct sv_nccl_api {
  int abi; /* SV_NCCL_ABI */
  /* "NCCL 2.28.9" (the library the plugin loaded: ncclGetVersion) */
  const char *(*describe)(void);
  /* ncclGetUniqueId into id (SV_NCCL_ID_BYTES), on rank 0 only */
  int (*unique_id)(void *id, char *why, size_t len);
  /* ncclCommInitRankConfig (non-blocking) on CUDA device `device`, waited
   * for at most timeout_s; *comm owned by the caller (comm_destroy) */
  int (*comm_init)(void **comm, int device, int nranks, int rank,
                   const void *id, int timeout_s, char *why, size_t len);
  /* ncclAllReduce in place of n device buffers (bufs[i] holding counts[i]
   * elements of type) between ncclGroupStart and ncclGroupEnd on stream
   * (a cudaStream_t of device), sum or, avg != 0, ncclAvg; then waits for
   * the stream at most timeout_s (cudaStreamQuery and
   * ncclCommGetAsyncError). On -1 the communicator has been aborted:
   * destroy it and make no other call on it. */
  int (*allreduce)(void *comm, int device, void *stream, size_t n,
                   void *const *bufs, const size_t *counts, int type,
                   int avg, int timeout_s, char *why, size_t len);
  /* frees a communicator no call failed on (a failed call has aborted
   * and freed it already): ncclCommDestroy, or when abort != 0 (its peers
   * may be gone) ncclCommAbort, which waits for nobody */
  void (*comm_destroy)(void *comm, int abort);
} sv_nccl_api;

typedef const sv_nccl_api *(*sv_nccl_entry_fn)(void);

/* group.c: loads the NCCL plugin (each call tries anew; the group calls
 * it once, at start): $DISPATCH_NCCL_PLUGIN when set and not empty, else
 * dispatch-nccl.so beside the server binary, else ../lib/dispatch/ from
 * it (make install). 0 with *out (lives until the process exits) and
 * *path (the file); else DISPATCH_EUNSUPPORTED with one line in why:
 * where it was looked for and why dlopen failed, or that the file is not
 * a dispatch NCCL plugin of ABI SV_NCCL_ABI. */
int sv_nccl_load(const sv_nccl_api **out, const char **path, char *why,
                 size_t len);

#endif
