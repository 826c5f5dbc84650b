/* Bounded work per request (issue 9 item 7), through a real server:
 * - the per-op cost limit (--max-op-cost) refuses a 512x512-window pool on
 *   a 1024x1024 input with DISPATCH_ELIMIT naming the estimate and the
 *   limit, and the session goes on; the limit also covers the helper ops a
 *   remote backward pass runs;
 * - fairness: with one worker, a session whose chain holds such an op
 *   does not hold the worker; another session is answered while the chain
 *   is still running;
 * - cancellation: a client that leaves while its long op runs frees the
 *   worker (the op is cancelled, which the server logs), and SIGTERM during
 *   a long op exits promptly.
 * Waits are bounded (generously) for things that must happen; nothing
 * asserts on how long something took. The server's stderr goes to a file
 * so a test can wait for "running request N" and "cancelled" lines. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#define WAIT_S 60 /* a bound on what must happen, not a timing check */

static sp_server g_srv;
static char g_log[64];

/* Starts the server with its stderr in a fresh temporary file (g_log). */
static void start_logged(const char *const *args) {
  if (!getenv("DISPATCH_SERVER_BIN") || !*getenv("DISPATCH_SERVER_BIN"))
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
  snprintf(g_log, sizeof g_log, "/tmp/dsp-fairness-XXXXXX");
  int fd = mkstemp(g_log);
  cr_assert_geq(fd, 0);
  int rc = sp_start_logged(&g_srv, args, fd);
  close(fd);
  if (rc != 0) unlink(g_log); /* .fini does not run after a failed .init */
  cr_assert_eq(rc, 0, "server did not start");
}

/* SIGTERM, then waits up to WAIT_S seconds for the exit; 0 and *status
 * when it exited, -1 when it had to be killed (a server stuck in an op
 * that was not cancelled). */
static int stop_bounded(int *status) {
  if (sp_signal(&g_srv, SIGTERM) < 0) return -1;
  pid_t got = 0;
  int st = 0;
  for (int i = 0; i < WAIT_S * 20 && got == 0; i++) {
    got = waitpid(g_srv.pid, &st, WNOHANG);
    if (got == 0) usleep(50000);
  }
  if (got <= 0) {
    sp_signal(&g_srv, SIGKILL);
    sp_wait(&g_srv);
    return -1;
  }
  g_srv.pid = 0;
  close(g_srv.out_fd);
  g_srv.out_fd = -1;
  *status = st;
  return 0;
}

static void cleanup(void) {
  int st;
  if (g_srv.pid > 0) {
    cr_expect_eq(stop_bounded(&st), 0, "server still running %d s after "
                 "SIGTERM", WAIT_S);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
  }
  if (*g_log) unlink(g_log);
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "fairness"), 0);
}

/* 1 when the server's log contains needle (read whole each time). */
static int log_has(const char *needle) {
  FILE *f = fopen(g_log, "rb");
  if (!f) return 0;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap + 1);
  size_t k;
  while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
    n += k;
    if (n == cap) {
      char *nb = realloc(buf, 2 * cap + 1);
      if (!nb) break;
      buf = nb;
      cap *= 2;
    }
  }
  fclose(f);
  if (!buf) return 0;
  buf[n] = '\0';
  int found = strstr(buf, needle) != NULL;
  free(buf);
  return found;
}

/* Waits up to WAIT_S seconds for needle in the log. */
static int wait_log(const char *needle) {
  for (int i = 0; i < WAIT_S * 20; i++) {
    if (log_has(needle)) return 1;
    usleep(50000);
  }
  return 0;
}

/* Waits up to WAIT_S seconds for a reply to be readable on c. */
static int wait_readable(wire_conn *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN};
  int r;
  do {
    r = poll(&p, 1, WAIT_S * 1000);
  } while (r < 0 && errno == EINTR);
  return r > 0;
}

/* x = f32 [1, C, 1024, 1024] of zeros as id 1, synced. */
static void upload_image(wire_conn *c, int64_t ch) {
  size_t n = (size_t)ch * 1024 * 1024;
  float *d = calloc(n, sizeof *d);
  cr_assert_not_null(d);
  int64_t s[4] = {1, ch, 1024, 1024};
  cr_assert_neq(wire_upload(c, 1, DSP_F32, 4, s, d, n * sizeof *d), 0);
  free(d);
  cr_assert_eq(wire_sync_check(c, NULL, 0, NULL), 0);
}

/* The attack of the issue: a 512x512 window at stride 1 over id 1, into
 * id out: (1024-512+1)^2 outputs per channel, 512*512 loads each. */
static uint64_t huge_pool(wire_conn *c, uint64_t out) {
  int64_t ints[4] = {512, 512, 1, 1};
  uint64_t in[1] = {1};
  return wire_op(c, DSP_OP_MAX_POOL2D, in, 1, out, ints, 4, NULL, 0);
}

/* ------------------------------------------------------------ cost limit */

static void start_default(void) {
  const char *args[] = {"--log-level", "info", "--threads", "2", NULL};
  start_logged(args);
}

TestSuite(op_cost, .init = start_default, .fini = cleanup);

/* Refused before it runs, with both numbers; the session goes on. */
Test(op_cost, huge_pool_is_refused_and_session_goes_on) {
  wire_conn c;
  connect_hello(&c);
  Dspwire__StatsReply before, after;
  cr_assert_eq(wire_get_stats(&c, &before), 0);
  upload_image(&c, 1);
  huge_pool(&c, 2);
  char msg[640];
  int code = wire_sync_check(&c, msg, sizeof msg, NULL);
  cr_assert_eq(code, DISPATCH_ELIMIT, "code %d: %s", code, msg);
  /* 263169 outputs * 262144 window loads + 263169 outputs written */
  cr_assert(strstr(msg, "max_pool2d: estimated 68988437505 elementary "
                        "operations, over the per-op limit of 17179869184 "
                        "(dispatch-server --max-op-cost)") != NULL,
            "message: %s", msg);
  /* the session goes on: a realistic pool runs and reads back */
  int64_t ints[2] = {2, 2};
  uint64_t in[1] = {1};
  wire_op(&c, DSP_OP_MAX_POOL2D, in, 1, 3, ints, 2, NULL, 0);
  void *data;
  size_t n;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&c, 3, &data, &n, &ndim, shape), 0);
  cr_assert_eq(ndim, 4);
  cr_assert_eq(shape[2], 512);
  cr_assert_eq(n, (size_t)512 * 512 * 4);
  free(data);
  cr_assert_eq(wire_read_tensor(&c, 2, &data, &n, NULL, NULL),
               DISPATCH_EPOISONED);
  cr_assert_eq(wire_get_stats(&c, &after), 0);
  cr_assert_eq(after.limit_violations, before.limit_violations + 1);
  wire_close(&c);
}

static void start_small_limit(void) {
  const char *args[] = {"--log-level", "info", "--max-op-cost", "1000000",
                        NULL};
  start_logged(args);
}

TestSuite(op_cost_backward, .init = start_small_limit, .fini = cleanup);

/* index_select of one row of a [4096, 256] tensor is cheap forward, but
 * its backward helper op writes the whole [4096, 256] gradient: the
 * limit refuses it inside the one Backward request. */
Test(op_cost_backward, backward_helper_ops_are_limited) {
  wire_conn c;
  connect_hello(&c);
  size_t n = 4096 * 256;
  float *d = calloc(n, sizeof *d);
  cr_assert_not_null(d);
  int64_t s[2] = {4096, 256}, s1[1] = {1}, zero[1] = {0};
  wire_upload(&c, 1, DSP_F32, 2, s, d, n * sizeof *d);
  free(d);
  wire_upload(&c, 2, DSP_I64, 1, s1, zero, sizeof zero);
  wire_track(&c, 1);
  int64_t dim0[1] = {0};
  uint64_t sel_in[2] = {1, 2}, sum_in[1] = {3};
  wire_op(&c, DSP_OP_INDEX_SELECT, sel_in, 2, 3, dim0, 1, NULL, 0);
  wire_op(&c, DSP_OP_SUM, sum_in, 1, 4, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0, "forward refused");
  uint64_t rid = wire_backward(&c, 4, 50, 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_not_null(r->error, "backward ran past the limit");
  cr_assert_eq(r->error->code, DISPATCH_ELIMIT, "%s", r->error->message);
  cr_assert(strstr(r->error->message,
                   "index_select_backward: estimated 1048832 elementary "
                   "operations, over the per-op limit of 1000000") != NULL,
            "message: %s", r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
}

/* ------------------------------------------------------------ fairness */

static void start_one_thread(void) {
  const char *args[] = {"--log-level", "info", "--threads", "1", NULL};
  start_logged(args);
}

TestSuite(fairness, .init = start_one_thread, .fini = cleanup);

/* With one worker, A queues the huge pool and then a chain of 30 256^3
 * matmuls; B's read is answered while A's chain is still running (B waits
 * for at most about one op of A, because every op is bounded), which
 * before the cost limit took the whole pool (minutes). */
Test(fairness, other_session_answered_within_a_bounded_op) {
  wire_conn a, b;
  connect_hello(&a);
  connect_hello(&b);
  Dspwire__StatsReply base, st;
  cr_assert_eq(wire_get_stats(&b, &base), 0);
  upload_image(&a, 1);
  enum { N = 256, OPS = 30 };
  float *d = calloc(N * N, sizeof *d);
  for (int i = 0; i < N * N; i++) d[i] = (float)(i % 13) * 0.01f;
  int64_t s[2] = {N, N};
  wire_upload(&a, 5, DSP_F32, 2, s, d, (size_t)N * N * 4);
  free(d);
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  huge_pool(&a, 2);
  uint64_t in[2] = {5, 5};
  for (int i = 0; i < OPS; i++)
    wire_op(&a, DSP_OP_MATMUL, in, 2, 100 + (uint64_t)i, NULL, 0, NULL, 0);
  uint64_t sid = wire_sync(&a); /* answered last, with the pool's error */
  float one[1] = {42};
  int64_t s1[1] = {1};
  wire_upload(&b, 7, DSP_F32, 1, s1, one, 4);
  uint64_t rid = wire_read(&b, 7);
  cr_assert(wait_readable(&b), "B not answered within %d s", WAIT_S);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&b, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_null(r->error);
  cr_assert_eq(*(float *)bulk, 42.0f);
  wire_reply_free(r, bulk);
  cr_assert_eq(wire_get_stats(&b, &st), 0);
  /* A holds x, its matrix and the matmuls done so far; B holds one */
  cr_assert_geq(st.server_tensors, base.server_tensors + 3);
  uint64_t a_done = st.server_tensors - base.server_tensors - 3;
  cr_assert_lt(a_done, OPS, "B waited for all %d of A's ops", OPS);
  cr_assert(wait_readable(&a), "A's chain did not finish");
  cr_assert_eq(wire_recv(&a, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, sid);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_ELIMIT);
  wire_reply_free(r, NULL);
  wire_close(&a);
  wire_close(&b);
}

/* ------------------------------------------------------------ cancel */

static void start_unlimited(void) {
  /* debug: the worker logs each request it starts; no cost limit, so the
   * 2.8e11-operation pool below runs (for minutes) until cancelled; a
   * SIGTERM drains for 1 s before it cancels (the default 30 s would only
   * make the wait longer) */
  const char *args[] = {"--log-level", "debug",  "--threads", "1",
                        "--max-op-cost", "0", "--drain-timeout", "1", NULL};
  start_logged(args);
}

TestSuite(cancel, .init = start_unlimited, .fini = cleanup);

/* Starts the huge pool on 4 channels in session a and waits until the
 * worker runs it; returns its request id. */
static uint64_t start_long_op(wire_conn *a) {
  upload_image(a, 4);
  uint64_t rid = huge_pool(a, 2);
  char line[96];
  snprintf(line, sizeof line, "running request %llu (op max_pool2d",
           (unsigned long long)rid);
  cr_assert(wait_log(line), "the pool did not start");
  return rid;
}

/* A leaves while its op runs: the op is cancelled, the only worker is
 * free again and answers B; the op never finished (no "ok" for it: the
 * log says it was cancelled, and A's output id was never made). */
Test(cancel, disconnect_cancels_running_op) {
  wire_conn a, b;
  connect_hello(&a);
  uint64_t rid = start_long_op(&a);
  wire_close(&a);
  connect_hello(&b);
  /* an upload needs the worker (a sync of an idle session is answered on
   * the loop thread), and the sync waits for it */
  float one[1] = {1};
  int64_t s1[1] = {1};
  wire_upload(&b, 7, DSP_F32, 1, s1, one, 4);
  uint64_t sid = wire_sync(&b);
  cr_assert(wait_readable(&b), "worker still busy %d s after A left",
            WAIT_S);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&b, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, sid);
  cr_assert_null(r->error);
  wire_reply_free(r, NULL);
  char line[128];
  snprintf(line, sizeof line, "request %llu (op max_pool2d [1] -> 2) "
           "cancelled: max_pool2d: cancelled before it finished",
           (unsigned long long)rid);
  cr_assert(wait_log(line), "no cancel logged");
  /* A's teardown follows its cancelled op on the worker; B's stats may be
   * answered on the loop thread first, so this waits (bounded) for it */
  Dspwire__StatsReply st;
  for (int i = 0; i < WAIT_S * 20; i++) {
    cr_assert_eq(wire_get_stats(&b, &st), 0);
    if (st.server_tensors == 1) break;
    usleep(50000);
  }
  cr_assert_eq(st.server_tensors, 1, "A's tensors outlived its session");
  wire_close(&b);
}

/* SIGTERM while a worker runs a long op: once the drain timeout is over
 * the server cancels it and exits cleanly instead of finishing the op. */
Test(cancel, sigterm_during_long_op_exits_promptly) {
  wire_conn a;
  connect_hello(&a);
  start_long_op(&a);
  int st = 0;
  cr_assert_eq(stop_bounded(&st), 0, "server still running %d s after "
               "SIGTERM", WAIT_S);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
  cr_assert(log_has("cancelled: max_pool2d: cancelled before it finished"));
  wire_close(&a);
}

/* ------------------------------------------------------------ kernels */

/* Every family's kernel stops when the ctx is cancelled: each op runs on
 * ~2M-element inputs straight on the backend (dsp_op would refuse it up
 * front) with the flag already raised, and must give DISPATCH_ECANCELED
 * after at most one block of work. */
typedef struct kcase {
  const char *name;
  dsp_opcode op;
  int n_in;
  int in[3]; /* indexes into the inputs made below */
  int n_ints;
  int64_t ints[6];
  int n_floats;
  double floats[3];
} kcase;

enum { K_IMG, K_ROW, K_MAT, K_WIDE, K_COL, K_W, K_IDX, K_LAB, K_MASK,
       K_N };

Test(cancel_kernels, every_long_kernel_stops) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta metas[K_N] = {
      [K_IMG] = {DSP_F32, 4, {1, 2, 1024, 1024}},
      [K_ROW] = {DSP_F32, 1, {1024}},
      [K_MAT] = {DSP_F32, 2, {2048, 1024}},
      [K_WIDE] = {DSP_F32, 2, {1024, 2048}},
      [K_COL] = {DSP_F32, 2, {1024, 64}},
      [K_W] = {DSP_F32, 4, {4, 2, 3, 3}},
      [K_IDX] = {DSP_I64, 1, {2048}},
      [K_LAB] = {DSP_I64, 1, {2048}},
      [K_MASK] = {DSP_BOOL, 4, {1, 2, 1024, 1024}},
  };
  dsp_tensor *t[K_N];
  for (int i = 0; i < K_N; i++)
    cr_assert_eq(dsp_tensor_new(ctx, &metas[i], &t[i]), 0);
  int64_t *ix = dsp_tensor_data(t[K_IDX]);
  for (int i = 0; i < 2048; i++) ix[i] = i % 1024;
  static const kcase cases[] = {
      {"add", DSP_OP_ADD, 2, {K_IMG, K_IMG}, 0, {0}, 0, {0}},
      {"add broadcast", DSP_OP_ADD, 2, {K_IMG, K_ROW}, 0, {0}, 0, {0}},
      {"exp", DSP_OP_EXP, 1, {K_IMG}, 0, {0}, 0, {0}},
      {"mul_scalar", DSP_OP_MUL_SCALAR, 1, {K_IMG}, 0, {0}, 1, {2}},
      {"relu_backward", DSP_OP_RELU_BACKWARD, 2, {K_IMG, K_IMG}, 0, {0}, 0,
       {0}},
      {"where", DSP_OP_WHERE, 3, {K_MASK, K_IMG, K_IMG}, 0, {0}, 0, {0}},
      {"sum rows", DSP_OP_SUM, 1, {K_IMG}, 1, {3}, 0, {0}},
      {"sum channels", DSP_OP_SUM, 1, {K_IMG}, 1, {1}, 0, {0}},
      {"max", DSP_OP_MAX, 1, {K_IMG}, 1, {2}, 0, {0}},
      {"argmax", DSP_OP_ARGMAX, 1, {K_IMG}, 1, {3}, 0, {0}},
      {"softmax", DSP_OP_SOFTMAX, 1, {K_IMG}, 1, {3}, 0, {0}},
      {"cross_entropy", DSP_OP_CROSS_ENTROPY, 2, {K_MAT, K_LAB}, 0, {0}, 0,
       {0}},
      {"mse", DSP_OP_MSE, 2, {K_IMG, K_IMG}, 0, {0}, 0, {0}},
      {"dropout", DSP_OP_DROPOUT, 1, {K_IMG}, 1, {7}, 1, {0.5}},
      {"conv2d", DSP_OP_CONV2D, 2, {K_IMG, K_W}, 4, {1, 1, 1, 1}, 0, {0}},
      {"max_pool2d", DSP_OP_MAX_POOL2D, 1, {K_IMG}, 4, {8, 8, 1, 1}, 0, {0}},
      {"matmul", DSP_OP_MATMUL, 2, {K_MAT, K_COL}, 0, {0}, 0, {0}},
      {"transpose", DSP_OP_TRANSPOSE, 1, {K_MAT}, 2, {0, 1}, 0, {0}},
      {"slice", DSP_OP_SLICE, 1, {K_IMG}, 4, {3, 0, 1024, 2}, 0, {0}},
      {"cat", DSP_OP_CAT, 2, {K_MAT, K_MAT}, 1, {1}, 0, {0}},
      {"index_select", DSP_OP_INDEX_SELECT, 2, {K_WIDE, K_IDX}, 1, {0}, 0,
       {0}},
      {"ones", DSP_OP_ONES, 0, {0}, 3, {DSP_F32, 2048, 1024}, 0, {0}},
      {"uniform", DSP_OP_UNIFORM, 0, {0}, 4, {DSP_F32, 1, 2048, 1024}, 2,
       {0, 1}},
  };
  const dsp_backend *be = dsp_ctx_backend(ctx);
  dsp_ctx_cancel(ctx);
  cr_assert(dsp_ctx_cancelled(ctx));
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    const kcase *c = &cases[k];
    dsp_tensor *in[3];
    dsp_meta im[3], om;
    for (int i = 0; i < c->n_in; i++) {
      in[i] = t[c->in[i]];
      im[i] = in[i]->meta;
    }
    dsp_attrs a = dsp_attrs_ints(c->n_ints, c->ints);
    a.n_floats = c->n_floats;
    for (int i = 0; i < c->n_floats; i++) a.floats[i] = c->floats[i];
    cr_assert_eq(dsp_op_infer(ctx, c->op, im, c->n_in, &a, &om), 0, "%s: %s",
                 c->name, dsp_ctx_errmsg(ctx));
    dsp_tensor *out;
    cr_assert_eq(dsp_tensor_new(ctx, &om, &out), 0);
    int rc = be->run_op(be->bctx, ctx, c->op, in, c->n_in, &a, out);
    cr_expect_eq(rc, DISPATCH_ECANCELED, "%s: kernel gave %d (%s)", c->name,
                 rc, dsp_ctx_errmsg(ctx));
    dsp_tensor_unref(out);
    /* and dsp_op refuses before allocating anything */
    cr_expect_eq(dsp_op(ctx, c->op, in, c->n_in, &a, &out),
                 DISPATCH_ECANCELED, "%s", c->name);
    cr_expect_null(out);
  }
  for (int i = 0; i < K_N; i++) dsp_tensor_unref(t[i]);
  dsp_ctx_free(ctx);
}

/* The estimates the README states, on shapes small enough to check by
 * hand; each includes the output elements written. */
Test(cancel_kernels, op_cost_estimates) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta mm[2] = {{DSP_F32, 2, {2, 3}}, {DSP_F32, 2, {3, 4}}}, o;
  dsp_attrs none = dsp_attrs_none();
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_MATMUL, mm, 2, &none, &o), 0);
  cr_assert_eq(dsp_op_cost(DSP_OP_MATMUL, mm, 2, &none, &o), 2 * 4 * 3 + 8);
  dsp_meta img = {DSP_F32, 4, {1, 1, 1024, 1024}};
  int64_t pi[4] = {512, 512, 1, 1};
  dsp_attrs pa = dsp_attrs_ints(4, pi);
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_MAX_POOL2D, &img, 1, &pa, &o), 0);
  cr_assert_eq(dsp_op_cost(DSP_OP_MAX_POOL2D, &img, 1, &pa, &o),
               263169ull * 262144 + 263169);
  dsp_meta x = {DSP_F32, 2, {10, 20}};
  int64_t d1[1] = {1};
  dsp_attrs ra = dsp_attrs_ints(1, d1);
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_SUM, &x, 1, &ra, &o), 0);
  cr_assert_eq(dsp_op_cost(DSP_OP_SUM, &x, 1, &ra, &o), 200 + 10);
  /* a limit on the ctx refuses a costlier op before it allocates */
  dsp_ctx_set_max_op_cost(ctx, 100);
  dsp_tensor *t, *out;
  cr_assert_eq(dsp_tensor_new(ctx, &x, &t), 0);
  cr_assert_eq(dsp_op(ctx, DSP_OP_SUM, &t, 1, &ra, &out), DISPATCH_ELIMIT);
  cr_assert_null(out);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "sum: estimated 210 elementary "
                                        "operations, over the per-op limit "
                                        "of 100") != NULL,
            "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}
