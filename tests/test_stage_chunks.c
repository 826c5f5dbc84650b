/* Staging in parts, overlapped with the socket (issue 10 item 4: uploads
 * and reads through pinned staging buffers overlapped with the socket).
 *
 * The CUDA backend copies an upload's bulk to the device part by part as
 * the reader receives it (commit_part), and sends a Read's bytes part by
 * part as their copy off the device lands (stage_out_wait). No GPU here,
 * so a test double backend ("parts") implements the same two hooks over
 * host memory: its copies are only queued by commit_part and run when the
 * last call waits (as a stream would), and a read lands only part 0 at
 * stage_out, every later part when it is waited for. Through the same
 * dsp_stage / dsp_pin calls the server's reader and writer make: each part
 * must be handed over as soon as the bytes before its end have arrived,
 * in order, never twice, never before it is full; the last short part
 * goes with the last byte; commit waits; a failed part is reported by the
 * commit; the sender gets only landed bytes, and waits part by part. The
 * CPU backend keeps its zero-copy path: no part is handed anywhere. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsp.h"
#include "dsp_internal.h"

#define OUT_PART 1000 /* the double's read parts */

typedef struct part_call {
  size_t off, n;
  int last;
  size_t filled; /* what the "socket" had delivered at the call */
} part_call;

static part_call g_calls[256];
static int g_ncalls;
static size_t g_filled;
static int g_fail_at = -1; /* commit_part call that fails */
/* queued copies, run at the waiting call */
static struct { void *dst; const void *src; size_t n; } g_q[256];
static int g_nq;
static int g_waits[64], g_nwaits;
static size_t g_landed_total;

static int p_alloc(void *b, size_t n, int zero, void **data) {
  (void)b;
  *data = calloc(1, n ? n : 1);
  (void)zero;
  return *data ? 0 : DISPATCH_ENOMEM;
}
static void p_free(void *b, void *data) { (void)b, free(data); }
static int p_copy(void *b, void *dst, const void *src, size_t n) {
  (void)b;
  memcpy(dst, src, n);
  return 0;
}
/* the double's staging tokens: the block, and for a read its source and
 * how much of it has landed */
typedef struct out_tok {
  uint8_t *host;
  const uint8_t *src;
  size_t n, landed;
} out_tok;
static int p_stage_in(void *b, void *data, size_t n, void **host, void **tok) {
  (void)b, (void)data;
  out_tok *t = calloc(1, sizeof *t);
  if (!t || !(t->host = malloc(n ? n : 1))) {
    free(t);
    return DISPATCH_ENOMEM;
  }
  *host = t->host;
  *tok = t;
  return 0;
}
static int p_commit_in(void *b, void *data, const void *host, size_t n,
                       void *tok) {
  (void)b, (void)data, (void)host, (void)n, (void)tok;
  cr_assert_fail("commit_in used although commit_part is set");
  return DISPATCH_EINTERNAL;
}
static int p_commit_part(void *b, void *data, const void *host, size_t off,
                         size_t n, int last, void *tok) {
  (void)b, (void)tok;
  cr_assert_lt(g_ncalls, 256);
  if (g_ncalls == g_fail_at) return DISPATCH_ENOMEM;
  g_calls[g_ncalls++] = (part_call){off, n, last, g_filled};
  if (n) {
    g_q[g_nq].dst = (char *)data + off;
    g_q[g_nq].src = (const char *)host + off;
    g_q[g_nq++].n = n;
  }
  if (last) {
    for (int i = 0; i < g_nq; i++) memcpy(g_q[i].dst, g_q[i].src, g_q[i].n);
    g_nq = 0;
  }
  return 0;
}

static void land_upto(out_tok *t, size_t end) {
  if (end > t->n) end = t->n;
  if (end > t->landed) {
    memcpy(t->host + t->landed, t->src + t->landed, end - t->landed);
    g_landed_total += end - t->landed;
    t->landed = end;
  }
}
static int p_stage_out(void *b, const void *data, size_t n, const void **host,
                       void **tok) {
  (void)b;
  out_tok *t = calloc(1, sizeof *t);
  t->host = malloc(n ? n : 1);
  memset(t->host, 0xEE, n); /* not landed yet */
  t->src = data;
  t->n = n;
  land_upto(t, OUT_PART); /* stage_out returns once part 0 is there */
  *host = t->host;
  *tok = t;
  return 0;
}
static size_t p_stage_out_wait(void *b, void *tok, size_t off) {
  (void)b;
  out_tok *t = tok;
  cr_assert_lt(off, t->n);
  size_t part = off / OUT_PART;
  cr_assert_lt(g_nwaits, 64);
  g_waits[g_nwaits++] = (int)part;
  land_upto(t, (part + 1) * OUT_PART);
  return t->landed;
}
static void p_stage_release(void *b, void *tok) {
  (void)b;
  out_tok *t = tok;
  if (t) free(t->host);
  free(t);
}
static int p_supports(void *b, dsp_opcode op, const dsp_meta *in, int n,
                      const dsp_meta *out) {
  (void)b, (void)op, (void)in, (void)n, (void)out;
  return 0;
}
static int p_run(void *b, dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                 int n_in, const dsp_attrs *a, dsp_tensor *out) {
  (void)b, (void)in, (void)n_in, (void)a, (void)out;
  return dsp__unsupported(ctx, "parts", op, NULL, 0, &out->meta);
}

static const dsp_backend g_parts = {
    .name = "parts",
    .device = "test double: staging in parts",
    .alloc = p_alloc,
    .free = p_free,
    .copy_in = p_copy,
    .copy_out = p_copy,
    .stage_in = p_stage_in,
    .commit_in = p_commit_in,
    .stage_out = p_stage_out,
    .stage_release = p_stage_release,
    .commit_part = p_commit_part,
    .stage_out_wait = p_stage_out_wait,
    .caps = 0,
    .supports_op = p_supports,
    .run_op = p_run,
};

static void reset(void) {
  g_ncalls = g_nq = g_nwaits = 0;
  g_filled = g_landed_total = 0;
  g_fail_at = -1;
}

static dsp_tensor *tensor_on(dsp_ctx *ctx, const dsp_backend *be, int64_t n) {
  ctx->backend = be;
  dsp_meta m = {.dtype = DSP_BOOL, .ndim = 1, .shape = {n}};
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new_uninit(ctx, &m, &t), 0, "%s",
               dsp_ctx_errmsg(ctx));
  return t;
}

/* The reader's pattern: socket reads of irregular sizes land in the
 * staging, dsp_stage_progress after each. */
Test(stage_chunks, upload_parts_go_to_the_backend_as_the_socket_fills_them) {
  reset();
  const size_t N = 10000, C = 1024;
  uint8_t *src = malloc(N);
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i * 7 + 3);
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, &g_parts, (int64_t)N);
  dsp_stage st;
  cr_assert_eq(dsp_tensor_stage_in(ctx, t, &st), 0);
  cr_assert_eq(st.chunk, DSP_STAGE_CHUNK);
  st.chunk = C;
  size_t reads[] = {1, 500, 523, 1, 3000, 1024, 2048, 17, 2000, 10000};
  for (size_t r = 0; g_filled < N; r++) {
    size_t k = reads[r % 10];
    if (k > N - g_filled) k = N - g_filled;
    memcpy((uint8_t *)st.host + g_filled, src + g_filled, k);
    g_filled += k;
    dsp_stage_progress(&st, g_filled);
    size_t want = g_filled == N ? N : g_filled / C * C;
    cr_assert_eq(st.committed, want,
                 "after %zu bytes: %zu handed over, expected %zu", g_filled,
                 st.committed, want);
  }
  /* 9 whole parts and the short tail, in order, each once, none early */
  cr_assert_eq(g_ncalls, 10);
  for (int i = 0; i < 10; i++) {
    cr_assert_eq(g_calls[i].off, (size_t)i * C, "part %d", i);
    cr_assert_eq(g_calls[i].n, i < 9 ? C : N - 9 * C, "part %d", i);
    cr_assert_eq(g_calls[i].last, 0);
    cr_assert_geq(g_calls[i].filled, g_calls[i].off + g_calls[i].n,
                  "part %d handed over before its bytes arrived", i);
    cr_assert_lt(g_calls[i].filled, g_calls[i].off + g_calls[i].n + 3000,
                 "part %d handed over late (read of %zu)", i,
                 g_calls[i].filled);
  }
  cr_assert_eq(g_nq, 10, "parts are queued, not yet copied");
  cr_assert_eq(dsp_stage_commit(ctx, &st), 0, "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(g_ncalls, 11);
  cr_assert(g_calls[10].last && g_calls[10].n == 0 && g_calls[10].off == N,
            "commit only waits for what progress handed over");
  cr_assert_eq(memcmp(t->storage->data, src, N), 0, "every byte landed");
  dsp_stage_release(&st);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
  free(src);
}

/* A whole upload that arrives in one read, then a commit with no
 * progress at all (the in-process request path): both hand every part. */
Test(stage_chunks, commit_hands_over_what_progress_did_not) {
  reset();
  const size_t N = 3000;
  uint8_t src[3000];
  for (size_t i = 0; i < N; i++) src[i] = (uint8_t)(i ^ 0x5a);
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, &g_parts, (int64_t)N);
  dsp_stage st;
  cr_assert_eq(dsp_tensor_stage_in(ctx, t, &st), 0);
  st.chunk = 1024;
  memcpy(st.host, src, N);
  cr_assert_eq(dsp_stage_commit(ctx, &st), 0);
  cr_assert_eq(g_ncalls, 4);
  cr_assert_eq(g_calls[2].n, N - 2048);
  cr_assert(g_calls[3].last);
  cr_assert_eq(memcmp(t->storage->data, src, N), 0);
  dsp_stage_release(&st);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}

Test(stage_chunks, a_failed_part_is_reported_by_the_commit) {
  reset();
  g_fail_at = 2;
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, &g_parts, 5000);
  dsp_stage st;
  cr_assert_eq(dsp_tensor_stage_in(ctx, t, &st), 0);
  st.chunk = 1000;
  memset(st.host, 1, 5000);
  dsp_stage_progress(&st, 4500);
  cr_assert_eq(st.err, DISPATCH_ENOMEM);
  cr_assert_eq(st.committed, 2000, "nothing past the failed part");
  dsp_stage_progress(&st, 5000);
  cr_assert_eq(g_ncalls, 2, "no part after a failure");
  cr_assert_eq(dsp_stage_commit(ctx, &st), DISPATCH_ENOMEM);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "parts"), "%s", dsp_ctx_errmsg(ctx));
  dsp_stage_release(&st);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}

/* The writer's pattern: ask for up to `piece` bytes at the send offset,
 * send what dsp_pin_avail allows, repeat. */
Test(stage_chunks, read_parts_are_sent_as_they_land) {
  reset();
  const size_t N = 4500; /* 5 parts of the double, the last short */
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, &g_parts, (int64_t)N);
  uint8_t *data = t->storage->data;
  for (size_t i = 0; i < N; i++) data[i] = (uint8_t)(i * 13 + 1);
  dsp_pin *p;
  cr_assert_eq(dsp_tensor_pin(ctx, t, &p), 0);
  cr_assert_eq(g_landed_total, OUT_PART, "the read returns with part 0");
  const uint8_t *h = dsp_pin_data(p);
  size_t off = 0, piece = 1700, sends = 0;
  while (off < N) {
    size_t want = N - off < piece ? N - off : piece;
    size_t k = dsp_pin_avail(p, off, want);
    cr_assert(k > 0 && k <= want);
    cr_assert_leq(off + k, g_landed_total, "sent bytes that had not landed");
    cr_assert_eq(memcmp(h + off, data + off, k), 0, "bytes at %zu", off);
    off += k;
    sends++;
  }
  cr_assert_eq(g_nwaits, 5, "one wait per part");
  for (int i = 0; i < g_nwaits; i++)
    cr_assert_eq(g_waits[i], i, "parts waited for in order");
  cr_assert_geq(sends, 5, "no send spans a part that had not landed");
  dsp_pin_release(p);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}

/* The CPU keeps its zero-copy path: the staging is the storage, progress
 * hands nothing anywhere and a pin's bytes are all available at once. */
Test(stage_chunks, cpu_staging_stays_zero_copy) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, dsp_cpu_backend(), 9000);
  dsp_stage st;
  cr_assert_eq(dsp_tensor_stage_in(ctx, t, &st), 0);
  cr_assert_eq(st.host, t->storage->data);
  memset(st.host, 7, 9000);
  dsp_stage_progress(&st, 9000);
  cr_assert_eq(st.committed, 0);
  cr_assert_eq(dsp_stage_commit(ctx, &st), 0);
  dsp_stage_release(&st);
  dsp_pin *p;
  cr_assert_eq(dsp_tensor_pin(ctx, t, &p), 0);
  cr_assert_eq(dsp_pin_data(p), t->storage->data);
  cr_assert_eq(dsp_pin_avail(p, 100, 8900), 8900);
  dsp_pin_release(p);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}

/* A move inside the server from a device that lands its read in parts
 * (a GPU) takes each part only once it has landed. */
Test(stage_chunks, a_move_off_a_device_waits_for_every_part) {
  reset();
  const size_t N = 3500; /* 4 parts of the double, the last short */
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *t = tensor_on(ctx, &g_parts, (int64_t)N);
  uint8_t *data = t->storage->data;
  for (size_t i = 0; i < N; i++) data[i] = (uint8_t)(i * 5 + 2) & 1;
  dsp_tensor *c = NULL;
  cr_assert_eq(dsp_tensor_to_backend(ctx, t, dsp_cpu_backend(), &c), 0, "%s",
               dsp_ctx_errmsg(ctx));
  cr_assert_eq(memcmp(c->storage->data, data, N), 0,
               "the copy took bytes that had not landed");
  cr_assert_eq(g_nwaits, 4, "each part waited for");
  dsp_tensor_unref(c);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}
