/* bench/bench.h: what every benchmark program shares. Header-only on
 * purpose: the Makefile builds each bench/<name>.c into its own binary, so a
 * shared .c would become a program of its own.
 *
 * A program prints one CSV row per figure on stdout, in the columns of
 * BENCH_CSV_HEADER, and its diagnostics on stderr; scripts/bench.sh joins
 * the rows into bench/results.csv and prints them as a table. A row comes
 * from n repetitions, each measuring our figure and its reference in the
 * same minutes (bench_turn rotates the order of variants per repetition):
 * it carries the medians, min and max of ours, and the median and
 * quartiles of the per-repetition ratios ours/reference. The verdict
 * (bench_verdict) is met or missed only when the goal lies outside that
 * interquartile range, unclear when it lies inside (the spread does not
 * support a verdict; programs repeat while a row is unclear, to a cap),
 * and REF SUSPECT when dispatch beats a reference that is a limit by more
 * than 5%: such a reference is not the best a plain implementation does.
 * A figure that could not be measured is written "n/a" with the reason in
 * the note column, never a made-up number.
 *
 * Remote rows need a server: env DISPATCH_BENCH_REMOTE holds its spec
 * ("tcp://127.0.0.1:PORT") and DISPATCH_BENCH_SERVER_PID its pid; raw
 * socket references need bench/raw_server, named by DISPATCH_BENCH_RAW.
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

#include "cpu/par.h"
#include "dispatch_client.h"

#define BENCH_CSV_HEADER                                                   \
  "section,metric,ours,ours_min,ours_max,unit,reference,ref_value,ratio," \
  "ratio_q1,ratio_q3,reps,goal,verdict,note"

/* n bytes in t seconds, in MB/s (10^6 bytes); NAN when t is not positive */
static inline double bench_mbps(size_t n, double t) {
  return t > 0 ? (double)n / t / 1e6 : NAN;
}

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

/* BENCH_QUICK=1 (make bench-quick): tiny sizes and a rep or two, so CI can
 * check every program still runs and prints every row; no goal is judged
 * on such figures. */
static inline int bench_quick(void) {
  const char *e = getenv("BENCH_QUICK");
  return e && *e && strcmp(e, "0") != 0;
}

/* Variant k's turn within repetition r when there are nvar variants: the
 * order rotates by one each repetition, so no variant always runs right
 * after another one's leftovers (spinning BLAS threads, a warm cache, a
 * socket's grown window). Returns the variant to run at position k. */
static inline int bench_turn(int r, int k, int nvar) {
  if (r < 0) r = 0;
  return (k + r) % nvar;
}

/* How a row's goal is judged. */
typedef enum bench_goal {
  BENCH_GOAL_NONE,     /* reported, no goal */
  BENCH_GOAL_RATIO_LE, /* ours/ref <= goal */
  BENCH_GOAL_RATIO_GE, /* ours/ref >= goal */
  BENCH_GOAL_OURS_GE   /* ours >= goal (an absolute target) */
} bench_goal;

/* What one row measures and how it is judged. */
typedef struct bench_def {
  const char *section, *metric, *unit;
  int lower_better;     /* the figure is a time: smaller is better */
  const char *ref_name; /* NULL: the row has no reference */
  /* the reference is a limit dispatch cannot honestly beat (the same bytes
   * over a plain socket, the same BLAS call, the same step without the
   * wire): a median ratio more than BENCH_SUSPECT better than it means
   * the reference is wrong, and the row says REF SUSPECT */
  int ref_is_limit;
  bench_goal goal;
  double goal_value;
} bench_def;

#define BENCH_SUSPECT 1.05
/* fewer paired repetitions than this never carry a verdict */
#define BENCH_MIN_VERDICT_REPS 5

/* The per-repetition ratios ours[i]/ref[i] into out; returns how many. */
static inline int bench_ratios_(const double *ours, const double *ref, int n,
                                double *out) {
  int k = 0;
  for (int i = 0; ours && ref && i < n; i++)
    if (isfinite(ours[i]) && isfinite(ref[i]) && ref[i] != 0)
      out[k++] = ours[i] / ref[i];
  return k;
}

/* Summary of a row's n paired samples. */
typedef struct bench_sum {
  int n;                   /* samples of ours that are numbers */
  double ours, omin, omax; /* median, min, max of ours */
  double oq1, oq3;         /* quartiles of ours */
  double ref;              /* median of the reference */
  double ratio, rq1, rq3;  /* median and quartiles of ours[i]/ref[i] */
} bench_sum;

static inline bench_sum bench_summarize(const double *ours, const double *ref,
                                        int n) {
  bench_sum s = {0, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
  double *a = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  double *b = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!a || !b) {
    free(a);
    free(b);
    return s;
  }
  int k = 0;
  for (int i = 0; ours && i < n; i++)
    if (isfinite(ours[i])) a[k++] = ours[i];
  s.n = k;
  if (k) {
    s.omin = bench_quantile(a, k, 0);
    s.omax = bench_quantile(a, k, 1);
    s.ours = bench_quantile(a, k, 0.5);
    s.oq1 = bench_quantile(a, k, 0.25);
    s.oq3 = bench_quantile(a, k, 0.75);
  }
  k = 0;
  for (int i = 0; ref && i < n; i++)
    if (isfinite(ref[i])) b[k++] = ref[i];
  if (k) s.ref = bench_quantile(b, k, 0.5);
  k = bench_ratios_(ours, ref, n, a);
  if (k) {
    s.ratio = bench_quantile(a, k, 0.5);
    s.rq1 = bench_quantile(a, k, 0.25);
    s.rq3 = bench_quantile(a, k, 0.75);
  }
  free(a);
  free(b);
  return s;
}

/* The verdict on a row: "" (no goal, nothing suspect), "REF SUSPECT"
 * (dispatch beats a limit by more than 5% at the median), "met" / "missed"
 * (the goal lies outside the interquartile range of the per-repetition
 * ratios, on one side or the other: at least three quarters of the paired
 * repetitions agree), "unclear" (the goal falls inside that range, or too
 * few repetitions: the spread does not support a verdict), "n/a" (not
 * measured) or "quick" (BENCH_QUICK: nothing judged). */
static inline const char *bench_verdict(const bench_def *d, bench_sum s) {
  double ratio = s.ratio;
  if (bench_quick()) return d->goal == BENCH_GOAL_NONE ? "" : "quick";
  if (d->ref_is_limit && isfinite(ratio) &&
      (d->lower_better ? ratio < 1 / BENCH_SUSPECT : ratio > BENCH_SUSPECT))
    return "REF SUSPECT";
  if (d->goal == BENCH_GOAL_NONE) return "";
  double lo = d->goal == BENCH_GOAL_OURS_GE ? s.oq1 : s.rq1;
  double hi = d->goal == BENCH_GOAL_OURS_GE ? s.oq3 : s.rq3;
  if (isnan(lo) || isnan(hi)) return "n/a";
  if (s.n < BENCH_MIN_VERDICT_REPS) return "unclear";
  double g = d->goal_value;
  if (d->goal == BENCH_GOAL_RATIO_LE)
    return hi <= g ? "met" : lo > g ? "missed" : "unclear";
  return lo >= g ? "met" : hi < g ? "missed" : "unclear";
}

/* Whether more repetitions could still change the row's verdict: its goal
 * is neither met nor missed yet, or it says REF SUSPECT while its
 * interquartile range still reaches back inside the 5% line (a suspect
 * row is confirmed or cleared, not left to one noisy median). A row with
 * neither a goal nor a limit never asks for more. */
static inline int bench_unsettled(const bench_def *d, const double *ours,
                                  const double *ref, int n) {
  if (bench_quick()) return 0;
  bench_sum s = bench_summarize(ours, ref, n);
  const char *v = bench_verdict(d, s);
  if (strcmp(v, "unclear") == 0) return 1;
  if (strcmp(v, "REF SUSPECT") == 0)
    return d->lower_better ? !(s.rq3 < 1 / BENCH_SUSPECT)
                           : !(s.rq1 > BENCH_SUSPECT);
  return 0;
}

/* Writes s into a CSV field: commas and newlines would break the row. */
static inline void bench_csv_field_(const char *s) {
  for (; s && *s; s++) putchar(*s == ',' || *s == '\n' ? ';' : *s);
}

static inline void bench_num_(double v) {
  if (isnan(v) || isinf(v))
    fputs("n/a", stdout);
  else if (fabs(v) >= 100 || v == 0)
    printf("%.0f", v);
  else
    printf("%.3g", v);
}

/* Prints one row from n paired repetitions: ours[i] and ref[i] were
 * measured in the same repetition (ref NULL when d has no reference; a
 * NAN sample is one that was not measured, say why in the note). The
 * figures are medians, the spread is min/max of ours and the quartiles of
 * the per-repetition ratios ours[i]/ref[i], whose median is the ratio. */
static inline void bench_emit(const bench_def *d, const double *ours,
                              const double *ref, int n, const char *note_fmt,
                              ...) {
  bench_sum s = bench_summarize(ours, d->ref_name ? ref : NULL, n);
  char goal_s[64] = "", note[600] = "";
  if (note_fmt) {
    va_list ap;
    va_start(ap, note_fmt);
    vsnprintf(note, sizeof note, note_fmt, ap);
    va_end(ap);
  }
  switch (d->goal) {
    case BENCH_GOAL_NONE:
      break;
    case BENCH_GOAL_RATIO_LE:
      snprintf(goal_s, sizeof goal_s, "ratio<=%.3g", d->goal_value);
      break;
    case BENCH_GOAL_RATIO_GE:
      snprintf(goal_s, sizeof goal_s, "ratio>=%.3g", d->goal_value);
      break;
    case BENCH_GOAL_OURS_GE:
      snprintf(goal_s, sizeof goal_s, "ours>=%g", d->goal_value);
      break;
  }
  const char *verdict = bench_verdict(d, s);
  bench_csv_field_(d->section);
  putchar(',');
  bench_csv_field_(d->metric);
  putchar(',');
  bench_num_(s.ours);
  putchar(',');
  bench_num_(s.omin);
  putchar(',');
  bench_num_(s.omax);
  putchar(',');
  bench_csv_field_(d->unit);
  putchar(',');
  bench_csv_field_(d->ref_name ? d->ref_name : "-");
  putchar(',');
  if (d->ref_name) {
    bench_num_(s.ref);
    putchar(',');
    bench_num_(s.ratio);
    putchar(',');
    bench_num_(s.rq1);
    putchar(',');
    bench_num_(s.rq3);
  } else {
    fputs("-,-,-,-", stdout);
  }
  printf(",%d,", s.n);
  bench_csv_field_(goal_s);
  putchar(',');
  bench_csv_field_(verdict);
  putchar(',');
  bench_csv_field_(note);
  putchar('\n');
  fflush(stdout);
}

/* A row of one measurement each (server RSS, say): the spread is that
 * one value. */
static inline void bench_emit1(const bench_def *d, double ours, double ref,
                               const char *note) {
  bench_emit(d, &ours, &ref, 1, note ? "%s" : NULL, note);
}

/* Whether a repetition loop goes on: always below min_reps, never at
 * max_reps, and in between while a goal of the rows it feeds is still
 * unclear and the time budget lasts. */
static inline int bench_more(int n, int min_reps, int max_reps,
                             double elapsed, double budget, int unsettled) {
  if (n < min_reps) return 1;
  if (n >= max_reps) return 0;
  return unsettled && elapsed < budget;
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
 * len bytes from the buffer. The server is bench/raw_server.c, its own
 * process, which scripts/bench.sh starts the way it starts
 * dispatch-server and names in DISPATCH_BENCH_RAW ("127.0.0.1:PORT"). */
enum {
  BENCH_RAW_ECHO = 0,
  BENCH_RAW_PUT = 1,
  BENCH_RAW_GET = 2,
  /* PUT into a buffer malloc'd for this request and freed after: what a
   * receiver that allocates per transfer pays in page faults */
  BENCH_RAW_PUT_FRESH = 3
};
#define BENCH_RAW_HDR 16

/* How the raw client waits for bytes. A reference is the better of the
 * two, per row, so it is the best a plain socket does here, whichever way
 * of waiting suits this machine and size. */
typedef enum bench_wait {
  /* blocking write() and read(): the thread sleeps in the kernel until
   * bytes arrive, no spinning */
  BENCH_WAIT_BLOCK = 0,
  /* what libdispatch-client does (client/conn.c, wait.c): non-blocking send
   * that polls for POLLOUT when the buffer is full; before reading, and
   * again after every recv that finds nothing mid-payload, poll(0) in a
   * loop for DISPATCH_SPIN_US (default 50) and then sleep in poll() */
  BENCH_WAIT_CLIENT = 1,
  /* the same without the spin, as the client waits when its policy
   * spins for nothing (client/wait.c: a loopback server on fewer than 3
   * cores, or replies slower than any spin): blocking reads stood for
   * that, and were much the slower way (a 64 MiB GET at 2.7 GB/s against
   * 3.8-4.2 GB/s polling, and dispatch's read at 4.3 GB/s) */
  BENCH_WAIT_POLL = 2
} bench_wait;
#define BENCH_NWAIT 3
static const char *const bench_wait_name[BENCH_NWAIT] = {
    "blocking", "client-like", "client-like without spin"};

/* Blocking sends of at most BENCH_RAW_PIECE bytes each, the pieces
 * dispatch's server and client send in (SV_WRITE_PIECE, SEND_PIECE). One
 * send of a whole 64 MiB payload made the raw GET 2.7-3.0 GB/s, which
 * dispatch beat (3.4 GB/s): the sender holds the socket for the whole
 * call while the peer's acknowledgements wait. In pieces the same GET ran
 * at 4.4 GB/s (1 MiB), 5.2 (256 KiB, one run; but a 1 MiB GET then fell
 * from 6.9 to 4.1 GB/s), 3.9 (4 MiB). */
#define BENCH_RAW_PIECE ((size_t)1 << 20)
static inline int bench_write_all(int fd, const void *p, size_t n) {
  const unsigned char *c = p;
  while (n) {
    ssize_t w = send(fd, c, n < BENCH_RAW_PIECE ? n : BENCH_RAW_PIECE,
                     MSG_NOSIGNAL);
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

/* The spin of the client-like raw variant: DISPATCH_SPIN_US (default 50,
 * 0 = off, at most 10000), read once so no getenv lands inside a timing.
 * The client itself now picks its spin per connection (client/wait.c: none
 * on a loopback server with fewer than 3 usable cores, else about twice
 * the recent reply latency); the blocking variant stands for "no spin",
 * and each row takes the better of the two, so the reference is at least
 * as good as the client's own policy on either side of that rule. */
static inline long bench_spin_us(void) {
  static long us = -1;
  if (us < 0) {
    const char *e = getenv("DISPATCH_SPIN_US");
    us = e && *e ? strtol(e, NULL, 10) : 50;
    if (us < 0) us = 0;
    if (us > 10000) us = 10000;
  }
  return us;
}

/* The client's wait_readable: spin on poll(0) for us microseconds, then
 * sleep in poll(). */
static inline int bench_wait_readable_(int fd, long us) {
  struct pollfd pfd = {fd, POLLIN, 0};
  if (us > 0) {
    double end = bench_now() + (double)us * 1e-6;
    do {
      if (poll(&pfd, 1, 0) > 0) return 0;
    } while (bench_now() < end);
  }
  for (;;) {
    int pr = poll(&pfd, 1, 10000);
    if (pr > 0) return 0;
    if (pr == 0 || errno != EINTR) return -1;
  }
}

/* The client's send_all: non-blocking sends, poll for room when full. */
static inline int bench_send_client_(int fd, const void *p, size_t n) {
  const unsigned char *c = p;
  while (n) {
    ssize_t w = send(fd, c, n < BENCH_RAW_PIECE ? n : BENCH_RAW_PIECE,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      c += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    struct pollfd pfd = {fd, POLLOUT, 0};
    if (poll(&pfd, 1, 10000) <= 0 && errno != EINTR) return -1;
  }
  return 0;
}

/* The client's recv_all for a reply that cannot have arrived yet: wait
 * first, then non-blocking recvs, waiting (spin included) again whenever
 * one finds nothing. */
static inline int bench_recv_client_(int fd, void *p, size_t n,
                                     long spin_us) {
  unsigned char *c = p;
  int wait_first = 1;
  while (n) {
    if (wait_first && bench_wait_readable_(fd, spin_us) < 0) return -1;
    ssize_t r = recv(fd, c, n, MSG_DONTWAIT);
    if (r > 0) {
      c += r;
      n -= (size_t)r;
      wait_first = 0;
      continue;
    }
    if (r == 0) return -1;
    if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    wait_first = 1;
  }
  return 0;
}

/* "IPV4:PORT" into *a; 0, or -1 when there is no colon or the host is not
 * an IPv4 literal (the raw server and its clients take nothing else). */
static inline int bench_ipv4_addr(const char *hostport, struct sockaddr_in *a) {
  const char *colon = hostport ? strrchr(hostport, ':') : NULL;
  if (!colon) return -1;
  char host[64];
  size_t hl = (size_t)(colon - hostport);
  if (hl >= sizeof host) hl = sizeof host - 1;
  memcpy(host, hostport, hl);
  host[hl] = 0;
  memset(a, 0, sizeof *a);
  a->sin_family = AF_INET;
  a->sin_port = htons((uint16_t)atoi(colon + 1));
  return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

/* A connection to the raw server named by DISPATCH_BENCH_RAW (TCP_NODELAY,
 * as dispatch's), or -1 with the reason in why. */
static inline int bench_raw_connect(char *why, size_t why_len) {
  const char *e = getenv("DISPATCH_BENCH_RAW");
  if (!e || !*e) {
    snprintf(why, why_len, "no raw server (DISPATCH_BENCH_RAW unset)");
    return -1;
  }
  struct sockaddr_in a;
  if (bench_ipv4_addr(e, &a) < 0) {
    snprintf(why, why_len, "raw server address %s is not IPV4:PORT", e);
    return -1;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    snprintf(why, why_len, "connect raw server %s: %s", e, strerror(errno));
    if (fd >= 0) close(fd);
    return -1;
  }
  bench_nodelay(fd);
  return fd;
}

/* One raw request waited for in the given way; PUT sends len bytes of
 * data and reads the answering header, GET reads len bytes into data,
 * ECHO reads the header back. 0 or -1. */
static inline int bench_raw_call(int fd, uint32_t cmd, void *data,
                                 uint64_t len, bench_wait how) {
  unsigned char h[BENCH_RAW_HDR] = {0};
  memcpy(h, &cmd, 4);
  memcpy(h + 8, &len, 8);
  int put = cmd == BENCH_RAW_PUT || cmd == BENCH_RAW_PUT_FRESH;
  /* a small payload leaves with its header in one send, as
   * libdispatch-client sends a frame with a bulk of up to 64 KiB (two
   * sends cost the reference a second syscall and segment: dispatch beat
   * it twofold at 4 KiB) */
  static _Thread_local unsigned char one[BENCH_RAW_HDR + (64u << 10)];
  const void *first = h;
  size_t first_len = sizeof h;
  if (put && len <= 64u << 10) {
    memcpy(one, h, sizeof h);
    if (len) memcpy(one + sizeof h, data, len);
    first = one;
    first_len = sizeof h + len;
    put = 0; /* sent with the header */
  }
  if (how == BENCH_WAIT_BLOCK) {
    if (bench_write_all(fd, first, first_len) < 0) return -1;
    if (put && bench_write_all(fd, data, len) < 0) return -1;
    if (cmd == BENCH_RAW_GET) return bench_read_all(fd, data, len);
    return bench_read_all(fd, h, sizeof h);
  }
  long spin = how == BENCH_WAIT_CLIENT ? bench_spin_us() : 0;
  if (bench_send_client_(fd, first, first_len) < 0) return -1;
  if (put && bench_send_client_(fd, data, len) < 0) return -1;
  if (cmd == BENCH_RAW_GET) return bench_recv_client_(fd, data, len, spin);
  return bench_recv_client_(fd, h, sizeof h, spin);
}

/* Of nvar variants' samples t[v][0..n-1] (times: smaller is better),
 * the index of the one with the smallest median: the reference a row
 * uses. */
static inline int bench_best_variant(double *const *t, int nvar, int n) {
  int best = 0;
  double bm = INFINITY;
  double *tmp = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!tmp) return 0;
  for (int v = 0; v < nvar; v++) {
    memcpy(tmp, t[v], sizeof(double) * (size_t)n);
    double m = bench_median(tmp, n);
    if (m < bm) {
      bm = m;
      best = v;
    }
  }
  free(tmp);
  return best;
}

/* n threads for what runs next in this process: OpenBLAS called directly
 * (the plain-C and raw BLAS variants) and the LOCAL device's kernels (the
 * CPU backend's pool, which runs OpenBLAS single-threaded in its chunks
 * and so ignores OpenBLAS's own setting). */
extern void openblas_set_num_threads(int n);
static inline void bench_threads(int n) {
  openblas_set_num_threads(n);
  dsp__par_set_threads(n);
}

#endif
