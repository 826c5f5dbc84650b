/* dispatch-server integration: deferred errors and poisoning, validation
 * of ids/bytes/attributes, malformed frames (each while another session
 * keeps being served), quotas, slow readers, memory freed on disconnect. */
#include <criterion/criterion.h>
#include <unistd.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dsp.h"
#include "frame.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void start_with(const char *const *args) {
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void start_default(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  start_with(args);
}
static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "test"), 0);
}

static const float k_d6[6] = {1, 2, 3, 4, 5, 6};

/* The other session of the malformed-frame tests: still served. */
static void assert_served(wire_conn *c, uint64_t id) {
  cr_assert_eq(wire_round_trip(c, id, DSP_F32, k_d6, sizeof k_d6), 0,
               "tensor %llu did not come back", (unsigned long long)id);
}

TestSuite(server_errors, .init = start_default, .fini = stop_checked);

Test(server_errors, deferred_error_poisons_and_session_recovers) {
  wire_conn c;
  connect_hello(&c);
  int64_t s23[2] = {2, 3}, s45[2] = {4, 5};
  float d20[20] = {0};
  wire_upload(&c, 1, DSP_F32, 2, s23, k_d6, sizeof k_d6);
  wire_upload(&c, 2, DSP_F32, 2, s45, d20, sizeof d20);
  uint64_t mm[2] = {1, 2}, dep[2] = {3, 1}, ok[2] = {1, 1};
  uint64_t bad = wire_op(&c, DSP_OP_MATMUL, mm, 2, 3, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_ADD, dep, 2, 4, NULL, 0, NULL, 0); /* uses poisoned 3 */
  wire_op(&c, DSP_OP_ADD, ok, 2, 5, NULL, 0, NULL, 0);  /* independent */
  char msg[700];
  uint64_t failed = 0;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed), DISPATCH_ESHAPE,
               "%s", msg);
  cr_assert_eq(failed, bad);
  cr_assert(strstr(msg, "matmul"), "%s", msg);
  cr_assert(strstr(msg, "-> 3"), "%s", msg);
  /* cleared once reported */
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 5, &got, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)got)[5], 12.0f);
  free(got);
  /* poisoned ids exist but fail, naming the original failure */
  uint64_t rid = wire_read(&c, 4);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_EPOISONED);
  cr_assert(strstr(r->error->message, "matmul"), "%s", r->error->message);
  wire_reply_free(r, NULL);
  /* the id 3 is taken (poisoned) until freed */
  wire_upload(&c, 3, DSP_F32, 2, s23, k_d6, sizeof k_d6);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EIDINUSE);
  uint64_t f[1] = {3};
  wire_free(&c, f, 1, NULL, 0);
  wire_upload(&c, 3, DSP_F32, 2, s23, k_d6, sizeof k_d6);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  /* matmul, add on poison, read of poison, upload on a taken id */
  cr_assert_eq(st.errors, 4);
  wire_close(&c);
}

Test(server_errors, only_first_error_reported_per_wait) {
  wire_conn c;
  connect_hello(&c);
  uint64_t in[2] = {100, 101};
  uint64_t first = wire_op(&c, DSP_OP_ADD, in, 2, 1, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_ADD, in, 2, 2, NULL, 0, NULL, 0);
  char msg[700];
  uint64_t failed;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed), DISPATCH_ENOID);
  cr_assert_eq(failed, first);
  cr_assert(strstr(msg, "100"), "%s", msg);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0);
  wire_close(&c);
}

/* Sends one request that must fail and returns the sync's error code. */
static int failing(wire_conn *c, char *msg, size_t len) {
  return wire_sync_check(c, msg, len, NULL);
}

Test(server_errors, ids_bytes_and_attributes_are_validated) {
  wire_conn c;
  connect_hello(&c);
  char msg[700];
  int64_t s6[1] = {6}, s23[2] = {2, 3};
  wire_upload(&c, 1, DSP_F32, 1, s6, k_d6, sizeof k_d6);
  /* reused live id */
  wire_upload(&c, 1, DSP_F32, 1, s6, k_d6, sizeof k_d6);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EIDINUSE, "%s", msg);
  uint64_t one[1] = {1};
  wire_op(&c, DSP_OP_NEG, one, 1, 1, NULL, 0, NULL, 0);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EIDINUSE, "%s", msg);
  /* wrong byte count: 5 bytes for [2, 3] f32 */
  wire_upload(&c, 2, DSP_F32, 2, s23, k_d6, 5);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EINVAL, "%s", msg);
  cr_assert(strstr(msg, "24"), "%s", msg);
  /* bad dtype, rank 9, negative size */
  wire_upload(&c, 3, 77, 1, s6, k_d6, sizeof k_d6);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EDTYPE, "%s", msg);
  int64_t s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 6};
  wire_upload(&c, 3, DSP_F32, 9, s9, k_d6, sizeof k_d6);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EINVAL, "%s", msg);
  int64_t sneg[1] = {-6};
  wire_upload(&c, 3, DSP_F32, 1, sneg, k_d6, sizeof k_d6);
  cr_assert_lt(failing(&c, msg, sizeof msg), 0);
  /* bad attribute: sum over dim 5 of a 1-D tensor; too many attributes */
  int64_t dim[1] = {5};
  wire_op(&c, DSP_OP_SUM, one, 1, 4, dim, 1, NULL, 0);
  cr_assert_lt(failing(&c, msg, sizeof msg), 0);
  cr_assert(strstr(msg, "sum"), "%s", msg);
  int64_t many[17] = {0};
  wire_op(&c, DSP_OP_SUM, one, 1, 5, many, 17, NULL, 0);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EINVAL, "%s", msg);
  /* wrong input count */
  uint64_t three[3] = {1, 1, 1};
  wire_op(&c, DSP_OP_ADD, three, 3, 6, NULL, 0, NULL, 0);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_EINVAL, "%s", msg);
  /* unknown ids in track, grad, free, backward, read */
  wire_track(&c, 999);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_ENOID, "%s", msg);
  wire_grad(&c, 55, 1, 9);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_ENOID, "%s", msg);
  uint64_t gone[1] = {12345};
  wire_free(&c, gone, 1, NULL, 0);
  cr_assert_eq(failing(&c, msg, sizeof msg), DISPATCH_ENOID, "%s", msg);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 999, &got, &n, NULL, NULL),
               DISPATCH_ENOID);
  /* the valid tensor is untouched by all this */
  cr_assert_eq(wire_read_tensor(&c, 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(memcmp(got, k_d6, sizeof k_d6), 0);
  free(got);
  wire_close(&c);
}

/* Sends raw bytes on a fresh session (after a hello when asked), expects an
 * Error frame with `code` and a close, while session `other` is served. */
static void malformed_case(const void *bytes, size_t n, int hello, int code,
                           const char *what) {
  wire_conn other, bad;
  connect_hello(&other);
  cr_assert_eq(wire_connect(&bad, g_srv.port), 0);
  if (hello) cr_assert_eq(wire_hello(&bad, "bad"), 0);
  assert_served(&other, 1);
  cr_assert_eq(wire_send_raw(&bad, bytes, n), 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&bad, &r, NULL, NULL), 0, "%s: no error frame",
               what);
  cr_assert_not_null(r->error, "%s", what);
  cr_assert_eq(r->error->code, code, "%s: %s", what, r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_wait_closed(&bad), 1, "%s: not closed", what);
  wire_close(&bad);
  assert_served(&other, 2);
  wire_close(&other);
}

Test(server_errors, oversized_length_is_refused) {
  uint8_t hb[16];
  dsp_frame_header h = {0xFFFFFFFFu, 0, 0};
  dsp_frame_header_encode(hb, &h);
  malformed_case(hb, sizeof hb, 1, DISPATCH_ETOOLARGE, "huge msg_len");
  dsp_frame_header h2 = {10, 0, 1ULL << 62};
  dsp_frame_header_encode(hb, &h2);
  malformed_case(hb, sizeof hb, 1, DISPATCH_ETOOLARGE, "huge bulk_len");
}

Test(server_errors, bad_flags_and_empty_message_are_refused) {
  uint8_t hb[16];
  dsp_frame_header h = {4, 7, 0};
  dsp_frame_header_encode(hb, &h);
  malformed_case(hb, sizeof hb, 1, DISPATCH_EPROTO, "flags");
  dsp_frame_header h0 = {0, 0, 0};
  dsp_frame_header_encode(hb, &h0);
  malformed_case(hb, sizeof hb, 1, DISPATCH_EPROTO, "no message");
}

Test(server_errors, garbage_and_truncated_protobuf_are_refused) {
  uint8_t buf[64];
  dsp_frame_header h = {8, 0, 0};
  dsp_frame_header_encode(buf, &h);
  memcpy(buf + 16, "\xff\xff\xff\xff\xff\xff\xff\xff", 8);
  malformed_case(buf, 24, 1, DISPATCH_EPROTO, "garbage");

  /* a valid read request cut short inside its varint */
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_read(&w, 0x7fffffffffffULL);
  req->req_id = 0x123456789ULL;
  size_t full = dsp_req_frame_encode(req, 0, buf);
  size_t cut = full - DSP_FRAME_HEADER_SIZE - 3;
  dsp_frame_header hc = {(uint32_t)cut, 0, 0};
  dsp_frame_header_encode(buf, &hc);
  malformed_case(buf, DSP_FRAME_HEADER_SIZE + cut, 1, DISPATCH_EPROTO,
                 "truncated protobuf");
}

Test(server_errors, no_body_unknown_op_and_missing_hello_are_refused) {
  uint8_t buf[128];
  Dspwire__Request bare = DSPWIRE__REQUEST__INIT;
  bare.req_id = 5;
  size_t n = dsp_req_frame_encode(&bare, 0, buf);
  /* req_id only: a message, but no body */
  malformed_case(buf, n, 1, DISPATCH_EPROTO, "no body");

  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_op(&w, 9999, NULL, 0, 1, NULL, 0, NULL,
                                       0, 0);
  req->req_id = 5;
  n = dsp_req_frame_encode(req, 0, buf);
  malformed_case(buf, n, 1, DISPATCH_EPROTO, "unknown op");
  /* any request before the hello */
  req = dsp_wreq_sync(&w);
  req->req_id = 5;
  n = dsp_req_frame_encode(req, 0, buf);
  malformed_case(buf, n, 0, DISPATCH_EPROTO, "no hello");
  /* bulk after a request that is not an upload */
  n = dsp_req_frame_encode(req, 4, buf);
  memcpy(buf + n, "abcd", 4);
  malformed_case(buf, n + 4, 1, DISPATCH_EPROTO, "bulk on sync");
}

Test(server_errors, truncated_frame_then_disconnect_leaves_others_served) {
  wire_conn other, bad;
  connect_hello(&other);
  cr_assert_eq(wire_connect(&bad, g_srv.port), 0);
  cr_assert_eq(wire_hello(&bad, "bad"), 0);
  uint8_t hb[16];
  dsp_frame_header h = {100, 0, 0};
  dsp_frame_header_encode(hb, &h);
  cr_assert_eq(wire_send_raw(&bad, hb, 10), 0); /* half a header */
  assert_served(&other, 1);                      /* not blocked by it */
  cr_assert_eq(wire_send_raw(&bad, hb + 10, 6), 0);
  cr_assert_eq(wire_send_raw(&bad, "xyz", 3), 0); /* 3 of 100 bytes */
  assert_served(&other, 2);
  shutdown(bad.fd, SHUT_WR);
  cr_assert_eq(wire_wait_closed(&bad), 1);
  wire_close(&bad);
  assert_served(&other, 3);
  wire_close(&other);
}

Test(server_errors, byte_by_byte_frames_parse) {
  wire_conn c;
  connect_hello(&c);
  int64_t s[1] = {6};
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_upload(&w, 9, DSP_F32, 1, s);
  req->req_id = 77;
  uint8_t buf[256];
  size_t n = dsp_req_frame_encode(req, sizeof k_d6, buf);
  memcpy(buf + n, k_d6, sizeof k_d6);
  for (size_t i = 0; i < n + sizeof k_d6; i++)
    cr_assert_eq(wire_send_raw(&c, buf + i, 1), 0);
  void *got;
  size_t nb;
  cr_assert_eq(wire_read_tensor(&c, 9, &got, &nb, NULL, NULL), 0);
  cr_assert_eq(memcmp(got, k_d6, sizeof k_d6), 0);
  free(got);
  wire_close(&c);
}

Test(server_errors, memory_is_freed_on_disconnect) {
  wire_conn watch, a;
  connect_hello(&watch);
  Dspwire__StatsReply base, st;
  cr_assert_eq(wire_get_stats(&watch, &base), 0);
  connect_hello(&a);
  int64_t s[2] = {64, 64};
  float *d = calloc(64 * 64, sizeof *d);
  wire_upload(&a, 1, DSP_F32, 2, s, d, 64 * 64 * 4);
  wire_upload(&a, 2, DSP_F32, 2, s, d, 64 * 64 * 4);
  uint64_t in[2] = {1, 2};
  wire_op(&a, DSP_OP_MATMUL, in, 2, 3, NULL, 0, NULL, 0);
  wire_track(&a, 1);
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(&watch, &st), 0);
  cr_assert_eq(st.server_tensors, base.server_tensors + 3);
  cr_assert_eq(st.server_bytes, base.server_bytes + 3 * 64 * 64 * 4);
  cr_assert_eq(st.sessions, base.sessions + 1);
  /* pipelined work still queued when the connection drops */
  for (int i = 0; i < 50; i++) {
    uint64_t o = 100 + (uint64_t)i;
    wire_op(&a, DSP_OP_MATMUL, in, 2, o, NULL, 0, NULL, 0);
  }
  wire_close(&a);
  free(d);
  /* teardown is asynchronous: ask until it is done (bounded) */
  int back = 0;
  for (int i = 0; i < 2000 && !back; i++) {
    cr_assert_eq(wire_get_stats(&watch, &st), 0);
    back = st.server_tensors == base.server_tensors &&
           st.server_bytes == base.server_bytes &&
           st.sessions == base.sessions;
    if (!back) poll(NULL, 0, 5);
  }
  cr_assert(back, "server still holds %llu tensors, %llu bytes",
            (unsigned long long)st.server_tensors,
            (unsigned long long)st.server_bytes);
  wire_close(&watch);
}

Test(server_errors, concurrent_sessions_have_separate_ids) {
  wire_conn a, b;
  connect_hello(&a);
  connect_hello(&b);
  float x[6] = {9, 9, 9, 9, 9, 9};
  int64_t s[1] = {6};
  wire_upload(&a, 1, DSP_F32, 1, s, k_d6, sizeof k_d6);
  wire_upload(&b, 1, DSP_F32, 1, s, x, sizeof x);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&a, 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(memcmp(got, k_d6, n), 0);
  free(got);
  cr_assert_eq(wire_read_tensor(&b, 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(memcmp(got, x, n), 0);
  free(got);
  wire_close(&a);
  wire_close(&b);
}

/* ------------------------------------------------------------ limits */

static void start_small(void) {
  const char *args[] = {"--log-level", "error", "--max-session-bytes",
                        "2048", "--max-output-queue", "4096",
                        "--max-sessions", "4", NULL};
  start_with(args);
}

TestSuite(server_limits, .init = start_small, .fini = stop_checked);

Test(server_limits, quota_refuses_and_keeps_everything_else) {
  wire_conn c;
  connect_hello(&c);
  float d[200];
  for (int i = 0; i < 200; i++) d[i] = (float)i;
  int64_t s[1] = {200};
  char msg[700];
  /* 800 bytes + headers and id of 2048 */
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  wire_upload(&c, 2, DSP_F32, 1, s, d, sizeof d);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EQUOTA,
               "%s", msg);
  cr_assert(strstr(msg, "limit of 2048 bytes"), "%s", msg);
  uint64_t in[2] = {1, 1};
  wire_op(&c, DSP_OP_ADD, in, 2, 3, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EQUOTA,
               "%s", msg);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(memcmp(got, d, sizeof d), 0);
  free(got);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.bytes, 800);
  cr_assert_geq(st.limit_violations, 2);
  uint64_t f[1] = {1};
  wire_free(&c, f, 1, NULL, 0);
  /* 2 is poisoned by its failed upload; the quota is judged after the
   * pipelined free ran */
  wire_upload(&c, 4, DSP_F32, 1, s, d, sizeof d);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.bytes, 800);
  wire_close(&c);
}

Test(server_limits, slow_reader_is_dropped_others_served) {
  wire_conn slow, other;
  connect_hello(&slow);
  connect_hello(&other);
  float d[200] = {0};
  int64_t s[1] = {200};
  wire_upload(&slow, 1, DSP_F32, 1, s, d, sizeof d);
  /* asks for far more than socket buffers and the 4 KiB queue hold */
  for (int i = 0; i < 40000; i++)
    if (!wire_read(&slow, 1)) break; /* send fails once dropped */
  /* Read nothing until the server has dropped the slow reader: draining
   * earlier would let a server slower than the client (valgrind) keep up,
   * and then there is nothing to drop. */
  Dspwire__StatsReply st;
  for (int i = 0; i < 6000; i++) {
    cr_assert_eq(wire_get_stats(&other, &st), 0);
    if (st.limit_violations >= 1) break;
    usleep(20000);
  }
  cr_assert_geq(st.limit_violations, 1, "the slow reader was never dropped");
  cr_assert_eq(wire_wait_closed(&slow), 1);
  wire_close(&slow);
  assert_served(&other, 7);
  wire_close(&other);
}

Test(server_limits, session_limit_refuses_with_error) {
  wire_conn c[4], extra;
  for (int i = 0; i < 4; i++) connect_hello(&c[i]);
  cr_assert_eq(wire_connect(&extra, g_srv.port), 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&extra, &r, NULL, NULL), 0);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_ELIMIT);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_wait_closed(&extra), 1);
  wire_close(&extra);
  assert_served(&c[0], 1);
  for (int i = 0; i < 4; i++) wire_close(&c[i]);
}
