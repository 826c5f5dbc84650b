/* Every byte a session makes the server hold is charged to it: one test
 * per route a hostile client used to run the server out of memory (conv
 * scratch, the autodiff tape, retained gradients, a backward intermediate,
 * many empty or poisoned ids, queued decoded requests, many sessions
 * against --max-memory). Each drives its route to the limit through a real
 * server started with small caps and checks the DISPATCH_EQUOTA error and
 * its text, that the session still works, and that the server's resident
 * memory stays within the caps plus MARGIN and returns near its baseline
 * once the session ends.
 *
 * The server runs with --storage-cache 0 and glibc's mmap threshold fixed
 * at 128 KiB (GLIBC_TUNABLES), so freed tensors go back to the system at
 * once and RSS means what the sessions hold. Under AddressSanitizer the
 * allocator keeps freed memory in quarantine: the RSS checks are skipped
 * there, the error checks are not. Each test prints its figures. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#if defined(__SANITIZE_ADDRESS__)
#define RSS_CHECKS_BUILD 0
#else
#define RSS_CHECKS_BUILD 1
#endif
/* and not when the server runs under a wrapper (valgrind) */
#define RSS_CHECKS                                                           \
  (RSS_CHECKS_BUILD && !(getenv("DISPATCH_SERVER_WRAP") &&                   \
                         *getenv("DISPATCH_SERVER_WRAP")))

#define MiB (1024ull * 1024ull)
/* what the server may hold beyond its caps: code, libc and OpenBLAS
 * buffers touched after the baseline, socket buffers, one frame */
#define MARGIN (24 * MiB)

static sp_server g_srv;

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

/* A clean shutdown: exit status 0 (a sanitizer's leak report or a crash
 * would change it). */
static void stop_checked(void) {
  cr_assert_eq(sp_stop(&g_srv), 0, "server did not shut down cleanly");
}

/* Starts the server with the common settings plus extra (NULL ended). */
static void start(const char *const *extra) {
  if (!getenv("DISPATCH_SERVER_BIN") || !*getenv("DISPATCH_SERVER_BIN"))
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
  const char *args[32] = {"--log-level", "error", "--storage-cache", "0"};
  int n = 4;
  for (int i = 0; extra[i] && n < 31; i++) args[n++] = extra[i];
  args[n] = NULL;
  setenv("GLIBC_TUNABLES",
         "glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold="
         "131072",
         1);
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

/* A field of /proc/PID/status in bytes (VmRSS, VmHWM). */
static uint64_t proc_bytes(const char *field) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)g_srv.pid);
  FILE *f = fopen(path, "r");
  cr_assert_not_null(f);
  uint64_t kib = 0;
  size_t fl = strlen(field);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, fl) == 0 && line[fl] == ':')
      kib = strtoull(line + fl + 1, NULL, 10);
  fclose(f);
  return kib * 1024;
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "memory"), 0);
}

static Dspwire__StatsReply stats(wire_conn *c) {
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(c, &st), 0);
  return st;
}

/* The resident size once a small matmul ran (OpenBLAS sets up its
 * buffers on first use), with no session holding anything. */
static uint64_t baseline(void) {
  wire_conn c;
  connect_hello(&c);
  float v[64 * 64] = {0};
  int64_t s[2] = {64, 64};
  wire_upload(&c, 1, DSP_F32, 2, s, v, sizeof v);
  uint64_t in[2] = {1, 1};
  wire_op(&c, DSP_OP_MATMUL, in, 2, 2, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
  /* the session's teardown runs after the close is seen */
  for (int i = 0; i < 200; i++) {
    wire_conn p;
    connect_hello(&p);
    Dspwire__StatsReply st = stats(&p);
    wire_close(&p);
    if (st.sessions == 1) break;
    usleep(10000);
  }
  return proc_bytes("VmRSS");
}

/* Checks the peak against base + cap + MARGIN. */
static void check_peak(const char *route, uint64_t base, uint64_t cap) {
  uint64_t hwm = proc_bytes("VmHWM");
  fprintf(stderr, "memory %s: baseline %.1f MiB, peak %+.1f MiB (cap %.1f)\n",
          route, base / (double)MiB, ((double)hwm - base) / MiB,
          cap / (double)MiB);
  if (RSS_CHECKS)
    cr_assert_leq(hwm, base + cap + MARGIN,
                  "%s: peak RSS %llu bytes, baseline %llu, cap %llu", route,
                  (unsigned long long)hwm, (unsigned long long)base,
                  (unsigned long long)cap);
}

/* After every session ended: nothing is charged any more and RSS comes
 * back within MARGIN of the baseline (a bounded wait: teardown runs on a
 * worker after the close is seen). */
static void check_settles(const char *route, uint64_t base) {
  uint64_t rss = 0, held = 1;
  for (int i = 0; i < 300; i++) {
    wire_conn p;
    connect_hello(&p);
    Dspwire__StatsReply st = stats(&p);
    wire_close(&p);
    rss = proc_bytes("VmRSS");
    held = st.sessions == 1
               ? st.server_held_bytes - st.held_bytes - st.queued_bytes
               : 1;
    if (held == 0 && (!RSS_CHECKS || rss < base + MARGIN)) break;
    usleep(20000);
  }
  fprintf(stderr, "memory %s: after the session %+.1f MiB\n", route,
          ((double)rss - base) / MiB);
  cr_assert_eq(held, 0, "%s: sessions that ended still hold %llu bytes",
               route, (unsigned long long)held);
  if (RSS_CHECKS)
    cr_assert_lt(rss, base + MARGIN, "%s: RSS %llu after, baseline %llu",
                 route, (unsigned long long)rss, (unsigned long long)base);
}

/* A sync's deferred error must be DISPATCH_EQUOTA naming the session's
 * holding and its limit. */
static void expect_quota(wire_conn *c, const char *limit, const char *want) {
  char msg[700];
  cr_assert_eq(wire_sync_check(c, msg, sizeof msg, NULL), DISPATCH_EQUOTA,
               "%s", msg);
  cr_assert(strstr(msg, limit), "%s", msg);
  cr_assert(strstr(msg, "holds"), "%s", msg);
  if (want) cr_assert(strstr(msg, want), "%s", msg);
}

/* Sends a backward and returns its reply's error code (0: none). */
static int backward(wire_conn *c, uint64_t loss, uint64_t grads, int retain,
                    char *msg, size_t len) {
  uint64_t id = wire_backward(c, loss, grads, retain);
  cr_assert_neq(id, 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, id);
  int code = r->error ? r->error->code : 0;
  if (msg) snprintf(msg, len, "%s", r->error ? r->error->message : "");
  wire_reply_free(r, NULL);
  return code;
}

static void upload_f32(wire_conn *c, uint64_t id, int ndim,
                       const int64_t *shape, const float *v) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  cr_assert_neq(wire_upload(c, id, DSP_F32, ndim, shape, v,
                            (size_t)n * sizeof *v),
                0);
}

/* The session still computes: a small upload, an op and a read. */
static void still_works(wire_conn *c, uint64_t id) {
  float v[4] = {1, 2, 3, 4}, *got;
  int64_t s[1] = {4};
  upload_f32(c, id, 1, s, v);
  uint64_t in[2] = {id, id};
  wire_op(c, DSP_OP_ADD, in, 2, id + 1, NULL, 0, NULL, 0);
  size_t n;
  cr_assert_eq(wire_read_tensor(c, id + 1, (void **)&got, &n, NULL, NULL), 0);
  cr_assert_eq(n, sizeof v);
  for (int i = 0; i < 4; i++) cr_assert_float_eq(got[i], 2 * v[i], 0);
  free(got);
}

/* ------------------------------------------------------------ routes */

/* A 512x512 image with a 16x16 kernel needs a [256, 497*497] im2col
 * matrix, 253 MiB, for a 1 MiB input: the kernel builds it in blocks of a
 * few MiB (forward and both backward ops), within a 16 MiB quota, and
 * the results are those of the direct sums. */
Test(memory, conv_scratch_is_built_in_blocks, .fini = cleanup,
     .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "16777216", "--threads", "1",
                        NULL};
  start(args);
  uint64_t base = baseline();
  enum { H = 512, K = 16, O = H - K + 1 };
  float *x = malloc(sizeof(float) * H * H), w[K * K];
  cr_assert_not_null(x);
  for (int i = 0; i < H * H; i++) x[i] = (float)((i * 7919) % 13) - 6.0f;
  for (int i = 0; i < K * K; i++) w[i] = (float)(i % 5) - 2.0f;
  wire_conn c;
  connect_hello(&c);
  int64_t sx[4] = {1, 1, H, H}, sw[4] = {1, 1, K, K};
  upload_f32(&c, 1, 4, sx, x);
  upload_f32(&c, 2, 4, sw, w);
  wire_track(&c, 1);
  wire_track(&c, 2);
  uint64_t in[2] = {1, 2};
  wire_op(&c, DSP_OP_CONV2D, in, 2, 3, NULL, 0, NULL, 0);
  uint64_t y[1] = {3};
  wire_op(&c, DSP_OP_SUM, y, 1, 4, NULL, 0, NULL, 0);
  char msg[700];
  cr_assert_eq(backward(&c, 4, 1, 0, msg, sizeof msg), 0, "%s", msg);
  wire_grad(&c, 1, 1, 5);
  wire_grad(&c, 1, 2, 6);
  float *got;
  size_t n;
  /* forward: a few output pixels against the direct sum */
  cr_assert_eq(wire_read_tensor(&c, 3, (void **)&got, &n, NULL, NULL), 0);
  cr_assert_eq(n, sizeof(float) * O * O);
  for (int p = 0; p < O * O; p += 4099) {
    int oh = p / O, ow = p % O;
    double sum = 0;
    for (int i = 0; i < K; i++)
      for (int j = 0; j < K; j++) sum += x[(oh + i) * H + ow + j] * w[i * K + j];
    cr_assert_float_eq(got[p], sum, 1e-3, "y[%d] %g != %g", p, got[p], sum);
  }
  free(got);
  /* d sum / d w[i,j] is the sum of x over the window shifted by (i,j) */
  cr_assert_eq(wire_read_tensor(&c, 6, (void **)&got, &n, NULL, NULL), 0);
  for (int i = 0; i < K; i += 5)
    for (int j = 0; j < K; j += 3) {
      double sum = 0;
      for (int oh = 0; oh < O; oh++)
        for (int ow = 0; ow < O; ow++) sum += x[(oh + i) * H + ow + j];
      cr_assert_float_eq(got[i * K + j], sum, 1e-2 * (1 + fabs(sum)),
                         "dw[%d,%d] %g != %g", i, j, got[i * K + j], sum);
    }
  free(got);
  /* d sum / d x[h,w] sums w over the kernel taps that reach (h,w) */
  cr_assert_eq(wire_read_tensor(&c, 5, (void **)&got, &n, NULL, NULL), 0);
  for (int p = 0; p < H * H; p += 3203) {
    int h = p / H, ww = p % H;
    double sum = 0;
    for (int i = 0; i < K; i++)
      for (int j = 0; j < K; j++)
        if (h - i >= 0 && h - i < O && ww - j >= 0 && ww - j < O)
          sum += w[i * K + j];
    cr_assert_float_eq(got[p], sum, 1e-3, "dx[%d] %g != %g", p, got[p], sum);
  }
  free(got);
  free(x);
  check_peak("conv scratch", base, 16 * MiB);
  wire_close(&c);
  check_settles("conv scratch", base);
  stop_checked();
}

/* Freed intermediates stay on the tape: each mul saves its 4 MiB input.
 * Before, 48 such ops held 791 MiB while Stats said 32 MiB. */
Test(memory, tape_counts_freed_intermediates, .fini = cleanup,
     .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "33554432", NULL};
  start(args);
  uint64_t base = baseline();
  enum { N = 1 << 20 };
  float *v = calloc(N, sizeof *v);
  cr_assert_not_null(v);
  for (int i = 0; i < N; i++) v[i] = 1.0f;
  wire_conn c;
  connect_hello(&c);
  int64_t s[1] = {N};
  upload_f32(&c, 1, 1, s, v);
  free(v);
  wire_track(&c, 1);
  /* each step frees the previous output, as the attack did; a sync per
   * step finds the one that fails, whose input stays the live tip */
  uint64_t k;
  char msg[700];
  int rc = 0;
  for (k = 2; k < 2 + 24; k++) {
    uint64_t in[2] = {k - 1, k - 1};
    wire_op(&c, DSP_OP_MUL, in, 2, k, NULL, 0, NULL, 0);
    rc = wire_sync_check(&c, msg, sizeof msg, NULL);
    if (rc != 0) break;
    if (k > 2) {
      uint64_t f[1] = {k - 1};
      wire_free(&c, f, 1, NULL, 0);
    }
  }
  cr_assert_eq(rc, DISPATCH_EQUOTA, "%llu ops: %s", (unsigned long long)k,
               msg);
  cr_assert(strstr(msg, "limit of 33554432 bytes (--max-session-bytes)"),
            "%s", msg);
  cr_assert(strstr(msg, "session holds"), "%s", msg);
  Dspwire__StatsReply st = stats(&c);
  cr_assert_leq(st.held_bytes, 32 * MiB);
  cr_assert_gt(st.held_bytes, 24 * MiB, "held %llu",
               (unsigned long long)st.held_bytes);
  cr_assert_eq(st.session_limit, 32 * MiB);
  check_peak("tape", base, 32 * MiB);
  /* freeing the live tip (and the poisoned id) releases the whole chain */
  uint64_t f[2] = {k - 1, k};
  wire_free(&c, f, 2, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  st = stats(&c);
  cr_assert_lt(st.held_bytes, 5 * MiB, "held %llu",
               (unsigned long long)st.held_bytes);
  still_works(&c, 100);
  wire_close(&c);
  check_settles("tape", base);
  stop_checked();
}

/* Each retained backward keeps a gradient container with a 4 MiB
 * gradient: they are charged, so the ninth does not fit 32 MiB. */
Test(memory, retained_gradients_are_charged, .fini = cleanup,
     .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "33554432", NULL};
  start(args);
  uint64_t base = baseline();
  enum { N = 1 << 20 };
  float *v = calloc(N, sizeof *v);
  cr_assert_not_null(v);
  wire_conn c;
  connect_hello(&c);
  int64_t s[1] = {N};
  upload_f32(&c, 1, 1, s, v);
  free(v);
  wire_track(&c, 1);
  uint64_t in[1] = {1};
  wire_op(&c, DSP_OP_SUM, in, 1, 2, NULL, 0, NULL, 0);
  char msg[700];
  int code = 0, k;
  for (k = 0; k < 32 && code == 0; k++)
    code = backward(&c, 2, 100 + (uint64_t)k, 1, msg, sizeof msg);
  cr_assert_eq(code, DISPATCH_EQUOTA, "%d backward passes retained: %s", k,
               msg);
  cr_assert(strstr(msg, "session holds"), "%s", msg);
  cr_assert(strstr(msg, "--max-session-bytes"), "%s", msg);
  cr_assert_geq(k, 4);
  check_peak("retained grads", base, 32 * MiB);
  /* freeing the containers makes room again */
  uint64_t g[32];
  for (int i = 0; i < k - 1; i++) g[i] = 100 + (uint64_t)i;
  wire_free(&c, NULL, 0, g, k - 1);
  cr_assert_eq(backward(&c, 2, 200, 1, msg, sizeof msg), 0, "%s", msg);
  still_works(&c, 300);
  wire_close(&c);
  check_settles("retained grads", base);
  stop_checked();
}

/* The backward of a [1,256,256] x [256,256,1] matmul builds a
 * [256,256,256] product (64 MiB) from 512 KiB of inputs: refused by the
 * 16 MiB budget where it is allocated, and the session goes on. */
Test(memory, backward_intermediate_is_charged, .fini = cleanup,
     .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "16777216", NULL};
  start(args);
  uint64_t base = baseline();
  enum { M = 256 };
  float *v = calloc(M * M, sizeof *v);
  cr_assert_not_null(v);
  wire_conn c;
  connect_hello(&c);
  int64_t sa[3] = {1, M, M}, sb[3] = {M, M, 1};
  upload_f32(&c, 1, 3, sa, v);
  upload_f32(&c, 2, 3, sb, v);
  free(v);
  wire_track(&c, 1);
  wire_track(&c, 2);
  uint64_t in[2] = {1, 2}, y[1] = {3};
  wire_op(&c, DSP_OP_MATMUL, in, 2, 3, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_SUM, y, 1, 4, NULL, 0, NULL, 0);
  char msg[700];
  cr_assert_eq(backward(&c, 4, 10, 0, msg, sizeof msg), DISPATCH_EQUOTA,
               "%s", msg);
  cr_assert(strstr(msg, "session holds"), "%s", msg);
  cr_assert(strstr(msg, "limit of 16777216 bytes"), "%s", msg);
  check_peak("matmul backward", base, 16 * MiB);
  /* nothing was released by the failed pass: the graph is intact */
  Dspwire__StatsReply st = stats(&c);
  cr_assert_lt(st.held_bytes, 2 * MiB, "held %llu",
               (unsigned long long)st.held_bytes);
  still_works(&c, 20);
  wire_close(&c);
  check_settles("matmul backward", base);
  stop_checked();
}

/* Empty tensors and poisoned ids hold an entry, a header and a message
 * each (~230 B before: 800k ids, +187 MiB): they are charged. */
Test(memory, empty_and_poisoned_ids_are_charged, .fini = cleanup,
     .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "4194304", NULL};
  start(args);
  uint64_t base = baseline();
  wire_conn c;
  connect_hello(&c);
  enum { IDS = 40000 };
  int64_t zeros[2] = {DSP_F32, 0};
  for (uint64_t id = 1; id <= IDS; id++)
    cr_assert_neq(wire_op(&c, DSP_OP_ZEROS, NULL, 0, id, zeros, 2, NULL, 0),
                  0);
  expect_quota(&c, "limit of 4194304 bytes (--max-session-bytes)", NULL);
  Dspwire__StatsReply st = stats(&c);
  cr_assert_lt(st.tensors, IDS);
  cr_assert_gt(st.tensors, 1000);
  cr_assert_leq(st.held_bytes, 4 * MiB);
  fprintf(stderr, "memory ids: %llu empty tensors fit 4 MiB\n",
          (unsigned long long)st.tensors);
  /* poisoned ids: failing ops with fresh output ids, while full */
  uint64_t missing[1] = {999999999};
  for (uint64_t id = IDS + 1; id <= 2 * IDS; id++)
    wire_op(&c, DSP_OP_NEG, missing, 1, id, NULL, 0, NULL, 0);
  wire_sync_check(&c, NULL, 0, NULL);
  st = stats(&c);
  cr_assert_leq(st.held_bytes, 4 * MiB);
  /* free every id (unknown ones give ENOID), then poison with room */
  static uint64_t all[2 * IDS];
  for (uint64_t i = 0; i < 2 * IDS; i++) all[i] = i + 1;
  wire_free(&c, all, 2 * IDS, NULL, 0);
  wire_sync_check(&c, NULL, 0, NULL);
  st = stats(&c);
  cr_assert_lt(st.held_bytes, 64 * 1024, "held %llu",
               (unsigned long long)st.held_bytes);
  for (uint64_t id = 1; id <= IDS; id++)
    wire_op(&c, DSP_OP_NEG, missing, 1, id, NULL, 0, NULL, 0);
  wire_sync_check(&c, NULL, 0, NULL);
  st = stats(&c);
  cr_assert_gt(st.held_bytes, 2 * MiB, "poisoned ids are charged: %llu",
               (unsigned long long)st.held_bytes);
  cr_assert_leq(st.held_bytes, 4 * MiB);
  check_peak("ids", base, 4 * MiB);
  wire_free(&c, all, IDS, NULL, 0);
  wire_sync_check(&c, NULL, 0, NULL);
  still_works(&c, 3 * IDS);
  wire_close(&c);
  check_settles("ids", base);
  stop_checked();
}

/* A Free of 2M packed one-byte ids is a 2 MiB frame that decodes to
 * 16 MiB: over an 8 MiB queue budget even alone, so it fails with a
 * deferred DISPATCH_EQUOTA instead of being decoded. */
Test(memory, a_request_that_decodes_over_the_budget_fails,
     .fini = cleanup, .timeout = 300) {
  const char *args[] = {"--max-queued-bytes", "8388608", NULL};
  start(args);
  uint64_t base = baseline();
  enum { IDS = 2 << 20 };
  uint64_t *ids = malloc(sizeof *ids * IDS);
  cr_assert_not_null(ids);
  for (int i = 0; i < IDS; i++) ids[i] = 7;
  wire_conn c;
  connect_hello(&c);
  uint64_t rid = wire_free(&c, ids, IDS, NULL, 0);
  free(ids);
  char msg[700];
  uint64_t failed;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed),
               DISPATCH_EQUOTA, "%s", msg);
  cr_assert_eq(failed, rid);
  cr_assert(strstr(msg, "decoding the request"), "%s", msg);
  cr_assert(strstr(msg, "limit of 8388608 bytes (--max-queued-bytes)"),
            "%s", msg);
  check_peak("one large request", base, 8 * MiB);
  still_works(&c, 1);
  wire_close(&c);
  check_settles("one large request", base);
  stop_checked();
}

/* Behind slow ops, sixteen 1 MiB Free frames of packed ids (8 MiB each
 * decoded) wait for queue budget instead of all being decoded at once
 * (+128 MiB before); every one still runs, in order. */
Test(memory, queued_requests_are_charged, .fini = cleanup, .timeout = 300) {
  const char *args[] = {"--max-queued-bytes", "16777216", "--threads", "1",
                        NULL};
  start(args);
  uint64_t base = baseline();
  enum { M = 768, IDS = 1 << 20, FRAMES = 16 };
  float *v = calloc(M * M, sizeof *v);
  uint64_t *ids = malloc(sizeof *ids * IDS);
  cr_assert(v && ids);
  wire_conn c;
  connect_hello(&c);
  int64_t s[2] = {M, M};
  upload_f32(&c, 1, 2, s, v);
  upload_f32(&c, 2, 2, s, v);
  free(v);
  uint64_t in[2] = {1, 2};
  for (uint64_t k = 0; k < 4; k++)
    wire_op(&c, DSP_OP_MATMUL, in, 2, 10 + k, NULL, 0, NULL, 0);
  for (int f = 0; f < FRAMES; f++) {
    for (int i = 0; i < IDS; i++) ids[i] = 100 + (uint64_t)f;
    cr_assert_neq(wire_free(&c, ids, IDS, NULL, 0), 0);
  }
  free(ids);
  char msg[700];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_ENOID,
               "%s", msg);
  cr_assert(strstr(msg, "free: tensor id 100 does not exist"), "%s", msg);
  Dspwire__StatsReply st = stats(&c);
  cr_assert_eq(st.errors, FRAMES, "every Free ran: %llu errors",
               (unsigned long long)st.errors);
  /* 13.5 MiB of tensors, 16 MiB of queue */
  check_peak("queued requests", base, 30 * MiB);
  still_works(&c, 50);
  wire_close(&c);
  check_settles("queued requests", base);
  stop_checked();
}

/* Two sessions of a 32 MiB quota under --max-memory 48 MiB: the second's
 * 24 MiB upload would pass the server's cap and fails naming it; the
 * session goes on, and once the first frees its tensor it fits. */
Test(memory, max_memory_caps_all_sessions, .fini = cleanup, .timeout = 300) {
  const char *args[] = {"--max-session-bytes", "33554432", "--max-memory",
                        "50331648", NULL};
  start(args);
  uint64_t base = baseline();
  enum { N = 6 << 20 };
  float *v = calloc(N, sizeof *v);
  cr_assert_not_null(v);
  wire_conn a, b;
  connect_hello(&a);
  connect_hello(&b);
  int64_t s[1] = {N};
  upload_f32(&a, 1, 1, s, v);
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  upload_f32(&b, 1, 1, s, v);
  expect_quota(&b, "limit of 50331648 bytes (--max-memory)", "server holds");
  Dspwire__StatsReply st = stats(&b);
  cr_assert_eq(st.server_limit, 48 * MiB);
  cr_assert_gt(st.server_held_bytes, 24 * MiB);
  cr_assert_leq(st.server_held_bytes, 48 * MiB);
  still_works(&b, 10);
  uint64_t f[1] = {1};
  wire_free(&a, f, 1, NULL, 0);
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  upload_f32(&b, 2, 1, s, v);
  cr_assert_eq(wire_sync_check(&b, NULL, 0, NULL), 0);
  free(v);
  check_peak("max-memory", base, 48 * MiB);
  wire_close(&a);
  wire_close(&b);
  check_settles("max-memory", base);
  stop_checked();
}
