/* Server-to-server transfers (protocol 1.7): a tensor moves from this
 * server to a peer, or from a peer to this one, without passing through
 * the client.
 *
 * Source side: PeerGrant pins a snapshot of one tensor of the session and
 * hands the client a single-use capability for it (32 random bytes,
 * valid --peer-cap-ttl seconds). PeerFetch, sent by a peer server over its
 * own authenticated connection, consumes the capability and answers with
 * the snapshot's bytes. A Free of the tensor, or the end of its session,
 * revokes its capabilities.
 *
 * Destination side: PeerPull names a peer of --peer and a capability.
 * The worker charges the tensor to the session first, then connects to
 * the peer (blocking socket with --peer-timeout on every wait, TLS with
 * verification when --peer-ca is set, its own client credentials),
 * fetches into the new tensor's staging and inserts it only when every
 * byte arrived. The pull runs on a worker, never on the network thread,
 * so the loop keeps serving every other session meanwhile. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <uv.h>

#include "handlers.h"
#include "wire_req.h"

/* ------------------------------------------------------------ capabilities */

#define CAP_LEN 32
#define CAP_MAX 1024 /* outstanding capabilities of the whole server */

typedef struct peer_cap {
  uint8_t key[CAP_LEN];
  dsp_pin *pin;       /* the granted bytes (NULL: a free slot) */
  dsp_meta meta;
  const sv_session *owner; /* for revocation only, never dereferenced */
  uint64_t id;
  uint64_t expires_ms;
} peer_cap;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static peer_cap g_caps[CAP_MAX];
static atomic_int g_n_caps; /* slots in use: 0 lets a Free skip the lock */

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

/* Empties slot c (under g_mu); the pin is handed to *pins for release
 * outside the lock. */
static void cap_clear(peer_cap *c, dsp_pin **pins, size_t *n_pins) {
  pins[(*n_pins)++] = c->pin;
  memset(c, 0, sizeof *c);
  atomic_fetch_sub(&g_n_caps, 1);
}

/* Drops the capabilities that match: owner s (NULL: any) and id (0: any
 * of s), or, with expired set, those past their time. Pins are released
 * after the lock, in batches. */
static void caps_drop(const sv_session *s, uint64_t id, int expired) {
  if (atomic_load(&g_n_caps) == 0) return;
  dsp_pin *pins[64];
  size_t n = 0;
  uint64_t now = now_ms();
  for (size_t i = 0; i < CAP_MAX;) {
    pthread_mutex_lock(&g_mu);
    for (; i < CAP_MAX && n < 64; i++) {
      peer_cap *c = &g_caps[i];
      if (!c->pin) continue;
      int hit = expired ? c->expires_ms <= now
                        : c->owner == s && (id == 0 || c->id == id);
      if (hit) cap_clear(c, pins, &n);
    }
    pthread_mutex_unlock(&g_mu);
    for (size_t k = 0; k < n; k++) dsp_pin_release(pins[k]);
    n = 0;
  }
}

void sv_peer_revoke(const sv_session *s, uint64_t id) { caps_drop(s, id, 0); }

int sv_exec_peer_grant(sv_session *s, sv_job *j, char *why, size_t len) {
  const sv_config *cfg = s->cfg;
  if (!cfg->name)
    return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                  "peer_grant: this server has no --name, so no peer could "
                  "name it: server-to-server transfers from it are off");
  dsp_tensor *t;
  int rc = sv_get_tensor(s, j->req->peer_grant->id, SV_LABEL("peer_grant"),
                         why, len, &t);
  if (rc < 0) return rc;
  caps_drop(NULL, 0, 1);
  peer_cap c;
  memset(&c, 0, sizeof c);
  if (RAND_bytes(c.key, CAP_LEN) != 1)
    return sv_why(why, len, DISPATCH_EINTERNAL,
                  "peer_grant: no random bytes for the capability");
  if (dsp_tensor_pin(s->ctx, t, &c.pin) < 0)
    return sv_why(why, len, DISPATCH_ENOMEM,
                  "peer_grant: out of memory pinning the tensor");
  c.meta = t->meta;
  c.owner = s;
  c.id = j->req->peer_grant->id;
  uint64_t ttl_ms = (uint64_t)cfg->peer_cap_ttl_s * 1000u;
  c.expires_ms = now_ms() + ttl_ms;
  int slot = -1;
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < CAP_MAX && slot < 0; i++)
    if (!g_caps[i].pin) slot = i;
  if (slot >= 0) {
    g_caps[slot] = c;
    atomic_fetch_add(&g_n_caps, 1);
  }
  pthread_mutex_unlock(&g_mu);
  if (slot < 0) {
    dsp_pin_release(c.pin);
    return sv_why(why, len, DISPATCH_ELIMIT,
                  "peer_grant: %d capabilities are outstanding, the most "
                  "this server keeps; retry when some are used or expired",
                  CAP_MAX);
  }
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__PeerGrantReply g = DSPWIRE__PEER_GRANT_REPLY__INIT;
  Dspwire__TensorMeta m;
  sv_wire_meta(&m, &c.meta);
  g.capability.data = c.key;
  g.capability.len = CAP_LEN;
  g.name = (char *)cfg->name;
  g.meta = &m;
  g.ttl_ms = (uint32_t)ttl_ms;
  r.body_case = DSPWIRE__REPLY__BODY_PEER_GRANT;
  r.peer_grant = &g;
  /* on failure the client never learns it: it may as well not exist */
  rc = sv_job_reply(j, &r, "peer_grant", why, len);
  OPENSSL_cleanse(&c, sizeof c);
  return rc;
}

int sv_exec_peer_fetch(sv_session *s, sv_job *j, char *why, size_t len) {
  const ProtobufCBinaryData *k = &j->req->peer_fetch->capability;
  peer_cap c;
  int found = 0;
  if (k->len == CAP_LEN) {
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < CAP_MAX && !found; i++) {
      if (!g_caps[i].pin || CRYPTO_memcmp(g_caps[i].key, k->data, CAP_LEN))
        continue;
      c = g_caps[i]; /* taken: single use, whatever follows */
      memset(&g_caps[i], 0, sizeof g_caps[i]);
      atomic_fetch_sub(&g_n_caps, 1);
      found = 1;
    }
    pthread_mutex_unlock(&g_mu);
  }
  if (!found)
    return sv_why(why, len, DISPATCH_ECAPABILITY,
                  "peer_fetch: unknown capability (never issued, already "
                  "used, or revoked because its tensor was freed)");
  if (c.expires_ms <= now_ms()) {
    dsp_pin_release(c.pin);
    return sv_why(why, len, DISPATCH_ECAPABILITY,
                  "peer_fetch: the capability expired (--peer-cap-ttl %d s)",
                  s->cfg->peer_cap_ttl_s);
  }
  if (SV_LOG_ON(SV_LOG_INFO))
    sv_log(SV_LOG_INFO, "conn %llu: peer fetch of tensor %llu (%zu bytes)",
           s->log_id, (unsigned long long)c.id, dsp_pin_nbytes(c.pin));
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__ReadReply rr = DSPWIRE__READ_REPLY__INIT;
  Dspwire__TensorMeta m;
  sv_wire_meta(&m, &c.meta);
  rr.meta = &m;
  r.req_id = j->req->req_id;
  r.body_case = DSPWIRE__REPLY__BODY_READ;
  r.read = &rr;
  int rc = sv_encode_pin_reply(&r, c.pin, j); /* takes the pin */
  if (rc < 0) return sv_why(why, len, rc, "peer_fetch: out of memory");
  return 0;
}

/* ------------------------------------------------------------ credentials */

/* What a pull presents to its peer: --peer-token-file's token and, with
 * --peer-ca, one TLS client context built from --peer-ca, --peer-cert and
 * --peer-key. Both are made at start and replaced on SIGHUP (reload.c),
 * each on its own: a file that cannot be used is refused there and the
 * one in use stays. A pull takes a copy of the token and a reference to
 * the context under g_cred_mu, so a reload during a pull changes nothing
 * for it; the next pull presents what the reload put. */
static pthread_mutex_t g_cred_mu = PTHREAD_MUTEX_INITIALIZER;
static char *g_token; /* NULL: the hello carries no token */
static size_t g_token_len;
static SSL_CTX *g_ctx; /* NULL: no --peer-ca, plain TCP */

/* A TLS client context from the --peer-* files: the context, or NULL
 * with why (which step, OpenSSL's reason). */
static SSL_CTX *ctx_build(const sv_config *cfg, char *why, size_t len) {
  char step[600];
  snprintf(step, sizeof step, "setting up TLS");
  SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
  if (!ctx || !SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION)) goto fail;
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
  snprintf(step, sizeof step, "loading --peer-ca %s", cfg->peer_ca);
  if (SSL_CTX_load_verify_locations(ctx, cfg->peer_ca, NULL) != 1) goto fail;
  if (cfg->peer_cert) {
    snprintf(step, sizeof step, "loading --peer-cert %s with --peer-key %s",
             cfg->peer_cert, cfg->peer_key);
    if (SSL_CTX_use_certificate_chain_file(ctx, cfg->peer_cert) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, cfg->peer_key, SSL_FILETYPE_PEM) !=
            1 ||
        SSL_CTX_check_private_key(ctx) != 1)
      goto fail;
  }
  return ctx;
fail:;
  unsigned long err = ERR_get_error();
  ERR_clear_error();
  char buf[256] = "";
  if (err) ERR_error_string_n(err, buf, sizeof buf);
  snprintf(why, len, "%s failed%s%s", step, buf[0] ? ": " : "", buf);
  SSL_CTX_free(ctx);
  return NULL;
}

void sv_peer_set_token(char *tok, size_t len) {
  pthread_mutex_lock(&g_cred_mu);
  char *old = g_token;
  size_t old_len = g_token_len;
  g_token = tok;
  g_token_len = len;
  pthread_mutex_unlock(&g_cred_mu);
  sv_secret_free(&old, &old_len);
}

int sv_peer_reload_tls(const sv_config *cfg, char *why, size_t len) {
  SSL_CTX *ctx = ctx_build(cfg, why, len);
  if (!ctx) return -1;
  pthread_mutex_lock(&g_cred_mu);
  SSL_CTX *old = g_ctx;
  g_ctx = ctx;
  pthread_mutex_unlock(&g_cred_mu);
  SSL_CTX_free(old); /* a pull that holds it keeps its own reference */
  return 0;
}

int sv_peer_creds_start(const sv_config *cfg, char *why, size_t len) {
  if (cfg->peer_token) {
    char *t = dsp_malloc(cfg->peer_token_len + 1);
    if (!t) {
      snprintf(why, len, "out of memory for the peer token");
      return DISPATCH_ENOMEM;
    }
    memcpy(t, cfg->peer_token, cfg->peer_token_len + 1);
    sv_peer_set_token(t, cfg->peer_token_len);
  }
  if (cfg->peer_ca && sv_peer_reload_tls(cfg, why, len) < 0) {
    sv_peer_creds_free();
    return DISPATCH_ETLS;
  }
  return 0;
}

void sv_peer_creds_free(void) {
  sv_peer_set_token(NULL, 0);
  pthread_mutex_lock(&g_cred_mu);
  SSL_CTX *old = g_ctx;
  g_ctx = NULL;
  pthread_mutex_unlock(&g_cred_mu);
  SSL_CTX_free(old);
}

/* The credentials for one pull: a copy of the token in *tok (free with
 * sv_secret_free; NULL: none) and a reference to the TLS context in *ctx
 * (NULL: plain TCP). 0, or ENOMEM with why. */
static int creds_take(char **tok, size_t *tok_len, SSL_CTX **ctx, char *why,
                      size_t len) {
  int rc = 0;
  *tok = NULL;
  *tok_len = 0;
  pthread_mutex_lock(&g_cred_mu);
  if (g_token && (*tok = dsp_malloc(g_token_len + 1)) != NULL) {
    memcpy(*tok, g_token, g_token_len + 1);
    *tok_len = g_token_len;
  } else if (g_token) {
    rc = sv_why(why, len, DISPATCH_ENOMEM,
                "peer_pull: out of memory for the peer token");
  }
  *ctx = rc == 0 && g_ctx && SSL_CTX_up_ref(g_ctx) == 1 ? g_ctx : NULL;
  pthread_mutex_unlock(&g_cred_mu);
  return rc;
}

/* ------------------------------------------------------------ the pull */

/* One connection to a peer: a blocking socket whose every wait is held to
 * --peer-timeout (SO_RCVTIMEO/SO_SNDTIMEO), with TLS over it or not. */
typedef struct peer_conn {
  int fd;
  SSL_CTX *ctx;
  SSL *ssl;
  const char *name; /* the peer's, for messages */
} peer_conn;

static void pc_close(peer_conn *p) {
  if (p->ssl) {
    SSL_shutdown(p->ssl);
    SSL_free(p->ssl);
  }
  if (p->ctx) SSL_CTX_free(p->ctx);
  if (p->fd >= 0) close(p->fd);
  p->ssl = NULL;
  p->ctx = NULL;
  p->fd = -1;
}

static int io_fail(peer_conn *p, const char *what, char *why, size_t len) {
  int e = errno;
  if (e == EAGAIN || e == EWOULDBLOCK)
    return sv_why(why, len, DISPATCH_ETIMEDOUT,
                  "peer_pull: peer '%s' was silent for --peer-timeout while "
                  "%s", p->name, what);
  return sv_why(why, len, DISPATCH_ECONN,
                "peer_pull: the connection to peer '%s' dropped while %s%s%s",
                p->name, what, e ? ": " : "", e ? strerror(e) : "");
}

static int pc_write(peer_conn *p, const void *buf, size_t n, char *why,
                    size_t len) {
  const uint8_t *b = buf;
  while (n) {
    errno = 0;
    long w;
    if (p->ssl) {
      int k = SSL_write(p->ssl, b, n > INT32_MAX ? INT32_MAX : (int)n);
      w = k > 0 ? k : -1;
    } else {
      w = send(p->fd, b, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
    }
    if (w <= 0) return io_fail(p, "sending", why, len);
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads exactly n bytes into buf. With st, every read is reported to the
 * staging (dsp_stage_progress) so a device backend copies parts while
 * the next arrive. */
static int pc_read(peer_conn *p, void *buf, size_t n, dsp_stage *st,
                   char *why, size_t len) {
  uint8_t *b = buf;
  size_t got = 0;
  while (got < n) {
    errno = 0;
    long r;
    size_t want = n - got > (1u << 30) ? (1u << 30) : n - got;
    if (p->ssl) {
      int k = SSL_read(p->ssl, b + got, (int)want);
      r = k > 0 ? k : -1;
    } else {
      r = recv(p->fd, b + got, want, 0);
      if (r < 0 && errno == EINTR) continue;
    }
    if (r <= 0) return io_fail(p, "receiving", why, len);
    got += (size_t)r;
    if (st) dsp_stage_progress(st, got);
  }
  return 0;
}

/* Connects to host:port within timeout_s, the resolved address loopback
 * or TLS required (unless --insecure). */
static int pc_connect(const sv_config *cfg, peer_conn *p, const char *host,
                      const char *port, char *why, size_t len) {
  struct addrinfo hints, *ai = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, port, &hints, &ai);
  if (g != 0 || !ai)
    return sv_why(why, len, DISPATCH_EPEER,
                  "peer_pull: cannot resolve peer '%s' (%s): %s", p->name,
                  host, g ? gai_strerror(g) : "no address");
  if (!cfg->peer_ca && !cfg->insecure && !sv_addr_is_loopback(ai->ai_addr)) {
    freeaddrinfo(ai);
    return sv_why(why, len, DISPATCH_EPEER,
                  "peer_pull: refusing plain TCP to peer '%s' (%s), which "
                  "is not a loopback address: set --peer-ca for TLS",
                  p->name, host);
  }
  p->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (p->fd < 0) {
    freeaddrinfo(ai);
    return sv_why(why, len, DISPATCH_EIO, "peer_pull: socket: %s",
                  strerror(errno));
  }
  struct timeval tv = {cfg->peer_timeout_s, 0};
  setsockopt(p->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(p->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  setsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  /* a blocking connect is bounded by SO_SNDTIMEO on Linux */
  int c = connect(p->fd, ai->ai_addr, ai->ai_addrlen);
  int e = errno;
  freeaddrinfo(ai);
  if (c != 0)
    return sv_why(why, len, DISPATCH_EPEER,
                  "peer_pull: cannot connect to peer '%s' (%s:%s): %s",
                  p->name, host, port,
                  e == EINPROGRESS || e == EAGAIN ? "timed out"
                                                  : strerror(e));
  return 0;
}

/* TLS over p->fd with p->ctx (the --peer-* credentials), the peer's
 * certificate verified against --peer-ca and its host name (or IP). */
static int pc_tls(peer_conn *p, const char *host, char *why, size_t len) {
  unsigned long err = 0;
  const char *step = "setting up TLS";
  p->ssl = SSL_new(p->ctx);
  if (!p->ssl || SSL_set_fd(p->ssl, p->fd) != 1) goto fail;
  struct in6_addr a6;
  struct in_addr a4;
  if (inet_pton(AF_INET, host, &a4) == 1 || inet_pton(AF_INET6, host, &a6) == 1) {
    if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(p->ssl), host) != 1)
      goto fail;
  } else if (SSL_set1_host(p->ssl, host) != 1 ||
             SSL_set_tlsext_host_name(p->ssl, host) != 1) {
    goto fail;
  }
  step = "the TLS handshake";
  if (SSL_connect(p->ssl) != 1) goto fail;
  return 0;
fail:
  err = ERR_get_error();
  ERR_clear_error();
  char buf[256] = "";
  if (err) ERR_error_string_n(err, buf, sizeof buf);
  long v = p->ssl ? SSL_get_verify_result(p->ssl) : X509_V_OK;
  return sv_why(why, len, DISPATCH_ETLS, "peer_pull: peer '%s': %s failed%s%s%s",
                p->name, step, buf[0] ? ": " : "", buf,
                v != X509_V_OK ? X509_verify_cert_error_string(v) : "");
}

/* Sends req as one frame. */
static int pc_send(peer_conn *p, Dspwire__Request *req, char *why,
                   size_t len) {
  size_t n = dsp_req_frame_size(req);
  uint8_t *buf = dsp_malloc(n);
  if (!buf) return sv_why(why, len, DISPATCH_ENOMEM, "peer_pull: out of memory");
  dsp_req_frame_encode(req, 0, buf);
  int rc = pc_write(p, buf, n, why, len);
  dsp_free(buf);
  return rc;
}

/* Reads one reply frame's header and message: 0 with *out (free with
 * dspwire__reply__free_unpacked) and *bulk_len; the peer's own error is
 * returned as its code with its message. */
static int pc_reply(peer_conn *p, Dspwire__Reply **out, uint64_t *bulk_len,
                    char *why, size_t len) {
  uint8_t hb[DSP_FRAME_HEADER_SIZE];
  dsp_frame_header h;
  *out = NULL;
  int rc = pc_read(p, hb, sizeof hb, NULL, why, len);
  if (rc < 0) return rc;
  if (dsp_frame_header_decode(hb, 1u << 20, UINT64_MAX, &h) < 0)
    return sv_why(why, len, DISPATCH_EPROTO,
                  "peer_pull: peer '%s' sent a malformed frame", p->name);
  uint8_t *m = dsp_malloc(h.msg_len ? h.msg_len : 1);
  if (!m) return sv_why(why, len, DISPATCH_ENOMEM, "peer_pull: out of memory");
  rc = pc_read(p, m, h.msg_len, NULL, why, len);
  Dspwire__Reply *r =
      rc < 0 ? NULL : dspwire__reply__unpack(&sv_pb_allocator, h.msg_len, m);
  dsp_free(m);
  if (rc < 0) return rc;
  if (!r)
    return sv_why(why, len, DISPATCH_EPROTO,
                  "peer_pull: peer '%s' sent a reply that does not decode",
                  p->name);
  if (r->error && r->error->code) {
    int code = r->error->code < 0 ? r->error->code : DISPATCH_EPROTO;
    char msg[4 * 200 + 8];
    sv_log_str(msg, sizeof msg, r->error->message ? r->error->message : "",
               200);
    rc = sv_why(why, len, code, "peer_pull: peer '%s' refused: %s", p->name,
                msg);
    dspwire__reply__free_unpacked(r, &sv_pb_allocator);
    return rc;
  }
  *out = r;
  *bulk_len = h.bulk_len;
  return 0;
}

/* The --peer entry named name: 0 with host and port, else EPEER naming the
 * peers this server has. */
static int peer_find(const sv_config *cfg, const char *name, char *host,
                     size_t hlen, char *port, size_t plen, char *why,
                     size_t len) {
  char shown[4 * SV_LOG_STR_MAX + 8], names[256] = "";
  size_t used = 0, nl = strlen(name);
  for (int i = 0; i < cfg->n_peers; i++) {
    const char *e = cfg->peers[i], *eq = strchr(e, '=');
    if (!eq) continue;
    if ((size_t)(eq - e) == nl && memcmp(e, name, nl) == 0) {
      const char *a = eq + 1, *colon = strrchr(a, ':');
      if (*a == '[') a++;
      size_t hl = (size_t)(colon - a);
      if (hl && a[hl - 1] == ']') hl--;
      if (hl >= hlen || strlen(colon + 1) >= plen) break;
      memcpy(host, a, hl);
      host[hl] = '\0';
      snprintf(port, plen, "%s", colon + 1);
      return 0;
    }
    if (used < sizeof names)
      used += (size_t)snprintf(names + used, sizeof names - used, "%s%.*s",
                               used ? ", " : "", (int)(eq - e), e);
  }
  return sv_why(why, len, DISPATCH_EPEER,
                "peer_pull: this server has no peer '%s' (--peer NAME=ADDR; "
                "it has %s)",
                sv_log_str(shown, sizeof shown, name, SV_LOG_STR_MAX),
                names[0] ? names : "none");
}

/* Fetches the capability's bytes from peer p into t (staged), after the
 * hello: 0, or a code with why. */
static int fetch(const sv_config *cfg, sv_session *s, peer_conn *p,
                 const char *token, const Dspwire__PeerPull *m, dsp_tensor *t,
                 char *why, size_t len) {
  dsp_wreq w;
  char name[128];
  snprintf(name, sizeof name, "dispatch-server %s (peer pull)",
           cfg->name ? cfg->name : "");
  Dspwire__Request *req = dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR,
                                         token, name);
  req->req_id = 1;
  int rc = pc_send(p, req, why, len);
  Dspwire__Reply *r = NULL;
  uint64_t bulk = 0;
  if (rc == 0) rc = pc_reply(p, &r, &bulk, why, len);
  if (rc == 0 && (r->body_case != DSPWIRE__REPLY__BODY_HELLO ||
                  r->hello->major != DSP_PROTO_MAJOR || r->hello->minor < 7))
    rc = sv_why(why, len, DISPATCH_EPEER,
                "peer_pull: peer '%s' does not speak protocol 1.7 (it "
                "answered %u.%u)", p->name,
                r->body_case == DSPWIRE__REPLY__BODY_HELLO ? r->hello->major : 0,
                r->body_case == DSPWIRE__REPLY__BODY_HELLO ? r->hello->minor : 0);
  if (r) dspwire__reply__free_unpacked(r, &sv_pb_allocator);
  r = NULL;
  if (rc < 0) return rc;
  req = dsp_wreq_peer_fetch(&w, m->capability.data, m->capability.len);
  req->req_id = 2;
  if ((rc = pc_send(p, req, why, len)) < 0) return rc;
  if ((rc = pc_reply(p, &r, &bulk, why, len)) < 0) return rc;
  size_t nbytes = dsp_tensor_nbytes(t);
  dsp_meta got;
  memset(&got, 0, sizeof got);
  if (r->body_case == DSPWIRE__REPLY__BODY_READ && r->read->meta &&
      r->read->meta->n_shape <= DSP_MAX_DIMS) {
    got.dtype = (dsp_dtype)r->read->meta->dtype;
    got.ndim = (int)r->read->meta->n_shape;
    for (int i = 0; i < got.ndim; i++) got.shape[i] = r->read->meta->shape[i];
  }
  int same = r->body_case == DSPWIRE__REPLY__BODY_READ &&
             dsp_meta_equal(&got, &t->meta) && bulk == nbytes;
  dspwire__reply__free_unpacked(r, &sv_pb_allocator);
  if (!same)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "peer_pull: the capability grants a tensor of another "
                  "dtype or shape than the pull names");
  dsp_stage st;
  rc = dsp_tensor_stage_in(s->ctx, t, &st);
  if (rc < 0) return sv_why(why, len, rc, "peer_pull: staging failed");
  rc = pc_read(p, st.host, nbytes, &st, why, len);
  if (rc == 0 && t->meta.dtype == DSP_BOOL &&
      dsp_check_bool_bytes(s->ctx, st.host, nbytes) < 0)
    rc = sv_why(why, len, DISPATCH_EINVAL,
                "peer_pull: peer '%s' sent bool bytes other than 0 and 1",
                p->name);
  if (rc == 0 && (rc = dsp_stage_commit(s->ctx, &st)) < 0)
    sv_why(why, len, rc, "peer_pull: copying into the device failed");
  dsp_stage_release(&st);
  return rc;
}

int sv_exec_peer_pull(sv_session *s, sv_job *j, char *why, size_t len) {
  const Dspwire__PeerPull *m = j->req->peer_pull;
  const sv_config *cfg = s->cfg;
  char host[256], port[16];
  if (cfg->n_peers == 0) /* the client copies the bytes itself instead */
    return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                  "peer_pull: this server has no --peer: it pulls from no "
                  "server");
  int rc = peer_find(cfg, m->peer, host, sizeof host, port, sizeof port, why,
                     len);
  if (rc < 0) return rc;
  if ((rc = sv_check_free_id(s, m->output, why, len)) < 0) return rc;
  dsp_meta mt;
  memset(&mt, 0, sizeof mt);
  if (!m->meta || m->meta->n_shape > DSP_MAX_DIMS ||
      !dsp_dtype_valid(m->meta->dtype))
    return sv_why(why, len, DISPATCH_EINVAL,
                  "peer_pull: no valid tensor meta");
  mt.dtype = (dsp_dtype)m->meta->dtype;
  mt.ndim = (int)m->meta->n_shape;
  for (int i = 0; i < mt.ndim; i++) mt.shape[i] = m->meta->shape[i];
  int64_t numel;
  if ((rc = sv_check_meta(cfg, s->global, s->ctx, &mt, "peer_pull", &numel,
                          why, len)) < 0)
    return rc;
  const dsp_backend *be = s->device;
  if (m->device && m->device[0]) {
    const sv_device *d = sv_device_find(s->global, m->device);
    if (!d)
      return sv_why(why, len, DISPATCH_EDEVICE,
                    "peer_pull: this server has no device \"%s\"",
                    sv_log_str(host, sizeof host, m->device, SV_LOG_STR_MAX));
    if ((rc = sv_session_backend(s, d, &be, why, len)) < 0) return rc;
  }
  /* charged here, before a byte of the peer's is accepted */
  const dsp_backend *prev = dsp_ctx_backend(s->ctx);
  dsp_tensor *t = NULL;
  dsp_ctx_set_backend(s->ctx, be);
  rc = dsp_tensor_new_uninit(s->ctx, &mt, &t);
  dsp_ctx_set_backend(s->ctx, prev);
  if (rc < 0)
    return sv_why(why, len, rc, "peer_pull: %s for %zu bytes: %s",
                  rc == DISPATCH_EQUOTA ? "the session's quota has no room"
                                        : "no memory",
                  (size_t)numel * dsp_dtype_size(mt.dtype),
                  dsp_ctx_errmsg(s->ctx));
  peer_conn p = {.fd = -1, .name = m->peer};
  char *tok;
  size_t tok_len;
  /* what SIGHUP last put, taken once for the whole pull */
  rc = creds_take(&tok, &tok_len, &p.ctx, why, len);
  if (rc == 0) rc = pc_connect(cfg, &p, host, port, why, len);
  if (rc == 0 && cfg->peer_ca)
    rc = p.ctx ? pc_tls(&p, host, why, len)
               : sv_why(why, len, DISPATCH_ETLS,
                        "peer_pull: no TLS context for --peer-ca");
  if (rc == 0) rc = fetch(cfg, s, &p, tok, m, t, why, len);
  pc_close(&p);
  sv_secret_free(&tok, &tok_len);
  if (rc < 0) {
    dsp_tensor_unref(t); /* nothing half-written is left behind */
    return rc;
  }
  if ((rc = sv_insert(s, m->output, t, why, len)) < 0) return rc;
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  return sv_job_reply(j, &r, NULL, why, len);
}
