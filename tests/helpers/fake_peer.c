/* See fake_peer.h. */
#include "fake_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"

int fake_listen(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 4) < 0 ||
      getsockname(fd, (struct sockaddr *)&a, &sl) < 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

int fake_recv_n(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n) {
    ssize_t r = recv(fd, b, n, 0);
    if (r <= 0) return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

int fake_recv_request(int fd, Dspwire__Request **req, void **bulk,
                      size_t *bulk_len) {
  uint8_t hb[DSP_FRAME_HEADER_SIZE];
  dsp_frame_header h;
  *req = NULL;
  *bulk = NULL;
  if (fake_recv_n(fd, hb, sizeof hb) < 0 ||
      dsp_frame_header_decode(hb, 1 << 24, 1 << 24, &h) < 0)
    return -1;
  uint8_t *m = malloc(h.msg_len + 1), *b = malloc(h.bulk_len + 1);
  if (!m || !b || fake_recv_n(fd, m, h.msg_len) < 0 ||
      fake_recv_n(fd, b, h.bulk_len) < 0) {
    free(m);
    free(b);
    return -1;
  }
  *req = dspwire__request__unpack(NULL, h.msg_len, m);
  free(m);
  if (!*req) {
    free(b);
    return -1;
  }
  *bulk = b;
  *bulk_len = (size_t)h.bulk_len;
  return 0;
}

void fake_send_reply(int fd, const Dspwire__Reply *r, const void *bulk,
                     size_t bulk_len) {
  size_t n = dspwire__reply__get_packed_size(r);
  uint8_t *buf = malloc(DSP_FRAME_HEADER_SIZE + n + bulk_len);
  if (!buf) return;
  dsp_frame_header h = {(uint32_t)n, 0, bulk_len};
  dsp_frame_header_encode(buf, &h);
  dspwire__reply__pack(r, buf + DSP_FRAME_HEADER_SIZE);
  if (bulk_len) memcpy(buf + DSP_FRAME_HEADER_SIZE + n, bulk, bulk_len);
  ssize_t w = send(fd, buf, DSP_FRAME_HEADER_SIZE + n + bulk_len,
                   MSG_NOSIGNAL);
  (void)w;
  free(buf);
}
