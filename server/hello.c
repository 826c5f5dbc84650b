/* Hello and authentication: the first request of every connection. Until
 * it succeeds the reader refuses every other request (decode.c) and the
 * handshake timer runs. */
#include <openssl/crypto.h>
#include <stdio.h>
#include <string.h>

#include "conn.h"

/* Compares a token with the configured one in time that does not depend
 * on where they differ: a token of another length is compared against
 * the expected token itself, and the results are combined without
 * branching on content. */
int sv_token_matches(const char *want, size_t want_len, const char *tok) {
  size_t n = tok ? strlen(tok) : 0;
  int same_len = n == want_len;
  const char *cmp = same_len ? tok : want;
  int diff = CRYPTO_memcmp(cmp, want, want_len);
  return same_len & (diff == 0);
}

/* Answers a hello, or refuses the connection (version, token). */
void sv_hello(sv_conn *c, Dspwire__Request *req) {
  Dspwire__Hello *h = req->hello;
  const sv_config *cfg = c->srv->cfg;
  if (h->major != DSP_PROTO_MAJOR) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "protocol version mismatch: client speaks %u.%u, server speaks "
             "%d.%d",
             h->major, h->minor, DSP_PROTO_MAJOR, DSP_PROTO_MINOR);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer, "refused: %s", msg);
    sv_refuse(c, req->req_id, DISPATCH_EVERSION, msg);
    return;
  }
  /* the server's copy: SIGHUP may have replaced --token-file's */
  sv_server *srv = c->srv;
  if (srv->token && !sv_token_matches(srv->token, srv->token_len, h->token)) {
    int none = !h->token || !*h->token;
    atomic_fetch_add(&c->srv->g.protocol_errors, 1);
    char name[4 * SV_LOG_STR_MAX + 8];
    sv_log_conn(SV_LOG_WARN, c->id, c->peer,
                "refused: %s token from client '%s'", none ? "no" : "wrong",
                sv_log_str(name, sizeof name, h->client_name, SV_LOG_STR_MAX));
    sv_refuse(c, req->req_id, DISPATCH_EAUTH,
              none ? "authentication failed: this server requires a token "
                     "(none was sent)"
                   : "authentication failed: wrong token");
    return;
  }
  sv_global *g = &c->srv->g;
  const sv_device *dev = NULL;
  int resumed = 0, held;
  if (!h->resume_token.len && g->devices) {
    /* a new session's device is looked up first: a hello refused for it
     * must not have cost a detached session its place (below) */
    dev = h->device && *h->device ? sv_device_find(g, h->device)
                                  : &g->devices[0];
    if (!dev) {
      char names[256], want[4 * SV_LOG_STR_MAX + 8], msg[640];
      sv_device_names(g, names, sizeof names);
      sv_log_str(want, sizeof want, h->device, SV_LOG_STR_MAX);
      snprintf(msg, sizeof msg,
               "unknown device \"%s\": this server has %s", want, names);
      sv_log_conn(SV_LOG_WARN, c->id, c->peer, "refused: %s", msg);
      sv_refuse(c, req->req_id, DISPATCH_EDEVICE, msg);
      return;
    }
  }
  if (h->resume_token.len) {
    /* the session keeps its device; the token itself is never logged */
    char msg[256];
    sv_session *fresh;
    int rc = sv_resume_attach(c, h, &fresh, msg, sizeof msg);
    (void)fresh;
    if (rc < 0) {
      atomic_fetch_add(&g->protocol_errors, 1);
      sv_log(SV_LOG_WARN, "conn %llu (%s): refused: %s", c->id, c->peer, msg);
      sv_refuse(c, req->req_id, rc, msg);
      return;
    }
    resumed = 1;
    for (int i = 0; i < g->n_devices; i++)
      if (g->devices[i].be == c->sess->device) dev = &g->devices[i];
  } else if ((held = sv_resume_make_room(c)) > cfg->max_sessions) {
    /* detached sessions (kept for a resume) count towards the limit too,
     * or connecting and dropping would hold sessions past it, but they
     * never keep a new session out: past the limit they are expired to
     * make room; a resume (above) trades a detached session for a
     * connection and passes */
    char msg[192];
    sv_count_limit(g, SV_LIM_MAX_SESSIONS);
    snprintf(msg, sizeof msg, "server already holds %d sessions (limit)",
             held - 1);
    sv_log_conn(SV_LOG_WARN, c->id, c->peer, "refused: %s", msg);
    sv_refuse(c, req->req_id, DISPATCH_ELIMIT, msg);
    return;
  }
  if (!resumed) /* 1.7: what its client can name and be sent */
    c->sess->peer_minor = h->minor;
  if (!resumed && dev) {
    /* the session's device; the session has run nothing yet, so the loop
     * may still set its ctx */
    char why[320];
    int rc = sv_session_use_device(c->sess, dev, why, sizeof why);
    if (rc < 0) {
      sv_log(SV_LOG_WARN, "conn %llu (%s): refused: %s", c->id, c->peer, why);
      sv_refuse(c, req->req_id, rc, why);
      return;
    }
  }
  if (!resumed && h->resume && sv_resume_open(c, h->token) < 0) {
    sv_conn_close(c, "cannot make the session resumable");
    return;
  }
  const dsp_backend *be = dev ? dev->be : dsp_cpu_backend();
  Dspwire__DeviceInfo infos[SV_MAX_DEVICES], *ip[SV_MAX_DEVICES];
  /* the dtypes this client can name and read: f16 and bf16 only from 1.7
   * (a resumed session keeps the minor it was opened with) */
  char *dtypes[DSP_NDTYPES];
  size_t n_dtypes = 0;
  for (int i = 0; i < DSP_NDTYPES; i++)
    if (dsp_dtype_wire_minor(i) <= c->sess->peer_minor)
      dtypes[n_dtypes++] = (char *)dsp_dtype_name((dsp_dtype)i);
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__HelloReply hr = DSPWIRE__HELLO_REPLY__INIT;
  hr.major = DSP_PROTO_MAJOR;
  hr.minor = DSP_PROTO_MINOR;
  hr.server_version = DISPATCH_VERSION_STRING;
  hr.backend = (char *)dsp_backend_name(be);
  hr.device = (char *)dsp_backend_description(be);
  hr.n_dtypes = n_dtypes;
  hr.dtypes = dtypes;
  hr.max_frame = cfg->max_frame;
  hr.max_session_bytes = cfg->max_session_bytes;
  hr.max_rank = DSP_MAX_DIMS;
  hr.max_elements = cfg->max_elements;
  hr.max_queued = cfg->max_queued;
  hr.n_devices = sv_device_infos(g, infos, ip);
  hr.devices = ip;
  hr.session_device = dev ? (char *)dev->name : (char *)dsp_backend_name(be);
  hr.checkpoints = cfg->checkpoint_fd >= 0; /* 1.6 */
  if (c->sess->rs) {
    hr.resume_token.data = c->sess->rs->token;
    hr.resume_token.len = SV_RESUME_TOKEN;
    hr.resumed = resumed;
    hr.last_seq = c->sess->rs->last_seq;
    hr.session_grace = (uint32_t)cfg->session_grace_s;
  }
  /* 1.4: ticks start now; the reply says the interval used */
  hr.keepalive_ms = sv_keepalive_set(c, h->keepalive_ms);
  r.req_id = req->req_id;
  r.body_case = DSPWIRE__REPLY__BODY_HELLO;
  r.hello = &hr;
  uint8_t *buf;
  size_t len;
  if (sv_encode_reply(&r, NULL, 0, &buf, &len) < 0) {
    sv_conn_close(c, "out of memory for the hello reply");
    return;
  }
  c->hello_done = 1;
  uv_timer_stop(&c->hs);
  char name[4 * SV_LOG_STR_MAX + 8];
  sv_log_conn(SV_LOG_INFO, c->id, c->peer, "hello from '%s', protocol %u.%u%s",
              sv_log_str(name, sizeof name, h->client_name, SV_LOG_STR_MAX),
              h->major, h->minor, resumed ? ", session resumed" : "");
  sv_writer_queue(c, buf, len, NULL);
  if (resumed && !c->closing) sv_resume_push(c);
}
