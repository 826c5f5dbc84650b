/* A one-connection plain-to-TLS proxy for tests (see tls_proxy.h). */
#include "tls_proxy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int connect_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

/* Writes all of p to a blocking fd; 0 or -1. */
static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* SSL_write_ex of all of p over the blocking server socket; 0 or -1. */
static int ssl_write_all(SSL *ssl, const char *p, size_t n) {
  while (n > 0) {
    size_t w = 0;
    if (SSL_write_ex(ssl, p, n, &w) <= 0) return -1;
    p += w;
    n -= w;
  }
  return 0;
}

static void relay(SSL *ssl, int sfd, int cfd) {
  static char buf[1 << 16];
  for (;;) {
    /* records OpenSSL already decrypted are delivered before polling */
    if (SSL_pending(ssl) == 0) {
      struct pollfd pf[2] = {{cfd, POLLIN, 0}, {sfd, POLLIN, 0}};
      int r = poll(pf, 2, -1);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return;
      if (pf[0].revents) {
        ssize_t n = recv(cfd, buf, sizeof buf, 0);
        if (n <= 0) return; /* the plain client left */
        if (ssl_write_all(ssl, buf, (size_t)n) < 0) return;
        continue;
      }
      if (!pf[1].revents) continue;
    }
    /* the server socket is non-blocking for reads: a record that is not
     * application data (a session ticket) must not block the client */
    size_t got = 0;
    int rc = SSL_read_ex(ssl, buf, sizeof buf, &got);
    if (rc <= 0) {
      int e = SSL_get_error(ssl, rc);
      if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) continue;
      return; /* closed or failed */
    }
    if (write_all(cfd, buf, got) < 0) return;
  }
}

static void *proxy_main(void *arg) {
  tlsp_proxy *p = arg;
  int cfd = accept(p->lfd, NULL, NULL);
  if (cfd < 0) return NULL;
  int sfd = connect_port(p->server_port);
  SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
  SSL *ssl = NULL;
  if (sfd >= 0 && ctx && SSL_CTX_load_verify_locations(ctx, p->ca, NULL) == 1) {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    ssl = SSL_new(ctx);
  }
  if (ssl) {
    SSL_set_fd(ssl, sfd);
    SSL_set1_host(ssl, "localhost");
    SSL_set_tlsext_host_name(ssl, "localhost");
    if (SSL_connect(ssl) == 1) {
      /* writes may block (the server reads), reads may not */
      struct timeval tv = {0, 1000};
      setsockopt(sfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      relay(ssl, sfd, cfd);
    }
    SSL_free(ssl);
  }
  SSL_CTX_free(ctx);
  if (sfd >= 0) close(sfd);
  close(cfd);
  return NULL;
}

int tlsp_start(tlsp_proxy *p, int server_port, const char *ca_file) {
  memset(p, 0, sizeof *p);
  p->server_port = server_port;
  snprintf(p->ca, sizeof p->ca, "%s", ca_file);
  p->lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (p->lfd < 0) return -1;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof a;
  if (bind(p->lfd, (struct sockaddr *)&a, sizeof a) < 0 ||
      listen(p->lfd, 1) < 0 ||
      getsockname(p->lfd, (struct sockaddr *)&a, &al) < 0 ||
      pthread_create(&p->th, NULL, proxy_main, p) != 0) {
    close(p->lfd);
    return -1;
  }
  p->port = ntohs(a.sin_port);
  p->running = 1;
  return 0;
}

void tlsp_stop(tlsp_proxy *p) {
  if (!p->running) return;
  pthread_join(p->th, NULL);
  close(p->lfd);
  p->running = 0;
}
