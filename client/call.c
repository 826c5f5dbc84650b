/* A REMOTE device's requests on their way out and their replies on the
 * way back. Fire-and-forget requests are framed into a send buffer that
 * goes out when full, when a bulk is too large to copy, or before a wait;
 * ops queue as packed records (common/op_record.h) sent as one Ops
 * request; frees are batched. A wait reads frames until its reply, skips
 * keepalives and others' harmless replies, and maps a server error into
 * the device and onto the tensor it poisons.
 *
 * Waits (protocol 1.4): a server that works on the session's requests
 * sends keepalives, so a wait tells silence from slowness by the
 * connection: no bytes at all for the timeout is a lost connection (and
 * a resume), while a reply that is not there by the wait's deadline from
 * a server that is heard from gives DISPATCH_ETIMEDOUT and leaves the
 * session as it was: the request stays pending (pend_id) and the next
 * wait takes its reply first (as its own, when it asks the same thing
 * with nothing sent in between). An older server sends no keepalives: a
 * reply not there within the timeout then loses the connection, as
 * before.
 *
 * Request ids: one counter per connection hands out tensor ids, gradient
 * container ids and request ids, and a request that creates a tensor uses
 * the new tensor's id as its req_id. A server error's failed_req_id thus
 * names the tensor to poison without a table of pending requests. */
#include <stdio.h>
#include <string.h>

#include "conn.h"
#include "frame.h"
#include "op_record.h"
#include "wire_req.h"

#define FLUSH_AT (1u << 20)  /* send the buffer once this much is queued */
#define BULK_INLINE (64u << 10) /* larger bulk skips the buffer */
/* The replay log is acknowledged by the next waiting reply; past this
 * many bytes a Sync is sent so it cannot grow without bound. */
#define LOG_SYNC_AT (64u << 20)
/* Upload bytes up to this are copied into the log; a larger upload keeps
 * the caller's buffer and is acknowledged (a Sync) before it returns. */
#define LOG_COPY_MAX (1u << 20)

/* Set when protobuf-c's unpack failed for memory rather than bad bytes
 * (unpack returns NULL for both). */
static _Thread_local int g_pb_oom;

static void *pb_alloc(void *ud, size_t n) {
  (void)ud;
  void *p = dsp_malloc(n);
  if (!p) g_pb_oom = 1;
  return p;
}
static void pb_free(void *ud, void *p) {
  (void)ud;
  dsp_free(p);
}
ProtobufCAllocator dispatch__pb_alloc = {pb_alloc, pb_free, NULL};

static int close_ops(dispatch_device *dev);

int dispatch__flush(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (c->ops_n && !c->resuming) {
    int rc = close_ops(dev); /* puts the frame; sent below */
    if (rc < 0) return rc;
  }
  if (c->len == 0) return 0;
  int rc = dispatch__send_all(dev, c->buf, c->len);
  c->len = 0;
  return rc;
}

static int reserve(dispatch_device *dev, size_t more) {
  dispatch__conn *c = dev->conn;
  if (c->cap - c->len >= more) return 0;
  size_t cap = c->cap ? c->cap : 4096;
  while (cap - c->len < more) {
    if (cap > SIZE_MAX / 2)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "send buffer overflow");
    cap *= 2;
  }
  uint8_t *nb = dsp_realloc(c->buf, cap);
  if (!nb)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "out of memory (send buffer of %zu bytes)", cap);
  c->buf = nb;
  c->cap = cap;
  return 0;
}

/* Appends one frame (header, message, bulk). Either the whole frame is
 * queued or sent, or nothing is (ENOMEM) or the connection is lost. */
int dispatch__put_frame(dispatch_device *dev, Dspwire__Request *req,
                        const void *bulk, size_t bulk_len) {
  dispatch__conn *c = dev->conn;
  if (c->ops_n && !c->resuming) { /* queued ops go first, in order */
    int rc = close_ops(dev);
    if (rc < 0) return rc;
  }
  if (c->resumable && !c->resuming && !req->seq) req->seq = c->seq + 1;
  size_t flen = dsp_req_frame_size(req);
  size_t mlen = flen - DSP_FRAME_HEADER_SIZE;
  if (c->max_frame && mlen > c->max_frame)
    return dsp_seterr(dev->ctx, DISPATCH_ETOOLARGE,
                      "request of %zu bytes exceeds the server's frame limit "
                      "%llu",
                      mlen, (unsigned long long)c->max_frame);
  /* the server refuses a larger frame at its header and closes: refused
   * here, nothing is sent and the session goes on */
  if (c->max_frame && bulk_len > c->max_frame - mlen)
    return dsp_seterr(dev->ctx, DISPATCH_ETOOLARGE,
                      "upload of %zu bytes (+ %zu of message) exceeds the "
                      "server's frame limit %llu",
                      bulk_len, mlen, (unsigned long long)c->max_frame);
  int inline_bulk = bulk_len <= BULK_INLINE;
  int rc = reserve(dev, flen + (inline_bulk ? bulk_len : 0));
  if (rc < 0) return rc;
  uint8_t *at = c->buf + c->len;
  dsp_req_frame_encode(req, bulk_len, at);
  if (req->seq) { /* logged before it is sent: a reconnect sends it again */
    int ext = bulk_len > LOG_COPY_MAX;
    if (dispatch__log_frame(c, req->seq, at, flen, ext ? NULL : bulk,
                  ext ? 0 : bulk_len) < 0)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory for the replay log (%zu bytes)",
                        c->log_len + flen + bulk_len);
    if (ext) {
      c->ext_bulk = bulk;
      c->ext_len = bulk_len;
      c->ext_at = c->log_len;
      c->ext_seq = req->seq;
    }
    c->seq = req->seq;
  }
  c->len += flen;
  if (inline_bulk) {
    if (bulk_len) memcpy(c->buf + c->len, bulk, bulk_len);
    c->len += bulk_len;
  } else {
    rc = dispatch__flush(dev);
    if (rc == 0) rc = dispatch__send_all(dev, bulk, bulk_len);
    if (rc < 0) return rc;
  }
  if (c->len >= FLUSH_AT) return dispatch__flush(dev);
  return 0;
}

/* Queues one Free message for the ids gathered so far. */
static int put_frees(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c->n_free_ids && !c->n_free_grads) return 0;
  dsp_wreq w;
  Dspwire__Request *req =
      dsp_wreq_free(&w, c->free_ids, (size_t)c->n_free_ids, c->free_grads,
                    (size_t)c->n_free_grads);
  req->req_id = c->next_id++;
  int rc = dispatch__put_frame(dev, req, NULL, 0);
  if (rc == DISPATCH_ENOMEM && !c->resumable) {
    /* the caller cannot be told about a failed free: send it unbuffered */
    rc = dispatch__flush(dev);
    if (rc == 0) {
      uint8_t tmp[DSP_FRAME_HEADER_SIZE + 2 * DISPATCH__FREE_BATCH * 11 + 64];
      if (dsp_req_frame_size(req) <= sizeof tmp)
        rc = dispatch__send_all(dev, tmp, dsp_req_frame_encode(req, 0, tmp));
    }
  }
  if (rc < 0 && rc != DISPATCH_ECONN && rc != DISPATCH__EBROKEN) return rc;
  c->n_free_ids = c->n_free_grads = 0;
  return rc;
}

void dispatch__remote_free(dispatch_device *dev, uint64_t id, int is_grads) {
  dispatch__conn *c = dev->conn;
  if (c->dead || dev->closing || (c->fd < 0 && !c->broken)) return;
  if (c->n_free_ids == DISPATCH__FREE_BATCH ||
      c->n_free_grads == DISPATCH__FREE_BATCH)
    put_frees(dev);
  if (is_grads)
    c->free_grads[c->n_free_grads++] = id;
  else
    c->free_ids[c->n_free_ids++] = id;
}

uint64_t dispatch__remote_new_id(dispatch_device *dev) {
  return dev->conn->next_id++;
}

/* Maps the server's Error into the device: code, message, and the poison
 * mark on the tensor the failed request was creating. */
static int take_error(dispatch_device *dev, const Dspwire__Error *e,
                      uint64_t req_id, uint64_t target) {
  int code = e->code < 0 ? e->code : DISPATCH_EPROTO;
  dsp_seterr(dev->ctx, code, "server: %s",
             e->message && *e->message ? e->message : dispatch_strerror(code));
  /* a waiting request that failed itself on its target (a read of a
   * poisoned tensor) marks that tensor */
  uint64_t victim = e->failed_req_id;
  if (victim == req_id) victim = target;
  for (dispatch_tensor *t = dev->all; victim && t; t = t->anext)
    if (t->kind == DISPATCH_KIND_REMOTE && t->id == victim) {
      /* kept so a later op on t answers with this message, no round trip
       * (without memory for it, the code's generic text does) */
      t->status = code;
      dsp_free(t->poison_msg);
      t->poison_msg = dsp_strdup(dsp_ctx_errmsg(dev->ctx));
      break;
    }
  return code;
}

/* Reads and throws away n bulk bytes the caller has no use for. */
static int drain(dispatch_device *dev, uint64_t n, int64_t deadline) {
  uint8_t tmp[16384];
  while (n > 0) {
    size_t k = n < sizeof tmp ? (size_t)n : sizeof tmp;
    int rc = dispatch__recv_all(dev, tmp, k, deadline, 0, 0);
    if (rc < 0) return rc;
    n -= k;
  }
  return 0;
}

/* Reads frames until the reply to req_id. A READ reply's bulk lands in dst
 * when its size is dst_len. DISPATCH__EBROKEN when the socket failed on a
 * resumable session (nothing kept; the caller reconnects and waits again). With
 * keepalives and may_time_out, DISPATCH_ETIMEDOUT when the deadline
 * passed between frames with the server alive: the stream is at a frame
 * boundary, and the reply is still to come. */
int dispatch__await_reply(dispatch_device *dev, uint64_t req_id, void *dst,
                          size_t dst_len, uint64_t target,
                          Dspwire__Reply **reply, int may_time_out) {
  dispatch__conn *c = dev->conn;
  int64_t deadline = dispatch__deadline_in(c);
  int rc;
  /* the server owed nothing before the request */
  c->heard_ms = dispatch__now_ms();
  for (;;) {
    uint8_t hb[DSP_FRAME_HEADER_SIZE];
    rc = dispatch__recv_all(dev, hb, sizeof hb, deadline, 1, may_time_out);
    if (rc == DISPATCH_ETIMEDOUT)
      return dsp_seterr(dev->ctx, DISPATCH_ETIMEDOUT,
                        "%s: no reply to request %llu within %d ms; the "
                        "server is alive and still working on the "
                        "session's requests (the request stays queued: "
                        "wait again)",
                        dev->spec, (unsigned long long)req_id,
                        c->timeout_ms);
    if (rc < 0) return rc;
    dsp_frame_header h;
    rc = dsp_frame_header_decode(hb, DISPATCH__MAX_REPLY_MSG, UINT64_MAX, &h);
    if (rc < 0) return dispatch__conn_dead(dev, "malformed reply frame header");
    uint8_t *mb = dsp_malloc(h.msg_len);
    if (!mb) {
      /* skip the frame so the stream stays in step; the reply is lost */
      rc = drain(dev, (uint64_t)h.msg_len + h.bulk_len, deadline);
      if (rc < 0) return rc;
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory reading a reply of %u bytes",
                        h.msg_len);
    }
    rc = dispatch__recv_all(dev, mb, h.msg_len, deadline, 0, 0);
    if (rc < 0) {
      dsp_free(mb);
      return rc;
    }
    g_pb_oom = 0;
    Dspwire__Reply *r =
        dspwire__reply__unpack(&dispatch__pb_alloc, h.msg_len, mb);
    dsp_free(mb);
    if (!r && g_pb_oom) {
      rc = drain(dev, h.bulk_len, deadline);
      if (rc < 0) return rc;
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory decoding a reply");
    }
    if (!r) return dispatch__conn_dead(dev, "undecodable reply message");
    int mine = r->req_id == req_id;
    if (h.bulk_len) {
      if (mine && dst &&
          (r->body_case == DSPWIRE__REPLY__BODY_READ ||
           r->body_case == DSPWIRE__REPLY__BODY_GRAPH) &&
          h.bulk_len == dst_len)
        rc = dispatch__recv_all(dev, dst, dst_len, deadline, 0, 0);
      else
        rc = drain(dev, h.bulk_len, deadline);
      if (rc < 0) {
        dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
        return rc;
      }
    }
    if (r->keepalive && !r->error && r->req_id == 0) { /* 1.4: alive */
      dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
      continue;
    }
    if (!mine && !r->error) { /* not ours and harmless: skip it */
      dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
      continue;
    }
    *reply = r;
    if (r->error && r->error->code == DISPATCH_ESHUTDOWN)
      return dispatch__conn_down(dev, DISPATCH_ESHUTDOWN,
                       r->error->message ? r->error->message : "");
    if (r->error && r->error->code != 0)
      return take_error(dev, r->error, req_id, target);
    if (!mine) return dispatch__conn_dead(dev, "reply to an unknown request");
    return 0;
  }
}

/* put_frees across a reconnect of a resumable session (the frees were
 * logged, so the reconnect sends them again). */
int dispatch__put_frees_now(dispatch_device *dev) {
  int rc = put_frees(dev);
  return rc == DISPATCH__EBROKEN ? dispatch__reconnect(dev) : rc;
}

/* FNV-1a of n bytes: whether a replay sent again has the same inputs. */
static uint64_t fnv1a(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* A wait for req gave up (DISPATCH_ETIMEDOUT): its reply stays owed. */
static void pend_keep(dispatch__conn *c, const Dspwire__Request *req,
                      const void *bulk, size_t bulk_len, size_t dst_len) {
  c->pend_id = req->req_id;
  c->pend_seq = req->seq;
  c->pend_case = (int)req->body_case;
  c->pend_key = req->body_case == DSPWIRE__REQUEST__BODY_READ
                    ? req->read->id
                : req->body_case == DSPWIRE__REQUEST__BODY_GRAPH_REPLAY
                    ? req->graph_replay->graph
                    : 0;
  c->pend_len = bulk_len;
  c->pend_hash = req->body_case == DSPWIRE__REQUEST__BODY_GRAPH_REPLAY
                     ? fnv1a(bulk, bulk_len)
                     : 0;
  c->pend_dst_len = dst_len;
  c->pend_next = c->next_id;
  dispatch__log_take_ext(c);
}

/* Whether req asks what the pending request asked, with nothing sent
 * since: the pending reply then answers it (a Read sees the tensor as it
 * is, a replay runs once). */
static int pend_same(const dispatch__conn *c, const Dspwire__Request *req,
                     const void *bulk, size_t bulk_len, size_t dst_len) {
  if (!c->pend_id || c->next_id != c->pend_next || c->len || c->ops_n ||
      (int)req->body_case != c->pend_case)
    return 0;
  switch (req->body_case) {
  case DSPWIRE__REQUEST__BODY_SYNC:
  case DSPWIRE__REQUEST__BODY_STATS:
    return 1;
  case DSPWIRE__REQUEST__BODY_READ:
    return req->read->id == c->pend_key && dst_len == c->pend_dst_len;
  case DSPWIRE__REQUEST__BODY_GRAPH_REPLAY:
    return req->graph_replay->graph == c->pend_key &&
           bulk_len == c->pend_len && dst_len == c->pend_dst_len &&
           fnv1a(bulk, bulk_len) == c->pend_hash;
  default:
    return 0;
  }
}

/* Waits for the reply to request rid (seq) across reconnects; a reply to
 * it acknowledges everything up to seq. */
static int wait_reply(dispatch_device *dev, uint64_t rid, uint64_t seq,
                      void *dst, size_t dst_len, uint64_t target,
                      Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  int rc = dispatch__await_reply(dev, rid, dst, dst_len, target, reply, 1);
  while (rc == DISPATCH__EBROKEN) {
    rc = dispatch__reconnect(dev);
    if (rc == 0)
      rc = dispatch__await_reply(dev, rid, dst, dst_len, target, reply, 1);
  }
  if (rc != DISPATCH_ETIMEDOUT)
    c->ops_limit = DISPATCH__OPS_FIRST; /* the server has caught up */
  if (*reply && seq && (*reply)->req_id == rid) {
    /* the server ran everything up to it: nothing to send again */
    c->acked = seq;
    dispatch__log_trim(c, seq);
  }
  return rc;
}

/* Waits for the pending request's reply (into dst when it answers this
 * call). DISPATCH_ETIMEDOUT keeps it pending; anything else settles it. */
static int wait_pending(dispatch_device *dev, void *dst, size_t dst_len,
                        Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  uint64_t target =
      c->pend_case == DSPWIRE__REQUEST__BODY_READ ? c->pend_key : 0;
  int rc = wait_reply(dev, c->pend_id, c->pend_seq, dst, dst_len, target,
                      reply);
  if (rc != DISPATCH_ETIMEDOUT) c->pend_id = 0;
  else /* an upload queued since: the caller's buffer */
    dispatch__log_take_ext(c);
  return rc;
}

/* Sends req (and everything queued before it, then the batched frees) and
 * waits for its reply, across reconnects of a resumable session. A READ
 * reply's bulk lands in dst when its size is dst_len. *reply is the
 * caller's (free_unpacked) when it returns 0 or a server error; on
 * ECONN/EPROTO/ETIMEDOUT *reply is NULL.
 *
 * A request whose wait timed out is pending: this call takes its reply
 * first. When req asks the same (pend_same) that reply is req's and
 * nothing is sent; otherwise req goes once it came, and not at all when
 * it brings an error (the deferred error of the session, which this call
 * reports as any wait would: req not performed) or times out again. */
static int call_bulk(dispatch_device *dev, Dspwire__Request *req,
                     const void *bulk, size_t bulk_len, void *dst,
                     size_t dst_len, uint64_t target, Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  *reply = NULL;
  int rc = dispatch__check_alive(dev);
  if (rc == DISPATCH__EBROKEN) rc = dispatch__reconnect(dev);
  if (rc < 0) return rc;
  close_ops(dev); /* before req's id is taken; a failure is stashed */
  if (c->pend_id) {
    if (pend_same(c, req, bulk, bulk_len, dst_len))
      return wait_pending(dev, dst, dst_len, reply);
    rc = dispatch__flush(dev); /* what close_ops put: the server works on it */
    if (rc == DISPATCH__EBROKEN) rc = dispatch__reconnect(dev);
    if (rc == 0) rc = wait_pending(dev, NULL, 0, reply);
    if (rc < 0) return rc;
    dspwire__reply__free_unpacked(*reply, &dispatch__pb_alloc);
    *reply = NULL;
  }
  if (c->stash_code) { /* an earlier request's error, held for a wait */
    rc = dsp_seterr(dev->ctx, c->stash_code, "%s", c->stash_msg);
    c->stash_code = 0;
    return rc;
  }
  req->req_id = c->next_id++;
  req->ack = c->acked;
  uint32_t ka = dispatch__keepalive_for(c->timeout_ms);
  int ask = c->ka_ms && ka && ka != c->ka_asked; /* set_timeout changed */
  if (ask) req->keepalive_ms = ka;
  rc = dispatch__put_frees_now(dev);
  if (rc == 0) rc = dispatch__put_frame(dev, req, bulk, bulk_len);
  if (ask && (rc == 0 || rc == DISPATCH__EBROKEN))
    c->ka_asked = ka; /* logged */
  if (rc == 0) rc = dispatch__flush(dev);
  while (rc == DISPATCH__EBROKEN) {
    rc = dispatch__reconnect(dev);
    if (rc == 0) rc = wait_reply(dev, req->req_id, req->seq, dst, dst_len,
                                 target, reply);
  }
  if (rc == 0 && !*reply)
    rc = wait_reply(dev, req->req_id, req->seq, dst, dst_len, target, reply);
  if (rc == DISPATCH_ETIMEDOUT) pend_keep(c, req, bulk, bulk_len, dst_len);
  return rc;
}

int dispatch__call(dispatch_device *dev, Dspwire__Request *req, void *dst,
                   size_t dst_len, uint64_t target, Dspwire__Reply **reply) {
  return call_bulk(dev, req, NULL, 0, dst, dst_len, target, reply);
}

int dispatch__remote_call(dispatch_device *dev, Dspwire__Request *req,
                          const void *bulk, size_t bulk_len, void *dst,
                          size_t dst_len, Dspwire__Reply **reply) {
  return call_bulk(dev, req, bulk, bulk_len, dst, dst_len, 0, reply);
}

void dispatch__remote_reply_free(Dspwire__Reply *r) {
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
}

/* Puts the open batch of op records as one Ops frame (sent with the next
 * flush). Its ops were each accepted when queued, so a failure here loses
 * them after the fact: the code is returned to the caller at hand and
 * also held for the next wait, which reports it as it would the deferred
 * error of one of those ops. */
static int close_ops(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c->ops_n) return 0;
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_ops(&w, c->ops, c->ops_len);
  int n = c->ops_n;
  req->req_id = c->next_id++;
  c->ops_n = 0; /* put_frame must not close it again */
  c->ops_len = 0;
  int rc = dispatch__put_frame(dev, req, NULL, 0);
  if (rc == DISPATCH__EBROKEN)
    rc = dispatch__reconnect(dev); /* it was logged: sent again */
  if (rc < 0 && !c->stash_code && !c->dead) {
    c->stash_code = rc;
    snprintf(c->stash_msg, sizeof c->stash_msg, "%d queued ops were lost: %s",
             n, dsp_ctx_errmsg(dev->ctx));
  }
  return rc;
}

/* Queues one op as a record of the open batch; a full batch is put and
 * sent, so the server works on it while the caller queues the next. */
int dispatch__put_record(dispatch_device *dev, dsp_opcode op,
                         const uint64_t *in, int n_in, const dsp_attrs *a,
                         uint64_t out, int no_grad) {
  dispatch__conn *c = dev->conn;
  int rc = dispatch__check_alive(dev);
  if (rc == DISPATCH__EBROKEN) rc = dispatch__reconnect(dev);
  if (rc < 0) return rc;
  /* a new batch goes behind the frees queued so far: what the caller let
   * go of before these ops (last step's intermediates) is freed first, so
   * the server reuses those blocks, still in cache, for their results */
  if (c->ops_n == 0 && (c->n_free_ids || c->n_free_grads) &&
      (rc = dispatch__put_frees_now(dev)) < 0)
    return rc;
  size_t size = dsp_oprec_size(n_in, a->n_ints, a->n_floats);
  if (c->ops_len + size > DISPATCH__OPS_BYTES && (rc = close_ops(dev)) < 0)
    return rc;
  if (!c->ops && !(c->ops = dsp_malloc(DISPATCH__OPS_BYTES)))
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "out of memory for the op batch (%d bytes)",
                      DISPATCH__OPS_BYTES);
  c->ops_len += dsp_oprec_put(c->ops + c->ops_len, (int)op, no_grad, in, n_in,
                              out, a->ints, a->n_ints, a->floats,
                              a->n_floats);
  if (++c->ops_n < c->ops_limit) return 0;
  /* after a wait the server has nothing to do: the first batches are
   * small so it starts while the rest is queued, then they double */
  if (c->ops_limit < DISPATCH__OPS_MAX) c->ops_limit *= 2;
  rc = close_ops(dev);
  if (rc == 0) rc = dispatch__flush(dev);
  if (rc == DISPATCH__EBROKEN)
    rc = dispatch__reconnect(dev); /* the batch was logged */
  return rc;
}

int dispatch__queue(dispatch_device *dev, Dspwire__Request *req, uint64_t rid,
                    const void *bulk, size_t bulk_len) {
  dispatch__conn *c = dev->conn;
  int rc = dispatch__check_alive(dev);
  if (rc == DISPATCH__EBROKEN) rc = dispatch__reconnect(dev);
  if (rc < 0) return rc;
  if ((rc = close_ops(dev)) < 0) return rc; /* before req's id is taken */
  req->req_id = rid ? rid : c->next_id++;
  rc = dispatch__put_frame(dev, req, bulk, bulk_len);
  if (rc == DISPATCH__EBROKEN)
    rc = dispatch__reconnect(dev); /* it sends the frame again */
  if (rc == 0 && (c->ext_bulk || c->log_len > LOG_SYNC_AT)) {
    /* the caller's buffer may go once this returns: the server must have
     * the bytes first. A deferred error this brings back is the next
     * wait's to report, as without the Sync. */
    dsp_wreq w;
    Dspwire__Reply *r;
    int held = c->stash_code; /* the Sync must be sent even so */
    c->stash_code = 0;
    rc = dispatch__call(dev, dsp_wreq_sync(&w), NULL, 0, 0, &r);
    /* a busy server: the bytes are in the log now (pend_keep), the Sync
     * stays pending for the next wait, and the upload was handed over */
    if (rc == DISPATCH_ETIMEDOUT) rc = 0;
    if (rc < 0 && r) {
      if (!held)
        snprintf(c->stash_msg, sizeof c->stash_msg, "%s",
                 dsp_ctx_errmsg(dev->ctx));
      if (!held) held = rc;
      rc = 0;
    }
    c->stash_code = held;
    if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
    c->ext_bulk = NULL;
  }
  return rc;
}

int dispatch__remote_queue(dispatch_device *dev, Dspwire__Request *req) {
  return dispatch__queue(dev, req, 0, NULL, 0);
}
