/* Captured graphs: building, checking and running the node list (see
 * graph.h). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dsp_internal.h"
#include "graph.h"

static uint64_t add_sat(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* The parameters a checked STEP node updates */
static uint64_t step_params(const dsp_gnode *n) {
  uint32_t k = (uint32_t)dsp_step_states(n->op);
  if (!k) return 0;
  return n->n_in > 0 ? (uint64_t)((n->n_in - 1) / (k + 1)) : 0;
}

/* The work of node n not done through dsp_op (which counts its own with
 * DSP_WORK_PER_OP): a node that runs no kernel still costs its slot, a
 * tape lookup, a release; a gradient lookup scans the container
 * (n_grads leaves, 0 when unknown, at definition). */
static uint64_t node_overhead(const dsp_gnode *n, uint64_t n_grads) {
  switch (n->kind) {
    case DSP_G_OP: return 0;
    case DSP_G_FREE: return (uint64_t)(1 + n->n_in) * (DSP_WORK_PER_OP / 4);
    case DSP_G_GRAD: return add_sat(DSP_WORK_PER_OP, n_grads);
    case DSP_G_STEP:
      return add_sat(DSP_WORK_PER_OP, step_params(n) * n_grads);
    default: return DSP_WORK_PER_OP; /* track, backward */
  }
}

/* What dsp_graph_run adds to dsp_ctx_work for n at least: its overhead
 * and, for the ops it runs, DSP_WORK_PER_OP each */
static uint64_t node_static_work(const dsp_gnode *n) {
  uint64_t w = node_overhead(n, 0);
  if (n->kind == DSP_G_OP) w += DSP_WORK_PER_OP;
  if (n->kind == DSP_G_STEP) w += step_params(n) * DSP_WORK_PER_OP;
  return w;
}

dsp_graph *dsp_graph_new(void) { return dsp_calloc(1, sizeof(dsp_graph)); }

void dsp_graph_free(dsp_graph *g) {
  if (!g) return;
  for (size_t i = 0; i < g->n_nodes; i++) {
    dsp_free(g->nodes[i].in);
    dsp_free(g->nodes[i].wd);
  }
  dsp_free(g->nodes);
  dsp_free(g->input_meta);
  dsp_free(g->outputs);
  dsp_free(g->slot_grads);
  dsp_free(g);
}

int dsp_graph_add(dsp_graph *g, int kind, int op, int flags,
                  const uint32_t *in, uint32_t n_in, uint32_t out,
                  const dsp_attrs *a) {
  if (g->n_nodes == g->cap_nodes) {
    size_t cap = g->cap_nodes ? g->cap_nodes * 2 : 64;
    dsp_gnode *nn = dsp_realloc(g->nodes, cap * sizeof *nn);
    if (!nn) return DISPATCH_ENOMEM;
    g->nodes = nn;
    g->cap_nodes = cap;
  }
  dsp_gnode *n = &g->nodes[g->n_nodes];
  memset(n, 0, sizeof *n);
  if (n_in) {
    n->in = dsp_malloc(n_in * sizeof *n->in);
    if (!n->in) return DISPATCH_ENOMEM;
    memcpy(n->in, in, n_in * sizeof *n->in);
  }
  n->kind = kind;
  n->op = op;
  n->flags = flags;
  n->n_in = n_in;
  n->out = out;
  n->a = a ? *a : dsp_attrs_none();
  g->n_nodes++;
  return 0;
}

int dsp_graph_set_step(dsp_graph *g, double max_norm, const double *wd,
                       uint32_t n_wd) {
  dsp_gnode *n = &g->nodes[g->n_nodes - 1];
  double *copy = NULL;
  if (n_wd) {
    copy = dsp_malloc(n_wd * sizeof *copy);
    if (!copy) return DISPATCH_ENOMEM;
    memcpy(copy, wd, n_wd * sizeof *copy);
  }
  dsp_free(n->wd);
  n->wd = copy;
  n->n_wd = n_wd;
  n->max_norm = max_norm;
  return 0;
}

uint64_t dsp_graph_bytes(const dsp_graph *g) {
  uint64_t b = sizeof *g + g->cap_nodes * sizeof(dsp_gnode) +
               (uint64_t)g->n_inputs * sizeof(dsp_meta) +
               (uint64_t)g->n_outputs * 4 + g->n_slots;
  for (size_t i = 0; i < g->n_nodes; i++)
    b += (uint64_t)g->nodes[i].n_in * 4 + (uint64_t)g->nodes[i].n_wd * 8;
  return b;
}

static const char *node_name(const dsp_gnode *n) {
  switch (n->kind) {
    case DSP_G_OP:
    case DSP_G_STEP: {
      const dsp_op_info *info = dsp_op_lookup(n->op);
      return info ? info->name : "unknown op";
    }
    case DSP_G_TRACK: return "track";
    case DSP_G_BACKWARD: return "backward";
    case DSP_G_GRAD: return "grad";
    case DSP_G_FREE: return "free";
    default: return "unknown node";
  }
}

enum { S_NONE = 0, S_TENSOR, S_GRADS, S_FREED, S_OUTPUT };

/* Checks that slot `s` (operand `what` of node k) holds a live value of
 * sort `want`. */
static int want_live(dsp_ctx *ctx, const dsp_graph *g, const uint8_t *st,
                     size_t k, const char *name, const char *what,
                     uint32_t s, int want) {
  if (s >= g->n_slots)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "op %zu (%s): %s is slot %u, the graph has %u", k, name,
                      what, s, g->n_slots);
  if (st[s] == want) return 0;
  const char *is = st[s] == S_NONE    ? "which nothing made before"
                   : st[s] == S_FREED ? "which was released before"
                   : st[s] == S_GRADS ? "a gradient container"
                                      : "a tensor";
  return dsp_seterr(ctx, DISPATCH_EINVAL, "op %zu (%s): %s is slot %u, %s",
                    k, name, what, s, is);
}

static int want_new(dsp_ctx *ctx, const dsp_graph *g, const uint8_t *st,
                    size_t k, const char *name, uint32_t s) {
  if (s >= g->n_slots || s < g->n_inputs + g->n_ext || st[s] != S_NONE)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "op %zu (%s): result slot %u is not a fresh internal "
                      "slot", k, name, s);
  return 0;
}

/* A STEP's clip (finite, >= 0) and decays (none, or adamw's, one per
 * parameter, each finite), judged at definition as a Step's are. */
static int check_step_extras(dsp_ctx *ctx, const dsp_gnode *n, size_t k,
                             const char *name, uint32_t np) {
  if (!(n->max_norm >= 0.0) || isinf(n->max_norm))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "op %zu (%s): max_norm = %g is not finite and >= 0", k,
                      name, n->max_norm);
  if (n->n_wd && (n->op != DSP_OP_ADAMW_STEP || n->n_wd != np))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "op %zu (%s): %u weight decays for %u params (adamw "
                      "only, one per param)", k, name, n->n_wd, np);
  for (uint32_t i = 0; i < n->n_wd; i++)
    if (!isfinite(n->wd[i]))
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "op %zu (%s): weight decay %u = %g is not finite", k,
                        name, i, n->wd[i]);
  return 0;
}

int dsp_graph_check(dsp_ctx *ctx, dsp_graph *g) {
  if (g->n_slots > DSP_GRAPH_MAX_SLOTS || g->n_nodes > DSP_GRAPH_MAX_NODES ||
      (uint64_t)g->n_inputs + g->n_ext > g->n_slots)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "graph: %u inputs and %u externals in %u slots, %zu "
                      "nodes (at most %u slots and %u nodes)",
                      g->n_inputs, g->n_ext, g->n_slots, g->n_nodes,
                      DSP_GRAPH_MAX_SLOTS, DSP_GRAPH_MAX_NODES);
  for (uint32_t i = 0; i < g->n_inputs; i++) {
    int rc = dsp_meta_check(ctx, &g->input_meta[i]);
    if (rc < 0)
    {
      char m[512];
      snprintf(m, sizeof m, "%s", dsp_ctx_errmsg(ctx));
      return dsp_seterr(ctx, rc, "graph: input %u: %s", i, m);
    }
  }
  uint8_t *st = dsp_calloc(g->n_slots ? g->n_slots : 1, 1);
  dsp_free(g->slot_grads);
  g->slot_grads = dsp_calloc(g->n_slots ? g->n_slots : 1, 1);
  if (!st || !g->slot_grads) {
    dsp_free(st);
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "graph: out of memory");
  }
  for (uint32_t i = 0; i < g->n_inputs + g->n_ext; i++) st[i] = S_TENSOR;
  int rc = 0;
  size_t k = 0; /* counts nodes other than FREE, as errors name them */
  for (size_t i = 0; i < g->n_nodes && rc == 0; i++) {
    const dsp_gnode *n = &g->nodes[i];
    const char *name = node_name(n);
    if (n->kind != DSP_G_STEP && (n->max_norm != 0.0 || n->n_wd)) {
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "op %zu (%s): a clip or weight decays outside a step",
                      k, name);
      break;
    }
    switch (n->kind) {
      case DSP_G_OP: {
        const dsp_op_info *info = dsp_op_lookup(n->op);
        if (!info) {
          rc = dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                          "op %zu: unknown op code %d", k, n->op);
          break;
        }
        if (info->family == DSP_FAM_OPTIM) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                          "op %zu (%s): an in-place update goes in a step "
                          "node", k, name);
          break;
        }
        if (n->n_in > DSP_MAX_INPUTS) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                          "op %zu (%s): %u inputs, at most %d", k, name,
                          n->n_in, DSP_MAX_INPUTS);
          break;
        }
        for (uint32_t q = 0; q < n->n_in && rc == 0; q++)
          rc = want_live(ctx, g, st, k, name, "an input", n->in[q], S_TENSOR);
        if (rc == 0) rc = want_new(ctx, g, st, k, name, n->out);
        if (rc == 0) st[n->out] = S_TENSOR;
        break;
      }
      case DSP_G_TRACK:
        if (n->n_in != 1) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL, "op %zu (track): %u inputs",
                          k, n->n_in);
          break;
        }
        rc = want_live(ctx, g, st, k, name, "the tensor", n->in[0], S_TENSOR);
        break;
      case DSP_G_BACKWARD:
        if (n->n_in != 1) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                          "op %zu (backward): %u inputs", k, n->n_in);
          break;
        }
        rc = want_live(ctx, g, st, k, name, "the loss", n->in[0], S_TENSOR);
        if (rc == 0) rc = want_new(ctx, g, st, k, name, n->out);
        if (rc == 0) st[n->out] = S_GRADS;
        break;
      case DSP_G_GRAD:
        if (n->n_in != 2) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL, "op %zu (grad): %u inputs", k,
                          n->n_in);
          break;
        }
        rc = want_live(ctx, g, st, k, name, "the gradients", n->in[0],
                       S_GRADS);
        if (rc == 0)
          rc = want_live(ctx, g, st, k, name, "the tensor", n->in[1],
                         S_TENSOR);
        if (rc == 0) rc = want_new(ctx, g, st, k, name, n->out);
        if (rc == 0) st[n->out] = S_TENSOR;
        break;
      case DSP_G_STEP: {
        uint32_t kk = (uint32_t)dsp_step_states(n->op);
        if (!kk || n->n_in < 1 || n->n_in > DSP_GRAPH_MAX_STEP_IN ||
            (n->n_in - 1) % (kk + 1) != 0) {
          rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                          "op %zu (%s): not an sgd, adam or adamw step over "
                          "whole parameters (%u operands)", k, name, n->n_in);
          break;
        }
        rc = check_step_extras(ctx, n, k, name, (n->n_in - 1) / (kk + 1));
        if (rc < 0) break;
        rc = want_live(ctx, g, st, k, name, "the gradients", n->in[0],
                       S_GRADS);
        for (uint32_t q = 1; q < n->n_in && rc == 0; q++)
          rc = want_live(ctx, g, st, k, name, "a parameter or state",
                         n->in[q], S_TENSOR);
        break;
      }
      case DSP_G_FREE:
        for (uint32_t q = 0; q < n->n_in && rc == 0; q++) {
          uint32_t s = n->in[q];
          if (s < g->n_slots && s >= g->n_inputs && s < g->n_inputs + g->n_ext)
            rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                            "graph: node %zu releases external slot %u", i,
                            s);
          else if (s >= g->n_slots || (st[s] != S_TENSOR && st[s] != S_GRADS))
            rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                            "graph: node %zu releases slot %u, which holds "
                            "nothing", i, s);
          else
            st[s] = S_FREED;
        }
        break;
      default:
        rc = dsp_seterr(ctx, DISPATCH_EINVAL, "graph: node %zu has kind %d",
                        i, n->kind);
    }
    if (rc == 0 && n->kind != DSP_G_FREE &&
        (n->a.n_ints < 0 || n->a.n_ints > DSP_MAX_ATTR_INTS ||
         n->a.n_floats < 0 || n->a.n_floats > DSP_MAX_ATTR_FLOATS))
      rc = dsp_seterr(ctx, DISPATCH_EINVAL, "op %zu (%s): bad attributes", k,
                      name);
    if (n->kind != DSP_G_FREE) k++;
  }
  /* each output once: a reply carries every output's bytes, so a slot
   * named n times would cost n copies (the client names each once) */
  for (uint32_t i = 0; i < g->n_outputs && rc == 0; i++)
    if (g->outputs[i] < g->n_slots && st[g->outputs[i]] == S_OUTPUT)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "graph: output %u is slot %u, an earlier output: name "
                      "each output once", i, g->outputs[i]);
    else if (g->outputs[i] >= g->n_slots || st[g->outputs[i]] != S_TENSOR)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "graph: output %u is slot %u, which holds no tensor at "
                      "the end", i, g->outputs[i]);
    else
      st[g->outputs[i]] = S_OUTPUT;
  /* slots are made once, so a slot's sort is that of its maker */
  for (size_t i = 0; i < g->n_nodes && rc == 0; i++)
    if (g->nodes[i].kind == DSP_G_BACKWARD) g->slot_grads[g->nodes[i].out] = 1;
  g->static_work = g->n_slots;
  for (size_t i = 0; i < g->n_nodes && rc == 0; i++)
    g->static_work = add_sat(g->static_work, node_static_work(&g->nodes[i]));
  dsp_free(st);
  return rc;
}

static void release(const dsp_graph *g, void **vals, uint32_t s) {
  if (!vals[s]) return;
  if (g->slot_grads[s])
    dsp_grads_free(vals[s]);
  else
    dsp_tensor_unref(vals[s]);
  vals[s] = NULL;
}

/* One STEP node: every gradient is looked up and every update's shapes
 * inferred before the first parameter changes, then each runs in place
 * with grad mode off, as the server's Step and the LOCAL optimizer do. */
static int run_step(dsp_ctx *ctx, const dsp_gnode *n, void **vals,
                    int64_t adam_offset, uint64_t *n_ops) {
  uint32_t k = (uint32_t)dsp_step_states(n->op);
  uint32_t np = (n->n_in - 1) / (k + 1);
  dsp_attrs a = n->a, pa;
  if (n->op != DSP_OP_SGD_STEP && a.n_ints >= 1) a.ints[0] += adam_offset;
  int clip = n->max_norm > 0.0;
  const double *wd = n->n_wd ? n->wd : NULL;
  dsp_grads *g = vals[n->in[0]];
  dsp_tensor **gs = dsp_calloc(np ? np : 1, sizeof *gs);
  if (!gs) return dsp_seterr(ctx, DISPATCH_ENOMEM, "out of memory");
  int rc = 0;
  uint32_t got = 0;
  for (uint32_t i = 0; i < np && rc == 0; i++) {
    dsp_tensor *p = vals[n->in[1 + i]];
    rc = dsp_grads_get(ctx, g, p, &gs[i]);
    if (rc < 0) break;
    got = i + 1;
    dsp_meta metas[4], om;
    metas[0] = p->meta;
    metas[1] = gs[i]->meta;
    for (uint32_t q = 0; q < k; q++)
      metas[2 + q] = ((dsp_tensor *)vals[n->in[1 + np + i * k + q]])->meta;
    dsp_step_param_attrs(n->op, &a, wd, i, clip, 1.0, &pa);
    rc = dsp_op_infer(ctx, (dsp_opcode)n->op, metas, (int)(k + 2), &pa, &om);
  }
  /* the norm over every gradient before the first update, as the
   * server's Step and the LOCAL optimizer take it (a graph has no loss
   * scaler: the capture refuses a scaled step) */
  dsp_step_plan plan = {0};
  if (rc == 0)
    rc = dsp_step_prepare(ctx, gs, np, n->max_norm, NULL, NULL, NULL, &plan);
  if (rc == 0) {
    int prev = dsp_set_grad_enabled(ctx, 0);
    for (uint32_t i = 0; i < np && rc == 0; i++) {
      dsp_tensor *in[4], *out;
      in[0] = vals[n->in[1 + i]];
      in[1] = gs[i];
      for (uint32_t q = 0; q < k; q++) in[2 + q] = vals[n->in[1 + np + i * k + q]];
      dsp_step_param_attrs(n->op, &a, wd, i, plan.extra, plan.factor, &pa);
      rc = dsp_op(ctx, (dsp_opcode)n->op, in, (int)(k + 2), &pa, &out);
      if (rc == 0) {
        dsp_tensor_unref(out);
        (*n_ops)++;
      } else {
        char m[512];
        snprintf(m, sizeof m, "%s", dsp_ctx_errmsg(ctx));
        rc = dsp_seterr(ctx, rc, "param %u: %s", i, m);
      }
    }
    dsp_set_grad_enabled(ctx, prev);
  }
  for (uint32_t i = 0; i < got; i++) dsp_tensor_unref(gs[i]);
  dsp_free(gs);
  return rc;
}

int dsp_graph_run(dsp_ctx *ctx, const dsp_graph *g, dsp_tensor *const *inputs,
                  dsp_tensor *const *ext, int64_t adam_offset,
                  dsp_tensor **outputs, uint64_t *n_ops) {
  void **vals = dsp_calloc(g->n_slots ? g->n_slots : 1, sizeof *vals);
  if (!vals) return dsp_seterr(ctx, DISPATCH_ENOMEM, "graph: out of memory");
  /* the bound holds the ops inside (backward's, a step's updates) too: it
   * is the ctx's while the replay runs, a stricter one kept */
  uint64_t prev_limit = ctx->work_limit, prev_cap = ctx->work_cap;
  if (g->max_work) {
    uint64_t lim = add_sat(ctx->work, g->max_work);
    if (!prev_limit || lim < prev_limit) {
      ctx->work_limit = lim;
      ctx->work_cap = g->max_work;
    }
  }
  ctx->work = add_sat(ctx->work, g->n_slots); /* the slots, set and released */
  for (uint32_t i = 0; i < g->n_inputs; i++) vals[i] = dsp_tensor_ref(inputs[i]);
  for (uint32_t i = 0; i < g->n_ext; i++)
    vals[g->n_inputs + i] = dsp_tensor_ref(ext[i]);
  int rc = 0;
  size_t k = 0;
  dsp_tensor *in[DSP_MAX_INPUTS];
  for (size_t i = 0; i < g->n_nodes && rc == 0; i++) {
    const dsp_gnode *n = &g->nodes[i];
    /* a node boundary is a cancellation point whatever the node runs */
    if (dsp_ctx_cancelled(ctx)) {
      rc = dsp_seterr(ctx, DISPATCH_ECANCELED, "cancelled before it ran");
      goto failed;
    }
    uint64_t n_grads = 0;
    if (n->kind == DSP_G_GRAD || n->kind == DSP_G_STEP)
      n_grads = (uint64_t)dsp_grads_count(vals[n->in[0]]);
    ctx->work = add_sat(ctx->work, node_overhead(n, n_grads));
    if (ctx->work_limit && ctx->work > ctx->work_limit) {
      rc = dsp__work_limit_err(ctx, NULL);
      goto failed;
    }
    switch (n->kind) {
      case DSP_G_OP: {
        for (uint32_t q = 0; q < n->n_in; q++) in[q] = vals[n->in[q]];
        dsp_tensor *out;
        int prev = dsp_set_grad_enabled(ctx, !(n->flags & DSP_G_NO_GRAD));
        rc = dsp_op(ctx, (dsp_opcode)n->op, in, (int)n->n_in, &n->a, &out);
        dsp_set_grad_enabled(ctx, prev);
        if (rc == 0) {
          vals[n->out] = out;
          (*n_ops)++;
        }
        break;
      }
      case DSP_G_TRACK: rc = dsp_track(ctx, vals[n->in[0]]); break;
      case DSP_G_BACKWARD: {
        dsp_grads *gr;
        rc = dsp_backward(ctx, vals[n->in[0]], n->flags & DSP_G_RETAIN, &gr);
        if (rc == 0) vals[n->out] = gr;
        break;
      }
      case DSP_G_GRAD: {
        dsp_tensor *gt;
        rc = dsp_grads_get(ctx, vals[n->in[0]], vals[n->in[1]], &gt);
        if (rc == 0) vals[n->out] = gt;
        break;
      }
      case DSP_G_STEP: rc = run_step(ctx, n, vals, adam_offset, n_ops); break;
      case DSP_G_FREE:
        for (uint32_t q = 0; q < n->n_in; q++) release(g, vals, n->in[q]);
        break;
      default: rc = dsp_seterr(ctx, DISPATCH_EINTERNAL, "unchecked graph");
    }
  failed:
    if (rc < 0) {
      /* the core's message is copied: dsp_seterr writes where it lives */
      char m[512];
      const char *cm = dsp_ctx_errmsg(ctx);
      snprintf(m, sizeof m, "%s", cm && *cm ? cm : dispatch_strerror(rc));
      rc = dsp_seterr(ctx, rc, "op %zu (%s): %s", k, node_name(n), m);
    }
    if (n->kind != DSP_G_FREE) k++;
  }
  for (uint32_t i = 0; i < g->n_outputs; i++)
    outputs[i] = rc == 0 ? dsp_tensor_ref(vals[g->outputs[i]]) : NULL;
  for (uint32_t s = 0; s < g->n_slots; s++) release(g, vals, s);
  dsp_free(vals);
  ctx->work_limit = prev_limit;
  ctx->work_cap = prev_cap;
  return rc;
}
