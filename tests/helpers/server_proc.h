/* Test helper: run the real dispatch-server binary as a child process.
 *
 * sp_start runs `$DISPATCH_SERVER_BIN --listen 127.0.0.1:0 <extra_args>`
 * (prefixed by the words of $DISPATCH_SERVER_WRAP when set, e.g.
 * "valgrind --leak-check=full --error-exitcode=99"), reads the one line
 * "dispatch-server listening on 127.0.0.1:PORT" from its stdout and fills
 * s->port. Returns 0, or -1 when the binary is not set, cannot start, or
 * exits before printing its port (s is then left stopped).
 *
 * sp_stop sends SIGTERM, waits for the child and returns its exit status
 * (0..255), 128+signal when it died from a signal, or -1 on error.
 * sp_stop on a stopped server returns -1. Neither function fails the
 * running test itself: callers assert on the return values. */
#ifndef SERVER_PROC_H
#define SERVER_PROC_H

#include <stddef.h>
#include <sys/types.h>

typedef struct sp_server {
  pid_t pid;   /* 0 when not running */
  int port;    /* the port the server listens on (127.0.0.1) */
  int out_fd;  /* read end of the child's stdout, kept open until stop */
} sp_server;

int sp_start(sp_server *s, const char *const *extra_args);
/* sp_start with the server's stderr (its log) written to log_fd instead
 * of this process's stderr, for tests that read what the server logs;
 * log_fd stays the caller's. Same return values (-1 also when stderr
 * cannot be saved). */
int sp_start_logged(sp_server *s, const char *const *extra_args, int log_fd);
int sp_stop(sp_server *s);
/* Sends sig without waiting (for SIGINT tests); 0 or -1. */
int sp_signal(sp_server *s, int sig);
/* Waits for exit after sp_signal; same return values as sp_stop. */
int sp_wait(sp_server *s);

/* Runs `$DISPATCH_SERVER_BIN args...` to its end with stdout and stderr
 * captured together into out (NUL-terminated; what does not fit is read
 * and dropped, so a long output never meets a closed pipe). A server that
 * starts serving instead of exiting is killed after 60 s of silence.
 * Returns its exit status, 128+signal, or -1 when it could not be run. */
int sp_run_capture(const char *const *args, char *out, size_t len);

/* Points DISPATCH_CUDA_PLUGIN at dispatch-cuda.so beside
 * $DISPATCH_SERVER_BIN (the build tree's build/dispatch-cuda.so) unless it
 * is already set, for programs of build/tests/ whose own folder the
 * plugin loader does not search. */
void sp_use_build_plugin(void);

#endif
