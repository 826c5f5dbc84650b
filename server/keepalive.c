/* Keepalive (protocol 1.4): a client waiting for a reply must tell a
 * server that works on its requests from one that went silent (stopped,
 * partitioned, its host gone). Without a sign of life the only bound it
 * had was its reply timeout over the whole queued backlog, so a busy,
 * healthy session looked lost. A client that asks for it in its hello
 * (Hello.keepalive_ms) gets an empty Reply{keepalive} whenever a tick of
 * its interval finds the session with requests queued or running and
 * nothing written to it since the previous tick: so it hears something
 * at least every two intervals while it has work in flight, and nothing
 * extra while replies flow or the session is idle. At most one keepalive
 * waits in the reply queue (none is queued behind unsent frames), so a
 * client that stops reading is not sent more. */
#include "conn.h"

/* the floor: a client cannot make the server tick faster than this */
#define SV_KEEPALIVE_MIN_MS 20u
#define SV_KEEPALIVE_MAX_MS 3600000u

static void on_tick(uv_timer_t *t) {
  sv_conn *c = t->data;
  if (c->closing || !c->hello_done) return;
  if (c->sent != c->ka_sent) { /* the client is hearing from us anyway */
    c->ka_sent = c->sent;
    return;
  }
  if (c->inflight == 0 || !sv_writer_idle(c)) return;
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  r.keepalive = 1;
  uint8_t *buf;
  size_t len;
  if (sv_encode_reply(&r, NULL, 0, &buf, &len) < 0) return; /* next tick */
  sv_writer_queue(c, buf, len, NULL);
}

void sv_keepalive_init(sv_conn *c) {
  uv_timer_init(&c->srv->loop, &c->ka);
  c->ka.data = c;
}

uint32_t sv_keepalive_set(sv_conn *c, uint32_t ms) {
  if (c->closing) return 0;
  if (ms == 0) {
    uv_timer_stop(&c->ka);
    c->ka_ms = 0;
    return 0;
  }
  if (ms < SV_KEEPALIVE_MIN_MS) ms = SV_KEEPALIVE_MIN_MS;
  if (ms > SV_KEEPALIVE_MAX_MS) ms = SV_KEEPALIVE_MAX_MS;
  if (ms != c->ka_ms) {
    c->ka_ms = ms;
    c->ka_sent = c->sent;
    uv_timer_start(&c->ka, on_tick, ms, ms);
  }
  return ms;
}

void sv_keepalive_close(sv_conn *c, uv_close_cb cb) {
  uv_close((uv_handle_t *)&c->ka, cb);
}
