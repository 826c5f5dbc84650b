/* bench raw_server: the far end of the raw-socket references (bench.h's
 * 16-byte-header protocol: ECHO, PUT, PUT_FRESH, GET).
 *
 * It is a program of its own, not a fork of the benchmark, so that
 * scripts/bench.sh can start it exactly as it starts dispatch-server: an
 * exec'd process with the same environment (allocator settings included)
 * and the same CPU placement, which a child forked from the client would
 * not have (it tends to start on the client's CPU). Like dispatch-server
 * it prints "raw-server listening on 127.0.0.1:PORT" once it accepts.
 *
 * Each connection gets a thread and its own buffer, which grows to the
 * largest PUT/GET seen and is touched when it grows, so that after a
 * warm-up transfer the reference pays no page faults (dispatch-server's
 * storage cache spares it the same). The server reads with blocking
 * read(), after polling a while for the next request as dispatch-server
 * does (RAW_SPIN_S).
 *
 * usage: raw_server --listen 127.0.0.1:0
 */
#include <sched.h>

#include "bench.h"

/* a request larger than this closes the connection instead of allocating */
#define RAW_MAX_LEN ((uint64_t)1 << 31)

typedef struct raw_conn {
  int fd;
  unsigned char *buf;
  size_t cap;
} raw_conn;

/* Makes c->buf at least n bytes, touching new pages now rather than in
 * a timed transfer. 0 or -1. */
static int raw_grow(raw_conn *c, size_t n) {
  if (n <= c->cap) return 0;
  unsigned char *nb = realloc(c->buf, n);
  if (!nb) return -1;
  memset(nb + c->cap, 1, n - c->cap);
  c->buf = nb;
  c->cap = n;
  return 0;
}

/* How long the wait for the next request polls before it blocks: what
 * dispatch-server's network thread does after a reply (--loop-spin-us,
 * default 50), so the reference pays no wake-up where dispatch pays none
 * (without it, dispatch beat the raw socket twofold at 4 KiB). */
#define RAW_SPIN_S 50e-6

/* Reads a request's header: polls the socket (yielding the core between
 * polls) for up to RAW_SPIN_S, then blocks. 0 or -1. */
static int raw_read_request(int fd, unsigned char *h, size_t n) {
  struct pollfd pfd = {fd, POLLIN, 0};
  double end = bench_now() + RAW_SPIN_S;
  while (poll(&pfd, 1, 0) == 0 && bench_now() < end) sched_yield();
  return bench_read_all(fd, h, n);
}

/* Serves one connection until it closes or sends something malformed. */
static void *raw_serve(void *arg) {
  raw_conn *c = arg;
  unsigned char h[BENCH_RAW_HDR];
  while (raw_read_request(c->fd, h, sizeof h) == 0) {
    uint32_t cmd;
    uint64_t len;
    memcpy(&cmd, h, 4);
    memcpy(&len, h + 8, 8);
    if (len > RAW_MAX_LEN) break;
    if (cmd == BENCH_RAW_ECHO) {
      if (bench_write_all(c->fd, h, sizeof h) < 0) break;
    } else if (cmd == BENCH_RAW_PUT) {
      if (raw_grow(c, (size_t)len) < 0 ||
          bench_read_all(c->fd, c->buf, (size_t)len) < 0 ||
          bench_write_all(c->fd, h, sizeof h) < 0)
        break;
    } else if (cmd == BENCH_RAW_PUT_FRESH) {
      unsigned char *fresh = malloc(len ? (size_t)len : 1);
      int bad = !fresh || bench_read_all(c->fd, fresh, (size_t)len) < 0;
      free(fresh);
      if (bad || bench_write_all(c->fd, h, sizeof h) < 0) break;
    } else if (cmd == BENCH_RAW_GET) {
      if (raw_grow(c, (size_t)len) < 0 ||
          bench_write_all(c->fd, c->buf, (size_t)len) < 0)
        break;
    } else {
      break;
    }
  }
  close(c->fd);
  free(c->buf);
  free(c);
  return NULL;
}

int main(int argc, char **argv) {
  const char *listen_at = NULL;
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--listen") == 0) listen_at = argv[i + 1];
  struct sockaddr_in a;
  if (!listen_at || bench_ipv4_addr(listen_at, &a) < 0) {
    fprintf(stderr, "usage: %s --listen IPV4:PORT\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  socklen_t al = sizeof a;
  if (lfd < 0 ||
      setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
      bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 16) < 0 ||
      getsockname(lfd, (struct sockaddr *)&a, &al) < 0) {
    fprintf(stderr, "raw-server: listen on %s: %s\n", listen_at,
            strerror(errno));
    return 1;
  }
  char shown[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a.sin_addr, shown, sizeof shown);
  printf("raw-server listening on %s:%d\n", shown, ntohs(a.sin_port));
  fflush(stdout);
  for (;;) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      fprintf(stderr, "raw-server: accept: %s\n", strerror(errno));
      return 1;
    }
    bench_nodelay(fd);
    raw_conn *c = calloc(1, sizeof *c);
    pthread_t th;
    if (!c) {
      close(fd);
      continue;
    }
    c->fd = fd;
    if (pthread_create(&th, NULL, raw_serve, c) != 0) {
      close(fd);
      free(c);
      continue;
    }
    pthread_detach(th);
  }
}
