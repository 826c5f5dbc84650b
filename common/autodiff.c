/* Reverse-mode autodiff engine: the tape (one refcounted node per tracked
 * tensor), the backward pass and the gradients container. The per-op
 * backward rules live in autodiff_rules.c.
 *
 * Every gradient is computed with dsp_op while grad mode is off, so
 * backward runs on whatever backend the ctx uses (the server walks the
 * tape where the tensors live) and records nothing itself. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "autodiff.h"

/* ------------------------------------------------------------------ */
/* nodes                                                               */

/* Nodes of a dying graph are freed from a per-thread pending list instead
 * of recursively: dropping the last tensor of a chain of a million ops
 * must not use a million stack frames. */
static _Thread_local dsp_node *t_pending;
static _Thread_local int t_draining;

static void node_unref(dsp_node *n);

static uint64_t node_cost(int n_in) {
  return DSP_BUDGET_COST(sizeof(dsp_node) + (size_t)n_in * sizeof(dsp_tensor *));
}

/* A node charged to ctx's budget; NULL with the error set in ctx. The
 * tensors it saves are charged already (their storage and headers), so a
 * tape that keeps freed intermediates alive is counted in full. */
/* A new node charged to ctx's budget. Its label for an error message is
 * name followed by suffix, put together only on failure: a node is made
 * for every tracked op, and formatting a label each time showed in the
 * server's profile. */
static int node_new(dsp_ctx *ctx, int n_in, const char *name,
                    const char *suffix, dsp_node **out) {
  *out = NULL;
  /* the tensor code frees a tracked tensor's node through this hook */
  dsp__tensor_set_node_release(node_unref);
  char refused[sizeof ctx->err];
  int rc = dsp_budget_charge_why(ctx->budget, node_cost(n_in), "", refused,
                                 sizeof refused);
  if (rc < 0) return dsp_seterr(ctx, rc, "%s%s%s", name, suffix, refused);
  dsp_node *n = dsp_calloc(1, sizeof *n + (size_t)n_in * sizeof(dsp_tensor *));
  if (!n) {
    dsp_budget_uncharge(ctx->budget, node_cost(n_in));
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "%s%s: out of memory", name,
                      suffix);
  }
  n->budget = ctx->budget;
  n->refcount = 1;
  n->n_in = n_in;
  n->idx = -1;
  n->tape = 1;
  *out = n;
  return 0;
}

/* Drops every tensor the node keeps for backward; the node stays. */
static void node_release_saved(dsp_node *n) {
  for (int i = 0; i < n->n_in; i++) {
    dsp_tensor *t = n->in[i];
    n->in[i] = NULL;
    dsp_tensor_unref(t);
  }
  dsp_tensor *o = n->out;
  n->out = NULL;
  dsp_tensor_unref(o);
}

static void node_free(dsp_node *n) {
  dsp_budget *b = n->budget;
  uint64_t cost = node_cost(n->n_in);
  dsp_free(n);
  dsp_budget_uncharge(b, cost);
}

static void node_ref(dsp_node *n) { n->refcount++; }

/* t->node's release hook (dsp__tensor_set_node_release) and the drop of
 * every other node reference. */
static void node_unref(dsp_node *n) {
  if (!n || --n->refcount > 0) return;
  n->next_free = t_pending;
  t_pending = n;
  if (t_draining) return; /* an outer call is emptying the list */
  t_draining = 1;
  while (t_pending) {
    dsp_node *m = t_pending;
    t_pending = m->next_free;
    node_release_saved(m); /* may push parents onto t_pending */
    node_free(m);
  }
  t_draining = 0;
}

/* ------------------------------------------------------------------ */
/* tracking                                                            */

int dsp_is_tracked(const dsp_tensor *t) { return t && t->node != NULL; }

uint64_t dsp_tape_size(const dsp_tensor *t) {
  if (!t || !t->node) return 0;
  /* a non-retained backward dropped what the node kept */
  return t->node->released ? 1 : t->node->tape;
}

/* Makes t a leaf; refuses a second wrap so a tensor has one tape only. */
int dsp_track(dsp_ctx *ctx, dsp_tensor *t) {
  if (!t) return dsp_seterr(ctx, DISPATCH_EINVAL, "track: tensor is NULL");
  if (t->node) {
    if (t->node->is_leaf)
      return dsp_seterr(ctx, DISPATCH_EDOUBLEWRAP,
                        "track: autodiff should not wrap an autodiff tensor "
                        "(this tensor is already a tracked leaf)");
    return dsp_seterr(ctx, DISPATCH_EDOUBLEWRAP,
                      "track: autodiff should not wrap an autodiff tensor "
                      "(this tensor is the tracked output of %s)",
                      dsp_op_lookup((int)t->node->op)->name);
  }
  if (!dsp_dtype_is_float(t->meta.dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "track: only f32 and f64 tensors can be tracked, got %s",
                      dsp_dtype_name(t->meta.dtype));
  dsp_node *n;
  int rc = node_new(ctx, 0, "track", "", &n);
  if (rc < 0) return rc;
  n->is_leaf = 1;
  n->meta = t->meta;
  t->node = n;
  return 0;
}

int dsp_detach(dsp_ctx *ctx, dsp_tensor *t, dsp_tensor **out) {
  if (!out) return dsp_seterr(ctx, DISPATCH_EINVAL, "detach: out is NULL");
  *out = NULL;
  if (!t) return dsp_seterr(ctx, DISPATCH_EINVAL, "detach: tensor is NULL");
  return dsp_tensor_alias(ctx, t, &t->meta, out);
}

/* Records `op` so that `out` becomes tracked. Non-float outputs
 * (comparisons, argmax, casts to integers) have no gradient: nothing is
 * recorded and out stays untracked. On failure out is untouched. */
int dsp__autodiff_record(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                         int n_in, const dsp_attrs *a, dsp_tensor *out) {
  if (!dsp_dtype_is_float(out->meta.dtype)) return 0;
  if (out->node)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL,
                      "%s: output is already tracked", dsp_op_lookup((int)op)->name);
  dsp_node *n;
  int rc = node_new(ctx, n_in, dsp_op_lookup((int)op)->name,
                    ": recording the op for autodiff", &n);
  if (rc < 0) return rc;
  n->op = op;
  n->attrs = *a;
  n->meta = out->meta;
  if (dsp__autodiff_saves_output(op)) {
    rc = dsp_tensor_alias(ctx, out, &out->meta, &n->out);
    if (rc < 0) {
      node_free(n);
      return rc;
    }
  }
  for (int i = 0; i < n_in; i++) {
    n->in[i] = dsp_tensor_ref(in[i]);
    uint64_t t = dsp_tape_size(in[i]);
    n->tape = t > UINT64_MAX - n->tape ? UINT64_MAX : n->tape + t;
  }
  out->node = n;
  return 0;
}

/* ------------------------------------------------------------------ */
/* gradients container                                                 */

struct dsp_grads {
  int n;
  dsp_node **nodes;    /* one reference each: keys stay valid */
  dsp_tensor **grads;  /* one reference each */
  dsp_budget *budget;  /* charged `charged` bytes for the three blocks */
  uint64_t charged;
};

/* An empty container for cap leaves, charged to ctx's budget (the
 * gradient tensors it will hold are charged as tensors). */
static int grads_new(dsp_ctx *ctx, int cap, dsp_grads **out) {
  *out = NULL;
  size_t c = cap > 0 ? (size_t)cap : 1;
  uint64_t cost = DSP_BUDGET_COST(sizeof(dsp_grads)) +
                  2 * DSP_BUDGET_COST(c * sizeof(void *));
  int rc = dsp_budget_charge(ctx->budget, ctx, cost, "backward: gradients");
  if (rc < 0) return rc;
  dsp_grads *g = dsp_calloc(1, sizeof *g);
  if (g) {
    g->nodes = dsp_calloc(c, sizeof *g->nodes);
    g->grads = dsp_calloc(c, sizeof *g->grads);
  }
  if (!g || !g->nodes || !g->grads) {
    if (g) {
      dsp_free(g->nodes);
      dsp_free(g->grads);
    }
    dsp_free(g);
    dsp_budget_uncharge(ctx->budget, cost);
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "backward: out of memory");
  }
  g->budget = ctx->budget;
  g->charged = cost;
  *out = g;
  return 0;
}

void dsp_grads_free(dsp_grads *g) {
  if (!g) return;
  for (int i = 0; i < g->n; i++) {
    dsp_tensor_unref(g->grads[i]);
    node_unref(g->nodes[i]);
  }
  dsp_budget *b = g->budget;
  uint64_t cost = g->charged;
  dsp_free(g->nodes);
  dsp_free(g->grads);
  dsp_free(g);
  dsp_budget_uncharge(b, cost);
}

int dsp_grads_count(const dsp_grads *g) { return g ? g->n : 0; }

int dsp_grads_get(dsp_ctx *ctx, const dsp_grads *g, const dsp_tensor *t,
                  dsp_tensor **out) {
  if (!out) return dsp_seterr(ctx, DISPATCH_EINVAL, "grads_get: out is NULL");
  *out = NULL;
  if (!g || !t)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "grads_get: %s is NULL",
                      g ? "tensor" : "grads");
  if (!t->node)
    return dsp_seterr(ctx, DISPATCH_ENOTTRACKED,
                      "grads_get: tensor is not tracked (call track before "
                      "the forward pass)");
  for (int i = 0; i < g->n; i++)
    if (g->nodes[i] == t->node) {
      *out = dsp_tensor_ref(g->grads[i]);
      return 0;
    }
  if (!t->node->is_leaf)
    return dsp_seterr(ctx, DISPATCH_ENOGRAD,
                      "grads_get: gradients are kept for tracked leaves only; "
                      "this tensor is the output of %s",
                      dsp_op_lookup((int)t->node->op)->name);
  return dsp_seterr(ctx, DISPATCH_ENOGRAD,
                    "grads_get: backward did not reach this leaf (the loss "
                    "does not depend on it)");
}

/* ------------------------------------------------------------------ */
/* backward                                                            */

/* Unique per pass, so visited marks of an earlier or concurrent pass (on
 * another ctx and graph) never look current. */
static _Atomic uint64_t g_generation;

typedef struct frame {
  dsp_node *node;
  int next; /* next input to look at */
} frame;

static int grow(dsp_ctx *ctx, void **arr, int64_t *cap, int64_t need,
                size_t elem) {
  if (need <= *cap) return 0;
  int64_t nc = *cap ? *cap * 2 : 64;
  while (nc < need) nc *= 2;
  if ((uint64_t)nc > SIZE_MAX / elem)
    return dsp_seterr(ctx, DISPATCH_EOVERFLOW, "backward: graph too large");
  void *p = dsp_realloc(*arr, (size_t)nc * elem);
  if (!p) return dsp_seterr(ctx, DISPATCH_ENOMEM, "backward: out of memory sorting the graph");
  *arr = p;
  *cap = nc;
  return 0;
}

static int graph_freed(dsp_ctx *ctx, const dsp_node *n) {
  return dsp_seterr(ctx, DISPATCH_EGRAPHFREED,
                    "backward: the graph through %s was released by an "
                    "earlier backward; pass retain to backward through it "
                    "twice", dsp_op_lookup((int)n->op)->name);
}

/* Post-order DFS with an explicit stack: on success *topo lists every node
 * reachable from root with inputs before their users, and each node's idx
 * is its position. */
static int topo_sort(dsp_ctx *ctx, dsp_node *root, uint64_t gen,
                     dsp_node ***topo, int64_t *n_topo) {
  frame *stack = NULL;
  int64_t sp = 0, scap = 0, tcap = 0, nt = 0;
  dsp_node **order = NULL;
  int rc;
  if (root->released) return graph_freed(ctx, root);
  if ((rc = grow(ctx, (void **)&stack, &scap, 1, sizeof *stack)) < 0) goto fail;
  root->mark = gen;
  stack[sp++] = (frame){root, 0};
  while (sp > 0) {
    frame *f = &stack[sp - 1];
    dsp_node *child = NULL;
    while (f->next < f->node->n_in) {
      dsp_tensor *t = f->node->in[f->next++];
      if (t && t->node && t->node->mark != gen) {
        child = t->node;
        break;
      }
    }
    if (child) {
      if (child->released) {
        rc = graph_freed(ctx, child);
        goto fail;
      }
      child->mark = gen;
      if ((rc = grow(ctx, (void **)&stack, &scap, sp + 1, sizeof *stack)) < 0)
        goto fail;
      stack[sp++] = (frame){child, 0};
      continue;
    }
    if ((rc = grow(ctx, (void **)&order, &tcap, nt + 1, sizeof *order)) < 0)
      goto fail;
    f->node->idx = nt;
    order[nt++] = f->node;
    sp--;
  }
  dsp_free(stack);
  *topo = order;
  *n_topo = nt;
  return 0;
fail:
  dsp_free(stack);
  dsp_free(order);
  return rc;
}

/* grads[slot] += g, taking g's reference in every case. */
static int accumulate(dsp_ctx *ctx, dsp_tensor **slot, dsp_tensor *g) {
  if (!*slot) {
    *slot = g;
    return 0;
  }
  dsp_tensor *in[2] = {*slot, g}, *sum;
  int rc = dsp_op(ctx, DSP_OP_ADD, in, 2, NULL, &sum);
  dsp_tensor_unref(g);
  if (rc < 0) return rc;
  dsp_tensor_unref(*slot);
  *slot = sum;
  return 0;
}

static int seed_ones(dsp_ctx *ctx, const dsp_meta *m, dsp_tensor **out) {
  dsp_attrs a = dsp_attrs_none();
  a.ints[0] = m->dtype;
  for (int i = 0; i < m->ndim; i++) a.ints[1 + i] = m->shape[i];
  a.n_ints = 1 + m->ndim;
  return dsp_op(ctx, DSP_OP_ONES, NULL, 0, &a, out);
}

/* Runs node n's rule and adds each input's gradient to its slot. */
static int backprop_node(dsp_ctx *ctx, dsp_node *n, dsp_tensor *g,
                         dsp_tensor **grads) {
  dsp_tensor *gin[DSP_MAX_INPUTS] = {0};
  int rc = dsp__autodiff_rule(ctx, n, g, gin);
  for (int i = 0; i < n->n_in; i++) {
    dsp_tensor *gi = gin[i];
    gin[i] = NULL;
    if (!gi) continue;
    dsp_tensor *x = n->in[i];
    if (rc < 0 || !x->node) {
      dsp_tensor_unref(gi);
      continue;
    }
    if (!dsp_meta_equal(&gi->meta, &x->meta)) {
      char s1[128], s2[128];
      rc = dsp_seterr(ctx, DISPATCH_EINTERNAL,
                      "backward: rule of %s gave a %s gradient of shape %s "
                      "for input %d, a %s of shape %s",
                      dsp_op_lookup((int)n->op)->name,
                      dsp_dtype_name(gi->meta.dtype),
                      dsp_shape_str(&gi->meta, s1, sizeof s1), i,
                      dsp_dtype_name(x->meta.dtype),
                      dsp_shape_str(&x->meta, s2, sizeof s2));
      dsp_tensor_unref(gi);
      continue;
    }
    rc = accumulate(ctx, &grads[x->node->idx], gi);
  }
  return rc;
}

/* Computes the gradient of loss w.r.t. every tracked leaf it depends on.
 * On failure nothing is released and the graph can be walked again. */
int dsp_backward(dsp_ctx *ctx, dsp_tensor *loss, int retain,
                 dsp_grads **out) {
  if (!out) return dsp_seterr(ctx, DISPATCH_EINVAL, "backward: out is NULL");
  *out = NULL;
  if (!loss) return dsp_seterr(ctx, DISPATCH_EINVAL, "backward: loss is NULL");
  if (!loss->node)
    return dsp_seterr(ctx, DISPATCH_ENOTTRACKED,
                      "backward: loss is not tracked (no tracked input "
                      "reached it, or grad mode was off)");
  if (loss->numel != 1) {
    char s[128];
    return dsp_seterr(ctx, DISPATCH_ENOTSCALAR,
                      "backward: loss has shape %s (%lld elements); it needs "
                      "exactly one element",
                      dsp_shape_str(&loss->meta, s, sizeof s),
                      (long long)loss->numel);
  }
  uint64_t gen = atomic_fetch_add(&g_generation, 1) + 1;
  dsp_node **topo = NULL;
  int64_t nt = 0;
  int rc = topo_sort(ctx, loss->node, gen, &topo, &nt);
  if (rc < 0) return rc;

  int n_leaves = 0;
  for (int64_t i = 0; i < nt; i++) n_leaves += topo[i]->is_leaf;
  dsp_tensor **grads = dsp_calloc((size_t)nt, sizeof *grads);
  dsp_grads *res = NULL;
  int prev = dsp_set_grad_enabled(ctx, 0);
  /* the seed and every zeros a rule creates go on the loss's device, so a
   * graph that lives on a device other than the ctx's is not refused as
   * mixing devices */
  const dsp_backend *home = ctx->backend;
  ctx->backend = loss->storage->backend;
  if (!grads) {
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM, "backward: out of memory");
    goto done;
  }
  rc = grads_new(ctx, n_leaves, &res);
  if (rc < 0) goto done;
  rc = seed_ones(ctx, &loss->meta, &grads[nt - 1]);
  for (int64_t k = nt - 1; rc == 0 && k >= 0; k--) {
    dsp_node *n = topo[k];
    dsp_tensor *g = grads[k];
    if (!g) continue; /* only reached through non-differentiable inputs */
    if (n->is_leaf) {
      node_ref(n);
      res->nodes[res->n] = n;
      res->grads[res->n++] = g;
      grads[k] = NULL;
      continue;
    }
    rc = backprop_node(ctx, n, g, grads);
    grads[k] = NULL;
    dsp_tensor_unref(g); /* this gradient is complete and now spent */
  }
  if (rc == 0 && !retain) {
    /* pin every node first: releasing one node's inputs may drop the
     * last reference to another node of this list */
    for (int64_t i = 0; i < nt; i++) node_ref(topo[i]);
    for (int64_t i = 0; i < nt; i++)
      if (!topo[i]->is_leaf) {
        node_release_saved(topo[i]);
        topo[i]->released = 1;
      }
    for (int64_t i = 0; i < nt; i++) node_unref(topo[i]);
  }
done:
  dsp_set_grad_enabled(ctx, prev);
  ctx->backend = home;
  if (grads)
    for (int64_t i = 0; i < nt; i++) dsp_tensor_unref(grads[i]);
  dsp_free(grads);
  dsp_free(topo);
  if (rc < 0) {
    dsp_grads_free(res);
    return rc;
  }
  *out = res;
  return 0;
}
