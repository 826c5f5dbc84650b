/* The one table of request kinds: for each body case its name, whether
 * it waits for a reply, whether the loop may answer it or run it inline
 * and what that costs, its bulk part, the decoder's extra check, the
 * handler that runs it, the output its failure poisons and how messages
 * describe it. Adding a request kind means adding a row here (and its
 * handler), not finding the places that name kinds. */
#include <stdio.h>

#include "group.h"
#include "handlers.h"
#include "op_record.h"

/* ------------------------------------------------------------ describe */

/* Appends "a, b, c" of at most 8 ids, then ", ..." */
static void ids_str(char *buf, size_t len, const uint64_t *ids, size_t n) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < n && used < len; i++) {
    if (i == 8) {
      snprintf(buf + used, len - used, ", ...");
      return;
    }
    int w = snprintf(buf + used, len - used, "%s%llu", i ? ", " : "",
                     (unsigned long long)ids[i]);
    if (w < 0) return;
    used += (size_t)w;
  }
}

static const char *op_name(int code) {
  const dsp_op_info *i = dsp_op_lookup(code);
  return i ? i->name : "unknown-op";
}

void sv_describe_record(const dsp_oprec *r, char *buf, size_t len) {
  uint64_t in[DSP_MAX_INPUTS];
  char ids[160];
  for (int i = 0; i < r->n_in; i++) in[i] = dsp_oprec_in(r, i);
  ids_str(ids, sizeof ids, in, (size_t)r->n_in);
  snprintf(buf, len, "op %s [%s] -> %llu", op_name(r->op), ids,
           (unsigned long long)r->out);
}

static void describe_hello(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "hello %u.%u", r->hello->major, r->hello->minor);
}

static void describe_upload(const Dspwire__Request *r, char *buf,
                            size_t len) {
  dsp_meta m = {0};
  char shape[128] = "?";
  if (r->upload->meta) {
    m.dtype = dsp_dtype_valid(r->upload->meta->dtype)
                  ? (dsp_dtype)r->upload->meta->dtype
                  : DSP_F32;
    m.ndim = r->upload->meta->n_shape > DSP_MAX_DIMS
                 ? DSP_MAX_DIMS
                 : (int)r->upload->meta->n_shape;
    for (int i = 0; i < m.ndim; i++) m.shape[i] = r->upload->meta->shape[i];
    dsp_shape_str(&m, shape, sizeof shape);
  }
  snprintf(buf, len, "upload %llu %s %s", (unsigned long long)r->upload->id,
           r->upload->meta && dsp_dtype_valid(r->upload->meta->dtype)
               ? dsp_dtype_name(m.dtype)
               : "bad-dtype",
           shape);
}

static void describe_op(const Dspwire__Request *r, char *buf, size_t len) {
  char ids[160];
  ids_str(ids, sizeof ids, r->op->inputs, r->op->n_inputs);
  snprintf(buf, len, "op %s [%s] -> %llu", op_name(r->op->op), ids,
           (unsigned long long)r->op->output);
}

static void describe_track(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "track %llu", (unsigned long long)r->track->id);
}

static void describe_backward(const Dspwire__Request *r, char *buf,
                              size_t len) {
  snprintf(buf, len, "backward loss %llu -> grads %llu%s",
           (unsigned long long)r->backward->loss,
           (unsigned long long)r->backward->grads,
           r->backward->retain ? " (retain)" : "");
}

static void describe_grad(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "grad grads %llu tensor %llu -> %llu",
           (unsigned long long)r->grad->grads,
           (unsigned long long)r->grad->tensor,
           (unsigned long long)r->grad->output);
}

static void describe_step(const Dspwire__Request *r, char *buf, size_t len) {
  char ids[160];
  ids_str(ids, sizeof ids, r->step->params, r->step->n_params);
  snprintf(buf, len, "step %s grads %llu params [%s]", op_name(r->step->op),
           (unsigned long long)r->step->grads, ids);
}

static void describe_free(const Dspwire__Request *r, char *buf, size_t len) {
  char ids[160], ids2[160];
  ids_str(ids, sizeof ids, r->free->tensors, r->free->n_tensors);
  ids_str(ids2, sizeof ids2, r->free->grads, r->free->n_grads);
  snprintf(buf, len, "free tensors [%s] grads [%s]", ids, ids2);
}

static void describe_read(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "read %llu", (unsigned long long)r->read->id);
}

static void describe_to_device(const Dspwire__Request *r, char *buf,
                               size_t len) {
  char dev[4 * SV_LOG_STR_MAX + 8];
  snprintf(buf, len, "to_device %llu -> %llu on \"%s\"",
           (unsigned long long)r->to_device->id,
           (unsigned long long)r->to_device->output,
           sv_log_str(dev, sizeof dev, r->to_device->device, 32));
}

static void describe_ops(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "ops (%zu bytes of records)", r->ops->records.len);
}

/* Sync, Stats, Bye: the kind's name says it all */
static void describe_name(const Dspwire__Request *r, char *buf, size_t len) {
  snprintf(buf, len, "%s", sv_req_kind_of(r->body_case)->name);
}

static void describe_graph_define(const Dspwire__Request *r, char *buf,
                                  size_t len) {
  snprintf(buf, len, "graph_define %llu (%zu nodes)",
           (unsigned long long)r->graph_define->graph,
           r->graph_define->n_nodes);
}

static void describe_graph_replay(const Dspwire__Request *r, char *buf,
                                  size_t len) {
  snprintf(buf, len, "graph_replay %llu",
           (unsigned long long)r->graph_replay->graph);
}

/* the file name as a log line may quote it: at most 64 bytes, escaped */
static void describe_ckpt(const char *what, const ProtobufCBinaryData *f,
                          char *buf, size_t len) {
  char name[SV_LOG_STR_MAX + 1], shown[4 * SV_LOG_STR_MAX + 8];
  size_t n = f->len < SV_LOG_STR_MAX ? f->len : SV_LOG_STR_MAX;
  size_t k = 0;
  for (; k < n && f->data[k]; k++) name[k] = (char)f->data[k];
  name[k] = '\0';
  snprintf(buf, len, "%s \"%s\"%s", what,
           sv_log_str(shown, sizeof shown, name, SV_LOG_STR_MAX),
           k < f->len ? "..." : "");
}

static void describe_ckpt_save(const Dspwire__Request *r, char *buf,
                               size_t len) {
  describe_ckpt("checkpoint save", &r->ckpt_save->file, buf, len);
}

static void describe_ckpt_load(const Dspwire__Request *r, char *buf,
                               size_t len) {
  describe_ckpt("checkpoint load", &r->ckpt_load->file, buf, len);
}

static void describe_peer_grant(const Dspwire__Request *r, char *buf,
                                size_t len) {
  snprintf(buf, len, "peer_grant %llu",
           (unsigned long long)r->peer_grant->id);
}

static void describe_peer_pull(const Dspwire__Request *r, char *buf,
                               size_t len) {
  char peer[4 * SV_LOG_STR_MAX + 8];
  snprintf(buf, len, "peer_pull from \"%s\" -> %llu",
           sv_log_str(peer, sizeof peer, r->peer_pull->peer, 32),
           (unsigned long long)r->peer_pull->output);
}

static void describe_group_join(const Dspwire__Request *r, char *buf,
                                size_t len) {
  snprintf(buf, len, "group_join %llx of %u",
           (unsigned long long)r->group_join->group, r->group_join->size);
}

static void describe_group_allreduce(const Dspwire__Request *r, char *buf,
                                     size_t len) {
  const Dspwire__GroupAllreduce *g = r->group_allreduce;
  char rn[40];
  snprintf(buf, len, "group_allreduce %llx seq %llu %s of %zu %s",
           (unsigned long long)g->group, (unsigned long long)g->seq,
           sv_group_reduce_name(g->reduce, rn, sizeof rn),
           g->grads ? g->n_params : g->n_tensors,
           g->grads ? "gradients" : "tensors");
}

void sv_describe(const Dspwire__Request *r, char *buf, size_t len) {
  const sv_req_kind *k = sv_req_kind_of(r->body_case);
  if (k->describe) k->describe(r, buf, len);
  else snprintf(buf, len, "empty request");
}

/* ------------------------------------------------------------ outputs */

static uint64_t out_upload(const Dspwire__Request *r) { return r->upload->id; }
static uint64_t out_op(const Dspwire__Request *r) { return r->op->output; }
static uint64_t out_to_device(const Dspwire__Request *r) {
  return r->to_device->output;
}
static uint64_t out_grad(const Dspwire__Request *r) { return r->grad->output; }

/* ------------------------------------------------------------ the table */

/* The fields of sv_req_kind (sv.h), by name: a row states only what its
 * kind has. */
#define ROW(bc, ...) [bc] = {__VA_ARGS__}

static const sv_req_kind g_kinds[] = {
    ROW(DSPWIRE__REQUEST__BODY__NOT_SET, .name = "empty"),
    ROW(DSPWIRE__REQUEST__BODY_HELLO, .name = "hello", .waits = 1,
        .describe = describe_hello),
    ROW(DSPWIRE__REQUEST__BODY_UPLOAD, .name = "upload", .bulk = sv_upload_bulk,
        .exec = sv_exec_upload, .out = out_upload,
        .inline_cost = sv_inline_upload_cost, .describe = describe_upload),
    ROW(DSPWIRE__REQUEST__BODY_OP, .name = "op", .inline_tail = 1,
        .check = sv_check_op, .exec = sv_exec_op, .out = out_op,
        .inline_cost = sv_inline_op_cost, .describe = describe_op),
    ROW(DSPWIRE__REQUEST__BODY_TRACK, .name = "track", .exec = sv_exec_track,
        .describe = describe_track),
    ROW(DSPWIRE__REQUEST__BODY_BACKWARD, .name = "backward", .waits = 1,
        .own_turn = 1, .exec = sv_exec_backward,
        .describe = describe_backward),
    ROW(DSPWIRE__REQUEST__BODY_GRAD, .name = "grad", .exec = sv_exec_grad,
        .out = out_grad, .describe = describe_grad),
    ROW(DSPWIRE__REQUEST__BODY_STEP, .name = "step", .own_turn = 1,
        .exec = sv_exec_step, .describe = describe_step),
    ROW(DSPWIRE__REQUEST__BODY_TO_DEVICE, .name = "to_device",
        .exec = sv_exec_to_device, .out = out_to_device,
        .describe = describe_to_device),
    ROW(DSPWIRE__REQUEST__BODY_FREE, .name = "free", .exec = sv_exec_free,
        .inline_cost = sv_inline_free_cost, .describe = describe_free),
    ROW(DSPWIRE__REQUEST__BODY_READ, .name = "read", .waits = 1, .on_loop = 1,
        .exec = sv_exec_read, .describe = describe_read),
    ROW(DSPWIRE__REQUEST__BODY_SYNC, .name = "sync", .waits = 1, .on_loop = 1,
        .exec = sv_exec_sync, .describe = describe_name),
    ROW(DSPWIRE__REQUEST__BODY_STATS, .name = "stats", .waits = 1,
        .on_loop = 1, .exec = sv_exec_stats, .describe = describe_name),
    ROW(DSPWIRE__REQUEST__BODY_BYE, .name = "bye", .ends = 1,
        .exec = sv_exec_bye, .describe = describe_name),
    ROW(DSPWIRE__REQUEST__BODY_GRAPH_DEFINE, .name = "graph_define",
        .exec = sv_graph_define, .describe = describe_graph_define),
    ROW(DSPWIRE__REQUEST__BODY_GRAPH_REPLAY, .name = "graph_replay",
        .waits = 1, .inline_whole = 1, .bulk = sv_graph_replay_prepare,
        .exec = sv_graph_replay, .inline_cost = sv_graph_inline_cost,
        .describe = describe_graph_replay),
    ROW(DSPWIRE__REQUEST__BODY_OPS, .name = "ops", .check = sv_check_ops,
        .exec = sv_exec_ops, .describe = describe_ops),
    /* 1.6, server/checkpoint.c: file I/O, so never on the loop */
    ROW(DSPWIRE__REQUEST__BODY_CKPT_SAVE, .name = "ckpt_save", .waits = 1,
        .own_turn = 1, .exec = sv_exec_ckpt_save,
        .describe = describe_ckpt_save),
    ROW(DSPWIRE__REQUEST__BODY_CKPT_LOAD, .name = "ckpt_load", .waits = 1,
        .own_turn = 1, .exec = sv_exec_ckpt_load,
        .describe = describe_ckpt_load),
    /* 1.7, server/peer.c: a pull holds its worker for the transfer (the
     * loop never waits on a peer); a fetch answers from a pinned snapshot */
    ROW(DSPWIRE__REQUEST__BODY_PEER_GRANT, .name = "peer_grant", .waits = 1,
        .exec = sv_exec_peer_grant, .describe = describe_peer_grant),
    ROW(DSPWIRE__REQUEST__BODY_PEER_PULL, .name = "peer_pull", .waits = 1,
        .own_turn = 1, .exec = sv_exec_peer_pull,
        .describe = describe_peer_pull),
    ROW(DSPWIRE__REQUEST__BODY_PEER_FETCH, .name = "peer_fetch", .waits = 1,
        .exec = sv_exec_peer_fetch, .describe = describe_name),
    /* 1.7, server/group.c: the MPI group; an all-reduce waits for the
     * other members, so never on the loop */
    ROW(DSPWIRE__REQUEST__BODY_GROUP_JOIN, .name = "group_join", .waits = 1,
        .exec = sv_exec_group_join, .describe = describe_group_join),
    ROW(DSPWIRE__REQUEST__BODY_GROUP_ALLREDUCE, .name = "group_allreduce",
        .own_turn = 1, .exec = sv_exec_group_allreduce,
        .describe = describe_group_allreduce),
};

const sv_req_kind *sv_req_kind_of(Dspwire__Request__BodyCase bc) {
  static const sv_req_kind none = {.name = "unknown"};
  size_t i = (size_t)bc;
  if (i >= sizeof g_kinds / sizeof g_kinds[0] || !g_kinds[i].name)
    return &none;
  return &g_kinds[i];
}

int sv_req_waits(const Dspwire__Request *r) {
  if (r->body_case == DSPWIRE__REQUEST__BODY_BACKWARD && r->backward &&
      r->backward->no_reply)
    return 0;
  return sv_req_kind_of(r->body_case)->waits;
}

int sv_inline_cost(sv_session *s, const sv_job *j, uint64_t *cost) {
  const sv_req_kind *k = sv_req_kind_of(j->req->body_case);
  return k->inline_cost && k->inline_cost(s, j, cost);
}
