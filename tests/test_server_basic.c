/* dispatch-server integration: every request kind over the raw protocol
 * against the real binary on 127.0.0.1 (port 0). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "frame.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void start_default(void) {
  const char *args[] = {"--log-level", "warn", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "test"), 0);
}

TestSuite(server_basic, .init = start_default, .fini = stop_checked);

Test(server_basic, hello_reply_describes_server) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  uint64_t id = wire_hello_send(&c, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, "t");
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, id);
  cr_assert_null(r->error);
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_HELLO);
  cr_assert_eq(r->hello->major, DSP_PROTO_MAJOR);
  cr_assert_eq(r->hello->minor, DSP_PROTO_MINOR);
  cr_assert_str_eq(r->hello->backend, "cpu");
  cr_assert_str_eq(r->hello->server_version, DISPATCH_VERSION_STRING);
  cr_assert_eq(r->hello->n_dtypes, 6);
  cr_assert_str_eq(r->hello->dtypes[0], "f32");
  cr_assert_str_eq(r->hello->dtypes[5], "bf16"); /* 1.7 */
  cr_assert_eq(r->hello->max_rank, 8);
  cr_assert_gt(r->hello->max_frame, 0);
  cr_assert_gt(r->hello->max_session_bytes, 0);
  cr_assert_gt(r->hello->max_elements, 0);
  wire_reply_free(r, NULL);
  wire_close(&c);
}

Test(server_basic, version_mismatch_names_both_versions) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  uint64_t id = wire_hello_send(&c, DSP_PROTO_MAJOR + 1, 3, "future");
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, id);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_EVERSION);
  char want_client[32], want_server[32];
  snprintf(want_client, sizeof want_client, "%d.3", DSP_PROTO_MAJOR + 1);
  snprintf(want_server, sizeof want_server, "%d.%d", DSP_PROTO_MAJOR,
           DSP_PROTO_MINOR);
  cr_assert(strstr(r->error->message, want_client), "%s", r->error->message);
  cr_assert(strstr(r->error->message, want_server), "%s", r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
}

Test(server_basic, upload_then_read_returns_same_bytes) {
  wire_conn c;
  connect_hello(&c);
  float data[6] = {1, -2, 3.5f, 4, 5, 6e10f};
  int64_t shape[2] = {2, 3};
  cr_assert_neq(wire_upload(&c, 42, DSP_F32, 2, shape, data, sizeof data), 0);
  int64_t i64[3] = {7, -8, INT64_MAX};
  int64_t s1[1] = {3};
  cr_assert_neq(wire_upload(&c, 43, DSP_I64, 1, s1, i64, sizeof i64), 0);
  /* a 0-d scalar with 4 bytes, and an empty tensor with no bulk */
  float sc = 9;
  cr_assert_neq(wire_upload(&c, 44, DSP_F32, 0, NULL, &sc, 4), 0);
  int64_t s0[2] = {0, 5};
  cr_assert_neq(wire_upload(&c, 45, DSP_F32, 2, s0, NULL, 0), 0);

  void *got;
  size_t n;
  int nd;
  int64_t sh[8];
  cr_assert_eq(wire_read_tensor(&c, 42, &got, &n, &nd, sh), 0);
  cr_assert_eq(n, sizeof data);
  cr_assert_eq(nd, 2);
  cr_assert_eq(sh[0], 2);
  cr_assert_eq(sh[1], 3);
  cr_assert_eq(memcmp(got, data, n), 0);
  free(got);
  cr_assert_eq(wire_read_tensor(&c, 43, &got, &n, &nd, sh), 0);
  cr_assert_eq(n, sizeof i64);
  cr_assert_eq(memcmp(got, i64, n), 0);
  free(got);
  cr_assert_eq(wire_read_tensor(&c, 44, &got, &n, &nd, sh), 0);
  cr_assert_eq(nd, 0);
  cr_assert_eq(n, 4);
  cr_assert_eq(memcmp(got, &sc, 4), 0);
  free(got);
  cr_assert_eq(wire_read_tensor(&c, 45, &got, &n, &nd, sh), 0);
  cr_assert_eq(n, 0);
  cr_assert_eq(nd, 2);
  free(got);
  wire_close(&c);
}

Test(server_basic, large_upload_lands_intact) {
  wire_conn c;
  connect_hello(&c);
  size_t n = 3 * 1000 * 1000; /* 12 MB: many partial reads into storage */
  float *data = malloc(n * sizeof *data);
  cr_assert_not_null(data);
  for (size_t i = 0; i < n; i++) data[i] = (float)i * 0.5f;
  int64_t shape[1] = {(int64_t)n};
  cr_assert_neq(wire_upload(&c, 1, DSP_F32, 1, shape, data, n * 4), 0);
  void *got;
  size_t nb;
  cr_assert_eq(wire_read_tensor(&c, 1, &got, &nb, NULL, NULL), 0);
  cr_assert_eq(nb, n * 4);
  cr_assert_eq(memcmp(got, data, nb), 0);
  free(got);
  free(data);
  wire_close(&c);
}

/* Runs op in-process on the same inputs for an exact comparison. */
static dsp_tensor *local_op(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *a,
                            dsp_tensor *b, const dsp_attrs *at) {
  dsp_tensor *in[2] = {a, b}, *out;
  int rc = dsp_op(ctx, op, in, b ? 2 : 1, at, &out);
  cr_assert_eq(rc, 0, "%s", dsp_ctx_errmsg(ctx));
  return out;
}

Test(server_basic, ops_match_in_process_results) {
  wire_conn c;
  connect_hello(&c);
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {0.5f, -1, 2, 0.25f, 3, -4};
  int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
  dsp_meta ma = {DSP_F32, 2, {2, 3}}, mb = {DSP_F32, 2, {3, 2}};
  dsp_tensor *ta, *tb;
  cr_assert_eq(dsp_tensor_from_data(ctx, &ma, a, sizeof a, &ta), 0);
  cr_assert_eq(dsp_tensor_from_data(ctx, &mb, b, sizeof b, &tb), 0);
  wire_upload(&c, 1, DSP_F32, 2, sa, a, sizeof a);
  wire_upload(&c, 2, DSP_F32, 2, sb, b, sizeof b);
  uint64_t mm_in[2] = {1, 2}, add_in[2] = {1, 1};
  wire_op(&c, DSP_OP_MATMUL, mm_in, 2, 3, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_ADD, add_in, 2, 4, NULL, 0, NULL, 0);
  int64_t dims[1] = {1};
  uint64_t one[1] = {4};
  wire_op(&c, DSP_OP_SUM, one, 1, 5, dims, 1, NULL, 0);
  double s = 2.5;
  uint64_t three[1] = {3};
  wire_op(&c, DSP_OP_MUL_SCALAR, three, 1, 6, NULL, 0, &s, 1);

  dsp_attrs none = dsp_attrs_none(), sum1 = dsp_attrs_ints(1, dims),
            sc = dsp_attrs_f1(2.5);
  dsp_tensor *mm = local_op(ctx, DSP_OP_MATMUL, ta, tb, &none);
  dsp_tensor *ad = local_op(ctx, DSP_OP_ADD, ta, ta, &none);
  dsp_tensor *su = local_op(ctx, DSP_OP_SUM, ad, NULL, &sum1);
  dsp_tensor *ms = local_op(ctx, DSP_OP_MUL_SCALAR, mm, NULL, &sc);
  struct { uint64_t id; dsp_tensor *t; } want[] = {
      {3, mm}, {4, ad}, {5, su}, {6, ms}};
  for (int i = 0; i < 4; i++) {
    void *got;
    size_t n;
    int nd;
    int64_t sh[8];
    cr_assert_eq(wire_read_tensor(&c, want[i].id, &got, &n, &nd, sh), 0);
    cr_assert_eq(n, dsp_tensor_nbytes(want[i].t));
    cr_assert_eq(nd, want[i].t->meta.ndim);
    for (int d = 0; d < nd; d++) cr_assert_eq(sh[d], want[i].t->meta.shape[d]);
    cr_assert_eq(memcmp(got, dsp_tensor_data(want[i].t), n), 0, "id %llu",
                 (unsigned long long)want[i].id);
    free(got);
  }
  dsp_tensor_unref(mm);
  dsp_tensor_unref(ad);
  dsp_tensor_unref(su);
  dsp_tensor_unref(ms);
  dsp_tensor_unref(ta);
  dsp_tensor_unref(tb);
  dsp_ctx_free(ctx);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
}

Test(server_basic, free_and_stats_count_tensors) {
  wire_conn c;
  connect_hello(&c);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 0);
  cr_assert_eq(st.bytes, 0);
  float d[4] = {1, 2, 3, 4};
  int64_t s[1] = {4};
  wire_upload(&c, 10, DSP_F32, 1, s, d, sizeof d);
  wire_upload(&c, 11, DSP_F32, 1, s, d, sizeof d);
  uint64_t in[2] = {10, 11};
  wire_op(&c, DSP_OP_ADD, in, 2, 12, NULL, 0, NULL, 0);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 3);
  cr_assert_eq(st.bytes, 48);
  cr_assert_eq(st.ops, 1);
  cr_assert_eq(st.errors, 0);
  cr_assert_geq(st.sessions, 1);
  cr_assert_geq(st.server_tensors, 3);
  uint64_t f[2] = {10, 12};
  wire_free(&c, f, 2, NULL, 0);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 1);
  cr_assert_eq(st.bytes, 16);
  /* a freed id is unknown afterwards and may be reused */
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 10, &got, &n, NULL, NULL),
               DISPATCH_ENOID);
  cr_assert_eq(wire_upload(&c, 10, DSP_F32, 1, s, d, sizeof d) != 0, 1);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
}

Test(server_basic, bye_closes_after_pending_work) {
  wire_conn c;
  connect_hello(&c);
  float d[2] = {1, 2};
  int64_t s[1] = {2};
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  uint64_t rid = wire_read(&c, 1);
  wire_bye(&c);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_eq(bl, sizeof d);
  wire_reply_free(r, bulk);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
}

Test(server_basic, sigterm_exits_zero_with_open_sessions) {
  wire_conn c;
  connect_hello(&c);
  float d[2] = {1, 2};
  int64_t s[1] = {2};
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(sp_stop(&g_srv), 0);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
}

Test(server_basic, sigint_exits_zero) {
  cr_assert_eq(sp_signal(&g_srv, SIGINT), 0);
  cr_assert_eq(sp_wait(&g_srv), 0);
}

static void start_idle(void) {
  const char *args[] = {"--log-level", "warn", "--idle-timeout", "1", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

TestSuite(server_idle, .init = start_idle, .fini = stop_checked);

Test(server_idle, idle_session_is_closed_and_freed) {
  wire_conn c, w;
  connect_hello(&c);
  float d[2] = {1, 2};
  int64_t s[1] = {2};
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_wait_closed(&c), 1); /* nothing sent: closed by server */
  wire_close(&c);
  connect_hello(&w);
  Dspwire__StatsReply st;
  int freed = 0;
  for (int i = 0; i < 2000 && !freed; i++) {
    cr_assert_eq(wire_get_stats(&w, &st), 0);
    freed = st.server_tensors == 0;
  }
  cr_assert(freed);
  wire_close(&w);
}
