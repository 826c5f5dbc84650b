/* dispatch-server: parses the command line and runs the server. */
#include <signal.h>
#include <stdio.h>

#include "group.h"
#include "sv.h"

/* Threads for kernels: the CPU backend's pool (common/cpu/par.h), shared
 * by every worker: a lone session's kernels use every core
 * (DISPATCH_CPU_THREADS overrides the count), two sessions' kernels at
 * once each run on their own worker's thread, and OpenBLAS runs
 * single-threaded inside the pool's chunks (its own threads, every core
 * for each call before, spun in sched_yield between calls: a quarter of
 * a training step's CPU time on 2 cores). */
int main(int argc, char **argv) {
  sv_config cfg;
  sv_config_defaults(&cfg);
  int rc = sv_config_parse(&cfg, argc, argv);
  if (rc != 0) {
    sv_config_release(&cfg);
    return rc > 0 ? 0 : 2;
  }
  signal(SIGPIPE, SIG_IGN);
  /* a reload asked for while the server starts must not end it: the loop
   * takes SIGHUP over before the port is announced (reload.c) */
  signal(SIGHUP, SIG_IGN);
  dsp_cpu_cache_set_limit((size_t)cfg.storage_cache);
  /* --mpi: MPI_Init (on the group's thread) only here, so a server
   * without it never touches MPI; the port becomes --listen's + rank */
  if (cfg.mpi && (rc = sv_group_start(&cfg)) < 0) {
    sv_config_release(&cfg);
    return 1;
  }
  rc = sv_run(&cfg);
  sv_group_stop();
  dsp_cpu_cache_set_limit(0); /* gives the kept blocks back */
  sv_config_release(&cfg);
  if (rc < 0) {
    if (sv_start_reason_printed) return 1;
    fprintf(stderr, "dispatch-server: %s\n", dispatch_strerror(rc));
    return 1;
  }
  return 0;
}
