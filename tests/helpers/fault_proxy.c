/* Fault-injection proxy (see fault_proxy.h). One libuv loop on its own
 * thread; every byte passes through pump(), which forwards it in pieces
 * that end at frame-part boundaries and at the next armed fault, so a
 * fault lands exactly at its offset whatever the socket reads return. */
#include "fault_proxy.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <uv.h>

#include "dispatch.pb-c.h"
#include "frame.h"

typedef struct fp_pair fp_pair;

typedef struct fp_side {
  fp_pair *pair;
  int dir;
  uint64_t count; /* bytes forwarded */
  /* frame parser */
  int st; /* 0 header, 1 message, 2 bulk */
  uint8_t hdr[DSP_FRAME_HEADER_SIZE];
  size_t hgot;
  uint8_t *msg;
  uint32_t mlen, mgot;
  uint64_t blen, bgot;
  uint64_t frame_no, frame_start;
  int body;
  int counts[64];
  /* bytes read, not yet forwarded */
  uint8_t *pend;
  size_t pend_len, pend_off;
  int held;          /* DELAY in progress */
  int64_t throttle;  /* bytes per second, 0: none */
  int64_t quota;     /* bytes the throttle lets through now */
  uv_timer_t timer;
} fp_side;

struct fp_pair {
  fault_proxy *fp;
  int idx;
  uv_tcp_t cli, srv;
  uv_connect_t creq;
  uv_timer_t ttimer;
  int connected, closing, handles;
  fp_side side[2]; /* [FP_C2S]: cli -> srv, [FP_S2C]: srv -> cli */
  int fired[FP_MAX_RULES];
  int64_t resolved[FP_MAX_RULES]; /* frame rules: the byte, once known */
  fp_pair *next;
};

struct fault_proxy {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t stop;
  pthread_t th;
  int port, server_port;
  fp_rule rules[FP_MAX_RULES];
  int n_rules;
  fp_pair *pairs;
  pthread_mutex_t mu;
  int n_conns, n_fired;
  char where[FP_MAX_RULES * 4][160];
};

static uv_stream_t *src_of(fp_side *s) {
  return (uv_stream_t *)(s->dir == FP_C2S ? &s->pair->cli : &s->pair->srv);
}
static uv_stream_t *dst_of(fp_side *s) {
  return (uv_stream_t *)(s->dir == FP_C2S ? &s->pair->srv : &s->pair->cli);
}

static void on_pair_handle_closed(uv_handle_t *h) {
  fp_pair *p = h->data;
  if (--p->handles > 0) return;
  fault_proxy *fp = p->fp;
  for (fp_pair **pp = &fp->pairs; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  for (int d = 0; d < 2; d++) {
    free(p->side[d].pend);
    free(p->side[d].msg);
  }
  free(p);
}

static void pair_close(fp_pair *p, int rst) {
  if (p->closing) return;
  p->closing = 1;
  if (rst) {
    struct linger lg = {1, 0};
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&p->cli, &fd) == 0)
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    if (p->connected && uv_fileno((uv_handle_t *)&p->srv, &fd) == 0)
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  }
  uv_close((uv_handle_t *)&p->cli, on_pair_handle_closed);
  uv_close((uv_handle_t *)&p->srv, on_pair_handle_closed);
  uv_close((uv_handle_t *)&p->ttimer, on_pair_handle_closed);
  /* the close callback finds the pair through data */
  p->side[0].timer.data = p->side[1].timer.data = p;
  uv_close((uv_handle_t *)&p->side[0].timer, on_pair_handle_closed);
  uv_close((uv_handle_t *)&p->side[1].timer, on_pair_handle_closed);
}

static const char *body_name(int dir, int body) {
  static const char *const req[] = {
      "none", "?", "hello", "upload", "op", "track", "backward", "grad",
      "free", "read", "sync", "stats", "bye", "step", "to_device"};
  static const char *const rep[] = {"?", "?", "?", "hello", "read", "stats"};
  if (body == FP_EMPTY_REPLY) return "empty reply";
  if (dir == FP_C2S)
    return body >= 0 && body < (int)(sizeof req / sizeof *req) ? req[body]
                                                                : "?";
  return body >= 0 && body < (int)(sizeof rep / sizeof *rep) ? rep[body] : "?";
}

static const char *action_name(fp_action a) {
  return a == FP_CUT ? "cut" : a == FP_RESET ? "reset"
         : a == FP_DELAY ? "delay" : "throttle";
}

static void pump(fp_side *s);

static void on_delay_over(uv_timer_t *t) {
  fp_side *s = t->data;
  s->held = 0;
  pump(s);
}

static void on_throttle_tick(uv_timer_t *t) {
  fp_side *s = t->data;
  s->quota += s->throttle / 100 > 0 ? s->throttle / 100 : 1;
  if (s->quota > s->throttle) s->quota = s->throttle;
  pump(s);
}

/* Applies rule r to the connection of s (the direction of the rule). */
static void fire(fp_side *s, int r) {
  fp_pair *p = s->pair;
  fault_proxy *fp = p->fp;
  const fp_rule *ru = &fp->rules[r];
  p->fired[r] = 1;
  pthread_mutex_lock(&fp->mu);
  if (fp->n_fired < (int)(sizeof fp->where / sizeof *fp->where)) {
    char *w = fp->where[fp->n_fired];
    size_t wl = sizeof fp->where[0];
    if (s->st == 2 || (s->st == 0 && s->hgot == 0 && s->frame_no))
      snprintf(w, wl,
               "conn %d: %s %s at byte %llu, frame %llu (%s), bulk byte "
               "%llu of %llu",
               p->idx, action_name(ru->action), s->dir ? "s2c" : "c2s",
               (unsigned long long)s->count,
               (unsigned long long)s->frame_no, body_name(s->dir, s->body),
               (unsigned long long)(s->st == 2 ? s->bgot : s->blen),
               (unsigned long long)s->blen);
    else
      snprintf(w, wl, "conn %d: %s %s at byte %llu (frame part %d)", p->idx,
               action_name(ru->action), s->dir ? "s2c" : "c2s",
               (unsigned long long)s->count, s->st);
  }
  fp->n_fired++;
  pthread_mutex_unlock(&fp->mu);
  switch (ru->action) {
  case FP_CUT:
  case FP_RESET:
    pair_close(p, ru->action == FP_RESET);
    break;
  case FP_DELAY:
    s->held = 1;
    uv_timer_start(&s->timer, on_delay_over, (uint64_t)ru->arg, 0);
    break;
  case FP_THROTTLE:
    s->throttle = ru->arg > 0 ? ru->arg : 1;
    s->quota = 0;
    uv_timer_start(&s->timer, on_throttle_tick, 10, 10);
    break;
  }
}

/* The next byte offset of s where a rule fires, -1 when none is armed. */
static int64_t next_trigger(fp_side *s, int *rule) {
  fp_pair *p = s->pair;
  fault_proxy *fp = p->fp;
  int64_t best = -1;
  for (int r = 0; r < fp->n_rules; r++) {
    const fp_rule *ru = &fp->rules[r];
    if (p->fired[r] || (int)ru->dir != s->dir ||
        (ru->conn >= 0 && ru->conn != p->idx))
      continue;
    int64_t at = ru->body > 0 ? p->resolved[r] : ru->at_byte;
    if (at < 0) continue;
    if (at < (int64_t)s->count) at = (int64_t)s->count;
    if (best < 0 || at < best) {
      best = at;
      *rule = r;
    }
  }
  return best;
}

/* A frame's message is complete: its kind is known, so the rules on the
 * nth frame of that kind get their byte. */
static void frame_known(fp_side *s) {
  if (s->dir == FP_C2S) {
    Dspwire__Request *r = dspwire__request__unpack(NULL, s->mlen, s->msg);
    s->body = r ? (int)r->body_case : -1;
    if (r) dspwire__request__free_unpacked(r, NULL);
  } else {
    Dspwire__Reply *r = dspwire__reply__unpack(NULL, s->mlen, s->msg);
    s->body = r ? (r->body_case ? (int)r->body_case : FP_EMPTY_REPLY) : -1;
    if (r) dspwire__reply__free_unpacked(r, NULL);
  }
  int slot = s->body == FP_EMPTY_REPLY ? 63 : s->body & 63;
  s->counts[slot]++;
  fp_pair *p = s->pair;
  fault_proxy *fp = p->fp;
  for (int r = 0; r < fp->n_rules; r++) {
    const fp_rule *ru = &fp->rules[r];
    if (p->fired[r] || ru->body != s->body || (int)ru->dir != s->dir ||
        (ru->conn >= 0 && ru->conn != p->idx) || s->counts[slot] != ru->nth)
      continue;
    p->resolved[r] = (int64_t)(s->frame_start + DSP_FRAME_HEADER_SIZE +
                               s->mlen + s->blen * (uint64_t)ru->pct / 100);
  }
}

/* How many bytes the parser takes before its next boundary. */
static size_t parser_room(const fp_side *s) {
  if (s->st == 0) return DSP_FRAME_HEADER_SIZE - s->hgot;
  if (s->st == 1) return s->mlen - s->mgot;
  uint64_t left = s->blen - s->bgot;
  return left > (1u << 30) ? (1u << 30) : (size_t)left;
}

static void parse(fp_side *s, const uint8_t *b, size_t n) {
  if (s->st == 0) {
    if (s->hgot == 0) s->frame_start = s->count;
    memcpy(s->hdr + s->hgot, b, n);
    s->hgot += n;
    if (s->hgot < DSP_FRAME_HEADER_SIZE) return;
    dsp_frame_header h;
    if (dsp_frame_header_decode(s->hdr, UINT32_MAX, UINT64_MAX, &h) < 0) {
      s->st = 3; /* not frames: forward blindly */
      return;
    }
    s->frame_no++;
    s->mlen = h.msg_len;
    s->blen = h.bulk_len;
    s->mgot = 0;
    s->bgot = 0;
    free(s->msg);
    s->msg = malloc(s->mlen ? s->mlen : 1);
    s->st = 1;
    if (s->mlen == 0) {
      frame_known(s);
      s->st = s->blen ? 2 : 0;
      s->hgot = 0;
    }
    return;
  }
  if (s->st == 1) {
    if (s->msg) memcpy(s->msg + s->mgot, b, n);
    s->mgot += (uint32_t)n;
    if (s->mgot < s->mlen) return;
    frame_known(s);
    s->st = s->blen ? 2 : 0;
    s->hgot = 0;
    return;
  }
  if (s->st == 2) {
    s->bgot += n;
    if (s->bgot == s->blen) {
      s->st = 0;
      s->hgot = 0;
    }
  }
}

static void on_written(uv_write_t *w, int status) {
  (void)status;
  free(w->data);
  free(w);
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *b) {
  (void)h;
  (void)hint;
  b->base = malloc(65536);
  b->len = b->base ? 65536 : 0;
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b);

/* Forwards what is pending as far as faults, delays and the throttle let
 * it, then reads on only when nothing is left pending. */
static void pump(fp_side *s) {
  fp_pair *p = s->pair;
  while (!p->closing && !s->held && s->pend_off < s->pend_len) {
    size_t k = s->pend_len - s->pend_off;
    if (s->st != 3) {
      size_t room = parser_room(s);
      if (room && room < k) k = room;
    }
    int r = -1;
    int64_t at = next_trigger(s, &r);
    if (at >= 0 && (uint64_t)at == s->count) {
      fire(s, r);
      continue;
    }
    if (at >= 0 && (uint64_t)at - s->count < k) k = (size_t)(at - s->count);
    if (s->throttle) {
      if (s->quota <= 0) return;
      if ((int64_t)k > s->quota) k = (size_t)s->quota;
      s->quota -= (int64_t)k;
    }
    uv_write_t *w = malloc(sizeof *w);
    uint8_t *copy = malloc(k);
    if (!w || !copy) {
      free(w);
      free(copy);
      pair_close(p, 0);
      return;
    }
    memcpy(copy, s->pend + s->pend_off, k);
    w->data = copy;
    uv_buf_t buf = uv_buf_init((char *)copy, (unsigned)k);
    if (uv_write(w, dst_of(s), &buf, 1, on_written) != 0) {
      free(copy);
      free(w);
      pair_close(p, 0);
      return;
    }
    if (s->st != 3) parse(s, s->pend + s->pend_off, k);
    s->pend_off += k;
    s->count += k;
    /* a fault exactly at the end of what was pending fires now */
    at = next_trigger(s, &r);
    if (at >= 0 && (uint64_t)at == s->count && s->pend_off == s->pend_len)
      fire(s, r);
  }
  if (p->closing) return;
  if (s->pend_off >= s->pend_len) {
    free(s->pend);
    s->pend = NULL;
    s->pend_len = s->pend_off = 0;
    uv_read_start(src_of(s), on_alloc, on_read);
  } else {
    uv_read_stop(src_of(s));
  }
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b) {
  fp_pair *p = st->data;
  fp_side *s = &p->side[st == (uv_stream_t *)&p->cli ? FP_C2S : FP_S2C];
  if (n < 0) {
    free(b->base);
    pair_close(p, 0); /* either side closed: so does the other */
    return;
  }
  if (n == 0 || p->closing) {
    free(b->base);
    return;
  }
  /* nothing is pending here: pump() stops reading until it is empty */
  free(s->pend);
  s->pend = (uint8_t *)b->base;
  s->pend_len = (size_t)n;
  s->pend_off = 0;
  pump(s);
}

static void on_time_rule(uv_timer_t *t) {
  fp_pair *p = t->data;
  fault_proxy *fp = p->fp;
  for (int r = 0; r < fp->n_rules; r++) {
    const fp_rule *ru = &fp->rules[r];
    if (p->fired[r] || ru->at_ms <= 0 || ru->at_byte >= 0 || ru->body > 0 ||
        (ru->conn >= 0 && ru->conn != p->idx))
      continue;
    fire(&p->side[ru->dir], r);
    if (!p->closing) pump(&p->side[ru->dir]);
    return;
  }
}

static void on_upstream(uv_connect_t *req, int status) {
  fp_pair *p = req->data;
  if (p->closing) return;
  if (status < 0) {
    pair_close(p, 0);
    return;
  }
  p->connected = 1;
  uv_read_start((uv_stream_t *)&p->cli, on_alloc, on_read);
  uv_read_start((uv_stream_t *)&p->srv, on_alloc, on_read);
  fault_proxy *fp = p->fp;
  int64_t first = -1;
  for (int r = 0; r < fp->n_rules; r++) {
    const fp_rule *ru = &fp->rules[r];
    if (ru->at_ms > 0 && ru->at_byte < 0 && ru->body <= 0 &&
        (ru->conn < 0 || ru->conn == p->idx) &&
        (first < 0 || ru->at_ms < first))
      first = ru->at_ms;
  }
  if (first > 0) uv_timer_start(&p->ttimer, on_time_rule, (uint64_t)first, 0);
}

static void on_accept(uv_stream_t *l, int status) {
  fault_proxy *fp = l->data;
  if (status < 0) return;
  fp_pair *p = calloc(1, sizeof *p);
  if (!p) return;
  p->fp = fp;
  uv_tcp_init(&fp->loop, &p->cli);
  uv_tcp_init(&fp->loop, &p->srv);
  uv_timer_init(&fp->loop, &p->ttimer);
  p->cli.data = p->srv.data = p->ttimer.data = p;
  for (int d = 0; d < 2; d++) {
    p->side[d].pair = p;
    p->side[d].dir = d;
    uv_timer_init(&fp->loop, &p->side[d].timer);
    p->side[d].timer.data = &p->side[d];
  }
  for (int r = 0; r < FP_MAX_RULES; r++) p->resolved[r] = -1;
  p->handles = 5;
  p->next = fp->pairs;
  fp->pairs = p;
  pthread_mutex_lock(&fp->mu);
  p->idx = fp->n_conns++;
  pthread_mutex_unlock(&fp->mu);
  if (uv_accept(l, (uv_stream_t *)&p->cli) != 0) {
    pair_close(p, 0);
    return;
  }
  uv_tcp_nodelay(&p->cli, 1);
  uv_tcp_nodelay(&p->srv, 1);
  struct sockaddr_in sa;
  uv_ip4_addr("127.0.0.1", fp->server_port, &sa);
  p->creq.data = p;
  if (uv_tcp_connect(&p->creq, &p->srv, (const struct sockaddr *)&sa,
                     on_upstream) != 0)
    pair_close(p, 0);
}

static void on_stop(uv_async_t *a) {
  fault_proxy *fp = a->data;
  for (fp_pair *p = fp->pairs; p; p = p->next) pair_close(p, 0);
  uv_close((uv_handle_t *)&fp->listener, NULL);
  uv_close((uv_handle_t *)&fp->stop, NULL);
}

static void *run(void *arg) {
  fault_proxy *fp = arg;
  uv_run(&fp->loop, UV_RUN_DEFAULT);
  return NULL;
}

fault_proxy *fp_start(int server_port, const fp_rule *rules, int n) {
  if (n < 0 || n > FP_MAX_RULES) return NULL;
  /* a write to a socket the client already closed must not kill the
   * test process */
  signal(SIGPIPE, SIG_IGN);
  fault_proxy *fp = calloc(1, sizeof *fp);
  if (!fp) return NULL;
  fp->server_port = server_port;
  if (n) memcpy(fp->rules, rules, (size_t)n * sizeof *rules);
  fp->n_rules = n;
  pthread_mutex_init(&fp->mu, NULL);
  uv_loop_init(&fp->loop);
  uv_tcp_init(&fp->loop, &fp->listener);
  fp->listener.data = fp;
  uv_async_init(&fp->loop, &fp->stop, on_stop);
  fp->stop.data = fp;
  struct sockaddr_in sa;
  uv_ip4_addr("127.0.0.1", 0, &sa);
  struct sockaddr_storage bound;
  int blen = sizeof bound;
  if (uv_tcp_bind(&fp->listener, (const struct sockaddr *)&sa, 0) != 0 ||
      uv_listen((uv_stream_t *)&fp->listener, 64, on_accept) != 0 ||
      uv_tcp_getsockname(&fp->listener, (struct sockaddr *)&bound, &blen) !=
          0 ||
      pthread_create(&fp->th, NULL, run, fp) != 0) {
    uv_close((uv_handle_t *)&fp->listener, NULL);
    uv_close((uv_handle_t *)&fp->stop, NULL);
    uv_run(&fp->loop, UV_RUN_DEFAULT);
    uv_loop_close(&fp->loop);
    pthread_mutex_destroy(&fp->mu);
    free(fp);
    return NULL;
  }
  fp->port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
  return fp;
}

int fp_port(const fault_proxy *p) { return p->port; }

int fp_fired(fault_proxy *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->n_fired;
  pthread_mutex_unlock(&p->mu);
  return n;
}

int fp_conns(fault_proxy *p) {
  pthread_mutex_lock(&p->mu);
  int n = p->n_conns;
  pthread_mutex_unlock(&p->mu);
  return n;
}

void fp_where(fault_proxy *p, int i, char *buf, size_t len) {
  pthread_mutex_lock(&p->mu);
  int ok = i >= 0 && i < p->n_fired &&
           i < (int)(sizeof p->where / sizeof *p->where);
  snprintf(buf, len, "%s", ok ? p->where[i] : "");
  pthread_mutex_unlock(&p->mu);
}

void fp_stop(fault_proxy *p) {
  if (!p) return;
  uv_async_send(&p->stop);
  pthread_join(p->th, NULL);
  uv_loop_close(&p->loop);
  pthread_mutex_destroy(&p->mu);
  free(p);
}
