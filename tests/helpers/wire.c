/* Blocking raw-protocol test client (see wire.h). */
#include "wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dsp.h"
#include "frame.h"
#include "wire_req.h"

#define WIRE_WAIT_MS 180000

int wire_connect(wire_conn *c, int port) {
  c->fd = -1;
  c->next_req_id = 1;
  c->wait_ms = WIRE_WAIT_MS;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  c->fd = fd;
  return 0;
}

void wire_close(wire_conn *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

int wire_send_raw(wire_conn *c, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int wire_send(wire_conn *c, const Dspwire__Request *req, const void *bulk,
              size_t bulk_len) {
  uint8_t *buf = malloc(dsp_req_frame_size(req));
  if (!buf) return -1;
  int rc = wire_send_raw(c, buf, dsp_req_frame_encode(req, bulk_len, buf));
  free(buf);
  if (rc == 0 && bulk_len) rc = wire_send_raw(c, bulk, bulk_len);
  return rc;
}

static int recv_all(wire_conn *c, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    struct pollfd pf = {.fd = c->fd, .events = POLLIN};
    int r = poll(&pf, 1, c->wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t got = recv(c->fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return -1;
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

int wire_recv(wire_conn *c, Dspwire__Reply **rep, void **bulk,
              size_t *bulk_len) {
  *rep = NULL;
  if (bulk) *bulk = NULL;
  if (bulk_len) *bulk_len = 0;
  uint8_t hb[DSP_FRAME_HEADER_SIZE];
  if (recv_all(c, hb, sizeof hb) < 0) return -1;
  dsp_frame_header h;
  if (dsp_frame_header_decode(hb, UINT32_MAX, UINT64_MAX, &h) < 0) return -1;
  uint8_t *msg = malloc(h.msg_len ? h.msg_len : 1);
  if (!msg) return -1;
  if (recv_all(c, msg, h.msg_len) < 0) {
    free(msg);
    return -1;
  }
  Dspwire__Reply *r = dspwire__reply__unpack(NULL, h.msg_len, msg);
  free(msg);
  if (!r) return -1;
  void *b = NULL;
  if (h.bulk_len) {
    b = malloc(h.bulk_len);
    if (!b || recv_all(c, b, h.bulk_len) < 0) {
      free(b);
      dspwire__reply__free_unpacked(r, NULL);
      return -1;
    }
  }
  *rep = r;
  if (bulk) *bulk = b;
  else free(b);
  if (bulk_len) *bulk_len = h.bulk_len;
  return 0;
}

void wire_reply_free(Dspwire__Reply *rep, void *bulk) {
  if (rep) dspwire__reply__free_unpacked(rep, NULL);
  free(bulk);
}

int wire_wait_closed(wire_conn *c) {
  char buf[4096];
  for (;;) {
    struct pollfd pf = {.fd = c->fd, .events = POLLIN};
    int r = poll(&pf, 1, c->wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return 0;
    ssize_t got = recv(c->fd, buf, sizeof buf, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return 1;
  }
}

static uint64_t send_req(wire_conn *c, Dspwire__Request *req,
                         const void *bulk, size_t bulk_len) {
  req->req_id = c->next_req_id++;
  if (wire_send(c, req, bulk, bulk_len) < 0) return 0;
  return req->req_id;
}

uint64_t wire_hello_send(wire_conn *c, uint32_t major, uint32_t minor,
                         const char *name) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_hello(&w, major, minor, NULL, name), NULL, 0);
}

int wire_hello(wire_conn *c, const char *name) {
  uint64_t id = wire_hello_send(c, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, name);
  if (!id) return -1;
  Dspwire__Reply *r;
  if (wire_recv(c, &r, NULL, NULL) < 0) return -1;
  int ok = r->req_id == id && !r->error &&
           r->body_case == DSPWIRE__REPLY__BODY_HELLO;
  wire_reply_free(r, NULL);
  return ok ? 0 : -1;
}

uint64_t wire_upload(wire_conn *c, uint64_t id, int dtype, int ndim,
                     const int64_t *shape, const void *data, size_t nbytes) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_upload(&w, id, dtype, (size_t)ndim, shape),
                  data, nbytes);
}

uint64_t wire_op(wire_conn *c, int op, const uint64_t *inputs, int n_in,
                 uint64_t output, const int64_t *ints, int n_ints,
                 const double *floats, int n_floats) {
  dsp_wreq w;
  return send_req(c,
                  dsp_wreq_op(&w, op, inputs, (size_t)n_in, output, ints,
                              (size_t)n_ints, floats, (size_t)n_floats, 0),
                  NULL, 0);
}

uint64_t wire_ops(wire_conn *c, const uint8_t *records, size_t len) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_ops(&w, records, len), NULL, 0);
}

uint64_t wire_track(wire_conn *c, uint64_t id) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_track(&w, id), NULL, 0);
}

uint64_t wire_backward(wire_conn *c, uint64_t loss, uint64_t grads,
                       int retain) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_backward(&w, loss, grads, retain), NULL, 0);
}

uint64_t wire_grad(wire_conn *c, uint64_t grads, uint64_t tensor,
                   uint64_t output) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_grad(&w, grads, tensor, output), NULL, 0);
}

uint64_t wire_step(wire_conn *c, int op, uint64_t grads,
                   const uint64_t *params, int n_params,
                   const uint64_t *states, int n_states, const int64_t *ints,
                   int n_ints, const double *floats, int n_floats) {
  dsp_wreq w;
  return send_req(c,
                  dsp_wreq_step(&w, op, grads, params, (size_t)n_params,
                                states, (size_t)n_states, ints,
                                (size_t)n_ints, floats, (size_t)n_floats),
                  NULL, 0);
}

uint64_t wire_free(wire_conn *c, const uint64_t *tensors, int n_t,
                   const uint64_t *grads, int n_g) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_free(&w, tensors, (size_t)n_t, grads,
                                   (size_t)n_g),
                  NULL, 0);
}

uint64_t wire_read(wire_conn *c, uint64_t id) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_read(&w, id), NULL, 0);
}

uint64_t wire_sync(wire_conn *c) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_sync(&w), NULL, 0);
}

uint64_t wire_stats(wire_conn *c) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_stats(&w), NULL, 0);
}

uint64_t wire_bye(wire_conn *c) {
  dsp_wreq w;
  return send_req(c, dsp_wreq_bye(&w), NULL, 0);
}

int wire_sync_check(wire_conn *c, char *msg, size_t msg_len,
                    uint64_t *failed_req) {
  uint64_t id = wire_sync(c);
  if (!id) return 1;
  Dspwire__Reply *r;
  if (wire_recv(c, &r, NULL, NULL) < 0) return 1;
  if (r->req_id != id) {
    wire_reply_free(r, NULL);
    return 1;
  }
  int code = 0;
  if (msg && msg_len) msg[0] = '\0';
  if (r->error) {
    code = r->error->code;
    if (msg && msg_len && r->error->message)
      snprintf(msg, msg_len, "%s", r->error->message);
    if (failed_req) *failed_req = r->error->failed_req_id;
  }
  wire_reply_free(r, NULL);
  return code;
}

int wire_get_stats(wire_conn *c, Dspwire__StatsReply *out) {
  uint64_t id = wire_stats(c);
  if (!id) return -1;
  Dspwire__Reply *r;
  if (wire_recv(c, &r, NULL, NULL) < 0) return -1;
  int ok = r->req_id == id && !r->error &&
           r->body_case == DSPWIRE__REPLY__BODY_STATS;
  if (ok) *out = *r->stats;
  wire_reply_free(r, NULL);
  return ok ? 0 : -1;
}

int wire_server_stats(int port, Dspwire__StatsReply *out) {
  wire_conn c;
  if (wire_connect(&c, port) < 0) return -1;
  int rc = wire_hello(&c, "stats") == 0 ? wire_get_stats(&c, out) : -1;
  wire_bye(&c);
  wire_close(&c);
  return rc;
}

int wire_wait_held_bytes(int port, uint64_t want, int tries,
                         Dspwire__StatsReply *out) {
  for (int i = 0;; i++) {
    if (wire_server_stats(port, out) < 0) return -2;
    if (out->server_held_bytes == want) return 0;
    if (i + 1 >= tries) return -1;
    struct timespec ts = {0, 20 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

int wire_read_tensor(wire_conn *c, uint64_t id, void **data, size_t *nbytes,
                     int *ndim, int64_t *shape) {
  *data = NULL;
  *nbytes = 0;
  uint64_t rid = wire_read(c, id);
  if (!rid) return 1;
  Dspwire__Reply *r;
  void *bulk;
  size_t blen;
  if (wire_recv(c, &r, &bulk, &blen) < 0) return 1;
  if (r->req_id != rid) {
    wire_reply_free(r, bulk);
    return 1;
  }
  if (r->error) {
    int code = r->error->code;
    wire_reply_free(r, bulk);
    return code < 0 ? code : 1;
  }
  if (r->body_case != DSPWIRE__REPLY__BODY_READ || !r->read->meta) {
    wire_reply_free(r, bulk);
    return 1;
  }
  if (ndim) *ndim = (int)r->read->meta->n_shape;
  if (shape)
    for (size_t i = 0; i < r->read->meta->n_shape && i < 8; i++)
      shape[i] = r->read->meta->shape[i];
  *data = bulk;
  *nbytes = blen;
  wire_reply_free(r, NULL);
  return 0;
}

int wire_round_trip(wire_conn *c, uint64_t id, int dtype, const void *data,
                    size_t nbytes) {
  size_t es = dsp_dtype_size((dsp_dtype)dtype);
  int64_t shape[1] = {es ? (int64_t)(nbytes / es) : 0};
  if (!wire_upload(c, id, dtype, 1, shape, data, nbytes)) return -1;
  void *got;
  size_t n;
  if (wire_read_tensor(c, id, &got, &n, NULL, NULL) != 0) return -1;
  int same = n == nbytes && memcmp(got, data, n) == 0;
  free(got);
  return same ? 0 : -1;
}

void wire_graph_define_init(Dspwire__GraphDefine *d, uint64_t graph,
                            Dspwire__TensorMeta **inputs, size_t n_in,
                            uint32_t n_slots, Dspwire__GraphNode **nodes,
                            size_t n_nodes, uint32_t *outputs, size_t n_out) {
  dspwire__graph_define__init(d);
  d->graph = graph;
  d->n_inputs = n_in;
  d->inputs = inputs;
  d->n_slots = n_slots;
  d->n_nodes = n_nodes;
  d->nodes = nodes;
  d->n_outputs = n_out;
  d->outputs = outputs;
}
