/* The LOCAL row of the device-kind table: tensors are dsp tensors of this
 * process, ops run now in the device's ctx on the CPU backend (or on a
 * GPU for local:cuda:N, through the CUDA plugin), and the
 * tape and gradients are common's engine (common/autodiff.c). The counters
 * a server keeps for a session are kept here in dev->local_stats. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* The LOCAL storage cache's bound: env DISPATCH_LOCAL_CACHE (bytes, with
 * an optional K, M or G suffix; 0 turns it off), else 256 MiB. A value
 * that does not parse keeps the default rather than failing the open. */
#define LOCAL_CACHE_DEFAULT (256ull << 20)
static uint64_t local_cache_bytes(void) {
  const char *e = getenv("DISPATCH_LOCAL_CACHE");
  if (!e || !*e) return LOCAL_CACHE_DEFAULT;
  char *end;
  unsigned long long v = strtoull(e, &end, 10);
  if (end == e) return LOCAL_CACHE_DEFAULT;
  int shift = *end == 'K' || *end == 'k'   ? 10
              : *end == 'M' || *end == 'm' ? 20
              : *end == 'G' || *end == 'g' ? 30
                                           : 0;
  if (shift) end++;
  if (*end || v > (UINT64_MAX >> shift)) return LOCAL_CACHE_DEFAULT;
  return (uint64_t)v << shift;
}

/* A LOCAL device's ctx charges an unlimited budget that holds its free
 * lists (common/cache.c), so freed storage and headers are reused by the
 * next op of the same size instead of going back to malloc. */
static int local_cache_init(dispatch_device *dev) {
  dsp_budget *b = dsp_budget_new(UINT64_MAX, NULL, "local device",
                                 "DISPATCH_LOCAL_CACHE");
  if (!b) return DISPATCH_ENOMEM;
  int rc = dsp_budget_set_cache(b, local_cache_bytes());
  if (rc == 0) dsp_ctx_set_budget(dev->ctx, b);
  dsp_budget_unref(b); /* the ctx holds it */
  return rc;
}

static int local_open(dispatch_device *dev, const dispatch__open_args *a) {
  (void)a;
  if (local_cache_init(dev) < 0)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "dispatch_device_open: out of memory");
  return 0;
}

static void local_detach(dispatch_device *dev) { (void)dev; }

/* only its timeout was used */
static void local_close(dispatch_device *dev) { dsp_free(dev->conn); }

static int local_peer(dispatch_device *dev) {
  return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                    "open_peer: \"%s\" is not a remote device", dev->spec);
}

static size_t meta_nbytes(const dsp_meta *m, int64_t numel) {
  return (size_t)numel * dsp_dtype_size(m->dtype);
}

/* A new unscoped LOCAL handle of meta m holding lt (its reference is
 * transferred; dropped on failure), counted in the device's stats. */
static int local_tensor(dispatch_device *dev, const dsp_meta *m,
                        dsp_tensor *lt, dispatch_tensor **out) {
  dispatch_tensor *t;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_LOCAL, m, 0, &t);
  if (rc < 0) {
    dsp_tensor_unref(lt);
    return rc;
  }
  dev->local_stats.tensors++;
  dev->local_stats.bytes += meta_nbytes(m, t->numel);
  t->local = lt;
  *out = t;
  return 0;
}

/* dsp_op with grad mode on only when an input is AUTODIFF, so plain
 * tensors never grow a tape; the output is tracked as the engine
 * decided. */
static int local_op(dispatch_device *dev, dsp_opcode op,
                    dispatch_tensor *const *cin, int n_in, const dsp_attrs *a,
                    int any_ad, dispatch_tensor **out, int *wrap) {
  dsp_tensor *lin[DSP_MAX_INPUTS], *lt;
  for (int i = 0; i < n_in; i++) lin[i] = cin[i]->local;
  int prev = dsp_set_grad_enabled(dev->ctx, any_ad);
  int rc = dsp_op(dev->ctx, op, lin, n_in, a, &lt);
  dsp_set_grad_enabled(dev->ctx, prev);
  if (rc < 0) {
    dev->local_stats.errors++;
    return rc;
  }
  dev->local_stats.ops++;
  rc = local_tensor(dev, &lt->meta, lt, out);
  if (rc < 0) return rc;
  *wrap = any_ad && dsp_is_tracked(lt);
  return 0;
}

static int local_upload(dispatch_device *dev, const dsp_meta *m,
                        const void *data, size_t nbytes,
                        dispatch_tensor **out) {
  dsp_tensor *lt;
  int rc = dsp_tensor_from_data(dev->ctx, m, data, nbytes, &lt);
  if (rc < 0) return rc;
  return local_tensor(dev, m, lt, out);
}

static int local_read(dispatch_tensor *t, void *buf, size_t nbytes) {
  if (!nbytes) return 0;
  int rc = dsp_tensor_read(t->dev->ctx, t->local, buf, nbytes);
  if (rc < 0)
    return dsp_seterr(t->dev->ctx, rc, "tensor_read: copy out failed");
  return 0;
}

/* between two LOCAL devices the bytes are copied through the caller */
static int local_move(dispatch_tensor *t, dispatch_device *dev,
                      dispatch_tensor **out) {
  (void)t, (void)dev, (void)out;
  return 1;
}

static void local_release(dispatch_tensor *t) { (void)t; }

/* an AUTODIFF wrapper holds no dsp tensor */
static void local_destroy(dispatch_tensor *t) {
  if (!t->local) return;
  dispatch_device *dev = t->dev;
  dsp_tensor_unref(t->local);
  dev->local_stats.tensors--;
  dev->local_stats.bytes -= meta_nbytes(&t->meta, t->numel);
}

static int local_track(dispatch_tensor *t) {
  return dsp_track(t->dev->ctx, t->local);
}

static int local_backward(dispatch_tensor *loss, int retain,
                          dispatch_grads *g) {
  dispatch_device *dev = g->dev;
  int rc = dsp_backward(dev->ctx, loss->local, retain, &g->local);
  if (rc == 0) dev->local_stats.grads++;
  return rc;
}

static int local_grad(dispatch_grads *g, dispatch_tensor *leaf,
                      dispatch_tensor **out) {
  dsp_tensor *lt;
  int rc = dsp_grads_get(g->dev->ctx, g->local, leaf->local, &lt);
  if (rc < 0) return rc;
  return local_tensor(g->dev, &lt->meta, lt, out);
}

static void local_grads_free(dispatch_grads *g) {
  dsp_grads_free(g->local);
  g->dev->local_stats.grads--;
}

/* Every parameter's gradient is looked up before the first update, so a
 * parameter without one (DISPATCH_ENOGRAD) changes nothing, as on the
 * server; then each update runs as one in-place op. */
static int local_step(dispatch_optim *opt, dispatch_grads *grads,
                      const dsp_attrs *a) {
  dispatch_device *dev = opt->dev;
  dsp_tensor *gstack[64], **gs = gstack;
  if (opt->n > 64) {
    gs = dsp_calloc((size_t)opt->n, sizeof *gs);
    if (!gs)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "optim_step: out of memory");
  }
  int rc = 0, n_got = 0;
  for (int i = 0; i < opt->n && rc == 0; i++) {
    rc = dsp_grads_get(dev->ctx, grads->local, opt->params[i]->inner->local,
                       &gs[i]);
    if (rc == 0) n_got = i + 1;
  }
  /* the server's order: every gradient, then the norm over all of them
   * and the scaler's decision, then the updates */
  dsp_attrs base = *a;
  dsp_step_scaler sc = {0};
  if (opt->ls_scale)
    sc = (dsp_step_scaler){opt->ls_scale->local, opt->ls_counts->local,
                           opt->ls_growth, opt->ls_backoff, opt->ls_interval};
  dsp_step_plan plan = {0};
  if (rc == 0)
    rc = dsp_step_prepare(dev->ctx, gs, (size_t)opt->n, opt->max_norm,
                          opt->max_norm > 0.0 && opt->norm ? opt->norm->local
                                                           : NULL,
                          opt->ls_scale ? &sc : NULL, &base, &plan);
  for (int i = 0; i < opt->n && rc == 0 && !plan.skip; i++) {
    dsp_tensor *in[4], *res;
    in[0] = opt->params[i]->inner->local;
    in[1] = gs[i];
    for (int j = 0; j < opt->k; j++)
      in[2 + j] = opt->states[i * opt->k + j]->local;
    dsp_attrs pa;
    dsp_step_param_attrs(opt->op, &base, opt->wd, (size_t)i, plan.extra,
                         plan.factor, &pa);
    rc = dsp_op(dev->ctx, opt->op, in, 2 + opt->k, &pa, &res);
    if (rc == 0) {
      dsp_tensor_unref(res);
      dev->local_stats.ops++;
    }
  }
  if (rc == 0 && opt->ls_scale) rc = dsp_step_finish(dev->ctx, &sc, &plan);
  for (int i = 0; i < n_got; i++) dsp_tensor_unref(gs[i]);
  if (gs != gstack) dsp_free(gs);
  if (rc < 0) dev->local_stats.errors++; /* the server counts it too */
  return rc;
}

/* the graph runs here: nothing to send, nothing to free */
static int local_graph_define(dispatch_graph *g) {
  (void)g;
  return 0;
}

static void local_graph_free(dispatch_device *dev, uint64_t id) {
  (void)dev, (void)id;
}

/* ops run at the call: nothing is ever pending */
static int local_sync(dispatch_device *dev) {
  (void)dev;
  return 0;
}

static int local_stats(dispatch_device *dev, dispatch_stats *all) {
  *all = dev->local_stats;
  all->devices = 1;
  return 0;
}

static int local_devices(dispatch_device *dev, dispatch_device_info *all,
                         int max, int *n) {
  *n = 1;
  if (max > 0) {
    const dsp_backend *be = dsp_ctx_backend(dev->ctx);
    snprintf(all->kind, sizeof all->kind, "%s", dev->cuda_be ? "cuda" : "cpu");
    snprintf(all->name, sizeof all->name, "local:%s",
             dev->cuda_be ? dsp_backend_name(be) : "cpu");
    snprintf(all->description, sizeof all->description, "%s",
             dsp_backend_description(be));
  }
  return 0;
}

static int local_set_cache(dispatch_device *dev, uint64_t bytes) {
  if (dsp_budget_set_cache(dsp_ctx_budget(dev->ctx), bytes) < 0)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "set_cache: out of memory");
  return 0;
}

const dispatch__kind_ops dispatch__local_ops = {
    .kind = DISPATCH_KIND_LOCAL,
    .open = local_open,
    .detach = local_detach,
    .close = local_close,
    .peer = local_peer,
    .op = local_op,
    .upload = local_upload,
    .read = local_read,
    .move = local_move,
    .release = local_release,
    .destroy = local_destroy,
    .track = local_track,
    .backward = local_backward,
    .grad = local_grad,
    .grads_free = local_grads_free,
    .step = local_step,
    .graph_define = local_graph_define,
    .graph_replay = dispatch__graph_replay_local,
    .graph_free = local_graph_free,
    .sync = local_sync,
    .stats = local_stats,
    .devices = local_devices,
    .set_cache = local_set_cache,
};
