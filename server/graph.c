/* Captured graphs on the server (protocol 1.2): GraphDefine keeps a
 * checked node list in the session, GraphReplay runs it on fresh input
 * bytes through the same executor the LOCAL device uses (common/graph.c),
 * Free.graphs drops it. A replay's internal values live in the executor's
 * slots, never under session ids, so replays cannot collide with the
 * session's tensors; externals are looked up by id at every replay and
 * keep their identity (a step updates them in place). */
#include <stdio.h>
#include <string.h>

#include "graph.h"
#include "sv.h"

typedef struct sv_graph {
  dsp_graph *g;
  uint64_t *ext_ids; /* n_ext session ids */
  uint64_t charged;  /* to the session budget */
  uint64_t replays;  /* runs so far: Adam's step count advances with them */
  /* the last replay that succeeded: its work (dsp_ctx_work, 0 before the
   * first) and its externals' metas, so the loop can tell that the next
   * replay will do the same work (sv_graph_inline_cost) */
  uint64_t last_work;
  dsp_meta *last_ext; /* n_ext */
} sv_graph;

static void graph_free(sv_session *s, sv_graph *sg) {
  if (!sg) return;
  dsp_budget_uncharge(s->budget, sg->charged);
  dsp_graph_free(sg->g);
  dsp_free(sg->ext_ids);
  dsp_free(sg->last_ext);
  dsp_free(sg);
}

static int meta_from(const Dspwire__TensorMeta *w, dsp_meta *m) {
  memset(m, 0, sizeof *m);
  if (!w || w->n_shape > DSP_MAX_DIMS || !dsp_dtype_valid(w->dtype))
    return DISPATCH_EINVAL;
  m->dtype = (dsp_dtype)w->dtype;
  m->ndim = (int)w->n_shape;
  for (int i = 0; i < m->ndim; i++) m->shape[i] = w->shape[i];
  return 0;
}

/* Everything a definition declares is bounded and charged before its
 * arrays are allocated: slot and node counts by the executor's limits, the
 * bytes (nodes, operands, per-slot state of a run) by the session budget. */
int sv_graph_define(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__GraphDefine *d = j->req->graph_define;
  if (sv_idmap_get(&s->graphs, d->graph))
    return sv_why(why, len, DISPATCH_EIDINUSE,
                  "graph id %llu is already in use",
                  (unsigned long long)d->graph);
  if (d->n_slots > DSP_GRAPH_MAX_SLOTS || d->n_nodes > DSP_GRAPH_MAX_NODES ||
      (uint64_t)d->n_inputs + d->n_externals > d->n_slots ||
      d->n_outputs > d->n_slots)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "graph %llu: %zu inputs, %zu externals, %zu outputs in %u "
                  "slots, %zu nodes (at most %u slots and %u nodes)",
                  (unsigned long long)d->graph, d->n_inputs, d->n_externals,
                  d->n_outputs, d->n_slots, d->n_nodes, DSP_GRAPH_MAX_SLOTS,
                  DSP_GRAPH_MAX_NODES);
  uint64_t cost = sizeof(sv_graph) + sizeof(dsp_graph) +
                  (uint64_t)d->n_slots * (1 + sizeof(void *)) +
                  (uint64_t)d->n_externals * (16 + sizeof(dsp_meta)) +
                  (uint64_t)d->n_inputs * sizeof(dsp_meta) +
                  (uint64_t)d->n_outputs * 4 +
                  (uint64_t)d->n_nodes * (sizeof(dsp_gnode) + 16);
  for (size_t i = 0; i < d->n_nodes; i++)
    cost += (uint64_t)d->nodes[i]->n_inputs * 4 +
            (uint64_t)d->nodes[i]->n_weight_decay * 8;
  char refused[256];
  int rc = dsp_budget_charge_why(s->budget, cost, "", refused, sizeof refused);
  if (rc < 0)
    return sv_why(why, len, rc, "graph %llu%s", (unsigned long long)d->graph,
                  refused);
  sv_graph *sg = dsp_calloc(1, sizeof *sg);
  dsp_graph *g = dsp_graph_new();
  if (sg) sg->charged = cost;
  if (!sg || !g) {
    dsp_graph_free(g);
    dsp_free(sg);
    dsp_budget_uncharge(s->budget, cost);
    return sv_why(why, len, DISPATCH_ENOMEM, "graph: out of memory");
  }
  sg->g = g;
  g->n_inputs = (uint32_t)d->n_inputs;
  g->n_ext = (uint32_t)d->n_externals;
  g->n_slots = d->n_slots;
  g->input_meta = dsp_calloc(d->n_inputs ? d->n_inputs : 1, sizeof(dsp_meta));
  sg->ext_ids = dsp_calloc(d->n_externals ? d->n_externals : 1, 8);
  sg->last_ext = dsp_calloc(d->n_externals ? d->n_externals : 1,
                            sizeof(dsp_meta));
  g->outputs = dsp_calloc(d->n_outputs ? d->n_outputs : 1, 4);
  if (!g->input_meta || !sg->ext_ids || !sg->last_ext || !g->outputs) {
    rc = sv_why(why, len, DISPATCH_ENOMEM, "graph: out of memory");
    goto fail;
  }
  for (size_t i = 0; i < d->n_inputs; i++) {
    if (meta_from(d->inputs[i], &g->input_meta[i]) < 0) {
      rc = sv_why(why, len, DISPATCH_EINVAL,
                  "graph %llu: input %zu has no valid dtype and rank",
                  (unsigned long long)d->graph, i);
      goto fail;
    }
    int64_t numel;
    char msg[384];
    char what[32];
    snprintf(what, sizeof what, "input %zu", i);
    rc = sv_dtype_for_client(s, g->input_meta[i].dtype, what, msg, sizeof msg);
    if (rc == 0)
      rc = sv_check_meta(s->cfg, s->global, s->ctx, &g->input_meta[i],
                         "graph input", &numel, msg, sizeof msg);
    if (rc < 0) {
      sv_why(why, len, rc, "graph %llu: %s", (unsigned long long)d->graph, msg);
      goto fail;
    }
  }
  if (d->n_externals) memcpy(sg->ext_ids, d->externals, d->n_externals * 8);
  if (d->n_outputs) memcpy(g->outputs, d->outputs, d->n_outputs * 4);
  g->n_outputs = (uint32_t)d->n_outputs;
  for (size_t i = 0; i < d->n_nodes; i++) {
    const Dspwire__GraphNode *n = d->nodes[i];
    dsp_attrs a;
    if (sv_attrs_from(n->n_ints, n->ints, n->n_floats, n->floats, &a) < 0 ||
        n->n_inputs > DSP_GRAPH_MAX_STEP_IN ||
        n->n_weight_decay > DSP_GRAPH_MAX_STEP_IN) {
      rc = sv_why(why, len, DISPATCH_EINVAL,
                  "graph %llu: node %zu has %zu operands, %zu int and %zu "
                  "float attributes (at most %u, %d, %d)",
                  (unsigned long long)d->graph, i, n->n_inputs, n->n_ints,
                  n->n_floats, DSP_GRAPH_MAX_STEP_IN, DSP_MAX_ATTR_INTS,
                  DSP_MAX_ATTR_FLOATS);
      goto fail;
    }
    if (dsp_graph_add(g, n->kind, n->op, n->flags, n->inputs,
                      (uint32_t)n->n_inputs, n->output, &a) < 0 ||
        ((n->max_norm != 0.0 || n->n_weight_decay) &&
         dsp_graph_set_step(g, n->max_norm, n->weight_decay,
                            (uint32_t)n->n_weight_decay) < 0)) {
      rc = sv_why(why, len, DISPATCH_ENOMEM, "graph: out of memory");
      goto fail;
    }
  }
  rc = dsp_graph_check(s->ctx, g);
  if (rc < 0) {
    sv_why(why, len, rc, "graph %llu: %s", (unsigned long long)d->graph,
           dsp_ctx_errmsg(s->ctx));
    goto fail;
  }
  /* every replay does at least the nodes' own work: a graph that must
   * pass the bound is refused now, not at each replay */
  g->max_work = s->cfg->max_replay_cost;
  if (g->max_work && g->static_work > g->max_work) {
    atomic_fetch_add(&s->global->limit_violations, 1);
    rc = sv_why(why, len, DISPATCH_ELIMIT,
                "graph %llu: %zu nodes and %u slots, at least %llu elementary "
                "operations a replay, over the per-replay limit of %llu "
                "(dispatch-server --max-replay-cost)",
                (unsigned long long)d->graph, g->n_nodes, g->n_slots,
                (unsigned long long)g->static_work,
                (unsigned long long)g->max_work);
    goto fail;
  }
  if (sv_idmap_put(&s->graphs, d->graph, sg) < 0) {
    rc = sv_why(why, len, DISPATCH_ENOMEM, "graph: out of memory");
    goto fail;
  }
  return 0;
fail:
  graph_free(s, sg);
  return rc;
}

/* A replay's bulk (every input's bytes) lands in one host block charged
 * to the session while the request waits, as an upload's does; the bytes
 * become tensors when the replay runs and the placeholders' metas are
 * known (only the worker may read the session's graphs). */
int sv_graph_replay_prepare(const sv_config *cfg, dsp_ctx *io_ctx,
                            sv_session *s, sv_job *j, uint64_t bulk_len,
                            int may_wait) {
  if (bulk_len == 0) return 0;
  if (may_wait && !dsp_budget_fits(s->budget, bulk_len + 512)) return 1;
  dsp_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = DSP_BOOL; /* one byte per element: a byte block */
  m.ndim = 1;
  m.shape[0] = (int64_t)bulk_len;
  dsp_tensor *t;
  dsp_ctx_set_budget(io_ctx, s->budget);
  dsp_ctx_set_backend(io_ctx, dsp_cpu_backend());
  int rc = dsp_tensor_new_uninit(io_ctx, &m, &t);
  if (rc == 0) {
    rc = dsp_tensor_stage_in(io_ctx, t, &j->upload_stage);
    if (rc < 0) dsp_tensor_unref(t);
  }
  dsp_ctx_set_backend(io_ctx, NULL);
  dsp_ctx_set_budget(io_ctx, NULL);
  if (rc < 0) {
    char msg[512];
    if (rc == DISPATCH_EQUOTA)
      atomic_fetch_add(&s->global->limit_violations, 1);
    snprintf(msg, sizeof msg, "graph_replay: %llu input bytes: %s",
             (unsigned long long)bulk_len, dsp_ctx_errmsg(io_ctx));
    j->pre_err = rc;
    j->pre_msg = dsp_strdup(msg);
    return 0;
  }
  j->upload = t;
  j->upload_bytes = bulk_len;
  atomic_fetch_add(&s->queued_bytes, (long long)bulk_len);
  return 0;
}

/* Checks the inputs against the placeholders, makes them tensors, looks
 * up the externals, runs the graph and encodes every output's bytes after
 * a GraphReply. */
int sv_graph_replay(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__GraphReplay *r = j->req->graph_replay;
  s->turn_cost = SV_TURN_COST; /* a whole step: its own turn */
  unsigned long long gid = (unsigned long long)r->graph;
  if (j->pre_err < 0)
    return sv_why(why, len, j->pre_err, "%s",
                  j->pre_msg ? j->pre_msg : dispatch_strerror(j->pre_err));
  sv_graph *sg = sv_idmap_get(&s->graphs, r->graph);
  if (!sg)
    return sv_why(why, len, DISPATCH_ENOID, "graph %llu does not exist", gid);
  dsp_graph *g = sg->g;
  if (r->n_inputs != g->n_inputs)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "graph %llu: %zu inputs given, it has %u", gid, r->n_inputs,
                  g->n_inputs);
  uint64_t total = 0;
  for (uint32_t i = 0; i < g->n_inputs; i++) {
    dsp_meta m;
    char a[160], b[160];
    if (meta_from(r->inputs[i], &m) < 0 ||
        !dsp_meta_equal(&m, &g->input_meta[i])) {
      if (meta_from(r->inputs[i], &m) < 0) snprintf(a, sizeof a, "invalid");
      else
        snprintf(a, sizeof a, "%s %s", dsp_dtype_name(m.dtype),
                 dsp_shape_str(&m, b, sizeof b));
      char c[160];
      return sv_why(why, len, DISPATCH_ESHAPE,
                    "graph %llu: input %u is %s, its placeholder %s %s", gid, i,
                    a, dsp_dtype_name(g->input_meta[i].dtype),
                    dsp_shape_str(&g->input_meta[i], c, sizeof c));
    }
    int64_t numel;
    dsp_meta_numel(s->ctx, &m, &numel);
    total += (uint64_t)numel * dsp_dtype_size(m.dtype);
  }
  uint64_t got = j->upload ? j->upload_stage.nbytes : 0;
  if (got != total)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "graph %llu: %llu bulk bytes, its inputs need %llu", gid,
                  (unsigned long long)got, (unsigned long long)total);
  size_t n_t = (size_t)g->n_inputs + g->n_ext + g->n_outputs;
  dsp_tensor **ts = dsp_calloc(n_t ? n_t : 1, sizeof *ts);
  if (!ts) return sv_why(why, len, DISPATCH_ENOMEM, "graph: out of memory");
  dsp_tensor **in = ts, **ext = ts + g->n_inputs,
             **out = ext + g->n_ext;
  int rc = 0;
  const uint8_t *p = j->upload ? j->upload_stage.host : NULL;
  for (uint32_t i = 0; i < g->n_inputs && rc == 0; i++) {
    int64_t numel;
    dsp_meta_numel(s->ctx, &g->input_meta[i], &numel);
    size_t nb = (size_t)numel * dsp_dtype_size(g->input_meta[i].dtype);
    rc = dsp_tensor_from_data(s->ctx, &g->input_meta[i], p, nb, &in[i]);
    if (rc < 0)
      sv_why(why, len, rc, "graph %llu: input %u: %s", gid, i,
             dsp_ctx_errmsg(s->ctx));
    if (p) p += nb;
  }
  /* the bytes are tensors now: the block goes back at once */
  dsp_stage_release(&j->upload_stage);
  dsp_tensor_unref(j->upload);
  j->upload = NULL;
  for (uint32_t i = 0; i < g->n_ext && rc == 0; i++) {
    sv_entry *e = sv_idmap_get(&s->tensors, sg->ext_ids[i]);
    if (!e)
      rc = sv_why(why, len, DISPATCH_ENOID,
                  "graph %llu: external tensor %u (id %llu) does not exist",
                  gid, i, (unsigned long long)sg->ext_ids[i]);
    else if (!e->t)
      rc = sv_why(why, len, DISPATCH_EPOISONED,
                  "graph %llu: external tensor %u (id %llu) is poisoned by %s",
                  gid, i, (unsigned long long)sg->ext_ids[i],
                  e->poison ? e->poison : "?");
    else
      ext[i] = e->t;
  }
  if (rc == 0) {
    sg->replays++;
    uint64_t work = dsp_ctx_work(s->ctx);
    sg->last_work = 0; /* known again only once this one succeeds */
    rc = dsp_graph_run(s->ctx, g, in, ext, (int64_t)sg->replays, out,
                       &s->n_ops);
    if (rc == 0) {
      work = dsp_ctx_work(s->ctx) - work;
      sg->last_work = work ? work : 1;
      for (uint32_t i = 0; i < g->n_ext; i++) sg->last_ext[i] = ext[i]->meta;
    }
    if (rc < 0) {
      if (rc == DISPATCH_ELIMIT)
        atomic_fetch_add(&s->global->limit_violations, 1);
      sv_why(why, len, rc, "graph %llu, %s", gid, dsp_ctx_errmsg(s->ctx));
    }
  }
  Dspwire__TensorMeta *metas = NULL, **mp = NULL;
  if (rc == 0) {
    metas = dsp_calloc(g->n_outputs ? g->n_outputs : 1, sizeof *metas);
    mp = dsp_calloc(g->n_outputs ? g->n_outputs : 1, sizeof *mp);
    if (!metas || !mp)
      rc = sv_why(why, len, DISPATCH_ENOMEM,
                  "graph %llu: out of memory for the "
                  "reply",
                  gid);
  }
  for (uint32_t i = 0; i < g->n_outputs && rc == 0; i++) {
    char what[64], msg[192];
    snprintf(what, sizeof what, "graph %llu: output %u", gid, i);
    if ((rc = sv_dtype_for_client(s, out[i]->meta.dtype, what, msg,
                                  sizeof msg)) < 0) {
      sv_why(why, len, rc, "%s", msg);
      break;
    }
    sv_wire_meta(&metas[i], &out[i]->meta);
    mp[i] = &metas[i];
  }
  if (rc == 0) {
    Dspwire__Reply rep = DSPWIRE__REPLY__INIT;
    Dspwire__GraphReply gr = DSPWIRE__GRAPH_REPLY__INIT;
    gr.n_outputs = g->n_outputs;
    gr.outputs = mp;
    rep.req_id = j->req->req_id;
    rep.body_case = DSPWIRE__REPLY__BODY_GRAPH;
    rep.graph = &gr;
    /* each output's bytes copied once, charged to the session until sent
     * (dsp_graph_check refused an output named twice) */
    rc = sv_encode_tensors_reply(s->ctx, &rep, out, g->n_outputs, j);
    if (rc < 0)
      sv_why(why, len, rc, "graph %llu: the reply: %s", gid,
             dsp_ctx_errmsg(s->ctx));
  }
  dsp_free(metas);
  dsp_free(mp);
  for (size_t i = 0; i < g->n_inputs; i++) dsp_tensor_unref(in[i]);
  for (size_t i = 0; i < g->n_outputs; i++) dsp_tensor_unref(out[i]);
  dsp_free(ts);
  return rc;
}

int sv_graph_inline_cost(sv_session *s, const sv_job *j, uint64_t *cost) {
  if (j->pre_err != 0) return 0;
  const sv_graph *sg = sv_idmap_get(&s->graphs, j->req->graph_replay->graph);
  if (!sg || !sg->last_work || !sv_inline_placed(s, NULL, 0)) return 0;
  for (uint32_t i = 0; i < sg->g->n_ext; i++) {
    const sv_entry *e = sv_idmap_get(&s->tensors, sg->ext_ids[i]);
    if (!e || !e->t || !dsp_meta_equal(&e->t->meta, &sg->last_ext[i]) ||
        !sv_inline_placed(s, &e->t, 1))
      return 0;
  }
  *cost = sg->last_work + j->upload_bytes;
  return 1;
}

/* What freeing a graph costs the thread that does it: a free() of each
 * node's operand array, about an eighth of what running the node costs
 * (DSP_WORK_PER_OP) */
#define GRAPH_FREE_NODE_COST (DSP_WORK_PER_OP / 8)

uint64_t sv_graph_free_cost(sv_session *s, uint64_t id) {
  const sv_graph *sg = sv_idmap_get(&s->graphs, id);
  if (!sg) return 0;
  return 1 + (uint64_t)sg->g->n_nodes * GRAPH_FREE_NODE_COST;
}

int sv_graph_free_id(sv_session *s, uint64_t id) {
  sv_graph *sg = sv_idmap_del(&s->graphs, id);
  if (!sg) return DISPATCH_ENOID;
  graph_free(s, sg);
  return 0;
}

void sv_graph_teardown(sv_session *s) {
  for (size_t i = 0; i < s->graphs.cap; i++)
    if (s->graphs.vals[i]) graph_free(s, s->graphs.vals[i]);
  sv_idmap_clear(&s->graphs);
}
