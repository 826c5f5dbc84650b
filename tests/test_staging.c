/* Uploads and reads go through the tensor's backend (issue 10 item 1c).
 *
 * The server used to decode an upload's bulk straight into storage and send
 * Read replies straight from storage, which only works while storage is
 * host memory. A test double backend ("xor") keeps its storage encoded
 * (every byte XOR 0xA5) and hands out staging memory of its own, as a GPU
 * backend hands out pinned host memory: whoever touches its storage
 * without the backend sees the wrong bytes. Through the server's own
 * request path (sv_stream_exec: frame decode, upload checks, the bulk
 * landing, the session running it) an upload must arrive intact and a bool
 * upload be checked; Read replies, copied or pinned, must carry the real
 * bytes. Then, through a real dispatch-server on the CPU backend (staging
 * is the storage itself there), uploads and reads on either side of the
 * 64 KiB copy limit round-trip and a bad bool byte is refused. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsp.h"
#include "dsp_internal.h"
#include "frame.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"
#include "sv.h"
#include "wire_req.h"

/* ------------------------------------------------------------------ */
/* the foreign-memory test double                                      */

#define XK 0xA5
static long g_staged_in, g_committed, g_staged_out, g_released;

static void xor_bytes(uint8_t *dst, const uint8_t *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = src[i] ^ XK;
}
static int x_alloc(void *b, size_t n, int zero, void **data) {
  (void)b;
  uint8_t *p = malloc(n ? n : 1);
  if (!p) return DISPATCH_ENOMEM;
  if (zero) memset(p, XK, n); /* encoded zeros */
  *data = p;
  return 0;
}
static void x_free(void *b, void *data) { (void)b, free(data); }
static int x_copy(void *b, void *dst, const void *src, size_t n) {
  (void)b;
  xor_bytes(dst, src, n);
  return 0;
}
static int x_stage_in(void *b, void *data, size_t n, void **host, void **tok) {
  (void)b, (void)data;
  *host = *tok = malloc(n ? n : 1);
  g_staged_in++;
  return *host ? 0 : DISPATCH_ENOMEM;
}
static int x_commit(void *b, void *data, const void *host, size_t n, void *tok) {
  (void)b, (void)tok;
  xor_bytes(data, host, n);
  g_committed++;
  return 0;
}
static int x_stage_out(void *b, const void *data, size_t n, const void **host,
                       void **tok) {
  (void)b;
  uint8_t *h = malloc(n ? n : 1);
  if (!h) return DISPATCH_ENOMEM;
  xor_bytes(h, data, n);
  *host = *tok = h;
  g_staged_out++;
  return 0;
}
static void x_release(void *b, void *tok) {
  (void)b;
  free(tok);
  g_released++;
}
/* Kernels: decode into CPU tensors, run the CPU kernel, encode. */
static int x_supports(void *b, dsp_opcode op, const dsp_meta *in, int n_in,
                      const dsp_meta *out) {
  const dsp_backend *cpu = dsp_cpu_backend();
  return dsp_op_lookup((int)op)->family != DSP_FAM_OPTIM &&
         cpu->supports_op(b, op, in, n_in, out);
}
static int x_run(void *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                 int n_in, const dsp_attrs *a, dsp_tensor *out) {
  (void)b;
  dsp_ctx *cctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *ci[8] = {0}, *co = NULL;
  int rc = n_in <= 8 ? 0 : DISPATCH_EINVAL;
  for (int i = 0; rc == 0 && i < n_in; i++) {
    size_t nb = dsp_tensor_nbytes(in[i]);
    uint8_t *tmp = malloc(nb ? nb : 1);
    xor_bytes(tmp, in[i]->storage->data, nb);
    rc = dsp_tensor_from_data(cctx, &in[i]->meta, tmp, nb, &ci[i]);
    free(tmp);
  }
  if (rc == 0) rc = dsp_tensor_new(cctx, &out->meta, &co);
  const dsp_backend *cpu = dsp_cpu_backend();
  if (rc == 0) rc = cpu->run_op(cpu->bctx, cctx, op, ci, n_in, a, co);
  if (rc == 0) xor_bytes(out->storage->data, co->storage->data, dsp_tensor_nbytes(co));
  else dsp_seterr(ctx, rc, "%s", dsp_ctx_errmsg(cctx));
  for (int i = 0; i < n_in; i++) dsp_tensor_unref(ci[i]);
  dsp_tensor_unref(co);
  dsp_ctx_free(cctx);
  return rc;
}
static const dsp_backend g_xor = {
    .name = "xor",
    .device = "test double: storage kept XOR 0xA5",
    .alloc = x_alloc,
    .free = x_free,
    .copy_in = x_copy,
    .copy_out = x_copy,
    .stage_in = x_stage_in,
    .commit_in = x_commit,
    .stage_out = x_stage_out,
    .stage_release = x_release,
    .caps = 0,
    .supports_op = x_supports,
    .run_op = x_run,
};

/* ------------------------------------------------------------------ */
/* through the server's request path, in process                       */

typedef struct stream {
  uint8_t *p;
  size_t n, cap;
  uint64_t rid;
} stream;

static void put(stream *s, const void *p, size_t n) {
  if (s->n + n > s->cap) {
    s->cap = (s->n + n) * 2 + 256;
    s->p = realloc(s->p, s->cap);
    cr_assert_not_null(s->p);
  }
  memcpy(s->p + s->n, p, n);
  s->n += n;
}
static void frame(stream *s, Dspwire__Request *req, const void *bulk,
                  size_t bulk_len) {
  req->req_id = ++s->rid;
  uint8_t *buf = malloc(dsp_req_frame_size(req));
  size_t n = dsp_req_frame_encode(req, bulk_len, buf);
  put(s, buf, n);
  free(buf);
  if (bulk_len) put(s, bulk, bulk_len);
}

static sv_config g_cfg;

static sv_session *session_on(const dsp_backend *be, sv_global *g,
                              dsp_ctx **io) {
  sv_config_defaults(&g_cfg);
  g_cfg.log_level = SV_LOG_ERROR;
  sv_log_level = SV_LOG_ERROR;
  memset(g, 0, sizeof *g);
  *io = dsp_ctx_new(dsp_cpu_backend());
  sv_session *s = sv_session_new(&g_cfg, g, NULL);
  cr_assert(*io && s);
  (*io)->backend = be;
  s->device = be; /* the session's device: uploads land on it */
  s->ctx->backend = be;
  return s;
}

static void session_done(sv_session *s, dsp_ctx *io) {
  sv_session_teardown(s);
  dsp_free(s);
  dsp_ctx_free(io);
}

static dsp_tensor *lookup(sv_session *s, uint64_t id) {
  sv_entry *e = sv_idmap_get(&s->tensors, id);
  return e ? e->t : NULL;
}

Test(staging, uploads_land_through_the_backend) {
  sv_global g;
  dsp_ctx *io;
  sv_session *s = session_on(&g_xor, &g, &io);
  float x[300];
  for (int i = 0; i < 300; i++) x[i] = (float)i * 0.25f - 7.0f;
  uint8_t good[5] = {1, 0, 1, 1, 0}, bad[5] = {1, 0, 2, 1, 0};
  stream st = {0};
  dsp_wreq w;
  int64_t sh[1] = {300}, sb[1] = {5};
  frame(&st, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), x, sizeof x);
  frame(&st, dsp_wreq_upload(&w, 2, DSP_BOOL, 1, sb), good, sizeof good);
  frame(&st, dsp_wreq_upload(&w, 3, DSP_BOOL, 1, sb), bad, sizeof bad);
  uint64_t in1 = 1;
  frame(&st, dsp_wreq_op(&w, DSP_OP_NEG, &in1, 1, 4, NULL, 0, NULL, 0, 1), NULL, 0);
  int hello = 1;
  sv_stream_stats stats;
  long before = g_staged_in;
  cr_assert_eq(sv_stream_exec(s, io, &hello, st.p, st.n, &stats), 0);
  cr_assert_eq(stats.executed, 4);
  cr_assert_eq(g_staged_in - before, 3, "each upload is staged by its backend");
  /* the bad bool byte is found in the staging memory, before the backend
   * takes it; the session goes on */
  cr_assert_eq(s->err_code, DISPATCH_EINVAL, "%d %s", s->err_code, s->err_msg);
  cr_assert(strstr(s->err_msg, "bool"), "%s", s->err_msg);
  cr_assert_null(lookup(s, 3));
  dsp_tensor *t1 = lookup(s, 1), *t2 = lookup(s, 2), *t4 = lookup(s, 4);
  cr_assert(t1 && t2 && t4);
  cr_assert_eq(t1->storage->backend, &g_xor);
  float back[300], neg[300];
  uint8_t bb[5];
  cr_assert_eq(dsp_tensor_read(s->ctx, t1, back, sizeof back), 0);
  cr_assert_eq(dsp_tensor_read(s->ctx, t2, bb, sizeof bb), 0);
  cr_assert_eq(dsp_tensor_read(s->ctx, t4, neg, sizeof neg), 0);
  for (int i = 0; i < 300; i++) {
    cr_assert_eq(back[i], x[i], "element %d: %g uploaded, %g held", i, x[i],
                 back[i]);
    cr_assert_eq(neg[i], -x[i], "neg element %d", i);
  }
  cr_assert_eq(memcmp(bb, good, 5), 0);
  free(st.p);
  session_done(s, io);
  cr_assert_eq(g_staged_in, g_released, "every staging is released");
}

/* A Read reply's bulk: small ones are copied into the frame, large ones
 * (bulk_by_ref) follow it from a pin; both through the backend. */
Test(staging, read_replies_come_out_through_the_backend) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  ctx->backend = &g_xor;
  for (int big = 0; big < 2; big++) {
    int64_t n = big ? 40000 : 1000; /* 160 KB over the 64 KiB copy limit */
    float *x = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = (float)i - 3.5f;
    dsp_meta m = {DSP_F32, 1, {n}};
    dsp_tensor *t;
    cr_assert_eq(dsp_tensor_from_data(ctx, &m, x, sizeof(float) * (size_t)n, &t), 0);
    sv_job j;
    memset(&j, 0, sizeof j);
    j.bulk_by_ref = 1;
    Dspwire__Reply r = DSPWIRE__REPLY__INIT;
    r.req_id = 7;
    long out0 = g_staged_out, rel0 = g_released;
    cr_assert_eq(sv_encode_read_reply(ctx, &r, t, &j), 0);
    const uint8_t *bulk;
    if (big) {
      cr_assert_not_null(j.out_pin);
      cr_assert_eq(g_staged_out - out0, 1, "a large read is staged out");
      bulk = dsp_pin_data(j.out_pin);
      cr_assert_eq(dsp_pin_nbytes(j.out_pin), sizeof(float) * (size_t)n);
    } else {
      cr_assert_null(j.out_pin);
      bulk = j.out + j.out_len - sizeof(float) * (size_t)n;
    }
    cr_assert_eq(memcmp(bulk, x, sizeof(float) * (size_t)n), 0,
                 "%s read reply carries the storage's raw bytes",
                 big ? "pinned" : "copied");
    dsp_pin_release(j.out_pin);
    j.out_pin = NULL;
    dsp_free(j.out);
    if (big) cr_assert_eq(g_released - rel0, 1);
    dsp_tensor_unref(t);
    free(x);
  }
  dsp_ctx_free(ctx);
}

/* ------------------------------------------------------------------ */
/* through a real dispatch-server                                      */

Test(staging, round_trips_through_dispatch_server) {
  sp_server srv;
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&srv, args), 0, "server did not start");
  wire_conn w;
  cr_assert_eq(wire_connect(&w, srv.port), 0);
  cr_assert_eq(wire_hello(&w, "staging"), 0);
  /* either side of the 64 KiB copy limit, and an empty tensor */
  const int64_t sizes[] = {0, 1, 16383, 16384, 16385, 300000};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    int64_t n = sizes[k];
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 1000) * 0.5f + (float)k;
    cr_assert_neq(wire_upload(&w, 1, DSP_F32, 1, &n, x, sizeof(float) * (size_t)n), 0);
    void *data = NULL;
    size_t nb = 0;
    int ndim = 0;
    int64_t shape[DSP_MAX_DIMS];
    cr_assert_eq(wire_read_tensor(&w, 1, &data, &nb, &ndim, shape), 0);
    cr_assert_eq(nb, sizeof(float) * (size_t)n, "%lld elements", (long long)n);
    cr_assert(n == 0 || memcmp(data, x, nb) == 0, "%lld elements differ", (long long)n);
    free(data);
    free(x);
    uint64_t id = 1;
    wire_free(&w, &id, 1, NULL, 0);
  }
  /* a bool byte other than 0 or 1 is refused, the session goes on */
  uint8_t bad[3] = {0, 7, 1};
  int64_t n3 = 3;
  wire_upload(&w, 2, DSP_BOOL, 1, &n3, bad, 3);
  char msg[512] = "";
  cr_assert_eq(wire_sync_check(&w, msg, sizeof msg, NULL), DISPATCH_EINVAL, "%s", msg);
  cr_assert(strstr(msg, "upload"), "%s", msg);
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  wire_close(&w);
  cr_assert_eq(sp_stop(&srv), 0, "server exit status");
}
