/* Graph capture and replay (public dispatch_graph_*): the capture hooks
 * record what the op runner, uploads, autodiff and optimizers did into a
 * common dsp_graph whose slots are numbered as they appear; the end
 * renumbers them (inputs, externals, internals), and a replay runs the
 * graph in process (LOCAL) or sends it once to the server and then one
 * GraphReplay per step (REMOTE). */
#include <stdio.h>
#include <string.h>

#include "client_internal.h"
#include "dispatch.pb-c.h"
#include "graph.h"

enum { SL_INPUT = 0, SL_EXT, SL_INTERNAL };

typedef struct cap_slot {
  int kind;
  dispatch_tensor *ext; /* SL_EXT: one reference */
  dsp_meta meta;        /* SL_INPUT */
  int is_output;
} cap_slot;

struct dispatch__capture {
  dsp_graph *g; /* nodes in capture numbering */
  cap_slot *slots;
  uint32_t n_slots, cap_slots;
  uint32_t *outputs;
  dsp_meta *out_meta;
  uint32_t n_out, cap_out;
  int err; /* first failure: dispatch_graph_end reports it */
  char msg[256];
};

struct dispatch_graph {
  dispatch_device *dev;
  dsp_graph *g;
  dispatch_tensor **ext; /* n_ext references */
  /* the caller's outputs, in dispatch_graph_output order; a tensor named
   * twice is one output of g (a slot is sent once) that both take */
  uint32_t n_out;
  dsp_meta *out_meta; /* n_out */
  uint32_t *out_ix;   /* n_out: its output of g */
  size_t *out_off;    /* g->n_outputs + 1: where each starts in a reply */
  uint64_t id;
  uint64_t replays; /* LOCAL: Adam's step offset, as the server keeps it */
  uint8_t *scratch;
  size_t scratch_cap;
  dispatch_graph *prev, *next;
};

static void broken(struct dispatch__capture *c, int code, const char *msg) {
  if (c->err) return;
  c->err = code;
  snprintf(c->msg, sizeof c->msg, "%s", msg);
}

/* A new slot of kind; UINT32_MAX (and the capture broken) when out of
 * memory. */
static uint32_t new_slot(struct dispatch__capture *c, int kind) {
  if (c->n_slots == c->cap_slots) {
    uint32_t cap = c->cap_slots ? c->cap_slots * 2 : 64;
    cap_slot *ns = dsp_realloc(c->slots, cap * sizeof *ns);
    if (!ns || c->n_slots >= DSP_GRAPH_MAX_SLOTS) {
      if (ns) c->slots = ns;
      broken(c, DISPATCH_ENOMEM, "graph: out of memory for its values");
      return UINT32_MAX;
    }
    c->slots = ns;
    c->cap_slots = cap;
  }
  cap_slot *s = &c->slots[c->n_slots];
  memset(s, 0, sizeof *s);
  s->kind = kind;
  return c->n_slots++;
}

/* The slot of a plain tensor: its own, or a new external slot holding a
 * reference to a tensor made before the capture. */
static uint32_t slot_of(struct dispatch__capture *c, dispatch_tensor *t) {
  if (t->gslot) return t->gslot - 1;
  uint32_t s = new_slot(c, SL_EXT);
  if (s == UINT32_MAX) return s;
  c->slots[s].ext = dispatch_tensor_ref(t);
  t->gslot = s + 1;
  return s;
}

static void add(struct dispatch__capture *c, int kind, int op, int flags,
                const uint32_t *in, uint32_t n_in, uint32_t out,
                const dsp_attrs *a) {
  if (c->err) return;
  for (uint32_t i = 0; i < n_in; i++)
    if (in[i] == UINT32_MAX) return;
  if (dsp_graph_add(c->g, kind, op, flags, in, n_in, out, a) < 0)
    broken(c, DISPATCH_ENOMEM, "graph: out of memory for its nodes");
}

void dispatch__graph_op(dispatch_device *dev, dsp_opcode op,
                        dispatch_tensor *const *in, int n_in,
                        const dsp_attrs *a, int no_grad,
                        dispatch_tensor *out) {
  struct dispatch__capture *c = dev->capture;
  uint32_t ins[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) ins[i] = slot_of(c, in[i]);
  uint32_t o = new_slot(c, SL_INTERNAL);
  if (o == UINT32_MAX) return;
  out->gslot = o + 1;
  add(c, DSP_G_OP, (int)op, no_grad ? DSP_G_NO_GRAD : 0, ins, (uint32_t)n_in,
      o, a);
}

void dispatch__graph_input(dispatch_tensor *t) {
  struct dispatch__capture *c = t->dev->capture;
  uint32_t s = new_slot(c, SL_INPUT);
  if (s == UINT32_MAX) return;
  c->slots[s].meta = t->meta;
  t->gslot = s + 1;
}

void dispatch__graph_track(dispatch_tensor *t) {
  struct dispatch__capture *c = t->dev->capture;
  /* a tensor from before the capture stays tracked for good: only one
   * made inside is tracked again by each replay */
  if (!t->gslot) return;
  uint32_t s = t->gslot - 1;
  if (c->slots[s].kind == SL_EXT) return;
  add(c, DSP_G_TRACK, 0, 0, &s, 1, 0, NULL);
}

void dispatch__graph_backward(dispatch_tensor *loss, int retain,
                              dispatch_grads *g) {
  struct dispatch__capture *c = loss->dev->capture;
  uint32_t l = slot_of(c, loss);
  uint32_t o = new_slot(c, SL_INTERNAL);
  if (o == UINT32_MAX) return;
  g->gslot = o + 1;
  add(c, DSP_G_BACKWARD, 0, retain ? DSP_G_RETAIN : 0, &l, 1, o, NULL);
}

static int grads_slot(struct dispatch__capture *c, dispatch_grads *g,
                      uint32_t *s) {
  if (!g->gslot) {
    broken(c, DISPATCH_EINVAL,
           "graph: the capture uses gradients made before it began (run "
           "the backward inside the capture)");
    return -1;
  }
  *s = g->gslot - 1;
  return 0;
}

void dispatch__graph_grad(dispatch_grads *g, dispatch_tensor *leaf,
                          dispatch_tensor *out) {
  struct dispatch__capture *c = g->dev->capture;
  uint32_t in[2];
  if (grads_slot(c, g, &in[0]) < 0) return;
  in[1] = slot_of(c, leaf);
  uint32_t o = new_slot(c, SL_INTERNAL);
  if (o == UINT32_MAX) return;
  out->gslot = o + 1;
  add(c, DSP_G_GRAD, 0, 0, in, 2, o, NULL);
}

void dispatch__graph_step(dispatch_optim *opt, dispatch_grads *g,
                          const dsp_attrs *a) {
  struct dispatch__capture *c = opt->dev->capture;
  uint32_t n = (uint32_t)opt->n, k = (uint32_t)opt->k;
  if (opt->ls_scale) {
    /* a replay would need the scale's skip and update in the graph */
    broken(c, DISPATCH_EUNSUPPORTED,
           "graph: a step with loss scaling cannot be captured");
    return;
  }
  uint32_t *in = dsp_calloc(1 + n + n * k, sizeof *in);
  if (!in) {
    broken(c, DISPATCH_ENOMEM, "graph: out of memory for a step");
    return;
  }
  if (grads_slot(c, g, &in[0]) == 0) {
    for (uint32_t i = 0; i < n; i++)
      in[1 + i] = slot_of(c, opt->params[i]->inner);
    for (uint32_t i = 0; i < n * k; i++)
      in[1 + n + i] = slot_of(c, opt->states[i]);
    size_t before = c->g->n_nodes;
    add(c, DSP_G_STEP, (int)opt->op, 0, in, 1 + n + n * k, 0, a);
    /* the clip and the decays replay with the node, as a Step carries them */
    if (c->g->n_nodes > before &&
        dsp_graph_set_step(c->g, opt->max_norm, opt->wd, opt->wd ? n : 0) < 0)
      broken(c, DISPATCH_ENOMEM, "graph: out of memory for a step");
  }
  dsp_free(in);
}

/* An output stays alive to the end of every replay, whatever the capture
 * freed: its release is not recorded. */
void dispatch__graph_forget(dispatch_tensor *t) {
  struct dispatch__capture *c = t->dev->capture;
  uint32_t s = t->gslot - 1;
  t->gslot = 0;
  if (c->slots[s].kind == SL_EXT || c->slots[s].is_output) return;
  add(c, DSP_G_FREE, 0, 0, &s, 1, 0, NULL);
}

void dispatch__graph_forget_grads(dispatch_grads *g) {
  struct dispatch__capture *c = g->dev->capture;
  uint32_t s = g->gslot - 1;
  g->gslot = 0;
  add(c, DSP_G_FREE, 0, 0, &s, 1, 0, NULL);
}

/* Clears every handle's slot and frees the capture (its external
 * references go unless they were handed to a graph: ext set to NULL). */
static void capture_drop(dispatch_device *dev) {
  struct dispatch__capture *c = dev->capture;
  if (!c) return;
  dev->capture = NULL;
  for (dispatch_tensor *t = dev->all; t; t = t->anext) t->gslot = 0;
  for (dispatch_grads *g = dev->grads; g; g = g->next) g->gslot = 0;
  for (uint32_t i = 0; i < c->n_slots; i++)
    if (c->slots[i].ext) dispatch_tensor_free(c->slots[i].ext);
  dsp_graph_free(c->g);
  dsp_free(c->slots);
  dsp_free(c->outputs);
  dsp_free(c->out_meta);
  dsp_free(c);
}

int dispatch_graph_begin(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "graph_begin");
  if (dev->capture)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "graph_begin: a capture is open on "
                                         "this device already"));
  struct dispatch__capture *c = dsp_calloc(1, sizeof *c);
  if (c) c->g = dsp_graph_new();
  if (!c || !c->g) {
    dsp_free(c);
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "graph_begin: out of memory"));
  }
  dev->capture = c;
  return 0;
}

int dispatch_graph_input(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                         const int64_t *shape, const void *data,
                         size_t nbytes, dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "graph_input");
  if (!dev->capture)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "graph_input: no capture is open "
                                         "on this device"));
  return dispatch_tensor_from_data(dev, dtype, ndim, shape, data, nbytes,
                                   out);
}

int dispatch_graph_output(dispatch_tensor *t) {
  if (!t) return DISPATCH_EINVAL;
  dispatch_device *dev = t->dev;
  DISPATCH__GUARD(dev, "graph_output");
  struct dispatch__capture *c = dev->capture;
  if (!c)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "graph_output: no capture is open "
                                         "on this tensor's device"));
  t = dispatch_inner(t);
  if (c->n_out == c->cap_out) {
    uint32_t cap = c->cap_out ? c->cap_out * 2 : 8;
    uint32_t *no = dsp_realloc(c->outputs, cap * sizeof *no);
    if (no) c->outputs = no;
    dsp_meta *nm = no ? dsp_realloc(c->out_meta, cap * sizeof *nm) : NULL;
    if (nm) c->out_meta = nm;
    if (!no || !nm)
      return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                           "graph_output: out of memory"));
    c->cap_out = cap;
  }
  uint32_t s = slot_of(c, t);
  if (s == UINT32_MAX)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, c->err, "%s", c->msg));
  c->slots[s].is_output = 1;
  c->outputs[c->n_out] = s;
  c->out_meta[c->n_out] = t->meta;
  return (int)c->n_out++;
}

static size_t meta_bytes(const dsp_meta *m) {
  size_t n = dsp_dtype_size(m->dtype);
  for (int i = 0; i < m->ndim; i++) n *= (size_t)m->shape[i];
  return n;
}

static void graph_destroy(dispatch_graph *gr) {
  if (!gr) return;
  for (uint32_t i = 0; gr->ext && gr->g && i < gr->g->n_ext; i++)
    dispatch_tensor_free(gr->ext[i]);
  dsp_free(gr->ext);
  dsp_graph_free(gr->g);
  dsp_free(gr->out_meta);
  dsp_free(gr->out_ix);
  dsp_free(gr->out_off);
  dsp_free(gr->scratch);
  dsp_free(gr);
}

/* The capture's nodes in the final numbering: inputs, then externals (in
 * the order first used), then internal values. The external references
 * move from the capture to the graph. */
static int build(dispatch_device *dev, struct dispatch__capture *c,
                 dispatch_graph *gr) {
  uint32_t *map = dsp_calloc(c->n_slots ? c->n_slots : 1, sizeof *map);
  dsp_graph *g = dsp_graph_new();
  gr->g = g;
  if (!map || !g) {
    dsp_free(map);
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "graph_end: out of memory");
  }
  uint32_t n_in = 0, n_ext = 0;
  for (uint32_t i = 0; i < c->n_slots; i++) {
    n_in += c->slots[i].kind == SL_INPUT;
    n_ext += c->slots[i].kind == SL_EXT;
  }
  g->n_inputs = n_in;
  g->n_ext = n_ext;
  g->n_slots = c->n_slots;
  g->input_meta = dsp_calloc(n_in ? n_in : 1, sizeof *g->input_meta);
  gr->ext = dsp_calloc(n_ext ? n_ext : 1, sizeof *gr->ext);
  g->outputs = dsp_calloc(c->n_out ? c->n_out : 1, sizeof *g->outputs);
  gr->out_meta = dsp_calloc(c->n_out ? c->n_out : 1, sizeof *gr->out_meta);
  gr->out_ix = dsp_calloc(c->n_out ? c->n_out : 1, sizeof *gr->out_ix);
  gr->out_off = dsp_calloc(c->n_out + 1, sizeof *gr->out_off);
  /* per capture slot: 1 + its output of g, 0 while it is none */
  uint32_t *seen = dsp_calloc(c->n_slots ? c->n_slots : 1, sizeof *seen);
  int rc = 0;
  if (!g->input_meta || !gr->ext || !g->outputs || !gr->out_meta ||
      !gr->out_ix || !gr->out_off || !seen)
    rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "graph_end: out of memory");
  uint32_t ni = 0, ne = 0, nx = n_in + n_ext;
  for (uint32_t i = 0; i < c->n_slots && rc == 0; i++) {
    cap_slot *s = &c->slots[i];
    if (s->kind == SL_INPUT) {
      g->input_meta[ni] = s->meta;
      map[i] = ni++;
    } else if (s->kind == SL_EXT) {
      gr->ext[ne] = s->ext;
      s->ext = NULL;
      map[i] = n_in + ne++;
    } else {
      map[i] = nx++;
    }
  }
  for (size_t i = 0; i < c->g->n_nodes && rc == 0; i++) {
    dsp_gnode *n = &c->g->nodes[i];
    for (uint32_t q = 0; q < n->n_in; q++) n->in[q] = map[n->in[q]];
    if (n->kind == DSP_G_OP || n->kind == DSP_G_BACKWARD ||
        n->kind == DSP_G_GRAD)
      n->out = map[n->out];
  }
  if (rc == 0) {
    /* the nodes move over as they are */
    g->nodes = c->g->nodes;
    g->n_nodes = c->g->n_nodes;
    g->cap_nodes = c->g->cap_nodes;
    c->g->nodes = NULL;
    c->g->n_nodes = c->g->cap_nodes = 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->n_out; i++) {
      uint32_t s = c->outputs[i];
      if (!seen[s]) {
        g->outputs[n] = map[s];
        gr->out_off[n + 1] = gr->out_off[n] + meta_bytes(&c->out_meta[i]);
        seen[s] = ++n;
      }
      gr->out_ix[i] = seen[s] - 1;
      gr->out_meta[i] = c->out_meta[i];
    }
    g->n_outputs = n;
    gr->n_out = c->n_out;
    rc = dsp_graph_check(dev->ctx, g);
  }
  dsp_free(seen);
  dsp_free(map);
  return rc;
}

static void meta_to_wire(const dsp_meta *m, Dspwire__TensorMeta *w) {
  dspwire__tensor_meta__init(w);
  w->dtype = (int32_t)m->dtype;
  w->n_shape = (size_t)m->ndim;
  w->shape = (int64_t *)m->shape;
}

/* One GraphDefine for the whole graph, then a sync so that a refusal
 * surfaces at dispatch_graph_end rather than at the first replay. */
static int define_remote(dispatch_device *dev, dispatch_graph *gr) {
  const dsp_graph *g = gr->g;
  Dspwire__GraphDefine d = DSPWIRE__GRAPH_DEFINE__INIT;
  Dspwire__TensorMeta *metas = dsp_calloc(g->n_inputs + 1, sizeof *metas);
  Dspwire__TensorMeta **mp = dsp_calloc(g->n_inputs + 1, sizeof *mp);
  uint64_t *ext = dsp_calloc(g->n_ext + 1, sizeof *ext);
  Dspwire__GraphNode *nodes = dsp_calloc(g->n_nodes + 1, sizeof *nodes);
  Dspwire__GraphNode **np = dsp_calloc(g->n_nodes + 1, sizeof *np);
  int rc = 0;
  if (!metas || !mp || !ext || !nodes || !np) {
    rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "graph_end: out of memory");
    goto out;
  }
  for (uint32_t i = 0; i < g->n_inputs; i++) {
    meta_to_wire(&g->input_meta[i], &metas[i]);
    mp[i] = &metas[i];
  }
  for (uint32_t i = 0; i < g->n_ext; i++) ext[i] = gr->ext[i]->id;
  for (size_t i = 0; i < g->n_nodes; i++) {
    dsp_gnode *n = &g->nodes[i];
    Dspwire__GraphNode *w = &nodes[i];
    dspwire__graph_node__init(w);
    w->kind = n->kind;
    w->op = n->op;
    w->flags = n->flags;
    w->n_inputs = n->n_in;
    w->inputs = n->in;
    w->output = n->out;
    w->n_ints = (size_t)n->a.n_ints;
    w->ints = n->a.ints;
    w->n_floats = (size_t)n->a.n_floats;
    w->floats = n->a.floats;
    w->max_norm = n->max_norm;
    w->n_weight_decay = n->n_wd;
    w->weight_decay = n->wd;
    /* a 1.4 server would skip these two fields unread */
    if (dev->conn->server_minor < 5 &&
        (n->max_norm > 0.0 || n->op == DSP_OP_ADAMW_STEP) &&
        n->kind == DSP_G_STEP) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                      "graph_end: a %s step needs a server of protocol 1.5, "
                      "\"%s\" speaks 1.%u",
                      n->op == DSP_OP_ADAMW_STEP ? "adamw" : "clipped",
                      dev->spec, dev->conn->server_minor);
      goto out;
    }
    np[i] = w;
  }
  d.graph = gr->id;
  d.n_inputs = g->n_inputs;
  d.inputs = mp;
  d.n_externals = g->n_ext;
  d.externals = ext;
  d.n_slots = g->n_slots;
  d.n_nodes = g->n_nodes;
  d.nodes = np;
  d.n_outputs = g->n_outputs;
  d.outputs = g->outputs;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_DEFINE;
  req.graph_define = &d;
  rc = dispatch__remote_queue(dev, &req);
  if (rc == 0) rc = dispatch__remote_sync(dev);
out:
  dsp_free(metas);
  dsp_free(mp);
  dsp_free(ext);
  dsp_free(nodes);
  dsp_free(np);
  return rc;
}

/* The REMOTE row's graph_define: the server may hold the graph after a
 * refusal (a deferred error of the captured step), so it is freed then. */
int dispatch__graph_define_remote(dispatch_graph *gr) {
  dispatch_device *dev = gr->dev;
  int rc = define_remote(dev, gr);
  if (rc < 0) dev->ops->graph_free(dev, gr->id);
  return rc;
}

int dispatch_graph_end(dispatch_device *dev, dispatch_graph **out) {
  if (out) *out = NULL;
  if (!dev || !out) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "graph_end");
  struct dispatch__capture *c = dev->capture;
  if (!c)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "graph_end: no capture is open on "
                                         "this device"));
  int rc = 0;
  if (c->err) rc = dsp_seterr(dev->ctx, c->err, "%s", c->msg);
  dispatch_graph *gr = NULL;
  if (rc == 0) {
    gr = dsp_calloc(1, sizeof *gr);
    if (!gr)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "graph_end: out of memory");
  }
  if (rc == 0) {
    gr->dev = dev;
    gr->id = dispatch__remote_new_id(dev);
    rc = build(dev, c, gr);
  }
  capture_drop(dev);
  if (rc == 0) rc = dev->ops->graph_define(gr);
  if (rc < 0) {
    graph_destroy(gr);
    return dispatch__ret(dev, rc);
  }
  gr->next = dev->graphs;
  if (dev->graphs) dev->graphs->prev = gr;
  dev->graphs = gr;
  *out = gr;
  return 0;
}

int dispatch_graph_n_inputs(const dispatch_graph *g) {
  return g ? (int)g->g->n_inputs : DISPATCH_EINVAL;
}

int dispatch_graph_n_outputs(const dispatch_graph *g) {
  return g ? (int)g->n_out : DISPATCH_EINVAL;
}

size_t dispatch_graph_output_nbytes(const dispatch_graph *g, int i) {
  if (!g || i < 0 || (uint32_t)i >= g->n_out) return 0;
  return meta_bytes(&g->out_meta[i]);
}

static int scratch(dispatch_graph *gr, size_t n) {
  if (gr->scratch_cap >= n) return 0;
  uint8_t *p = dsp_realloc(gr->scratch, n ? n : 1);
  if (!p)
    return dsp_seterr(gr->dev->ctx, DISPATCH_ENOMEM,
                      "graph_replay: out of memory (%zu bytes)", n);
  gr->scratch = p;
  gr->scratch_cap = n;
  return 0;
}

/* Every count, dtype, shape and byte size is checked before anything
 * runs, on both kinds, with the same messages. */
static int check_io(dispatch_graph *gr, const dispatch_graph_io *in, int n_in,
                    const dispatch_graph_io *out, int n_out) {
  dispatch_device *dev = gr->dev;
  const dsp_graph *g = gr->g;
  if (n_in != (int)g->n_inputs || n_out != (int)gr->n_out ||
      (n_in && !in) || (n_out && !out))
    return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "graph_replay: graph %llu has %u inputs and %u outputs, "
                      "got %d and %d",
                      (unsigned long long)gr->id, g->n_inputs, gr->n_out,
                      n_in, n_out);
  for (int i = 0; i < n_in; i++) {
    const dsp_meta *p = &g->input_meta[i];
    int same = (int)in[i].dtype == (int)p->dtype && in[i].ndim == p->ndim &&
               (in[i].ndim == 0 || in[i].shape);
    for (int d = 0; same && d < p->ndim; d++)
      same = in[i].shape[d] == p->shape[d];
    if (!same) {
      char a[160] = "?", b[160];
      if (in[i].ndim >= 0 && in[i].ndim <= DSP_MAX_DIMS &&
          (in[i].ndim == 0 || in[i].shape)) {
        dsp_meta m;
        memset(&m, 0, sizeof m);
        m.ndim = in[i].ndim;
        for (int d = 0; d < m.ndim; d++) m.shape[d] = in[i].shape[d];
        dsp_shape_str(&m, a, sizeof a);
      }
      return dsp_seterr(dev->ctx, DISPATCH_ESHAPE,
                        "graph_replay: graph %llu input %d is %s %s, its "
                        "placeholder %s %s",
                        (unsigned long long)gr->id, i,
                        dsp_dtype_name((dsp_dtype)in[i].dtype), a,
                        dsp_dtype_name(p->dtype),
                        dsp_shape_str(p, b, sizeof b));
    }
    size_t nb = meta_bytes(p);
    if (in[i].nbytes != nb || (nb && !in[i].data))
      return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "graph_replay: graph %llu input %d has %zu bytes, "
                        "needs %zu",
                        (unsigned long long)gr->id, i, in[i].nbytes, nb);
    if (p->dtype == DSP_BOOL) {
      int rc = dsp_check_bool_bytes(dev->ctx, in[i].data, nb);
      if (rc < 0) return rc;
    }
  }
  for (int i = 0; i < n_out; i++) {
    size_t nb = meta_bytes(&gr->out_meta[i]);
    if (out[i].nbytes != nb || (nb && !out[i].data))
      return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "graph_replay: graph %llu output %d needs %zu bytes, "
                        "got room for %zu",
                        (unsigned long long)gr->id, i, nb, out[i].nbytes);
  }
  return 0;
}

int dispatch__graph_replay_local(dispatch_graph *gr,
                                 const dispatch_graph_io *in,
                                 const dispatch_graph_io *out) {
  dispatch_device *dev = gr->dev;
  const dsp_graph *g = gr->g;
  size_t n = (size_t)g->n_inputs + g->n_ext + g->n_outputs;
  dsp_tensor **ts = dsp_calloc(n ? n : 1, sizeof *ts);
  if (!ts)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "graph_replay: out of memory");
  dsp_tensor **tin = ts, **text = ts + g->n_inputs,
             **tout = text + g->n_ext;
  int rc = 0;
  for (uint32_t i = 0; i < g->n_inputs && rc == 0; i++)
    rc = dsp_tensor_from_data(dev->ctx, &g->input_meta[i], in[i].data,
                              in[i].nbytes, &tin[i]);
  for (uint32_t i = 0; i < g->n_ext; i++) text[i] = gr->ext[i]->local;
  if (rc == 0) {
    gr->replays++;
    rc = dsp_graph_run(dev->ctx, g, tin, text, (int64_t)gr->replays, tout,
                       &dev->local_stats.ops);
    if (rc < 0) {
      char m[512];
      snprintf(m, sizeof m, "%s", dsp_ctx_errmsg(dev->ctx));
      rc = dsp_seterr(dev->ctx, rc, "graph %llu, %s",
                      (unsigned long long)gr->id, m);
      dev->local_stats.errors++;
    }
  }
  for (uint32_t i = 0; i < gr->n_out && rc == 0; i++)
    rc = dsp_tensor_read(dev->ctx, tout[gr->out_ix[i]], out[i].data,
                         out[i].nbytes);
  for (uint32_t i = 0; i < g->n_inputs; i++) dsp_tensor_unref(tin[i]);
  for (uint32_t i = 0; i < g->n_outputs; i++) dsp_tensor_unref(tout[i]);
  dsp_free(ts);
  return rc;
}

int dispatch__graph_replay_remote(dispatch_graph *gr,
                                  const dispatch_graph_io *in,
                                  const dispatch_graph_io *out) {
  dispatch_device *dev = gr->dev;
  const dsp_graph *g = gr->g;
  size_t in_len = 0, out_len = gr->out_off[g->n_outputs];
  for (uint32_t i = 0; i < g->n_inputs; i++) in_len += in[i].nbytes;
  /* one input goes from the caller's memory, several are gathered; one
   * output lands in the caller's memory, several (or one named twice)
   * are scattered */
  int scatter = gr->n_out > 1;
  const void *bulk = g->n_inputs == 1 ? in[0].data : NULL;
  void *dst = gr->n_out == 1 ? out[0].data : NULL;
  size_t need = (g->n_inputs > 1 ? in_len : 0) + (scatter ? out_len : 0);
  int rc = scratch(gr, need);
  if (rc < 0) return rc;
  if (g->n_inputs > 1) {
    size_t off = 0;
    for (uint32_t i = 0; i < g->n_inputs; i++) {
      if (in[i].nbytes) memcpy(gr->scratch + off, in[i].data, in[i].nbytes);
      off += in[i].nbytes;
    }
    bulk = gr->scratch;
  }
  if (scatter) dst = gr->scratch + (g->n_inputs > 1 ? in_len : 0);
  Dspwire__TensorMeta mstack[8], *pstack[8];
  Dspwire__TensorMeta *metas = mstack, **mp = pstack;
  if (g->n_inputs > 8) {
    metas = dsp_calloc(g->n_inputs, sizeof *metas);
    mp = dsp_calloc(g->n_inputs, sizeof *mp);
    if (!metas || !mp) {
      dsp_free(metas);
      dsp_free(mp);
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "graph_replay: out of memory");
    }
  }
  for (uint32_t i = 0; i < g->n_inputs; i++) {
    meta_to_wire(&g->input_meta[i], &metas[i]);
    mp[i] = &metas[i];
  }
  Dspwire__GraphReplay r = DSPWIRE__GRAPH_REPLAY__INIT;
  r.graph = gr->id;
  r.n_inputs = g->n_inputs;
  r.inputs = mp;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_REPLAY;
  req.graph_replay = &r;
  Dspwire__Reply *rep = NULL;
  rc = dispatch__remote_call(dev, &req, bulk, in_len, dst, out_len, &rep);
  if (metas != mstack) {
    dsp_free(metas);
    dsp_free(mp);
  }
  if (rc == 0) {
    int ok = rep && rep->body_case == DSPWIRE__REPLY__BODY_GRAPH &&
             rep->graph->n_outputs == g->n_outputs;
    for (uint32_t i = 0; ok && i < gr->n_out; i++) {
      const Dspwire__TensorMeta *m = rep->graph->outputs[gr->out_ix[i]];
      const dsp_meta *want = &gr->out_meta[i];
      ok = m->dtype == (int32_t)want->dtype &&
           m->n_shape == (size_t)want->ndim;
      for (int d = 0; ok && d < want->ndim; d++)
        ok = m->shape[d] == want->shape[d];
    }
    if (!ok)
      rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                      "graph_replay: the server's reply does not carry the "
                      "graph's %u outputs",
                      g->n_outputs);
  }
  dispatch__remote_reply_free(rep);
  if (rc == 0 && scatter) {
    const uint8_t *src = dst;
    for (uint32_t i = 0; i < gr->n_out; i++)
      if (out[i].nbytes)
        memcpy(out[i].data, src + gr->out_off[gr->out_ix[i]], out[i].nbytes);
  }
  return rc;
}

int dispatch_graph_replay(dispatch_graph *g, const dispatch_graph_io *in,
                          int n_in, const dispatch_graph_io *out, int n_out) {
  if (!g) return DISPATCH_EINVAL;
  dispatch_device *dev = g->dev;
  DISPATCH__GUARD(dev, "graph_replay");
  if (dev->capture)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "graph_replay: a capture is open on "
                                         "this device"));
  int rc = check_io(g, in, n_in, out, n_out);
  if (rc == 0)
    rc = dev->ops->graph_replay(g, in, out);
  return dispatch__ret(dev, rc);
}

void dispatch_graph_free(dispatch_graph *g) {
  if (!g) return;
  dispatch_device *dev = g->dev;
  if (g->prev)
    g->prev->next = g->next;
  else
    dev->graphs = g->next;
  if (g->next) g->next->prev = g->prev;
  dev->ops->graph_free(dev, g->id);
  graph_destroy(g);
}

void dispatch__graph_close_all(dispatch_device *dev) {
  capture_drop(dev);
  while (dev->graphs) dispatch_graph_free(dev->graphs);
}
