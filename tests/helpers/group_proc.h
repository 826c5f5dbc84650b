/* Test helper: an MPI group of real dispatch-servers on loopback.
 *
 * gp_start runs `mpirun --allow-run-as-root --oversubscribe --mca btl
 * self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo -np N
 * $DISPATCH_SERVER_BIN --mpi --listen 127.0.0.1:0 <extra_args>` ($MPIRUN
 * names another mpirun) in a process group of its own, reads from its
 * stdout each rank's "MPI rank R of N (pid P)" and "listening on
 * 127.0.0.1:PORT" lines, and fills g. Returns 0, or -1 (g stopped) when
 * mpirun cannot start or the ranks do not all announce themselves within
 * 60 s. Every MPI channel stays on loopback.
 *
 * gp_stop sends SIGTERM to mpirun (which passes it on to the ranks),
 * waits at most 20 s, then kills the whole process group; returns
 * mpirun's exit status, 128+signal, or -1 when nothing was running. */
#ifndef GROUP_PROC_H
#define GROUP_PROC_H

#include <sys/types.h>

#define GP_MAX 8

typedef struct gp_group {
  pid_t pid;            /* mpirun; 0 when not running */
  int n;
  int ports[GP_MAX];    /* in the order the ranks announced their ports */
  pid_t rank_pid[GP_MAX]; /* by rank */
  char specs[GP_MAX][48]; /* "tcp://127.0.0.1:PORT", as ports */
  int out_fd;
} gp_group;

/* mpirun's options gp_start passes before -np (NULL-terminated): every
 * MPI channel on loopback; a program that runs mpirun itself uses them
 * too (bench/group.c's Open MPI reference) */
extern const char *const gp_mpirun_opts[];

int gp_start(gp_group *g, int n, const char *const *extra_args);
/* Sets this process's environment for MPI ranks it is about to start
 * (under ASan: no leak check, Open MPI's leaks are not ours); gp_start's
 * ranks get it, a test that runs mpirun itself calls it first. */
void gp_rank_env(void);
int gp_stop(gp_group *g);

#endif
