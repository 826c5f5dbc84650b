/* Client-side TLS for tls:// devices. OpenSSL works over a BIO of this
 * file that moves the ciphertext with send(MSG_NOSIGNAL)/recv on the
 * non-blocking socket (records go between the socket and OpenSSL's own
 * buffers with no copy in between), each wait a poll bounded by the
 * caller's deadline: so a TLS device keeps the ECONN-within-the-timeout
 * guarantee of tcp://, and a closed peer can never raise SIGPIPE in the
 * application. */
#include <arpa/inet.h>
#include <errno.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "conn.h"

#define TLS_CHUNK (1u << 20) /* plaintext encrypted per step */
#define TLS_READ_BUF (256u << 10) /* ciphertext OpenSSL reads per recv */

/* The socket BIO's state: the fd, and why the socket itself failed (the
 * server closed, recv/send errors), which step() reports as such rather
 * than as a TLS failure. */
typedef struct sock_bio {
  int fd;
  char why[128];
} sock_bio;

static int sock_write(BIO *b, const char *p, size_t n, size_t *done) {
  sock_bio *s = BIO_get_data(b);
  BIO_clear_retry_flags(b);
  for (;;) {
    ssize_t w = send(s->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w >= 0) {
      *done = (size_t)w;
      return 1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      BIO_set_retry_write(b);
    } else if (!s->why[0]) {
      snprintf(s->why, sizeof s->why, "send: %s", strerror(errno));
    }
    return 0;
  }
}

static int sock_read(BIO *b, char *p, size_t n, size_t *got) {
  sock_bio *s = BIO_get_data(b);
  BIO_clear_retry_flags(b);
  for (;;) {
    ssize_t r = recv(s->fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      *got = (size_t)r;
      return 1;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      BIO_set_retry_read(b);
    } else if (!s->why[0]) {
      if (r == 0)
        snprintf(s->why, sizeof s->why, "the server closed the connection");
      else
        snprintf(s->why, sizeof s->why, "recv: %s", strerror(errno));
    }
    return 0;
  }
}

static long sock_ctrl(BIO *b, int cmd, long num, void *ptr) {
  (void)b;
  (void)num;
  (void)ptr;
  return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

static int sock_destroy(BIO *b) {
  OPENSSL_free(BIO_get_data(b));
  BIO_set_data(b, NULL);
  return 1;
}

static BIO_METHOD *sock_method;
static void sock_method_init(void) {
  BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK,
                               "dispatch socket");
  if (m && (!BIO_meth_set_write_ex(m, sock_write) ||
            !BIO_meth_set_read_ex(m, sock_read) ||
            !BIO_meth_set_ctrl(m, sock_ctrl) ||
            !BIO_meth_set_destroy(m, sock_destroy))) {
    BIO_meth_free(m);
    m = NULL;
  }
  sock_method = m;
}

/* A BIO on the socket fd (NULL when out of memory). */
static BIO *sock_bio_new(int fd) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, sock_method_init);
  if (!sock_method) return NULL;
  BIO *b = BIO_new(sock_method);
  sock_bio *s = b ? OPENSSL_zalloc(sizeof *s) : NULL;
  if (!s) {
    BIO_free(b);
    return NULL;
  }
  s->fd = fd;
  BIO_set_data(b, s);
  BIO_set_init(b, 1);
  return b;
}

/* Why the socket under the session failed, or NULL. */
static const char *sock_failure(dispatch__conn *c) {
  BIO *b = c->ssl ? SSL_get_rbio(c->ssl) : NULL;
  sock_bio *s = b ? BIO_get_data(b) : NULL;
  return s && s->why[0] ? s->why : NULL;
}

static int64_t tls_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The reason of a failed TLS call: a certificate the verifier refused is
 * named by the verifier's reason (expired, unknown CA, hostname
 * mismatch); otherwise OpenSSL's first queued error. */
static void tls_reason(dispatch__conn *c, char *why, size_t len) {
  long v = c->ssl ? SSL_get_verify_result(c->ssl) : X509_V_OK;
  unsigned long e = ERR_peek_error();
  char r[256] = "";
  if (e) ERR_error_string_n(e, r, sizeof r);
  if (v != X509_V_OK)
    snprintf(why, len, "certificate verify failed: %s",
             X509_verify_cert_error_string(v));
  else if (*r)
    snprintf(why, len, "%s", r);
  else
    snprintf(why, len, "TLS failure without an OpenSSL reason");
  ERR_clear_error();
  c->tls_failed = 1;
}

/* Waits for the socket within the deadline: 0 ready, -1 why filled. */
static int wait_fd(dispatch__conn *c, short ev, int64_t deadline, char *why,
                   size_t len) {
  for (;;) {
    int64_t left = deadline - tls_now_ms();
    if (left <= 0) {
      snprintf(why, len, "no progress within %d ms", c->timeout_ms);
      c->tls_expired = 1;
      return -1;
    }
    struct pollfd pfd = {c->fd, ev, 0};
    /* deadline INT64_MAX: no bound (timeout 0), polled in long pieces */
    int pr = poll(&pfd, 1, left > (1 << 30) ? (1 << 30) : (int)left);
    if (pr > 0) return 0;
    if (pr < 0 && errno != EINTR) {
      snprintf(why, len, "poll: %s", strerror(errno));
      return -1;
    }
  }
}

/* After an SSL call returned rc <= 0: waits (within the deadline) for
 * the socket to take or bring what OpenSSL wants; a failed socket is
 * reported as itself, not as a TLS failure. 0: retry the call; -1: why
 * filled. */
static int step(dispatch__conn *c, int rc, int64_t deadline, char *why,
                size_t len) {
  int err = SSL_get_error(c->ssl, rc);
  const char *sock = sock_failure(c);
  if (sock) { /* the socket failed, not TLS */
    snprintf(why, len, "%s", sock);
    ERR_clear_error();
    return -1;
  }
  if (err == SSL_ERROR_WANT_READ) return wait_fd(c, POLLIN, deadline, why, len);
  if (err == SSL_ERROR_WANT_WRITE)
    return wait_fd(c, POLLOUT, deadline, why, len);
  if (err == SSL_ERROR_ZERO_RETURN) {
    snprintf(why, len, "the server closed the TLS session");
    return -1;
  }
  tls_reason(c, why, len);
  return -1;
}

/* Encrypts and sends all n bytes: 0, or -1 with the reason in why. */
static int tls_write(dispatch__conn *c, const void *p, size_t n,
                     int64_t deadline, char *why, size_t len) {
  const uint8_t *b = p;
  while (n > 0) {
    size_t k = n < TLS_CHUNK ? n : TLS_CHUNK, done = 0;
    int rc = SSL_write_ex(c->ssl, b, k, &done);
    if (rc == 1) {
      b += done;
      n -= done;
    } else if (step(c, rc, deadline, why, len) < 0) {
      return -1;
    }
  }
  return 0; /* the socket BIO sent every record SSL_write_ex made */
}

/* Receives 1..n plaintext bytes (*got): 0, or -1 with the reason. */
static int tls_read(dispatch__conn *c, void *p, size_t n, size_t *got,
                    int64_t deadline, char *why, size_t len) {
  for (;;) {
    int rc = SSL_read_ex(c->ssl, p, n, got);
    if (rc == 1) return 0;
    if (step(c, rc, deadline, why, len) < 0) return -1;
  }
}

static int is_ip_literal(const char *s) {
  unsigned char a[16];
  return inet_pton(AF_INET, s, a) == 1 || inet_pton(AF_INET6, s, a) == 1;
}

static const char *opt_or_env(const char *v, const char *env) {
  if (v && *v) return v;
  v = getenv(env);
  return v && *v ? v : NULL;
}

/* Builds the context (TLS 1.2 minimum, peer verification on, the CA file
 * or the system store, an optional client certificate), pins the name
 * the certificate must carry and runs the handshake within the device's
 * timeout. On failure the detail is in dev->ctx and the code is
 * DISPATCH_ETLS (or DISPATCH_ECONN when the socket itself failed). */
static int tls_open(dispatch_device *dev, const char *host,
                    const dispatch_options *o) {
  dispatch__conn *c = dev->conn;
  const char *ca = opt_or_env(o->ca_file, "DISPATCH_TLS_CA");
  const char *cert = opt_or_env(o->cert_file, "DISPATCH_TLS_CERT");
  const char *key = opt_or_env(o->key_file, "DISPATCH_TLS_KEY");
  const char *name = opt_or_env(o->server_name, "DISPATCH_TLS_SERVER_NAME");
  if (!name) name = host;
  if (!key) key = cert;
  char why[384];
  const char *what = "create a TLS context";
  const char *file = NULL;
  ERR_clear_error();
  c->ssl_ctx = SSL_CTX_new(TLS_client_method());
  if (!c->ssl_ctx) goto fail;
  what = "set the minimum TLS version";
  if (!SSL_CTX_set_min_proto_version(c->ssl_ctx, TLS1_2_VERSION)) goto fail;
  SSL_CTX_set_verify(c->ssl_ctx, SSL_VERIFY_PEER, NULL);
  if (ca) {
    what = "load the CA file";
    file = ca;
    if (SSL_CTX_load_verify_locations(c->ssl_ctx, ca, NULL) != 1) goto fail;
  } else {
    what = "load the system trust store";
    if (SSL_CTX_set_default_verify_paths(c->ssl_ctx) != 1) goto fail;
  }
  if (cert) {
    what = "load the client certificate";
    file = cert;
    if (SSL_CTX_use_certificate_chain_file(c->ssl_ctx, cert) != 1) goto fail;
    what = "load the client key";
    file = key;
    if (SSL_CTX_use_PrivateKey_file(c->ssl_ctx, key, SSL_FILETYPE_PEM) != 1)
      goto fail;
    what = "match the client key to its certificate";
    file = NULL;
    if (SSL_CTX_check_private_key(c->ssl_ctx) != 1) goto fail;
  }
  what = "create a TLS session";
  c->ssl = SSL_new(c->ssl_ctx);
  BIO *sb = c->ssl ? sock_bio_new(c->fd) : NULL;
  if (!sb) goto fail;
  SSL_set_bio(c->ssl, sb, sb);
  /* whole socket reads of up to TLS_READ_BUF, not a recv per record
   * header and another per record body */
  SSL_set_default_read_buffer_len(c->ssl, TLS_READ_BUF);
  SSL_set_read_ahead(c->ssl, 1);
  what = "set the server name to verify";
  if (is_ip_literal(name)) {
    if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(c->ssl), name) != 1)
      goto fail;
  } else {
    SSL_set_hostflags(c->ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (SSL_set1_host(c->ssl, name) != 1 ||
        SSL_set_tlsext_host_name(c->ssl, name) != 1)
      goto fail;
  }
  SSL_set_connect_state(c->ssl);
  int64_t deadline =
      c->timeout_ms > 0 ? tls_now_ms() + c->timeout_ms : INT64_MAX;
  for (;;) {
    int rc = SSL_do_handshake(c->ssl);
    if (rc == 1) break;
    if (step(c, rc, deadline, why, sizeof why) < 0) {
      return dsp_seterr(dev->ctx, DISPATCH_ETLS,
                        "%s: TLS handshake failed: %s (server name checked: "
                        "%s%s%s)",
                        dev->spec, why, name, ca ? ", CA file " : "",
                        ca ? ca : "");
    }
  }
  return 0;
fail:
  tls_reason(c, why, sizeof why);
  return dsp_seterr(dev->ctx, DISPATCH_ETLS, "%s: cannot %s%s%s: %s",
                    dev->spec, what, file ? " " : "", file ? file : "", why);
}

/* Best effort close_notify (never waits), then frees the session. */
static void tls_close(dispatch__conn *c) {
  if (c->ssl && c->fd >= 0 && !c->dead && SSL_is_init_finished(c->ssl)) {
    SSL_shutdown(c->ssl); /* the socket BIO sends without waiting */
  }
  SSL_free(c->ssl);
  SSL_CTX_free(c->ssl_ctx);
  c->ssl = NULL;
  c->ssl_ctx = NULL;
  ERR_clear_error();
}

/* The TLS row of the transport table (conn.c has plain TCP's). */

/* Writes all n bytes or loses the connection, within the timeout. */
static int tls_write_all(dispatch_device *dev, const void *p, size_t n) {
  dispatch__conn *c = dev->conn;
  char why[384];
  if (tls_write(c, p, n, dispatch__deadline_in(c), why, sizeof why) < 0)
    return dispatch__conn_lost(dev, why);
  return 0;
}

/* Reads exactly n plaintext bytes. OpenSSL buffers the records itself
 * (read ahead), so there is no receive buffer here and no poll before the
 * first read (wait_first): a read that needs bytes waits in tls_read.
 * With keepalives the deadline ends only a wait at a frame boundary
 * (DISPATCH_ETIMEDOUT); silence for the timeout ends any. */
static int tls_read_all(dispatch_device *dev, void *p, size_t n,
                        int64_t deadline, int wait_first, int boundary) {
  (void)wait_first;
  dispatch__conn *c = dev->conn;
  uint8_t *b = p;
  while (n > 0) {
    char why[384];
    size_t got = 0;
    int64_t dl = c->timeout_ms > 0 ? deadline : INT64_MAX;
    if (c->ka_ms) {
      int64_t now = dispatch__now_ms(), left;
      int v = dispatch__wait_verdict(now, c->heard_ms, deadline,
                                     c->timeout_ms, boundary && b == p,
                                     &left);
      if (v == DISPATCH__WAIT_SILENT) return dispatch__conn_silent(dev);
      if (v == DISPATCH__WAIT_TIMEDOUT) return DISPATCH_ETIMEDOUT;
      dl = left < 0 ? INT64_MAX : now + left;
    }
    c->tls_expired = 0;
    if (tls_read(c, b, n, &got, dl, why, sizeof why) < 0) {
      if (c->ka_ms && c->tls_expired) continue; /* judged above */
      return dispatch__conn_lost(dev, why);
    }
    c->heard_ms = dispatch__now_ms();
    b += got;
    n -= got;
  }
  return 0;
}

/* a TLS connection's unread bytes are records in OpenSSL's buffers: none
 * is looked at */
static size_t tls_unread(dispatch__conn *c, uint8_t *buf, size_t cap) {
  (void)c, (void)buf, (void)cap;
  return 0;
}

const dispatch__transport dispatch__transport_tls = {
    .name = "tls",
    .open = tls_open,
    .write = tls_write_all,
    .read = tls_read_all,
    .unread = tls_unread,
    .close = tls_close,
};
