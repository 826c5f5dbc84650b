/* bench/mpi/allreduce: Open MPI alone, the fair limit of the group
 * all-reduce row of bench/group.c. Started by that program under the same
 * mpirun options its servers run with (2 ranks, every channel on
 * loopback), it all-reduces (MPI_SUM, in place) BYTES of f32 per rank
 * REPS times after one warm-up, each between two barriers, and rank 0
 * prints one line per rep: "mbps <one rank's bytes / seconds / 1e6>".
 *
 *   mpirun -np 2 ... build/bench/mpi_allreduce BYTES REPS */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  long long bytes = argc > 1 ? atoll(argv[1]) : 16 << 20;
  int reps = argc > 2 ? atoi(argv[2]) : 1;
  int count = (int)(bytes / (long long)sizeof(float));
  float *buf = malloc((size_t)count * sizeof *buf);
  if (!buf || count <= 0 || reps <= 0) {
    fprintf(stderr, "mpi_allreduce: bad size or out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (int i = 0; i < count; i++) buf[i] = (float)(i % 251) / 251.0f;
  for (int r = 0; r <= reps; r++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM,
                  MPI_COMM_WORLD);
    t = MPI_Wtime() - t;
    if (rank == 0 && r > 0) /* the first is a warm-up */
      printf("mbps %.1f\n", (double)count * sizeof(float) / t / 1e6);
  }
  fflush(stdout);
  free(buf);
  MPI_Finalize();
  return 0;
}
