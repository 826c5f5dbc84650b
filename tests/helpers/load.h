/* The load driver shared by tests/test_load.c (reduced size, in make test)
 * and bench/load.c (full size, in make bench): many libdispatch-client
 * sessions at once against one dispatch-server, every value read checked
 * against what this process computes locally, the server's RSS sampled
 * from /proc/PID/status throughout.
 *
 * A small client runs rounds of 10 library calls each (two uploads, a
 * track, a mul, a sum, a backward, a grad and three reads: x*w, the sum
 * and the gradient, which must be x), inside a scope so the server frees
 * each round's tensors. Inputs are small integers that depend on the
 * client and the round, so every product and sum is exact and a reply
 * that went to the wrong request or session would not match. A big
 * client uploads an i64 tensor of big_bytes, sums it and reads the sum
 * and the tail of the tensor, big_rounds times. */
#ifndef LOAD_H
#define LOAD_H

#include <stddef.h>
#include <stdint.h>

typedef struct load_cfg {
  const char *spec; /* "tcp://127.0.0.1:PORT" */
  long server_pid;  /* for VmRSS; 0: not sampled */
  int clients;      /* small clients */
  int ops;          /* library calls per small client (rounds of 10) */
  int big_clients;
  size_t big_bytes; /* per big upload, a multiple of 8 */
  int big_rounds;
} load_cfg;

typedef struct load_result {
  long long ops;         /* library calls that returned success */
  long long waits;       /* of them, calls that wait for a reply */
  long long errors;      /* calls that failed */
  long long mismatches;  /* reads whose values differ from the local ones */
  double seconds;        /* wall time of the whole run */
  double ops_per_s;      /* ops / seconds */
  double p50_us, p99_us; /* latency of the waiting calls (reads, backward) */
  long long rss_before;  /* server VmRSS before the clients connect */
  long long rss_peak;    /* the largest sample during the run */
  char first_error[256]; /* the first failure, "" when none */
} load_result;

/* Runs the load; 0 when every call succeeded and every value matched,
 * -1 otherwise (details in *out). */
int load_run(const load_cfg *cfg, load_result *out);

/* VmRSS of pid in bytes, -1 when it cannot be read. */
long long load_rss(long pid);

#endif
