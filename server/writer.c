/* The reply queue of a connection: frames leave in the order they were
 * queued, through whichever transport the connection has. This is the one
 * place that counts what a connection holds for its client
 * (outq_bytes: bytes and SV_OUT_COST of bookkeeping per frame) and drops
 * a client that does not read. A frame's bulk (a
 * Read reply) is handed on in pieces of at most SV_WRITE_PIECE bytes, so
 * any size the limits admit round-trips. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "conn.h"

int sv_writer_idle(const sv_conn *c) {
  return c->writes_pending == 0 && c->oq_head == NULL;
}

static void out_free(sv_out *o) {
  dsp_free(o->buf);
  dsp_pin_release(o->bulk);
  dsp_free(o);
}

void sv_writer_clear(sv_conn *c) {
  while (c->oq_head) {
    sv_out *o = c->oq_head;
    c->oq_head = o->next;
    c->outq_bytes -= o->len + o->bulk_len - o->done + SV_OUT_COST;
    out_free(o);
  }
  c->oq_tail = NULL;
}

/* The next contiguous bytes of the head frame, at most max. */
int sv_writer_peek(sv_conn *c, size_t max, const uint8_t **p, size_t *n) {
  sv_out *o = c->oq_head;
  if (!o) return 0;
  size_t k;
  if (o->done < o->len) {
    *p = o->buf + o->done;
    k = o->len - o->done;
  } else {
    *p = (const uint8_t *)dsp_pin_data(o->bulk) + (o->done - o->len);
    k = o->len + o->bulk_len - o->done;
    if (k > max) k = max;
    k = dsp_pin_avail(o->bulk, o->done - o->len, k); /* landed parts only */
  }
  *n = k < max ? k : max;
  return 1;
}

/* Takes n bytes off the front of the queue (possibly several frames),
 * freeing each frame once all of it is gone. */
void sv_writer_consume(sv_conn *c, size_t n) {
  while (n > 0 && c->oq_head) {
    sv_out *o = c->oq_head;
    size_t left = o->len + o->bulk_len - o->done;
    size_t k = n < left ? n : left;
    o->done += k;
    n -= k;
    c->outq_bytes -= k;
    if (o->done == o->len + o->bulk_len) {
      c->outq_bytes -= SV_OUT_COST;
      c->oq_head = o->next;
      if (!c->oq_head) c->oq_tail = NULL;
      out_free(o);
    }
  }
}

static void on_write(uv_write_t *req, int status) {
  sv_conn *c = (sv_conn *)req->handle;
  sv_write *w = (sv_write *)req;
  size_t len = w->len;
  c->writes_pending--;
  if (status >= 0) c->sent += len;
  if (w->owned) { /* transport bytes (ciphertext) */
    c->outq_bytes -= len + sizeof *w;
    dsp_free(w->owned);
  } else { /* bytes of queued frames, which stayed until now */
    c->outq_bytes -= sizeof *w;
    sv_writer_consume(c, len);
  }
  dsp_free(w);
  if (c->closing) return;
  if (status < 0) {
    sv_conn_close(c, uv_strerror(status));
    return;
  }
  if (c->oq_head) c->tp->send(c);
  if (!c->closing && c->close_after_flush && sv_writer_idle(c))
    sv_conn_close(c, "after its last reply");
}

long sv_writer_sock(sv_conn *c, uv_buf_t *b, unsigned nb, uint8_t *owned,
                    int queued) {
  size_t total = 0, done = 0;
  for (unsigned i = 0; i < nb; i++) total += b[i].len;
  if (!queued) {
    int n = uv_try_write((uv_stream_t *)&c->tcp, b, nb);
    if (n < 0 && n != UV_EAGAIN) {
      dsp_free(owned);
      sv_conn_close(c, uv_strerror(n));
      return -1;
    }
    done = n > 0 ? (size_t)n : 0;
    c->sent += done;
  }
  if (done == total) {
    dsp_free(owned);
    return (long)done;
  }
  size_t skip = done;
  unsigned first = 0;
  while (skip >= b[first].len) skip -= b[first++].len;
  b[first].base += skip;
  b[first].len -= skip;
  sv_write *w = dsp_malloc(sizeof *w);
  if (!w) {
    dsp_free(owned);
    sv_conn_close(c, "out of memory queueing a write");
    return -1;
  }
  w->owned = owned;
  w->len = total - done;
  int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, b + first, nb - first,
                    on_write);
  if (rc < 0) {
    dsp_free(owned);
    dsp_free(w);
    sv_conn_close(c, uv_strerror(rc));
    return -1;
  }
  c->outq_bytes += (owned ? w->len : 0) + sizeof *w;
  c->writes_pending++;
  return (long)done;
}

void sv_writer_raw(sv_conn *c, uint8_t *buf, size_t len, int queued) {
  if (c->closing) {
    dsp_free(buf);
    return;
  }
  uv_buf_t b = uv_buf_init((char *)buf, (unsigned)len);
  if (sv_writer_sock(c, &b, 1, buf, queued) >= 0 && !c->closing &&
      c->close_after_flush && sv_writer_idle(c))
    sv_conn_close(c, "after its last reply");
}

/* A client whose unsent replies pass the output limit is dropped: it does
 * not read what it asked for. */
void sv_writer_queue(sv_conn *c, uint8_t *buf, size_t len, dsp_pin *bulk) {
  size_t bulk_len = bulk ? dsp_pin_nbytes(bulk) : 0;
  if (c->closing) {
    dsp_free(buf);
    dsp_pin_release(bulk);
    return;
  }
  const sv_config *cfg = c->srv->cfg;
  if (c->outq_bytes > cfg->max_output_queue) {
    dsp_free(buf);
    dsp_pin_release(bulk);
    sv_count_limit(&c->srv->g, SV_LIM_OUTPUT_QUEUE);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer,
                "output queue holds %llu bytes, over %llu: "
                "dropping a client that does not read its replies",
                (unsigned long long)c->outq_bytes,
                (unsigned long long)cfg->max_output_queue);
    c->limit_closed = 1;
    sv_conn_close(c, "slow reader");
    return;
  }
  sv_out *o = dsp_malloc(sizeof *o);
  if (!o) {
    dsp_free(buf);
    dsp_pin_release(bulk);
    sv_conn_close(c, "out of memory queueing a reply");
    return;
  }
  *o = (sv_out){NULL, buf, len, bulk, bulk_len, 0};
  if (c->oq_tail) c->oq_tail->next = o;
  else c->oq_head = o;
  c->oq_tail = o;
  c->outq_bytes += len + bulk_len + SV_OUT_COST;
  c->tp->send(c);
  if (!c->closing && c->close_after_flush && sv_writer_idle(c))
    sv_conn_close(c, "after its last reply");
}

void sv_refuse(sv_conn *c, uint64_t req_id, int code, const char *msg) {
  uint8_t *buf;
  size_t len;
  sv_count_error(&c->srv->g, code);
  sv_reader_stop(c);
  if (!c->tp->ready(c)) { /* no session to carry a frame yet */
    sv_conn_close(c, msg);
    return;
  }
  if (sv_encode_error(req_id, code, msg, req_id, &buf, &len) < 0) {
    sv_conn_close(c, "out of memory for an error frame");
    return;
  }
  c->close_after_flush = 1;
  sv_writer_queue(c, buf, len, NULL);
}

void sv_proto_error(sv_conn *c, uint64_t req_id, int code, const char *fmt,
                    ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  atomic_fetch_add(&c->srv->g.protocol_errors, 1);
  if (code == DISPATCH_ETOOLARGE) /* the frame limit */
    sv_count_limit(&c->srv->g, SV_LIM_FRAME_SIZE);
  sv_log_conn(SV_LOG_WARN, c->id, c->peer, "protocol error: %s: %s",
              dispatch_err_name(code), msg);
  sv_refuse(c, req_id, code, msg);
}
