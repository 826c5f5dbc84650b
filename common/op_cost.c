/* Per-op work estimates from shapes alone (dsp_op_cost), so a server can
 * refuse one request's unbounded work before it runs. The estimates are
 * upper-bound-ish counts of the kernels' inner loops, not timings: they
 * only need to separate realistic ops from ones that would hold a worker
 * for minutes. */
#include <stdint.h>

#include "dsp_internal.h"
#include "ops_plan.h"

static uint64_t mul_sat(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t add_sat(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

/* Element count of a meta infer accepted (sizes >= 0, product fits). */
static uint64_t numel(const dsp_meta *m) {
  uint64_t n = 1;
  for (int i = 0; i < m->ndim; i++) n = mul_sat(n, (uint64_t)m->shape[i]);
  return n;
}

/* The work besides writing the output, per family. */
static uint64_t work(dsp_opcode op, const dsp_meta *in, int n_in,
                     const dsp_attrs *a, const dsp_meta *out) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  uint64_t on = numel(out);
  switch (info->family) {
    case DSP_FAM_EW:
    case DSP_FAM_CREATE:
      return on;
    case DSP_FAM_RED:
      return numel(&in[0]);
    case DSP_FAM_SHAPE:
      /* the backward ops also read every grad element */
      if (op == DSP_OP_SLICE_BACKWARD || op == DSP_OP_INDEX_SELECT_BACKWARD)
        return numel(&in[0]);
      return on;
    case DSP_FAM_LINALG: {
      /* batch*m*n is the output's element count; k is op(a)'s last dim
       * (a's second last when the attributes transpose a) */
      int ta = a && a->n_ints == 2 && a->ints[0] == 1 && in[0].ndim >= 2;
      uint64_t k = (uint64_t)in[0].shape[in[0].ndim - 1 - ta];
      return mul_sat(on, k);
    }
    case DSP_FAM_OPTIM:
      return mul_sat(numel(&in[0]), 4);
    case DSP_FAM_NN:
      break;
  }
  /* the nn ops are costed one by one: a new one needs its case here */
  _Static_assert(DSP__OPS_IN_FAMILY(NN) - DSP__N_NORM_OPS == 17,
                 "a new nn op needs a cost decision in dsp_op_cost");
  switch (op) {
    case DSP_OP_SOFTMAX:
    case DSP_OP_LOG_SOFTMAX:
    case DSP_OP_SOFTMAX_BACKWARD:
    case DSP_OP_LOG_SOFTMAX_BACKWARD:
    case DSP_OP_CROSS_ENTROPY:
    case DSP_OP_CROSS_ENTROPY_BACKWARD:
      /* a max pass, an exp-sum pass and a write pass over the input */
      return mul_sat(numel(&in[n_in == 3 ? 1 : 0]), 3);
    case DSP_OP_CONV2D:
    case DSP_OP_CONV2D_BACKWARD_INPUT:
    case DSP_OP_CONV2D_BACKWARD_WEIGHT: {
      /* every output pixel of the forward conv is a C*kh*kw dot product;
       * the backward ops do the same products the other way round */
      const dsp_meta *w = op == DSP_OP_CONV2D_BACKWARD_WEIGHT ? out : &in[1];
      uint64_t y = op == DSP_OP_CONV2D ? on : numel(&in[0]);
      uint64_t ck = mul_sat(mul_sat((uint64_t)w->shape[1],
                                    (uint64_t)w->shape[2]),
                            (uint64_t)w->shape[3]);
      /* + the im2col / col2im pass over the same col matrix */
      uint64_t prods = mul_sat(y, ck);
      return add_sat(prods, prods / (uint64_t)(w->shape[0] ? w->shape[0] : 1));
    }
    case DSP_OP_MAX_POOL2D:
    case DSP_OP_AVG_POOL2D:
    case DSP_OP_MAX_POOL2D_BACKWARD:
    case DSP_OP_AVG_POOL2D_BACKWARD: {
      uint64_t y = (op == DSP_OP_MAX_POOL2D || op == DSP_OP_AVG_POOL2D)
                       ? on
                       : numel(&in[0]);
      return mul_sat(y, mul_sat((uint64_t)a->ints[0], (uint64_t)a->ints[1]));
    }
    /* issue 23: a row copy per index; a scatter-add per grad element */
    case DSP_OP_EMBEDDING:
      return on;
    case DSP_OP_EMBEDDING_BACKWARD:
      return numel(&in[0]);
    /* mean, variance and write passes forward; two sums and a write per
     * element and the weight/bias column sums backward */
    case DSP_OP_LAYER_NORM:
    case DSP_OP_RMS_NORM:
      return mul_sat(numel(&in[0]), 3);
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM_BACKWARD:
      return mul_sat(numel(&in[1]), 5);
    case DSP_OP_ATTENTION:
    case DSP_OP_ATTENTION_BACKWARD: {
      /* B*H*Tq*Tk scores, each a d-long product and a dv-long one forward
       * plus the softmax passes; the backward recomputes them and does
       * three more products (dq, dk: d each; dv: dv) */
      const dsp_meta *q = &in[op == DSP_OP_ATTENTION_BACKWARD],
                     *v = &in[(op == DSP_OP_ATTENTION_BACKWARD) + 2];
      uint64_t sc = mul_sat(mul_sat(mul_sat((uint64_t)q->shape[0],
                                            (uint64_t)q->shape[1]),
                                    (uint64_t)q->shape[2]),
                            (uint64_t)v->shape[2]);
      uint64_t d = (uint64_t)q->shape[3], dv = (uint64_t)v->shape[3];
      uint64_t per = op == DSP_OP_ATTENTION ? add_sat(add_sat(d, dv), 3)
                                            : add_sat(add_sat(mul_sat(d, 3),
                                                              mul_sat(dv, 2)), 4);
      return mul_sat(sc, per);
    }
    default:
      return numel(&in[0]);
  }
}

uint64_t dsp_op_cost(dsp_opcode op, const dsp_meta *in, int n_in,
                     const dsp_attrs *a, const dsp_meta *out) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  if (!info || !a || !out || (n_in > 0 && !in)) return UINT64_MAX;
  return add_sat(work(op, in, n_in, a, out), numel(out));
}
