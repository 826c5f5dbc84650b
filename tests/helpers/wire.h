/* Test helper: a small blocking raw-protocol client for dispatch-server.
 *
 * Speaks frames exactly as proto/README.md describes (16-byte header,
 * protobuf Request/Reply, raw bulk) over a blocking TCP socket on
 * 127.0.0.1, so tests can send well-formed, pipelined and malformed
 * traffic. Every function returns 0 on success and -1 on an I/O or decode
 * failure (including the peer closing), never failing the test itself.
 * Receives wait at most a few minutes (a safety net against a hung server,
 * not a timing check). */
#ifndef WIRE_H
#define WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch.pb-c.h"
#include "wire_req.h"

typedef struct wire_conn {
  int fd;
  uint64_t next_req_id; /* used by the helpers that build requests */
  int wait_ms; /* how long a receive waits for data (wire_connect: minutes) */
} wire_conn;

int wire_connect(wire_conn *c, int port);
void wire_close(wire_conn *c);

/* Raw bytes, for malformed-frame tests. */
int wire_send_raw(wire_conn *c, const void *buf, size_t n);
/* One frame: header + packed req + bulk (bulk may be NULL when len 0).
 * Built requests come from common/wire_req.h (dsp_wreq_*), the encoder
 * the client and the fuzzers use too. */
int wire_send(wire_conn *c, const Dspwire__Request *req, const void *bulk,
              size_t bulk_len);
/* One frame back. *rep is freed with wire_reply_free (with *bulk, which is
 * NULL when the frame had no bulk part). */
int wire_recv(wire_conn *c, Dspwire__Reply **rep, void **bulk,
              size_t *bulk_len);
void wire_reply_free(Dspwire__Reply *rep, void *bulk);
/* 1 when the server closed the connection (EOF or reset, after skipping
 * any frames still queued), 0 when it did not within the wait. */
int wire_wait_closed(wire_conn *c);

/* Request builders; each sends one frame and returns the req_id used. */
uint64_t wire_hello_send(wire_conn *c, uint32_t major, uint32_t minor,
                         const char *name);
/* Sends a hello of the current version and checks the reply: 0 or -1. */
int wire_hello(wire_conn *c, const char *name);
uint64_t wire_upload(wire_conn *c, uint64_t id, int dtype, int ndim,
                     const int64_t *shape, const void *data, size_t nbytes);
uint64_t wire_op(wire_conn *c, int op, const uint64_t *inputs, int n_in,
                 uint64_t output, const int64_t *ints, int n_ints,
                 const double *floats, int n_floats);
/* 1.3: one Ops request of len bytes of packed records (op_record.h). */
uint64_t wire_ops(wire_conn *c, const uint8_t *records, size_t len);
uint64_t wire_track(wire_conn *c, uint64_t id);
uint64_t wire_backward(wire_conn *c, uint64_t loss, uint64_t grads,
                       int retain);
uint64_t wire_grad(wire_conn *c, uint64_t grads, uint64_t tensor,
                   uint64_t output);
/* Step (sgd/adam, op as in dsp.h) over grads container and params, with
 * the optimizer's state tensors and attributes. */
uint64_t wire_step(wire_conn *c, int op, uint64_t grads,
                   const uint64_t *params, int n_params,
                   const uint64_t *states, int n_states, const int64_t *ints,
                   int n_ints, const double *floats, int n_floats);
uint64_t wire_free(wire_conn *c, const uint64_t *tensors, int n_t,
                   const uint64_t *grads, int n_g);
uint64_t wire_read(wire_conn *c, uint64_t id);
uint64_t wire_sync(wire_conn *c);
uint64_t wire_stats(wire_conn *c);
uint64_t wire_bye(wire_conn *c);

/* Sends a sync and receives its reply: the reply's error code (0 when
 * none), or a positive 1 on an I/O failure. msg (may be NULL) receives the
 * error message, failed_req (may be NULL) the failing request id. */
int wire_sync_check(wire_conn *c, char *msg, size_t msg_len,
                    uint64_t *failed_req);
/* Sends a stats request and copies the reply; 0 or -1 (also when the reply
 * carries an error). */
int wire_get_stats(wire_conn *c, Dspwire__StatsReply *out);
/* Server-wide stats through a raw connection of its own to port (closed
 * with a bye, so it is not kept for a resume); 0 or -1. */
int wire_server_stats(int port, Dspwire__StatsReply *out);
/* Polls wire_server_stats every 20 ms, at most tries times (a safety
 * net, not a timing check), until the server holds want bytes
 * (server_held_bytes); *out is the last stats read. 0 when it did, -1
 * when it did not, -2 when the stats could not be read. */
int wire_wait_held_bytes(int port, uint64_t want, int tries,
                         Dspwire__StatsReply *out);
/* Reads tensor id into a malloc'd buffer (*data, *nbytes, free()); returns
 * 0, the reply's (negative) error code, or 1 on I/O failure. */
int wire_read_tensor(wire_conn *c, uint64_t id, void **data, size_t *nbytes,
                     int *ndim, int64_t *shape);
/* Fills *d (a GraphDefine, 1.2) for graph: its placeholders, slot count,
 * nodes and output slots; every array is borrowed, none copied. */
void wire_graph_define_init(Dspwire__GraphDefine *d, uint64_t graph,
                            Dspwire__TensorMeta **inputs, size_t n_in,
                            uint32_t n_slots, Dspwire__GraphNode **nodes,
                            size_t n_nodes, uint32_t *outputs, size_t n_out);
/* Uploads nbytes of data as 1-D tensor id of dtype and reads it back: 0
 * when the same bytes came back, else -1 (the session no longer serves
 * plain requests). */
int wire_round_trip(wire_conn *c, uint64_t id, int dtype, const void *data,
                    size_t nbytes);

#endif
