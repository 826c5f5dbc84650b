/* An MPI group of dispatch-servers for the tests (group_proc.h). */
#include "group_proc.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* what the child's stdout said, line by line, until every rank announced
 * its pid and port */
static int read_announcements(gp_group *g) {
  char buf[8192];
  size_t used = 0;
  int pids = 0, ports = 0;
  double until = now_s() + 60.0;
  while (pids < g->n || ports < g->n) {
    double left = until - now_s();
    if (left <= 0) return -1;
    struct pollfd p = {g->out_fd, POLLIN, 0};
    if (poll(&p, 1, (int)(left * 1000) + 1) <= 0) return -1;
    ssize_t k = read(g->out_fd, buf + used, sizeof buf - 1 - used);
    if (k <= 0) return -1;
    used += (size_t)k;
    buf[used] = '\0';
    char *nl;
    while ((nl = strchr(buf, '\n'))) {
      *nl = '\0';
      int r, n, pid, port;
      if (sscanf(buf, "dispatch-server: MPI rank %d of %d (pid %d)", &r, &n,
                 &pid) == 3 && r >= 0 && r < g->n) {
        g->rank_pid[r] = pid;
        pids++;
      } else if (sscanf(buf, "dispatch-server listening on 127.0.0.1:%d",
                        &port) == 1 && ports < g->n) {
        g->ports[ports] = port;
        snprintf(g->specs[ports], sizeof g->specs[ports],
                 "tcp://127.0.0.1:%d", port);
        ports++;
      }
      size_t rest = used - (size_t)(nl + 1 - buf);
      memmove(buf, nl + 1, rest);
      used = rest;
      buf[used] = '\0';
    }
    if (used >= sizeof buf - 1) used = 0; /* a long line: dropped */
  }
  return 0;
}

/* Under AddressSanitizer (make sanitize) the ranks' leak check would
 * report what Open MPI's own libraries keep until exit. Suppressing
 * them by library is not enough: its components are dlclose-d before
 * the check ("<unknown module>" frames) and stacks through glibc's
 * vasprintf stop there, so the ranks run without the leak check
 * (detect_leaks=0; every other ASan and UBSan check stays on). The
 * server's own leaks are checked by every other suite that starts one,
 * which run the same code apart from server/group.c. */
void gp_rank_env(void) {
  const char *asan = getenv("ASAN_OPTIONS");
  if (asan) {
    char full[1024];
    snprintf(full, sizeof full, "%s%sdetect_leaks=0", asan,
             *asan ? ":" : "");
    setenv("ASAN_OPTIONS", full, 1);
  }
}

const char *const gp_mpirun_opts[] = {
    "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,tcp",
    "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
    NULL};

int gp_start(gp_group *g, int n, const char *const *extra_args) {
  memset(g, 0, sizeof *g);
  g->out_fd = -1;
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  const char *mpirun = getenv("MPIRUN");
  if (!bin || n < 1 || n > GP_MAX) return -1;
  if (!mpirun || !*mpirun) mpirun = "mpirun";
  char np[16];
  snprintf(np, sizeof np, "%d", n);
  const char *argv[64] = {mpirun};
  int a = 1;
  for (int i = 0; gp_mpirun_opts[i]; i++) argv[a++] = gp_mpirun_opts[i];
  const char *tail[] = {"-np", np, bin, "--mpi", "--listen", "127.0.0.1:0"};
  for (size_t i = 0; i < sizeof tail / sizeof *tail; i++) argv[a++] = tail[i];
  for (int i = 0; extra_args && extra_args[i] && a < 63; i++)
    argv[a++] = extra_args[i];
  argv[a] = NULL;
  int fds[2];
  if (pipe(fds) < 0) return -1;
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    gp_rank_env();
    setpgid(0, 0); /* gp_stop can end mpirun and every rank together */
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    execvp(mpirun, (char *const *)argv);
    _exit(127);
  }
  setpgid(pid, pid);
  close(fds[1]);
  g->pid = pid;
  g->n = n;
  g->out_fd = fds[0];
  if (read_announcements(g) < 0) {
    gp_stop(g);
    return -1;
  }
  return 0;
}

int gp_stop(gp_group *g) {
  if (!g->pid) return -1;
  kill(g->pid, SIGTERM);
  int st = 0, got = 0;
  for (double until = now_s() + 20.0; now_s() < until;) {
    if (waitpid(g->pid, &st, WNOHANG) == g->pid) {
      got = 1;
      break;
    }
    usleep(20000);
  }
  if (!got) {
    kill(-g->pid, SIGKILL);
    waitpid(g->pid, &st, 0);
  }
  kill(-g->pid, SIGKILL); /* a rank mpirun left behind */
  if (g->out_fd >= 0) close(g->out_fd);
  g->out_fd = -1;
  g->pid = 0;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
