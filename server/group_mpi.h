/* The table the MPI plugin (build/dispatch-mpi.so, server/mpi/engine.c)
 * hands the server: the few MPI calls a group needs, so dispatch-server
 * itself links no MPI library and starts without mpirun. Every call is
 * made from the group's own thread (group.c), the one that called init
 * (MPI_THREAD_FUNNELED). Each returns 0, or -1 with MPI's error string in
 * why[0..len-1] (MPI_COMM_WORLD's handler is MPI_ERRORS_RETURN). */
#ifndef SV_GROUP_MPI_H
#define SV_GROUP_MPI_H

#include <stddef.h>

#define SV_MPI_ABI 3

/* element types of reduce_bcast */
enum { SV_MPI_F32 = 0, SV_MPI_F64 = 1, SV_MPI_I64 = 2 };

typedef struct sv_mpi_api {
  int abi; /* SV_MPI_ABI */
  /* MPI_Init_thread (funneled) and the calling process's place */
  int (*init)(int *rank, int *size, char *why, size_t len);
  /* MPI_Bcast of bytes from rank 0. A rank other than 0 may wait long
   * for it and sleeps between polls, up to 1 ms, or up to 50 us while
   * hurry (NULL: never) returns non-zero (it has work of its own waiting
   * for rank 0's word) */
  int (*bcast)(void *buf, size_t bytes, int (*hurry)(void), char *why,
               size_t len);
  /* MPI_Allgather of bytes from each rank into all (size * bytes),
   * sleeping up to 100 us between polls while a slower rank arrives */
  int (*allgather)(const void *mine, void *all, size_t bytes, char *why,
                   size_t len);
  /* MPI_Allreduce (MPI_SUM) of count elements in place; when every rank
   * must end with the same bits whatever the algorithm, same_bits asks
   * for MPI_Reduce to rank 0 followed by MPI_Bcast instead */
  int (*allreduce_sum)(void *buf, size_t count, int type, int same_bits,
                       char *why, size_t len);
  /* MPI_Bcast of bytes from rank root (in pieces of at most INT_MAX) */
  int (*bcast_from)(void *buf, size_t bytes, int root, char *why, size_t len);
  /* MPI_Finalize */
  void (*finalize)(void);
} sv_mpi_api;

typedef const sv_mpi_api *(*sv_mpi_entry_fn)(void);
#define SV_MPI_ENTRY "dispatch_mpi_engine_v1"

#endif
