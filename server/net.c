/* The libuv loop: accepts connections, frames and decodes requests, hands
 * them to the worker pool and writes replies. The loop only does I/O and
 * structural checks; nothing here runs a kernel.
 *
 * Ownership: a connection struct embeds its uv handles and is freed only
 * when both handles are closed and its session's teardown job (the last
 * job of the session, run on a worker after any running job) came back.
 * Each uv_write has an sv_write that owns its buffer until on_write. */
#include <openssl/crypto.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <uv.h>

#include "frame.h"
#include "sv.h"

/* ST_WAIT: an upload's header is decoded but the quota cannot be judged
 * until the session's earlier requests (a free, say) have run; reading
 * stops and the unparsed rest of rbuf is kept for later. */
enum { ST_HEADER, ST_MSG, ST_BULK, ST_WAIT, ST_DEAD };
#define RBUF_SIZE 65536
/* TLS replies are encrypted a step at a time as the socket takes them:
 * a 64 MiB Read reply never becomes 64 MiB of ciphertext in memory, and
 * the loop encrypts at most TLS_BUDGET before it lets other connections
 * run (the rest resumes from on_write). */
#define TLS_STEP (512u << 10)
#define TLS_BUDGET (8u << 20)

/* A reply frame waiting to be encrypted: buf, then the reference bulk
 * (a Read reply's tensor, encrypted straight from its storage). */
typedef struct sv_tls_out {
  struct sv_tls_out *next;
  uint8_t *buf;
  size_t len;
  dsp_tensor *bulk;
  size_t bulk_len;
  size_t done; /* plaintext bytes of buf, then bulk, already encrypted */
} sv_tls_out;

typedef struct sv_server sv_server;

typedef struct sv_conn {
  uv_tcp_t tcp; /* first: the handle pointer is the conn pointer */
  uv_timer_t idle;
  uv_timer_t hs;   /* handshake timeout: TLS handshake + hello */
  sv_tls *tls;     /* NULL: plain TCP */
  uint8_t *cbuf;   /* TLS: ciphertext read buffer */
  int tls_done;    /* TLS handshake finished */
  sv_tls_out *tq_head, *tq_tail; /* TLS: frames not yet encrypted */
  int over_limit;  /* TLS: refuse with ELIMIT once the handshake is done */
  sv_server *srv;
  sv_session *sess;
  sv_job *teardown; /* allocated up front so closing never fails */
  struct sv_conn *prev, *next;
  unsigned long long id;
  char peer[96];
  /* parser: keeps its place across partial reads */
  int state;
  uint8_t hdr[DSP_FRAME_HEADER_SIZE];
  size_t hdr_got;
  uint8_t *msg;
  uint32_t msg_len, msg_got;
  uint64_t bulk_len, bulk_got;
  uint8_t *bulk_dst; /* NULL: the bulk is read and discarded */
  sv_job *bulk_job;
  sv_job *wait_job;         /* ST_WAIT: the upload waiting for the FIFO */
  const uint8_t *pend;      /* ST_WAIT: unparsed bytes left in rbuf */
  size_t pend_n;
  int hello_done;
  /* lifecycle */
  int closing, close_after_flush, paused, handles_open, teardown_done;
  uint64_t outq_bytes; /* unsent reply bytes: queued writes + tq */
  int writes_pending;
  uint32_t inflight;
  unsigned long long n_requests;
  uint8_t rbuf[RBUF_SIZE];
} sv_conn;

struct sv_server {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_signal_t sigint, sigterm;
  const sv_config *cfg;
  sv_global g;
  sv_pool *pool;
  sv_tls_ctx *tls; /* NULL: plain TCP */
  dsp_ctx *io_ctx; /* loop-thread ctx for upload allocation */
  unsigned long long next_id;
  int n_conns;
  int shutting_down;
  sv_conn *conns;
};

typedef struct sv_write {
  uv_write_t req;
  uint8_t *buf;
  size_t len;        /* bytes of buf and bulk still to go */
  dsp_tensor *bulk;  /* a Read reply's tensor, sent from its storage */
} sv_write;

static void conn_close(sv_conn *c, const char *reason);
static void tls_send(sv_conn *c);

/* Nothing left to send: no write in flight, no frame waiting for TLS. */
static int out_idle(const sv_conn *c) {
  return c->writes_pending == 0 && c->tq_head == NULL;
}

/* Drops the frames still waiting for encryption (the connection closes
 * or its TLS session broke), with their bytes and tensor references. */
static void tls_out_clear(sv_conn *c) {
  while (c->tq_head) {
    sv_tls_out *t = c->tq_head;
    c->tq_head = t->next;
    c->outq_bytes -= t->len + t->bulk_len - t->done;
    dsp_free(t->buf);
    dsp_tensor_unref(t->bulk);
    dsp_free(t);
  }
  c->tq_tail = NULL;
}

/* ------------------------------------------------------------ writes */

static void on_write(uv_write_t *req, int status) {
  sv_write *w = (sv_write *)req;
  sv_conn *c = (sv_conn *)req->handle;
  c->outq_bytes -= w->len;
  c->writes_pending--;
  dsp_free(w->buf);
  dsp_tensor_unref(w->bulk);
  dsp_free(w);
  if (c->closing) return;
  if (status < 0) conn_close(c, uv_strerror(status));
  else if (c->tq_head) tls_send(c);
  else if (c->close_after_flush && c->writes_pending == 0)
    conn_close(c, "after its last reply");
}

/* Hands bytes that are ready for the socket to the kernel, taking buf
 * and the reference bulk (may be NULL: then bulk_len is 0), whose
 * storage follows buf on the wire without a copy. With nothing queued
 * before it the frame is first written at once (uv_try_write): a reply
 * that fits the socket buffer then costs one write and no write request,
 * completion callback or epoll change. queued: always through uv_write,
 * so on_write runs on a later loop turn (TLS resumes encrypting there). */
static void raw_write(sv_conn *c, uint8_t *buf, size_t len, dsp_tensor *bulk,
                      size_t bulk_len, int queued) {
  uv_buf_t b[2] = {uv_buf_init((char *)buf, (unsigned)len),
                   uv_buf_init(bulk ? (char *)dsp_tensor_data(bulk) : NULL,
                               (unsigned)bulk_len)};
  unsigned nb = bulk_len ? 2 : 1;
  if (c->writes_pending == 0 && !queued) {
    int n = uv_try_write((uv_stream_t *)&c->tcp, b, nb);
    if (n < 0 && n != UV_EAGAIN) {
      dsp_free(buf);
      dsp_tensor_unref(bulk);
      conn_close(c, uv_strerror(n));
      return;
    }
    size_t done = n > 0 ? (size_t)n : 0;
    for (unsigned i = 0; i < nb; i++) { /* skip what went out */
      size_t k = done < b[i].len ? done : b[i].len;
      b[i].base += k;
      b[i].len -= k;
      done -= k;
    }
    if (b[nb - 1].len == 0) {
      dsp_free(buf);
      dsp_tensor_unref(bulk);
      if (c->close_after_flush && out_idle(c))
        conn_close(c, "after its last reply");
      return;
    }
  }
  sv_write *w = dsp_malloc(sizeof *w);
  if (!w) {
    dsp_free(buf);
    dsp_tensor_unref(bulk);
    conn_close(c, "out of memory queueing a reply");
    return;
  }
  w->buf = buf;
  w->bulk = bulk;
  w->len = b[0].len + b[1].len;
  uv_buf_t *first = b[0].len ? &b[0] : &b[1];
  unsigned cnt = b[0].len && nb == 2 ? 2 : 1;
  int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, first, cnt, on_write);
  if (rc < 0) {
    dsp_free(w->buf);
    dsp_tensor_unref(w->bulk);
    dsp_free(w);
    conn_close(c, uv_strerror(rc));
    return;
  }
  c->outq_bytes += w->len;
  c->writes_pending++;
}

/* Sends what OpenSSL queued in the write BIO (handshake records, alerts,
 * encrypted frames); queued as for raw_write. */
static void tls_flush_q(sv_conn *c, int queued) {
  uint8_t *buf;
  size_t len;
  if (c->closing || !c->tls) return;
  if (sv_tls_take(c->tls, &buf, &len) < 0) {
    conn_close(c, "out of memory for TLS output");
    return;
  }
  if (buf) raw_write(c, buf, len, NULL, 0, queued);
}

static void tls_flush(sv_conn *c) { tls_flush_q(c, 0); }

/* Encrypts waiting frames TLS_STEP at a time while the socket takes each
 * step at once, and at most TLS_BUDGET per call; a step the socket does
 * not take at once (or the last of the budget) is left to uv_write, and
 * on_write calls again. Frames leave the queue in order, so an Error
 * frame queued behind a large reply follows it on the wire. */
static void tls_send(sv_conn *c) {
  size_t budget = TLS_BUDGET;
  while (!c->closing && c->tq_head && c->writes_pending == 0) {
    size_t step = 0;
    int rc = 0;
    while (c->tq_head && step < TLS_STEP) {
      sv_tls_out *t = c->tq_head;
      size_t total = t->len + t->bulk_len, k;
      const uint8_t *p;
      if (t->done < t->len) {
        p = t->buf + t->done;
        k = t->len - t->done;
      } else {
        p = (const uint8_t *)dsp_tensor_data(t->bulk) + (t->done - t->len);
        k = total - t->done;
      }
      if (k > TLS_STEP - step) k = TLS_STEP - step;
      rc = sv_tls_write(c->tls, p, k);
      if (rc < 0) break;
      t->done += k;
      step += k;
      c->outq_bytes -= k;
      if (t->done == total) {
        c->tq_head = t->next;
        if (!c->tq_head) c->tq_tail = NULL;
        dsp_free(t->buf);
        dsp_tensor_unref(t->bulk);
        dsp_free(t);
      }
    }
    if (rc < 0) {
      conn_close(c, "TLS write failed");
      return;
    }
    budget = budget > step ? budget - step : 0;
    tls_flush_q(c, budget == 0);
    if (budget == 0) return;
  }
}

/* Queues one frame, taking buf and the reference bulk (NULL, or a Read
 * reply's tensor whose bytes complete the frame). A client whose unsent
 * replies pass the output limit is dropped: it does not read what it
 * asked for. */
static void queue_write(sv_conn *c, uint8_t *buf, size_t len,
                        dsp_tensor *bulk) {
  size_t bulk_len = bulk ? dsp_tensor_nbytes(bulk) : 0;
  if (c->closing) {
    dsp_free(buf);
    dsp_tensor_unref(bulk);
    return;
  }
  if (c->tls && c->outq_bytes <= c->srv->cfg->max_output_queue) {
    /* a frame's bytes go out through the TLS session, encrypted straight
     * from the tensor's storage, a step at a time (tls_send) */
    sv_tls_out *t = dsp_malloc(sizeof *t);
    if (!t) {
      dsp_free(buf);
      dsp_tensor_unref(bulk);
      conn_close(c, "out of memory queueing a reply");
      return;
    }
    *t = (sv_tls_out){NULL, buf, len, bulk, bulk_len, 0};
    if (c->tq_tail) c->tq_tail->next = t;
    else c->tq_head = t;
    c->tq_tail = t;
    c->outq_bytes += len + bulk_len;
    tls_send(c);
    return;
  }
  if (c->outq_bytes > c->srv->cfg->max_output_queue) {
    dsp_free(buf);
    dsp_tensor_unref(bulk);
    atomic_fetch_add(&c->srv->g.limit_violations, 1);
    sv_log(SV_LOG_WARN,
           "conn %llu (%s): output queue holds %llu bytes, over %llu: "
           "dropping a client that does not read its replies",
           c->id, c->peer, (unsigned long long)c->outq_bytes,
           (unsigned long long)c->srv->cfg->max_output_queue);
    conn_close(c, "slow reader");
    return;
  }
  raw_write(c, buf, len, bulk, bulk_len, 0);
}

/* Sends an Error frame and closes the connection once it is written. */
static void refuse(sv_conn *c, uint64_t req_id, int code, const char *msg) {
  uint8_t *buf;
  size_t len;
  c->state = ST_DEAD;
  uv_read_stop((uv_stream_t *)&c->tcp);
  if (c->tls && !c->tls_done) { /* no TLS session to carry a frame yet */
    conn_close(c, msg);
    return;
  }
  if (sv_encode_error(req_id, code, msg, req_id, &buf, &len) < 0) {
    conn_close(c, "out of memory for an error frame");
    return;
  }
  c->close_after_flush = 1;
  queue_write(c, buf, len, NULL);
}

static void proto_error(sv_conn *c, uint64_t req_id, int code,
                        const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void proto_error(sv_conn *c, uint64_t req_id, int code,
                        const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  atomic_fetch_add(&c->srv->g.protocol_errors, 1);
  if (code == DISPATCH_ETOOLARGE) /* the frame limit */
    atomic_fetch_add(&c->srv->g.limit_violations, 1);
  sv_log(SV_LOG_WARN, "conn %llu (%s): protocol error: %s: %s", c->id,
         c->peer, dispatch_err_name(code), msg);
  refuse(c, req_id, code, msg);
}

/* ------------------------------------------------------------ lifecycle */

static void finish_shutdown(sv_server *srv) {
  if (!srv->pool) return;
  sv_pool_close(srv->pool);
  srv->pool = NULL;
}

static void maybe_free(sv_conn *c) {
  if (c->handles_open > 0 || !c->teardown_done) return;
  sv_server *srv = c->srv;
  if (c->prev) c->prev->next = c->next;
  else srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  dsp_free(c->sess);
  sv_tls_free(c->tls);
  dsp_free(c->cbuf);
  dsp_free(c->msg);
  sv_job_free(c->bulk_job);
  sv_job_free(c->wait_job);
  dsp_free(c);
  srv->n_conns--;
  atomic_fetch_sub(&srv->g.sessions, 1);
  if (srv->shutting_down && srv->n_conns == 0) finish_shutdown(srv);
}

static void on_handle_closed(uv_handle_t *h) {
  sv_conn *c = h->data;
  c->handles_open--;
  maybe_free(c);
}

/* Stops reading, cancels the session's queued requests and queues its
 * teardown behind any request a worker is running now. Idempotent. */
static void conn_close(sv_conn *c, const char *reason) {
  if (c->closing) return;
  c->closing = 1;
  c->state = ST_DEAD;
  sv_log(SV_LOG_INFO, "conn %llu (%s) closed (%s) after %llu requests", c->id,
         c->peer, reason, c->n_requests);
  uv_read_stop((uv_stream_t *)&c->tcp);
  tls_out_clear(c);
  uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
  uv_close((uv_handle_t *)&c->idle, on_handle_closed);
  uv_close((uv_handle_t *)&c->hs, on_handle_closed);
  sv_session_cancel(c->sess); /* stops a running op at its next block */
  sv_job *list = sv_pool_cancel(c->srv->pool, c->sess);
  while (list) {
    sv_job *next = list->next;
    c->inflight--;
    sv_job_free(list);
    list = next;
  }
  sv_job *t = c->teardown;
  c->teardown = NULL;
  sv_pool_submit(c->srv->pool, t);
}

/* An idle session is a limit violation: it gets an Error frame saying
 * why (a client sees it at its next wait) and is closed. */
static void on_idle(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->inflight > 0 || !out_idle(c)) return; /* still working */
  if (c->closing || c->close_after_flush) return;
  char msg[128];
  snprintf(msg, sizeof msg,
           "session idle for %d s (server limit --idle-timeout): closed",
           c->srv->cfg->idle_timeout_s);
  atomic_fetch_add(&c->srv->g.limit_violations, 1);
  sv_log(SV_LOG_INFO, "conn %llu (%s): %s", c->id, c->peer, msg);
  refuse(c, 0, DISPATCH_ELIMIT, msg);
}

/* The TLS handshake and the hello did not finish in time: a client that
 * connects and says nothing holds a session slot, so it is closed. */
static void on_handshake_timeout(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->closing || c->close_after_flush || c->hello_done) return;
  char msg[160];
  snprintf(msg, sizeof msg,
           "no %shello within %d s (server limit --handshake-timeout)",
           c->tls && !c->tls_done ? "TLS handshake and " : "",
           c->srv->cfg->handshake_timeout_s);
  atomic_fetch_add(&c->srv->g.limit_violations, 1);
  sv_log(SV_LOG_WARN, "conn %llu (%s): %s", c->id, c->peer, msg);
  refuse(c, 0, DISPATCH_ELIMIT, msg);
}

static void touch(sv_conn *c) {
  int s = c->srv->cfg->idle_timeout_s;
  if (s > 0 && !c->closing)
    uv_timer_start(&c->idle, on_idle, (uint64_t)s * 1000, (uint64_t)s * 1000);
}

/* ------------------------------------------------------------ requests */

static void submit(sv_conn *c, sv_job *j) {
  j->sess = c->sess;
  c->inflight++;
  sv_pool_submit(c->srv->pool, j);
  if (c->inflight >= c->srv->cfg->max_queued && !c->paused) {
    c->paused = 1; /* input backpressure until the workers catch up */
    uv_read_stop((uv_stream_t *)&c->tcp);
  }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf);
static void prepare_upload(sv_conn *c, sv_job *j, int final);
static void finish_bulk(sv_conn *c);
static void handle_msg(sv_conn *c);
static void parse(sv_conn *c, const uint8_t *p, size_t n);
static void tls_pump(sv_conn *c);

/* Starts reading the socket again; a TLS session first decrypts what it
 * already holds, which no socket event would announce. */
static void read_again(sv_conn *c) {
  if (c->tls) tls_pump(c);
  if (!c->closing && !c->paused && c->state != ST_WAIT &&
      c->state != ST_DEAD)
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* Once the FIFO is empty, judges the waiting upload for good and parses
 * what was left in rbuf before reading again. */
static void resume_wait(sv_conn *c) {
  sv_job *j = c->wait_job;
  c->wait_job = NULL;
  if (j) {
    prepare_upload(c, j, 1);
    if (c->bulk_len == 0) finish_bulk(c);
  } else { /* a message that did not fit the budget: decode it again */
    handle_msg(c);
  }
  const uint8_t *p = c->pend;
  size_t n = c->pend_n;
  c->pend = NULL;
  c->pend_n = 0;
  parse(c, p, n);
  if (!c->closing && !c->paused && c->state != ST_WAIT &&
      c->state != ST_DEAD)
    read_again(c);
}

static void on_done(sv_job *j, void *ud) {
  (void)ud;
  sv_conn *c = j->sess->owner;
  if (j->kind == SV_JOB_TEARDOWN) {
    c->teardown_done = 1;
    sv_job_free(j);
    maybe_free(c);
    return;
  }
  c->inflight--;
  if (c->closing) {
    sv_job_free(j);
    return;
  }
  Dispatch__Request__BodyCase bc = j->req->body_case;
  int wants_reply = bc == DISPATCH__REQUEST__BODY_READ ||
                    bc == DISPATCH__REQUEST__BODY_BACKWARD ||
                    bc == DISPATCH__REQUEST__BODY_SYNC ||
                    bc == DISPATCH__REQUEST__BODY_STATS;
  if (j->out) {
    if (SV_LOG_ON(SV_LOG_DEBUG)) {
      uint32_t mlen = (uint32_t)j->out[0] | (uint32_t)j->out[1] << 8 |
                      (uint32_t)j->out[2] << 16 | (uint32_t)j->out[3] << 24;
      Dispatch__Reply *r = dispatch__reply__unpack(&sv_pb_allocator, mlen,
                                  j->out + DSP_FRAME_HEADER_SIZE);
      if (r) {
        const char *kind = r->error ? "error"
                           : r->body_case == DISPATCH__REPLY__BODY_READ
                               ? "read"
                           : r->body_case == DISPATCH__REPLY__BODY_STATS
                               ? "stats"
                               : "ok";
        sv_log(SV_LOG_DEBUG, "conn %llu <- reply req %llu: %s%s%s (%zu bytes)",
               c->id, (unsigned long long)r->req_id, kind,
               r->error ? ": " : "", r->error ? r->error->message : "",
               j->out_len);
        dispatch__reply__free_unpacked(r, &sv_pb_allocator);
      }
    }
    uint8_t *out = j->out;
    dsp_tensor *bulk = j->out_bulk;
    j->out = NULL;
    j->out_bulk = NULL;
    queue_write(c, out, j->out_len, bulk);
  } else if (wants_reply) {
    conn_close(c, "out of memory for a reply");
  }
  if (j->is_bye && !c->closing) {
    c->close_after_flush = 1;
    if (out_idle(c)) conn_close(c, "bye");
  }
  sv_job_free(j);
  if (c->closing) return;
  if (c->paused && c->inflight < c->srv->cfg->max_queued / 2 + 1) {
    c->paused = 0;
    if (c->state != ST_DEAD && c->state != ST_WAIT) read_again(c);
  }
  if (c->state == ST_WAIT && c->inflight == 0) resume_wait(c);
}

/* Compares the hello's token with the configured one in time that does
 * not depend on where they differ: a token of another length is compared
 * against the expected token itself, and the results are combined
 * without branching on content. */
static int token_matches(const sv_config *cfg, const char *tok) {
  size_t n = tok ? strlen(tok) : 0;
  int same_len = n == cfg->token_len;
  const char *cmp = same_len ? tok : cfg->token;
  int diff = CRYPTO_memcmp(cmp, cfg->token, cfg->token_len);
  return same_len & (diff == 0);
}

static void handle_hello(sv_conn *c, Dispatch__Request *req) {
  Dispatch__Hello *h = req->hello;
  const sv_config *cfg = c->srv->cfg;
  if (h->major != DSP_PROTO_MAJOR) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "protocol version mismatch: client speaks %u.%u, server speaks "
             "%d.%d",
             h->major, h->minor, DSP_PROTO_MAJOR, DSP_PROTO_MINOR);
    sv_log(SV_LOG_WARN, "conn %llu (%s): refused: %s", c->id, c->peer, msg);
    refuse(c, req->req_id, DISPATCH_EVERSION, msg);
    return;
  }
  if (cfg->token && !token_matches(cfg, h->token)) {
    int none = !h->token || !*h->token;
    atomic_fetch_add(&c->srv->g.protocol_errors, 1);
    sv_log(SV_LOG_WARN,
           "conn %llu (%s): refused: %s token from client '%s'", c->id,
           c->peer, none ? "no" : "wrong",
           h->client_name ? h->client_name : "");
    refuse(c, req->req_id, DISPATCH_EAUTH,
           none ? "authentication failed: this server requires a token "
                  "(none was sent)"
                : "authentication failed: wrong token");
    return;
  }
  const dsp_backend *be = dsp_cpu_backend();
  char *dtypes[DSP_NDTYPES];
  for (int i = 0; i < DSP_NDTYPES; i++)
    dtypes[i] = (char *)dsp_dtype_name((dsp_dtype)i);
  Dispatch__Reply r = DISPATCH__REPLY__INIT;
  Dispatch__HelloReply hr = DISPATCH__HELLO_REPLY__INIT;
  hr.major = DSP_PROTO_MAJOR;
  hr.minor = DSP_PROTO_MINOR;
  hr.server_version = DISPATCH_VERSION_STRING;
  hr.backend = (char *)be->name;
  hr.device = (char *)be->device;
  hr.n_dtypes = DSP_NDTYPES;
  hr.dtypes = dtypes;
  hr.max_frame = cfg->max_frame;
  hr.max_session_bytes = cfg->max_session_bytes;
  hr.max_rank = DSP_MAX_DIMS;
  hr.max_elements = cfg->max_elements;
  hr.max_queued = cfg->max_queued;
  r.req_id = req->req_id;
  r.body_case = DISPATCH__REPLY__BODY_HELLO;
  r.hello = &hr;
  uint8_t *buf;
  size_t len;
  if (sv_encode_reply(&r, NULL, 0, &buf, &len) < 0) {
    conn_close(c, "out of memory for the hello reply");
    return;
  }
  c->hello_done = 1;
  uv_timer_stop(&c->hs);
  sv_log(SV_LOG_INFO, "conn %llu (%s): hello from '%s', protocol %u.%u",
         c->id, c->peer, h->client_name ? h->client_name : "", h->major,
         h->minor);
  queue_write(c, buf, len, NULL);
}

/* Checks an Upload against every limit before allocating, then allocates
 * the tensor so the bulk lands straight in its storage. A failure keeps
 * the stream in sync by discarding the bulk and defers the error. */
static void prepare_upload(sv_conn *c, sv_job *j, int final) {
  if (sv_upload_prepare(c->srv->cfg, c->srv->io_ctx, c->sess, j, c->bulk_len,
                        !final && c->inflight > 0)) {
    /* earlier requests may free memory: judge once they have run */
    c->wait_job = j;
    c->state = ST_WAIT;
    uv_read_stop((uv_stream_t *)&c->tcp);
    return;
  }
  c->bulk_job = j;
  c->bulk_got = 0;
  c->bulk_dst = j->upload ? dsp_tensor_data(j->upload) : NULL;
  c->state = ST_BULK;
}

static void finish_bulk(sv_conn *c) {
  sv_job *j = c->bulk_job;
  c->bulk_job = NULL;
  c->bulk_dst = NULL;
  c->state = ST_HEADER;
  c->hdr_got = 0;
  if (j) submit(c, j); /* NULL: the bulk of a request already refused */
}

/* A message whose decoded form does not fit the session's budget: while
 * earlier requests are queued it waits for them (reading stops, as for an
 * upload in ST_WAIT), since they may free memory; with nothing queued it
 * fails like any request, with the error deferred or answered. */
static void over_budget(sv_conn *c, uint64_t rid, int body, const char *why) {
  if (c->inflight > 0) {
    c->wait_job = NULL;
    c->state = ST_WAIT;
    uv_read_stop((uv_stream_t *)&c->tcp);
    return;
  }
  dsp_free(c->msg);
  c->msg = NULL;
  uint8_t *out;
  size_t len;
  sv_session_defer(c->sess, rid, body, DISPATCH_EQUOTA, why, &out, &len);
  if (out) queue_write(c, out, len, NULL);
  else if (body == DISPATCH__REQUEST__BODY_READ ||
           body == DISPATCH__REQUEST__BODY_BACKWARD ||
           body == DISPATCH__REQUEST__BODY_SYNC ||
           body == DISPATCH__REQUEST__BODY_STATS) {
    conn_close(c, "out of memory for a reply");
    return;
  }
  c->bulk_job = NULL;
  c->bulk_dst = NULL;
  c->bulk_got = 0;
  c->state = ST_BULK;
  if (c->bulk_len == 0) finish_bulk(c);
}

/* A waiting request that only reads session state (Sync, Stats, a Read:
 * its reply references the tensor's storage, nothing is copied) is answered on the loop thread when the session has nothing
 * queued or running: no worker can touch the session until the loop
 * submits again, and the pool mutex taken in the check orders the last
 * worker's writes (tensor table, first deferred error) before these
 * reads. The reply is the one a worker would produce. */
static int answers_on_loop(sv_conn *c, const Dispatch__Request *req) {
  Dispatch__Request__BodyCase bc = req->body_case;
  if (bc != DISPATCH__REQUEST__BODY_SYNC &&
      bc != DISPATCH__REQUEST__BODY_STATS &&
      bc != DISPATCH__REQUEST__BODY_READ)
    return 0;
  if (c->inflight > 0 || !sv_pool_session_idle(c->srv->pool, c->sess))
    return 0;
  return 1;
}

/* Decodes one complete message; anything structurally wrong is a
 * protocol error that closes this connection only. */
static void handle_msg(sv_conn *c) {
  Dispatch__Request *req;
  uint64_t rid;
  int body;
  char why[384];
  int drc = sv_decode_request_charged(c->sess, c->msg, c->msg_len,
                                      c->bulk_len, c->hello_done, &req, &rid,
                                      &body, why, sizeof why);
  if (drc == DISPATCH_EQUOTA && c->hello_done) {
    over_budget(c, rid, body, why);
    return;
  }
  dsp_free(c->msg);
  c->msg = NULL;
  if (drc < 0) {
    proto_error(c, rid, drc, "%s", why);
    return;
  }
  c->n_requests++;
  if (SV_LOG_ON(SV_LOG_DEBUG)) {
    char desc[256];
    sv_describe(req, desc, sizeof desc);
    sv_log(SV_LOG_DEBUG, "conn %llu -> req %llu: %s%s", c->id,
           (unsigned long long)rid, desc,
           c->bulk_len ? " (+bulk)" : "");
  }
  if (req->body_case == DISPATCH__REQUEST__BODY_HELLO) {
    handle_hello(c, req);
    dispatch__request__free_unpacked(req, &sv_pb_allocator);
    c->state = c->state == ST_DEAD ? ST_DEAD : ST_HEADER;
    c->hdr_got = 0;
    return;
  }
  sv_job *j = dsp_calloc(1, sizeof *j);
  if (!j) {
    dispatch__request__free_unpacked(req, &sv_pb_allocator);
    conn_close(c, "out of memory for a request");
    return;
  }
  j->req = req;
  j->bulk_by_ref = 1;
  if (req->body_case == DISPATCH__REQUEST__BODY_UPLOAD) {
    prepare_upload(c, j, 0);
    if (c->state == ST_BULK && c->bulk_len == 0) finish_bulk(c);
    return;
  }
  c->state = ST_HEADER;
  c->hdr_got = 0;
  if (req->body_case == DISPATCH__REQUEST__BODY_BYE) {
    c->state = ST_DEAD; /* nothing after a bye is read */
    uv_read_stop((uv_stream_t *)&c->tcp);
  }
  if (answers_on_loop(c, req)) {
    /* the same steps a worker and on_done take, minus two thread hops */
    j->sess = c->sess;
    c->inflight++;
    sv_session_exec(c->sess, j);
    on_done(j, NULL);
    return;
  }
  submit(c, j);
}

static void parse(sv_conn *c, const uint8_t *p, size_t n) {
  const sv_config *cfg = c->srv->cfg;
  while (n > 0 && !c->closing) {
    if (c->state == ST_HEADER) {
      size_t take = DSP_FRAME_HEADER_SIZE - c->hdr_got;
      if (take > n) take = n;
      memcpy(c->hdr + c->hdr_got, p, take);
      c->hdr_got += take;
      p += take;
      n -= take;
      if (c->hdr_got < DSP_FRAME_HEADER_SIZE) return;
      dsp_frame_header h;
      char why[256];
      int rc = sv_decode_header(cfg, c->hdr, &h, why, sizeof why);
      if (rc < 0) {
        proto_error(c, 0, rc, "%s", why);
        return;
      }
      c->msg = dsp_malloc(h.msg_len);
      if (!c->msg) {
        conn_close(c, "out of memory for a message");
        return;
      }
      c->msg_len = h.msg_len;
      c->msg_got = 0;
      c->bulk_len = h.bulk_len;
      c->state = ST_MSG;
    } else if (c->state == ST_MSG) {
      size_t take = c->msg_len - c->msg_got;
      if (take > n) take = n;
      memcpy(c->msg + c->msg_got, p, take);
      c->msg_got += (uint32_t)take;
      p += take;
      n -= take;
      if (c->msg_got == c->msg_len) handle_msg(c);
      if (c->state == ST_WAIT) {
        c->pend = p;
        c->pend_n = n;
        return;
      }
    } else if (c->state == ST_BULK) {
      uint64_t rem = c->bulk_len - c->bulk_got;
      size_t take = rem < n ? (size_t)rem : n;
      if (c->bulk_dst) memcpy(c->bulk_dst + c->bulk_got, p, take);
      c->bulk_got += take;
      p += take;
      n -= take;
      if (c->bulk_got == c->bulk_len) finish_bulk(c);
    } else {
      return; /* ST_DEAD: the rest is ignored */
    }
  }
}

/* Points libuv straight into tensor storage while an upload's bulk is
 * being read, so tensor bytes are never copied through a buffer. */
static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  (void)hint;
  sv_conn *c = h->data;
  if (c->tls) { /* ciphertext: OpenSSL copies it into its read BIO */
    *buf = uv_buf_init((char *)c->cbuf, RBUF_SIZE);
  } else if (c->state == ST_BULK && c->bulk_dst && c->bulk_got < c->bulk_len) {
    uint64_t rem = c->bulk_len - c->bulk_got;
    if (rem > (1u << 30)) rem = 1u << 30;
    *buf = uv_buf_init((char *)c->bulk_dst + c->bulk_got, (unsigned)rem);
  } else {
    *buf = uv_buf_init((char *)c->rbuf, RBUF_SIZE);
  }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  sv_conn *c = s->data;
  if (c->closing) return;
  if (nread < 0) {
    conn_close(c, nread == UV_EOF ? "peer closed" : uv_strerror((int)nread));
    return;
  }
  if (nread == 0) return;
  touch(c);
  if (c->tls) {
    if (sv_tls_feed(c->tls, buf->base, (size_t)nread) < 0) {
      conn_close(c, "out of memory for TLS input");
      return;
    }
    tls_pump(c);
    return;
  }
  if ((uint8_t *)buf->base != c->rbuf) {
    c->bulk_got += (uint64_t)nread;
    if (c->bulk_got == c->bulk_len) finish_bulk(c);
    return;
  }
  parse(c, c->rbuf, (size_t)nread);
}

/* A failed TLS handshake (a plain TCP client, an unknown certificate, no
 * client certificate under mutual TLS): the alert OpenSSL queued is sent,
 * then the connection closes. Counted as a protocol error. */
static void tls_failed(sv_conn *c, const char *why) {
  atomic_fetch_add(&c->srv->g.protocol_errors, 1);
  sv_log(SV_LOG_WARN, "conn %llu (%s): TLS %s failed: %s", c->id, c->peer,
         c->tls_done ? "read" : "handshake", why);
  tls_out_clear(c); /* the session cannot encrypt them any more */
  tls_flush(c);
  if (c->closing) return;
  c->state = ST_DEAD;
  uv_read_stop((uv_stream_t *)&c->tcp);
  if (c->writes_pending == 0) conn_close(c, "TLS failure");
  else c->close_after_flush = 1;
}

/* Advances the handshake, then decrypts buffered records into the parser
 * for as long as it takes input (not while throttled or waiting on an
 * upload's quota: the bytes stay inside the TLS session until
 * read_again). An upload's bulk is decrypted straight into the tensor. */
static void tls_pump(sv_conn *c) {
  char why[384];
  if (c->closing) return;
  if (!c->tls_done) {
    int rc = sv_tls_handshake(c->tls, why, sizeof why);
    if (rc < 0) {
      tls_failed(c, why);
      return;
    }
    tls_flush(c);
    if (rc == 0 || c->closing) return;
    c->tls_done = 1;
    if (SV_LOG_ON(SV_LOG_INFO)) {
      char peer[256];
      sv_tls_peer_name(c->tls, peer, sizeof peer);
      sv_log(SV_LOG_INFO, "conn %llu (%s): TLS handshake done%s%s", c->id,
             c->peer, *peer ? ", client certificate " : "", peer);
    }
    if (c->over_limit) {
      char msg[128];
      snprintf(msg, sizeof msg, "server already serves %d sessions (limit)",
               c->srv->cfg->max_sessions);
      refuse(c, 0, DISPATCH_ELIMIT, msg);
      return;
    }
  }
  while (!c->closing && !c->paused && c->state != ST_WAIT &&
         c->state != ST_DEAD) {
    long n;
    if (c->state == ST_BULK && c->bulk_dst && c->bulk_got < c->bulk_len) {
      uint64_t rem = c->bulk_len - c->bulk_got;
      if (rem > (1u << 30)) rem = 1u << 30;
      n = sv_tls_read(c->tls, c->bulk_dst + c->bulk_got, (size_t)rem, why,
                      sizeof why);
      if (n > 0) {
        c->bulk_got += (uint64_t)n;
        if (c->bulk_got == c->bulk_len) finish_bulk(c);
        continue;
      }
    } else {
      n = sv_tls_read(c->tls, c->rbuf, RBUF_SIZE, why, sizeof why);
      if (n > 0) {
        parse(c, c->rbuf, (size_t)n);
        continue;
      }
    }
    if (n == 0) break;
    if (n == -1) {
      conn_close(c, "peer closed the TLS session");
      return;
    }
    tls_failed(c, why);
    return;
  }
  tls_flush(c); /* reading may answer (key updates) */
}

/* ------------------------------------------------------------ accept */

static void free_handle(uv_handle_t *h) { dsp_free(h); }

static void on_connection(uv_stream_t *l, int status) {
  sv_server *srv = l->data;
  if (status < 0) {
    sv_log(SV_LOG_WARN, "accept failed: %s", uv_strerror(status));
    return;
  }
  sv_conn *c = dsp_calloc(1, sizeof *c);
  sv_job *td = dsp_calloc(1, sizeof *td);
  sv_session *sess = c ? sv_session_new(srv->cfg, &srv->g, c) : NULL;
  if (!c || !td || !sess) {
    /* accept and drop, so the kernel's backlog does not fill up */
    uv_tcp_t *tmp = dsp_malloc(sizeof *tmp);
    if (sess) {
      sv_session_teardown(sess);
      dsp_free(sess);
    }
    dsp_free(td);
    dsp_free(c);
    sv_log(SV_LOG_ERROR, "out of memory accepting a connection");
    if (tmp && uv_tcp_init(&srv->loop, tmp) == 0) {
      if (uv_accept(l, (uv_stream_t *)tmp) != 0) {}
      uv_close((uv_handle_t *)tmp, free_handle);
    } else {
      dsp_free(tmp);
    }
    return;
  }
  c->srv = srv;
  c->sess = sess;
  td->kind = SV_JOB_TEARDOWN;
  td->sess = sess;
  c->teardown = td;
  c->id = ++srv->next_id;
  snprintf(c->peer, sizeof c->peer, "?");
  uv_tcp_init(&srv->loop, &c->tcp);
  uv_timer_init(&srv->loop, &c->idle);
  uv_timer_init(&srv->loop, &c->hs);
  c->tcp.data = c;
  c->idle.data = c;
  c->hs.data = c;
  c->handles_open = 3;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->n_conns++;
  atomic_fetch_add(&srv->g.sessions, 1);
  if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0) {
    conn_close(c, "accept failed");
    return;
  }
  struct sockaddr_storage ss;
  int len = sizeof ss;
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0 &&
      ss.ss_family == AF_INET) {
    char ip[32];
    const struct sockaddr_in *sin = (const struct sockaddr_in *)&ss;
    uv_ip4_name(sin, ip, sizeof ip);
    snprintf(c->peer, sizeof c->peer, "%s:%d", ip, ntohs(sin->sin_port));
  } else if (ss.ss_family == AF_INET6) {
    char ip[64];
    const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)&ss;
    uv_ip6_name(s6, ip, sizeof ip);
    snprintf(c->peer, sizeof c->peer, "[%s]:%d", ip, ntohs(s6->sin6_port));
  }
  uv_tcp_nodelay(&c->tcp, 1);
  sv_log(SV_LOG_INFO, "conn %llu (%s) opened", c->id, c->peer);
  if (srv->shutting_down) {
    conn_close(c, "server shutting down");
    return;
  }
  if (srv->tls) {
    c->tls = sv_tls_new(srv->tls);
    c->cbuf = c->tls ? dsp_malloc(RBUF_SIZE) : NULL;
    if (!c->cbuf) {
      conn_close(c, "out of memory for a TLS session");
      return;
    }
  }
  if (srv->cfg->handshake_timeout_s > 0)
    uv_timer_start(&c->hs, on_handshake_timeout,
                   (uint64_t)srv->cfg->handshake_timeout_s * 1000, 0);
  if (srv->n_conns > srv->cfg->max_sessions && srv->tls) {
    /* the refusal can only travel inside the TLS session */
    atomic_fetch_add(&srv->g.limit_violations, 1);
    sv_log(SV_LOG_WARN, "conn %llu (%s): refused: server already serves %d "
           "sessions (limit)", c->id, c->peer, srv->n_conns - 1);
    c->over_limit = 1;
  } else if (srv->n_conns > srv->cfg->max_sessions) {
    char msg[128];
    atomic_fetch_add(&srv->g.limit_violations, 1);
    snprintf(msg, sizeof msg, "server already serves %d sessions (limit)",
             srv->n_conns - 1);
    sv_log(SV_LOG_WARN, "conn %llu (%s): refused: %s", c->id, c->peer, msg);
    refuse(c, 0, DISPATCH_ELIMIT, msg);
    return;
  }
  touch(c);
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* ------------------------------------------------------------ run */

static void on_signal(uv_signal_t *sig, int signum) {
  sv_server *srv = sig->data;
  if (srv->shutting_down) return;
  srv->shutting_down = 1;
  sv_log(SV_LOG_INFO, "signal %d: shutting down (%d connections)", signum,
         srv->n_conns);
  uv_close((uv_handle_t *)&srv->listener, NULL);
  uv_close((uv_handle_t *)&srv->sigint, NULL);
  uv_close((uv_handle_t *)&srv->sigterm, NULL);
  for (sv_conn *c = srv->conns; c; c = c->next) conn_close(c, "shutdown");
  if (srv->n_conns == 0) finish_shutdown(srv);
}

int sv_run(const sv_config *cfg) {
  sv_server *srv = dsp_calloc(1, sizeof *srv);
  if (!srv) return DISPATCH_ENOMEM;
  srv->cfg = cfg;
  sv_log_level = cfg->log_level;
  int rc = uv_loop_init(&srv->loop);
  if (rc < 0) {
    dsp_free(srv);
    return DISPATCH_EIO;
  }
  srv->io_ctx = dsp_ctx_new();
  srv->g.mem = dsp_budget_new(cfg->max_memory, NULL, "server",
                              "--max-memory");
  srv->pool = srv->io_ctx && srv->g.mem
                  ? sv_pool_new(&srv->loop, cfg->threads, on_done, srv)
                  : NULL;
  int err = 0;
  struct sockaddr_storage addr;
  if (cfg->tls_cert) {
    srv->tls = sv_tls_ctx_new(cfg);
    if (!srv->tls) err = DISPATCH_ETLS;
  }
  if (err < 0) {
    /* the reason is on stderr already */
  } else if (!srv->pool) {
    sv_log(SV_LOG_ERROR, "cannot start %d worker threads", cfg->threads);
    err = DISPATCH_ENOMEM;
  } else if (uv_ip4_addr(cfg->host, cfg->port, (struct sockaddr_in *)&addr) !=
                 0 &&
             uv_ip6_addr(cfg->host, cfg->port,
                         (struct sockaddr_in6 *)&addr) != 0) {
    sv_log(SV_LOG_ERROR, "bad listen address '%s'", cfg->host);
    err = DISPATCH_EINVAL;
  } else {
    uv_tcp_init(&srv->loop, &srv->listener);
    srv->listener.data = srv;
    rc = uv_tcp_bind(&srv->listener, (struct sockaddr *)&addr, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&srv->listener, 128,
                                on_connection);
    if (rc < 0) {
      sv_log(SV_LOG_ERROR, "cannot listen on %s:%d: %s", cfg->host,
             cfg->port, uv_strerror(rc));
      uv_close((uv_handle_t *)&srv->listener, NULL);
      err = DISPATCH_EIO;
    }
  }
  if (err < 0) {
    if (srv->pool) sv_pool_close(srv->pool);
    uv_run(&srv->loop, UV_RUN_DEFAULT);
    uv_loop_close(&srv->loop);
    dsp_ctx_free(srv->io_ctx);
    dsp_budget_unref(srv->g.mem);
    sv_tls_ctx_free(srv->tls);
    dsp_free(srv);
    return err;
  }
  struct sockaddr_storage bound;
  int blen = sizeof bound;
  uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&bound, &blen);
  char ip[64] = "?";
  int port = 0;
  if (bound.ss_family == AF_INET) {
    uv_ip4_name((struct sockaddr_in *)&bound, ip, sizeof ip);
    port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
  } else {
    uv_ip6_name((struct sockaddr_in6 *)&bound, ip, sizeof ip);
    port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
  }
  /* the handlers are in place before the port is announced: a signal
   * sent as soon as the port is known shuts down cleanly */
  uv_signal_init(&srv->loop, &srv->sigint);
  uv_signal_init(&srv->loop, &srv->sigterm);
  srv->sigint.data = srv->sigterm.data = srv;
  uv_signal_start(&srv->sigint, on_signal, SIGINT);
  uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
  printf("dispatch-server listening on %s:%d\n", ip, port);
  fflush(stdout);
  sv_log(SV_LOG_INFO, "listening on %s:%d with %d worker threads%s%s%s", ip,
         port, cfg->threads,
         srv->tls ? ", TLS" : ", plain TCP (no TLS)",
         cfg->tls_client_ca ? " with client certificates" : "",
         cfg->token ? ", token required" : "");

  uv_run(&srv->loop, UV_RUN_DEFAULT);

  rc = uv_loop_close(&srv->loop);
  if (rc != 0) sv_log(SV_LOG_ERROR, "loop closed with live handles");
  dsp_ctx_free(srv->io_ctx);
  dsp_budget_unref(srv->g.mem);
  sv_tls_ctx_free(srv->tls);
  dsp_free(srv);
  sv_log(SV_LOG_INFO, "shut down cleanly (storage cache held %zu bytes)",
         dsp_cpu_cache_bytes());
  return 0;
}
