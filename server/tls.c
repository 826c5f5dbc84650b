/* Server-side TLS over memory BIOs: the libuv loop owns the socket, so
 * OpenSSL never touches it. Ciphertext read from the stream is fed into
 * the read BIO; whatever OpenSSL wants to send (handshake records, alerts,
 * encrypted replies) is taken from the write BIO and handed to uv_write.
 * Nothing here blocks: a call that needs more input says so and returns. */
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <stdio.h>
#include <string.h>

#include "sv.h"

struct sv_tls_ctx {
  SSL_CTX *ctx;
};

struct sv_tls {
  SSL *ssl;
  BIO *rbio, *wbio; /* owned by ssl */
};

/* The oldest queued OpenSSL error as text, then the queue is cleared so a
 * later failure on another connection does not report a stale reason. */
static void ssl_reason(char *buf, size_t len) {
  unsigned long e = ERR_get_error();
  if (e) {
    ERR_error_string_n(e, buf, len);
  } else {
    snprintf(buf, len, "no OpenSSL reason");
  }
  ERR_clear_error();
}

/* A new SSL_CTX from the config's files: TLS 1.2 at least (1.3
 * preferred: OpenSSL negotiates the highest both sides speak). With a
 * client CA, a client must present a certificate it signed, or the
 * handshake fails. NULL with "cannot STEP FILE: REASON" in why. */
static SSL_CTX *build_ctx(const sv_config *cfg, char *why, size_t len) {
  char r[256];
  const char *what = "create the TLS context";
  const char *file = "";
  SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
  if (!ctx) goto fail;
  what = "set the minimum TLS version";
  if (!SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION)) goto fail;
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
  what = "load the certificate chain";
  file = cfg->tls_cert;
  if (SSL_CTX_use_certificate_chain_file(ctx, cfg->tls_cert) != 1) goto fail;
  what = "load the private key";
  file = cfg->tls_key;
  if (SSL_CTX_use_PrivateKey_file(ctx, cfg->tls_key, SSL_FILETYPE_PEM) != 1)
    goto fail;
  what = "match the private key to the certificate";
  if (SSL_CTX_check_private_key(ctx) != 1) goto fail;
  if (cfg->tls_client_ca) {
    what = "load the client CA";
    file = cfg->tls_client_ca;
    if (SSL_CTX_load_verify_locations(ctx, cfg->tls_client_ca, NULL) != 1)
      goto fail;
    STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(cfg->tls_client_ca);
    if (names) SSL_CTX_set_client_CA_list(ctx, names);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT,
                       NULL);
  }
  return ctx;
fail:
  ssl_reason(r, sizeof r);
  snprintf(why, len, "cannot %s%s%s: %s", what, *file ? " " : "", file, r);
  SSL_CTX_free(ctx);
  return NULL;
}

sv_tls_ctx *sv_tls_ctx_new(const sv_config *cfg) {
  char why[1024];
  sv_tls_ctx *t = dsp_calloc(1, sizeof *t);
  if (!t) {
    fprintf(stderr, "dispatch-server: out of memory for the TLS context\n");
    return NULL;
  }
  t->ctx = build_ctx(cfg, why, sizeof why);
  if (!t->ctx) {
    fprintf(stderr, "dispatch-server: TLS: %s\n", why);
    dsp_free(t);
    return NULL;
  }
  return t;
}

/* Connections made so far hold their own reference to the old SSL_CTX
 * (SSL_new takes one), so it lives until the last of them is freed. */
int sv_tls_ctx_reload(sv_tls_ctx *t, const sv_config *cfg, char *why,
                      size_t len) {
  SSL_CTX *fresh = build_ctx(cfg, why, len);
  if (!fresh) return DISPATCH_ETLS;
  SSL_CTX_free(t->ctx);
  t->ctx = fresh;
  return 0;
}

void sv_tls_ctx_free(sv_tls_ctx *t) {
  if (!t) return;
  SSL_CTX_free(t->ctx);
  dsp_free(t);
}

sv_tls *sv_tls_new(sv_tls_ctx *t) {
  sv_tls *s = dsp_calloc(1, sizeof *s);
  if (!s) return NULL;
  s->ssl = SSL_new(t->ctx);
  s->rbio = BIO_new(BIO_s_mem());
  s->wbio = BIO_new(BIO_s_mem());
  if (!s->ssl || !s->rbio || !s->wbio) {
    SSL_free(s->ssl);
    BIO_free(s->rbio);
    BIO_free(s->wbio);
    dsp_free(s);
    ERR_clear_error();
    return NULL;
  }
  /* an empty memory BIO reports "retry", not end of file */
  BIO_set_mem_eof_return(s->rbio, -1);
  SSL_set_bio(s->ssl, s->rbio, s->wbio);
  SSL_set_accept_state(s->ssl);
  return s;
}

void sv_tls_free(sv_tls *s) {
  if (!s) return;
  SSL_free(s->ssl); /* frees both BIOs */
  dsp_free(s);
  ERR_clear_error();
}

int sv_tls_feed(sv_tls *s, const void *p, size_t n) {
  while (n > 0) {
    int k = n > (1u << 30) ? 1 << 30 : (int)n;
    int w = BIO_write(s->rbio, p, k);
    if (w <= 0) return DISPATCH_ENOMEM;
    p = (const uint8_t *)p + w;
    n -= (size_t)w;
  }
  return 0;
}

/* The reason of a failed handshake or read: a verify failure names the
 * certificate problem (no client certificate, expired, unknown CA). */
static int fail(sv_tls *s, int rc, char *why, size_t why_len) {
  int err = SSL_get_error(s->ssl, rc);
  char r[256];
  if (err == SSL_ERROR_SSL) {
    ssl_reason(r, sizeof r);
  } else {
    snprintf(r, sizeof r, "TLS error %d", err);
    ERR_clear_error();
  }
  long v = SSL_get_verify_result(s->ssl);
  if (v != X509_V_OK)
    snprintf(why, why_len, "%s (certificate: %s)", r,
             X509_verify_cert_error_string(v));
  else
    snprintf(why, why_len, "%s", r);
  return DISPATCH_ETLS;
}

int sv_tls_handshake(sv_tls *s, char *why, size_t why_len) {
  if (SSL_is_init_finished(s->ssl)) return 1;
  int rc = SSL_do_handshake(s->ssl);
  if (rc == 1) return 1;
  int err = SSL_get_error(s->ssl, rc);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return 0;
  return fail(s, rc, why, why_len);
}

long sv_tls_read(sv_tls *s, void *dst, size_t n, char *why, size_t why_len) {
  size_t got = 0;
  if (SSL_read_ex(s->ssl, dst, n, &got) == 1) return (long)got;
  int err = SSL_get_error(s->ssl, 0);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return 0;
  if (err == SSL_ERROR_ZERO_RETURN) return -1;
  return fail(s, 0, why, why_len);
}

int sv_tls_write(sv_tls *s, const void *p, size_t n) {
  size_t done = 0;
  if (n == 0) return 0;
  if (SSL_write_ex(s->ssl, p, n, &done) == 1 && done == n) return 0;
  ERR_clear_error();
  return DISPATCH_ETLS;
}

int sv_tls_take(sv_tls *s, uint8_t **out, size_t *len) {
  *out = NULL;
  *len = 0;
  size_t n = BIO_ctrl_pending(s->wbio);
  if (n == 0) return 0;
  uint8_t *b = dsp_malloc(n);
  if (!b) return DISPATCH_ENOMEM;
  size_t got = 0;
  while (got < n) {
    size_t k = n - got > (1u << 30) ? (1u << 30) : n - got;
    int r = BIO_read(s->wbio, b + got, (int)k);
    if (r <= 0) break;
    got += (size_t)r;
  }
  if (got == 0) {
    dsp_free(b);
    return 0;
  }
  *out = b;
  *len = got;
  return 0;
}

void sv_tls_peer_name(sv_tls *s, char *buf, size_t len) {
  if (len) buf[0] = '\0';
  X509 *x = SSL_get1_peer_certificate(s->ssl);
  if (!x) return;
  X509_NAME_oneline(X509_get_subject_name(x), buf, (int)len);
  X509_free(x);
}

int sv_tls_peer_digest(sv_tls *s, uint8_t out[32]) {
  memset(out, 0, 32);
  X509 *x = SSL_get1_peer_certificate(s->ssl);
  if (!x) return 0;
  unsigned n = 32;
  int ok = X509_digest(x, EVP_sha256(), out, &n) == 1;
  X509_free(x);
  return ok ? 1 : -1;
}
