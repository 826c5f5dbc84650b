/* The frame reader of a connection: turns plaintext bytes (from whichever
 * transport) into decoded requests, keeping its place across partial
 * reads. Every limit on what a peer may send sits here: the frame header
 * limits, uploads' quota, and the input backpressure of --max-queued. An
 * upload's bulk lands straight in the backend's staging memory for the
 * tensor (on the CPU its storage). */
#include <stdio.h>
#include <string.h>

#include "conn.h"

/* A frame did not arrive whole in time: a peer that sends a byte now and
 * then would otherwise hold its session slot forever. */
static void on_frame_timeout(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->closing || c->close_after_flush || !c->in_frame) return;
  char msg[256];
  snprintf(msg, sizeof msg,
           "frame not complete within %d s (server limit --frame-timeout): "
           "%s",
           c->srv->cfg->frame_timeout_s,
           c->state == ST_HEADER ? "header unfinished"
           : c->state == ST_MSG  ? "message unfinished"
                                 : "bulk unfinished");
  sv_count_limit(&c->srv->g, SV_LIM_FRAME_TIMEOUT);
  sv_log_conn(SV_LOG_WARN, c->id, c->peer, "%s", msg);
  sv_refuse(c, 0, DISPATCH_ELIMIT, msg);
}

void sv_reader_frame_timer(sv_conn *c) {
  int s = c->srv->cfg->frame_timeout_s;
  if (s <= 0 || c->closing) return;
  int held = c->paused || c->state == ST_WAIT || c->state == ST_DEAD;
  if (!c->in_frame || held) uv_timer_stop(&c->frame);
  else if (!uv_is_active((uv_handle_t *)&c->frame))
    uv_timer_start(&c->frame, on_frame_timeout, (uint64_t)s * 1000, 0);
}

/* The first byte of a frame arrived: its clock starts. */
static void frame_begin(sv_conn *c) {
  c->in_frame = 1;
  uv_timer_stop(&c->frame);
  sv_reader_frame_timer(c);
}

/* The frame is complete: its clock stops and idle time counts from now. */
static void frame_end(sv_conn *c) {
  c->in_frame = 0;
  uv_timer_stop(&c->frame);
  sv_conn_touch(c);
}

int sv_reader_open(const sv_conn *c) {
  return !c->closing && !c->paused && c->state != ST_WAIT &&
         c->state != ST_DEAD;
}

void sv_reader_stop(sv_conn *c) {
  c->state = ST_DEAD;
  uv_read_stop((uv_stream_t *)&c->tcp);
}

uint8_t *sv_reader_bulk_dst(sv_conn *c, size_t *room) {
  if (c->state != ST_BULK || !c->bulk_dst || c->bulk_got >= c->bulk_len)
    return NULL;
  uint64_t rem = c->bulk_len - c->bulk_got;
  *room = rem > (1u << 30) ? (size_t)1 << 30 : (size_t)rem;
  return c->bulk_dst + c->bulk_got;
}

static void handle_msg(sv_conn *c);

static void finish_bulk(sv_conn *c) {
  sv_job *j = c->bulk_job;
  c->bulk_job = NULL;
  c->bulk_dst = NULL;
  c->state = ST_HEADER;
  c->hdr_got = 0;
  frame_end(c);
  if (j && c->sess->rs && j->req->seq > c->sess->rs->last_seq)
    c->sess->rs->last_seq = j->req->seq; /* received in full */
  if (j) sv_conn_dispatch(c, j); /* NULL: the bulk of a request refused */
}

/* Hands the parts of an upload's bulk that have arrived to the backend
 * (a GPU starts their copy), so they cross the bus while the socket
 * delivers the rest; on the CPU nothing happens. */
static void bulk_progress(sv_conn *c) {
  sv_job *j = c->bulk_job;
  if (j && j->upload && c->bulk_dst)
    dsp_stage_progress(&j->upload_stage, (size_t)c->bulk_got);
}

void sv_reader_bulk_got(sv_conn *c, size_t n) {
  c->bulk_got += (uint64_t)n;
  bulk_progress(c);
  if (c->bulk_got == c->bulk_len) finish_bulk(c);
}

/* Starts reading the socket again; the transport first delivers what it
 * already holds, which no socket event would announce. */
void sv_reader_again(sv_conn *c) {
  c->tp->resume(c);
  if (sv_reader_open(c)) sv_conn_read_start(c);
}

/* Checks an Upload against every limit before allocating, then allocates
 * the tensor so the bulk lands straight in its staging memory. A failure keeps
 * the stream in sync by discarding the bulk and defers the error. */
static void prepare_upload(sv_conn *c, sv_job *j, int final) {
  if (sv_upload_prepare(c->srv->cfg, c->srv->io_ctx, c->sess, j, c->bulk_len,
                        !final && c->inflight > 0)) {
    /* earlier requests may free memory: judge once they have run */
    c->wait_job = j;
    c->state = ST_WAIT;
    uv_read_stop((uv_stream_t *)&c->tcp);
    sv_reader_frame_timer(c);
    return;
  }
  c->bulk_job = j;
  c->bulk_got = 0;
  c->bulk_dst = j->upload ? j->upload_stage.host : NULL;
  c->state = ST_BULK;
  sv_reader_frame_timer(c); /* resumed after a wait */
}

/* Once the FIFO is empty, judges the waiting upload for good and parses
 * what was left in rbuf before reading again. */
void sv_reader_resume_wait(sv_conn *c) {
  sv_job *j = c->wait_job;
  c->wait_job = NULL;
  if (j) {
    prepare_upload(c, j, 1);
    if (c->bulk_len == 0) finish_bulk(c);
  } else { /* a message that did not fit the budget: decode it again */
    c->read_left = c->pend_n;
    handle_msg(c);
    if (c->state == ST_HEADER && c->hdr_got == 0) frame_end(c);
  }
  const uint8_t *p = c->pend;
  size_t n = c->pend_n;
  c->pend = NULL;
  c->pend_n = 0;
  sv_reader_parse(c, p, n);
  if (sv_reader_open(c)) sv_reader_again(c);
}

/* A message whose decoded form does not fit the session's queue budget:
 * while earlier requests are queued it waits for them (reading stops, as
 * for an upload in ST_WAIT), since they may free memory; with nothing
 * queued it fails like any request, with the error deferred or answered,
 * and its bulk (if any) is read and dropped so the stream stays in step. */
static void over_budget(sv_conn *c, uint64_t rid, int body, const char *why) {
  if (c->inflight > 0) {
    c->wait_job = NULL;
    c->state = ST_WAIT;
    uv_read_stop((uv_stream_t *)&c->tcp);
    sv_reader_frame_timer(c);
    return;
  }
  dsp_free(c->msg);
  c->msg = NULL;
  uint8_t *out;
  size_t len;
  sv_session_defer(c->sess, rid, body, DISPATCH_EQUOTA, why, &out, &len);
  if (out) {
    sv_writer_queue(c, out, len, NULL);
  } else if (sv_req_kind_of((Dspwire__Request__BodyCase)body)->waits) {
    sv_conn_close(c, "out of memory for a reply");
    return;
  }
  c->bulk_job = NULL;
  c->bulk_dst = NULL;
  c->bulk_got = 0;
  c->state = ST_BULK;
  if (c->bulk_len == 0) finish_bulk(c);
}

/* A request the session received before (sent again after a resume): it
 * does not run again; a waiting one gets its kept reply, and an upload's
 * bulk is read and dropped so the stream stays in step. */
static void duplicate(sv_conn *c, Dspwire__Request *req) {
  int waits = sv_req_waits(req);
  sv_log(SV_LOG_DEBUG, "conn %llu: seq %llu received before: not run again",
         c->id, (unsigned long long)req->seq);
  if (waits && sv_resume_resend(c, req->seq) < 0) {
    dspwire__request__free_unpacked(req, &sv_pb_allocator);
    sv_conn_close(c, "out of memory resending a reply");
    return;
  }
  dspwire__request__free_unpacked(req, &sv_pb_allocator);
  c->bulk_job = NULL;
  c->bulk_dst = NULL;
  c->bulk_got = 0;
  c->state = ST_BULK;
  if (c->bulk_len == 0) finish_bulk(c);
}

/* Decodes one complete message, charging its decoded form to the
 * session's queue budget; anything structurally wrong is a protocol error
 * that closes this connection only. */
static void handle_msg(sv_conn *c) {
  Dspwire__Request *req;
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
    sv_proto_error(c, rid, drc, "%s", why);
    return;
  }
  c->n_requests++;
  if (SV_LOG_ON(SV_LOG_DEBUG)) {
    char desc[256];
    sv_describe(req, desc, sizeof desc);
    sv_log_conn(SV_LOG_DEBUG, c->id, c->peer, "-> req %llu: %s%s",
                (unsigned long long)rid, desc, c->bulk_len ? " (+bulk)" : "");
  }
  uint64_t t0 = uv_hrtime();
  if (req->body_case == DSPWIRE__REQUEST__BODY_HELLO) {
    sv_hello(c, req);
    sv_metrics_observe(c->srv, (int)req->body_case, uv_hrtime() - t0);
    dspwire__request__free_unpacked(req, &sv_pb_allocator);
    c->state = c->state == ST_DEAD ? ST_DEAD : ST_HEADER;
    c->hdr_got = 0;
    return;
  }
  if (req->keepalive_ms) sv_keepalive_set(c, req->keepalive_ms); /* 1.4 */
  sv_resume *rs = c->sess->rs;
  if (rs) sv_resume_ack(c->sess, req->ack);
  if (rs && req->seq && req->seq <= rs->last_seq) {
    duplicate(c, req);
    return;
  }
  sv_job *j = dsp_calloc(1, sizeof *j);
  if (!j) {
    dspwire__request__free_unpacked(req, &sv_pb_allocator);
    sv_conn_close(c, "out of memory for a request");
    return;
  }
  j->req = req;
  j->t0 = t0;
  j->bulk_by_ref = 1;
  if (sv_req_kind_of(req->body_case)->bulk) {
    prepare_upload(c, j, 0);
    if (c->state == ST_BULK && c->bulk_len == 0) finish_bulk(c);
    return;
  }
  c->state = ST_HEADER;
  c->hdr_got = 0;
  if (sv_req_kind_of(req->body_case)->ends)
    sv_reader_stop(c); /* nothing after a bye is read */
  if (rs && req->seq > rs->last_seq) rs->last_seq = req->seq;
  sv_conn_dispatch(c, j);
}

void sv_reader_parse(sv_conn *c, const uint8_t *p, size_t n) {
  const sv_config *cfg = c->srv->cfg;
  while (n > 0 && !c->closing) {
    if (c->state == ST_HEADER) {
      if (c->hdr_got == 0) frame_begin(c);
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
        sv_proto_error(c, 0, rc, "%s", why);
        return;
      }
      if (!c->hello_done &&
          (uint64_t)h.msg_len + h.bulk_len > SV_PREAUTH_FRAME_MAX) {
        sv_proto_error(c, 0, DISPATCH_ETOOLARGE,
                       "frame of %u + %llu bytes before hello: at most %u "
                       "bytes until a hello succeeds",
                       h.msg_len, (unsigned long long)h.bulk_len,
                       SV_PREAUTH_FRAME_MAX);
        return;
      }
      c->msg = dsp_malloc(h.msg_len);
      if (!c->msg) {
        sv_conn_close(c, "out of memory for a message");
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
      if (c->msg_got == c->msg_len) {
        c->read_left = n; /* what follows it in this read (inline.c) */
        handle_msg(c);
        if (c->state == ST_HEADER && c->hdr_got == 0) frame_end(c);
      }
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
      bulk_progress(c);
      p += take;
      n -= take;
      if (c->bulk_got == c->bulk_len) finish_bulk(c);
    } else {
      return; /* ST_DEAD: the rest is ignored */
    }
  }
}
