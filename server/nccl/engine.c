/* The NCCL plugin: dispatch-nccl.so, loaded by dispatch-server --mpi when
 * the server has a CUDA device (server/group.c) and linked with NCCL and
 * the CUDA runtime; the server binary links neither. It exports
 * dispatch_nccl_engine_v1 only.
 *
 * Communicators are made non-blocking (ncclConfig_t.blocking = 0) so that
 * every wait here is a poll with a bound: a peer that never joins the
 * init, or stalls inside an all-reduce, costs at most timeout_s, then
 * ncclCommAbort, never a hang of the group's thread. */
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdio.h>
#include <time.h>

#include "group_mpi.h"
#include "group_nccl.h"

_Static_assert(SV_NCCL_ID_BYTES == NCCL_UNIQUE_ID_BYTES,
               "ncclUniqueId size");

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Sleeps growing from 2 us to 1 ms: a short all-reduce is seen done
 * within microseconds, a long one costs the thread nothing. */
static void nap(long *ns) {
  *ns = *ns ? *ns * 2 : 2000;
  if (*ns > 1000000) *ns = 1000000;
  struct timespec ts = {0, *ns};
  nanosleep(&ts, NULL);
}

static int nccl_fail(ncclResult_t r, const char *what, ncclComm_t comm,
                     char *why, size_t len) {
  const char *last = comm ? ncclGetLastError(comm) : NULL;
  snprintf(why, len, "%s: %s (NCCL error %d)%s%s", what,
           ncclGetErrorString(r), (int)r, last && *last ? ": " : "",
           last && *last ? last : "");
  return -1;
}

static int cuda_fail(cudaError_t e, const char *what, char *why, size_t len) {
  snprintf(why, len, "%s: %s (%s)", what, cudaGetErrorString(e),
           cudaGetErrorName(e));
  return -1;
}

static const char *e_describe(void) {
  static char s[48];
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
  /* 2.9 on: major * 10000 + minor * 100 + patch */
  snprintf(s, sizeof s, "NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
  return s;
}

static int e_unique_id(void *id, char *why, size_t len) {
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_fail(r, "ncclGetUniqueId", NULL, why, len);
  __builtin_memcpy(id, &u, sizeof u);
  return 0;
}

/* The communicator's state once ncclInProgress is over, at most until
 * `until`; ncclInProgress itself when time ran out. */
static ncclResult_t settle(ncclComm_t comm, double until) {
  long ns = 0;
  for (;;) {
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (now_s() >= until) return ncclInProgress;
    nap(&ns);
  }
}

static int e_comm_init(void **out, int device, int nranks, int rank,
                       const void *id, int timeout_s, char *why,
                       size_t len) {
  *out = NULL;
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) return cuda_fail(ce, "cudaSetDevice", why, len);
  ncclUniqueId u;
  __builtin_memcpy(&u, id, sizeof u);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  double until = now_s() + timeout_s;
  ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, u, rank, &cfg);
  if (r == ncclInProgress || r == ncclSuccess) r = settle(comm, until);
  if (r == ncclSuccess) {
    *out = comm;
    return 0;
  }
  if (r == ncclInProgress)
    snprintf(why, len,
             "ncclCommInitRankConfig (cuda:%d, rank %d of %d): not done "
             "within %d s (a member never joined); aborted",
             device, rank, nranks, timeout_s);
  else
    nccl_fail(r, "ncclCommInitRankConfig", comm, why, len);
  if (comm) ncclCommAbort(comm);
  return -1;
}

static ncclDataType_t nccl_type(int type) {
  switch (type) {
  case SV_MPI_F32: return ncclFloat32;
  case SV_MPI_F64: return ncclFloat64;
  case SV_MPI_I64: return ncclInt64;
  case SV_NCCL_F16: return ncclFloat16;
  default: return ncclBfloat16;
  }
}

/* Several tensors: one ncclAllReduce each inside ncclGroupStart/End, not
 * one packed buffer. Reasoning, not a measurement (no GPU where this was
 * written, and a one-rank communicator, all one GPU allows, reduces
 * nothing worth timing): NCCL fuses the operations of a group into one
 * launch, so the group costs about what one call of the total size costs
 * plus a little per tensor, while packing adds a device-to-device copy of
 * every byte in and out (two more passes over the gradients at memory
 * speed, small beside the network but not free) and a scratch buffer as
 * large as the gradients, charged to nobody's budget. Worth timing on a
 * host with two GPUs: many small tensors are where packing could win. */
static int e_allreduce(void *comm_, int device, void *stream_, size_t n,
                       void *const *bufs, const size_t *counts, int type,
                       int avg, int timeout_s, char *why, size_t len) {
  ncclComm_t comm = comm_;
  cudaStream_t stream = stream_;
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    ncclCommAbort(comm);
    return cuda_fail(ce, "cudaSetDevice", why, len);
  }
  double until = now_s() + timeout_s;
  ncclDataType_t t = nccl_type(type);
  ncclRedOp_t op = avg ? ncclAvg : ncclSum;
  ncclResult_t r = ncclGroupStart();
  for (size_t i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); i++)
    if (counts[i])
      r = ncclAllReduce(bufs[i], bufs[i], counts[i], t, op, comm, stream);
  ncclResult_t e = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = e;
  if (r == ncclInProgress) r = settle(comm, until);
  if (r != ncclSuccess) {
    if (r == ncclInProgress)
      snprintf(why, len, "ncclAllReduce: not enqueued within %d s", timeout_s);
    else
      nccl_fail(r, "ncclAllReduce", comm, why, len);
    ncclCommAbort(comm);
    return -1;
  }
  long ns = 0;
  for (;;) {
    ce = cudaStreamQuery(stream);
    if (ce == cudaSuccess) return 0;
    if (ce != cudaErrorNotReady) {
      cuda_fail(ce, "ncclAllReduce: cudaStreamQuery", why, len);
      break;
    }
    ncclResult_t st = ncclSuccess;
    r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess || (st != ncclSuccess && st != ncclInProgress)) {
      nccl_fail(r != ncclSuccess ? r : st, "ncclAllReduce", comm, why, len);
      break;
    }
    if (now_s() >= until) {
      snprintf(why, len,
               "ncclAllReduce (cuda:%d): not done within --mpi-timeout %d s "
               "(a member stalled or died); communicator aborted",
               device, timeout_s);
      break;
    }
    nap(&ns);
  }
  ncclCommAbort(comm);
  return -1;
}

/* an aborted communicator is already freed by ncclCommAbort: group.c
 * calls this only for one that never failed */
static void e_comm_destroy(void *comm, int abort) {
  if (!comm) return;
  /* a non-blocking communicator is finalized (its last work flushed)
   * before it is destroyed: waited for 5 s at most, then aborted */
  ncclResult_t r = abort ? ncclInternalError : ncclCommFinalize(comm);
  if (r == ncclInProgress) r = settle(comm, now_s() + 5.0);
  if (r == ncclSuccess) ncclCommDestroy(comm);
  else ncclCommAbort(comm);
}

static const sv_nccl_api g_api = {
    .abi = SV_NCCL_ABI,
    .describe = e_describe,
    .unique_id = e_unique_id,
    .comm_init = e_comm_init,
    .allreduce = e_allreduce,
    .comm_destroy = e_comm_destroy,
};

__attribute__((visibility("default"))) const sv_nccl_api *
dispatch_nccl_engine_v1(void) {
  return &g_api;
}
