/* The connection of a REMOTE device: one non-blocking socket reached by
 * a connect bounded by the timeout, the transport table's plain TCP row
 * (tls.c has the TLS row), and how a connection fails: lost (a resumable
 * session only loses the socket: DISPATCH__EBROKEN, the caller
 * reconnects, replay.c), dead for good, or told the server is going
 * away. Every wait is a poll() bounded by a deadline, so a lost server
 * gives DISPATCH_ECONN instead of a hang; with keepalives (1.4) a wait
 * tells silence (the connection is lost) from slowness (the wait times
 * out, the session intact). The rest of the library moves bytes through
 * dispatch__send_all and dispatch__recv_all and never asks which
 * transport it has. */
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

#include "conn.h"
#include "frame.h"

#define SEND_PIECE ((size_t)1 << 20)
#define REMOTE_RBUF (16u << 10) /* receive buffer of a plain connection */

int64_t dispatch__now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The deadline of a wait or send starting now: timeout_ms 0 is no bound. */
int64_t dispatch__deadline_in(const dispatch__conn *c) {
  return c->timeout_ms > 0 ? dispatch__now_ms() + c->timeout_ms : INT64_MAX;
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
  uint8_t buf[4096];
  size_t n = c->tr->unread(c, buf, sizeof buf);
  size_t off = 0;
  while (n - off >= DSP_FRAME_HEADER_SIZE) {
    dsp_frame_header h;
    if (dsp_frame_header_decode(buf + off, DISPATCH__MAX_REPLY_MSG, UINT64_MAX,
                                &h) < 0)
      return 0;
    size_t body = n - off - DSP_FRAME_HEADER_SIZE;
    if (h.msg_len > body) return 0;
    Dspwire__Reply *r = dspwire__reply__unpack(
        &dispatch__pb_alloc, h.msg_len, buf + off + DSP_FRAME_HEADER_SIZE);
    if (!r) return 0;
    int bye = r->error && r->error->code == DISPATCH_ESHUTDOWN;
    if (bye)
      snprintf(why, len, "%s", r->error->message ? r->error->message : "");
    dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
    if (bye) return 1;
    if (h.bulk_len > body - h.msg_len) return 0;
    off += DSP_FRAME_HEADER_SIZE + h.msg_len + (size_t)h.bulk_len;
  }
  return 0;
}

/* Closes the socket (and TLS session) and forgets bytes in flight. */
void dispatch__drop_socket(dispatch__conn *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  c->tr->close(c);
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
int dispatch__conn_down(dispatch_device *dev, int code, const char *why) {
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

int dispatch__conn_dead(dispatch_device *dev, const char *why) {
  return dispatch__conn_down(dev, DISPATCH_ECONN, why);
}

/* The socket failed (an error, EOF). The server's goodbye waiting unread
 * makes it a shutdown, for good (a draining server takes no resume); a
 * resumable session otherwise only loses the socket (DISPATCH__EBROKEN: the
 * caller reconnects); else the connection is dead. */
int dispatch__conn_lost(dispatch_device *dev, const char *why) {
  dispatch__conn *c = dev->conn;
  char bye[192];
  if (!c->dead && !c->broken && goodbye_waiting(c, bye, sizeof bye))
    return dispatch__conn_down(dev, DISPATCH_ESHUTDOWN, bye);
  if (!c->resumable || c->dead || c->closing)
    return dispatch__conn_dead(dev, why);
  if (!c->broken) snprintf(c->dead_why, sizeof c->dead_why, "%s", why);
  dispatch__drop_socket(c);
  c->broken = 1;
  return DISPATCH__EBROKEN;
}

int dispatch__check_alive(dispatch_device *dev) {
  if (dev->conn->broken) return DISPATCH__EBROKEN;
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
    c->heard_ms = dispatch__now_ms();
    return 1;
  }
  if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
    return 0;
  return -1;
}

/* Writes all n bytes or loses the connection; each poll waits at most
 * the remaining time to the deadline. With keepalives the
 * timeout bounds silence, not the send: bytes the socket takes or the
 * server sends (its keepalives while it is too busy to read) start it
 * again. */
static int tcp_write(dispatch_device *dev, const void *p, size_t n) {
  dispatch__conn *c = dev->conn;
  const uint8_t *b = p;
  int64_t deadline = dispatch__deadline_in(c);
  int ka = c->ka_ms && c->rbuf && c->timeout_ms > 0;
  if (ka) c->heard_ms = dispatch__now_ms(); /* silence counts from here */
  while (n > 0) {
    /* in pieces of at most SEND_PIECE, as the server writes a Read's
     * bytes (server/conn.h SV_WRITE_PIECE) */
    ssize_t w = send(c->fd, b, n < SEND_PIECE ? n : SEND_PIECE,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      b += w;
      n -= (size_t)w;
      if (ka) deadline = dispatch__deadline_in(c); /* the server takes bytes */
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      char why[128];
      snprintf(why, sizeof why, "send: %s", strerror(errno));
      return dispatch__conn_lost(dev, why);
    }
    int64_t now = dispatch__now_ms(), end = deadline;
    if (ka && c->heard_ms + c->timeout_ms > end)
      end = c->heard_ms + c->timeout_ms;
    if (end - now <= 0) return dispatch__conn_lost(dev, "send timed out");
    short ev = ka && c->rlen - c->rpos < REMOTE_RBUF ? POLLOUT | POLLIN
                                                      : POLLOUT;
    struct pollfd pfd = {c->fd, ev, 0};
    int pr = poll(&pfd, 1, poll_ms(end - now));
    if (pr < 0 && errno != EINTR)
      return dispatch__conn_lost(dev, "poll failed");
    if (pr > 0 && (pfd.revents & POLLIN) && take_early_bytes(c) < 0)
      return dispatch__conn_lost(dev, "the server closed the connection");
  }
  return 0;
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* A server that sends keepalives was silent for the whole timeout. */
int dispatch__conn_silent(dispatch_device *dev) {
  char why[128];
  snprintf(why, sizeof why, "the server sent nothing for %d ms",
           dev->conn->timeout_ms);
  return dispatch__conn_lost(dev, why);
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
      int v = dispatch__wait_verdict(dispatch__now_ms(), c->heard_ms, deadline,
                                     c->timeout_ms, boundary, &left);
      if (v == DISPATCH__WAIT_SILENT) return dispatch__conn_silent(dev);
      if (v == DISPATCH__WAIT_TIMEDOUT) return DISPATCH_ETIMEDOUT;
    } else if (c->timeout_ms > 0 &&
               (left = deadline - dispatch__now_ms()) <= 0) {
      /* an older server: no keepalive tells slow from silent */
      char why[128];
      snprintf(why, sizeof why, "no reply within %d ms", c->timeout_ms);
      return dispatch__conn_dead(dev, why);
    }
    struct pollfd pfd = {c->fd, POLLIN, 0};
    int pr = poll(&pfd, 1, poll_ms(left));
    if (pr > 0) {
      if (record) dispatch__spin_record(&c->spin, spin, now_ns() - t0);
      return 0;
    }
    if (pr < 0 && errno != EINTR)
      return dispatch__conn_lost(dev, "poll failed");
  }
}

/* One non-blocking recv: >0 bytes, 0 nothing yet, or ECONN. */
static long recv_some(dispatch_device *dev, void *p, size_t n) {
  ssize_t r = recv(dev->conn->fd, p, n, MSG_DONTWAIT);
  if (r > 0) {
    dev->conn->heard_ms = dispatch__now_ms();
    return (long)r;
  }
  if (r == 0)
    return dispatch__conn_lost(dev, "the server closed the connection");
  if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return 0;
  char why[128];
  snprintf(why, sizeof why, "recv: %s", strerror(errno));
  return dispatch__conn_lost(dev, why);
}

/* Reads exactly n bytes: bytes already in rbuf come first;
 * a short remainder is read into rbuf with whatever else has arrived (a
 * reply's header, message and the start of its bulk in one recv), a long
 * one straight into p, so a bulk lands in the caller's buffer without an
 * intermediate copy. wait_first: poll before the first recv (a reply that
 * cannot have arrived yet), saving a recv that would only say EAGAIN.
 * boundary: p is a frame's start, where the deadline may end the wait
 * with DISPATCH_ETIMEDOUT while none of it was read (keepalives only). */
static int tcp_read(dispatch_device *dev, void *p, size_t n, int64_t deadline,
                    int wait_first, int boundary) {
  dispatch__conn *c = dev->conn;
  uint8_t *b = p;
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
    if (c->fd < 0) return dispatch__check_alive(dev);
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

/* Plain TCP reads through a receive buffer; a reconnect keeps it. */
static int tcp_open(dispatch_device *dev, const char *host,
                    const dispatch_options *tls) {
  (void)host, (void)tls;
  dispatch__conn *c = dev->conn;
  if (c->rbuf) return 0;
  c->rbuf = dsp_malloc(REMOTE_RBUF);
  if (!c->rbuf)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "%s: out of memory for the receive buffer", dev->spec);
  return 0;
}

/* What rbuf holds unread, then what the socket holds now (taken from it:
 * the connection is being lost). */
static size_t tcp_unread(dispatch__conn *c, uint8_t *buf, size_t cap) {
  if (c->fd < 0 || !c->rbuf) return 0;
  size_t n = c->rlen > c->rpos ? c->rlen - c->rpos : 0;
  if (n > cap) n = cap;
  memcpy(buf, c->rbuf + c->rpos, n);
  while (n < cap) {
    ssize_t r = recv(c->fd, buf + n, cap - n, MSG_DONTWAIT);
    if (r <= 0) break;
    n += (size_t)r;
  }
  return n;
}

static void tcp_close(dispatch__conn *c) { (void)c; }

const dispatch__transport dispatch__transport_tcp = {
    .name = "tcp",
    .open = tcp_open,
    .write = tcp_write,
    .read = tcp_read,
    .unread = tcp_unread,
    .close = tcp_close,
};

int dispatch__conn_open(dispatch_device *dev, const char *host,
                        const char *port, const dispatch_options *tls) {
  int rc = connect_to(dev, host, port);
  if (rc == 0) rc = dev->conn->tr->open(dev, host, tls);
  return rc;
}

int dispatch__send_all(dispatch_device *dev, const void *p, size_t n) {
  return dev->conn->tr->write(dev, p, n);
}

int dispatch__recv_all(dispatch_device *dev, void *p, size_t n,
                       int64_t deadline, int wait_first, int boundary) {
  return dev->conn->tr->read(dev, p, n, deadline, wait_first, boundary);
}
