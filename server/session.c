/* A session on the worker side: its lifecycle (new, teardown, cancel),
 * its id tables (tensors, poisoned ids, gradient containers), the
 * deferred errors of requests without a reply, and sv_session_exec, which
 * runs one request through its kind's handler (kinds.c, handlers.c):
 * failures of no-reply requests poison their outputs and become the
 * session's deferred error, reported by the next waiting request. */
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

#include "frame.h"
#include "handlers.h"

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
  s->peer_minor = DSP_PROTO_MINOR; /* until a hello says otherwise */
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

/* Entries are charged without a budget reference of their own
 * (dsp_budget_charge_held): the session's reference outlives them all. A
 * freed entry is kept as a spare (up to SV_SPARE_ENTRIES, as many as the
 * client frees in one message), still charged its SV_ID_COST, for the next
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
    if (e->charged > SV_ID_COST)
      dsp_budget_uncharge_part(s->budget, e->charged - SV_ID_COST);
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
    dsp_budget_uncharge_part(s->budget, SV_ID_COST);
  }
}

/* Inserts t under a free id, taking the caller's reference (dropped on
 * failure). */
int sv_insert(sv_session *s, uint64_t id, dsp_tensor *t, char *why,
              size_t len) {
  sv_entry *e = s->n_spare > 0 ? s->spare[--s->n_spare] : NULL;
  if (!e) {
    /* the budget formats its refusal only when it refuses (": session
     * holds ..." with an empty label), so the id is put in front then,
     * not formatted into a label for every insert */
    char refused[SV_WHY_LEN];
    int rc = dsp_budget_charge_held(s->budget, SV_ID_COST, "", refused,
                                    sizeof refused);
    if (rc < 0) {
      dsp_tensor_unref(t);
      return sv_why(why, len, rc, "id %llu%s", (unsigned long long)id,
                    refused);
    }
    e = dsp_calloc(1, sizeof *e);
  }
  if (!e || sv_idmap_put(&s->tensors, id, e) < 0) {
    dsp_free(e);
    dsp_tensor_unref(t);
    dsp_budget_uncharge_part(s->budget, SV_ID_COST);
    return sv_why(why, len, DISPATCH_ENOMEM, "out of memory adding id %llu",
                  (unsigned long long)id);
  }
  e->charged = SV_ID_COST;
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
  uint64_t cost = SV_ID_COST + DSP_BUDGET_COST(strlen(msg) + 1);
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

/* The text of an sv_label (handlers.h), formatted only to refuse. */
static const char *label_text(const sv_label *l, char *buf, size_t len) {
  switch (l->kind) {
    case SV_LBL_INPUT:
      snprintf(buf, len, "%s: input %zu", l->name, l->i);
      break;
    case SV_LBL_PARAM:
      snprintf(buf, len, "step %s: param %zu", l->name, l->i);
      break;
    case SV_LBL_STATE:
      snprintf(buf, len, "step %s: state %zu of param %zu", l->name, l->q,
               l->i);
      break;
    default: return l->name;
  }
  return buf;
}

int sv_get_tensor(sv_session *s, uint64_t id, sv_label what, char *why,
                  size_t len, dsp_tensor **t) {
  sv_entry *e = sv_idmap_get(&s->tensors, id);
  if (e && e->t) {
    *t = e->t;
    return 0;
  }
  char buf[96];
  const char *w = label_text(&what, buf, sizeof buf);
  if (!e)
    return sv_why(why, len, DISPATCH_ENOID, "%s id %llu does not exist", w,
                  (unsigned long long)id);
  return sv_why(why, len, DISPATCH_EPOISONED, "%s id %llu is poisoned by %s",
                w, (unsigned long long)id, e->poison ? e->poison : "?");
}

int sv_check_free_id(sv_session *s, uint64_t id, char *why, size_t len) {
  if (sv_idmap_get(&s->tensors, id))
    return sv_why(why, len, DISPATCH_EIDINUSE,
                  "output id %llu is already in use", (unsigned long long)id);
  return 0;
}

int sv_tensor_drop(sv_session *s, uint64_t id) {
  sv_entry *e = sv_idmap_del(&s->tensors, id);
  if (!e) return -1;
  entry_free(s, e);
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

int sv_dtype_for_client(const sv_session *s, int dt, const char *what,
                        char *msg, size_t len) {
  char why[128];
  if (!dsp_dtype_wire_refusal(dt, s->peer_minor, "client", why, sizeof why))
    return 0;
  snprintf(msg, len, "%s: %s", what, why);
  return DISPATCH_EDTYPE;
}

/* The value of a gradients id whose no-reply Backward failed (1.3): the
 * id is taken, as the client believes, but holds nothing. Never freed. */
static char g_failed_grads;
#define FAILED_GRADS ((dsp_grads *)(void *)&g_failed_grads)

void sv_grads_failed(sv_session *s, uint64_t id) {
  if (sv_idmap_get(&s->grads, id) ||
      dsp_budget_charge(s->budget, NULL, SV_ID_COST, NULL) < 0)
    return;
  if (sv_idmap_put(&s->grads, id, FAILED_GRADS) < 0)
    dsp_budget_uncharge(s->budget, SV_ID_COST);
}

static void grads_free(dsp_grads *g) {
  if (g != FAILED_GRADS) dsp_grads_free(g);
}

int sv_get_grads(sv_session *s, uint64_t id, char *why, size_t len,
                 dsp_grads **g) {
  *g = sv_idmap_get(&s->grads, id);
  if (!*g)
    return sv_why(why, len, DISPATCH_ENOID, "gradients id %llu does not exist",
                  (unsigned long long)id);
  if (*g == FAILED_GRADS)
    return sv_why(why, len, DISPATCH_EPOISONED,
                  "gradients id %llu holds nothing: the backward that was "
                  "to make it failed",
                  (unsigned long long)id);
  return 0;
}

int sv_grads_drop(sv_session *s, uint64_t id) {
  dsp_grads *g = sv_idmap_del(&s->grads, id);
  if (!g) return -1;
  grads_free(g);
  dsp_budget_uncharge(s->budget, SV_ID_COST);
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

void sv_fail_deferred(sv_session *s, int rc, int pre_err, uint64_t req_id,
                      const char *desc, const char *why, int has_out,
                      uint64_t out_id) {
  char msg[sizeof s->err_msg];
  count_failure(s, rc, pre_err, req_id, desc, why);
  label_failure(msg, sizeof msg, req_id, desc, rc, why);
  if (has_out) poison(s, out_id, rc, msg);
  defer_error(s, rc, req_id, msg);
}

static void exec_job(sv_session *s, sv_job *j);

void sv_session_exec(sv_session *s, sv_job *j) {
  exec_job(s, j);
  sv_tally_flush(&s->tally, s->global, &s->bytes);
}

/* Runs j through its kind's handler (kinds.c): a waiting request takes
 * the pending deferred error instead of running; a failure becomes its
 * error reply, or for a request without one the deferred error, with the
 * output its kind names poisoned. */
static void exec_job(sv_session *s, sv_job *j) {
  Dspwire__Request *r = j->req;
  const sv_req_kind *kind = sv_req_kind_of(r->body_case);
  char why[SV_WHY_LEN];
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
  s->turn_cost += 1 + upload_bytes;
  if (kind->own_turn) s->turn_cost = SV_TURN_COST;
  int rc = kind->exec ? kind->exec(s, j, why, sizeof why)
                      : sv_why(why, sizeof why, DISPATCH_EPROTO,
                               "request has no body");
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
  sv_fail_deferred(s, rc, j->pre_err, r->req_id, desc, why, kind->out != NULL,
                   kind->out ? kind->out(r) : 0);
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
  sv_peer_revoke(s, 0);
  sv_graph_teardown(s);
  for (size_t i = 0; i < s->grads.cap; i++)
    if (s->grads.vals[i]) {
      grads_free(s->grads.vals[i]);
      dsp_budget_uncharge(s->budget, SV_ID_COST);
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
