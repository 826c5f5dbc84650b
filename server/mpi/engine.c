/* The MPI plugin: dispatch-mpi.so, loaded by dispatch-server --mpi
 * (server/group.c) and linked with Open MPI; the server binary links no
 * MPI. It exports dispatch_mpi_engine_v1 only. */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <time.h>

#include "group_mpi.h"

static int fail(int rc, const char *what, char *why, size_t len) {
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "?");
  snprintf(why, len, "%s: %s (MPI error %d)", what, s, rc);
  return -1;
}

static int e_init(int *rank, int *size, char *why, size_t len) {
  int provided = 0;
  int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) return fail(rc, "MPI_Init_thread", why, len);
  /* a dead or stalled peer must come back as an error, never abort() */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if ((rc = MPI_Comm_rank(MPI_COMM_WORLD, rank)) != MPI_SUCCESS ||
      (rc = MPI_Comm_size(MPI_COMM_WORLD, size)) != MPI_SUCCESS)
    return fail(rc, "MPI_Comm_rank", why, len);
  return 0;
}

/* Waits for req with MPI_Test and sleeps that grow from 20 us to cap
 * (or to 50 us while hurry says there is work): Open MPI's blocking
 * calls poll, and a rank that spins while a slower one is still packing
 * its tensors takes a core that rank needs when the ranks share a host;
 * an idle rank costs nothing. */
static int wait_req(MPI_Request *req, long cap, int (*hurry)(void),
                    const char *what, char *why, size_t len) {
  long nap = 0;
  for (;;) {
    int done = 0;
    int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return fail(rc, what, why, len);
    if (done) return 0;
    long top = hurry && hurry() ? 50000 : cap;
    nap = nap ? nap * 2 : 20000;
    if (nap > top) nap = top;
    struct timespec ts = {0, nap};
    nanosleep(&ts, NULL);
  }
}

/* A rank other than 0 waits here for rank 0's next word, which may be
 * minutes away: a blocking MPI_Bcast would spin a core all that time. */
static int e_bcast(void *buf, size_t bytes, int (*hurry)(void), char *why,
                   size_t len) {
  if (bytes > INT_MAX) return fail(MPI_ERR_COUNT, "MPI_Ibcast", why, len);
  MPI_Request req;
  int rc = MPI_Ibcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD, &req);
  if (rc != MPI_SUCCESS) return fail(rc, "MPI_Ibcast", why, len);
  return wait_req(&req, 1000000, hurry, "MPI_Ibcast", why, len);
}

static int e_allgather(const void *mine, void *all, size_t bytes, char *why,
                       size_t len) {
  if (bytes > INT_MAX) return fail(MPI_ERR_COUNT, "MPI_Iallgather", why, len);
  MPI_Request req;
  int rc = MPI_Iallgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes,
                          MPI_BYTE, MPI_COMM_WORLD, &req);
  if (rc != MPI_SUCCESS) return fail(rc, "MPI_Iallgather", why, len);
  return wait_req(&req, 100000, NULL, "MPI_Iallgather", why, len);
}

/* in pieces of at most INT_MAX elements (MPI counts are int) */
static int e_allreduce_sum(void *buf, size_t count, int type, int same_bits,
                           char *why, size_t len) {
  MPI_Datatype t = type == SV_MPI_F32   ? MPI_FLOAT
                   : type == SV_MPI_F64 ? MPI_DOUBLE
                                        : MPI_INT64_T;
  size_t esize = type == SV_MPI_F32 ? 4 : 8;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (size_t at = 0; at < count;) {
    size_t n = count - at > INT_MAX ? INT_MAX : count - at;
    char *p = (char *)buf + at * esize;
    int rc;
    if (!same_bits) {
      rc = MPI_Allreduce(MPI_IN_PLACE, p, (int)n, t, MPI_SUM, MPI_COMM_WORLD);
      if (rc != MPI_SUCCESS) return fail(rc, "MPI_Allreduce", why, len);
    } else {
      rc = MPI_Reduce(rank == 0 ? MPI_IN_PLACE : p, rank == 0 ? p : NULL,
                      (int)n, t, MPI_SUM, 0, MPI_COMM_WORLD);
      if (rc != MPI_SUCCESS) return fail(rc, "MPI_Reduce", why, len);
      rc = MPI_Bcast(p, (int)n, t, 0, MPI_COMM_WORLD);
      if (rc != MPI_SUCCESS) return fail(rc, "MPI_Bcast", why, len);
    }
    at += n;
  }
  return 0;
}

static int e_bcast_from(void *buf, size_t bytes, int root, char *why,
                        size_t len) {
  for (size_t at = 0; at < bytes;) {
    size_t n = bytes - at > INT_MAX ? INT_MAX : bytes - at;
    int rc = MPI_Bcast((char *)buf + at, (int)n, MPI_BYTE, root,
                       MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return fail(rc, "MPI_Bcast", why, len);
    at += n;
  }
  return 0;
}

static void e_finalize(void) { MPI_Finalize(); }

static const sv_mpi_api g_api = {
    .abi = SV_MPI_ABI,
    .init = e_init,
    .bcast = e_bcast,
    .allgather = e_allgather,
    .allreduce_sum = e_allreduce_sum,
    .bcast_from = e_bcast_from,
    .finalize = e_finalize,
};

__attribute__((visibility("default"))) const sv_mpi_api *
dispatch_mpi_engine_v1(void) {
  return &g_api;
}
