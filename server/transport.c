/* Plain TCP and TLS behind one table (sv_transport, conn.h). The rest of
 * the server reads plaintext through the reader and queues frames with
 * the writer; only this file knows whether bytes are encrypted. */
#include <string.h>

#include "conn.h"

/* ------------------------------------------------------------ plain TCP */

static int tcp_open(sv_conn *c) {
  (void)c;
  return 0;
}
static void tcp_free(sv_conn *c) { (void)c; }
static void tcp_resume(sv_conn *c) { (void)c; }
static int tcp_ready(const sv_conn *c) {
  (void)c;
  return 1;
}

/* Points libuv straight into tensor storage while an upload's bulk is
 * being read, so tensor bytes are never copied through a buffer. */
static void tcp_alloc(sv_conn *c, uv_buf_t *buf) {
  size_t room;
  uint8_t *dst = sv_reader_bulk_dst(c, &room);
  if (dst) *buf = uv_buf_init((char *)dst, (unsigned)room);
  else *buf = uv_buf_init((char *)c->rbuf, RBUF_SIZE);
}

static void tcp_on_bytes(sv_conn *c, const uv_buf_t *buf, size_t n) {
  if ((uint8_t *)buf->base != c->rbuf) sv_reader_bulk_got(c, n);
  else sv_reader_parse(c, c->rbuf, n);
}

/* Hands queued frames to the socket straight from their buffers and the
 * Read tensors' storage, several small frames in one write, a bulk in
 * pieces of at most SV_WRITE_PIECE; try_write first, so a reply that
 * fits the socket buffer costs one write and no write request. */
static void tcp_send(sv_conn *c) {
  enum { MAXB = 16 };
  while (!c->closing && c->oq_head && !c->writes_pending) {
    uv_buf_t b[MAXB];
    unsigned nb = 0;
    size_t total = 0;
    for (sv_out *o = c->oq_head; o && nb < MAXB && total < SV_WRITE_PIECE;
         o = o->next) {
      size_t off = o == c->oq_head ? o->done : 0;
      if (off < o->len) {
        size_t k = o->len - off;
        if (k > SV_WRITE_PIECE - total) k = SV_WRITE_PIECE - total;
        b[nb++] = uv_buf_init((char *)o->buf + off, (unsigned)k);
        total += k;
        off += k;
      }
      if (nb < MAXB && total < SV_WRITE_PIECE && off < o->len + o->bulk_len) {
        size_t k = o->len + o->bulk_len - off;
        if (k > SV_WRITE_PIECE - total) k = SV_WRITE_PIECE - total;
        /* a GPU's read lands part by part: send what has (the wait is
         * for one part's DMA at most, the Read itself waited for the
         * first), and nothing of a later frame before the rest of it */
        size_t avail = dsp_pin_avail(o->bulk, off - o->len, k);
        b[nb++] = uv_buf_init((char *)dsp_pin_data(o->bulk) +
                                  (off - o->len),
                              (unsigned)avail);
        total += avail;
        if (avail < k) break;
      }
    }
    long n = sv_writer_sock(c, b, nb, NULL, 0);
    if (n < 0) return;
    sv_writer_consume(c, (size_t)n);
  }
}

const sv_transport sv_transport_tcp = {
    "tcp",      tcp_open, tcp_free,  tcp_alloc, tcp_on_bytes,
    tcp_resume, tcp_send, tcp_ready,
};

/* ------------------------------------------------------------ TLS */

/* TLS replies are encrypted a step at a time as the socket takes them:
 * a 64 MiB Read reply never becomes 64 MiB of ciphertext in memory, and
 * the loop encrypts at most TLS_BUDGET before it lets other connections
 * run (the rest resumes from on_write). */
#define TLS_STEP (512u << 10)
#define TLS_BUDGET (8u << 20)

typedef struct tls_conn {
  sv_tls *tls;
  uint8_t *cbuf; /* ciphertext read buffer */
  int done;      /* handshake finished */
} tls_conn;

static int tls_open(sv_conn *c) {
  tls_conn *t = dsp_calloc(1, sizeof *t);
  if (!t) return DISPATCH_ENOMEM;
  c->tpd = t;
  t->tls = sv_tls_new(c->srv->tls);
  t->cbuf = t->tls ? dsp_malloc(RBUF_SIZE) : NULL;
  return t->cbuf ? 0 : DISPATCH_ENOMEM;
}

static void tls_free(sv_conn *c) {
  tls_conn *t = c->tpd;
  if (!t) return;
  sv_tls_free(t->tls);
  dsp_free(t->cbuf);
  dsp_free(t);
  c->tpd = NULL;
}

static int tls_ready(const sv_conn *c) {
  const tls_conn *t = c->tpd;
  return t && t->done;
}

/* Ciphertext lands in cbuf; OpenSSL copies it into its read BIO. */
static void tls_alloc(sv_conn *c, uv_buf_t *buf) {
  tls_conn *t = c->tpd;
  *buf = uv_buf_init((char *)t->cbuf, RBUF_SIZE);
}

/* Sends what OpenSSL queued in the write BIO (handshake records, alerts,
 * encrypted frames); queued: through uv_write even when the socket would
 * take it now, so on_write runs on a later loop turn. */
static void tls_flush_q(sv_conn *c, int queued) {
  tls_conn *t = c->tpd;
  uint8_t *buf;
  size_t len;
  if (c->closing) return;
  if (sv_tls_take(t->tls, &buf, &len) < 0) {
    sv_conn_close(c, "out of memory for TLS output");
    return;
  }
  if (buf) sv_writer_raw(c, buf, len, queued);
}

/* Encrypts queued frames TLS_STEP at a time while the socket takes each
 * step at once, and at most TLS_BUDGET per call; a step the socket does
 * not take at once (or the last of the budget) is left to uv_write, and
 * on_write calls again. Frames leave the queue in order, so an Error
 * frame queued behind a large reply follows it on the wire. */
static void tls_send(sv_conn *c) {
  tls_conn *t = c->tpd;
  size_t budget = TLS_BUDGET;
  if (!t->done) return; /* frames wait for the handshake */
  while (!c->closing && c->oq_head && c->writes_pending == 0) {
    size_t step = 0;
    int rc = 0;
    const uint8_t *p;
    size_t k;
    while (step < TLS_STEP && sv_writer_peek(c, TLS_STEP - step, &p, &k)) {
      rc = sv_tls_write(t->tls, p, k);
      if (rc < 0) break;
      sv_writer_consume(c, k);
      step += k;
    }
    if (rc < 0) {
      sv_conn_close(c, "TLS write failed");
      return;
    }
    budget = budget > step ? budget - step : 0;
    tls_flush_q(c, budget == 0);
    if (budget == 0) return;
  }
}

/* A failed TLS handshake (a plain TCP client, an unknown certificate, no
 * client certificate under mutual TLS) or read: the alert OpenSSL queued
 * is sent, then the connection closes. Counted as a protocol error. */
static void tls_failed(sv_conn *c, const char *why) {
  tls_conn *t = c->tpd;
  atomic_fetch_add(&c->srv->g.protocol_errors, 1);
  sv_count_error(&c->srv->g, DISPATCH_ETLS);
  sv_log_conn(SV_LOG_WARN, c->id, c->peer, "TLS %s failed: %s",
              t->done ? "read" : "handshake", why);
  sv_writer_clear(c); /* the session cannot encrypt them any more */
  tls_flush_q(c, 0);
  if (c->closing) return;
  sv_reader_stop(c);
  if (c->writes_pending == 0) sv_conn_close(c, "TLS failure");
  else c->close_after_flush = 1;
}

/* Advances the handshake, then decrypts buffered records into the reader
 * for as long as it takes input (not while throttled or waiting on an
 * upload's quota: the bytes stay inside the TLS session until resume). An
 * upload's bulk is decrypted straight into the tensor. */
static void tls_pump(sv_conn *c) {
  tls_conn *t = c->tpd;
  char why[384];
  if (c->closing) return;
  if (!t->done) {
    int rc = sv_tls_handshake(t->tls, why, sizeof why);
    if (rc < 0) {
      tls_failed(c, why);
      return;
    }
    tls_flush_q(c, 0);
    if (rc == 0 || c->closing) return;
    t->done = 1;
    if (SV_LOG_ON(SV_LOG_INFO)) {
      char peer[256], safe[4 * SV_LOG_STR_MAX + 8];
      sv_tls_peer_name(t->tls, peer, sizeof peer);
      sv_log_conn(SV_LOG_INFO, c->id, c->peer, "TLS handshake done%s%s",
                  *peer ? ", client certificate " : "",
                  sv_log_str(safe, sizeof safe, peer, SV_LOG_STR_MAX));
    }
    if (c->over_limit) {
      char msg[128];
      snprintf(msg, sizeof msg, "server already serves %d sessions (limit)",
               c->srv->cfg->max_sessions);
      sv_refuse(c, 0, DISPATCH_ELIMIT, msg);
      return;
    }
  }
  while (sv_reader_open(c)) {
    long n;
    size_t room;
    uint8_t *dst = sv_reader_bulk_dst(c, &room);
    if (dst) {
      n = sv_tls_read(t->tls, dst, room, why, sizeof why);
      if (n > 0) {
        sv_reader_bulk_got(c, (size_t)n);
        continue;
      }
    } else {
      n = sv_tls_read(t->tls, c->rbuf, RBUF_SIZE, why, sizeof why);
      if (n > 0) {
        sv_reader_parse(c, c->rbuf, (size_t)n);
        continue;
      }
    }
    if (n == 0) break;
    if (n == -1) {
      sv_conn_close(c, "peer closed the TLS session");
      return;
    }
    tls_failed(c, why);
    return;
  }
  tls_flush_q(c, 0); /* reading may answer (key updates) */
}

static void tls_on_bytes(sv_conn *c, const uv_buf_t *buf, size_t n) {
  tls_conn *t = c->tpd;
  if (sv_tls_feed(t->tls, buf->base, n) < 0) {
    sv_conn_close(c, "out of memory for TLS input");
    return;
  }
  tls_pump(c);
}

const sv_transport sv_transport_tls = {
    "tls",    tls_open, tls_free,  tls_alloc, tls_on_bytes,
    tls_pump, tls_send, tls_ready,
};

void sv_transport_peer_digest(sv_conn *c, uint8_t out[32]) {
  memset(out, 0, 32);
  if (c->tp != &sv_transport_tls) return;
  const tls_conn *t = c->tpd;
  if (t && sv_tls_peer_digest(t->tls, out) < 0) memset(out, 0xff, 32);
}
