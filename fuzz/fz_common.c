/* Fuzz harness pieces shared with the regression suite (see fz_common.h). */
#include "fz_common.h"

#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "op_record.h"
#include "wire_req.h"

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

const sv_config *fz_config_once(void) {
  static sv_config cfg;
  static int ready;
  if (!ready) {
    fz_config(&cfg);
    sv_log_level = cfg.log_level;
    ready = 1;
  }
  return &cfg;
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

void fz_frame(fz_buf *b, const Dspwire__Request *req, const void *bulk,
              size_t have, uint64_t bulk_len) {
  size_t at = b->n;
  fz_buf_put(b, NULL, dsp_req_frame_size(req));
  if (!b->failed) dsp_req_frame_encode(req, bulk_len, b->p + at);
  if (have > bulk_len) have = (size_t)bulk_len;
  fz_buf_put(b, bulk, have);
  if (bulk_len > have && bulk_len - have < (1u << 20))
    fz_buf_put(b, NULL, (size_t)(bulk_len - have));
}

/* ------------------------------------------------------------ builders */

static uint64_t g_rid = 1;

/* Appends req as the next request of the stream (req_id from g_rid). */
static void put(fz_buf *b, Dspwire__Request *req) {
  req->req_id = g_rid++;
  fz_frame(b, req, NULL, 0, 0);
}

static void put_upload(fz_buf *b, uint64_t id, int dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes,
                       uint64_t bulk_len) {
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_upload(&w, id, dtype, (size_t)ndim, shape);
  r->req_id = g_rid++;
  fz_frame(b, r, data, nbytes, bulk_len);
}

static void put_op(fz_buf *b, int op, const uint64_t *in, size_t n_in,
                   uint64_t out, const int64_t *ints, size_t n_ints,
                   const double *floats, size_t n_floats) {
  dsp_wreq w;
  put(b, dsp_wreq_op(&w, op, in, n_in, out, ints, n_ints, floats, n_floats,
                     0));
}

static void put_track(fz_buf *b, uint64_t id) {
  dsp_wreq w;
  put(b, dsp_wreq_track(&w, id));
}

static void put_backward(fz_buf *b, uint64_t loss, uint64_t grads,
                         int retain) {
  dsp_wreq w;
  put(b, dsp_wreq_backward(&w, loss, grads, retain));
}

static void put_grad(fz_buf *b, uint64_t grads, uint64_t t, uint64_t out) {
  dsp_wreq w;
  put(b, dsp_wreq_grad(&w, grads, t, out));
}

static void put_step(fz_buf *b, int op, uint64_t grads, const uint64_t *p,
                     size_t np, const uint64_t *s, size_t ns,
                     const int64_t *ints, size_t ni, const double *fl,
                     size_t nf) {
  dsp_wreq w;
  put(b, dsp_wreq_step(&w, op, grads, p, np, s, ns, ints, ni, fl, nf));
}

static void put_free(fz_buf *b, const uint64_t *t, size_t nt,
                     const uint64_t *g, size_t ng) {
  dsp_wreq w;
  put(b, dsp_wreq_free(&w, t, nt, g, ng));
}

static void put_read(fz_buf *b, uint64_t id) {
  dsp_wreq w;
  put(b, dsp_wreq_read(&w, id));
}

static void put_sync(fz_buf *b) {
  dsp_wreq w;
  put(b, dsp_wreq_sync(&w));
}

static void put_stats(fz_buf *b) {
  dsp_wreq w;
  put(b, dsp_wreq_stats(&w));
}

/* 1.3: one Ops request carrying len bytes of packed records */
static void put_ops(fz_buf *b, const uint8_t *records, size_t len) {
  dsp_wreq w;
  put(b, dsp_wreq_ops(&w, records, len));
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

/* Shapes with a zero-size dimension beside huge ones: numel is 0, so
 * element-count limits pass them, while anything that loops over a dim or
 * multiplies strides meets 2^63-1 (issue 9, item 1). Small zero shapes
 * too, where nothing is hostile but the kernels' zero-element paths. */
#define FZ_H INT64_MAX
#define FZ_G ((int64_t)1 << 62)
#define FZ_T ((int64_t)1 << 32)
static const struct {
  int ndim;
  int64_t d[4];
} k_zshapes[] = {
    {2, {FZ_H, 0}},       {3, {0, FZ_H, 2}},    {3, {0, FZ_H, 0}},
    {1, {0}},             {3, {FZ_T, FZ_T, 0}}, {3, {0, FZ_G, 4}},
    {3, {2, 0, FZ_H}},    {4, {1, 0, 1, FZ_H}}, {4, {FZ_H, 0, 3, 3}},
    {2, {0, 3}},          {3, {FZ_H, FZ_H, 0}}, {3, {3, 0, 2}},
    {4, {0, 1, FZ_H, 2}}, {2, {FZ_G, 0}},       {2, {1, 0}},
    {4, {2, 1, 0, 3}},
};
#define N_ZSHAPES (sizeof k_zshapes / sizeof k_zshapes[0])

/* Appends one zero-size shape (picked by the next byte) to v at *n. */
static void zshape(rd *r, int64_t *v, size_t *n, size_t cap) {
  unsigned k = u8(r) % N_ZSHAPES;
  for (int i = 0; i < k_zshapes[k].ndim && *n < cap; i++)
    v[(*n)++] = k_zshapes[k].d[i];
}

/* Ops whose kernels walk dimensions one by one (softmax, slice, cat,
 * index_select, reductions, pools, ...): the ones a zero-size tensor with
 * a huge dim reaches. */
static const int k_zops[] = {
    DSP_OP_SOFTMAX,       DSP_OP_LOG_SOFTMAX,  DSP_OP_SOFTMAX_BACKWARD,
    DSP_OP_LOG_SOFTMAX_BACKWARD, DSP_OP_SLICE, DSP_OP_CAT,
    DSP_OP_STACK,         DSP_OP_INDEX_SELECT, DSP_OP_INDEX_SELECT_BACKWARD,
    DSP_OP_SUM,           DSP_OP_MEAN,         DSP_OP_MAX,
    DSP_OP_ARGMAX,        DSP_OP_TRANSPOSE,    DSP_OP_PERMUTE,
    DSP_OP_RESHAPE,       DSP_OP_BROADCAST_TO, DSP_OP_MATMUL,
    DSP_OP_CONV2D,        DSP_OP_MAX_POOL2D,   DSP_OP_AVG_POOL2D,
    DSP_OP_ADD,           DSP_OP_RELU,         DSP_OP_CAST,
    DSP_OP_SLICE_BACKWARD, DSP_OP_CROSS_ENTROPY, DSP_OP_DROPOUT,
};
#define N_ZOPS (sizeof k_zops / sizeof k_zops[0])

/* Ops that take a shape among their attributes, and where it starts. */
static const struct {
  int op, n_in, lead; /* lead: attribute ints before the shape */
} k_shape_attr_ops[] = {
    {DSP_OP_RESHAPE, 1, 0},
    {DSP_OP_BROADCAST_TO, 1, 0},
    {DSP_OP_SLICE_BACKWARD, 1, 4},
    {DSP_OP_INDEX_SELECT_BACKWARD, 2, 1},
    {DSP_OP_CONV2D_BACKWARD_INPUT, 2, 6},
    {DSP_OP_CONV2D_BACKWARD_WEIGHT, 2, 6},
    {DSP_OP_ZEROS, 0, 1},
    {DSP_OP_ONES, 0, 1},
    {DSP_OP_FULL, 0, 1},
    {DSP_OP_UNIFORM, 0, 2},
    {DSP_OP_NORMAL, 0, 2},
};
#define N_SHAPE_ATTR_OPS (sizeof k_shape_attr_ops / sizeof k_shape_attr_ops[0])

/* kind 0xf0: an upload of a zero-size shape (no bulk), then 0..2 ops
 * walking it with small dim attributes, then maybe a read. */
static void recipe_zero_upload(rd *r, fz_buf *out) {
  uint64_t id = 13 + u8(r) % 3;
  int64_t shape[DSP_MAX_DIMS];
  size_t nd = 0;
  zshape(r, shape, &nd, DSP_MAX_DIMS);
  uint8_t b = u8(r);
  int dtype = b & 0x80 ? DSP_I64 : b % 4;
  put_upload(out, id, dtype, (int)nd, shape, NULL, 0, 0);
  int n_ops = u8(r) % 3;
  for (int k = 0; k < n_ops; k++) {
    int op = k_zops[u8(r) % N_ZOPS];
    uint64_t in[3] = {id, u8(r) & 1 ? id : rid_of(r), id};
    const dsp_op_info *info = dsp_op_lookup(op);
    size_t n_in = info && info->n_inputs > 0 ? (size_t)info->n_inputs : 2;
    int64_t ints[6];
    size_t n_ints = u8(r) % 5;
    for (size_t i = 0; i < n_ints; i++) ints[i] = small_int(r);
    double fl[1] = {0.5};
    put_op(out, op, in, n_in, 16 + (uint64_t)k, ints, n_ints, fl,
           op == DSP_OP_DROPOUT);
  }
  if (u8(r) & 1) put_read(out, n_ops ? 16 + (uint64_t)(n_ops - 1) : id);
}

/* kind 0xf1: an op whose attributes carry a zero-size shape (creation
 * ops, reshape, broadcast_to, the backward ops that take the input's
 * shape), then maybe a read of its output. */
static void recipe_zero_attr(rd *r, fz_buf *out) {
  unsigned k = u8(r) % N_SHAPE_ATTR_OPS;
  int64_t ints[DSP_MAX_ATTR_INTS];
  size_t n = 0;
  int op = k_shape_attr_ops[k].op;
  if (k_shape_attr_ops[k].n_in == 0) { /* dtype (, seed) first */
    ints[n++] = u8(r) % 4;
    if (k_shape_attr_ops[k].lead == 2) ints[n++] = 7;
  } else {
    for (int i = 0; i < k_shape_attr_ops[k].lead; i++)
      ints[n++] = small_int(r);
  }
  zshape(r, ints, &n, DSP_MAX_ATTR_INTS);
  uint64_t in[2] = {rid_of(r), rid_of(r)};
  double fl[2] = {0, 1}; /* full's value; uniform's range, normal's std */
  size_t n_fl = op == DSP_OP_FULL ? 1
                : op == DSP_OP_UNIFORM || op == DSP_OP_NORMAL ? 2
                                                              : 0;
  put_op(out, op, in, (size_t)k_shape_attr_ops[k].n_in, 13, ints, n, fl,
         n_fl);
  if (u8(r) & 1) put_read(out, 13);
}

/* kind 0xf2: in-place optimizer steps interleaved with reads of the
 * parameter (and its state) they update (issue 9, item 3). Over the
 * seeded session: param 1, its gradient in container 1, sgd velocity 10,
 * adam moments 11 and 12. */
static void recipe_step_reads(rd *r, fz_buf *out) {
  static const double sgd[3] = {0.1, 0.9, 0.01};
  static const double adam[4] = {0.01, 0.9, 0.999, 1e-8};
  int rounds = 1 + u8(r) % 4;
  for (int k = 0; k < rounds; k++) {
    uint8_t b = u8(r);
    uint64_t p = b & 0x40 ? rid_of(r) : 1;
    if (b & 1) put_read(out, p);
    if (b & 2) {
      int64_t t = 1 + k;
      static const uint64_t st[2] = {11, 12};
      put_step(out, DSP_OP_ADAM_STEP, 1, &p, 1, st, 2, &t, 1, adam, 4);
    } else {
      static const uint64_t v = 10;
      put_step(out, DSP_OP_SGD_STEP, 1, &p, 1, &v, 1, NULL, 0, sgd, 3);
    }
    if (b & 4) put_read(out, p);
    if (b & 8) put_read(out, b & 2 ? 11 : 10);
    if (b & 0x10) put_sync(out);
    if (b & 0x20) { /* a fresh gradient between steps */
      static const uint64_t g1 = 1;
      put_free(out, NULL, 0, &g1, 1);
      put_backward(out, 9, 1, 1);
    }
  }
}

/* kind 0xf3: retained backward passes, repeated into one container or
 * several, then Grad requests out of each and reads of what they give
 * (issue 9, item 4: containers and the tape they keep). Over the seeded
 * session: loss 9 = sum(matmul(1, 2)), 1 and 2 tracked. */
static void recipe_retained_backward(rd *r, fz_buf *out) {
  int passes = 1 + u8(r) % 4;
  uint8_t how = u8(r);
  uint64_t loss = how & 0x80 ? rid_of(r) : 9;
  for (int k = 0; k < passes; k++) {
    uint64_t g = how & 1 ? 2 : 2 + (uint64_t)k; /* one container or many */
    int retain = (how & 2) && k == passes - 1 ? 0 : 1;
    put_backward(out, loss, g, retain);
  }
  int grads = u8(r) % 4;
  for (int k = 0; k < grads; k++) {
    uint64_t g = 1 + u8(r) % 5, t = u8(r) & 1 ? 2 : 1, o = 13 + (uint64_t)k;
    put_grad(out, g, t, o);
    if (how & 4) put_read(out, o);
  }
  if (how & 8) put_stats(out);
  if (how & 0x10) { /* free the containers, then ask again */
    static const uint64_t gs[4] = {2, 3, 4, 5};
    put_free(out, NULL, 0, gs, 4);
    put_grad(out, 2, 1, 17);
  }
}

/* kind 0xf4..0xf7: one 1.3 Ops request of 1..8 packed records over small
 * ids (op_record.h). A record's mode byte below 0xf0 sets only no_grad;
 * from 0xf0 up it breaks the record (unknown flag, non-zero padding, a
 * count over its limit, op code 0), and a last byte from 0xf8 up cuts
 * 1..8 bytes off the end: all of those are protocol errors. */
static void recipe_ops(rd *r, fz_buf *out) {
  enum { REC_MAX = DSP_OPREC_FIXED + 8 * (4 + 4 + 2) };
  uint8_t recs[8 * REC_MAX];
  size_t len = 0;
  int n = u8(r) % 8 + 1;
  for (int k = 0; k < n; k++) {
    uint64_t in[4];
    int64_t ints[4];
    double fl[2];
    uint8_t b = u8(r);
    int op = b < 0xf0 ? k_ops[b % N_OPS] : u8(r);
    int n_in = u8(r) % 5;
    for (int i = 0; i < n_in; i++) in[i] = rid_of(r);
    uint64_t o = rid_of(r);
    int n_ints = u8(r) % 5;
    for (int i = 0; i < n_ints; i++) ints[i] = small_int(r);
    int n_fl = u8(r) % 3;
    for (int i = 0; i < n_fl; i++) fl[i] = small_float(r);
    uint8_t m = u8(r);
    uint8_t *q = recs + len;
    len += dsp_oprec_put(q, op, m & 1, in, n_in, o, ints, n_ints, fl, n_fl);
    if (m >= 0xf0) {
      switch (m & 3) {
        case 0: q[1] |= 2; break;
        case 1: q[5 + (m >> 2) % 3] = 1; break;
        case 2: q[2] = DSP_MAX_INPUTS + 1; break;
        default: q[0] = 0; break;
      }
    }
  }
  uint8_t cut = u8(r);
  if (cut >= 0xf8) len -= (size_t)(cut - 0xf7);
  put_ops(out, recs, len);
}

static void recipe_one(rd *r, fz_buf *out) {
  uint8_t kb = u8(r);
  if (kb >= 0xf4 && kb < 0xf8) { /* 1.3 Ops */
    recipe_ops(r, out);
    return;
  }
  if (kb >= 0xf0) { /* the structured shapes of issue 9 */
    switch (kb & 3) {
      case 0: recipe_zero_upload(r, out); return;
      case 1: recipe_zero_attr(r, out); return;
      case 2: recipe_step_reads(r, out); return;
      default: recipe_retained_backward(r, out); return;
    }
  }
  uint8_t kind = kb % 11;
  uint64_t ids[DSP_MAX_INPUTS + 4], ids2[8];
  int64_t ints[DSP_MAX_ATTR_INTS + 2];
  double floats[DSP_MAX_ATTR_FLOATS + 2];
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
      uint64_t g = rid_of(r), t = rid_of(r);
      put_grad(out, g, t, rid_of(r));
      return;
    }
    case 5: { /* step */
      uint8_t b = u8(r);
      int op = b % 3 == 0   ? DSP_OP_SGD_STEP
               : b % 3 == 1 ? DSP_OP_ADAM_STEP
                            : (int)small_int(r);
      uint64_t g = rid_of(r);
      size_t np = u8(r) % 4;
      for (size_t i = 0; i < np; i++) ids[i] = rid_of(r);
      size_t ns = u8(r) % 9;
      for (size_t i = 0; i < ns; i++) ids2[i] = rid_of(r);
      size_t ni = u8(r) % 3;
      for (size_t i = 0; i < ni; i++) ints[i] = small_int(r);
      size_t nf = u8(r) % (DSP_MAX_ATTR_FLOATS + 2);
      for (size_t i = 0; i < nf; i++) floats[i] = small_float(r);
      put_step(out, op, g, ids, np, ids2, ns, ints, ni, floats, nf);
      return;
    }
    case 6: { /* free */
      size_t nt = u8(r) % 4;
      for (size_t i = 0; i < nt; i++) ids[i] = rid_of(r);
      size_t ng = u8(r) % 3;
      for (size_t i = 0; i < ng; i++) ids2[i] = rid_of(r);
      put_free(out, ids, nt, ids2, ng);
      return;
    }
    case 7: put_read(out, rid_of(r)); return;
    case 8: put_sync(out); return;
    case 9: put_stats(out); return;
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
  const sv_config *cfg = fz_config_once();
  memset(o, 0, sizeof *o);
  sv_global g;
  memset(&g, 0, sizeof g);
  dsp_ctx *io = dsp_ctx_new(dsp_cpu_backend());
  sv_session *s = io ? sv_session_new(cfg, &g, NULL) : NULL;
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
