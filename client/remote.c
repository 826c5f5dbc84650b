/* The wire side of a REMOTE device: one blocking TCP socket, a send buffer
 * that batches fire-and-forget requests, and waits bounded by poll()
 * deadlines so a lost server gives DISPATCH_ECONN instead of a hang.
 *
 * Waits (protocol 1.4): a server that works on the session's requests
 * sends keepalives, so a wait tells silence from slowness by the
 * connection: no bytes at all for the timeout is a lost connection (and
 * a resume), while a reply that is not there by the wait's deadline from
 * a server that is heard from gives DISPATCH_ETIMEDOUT and leaves the
 * session as it was: the request stays pending (pend_id) and the next
 * wait takes its reply first (as its own, when it asks the same thing
 * with nothing sent in between). An older server sends no keepalives: a
 * reply not there within the timeout then loses the connection, as
 * before.
 *
 * Request ids: one counter per connection hands out tensor ids, gradient
 * container ids and request ids, and a request that creates a tensor uses
 * the new tensor's id as its req_id. A server error's failed_req_id thus
 * names the tensor to poison without a table of pending requests. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "client_internal.h"
#include "dispatch.pb-c.h"
#include "frame.h"
#include "op_record.h"
#include "wire_req.h"

#define MAX_REPLY_MSG (64u << 20)
#define FLUSH_AT (1u << 20)  /* send the buffer once this much is queued */
#define BULK_INLINE (64u << 10) /* larger bulk skips the buffer */
#define SEND_PIECE ((size_t)1 << 20)
#define REMOTE_RBUF (16u << 10) /* receive buffer of a plain connection */
/* The replay log is acknowledged by the next waiting reply; past this
 * many bytes a Sync is sent so it cannot grow without bound. */
#define LOG_SYNC_AT (64u << 20)
/* Upload bytes up to this are copied into the log; a larger upload keeps
 * the caller's buffer and is acknowledged (a Sync) before it returns. */
#define LOG_COPY_MAX (1u << 20)
/* Internal: the socket is gone but the session may be resumed. Never
 * returned to a caller. */
#define EBROKEN (-1000)

/* Set when protobuf-c's unpack failed for memory rather than bad bytes
 * (unpack returns NULL for both). */
static _Thread_local int g_pb_oom;

static void *pb_alloc(void *ud, size_t n) {
  (void)ud;
  void *p = dsp_malloc(n);
  if (!p) g_pb_oom = 1;
  return p;
}
static void pb_free(void *ud, void *p) {
  (void)ud;
  dsp_free(p);
}
static ProtobufCAllocator g_pb_alloc = {pb_alloc, pb_free, NULL};

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The deadline of a wait or send starting now: timeout_ms 0 is no bound. */
static int64_t deadline_in(const dispatch__conn *c) {
  return c->timeout_ms > 0 ? now_ms() + c->timeout_ms : INT64_MAX;
}

/* A poll timeout for left ms (negative: none). */
static int poll_ms(int64_t left) {
  if (left < 0) return -1;
  return left > (1 << 30) ? (1 << 30) : (int)left;
}

/* The message of the server's going-away frame when one is waiting
 * unread (plain TCP: the bytes left in rbuf and what the socket holds
 * now), so a send that failed because the server had already closed
 * still reports the shutdown rather than a lost connection. 1 with the
 * message in why, else 0. TLS connections are not looked at: their
 * records are OpenSSL's to read. */
static int goodbye_waiting(dispatch__conn *c, char *why, size_t len) {
  if (c->ssl || c->fd < 0 || !c->rbuf) return 0;
  uint8_t buf[4096];
  size_t n = c->rlen > c->rpos ? c->rlen - c->rpos : 0;
  if (n > sizeof buf) n = sizeof buf;
  memcpy(buf, c->rbuf + c->rpos, n);
  while (n < sizeof buf) {
    ssize_t r = recv(c->fd, buf + n, sizeof buf - n, MSG_DONTWAIT);
    if (r <= 0) break;
    n += (size_t)r;
  }
  size_t off = 0;
  while (n - off >= DSP_FRAME_HEADER_SIZE) {
    dsp_frame_header h;
    if (dsp_frame_header_decode(buf + off, MAX_REPLY_MSG, UINT64_MAX, &h) < 0)
      return 0;
    size_t body = n - off - DSP_FRAME_HEADER_SIZE;
    if (h.msg_len > body) return 0;
    Dspwire__Reply *r = dspwire__reply__unpack(
        &g_pb_alloc, h.msg_len, buf + off + DSP_FRAME_HEADER_SIZE);
    if (!r) return 0;
    int bye = r->error && r->error->code == DISPATCH_ESHUTDOWN;
    if (bye)
      snprintf(why, len, "%s", r->error->message ? r->error->message : "");
    dspwire__reply__free_unpacked(r, &g_pb_alloc);
    if (bye) return 1;
    if (h.bulk_len > body - h.msg_len) return 0;
    off += DSP_FRAME_HEADER_SIZE + h.msg_len + (size_t)h.bulk_len;
  }
  return 0;
}

/* Closes the socket (and TLS session) and forgets bytes in flight. */
static void drop_socket(dispatch__conn *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  if (c->ssl || c->ssl_ctx) dispatch__tls_close(c);
  c->len = 0;
  c->rpos = c->rlen = 0;
}

/* The error a dead connection reports: the server's goodbye
 * (DISPATCH_ESHUTDOWN), a refused resume (its code), else a lost
 * connection (DISPATCH_ECONN), each with the first reason. */
static int dead_error(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (c->dead_code == DISPATCH_ESHUTDOWN)
    return dsp_seterr(dev->ctx, DISPATCH_ESHUTDOWN,
                      "%s: the server is shutting down: %s", dev->spec,
                      c->dead_why);
  return dsp_seterr(dev->ctx, c->dead_code ? c->dead_code : DISPATCH_ECONN,
                    "connection to %s lost: %s", dev->spec, c->dead_why);
}

/* Marks the connection gone for good: the socket is closed, queued bytes
 * dropped, and every later call reports code with the first reason. */
static int conn_down(dispatch_device *dev, int code, const char *why) {
  dispatch__conn *c = dev->conn;
  if (!c->dead) {
    c->dead = 1;
    c->dead_code = code;
    c->broken = 0;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->len = 0;
    c->rpos = c->rlen = 0;
    c->n_free_ids = c->n_free_grads = 0;
    snprintf(c->dead_why, sizeof c->dead_why, "%s", why);
  }
  return dead_error(dev);
}

static int conn_dead(dispatch_device *dev, const char *why) {
  return conn_down(dev, DISPATCH_ECONN, why);
}

/* The socket failed (an error, EOF). The server's goodbye waiting unread
 * makes it a shutdown, for good (a draining server takes no resume); a
 * resumable session otherwise only loses the socket (EBROKEN: the caller
 * reconnects); else the connection is dead. */
static int conn_lost(dispatch_device *dev, const char *why) {
  dispatch__conn *c = dev->conn;
  char bye[192];
  if (!c->dead && !c->broken && goodbye_waiting(c, bye, sizeof bye))
    return conn_down(dev, DISPATCH_ESHUTDOWN, bye);
  if (!c->resumable || c->dead || c->closing) return conn_dead(dev, why);
  if (!c->broken) snprintf(c->dead_why, sizeof c->dead_why, "%s", why);
  drop_socket(c);
  c->broken = 1;
  return EBROKEN;
}

static int check_alive(dispatch_device *dev) {
  if (dev->conn->broken) return EBROKEN;
  if (!dev->conn->dead) return 0;
  return dead_error(dev);
}

/* While a send waits on a server that reads nothing (busy with the
 * session's queue, its reading paused), the server's keepalives say it is
 * alive: they are read into rbuf, after what it holds, for the next wait
 * to parse. 1 when bytes came, 0 when none (or rbuf is full), -1 at EOF
 * or an error (the caller loses the connection). */
static int take_early_bytes(dispatch__conn *c) {
  if (c->rpos > 0) {
    memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
    c->rlen -= c->rpos;
    c->rpos = 0;
  }
  if (c->rlen == REMOTE_RBUF) return 0;
  ssize_t r = recv(c->fd, c->rbuf + c->rlen, REMOTE_RBUF - c->rlen,
                   MSG_DONTWAIT);
  if (r > 0) {
    c->rlen += (size_t)r;
    c->heard_ms = now_ms();
    return 1;
  }
  if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
    return 0;
  return -1;
}

/* Writes all n bytes or loses the connection; each poll waits at most
 * the remaining time to the deadline. With keepalives (plain TCP) the
 * timeout bounds silence, not the send: bytes the socket takes or the
 * server sends (its keepalives while it is too busy to read) start it
 * again. */
static int send_all(dispatch_device *dev, const void *p, size_t n) {
  dispatch__conn *c = dev->conn;
  const uint8_t *b = p;
  int64_t deadline = deadline_in(c);
  int ka = c->ka_ms && c->rbuf && c->timeout_ms > 0;
  if (ka) c->heard_ms = now_ms(); /* silence counts from here */
  if (c->ssl) {
    char why[384];
    if (dispatch__tls_write(c, p, n, deadline, why, sizeof why) < 0)
      return conn_lost(dev, why);
    return 0;
  }
  while (n > 0) {
    /* in pieces of at most SEND_PIECE, as the server writes a Read's
     * bytes (server/conn.h SV_WRITE_PIECE) */
    ssize_t w = send(c->fd, b, n < SEND_PIECE ? n : SEND_PIECE,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      b += w;
      n -= (size_t)w;
      if (ka) deadline = deadline_in(c); /* the server takes bytes */
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      char why[128];
      snprintf(why, sizeof why, "send: %s", strerror(errno));
      return conn_lost(dev, why);
    }
    int64_t now = now_ms(), end = deadline;
    if (ka && c->heard_ms + c->timeout_ms > end)
      end = c->heard_ms + c->timeout_ms;
    if (end - now <= 0) return conn_lost(dev, "send timed out");
    short ev = ka && c->rlen - c->rpos < REMOTE_RBUF ? POLLOUT | POLLIN
                                                      : POLLOUT;
    struct pollfd pfd = {c->fd, ev, 0};
    int pr = poll(&pfd, 1, poll_ms(end - now));
    if (pr < 0 && errno != EINTR) return conn_lost(dev, "poll failed");
    if (pr > 0 && (pfd.revents & POLLIN) && take_early_bytes(c) < 0)
      return conn_lost(dev, "the server closed the connection");
  }
  return 0;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A server that sends keepalives was silent for the whole timeout. */
static int conn_silent(dispatch_device *dev) {
  char why[128];
  snprintf(why, sizeof why, "the server sent nothing for %d ms",
           dev->conn->timeout_ms);
  return conn_lost(dev, why);
}

/* Waits until the socket is readable or the deadline passes, polling it
 * for the spin budget of the connection's policy (wait.c) before sleeping.
 * record: this is the wait for a reply's first bytes, whose latency feeds
 * the policy (waits mid-frame only follow it). With keepalives (1.4) the
 * deadline ends only a wait at a frame boundary (DISPATCH_ETIMEDOUT, no
 * message: the caller words it); silence ends any. */
static int wait_readable(dispatch_device *dev, int64_t deadline, int record,
                         int boundary) {
  dispatch__conn *c = dev->conn;
  int64_t spin = dispatch__spin_budget(&c->spin);
  int64_t t0 = now_ns();
  if (spin > 0) {
    struct pollfd pfd = {c->fd, POLLIN, 0};
    int64_t end = t0 + spin;
    do {
      if (poll(&pfd, 1, 0) > 0) {
        if (record) dispatch__spin_record(&c->spin, spin, now_ns() - t0);
        return 0;
      }
    } while (now_ns() < end);
  }
  for (;;) {
    int64_t left = -1;
    if (c->ka_ms) {
      int v = dispatch__wait_verdict(now_ms(), c->heard_ms, deadline,
                                     c->timeout_ms, boundary, &left);
      if (v == DISPATCH__WAIT_SILENT) return conn_silent(dev);
      if (v == DISPATCH__WAIT_TIMEDOUT) return DISPATCH_ETIMEDOUT;
    } else if (c->timeout_ms > 0 && (left = deadline - now_ms()) <= 0) {
      /* an older server: no keepalive tells slow from silent */
      char why[128];
      snprintf(why, sizeof why, "no reply within %d ms", c->timeout_ms);
      return conn_dead(dev, why);
    }
    struct pollfd pfd = {c->fd, POLLIN, 0};
    int pr = poll(&pfd, 1, poll_ms(left));
    if (pr > 0) {
      if (record) dispatch__spin_record(&c->spin, spin, now_ns() - t0);
      return 0;
    }
    if (pr < 0 && errno != EINTR) return conn_lost(dev, "poll failed");
  }
}

/* One non-blocking recv: >0 bytes, 0 nothing yet, or ECONN. */
static long recv_some(dispatch_device *dev, void *p, size_t n) {
  ssize_t r = recv(dev->conn->fd, p, n, MSG_DONTWAIT);
  if (r > 0) {
    dev->conn->heard_ms = now_ms();
    return (long)r;
  }
  if (r == 0) return conn_lost(dev, "the server closed the connection");
  if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return 0;
  char why[128];
  snprintf(why, sizeof why, "recv: %s", strerror(errno));
  return conn_lost(dev, why);
}

/* Reads exactly n bytes. Plain TCP: bytes already in rbuf come first;
 * a short remainder is read into rbuf with whatever else has arrived (a
 * reply's header, message and the start of its bulk in one recv), a long
 * one straight into p, so a bulk lands in the caller's buffer without an
 * intermediate copy. wait_first: poll before the first recv (a reply that
 * cannot have arrived yet), saving a recv that would only say EAGAIN.
 * boundary: p is a frame's start, where the deadline may end the wait
 * with DISPATCH_ETIMEDOUT while none of it was read (keepalives only). */
static int recv_all(dispatch_device *dev, void *p, size_t n,
                    int64_t deadline, int wait_first, int boundary) {
  dispatch__conn *c = dev->conn;
  uint8_t *b = p;
  while (c->ssl && n > 0) {
    char why[384];
    size_t got = 0;
    int64_t dl = c->timeout_ms > 0 ? deadline : INT64_MAX;
    if (c->ka_ms) {
      int64_t now = now_ms(), left;
      int v = dispatch__wait_verdict(now, c->heard_ms, deadline,
                                     c->timeout_ms, boundary && b == p,
                                     &left);
      if (v == DISPATCH__WAIT_SILENT) return conn_silent(dev);
      if (v == DISPATCH__WAIT_TIMEDOUT) return DISPATCH_ETIMEDOUT;
      dl = left < 0 ? INT64_MAX : now + left;
    }
    c->tls_expired = 0;
    if (dispatch__tls_read(c, b, n, &got, dl, why, sizeof why) < 0) {
      if (c->ka_ms && c->tls_expired) continue; /* judged above */
      return conn_lost(dev, why);
    }
    c->heard_ms = now_ms();
    b += got;
    n -= got;
  }
  if (n > 0 && c->rlen > c->rpos) {
    size_t k = c->rlen - c->rpos < n ? c->rlen - c->rpos : n;
    memcpy(b, c->rbuf + c->rpos, k);
    c->rpos += k;
    b += k;
    n -= k;
    wait_first = 0;
  }
  int first = wait_first; /* the wait for a reply's first bytes */
  while (n > 0) {
    if (c->fd < 0) return check_alive(dev);
    if (wait_first) {
      int rc = wait_readable(dev, deadline, first, boundary && b == p);
      if (rc < 0) return rc;
      wait_first = first = 0;
    }
    long r;
    if (c->rbuf && n < REMOTE_RBUF) {
      r = recv_some(dev, c->rbuf, REMOTE_RBUF);
      if (r > 0) {
        size_t k = (size_t)r < n ? (size_t)r : n;
        memcpy(b, c->rbuf, k);
        c->rpos = k;
        c->rlen = (size_t)r;
        b += k;
        n -= k;
      }
    } else {
      r = recv_some(dev, b, n);
      if (r > 0) {
        b += r;
        n -= (size_t)r;
      }
    }
    if (r < 0) return (int)r;
    if (r == 0) wait_first = 1;
  }
  return 0;
}

static int close_ops(dispatch_device *dev);

static int flush(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (c->ops_n && !c->resuming) {
    int rc = close_ops(dev); /* puts the frame; sent below */
    if (rc < 0) return rc;
  }
  if (c->len == 0) return 0;
  int rc = send_all(dev, c->buf, c->len);
  c->len = 0;
  return rc;
}

static int reserve(dispatch_device *dev, size_t more) {
  dispatch__conn *c = dev->conn;
  if (c->cap - c->len >= more) return 0;
  size_t cap = c->cap ? c->cap : 4096;
  while (cap - c->len < more) {
    if (cap > SIZE_MAX / 2)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "send buffer overflow");
    cap *= 2;
  }
  uint8_t *nb = dsp_realloc(c->buf, cap);
  if (!nb)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "out of memory (send buffer of %zu bytes)", cap);
  c->buf = nb;
  c->cap = cap;
  return 0;
}

/* Appends one frame (header, message, bulk). Either the whole frame is
 * queued or sent, or nothing is (ENOMEM) or the connection is lost. */
static int log_frame(dispatch__conn *c, uint64_t seq, const uint8_t *frame,
                     size_t flen, const void *bulk, size_t bulk_len);

static int put_frame(dispatch_device *dev, Dspwire__Request *req,
                     const void *bulk, size_t bulk_len) {
  dispatch__conn *c = dev->conn;
  if (c->ops_n && !c->resuming) { /* queued ops go first, in order */
    int rc = close_ops(dev);
    if (rc < 0) return rc;
  }
  if (c->resumable && !c->resuming && !req->seq) req->seq = c->seq + 1;
  size_t flen = dsp_req_frame_size(req);
  size_t mlen = flen - DSP_FRAME_HEADER_SIZE;
  if (c->max_frame && mlen > c->max_frame)
    return dsp_seterr(dev->ctx, DISPATCH_ETOOLARGE,
                      "request of %zu bytes exceeds the server's frame limit "
                      "%llu",
                      mlen, (unsigned long long)c->max_frame);
  /* the server refuses a larger frame at its header and closes: refused
   * here, nothing is sent and the session goes on */
  if (c->max_frame && bulk_len > c->max_frame - mlen)
    return dsp_seterr(dev->ctx, DISPATCH_ETOOLARGE,
                      "upload of %zu bytes (+ %zu of message) exceeds the "
                      "server's frame limit %llu",
                      bulk_len, mlen, (unsigned long long)c->max_frame);
  int inline_bulk = bulk_len <= BULK_INLINE;
  int rc = reserve(dev, flen + (inline_bulk ? bulk_len : 0));
  if (rc < 0) return rc;
  uint8_t *at = c->buf + c->len;
  dsp_req_frame_encode(req, bulk_len, at);
  if (req->seq) { /* logged before it is sent: a reconnect sends it again */
    int ext = bulk_len > LOG_COPY_MAX;
    if (log_frame(c, req->seq, at, flen, ext ? NULL : bulk,
                  ext ? 0 : bulk_len) < 0)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory for the replay log (%zu bytes)",
                        c->log_len + flen + bulk_len);
    if (ext) {
      c->ext_bulk = bulk;
      c->ext_len = bulk_len;
      c->ext_at = c->log_len;
      c->ext_seq = req->seq;
    }
    c->seq = req->seq;
  }
  c->len += flen;
  if (inline_bulk) {
    if (bulk_len) memcpy(c->buf + c->len, bulk, bulk_len);
    c->len += bulk_len;
  } else {
    rc = flush(dev);
    if (rc == 0) rc = send_all(dev, bulk, bulk_len);
    if (rc < 0) return rc;
  }
  if (c->len >= FLUSH_AT) return flush(dev);
  return 0;
}

/* Queues one Free message for the ids gathered so far. */
static int put_frees(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c->n_free_ids && !c->n_free_grads) return 0;
  dsp_wreq w;
  Dspwire__Request *req =
      dsp_wreq_free(&w, c->free_ids, (size_t)c->n_free_ids, c->free_grads,
                    (size_t)c->n_free_grads);
  req->req_id = c->next_id++;
  int rc = put_frame(dev, req, NULL, 0);
  if (rc == DISPATCH_ENOMEM && !c->resumable) {
    /* the caller cannot be told about a failed free: send it unbuffered */
    rc = flush(dev);
    if (rc == 0) {
      uint8_t tmp[DSP_FRAME_HEADER_SIZE + 2 * DISPATCH__FREE_BATCH * 11 + 64];
      if (dsp_req_frame_size(req) <= sizeof tmp)
        rc = send_all(dev, tmp, dsp_req_frame_encode(req, 0, tmp));
    }
  }
  if (rc < 0 && rc != DISPATCH_ECONN && rc != EBROKEN) return rc;
  c->n_free_ids = c->n_free_grads = 0;
  return rc;
}

void dispatch__remote_free(dispatch_device *dev, uint64_t id, int is_grads) {
  dispatch__conn *c = dev->conn;
  if (c->dead || dev->closing || (c->fd < 0 && !c->broken)) return;
  if (c->n_free_ids == DISPATCH__FREE_BATCH ||
      c->n_free_grads == DISPATCH__FREE_BATCH)
    put_frees(dev);
  if (is_grads)
    c->free_grads[c->n_free_grads++] = id;
  else
    c->free_ids[c->n_free_ids++] = id;
}

uint64_t dispatch__remote_new_id(dispatch_device *dev) {
  return dev->conn->next_id++;
}

/* Maps the server's Error into the device: code, message, and the poison
 * mark on the tensor the failed request was creating. */
static int take_error(dispatch_device *dev, const Dspwire__Error *e,
                      uint64_t req_id, uint64_t target) {
  int code = e->code < 0 ? e->code : DISPATCH_EPROTO;
  dsp_seterr(dev->ctx, code, "server: %s",
             e->message && *e->message ? e->message : dispatch_strerror(code));
  /* a waiting request that failed itself on its target (a read of a
   * poisoned tensor) marks that tensor */
  uint64_t victim = e->failed_req_id;
  if (victim == req_id) victim = target;
  for (dispatch_tensor *t = dev->all; victim && t; t = t->anext)
    if (t->kind == DISPATCH_KIND_REMOTE && t->id == victim) {
      /* kept so a later op on t answers with this message, no round trip
       * (without memory for it, the code's generic text does) */
      t->status = code;
      dsp_free(t->poison_msg);
      t->poison_msg = dsp_strdup(dsp_ctx_errmsg(dev->ctx));
      break;
    }
  return code;
}

/* Reads and throws away n bulk bytes the caller has no use for. */
static int drain(dispatch_device *dev, uint64_t n, int64_t deadline) {
  uint8_t tmp[16384];
  while (n > 0) {
    size_t k = n < sizeof tmp ? (size_t)n : sizeof tmp;
    int rc = recv_all(dev, tmp, k, deadline, 0, 0);
    if (rc < 0) return rc;
    n -= k;
  }
  return 0;
}

/* Appends one frame to the replay log; 0 or -1 when out of memory. */
static int log_frame(dispatch__conn *c, uint64_t seq, const uint8_t *frame,
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
static void log_trim(dispatch__conn *c, uint64_t seq) {
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

/* Reads frames until the reply to req_id. A READ reply's bulk lands in dst
 * when its size is dst_len. EBROKEN when the socket failed on a resumable
 * session (nothing kept; the caller reconnects and waits again). With
 * keepalives and may_time_out, DISPATCH_ETIMEDOUT when the deadline
 * passed between frames with the server alive: the stream is at a frame
 * boundary, and the reply is still to come. */
static int await_reply(dispatch_device *dev, uint64_t req_id, void *dst,
                       size_t dst_len, uint64_t target,
                       Dspwire__Reply **reply, int may_time_out) {
  dispatch__conn *c = dev->conn;
  int64_t deadline = deadline_in(c);
  int rc;
  c->heard_ms = now_ms(); /* the server owed nothing before the request */
  for (;;) {
    uint8_t hb[DSP_FRAME_HEADER_SIZE];
    rc = recv_all(dev, hb, sizeof hb, deadline, 1, may_time_out);
    if (rc == DISPATCH_ETIMEDOUT)
      return dsp_seterr(dev->ctx, DISPATCH_ETIMEDOUT,
                        "%s: no reply to request %llu within %d ms; the "
                        "server is alive and still working on the "
                        "session's requests (the request stays queued: "
                        "wait again)",
                        dev->spec, (unsigned long long)req_id,
                        c->timeout_ms);
    if (rc < 0) return rc;
    dsp_frame_header h;
    rc = dsp_frame_header_decode(hb, MAX_REPLY_MSG, UINT64_MAX, &h);
    if (rc < 0) return conn_dead(dev, "malformed reply frame header");
    uint8_t *mb = dsp_malloc(h.msg_len);
    if (!mb) {
      /* skip the frame so the stream stays in step; the reply is lost */
      rc = drain(dev, (uint64_t)h.msg_len + h.bulk_len, deadline);
      if (rc < 0) return rc;
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory reading a reply of %u bytes",
                        h.msg_len);
    }
    rc = recv_all(dev, mb, h.msg_len, deadline, 0, 0);
    if (rc < 0) {
      dsp_free(mb);
      return rc;
    }
    g_pb_oom = 0;
    Dspwire__Reply *r = dspwire__reply__unpack(&g_pb_alloc, h.msg_len, mb);
    dsp_free(mb);
    if (!r && g_pb_oom) {
      rc = drain(dev, h.bulk_len, deadline);
      if (rc < 0) return rc;
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "out of memory decoding a reply");
    }
    if (!r) return conn_dead(dev, "undecodable reply message");
    int mine = r->req_id == req_id;
    if (h.bulk_len) {
      if (mine && dst &&
          (r->body_case == DSPWIRE__REPLY__BODY_READ ||
           r->body_case == DSPWIRE__REPLY__BODY_GRAPH) &&
          h.bulk_len == dst_len)
        rc = recv_all(dev, dst, dst_len, deadline, 0, 0);
      else
        rc = drain(dev, h.bulk_len, deadline);
      if (rc < 0) {
        dspwire__reply__free_unpacked(r, &g_pb_alloc);
        return rc;
      }
    }
    if (r->keepalive && !r->error && r->req_id == 0) { /* 1.4: alive */
      dspwire__reply__free_unpacked(r, &g_pb_alloc);
      continue;
    }
    if (!mine && !r->error) { /* not ours and harmless: skip it */
      dspwire__reply__free_unpacked(r, &g_pb_alloc);
      continue;
    }
    *reply = r;
    if (r->error && r->error->code == DISPATCH_ESHUTDOWN)
      return conn_down(dev, DISPATCH_ESHUTDOWN,
                       r->error->message ? r->error->message : "");
    if (r->error && r->error->code != 0)
      return take_error(dev, r->error, req_id, target);
    if (!mine) return conn_dead(dev, "reply to an unknown request");
    return 0;
  }
}

static int connect_to(dispatch_device *dev, const char *host,
                      const char *port);

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
 * then the logged frames the server did not receive. 0, EBROKEN (try
 * again), or a code that ends the session (ESESSION, EAUTH, EVERSION,
 * ENOMEM). */
static int resume_once(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  drop_socket(c);
  int rc = connect_to(dev, c->host, c->port);
  if (rc == 0 && c->tls_o) rc = dispatch__tls_open(dev, c->host, c->tls_o);
  if (rc < 0) {
    drop_socket(c);
    return rc == DISPATCH_ENOMEM ? rc : EBROKEN;
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
  rc = put_frame(dev, hello, NULL, 0);
  if (rc == 0) rc = flush(dev);
  Dspwire__Reply *r = NULL;
  if (rc == 0) rc = await_reply(dev, hello->req_id, NULL, 0, 0, &r, 0);
  if (rc == 0 && (r->body_case != DSPWIRE__REPLY__BODY_HELLO ||
                  !r->hello->resumed))
    rc = dsp_seterr(dev->ctx, DISPATCH_ESESSION,
                    "the server did not resume the session");
  uint64_t last = rc == 0 ? r->hello->last_seq : 0;
  if (rc == 0) c->ka_ms = r->hello->keepalive_ms;
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  if (rc < 0) return rc == DISPATCH_ECONN && !c->dead ? EBROKEN : rc;
  if (last < c->acked || (c->n_log && last + 1 < c->log_seq[0]) ||
      last > c->seq)
    return dsp_seterr(dev->ctx, DISPATCH_ESESSION,
                      "the resumed session has received requests up to %llu, "
                      "this client sent up to %llu",
                      (unsigned long long)last, (unsigned long long)c->seq);
  log_trim(c, last);
  size_t cut = c->ext_bulk ? c->ext_at : c->log_len;
  if (cut) rc = send_all(dev, c->log, cut);
  if (rc == 0 && c->ext_bulk) rc = send_all(dev, c->ext_bulk, c->ext_len);
  if (rc == 0 && c->log_len > cut)
    rc = send_all(dev, c->log + cut, c->log_len - cut);
  return rc;
}

/* After the socket failed: reconnects with bounded exponential backoff
 * (20 ms doubling to 1 s) within resume_bound_ms and resumes the session.
 * 0, or the code the connection is now dead with (every later call gets
 * it too). */
static int reconnect(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (c->dead) return check_alive(dev);
  if (c->resuming) return EBROKEN;
  c->resuming = 1;
  char first[192];
  snprintf(first, sizeof first, "%s", c->dead_why);
  int64_t end = now_ms() + resume_bound_ms(c);
  int backoff = 20, attempts = 0, rc;
  for (;;) {
    attempts++;
    rc = resume_once(dev);
    if (rc == 0 || (rc != EBROKEN && rc != DISPATCH_ECONN) || c->dead) break;
    if (now_ms() + backoff >= end) break;
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
  int code = rc == EBROKEN || rc == DISPATCH_ECONN ? DISPATCH_ECONN : rc;
  char why[192];
  if (code == DISPATCH_ECONN)
    snprintf(why, sizeof why, "%.80s; no resume within %d ms (%d attempts)",
             first, resume_bound_ms(c), attempts);
  else
    snprintf(why, sizeof why, "%.60s; resume refused: %.100s", first,
             dsp_ctx_errmsg(dev->ctx));
  c->resumable = 0;
  c->broken = 0;
  drop_socket(c);
  conn_dead(dev, why);
  c->dead_code = code;
  return check_alive(dev);
}

/* put_frees across a reconnect of a resumable session (the frees were
 * logged, so the reconnect sends them again). */
static int put_frees_now(dispatch_device *dev) {
  int rc = put_frees(dev);
  return rc == EBROKEN ? reconnect(dev) : rc;
}

/* FNV-1a of n bytes: whether a replay sent again has the same inputs. */
static uint64_t fnv1a(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* A large upload's bytes still stand in the caller's buffer for the log
 * (ext_bulk): copies them into the log, as a call about to return
 * without the reply that acknowledges them must (the caller may free the
 * buffer). Without memory for it a later drop ends the session instead
 * of resuming it. */
static void log_take_ext(dispatch__conn *c) {
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

/* A wait for req gave up (DISPATCH_ETIMEDOUT): its reply stays owed. */
static void pend_keep(dispatch__conn *c, const Dspwire__Request *req,
                      const void *bulk, size_t bulk_len, size_t dst_len) {
  c->pend_id = req->req_id;
  c->pend_seq = req->seq;
  c->pend_case = (int)req->body_case;
  c->pend_key = req->body_case == DSPWIRE__REQUEST__BODY_READ
                    ? req->read->id
                : req->body_case == DSPWIRE__REQUEST__BODY_GRAPH_REPLAY
                    ? req->graph_replay->graph
                    : 0;
  c->pend_len = bulk_len;
  c->pend_hash = req->body_case == DSPWIRE__REQUEST__BODY_GRAPH_REPLAY
                     ? fnv1a(bulk, bulk_len)
                     : 0;
  c->pend_dst_len = dst_len;
  c->pend_next = c->next_id;
  log_take_ext(c);
}

/* Whether req asks what the pending request asked, with nothing sent
 * since: the pending reply then answers it (a Read sees the tensor as it
 * is, a replay runs once). */
static int pend_same(const dispatch__conn *c, const Dspwire__Request *req,
                     const void *bulk, size_t bulk_len, size_t dst_len) {
  if (!c->pend_id || c->next_id != c->pend_next || c->len || c->ops_n ||
      (int)req->body_case != c->pend_case)
    return 0;
  switch (req->body_case) {
  case DSPWIRE__REQUEST__BODY_SYNC:
  case DSPWIRE__REQUEST__BODY_STATS:
    return 1;
  case DSPWIRE__REQUEST__BODY_READ:
    return req->read->id == c->pend_key && dst_len == c->pend_dst_len;
  case DSPWIRE__REQUEST__BODY_GRAPH_REPLAY:
    return req->graph_replay->graph == c->pend_key &&
           bulk_len == c->pend_len && dst_len == c->pend_dst_len &&
           fnv1a(bulk, bulk_len) == c->pend_hash;
  default:
    return 0;
  }
}

/* Waits for the reply to request rid (seq) across reconnects; a reply to
 * it acknowledges everything up to seq. */
static int wait_reply(dispatch_device *dev, uint64_t rid, uint64_t seq,
                      void *dst, size_t dst_len, uint64_t target,
                      Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  int rc = await_reply(dev, rid, dst, dst_len, target, reply, 1);
  while (rc == EBROKEN) {
    rc = reconnect(dev);
    if (rc == 0) rc = await_reply(dev, rid, dst, dst_len, target, reply, 1);
  }
  if (rc != DISPATCH_ETIMEDOUT)
    c->ops_limit = DISPATCH__OPS_FIRST; /* the server has caught up */
  if (*reply && seq && (*reply)->req_id == rid) {
    /* the server ran everything up to it: nothing to send again */
    c->acked = seq;
    log_trim(c, seq);
  }
  return rc;
}

/* Waits for the pending request's reply (into dst when it answers this
 * call). DISPATCH_ETIMEDOUT keeps it pending; anything else settles it. */
static int wait_pending(dispatch_device *dev, void *dst, size_t dst_len,
                        Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  uint64_t target =
      c->pend_case == DSPWIRE__REQUEST__BODY_READ ? c->pend_key : 0;
  int rc = wait_reply(dev, c->pend_id, c->pend_seq, dst, dst_len, target,
                      reply);
  if (rc != DISPATCH_ETIMEDOUT) c->pend_id = 0;
  else log_take_ext(c); /* an upload queued since: the caller's buffer */
  return rc;
}

/* Sends req (and everything queued before it, then the batched frees) and
 * waits for its reply, across reconnects of a resumable session. A READ
 * reply's bulk lands in dst when its size is dst_len. *reply is the
 * caller's (free_unpacked) when it returns 0 or a server error; on
 * ECONN/EPROTO/ETIMEDOUT *reply is NULL.
 *
 * A request whose wait timed out is pending: this call takes its reply
 * first. When req asks the same (pend_same) that reply is req's and
 * nothing is sent; otherwise req goes once it came, and not at all when
 * it brings an error (the deferred error of the session, which this call
 * reports as any wait would: req not performed) or times out again. */
static int call_bulk(dispatch_device *dev, Dspwire__Request *req,
                     const void *bulk, size_t bulk_len, void *dst,
                     size_t dst_len, uint64_t target, Dspwire__Reply **reply) {
  dispatch__conn *c = dev->conn;
  *reply = NULL;
  int rc = check_alive(dev);
  if (rc == EBROKEN) rc = reconnect(dev);
  if (rc < 0) return rc;
  close_ops(dev); /* before req's id is taken; a failure is stashed */
  if (c->pend_id) {
    if (pend_same(c, req, bulk, bulk_len, dst_len))
      return wait_pending(dev, dst, dst_len, reply);
    rc = flush(dev); /* what close_ops put: the server works on it */
    if (rc == EBROKEN) rc = reconnect(dev);
    if (rc == 0) rc = wait_pending(dev, NULL, 0, reply);
    if (rc < 0) return rc;
    dspwire__reply__free_unpacked(*reply, &g_pb_alloc);
    *reply = NULL;
  }
  if (c->stash_code) { /* an earlier request's error, held for a wait */
    rc = dsp_seterr(dev->ctx, c->stash_code, "%s", c->stash_msg);
    c->stash_code = 0;
    return rc;
  }
  req->req_id = c->next_id++;
  req->ack = c->acked;
  uint32_t ka = dispatch__keepalive_for(c->timeout_ms);
  int ask = c->ka_ms && ka && ka != c->ka_asked; /* set_timeout changed */
  if (ask) req->keepalive_ms = ka;
  rc = put_frees_now(dev);
  if (rc == 0) rc = put_frame(dev, req, bulk, bulk_len);
  if (ask && (rc == 0 || rc == EBROKEN)) c->ka_asked = ka; /* logged */
  if (rc == 0) rc = flush(dev);
  while (rc == EBROKEN) {
    rc = reconnect(dev);
    if (rc == 0) rc = wait_reply(dev, req->req_id, req->seq, dst, dst_len,
                                 target, reply);
  }
  if (rc == 0 && !*reply)
    rc = wait_reply(dev, req->req_id, req->seq, dst, dst_len, target, reply);
  if (rc == DISPATCH_ETIMEDOUT) pend_keep(c, req, bulk, bulk_len, dst_len);
  return rc;
}

static int call(dispatch_device *dev, Dspwire__Request *req, void *dst,
                size_t dst_len, uint64_t target, Dspwire__Reply **reply) {
  return call_bulk(dev, req, NULL, 0, dst, dst_len, target, reply);
}

int dispatch__remote_call(dispatch_device *dev, Dspwire__Request *req,
                          const void *bulk, size_t bulk_len, void *dst,
                          size_t dst_len, Dspwire__Reply **reply) {
  return call_bulk(dev, req, bulk, bulk_len, dst, dst_len, 0, reply);
}

void dispatch__remote_reply_free(Dspwire__Reply *r) {
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
}

/* Puts the open batch of op records as one Ops frame (sent with the next
 * flush). Its ops were each accepted when queued, so a failure here loses
 * them after the fact: the code is returned to the caller at hand and
 * also held for the next wait, which reports it as it would the deferred
 * error of one of those ops. */
static int close_ops(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c->ops_n) return 0;
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_ops(&w, c->ops, c->ops_len);
  int n = c->ops_n;
  req->req_id = c->next_id++;
  c->ops_n = 0; /* put_frame must not close it again */
  c->ops_len = 0;
  int rc = put_frame(dev, req, NULL, 0);
  if (rc == EBROKEN) rc = reconnect(dev); /* it was logged: sent again */
  if (rc < 0 && !c->stash_code && !c->dead) {
    c->stash_code = rc;
    snprintf(c->stash_msg, sizeof c->stash_msg, "%d queued ops were lost: %s",
             n, dsp_ctx_errmsg(dev->ctx));
  }
  return rc;
}

/* Queues one op as a record of the open batch; a full batch is put and
 * sent, so the server works on it while the caller queues the next. */
static int put_record(dispatch_device *dev, dsp_opcode op, const uint64_t *in,
                      int n_in, const dsp_attrs *a, uint64_t out,
                      int no_grad) {
  dispatch__conn *c = dev->conn;
  int rc = check_alive(dev);
  if (rc == EBROKEN) rc = reconnect(dev);
  if (rc < 0) return rc;
  /* a new batch goes behind the frees queued so far: what the caller let
   * go of before these ops (last step's intermediates) is freed first, so
   * the server reuses those blocks, still in cache, for their results */
  if (c->ops_n == 0 && (c->n_free_ids || c->n_free_grads) &&
      (rc = put_frees_now(dev)) < 0)
    return rc;
  size_t size = dsp_oprec_size(n_in, a->n_ints, a->n_floats);
  if (c->ops_len + size > DISPATCH__OPS_BYTES && (rc = close_ops(dev)) < 0)
    return rc;
  if (!c->ops && !(c->ops = dsp_malloc(DISPATCH__OPS_BYTES)))
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "out of memory for the op batch (%d bytes)",
                      DISPATCH__OPS_BYTES);
  c->ops_len += dsp_oprec_put(c->ops + c->ops_len, (int)op, no_grad, in, n_in,
                              out, a->ints, a->n_ints, a->floats,
                              a->n_floats);
  if (++c->ops_n < c->ops_limit) return 0;
  /* after a wait the server has nothing to do: the first batches are
   * small so it starts while the rest is queued, then they double */
  if (c->ops_limit < DISPATCH__OPS_MAX) c->ops_limit *= 2;
  rc = close_ops(dev);
  if (rc == 0) rc = flush(dev);
  if (rc == EBROKEN) rc = reconnect(dev); /* the batch was logged */
  return rc;
}

static int queue(dispatch_device *dev, Dspwire__Request *req, uint64_t rid,
                 const void *bulk, size_t bulk_len) {
  dispatch__conn *c = dev->conn;
  int rc = check_alive(dev);
  if (rc == EBROKEN) rc = reconnect(dev);
  if (rc < 0) return rc;
  if ((rc = close_ops(dev)) < 0) return rc; /* before req's id is taken */
  req->req_id = rid ? rid : c->next_id++;
  rc = put_frame(dev, req, bulk, bulk_len);
  if (rc == EBROKEN) rc = reconnect(dev); /* it sends the frame again */
  if (rc == 0 && (c->ext_bulk || c->log_len > LOG_SYNC_AT)) {
    /* the caller's buffer may go once this returns: the server must have
     * the bytes first. A deferred error this brings back is the next
     * wait's to report, as without the Sync. */
    dsp_wreq w;
    Dspwire__Reply *r;
    int held = c->stash_code; /* the Sync must be sent even so */
    c->stash_code = 0;
    rc = call(dev, dsp_wreq_sync(&w), NULL, 0, 0, &r);
    /* a busy server: the bytes are in the log now (pend_keep), the Sync
     * stays pending for the next wait, and the upload was handed over */
    if (rc == DISPATCH_ETIMEDOUT) rc = 0;
    if (rc < 0 && r) {
      if (!held)
        snprintf(c->stash_msg, sizeof c->stash_msg, "%s",
                 dsp_ctx_errmsg(dev->ctx));
      if (!held) held = rc;
      rc = 0;
    }
    c->stash_code = held;
    if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
    c->ext_bulk = NULL;
  }
  return rc;
}

int dispatch__remote_queue(dispatch_device *dev, Dspwire__Request *req) {
  return queue(dev, req, 0, NULL, 0);
}

int dispatch__remote_op(dispatch_device *dev, dsp_opcode op,
                        const uint64_t *in, int n_in, const dsp_attrs *a,
                        uint64_t out, int no_grad) {
  /* a peer's creation op names its device: only an Op carries that */
  if (dev->conn->batch_ops && !(n_in == 0 && dev->device) &&
      dsp_oprec_fits(n_in, a->n_ints, a->n_floats))
    return put_record(dev, op, in, n_in, a, out, no_grad);
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_op(&w, (int32_t)op, in, (size_t)n_in, out, a->ints,
                  (size_t)a->n_ints, a->floats, (size_t)a->n_floats, no_grad);
  /* a peer's creation ops land on its device; ops on inputs follow them */
  if (n_in == 0 && dev->device) w.body.op.device = dev->device;
  return queue(dev, r, out, NULL, 0);
}

int dispatch__remote_upload(dispatch_device *dev, uint64_t id,
                            const dsp_meta *meta, const void *data,
                            size_t n) {
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_upload(&w, id, (int32_t)meta->dtype,
                                         (size_t)meta->ndim, meta->shape);
  if (dev->device) w.body.upload.device = dev->device;
  return queue(dev, r, id, data, n);
}

int dispatch__remote_to_device(dispatch_device *dev, uint64_t id, uint64_t out,
                               const char *device) {
  dsp_wreq w;
  return queue(dev, dsp_wreq_to_device(&w, id, out, device), out, NULL, 0);
}

int dispatch__remote_devices(dispatch_device *dev, dispatch_device_info *out,
                             int max, int *n) {
  dsp_wreq w;
  Dspwire__Reply *r;
  *n = 0;
  int rc = call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "device_list: the server's reply carries no stats");
  if (rc == 0) {
    for (size_t i = 0; i < r->stats->n_devices; i++) {
      const Dspwire__DeviceInfo *d = r->stats->devices[i];
      if ((int)i < max) {
        dispatch_device_info *o = &out[i];
        snprintf(o->kind, sizeof o->kind, "%s", d->kind);
        snprintf(o->name, sizeof o->name, "%s", d->name);
        snprintf(o->description, sizeof o->description, "%s",
                 d->description);
        o->total_memory = d->total_memory;
        o->free_memory = d->free_memory;
      }
    }
    *n = (int)r->stats->n_devices;
  }
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

/* 0 when the server has dev->device (by its stats' device list), else
 * DISPATCH_EDEVICE naming the devices it has. */
int dispatch__remote_check_device(dispatch_device *dev) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "open_peer: the server's reply carries no stats");
  if (rc == 0) {
    char names[256];
    size_t k = 0;
    names[0] = '\0';
    int found = 0;
    size_t dl = strlen(dev->device);
    for (size_t i = 0; i < r->stats->n_devices; i++) {
      const Dspwire__DeviceInfo *d = r->stats->devices[i];
      if (strcmp(d->name, dev->device) == 0 ||
          (!strchr(dev->device, ':') && strncmp(d->name, dev->device, dl) == 0 &&
           d->name[dl] == ':'))
        found = 1;
      if (k < sizeof names) {
        int wr = snprintf(names + k, sizeof names - k, "%s%s", i ? ", " : "",
                          d->name);
        if (wr > 0) k += (size_t)wr;
      }
    }
    if (!found)
      rc = dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                      "%s: the server has no device \"%s\" (it has %s)",
                      dev->spec, dev->device,
                      names[0] ? names : "no device list: protocol 1.0");
  }
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

int dispatch__remote_track(dispatch_device *dev, uint64_t id) {
  dsp_wreq w;
  return queue(dev, dsp_wreq_track(&w, id), 0, NULL, 0);
}

int dispatch__remote_grad(dispatch_device *dev, uint64_t grads,
                          uint64_t tensor, uint64_t out) {
  dsp_wreq w;
  return queue(dev, dsp_wreq_grad(&w, grads, tensor, out), out, NULL, 0);
}

int dispatch__remote_step(dispatch_device *dev, dsp_opcode op, uint64_t grads,
                          const uint64_t *params, int n,
                          const uint64_t *states, int n_st,
                          const dsp_attrs *a) {
  dsp_wreq w;
  return queue(dev,
               dsp_wreq_step(&w, (int32_t)op, grads, params, (size_t)n,
                             states, (size_t)n_st, a->ints, (size_t)a->n_ints,
                             a->floats, (size_t)a->n_floats),
               0, NULL, 0);
}

int dispatch__remote_read(dispatch_device *dev, uint64_t id, void *buf,
                          size_t nbytes) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = call(dev, dsp_wreq_read(&w, id), buf, nbytes, id, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_READ)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "read: the server's reply carries no tensor");
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

int dispatch__remote_backward(dispatch_device *dev, uint64_t loss,
                              uint64_t grads, int retain) {
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_backward(&w, loss, grads, retain);
  if (dev->conn->server_minor >= 3) {
    /* 1.3: pipelined like an op; a failure is the next wait's error and
     * leaves grads a failed container (proto/README.md). The frees queued
     * so far go first: the gradients a loop let go of last step must be
     * gone before this pass makes new ones (one set within the quota) */
    w.body.backward.no_reply = 1;
    int rc = check_alive(dev);
    if (rc == EBROKEN) rc = reconnect(dev);
    if (rc == 0) rc = put_frees_now(dev);
    return rc < 0 ? rc : queue(dev, req, grads, NULL, 0);
  }
  Dspwire__Reply *r;
  int rc = call(dev, req, NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

int dispatch__remote_sync(dispatch_device *dev) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = call(dev, dsp_wreq_sync(&w), NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

int dispatch__remote_stats(dispatch_device *dev, dispatch_stats *out) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "stats: the server's reply carries no stats");
  if (r && r->body_case == DSPWIRE__REPLY__BODY_STATS) {
    out->tensors = r->stats->tensors;
    out->bytes = r->stats->bytes;
    out->ops = r->stats->ops;
    out->errors = r->stats->errors;
    out->grads = r->stats->grads;
    out->held_bytes = r->stats->held_bytes;
    out->session_limit = r->stats->session_limit;
    out->queued_bytes = r->stats->queued_bytes;
    out->batches = r->stats->batches;
    out->sessions = r->stats->sessions;
    out->server_tensors = r->stats->server_tensors;
    out->server_bytes = r->stats->server_bytes;
    out->server_held_bytes = r->stats->server_held_bytes;
    out->server_limit = r->stats->server_limit;
    out->protocol_errors = r->stats->protocol_errors;
    out->limit_violations = r->stats->limit_violations;
    out->devices = r->stats->n_devices;
    out->sessions_detached = r->stats->sessions_detached;
    out->sessions_resumed = r->stats->sessions_resumed;
    out->sessions_expired = r->stats->sessions_expired;
    out->inline_ops = r->stats->inline_ops;
    out->handoffs = r->stats->handoffs;
    out->returns = r->stats->returns;
  }
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

/* Connects within the timeout (non-blocking connect + poll), then keeps
 * the socket non-blocking: every I/O goes through poll deadlines. */
static int connect_to(dispatch_device *dev, const char *host,
                      const char *port) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int gai = getaddrinfo(host, port, &hints, &res);
  if (gai != 0)
    return dsp_seterr(dev->ctx, DISPATCH_ECONN, "%s: cannot resolve %s: %s",
                      dev->spec, host, gai_strerror(gai));
  int err = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC,
                    ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      struct pollfd pfd = {fd, POLLOUT, 0};
      int pr;
      do pr = poll(&pfd, 1, dev->conn->timeout_ms > 0 ? dev->conn->timeout_ms
                                                      : -1);
      while (pr < 0 && errno == EINTR);
      socklen_t sl = sizeof err;
      if (pr == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) == 0 &&
          err == 0)
        r = 0;
      else if (pr == 0)
        err = ETIMEDOUT;
    } else if (r < 0) {
      err = errno;
    }
    if (r == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      dev->conn->fd = fd;
      dispatch__spin_init(&dev->conn->spin, fd);
      freeaddrinfo(res);
      return 0;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return dsp_seterr(dev->ctx, DISPATCH_ECONN, "%s: cannot connect: %s",
                    dev->spec, strerror(err ? err : ECONNREFUSED));
}

static char *dup_or_null(const char *s, int *failed) {
  if (!s) return NULL;
  char *d = dsp_strdup(s);
  if (!d) *failed = 1;
  return d;
}

/* Keeps what a reconnect needs when the server offers resume and the
 * caller did not turn it off (option no_resume, env DISPATCH_RESUME=0). */
static int setup_resume(dispatch_device *dev, const Dspwire__HelloReply *h,
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

int dispatch__remote_open(dispatch_device *dev, const char *host,
                          const char *port, const char *token,
                          const char *client_name, const char *device,
                          const dispatch_options *tls) {
  dev->conn->next_id = 1;
  int rc = connect_to(dev, host, port);
  if (rc == 0 && tls) rc = dispatch__tls_open(dev, host, tls);
  if (rc < 0) return rc;
  if (!tls) {
    dev->conn->rbuf = dsp_malloc(REMOTE_RBUF);
    if (!dev->conn->rbuf)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "%s: out of memory for the receive buffer", dev->spec);
  }
  dsp_wreq w;
  Dspwire__Reply *r;
  Dspwire__Request *hello = dsp_wreq_hello(&w, DSP_PROTO_MAJOR,
                                            DSP_PROTO_MINOR, token,
                                            client_name);
  if (device) w.body.hello.device = (char *)device;
  const char *e = getenv("DISPATCH_RESUME");
  if (e && strcmp(e, "0") == 0) dev->conn->resume_off = 1;
  w.body.hello.resume = !dev->conn->resume_off;
  w.body.hello.keepalive_ms = dev->conn->ka_asked =
      dispatch__keepalive_for(dev->conn->timeout_ms);
  rc = call(dev, hello, NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_HELLO)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "%s: the server did not answer hello", dev->spec);
  if (rc == 0 && r->hello->major != DSP_PROTO_MAJOR)
    rc = dsp_seterr(dev->ctx, DISPATCH_EVERSION,
                    "%s: server speaks protocol %u.%u, this client %d.%d",
                    dev->spec, r->hello->major, r->hello->minor,
                    DSP_PROTO_MAJOR, DSP_PROTO_MINOR);
  if (rc == 0) {
    dev->conn->max_frame = r->hello->max_frame;
    dev->conn->ready = 1;
    /* 1.3 servers take Ops; a frame limit below a full batch (and room
     * for its message) turns batching off rather than refuse the batch */
    const char *b = getenv("DISPATCH_OPS_BATCH");
    dev->conn->server_minor = r->hello->minor;
    dev->conn->ka_ms = r->hello->keepalive_ms; /* 0: an older server */
    dev->conn->ops_limit = DISPATCH__OPS_FIRST;
    dev->conn->batch_ops = r->hello->minor >= 3 &&
                           r->hello->max_frame >= 4 * DISPATCH__OPS_BYTES &&
                           !(b && strcmp(b, "0") == 0);
    rc = setup_resume(dev, r->hello, host, port, token, client_name, tls);
    if (r->hello->session_device && *r->hello->session_device &&
        !(dev->conn->server_device = dsp_strdup(r->hello->session_device)))
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "%s: out of memory",
                      dev->spec);
  } else if (rc == DISPATCH_ECONN && dev->conn->tls_failed) {
    /* TLS 1.3 reports a refused client certificate only after the
     * handshake, with the server's alert: still a TLS failure */
    rc = dsp_seterr(dev->ctx, DISPATCH_ETLS, "%s: TLS session refused: %s",
                    dev->spec, dev->conn->dead_why);
  }
  if (r) dspwire__reply__free_unpacked(r, &g_pb_alloc);
  return rc;
}

/* Says bye without waiting (the server frees the session's tensors when
 * the connection closes), then releases the socket and buffer. */
void dispatch__remote_close(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c || --c->refs > 0) return; /* a peer still uses the session */
  c->closing = 1; /* a failure now only ends it: no reconnect */
  if (c->fd >= 0 && !c->dead && c->ready) {
    dsp_wreq w;
    c->n_free_ids = c->n_free_grads = 0;
    c->ops_n = 0; /* nothing can read their results any more */
    c->ops_len = 0;
    if (queue(dev, dsp_wreq_bye(&w), 0, NULL, 0) == 0) flush(dev);
  }
  if (c->ssl || c->ssl_ctx) dispatch__tls_close(c);
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  dsp_free(c->buf);
  c->buf = NULL;
  c->len = c->cap = 0;
  dsp_free(c->ops);
  c->ops = NULL;
  dsp_free(c->rbuf);
  c->rbuf = NULL;
  c->rpos = c->rlen = 0;
  dsp_free(c->server_device);
  dsp_free(c->log);
  dsp_free(c->log_seq);
  dsp_free(c->log_off);
  dsp_free(c->host);
  dsp_free(c->port);
  dsp_free(c->auth);
  dsp_free(c->name);
  if (c->tls_o) {
    dsp_free((char *)c->tls_o->ca_file);
    dsp_free((char *)c->tls_o->cert_file);
    dsp_free((char *)c->tls_o->key_file);
    dsp_free((char *)c->tls_o->server_name);
    dsp_free(c->tls_o);
  }
  OPENSSL_cleanse(c->token, sizeof c->token);
  dsp_free(c);
  dev->conn = NULL;
}

/* ------------------------------------------------------------------ */
/* the REMOTE row of the device-kind table                             */

/* The output's meta is inferred here (shape errors come back now) and the
 * op is queued without waiting; the output is tracked when an input is
 * AUTODIFF and the result is a float of a non-creation op, the rule the
 * engine applies on the server. */
static int remote_op(dispatch_device *dev, dsp_opcode op,
                     dispatch_tensor *const *cin, int n_in, const dsp_attrs *a,
                     int any_ad, dispatch_tensor **out, int *wrap) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  dsp_meta metas[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) metas[i] = cin[i]->meta;
  dsp_attrs none = dsp_attrs_none();
  dsp_meta om;
  int rc = dsp_op_infer(dev->ctx, op, metas, n_in, a ? a : &none, &om);
  if (rc < 0) return rc;
  dispatch_tensor *t;
  rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &om, 0, &t);
  if (rc < 0) return rc;
  uint64_t ids[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) ids[i] = cin[i]->id;
  t->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_op(dev, op, ids, n_in, a ? a : &none, t->id, !any_ad);
  if (rc < 0) {
    t->id = 0;
    dispatch__tensor_unref(t);
    return rc;
  }
  *wrap = any_ad && dsp_dtype_is_float(om.dtype) &&
          info->family != DSP_FAM_CREATE && info->family != DSP_FAM_OPTIM;
  *out = t;
  return 0;
}

/* one queued Upload whose bulk part is the bytes */
static int remote_upload(dispatch_device *dev, const dsp_meta *m,
                         const void *data, size_t nbytes,
                         dispatch_tensor **out) {
  dispatch_tensor *t;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, m, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_upload(dev, t->id, m, data, nbytes);
  if (rc < 0) {
    t->id = 0; /* never reached the server: nothing to Free */
    dispatch__tensor_unref(t);
    return rc;
  }
  *out = t;
  return 0;
}

static int remote_read(dispatch_tensor *t, void *buf, size_t nbytes) {
  return dispatch__remote_read(t->dev, t->id, buf, nbytes);
}

/* Between two devices of one session (a device and its peers) the server
 * copies: one ToDevice request, no bytes through the client. */
static int remote_move(dispatch_tensor *c, dispatch_device *dev,
                       dispatch_tensor **out) {
  if (c->dev->conn != dev->conn) return 1;
  const char *target = dev->device ? dev->device : dev->conn->server_device;
  if (!target)
    return dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                      "to_device: the server named no session device");
  dispatch_tensor *t;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &c->meta, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_to_device(dev, c->id, t->id, target);
  if (rc < 0) {
    t->id = 0;
    dispatch__tensor_unref(t);
    return rc;
  }
  if ((rc = dispatch__sync_call(dev)) < 0) {
    dispatch__tensor_unref(t);
    return rc;
  }
  dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

/* an AUTODIFF wrapper has no id */
static void remote_release(dispatch_tensor *t) {
  if (t->id) dispatch__remote_free(t->dev, t->id, 0);
}

static void remote_destroy(dispatch_tensor *t) { (void)t; }

static int remote_track(dispatch_tensor *t) {
  return dispatch__remote_track(t->dev, t->id);
}

static int remote_backward(dispatch_tensor *loss, int retain,
                           dispatch_grads *g) {
  dispatch_device *dev = g->dev;
  g->id = dispatch__remote_new_id(dev);
  int rc = dispatch__remote_backward(dev, loss->id, g->id, retain);
  if (rc == 0 && (rc = dispatch__sync_call(dev)) < 0)
    dispatch__remote_free(dev, g->id, 1); /* the failed container */
  return rc;
}

static int remote_grad(dispatch_grads *g, dispatch_tensor *leaf,
                       dispatch_tensor **out) {
  dispatch_device *dev = g->dev;
  /* the client knows an op's output from a leaf, so a non-leaf fails here
   * as on LOCAL (same code and message), not at a later wait */
  if (leaf->made_by)
    return dsp_seterr(dev->ctx, DISPATCH_ENOGRAD,
                      "grads_get: gradients are kept for tracked leaves "
                      "only; this tensor is the output of %s",
                      dsp_op_lookup(leaf->made_by - 1)->name);
  dispatch_tensor *r;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &leaf->meta, 0, &r);
  if (rc < 0) return rc;
  r->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_grad(dev, g->id, leaf->id, r->id);
  if (rc < 0) {
    r->id = 0;
    dispatch__tensor_unref(r);
    return rc;
  }
  *out = r;
  return 0;
}

static void remote_grads_free(dispatch_grads *g) {
  dispatch__remote_free(g->dev, g->id, 1);
}

/* one Step message carrying every parameter */
static int remote_step(dispatch_optim *opt, dispatch_grads *grads,
                       const dsp_attrs *a) {
  dispatch_device *dev = opt->dev;
  uint64_t pstack[64], sstack[128];
  uint64_t *pids = pstack, *sids = sstack;
  if (opt->n > 64) {
    pids = dsp_calloc((size_t)opt->n, sizeof *pids);
    sids = dsp_calloc((size_t)opt->n * (size_t)opt->k, sizeof *sids);
    if (!pids || !sids) {
      dsp_free(pids);
      dsp_free(sids);
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "optim_step: out of memory");
    }
  }
  for (int i = 0; i < opt->n; i++) pids[i] = opt->params[i]->inner->id;
  for (int i = 0; i < opt->n * opt->k; i++) sids[i] = opt->states[i]->id;
  int rc = dispatch__remote_step(dev, opt->op, grads->id, pids, opt->n, sids,
                                 opt->n * opt->k, a);
  if (pids != pstack) {
    dsp_free(pids);
    dsp_free(sids);
  }
  return rc;
}

/* Queues a Free of graph id (a lost connection frees it anyway). */
static void remote_graph_free(dispatch_device *dev, uint64_t id) {
  /* closing too: a peer going leaves its session serving the others */
  if (dev->conn->dead || dev->conn->fd < 0) return;
  Dspwire__Free f = DSPWIRE__FREE__INIT;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  f.n_graphs = 1;
  f.graphs = &id;
  req.body_case = DSPWIRE__REQUEST__BODY_FREE;
  req.free = &f;
  dispatch__remote_queue(dev, &req);
}

static int remote_stats(dispatch_device *dev, dispatch_stats *all) {
  memset(all, 0, sizeof *all);
  return dispatch__remote_stats(dev, all);
}

static int remote_set_cache(dispatch_device *dev, uint64_t bytes) {
  (void)bytes;
  return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                    "set_cache: \"%s\" is a remote device (its "
                    "server's cache is dispatch-server --session-cache)",
                    dev->spec);
}

static int remote_open_row(dispatch_device *dev, const dispatch__open_args *a) {
  return dispatch__remote_open(dev, a->host, a->port, a->token,
                               a->client_name, a->device, a->tls);
}

/* a peer goes while the session stays: free what it made there */
static void remote_detach(dispatch_device *dev) {
  if (!dev->conn || dev->conn->refs <= 1) return;
  for (dispatch_tensor *t = dev->all; t; t = t->anext)
    if (t->id) dispatch__remote_free(dev, t->id, 0);
  for (dispatch_grads *g = dev->grads; g; g = g->next)
    dispatch__remote_free(dev, g->id, 1);
}

static int remote_peer(dispatch_device *dev) {
  (void)dev;
  return 0;
}

const dispatch__kind_ops dispatch__remote_ops = {
    .kind = DISPATCH_KIND_REMOTE,
    .open = remote_open_row,
    .detach = remote_detach,
    .close = dispatch__remote_close,
    .peer = remote_peer,
    .op = remote_op,
    .upload = remote_upload,
    .read = remote_read,
    .move = remote_move,
    .release = remote_release,
    .destroy = remote_destroy,
    .track = remote_track,
    .backward = remote_backward,
    .grad = remote_grad,
    .grads_free = remote_grads_free,
    .step = remote_step,
    .graph_define = dispatch__graph_define_remote,
    .graph_replay = dispatch__graph_replay_remote,
    .graph_free = remote_graph_free,
    .sync = dispatch__remote_sync,
    .stats = remote_stats,
    .devices = dispatch__remote_devices,
    .set_cache = remote_set_cache,
};
