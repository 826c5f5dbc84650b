/* Hostile clients against the real dispatch-server on 127.0.0.1: truncated
 * frames, huge lengths, negative and overflowing shapes, id reuse, unknown
 * op codes, wrong byte counts, a frame trickled byte by byte while another
 * client is served, 1000 connections opened and dropped. After each, a
 * well-behaved client still gets correct results, the server-wide tensor
 * and byte counters are back to their baseline exactly, and the server's
 * VmRSS is back near its baseline (+16 MiB). */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dsp.h"
#include "frame.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#define RSS_MARGIN_KB (16 * 1024)

static sp_server g_srv;
static long g_rss_base_kb;
static Dspwire__StatsReply g_base;

static long rss_kb(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)g_srv.pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "hostile-test"), 0);
}

/* A well-behaved session: upload, matmul, read (checked against the
 * numbers), free, and a clean sync. */
static void good_client(void) {
  wire_conn c;
  connect_hello(&c);
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
  int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
  wire_upload(&c, 1, DSP_F32, 2, sa, a, sizeof a);
  wire_upload(&c, 2, DSP_F32, 2, sb, b, sizeof b);
  uint64_t in[2] = {1, 2};
  wire_op(&c, DSP_OP_MATMUL, in, 2, 3, NULL, 0, NULL, 0);
  void *data;
  size_t nb;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&c, 3, &data, &nb, &ndim, shape), 0);
  float want[4] = {1 + 3, 2 + 3, 4 + 6, 5 + 6};
  cr_assert_eq(nb, sizeof want);
  cr_assert_eq(ndim, 2);
  cr_assert_eq(shape[0], 2);
  cr_assert_eq(shape[1], 2);
  cr_assert_arr_eq(data, want, sizeof want);
  free(data);
  uint64_t all[3] = {1, 2, 3};
  wire_free(&c, all, 3, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_bye(&c);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
}

/* Stats from a fresh session once every other session has been torn down
 * (closing is asynchronous: this waits, bounded, for sessions == 1). */
static void settled_stats(Dspwire__StatsReply *st) {
  for (int i = 0; i < 600; i++) {
    wire_conn c;
    connect_hello(&c);
    cr_assert_eq(wire_get_stats(&c, st), 0);
    wire_bye(&c);
    wire_wait_closed(&c);
    wire_close(&c);
    if (st->sessions == 1) return;
    sleep_ms(50);
  }
  cr_assert_fail("%llu sessions still open",
                 (unsigned long long)st->sessions);
}

/* Under AddressSanitizer freed blocks sit in a quarantine (256 MiB by
 * default) and 1000 connections' 64 KiB read buffers would look like
 * growth; a small quarantine keeps VmRSS meaningful for a sanitized server
 * that also hands freed pages back at once (ASAN_OPTIONS is ignored by a
 * plain build). */
static void small_asan_quarantine(void) {
  const char *old = getenv("ASAN_OPTIONS");
  if (old && strstr(old, "quarantine_size_mb")) return;
  char buf[1024];
  snprintf(buf, sizeof buf,
           "%s%squarantine_size_mb=4:allocator_release_to_os_interval_ms=0",
           old ? old : "", old && *old ? ":" : "");
  setenv("ASAN_OPTIONS", buf, 1);
}

static void start(void) {
  small_asan_quarantine();
  const char *args[] = {"--log-level", "error", "--threads", "2",
                        "--max-sessions", "400", "--max-frame", "4194304",
                        NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
  good_client(); /* warm up: threads, BLAS, allocator arenas */
  settled_stats(&g_base);
  g_rss_base_kb = rss_kb();
  cr_assert_gt(g_rss_base_kb, 0);
}

/* The server survived: correct results, counters exactly at baseline,
 * memory near baseline, and a clean exit. */
static void check_recovered(void) {
  good_client();
  Dspwire__StatsReply st;
  settled_stats(&st);
  cr_assert_eq(st.server_tensors, g_base.server_tensors);
  cr_assert_eq(st.server_bytes, g_base.server_bytes);
  long rss = rss_kb();
  cr_assert_lt(rss, g_rss_base_kb + RSS_MARGIN_KB,
               "VmRSS %ld kB, baseline %ld kB", rss, g_rss_base_kb);
  cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

static void stop_unchecked(void) {
  if (g_srv.pid > 0) sp_stop(&g_srv);
}

TestSuite(hostile, .init = start, .fini = stop_unchecked);

static void header(uint8_t out[DSP_FRAME_HEADER_SIZE], uint32_t msg_len,
                   uint32_t flags, uint64_t bulk_len) {
  dsp_frame_header h = {msg_len, flags, bulk_len};
  dsp_frame_header_encode(out, &h);
}

/* The error reply of a refused frame, then the close. */
static void expect_refused(wire_conn *c, int code) {
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0, "no error frame");
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, code, "got %d: %s", r->error->code,
               r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_wait_closed(c), 1);
  wire_close(c);
}

Test(hostile, truncated_frames_then_disconnect) {
  uint8_t h[DSP_FRAME_HEADER_SIZE];
  wire_conn c;
  /* half a header */
  connect_hello(&c);
  header(h, 10, 0, 0);
  cr_assert_eq(wire_send_raw(&c, h, 7), 0);
  wire_close(&c);
  /* a header promising 100 message bytes, 50 sent */
  connect_hello(&c);
  header(h, 100, 0, 0);
  uint8_t junk[64];
  memset(junk, 0x08, sizeof junk);
  cr_assert_eq(wire_send_raw(&c, h, sizeof h), 0);
  cr_assert_eq(wire_send_raw(&c, junk, 50), 0);
  wire_close(&c);
  /* an upload whose 1 MiB bulk stops after 1000 bytes: the tensor was
   * allocated for the bulk and must be freed with the session */
  connect_hello(&c);
  int64_t shape[1] = {1 << 18};
  float *big = calloc(1 << 18, sizeof *big);
  cr_assert_not_null(big);
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_upload(&w, 1, DSP_F32, 1, shape);
  req->req_id = 7;
  cr_assert_eq(wire_send(&c, req, NULL, 0), 0); /* header says no bulk */
  wire_close(&c);
  connect_hello(&c);
  uint8_t *buf = malloc(dsp_req_frame_size(req));
  cr_assert_not_null(buf);
  size_t flen = dsp_req_frame_encode(req, (1u << 18) * sizeof(float), buf);
  cr_assert_eq(wire_send_raw(&c, buf, flen), 0);
  cr_assert_eq(wire_send_raw(&c, big, 1000), 0);
  free(buf);
  free(big);
  wire_close(&c);
  check_recovered();
}

Test(hostile, huge_lengths_are_refused_before_allocating) {
  uint8_t h[DSP_FRAME_HEADER_SIZE];
  wire_conn c;
  connect_hello(&c);
  header(h, UINT32_MAX, 0, 0);
  cr_assert_eq(wire_send_raw(&c, h, sizeof h), 0);
  expect_refused(&c, DISPATCH_ETOOLARGE);

  connect_hello(&c);
  header(h, 4, 0, UINT64_MAX);
  cr_assert_eq(wire_send_raw(&c, h, sizeof h), 0);
  expect_refused(&c, DISPATCH_ETOOLARGE);

  connect_hello(&c); /* each part fits, the sum does not */
  header(h, 1u << 20, 0, 4194304 - (1u << 20) + 1);
  cr_assert_eq(wire_send_raw(&c, h, sizeof h), 0);
  expect_refused(&c, DISPATCH_ETOOLARGE);

  cr_assert_eq(wire_connect(&c, g_srv.port), 0); /* before the hello too */
  header(h, 0x7fffffff, 0, 1ull << 62);
  cr_assert_eq(wire_send_raw(&c, h, sizeof h), 0);
  expect_refused(&c, DISPATCH_ETOOLARGE);
  check_recovered();
}

/* Uploads and creation ops with shapes no tensor can have: each fails as a
 * deferred error with its own code, and the session goes on. */
Test(hostile, negative_and_overflowing_shapes) {
  wire_conn c;
  connect_hello(&c);
  static const struct {
    int ndim;
    int64_t shape[4];
    int code;
  } cases[] = {
      {2, {-1, 4}, DISPATCH_ESHAPE},
      {1, {INT64_MIN}, DISPATCH_ESHAPE},
      {3, {1ll << 40, 1ll << 40, 4}, DISPATCH_EOVERFLOW},
      {2, {INT64_MAX, 2}, DISPATCH_EOVERFLOW},
      {1, {1ll << 61}, DISPATCH_EOVERFLOW}, /* x4 bytes overflows */
      {2, {1 << 20, 1 << 20}, DISPATCH_ELIMIT},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    wire_upload(&c, 10 + i, DSP_F32, cases[i].ndim, cases[i].shape, NULL, 0);
    char msg[512];
    int rc = wire_sync_check(&c, msg, sizeof msg, NULL);
    cr_assert_eq(rc, cases[i].code, "case %zu: %d (%s)", i, rc, msg);
  }
  int64_t zs[3] = {DSP_F32, -5, 3};
  wire_op(&c, DSP_OP_ZEROS, NULL, 0, 30, zs, 3, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_ESHAPE);
  int64_t zb[4] = {DSP_F64, 1ll << 32, 1ll << 32, 1ll << 32};
  wire_op(&c, DSP_OP_ONES, NULL, 0, 31, zb, 4, NULL, 0);
  cr_assert_lt(wire_sync_check(&c, NULL, 0, NULL), 0);
  float x[4] = {1, 2, 3, 4};
  int64_t s4[1] = {4};
  wire_upload(&c, 1, DSP_F32, 1, s4, x, sizeof x);
  int64_t rs[2] = {-1, -1};
  uint64_t in1 = 1;
  wire_op(&c, DSP_OP_RESHAPE, &in1, 1, 32, rs, 2, NULL, 0);
  cr_assert_lt(wire_sync_check(&c, NULL, 0, NULL), 0);
  int64_t rb[2] = {INT64_MAX, INT64_MAX};
  wire_op(&c, DSP_OP_BROADCAST_TO, &in1, 1, 33, rb, 2, NULL, 0);
  cr_assert_lt(wire_sync_check(&c, NULL, 0, NULL), 0);
  /* the poisoned ids say why; the good tensor is intact */
  void *data;
  size_t nb;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&c, 10, &data, &nb, &ndim, shape),
               DISPATCH_EPOISONED);
  cr_assert_eq(wire_read_tensor(&c, 1, &data, &nb, &ndim, shape), 0);
  cr_assert_arr_eq(data, x, sizeof x);
  free(data);
  wire_close(&c); /* dropped without a bye: everything is freed anyway */
  check_recovered();
}

Test(hostile, id_reuse_never_overwrites) {
  wire_conn c;
  connect_hello(&c);
  float a[2] = {1, 2}, b[2] = {7, 8};
  int64_t s2[1] = {2};
  wire_upload(&c, 5, DSP_F32, 1, s2, a, sizeof a);
  wire_upload(&c, 5, DSP_F32, 1, s2, b, sizeof b);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EIDINUSE);
  uint64_t in[2] = {5, 5};
  wire_op(&c, DSP_OP_ADD, in, 2, 5, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EIDINUSE);
  wire_track(&c, 5);
  wire_op(&c, DSP_OP_SUM, in, 1, 6, NULL, 0, NULL, 0);
  Dspwire__Reply *r;
  wire_backward(&c, 6, 1, 1);
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_null(r->error);
  wire_reply_free(r, NULL);
  wire_backward(&c, 6, 1, 1); /* gradients id 1 is taken */
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_EIDINUSE);
  wire_reply_free(r, NULL);
  wire_grad(&c, 1, 5, 6); /* output id 6 is live */
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EIDINUSE);
  void *data;
  size_t nb;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&c, 5, &data, &nb, &ndim, shape), 0);
  cr_assert_arr_eq(data, a, sizeof a);
  free(data);
  /* the same ids in another session are another namespace */
  wire_conn d;
  connect_hello(&d);
  wire_upload(&d, 5, DSP_F32, 1, s2, b, sizeof b);
  cr_assert_eq(wire_read_tensor(&d, 5, &data, &nb, &ndim, shape), 0);
  cr_assert_arr_eq(data, b, sizeof b);
  free(data);
  wire_close(&d);
  wire_close(&c);
  check_recovered();
}

Test(hostile, unknown_op_codes) {
  wire_conn c;
  /* codes[1]: the first gap in the op table's codes (a new op may take
   * any fixed one: 33 was unknown until silu) */
  int codes[] = {0, 1, 999, -1, INT32_MAX, INT32_MIN};
  while (dsp_op_lookup(codes[1])) codes[1]++;
  cr_assert_lt(codes[1], 999);
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    connect_hello(&c);
    uint64_t in = 1;
    wire_op(&c, codes[i], &in, 1, 2, NULL, 0, NULL, 0);
    expect_refused(&c, DISPATCH_EPROTO);
  }
  /* a step names its op too: not an optimizer op is a deferred EINVAL */
  connect_hello(&c);
  wire_step(&c, DSP_OP_MATMUL, 0, NULL, 0, NULL, 0, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EINVAL);
  wire_step(&c, 12345, 0, NULL, 0, NULL, 0, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EINVAL);
  wire_close(&c);
  check_recovered();
}

/* Bulk bytes that do not match the meta are read and dropped (the stream
 * stays in step) and the upload fails as a deferred EINVAL. */
Test(hostile, wrong_byte_counts_keep_the_stream_in_step) {
  wire_conn c;
  connect_hello(&c);
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t s4[1] = {4};
  static const size_t sizes[] = {0, 4, 15, 17, 32};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    wire_upload(&c, 100 + i, DSP_F32, 1, s4, x, sizes[i]);
    cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EINVAL,
                 "bulk of %zu bytes", sizes[i]);
  }
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_upload(&w, 200, DSP_F32, 1, s4);
  req->upload->meta = NULL; /* no meta at all */
  req->req_id = 200;
  cr_assert_eq(wire_send(&c, req, x, 16), 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_EINVAL);
  wire_upload(&c, 1, DSP_F32, 1, s4, x, 16);
  void *data;
  size_t nb;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&c, 1, &data, &nb, &ndim, shape), 0);
  cr_assert_eq(nb, 16);
  cr_assert_arr_eq(data, x, 16);
  free(data);
  wire_close(&c);
  check_recovered();
}

/* One client trickles an upload frame a few bytes at a time with pauses;
 * between every piece another client completes a full request/reply, so
 * the partial frame never holds up the other session. */
Test(hostile, slow_partial_frame_does_not_block_others) {
  wire_conn slow, fast;
  connect_hello(&slow);
  connect_hello(&fast);
  float x[16];
  for (int i = 0; i < 16; i++) x[i] = (float)i * 0.5f;
  int64_t s16[1] = {16};
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_upload(&w, 9, DSP_F32, 1, s16);
  req->req_id = 90;
  size_t flen = dsp_req_frame_size(req);
  size_t total = flen + sizeof x;
  uint8_t *frame = malloc(total);
  cr_assert_not_null(frame);
  dsp_req_frame_encode(req, sizeof x, frame);
  memcpy(frame + flen, x, sizeof x);
  float fv[2] = {3, 4};
  int64_t s2[1] = {2};
  wire_upload(&fast, 1, DSP_F32, 1, s2, fv, sizeof fv);
  int rounds = 0;
  for (size_t off = 0; off < total; off += 2, rounds++) {
    size_t n = total - off < 2 ? total - off : 2;
    cr_assert_eq(wire_send_raw(&slow, frame + off, n), 0);
    sleep_ms(2);
    /* a round trip on the other session while this frame is partial */
    uint64_t in = 1;
    double s = (double)rounds;
    wire_op(&fast, DSP_OP_ADD_SCALAR, &in, 1, 1000 + rounds, NULL, 0, &s, 1);
    void *data;
    size_t nb;
    int ndim;
    int64_t shape[8];
    cr_assert_eq(wire_read_tensor(&fast, 1000 + rounds, &data, &nb, &ndim,
                                  shape), 0);
    float want[2] = {3 + (float)rounds, 4 + (float)rounds};
    cr_assert_arr_eq(data, want, sizeof want);
    free(data);
  }
  free(frame);
  cr_assert_gt(rounds, 30);
  void *data;
  size_t nb;
  int ndim;
  int64_t shape[8];
  cr_assert_eq(wire_read_tensor(&slow, 9, &data, &nb, &ndim, shape), 0);
  cr_assert_arr_eq(data, x, sizeof x);
  free(data);
  wire_close(&slow);
  wire_close(&fast);
  check_recovered();
}

/* 1000 connections in batches of 100: some silent, some half a frame,
 * some a full session with a tensor, some reset (SO_LINGER 0), all
 * dropped without a bye. */
Test(hostile, thousand_connections_opened_and_dropped) {
  enum { BATCH = 100, ROUNDS = 10 };
  wire_conn cs[BATCH];
  float x[64] = {0};
  int64_t s64[1] = {64};
  for (int r = 0; r < ROUNDS; r++) {
    int opened = 0;
    for (int i = 0; i < BATCH; i++) {
      if (wire_connect(&cs[i], g_srv.port) != 0) {
        cs[i].fd = -1;
        continue;
      }
      opened++;
      switch (i % 4) {
        case 0: break; /* silent */
        case 1: {
          uint8_t h[DSP_FRAME_HEADER_SIZE];
          header(h, 20, 0, 0);
          wire_send_raw(&cs[i], h, sizeof h);
          wire_send_raw(&cs[i], "\x08\x01\x12", 3);
          break;
        }
        case 2:
          wire_hello_send(&cs[i], DSP_PROTO_MAJOR, DSP_PROTO_MINOR, "drop");
          wire_upload(&cs[i], 1, DSP_F32, 1, s64, x, sizeof x);
          break;
        default: {
          struct linger lg = {1, 0};
          setsockopt(cs[i].fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
          wire_hello_send(&cs[i], DSP_PROTO_MAJOR, DSP_PROTO_MINOR, "rst");
          break;
        }
      }
    }
    cr_assert_eq(opened, BATCH, "round %d: %d connections opened", r,
                 opened);
    for (int i = 0; i < BATCH; i++) wire_close(&cs[i]);
    /* every dropped session is torn down before the next batch: glibc
     * keeps the heap's high-water mark, so piling batches up would
     * measure how many were alive at once, not what was left behind */
    Dspwire__StatsReply st;
    settled_stats(&st);
    cr_assert_eq(st.server_tensors, g_base.server_tensors, "round %d", r);
  }
  check_recovered();
}
