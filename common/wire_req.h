/* The one request encoder: builds each kind of Request and frames it
 * (header + packed message), for every program that speaks to a server —
 * the client library (client/call.c, client/remote.c), the raw-protocol test helper
 * (tests/helpers/wire.c) and the fuzz harness (fuzz/fz_common.c).
 *
 * Beside frame.c this is the only common/ code that knows protobuf. No
 * I/O and no allocation here: the caller owns the output buffer and sends
 * any bulk bytes itself after the frame, so the client can encode into
 * its reusable send buffer and write a large upload straight from the
 * caller's memory.
 *
 * Ownership: a dsp_wreq only borrows what the builders are given (ids,
 * shapes, attribute arrays, strings); those must outlive the encode. The
 * Request points into its own dsp_wreq, so a dsp_wreq must not be copied
 * or moved once built. Builders leave req_id 0: the caller sets
 * w->req.req_id (each program has its own rule for request ids). */
#ifndef DSP_WIRE_REQ_H
#define DSP_WIRE_REQ_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch.pb-c.h"
#include "frame.h"

typedef struct dsp_wreq {
  Dspwire__Request req;
  Dspwire__TensorMeta meta; /* an upload's */
  union {
    Dspwire__Hello hello;
    Dspwire__Upload upload;
    Dspwire__Op op;
    Dspwire__Track track;
    Dspwire__Backward backward;
    Dspwire__Grad grad;
    Dspwire__Step step;
    Dspwire__Free free;
    Dspwire__Read read;
    Dspwire__Sync sync;
    Dspwire__Stats stats;
    Dspwire__Bye bye;
    Dspwire__ToDevice to_device;
    Dspwire__Ops ops;
    Dspwire__CkptSave ckpt_save;
    Dspwire__CkptLoad ckpt_load;
    Dspwire__PeerGrant peer_grant;
    Dspwire__PeerPull peer_pull;
    Dspwire__PeerFetch peer_fetch;
  } body;
} dsp_wreq;

/* Builders: each fills *w as one request of its kind and returns &w->req.
 * Counts are taken as given (a hostile-client test or a fuzzer may want
 * them wrong); token and client_name may be NULL. */
Dspwire__Request *dsp_wreq_hello(dsp_wreq *w, uint32_t major, uint32_t minor,
                                  const char *token, const char *client_name);
Dspwire__Request *dsp_wreq_upload(dsp_wreq *w, uint64_t id, int32_t dtype,
                                   size_t ndim, const int64_t *shape);
Dspwire__Request *dsp_wreq_op(dsp_wreq *w, int32_t op, const uint64_t *in,
                               size_t n_in, uint64_t out, const int64_t *ints,
                               size_t n_ints, const double *floats,
                               size_t n_floats, int no_grad);
Dspwire__Request *dsp_wreq_track(dsp_wreq *w, uint64_t id);
Dspwire__Request *dsp_wreq_backward(dsp_wreq *w, uint64_t loss,
                                     uint64_t grads, int retain);
Dspwire__Request *dsp_wreq_grad(dsp_wreq *w, uint64_t grads, uint64_t tensor,
                                 uint64_t out);
Dspwire__Request *dsp_wreq_step(dsp_wreq *w, int32_t op, uint64_t grads,
                                 const uint64_t *params, size_t n_params,
                                 const uint64_t *states, size_t n_states,
                                 const int64_t *ints, size_t n_ints,
                                 const double *floats, size_t n_floats);
Dspwire__Request *dsp_wreq_free(dsp_wreq *w, const uint64_t *tensors,
                                 size_t n_tensors, const uint64_t *grads,
                                 size_t n_grads);
Dspwire__Request *dsp_wreq_read(dsp_wreq *w, uint64_t id);
Dspwire__Request *dsp_wreq_sync(dsp_wreq *w);
Dspwire__Request *dsp_wreq_stats(dsp_wreq *w);
Dspwire__Request *dsp_wreq_bye(dsp_wreq *w);
/* 1.1: a copy of tensor id as tensor out on server device `device`. */
/* 1.3: len bytes of packed op records (op_record.h), borrowed. */
Dspwire__Request *dsp_wreq_ops(dsp_wreq *w, const uint8_t *records,
                                size_t len);
Dspwire__Request *dsp_wreq_to_device(dsp_wreq *w, uint64_t id, uint64_t out,
                                      const char *device);

/* 1.6: a checkpoint the server writes into (CkptSave) or reads from
 * (CkptLoad) its --checkpoint-dir: file is file_len bytes (a test may put
 * a NUL in it); names, ids, keys and values as many as their counts. */
Dspwire__Request *dsp_wreq_ckpt_save(dsp_wreq *w, const char *file,
                                      size_t file_len,
                                      const char *const *names,
                                      const uint64_t *ids, size_t n,
                                      const char *const *keys,
                                      const char *const *values,
                                      size_t n_meta);
Dspwire__Request *dsp_wreq_ckpt_load(dsp_wreq *w, const char *file,
                                      size_t file_len, uint64_t first_id,
                                      uint32_t max_tensors);

/* Bytes dsp_req_frame_encode writes for req: the header and the packed
 * message (the bulk is not counted: the caller sends it after). */
/* 1.7, server to server transfers: a grant of tensor id on its server, a
 * pull on another server (dtype and shape[0..ndim-1] the granted
 * tensor's; device may be NULL), and the peer's fetch. cap is cap_len
 * bytes. */
Dspwire__Request *dsp_wreq_peer_grant(dsp_wreq *w, uint64_t id);
Dspwire__Request *dsp_wreq_peer_pull(dsp_wreq *w, const char *peer,
                                      const uint8_t *cap, size_t cap_len,
                                      uint64_t output, int32_t dtype,
                                      size_t ndim, const int64_t *shape,
                                      const char *device);
Dspwire__Request *dsp_wreq_peer_fetch(dsp_wreq *w, const uint8_t *cap,
                                       size_t cap_len);
size_t dsp_req_frame_size(const Dspwire__Request *req);
/* Writes the frame header, announcing bulk_len bulk bytes to follow, and
 * the packed req into out, which has room for dsp_req_frame_size(req)
 * bytes; returns the bytes written. The header's msg_len is the packed
 * size cut to 32 bits: callers bound it first (the client by the server's
 * frame limit), or mean to send a malformed frame. */
size_t dsp_req_frame_encode(const Dspwire__Request *req, uint64_t bulk_len,
                            uint8_t *out);

#endif
