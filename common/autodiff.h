/* Internal to the autodiff engine (common/autodiff.c) and its per-op
 * backward rules (common/autodiff_rules.c). */
#ifndef DSP_AUTODIFF_H
#define DSP_AUTODIFF_H

#include <stdint.h>

#include "dsp_internal.h"

/* One tape entry. A tracked tensor holds one reference to its node
 * (t->node); a grads container holds one per leaf it maps; backward holds
 * one per visited node while it runs. A node never points back at the
 * tensor it belongs to: ops that need their output for backward keep an
 * untracked alias of it (`out`), so there is no cycle out->node->out.
 * Inputs are older than the output, so the references in `in` form a DAG
 * and the last reference to a graph frees it all. */
typedef struct dsp_node {
  long refcount;
  int is_leaf;
  int released;     /* saved tensors dropped by a non-retained backward */
  dsp_opcode op;
  dsp_attrs attrs;
  dsp_meta meta;    /* the tracked tensor's meta */
  dsp_tensor *out;  /* untracked alias of the output, or NULL */
  /* scratch for a running backward: `mark` equals that pass's unique
   * generation once the node is visited, then `idx` is its place in the
   * topological order */
  uint64_t mark;
  int64_t idx;
  struct dsp_node *next_free; /* pending list of the iterative free */
  dsp_budget *budget;         /* charged for this node until freed */
  /* this node and the nodes its inputs keep alive, shared ones counted
   * once per path, saturating: dsp_tape_size */
  uint64_t tape;
  int n_in;
  dsp_tensor *in[]; /* one reference per input (NULL once released) */
} dsp_node;

/* 1 if `op`'s backward rule reads the op's output (saved as an alias). */
int dsp__autodiff_saves_output(dsp_opcode op);

/* Runs the backward rule of non-leaf node n: given g = d loss / d out,
 * stores in gin[i] a new reference to d loss / d in[i] for every input i
 * that is tracked (others may stay NULL). gin must come zeroed with n->n_in
 * slots; on failure the caller drops whatever was stored. Every
 * computation goes through dsp_op, so the caller must have turned grad mode
 * off. */
int dsp__autodiff_rule(dsp_ctx *ctx, const dsp_node *n, dsp_tensor *g,
                       dsp_tensor **gin);

#endif
