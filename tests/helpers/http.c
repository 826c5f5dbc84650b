/* One HTTP/1.0 request over a plain socket (http.h). */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int fail(int fd, char *buf, char *why, size_t why_len,
                const char *what) {
  snprintf(why, why_len, "%s", what);
  if (fd >= 0) close(fd);
  free(buf);
  return -1;
}

int http_request(int port, const char *method, const char *path,
                 char **body, char *why, size_t why_len) {
  return http_request_hdr(port, method, path, NULL, body, why, why_len);
}

int http_request_hdr(int port, const char *method, const char *path,
                     const char *headers, char **body, char *why,
                     size_t why_len) {
  *body = NULL;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return fail(fd, NULL, why, why_len, strerror(errno));
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
    return fail(fd, NULL, why, why_len, strerror(errno));
  char req[1024];
  int n = snprintf(req, sizeof req,
                   "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n%s\r\n", method, path,
                   headers ? headers : "");
  if (n < 0 || (size_t)n >= sizeof req || write(fd, req, (size_t)n) != n)
    return fail(fd, NULL, why, why_len, "cannot send the request");
  size_t cap = 1 << 17, len = 0;
  char *buf = malloc(cap);
  if (!buf) return fail(fd, NULL, why, why_len, "out of memory");
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 60000) <= 0)
      return fail(fd, buf, why, why_len, "no answer from the endpoint");
    if (len + 1 == cap) {
      char *b = realloc(buf, cap * 2);
      if (!b) return fail(fd, buf, why, why_len, "out of memory");
      buf = b;
      cap *= 2;
    }
    ssize_t r = read(fd, buf + len, cap - len - 1);
    if (r < 0) return fail(fd, buf, why, why_len, strerror(errno));
    if (r == 0) break;
    len += (size_t)r;
  }
  close(fd);
  buf[len] = '\0';
  int status = 0;
  char *sep = strstr(buf, "\r\n\r\n");
  if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !sep)
    return fail(-1, buf, why, why_len, "malformed answer (no status line "
                                       "or no end of headers)");
  *body = strdup(sep + 4);
  free(buf);
  if (!*body) return fail(-1, NULL, why, why_len, "out of memory");
  return status;
}
