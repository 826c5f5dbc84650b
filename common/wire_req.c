/* Request builders and framing shared by client, tests and fuzzers (see
 * wire_req.h). Only field filling and one pack: the client encodes every
 * small op through here, so nothing may allocate or pack twice. */
#include "wire_req.h"

/* A fresh request of one body case; the body itself is the caller's. */
static Dspwire__Request *begin(dsp_wreq *w,
                                Dspwire__Request__BodyCase body_case) {
  w->req = (Dspwire__Request)DSPWIRE__REQUEST__INIT;
  w->req.body_case = body_case;
  return &w->req;
}

Dspwire__Request *dsp_wreq_hello(dsp_wreq *w, uint32_t major, uint32_t minor,
                                  const char *token, const char *client_name) {
  Dspwire__Hello *m = &w->body.hello;
  *m = (Dspwire__Hello)DSPWIRE__HELLO__INIT;
  m->major = major;
  m->minor = minor;
  m->token = (char *)token;
  m->client_name = (char *)client_name;
  begin(w, DSPWIRE__REQUEST__BODY_HELLO)->hello = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_upload(dsp_wreq *w, uint64_t id, int32_t dtype,
                                   size_t ndim, const int64_t *shape) {
  w->meta = (Dspwire__TensorMeta)DSPWIRE__TENSOR_META__INIT;
  w->meta.dtype = dtype;
  w->meta.n_shape = ndim;
  w->meta.shape = (int64_t *)shape;
  Dspwire__Upload *m = &w->body.upload;
  *m = (Dspwire__Upload)DSPWIRE__UPLOAD__INIT;
  m->id = id;
  m->meta = &w->meta;
  begin(w, DSPWIRE__REQUEST__BODY_UPLOAD)->upload = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_op(dsp_wreq *w, int32_t op, const uint64_t *in,
                               size_t n_in, uint64_t out, const int64_t *ints,
                               size_t n_ints, const double *floats,
                               size_t n_floats, int no_grad) {
  Dspwire__Op *m = &w->body.op;
  *m = (Dspwire__Op)DSPWIRE__OP__INIT;
  m->op = op;
  m->no_grad = no_grad != 0;
  m->n_inputs = n_in;
  m->inputs = (uint64_t *)in;
  m->output = out;
  m->n_ints = n_ints;
  m->ints = (int64_t *)ints;
  m->n_floats = n_floats;
  m->floats = (double *)floats;
  begin(w, DSPWIRE__REQUEST__BODY_OP)->op = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_track(dsp_wreq *w, uint64_t id) {
  Dspwire__Track *m = &w->body.track;
  *m = (Dspwire__Track)DSPWIRE__TRACK__INIT;
  m->id = id;
  begin(w, DSPWIRE__REQUEST__BODY_TRACK)->track = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_backward(dsp_wreq *w, uint64_t loss,
                                     uint64_t grads, int retain) {
  Dspwire__Backward *m = &w->body.backward;
  *m = (Dspwire__Backward)DSPWIRE__BACKWARD__INIT;
  m->loss = loss;
  m->grads = grads;
  m->retain = retain != 0;
  begin(w, DSPWIRE__REQUEST__BODY_BACKWARD)->backward = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_grad(dsp_wreq *w, uint64_t grads, uint64_t tensor,
                                 uint64_t out) {
  Dspwire__Grad *m = &w->body.grad;
  *m = (Dspwire__Grad)DSPWIRE__GRAD__INIT;
  m->grads = grads;
  m->tensor = tensor;
  m->output = out;
  begin(w, DSPWIRE__REQUEST__BODY_GRAD)->grad = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_step(dsp_wreq *w, int32_t op, uint64_t grads,
                                 const uint64_t *params, size_t n_params,
                                 const uint64_t *states, size_t n_states,
                                 const int64_t *ints, size_t n_ints,
                                 const double *floats, size_t n_floats) {
  Dspwire__Step *m = &w->body.step;
  *m = (Dspwire__Step)DSPWIRE__STEP__INIT;
  m->op = op;
  m->grads = grads;
  m->n_params = n_params;
  m->params = (uint64_t *)params;
  m->n_states = n_states;
  m->states = (uint64_t *)states;
  m->n_ints = n_ints;
  m->ints = (int64_t *)ints;
  m->n_floats = n_floats;
  m->floats = (double *)floats;
  begin(w, DSPWIRE__REQUEST__BODY_STEP)->step = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_free(dsp_wreq *w, const uint64_t *tensors,
                                 size_t n_tensors, const uint64_t *grads,
                                 size_t n_grads) {
  Dspwire__Free *m = &w->body.free;
  *m = (Dspwire__Free)DSPWIRE__FREE__INIT;
  m->n_tensors = n_tensors;
  m->tensors = (uint64_t *)tensors;
  m->n_grads = n_grads;
  m->grads = (uint64_t *)grads;
  begin(w, DSPWIRE__REQUEST__BODY_FREE)->free = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_read(dsp_wreq *w, uint64_t id) {
  Dspwire__Read *m = &w->body.read;
  *m = (Dspwire__Read)DSPWIRE__READ__INIT;
  m->id = id;
  begin(w, DSPWIRE__REQUEST__BODY_READ)->read = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_sync(dsp_wreq *w) {
  w->body.sync = (Dspwire__Sync)DSPWIRE__SYNC__INIT;
  begin(w, DSPWIRE__REQUEST__BODY_SYNC)->sync = &w->body.sync;
  return &w->req;
}

Dspwire__Request *dsp_wreq_stats(dsp_wreq *w) {
  w->body.stats = (Dspwire__Stats)DSPWIRE__STATS__INIT;
  begin(w, DSPWIRE__REQUEST__BODY_STATS)->stats = &w->body.stats;
  return &w->req;
}

Dspwire__Request *dsp_wreq_bye(dsp_wreq *w) {
  w->body.bye = (Dspwire__Bye)DSPWIRE__BYE__INIT;
  begin(w, DSPWIRE__REQUEST__BODY_BYE)->bye = &w->body.bye;
  return &w->req;
}

Dspwire__Request *dsp_wreq_to_device(dsp_wreq *w, uint64_t id, uint64_t out,
                                      const char *device) {
  Dspwire__ToDevice *m = &w->body.to_device;
  *m = (Dspwire__ToDevice)DSPWIRE__TO_DEVICE__INIT;
  m->id = id;
  m->output = out;
  m->device = (char *)device;
  begin(w, DSPWIRE__REQUEST__BODY_TO_DEVICE)->to_device = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_ops(dsp_wreq *w, const uint8_t *records,
                                size_t len) {
  Dspwire__Ops *m = &w->body.ops;
  *m = (Dspwire__Ops)DSPWIRE__OPS__INIT;
  m->records.data = (uint8_t *)records;
  m->records.len = len;
  begin(w, DSPWIRE__REQUEST__BODY_OPS)->ops = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_ckpt_save(dsp_wreq *w, const char *file,
                                      size_t file_len,
                                      const char *const *names,
                                      const uint64_t *ids, size_t n,
                                      const char *const *keys,
                                      const char *const *values,
                                      size_t n_meta) {
  Dspwire__CkptSave *m = &w->body.ckpt_save;
  *m = (Dspwire__CkptSave)DSPWIRE__CKPT_SAVE__INIT;
  m->file.data = (uint8_t *)file;
  m->file.len = file_len;
  m->n_names = m->n_ids = n;
  m->names = (char **)names;
  m->ids = (uint64_t *)ids;
  m->n_meta_keys = m->n_meta_values = n_meta;
  m->meta_keys = (char **)keys;
  m->meta_values = (char **)values;
  begin(w, DSPWIRE__REQUEST__BODY_CKPT_SAVE)->ckpt_save = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_ckpt_load(dsp_wreq *w, const char *file,
                                      size_t file_len, uint64_t first_id,
                                      uint32_t max_tensors) {
  Dspwire__CkptLoad *m = &w->body.ckpt_load;
  *m = (Dspwire__CkptLoad)DSPWIRE__CKPT_LOAD__INIT;
  m->file.data = (uint8_t *)file;
  m->file.len = file_len;
  m->first_id = first_id;
  m->max_tensors = max_tensors;
  begin(w, DSPWIRE__REQUEST__BODY_CKPT_LOAD)->ckpt_load = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_peer_grant(dsp_wreq *w, uint64_t id) {
  Dspwire__PeerGrant *m = &w->body.peer_grant;
  *m = (Dspwire__PeerGrant)DSPWIRE__PEER_GRANT__INIT;
  m->id = id;
  begin(w, DSPWIRE__REQUEST__BODY_PEER_GRANT)->peer_grant = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_peer_pull(dsp_wreq *w, const char *peer,
                                      const uint8_t *cap, size_t cap_len,
                                      uint64_t output, int32_t dtype,
                                      size_t ndim, const int64_t *shape,
                                      const char *device) {
  Dspwire__PeerPull *m = &w->body.peer_pull;
  *m = (Dspwire__PeerPull)DSPWIRE__PEER_PULL__INIT;
  m->peer = (char *)(peer ? peer : "");
  m->capability.data = (uint8_t *)cap;
  m->capability.len = cap_len;
  m->output = output;
  w->meta = (Dspwire__TensorMeta)DSPWIRE__TENSOR_META__INIT;
  w->meta.dtype = dtype;
  w->meta.n_shape = ndim;
  w->meta.shape = (int64_t *)shape;
  m->meta = &w->meta;
  m->device = (char *)(device ? device : "");
  begin(w, DSPWIRE__REQUEST__BODY_PEER_PULL)->peer_pull = m;
  return &w->req;
}

Dspwire__Request *dsp_wreq_peer_fetch(dsp_wreq *w, const uint8_t *cap,
                                       size_t cap_len) {
  Dspwire__PeerFetch *m = &w->body.peer_fetch;
  *m = (Dspwire__PeerFetch)DSPWIRE__PEER_FETCH__INIT;
  m->capability.data = (uint8_t *)cap;
  m->capability.len = cap_len;
  begin(w, DSPWIRE__REQUEST__BODY_PEER_FETCH)->peer_fetch = m;
  return &w->req;
}

size_t dsp_req_frame_size(const Dspwire__Request *req) {
  return DSP_FRAME_HEADER_SIZE + dspwire__request__get_packed_size(req);
}

/* Packs first and takes the length pack reports, so a frame costs one
 * size pass (the caller's, to make room) and one pack pass. */
size_t dsp_req_frame_encode(const Dspwire__Request *req, uint64_t bulk_len,
                            uint8_t *out) {
  size_t mlen = dspwire__request__pack(req, out + DSP_FRAME_HEADER_SIZE);
  dsp_frame_header h = {(uint32_t)mlen, 0, bulk_len};
  dsp_frame_header_encode(out, &h);
  return DSP_FRAME_HEADER_SIZE + mlen;
}
