/* Starts and stops the real dispatch-server for integration tests. */
#include "server_proc.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define SP_MAX_ARGS 64

/* Splits the wrapper string in place into argv words (spaces only). */
static int split_words(char *s, char **argv, int max) {
  int n = 0;
  for (char *tok = strtok(s, " \t"); tok && n < max;
       tok = strtok(NULL, " \t"))
    argv[n++] = tok;
  return n;
}

/* Reads stdout until one full line arrived; the child has at most a few
 * minutes (valgrind is slow to start), then the start counts as failed. */
static int read_port(int fd, int *port) {
  char line[256];
  size_t len = 0;
  while (len < sizeof line - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 180000);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t n = read(fd, line + len, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    if (line[len] == '\n') break;
    len++;
  }
  line[len] = '\0';
  const char *prefix = "dispatch-server listening on 127.0.0.1:";
  if (strncmp(line, prefix, strlen(prefix)) != 0) return -1;
  int p = atoi(line + strlen(prefix));
  if (p <= 0 || p > 65535) return -1;
  *port = p;
  return 0;
}

static int status_of(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

int sp_start(sp_server *s, const char *const *extra_args) {
  memset(s, 0, sizeof *s);
  s->out_fd = -1;
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin) return -1;
  char wrap[1024] = "";
  const char *w = getenv("DISPATCH_SERVER_WRAP");
  if (w) snprintf(wrap, sizeof wrap, "%s", w);
  char *argv[SP_MAX_ARGS + 1];
  int argc = split_words(wrap, argv, SP_MAX_ARGS - 4);
  argv[argc++] = (char *)bin;
  argv[argc++] = "--listen";
  argv[argc++] = "127.0.0.1:0";
  for (int i = 0; extra_args && extra_args[i] && argc < SP_MAX_ARGS; i++)
    argv[argc++] = (char *)extra_args[i];
  argv[argc] = NULL;

  int pfd[2];
  if (pipe(pfd) < 0) return -1;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(pfd[0]);
    close(pfd[1]);
    return -1;
  }
  if (pid == 0) {
    /* a test process that dies without stopping its server (Criterion
     * kills a test past its .timeout) takes the server with it: a server
     * left running would keep the suite's output pipe open and hang
     * whatever waits for it (make, CI) instead of failing */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
      _exit(127);
    dup2(pfd[1], 1);
    close(pfd[0]);
    close(pfd[1]);
    execvp(argv[0], argv);
    _exit(127);
  }
  close(pfd[1]);
  s->pid = pid;
  s->out_fd = pfd[0];
  if (read_port(s->out_fd, &s->port) < 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(s->out_fd);
    s->pid = 0;
    s->out_fd = -1;
    return -1;
  }
  return 0;
}

int sp_signal(sp_server *s, int sig) {
  if (s->pid <= 0) return -1;
  return kill(s->pid, sig) == 0 ? 0 : -1;
}

int sp_wait(sp_server *s) {
  if (s->pid <= 0) return -1;
  int st;
  pid_t r;
  do {
    r = waitpid(s->pid, &st, 0);
  } while (r < 0 && errno == EINTR);
  s->pid = 0;
  if (s->out_fd >= 0) close(s->out_fd);
  s->out_fd = -1;
  return r < 0 ? -1 : status_of(st);
}

int sp_start_logged(sp_server *s, const char *const *extra_args,
                    int log_fd) {
  fflush(stderr);
  int saved = dup(2);
  if (saved < 0 || log_fd < 0 || dup2(log_fd, 2) < 0) {
    if (saved >= 0) close(saved);
    return -1;
  }
  int rc = sp_start(s, extra_args);
  dup2(saved, 2);
  close(saved);
  return rc;
}

int sp_stop(sp_server *s) {
  if (sp_signal(s, SIGTERM) < 0) return -1;
  return sp_wait(s);
}

int sp_run_capture(const char *const *args, char *out, size_t len) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin || len == 0) return -1;
  int pfd[2];
  if (pipe(pfd) < 0) return -1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(pfd[0]);
    close(pfd[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(pfd[1], 1);
    dup2(pfd[1], 2);
    close(pfd[0]);
    close(pfd[1]);
    const char *argv[32];
    int n = 0;
    argv[n++] = bin;
    for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
    argv[n] = NULL;
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(pfd[1]);
  size_t got = 0;
  for (;;) {
    struct pollfd p = {pfd[0], POLLIN, 0};
    if (poll(&p, 1, 60000) <= 0) { /* a server that serves: stop it */
      kill(pid, SIGKILL);
      break;
    }
    char sink[4096];
    int full = got == len - 1;
    ssize_t r = full ? read(pfd[0], sink, sizeof sink)
                     : read(pfd[0], out + got, len - 1 - got);
    if (r <= 0) break;
    if (!full) got += (size_t)r;
  }
  out[got] = '\0';
  close(pfd[0]);
  int st;
  pid_t w;
  do {
    w = waitpid(pid, &st, 0);
  } while (w < 0 && errno == EINTR);
  return w < 0 ? -1 : status_of(st);
}

void sp_use_build_plugin(void) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  const char *set = getenv("DISPATCH_CUDA_PLUGIN");
  if (!bin || !*bin || (set && *set)) return;
  const char *slash = strrchr(bin, '/');
  char path[4096];
  int n = slash ? (int)(slash - bin) : 1;
  snprintf(path, sizeof path, "%.*s/dispatch-cuda.so", n, slash ? bin : ".");
  setenv("DISPATCH_CUDA_PLUGIN", path, 1);
}
