/* bench/bench.h: what every benchmark program shares. Header-only on
 * purpose: the Makefile builds each bench/<name>.c into its own binary, so a
 * shared .c would become a program of its own.
 *
 * A program prints one CSV row per figure on stdout, in the columns of
 * BENCH_CSV_HEADER, and its diagnostics on stderr; scripts/bench.sh joins
 * the rows into bench/results.csv and prints them as a table. Each row
 * carries our figure, the reference measured in the same process run, and
 * their ratio ours/reference; a goal, when the issue sets one, is checked
 * against that ratio (or against our figure) and reported as met or not.
 * A figure that could not be measured is written "n/a" with the reason in
 * the note column, never a made-up number.
 *
 * Remote rows need a server: env DISPATCH_BENCH_REMOTE holds its spec
 * ("tcp://127.0.0.1:PORT") and DISPATCH_BENCH_SERVER_PID its pid.
 */
#ifndef BENCH_H
#define BENCH_H

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"

#define BENCH_CSV_HEADER \
  "section,metric,ours,unit,reference,ref_value,ratio,goal,met,note"

/* Monotonic seconds; only differences mean anything. */
static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int bench_cmp_double_(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Quantile q in [0,1] of v[0..n-1] (sorts v in place; nearest rank, so
 * the value is one that was really measured). NaN for n == 0. */
static inline double bench_quantile(double *v, int n, double q) {
  if (n <= 0) return NAN;
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double_);
  int i = (int)ceil(q * n) - 1;
  if (i < 0) i = 0;
  if (i >= n) i = n - 1;
  return v[i];
}
static inline double bench_median(double *v, int n) {
  return bench_quantile(v, n, 0.5);
}

/* How a row's goal is judged. */
typedef enum bench_goal {
  BENCH_GOAL_NONE,     /* reported, no goal */
  BENCH_GOAL_RATIO_LE, /* ours/ref <= goal */
  BENCH_GOAL_RATIO_GE, /* ours/ref >= goal */
  BENCH_GOAL_OURS_GE   /* ours >= goal (an absolute target) */
} bench_goal;

/* Writes s into a CSV field: commas and newlines would break the row. */
static inline void bench_csv_field_(const char *s) {
  for (; s && *s; s++) putchar(*s == ',' || *s == '\n' ? ';' : *s);
}

static inline void bench_num_(double v) {
  if (isnan(v) || isinf(v))
    fputs("n/a", stdout);
  else if (fabs(v) >= 100 || v == 0)
    printf("%.0f", v);
  else if (fabs(v) >= 1)
    printf("%.3g", v);
  else
    printf("%.3g", v);
}

/* Prints one row. ours or ref may be NAN (not measured: say why in note).
 * The ratio is always ours/ref. */
static inline void bench_row(const char *section, const char *metric,
                             double ours, const char *unit,
                             const char *ref_name, double ref,
                             bench_goal goal, double goal_value,
                             const char *note_fmt, ...) {
  double ratio = (isnan(ours) || isnan(ref) || ref == 0) ? NAN : ours / ref;
  char goal_s[64] = "", note[512] = "";
  const char *met = "";
  if (note_fmt) {
    va_list ap;
    va_start(ap, note_fmt);
    vsnprintf(note, sizeof note, note_fmt, ap);
    va_end(ap);
  }
  switch (goal) {
    case BENCH_GOAL_NONE:
      break;
    case BENCH_GOAL_RATIO_LE:
      snprintf(goal_s, sizeof goal_s, "ratio<=%g", goal_value);
      met = isnan(ratio) ? "n/a" : ratio <= goal_value ? "yes" : "NO";
      break;
    case BENCH_GOAL_RATIO_GE:
      snprintf(goal_s, sizeof goal_s, "ratio>=%g", goal_value);
      met = isnan(ratio) ? "n/a" : ratio >= goal_value ? "yes" : "NO";
      break;
    case BENCH_GOAL_OURS_GE:
      snprintf(goal_s, sizeof goal_s, "ours>=%g", goal_value);
      met = isnan(ours) ? "n/a" : ours >= goal_value ? "yes" : "NO";
      break;
  }
  bench_csv_field_(section);
  putchar(',');
  bench_csv_field_(metric);
  putchar(',');
  bench_num_(ours);
  putchar(',');
  bench_csv_field_(unit);
  putchar(',');
  bench_csv_field_(ref_name ? ref_name : "-");
  putchar(',');
  if (ref_name)
    bench_num_(ref);
  else
    fputs("-", stdout);
  putchar(',');
  if (ref_name)
    bench_num_(ratio);
  else
    fputs("-", stdout);
  putchar(',');
  bench_csv_field_(goal_s);
  putchar(',');
  bench_csv_field_(met);
  putchar(',');
  bench_csv_field_(note);
  putchar('\n');
  fflush(stdout);
}

/* Spec of the server to measure, or NULL when none was started. */
static inline const char *bench_remote_spec(void) {
  const char *s = getenv("DISPATCH_BENCH_REMOTE");
  return s && *s ? s : NULL;
}

/* Opens spec; on failure prints why and returns NULL, with the reason in
 * why[0..why_len-1] for the rows' note. */
static inline dispatch_device *bench_open(const char *spec, char *why,
                                          size_t why_len) {
  dispatch_device *dev = NULL;
  char msg[256] = "";
  if (!spec) {
    snprintf(why, why_len, "no server (DISPATCH_BENCH_REMOTE unset)");
    return NULL;
  }
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  if (rc < 0) {
    snprintf(why, why_len, "open %s: %s: %s", spec, dispatch_err_name(rc),
             msg);
    fprintf(stderr, "bench: %s\n", why);
    return NULL;
  }
  return dev;
}

/* Resident set size of pid in bytes (VmRSS of /proc/PID/status), or -1. */
static inline long long bench_rss_bytes(long pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%ld/status", pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  long long kb = -1;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "VmRSS:", 6) == 0) {
      kb = strtoll(line + 6, NULL, 10);
      break;
    }
  fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

/* ------------------------------------------------------------------ */
/* raw loopback reference: a 16-byte-header protocol over plain TCP     */

/* Request header, the size of a dispatch frame header: cmd at offset 0,
 * length at offset 8. ECHO sends the header back (ping-pong); PUT reads
 * len bytes into the server's buffer, then answers a header; GET writes
 * len bytes from the buffer. */
enum {
  BENCH_RAW_ECHO = 0,
  BENCH_RAW_PUT = 1,
  BENCH_RAW_GET = 2,
  /* PUT into a buffer malloc'd for this request and freed after: what a
   * receiver that allocates per transfer pays in page faults */
  BENCH_RAW_PUT_FRESH = 3
};
#define BENCH_RAW_HDR 16

typedef struct bench_raw {
  int lfd;
  int port;
  pid_t pid; /* the child process serving it */
  int running;
  unsigned char *buf; /* the child's: receives PUTs, feeds GETs */
  size_t cap;
} bench_raw;

static inline int bench_write_all(int fd, const void *p, size_t n) {
  const unsigned char *c = p;
  while (n) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

static inline int bench_read_all(int fd, void *p, size_t n) {
  unsigned char *c = p;
  while (n) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    c += r;
    n -= (size_t)r;
  }
  return 0;
}

static inline void bench_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Serves connections one after another until the listener is shut. */
static void bench_raw_serve_(bench_raw *r) {
  for (;;) {
    int fd = accept(r->lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;
    }
    bench_nodelay(fd);
    unsigned char h[BENCH_RAW_HDR];
    while (bench_read_all(fd, h, sizeof h) == 0) {
      uint32_t cmd;
      uint64_t len;
      memcpy(&cmd, h, 4);
      memcpy(&len, h + 8, 8);
      if (len > r->cap) break;
      if (cmd == BENCH_RAW_ECHO) {
        if (bench_write_all(fd, h, sizeof h) < 0) break;
      } else if (cmd == BENCH_RAW_PUT) {
        if (bench_read_all(fd, r->buf, len) < 0) break;
        if (bench_write_all(fd, h, sizeof h) < 0) break;
      } else if (cmd == BENCH_RAW_PUT_FRESH) {
        unsigned char *fresh = malloc(len ? len : 1);
        int bad = !fresh || bench_read_all(fd, fresh, len) < 0;
        free(fresh);
        if (bad || bench_write_all(fd, h, sizeof h) < 0) break;
      } else if (cmd == BENCH_RAW_GET) {
        if (bench_write_all(fd, r->buf, len) < 0) break;
      } else {
        break;
      }
    }
    close(fd);
  }
}

/* Starts the raw server on 127.0.0.1:0 in a child process, as
 * dispatch-server is another process than its client, with a cap-byte
 * buffer whose pages it touches up front so a PUT does not pay for faults
 * the reference should not have. Returns 0 or -1. */
static inline int bench_raw_start(bench_raw *r, size_t cap) {
  memset(r, 0, sizeof *r);
  r->cap = cap;
  r->lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (r->lfd < 0) goto fail;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof a;
  if (bind(r->lfd, (struct sockaddr *)&a, sizeof a) < 0 ||
      listen(r->lfd, 16) < 0 ||
      getsockname(r->lfd, (struct sockaddr *)&a, &al) < 0)
    goto fail;
  r->port = ntohs(a.sin_port);
  r->pid = fork();
  if (r->pid < 0) goto fail;
  if (r->pid == 0) { /* the buffer is the child's own, touched up front */
    r->buf = malloc(cap ? cap : 1);
    if (!r->buf) _exit(1);
    memset(r->buf, 1, cap);
    bench_raw_serve_(r);
    _exit(0);
  }
  r->running = 1;
  return 0;
fail:
  if (r->lfd >= 0) close(r->lfd);
  return -1;
}

/* A client connection to the raw server (TCP_NODELAY), or -1. */
static inline int bench_raw_connect(const bench_raw *r) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons((uint16_t)r->port);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    close(fd);
    return -1;
  }
  bench_nodelay(fd);
  return fd;
}

/* The raw client waits for a reply the way libdispatch-client does
 * (client/remote.c): it polls the socket for DISPATCH_SPIN_US (default
 * 50) before it sleeps, so the reference and dispatch differ in protocol
 * and server work, not in how the client thread waits. */
static inline void bench_spin_until_readable(int fd) {
  static long us = -1; /* read once, as the client does: not in the timing */
  if (us < 0) {
    const char *e = getenv("DISPATCH_SPIN_US");
    us = e && *e ? strtol(e, NULL, 10) : 50;
    if (us < 0) us = 0;
  }
  struct pollfd pfd = {fd, POLLIN, 0};
  double end = bench_now() + (double)us * 1e-6;
  while (us > 0 && poll(&pfd, 1, 0) == 0 && bench_now() < end) {
  }
}

/* One raw request; PUT sends len bytes of data, GET reads len into data. */
static inline int bench_raw_call(int fd, uint32_t cmd, void *data,
                                 uint64_t len) {
  unsigned char h[BENCH_RAW_HDR] = {0};
  memcpy(h, &cmd, 4);
  memcpy(h + 8, &len, 8);
  if (bench_write_all(fd, h, sizeof h) < 0) return -1;
  if (cmd == BENCH_RAW_PUT || cmd == BENCH_RAW_PUT_FRESH) {
    if (bench_write_all(fd, data, len) < 0) return -1;
    return bench_read_all(fd, h, sizeof h);
  }
  bench_spin_until_readable(fd);
  if (cmd == BENCH_RAW_GET) return bench_read_all(fd, data, len);
  return bench_read_all(fd, h, sizeof h);
}

/* Stops the server; every client connection must be closed first. */
static inline void bench_raw_stop(bench_raw *r) {
  if (!r->running) return;
  shutdown(r->lfd, SHUT_RDWR);
  close(r->lfd);
  kill(r->pid, SIGTERM);
  waitpid(r->pid, NULL, 0);
  r->running = 0;
}

#endif
