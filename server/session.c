/* Session execution on a worker thread: every request's ids, counts,
 * attributes and sizes are checked before a kernel runs; failures of
 * no-reply requests poison their outputs and become the session's deferred
 * error, reported by the next waiting request. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
/* glibc's malloc_trim, except under AddressSanitizer: its allocator
 * replaces malloc but not malloc_trim, which then walks glibc arenas that
 * were never set up (a SEGV in mtrim, seen at session teardown) */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SV_NO_MALLOC_TRIM 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SV_NO_MALLOC_TRIM 1
#endif
#if defined(__GLIBC__) && !defined(SV_NO_MALLOC_TRIM)
#include <malloc.h>
#define SV_MALLOC_TRIM 1
#endif

#include "op_record.h"
#include "sv.h"

#define WHY_LEN 512

/* What an id costs beside its tensor: the entry and its share of the id
 * map (two 16-byte slots at the map's lowest load). */
#define ID_COST (DSP_BUDGET_COST(sizeof(sv_entry)) + 32)

/* Everything the session's requests allocate is charged to its budget
 * (inside the server's, when there is one): the ctx carries it to every
 * tensor, node, gradient container and kernel scratch block. Decoded
 * requests are charged to the session's queue budget, also inside the
 * server's. */
sv_session *sv_session_new(const sv_config *cfg, sv_global *g, void *owner) {
  sv_session *s = dsp_calloc(1, sizeof *s);
  if (!s) return NULL;
  s->ctx = dsp_ctx_new(dsp_cpu_backend());
  s->budget = dsp_budget_new(cfg->max_session_bytes, g->mem, "session",
                             "--max-session-bytes");
  s->queue = dsp_budget_new(cfg->max_queued_bytes, g->mem, "session queue",
                            "--max-queued-bytes");
  if (!s->ctx || !s->budget || !s->queue) {
    dsp_ctx_free(s->ctx);
    dsp_budget_unref(s->budget);
    dsp_budget_unref(s->queue);
    dsp_free(s);
    return NULL;
  }
  /* the session's free lists: charged to it, so they count toward its
   * quota and the server's, which get them back before refusing */
  if (dsp_budget_set_cache(s->budget, cfg->session_cache) < 0) {
    dsp_ctx_free(s->ctx);
    dsp_budget_unref(s->budget);
    dsp_budget_unref(s->queue);
    dsp_free(s);
    return NULL;
  }
  dsp_ctx_set_budget(s->ctx, s->budget);
  s->cfg = cfg;
  s->global = g;
  for (int i = 0; i < SV_MAX_DEVICES; i++) atomic_init(&s->views[i], NULL);
  /* the first device until the hello picks the session's own
   * (sv_session_use_device: a GPU session gets its stream only then, so
   * a connection that never authenticates costs the GPU nothing) */
  s->device = g->devices && g->n_devices ? g->devices[0].be
                                         : dsp_cpu_backend();
  dsp_ctx_set_backend(s->ctx, s->device);
  sv_pb_charge_init(&s->pb, s->queue);
  /* also bounds what the session cannot name: backward intermediates */
  dsp_ctx_set_max_elements(s->ctx, (int64_t)cfg->max_elements);
  dsp_ctx_set_max_op_cost(s->ctx, cfg->max_op_cost);
  sv_idmap_init(&s->tensors);
  sv_idmap_init(&s->grads);
  atomic_init(&s->bytes, 0);
  atomic_init(&s->queued_bytes, 0);
  s->owner = owner;
  return s;
}

static int why_set(char *why, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int why_set(char *why, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, WHY_LEN, fmt, ap);
  va_end(ap);
  return code;
}

/* Copies the ctx's detail of a failed core call. */
static int why_ctx(sv_session *s, char *why, int code) {
  const char *m = dsp_ctx_errmsg(s->ctx);
  return why_set(why, code, "%s", m && *m ? m : dispatch_strerror(code));
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
static int why_run(sv_session *s, char *why, int code) {
  if (code == DISPATCH_ELIMIT) sv_count_limit(s->global, op_limit(s));
  return why_ctx(s, why, code);
}

/* Entries are charged without a budget reference of their own
 * (dsp_budget_charge_held): the session's reference outlives them all. A
 * freed entry is kept as a spare (up to SV_SPARE_ENTRIES, as many as the
 * client frees in one message), still charged its ID_COST, for the next
 * insert: a chain of small ops makes and frees one entry per op, and two
 * budget updates and a malloc/free pair each time were a visible share of
 * the server's time. */
static void entry_free(sv_session *s, sv_entry *e) {
  if (e->t) {
    long long nb = (long long)dsp_tensor_nbytes(e->t);
    sv_tally_tensor(&s->tally, s->global, e->t, nb, -1);
    s->n_live--;
    dsp_tensor_unref(e->t);
  }
  dsp_free(e->poison);
  if (s->n_spare < SV_SPARE_ENTRIES) {
    if (e->charged > ID_COST)
      dsp_budget_uncharge_part(s->budget, e->charged - ID_COST);
    memset(e, 0, sizeof *e);
    s->spare[s->n_spare++] = e;
    return;
  }
  dsp_budget_uncharge_part(s->budget, e->charged);
  dsp_free(e);
}

/* The spares go (teardown). */
static void spares_free(sv_session *s) {
  while (s->n_spare > 0) {
    dsp_free(s->spare[--s->n_spare]);
    dsp_budget_uncharge_part(s->budget, ID_COST);
  }
}

/* Inserts t under a free id, taking the caller's reference (dropped on
 * failure). */
static int insert(sv_session *s, uint64_t id, dsp_tensor *t, char *why) {
  sv_entry *e = s->n_spare > 0 ? s->spare[--s->n_spare] : NULL;
  if (!e) {
    /* the budget formats its refusal only when it refuses (": session
     * holds ..." with an empty label), so the id is put in front then,
     * not formatted into a label for every insert */
    char refused[WHY_LEN];
    int rc = dsp_budget_charge_held(s->budget, ID_COST, "", refused,
                                    sizeof refused);
    if (rc < 0) {
      dsp_tensor_unref(t);
      return why_set(why, rc, "id %llu%s", (unsigned long long)id, refused);
    }
    e = dsp_calloc(1, sizeof *e);
  }
  if (!e || sv_idmap_put(&s->tensors, id, e) < 0) {
    dsp_free(e);
    dsp_tensor_unref(t);
    dsp_budget_uncharge_part(s->budget, ID_COST);
    return why_set(why, DISPATCH_ENOMEM, "out of memory adding id %llu",
                   (unsigned long long)id);
  }
  e->charged = ID_COST;
  e->t = t;
  long long nb = (long long)dsp_tensor_nbytes(t);
  sv_tally_tensor(&s->tally, s->global, t, nb, 1);
  s->n_live++;
  return 0;
}

/* Marks a free id as poisoned by the failure `msg`; an id that is live is
 * left alone (its request failed because it was in use). Out of memory or
 * of budget leaves the id unknown, which later fails with DISPATCH_ENOID
 * instead (the session's deferred error still names the failure). */
static void poison(sv_session *s, uint64_t id, int code, const char *msg) {
  if (sv_idmap_get(&s->tensors, id)) return;
  uint64_t cost = ID_COST + DSP_BUDGET_COST(strlen(msg) + 1);
  if (dsp_budget_charge_held(s->budget, cost, NULL, NULL, 0) < 0) return;
  sv_entry *e = dsp_calloc(1, sizeof *e);
  if (e) {
    e->poison_code = code;
    e->poison = dsp_strdup(msg);
    e->charged = cost;
  }
  if (!e || !e->poison || sv_idmap_put(&s->tensors, id, e) < 0) {
    if (e) dsp_free(e->poison);
    dsp_free(e);
    dsp_budget_uncharge_part(s->budget, cost);
  }
}

/* What names an id in an error message ("add: input 1", "step sgd: state
 * 0 of param 2"): kept as its parts and formatted by label_text only when
 * the lookup fails, so a successful op formats nothing (formatting a label
 * for every input of every op was ~4% of the server's time on a chain of
 * small ops). */
typedef enum { LBL_PLAIN, LBL_INPUT, LBL_PARAM, LBL_STATE } label_kind;
typedef struct label {
  label_kind kind;
  const char *name; /* the whole label (LBL_PLAIN), or the op's name */
  size_t i, q;      /* input or param index; state index */
} label;
#define LABEL(text) ((label){LBL_PLAIN, (text), 0, 0})

static const char *label_text(const label *l, char *buf, size_t len) {
  switch (l->kind) {
    case LBL_INPUT: snprintf(buf, len, "%s: input %zu", l->name, l->i); break;
    case LBL_PARAM:
      snprintf(buf, len, "step %s: param %zu", l->name, l->i);
      break;
    case LBL_STATE:
      snprintf(buf, len, "step %s: state %zu of param %zu", l->name, l->q,
               l->i);
      break;
    default: return l->name;
  }
  return buf;
}

static int get_tensor(sv_session *s, uint64_t id, label what, char *why,
                      dsp_tensor **t) {
  sv_entry *e = sv_idmap_get(&s->tensors, id);
  if (e && e->t) {
    *t = e->t;
    return 0;
  }
  char buf[96];
  const char *w = label_text(&what, buf, sizeof buf);
  if (!e)
    return why_set(why, DISPATCH_ENOID, "%s id %llu does not exist", w,
                   (unsigned long long)id);
  return why_set(why, DISPATCH_EPOISONED, "%s id %llu is poisoned by %s", w,
                 (unsigned long long)id, e->poison ? e->poison : "?");
}

static int check_free_id(sv_session *s, uint64_t id, char *why) {
  if (sv_idmap_get(&s->tensors, id))
    return why_set(why, DISPATCH_EIDINUSE, "output id %llu is already in use",
                   (unsigned long long)id);
  return 0;
}

int sv_check_meta(const sv_config *cfg, sv_global *g, dsp_ctx *ctx,
                  const dsp_meta *m, const char *what, int64_t *numel,
                  char *msg, size_t len) {
  int64_t span;
  int rc = dsp_meta_span(ctx, m, numel, &span);
  if (rc < 0) {
    snprintf(msg, len, "%s: %s", what, dsp_ctx_errmsg(ctx));
    return rc;
  }
  if ((uint64_t)span <= cfg->max_elements) return 0;
  sv_count_limit(g, SV_LIM_MAX_ELEMENTS);
  char shape[160];
  dsp_shape_str(m, shape, sizeof shape);
  if (*numel == span)
    snprintf(msg, len, "%s: shape %s has %lld elements, over the limit of %llu",
             what, shape, (long long)span,
             (unsigned long long)cfg->max_elements);
  else
    snprintf(msg, len,
             "%s: shape %s has %lld elements but spans %lld (the product of "
             "its sizes, zero sizes counted as 1), over the limit of %llu",
             what, shape, (long long)*numel, (long long)span,
             (unsigned long long)cfg->max_elements);
  return DISPATCH_ELIMIT;
}

/* Element limit for a tensor of meta m about to be made. The bytes are
 * judged where they are allocated (the session budget): the output, what
 * the kernel needs on the side and what autodiff saves alike. */
static int check_new_meta(sv_session *s, const dsp_meta *m, char *why) {
  int64_t numel;
  return sv_check_meta(s->cfg, s->global, s->ctx, m, "result", &numel, why,
                       WHY_LEN);
}

static int attrs_from(const char *name, size_t n_ints, const int64_t *ints,
                      size_t n_floats, const double *floats, dsp_attrs *a,
                      char *why) {
  if (n_ints > DSP_MAX_ATTR_INTS)
    return why_set(why, DISPATCH_EINVAL, "%s: %zu int attributes, at most %d",
                   name, n_ints, DSP_MAX_ATTR_INTS);
  if (n_floats > DSP_MAX_ATTR_FLOATS)
    return why_set(why, DISPATCH_EINVAL,
                   "%s: %zu float attributes, at most %d", name, n_floats,
                   DSP_MAX_ATTR_FLOATS);
  *a = dsp_attrs_none();
  a->n_ints = (int)n_ints;
  for (size_t i = 0; i < n_ints; i++) a->ints[i] = ints[i];
  a->n_floats = (int)n_floats;
  for (size_t i = 0; i < n_floats; i++) a->floats[i] = floats[i];
  return 0;
}

/* ------------------------------------------------------------ requests */

static int do_upload(sv_session *s, sv_job *j, char *why) {
  Dspwire__Upload *u = j->req->upload;
  if (j->pre_err < 0)
    return why_set(why, j->pre_err, "%s",
                   j->pre_msg ? j->pre_msg : dispatch_strerror(j->pre_err));
  int rc = check_free_id(s, u->id, why);
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
      return why_set(why, rc, "upload: %s", dsp_ctx_errmsg(s->ctx));
    rc = dsp_stage_commit(s->ctx, &j->upload_stage);
    dsp_stage_release(&j->upload_stage);
    if (rc < 0)
      return why_set(why, rc, "upload: %s", dsp_ctx_errmsg(s->ctx));
  }
  dsp_tensor *t = j->upload; /* charged to the session since it was read */
  j->upload = NULL;
  return insert(s, u->id, t, why);
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

static int run_op(sv_session *s, const op_args *o, char *why) {
  const dsp_op_info *info = dsp_op_lookup(o->op);
  if (!info) /* the loop refuses these; kept for direct callers */
    return why_set(why, DISPATCH_EUNSUPPORTED, "unknown op code %d", o->op);
  if (info->family == DSP_FAM_OPTIM) /* an output id would alias the param */
    return why_set(why, DISPATCH_EINVAL,
                   "%s updates its parameter in place: send it as a Step",
                   info->name);
  dsp_tensor *in[DSP_MAX_INPUTS];
  dsp_meta metas[DSP_MAX_INPUTS];
  int rc;
  for (int i = 0; i < o->n_in; i++) {
    rc = get_tensor(s, o->in[i], (label){LBL_INPUT, info->name, (size_t)i, 0},
                    why, &in[i]);
    if (rc < 0) return rc;
    metas[i] = in[i]->meta;
  }
  rc = check_free_id(s, o->out, why);
  if (rc < 0) return rc;
  dsp_meta om;
  rc = dsp_op_infer(s->ctx, (dsp_opcode)o->op, metas, o->n_in, o->a, &om);
  if (rc < 0) return why_ctx(s, why, rc);
  rc = check_new_meta(s, &om, why);
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
      return why_set(why, DISPATCH_EINVAL,
                     "%s: device \"%s\" given for an op with inputs (it runs "
                     "on its inputs' device)", info->name, w);
    if (!d) {
      sv_device_names(s->global, names, sizeof names);
      return why_set(why, DISPATCH_EDEVICE,
                     "%s: this server has no device \"%s\" (it has %s)",
                     info->name, w, names[0] ? names : "only its default CPU");
    }
    const dsp_backend *be;
    if ((rc = sv_session_backend(s, d, &be, why, WHY_LEN)) < 0) return rc;
    dsp_ctx_set_backend(s->ctx, be);
  }
  dsp_tensor *out;
  int grad = dsp_set_grad_enabled(s->ctx, !o->no_grad);
  rc = dsp_op_inferred(s->ctx, (dsp_opcode)o->op, in, o->n_in, o->a, &om,
                       cost, &out);
  dsp_set_grad_enabled(s->ctx, grad);
  dsp_ctx_set_backend(s->ctx, s->device);
  if (rc < 0) return why_run(s, why, rc);
  s->n_ops++;
  sv_tally_op(&s->tally, o->op);
  return insert(s, o->out, out, why);
}

static int do_op(sv_session *s, sv_job *j, char *why) {
  Dspwire__Op *o = j->req->op;
  const dsp_op_info *info = dsp_op_lookup(o->op);
  const char *name = info ? info->name : "op";
  if (o->n_inputs > DSP_MAX_INPUTS)
    return why_set(why, DISPATCH_EINVAL, "%s: %zu inputs, at most %d", name,
                   o->n_inputs, DSP_MAX_INPUTS);
  dsp_attrs a;
  int rc = attrs_from(name, o->n_ints, o->ints, o->n_floats, o->floats, &a,
                      why);
  if (rc < 0) return rc;
  op_args args = {o->op, o->inputs,  (int)o->n_inputs, o->output,
                  &a,    o->no_grad, o->device,         NULL,
                  NULL};
  return run_op(s, &args, why);
}

/* A copy of a tensor on another device of this server (or the same one),
 * made inside the server; charged to the session and the target device. */
static int do_to_device(sv_session *s, sv_job *j, char *why) {
  Dspwire__ToDevice *m = j->req->to_device;
  dsp_tensor *t;
  int rc = get_tensor(s, m->id, LABEL("to_device"), why, &t);
  if (rc < 0) return rc;
  rc = check_free_id(s, m->output, why);
  if (rc < 0) return rc;
  const sv_device *d = sv_device_find(s->global, m->device);
  if (!d) {
    char names[256], dev[4 * SV_LOG_STR_MAX + 8];
    sv_device_names(s->global, names, sizeof names);
    return why_set(why, DISPATCH_EDEVICE,
                   "to_device: this server has no device \"%s\" (it has %s)",
                   sv_log_str(dev, sizeof dev, m->device, SV_LOG_STR_MAX),
                   names[0] ? names : "only its default CPU");
  }
  const dsp_backend *be;
  if ((rc = sv_session_backend(s, d, &be, why, WHY_LEN)) < 0) return rc;
  dsp_tensor *out;
  rc = dsp_tensor_to_backend(s->ctx, t, be, &out);
  if (rc < 0) return why_run(s, why, rc);
  return insert(s, m->output, out, why);
}

static int do_track(sv_session *s, sv_job *j, char *why) {
  dsp_tensor *t;
  int rc = get_tensor(s, j->req->track->id, LABEL("track"), why, &t);
  if (rc < 0) return rc;
  rc = dsp_track(s->ctx, t);
  return rc < 0 ? why_ctx(s, why, rc) : 0;
}

static int do_backward(sv_session *s, sv_job *j, char *why) {
  Dspwire__Backward *b = j->req->backward;
  dsp_tensor *loss;
  int rc = get_tensor(s, b->loss, LABEL("backward: loss"), why, &loss);
  if (rc < 0) return rc;
  if (sv_idmap_get(&s->grads, b->grads))
    return why_set(why, DISPATCH_EIDINUSE,
                   "backward: gradients id %llu is already in use",
                   (unsigned long long)b->grads);
  rc = dsp_budget_charge(s->budget, s->ctx, ID_COST, "backward: gradients id");
  if (rc < 0) return why_ctx(s, why, rc);
  dsp_grads *g;
  rc = dsp_backward(s->ctx, loss, b->retain, &g);
  if (rc < 0) {
    dsp_budget_uncharge(s->budget, ID_COST);
    return why_run(s, why, rc);
  }
  if (sv_idmap_put(&s->grads, b->grads, g) < 0) {
    dsp_grads_free(g);
    dsp_budget_uncharge(s->budget, ID_COST);
    return why_set(why, DISPATCH_ENOMEM, "out of memory adding gradients");
  }
  return 0;
}

/* The value of a gradients id whose no-reply Backward failed (1.3): the
 * id is taken, as the client believes, but holds nothing. Never freed. */
static char g_failed_grads;
#define FAILED_GRADS ((dsp_grads *)(void *)&g_failed_grads)

/* A no-reply Backward failed: its id becomes a failed container, charged
 * like a real one, so a later Grad or Step on it fails with
 * DISPATCH_EPOISONED and the client's Free of it succeeds. Out of quota
 * or memory the id stays unknown (those fail with DISPATCH_ENOID). */
static void grads_failed(sv_session *s, uint64_t id) {
  if (sv_idmap_get(&s->grads, id) ||
      dsp_budget_charge(s->budget, NULL, ID_COST, NULL) < 0)
    return;
  if (sv_idmap_put(&s->grads, id, FAILED_GRADS) < 0)
    dsp_budget_uncharge(s->budget, ID_COST);
}

static void grads_free(dsp_grads *g) {
  if (g != FAILED_GRADS) dsp_grads_free(g);
}

static int get_grads(sv_session *s, uint64_t id, char *why, dsp_grads **g) {
  *g = sv_idmap_get(&s->grads, id);
  if (!*g)
    return why_set(why, DISPATCH_ENOID, "gradients id %llu does not exist",
                   (unsigned long long)id);
  if (*g == FAILED_GRADS)
    return why_set(why, DISPATCH_EPOISONED,
                   "gradients id %llu holds nothing: the backward that was "
                   "to make it failed",
                   (unsigned long long)id);
  return 0;
}

static int do_grad(sv_session *s, sv_job *j, char *why) {
  Dspwire__Grad *gr = j->req->grad;
  dsp_grads *g;
  dsp_tensor *t, *gt;
  int rc = get_grads(s, gr->grads, why, &g);
  if (rc < 0) return rc;
  rc = get_tensor(s, gr->tensor, LABEL("grad: tensor"), why, &t);
  if (rc < 0) return rc;
  rc = check_free_id(s, gr->output, why);
  if (rc < 0) return rc;
  rc = dsp_grads_get(s->ctx, g, t, &gt);
  if (rc < 0) return why_ctx(s, why, rc);
  /* shares the container's gradient: only the id is new */
  return insert(s, gr->output, gt, why);
}

/* Validates every id and shape of the step first, then updates the
 * parameters in place with grad mode off (an update is not a graph op). */
static int do_step(sv_session *s, sv_job *j, char *why) {
  Dspwire__Step *st = j->req->step;
  size_t k;
  if (st->op == DSP_OP_SGD_STEP) k = 1;
  else if (st->op == DSP_OP_ADAM_STEP) k = 2;
  else
    return why_set(why, DISPATCH_EINVAL,
                   "step: op %d is not sgd_step (%d) or adam_step (%d)",
                   st->op, DSP_OP_SGD_STEP, DSP_OP_ADAM_STEP);
  const char *name = dsp_op_lookup(st->op)->name;
  /* each parameter and state is a distinct live tensor in a real step, so
   * more parameters than tensors is refused before anything is allocated
   * for them (n_params comes from the network) */
  if (st->n_params > s->tensors.count)
    return why_set(why, DISPATCH_EINVAL,
                   "step %s: %zu params, but the session holds only %zu "
                   "tensors",
                   name, st->n_params, s->tensors.count);
  if (st->n_states != k * st->n_params)
    return why_set(why, DISPATCH_EINVAL,
                   "step %s: %zu params need %zu state ids, got %zu", name,
                   st->n_params, k * st->n_params, st->n_states);
  dsp_attrs a;
  int rc = attrs_from(name, st->n_ints, st->ints, st->n_floats, st->floats,
                      &a, why);
  if (rc < 0) return rc;
  dsp_grads *g;
  rc = get_grads(s, st->grads, why, &g);
  if (rc < 0) return rc;
  if (st->n_params == 0) return 0;
  dsp_tensor **args = dsp_calloc(st->n_params * (k + 2), sizeof *args);
  if (!args) return why_set(why, DISPATCH_ENOMEM, "step: out of memory");
  size_t n_grads = 0;
  for (size_t i = 0; i < st->n_params && rc == 0; i++) {
    dsp_tensor **row = args + i * (k + 2);
    rc = get_tensor(s, st->params[i], (label){LBL_PARAM, name, i, 0}, why,
                    &row[0]);
    for (size_t q = 0; q < k && rc == 0; q++)
      rc = get_tensor(s, st->states[i * k + q],
                      (label){LBL_STATE, name, i, q}, why, &row[2 + q]);
    if (rc < 0) break;
    rc = dsp_grads_get(s->ctx, g, row[0], &row[1]);
    if (rc < 0) {
      rc = why_ctx(s, why, rc);
      break;
    }
    n_grads = i + 1;
    dsp_meta metas[4], om;
    for (size_t q = 0; q < k + 2; q++) metas[q] = row[q]->meta;
    rc = dsp_op_infer(s->ctx, (dsp_opcode)st->op, metas, (int)(k + 2), &a,
                      &om);
    if (rc < 0) rc = why_ctx(s, why, rc);
  }
  if (rc == 0) {
    int prev = dsp_set_grad_enabled(s->ctx, 0);
    for (size_t i = 0; i < st->n_params && rc == 0; i++) {
      dsp_tensor *out;
      rc = dsp_op(s->ctx, (dsp_opcode)st->op, args + i * (k + 2),
                  (int)(k + 2), &a, &out);
      if (rc < 0) {
        if (rc == DISPATCH_ELIMIT) sv_count_limit(s->global, op_limit(s));
        const char *m = dsp_ctx_errmsg(s->ctx);
        rc = why_set(why, rc, "param %zu (id %llu): %s", i,
                     (unsigned long long)st->params[i], m);
      } else {
        dsp_tensor_unref(out);
        s->n_ops++; /* one per parameter, as the local device counts */
        sv_tally_op(&s->tally, st->op);
      }
    }
    dsp_set_grad_enabled(s->ctx, prev);
  }
  for (size_t i = 0; i < n_grads; i++) dsp_tensor_unref(args[i * (k + 2) + 1]);
  dsp_free(args);
  return rc;
}

/* Frees every id it can; the first unknown id is reported after the rest
 * were freed. */
static int do_free(sv_session *s, sv_job *j, char *why) {
  Dspwire__Free *f = j->req->free;
  int rc = 0;
  for (size_t i = 0; i < f->n_tensors; i++) {
    sv_entry *e = sv_idmap_del(&s->tensors, f->tensors[i]);
    if (e) entry_free(s, e);
    else if (rc == 0)
      rc = why_set(why, DISPATCH_ENOID, "free: tensor id %llu does not exist",
                   (unsigned long long)f->tensors[i]);
  }
  for (size_t i = 0; i < f->n_grads; i++) {
    dsp_grads *g = sv_idmap_del(&s->grads, f->grads[i]);
    if (g) {
      grads_free(g);
      dsp_budget_uncharge(s->budget, ID_COST);
    } else if (rc == 0)
      rc = why_set(why, DISPATCH_ENOID,
                   "free: gradients id %llu does not exist",
                   (unsigned long long)f->grads[i]);
  }
  for (size_t i = 0; i < f->n_graphs; i++)
    if (sv_graph_free_id(s, f->graphs[i]) < 0 && rc == 0)
      rc = why_set(why, DISPATCH_ENOID, "free: graph id %llu does not exist",
                   (unsigned long long)f->graphs[i]);
  return rc;
}

static int do_read(sv_session *s, sv_job *j, char *why) {
  dsp_tensor *t;
  int rc = get_tensor(s, j->req->read->id, LABEL("read"), why, &t);
  if (rc < 0) return rc;
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__ReadReply rr = DSPWIRE__READ_REPLY__INIT;
  Dspwire__TensorMeta m = DSPWIRE__TENSOR_META__INIT;
  m.dtype = (int32_t)t->meta.dtype;
  m.n_shape = (size_t)t->meta.ndim;
  m.shape = t->meta.shape;
  rr.meta = &m;
  r.req_id = j->req->req_id;
  r.body_case = DSPWIRE__REPLY__BODY_READ;
  r.read = &rr;
  rc = sv_encode_read_reply(s->ctx, &r, t, j);
  if (rc < 0) return why_set(why, rc, "read: out of memory for the reply");
  return 0;
}

static int do_stats(sv_session *s, sv_job *j, char *why) {
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
  r.req_id = j->req->req_id;
  r.body_case = DSPWIRE__REPLY__BODY_STATS;
  r.stats = &st;
  int rc = sv_encode_reply(&r, NULL, 0, &j->out, &j->out_len);
  if (rc < 0) return why_set(why, rc, "stats: out of memory for the reply");
  return 0;
}

static int empty_reply(sv_job *j, char *why) {
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  r.req_id = j->req->req_id;
  int rc = sv_encode_reply(&r, NULL, 0, &j->out, &j->out_len);
  if (rc < 0) return why_set(why, rc, "out of memory for the reply");
  return 0;
}

/* An error reply for a waiting request; a failure to allocate even that
 * leaves out NULL and the loop closes the connection (the client would
 * otherwise wait forever). */
static void error_reply(sv_job *j, int code, const char *msg,
                        uint64_t failed) {
  dsp_free(j->out);
  j->out = NULL;
  j->out_len = 0;
  dsp_pin_release(j->out_pin);
  j->out_pin = NULL;
  sv_encode_error(j->req->req_id, code, msg, failed, &j->out, &j->out_len);
}

void sv_session_cancel(sv_session *s) { dsp_ctx_cancel(s->ctx); }

/* The deferred-error bookkeeping shared by sv_session_exec and
 * sv_session_defer: a waiting request takes (and clears) the pending
 * error; a failure is labelled "request N (what): CODE: why" and becomes
 * the pending error unless one is already there. */
static void clear_deferred(sv_session *s) {
  s->err_code = 0;
  s->err_msg[0] = '\0';
  s->err_req = 0;
}

static void label_failure(char *m, size_t len, uint64_t req_id,
                          const char *what, int code, const char *why) {
  /* long reasons are cut to the message buffer on purpose */
  if (snprintf(m, len, "request %llu (%s): %s: %s", (unsigned long long)req_id,
               what, dispatch_err_name(code), why) < 0)
    m[0] = '\0';
  sv_log(SV_LOG_DEBUG, "session error: %s", m);
}

static void defer_error(sv_session *s, int code, uint64_t req_id,
                        const char *msg) {
  if (s->err_code) return;
  s->err_code = code;
  s->err_req = req_id;
  snprintf(s->err_msg, sizeof s->err_msg, "%s", msg);
}

/* The counters and log line of a failed request. */
static void count_failure(sv_session *s, int rc, int pre_err, uint64_t req_id,
                          const char *desc, const char *why) {
  s->n_errors++;
  sv_count_error(s->global, rc);
  /* budget refusals are counted here, where they surface; an upload's
   * was counted when it was read */
  if (rc == DISPATCH_EQUOTA && pre_err != DISPATCH_EQUOTA)
    sv_count_limit(s->global, SV_LIM_QUOTA);
  if (rc == DISPATCH_ECANCELED) /* nobody is left to read an error reply */
    sv_log_conn(SV_LOG_INFO, s->log_id, NULL,
                "request %llu (%s) cancelled: %s", (unsigned long long)req_id,
                desc, why);
}

/* A failed request without a reply (an Op, or one record of an Ops): its
 * output, if it has one, is poisoned and the failure becomes the
 * session's deferred error unless one is pending. */
static void fail_deferred(sv_session *s, int rc, int pre_err, uint64_t req_id,
                          const char *desc, const char *why, int has_out,
                          uint64_t out_id) {
  char msg[sizeof s->err_msg];
  count_failure(s, rc, pre_err, req_id, desc, why);
  label_failure(msg, sizeof msg, req_id, desc, rc, why);
  if (has_out) poison(s, out_id, rc, msg);
  defer_error(s, rc, req_id, msg);
}

/* The records of an Ops request from j->ops_at on, each as the Op whose
 * req_id is its output id (decode.c checked their layout and op codes). A
 * record's failure is its own, as an Op's would be: the rest still run.
 * With j->gate set (the loop running them inline) the run stops at the
 * first record the gate refuses, j->ops_at marking it: that record has
 * changed nothing and runs again in full where the rest runs. */
static void do_ops(sv_session *s, sv_job *j) {
  const ProtobufCBinaryData *recs = &j->req->ops->records;
  const uint8_t *p = recs->data + j->ops_at, *end = recs->data + recs->len;
  char why[WHY_LEN];
  while (p < end) {
    const uint8_t *at = p;
    dsp_oprec r;
    if (dsp_oprec_next(&p, end, &r, why, sizeof why) < 0) break; /* checked */
    uint64_t in[DSP_MAX_INPUTS];
    for (int i = 0; i < r.n_in; i++) in[i] = dsp_oprec_in(&r, i);
    dsp_attrs a;
    op_args args = {r.op,      in,   r.n_in,  r.out,     dsp_oprec_attrs(&r, &a),
                    r.no_grad, NULL, j->gate, j->gate_ud};
    why[0] = '\0';
    dsp_clearerr(s->ctx);
    int rc = run_op(s, &args, why);
    if (rc == OP_LATER) {
      p = at;
      break;
    }
    if (rc < 0) {
      char desc[256];
      sv_describe_record(&r, desc, sizeof desc);
      fail_deferred(s, rc, 0, r.out, desc, why, 1, r.out);
    }
  }
  j->ops_at = (size_t)(p - recs->data);
}

static void exec_job(sv_session *s, sv_job *j);

void sv_session_exec(sv_session *s, sv_job *j) {
  exec_job(s, j);
  sv_tally_flush(&s->tally, s->global, &s->bytes);
}

static void exec_job(sv_session *s, sv_job *j) {
  Dspwire__Request *r = j->req;
  char why[WHY_LEN];
  why[0] = '\0';
  dsp_clearerr(s->ctx);
  /* The request's bulk stops being queued here, whatever follows: run,
   * refused, or answered with an earlier deferred error without running
   * (a handler that took it off only when it ran left a GraphReplay's
   * bytes counted forever; the stream fuzzer found that). */
  uint64_t upload_bytes = j->upload_bytes;
  atomic_fetch_sub(&s->queued_bytes, (long long)upload_bytes);
  j->upload_bytes = 0;
  if (SV_LOG_ON(SV_LOG_DEBUG)) {
    char d[256];
    sv_describe(r, d, sizeof d);
    sv_log_conn(SV_LOG_DEBUG, s->log_id, NULL, "running request %llu (%s)",
                (unsigned long long)r->req_id, d);
  }
  int wait = sv_req_waits(r);
  if (wait && s->err_code) {
    error_reply(j, s->err_code, s->err_msg, s->err_req);
    clear_deferred(s);
    return;
  }
  int rc = 0;
  uint64_t out_id = 0;
  int has_out = 0;
  s->turn_cost += 1 + upload_bytes;
  if (r->body_case == DSPWIRE__REQUEST__BODY_BACKWARD ||
      r->body_case == DSPWIRE__REQUEST__BODY_STEP)
    s->turn_cost = SV_TURN_COST; /* many ops in one request: its own turn */
  switch (r->body_case) {
    case DSPWIRE__REQUEST__BODY_UPLOAD:
      rc = do_upload(s, j, why);
      out_id = r->upload->id;
      has_out = 1;
      break;
    case DSPWIRE__REQUEST__BODY_OP:
      rc = do_op(s, j, why);
      out_id = r->op->output;
      has_out = 1;
      break;
    case DSPWIRE__REQUEST__BODY_OPS: do_ops(s, j); break;
    case DSPWIRE__REQUEST__BODY_TO_DEVICE:
      rc = do_to_device(s, j, why);
      out_id = r->to_device->output;
      has_out = 1;
      break;
    case DSPWIRE__REQUEST__BODY_TRACK: rc = do_track(s, j, why); break;
    case DSPWIRE__REQUEST__BODY_BACKWARD:
      rc = do_backward(s, j, why);
      if (rc == 0 && wait) rc = empty_reply(j, why);
      if (rc < 0 && !wait) grads_failed(s, r->backward->grads);
      break;
    case DSPWIRE__REQUEST__BODY_GRAD:
      rc = do_grad(s, j, why);
      out_id = r->grad->output;
      has_out = 1;
      break;
    case DSPWIRE__REQUEST__BODY_STEP: rc = do_step(s, j, why); break;
    case DSPWIRE__REQUEST__BODY_FREE: rc = do_free(s, j, why); break;
    case DSPWIRE__REQUEST__BODY_READ: rc = do_read(s, j, why); break;
    case DSPWIRE__REQUEST__BODY_SYNC: rc = empty_reply(j, why); break;
    case DSPWIRE__REQUEST__BODY_STATS: rc = do_stats(s, j, why); break;
    case DSPWIRE__REQUEST__BODY_BYE: j->is_bye = 1; break;
    case DSPWIRE__REQUEST__BODY_GRAPH_DEFINE:
      rc = sv_graph_define(s, j, why, WHY_LEN);
      break;
    case DSPWIRE__REQUEST__BODY_GRAPH_REPLAY:
      rc = sv_graph_replay(s, j, why, WHY_LEN);
      break;
    default:
      rc = why_set(why, DISPATCH_EPROTO, "request has no body");
      break;
  }
  if (rc >= 0) return;
  char desc[256];
  sv_describe(r, desc, sizeof desc);
  if (wait) {
    char msg[sizeof s->err_msg];
    count_failure(s, rc, j->pre_err, r->req_id, desc, why);
    label_failure(msg, sizeof msg, r->req_id, desc, rc, why);
    error_reply(j, rc, msg, r->req_id);
    return;
  }
  fail_deferred(s, rc, j->pre_err, r->req_id, desc, why, has_out, out_id);
}

/* The same outcome sv_session_exec gives a failed request, for one that
 * failed before it could become a job: a waiting request is answered (with
 * an earlier deferred error first, as exec does), any other becomes the
 * deferred error unless one is pending. */
void sv_session_defer(sv_session *s, uint64_t req_id, int body, int code,
                      const char *msg, uint8_t **out, size_t *out_len) {
  const sv_req_kind *kind = sv_req_kind_of((Dspwire__Request__BodyCase)body);
  *out = NULL;
  *out_len = 0;
  if (code == DISPATCH_EQUOTA) sv_count_limit(s->global, SV_LIM_QUOTA);
  if (kind->waits && s->err_code) {
    sv_encode_error(req_id, s->err_code, s->err_msg, s->err_req, out,
                    out_len);
    clear_deferred(s);
    return;
  }
  s->n_errors++;
  sv_count_error(s->global, code);
  char m[sizeof s->err_msg];
  label_failure(m, sizeof m, req_id, kind->name, code, msg);
  if (kind->waits) {
    sv_encode_error(req_id, code, m, req_id, out, out_len);
    return;
  }
  defer_error(s, code, req_id, m);
}

void sv_session_teardown(sv_session *s) {
  sv_graph_teardown(s);
  for (size_t i = 0; i < s->grads.cap; i++)
    if (s->grads.vals[i]) {
      grads_free(s->grads.vals[i]);
      dsp_budget_uncharge(s->budget, ID_COST);
    }
  sv_idmap_clear(&s->grads);
  for (size_t i = 0; i < s->tensors.cap; i++)
    if (s->tensors.vals[i]) entry_free(s, s->tensors.vals[i]);
  sv_idmap_clear(&s->tensors);
  spares_free(s);
  sv_tally_flush(&s->tally, s->global, &s->bytes);
  dsp_ctx_free(s->ctx);
  s->ctx = NULL;
  /* the free lists go now (each kept block holds a reference on the
   * budget); what is freed later is freed at once */
  dsp_budget_set_cache(s->budget, 0);
  sv_session_backends_close(s);
  /* what the loop still holds for the session (a request being read, a
   * reply being written) keeps the budget alive until it is freed */
  dsp_budget_unref(s->budget);
  s->budget = NULL;
  dsp_budget_unref(s->queue);
  s->queue = NULL;
#ifdef SV_MALLOC_TRIM
  malloc_trim(0); /* hand the session's freed heap back to the system */
#endif
}
