/* The request handlers: one function per request kind, each the `exec` of
 * its row in the kinds table (kinds.c), run by sv_session_exec on a worker
 * (or on the loop, for the kinds and ops the loop may run). Every id,
 * count, attribute and size a request names is checked here before a
 * kernel runs; a handler reports a failure as a code and a reason, and
 * session.c turns it into an error reply or the session's deferred error
 * and poisons the output. */
#include "handlers.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "group.h"
#include "op_record.h"

/* Copies the ctx's detail of a failed core call. */
static int why_ctx(sv_session *s, char *why, size_t len, int code) {
  const char *m = dsp_ctx_errmsg(s->ctx);
  return sv_why(why, len, code, "%s", m && *m ? m : dispatch_strerror(code));
}

/* Which limit a dsp_op's DISPATCH_ELIMIT was: the per-op cost (its
 * message names --max-op-cost, common/op.c) or the span of a result that
 * the session never named (a backward intermediate, --max-elements). */
static sv_limit op_limit(sv_session *s) {
  return strstr(dsp_ctx_errmsg(s->ctx), "--max-op-cost") ? SV_LIM_MAX_OP_COST
                                                         : SV_LIM_MAX_ELEMENTS;
}

/* why_ctx for a failed dsp_op / dsp_backward: a refusal by the per-op cost
 * limit (--max-op-cost) counts as a limit violation. */
static int why_run(sv_session *s, char *why, size_t len, int code) {
  if (code == DISPATCH_ELIMIT) sv_count_limit(s->global, op_limit(s));
  return why_ctx(s, why, len, code);
}

/* Element limit for a tensor of meta m about to be made. The bytes are
 * judged where they are allocated (the session budget): the output, what
 * the kernel needs on the side and what autodiff saves alike. */
static int check_new_meta(sv_session *s, const dsp_meta *m, char *why,
                          size_t len) {
  int64_t numel;
  return sv_check_meta(s->cfg, s->global, s->ctx, m, "result", &numel, why,
                       len);
}

/* The attributes of an Op or a Step (sv_attrs_from), refused in the
 * words of the request they came with ("add: 9 int attributes, at most
 * 8"). */
static int attrs_from(const char *name, size_t n_ints, const int64_t *ints,
                      size_t n_floats, const double *floats, dsp_attrs *a,
                      char *why, size_t len) {
  if (sv_attrs_from(n_ints, ints, n_floats, floats, a) == 0) return 0;
  if (n_ints > DSP_MAX_ATTR_INTS)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "%s: %zu int attributes, at most %d", name, n_ints,
                  DSP_MAX_ATTR_INTS);
  return sv_why(why, len, DISPATCH_EINVAL,
                "%s: %zu float attributes, at most %d", name, n_floats,
                DSP_MAX_ATTR_FLOATS);
}

/* ------------------------------------------------------------ requests */

int sv_exec_upload(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Upload *u = j->req->upload;
  if (j->pre_err < 0)
    return sv_why(why, len, j->pre_err, "%s",
                  j->pre_msg ? j->pre_msg : dispatch_strerror(j->pre_err));
  int rc = sv_check_free_id(s, u->id, why, len);
  if (rc < 0) return rc;
  /* the bytes came straight from the socket into the backend's staging
   * memory: as dsp_tensor_from_data does for a local caller, refuse a bool
   * byte other than 0 or 1 there, before the backend takes them. (A job
   * made in process may carry a tensor already filled through its backend,
   * with no staging: dsp_tensor_from_data checked its bytes.) */
  if (j->upload_stage.t) {
    if (j->upload->meta.dtype == DSP_BOOL &&
        (rc = dsp_check_bool_bytes(s->ctx, j->upload_stage.host,
                                   j->upload_stage.nbytes)) < 0)
      return sv_why(why, len, rc, "upload: %s", dsp_ctx_errmsg(s->ctx));
    rc = dsp_stage_commit(s->ctx, &j->upload_stage);
    dsp_stage_release(&j->upload_stage);
    if (rc < 0)
      return sv_why(why, len, rc, "upload: %s", dsp_ctx_errmsg(s->ctx));
  }
  dsp_tensor *t = j->upload; /* charged to the session since it was read */
  j->upload = NULL;
  return sv_insert(s, u->id, t, why, len);
}

/* One op as an Op request or an Ops record carries it. */
typedef struct op_args {
  int op;
  const uint64_t *in;
  int n_in;
  uint64_t out;
  const dsp_attrs *a;
  int no_grad;
  const char *device; /* NULL or "": the inputs' (or the session's) */
  /* asked once the op is checked and its cost known, before it runs
   * (sv_job.gate); NULL: it runs */
  int (*gate)(void *ud, sv_session *s, dsp_tensor *const *in, int n_in,
              uint64_t cost);
  void *gate_ud;
} op_args;

/* run_op's answer when the gate kept the op from running here */
#define OP_LATER 1

static int run_op(sv_session *s, const op_args *o, char *why, size_t len) {
  const dsp_op_info *info = dsp_op_lookup(o->op);
  if (!info) /* the loop refuses these; kept for direct callers */
    return sv_why(why, len, DISPATCH_EUNSUPPORTED, "unknown op code %d", o->op);
  if (info->family == DSP_FAM_OPTIM) /* an output id would alias the param */
    return sv_why(why, len, DISPATCH_EINVAL,
                  "%s updates its parameter in place: send it as a Step",
                  info->name);
  dsp_tensor *in[DSP_MAX_INPUTS];
  dsp_meta metas[DSP_MAX_INPUTS];
  int rc;
  for (int i = 0; i < o->n_in; i++) {
    rc = sv_get_tensor(s, o->in[i],
                       (sv_label){SV_LBL_INPUT, info->name, (size_t)i, 0}, why,
                       len, &in[i]);
    if (rc < 0) return rc;
    metas[i] = in[i]->meta;
  }
  rc = sv_check_free_id(s, o->out, why, len);
  if (rc < 0) return rc;
  dsp_meta om;
  rc = dsp_op_infer(s->ctx, (dsp_opcode)o->op, metas, o->n_in, o->a, &om);
  if (rc < 0) return why_ctx(s, why, len, rc);
  rc = check_new_meta(s, &om, why, len);
  if (rc < 0) return rc;
  uint64_t cost = dsp_op_cost((dsp_opcode)o->op, metas, o->n_in, o->a, &om);
  if (o->gate && !o->gate(o->gate_ud, s, in, o->n_in, cost)) return OP_LATER;
  s->turn_cost += cost;
  /* a creation op may name its device; an op on inputs runs on theirs */
  if (o->device && *o->device) {
    const sv_device *d = sv_device_find(s->global, o->device);
    char names[256], w[4 * SV_LOG_STR_MAX + 8];
    sv_log_str(w, sizeof w, o->device, SV_LOG_STR_MAX);
    if (o->n_in > 0)
      return sv_why(why, len, DISPATCH_EINVAL,
                    "%s: device \"%s\" given for an op with inputs (it runs "
                    "on its inputs' device)",
                    info->name, w);
    if (!d) {
      sv_device_names(s->global, names, sizeof names);
      return sv_why(why, len, DISPATCH_EDEVICE,
                    "%s: this server has no device \"%s\" (it has %s)",
                    info->name, w, names[0] ? names : "only its default CPU");
    }
    const dsp_backend *be;
    if ((rc = sv_session_backend(s, d, &be, why, len)) < 0) return rc;
    dsp_ctx_set_backend(s->ctx, be);
  }
  dsp_tensor *out;
  int grad = dsp_set_grad_enabled(s->ctx, !o->no_grad);
  rc = dsp_op_inferred(s->ctx, (dsp_opcode)o->op, in, o->n_in, o->a, &om, cost,
                       &out);
  dsp_set_grad_enabled(s->ctx, grad);
  dsp_ctx_set_backend(s->ctx, s->device);
  if (rc < 0) return why_run(s, why, len, rc);
  s->n_ops++;
  sv_tally_op(&s->tally, o->op);
  return sv_insert(s, o->out, out, why, len);
}

int sv_exec_op(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Op *o = j->req->op;
  const dsp_op_info *info = dsp_op_lookup(o->op);
  const char *name = info ? info->name : "op";
  if (o->n_inputs > DSP_MAX_INPUTS)
    return sv_why(why, len, DISPATCH_EINVAL, "%s: %zu inputs, at most %d", name,
                  o->n_inputs, DSP_MAX_INPUTS);
  dsp_attrs a;
  int rc = attrs_from(name, o->n_ints, o->ints, o->n_floats, o->floats, &a, why,
                      len);
  if (rc < 0) return rc;
  op_args args = {o->op,     o->inputs, (int)o->n_inputs,
                  o->output, &a,        o->no_grad,
                  o->device, NULL,      NULL};
  return run_op(s, &args, why, len);
}

/* A copy of a tensor on another device of this server (or the same one),
 * made inside the server; charged to the session and the target device. */
int sv_exec_to_device(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__ToDevice *m = j->req->to_device;
  dsp_tensor *t;
  int rc = sv_get_tensor(s, m->id, SV_LABEL("to_device"), why, len, &t);
  if (rc < 0) return rc;
  rc = sv_check_free_id(s, m->output, why, len);
  if (rc < 0) return rc;
  const sv_device *d = sv_device_find(s->global, m->device);
  if (!d) {
    char names[256], dev[4 * SV_LOG_STR_MAX + 8];
    sv_device_names(s->global, names, sizeof names);
    return sv_why(why, len, DISPATCH_EDEVICE,
                  "to_device: this server has no device \"%s\" (it has %s)",
                  sv_log_str(dev, sizeof dev, m->device, SV_LOG_STR_MAX),
                  names[0] ? names : "only its default CPU");
  }
  const dsp_backend *be;
  if ((rc = sv_session_backend(s, d, &be, why, len)) < 0) return rc;
  dsp_tensor *out;
  rc = dsp_tensor_to_backend(s->ctx, t, be, &out);
  if (rc < 0) return why_run(s, why, len, rc);
  return sv_insert(s, m->output, out, why, len);
}

int sv_exec_track(sv_session *s, sv_job *j, char *why, size_t len) {
  dsp_tensor *t;
  int rc = sv_get_tensor(s, j->req->track->id, SV_LABEL("track"), why, len, &t);
  if (rc < 0) return rc;
  rc = dsp_track(s->ctx, t);
  return rc < 0 ? why_ctx(s, why, len, rc) : 0;
}

static int backward(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Backward *b = j->req->backward;
  dsp_tensor *loss;
  int rc =
      sv_get_tensor(s, b->loss, SV_LABEL("backward: loss"), why, len, &loss);
  if (rc < 0) return rc;
  if (sv_idmap_get(&s->grads, b->grads))
    return sv_why(why, len, DISPATCH_EIDINUSE,
                  "backward: gradients id %llu is already in use",
                  (unsigned long long)b->grads);
  rc = dsp_budget_charge(s->budget, s->ctx, SV_ID_COST,
                         "backward: gradients id");
  if (rc < 0) return why_ctx(s, why, len, rc);
  dsp_grads *g;
  rc = dsp_backward(s->ctx, loss, b->retain, &g);
  if (rc < 0) {
    dsp_budget_uncharge(s->budget, SV_ID_COST);
    return why_run(s, why, len, rc);
  }
  if (sv_idmap_put(&s->grads, b->grads, g) < 0) {
    dsp_grads_free(g);
    dsp_budget_uncharge(s->budget, SV_ID_COST);
    return sv_why(why, len, DISPATCH_ENOMEM, "out of memory adding gradients");
  }
  return 0;
}

static int empty_reply(sv_job *j, char *why, size_t len) {
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  return sv_job_reply(j, &r, NULL, why, len);
}

/* A Backward that waits is answered with an empty reply; one sent with
 * no_reply (1.3) that fails leaves its gradients id taken but failed
 * (sv_grads_failed), as the client believes it taken. */
int sv_exec_backward(sv_session *s, sv_job *j, char *why, size_t len) {
  int wait = sv_req_waits(j->req);
  int rc = backward(s, j, why, len);
  if (rc == 0 && wait) rc = empty_reply(j, why, len);
  if (rc < 0 && !wait) sv_grads_failed(s, j->req->backward->grads);
  return rc;
}

int sv_exec_grad(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Grad *gr = j->req->grad;
  dsp_grads *g;
  dsp_tensor *t, *gt;
  int rc = sv_get_grads(s, gr->grads, why, len, &g);
  if (rc < 0) return rc;
  rc = sv_get_tensor(s, gr->tensor, SV_LABEL("grad: tensor"), why, len, &t);
  if (rc < 0) return rc;
  rc = sv_check_free_id(s, gr->output, why, len);
  if (rc < 0) return rc;
  rc = dsp_grads_get(s->ctx, g, t, &gt);
  if (rc < 0) return why_ctx(s, why, len, rc);
  /* shares the container's gradient: only the id is new */
  return sv_insert(s, gr->output, gt, why, len);
}

/* Validates every id and shape of the step first, then updates the
 * parameters in place with grad mode off (an update is not a graph op). */
int sv_exec_step(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Step *st = j->req->step;
  size_t k = (size_t)dsp_step_states(st->op);
  if (!k)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "step: op %d is not sgd_step (%d), adam_step (%d) or "
                  "adamw_step (%d)",
                  st->op, DSP_OP_SGD_STEP, DSP_OP_ADAM_STEP,
                  DSP_OP_ADAMW_STEP);
  const char *name = dsp_op_lookup(st->op)->name;
  if (!(st->max_norm >= 0.0) || isinf(st->max_norm))
    return sv_why(why, len, DISPATCH_EINVAL,
                  "step %s: max_norm = %g is not finite and >= 0", name,
                  st->max_norm);
  if (st->n_weight_decay &&
      (st->op != DSP_OP_ADAMW_STEP || st->n_weight_decay != st->n_params))
    return sv_why(why, len, DISPATCH_EINVAL,
                  "step %s: %zu weight decays for %zu params (adamw_step "
                  "only, one per param)",
                  name, st->n_weight_decay, st->n_params);
  /* each parameter and state is a distinct live tensor in a real step, so
   * more parameters than tensors is refused before anything is allocated
   * for them (n_params comes from the network) */
  if (st->n_params > s->tensors.count)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "step %s: %zu params, but the session holds only %zu "
                  "tensors",
                  name, st->n_params, s->tensors.count);
  if (st->n_states != k * st->n_params)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "step %s: %zu params need %zu state ids, got %zu", name,
                  st->n_params, k * st->n_params, st->n_states);
  dsp_attrs base, a;
  int rc = attrs_from(name, st->n_ints, st->ints, st->n_floats, st->floats,
                      &base, why, len);
  if (rc < 0) return rc;
  int clip = st->max_norm > 0.0;
  const double *wd = st->n_weight_decay ? st->weight_decay : NULL;
  dsp_grads *g;
  rc = sv_get_grads(s, st->grads, why, len, &g);
  if (rc < 0) return rc;
  dsp_tensor *norm_t = NULL; /* where the norm goes (1.5), judged first */
  if (st->norm) {
    rc = sv_get_tensor(s, st->norm, SV_LABEL("step: norm"), why, len, &norm_t);
    if (rc < 0) return rc;
    if (norm_t->meta.dtype != DSP_F64 || norm_t->numel != 1)
      return sv_why(why, len, DISPATCH_EINVAL,
                    "step %s: the norm's tensor (id %llu) must be one f64",
                    name, (unsigned long long)st->norm);
  }
  /* the loss scale (1.7), judged with the norm's tensor */
  dsp_step_scaler sc = {NULL, NULL, st->loss_scale_growth,
                        st->loss_scale_backoff, st->loss_scale_interval};
  if (st->loss_scale) {
    rc = sv_get_tensor(s, st->loss_scale, SV_LABEL("step: loss scale"), why,
                       len, &sc.scale);
    if (rc == 0)
      rc = sv_get_tensor(s, st->loss_scale_counts,
                         SV_LABEL("step: loss scale counts"), why, len,
                         &sc.counts);
    if (rc == 0 && (rc = dsp_step_check_scaler(s->ctx, &sc)) < 0)
      rc = why_ctx(s, why, len, rc);
    if (rc < 0) return rc;
  }
  if (st->n_params == 0) return 0;
  dsp_tensor **args = dsp_calloc(st->n_params * (k + 2), sizeof *args);
  if (!args) return sv_why(why, len, DISPATCH_ENOMEM, "step: out of memory");
  size_t n_grads = 0;
  for (size_t i = 0; i < st->n_params && rc == 0; i++) {
    dsp_tensor **row = args + i * (k + 2);
    rc = sv_get_tensor(s, st->params[i], (sv_label){SV_LBL_PARAM, name, i, 0},
                       why, len, &row[0]);
    for (size_t q = 0; q < k && rc == 0; q++)
      rc = sv_get_tensor(s, st->states[i * k + q],
                         (sv_label){SV_LBL_STATE, name, i, q}, why, len,
                         &row[2 + q]);
    if (rc < 0) break;
    rc = dsp_grads_get(s->ctx, g, row[0], &row[1]);
    if (rc < 0) {
      rc = why_ctx(s, why, len, rc);
      break;
    }
    n_grads = i + 1;
    dsp_meta metas[4], om;
    for (size_t q = 0; q < k + 2; q++) metas[q] = row[q]->meta;
    /* checked with the factor it may get: a clip or a scaler gives every
     * op one more float, so the counts are judged here, before anything
     * changes */
    dsp_step_param_attrs(st->op, &base, wd, i, clip || sc.scale, 1.0, &a);
    rc = dsp_op_infer(s->ctx, (dsp_opcode)st->op, metas, (int)(k + 2), &a, &om);
    if (rc < 0) rc = why_ctx(s, why, len, rc);
  }
  /* 1.7 data-parallel: the gradients summed or averaged over the group
   * first, so every member steps with the same ones (group.c), and a loss
   * scaler decides on the reduced gradients alike on every member */
  if (rc == 0 && st->group)
    rc = sv_group_step_grads(s, args, st->n_params, k + 2, st, why, len);
  /* the norm over every gradient and the scaler's decision, before the
   * first parameter changes, in the LOCAL device's order */
  dsp_step_plan plan = {0};
  if (rc == 0) {
    dsp_tensor **gs = dsp_calloc(st->n_params, sizeof *gs);
    if (!gs) rc = sv_why(why, len, DISPATCH_ENOMEM, "step: out of memory");
    for (size_t i = 0; gs && i < st->n_params; i++) gs[i] = args[i * (k + 2) + 1];
    if (gs &&
        (rc = dsp_step_prepare(s->ctx, gs, st->n_params, st->max_norm, norm_t,
                               sc.scale ? &sc : NULL, &base, &plan)) < 0)
      rc = why_ctx(s, why, len, rc);
    dsp_free(gs);
  }
  if (rc == 0 && !plan.skip) {
    int prev = dsp_set_grad_enabled(s->ctx, 0);
    for (size_t i = 0; i < st->n_params && rc == 0; i++) {
      dsp_tensor *out;
      dsp_step_param_attrs(st->op, &base, wd, i, plan.extra, plan.factor, &a);
      rc = dsp_op(s->ctx, (dsp_opcode)st->op, args + i * (k + 2), (int)(k + 2),
                  &a, &out);
      if (rc < 0) {
        if (rc == DISPATCH_ELIMIT) sv_count_limit(s->global, op_limit(s));
        const char *m = dsp_ctx_errmsg(s->ctx);
        rc = sv_why(why, len, rc, "param %zu (id %llu): %s", i,
                    (unsigned long long)st->params[i], m);
      } else {
        dsp_tensor_unref(out);
        s->n_ops++; /* one per parameter, as the local device counts */
        sv_tally_op(&s->tally, st->op);
      }
    }
    dsp_set_grad_enabled(s->ctx, prev);
  }
  if (rc == 0 && sc.scale && (rc = dsp_step_finish(s->ctx, &sc, &plan)) < 0)
    rc = why_ctx(s, why, len, rc);
  for (size_t i = 0; i < n_grads; i++) dsp_tensor_unref(args[i * (k + 2) + 1]);
  dsp_free(args);
  return rc;
}

/* Frees every id it can; the first unknown id is reported after the rest
 * were freed. */
int sv_exec_free(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Free *f = j->req->free;
  int rc = 0;
  for (size_t i = 0; i < f->n_tensors; i++) {
    if (sv_tensor_drop(s, f->tensors[i]) == 0)
      sv_peer_revoke(s, f->tensors[i]); /* its grants die with it */
    else if (rc == 0)
      rc = sv_why(why, len, DISPATCH_ENOID,
                  "free: tensor id %llu does not exist",
                  (unsigned long long)f->tensors[i]);
  }
  for (size_t i = 0; i < f->n_grads; i++) {
    if (sv_grads_drop(s, f->grads[i]) < 0 && rc == 0)
      rc = sv_why(why, len, DISPATCH_ENOID,
                  "free: gradients id %llu does not exist",
                  (unsigned long long)f->grads[i]);
  }
  for (size_t i = 0; i < f->n_graphs; i++)
    if (sv_graph_free_id(s, f->graphs[i]) < 0 && rc == 0)
      rc =
          sv_why(why, len, DISPATCH_ENOID, "free: graph id %llu does not exist",
                 (unsigned long long)f->graphs[i]);
  return rc;
}

int sv_exec_read(sv_session *s, sv_job *j, char *why, size_t len) {
  dsp_tensor *t;
  int rc = sv_get_tensor(s, j->req->read->id, SV_LABEL("read"), why, len, &t);
  if (rc < 0) return rc;
  char what[48];
  snprintf(what, sizeof what, "read %llu",
           (unsigned long long)j->req->read->id);
  if ((rc = sv_dtype_for_client(s, t->meta.dtype, what, why, len)) < 0)
    return rc;
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__ReadReply rr = DSPWIRE__READ_REPLY__INIT;
  Dspwire__TensorMeta m;
  sv_wire_meta(&m, &t->meta);
  rr.meta = &m;
  r.req_id = j->req->req_id;
  r.body_case = DSPWIRE__REPLY__BODY_READ;
  r.read = &rr;
  rc = sv_encode_read_reply(s->ctx, &r, t, j);
  if (rc < 0) return sv_why(why, len, rc, "read: out of memory for the reply");
  return 0;
}

int sv_exec_stats(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__StatsReply st = DSPWIRE__STATS_REPLY__INIT;
  sv_global *g = s->global;
  st.tensors = s->n_live;
  st.bytes = (uint64_t)atomic_load(&s->bytes);
  /* what the session's free lists keep is charged to it but not held
   * for it: any charge that needs the room gets it back */
  dsp_cache_stats cs;
  dsp_budget_cache_stats(s->budget, &cs);
  uint64_t used = dsp_budget_used(s->budget);
  st.held_bytes = used > cs.bytes ? used - cs.bytes : 0;
  st.queued_bytes = dsp_budget_used(s->queue);
  st.session_limit = dsp_budget_limit(s->budget);
  st.server_held_bytes = dsp_budget_used(g->mem);
  st.server_limit = g->mem ? dsp_budget_limit(g->mem) : 0;
  st.ops = s->n_ops;
  st.errors = s->n_errors;
  st.batches = s->n_batches;
  st.inline_ops = s->n_inline;
  st.handoffs = s->n_handoffs;
  st.returns = s->n_returns;
  st.grads = s->grads.count;
  st.sessions = (uint64_t)atomic_load(&g->sessions);
  st.server_tensors = (uint64_t)atomic_load(&g->tensors);
  st.server_bytes = (uint64_t)atomic_load(&g->bytes);
  st.protocol_errors = (uint64_t)atomic_load(&g->protocol_errors);
  st.limit_violations = (uint64_t)atomic_load(&g->limit_violations);
  st.sessions_detached = (uint64_t)atomic_load(&g->sessions_detached);
  st.sessions_resumed = (uint64_t)atomic_load(&g->sessions_resumed);
  st.sessions_expired = (uint64_t)atomic_load(&g->sessions_expired);
  Dspwire__DeviceInfo infos[SV_MAX_DEVICES], *ip[SV_MAX_DEVICES];
  st.n_devices = sv_device_infos(g, infos, ip);
  st.devices = ip;
  r.body_case = DSPWIRE__REPLY__BODY_STATS;
  r.stats = &st;
  return sv_job_reply(j, &r, "stats", why, len);
}

/* A Sync only waits for what came before it: an empty reply. */
int sv_exec_sync(sv_session *s, sv_job *j, char *why, size_t len) {
  return empty_reply(j, why, len);
}

/* A Bye: the loop closes the connection once its replies are written. */
int sv_exec_bye(sv_session *s, sv_job *j, char *why, size_t len) {
  j->is_bye = 1;
  return 0;
}

/* The records of an Ops request from j->ops_at on, each as the Op whose
 * req_id is its output id (decode.c checked their layout and op codes). A
 * record's failure is its own, as an Op's would be: the rest still run.
 * With j->gate set (the loop running them inline) the run stops at the
 * first record the gate refuses, j->ops_at marking it: that record has
 * changed nothing and runs again in full where the rest runs. Failures
 * are the records' own (deferred, each poisoning its output): the request
 * itself returns 0, and why is only the records' scratch. */
int sv_exec_ops(sv_session *s, sv_job *j, char *why, size_t len) {
  const ProtobufCBinaryData *recs = &j->req->ops->records;
  const uint8_t *p = recs->data + j->ops_at, *end = recs->data + recs->len;
  while (p < end) {
    const uint8_t *at = p;
    dsp_oprec r;
    if (dsp_oprec_next(&p, end, &r, why, len) < 0) break; /* checked */
    uint64_t in[DSP_MAX_INPUTS];
    for (int i = 0; i < r.n_in; i++) in[i] = dsp_oprec_in(&r, i);
    dsp_attrs a;
    op_args args = {
        r.op,      in,   r.n_in,  r.out,     dsp_oprec_attrs(&r, &a),
        r.no_grad, NULL, j->gate, j->gate_ud};
    why[0] = '\0';
    dsp_clearerr(s->ctx);
    int rc = run_op(s, &args, why, len);
    if (rc == OP_LATER) {
      p = at;
      break;
    }
    if (rc < 0) {
      char desc[256];
      sv_describe_record(&r, desc, sizeof desc);
      sv_fail_deferred(s, rc, 0, r.out, desc, why, 1, r.out);
    }
  }
  j->ops_at = (size_t)(p - recs->data);
  return 0;
}
