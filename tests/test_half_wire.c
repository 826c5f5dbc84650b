/* f16 and bf16 across the wire (protocol 1.7) against a real server on
 * 127.0.0.1: the hello lists the half dtypes only to a client that said
 * 1.7; a 1.7 client's uploads and reads carry their bits unchanged, and
 * LOCAL and REMOTE hold the same bytes; a client that said 1.6 cannot
 * name a half dtype (its upload fails with DISPATCH_EDTYPE naming the
 * dtype and both versions) and is never sent a half tensor (a checkpoint
 * load that would make one is refused and makes nothing), while the rest
 * of its session keeps working. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dsp.h"
#include "frame.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static char g_dir[64];

static void start(void) {
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp_halfwire_XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
  const char *args[] = {"--checkpoint-dir", g_dir, "--threads", "2",
                        "--log-level", "warn", NULL};
  check_server_start(&g_srv, args);
}

static void stop(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
  if (g_dir[0]) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_assert_eq(system(cmd), 0);
  }
}

TestSuite(half_wire, .init = start, .fini = stop, .timeout = 60);

/* f16 bits: 1, -2.5, 65504 (the largest), 2^-24 (the smallest subnormal),
 * -0, +inf, a quiet NaN, 1/3 rounded */
static const uint16_t k_f16[8] = {0x3c00, 0xc100, 0x7bff, 0x0001,
                                  0x8000, 0x7c00, 0x7e00, 0x3555};
/* bf16 bits: 1, -3.140625, the largest finite, -inf, a NaN with payload,
 * the smallest subnormal */
static const uint16_t k_bf16[6] = {0x3f80, 0xc049, 0x7f7f,
                                   0xff80, 0x7fc1, 0x0001};

/* A raw connection whose hello says 1.minor; the reply's dtypes in *dts
 * (joined by spaces) when dts is not NULL. */
static void connect_minor(wire_conn *c, unsigned minor, char *dts,
                          size_t len) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  uint64_t id = wire_hello_send(c, DSP_PROTO_MAJOR, minor, "half");
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, id);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_HELLO);
  cr_assert_eq(r->hello->minor, DSP_PROTO_MINOR, "the server's own minor");
  if (dts) {
    dts[0] = '\0';
    for (size_t i = 0; i < r->hello->n_dtypes; i++)
      snprintf(dts + strlen(dts), len - strlen(dts), "%s%s", i ? " " : "",
               r->hello->dtypes[i]);
  }
  wire_reply_free(r, NULL);
  c->next_req_id = 100;
}

/* The deferred error a sync reports: its code, with the message in msg. */
static int sync_code(wire_conn *c, char *msg, size_t len) {
  int rc = wire_sync_check(c, msg, len, NULL);
  cr_assert_neq(rc, 1, "sync: I/O failure");
  return rc;
}

/* An f32 upload and its read still work on c (the session went on). */
static void f32_still_works(wire_conn *c, uint64_t id) {
  float v[3] = {1.5f, -2, 1e30f};
  cr_assert_eq(wire_round_trip(c, id, DSP_F32, v, sizeof v), 0,
               "the session stopped serving f32");
}

/* Sends req under the connection's next request id; returns that id. */
static uint64_t send_next(wire_conn *c, Dspwire__Request *req,
                          const void *bulk, size_t len) {
  req->req_id = c->next_req_id++;
  cr_assert_eq(wire_send(c, req, bulk, len), 0);
  return req->req_id;
}

Test(half_wire, hello_lists_half_dtypes_only_to_a_1_7_client) {
  wire_conn c;
  char dts[128];
  connect_minor(&c, DSP_PROTO_MINOR, dts, sizeof dts);
  cr_assert_str_eq(dts, "f32 f64 i64 bool f16 bf16");
  wire_close(&c);
  connect_minor(&c, 6, dts, sizeof dts);
  cr_assert_str_eq(dts, "f32 f64 i64 bool", "a 1.6 client is told of none");
  wire_close(&c);
}

/* Every bit pattern (signed zero, subnormals, infinities, NaN payloads)
 * comes back as it went, with its dtype. */
Test(half_wire, a_1_7_upload_reads_back_bit_for_bit) {
  wire_conn c;
  connect_minor(&c, DSP_PROTO_MINOR, NULL, 0);
  int64_t s1[2] = {2, 4}, s2[1] = {6};
  cr_assert_neq(wire_upload(&c, 1, DSP_F16, 2, s1, k_f16, sizeof k_f16), 0);
  cr_assert_neq(wire_upload(&c, 2, DSP_BF16, 1, s2, k_bf16, sizeof k_bf16), 0);
  char msg[512] = "";
  cr_assert_eq(sync_code(&c, msg, sizeof msg), 0, "%s", msg);
  const void *want[2] = {k_f16, k_bf16};
  size_t wn[2] = {sizeof k_f16, sizeof k_bf16};
  for (int i = 0; i < 2; i++) {
    void *got;
    size_t n;
    int nd;
    int64_t sh[8];
    cr_assert_eq(wire_read_tensor(&c, (uint64_t)i + 1, &got, &n, &nd, sh), 0);
    cr_assert_eq(n, wn[i]);
    cr_assert_eq(memcmp(got, want[i], n), 0, "tensor %d: bits differ", i + 1);
    cr_assert_eq(nd, i == 0 ? 2 : 1);
    free(got);
  }
  /* a bulk of the f32 size for an f16 meta is refused (2 bytes each) */
  float four[4] = {0};
  int64_t s4[1] = {4};
  wire_upload(&c, 3, DSP_F16, 1, s4, four, sizeof four);
  cr_assert_eq(sync_code(&c, msg, sizeof msg), DISPATCH_EINVAL, "%s", msg);
  cr_assert(strstr(msg, "f16 [4] needs 8"), "%s", msg);
  wire_close(&c);
}

Test(half_wire, a_1_6_client_cannot_name_a_half_dtype) {
  wire_conn c;
  connect_minor(&c, 6, NULL, 0);
  int64_t sh[1] = {6};
  wire_upload(&c, 1, DSP_BF16, 1, sh, k_bf16, sizeof k_bf16);
  char msg[512] = "";
  cr_assert_eq(sync_code(&c, msg, sizeof msg), DISPATCH_EDTYPE, "%s", msg);
  cr_assert(strstr(msg, "upload: bf16 needs protocol 1.7; the client speaks "
                        "1.6"),
            "%s", msg);
  void *got = NULL;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 1, &got, &n, NULL, NULL),
               DISPATCH_EPOISONED, "the refused upload made nothing");
  f32_still_works(&c, 2);
  wire_close(&c);
}

/* A 1.6 session can still come to hold a half tensor (a cast names its
 * dtype by number): a read of it is refused with DISPATCH_EDTYPE naming
 * the dtype and both versions, no bytes of it are sent, and the session
 * goes on (the same tensor cast back to f32 reads). */
Test(half_wire, a_1_6_read_of_a_half_tensor_is_refused) {
  wire_conn c;
  connect_minor(&c, 6, NULL, 0);
  float v[3] = {1.5f, -0.25f, 65280.0f};
  int64_t sh[1] = {3};
  wire_upload(&c, 1, DSP_F32, 1, sh, v, sizeof v);
  uint64_t in1[1] = {1}, in2[1] = {2};
  int64_t to_bf16[1] = {DSP_BF16}, to_f32[1] = {DSP_F32};
  wire_op(&c, DSP_OP_CAST, in1, 1, 2, to_bf16, 1, NULL, 0);
  uint64_t rid = wire_read(&c, 2);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_not_null(r->error, "a bf16 tensor was sent to a 1.6 client");
  cr_assert_eq(r->error->code, DISPATCH_EDTYPE, "%s", r->error->message);
  cr_assert(strstr(r->error->message,
                   "read 2: bf16 needs protocol 1.7; the client speaks 1.6"),
            "%s", r->error->message);
  cr_assert_null(bulk, "no bytes of it either");
  cr_assert_neq(r->body_case, DSPWIRE__REPLY__BODY_READ);
  wire_reply_free(r, bulk);
  wire_op(&c, DSP_OP_CAST, in2, 1, 3, to_f32, 1, NULL, 0);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 3, &got, &n, NULL, NULL), 0);
  cr_assert_eq(n, sizeof v);
  cr_assert_eq(memcmp(got, v, n), 0, "exact in bf16, so back unchanged");
  free(got);
  f32_still_works(&c, 4);
  wire_close(&c);
}

/* A file with a bf16 tensor, saved by a 1.7 client: a 1.6 client's load
 * would be told its dtype, so it is refused whole (no tensor made), naming
 * the tensor, the dtype and the versions; a 1.7 client loads it. */
Test(half_wire, a_1_6_client_is_never_sent_a_half_tensor) {
  wire_conn c;
  connect_minor(&c, DSP_PROTO_MINOR, NULL, 0);
  float v[2] = {3, 4};
  int64_t s2[1] = {2}, s6[1] = {6};
  wire_upload(&c, 1, DSP_F32, 1, s2, v, sizeof v);
  wire_upload(&c, 2, DSP_BF16, 1, s6, k_bf16, sizeof k_bf16);
  dsp_wreq w;
  const char *names[2] = {"plain", "brain"};
  uint64_t ids[2] = {1, 2};
  Dspwire__Request *r =
      dsp_wreq_ckpt_save(&w, "mixed", 5, names, ids, 2, NULL, NULL, 0);
  send_next(&c, r, NULL, 0);
  Dspwire__Reply *rep;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &rep, &bulk, &bl), 0);
  cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
  wire_reply_free(rep, bulk);
  wire_close(&c);

  for (unsigned minor = 6; minor <= DSP_PROTO_MINOR; minor++) {
    connect_minor(&c, minor, NULL, 0);
    r = dsp_wreq_ckpt_load(&w, "mixed", 5, 10, 0);
    send_next(&c, r, NULL, 0);
    cr_assert_eq(wire_recv(&c, &rep, &bulk, &bl), 0);
    if (minor < DSP_PROTO_MINOR_HALF) {
      cr_assert_not_null(rep->error);
      cr_assert_eq(rep->error->code, DISPATCH_EDTYPE, "%s",
                   rep->error->message);
      cr_assert(strstr(rep->error->message, "tensor \"brain\": bf16 needs "
                                            "protocol 1.7; the client speaks "
                                            "1.6"),
                "%s", rep->error->message);
      wire_reply_free(rep, bulk);
      Dspwire__StatsReply st;
      cr_assert_eq(wire_get_stats(&c, &st), 0);
      cr_assert_eq(st.tensors, 0, "a refused load makes nothing");
      f32_still_works(&c, 20);
    } else {
      cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
      cr_assert_eq(rep->body_case, DSPWIRE__REPLY__BODY_CKPT);
      cr_assert_eq(rep->ckpt->n_metas, 2);
      cr_assert_eq(rep->ckpt->metas[1]->dtype, DSP_BF16);
      wire_reply_free(rep, bulk);
      void *got;
      size_t n;
      cr_assert_eq(wire_read_tensor(&c, 11, &got, &n, NULL, NULL), 0);
      cr_assert_eq(n, sizeof k_bf16);
      cr_assert_eq(memcmp(got, k_bf16, n), 0);
      free(got);
    }
    wire_close(&c);
  }
}

/* The library: a half tensor uploaded to LOCAL and to REMOTE reads back
 * the same bytes on both, bit for bit, and moves between them unchanged. */
Test(half_wire, local_and_remote_hold_the_same_half_bytes) {
  dispatch_device *loc = check_open(NULL, 0), *rem = check_open(&g_srv, 1);
  int64_t s1[2] = {4, 2}, s2[2] = {2, 3};
  dispatch_tensor *lh, *rh, *lb, *rb, *moved;
  OK(loc, dispatch_tensor_from_data(loc, DISPATCH_F16, 2, s1, k_f16,
                                    sizeof k_f16, &lh));
  OK(rem, dispatch_tensor_from_data(rem, DISPATCH_F16, 2, s1, k_f16,
                                    sizeof k_f16, &rh));
  OK(loc, dispatch_tensor_from_data(loc, DISPATCH_BF16, 2, s2, k_bf16,
                                    sizeof k_bf16, &lb));
  OK(rem, dispatch_tensor_from_data(rem, DISPATCH_BF16, 2, s2, k_bf16,
                                    sizeof k_bf16, &rb));
  cr_assert_eq(dispatch_tensor_nbytes(rh), 16, "2 bytes an element");
  cr_assert_eq(dispatch_tensor_dtype(rb), DISPATCH_BF16);
  check_same(lh, rh, "f16");
  check_same(lb, rb, "bf16");
  uint16_t got[8];
  OK(rem, dispatch_tensor_read(rh, got, sizeof got));
  cr_assert_eq(memcmp(got, k_f16, sizeof got), 0);
  OK(rem, dispatch_to_device(lb, rem, &moved));
  check_same(lb, moved, "bf16 moved to the server");
  /* the byte count is the half size, not the f32 one */
  int rc = dispatch_tensor_read(rb, got, 6 * 4);
  cr_assert_eq(rc, DISPATCH_EINVAL);
  dispatch_tensor_free(moved);
  dispatch_tensor_free(lh);
  dispatch_tensor_free(rh);
  dispatch_tensor_free(lb);
  dispatch_tensor_free(rb);
  dispatch_device_close(loc);
  dispatch_device_close(rem);
}

/* safetensors F16 and BF16: a REMOTE tensor saved by the server into its
 * --checkpoint-dir is read by a LOCAL dispatch_load from the directory
 * with the same dtype and bits, and a file dispatch_save wrote LOCAL is
 * loaded by the server the same way. */
Test(half_wire, checkpoints_keep_half_dtypes_and_bits) {
  dispatch_device *loc = check_open(NULL, 0), *rem = check_open(&g_srv, 1);
  int64_t s1[1] = {8}, s2[2] = {3, 2};
  dispatch_tensor *t[2], *lt[2];
  OK(rem, dispatch_tensor_from_data(rem, DISPATCH_F16, 1, s1, k_f16,
                                    sizeof k_f16, &t[0]));
  OK(rem, dispatch_tensor_from_data(rem, DISPATCH_BF16, 2, s2, k_bf16,
                                    sizeof k_bf16, &t[1]));
  OK(loc, dispatch_tensor_from_data(loc, DISPATCH_F16, 1, s1, k_f16,
                                    sizeof k_f16, &lt[0]));
  OK(loc, dispatch_tensor_from_data(loc, DISPATCH_BF16, 2, s2, k_bf16,
                                    sizeof k_bf16, &lt[1]));
  const char *names[2] = {"h", "b"};
  OK(rem, dispatch_save_on_server(rem, "srv.safetensors", names, t, 2, NULL));
  char path[128];
  snprintf(path, sizeof path, "%s/local.safetensors", g_dir);
  OK(loc, dispatch_save(loc, path, names, lt, 2, NULL));
  dispatch_checkpoint *a, *b;
  snprintf(path, sizeof path, "%s/srv.safetensors", g_dir);
  OK(loc, dispatch_load(loc, path, &a));
  OK(rem, dispatch_load_on_server(rem, "local.safetensors", &b));
  for (int i = 0; i < 2; i++) {
    check_same(lt[i], dispatch_checkpoint_get(a, names[i]), "server's file");
    check_same(t[i], dispatch_checkpoint_get(b, names[i]), "local file");
  }
  dispatch_checkpoint_free(a);
  dispatch_checkpoint_free(b);
  for (int i = 0; i < 2; i++) {
    dispatch_tensor_free(t[i]);
    dispatch_tensor_free(lt[i]);
  }
  dispatch_device_close(loc);
  dispatch_device_close(rem);
}

/* dispatch_convert gives the bits dispatch_cast gives, LOCAL and REMOTE,
 * for every pair of float dtypes, over f32 values of every exponent
 * (ties, subnormals, overflow to infinity, NaN); same dtype is a copy;
 * other dtypes and NULL pointers are refused. */
Test(half_wire, convert_gives_the_bits_cast_gives) {
  enum { N = 4096 };
  uint32_t *bits = malloc(N * 4);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < N; i++) { /* xorshift: every exponent */
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    bits[i] = (uint32_t)x;
  }
  const uint32_t special[] = {0x3f808000, 0x3f818000, 0x00008000,
                              0x477ff000, 0x33000000, 0x7f7fffff,
                              0xff800000, 0x80000000, 0x7fc00001};
  memcpy(bits, special, sizeof special);
  dispatch_device *loc = check_open(NULL, 0), *rem = check_open(&g_srv, 1);
  dispatch_device *devs[2] = {loc, rem};
  const dispatch_dtype dts[4] = {DISPATCH_F32, DISPATCH_F64, DISPATCH_F16,
                                 DISPATCH_BF16};
  const size_t sz[4] = {4, 8, 2, 2};
  unsigned char *src = malloc(N * 8), *want = malloc(N * 8),
                *got = malloc(N * 8);
  int64_t sh[1] = {N};
  for (int a = 0; a < 4; a++) {
    /* the source values: the random f32 bits converted into dts[a] */
    OK(loc, dispatch_convert(src, dts[a], bits, DISPATCH_F32, N));
    if (dts[a] == DISPATCH_F64) {
      /* just above a tie of f16 (and of bf16) that f32 cannot tell from
       * the tie: rounded once they go up, through f32 they would not */
      const double above[4] = {1 + 0x1p-11 + 0x1p-40, -(1 + 0x1p-11 + 0x1p-40),
                               1 + 0x1p-8 + 0x1p-40, 3 * 0x1p-25 + 0x1p-60};
      memcpy(src, above, sizeof above);
    }
    for (int b = 0; b < 4; b++)
      for (int d = 0; d < 2; d++) {
        dispatch_tensor *t, *c;
        OK(devs[d], dispatch_tensor_from_data(devs[d], dts[a], 1, sh, src,
                                              N * sz[a], &t));
        OK(devs[d], dispatch_cast(t, dts[b], &c));
        OK(devs[d], dispatch_tensor_read(c, want, N * sz[b]));
        cr_assert_eq(dispatch_convert(got, dts[b], src, dts[a], N), 0);
        for (int i = 0; i < N; i++)
          cr_assert_eq(memcmp(got + i * sz[b], want + i * sz[b], sz[b]), 0,
                       "%s -> %s on %s, element %d (f32 bits 0x%08x)",
                       dsp_dtype_name((dsp_dtype)dts[a]),
                       dsp_dtype_name((dsp_dtype)dts[b]),
                       d ? "remote" : "local", i, bits[i]);
        dispatch_tensor_free(t);
        dispatch_tensor_free(c);
      }
  }
  /* ties to even, by hand: 1 + 2^-8 -> 1 (0x3f80), 1 + 3 * 2^-8 -> 0x3f82 */
  uint16_t h[2];
  float tie[2] = {1.00390625f, 1.01171875f};
  cr_assert_eq(dispatch_convert(h, DISPATCH_BF16, tie, DISPATCH_F32, 2), 0);
  cr_assert(h[0] == 0x3f80 && h[1] == 0x3f82, "%04x %04x", h[0], h[1]);
  cr_assert_eq(dispatch_convert(got, DISPATCH_I64, src, DISPATCH_F32, 1),
               DISPATCH_EDTYPE);
  cr_assert_eq(dispatch_convert(got, DISPATCH_F16, src, DISPATCH_BOOL, 1),
               DISPATCH_EDTYPE);
  cr_assert_eq(dispatch_convert(NULL, DISPATCH_F16, src, DISPATCH_F32, 1),
               DISPATCH_EINVAL);
  cr_assert_eq(dispatch_convert(NULL, DISPATCH_F16, NULL, DISPATCH_F32, 0), 0);
  free(bits);
  free(src);
  free(want);
  free(got);
  dispatch_device_close(loc);
  dispatch_device_close(rem);
}

/* Captured graphs follow the same rule for a 1.6 client: a placeholder of
 * a half dtype is refused at GraphDefine, and a replay whose output is a
 * half tensor (a cast inside the graph) is refused instead of sent. */
Test(half_wire, a_1_6_graph_neither_takes_nor_gives_half) {
  wire_conn c;
  connect_minor(&c, 6, NULL, 0);
  Dspwire__TensorMeta m = DSPWIRE__TENSOR_META__INIT;
  int64_t sh[1] = {2};
  m.dtype = DSP_BF16;
  m.n_shape = 1;
  m.shape = sh;
  Dspwire__TensorMeta *mp[1] = {&m};
  Dspwire__GraphNode cast = DSPWIRE__GRAPH_NODE__INIT;
  uint32_t ins[1] = {0}, outs[1] = {1};
  int64_t to[1] = {DSP_BF16};
  cast.op = DSP_OP_CAST;
  cast.n_inputs = 1;
  cast.inputs = ins;
  cast.output = 1;
  cast.n_ints = 1;
  cast.ints = to;
  Dspwire__GraphNode *np[1] = {&cast};
  Dspwire__GraphDefine d;
  wire_graph_define_init(&d, 5, mp, 1, 2, np, 1, outs, 1);
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_DEFINE;
  req.graph_define = &d;
  send_next(&c, &req, NULL, 0);
  char msg[512] = "";
  cr_assert_eq(sync_code(&c, msg, sizeof msg), DISPATCH_EDTYPE, "%s", msg);
  cr_assert(strstr(msg, "graph 5: input 0: bf16 needs protocol 1.7"), "%s",
            msg);
  /* f32 in, bf16 out: defined, but a replay sends no bf16 back */
  m.dtype = DSP_F32;
  d.graph = 6;
  send_next(&c, &req, NULL, 0);
  cr_assert_eq(sync_code(&c, msg, sizeof msg), 0, "%s", msg);
  Dspwire__GraphReplay gr = DSPWIRE__GRAPH_REPLAY__INIT;
  gr.graph = 6;
  gr.n_inputs = 1;
  gr.inputs = mp;
  Dspwire__Request rr = DSPWIRE__REQUEST__INIT;
  rr.body_case = DSPWIRE__REQUEST__BODY_GRAPH_REPLAY;
  rr.graph_replay = &gr;
  float x[2] = {1, 2};
  send_next(&c, &rr, x, sizeof x);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rr.req_id);
  cr_assert_not_null(r->error, "a bf16 output was sent to a 1.6 client");
  cr_assert_eq(r->error->code, DISPATCH_EDTYPE, "%s", r->error->message);
  cr_assert(strstr(r->error->message, "graph 6: output 0: bf16 needs "
                                      "protocol 1.7; the client speaks 1.6"),
            "%s", r->error->message);
  cr_assert_null(bulk);
  wire_reply_free(r, bulk);
  f32_still_works(&c, 9);
  wire_close(&c);
}
