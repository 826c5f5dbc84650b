/* dispatch-server integration: tiny ops of an idle session run on the loop
 * thread (issue 11 item 4, --inline-cost). Running them there must change
 * nothing a client can see: the same replies, errors, poisoned ids and
 * values, in the same order, as with inline execution off
 * (--inline-cost 0), including ops behind queued work; only the Stats
 * counter inline_ops tells them apart. The cost bound is exact, and a long
 * pipeline read in one go is not run on the loop as a whole. */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_on, g_off;

static void start_both(void) {
  const char *on[] = {"--log-level", "error", "--threads", "2", NULL};
  const char *off[] = {"--log-level", "error", "--threads", "2",
                       "--inline-cost", "0", NULL};
  cr_assert_eq(sp_start(&g_on, on), 0, "server (inline on) did not start");
  if (sp_start(&g_off, off) != 0) {
    sp_stop(&g_on); /* a failed setup skips the teardown */
    cr_assert_fail("server (inline off) did not start");
  }
}
static void stop_both(void) {
  if (g_on.pid > 0) cr_assert_eq(sp_stop(&g_on), 0, "exit status (on)");
  if (g_off.pid > 0) cr_assert_eq(sp_stop(&g_off), 0, "exit status (off)");
}

TestSuite(inline_ops, .init = start_both, .fini = stop_both);

/* A third server with a test's own --inline-cost, stopped by the test's
 * teardown even when an assertion fails. */
static sp_server g_own;
static void start_own(const char *cost) {
  const char *args[] = {"--log-level", "error", "--inline-cost", cost, NULL};
  cr_assert_eq(sp_start(&g_own, args), 0, "server (--inline-cost %s)", cost);
}
static void start_cost_100(void) { start_own("100"); }
static void start_cost_max(void) { start_own("1048576"); }
static void stop_own(void) {
  if (g_own.pid > 0) cr_assert_eq(sp_stop(&g_own), 0, "exit status (own)");
}

/* Appends one line to the transcript. */
static void note(char *t, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void note(char *t, size_t len, const char *fmt, ...) {
  size_t k = strlen(t);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t + k, len - k, fmt, ap);
  va_end(ap);
  k = strlen(t);
  if (k + 1 < len) {
    t[k] = '\n';
    t[k + 1] = '\0';
  }
}

/* A waiting request's reply as a line: code, failing request, message. */
static void note_sync(wire_conn *c, char *t, size_t len, const char *what) {
  char msg[768] = "";
  uint64_t failed = 0;
  int code = wire_sync_check(c, msg, sizeof msg, &failed);
  note(t, len, "%s: code %d failed %llu: %s", what, code,
       (unsigned long long)failed, msg);
}

static void note_read(wire_conn *c, char *t, size_t len, uint64_t id) {
  void *data = NULL;
  size_t n = 0;
  int rc = wire_read_tensor(c, id, &data, &n, NULL, NULL);
  if (rc != 0) {
    /* the error's text: a sync right after returns nothing pending */
    note(t, len, "read %llu: code %d", (unsigned long long)id, rc);
    return;
  }
  note(t, len, "read %llu: %zu bytes", (unsigned long long)id, n);
  const float *f = data;
  for (size_t i = 0; i < n / sizeof(float) && i < 16; i++)
    note(t, len, "  [%zu] %g", i, (double)f[i]);
  free(data);
}

/* One session's traffic: inline-sized ops that succeed, that fail in the
 * kernel (poisoning their output), that fail on a used output id, ops on
 * a poisoned and on a freed id, then tiny ops queued behind large ones
 * (they must wait their turn, not overtake), each wait's reply noted. */
static void scenario(int port, char *t, size_t len,
                     Dspwire__StatsReply *st) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, port), 0);
  cr_assert_eq(wire_hello(&c, "inline"), 0);
  int64_t s16[1] = {16}, s2[1] = {2}, sbig[1] = {1 << 16};
  float k[16];
  for (int i = 0; i < 16; i++) k[i] = (float)(i + 1);
  int64_t idx[2] = {0, 99}; /* 99: out of range for 16 rows */
  wire_upload(&c, 1, DSP_F32, 1, s16, k, sizeof k);
  wire_upload(&c, 2, DSP_I64, 1, s2, idx, sizeof idx);
  note_sync(&c, t, len, "sync after uploads");
  uint64_t in11[2] = {1, 1}, in10[2] = {10, 1}, in12[2] = {12, 1};
  uint64_t in_idx[2] = {1, 2};
  int64_t dim0[1] = {0};
  wire_op(&c, DSP_OP_ADD, in11, 2, 10, NULL, 0, NULL, 0);    /* 2k */
  wire_op(&c, DSP_OP_ADD, in10, 2, 11, NULL, 0, NULL, 0);    /* 3k */
  wire_op(&c, DSP_OP_INDEX_SELECT, in_idx, 2, 12, dim0, 1, NULL, 0);
  wire_op(&c, DSP_OP_ADD, in12, 2, 13, NULL, 0, NULL, 0);    /* poisoned */
  wire_op(&c, DSP_OP_ADD, in11, 2, 10, NULL, 0, NULL, 0);    /* id in use */
  note_sync(&c, t, len, "sync after failures");
  note_sync(&c, t, len, "sync again");
  note_read(&c, t, len, 11);
  note_read(&c, t, len, 13);
  note_read(&c, t, len, 10);
  /* freed, then used: the op fails with its id unknown */
  uint64_t f10[1] = {10};
  wire_free(&c, f10, 1, NULL, 0);
  wire_op(&c, DSP_OP_ADD, in10, 2, 14, NULL, 0, NULL, 0);
  note_sync(&c, t, len, "sync after use of a freed id");
  /* behind queued work: a large upload and a large op (both for a
   * worker), then tiny ops on their results and on older tensors */
  float *ones = malloc(sizeof(float) << 16);
  cr_assert_not_null(ones);
  for (int i = 0; i < 1 << 16; i++) ones[i] = 1.0f;
  wire_upload(&c, 20, DSP_F32, 1, sbig, ones, sizeof(float) << 16);
  free(ones);
  uint64_t in20[2] = {20, 20}, in21[1] = {21}, in11b[2] = {11, 1};
  wire_op(&c, DSP_OP_ADD, in20, 2, 21, NULL, 0, NULL, 0);    /* 2 each */
  wire_op(&c, DSP_OP_SUM, in21, 1, 22, NULL, 0, NULL, 0);    /* 131072 */
  wire_op(&c, DSP_OP_ADD, in11b, 2, 23, NULL, 0, NULL, 0);   /* 4k */
  uint64_t in22[2] = {22, 22};
  wire_op(&c, DSP_OP_ADD, in22, 2, 24, NULL, 0, NULL, 0);    /* 262144 */
  note_read(&c, t, len, 24);
  note_read(&c, t, len, 23);
  note_sync(&c, t, len, "final sync");
  cr_assert_eq(wire_get_stats(&c, st), 0);
  note(t, len, "stats: tensors %llu ops %llu errors %llu",
       (unsigned long long)st->tensors, (unsigned long long)st->ops,
       (unsigned long long)st->errors);
  wire_close(&c);
}

/* The same traffic with inline execution on and off gives the same
 * transcript; with it on, the small ops really ran on the loop. Before
 * --inline-cost existed the "off" server did not start, and no server
 * counted inline_ops (0). */
Test(inline_ops, same_replies_errors_and_order_as_pooled) {
  static char on[16384], off[16384];
  on[0] = off[0] = '\0';
  Dspwire__StatsReply st_on, st_off;
  scenario(g_on.port, on, sizeof on, &st_on);
  scenario(g_off.port, off, sizeof off, &st_off);
  cr_log_info("transcript:\n%s", on);
  cr_assert_str_eq(on, off, "inline on:\n%s\ninline off:\n%s", on, off);
  /* the transcript itself says the right things happened */
  cr_assert(strstr(on, "sync after failures: code -") != NULL, "%s", on);
  cr_assert(strstr(on, "index_select") != NULL, "%s", on);
  cr_assert(strstr(on, "read 24: 4 bytes\n  [0] 262144") != NULL, "%s", on);
  cr_assert(strstr(on, "read 23: 64 bytes\n  [0] 4\n") != NULL, "%s", on);
  cr_assert_geq(st_on.inline_ops, 2, "only %llu ops ran inline",
               (unsigned long long)st_on.inline_ops);
  cr_assert_lt(st_on.inline_ops, st_on.ops, "large ops ran inline too");
  cr_assert_eq(st_off.inline_ops, 0, "--inline-cost 0 still ran %llu inline",
               (unsigned long long)st_off.inline_ops);
  cr_log_info("inline on: %llu of %llu ops inline, %llu worker turns; "
              "off: %llu worker turns",
              (unsigned long long)st_on.inline_ops,
              (unsigned long long)st_on.ops,
              (unsigned long long)st_on.batches,
              (unsigned long long)st_off.batches);
}

/* Inline ops run on one session while another session's large op keeps
 * a worker busy: both get the right results (the loop does not wait for
 * the worker, nor run the other session's work). */
Test(inline_ops, idle_session_inline_while_another_is_busy) {
  wire_conn a, b;
  cr_assert_eq(wire_connect(&a, g_on.port), 0);
  cr_assert_eq(wire_connect(&b, g_on.port), 0);
  cr_assert_eq(wire_hello(&a, "busy"), 0);
  cr_assert_eq(wire_hello(&b, "tiny"), 0);
  int64_t s[2] = {512, 512}, s16[1] = {16};
  float *m = calloc(512 * 512, sizeof *m);
  cr_assert_not_null(m);
  for (int i = 0; i < 512 * 512; i++) m[i] = 1.0f;
  wire_upload(&a, 1, DSP_F32, 2, s, m, 512 * 512 * sizeof *m);
  free(m);
  uint64_t mm[2] = {1, 1};
  for (uint64_t i = 0; i < 4; i++)
    wire_op(&a, DSP_OP_MATMUL, mm, 2, 10 + i, NULL, 0, NULL, 0);
  float k[16];
  for (int i = 0; i < 16; i++) k[i] = (float)i;
  wire_upload(&b, 1, DSP_F32, 1, s16, k, sizeof k);
  cr_assert_eq(wire_sync_check(&b, NULL, 0, NULL), 0);
  uint64_t x[2] = {1, 1};
  for (uint64_t i = 0; i < 50; i++) {
    wire_op(&b, DSP_OP_ADD, x, 2, 100 + i, NULL, 0, NULL, 0);
    x[0] = 100 + i; /* x_{i+1} = x_i + k */
  }
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&b, 149, &got, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)got)[3], 3.0f * 51);
  free(got);
  cr_assert_eq(wire_read_tensor(&a, 13, &got, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)got)[0], 512.0f);
  free(got);
  wire_close(&a);
  wire_close(&b);
}

/* The bound is dsp_op_cost <= --inline-cost: an add of n floats costs 2n
 * (n elements of work, n written), so with --inline-cost 100 an add of 50
 * runs inline and one of 51 goes to a worker. */
Test(inline_ops, cost_bound_is_exact, .init = start_cost_100,
     .fini = stop_own) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_own.port), 0);
  cr_assert_eq(wire_hello(&c, "bound"), 0);
  float z[51] = {0};
  int64_t s50[1] = {50}, s51[1] = {51};
  wire_upload(&c, 1, DSP_F32, 1, s50, z, 50 * sizeof(float));
  wire_upload(&c, 2, DSP_F32, 1, s51, z, 51 * sizeof(float));
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  Dspwire__StatsReply st;
  uint64_t a[2] = {1, 1}, b[2] = {2, 2};
  wire_op(&c, DSP_OP_ADD, a, 2, 10, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.inline_ops, 1, "add of 50 (cost 100): %llu inline",
               (unsigned long long)st.inline_ops);
  wire_op(&c, DSP_OP_ADD, b, 2, 11, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.inline_ops, 1, "add of 51 (cost 102) ran inline");
  cr_assert_eq(st.ops, 2);
  wire_close(&c);
}

/* A pipeline of N tiny dependent adds arriving in one write: it goes to
 * the workers (the loop decodes the rest while they run) rather than run
 * on the loop as a whole, since more than SV_INLINE_TAIL bytes follow its
 * first op; the chain's value is right either way. */
Test(inline_ops, long_pipeline_is_not_all_inline) {
  enum { N = 1000 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_on.port), 0);
  cr_assert_eq(wire_hello(&c, "chain"), 0);
  float one[16];
  for (int i = 0; i < 16; i++) one[i] = 1.0f;
  int64_t s16[1] = {16};
  wire_upload(&c, 1, DSP_F32, 1, s16, one, sizeof one);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  size_t cap = (size_t)N * 64, len = 0;
  uint8_t *buf = malloc(cap);
  cr_assert_not_null(buf);
  for (uint64_t i = 0; i < N; i++) {
    uint64_t in[2] = {i + 1, 1};
    dsp_wreq w;
    Dspwire__Request *r =
        dsp_wreq_op(&w, DSP_OP_ADD, in, 2, i + 2, NULL, 0, NULL, 0, 0);
    r->req_id = 1000 + i;
    cr_assert_leq(len + dsp_req_frame_size(r), cap);
    len += dsp_req_frame_encode(r, 0, buf + len);
  }
  cr_assert_eq(wire_send_raw(&c, buf, len), 0); /* one write */
  free(buf);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, N + 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)got)[0], (float)(N + 1));
  free(got);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, N);
  cr_assert_lt(st.inline_ops, N / 2, "%llu of %d pipelined ops ran inline",
               (unsigned long long)st.inline_ops, N);
  cr_log_info("%llu of %d pipelined ops ran inline, %llu worker turns",
              (unsigned long long)st.inline_ops, N,
              (unsigned long long)st.batches);
  wire_close(&c);
}

/* Encodes ops into one buffer and sends it with one write. */
static void send_ops_at_once(wire_conn *c, const uint64_t (*in)[2], int n,
                             uint64_t first_out) {
  uint8_t buf[1024];
  size_t len = 0;
  for (int i = 0; i < n; i++) {
    dsp_wreq w;
    Dspwire__Request *r = dsp_wreq_op(&w, DSP_OP_ADD, in[i], 2,
                                      first_out + (uint64_t)i, NULL, 0, NULL,
                                      0, 0);
    r->req_id = first_out + (uint64_t)i;
    cr_assert_leq(len + dsp_req_frame_size(r), sizeof buf);
    len += dsp_req_frame_encode(r, 0, buf + len);
  }
  cr_assert_eq(wire_send_raw(c, buf, len), 0);
}

/* What the loop runs inline per socket read is bounded: with
 * --inline-cost at its maximum, three adds of 2^19 floats (cost 2^20
 * each, past SV_INLINE_READ_COST = 2^16 alone) sent in one write: the
 * first runs inline (the op that crosses the allowance still runs), the
 * other two go to a worker. */
Test(inline_ops, read_allowance_bounds_inline_work, .init = start_cost_max,
     .fini = stop_own) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_own.port), 0);
  cr_assert_eq(wire_hello(&c, "allowance"), 0);
  enum { N = 1 << 19 };
  float *v = malloc(N * sizeof *v);
  cr_assert_not_null(v);
  for (int i = 0; i < N; i++) v[i] = 1.0f;
  int64_t sh[1] = {N};
  wire_upload(&c, 1, DSP_F32, 1, sh, v, N * sizeof *v);
  free(v);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  const uint64_t in[3][2] = {{1, 1}, {1, 1}, {1, 1}};
  send_ops_at_once(&c, in, 3, 10);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, 3);
  cr_assert_eq(st.inline_ops, 1, "%llu of 3 ops of cost 2^20 in one read "
               "ran inline", (unsigned long long)st.inline_ops);
  wire_close(&c);
}

/* The reply to the last request of a worker's turn reaches the loop only
 * once the session is marked idle, so an op the client sends on that
 * reply runs inline every time, not only when the worker happened to
 * finish its turn first. Each round: an upload (always a worker's), a
 * sync queued behind it, then an add sent on the sync's reply. */
Test(inline_ops, op_sent_on_a_worker_reply_runs_inline) {
  enum { ROUNDS = 300 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_on.port), 0);
  cr_assert_eq(wire_hello(&c, "race"), 0);
  float one[16];
  for (int i = 0; i < 16; i++) one[i] = 1.0f;
  int64_t s16[1] = {16};
  for (uint64_t r = 0; r < ROUNDS; r++) {
    uint64_t x = 10 * r + 1, y = 10 * r + 2;
    wire_upload(&c, x, DSP_F32, 1, s16, one, sizeof one);
    cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
    uint64_t in[2] = {x, x};
    wire_op(&c, DSP_OP_ADD, in, 2, y, NULL, 0, NULL, 0);
  }
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, ROUNDS);
  cr_assert_eq(st.inline_ops, ROUNDS, "%llu of %d adds sent on a reply ran "
               "inline", (unsigned long long)st.inline_ops, ROUNDS);
  wire_close(&c);
}

/* An upload to a CPU device lands straight in its tensor's storage, so
 * what is left to run is the table (and, for bool, a scan of the bytes
 * for 0 and 1): a 1 MiB f32 upload of an idle session runs on the
 * network thread, with its sync, and hands nothing to the workers; a 1
 * MiB bool upload, whose bytes are scanned, still goes to a worker. When
 * an upload counted its bytes as work whatever its dtype, the f32 one
 * took a hand-off (two thread wake-ups) for nothing. */
Test(inline_ops, an_in_place_cpu_upload_runs_inline) {
  enum { N = 1 << 20 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_on.port), 0);
  cr_assert_eq(wire_hello(&c, "upload"), 0);
  uint8_t *bytes = calloc(N, 1);
  cr_assert_not_null(bytes);
  Dspwire__StatsReply s0, s1, s2;
  cr_assert_eq(wire_get_stats(&c, &s0), 0);
  int64_t sf[1] = {N / 4}, sb[1] = {N};
  wire_upload(&c, 1, DSP_F32, 1, sf, bytes, N);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(&c, &s1), 0);
  cr_assert_eq(s1.handoffs, s0.handoffs,
               "a 1 MiB f32 upload and its sync took %llu hand-offs to the "
               "workers", (unsigned long long)(s1.handoffs - s0.handoffs));
  cr_assert_eq(s1.tensors, s0.tensors + 1);
  wire_upload(&c, 2, DSP_BOOL, 1, sb, bytes, N);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(&c, &s2), 0);
  cr_assert_gt(s2.handoffs, s1.handoffs,
               "a 1 MiB bool upload (its bytes scanned) ran inline");
  cr_assert_eq(s2.tensors, s1.tensors + 1);
  free(bytes);
  wire_close(&c);
}

/* Freeing a 1 MiB tensor puts its storage on the session's free lists
 * (64 MiB by default), a few pointer moves, and the next upload of its
 * size takes it back: the Free runs on the network thread, and so does
 * that upload behind it. Counted one per element, as if its pages went
 * back to the system, the Free went to a worker and took the upload with
 * it: what a training loop that uploads a fresh batch each step and
 * frees the last one paid at every step. */
Test(inline_ops, a_free_the_free_lists_take_runs_inline) {
  enum { N = 1 << 20 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_on.port), 0);
  cr_assert_eq(wire_hello(&c, "free"), 0);
  float *v = calloc(N / 4, sizeof *v);
  cr_assert_not_null(v);
  int64_t sf[1] = {N / 4};
  wire_upload(&c, 1, DSP_F32, 1, sf, v, N);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  Dspwire__StatsReply s0, s1;
  cr_assert_eq(wire_get_stats(&c, &s0), 0);
  for (uint64_t k = 1; k <= 4; k++) {
    uint64_t ids[1] = {k};
    wire_free(&c, ids, 1, NULL, 0);
    wire_upload(&c, k + 1, DSP_F32, 1, sf, v, N);
    cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  }
  cr_assert_eq(wire_get_stats(&c, &s1), 0);
  cr_assert_eq(s1.tensors, 1);
  cr_assert_eq(s1.handoffs, s0.handoffs,
               "4 rounds of free 1 MiB + upload 1 MiB + sync took %llu "
               "hand-offs to the workers",
               (unsigned long long)(s1.handoffs - s0.handoffs));
  free(v);
  wire_close(&c);
}
