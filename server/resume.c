/* Session resume: a session whose connection drops is detached instead of
 * freed, kept for --session-grace seconds with everything it holds (still
 * charged to its budgets and --max-memory), and attached to a new
 * connection whose hello presents its resume token with the credentials
 * that opened it. Sequence numbers make every request run once: the
 * session remembers the highest seq it received and the replies of waiting
 * requests the client has not acknowledged (bounded), so a request sent
 * again is not run again and a waiting one gets its original reply.
 *
 * Everything here runs on the loop thread. The token is a secret: it is
 * never logged.
 *
 * Detached sessions never keep a live client out: a new session that
 * would pass --max-sessions expires detached ones to make room
 * (sv_resume_make_room), and a resume of one of those is told so.
 *
 * Once a session is expired (grace, room, shutdown) its kept replies are
 * dropped and its teardown job is submitted: from then on the worker owns
 * what the session holds and releases s->queue, so the loop touches it no
 * more. A job still queued or running comes back with its reply, which
 * nobody will ask for: it is freed with the job, never kept. */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <string.h>

#include "conn.h"

/* The credentials a session was opened with, as one digest: the hello's
 * token and the client certificate's digest (zeros over plain TCP). */
static void cred_of(const char *token, const uint8_t cert[32],
                    uint8_t out[SV_RESUME_CRED]) {
  unsigned n = SV_RESUME_CRED;
  EVP_MD_CTX *m = EVP_MD_CTX_new();
  int ok = m && EVP_DigestInit_ex(m, EVP_sha256(), NULL) &&
           EVP_DigestUpdate(m, token ? token : "", token ? strlen(token) : 0) &&
           EVP_DigestUpdate(m, "\0", 1) &&
           EVP_DigestUpdate(m, cert, 32) &&
           EVP_DigestFinal_ex(m, out, &n);
  EVP_MD_CTX_free(m);
  if (!ok) memset(out, 0xff, SV_RESUME_CRED); /* matches no real digest */
}

/* ... of connection c, whose hello sent token. */
static void cred_digest(sv_conn *c, const char *token,
                        uint8_t out[SV_RESUME_CRED]) {
  uint8_t cert[32];
  sv_transport_peer_digest(c, cert);
  cred_of(token, cert, out);
}

int sv_resume_open(sv_conn *c, const char *token) {
  sv_server *srv = c->srv;
  if (srv->cfg->session_grace_s <= 0) return 0;
  sv_resume *rs = dsp_calloc(1, sizeof *rs);
  if (!rs) return DISPATCH_ENOMEM;
  if (RAND_bytes(rs->token, sizeof rs->token) != 1) {
    dsp_free(rs);
    return DISPATCH_EINTERNAL;
  }
  sv_transport_peer_digest(c, rs->cert);
  cred_of(token, rs->cert, rs->cred);
  rs->srv = srv;
  rs->sess = c->sess;
  rs->conn = c;
  rs->next = srv->resumable;
  if (rs->next) rs->next->prev = rs;
  srv->resumable = rs;
  c->sess->rs = rs;
  return 0;
}

/* Drops the kept replies and their charge (before a teardown, or when
 * the client acknowledged them). */
static void cache_drop(sv_resume *rs, uint64_t upto) {
  int k = 0;
  for (int i = 0; i < rs->n_cache; i++) {
    sv_rreply *e = &rs->cache[i];
    if (e->seq <= upto) {
      /* a stub was never charged: uncharging also drops a reference */
      if (e->charged) dsp_budget_uncharge(rs->sess->queue, e->charged);
      dsp_free(e->buf);
      dsp_pin_release(e->bulk);
    } else {
      rs->cache[k++] = *e;
    }
  }
  rs->n_cache = k;
}

void sv_resume_ack(sv_session *s, uint64_t ack) {
  if (s->rs && ack) cache_drop(s->rs, ack);
}

/* What stands for a reply that could not be kept: an error reply to the
 * same request, small enough to need no charge. */
static void keep_stub(sv_resume *rs, uint64_t seq, uint64_t req_id,
                      size_t len, const char *why) {
  char msg[384];
  snprintf(msg, sizeof msg,
           "the reply to this request (%zu bytes) was lost with the "
           "connection: it was not kept for a resume (%s)", len, why);
  uint8_t *buf;
  size_t n;
  if (sv_encode_error(req_id, DISPATCH_EQUOTA, msg, 0, &buf, &n) < 0) return;
  rs->cache[rs->n_cache++] = (sv_rreply){seq, buf, n, NULL, 0};
}

void sv_resume_keep(sv_session *s, uint64_t seq, uint64_t req_id,
                    const uint8_t *buf, size_t len, dsp_pin *bulk) {
  sv_resume *rs = s->rs;
  if (!rs || !seq) return;
  char why[256];
  size_t total = len + (bulk ? dsp_pin_nbytes(bulk) : 0);
  if (rs->n_cache == SV_RESUME_CACHE) cache_drop(rs, rs->cache[0].seq);
  if (dsp_budget_charge_why(s->queue, len, "kept reply", why, sizeof why) < 0) {
    sv_log(SV_LOG_WARN, "session: reply to seq %llu not kept for a resume: %s",
           (unsigned long long)seq, why);
    keep_stub(rs, seq, req_id, total, why);
    return;
  }
  uint8_t *copy = dsp_malloc(len);
  if (!copy) {
    dsp_budget_uncharge(s->queue, len);
    keep_stub(rs, seq, req_id, total, "out of memory");
    return;
  }
  memcpy(copy, buf, len);
  rs->cache[rs->n_cache++] =
      (sv_rreply){seq, copy, len, dsp_pin_retain(bulk), len};
}

/* Queues kept reply e on c again: 0, or DISPATCH_ENOMEM. */
static int requeue(sv_conn *c, const sv_rreply *e) {
  uint8_t *copy = dsp_malloc(e->len);
  if (!copy) return DISPATCH_ENOMEM;
  memcpy(copy, e->buf, e->len);
  sv_writer_queue(c, copy, e->len, dsp_pin_retain(e->bulk));
  return 0;
}

int sv_resume_resend(sv_conn *c, uint64_t seq) {
  sv_resume *rs = c->sess->rs;
  for (int i = 0; rs && i < rs->n_cache; i++) {
    if (rs->cache[i].seq != seq) continue;
    return requeue(c, &rs->cache[i]) < 0 ? DISPATCH_ENOMEM : 1;
  }
  return 0;
}

static void unlink_rs(sv_resume *rs) {
  sv_server *srv = rs->srv;
  if (rs->prev) rs->prev->next = rs->next;
  else if (srv->resumable == rs) srv->resumable = rs->next;
  if (rs->next) rs->next->prev = rs->prev;
  rs->prev = rs->next = NULL;
}

/* Frees a session nobody resumed: its teardown job runs behind whatever
 * it still has queued, and sv_resume_done frees the rest. */
static void expire(sv_resume *rs, const char *why) {
  sv_server *srv = rs->srv;
  unlink_rs(rs);
  rs->expired = 1;
  atomic_fetch_sub(&srv->g.sessions_detached, 1);
  atomic_fetch_add(&srv->g.sessions_expired, 1);
  sv_log(SV_LOG_INFO, "detached session freed (%s)", why);
  cache_drop(rs, UINT64_MAX);
  sv_job *t = rs->teardown;
  rs->teardown = NULL;
  sv_session_cancel(rs->sess);
  sv_pool_submit(srv->pool, t);
}

/* SHA-256 of a resume token: what the record of an evicted session
 * keeps instead of the token itself. */
static void token_digest(const uint8_t *token, size_t len, uint8_t out[32]) {
  unsigned n = 32;
  if (EVP_Digest(token, len, out, &n, EVP_sha256(), NULL) != 1)
    memset(out, 0xff, 32); /* matches no recorded digest (a miss) */
}

/* The detached session to expire for a new one: one whose connection the
 * server closed for a limit before any a client dropped, and among those
 * the one detached longest ago. NULL when none is detached. */
static sv_resume *victim(sv_server *srv) {
  sv_resume *best = NULL;
  for (sv_resume *rs = srv->resumable; rs; rs = rs->next) {
    if (rs->conn) continue;
    if (!best || rs->limit_closed > best->limit_closed ||
        (rs->limit_closed == best->limit_closed &&
         rs->detach_no < best->detach_no))
      best = rs;
  }
  return best;
}

/* Expires rs to make room for a new session: counted, and remembered (the
 * digest of its token) so that its resume is told why. */
static void evict(sv_resume *rs) {
  sv_server *srv = rs->srv;
  uint64_t grace_ms = (uint64_t)srv->cfg->session_grace_s * 1000;
  uint64_t now = uv_now(&srv->loop), since = now + grace_ms - rs->deadline;
  struct sv_evicted *e = &srv->evicted[srv->n_evicted++ % SV_EVICTED_KEPT];
  token_digest(rs->token, sizeof rs->token, e->token_digest);
  e->detached_ms = since;
  e->limit_closed = rs->limit_closed;
  atomic_fetch_add_explicit(&srv->g.m.evicted[rs->limit_closed ? 0 : 1], 1,
                            memory_order_relaxed);
  sv_log(SV_LOG_WARN, "detached session expired after %llu ms to make room "
         "for a new session (--max-sessions %d)%s",
         (unsigned long long)since, srv->cfg->max_sessions,
         rs->limit_closed ? "; the server had closed its connection" : "");
  expire(rs, "to make room for a new session");
}

int sv_resume_make_room(sv_conn *c) {
  sv_server *srv = c->srv;
  int max = srv->cfg->max_sessions, live = 0;
  /* a connection closing (its session freed or detached) is no client:
   * it must not cost a detached session its place */
  for (sv_conn *o = srv->conns; o; o = o->next) live += !o->closing;
  for (;;) {
    int held = live + (int)atomic_load(&srv->g.sessions_detached);
    sv_resume *rs = held > max ? victim(srv) : NULL;
    if (!rs) return held;
    evict(rs);
  }
}

/* The record of an evicted session whose token this is, or NULL. */
static const struct sv_evicted *evicted_find(sv_server *srv,
                                             const uint8_t *token,
                                             size_t len) {
  uint8_t d[32];
  token_digest(token, len, d);
  unsigned n = srv->n_evicted < SV_EVICTED_KEPT ? srv->n_evicted
                                                : SV_EVICTED_KEPT;
  const struct sv_evicted *found = NULL;
  for (unsigned i = 0; i < n; i++)
    if (CRYPTO_memcmp(srv->evicted[i].token_digest, d, sizeof d) == 0)
      found = &srv->evicted[i];
  return found;
}

static void on_sweep(uv_timer_t *t) {
  sv_server *srv = t->data;
  uint64_t now = uv_now(&srv->loop);
  int left = 0;
  for (sv_resume *rs = srv->resumable, *next; rs; rs = next) {
    next = rs->next;
    if (rs->conn) continue;
    if (now >= rs->deadline) expire(rs, "not resumed within --session-grace");
    else left = 1;
  }
  if (!left) uv_timer_stop(t);
}

int sv_resume_detach(sv_conn *c) {
  sv_session *s = c->sess;
  sv_resume *rs = s ? s->rs : NULL;
  sv_server *srv = c->srv;
  if (!rs || !c->hello_done || c->close_after_flush || srv->shutting_down)
    return 0;
  if (!srv->sweep_open) {
    uv_timer_init(&srv->loop, &srv->sweep);
    srv->sweep.data = srv;
    srv->sweep_open = 1;
  }
  /* an upload cut short never runs: its bytes leave the queue count */
  if (c->bulk_job) atomic_fetch_sub(&s->queued_bytes,
                                    (long long)c->bulk_job->upload_bytes);
  rs->conn = NULL;
  rs->limit_closed = c->limit_closed;
  rs->detach_no = ++srv->n_detaches;
  rs->inflight = c->inflight;
  rs->teardown = c->teardown;
  rs->deadline = uv_now(&srv->loop) + (uint64_t)srv->cfg->session_grace_s * 1000;
  c->teardown = NULL;
  c->teardown_done = 1; /* the session is the server's now, not c's */
  c->sess = NULL;
  s->owner = NULL;
  srv->n_held++;
  atomic_fetch_add(&srv->g.sessions_detached, 1);
  if (!uv_is_active((uv_handle_t *)&srv->sweep)) {
    uint64_t tick = (uint64_t)srv->cfg->session_grace_s * 250;
    if (tick > 500) tick = 500;
    if (tick < 50) tick = 50;
    uv_timer_start(&srv->sweep, on_sweep, tick, tick);
  }
  sv_log(SV_LOG_INFO, "conn %llu (%s): session detached, kept %d s for a "
         "resume (%u requests still queued)", c->id, c->peer,
         srv->cfg->session_grace_s, rs->inflight);
  return 1;
}

int sv_resume_rebind(sv_server *srv, const char *old, const char *fresh) {
  int n = 0;
  for (sv_resume *rs = srv->resumable; rs; rs = rs->next) {
    uint8_t was[SV_RESUME_CRED];
    cred_of(old, rs->cert, was);
    if (CRYPTO_memcmp(was, rs->cred, sizeof was) != 0) continue;
    cred_of(fresh, rs->cert, rs->cred);
    n++;
  }
  return n;
}

int sv_resume_attach(sv_conn *c, const Dspwire__Hello *h, sv_session **out,
                     char *msg, size_t len) {
  sv_server *srv = c->srv;
  sv_resume *rs = NULL;
  *out = NULL;
  if (h->resume_token.len == SV_RESUME_TOKEN)
    for (sv_resume *r = srv->resumable; r; r = r->next)
      if (CRYPTO_memcmp(r->token, h->resume_token.data, SV_RESUME_TOKEN) == 0)
        rs = r;
  const struct sv_evicted *ev =
      rs || !h->resume_token.len
          ? NULL
          : evicted_find(srv, h->resume_token.data, h->resume_token.len);
  if (ev) {
    snprintf(msg, len,
             "resume refused: the session was expired to make room for a "
             "new client (the server was at --max-sessions %d; the session "
             "had been detached %.1f s%s)",
             srv->cfg->max_sessions, (double)ev->detached_ms / 1000,
             ev->limit_closed ? ", its connection closed by the server"
                              : "");
    return DISPATCH_ESESSION;
  }
  if (!rs) {
    snprintf(msg, len,
             "resume refused: no session waits for this token (a detached "
             "session is freed after --session-grace %d s)",
             srv->cfg->session_grace_s);
    return DISPATCH_ESESSION;
  }
  uint8_t cred[SV_RESUME_CRED];
  cred_digest(c, h->token, cred);
  if (CRYPTO_memcmp(cred, rs->cred, SV_RESUME_CRED) != 0) {
    snprintf(msg, len, "resume refused: the session was opened with other "
                       "credentials (token or client certificate)");
    return DISPATCH_EAUTH;
  }
  if (rs->conn) /* the old connection's drop has not been seen yet */
    sv_conn_close(rs->conn, "its session resumed on a new connection");
  if (rs->conn) {
    snprintf(msg, len, "resume refused: the session is still in use");
    return DISPATCH_ESESSION;
  }
  sv_session *fresh = c->sess;
  sv_job *fresh_td = c->teardown;
  c->sess = rs->sess;
  c->sess->owner = c;
  c->teardown = rs->teardown;
  c->inflight = rs->inflight;
  rs->teardown = NULL;
  rs->conn = c;
  srv->n_held--;
  atomic_fetch_sub(&srv->g.sessions_detached, 1);
  atomic_fetch_add(&srv->g.sessions_resumed, 1);
  /* the session this connection opened with is not needed */
  fresh->owner = NULL;
  sv_pool_submit(srv->pool, fresh_td);
  *out = fresh;
  cache_drop(rs, h->resume_ack);
  return 0;
}

void sv_resume_push(sv_conn *c) {
  sv_resume *rs = c->sess->rs;
  for (int i = 0; rs && i < rs->n_cache && !c->closing; i++)
    if (requeue(c, &rs->cache[i]) < 0) {
      sv_conn_close(c, "out of memory resending a reply");
      return;
    }
}

void sv_resume_before_teardown(sv_session *s) {
  if (!s->rs) return;
  cache_drop(s->rs, UINT64_MAX);
}

sv_server *sv_resume_done(sv_job *j) {
  sv_session *s = j->sess;
  sv_resume *rs = s->rs;
  sv_server *srv = rs->srv;
  if (j->kind == SV_JOB_TEARDOWN) {
    unlink_rs(rs);
    dsp_free(rs);
    dsp_free(s);
    srv->n_held--;
  } else {
    rs->inflight--;
    /* the client waits for this reply: kept until it resumes; an expired
     * session's is freed with the job (its teardown, maybe running now,
     * releases the queue budget a kept reply would be charged to) */
    if (!rs->expired && j->out && sv_req_waits(j->req))
      sv_resume_keep(s, j->req->seq, j->req->req_id, j->out, j->out_len,
                     j->out_pin);
  }
  sv_job_free(j);
  return srv;
}

void sv_resume_forget(sv_session *s) {
  if (!s->rs) return;
  unlink_rs(s->rs);
  dsp_free(s->rs);
  s->rs = NULL;
}

void sv_resume_shutdown(sv_server *srv) {
  for (sv_resume *rs = srv->resumable, *next; rs; rs = next) {
    next = rs->next;
    if (!rs->conn) expire(rs, "server shutting down");
  }
  if (srv->sweep_open) {
    srv->sweep_open = 0;
    uv_close((uv_handle_t *)&srv->sweep, NULL);
  }
}
