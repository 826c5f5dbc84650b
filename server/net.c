/* Connection lifecycle on the libuv loop: accept, timers, close, the
 * jobs that come back from the workers, and sv_run. Reading frames
 * (reader.c), the reply queue (writer.c), hello (hello.c) and plain TCP
 * vs TLS (transport.c) live beside it; nothing here runs a kernel.
 *
 * Ownership: a connection struct embeds its uv handles and is freed only
 * when every handle is closed and its session's teardown job (the last
 * job of the session, run on a worker after any running job) came back. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn.h"
#include "op_record.h"

#define N_HANDLES 5 /* tcp, idle, hs, frame, ka */

/* SV_DEBUG_CHECK's report (debug builds): a rule of the server's threads
 * or of a session's idle state was broken, which no input may cause */
void sv__debug_fail(const char *file, int line, const char *cond,
                    const char *msg) {
  fprintf(stderr, "dispatch-server: debug check failed at %s:%d: %s (%s)\n",
          file, line, msg, cond);
  fflush(stderr);
  abort();
}

/* ------------------------------------------------------------ lifecycle */

/* The last connection is gone (or there was none): the workers stop and
 * the server's own handles close, so the loop runs out and sv_run
 * returns. */
static void finish_shutdown(sv_server *srv) {
  if (!srv->pool || srv->n_held > 0) return; /* detached sessions first */
  sv_pool_close(srv->pool);
  srv->pool = NULL;
  if (!srv->handles_closed) {
    srv->handles_closed = 1;
    uv_close((uv_handle_t *)&srv->drain, NULL);
    uv_close((uv_handle_t *)&srv->spin, NULL);
    uv_close((uv_handle_t *)&srv->sigint, NULL);
    uv_close((uv_handle_t *)&srv->sigterm, NULL);
    sv_reload_close(srv);
    sv_metrics_loop_close(srv); /* scrapes are answered until here */
  }
}

static void maybe_free(sv_conn *c) {
  SV_DEBUG_CHECK(sv_on_loop(c->srv), "a connection is freed on the loop");
  if (c->handles_open > 0 || !c->teardown_done) return;
  sv_server *srv = c->srv;
  if (c->prev) c->prev->next = c->next;
  else srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  dsp_free(c->sess);
  c->tp->free(c);
  dsp_free(c->msg);
  sv_job_free(c->bulk_job);
  sv_job_free(c->wait_job);
  srv->ls.in_closed += c->received; /* the totals outlive the connection */
  srv->ls.out_closed += c->sent;
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

/* Stops reading, drops unsent replies, cancels the session's queued
 * requests and queues its teardown behind any request a worker is running
 * now. Idempotent. */
static void submit_flush(sv_conn *c);

void sv_conn_close(sv_conn *c, const char *reason) {
  SV_DEBUG_CHECK(sv_on_loop(c->srv), "a connection closes on the loop thread");
  if (c->closing) return;
  /* what this read decoded before the close was received: it is queued
   * like any request before it (a detached session still runs it) */
  c->sub_batching = 0;
  submit_flush(c);
  c->closing = 1;
  c->state = ST_DEAD;
  sv_log_conn(SV_LOG_INFO, c->id, c->peer, "closed (%s) after %llu requests",
              reason, c->n_requests);
  uv_read_stop((uv_stream_t *)&c->tcp);
  sv_writer_clear(c);
  uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
  uv_close((uv_handle_t *)&c->idle, on_handle_closed);
  uv_close((uv_handle_t *)&c->hs, on_handle_closed);
  uv_close((uv_handle_t *)&c->frame, on_handle_closed);
  sv_keepalive_close(c, on_handle_closed);
  /* a dropped connection: its session waits for a resume, its queued
   * requests still run (the client counts them as received) */
  if (sv_resume_detach(c)) return;
  sv_resume_before_teardown(c->sess);
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
 * why (a client sees it at its next wait) and is closed. A client that
 * takes none of its replies for a whole period is closed too (no frame
 * can reach it): otherwise one Read it never reads holds a slot. */
static void on_idle(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->closing) return;
  /* a connection refused with a frame still waits for the client to take
   * it (close_after_flush): one that takes nothing is closed all the same,
   * or a client that stalls a frame behind unread replies holds its slot
   * for as long as it likes */
  if (!sv_writer_idle(c)) {
    if (c->sent != c->sent_at_idle) {
      c->sent_at_idle = c->sent; /* it reads, however slowly */
      return;
    }
    sv_count_limit(&c->srv->g, SV_LIM_IDLE_TIMEOUT);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer,
                "took none of %llu bytes of replies for %d s "
                "(server limit --idle-timeout)",
                (unsigned long long)c->outq_bytes,
                c->srv->cfg->idle_timeout_s);
    c->limit_closed = 1;
    sv_conn_close(c, "client does not read its replies");
    return;
  }
  c->sent_at_idle = c->sent;
  if (c->close_after_flush) return; /* refused: closes once flushed */
  if (c->inflight > 0) return;        /* still working */
  if (c->in_frame) return; /* a frame is arriving: --frame-timeout rules */
  char msg[128];
  snprintf(msg, sizeof msg,
           "session idle for %d s (server limit --idle-timeout): closed",
           c->srv->cfg->idle_timeout_s);
  sv_count_limit(&c->srv->g, SV_LIM_IDLE_TIMEOUT);
  sv_log_conn(SV_LOG_INFO, c->id, c->peer, "%s", msg);
  sv_refuse(c, 0, DISPATCH_ELIMIT, msg);
}

/* The TLS handshake and the hello did not finish in time: a client that
 * connects and says nothing holds a session slot, so it is closed. */
static void on_handshake_timeout(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->closing || c->close_after_flush || c->hello_done) return;
  char msg[160];
  snprintf(msg, sizeof msg,
           "no %shello within %d s (server limit --handshake-timeout)",
           c->tp->ready(c) ? "" : "TLS handshake and ",
           c->srv->cfg->handshake_timeout_s);
  sv_count_limit(&c->srv->g, SV_LIM_HANDSHAKE_TIMEOUT);
  sv_log_conn(SV_LOG_WARN, c->id, c->peer, "%s", msg);
  sv_refuse(c, 0, DISPATCH_ELIMIT, msg);
}

void sv_conn_touch(sv_conn *c) {
  int s = c->srv->cfg->idle_timeout_s;
  if (s > 0 && !c->closing)
    uv_timer_start(&c->idle, on_idle, (uint64_t)s * 1000, (uint64_t)s * 1000);
}

/* ------------------------------------------------------------ reading */

/* Hands the jobs collected during a socket read to the pool, in order,
 * with one lock round and at most one worker wake-up. */
static void submit_flush(sv_conn *c) {
  if (!c->sub_head) return;
  sv_pool_submit_list(c->srv->pool, c->sub_head, c->sub_tail);
  c->sub_head = c->sub_tail = NULL;
  c->sub_n = 0;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  (void)hint;
  sv_conn *c = h->data;
  c->tp->alloc(c, buf);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  sv_conn *c = s->data;
  if (c->closing) return;
  if (nread < 0) {
    sv_conn_close(c,
                  nread == UV_EOF ? "peer closed" : uv_strerror((int)nread));
    return;
  }
  if (nread == 0) return;
  c->received += (uint64_t)nread;
  c->inline_left = SV_INLINE_READ_COST;
  c->sub_batching = 1;
  c->tp->on_bytes(c, buf, (size_t)nread);
  c->sub_batching = 0;
  submit_flush(c);
}

void sv_conn_read_start(sv_conn *c) {
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* ------------------------------------------------------------ requests */

void sv_conn_submit(sv_conn *c, sv_job *j) {
  j->sess = c->sess;
  c->inflight++;
  /* a worker has work now: the core the loop was polling on is its */
  if (uv_is_active((uv_handle_t *)&c->srv->spin)) uv_idle_stop(&c->srv->spin);
  if (c->sub_batching) {
    j->next = NULL;
    if (c->sub_tail) c->sub_tail->next = j;
    else c->sub_head = j;
    c->sub_tail = j;
    if (++c->sub_n >= SV_SUBMIT_BATCH) submit_flush(c);
  } else {
    sv_pool_submit(c->srv->pool, j);
  }
  if (c->inflight >= c->srv->cfg->max_queued && !c->paused) {
    c->paused = 1; /* input backpressure until the workers catch up */
    uv_read_stop((uv_stream_t *)&c->tcp);
    sv_reader_frame_timer(c);
  }
}

/* 1 when j may run on the loop thread now: a waiting request that only
 * reads session state (the on_loop kinds: Sync, Stats, a Read whose reply
 * references the tensor's storage), or an op, Free or upload whose
 * estimated work is at most --inline-cost (inline.c) while this read's
 * inline allowance lasts, and for an Op only while at most SV_INLINE_TAIL
 * bytes of the read follow it (more is a pipeline of Op messages, whose
 * decoding overlaps its execution on a worker; a 1.3 client sends such a
 * pipeline as Ops, ops_on_loop);
 * and in both cases only while the session has nothing queued or running.
 * Then no worker can touch the session until the loop submits again, and
 * the pool mutex taken in the check orders the last worker's writes
 * (tensor table, first deferred error) before the loop's reads, so what
 * runs here sees what it would see on a worker, in the same order. */
static int runs_on_loop(sv_conn *c, const sv_job *j) {
  const sv_req_kind *kind = sv_req_kind_of(j->req->body_case);
  int on_loop = kind->on_loop;
  int replay = kind->inline_whole;
  int op = kind->inline_cost &&
           (!kind->inline_tail || c->read_left <= SV_INLINE_TAIL) &&
           c->srv->cfg->inline_cost > 0 && c->inline_left > 0;
  if ((!on_loop && !op) || c->inflight > 0 ||
      !sv_pool_session_idle(c->srv->pool, c->sess))
    return 0;
  if (on_loop) return 1;
  uint64_t cost;
  /* a replay is many ops: held to what is left of this read's allowance
   * as a whole (its ops together, as the records of an Ops request), not
   * to the cost of one op */
  if (!sv_inline_cost(c->sess, j, &cost) ||
      cost > (replay ? c->inline_left : c->srv->cfg->inline_cost))
    return 0;
  cost += SV_INLINE_OP_BASE;
  c->inline_left = cost < c->inline_left ? c->inline_left - cost : 0;
  return 1;
}

/* The gate of an Ops request's records run on the loop: a record runs
 * there while it is placed on a CPU, its estimated work is at most
 * --inline-cost and this read's inline allowance lasts (inline.c); the
 * first that fails goes, with the rest of the request, to a worker. */
static int inline_gate(void *ud, sv_session *s, dsp_tensor *const *in,
                       int n_in, uint64_t cost) {
  sv_conn *c = ud;
  if (c->inline_left == 0 || cost > c->srv->cfg->inline_cost ||
      !sv_inline_placed(s, in, n_in))
    return 0;
  cost += SV_INLINE_REC_BASE;
  c->inline_left = cost < c->inline_left ? c->inline_left - cost : 0;
  return 1;
}

/* An Ops request of an idle session: its leading records that pass
 * inline_gate run here, one by one, and the rest (if any) go to a worker
 * in the same job. Unlike an Op, no bytes-behind rule: its records cost
 * the loop no decoding, so there is nothing to overlap with a worker. 1
 * when it ran here (in full or in part), 0 when it is the pool's. */
/* Runs j on the loop thread for c's idle session, counting the ops it ran
 * as inline; j is then c's in flight, for sv_conn_on_done or a submit. */
static void exec_inline(sv_conn *c, sv_job *j) {
  SV_DEBUG_CHECK(sv_on_loop(c->srv) && c->inflight == 0 &&
                     sv_pool_session_idle(c->srv->pool, c->sess),
                 "the loop runs a request only for an idle session");
  j->sess = c->sess;
  c->inflight++;
  uint64_t ops = c->sess->n_ops;
  sv_session_exec(c->sess, j);
  c->sess->n_inline += c->sess->n_ops - ops; /* ops that ran, as n_ops */
}

static int ops_on_loop(sv_conn *c, sv_job *j) {
  if (j->req->body_case != DSPWIRE__REQUEST__BODY_OPS ||
      c->srv->cfg->inline_cost == 0 || c->inline_left == 0 ||
      c->inflight > 0 || !sv_pool_session_idle(c->srv->pool, c->sess))
    return 0;
  j->gate = inline_gate;
  j->gate_ud = c;
  exec_inline(c, j);
  j->gate = NULL;
  j->gate_ud = NULL;
  if (j->ops_at < j->req->ops->records.len) {
    c->inflight--; /* counted again by the submit */
    sv_conn_submit(c, j);
  } else {
    sv_conn_on_done(j, NULL);
  }
  return 1;
}

static void on_spin(uv_idle_t *h) {
  sv_server *srv = h->data;
  if (uv_hrtime() >= srv->spin_until) uv_idle_stop(h);
  /* a client woken on this core (the reply woke it here) runs at once */
  else sched_yield();
}

/* The loop answered a request itself and no worker has anything to do:
 * for the next --loop-spin-us it polls the sockets without sleeping (an
 * active idle handle makes libuv poll with a zero timeout), yielding its
 * core between polls, until then or until it hands work to a worker. A
 * client that waits on each reply sends its next request within
 * microseconds of reading it, and a loop asleep in epoll pays a wake-up
 * for it, tens of microseconds on a virtual machine. Not after a worker's
 * reply: a session whose work needs workers (a training step of large
 * products) keeps both cores busy with its BLAS threads, and a polling
 * loop slowed its step down (about 3% here). */
static void loop_spin(sv_server *srv) {
  if (srv->cfg->loop_spin_us == 0 || srv->handles_closed) return;
  srv->spin_until = uv_hrtime() + (uint64_t)srv->cfg->loop_spin_us * 1000;
  if (!uv_is_active((uv_handle_t *)&srv->spin))
    uv_idle_start(&srv->spin, on_spin);
}

/* Runs a request on the loop when runs_on_loop allows (the reply is the
 * one a worker would produce, minus two thread hops), else on the pool. */
void sv_conn_dispatch(sv_conn *c, sv_job *j) {
  if (ops_on_loop(c, j)) return;
  if (runs_on_loop(c, j)) {
    sv_server *srv = c->srv;
    int waits = sv_req_waits(j->req);
    exec_inline(c, j);
    sv_conn_on_done(j, NULL); /* may close c, even end the server's pool */
    /* the client may answer this reply with its next request at once */
    if (waits && srv->pool && sv_pool_idle(srv->pool)) loop_spin(srv);
    return;
  }
  sv_conn_submit(c, j);
}

static void log_reply(sv_conn *c, const sv_job *j) {
  uint32_t mlen = (uint32_t)j->out[0] | (uint32_t)j->out[1] << 8 |
                  (uint32_t)j->out[2] << 16 | (uint32_t)j->out[3] << 24;
  Dspwire__Reply *r = dspwire__reply__unpack(&sv_pb_allocator, mlen,
                                               j->out + DSP_FRAME_HEADER_SIZE);
  if (!r) return;
  const char *kind = r->error ? "error"
                     : r->body_case == DSPWIRE__REPLY__BODY_READ  ? "read"
                     : r->body_case == DSPWIRE__REPLY__BODY_STATS ? "stats"
                                                                   : "ok";
  sv_log_conn(SV_LOG_DEBUG, c->id, c->peer,
              "<- reply req %llu: %s%s%s (%zu bytes)",
              (unsigned long long)r->req_id, kind, r->error ? ": " : "",
              r->error ? r->error->message : "", j->out_len);
  dspwire__reply__free_unpacked(r, &sv_pb_allocator);
}

/* A job came back from a worker (or from sv_conn_dispatch): its reply
 * frame is queued, reading resumes when the backlog has halved, and a
 * waiting upload is judged once the FIFO is empty. */
void sv_conn_on_done(sv_job *j, void *ud) {
  (void)ud;
  sv_conn *c = j->sess->owner;
  if (!c && !j->sess->rs) { /* the one a resuming connection opened with */
    dsp_free(j->sess);
    sv_job_free(j);
    return;
  }
  if (!c) { /* a detached session's */
    sv_server *srv = sv_resume_done(j);
    if (srv->shutting_down && srv->n_conns == 0) finish_shutdown(srv);
    return;
  }
  if (j->kind == SV_JOB_TEARDOWN) {
    sv_resume_forget(j->sess);
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
  if (j->t0)
    sv_metrics_observe(c->srv, (int)j->req->body_case, uv_hrtime() - j->t0);
  if (j->out) {
    if (SV_LOG_ON(SV_LOG_DEBUG)) log_reply(c, j);
    /* kept until acknowledged: the frame may be lost with the socket */
    if (c->sess->rs && sv_req_waits(j->req))
      sv_resume_keep(c->sess, j->req->seq, j->req->req_id, j->out,
                     j->out_len, j->out_pin);
    uint8_t *out = j->out;
    dsp_pin *bulk = j->out_pin;
    j->out = NULL;
    j->out_pin = NULL;
    sv_writer_queue(c, out, j->out_len, bulk);
  } else if (sv_req_waits(j->req)) {
    sv_conn_close(c, "out of memory for a reply");
  }
  if (j->is_bye && !c->closing) {
    c->close_after_flush = 1;
    if (sv_writer_idle(c)) sv_conn_close(c, "bye");
  }
  sv_job_free(j);
  if (c->closing) return;
  if (c->srv->shutting_down) { /* nothing more is read: no resuming */
    sv_conn_goodbye(c);
    return;
  }
  if (c->paused && c->inflight < c->srv->cfg->max_queued / 2 + 1) {
    c->paused = 0;
    sv_reader_frame_timer(c);
    if (c->state != ST_DEAD && c->state != ST_WAIT) sv_reader_again(c);
  }
  if (c->state == ST_WAIT && c->inflight == 0) sv_reader_resume_wait(c);
}

/* ------------------------------------------------------------ accept */

static void free_handle(uv_handle_t *h) { dsp_free(h); }

static void on_connection(uv_stream_t *l, int status) {
  sv_server *srv = l->data;
  SV_DEBUG_CHECK(sv_on_loop(srv), "connections are made on the loop thread");
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
  c->tp = srv->tls ? &sv_transport_tls : &sv_transport_tcp;
  c->sess = sess;
  td->kind = SV_JOB_TEARDOWN;
  td->sess = sess;
  c->teardown = td;
  c->id = ++srv->next_id;
  sess->log_id = c->id;
  srv->ls.opened++;
  snprintf(c->peer, sizeof c->peer, "?");
  uv_tcp_init(&srv->loop, &c->tcp);
  uv_timer_init(&srv->loop, &c->idle);
  uv_timer_init(&srv->loop, &c->hs);
  uv_timer_init(&srv->loop, &c->frame);
  c->tcp.data = c;
  c->idle.data = c;
  c->hs.data = c;
  c->frame.data = c;
  sv_keepalive_init(c);
  c->handles_open = N_HANDLES;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->n_conns++;
  atomic_fetch_add(&srv->g.sessions, 1);
  if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0) {
    sv_conn_close(c, "accept failed");
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
  sv_log_conn(SV_LOG_INFO, c->id, c->peer, "opened");
  if (srv->shutting_down) {
    sv_conn_close(c, "server shutting down");
    return;
  }
  if (c->tp->open(c) < 0) {
    sv_conn_close(c, "out of memory for the connection's transport");
    return;
  }
  if (srv->cfg->handshake_timeout_s > 0)
    uv_timer_start(&c->hs, on_handshake_timeout,
                   (uint64_t)srv->cfg->handshake_timeout_s * 1000, 0);
  if (srv->n_conns > srv->cfg->max_sessions && !c->tp->ready(c)) {
    /* the refusal can only travel once the transport is ready */
    sv_count_limit(&srv->g, SV_LIM_MAX_SESSIONS);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer,
                "refused: server already serves %d sessions (limit)",
                srv->n_conns - 1);
    c->over_limit = 1;
  } else if (srv->n_conns > srv->cfg->max_sessions) {
    char msg[128];
    sv_count_limit(&srv->g, SV_LIM_MAX_SESSIONS);
    snprintf(msg, sizeof msg, "server already serves %d sessions (limit)",
             srv->n_conns - 1);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer, "refused: %s", msg);
    sv_refuse(c, 0, DISPATCH_ELIMIT, msg);
    return;
  }
  sv_conn_touch(c);
  sv_conn_read_start(c);
}

/* ------------------------------------------------------------ run */

/* Draining: once a session has nothing queued or running, it is told
 * the server is going away (an Error frame with DISPATCH_ESHUTDOWN and
 * req_id 0, behind every reply it is owed) and closed when that is
 * written. */
void sv_conn_goodbye(sv_conn *c) {
  if (!c->srv->shutting_down || c->closing || c->close_after_flush ||
      c->inflight > 0)
    return;
  sv_refuse(c, 0, DISPATCH_ESHUTDOWN,
            "server is shutting down: every request it received was run");
}

/* The drain is over (--drain-timeout ran out, it is 0, or a second
 * signal came): each session still open has its queued requests dropped
 * and its running op cancelled, gets the goodbye frame if the socket takes
 * it now, and is closed, so the exit waits at most for each running
 * kernel's next cancellation point. */
static void cut_off(sv_server *srv, const char *why) {
  if (srv->cut_off) return;
  srv->cut_off = 1;
  uv_timer_stop(&srv->drain);
  int n = 0;
  for (sv_conn *c = srv->conns; c; c = c->next) {
    if (c->closing) continue;
    if (!c->close_after_flush) {
      char msg[160];
      snprintf(msg, sizeof msg,
               "server is shutting down: %s cut off %u queued requests", why,
               c->inflight);
      n++;
      sv_session_cancel(c->sess);
      sv_refuse(c, 0, DISPATCH_ESHUTDOWN, msg);
    }
    if (!c->closing) sv_conn_close(c, why);
  }
  if (n > 0)
    sv_log(SV_LOG_WARN, "%s: %d sessions still had work, cancelled", why, n);
}

static void on_drain_timeout(uv_timer_t *t) {
  sv_server *srv = t->data;
  cut_off(srv, "the drain timeout (--drain-timeout)");
}

/* SIGTERM or SIGINT: no new connection is accepted (the listener closes,
 * so a connect is refused), nothing more is read from the sessions, and
 * what they already sent runs and is answered, for at most
 * --drain-timeout; a second signal ends the drain at once. The process
 * exits 0 either way: stopping on a signal is the expected way to end. */
static void on_signal(uv_signal_t *sig, int signum) {
  sv_server *srv = sig->data;
  if (srv->shutting_down) {
    sv_log(SV_LOG_INFO, "signal %d again: ending the drain now", signum);
    cut_off(srv, "a second signal");
    return;
  }
  srv->shutting_down = 1;
  sv_log(SV_LOG_INFO,
         "signal %d: shutting down, draining %d connections (at most %d s)",
         signum, srv->n_conns, srv->cfg->drain_timeout_s);
  uv_close((uv_handle_t *)&srv->listener, NULL);
  sv_resume_shutdown(srv); /* detached sessions: nothing to drain */
  for (sv_conn *c = srv->conns; c; c = c->next) {
    if (c->closing || c->close_after_flush) continue;
    if (!c->hello_done) { /* no session yet: nothing to drain */
      sv_refuse(c, 0, DISPATCH_ESHUTDOWN, "server is shutting down");
      continue;
    }
    sv_reader_stop(c);
    uv_timer_stop(&c->frame);
    sv_conn_goodbye(c);
  }
  if (srv->cfg->drain_timeout_s == 0)
    cut_off(srv, "no drain (--drain-timeout 0)");
  else
    uv_timer_start(&srv->drain, on_drain_timeout,
                   (uint64_t)srv->cfg->drain_timeout_s * 1000, 0);
  if (srv->n_conns == 0) finish_shutdown(srv);
}

int sv_start_reason_printed;

int sv_run(const sv_config *cfg) {
  sv_server *srv = dsp_calloc(1, sizeof *srv);
  if (!srv) return DISPATCH_ENOMEM;
  srv->cfg = cfg;
  srv->loop_thread = pthread_self(); /* uv_run below runs here */
  sv_log_level = cfg->log_level;
  sv_log_format = cfg->log_format;
  int rc = uv_loop_init(&srv->loop);
  if (rc < 0) {
    dsp_free(srv);
    return DISPATCH_EIO;
  }
  srv->io_ctx = dsp_ctx_new(dsp_cpu_backend());
  srv->g.mem = dsp_budget_new(cfg->max_memory, NULL, "server",
                              "--max-memory");
  srv->pool = srv->io_ctx && srv->g.mem
                  ? sv_pool_new(&srv->loop, cfg->threads, sv_conn_on_done, srv)
                  : NULL;
  int err = 0;
  char why[1024]; /* a device's reason names the CUDA plugin's path */
  if (srv->pool && (err = sv_devices_open(cfg, &srv->g, why, sizeof why)) < 0) {
    fprintf(stderr, "dispatch-server: %s\n", why);
    sv_start_reason_printed = 1; /* one line, not also main's */
  } else if (cfg->tls_cert && !(srv->tls = sv_tls_ctx_new(cfg))) {
    err = DISPATCH_ETLS;
  } else if ((err = sv_reload_start(srv)) < 0) {
    /* it printed why */
  }
  if (err < 0) {
    /* the reason is on stderr already */
  } else if (!srv->pool) {
    sv_log(SV_LOG_ERROR, "cannot start %d worker threads", cfg->threads);
    err = DISPATCH_ENOMEM;
  } else {
    uv_tcp_init(&srv->loop, &srv->listener);
    srv->listener.data = srv;
    /* the address sv_config_parse resolved and judged */
    rc = uv_tcp_bind(&srv->listener,
                     (const struct sockaddr *)&cfg->listen_addr, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&srv->listener, 128,
                                on_connection);
    if (rc < 0) {
      sv_log(SV_LOG_ERROR, "cannot listen on %s:%d: %s", cfg->host,
             cfg->port, uv_strerror(rc));
      uv_close((uv_handle_t *)&srv->listener, NULL);
      err = DISPATCH_EIO;
    } else if ((err = sv_metrics_start(srv)) < 0) {
      uv_close((uv_handle_t *)&srv->listener, NULL);
    }
  }
  if (err < 0) {
    sv_metrics_loop_close(srv);
    sv_metrics_stop(srv);
    if (srv->pool) sv_pool_close(srv->pool);
    uv_run(&srv->loop, UV_RUN_DEFAULT);
    uv_loop_close(&srv->loop);
    dsp_ctx_free(srv->io_ctx);
    sv_devices_close(&srv->g);
    dsp_budget_unref(srv->g.mem);
    sv_tls_ctx_free(srv->tls);
    sv_reload_free(srv);
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
  uv_timer_init(&srv->loop, &srv->drain);
  srv->drain.data = srv;
  uv_idle_init(&srv->loop, &srv->spin);
  srv->spin.data = srv;
  uv_signal_init(&srv->loop, &srv->sigint);
  uv_signal_init(&srv->loop, &srv->sigterm);
  srv->sigint.data = srv->sigterm.data = srv;
  uv_signal_start(&srv->sigint, on_signal, SIGINT);
  uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
  sv_reload_listen(srv); /* SIGHUP */
  printf("dispatch-server listening on %s:%d\n", ip, port);
  sv_log(SV_LOG_INFO, "listening on %s:%d with %d worker threads%s%s%s", ip,
         port, cfg->threads,
         srv->tls ? ", TLS" : ", plain TCP (no TLS)",
         cfg->tls_client_ca ? " with client certificates" : "",
         cfg->token ? ", token required" : "");
  sv_metrics_announce(srv); /* its stdout line after the listening one */
  fflush(stdout);

  char names[256];
  sv_device_names(&srv->g, names, sizeof names);
  if (cfg->device_memory)
    sv_log(SV_LOG_INFO, "devices: %s (each %llu bytes of --device-memory)",
           names, (unsigned long long)cfg->device_memory);
  else
    sv_log(SV_LOG_INFO, "devices: %s (together within --max-memory)", names);
  if (*sv_devices_note())
    sv_log(SV_LOG_INFO, "devices: %s (%s)", names, sv_devices_note());

  uv_run(&srv->loop, UV_RUN_DEFAULT);

  sv_metrics_stop(srv); /* its thread reads the devices and counters */
  rc = uv_loop_close(&srv->loop);
  if (rc != 0) sv_log(SV_LOG_ERROR, "loop closed with live handles");
  dsp_ctx_free(srv->io_ctx);
  sv_devices_close(&srv->g);
  dsp_budget_unref(srv->g.mem);
  sv_tls_ctx_free(srv->tls);
  sv_reload_free(srv);
  dsp_free(srv);
  sv_log(SV_LOG_INFO, "shut down cleanly (storage cache held %zu bytes)",
         dsp_cpu_cache_bytes());
  return 0;
}
