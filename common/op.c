/* The op table, validation by family, and the op runner that ties the
 * backend kernel to the autodiff tape. */
#include <stdio.h>
#include <string.h>

#include "dsp_internal.h"
#include "half.h"

/* The op table, indexed by code (codes are small and dense; holes have no
 * name): every op looks itself up several times, and a scan of a table in
 * code order was a visible share of a chain of small ops. */
static const dsp_op_info g_by_code[] = {
#define BYCODE_(NAME, code, name, nin, fam, ...) \
  [code] = {DSP_OP_##NAME, #name, nin, DSP_FAM_##fam},
    DSP_OP_MAP(BYCODE_)
#undef BYCODE_
};

const dsp_op_info *dsp_op_lookup(int code) {
  if (code >= 0 && (size_t)code < sizeof g_by_code / sizeof g_by_code[0] &&
      g_by_code[code].name)
    return &g_by_code[code];
  return NULL;
}

dsp_attrs dsp_attrs_none(void) {
  dsp_attrs a;
  memset(&a, 0, sizeof a);
  return a;
}

dsp_attrs dsp_attrs_ints(int n, const int64_t *v) {
  dsp_attrs a = dsp_attrs_none();
  for (int i = 0; i < n && i < DSP_MAX_ATTR_INTS; i++) a.ints[i] = v[i];
  /* a count out of range is kept as it is, so dsp_op_infer refuses the
   * attributes instead of running on a silently shortened list */
  a.n_ints = n;
  return a;
}

dsp_attrs dsp_attrs_f1(double f0) {
  dsp_attrs a = dsp_attrs_none();
  a.floats[0] = f0;
  a.n_floats = 1;
  return a;
}

int dsp__unsupported(dsp_ctx *ctx, const char *backend, dsp_opcode op,
                     const dsp_meta *in, int n_in, const dsp_meta *out) {
  char dts[160];
  size_t k = 0;
  dts[0] = 0;
  for (int i = 0; i < n_in && k < sizeof dts - 16; i++) {
    if (i == 6 && n_in > 7) { /* a long cat: the first few tell enough */
      k += (size_t)snprintf(dts + k, sizeof dts - k, ", ... (%d inputs)", n_in);
      break;
    }
    k += (size_t)snprintf(dts + k, sizeof dts - k, "%s%s", i ? ", " : "",
                          dsp_dtype_name(in[i].dtype));
  }
  const dsp_op_info *info = dsp_op_lookup((int)op);
  return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                    "%s: backend %s has no kernel for inputs (%s) -> %s",
                    info ? info->name : "?", backend, dts,
                    out ? dsp_dtype_name(out->dtype) : "?");
}

/* beside dsp__unsupported: both name the op from the table, which the
 * ctx code (common/ctx.c) does not reach */
int dsp__cancelled_err(dsp_ctx *ctx, dsp_opcode op) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  return dsp_seterr(ctx, DISPATCH_ECANCELED, "%s: cancelled before it finished",
                    info ? info->name : "op");
}

int dsp_op_infer(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                 const dsp_attrs *a, dsp_meta *out) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  if (!info) return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "unknown op code %d", (int)op);
  if (info->n_inputs >= 0 ? n_in != info->n_inputs
                          : (n_in < 1 || n_in > DSP_MAX_INPUTS)) {
    if (info->n_inputs < 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes 1 to %d inputs, got %d",
                        info->name, DSP_MAX_INPUTS, n_in);
    if (info->n_inputs == 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes no inputs, got %d",
                        info->name, n_in);
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: takes %d input%s, got %d",
                      info->name, info->n_inputs,
                      info->n_inputs == 1 ? "" : "s", n_in);
  }
  if (!a || a->n_ints < 0 || a->n_ints > DSP_MAX_ATTR_INTS ||
      a->n_floats < 0 || a->n_floats > DSP_MAX_ATTR_FLOATS)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: bad attribute counts",
                      info->name);
  for (int i = 0; i < n_in; i++) {
    int rc = dsp_meta_check(ctx, &in[i]);
    if (rc < 0) return rc;
  }
  int rc;
  switch (info->family) {
    case DSP_FAM_EW: rc = dsp__infer_ew(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_RED: rc = dsp__infer_red(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_SHAPE: rc = dsp__infer_shape(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_LINALG: rc = dsp__infer_linalg(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_NN: rc = dsp__infer_nn(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_CREATE: rc = dsp__infer_create(ctx, op, in, n_in, a, out); break;
    case DSP_FAM_OPTIM: rc = dsp__infer_optim(ctx, op, in, n_in, a, out); break;
    default: rc = dsp_seterr(ctx, DISPATCH_EINTERNAL, "bad family");
  }
  if (rc < 0) return rc;
  return dsp_meta_check(ctx, out);
}

int dsp__work_limit_err(dsp_ctx *ctx, const char *what) {
  return dsp_seterr(ctx, DISPATCH_ELIMIT,
                    "%s%sthe replay's estimated work reaches %llu elementary "
                    "operations, over the per-replay limit of %llu "
                    "(dispatch-server --max-replay-cost)",
                    what ? what : "", what ? ": " : "",
                    (unsigned long long)(ctx->work - (ctx->work_limit -
                                                      ctx->work_cap)),
                    (unsigned long long)ctx->work_cap);
}

int dsp__op_admit(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                  const dsp_attrs *a, const dsp_meta *om, uint64_t cost) {
  const char *name = dsp_op_lookup((int)op)->name;
  int64_t span;
  if (ctx->max_span > 0 && dsp_meta_span(ctx, om, NULL, &span) == 0 &&
      span > ctx->max_span) {
    char s[160];
    return dsp_seterr(ctx, DISPATCH_ELIMIT,
                      "%s: result %s spans %lld elements (zero sizes counted "
                      "as 1), over the limit of %lld",
                      name, dsp_shape_str(om, s, sizeof s), (long long)span,
                      (long long)ctx->max_span);
  }
  /* both checks come before the output is allocated: a refused or
   * cancelled op costs nothing */
  if (cost == UINT64_MAX) cost = dsp_op_cost(op, in, n_in, a, om);
  uint64_t w = cost > UINT64_MAX - DSP_WORK_PER_OP ? UINT64_MAX
                                                    : cost + DSP_WORK_PER_OP;
  ctx->work = w > UINT64_MAX - ctx->work ? UINT64_MAX : ctx->work + w;
  if (ctx->max_op_cost && cost > ctx->max_op_cost)
    return dsp_seterr(ctx, DISPATCH_ELIMIT,
                      "%s: estimated %llu elementary operations, over the "
                      "per-op limit of %llu (dispatch-server --max-op-cost)",
                      name, (unsigned long long)cost,
                      (unsigned long long)ctx->max_op_cost);
  if (ctx->work_limit && ctx->work > ctx->work_limit)
    return dsp__work_limit_err(ctx, name);
  if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
  return 0;
}

int dsp_op(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
           const dsp_attrs *a, dsp_tensor **out) {
  *out = NULL;
  dsp_attrs none = dsp_attrs_none();
  if (!a) a = &none;
  if (n_in < 0 || n_in > DSP_MAX_INPUTS || (n_in > 0 && !in))
    return dsp_seterr(ctx, DISPATCH_EINVAL, "op: bad input count %d", n_in);
  dsp_meta metas[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) {
    if (!in[i]) return dsp_seterr(ctx, DISPATCH_EINVAL, "op: input %d is NULL", i);
    metas[i] = in[i]->meta;
  }
  dsp_meta om;
  int rc = dsp_op_infer(ctx, op, metas, n_in, a, &om);
  if (rc < 0) return rc;
  return dsp_op_inferred(ctx, op, in, n_in, a, &om, UINT64_MAX, out);
}

/* Half in one place: an op a backend does not run natively on f16 or
 * bf16 runs as its f32 form. widen_plan gives the f32 metas (every half
 * input and a half output become f32; i64, bool and f32 operands stay)
 * and says whether the backend has what that takes: the f32 op, and cast
 * from each half input's dtype and back to the output's. cast itself is
 * never widened (it is how the widening converts). */
static int widen_plan(const dsp_backend *be, dsp_opcode op, const dsp_meta *in,
                      int n_in, const dsp_meta *om, dsp_meta *win,
                      dsp_meta *wom) {
  int any = 0;
  *wom = *om;
  if (dsp_dtype_is_half(om->dtype)) {
    wom->dtype = DSP_F32;
    any = 1;
    if (!dsp__backend_supports(be, DSP_OP_CAST, wom, 1, om)) return 0;
  }
  for (int i = 0; i < n_in; i++) {
    win[i] = in[i];
    if (!dsp_dtype_is_half(in[i].dtype)) continue;
    win[i].dtype = DSP_F32;
    any = 1;
    if (!dsp__backend_supports(be, DSP_OP_CAST, &in[i], 1, &win[i])) return 0;
  }
  return any && op != DSP_OP_CAST &&
         dsp__backend_supports(be, op, win, n_in, wom);
}

/* cast src into dst (allocated, of dst's dtype), through the backend. */
static int run_cast_into(dsp_ctx *ctx, const dsp_backend *be, dsp_tensor *src,
                         dsp_tensor *dst) {
  if (dst->numel == 0) return 0;
  int64_t dt = dst->meta.dtype;
  dsp_attrs ca = dsp_attrs_ints(1, &dt);
  return dsp__backend_run(be, ctx, DSP_OP_CAST, &src, 1, &ca, dst);
}

/* Runs op on the f32 forms (win, wom from widen_plan) of its half inputs
 * and writes the result, rounded once, into out (or, for an optimizer
 * step, back into every half input it updates). Memory beyond the op's
 * own: an f32 copy of each half input (twice its bytes) and of a half
 * result (twice the result's bytes), all charged to ctx's budget like
 * any tensor and freed before this returns. */
static int run_widened(dsp_ctx *ctx, const dsp_backend *be, dsp_opcode op,
                       dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                       const dsp_meta *win, const dsp_meta *wom,
                       dsp_tensor *out) {
  dsp_tensor *w[DSP_MAX_INPUTS], *wo = NULL;
  int rc = 0, nw = 0;
  const int optim = dsp_op_lookup((int)op)->family == DSP_FAM_OPTIM;
  for (; nw < n_in; nw++) {
    w[nw] = in[nw];
    if (win[nw].dtype == in[nw]->meta.dtype) continue;
    rc = dsp__tensor_new_on(ctx, be, &win[nw], 0, &w[nw]);
    if (rc == 0) rc = run_cast_into(ctx, be, in[nw], w[nw]);
    if (rc < 0) {
      if (w[nw] != in[nw]) dsp_tensor_unref(w[nw]);
      goto done;
    }
  }
  if (optim) {
    /* in place on the f32 copies, then each written one back (every
     * input but the gradient, in[1]) */
    rc = dsp__backend_run(be, ctx, op, w, n_in, a, w[0]);
    for (int i = 0; i < n_in && rc == 0; i++)
      if (i != 1 && w[i] != in[i]) rc = run_cast_into(ctx, be, w[i], in[i]);
    goto done;
  }
  if (wom->dtype == out->meta.dtype) { /* a bool or i64 result */
    rc = dsp__backend_run(be, ctx, op, w, n_in, a, out);
    goto done;
  }
  rc = dsp__tensor_new_on(
      ctx, be, wom,
      !dsp__backend_writes_every_element(be, dsp_op_lookup((int)op)->family),
      &wo);
  if (rc == 0) rc = dsp__backend_run(be, ctx, op, w, n_in, a, wo);
  if (rc == 0) rc = run_cast_into(ctx, be, wo, out);
  dsp_tensor_unref(wo);
done:
  for (int i = 0; i < nw; i++)
    if (w[i] != in[i]) dsp_tensor_unref(w[i]);
  return rc;
}

int dsp_op_inferred(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, const dsp_meta *omp,
                    uint64_t cost, dsp_tensor **out) {
  *out = NULL;
  dsp_meta metas[DSP_MAX_INPUTS];
  int tracked = 0, rc = 0;
  if (n_in == 0) memset(&metas[0], 0, sizeof metas[0]); /* read by none */
  for (int i = 0; i < n_in; i++) {
    metas[i] = in[i]->meta;
    tracked |= in[i]->node != NULL;
  }
  dsp_meta om = *omp;
  rc = dsp__op_admit(ctx, op, metas, n_in, a, &om, cost);
  if (rc < 0) return rc;
  /* An op runs on its inputs' device (the ctx's device only for creation
   * ops); inputs on two devices are refused, never copied behind the
   * caller's back. */
  const dsp_backend *be = n_in > 0 ? in[0]->storage->backend : ctx->backend;
  for (int i = 1; i < n_in; i++)
    if (in[i]->storage->backend != be)
      return dsp_seterr(ctx, DISPATCH_EDEVICE,
                        "%s: input 0 is on device %s, input %d on device %s; "
                        "move one first (no implicit copies between devices)",
                        dsp_op_lookup((int)op)->name, dsp_backend_id(be), i,
                        dsp_backend_id(in[i]->storage->backend));
  /* a backend without the hook claims nothing rather than everything;
   * one that lacks a half op but has its f32 form runs that (widen) */
  dsp_meta win[DSP_MAX_INPUTS], wom;
  const int widen = !dsp__backend_supports(be, op, metas, n_in, &om);
  if (widen && !widen_plan(be, op, metas, n_in, &om, win, &wom))
    return dsp__unsupported(ctx, dsp_backend_name(be), op, metas, n_in, &om);
  dsp_tensor *t;
  if (dsp_op_lookup((int)op)->family == DSP_FAM_OPTIM) {
    /* in-place: the parameter itself is the output, and the parameter and
     * its states (every input but the gradient) are written, so a read
     * still sending their bytes keeps its own copy */
    for (int i = 0; i < n_in; i++) {
      if (i == 1) continue;
      rc = dsp__storage_prepare_write(ctx, in[i]);
      if (rc < 0) return rc;
    }
    t = dsp_tensor_ref(in[0]);
  } else {
    /* a kernel that writes every element of its result (or fails, and
     * the result goes) needs no zeroing first */
    int zero = !dsp__backend_writes_every_element(
        be, dsp_op_lookup((int)op)->family);
    rc = dsp__tensor_new_on(ctx, be, &om, zero, &t);
    if (rc < 0) return rc;
  }
  /* An empty result needs no kernel: the zeroed storage already is the
   * answer, and a kernel could otherwise walk the other dims of a shape
   * like [2^40, 0] doing nothing. A non-empty result of empty inputs (a
   * sum over an empty dim, matmul with inner size 0) still runs its
   * kernel, as do the index ops (index_select, embedding and their
   * backward ops), whose index values are checked even when the result is
   * empty. */
  if (t->numel > 0 || op == DSP_OP_INDEX_SELECT ||
      op == DSP_OP_INDEX_SELECT_BACKWARD || op == DSP_OP_EMBEDDING ||
      op == DSP_OP_EMBEDDING_BACKWARD)
    rc = widen ? run_widened(ctx, be, op, in, n_in, a, win, &wom, t)
               : dsp__backend_run(be, ctx, op, in, n_in, a, t);
  if (rc == 0 && tracked && ctx->grad_enabled &&
      dsp_op_lookup((int)op)->family != DSP_FAM_OPTIM)
    rc = dsp__autodiff_record(ctx, op, in, n_in, a, t);
  if (rc < 0) {
    dsp_tensor_unref(t);
    return rc;
  }
  *out = t;
  return 0;
}
