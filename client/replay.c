/* Session resume on a REMOTE device: every request gets a seq and stays
 * in the replay log until a later waiting reply shows the server has it;
 * after a dropped connection the library reconnects with bounded
 * backoff, presents the resume token bound to its credentials, and sends
 * again what the server did not receive, so numbered requests run
 * exactly once. A large upload's bytes stand in the caller's buffer
 * until the server has them (log_take_ext copies them when a call must
 * return first). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/crypto.h>

#include "conn.h"
#include "wire_req.h"

/* Appends one frame to the replay log; 0 or -1 when out of memory. */
int dispatch__log_frame(dispatch__conn *c, uint64_t seq, const uint8_t *frame,
                        size_t flen, const void *bulk, size_t bulk_len) {
  size_t need = c->log_len + flen + bulk_len;
  if (need > c->log_cap) {
    size_t cap = c->log_cap ? c->log_cap : 4096;
    while (cap < need) cap *= 2;
    uint8_t *nb = dsp_realloc(c->log, cap);
    if (!nb) return -1;
    c->log = nb;
    c->log_cap = cap;
  }
  if (c->n_log == c->log_slots) {
    size_t n = c->log_slots ? c->log_slots * 2 : 64;
    uint64_t *ns = dsp_realloc(c->log_seq, n * sizeof *ns);
    if (ns) c->log_seq = ns;
    size_t *no = ns ? dsp_realloc(c->log_off, n * sizeof *no) : NULL;
    if (!no) return -1;
    c->log_off = no;
    c->log_slots = n;
  }
  c->log_seq[c->n_log] = seq;
  c->log_off[c->n_log++] = c->log_len;
  memcpy(c->log + c->log_len, frame, flen);
  if (bulk_len) memcpy(c->log + c->log_len + flen, bulk, bulk_len);
  c->log_len = need;
  return 0;
}

/* Forgets the logged frames up to seq: the server has received them. */
void dispatch__log_trim(dispatch__conn *c, uint64_t seq) {
  size_t k = 0;
  while (k < c->n_log && c->log_seq[k] <= seq) k++;
  if (k == 0) return;
  size_t off = k < c->n_log ? c->log_off[k] : c->log_len;
  memmove(c->log, c->log + off, c->log_len - off);
  c->log_len -= off;
  for (size_t i = k; i < c->n_log; i++) {
    c->log_seq[i - k] = c->log_seq[i];
    c->log_off[i - k] = c->log_off[i] - off;
  }
  c->n_log -= k;
  if (c->ext_bulk) {
    if (c->ext_seq <= seq) c->ext_bulk = NULL;
    else c->ext_at -= off;
  }
  if (c->log_cap > (1u << 20) && c->log_len < c->log_cap / 4) {
    uint8_t *nb = dsp_realloc(c->log, c->log_len > 4096 ? c->log_len : 4096);
    if (nb) {
      c->log = nb;
      c->log_cap = c->log_len > 4096 ? c->log_len : 4096;
    }
  }
}

/* A large upload's bytes still stand in the caller's buffer for the log
 * (ext_bulk): copies them into the log, as a call about to return
 * without the reply that acknowledges them must (the caller may free the
 * buffer). Without memory for it a later drop ends the session instead
 * of resuming it. */
void dispatch__log_take_ext(dispatch__conn *c) {
  if (!c->ext_bulk) return;
  size_t need = c->log_len + c->ext_len;
  uint8_t *nb = need > c->log_cap ? dsp_realloc(c->log, need) : c->log;
  if (!nb) {
    c->resumable = 0;
  } else {
    if (need > c->log_cap) c->log_cap = need;
    c->log = nb;
    memmove(c->log + c->ext_at + c->ext_len, c->log + c->ext_at,
            c->log_len - c->ext_at);
    memcpy(c->log + c->ext_at, c->ext_bulk, c->ext_len);
    /* the frames logged after the upload's start where its bytes go */
    for (size_t i = 0; i < c->n_log; i++)
      if (c->log_off[i] >= c->ext_at) c->log_off[i] += c->ext_len;
    c->log_len = need;
  }
  c->ext_bulk = NULL;
}

/* Total time a reconnect may take: the option or env, else the device's
 * timeout, never past the server's grace. */
static int resume_bound_ms(const dispatch__conn *c) {
  int64_t ms = c->resume_ms > 0 ? c->resume_ms : c->timeout_ms;
  if (ms <= 0) /* no wait bound: the server's grace, else 30 s */
    ms = c->grace_s ? (int64_t)c->grace_s * 1000 : 30000;
  if (c->grace_s && ms > (int64_t)c->grace_s * 1000)
    ms = (int64_t)c->grace_s * 1000;
  return (int)ms;
}

/* One reconnect attempt: connect (and TLS), hello with the resume token,
 * then the logged frames the server did not receive. 0, DISPATCH__EBROKEN (try
 * again), or a code that ends the session (ESESSION, EAUTH, EVERSION,
 * ENOMEM). */
static int resume_once(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  dispatch__drop_socket(c);
  int rc = dispatch__conn_open(dev, c->host, c->port, c->tls_o);
  if (rc < 0) {
    dispatch__drop_socket(c);
    return rc == DISPATCH_ENOMEM ? rc : DISPATCH__EBROKEN;
  }
  c->broken = 0;
  dsp_wreq w;
  Dspwire__Request *hello = dsp_wreq_hello(&w, DSP_PROTO_MAJOR,
                                            DSP_PROTO_MINOR, c->auth,
                                            c->name);
  w.body.hello.resume_token.data = c->token;
  w.body.hello.resume_token.len = c->token_len;
  w.body.hello.resume_ack = c->acked;
  w.body.hello.resume = 1;
  w.body.hello.keepalive_ms = c->ka_asked =
      dispatch__keepalive_for(c->timeout_ms);
  hello->req_id = c->next_id++;
  rc = dispatch__put_frame(dev, hello, NULL, 0);
  if (rc == 0) rc = dispatch__flush(dev);
  Dspwire__Reply *r = NULL;
  if (rc == 0)
    rc = dispatch__await_reply(dev, hello->req_id, NULL, 0, 0, &r, 0);
  if (rc == 0 && (r->body_case != DSPWIRE__REPLY__BODY_HELLO ||
                  !r->hello->resumed))
    rc = dsp_seterr(dev->ctx, DISPATCH_ESESSION,
                    "the server did not resume the session");
  uint64_t last = rc == 0 ? r->hello->last_seq : 0;
  if (rc == 0) c->ka_ms = r->hello->keepalive_ms;
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  if (rc < 0) return rc == DISPATCH_ECONN && !c->dead ? DISPATCH__EBROKEN : rc;
  if (last < c->acked || (c->n_log && last + 1 < c->log_seq[0]) ||
      last > c->seq)
    return dsp_seterr(dev->ctx, DISPATCH_ESESSION,
                      "the resumed session has received requests up to %llu, "
                      "this client sent up to %llu",
                      (unsigned long long)last, (unsigned long long)c->seq);
  dispatch__log_trim(c, last);
  size_t cut = c->ext_bulk ? c->ext_at : c->log_len;
  if (cut) rc = dispatch__send_all(dev, c->log, cut);
  if (rc == 0 && c->ext_bulk)
    rc = dispatch__send_all(dev, c->ext_bulk, c->ext_len);
  if (rc == 0 && c->log_len > cut)
    rc = dispatch__send_all(dev, c->log + cut, c->log_len - cut);
  return rc;
}

/* After the socket failed: reconnects with bounded exponential backoff
 * (20 ms doubling to 1 s) within resume_bound_ms and resumes the session.
 * 0, or the code the connection is now dead with (every later call gets
 * it too). */
int dispatch__reconnect(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (c->dead) return dispatch__check_alive(dev);
  if (c->resuming) return DISPATCH__EBROKEN;
  c->resuming = 1;
  char first[192];
  snprintf(first, sizeof first, "%s", c->dead_why);
  int64_t end = dispatch__now_ms() + resume_bound_ms(c);
  int backoff = 20, attempts = 0, rc;
  for (;;) {
    attempts++;
    rc = resume_once(dev);
    if (rc == 0 || (rc != DISPATCH__EBROKEN && rc != DISPATCH_ECONN) || c->dead)
      break;
    if (dispatch__now_ms() + backoff >= end) break;
    struct timespec ts = {backoff / 1000, (long)(backoff % 1000) * 1000000};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
    backoff = backoff * 2 > 1000 ? 1000 : backoff * 2;
  }
  c->resuming = 0;
  if (rc == 0) {
    c->broken = 0;
    c->resumes++;
    return 0;
  }
  int code =
      rc == DISPATCH__EBROKEN || rc == DISPATCH_ECONN ? DISPATCH_ECONN : rc;
  char why[192];
  if (code == DISPATCH_ECONN)
    snprintf(why, sizeof why, "%.80s; no resume within %d ms (%d attempts)",
             first, resume_bound_ms(c), attempts);
  else
    snprintf(why, sizeof why, "%.60s; resume refused: %.100s", first,
             dsp_ctx_errmsg(dev->ctx));
  c->resumable = 0;
  c->broken = 0;
  dispatch__drop_socket(c);
  dispatch__conn_dead(dev, why);
  c->dead_code = code;
  return dispatch__check_alive(dev);
}

static char *dup_or_null(const char *s, int *failed) {
  if (!s) return NULL;
  char *d = dsp_strdup(s);
  if (!d) *failed = 1;
  return d;
}

/* Keeps what a reconnect needs when the server offers resume and the
 * caller did not turn it off (option no_resume, env DISPATCH_RESUME=0). */
int dispatch__setup_resume(dispatch_device *dev, const Dspwire__HelloReply *h,
                           const char *host, const char *port,
                           const char *token, const char *client_name,
                           const dispatch_options *tls) {
  dispatch__conn *c = dev->conn;
  if (c->resume_ms <= 0) {
    const char *t = getenv("DISPATCH_RESUME_TIMEOUT_MS");
    long v = t ? strtol(t, NULL, 10) : 0;
    if (v > 0 && v < 86400000) c->resume_ms = (int)v;
  }
  if (c->resume_off || h->resume_token.len == 0 ||
      h->resume_token.len > sizeof c->token)
    return 0;
  int failed = 0;
  c->host = dup_or_null(host, &failed);
  c->port = dup_or_null(port, &failed);
  c->auth = dup_or_null(token, &failed);
  c->name = dup_or_null(client_name, &failed);
  if (tls) {
    c->tls_o = dsp_calloc(1, sizeof *c->tls_o);
    if (!c->tls_o) failed = 1;
    else {
      c->tls_o->ca_file = dup_or_null(tls->ca_file, &failed);
      c->tls_o->cert_file = dup_or_null(tls->cert_file, &failed);
      c->tls_o->key_file = dup_or_null(tls->key_file, &failed);
      c->tls_o->server_name = dup_or_null(tls->server_name, &failed);
    }
  }
  if (failed)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "%s: out of memory",
                      dev->spec);
  memcpy(c->token, h->resume_token.data, h->resume_token.len);
  c->token_len = h->resume_token.len;
  c->grace_s = h->session_grace;
  c->resumable = 1;
  return 0;
}
