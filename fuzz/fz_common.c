/* Fuzz harness pieces shared with the regression suite (see fz_common.h). */
#include "fz_common.h"

#include <stdlib.h>
#include <string.h>

#include "frame.h"

void fz_config(sv_config *c) {
  sv_config_defaults(c);
  c->max_frame = 1u << 16;
  c->max_msg = 1u << 14;
  c->max_elements = 1u << 12;
  c->max_session_bytes = 1u << 18;
  c->max_queued = 64;
  c->threads = 1;
  c->log_level = SV_LOG_ERROR;
}

void fz_buf_put(fz_buf *b, const void *p, size_t n) {
  if (b->failed || n == 0) return;
  if (b->n + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n) cap *= 2;
    uint8_t *q = dsp_realloc(b->p, cap);
    if (!q) {
      b->failed = 1;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
  if (p) memcpy(b->p + b->n, p, n);
  else memset(b->p + b->n, 0, n);
  b->n += n;
}

void fz_buf_free(fz_buf *b) {
  dsp_free(b->p);
  memset(b, 0, sizeof *b);
}

void fz_frame(fz_buf *b, const Dispatch__Request *req, const void *bulk,
              size_t have, uint64_t bulk_len) {
  size_t len = dispatch__request__get_packed_size(req);
  uint8_t hdr[DSP_FRAME_HEADER_SIZE];
  dsp_frame_header h = {(uint32_t)len, 0, bulk_len};
  dsp_frame_header_encode(hdr, &h);
  fz_buf_put(b, hdr, sizeof hdr);
  size_t at = b->n;
  fz_buf_put(b, NULL, len);
  if (!b->failed) dispatch__request__pack(req, b->p + at);
  if (have > bulk_len) have = (size_t)bulk_len;
  fz_buf_put(b, bulk, have);
  if (bulk_len > have && bulk_len - have < (1u << 20))
    fz_buf_put(b, NULL, (size_t)(bulk_len - have));
}

/* ------------------------------------------------------------ builders */

static uint64_t g_rid = 1;

static void put_upload(fz_buf *b, uint64_t id, int dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes,
                       uint64_t bulk_len) {
  Dispatch__Request r = DISPATCH__REQUEST__INIT;
  Dispatch__Upload u = DISPATCH__UPLOAD__INIT;
  Dispatch__TensorMeta m = DISPATCH__TENSOR_META__INIT;
  m.dtype = dtype;
  m.n_shape = (size_t)ndim;
  m.shape = (int64_t *)shape;
  u.id = id;
  u.meta = &m;
  r.req_id = g_rid++;
  r.body_case = DISPATCH__REQUEST__BODY_UPLOAD;
  r.upload = &u;
  fz_frame(b, &r, data, nbytes, bulk_len);
}

static void put_op(fz_buf *b, int op, const uint64_t *in, size_t n_in,
                   uint64_t out, const int64_t *ints, size_t n_ints,
                   const double *floats, size_t n_floats) {
  Dispatch__Request r = DISPATCH__REQUEST__INIT;
  Dispatch__Op o = DISPATCH__OP__INIT;
  o.op = op;
  o.inputs = (uint64_t *)in;
  o.n_inputs = n_in;
  o.output = out;
  o.ints = (int64_t *)ints;
  o.n_ints = n_ints;
  o.floats = (double *)floats;
  o.n_floats = n_floats;
  r.req_id = g_rid++;
  r.body_case = DISPATCH__REQUEST__BODY_OP;
  r.op = &o;
  fz_frame(b, &r, NULL, 0, 0);
}

static void put_track(fz_buf *b, uint64_t id) {
  Dispatch__Request r = DISPATCH__REQUEST__INIT;
  Dispatch__Track t = DISPATCH__TRACK__INIT;
  t.id = id;
  r.req_id = g_rid++;
  r.body_case = DISPATCH__REQUEST__BODY_TRACK;
  r.track = &t;
  fz_frame(b, &r, NULL, 0, 0);
}

static void put_backward(fz_buf *b, uint64_t loss, uint64_t grads,
                         int retain) {
  Dispatch__Request r = DISPATCH__REQUEST__INIT;
  Dispatch__Backward k = DISPATCH__BACKWARD__INIT;
  k.loss = loss;
  k.grads = grads;
  k.retain = retain;
  r.req_id = g_rid++;
  r.body_case = DISPATCH__REQUEST__BODY_BACKWARD;
  r.backward = &k;
  fz_frame(b, &r, NULL, 0, 0);
}

void fz_seed_frames(fz_buf *b) {
  static const float f6[6] = {1, -2, 3, 0.5f, -0.25f, 4};
  static const float f16[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                14, 15, 16};
  static const float f18[18] = {1, 0, -1, 2, 0, -2, 1, 1, 1,
                                0, 1, 0, 1, 0, 1, 0, 1, 0};
  static const float one = 1.5f;
  static const int64_t idx[3] = {0, 2, 1};
  static const uint8_t mask[6] = {1, 0, 1, 1, 0, 0};
  static const float zero6[6] = {0};
  static const int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s3[1] = {3};
  static const int64_t s1144[4] = {1, 1, 4, 4}, s2133[4] = {2, 1, 3, 3};
  put_upload(b, 1, DSP_F32, 2, s23, f6, sizeof f6, sizeof f6);
  put_upload(b, 2, DSP_F32, 2, s32, f6, sizeof f6, sizeof f6);
  put_upload(b, 3, DSP_F32, 0, NULL, &one, sizeof one, sizeof one);
  put_upload(b, 4, DSP_I64, 1, s3, idx, sizeof idx, sizeof idx);
  put_upload(b, 5, DSP_BOOL, 2, s23, mask, sizeof mask, sizeof mask);
  put_upload(b, 6, DSP_F32, 4, s1144, f16, sizeof f16, sizeof f16);
  put_upload(b, 7, DSP_F32, 4, s2133, f18, sizeof f18, sizeof f18);
  put_track(b, 1);
  put_track(b, 2);
  uint64_t mm[2] = {1, 2}, s8[1] = {8};
  put_op(b, DSP_OP_MATMUL, mm, 2, 8, NULL, 0, NULL, 0);
  put_op(b, DSP_OP_SUM, s8, 1, 9, NULL, 0, NULL, 0);
  put_backward(b, 9, 1, 1);
  put_upload(b, 10, DSP_F32, 2, s23, zero6, sizeof zero6, sizeof zero6);
  put_upload(b, 11, DSP_F32, 2, s23, zero6, sizeof zero6, sizeof zero6);
  put_upload(b, 12, DSP_F32, 2, s23, zero6, sizeof zero6, sizeof zero6);
}

/* ------------------------------------------------------------ recipes */

typedef struct rd {
  const uint8_t *p;
  size_t n;
} rd;

static uint8_t u8(rd *r) {
  if (r->n == 0) return 0;
  r->n--;
  return *r->p++;
}

/* Mostly small ids (collisions and reuse are the point), sometimes huge. */
static uint64_t rid_of(rd *r) {
  uint8_t b = u8(r);
  if (b == 0xff) return UINT64_MAX;
  if (b == 0xfe) return (uint64_t)1 << 63;
  return b % 16;
}

static int64_t small_int(rd *r) {
  uint8_t b = u8(r);
  switch (b) {
    case 0xff: return INT64_MAX;
    case 0xfe: return INT64_MIN;
    case 0xfd: return (int64_t)1 << 32;
    case 0xfc: return -((int64_t)1 << 40);
    default: return (int64_t)(int8_t)b;
  }
}

static double small_float(rd *r) {
  static const double tab[16] = {0,    1,     -1,   0.5,     2,    1e-3,
                                  -3.5, 0.999, 1e30, -1e308,  1e-310, 0.1,
                                  7,    0.9,   3,    -0.0};
  uint8_t b = u8(r);
  if (b == 0xff) return __builtin_nan("");
  if (b == 0xfe) return __builtin_inf();
  return tab[b % 16];
}

static const int k_ops[] = {
    1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,
    17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32,
    40, 41, 42, 43, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 70,
    80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 100,
    101, 102, 103, 104, 105, 110, 111};
#define N_OPS (sizeof k_ops / sizeof k_ops[0])

static void recipe_one(rd *r, fz_buf *out) {
  uint8_t kind = u8(r) % 11;
  uint64_t ids[DSP_MAX_INPUTS + 4], ids2[8];
  int64_t ints[DSP_MAX_ATTR_INTS + 2];
  double floats[DSP_MAX_ATTR_FLOATS + 2];
  Dispatch__Request q = DISPATCH__REQUEST__INIT;
  q.req_id = g_rid++;
  switch (kind) {
    case 0: { /* upload: small shape, exact or off-by-some bulk */
      uint64_t id = rid_of(r);
      uint8_t b = u8(r);
      int dtype = b & 0x80 ? (int)(int8_t)u8(r) : b % 4;
      int ndim = u8(r) % 6;
      int64_t shape[8];
      int64_t numel = 1;
      for (int i = 0; i < ndim; i++) {
        uint8_t d = u8(r);
        shape[i] = d >= 0xf0 ? small_int(r) : d % 5;
        numel = shape[i] >= 0 && shape[i] <= 64 ? numel * shape[i] : numel;
      }
      size_t es = dsp_dtype_size(dsp_dtype_valid(dtype) ? (dsp_dtype)dtype
                                                        : DSP_F32);
      uint64_t nb = (uint64_t)numel * es;
      uint8_t tweak = u8(r);
      if (tweak >= 0xf8) nb += (uint64_t)(tweak - 0xfb); /* -3 .. +4 */
      if (nb > 4096) nb = 4096;
      size_t have = r->n < nb ? r->n : (size_t)nb;
      put_upload(out, id, dtype, ndim, shape, r->p, have, nb);
      r->p += have;
      r->n -= have;
      return;
    }
    case 1: { /* op */
      uint8_t b = u8(r);
      int op = b < 0xf0 ? k_ops[b % N_OPS] : (int)small_int(r);
      size_t n_in = u8(r) % 5;
      if (n_in == 4 && (u8(r) & 1)) n_in = 65;
      for (size_t i = 0; i < n_in; i++) ids[i] = rid_of(r);
      uint64_t o = rid_of(r);
      size_t n_ints = u8(r) % (DSP_MAX_ATTR_INTS + 2);
      if (n_ints > 8 && n_ints <= DSP_MAX_ATTR_INTS) n_ints %= 5;
      for (size_t i = 0; i < n_ints; i++) ints[i] = small_int(r);
      size_t n_fl = u8(r) % (DSP_MAX_ATTR_FLOATS + 2);
      for (size_t i = 0; i < n_fl; i++) floats[i] = small_float(r);
      put_op(out, op, ids, n_in, o, ints, n_ints, floats, n_fl);
      return;
    }
    case 2: put_track(out, rid_of(r)); return;
    case 3: {
      uint64_t loss = rid_of(r), g = rid_of(r);
      put_backward(out, loss, g, u8(r) & 1);
      return;
    }
    case 4: {
      Dispatch__Grad g = DISPATCH__GRAD__INIT;
      g.grads = rid_of(r);
      g.tensor = rid_of(r);
      g.output = rid_of(r);
      q.body_case = DISPATCH__REQUEST__BODY_GRAD;
      q.grad = &g;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    case 5: { /* step */
      Dispatch__Step s = DISPATCH__STEP__INIT;
      uint8_t b = u8(r);
      s.op = b % 3 == 0 ? DSP_OP_SGD_STEP
             : b % 3 == 1 ? DSP_OP_ADAM_STEP
                          : (int)small_int(r);
      s.grads = rid_of(r);
      s.n_params = u8(r) % 4;
      for (size_t i = 0; i < s.n_params; i++) ids[i] = rid_of(r);
      s.params = ids;
      s.n_states = u8(r) % 9;
      for (size_t i = 0; i < s.n_states; i++) ids2[i] = rid_of(r);
      s.states = ids2;
      s.n_ints = u8(r) % 3;
      for (size_t i = 0; i < s.n_ints; i++) ints[i] = small_int(r);
      s.ints = ints;
      s.n_floats = u8(r) % (DSP_MAX_ATTR_FLOATS + 2);
      for (size_t i = 0; i < s.n_floats; i++) floats[i] = small_float(r);
      s.floats = floats;
      q.body_case = DISPATCH__REQUEST__BODY_STEP;
      q.step = &s;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    case 6: { /* free */
      Dispatch__Free f = DISPATCH__FREE__INIT;
      f.n_tensors = u8(r) % 4;
      for (size_t i = 0; i < f.n_tensors; i++) ids[i] = rid_of(r);
      f.tensors = ids;
      f.n_grads = u8(r) % 3;
      for (size_t i = 0; i < f.n_grads; i++) ids2[i] = rid_of(r);
      f.grads = ids2;
      q.body_case = DISPATCH__REQUEST__BODY_FREE;
      q.free = &f;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    case 7: {
      Dispatch__Read rr = DISPATCH__READ__INIT;
      rr.id = rid_of(r);
      q.body_case = DISPATCH__REQUEST__BODY_READ;
      q.read = &rr;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    case 8: {
      Dispatch__Sync sy = DISPATCH__SYNC__INIT;
      q.body_case = DISPATCH__REQUEST__BODY_SYNC;
      q.sync = &sy;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    case 9: {
      Dispatch__Stats st = DISPATCH__STATS__INIT;
      q.body_case = DISPATCH__REQUEST__BODY_STATS;
      q.stats = &st;
      fz_frame(out, &q, NULL, 0, 0);
      return;
    }
    default: { /* a raw frame: header fields and message bytes as given */
      size_t len = u8(r);
      uint8_t f = u8(r);
      uint64_t bulk = f == 0xfe ? u8(r) : 0;
      if (len > r->n) len = r->n; /* after every header byte was taken */
      uint8_t hdr[DSP_FRAME_HEADER_SIZE];
      dsp_frame_header h = {(uint32_t)len, f == 0xff ? 1u : 0u, bulk};
      dsp_frame_header_encode(hdr, &h);
      fz_buf_put(out, hdr, sizeof hdr);
      fz_buf_put(out, r->p, len);
      r->p += len;
      r->n -= len;
      return;
    }
  }
}

void fz_recipe_frames(const uint8_t *in, size_t n, fz_buf *out) {
  rd r = {in, n};
  g_rid = 1000;
  while (r.n > 0 && !out->failed) recipe_one(&r, out);
}

/* ------------------------------------------------------------ running */

int fz_run(const uint8_t *p, size_t n, int seeded, int hello_done,
           fz_outcome *o) {
  static sv_config cfg;
  static int cfg_ready;
  if (!cfg_ready) {
    fz_config(&cfg);
    sv_log_level = cfg.log_level;
    cfg_ready = 1;
  }
  memset(o, 0, sizeof *o);
  sv_global g;
  memset(&g, 0, sizeof g);
  dsp_ctx *io = dsp_ctx_new();
  sv_session *s = io ? sv_session_new(&cfg, &g, NULL) : NULL;
  if (!s) {
    dsp_ctx_free(io);
    return -1;
  }
  int hello = hello_done;
  if (seeded) {
    fz_buf b = {0};
    g_rid = 1;
    fz_seed_frames(&b);
    int h1 = 1;
    sv_stream_stats st;
    o->seed_rc = b.failed ? DISPATCH_ENOMEM
                          : sv_stream_exec(s, io, &h1, b.p, b.n, &st);
    if (o->seed_rc == 0 && st.error_replies) o->seed_rc = st.first_error;
    fz_buf_free(&b);
  }
  o->rc = sv_stream_exec(s, io, &hello, p, n, &o->st);
  /* the table and the counters must agree before teardown too */
  uint64_t live = 0, bytes = 0;
  for (size_t i = 0; i < s->tensors.cap; i++) {
    sv_entry *e = s->tensors.vals[i];
    if (e && e->t) {
      live++;
      bytes += dsp_tensor_nbytes(e->t);
    }
  }
  if (live != s->n_live || bytes != (uint64_t)atomic_load(&s->bytes) ||
      live != (uint64_t)atomic_load(&g.tensors) ||
      bytes != (uint64_t)atomic_load(&g.bytes))
    o->leak = 1;
  /* every charge is uncharged once the session and its requests are gone */
  dsp_budget *sb = dsp_budget_ref(s->budget), *qb = dsp_budget_ref(s->queue);
  sv_session_teardown(s);
  if (atomic_load(&g.tensors) != 0 || atomic_load(&g.bytes) != 0 ||
      atomic_load(&s->queued_bytes) != 0 || atomic_load(&s->bytes) != 0 ||
      dsp_budget_used(sb) != 0 || dsp_budget_used(qb) != 0)
    o->leak = 1;
  dsp_budget_unref(sb);
  dsp_budget_unref(qb);
  dsp_free(s);
  dsp_ctx_free(io);
  return 0;
}

/* ------------------------------------------------------------ failing
 * allocations: the N-th dsp allocation after fz_fail_alloc fails */

static long g_fail_at, g_alloc_count;

static void *fa_malloc(size_t n, void *ud) {
  (void)ud;
  if (++g_alloc_count == g_fail_at) return NULL;
  return malloc(n);
}
static void *fa_realloc(void *p, size_t n, void *ud) {
  (void)ud;
  if (++g_alloc_count == g_fail_at) return NULL;
  return realloc(p, n);
}
static void fa_free(void *p, void *ud) {
  (void)ud;
  free(p);
}

void fz_fail_alloc(long at) {
  static const dsp_allocator a = {fa_malloc, fa_realloc, fa_free, NULL};
  g_fail_at = at;
  g_alloc_count = 0;
  dsp_set_allocator(&a);
}

void fz_fail_alloc_off(void) { dsp_set_allocator(NULL); }

int fz_run_oom(const uint8_t *in, size_t n, fz_outcome *o) {
  memset(o, 0, sizeof *o);
  if (n < 2) return 0;
  long at = 1 + (long)(in[0] | (unsigned)in[1] << 8);
  fz_buf b = {0};
  fz_recipe_frames(in + 2, n - 2, &b);
  if (b.failed) {
    fz_buf_free(&b);
    return 0;
  }
  fz_fail_alloc(at);
  int rc = fz_run(b.p, b.n, 1, 1, o);
  fz_fail_alloc_off();
  fz_buf_free(&b);
  return rc;
}
