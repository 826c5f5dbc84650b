/* Captured graphs: the recorded ops of one step, as the client captured
 * them and as the server and the LOCAL device replay them. One IR and one
 * executor for both, so a REMOTE replay and a LOCAL replay run the same
 * core calls in the same order (bit-identical results by construction).
 *
 * Values live in numbered slots. Slots [0, n_inputs) are the placeholders
 * bound to fresh bytes at each replay; [n_inputs, n_inputs + n_ext) are
 * external tensors (parameters, optimizer state: tensors that existed
 * before the capture and keep their identity, updated in place by a step);
 * every later slot is internal: made by one node of the graph, private to
 * one replay and dropped at its end. Internal slots never get an id of the
 * session, so a replay cannot collide with the session's ids. */
#ifndef DSP_GRAPH_H
#define DSP_GRAPH_H

#include <stddef.h>
#include <stdint.h>

#include "dsp.h"

/* node kinds; the values are those of the wire (GraphNode.kind) */
typedef enum dsp_gkind {
  DSP_G_OP = 0,       /* in: op inputs; out: result; flags: no_grad */
  DSP_G_TRACK = 1,    /* in: [tensor] made a tracked leaf */
  DSP_G_BACKWARD = 2, /* in: [loss]; out: a gradient container; flags:
                         retain */
  DSP_G_GRAD = 3,     /* in: [container, leaf]; out: the leaf's gradient */
  DSP_G_STEP = 4,     /* op sgd/adam/adamw; in: [container, params...,
                         states...]
                         (k states per param, param i's at n+i*k) */
  DSP_G_FREE = 5      /* in: slots released here (internal or inputs) */
} dsp_gkind;

#define DSP_G_NO_GRAD 1 /* flags of an OP */
#define DSP_G_RETAIN 1  /* flags of a BACKWARD */

/* Bounds on what a definition may declare (judged before allocating) */
#define DSP_GRAPH_MAX_SLOTS (1u << 22)
#define DSP_GRAPH_MAX_NODES (1u << 22)
#define DSP_GRAPH_MAX_STEP_IN (1u << 20)

typedef struct dsp_gnode {
  int kind;
  int op;       /* OP, STEP: a dsp_opcode */
  int flags;
  uint32_t n_in;
  uint32_t *in; /* slots */
  uint32_t out; /* OP, BACKWARD, GRAD */
  dsp_attrs a;
  /* STEP (wire 1.5): the clip's max_norm (0: none) and adamw's decays
   * (n_wd: 0, all 0; else one per parameter), as in a Step message */
  double max_norm;
  uint32_t n_wd;
  double *wd;
} dsp_gnode;

typedef struct dsp_graph {
  uint32_t n_inputs, n_ext, n_slots;
  dsp_meta *input_meta; /* n_inputs */
  size_t n_nodes, cap_nodes;
  dsp_gnode *nodes;
  uint32_t n_outputs;
  uint32_t *outputs;    /* slots whose tensors a replay hands back */
  uint8_t *slot_grads;  /* per slot: 1 when it holds a gradient container
                           (set by dsp_graph_check) */
  /* the dsp_ctx_work every replay does at least, whatever the shapes
   * (DSP_WORK_PER_OP per node and per update of a STEP, a quarter of it
   * per operand of a FREE, one per slot): set by dsp_graph_check */
  uint64_t static_work;
  /* 0: none; else a replay whose dsp_ctx_work would pass this much fails
   * with DISPATCH_ELIMIT before the op or node that passes it runs (the
   * server's --max-replay-cost) */
  uint64_t max_work;
} dsp_graph;

/* An empty graph (zeroed); NULL when out of memory. */
dsp_graph *dsp_graph_new(void);
/* Frees the graph and everything it owns. NULL ok. */
void dsp_graph_free(dsp_graph *g);
/* Appends a node, copying in[0..n_in-1]; 0 or DISPATCH_ENOMEM (g as it
 * was). */
int dsp_graph_add(dsp_graph *g, int kind, int op, int flags,
                  const uint32_t *in, uint32_t n_in, uint32_t out,
                  const dsp_attrs *a);
/* Sets the last node's (a STEP's) clip and decays, copying wd[0..n_wd-1];
 * 0 or DISPATCH_ENOMEM (the node as it was). dsp_graph_check judges them. */
int dsp_graph_set_step(dsp_graph *g, double max_norm, const double *wd,
                       uint32_t n_wd);
/* Bytes the graph holds, for quotas. */
uint64_t dsp_graph_bytes(const dsp_graph *g);

/* Checks a definition from anywhere (the network included) so that a
 * replay can only fail in a core call: slot numbers in range, every slot
 * read is live and of the right sort (tensor or gradient container), each
 * internal slot made once before it is read, no external slot released,
 * op codes known (no optimizer op outside a STEP), attribute counts within
 * bounds, outputs live tensors at the end, each slot named as an output
 * at most once, input metas valid. Fills
 * g->slot_grads. 0 or DISPATCH_EINVAL / EUNSUPPORTED / ENOMEM with the
 * node named in ctx's message ("op 3 (matmul): input 1 is slot 9, which
 * nothing made before"). Sets g->static_work. */
int dsp_graph_check(dsp_ctx *ctx, dsp_graph *g);

/* Runs a checked graph once in ctx. inputs[0..n_inputs-1] and
 * ext[0..n_ext-1] are borrowed (the caller checked the inputs' metas);
 * on success outputs[0..n_outputs-1] get one new reference each. Adam's
 * step count of each STEP is its recorded one plus adam_offset. *n_ops
 * counts the ops and parameter updates run. Every internal value is
 * released before it returns, on failure too; nodes before a failing one
 * have run (a step's parameters stay updated). The error names the node:
 * "op 7 (matmul): ..." (ops counted from 0, FREE nodes not counted).
 * Every node adds its work to dsp_ctx_work, the kinds that run no op
 * (track, backward, grad, step, free) their own share too, so a replay's
 * work is never 0; past g->max_work the run stops with DISPATCH_ELIMIT.
 * A cancelled ctx stops it at the next node boundary with
 * DISPATCH_ECANCELED, whatever the node's kind. */
int dsp_graph_run(dsp_ctx *ctx, const dsp_graph *g, dsp_tensor *const *inputs,
                  dsp_tensor *const *ext, int64_t adam_offset,
                  dsp_tensor **outputs, uint64_t *n_ops);

#endif
