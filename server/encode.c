/* Reply framing shared by the loop and workers. */
#include <stdio.h>
#include <string.h>

#include "frame.h"
#include "sv.h"

/* Every block protobuf-c takes carries a PB_HDR-byte header with its size
 * and the budget it was charged to (NULL: none), so any allocator of this
 * kind frees it and uncharges the right session, on any thread. ud is an
 * sv_pb_charge (a session's) or NULL (sv_pb_allocator: uncharged).
 *
 * A session's request is decoded into one arena when it can be: the
 * arena counts the blocks it has handed out and goes, with its charge,
 * when the last of them is freed. (Not when the message itself is freed:
 * a failed unpack frees the message and then its scratch arrays, so a
 * block can outlive the message; the session fuzzer found that.) One
 * malloc and one charge per request instead of one per
 * block (a chain of small ops spent ~15% of the server's time in malloc
 * and in the budgets' atomics, most of it here). The arena is sized from
 * the message's length (pc->hint, set by the decoder); what does not fit
 * in it, or a request whose arena the budget refuses, takes a block of
 * its own as before. After the decode the charge is cut down to what the
 * blocks used. */
#define PB_HDR 16
#define PB_SUB (1ull << 63) /* header size word: a block inside an arena */
#define PB_ARENA_MAX 65536

typedef struct pb_arena {
  dsp_budget *b;
  uint64_t charged;
  size_t cap, used;
  size_t live; /* blocks handed out and not yet freed */
  _Alignas(16) uint8_t mem[];
} pb_arena;

static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The arena for the request pc is decoding: made at its first block. */
static pb_arena *arena_for(sv_pb_charge *pc) {
  if (pc->arena || !pc->hint) return pc->arena;
  size_t cap = pc->hint < (PB_ARENA_MAX - 512) / 8 ? pc->hint * 8 + 512
                                                   : PB_ARENA_MAX;
  pc->hint = 0; /* one try per request */
  uint64_t cost = DSP_BUDGET_COST(sizeof(pb_arena) + cap);
  if (dsp_budget_charge_why(pc->budget, cost, NULL, NULL, 0) < 0) return NULL;
  pb_arena *a = dsp_malloc(sizeof *a + cap);
  if (!a) {
    dsp_budget_uncharge(pc->budget, cost);
    return NULL;
  }
  *a = (pb_arena){pc->budget, cost, cap, 0, 0};
  pc->arena = a;
  return a;
}

static void *arena_alloc(pb_arena *a, size_t size) {
  size_t need = PB_HDR + round16(size);
  if (size > a->cap || need > a->cap - a->used) return NULL;
  uint8_t *p = a->mem + a->used;
  uint64_t w0 = PB_SUB;
  a->used += need;
  a->live++;
  memcpy(p, &w0, sizeof w0);
  memcpy(p + 8, &a, sizeof a);
  return p + PB_HDR;
}

void sv_pb_charge_done(sv_pb_charge *pc) {
  pb_arena *a = pc->arena;
  pc->arena = NULL;
  pc->hint = 0;
  if (!a) return;
  uint64_t keep = DSP_BUDGET_COST(sizeof *a + a->used);
  if (keep < a->charged) {
    dsp_budget_uncharge_part(a->b, a->charged - keep);
    a->charged = keep;
  }
}

static void *pb_alloc(void *ud, size_t size) {
  sv_pb_charge *pc = ud;
  dsp_budget *b = pc ? pc->budget : NULL;
  if (size > SIZE_MAX - PB_HDR - 64) return NULL;
  pb_arena *a = pc ? arena_for(pc) : NULL;
  if (a) {
    void *q = arena_alloc(a, size);
    if (q) return q;
    if (a->used == 0) { /* nothing handed out and the first block does not
                           fit: give the arena back */
      uint64_t charged = a->charged;
      pc->arena = NULL;
      dsp_free(a);
      dsp_budget_uncharge(b, charged);
    }
  }
  uint64_t cost = DSP_BUDGET_COST(size + PB_HDR);
  if (dsp_budget_charge_why(b, cost, "decoding the request", pc ? pc->why : NULL,
                            pc ? sizeof pc->why : 0) < 0) {
    pc->refused = 1;
    return NULL;
  }
  uint8_t *p = dsp_malloc(size + PB_HDR);
  if (!p) {
    dsp_budget_uncharge(b, cost);
    return NULL;
  }
  uint64_t sz = size;
  memcpy(p, &sz, sizeof sz);
  memcpy(p + 8, &b, sizeof b);
  return p + PB_HDR;
}

static void pb_free(void *ud, void *q) {
  sv_pb_charge *pc = ud; /* set while decoding: a refused request goes */
  if (!q) return;
  uint8_t *p = (uint8_t *)q - PB_HDR;
  uint64_t sz;
  dsp_budget *b;
  memcpy(&sz, p, sizeof sz);
  if (sz & PB_SUB) { /* the arena goes with its last block */
    pb_arena *a;
    memcpy(&a, p + 8, sizeof a);
    if (--a->live > 0) return;
    if (pc && pc->arena == a) pc->arena = NULL;
    b = a->b;
    uint64_t charged = a->charged;
    dsp_free(a);
    dsp_budget_uncharge(b, charged);
    return;
  }
  memcpy(&b, p + 8, sizeof b);
  dsp_free(p);
  dsp_budget_uncharge(b, DSP_BUDGET_COST(sz + PB_HDR));
}

ProtobufCAllocator sv_pb_allocator = {pb_alloc, pb_free, NULL};

void sv_pb_charge_init(sv_pb_charge *pc, dsp_budget *b) {
  pc->pb = (ProtobufCAllocator){pb_alloc, pb_free, pc};
  pc->budget = b;
  pc->arena = NULL;
  pc->hint = 0;
  pc->refused = 0;
  pc->why[0] = '\0';
}

void sv_job_free(sv_job *j) {
  if (!j) return;
  if (j->req) dspwire__request__free_unpacked(j->req, &sv_pb_allocator);
  dsp_stage_release(&j->upload_stage);
  dsp_tensor_unref(j->upload);
  dsp_pin_release(j->out_pin);
  dsp_free(j->pre_msg);
  dsp_free(j->out);
  dsp_free(j);
}

void sv_wire_meta(Dspwire__TensorMeta *w, const dsp_meta *m) {
  *w = (Dspwire__TensorMeta)DSPWIRE__TENSOR_META__INIT;
  w->dtype = (int32_t)m->dtype;
  w->n_shape = (size_t)m->ndim;
  w->shape = (int64_t *)m->shape;
}

int sv_encode_reply(const Dspwire__Reply *r, const void *bulk,
                    size_t bulk_len, uint8_t **out, size_t *out_len) {
  *out = NULL;
  *out_len = 0;
  size_t mlen = dspwire__reply__get_packed_size(r);
  if (mlen > UINT32_MAX || bulk_len > SIZE_MAX - DSP_FRAME_HEADER_SIZE - mlen)
    return DISPATCH_ETOOLARGE;
  size_t total = DSP_FRAME_HEADER_SIZE + mlen + bulk_len;
  uint8_t *buf = dsp_malloc(total);
  if (!buf) return DISPATCH_ENOMEM;
  dsp_frame_header h = {(uint32_t)mlen, 0, bulk_len};
  dsp_frame_header_encode(buf, &h);
  dspwire__reply__pack(r, buf + DSP_FRAME_HEADER_SIZE);
  if (bulk_len) memcpy(buf + DSP_FRAME_HEADER_SIZE + mlen, bulk, bulk_len);
  *out = buf;
  *out_len = total;
  return 0;
}

int sv_job_reply(sv_job *j, Dspwire__Reply *r, const char *what, char *why,
                 size_t len) {
  r->req_id = j->req->req_id;
  int rc = sv_encode_reply(r, NULL, 0, &j->out, &j->out_len);
  if (rc < 0)
    return sv_why(why, len, rc, "%s%sout of memory for the reply",
                  what ? what : "", what ? ": " : "");
  return 0;
}

/* Below this a copy is cheaper than the second write buffer. */
#define READ_COPY_MAX (64u << 10)

/* Fills buf's header and message (mlen bytes of r) for a bulk of
 * bulk_len bytes, in_frame of them in buf after the message and the rest
 * pin's, and hands buf and pin to j. */
static void frame_out(sv_job *j, const Dspwire__Reply *r, uint8_t *buf,
                      size_t mlen, uint64_t bulk_len, size_t in_frame,
                      dsp_pin *pin) {
  dsp_frame_header h = {(uint32_t)mlen, 0, bulk_len};
  dsp_frame_header_encode(buf, &h);
  dspwire__reply__pack(r, buf + DSP_FRAME_HEADER_SIZE);
  j->out = buf;
  j->out_len = DSP_FRAME_HEADER_SIZE + mlen + in_frame;
  j->out_pin = pin;
}

int sv_encode_read_reply(dsp_ctx *ctx, const Dspwire__Reply *r,
                         dsp_tensor *t, sv_job *j) {
  size_t nbytes = dsp_tensor_nbytes(t);
  size_t mlen = dspwire__reply__get_packed_size(r);
  if (mlen > UINT32_MAX) return DISPATCH_ETOOLARGE;
  if (!j->bulk_by_ref || nbytes <= READ_COPY_MAX) {
    /* the bytes are copied out by the backend into the frame */
    if (nbytes > SIZE_MAX - DSP_FRAME_HEADER_SIZE - mlen)
      return DISPATCH_ETOOLARGE;
    uint8_t *buf = dsp_malloc(DSP_FRAME_HEADER_SIZE + mlen + nbytes);
    if (!buf) return DISPATCH_ENOMEM;
    dsp_frame_header h = {(uint32_t)mlen, 0, nbytes};
    dsp_frame_header_encode(buf, &h);
    dspwire__reply__pack(r, buf + DSP_FRAME_HEADER_SIZE);
    int rc = dsp_tensor_read(ctx, t, buf + DSP_FRAME_HEADER_SIZE + mlen, nbytes);
    if (rc < 0) {
      dsp_free(buf);
      return rc;
    }
    j->out = buf;
    j->out_len = DSP_FRAME_HEADER_SIZE + mlen + nbytes;
    return 0;
  }
  dsp_pin *pin;
  if (dsp_tensor_pin(ctx, t, &pin) < 0) return DISPATCH_ENOMEM;
  uint8_t *buf = dsp_malloc(DSP_FRAME_HEADER_SIZE + mlen);
  if (!buf) {
    dsp_pin_release(pin);
    return DISPATCH_ENOMEM;
  }
  frame_out(j, r, buf, mlen, nbytes, 0, pin);
  return 0;
}

int sv_encode_pin_reply(const Dspwire__Reply *r, dsp_pin *pin, sv_job *j) {
  size_t nbytes = dsp_pin_nbytes(pin);
  size_t mlen = dspwire__reply__get_packed_size(r);
  int copy = !j->bulk_by_ref || nbytes <= READ_COPY_MAX;
  if (mlen > UINT32_MAX ||
      nbytes > SIZE_MAX - DSP_FRAME_HEADER_SIZE - mlen) {
    dsp_pin_release(pin);
    return DISPATCH_ETOOLARGE;
  }
  uint8_t *buf = dsp_malloc(DSP_FRAME_HEADER_SIZE + mlen + (copy ? nbytes : 0));
  if (!buf) {
    dsp_pin_release(pin);
    return DISPATCH_ENOMEM;
  }
  if (copy) {
    uint8_t *dst = buf + DSP_FRAME_HEADER_SIZE + mlen;
    const uint8_t *src = dsp_pin_data(pin);
    for (size_t off = 0; off < nbytes;) {
      size_t n = dsp_pin_avail(pin, off, nbytes - off);
      memcpy(dst + off, src + off, n);
      off += n;
    }
    dsp_pin_release(pin);
    frame_out(j, r, buf, mlen, nbytes, nbytes, NULL);
    return 0;
  }
  frame_out(j, r, buf, mlen, nbytes, 0, pin);
  return 0;
}

int sv_encode_tensors_reply(dsp_ctx *ctx, const Dspwire__Reply *r,
                            dsp_tensor *const *ts, size_t n, sv_job *j) {
  if (n == 1) { /* a Read's reply: pinned where it is, no copy */
    int rc = sv_encode_read_reply(ctx, r, ts[0], j);
    if (rc == DISPATCH_ETOOLARGE || rc == DISPATCH_ENOMEM)
      dsp_seterr(ctx, rc, "%zu output bytes: %s", dsp_tensor_nbytes(ts[0]),
                 rc == DISPATCH_ENOMEM ? "out of memory for the reply"
                                       : "they do not fit a reply");
    return rc;
  }
  size_t mlen = dspwire__reply__get_packed_size(r), blen = 0;
  for (size_t i = 0; i < n; i++) {
    size_t nb = dsp_tensor_nbytes(ts[i]);
    if (nb > SIZE_MAX - blen) blen = SIZE_MAX;
    else blen += nb;
  }
  if (mlen > UINT32_MAX || blen > SIZE_MAX - DSP_FRAME_HEADER_SIZE - mlen)
    return dsp_seterr(ctx, DISPATCH_ETOOLARGE,
                      "%zu output bytes: they do not fit a reply", blen);
  int by_ref = j->bulk_by_ref && blen > READ_COPY_MAX;
  uint8_t *buf = dsp_malloc(DSP_FRAME_HEADER_SIZE + mlen + (by_ref ? 0 : blen));
  if (!buf)
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "out of memory for the reply");
  uint8_t *dst = buf + DSP_FRAME_HEADER_SIZE + mlen;
  dsp_tensor *blk = NULL;
  int rc = 0;
  if (by_ref) {
    /* the bytes wait for the socket in one host block charged to ctx's
     * budget (the session's), made before anything is copied: a reply
     * that does not fit is refused, not held uncounted */
    dsp_meta m;
    memset(&m, 0, sizeof m);
    m.dtype = DSP_BOOL; /* one byte per element: a byte block */
    m.ndim = 1;
    m.shape[0] = (int64_t)blen;
    const dsp_backend *be = dsp_ctx_backend(ctx);
    dsp_ctx_set_backend(ctx, dsp_cpu_backend());
    rc = dsp_tensor_new_uninit(ctx, &m, &blk);
    dsp_ctx_set_backend(ctx, be);
    if (rc == 0) dst = dsp_tensor_data(blk);
  }
  size_t off = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    size_t nb = dsp_tensor_nbytes(ts[i]);
    rc = dsp_tensor_read(ctx, ts[i], dst + off, nb);
    off += nb;
  }
  dsp_pin *pin = NULL;
  if (rc == 0 && blk) rc = dsp_tensor_pin(ctx, blk, &pin);
  dsp_tensor_unref(blk); /* the pin keeps the block, and its charge */
  if (rc < 0) {
    dsp_free(buf);
    return rc;
  }
  frame_out(j, r, buf, mlen, blen, by_ref ? 0 : blen, pin);
  return 0;
}

int sv_encode_error(uint64_t req_id, int code, const char *msg,
                    uint64_t failed_req, uint8_t **out, size_t *out_len) {
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__Error e = DSPWIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)(msg ? msg : "");
  e.failed_req_id = failed_req;
  r.req_id = req_id;
  r.error = &e;
  return sv_encode_reply(&r, NULL, 0, out, out_len);
}
