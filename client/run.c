/* The generic op runner (one path for every op, keyed by op code) and the
 * public op functions, which only build attributes and call it. */
#include <string.h>

#include "client_internal.h"
#include "ops_plan.h"

/* Wraps `inner` (whose reference is transferred) as AUTODIFF. On failure
 * inner is dropped. */
static int wrap_autodiff(dsp_opcode op, dispatch_tensor *inner,
                         dispatch_tensor **out) {
  dispatch_tensor *w;
  int rc = dispatch__tensor_new(inner->dev, DISPATCH_KIND_AUTODIFF,
                                &inner->meta, 0, &w);
  if (rc < 0) {
    dispatch__tensor_unref(inner);
    return rc;
  }
  inner->tracked = 1;
  inner->made_by = 1 + (int)op; /* not a leaf: dispatch_grad refuses it */
  w->inner = inner;
  *out = w;
  return 0;
}

/* Runs op on inputs of one device through its kind's row (LOCAL: now, in
 * the device's ctx; REMOTE: inferred here, so shape errors come back now,
 * and queued without waiting). Output: AUTODIFF when an input is AUTODIFF
 * and the row says the result is tracked. */
int dispatch__run(dispatch_device *dev, dsp_opcode op,
                  dispatch_tensor *const *in, int n_in, const dsp_attrs *a,
                  int scoped, dispatch_tensor **out) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  /* the device is the first input's that exists: a NULL input is most
   * often the output of a failed call, whose error that device keeps */
  for (int i = 0; in && i < n_in && i < DSP_MAX_INPUTS; i++)
    if (in[i]) {
      dev = in[i]->dev;
      break;
    }
  DISPATCH__GUARD(dev, info ? info->name : "op");
  if (!out)
    return dev ? dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                               "%s: out is NULL",
                                               info ? info->name : "op"))
               : DISPATCH_EINVAL;
  *out = NULL;
  if (!info || (!dev && n_in <= 0)) return DISPATCH_EINVAL;
  if (n_in < 0 || n_in > DSP_MAX_INPUTS || (n_in > 0 && !in))
    return dev ? dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                               "%s: bad input count %d",
                                               info->name, n_in))
               : DISPATCH_EINVAL;
  dispatch_tensor *cin[DSP_MAX_INPUTS];
  int any_ad = 0;
  for (int i = 0; i < n_in; i++) {
    if (!in[i]) return dispatch__null_input(dev, info->name, i);
    if (in[i]->dev != dev)
      return dispatch__ret(
          dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                          "%s: input %d lives on \"%s\" but input 0 on \"%s\"; "
                          "copy with dispatch_to_device",
                          info->name, i, in[i]->dev->spec, dev->spec));
    any_ad |= in[i]->kind == DISPATCH_KIND_AUTODIFF;
    cin[i] = dispatch_inner(in[i]);
    /* REMOTE: the client learnt at a wait that this input failed; the op
     * fails here, so the server never runs work that cannot succeed */
    if (cin[i]->status) return dispatch__poisoned_input(dev, in[i]);
  }
  /* the device's mixed-precision policy: casts live until the op ran */
  dispatch_tensor *casts[DSP_MAX_INPUTS] = {NULL};
  int rc = 0;
  if (dev->autocast != DSP_F32)
    rc = dispatch__autocast_inputs(dev, op, in, n_in, cin, casts);
  dispatch_tensor *t = NULL;
  int wrap = 0;
  if (rc == 0) rc = dev->ops->op(dev, op, cin, n_in, a, any_ad, &t, &wrap);
  /* sync mode: the server's answer to this op is this call's (the Free
   * of the handle takes its poisoned id off the server) */
  if (rc == 0 && (rc = dispatch__sync_call(dev)) < 0) {
    dispatch__tensor_unref(t);
    t = NULL;
  }
  if (rc == 0 && dev->capture)
    dispatch__graph_op(dev, op, cin, n_in, a, !any_ad, t);
  for (int i = 0; i < n_in; i++) dispatch__tensor_unref(casts[i]);
  if (rc < 0) return dispatch__ret(dev, rc);
  if (wrap) {
    rc = wrap_autodiff(op, t, &t);
    if (rc < 0) return dispatch__ret(dev, rc);
  }
  if (scoped) dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

/* ------------------------------------------------------------------ */
/* public ops                                                          */

/* Every op's client function is defined here from its row of DSP_OP_MAP
 * (common/dsp.h): the row's signature kind picks the body below, which
 * packs the attributes and calls the one runner. Only the HAND rows are
 * written out, after them. A new row of an existing kind needs nothing in
 * this file. */

/* NULL inputs go to dispatch__run too: it answers with the first error
 * of the device of the other inputs, or of the thread's last failure. */
static int run1(dsp_opcode op, dispatch_tensor *x, const dsp_attrs *a,
                dispatch_tensor **out) {
  return dispatch__run(NULL, op, &x, 1, a, 1, out);
}

static int run2(dsp_opcode op, dispatch_tensor *x, dispatch_tensor *y,
                const dsp_attrs *a, dispatch_tensor **out) {
  dispatch_tensor *in[2] = {x, y};
  return dispatch__run(NULL, op, in, 2, a, 1, out);
}

static int run3(dsp_opcode op, dispatch_tensor *x, dispatch_tensor *y,
                dispatch_tensor *z, const dsp_attrs *a,
                dispatch_tensor **out) {
  dispatch_tensor *in[3] = {x, y, z};
  return dispatch__run(NULL, op, in, 3, a, 1, out);
}

/* Attributes from a caller's int list; too many is EINVAL, never a
 * silent truncation. */
static int ints_attrs(dispatch_tensor *x, const char *fn, int n,
                      const int64_t *v, dsp_attrs *a) {
  *a = dsp_attrs_none();
  if (n < 0 || n > DSP_MAX_ATTR_INTS || (n > 0 && !v))
    return x ? dispatch__ret(x->dev,
                             dsp_seterr(x->dev->ctx, DISPATCH_EINVAL,
                                        "%s: %d values (at most %d)", fn, n,
                                        DSP_MAX_ATTR_INTS))
             : DISPATCH_EINVAL;
  *a = dsp_attrs_ints(n, v);
  return 0;
}

/* keepdim as the reductions take it: floats[0] */
static int red_attrs(dispatch_tensor *x, const char *fn, int ndims,
                     const int64_t *dims, int keepdim, dsp_attrs *a) {
  int rc = ints_attrs(x, fn, ndims, dims, a);
  if (rc < 0) return rc;
  a->floats[0] = keepdim ? 1.0 : 0.0;
  a->n_floats = 1;
  return 0;
}

static int run_many(dsp_opcode op, dispatch_tensor *const *xs, int n,
                    int64_t dim, dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!xs || n < 1) return DISPATCH_EINVAL;
  dsp_attrs a = dsp_attrs_ints(1, &dim);
  return dispatch__run(NULL, op, xs, n, &a, 1, out);
}

static dsp_attrs conv_attrs(int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                            int64_t dh, int64_t dw, const int64_t *extra4) {
  int64_t v[10] = {sh, sw, ph, pw, dh, dw};
  int n = 6;
  if (extra4)
    for (int i = 0; i < 4; i++) v[n++] = extra4[i];
  return dsp_attrs_ints(n, v);
}

static dsp_attrs pool_attrs(int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                            int64_t ph, int64_t pw) {
  int64_t v[6] = {kh, kw, sh, sw, ph, pw};
  return dsp_attrs_ints(6, v);
}

static int create(dispatch_device *dev, dsp_opcode op, int64_t head0,
                  int has_seed, int64_t seed, int ndim, const int64_t *shape,
                  const double *f, int nf, dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  if (ndim < 0 || ndim > DSP_MAX_DIMS || (ndim && !shape))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "%s: rank %d is outside 0..%d",
                                         dsp_op_lookup((int)op)->name, ndim,
                                         DSP_MAX_DIMS));
  dsp_attrs a = dsp_attrs_none();
  a.ints[a.n_ints++] = head0;
  if (has_seed) a.ints[a.n_ints++] = seed;
  for (int i = 0; i < ndim; i++) a.ints[a.n_ints++] = shape[i];
  for (int i = 0; i < nf; i++) a.floats[a.n_floats++] = f[i];
  return dispatch__run(dev, op, NULL, 0, &a, 1, out);
}

/* One body per signature kind (client/op_sigs.h has the heads). */
#define BODY_UNARY(name, OP) \
  DISPATCH__SIG_UNARY(name) { return run1(OP, x, NULL, out); }
#define BODY_BINARY(name, OP) \
  DISPATCH__SIG_BINARY(name) { return run2(OP, a, b, NULL, out); }
#define BODY_TERNARY(name, OP) \
  DISPATCH__SIG_TERNARY(name) { return run3(OP, a, b, c, NULL, out); }
#define BODY_SCALAR(name, OP)         \
  DISPATCH__SIG_SCALAR(name) {        \
    dsp_attrs at = dsp_attrs_f1(s);   \
    return run1(OP, x, &at, out);     \
  }
#define BODY_RED(name, OP)                                             \
  DISPATCH__SIG_RED(name) {                                            \
    dsp_attrs at;                                                      \
    if (out) *out = NULL;                                              \
    int rc = red_attrs(x, #name, ndims, dims, keepdim, &at);           \
    return rc < 0 ? rc : run1(OP, x, &at, out);                        \
  }
#define BODY_SHAPEV(name, OP)                                          \
  DISPATCH__SIG_SHAPEV(name) {                                         \
    dsp_attrs at;                                                      \
    if (out) *out = NULL;                                              \
    int rc = ints_attrs(x, #name, ndim, v, &at);                       \
    return rc < 0 ? rc : run1(OP, x, &at, out);                        \
  }
#define BODY_DIM(name, OP)                    \
  DISPATCH__SIG_DIM(name) {                   \
    dsp_attrs at = dsp_attrs_ints(1, &dim);   \
    return run1(OP, x, &at, out);             \
  }
#define BODY_BINARY_DIM(name, OP)             \
  DISPATCH__SIG_BINARY_DIM(name) {            \
    dsp_attrs at = dsp_attrs_ints(1, &dim);   \
    return run2(OP, a, b, &at, out);          \
  }
#define BODY_MANY(name, OP) \
  DISPATCH__SIG_MANY(name) { return run_many(OP, xs, n, dim, out); }
#define BODY_POOL(name, OP)                                                 \
  DISPATCH__SIG_POOL(name) {                                                \
    dsp_attrs at = pool_attrs(kh, kw, stride_h, stride_w, pad_h, pad_w);    \
    return run1(OP, x, &at, out);                                           \
  }
#define BODY_POOL_BWD(name, OP)                                             \
  DISPATCH__SIG_POOL_BWD(name) {                                            \
    dsp_attrs at = pool_attrs(kh, kw, stride_h, stride_w, pad_h, pad_w);    \
    return run2(OP, grad, x, &at, out);                                     \
  }
#define BODY_CONV_BWD(name, OP)                                             \
  DISPATCH__SIG_CONV_BWD(name) {                                            \
    if (!shape) {                                                           \
      if (out) *out = NULL;                                                 \
      return DISPATCH_EINVAL;                                               \
    }                                                                       \
    dsp_attrs at =                                                          \
        conv_attrs(stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, shape);  \
    return run2(OP, grad, t, &at, out);                                     \
  }
#define BODY_CREATE(name, OP) \
  DISPATCH__SIG_CREATE(name) {                                              \
    return create(dev, OP, dtype, 0, 0, ndim, shape, NULL, 0, out);         \
  }
#define BODY_RANDOM(name, OP)                                               \
  DISPATCH__SIG_RANDOM(name) {                                              \
    double f[2] = {f0, f1};                                                 \
    return create(dev, OP, dtype, 1, (int64_t)seed, ndim, shape, f, 2, out); \
  }
#define BODY_HAND(name, OP)
#define BODY_NONE(name, OP)

#define OP_FUNCTION_(NAME, code, name, nin, fam, sig, api) \
  BODY_##sig(name, DSP_OP_##NAME)
DSP_OP_MAP(OP_FUNCTION_)
#undef OP_FUNCTION_

/* the HAND rows */

int dispatch_transpose(dispatch_tensor *x, int64_t dim0, int64_t dim1,
                       dispatch_tensor **out) {
  int64_t v[2] = {dim0, dim1};
  dsp_attrs a = dsp_attrs_ints(2, v);
  return run1(DSP_OP_TRANSPOSE, x, &a, out);
}

int dispatch_slice(dispatch_tensor *x, int64_t dim, int64_t start,
                   int64_t end, int64_t step, dispatch_tensor **out) {
  int64_t v[4] = {dim, start, end, step};
  dsp_attrs a = dsp_attrs_ints(4, v);
  return run1(DSP_OP_SLICE, x, &a, out);
}

int dispatch_index_select(dispatch_tensor *x, int64_t dim,
                          dispatch_tensor *index, dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_ints(1, &dim);
  return run2(DSP_OP_INDEX_SELECT, x, index, &a, out);
}

int dispatch_cast(dispatch_tensor *x, dispatch_dtype dtype,
                  dispatch_tensor **out) {
  int64_t v = (int64_t)dtype;
  dsp_attrs a = dsp_attrs_ints(1, &v);
  return run1(DSP_OP_CAST, x, &a, out);
}

int dispatch_slice_backward(dispatch_tensor *grad, int64_t dim,
                            int64_t start, int64_t end, int64_t step,
                            int in_ndim, const int64_t *in_shape,
                            dispatch_tensor **out) {
  if (out) *out = NULL;
  int64_t v[4 + DSP_MAX_DIMS] = {dim, start, end, step};
  if (in_ndim < 0 || in_ndim > DSP_MAX_DIMS || (in_ndim && !in_shape))
    return grad ? dispatch__ret(grad->dev,
                                dsp_seterr(grad->dev->ctx, DISPATCH_EINVAL,
                                           "slice_backward: input rank %d",
                                           in_ndim))
                : DISPATCH_EINVAL;
  for (int i = 0; i < in_ndim; i++) v[4 + i] = in_shape[i];
  dsp_attrs a = dsp_attrs_ints(4 + in_ndim, v);
  return run1(DSP_OP_SLICE_BACKWARD, grad, &a, out);
}

int dispatch_index_select_backward(dispatch_tensor *grad,
                                   dispatch_tensor *index, int64_t dim,
                                   int64_t dim_size, dispatch_tensor **out) {
  int64_t v[2] = {dim, dim_size};
  dsp_attrs a = dsp_attrs_ints(2, v);
  return run2(DSP_OP_INDEX_SELECT_BACKWARD, grad, index, &a, out);
}

int dispatch_conv2d(dispatch_tensor *x, dispatch_tensor *w, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w,
                    int64_t dil_h, int64_t dil_w, dispatch_tensor **out) {
  dsp_attrs a =
      conv_attrs(stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, NULL);
  return run2(DSP_OP_CONV2D, x, w, &a, out);
}

int dispatch_dropout(dispatch_tensor *x, double p, uint64_t seed,
                     dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_f1(p);
  a.ints[0] = (int64_t)seed;
  a.n_ints = 1;
  return run1(DSP_OP_DROPOUT, x, &a, out);
}

int dispatch_full(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, double value, dispatch_tensor **out) {
  return create(dev, DSP_OP_FULL, dtype, 0, 0, ndim, shape, &value, 1, out);
}

int dispatch_arange(dispatch_device *dev, dispatch_dtype dtype, double start,
                    double end, double step, dispatch_tensor **out) {
  double f[3] = {start, end, step};
  return create(dev, DSP_OP_ARANGE, dtype, 0, 0, 0, NULL, f, 3, out);
}

/* issue 23: embedding/norm */

int dispatch_embedding(dispatch_tensor *weight, dispatch_tensor *idx,
                       int64_t padding_idx, dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_ints(1, &padding_idx);
  return run2(DSP_OP_EMBEDDING, weight, idx, &a, out);
}

/* x and the affine inputs that are present, in order; ints {nlast,
 * has_weight[, has_bias]}, floats {eps}. A NULL x goes to dispatch__run,
 * which answers with the error that made it. */
static int run_norm(dsp_opcode op, dispatch_tensor *x, int nlast,
                    dispatch_tensor *w, dispatch_tensor *b, int with_bias,
                    double eps, dispatch_tensor **out) {
  dispatch_tensor *in[3] = {x, NULL, NULL};
  int n = 1;
  if (w) in[n++] = w;
  if (b) in[n++] = b;
  int64_t v[3] = {nlast, w != NULL, b != NULL};
  dsp_attrs a = dsp_attrs_ints(with_bias ? 3 : 2, v);
  a.floats[0] = eps;
  a.n_floats = 1;
  return dispatch__run(NULL, op, in, n, &a, 1, out);
}

int dispatch_layer_norm(dispatch_tensor *x, int nlast, dispatch_tensor *weight,
                        dispatch_tensor *bias, double eps,
                        dispatch_tensor **out) {
  return run_norm(DSP_OP_LAYER_NORM, x, nlast, weight, bias, 1, eps, out);
}

int dispatch_rms_norm(dispatch_tensor *x, int nlast, dispatch_tensor *weight,
                      double eps, dispatch_tensor **out) {
  return run_norm(DSP_OP_RMS_NORM, x, nlast, weight, NULL, 0, eps, out);
}

int dispatch_batch_norm(dispatch_tensor *x, dispatch_tensor *running_mean,
                        dispatch_tensor *running_var, dispatch_tensor *weight,
                        dispatch_tensor *bias, int training, double momentum,
                        double eps, dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!running_mean != !running_var) {
    dispatch_tensor *t = x ? x : running_mean ? running_mean : running_var;
    return dispatch__ret(t->dev, dsp_seterr(t->dev->ctx, DISPATCH_EINVAL,
                                            "batch_norm: running_mean and "
                                            "running_var go together"));
  }
  dispatch_tensor *in[5] = {x};
  int n = 1;
  if (running_mean) in[n++] = running_mean, in[n++] = running_var;
  if (weight) in[n++] = weight;
  if (bias) in[n++] = bias;
  int64_t v[4] = {training != 0, running_mean != NULL, weight != NULL,
                  bias != NULL};
  dsp_attrs a = dsp_attrs_ints(4, v);
  a.floats[0] = momentum, a.floats[1] = eps;
  a.n_floats = 2;
  return dispatch__run(NULL, DSP_OP_BATCH_NORM, in, n, &a, 1, out);
}

/* issue 23: attention */

int dispatch_attention(dispatch_tensor *q, dispatch_tensor *k,
                       dispatch_tensor *v, dispatch_tensor *key_mask,
                       int causal, double scale, dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_f1(scale);
  a.ints[0] = causal != 0;
  a.ints[1] = key_mask != NULL;
  a.n_ints = 2;
  dispatch_tensor *in[4] = {q, k, v, key_mask};
  return dispatch__run(NULL, DSP_OP_ATTENTION, in, key_mask ? 4 : 3, &a, 1,
                       out);
}

/* issue 23: elementwise and reductions */

int dispatch_clamp(dispatch_tensor *x, double lo, double hi,
                   dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_none();
  a.floats[0] = lo, a.floats[1] = hi;
  a.n_floats = 2;
  return run1(DSP_OP_CLAMP, x, &a, out);
}

int dispatch_masked_fill(dispatch_tensor *x, dispatch_tensor *mask,
                         double value, dispatch_tensor **out) {
  dsp_attrs a = dsp_attrs_f1(value);
  return run2(DSP_OP_MASKED_FILL, x, mask, &a, out);
}

/* var and std: red_attrs plus floats[1] = correction */
static int moments(dsp_opcode op, dispatch_tensor *x, int ndims,
                   const int64_t *dims, int64_t correction, int keepdim,
                   dispatch_tensor **out) {
  dsp_attrs a;
  if (out) *out = NULL;
  int rc = red_attrs(x, dsp_op_lookup((int)op)->name, ndims, dims, keepdim,
                     &a);
  if (rc < 0) return rc;
  a.floats[1] = (double)correction;
  a.n_floats = 2;
  return run1(op, x, &a, out);
}

int dispatch_var(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int64_t correction, int keepdim, dispatch_tensor **out) {
  return moments(DSP_OP_VAR, x, ndims, dims, correction, keepdim, out);
}

int dispatch_std(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int64_t correction, int keepdim, dispatch_tensor **out) {
  return moments(DSP_OP_STD, x, ndims, dims, correction, keepdim, out);
}

/* issue 23: loss */

_Static_assert(DISPATCH_REDUCE_NONE == DSP_REDUCE_NONE &&
                   DISPATCH_REDUCE_SUM == DSP_REDUCE_SUM &&
                   DISPATCH_REDUCE_MEAN == DSP_REDUCE_MEAN,
               "the public reductions are the op's attribute values");

static dsp_attrs ce_ex_attrs(int64_t ignore_index, double label_smoothing,
                             int reduction) {
  int64_t v[2] = {ignore_index, (int64_t)reduction};
  dsp_attrs a = dsp_attrs_ints(2, v);
  a.floats[0] = label_smoothing;
  a.n_floats = 1;
  return a;
}

int dispatch_cross_entropy_ex(dispatch_tensor *logits, dispatch_tensor *labels,
                              int64_t ignore_index, double label_smoothing,
                              int reduction, dispatch_tensor **out) {
  dsp_attrs a = ce_ex_attrs(ignore_index, label_smoothing, reduction);
  return run2(DSP_OP_CROSS_ENTROPY_EX, logits, labels, &a, out);
}

int dispatch_cross_entropy_ex_backward(dispatch_tensor *grad,
                                       dispatch_tensor *logits,
                                       dispatch_tensor *labels,
                                       int64_t ignore_index,
                                       double label_smoothing, int reduction,
                                       dispatch_tensor **out) {
  dsp_attrs a = ce_ex_attrs(ignore_index, label_smoothing, reduction);
  return run3(DSP_OP_CROSS_ENTROPY_EX_BACKWARD, grad, logits, labels, &a, out);
}

/* issue 23: pools */

int dispatch_avg_pool2d_ex(dispatch_tensor *x, int64_t kh, int64_t kw,
                           int64_t stride_h, int64_t stride_w, int64_t pad_h,
                           int64_t pad_w, int count_include_pad,
                           dispatch_tensor **out) {
  dsp_attrs a = pool_attrs(kh, kw, stride_h, stride_w, pad_h, pad_w);
  a.ints[a.n_ints++] = count_include_pad ? 1 : 0;
  return run1(DSP_OP_AVG_POOL2D_EX, x, &a, out);
}

/* issue 23: conv bias */

int dispatch_conv2d_bias(dispatch_tensor *x, dispatch_tensor *w,
                         dispatch_tensor *bias, int64_t stride_h,
                         int64_t stride_w, int64_t pad_h, int64_t pad_w,
                         int64_t dil_h, int64_t dil_w, dispatch_tensor **out) {
  if (!bias)
    return dispatch_conv2d(x, w, stride_h, stride_w, pad_h, pad_w, dil_h,
                           dil_w, out);
  dsp_attrs a =
      conv_attrs(stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, NULL);
  return run3(DSP_OP_CONV2D_BIAS, x, w, bias, &a, out);
}
