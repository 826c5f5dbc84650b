/* dispatch-server: parses the command line and runs the server. */
#include <signal.h>
#include <stdio.h>

#include "sv.h"

/* OpenBLAS spawns its own threads per call; with several worker threads
 * each running a matmul that oversubscribes the cores, so each worker
 * gets an equal share. */
extern void openblas_set_num_threads(int n);
extern int openblas_get_num_procs(void);

int main(int argc, char **argv) {
  sv_config cfg;
  sv_config_defaults(&cfg);
  int rc = sv_config_parse(&cfg, argc, argv);
  if (rc != 0) {
    sv_config_release(&cfg);
    return rc > 0 ? 0 : 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int procs = openblas_get_num_procs();
  int share = procs / cfg.threads;
  openblas_set_num_threads(share < 1 ? 1 : share);
  dsp_cpu_cache_set_limit((size_t)cfg.storage_cache);
  rc = sv_run(&cfg);
  dsp_cpu_cache_set_limit(0); /* gives the kept blocks back */
  sv_config_release(&cfg);
  if (rc < 0) {
    fprintf(stderr, "dispatch-server: %s\n", dispatch_strerror(rc));
    return 1;
  }
  return 0;
}
