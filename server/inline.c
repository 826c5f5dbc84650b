/* Which ops the loop thread may run itself (issue 11 item 4).
 *
 * Handing an op to a worker costs two thread wake-ups: the loop signals a
 * sleeping worker, and the worker's uv_async wakes the loop with the
 * result. On a virtual machine each is worth tens of microseconds, far
 * more than an add of a few thousand floats. So when a session is idle
 * (nothing queued, nothing running: the loop may touch its state, as it
 * does for Sync and Read) and an op's estimated work (dsp_op_cost) is at
 * most --inline-cost, the loop runs it (and likewise a Free of a few
 * small tensors, which a client sends batched before its next wait, or
 * an upload of a few thousand bytes, whose bytes the loop has already put
 * in place) through the same sv_session_exec a
 * worker would call: same checks, same deferred errors, same order (there
 * is nothing before it to overtake). The records of an Ops request (1.3)
 * are judged one by one as they come: the loop runs them while each one
 * passes, and hands the rest of the request to a worker at the first that
 * does not. This file only judges; net.c runs.
 *
 * The judgement reads the session's tensor table, so it too runs only
 * while the session is idle. It refuses rather than guesses: an op whose
 * inputs are missing or poisoned, whose shapes do not infer, or which
 * names a device or has an input off the CPU goes to the pool, where it
 * fails or runs exactly as before. */
#include <string.h>

#include "op_record.h"
#include "sv.h"

/* A backend whose kernels run synchronously on host memory (every CPU
 * device instance), so the work is what dsp_op_cost counts. A GPU
 * backend is left to the workers. */
static int on_cpu(const dsp_backend *be) {
  return (dsp_backend_caps(be) & DSP_CAP_INLINE) != 0;
}

static uint64_t add_sat(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* What dropping one tape node costs: its saved tensors' references and
 * the node itself, about a quarter of running an op (DSP_WORK_PER_OP) */
#define TAPE_NODE_FREE_COST (DSP_WORK_PER_OP / 4)

/* A Free of tensor ids and graphs: the work is dropping each entry and,
 * for a last reference, its storage. A storage the session's free lists
 * have room for goes there (a few pointer moves, and the next tensor of
 * its size takes it back); any other counts one per element like a kernel
 * that writes it, as it may go back to the system page by page (munmap of
 * a touched MiB: 18 us here) or push older blocks out of the lists. A
 * tracked tensor's last reference takes its tape with it, counted by
 * dsp_tape_size (a tape of 600k nodes took 0.18 s), and a graph its nodes
 * (3M took 0.25 s). Gradient containers are left to the workers: what
 * they hold is not in the table. */
int sv_inline_free_cost(sv_session *s, const sv_job *j, uint64_t *cost) {
  const Dspwire__Free *f = j->req->free;
  if (f->n_grads > 0) return 0;
  dsp_cache_stats cs;
  dsp_budget_cache_stats(s->budget, &cs);
  uint64_t room = cs.max_bytes > cs.bytes ? cs.max_bytes - cs.bytes : 0;
  uint64_t c = 0;
  for (size_t i = 0; i < f->n_tensors; i++) {
    const sv_entry *e = sv_idmap_get(&s->tensors, f->tensors[i]);
    c = add_sat(c, 1);
    if (!e || !e->t) continue;
    uint64_t b = dsp_tensor_nbytes(e->t);
    if (b <= room) room -= b;
    else c = add_sat(c, (uint64_t)e->t->numel);
    /* only a last reference drops the tape: a tensor a later node saved
     * keeps it (and its node) alive */
    uint64_t tape = e->t->refcount == 1 ? dsp_tape_size(e->t) : 0;
    c = add_sat(c, tape > UINT64_MAX / TAPE_NODE_FREE_COST
                       ? UINT64_MAX
                       : tape * TAPE_NODE_FREE_COST);
  }
  for (size_t i = 0; i < f->n_graphs; i++)
    c = add_sat(c, 1 + sv_graph_free_cost(s, f->graphs[i]));
  *cost = c;
  return 1;
}

/* An op on inputs of ids in[0..n_in-1] that the loop could run: known,
 * not an optimizer op, its inputs alive on a CPU device (or, without
 * inputs, the session's device a CPU) and its shapes inferred; 1 with its
 * dsp_op_cost in *cost. */
static int op_cost(sv_session *s, int op, const uint64_t *in, int n_in,
                   const dsp_attrs *a, uint64_t *cost) {
  const dsp_op_info *info = dsp_op_lookup(op);
  if (!info || info->family == DSP_FAM_OPTIM) return 0;
  if (n_in == 0 && !on_cpu(s->device)) return 0;
  dsp_meta metas[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) {
    const sv_entry *e = sv_idmap_get(&s->tensors, in[i]);
    if (!e || !e->t) return 0;
    if (e->t->storage && !on_cpu(e->t->storage->backend)) return 0;
    metas[i] = e->t->meta;
  }
  dsp_meta om;
  /* infer may leave a message in the ctx: sv_session_exec clears it
   * before it runs anything */
  if (dsp_op_infer(s->ctx, (dsp_opcode)op, metas, n_in, a, &om) < 0) return 0;
  *cost = dsp_op_cost((dsp_opcode)op, metas, n_in, a, &om);
  return 1;
}

/* An upload: its bytes are in place: what is left is the table, a check
 * of the bytes of a bool tensor, and a copy only when the staging is not
 * the storage itself (a CPU backend reads the socket straight into it); a
 * refused one (no tensor) fails the same anywhere */
int sv_inline_upload_cost(sv_session *s, const sv_job *j, uint64_t *cost) {
  if (j->upload && !on_cpu(j->upload->storage ? j->upload->storage->backend
                                               : NULL))
    return 0;
  const dsp_stage *st = &j->upload_stage;
  int in_place = !st->t || st->host == st->t->storage->data;
  int is_bool = j->upload && j->upload->meta.dtype == DSP_BOOL;
  *cost = (in_place ? 0 : j->upload_bytes) + (is_bool ? j->upload_bytes : 0);
  return 1;
}

int sv_inline_op_cost(sv_session *s, const sv_job *j, uint64_t *cost) {
  const Dspwire__Op *o = j->req->op;
  dsp_attrs a;
  if (o->n_inputs > DSP_MAX_INPUTS ||
      sv_attrs_from(o->n_ints, o->ints, o->n_floats, o->floats, &a) < 0)
    return 0;
  if (o->device && *o->device) return 0;
  return op_cost(s, o->op, o->inputs, (int)o->n_inputs, &a, cost);
}

int sv_inline_placed(const sv_session *s, dsp_tensor *const *in, int n_in) {
  if (n_in == 0) return on_cpu(s->device);
  for (int i = 0; i < n_in; i++)
    if (in[i]->storage && !on_cpu(in[i]->storage->backend)) return 0;
  return 1;
}
