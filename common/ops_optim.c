/* optim family: in-place sgd (momentum, weight decay) and adam steps.
 *
 * The parameter is inputs[0]; dsp_op hands that same tensor in as `out`.
 * Each element reads param, grad and state before writing, and the update
 * is computed in double and rounded once, so f32 and f64 behave alike and
 * results are bit-identical run to run. */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"

static const char *opname(dsp_opcode op) {
  return dsp_op_lookup((int)op)->name;
}

int dsp__infer_optim(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in,
                     int n_in, const dsp_attrs *a, dsp_meta *out) {
  static const char *sgd_names[3] = {"lr", "momentum", "weight_decay"};
  static const char *adam_names[4] = {"lr", "beta1", "beta2", "eps"};
  static const char *adam_in[4] = {"param", "grad", "m", "v"};
  static const char *sgd_in[3] = {"param", "grad", "velocity"};
  int is_sgd = op == DSP_OP_SGD_STEP;
  if (op != DSP_OP_SGD_STEP && op != DSP_OP_ADAM_STEP)
    return dsp_seterr(ctx, DISPATCH_EUNSUPPORTED, "optim: op %d unknown",
                      (int)op);
  int want_f = is_sgd ? 3 : 4, want_i = is_sgd ? 0 : 1;
  if (a->n_floats != want_f || a->n_ints != want_i)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "%s: takes %d float and %d int attributes, got %d and %d",
                      opname(op), want_f, want_i, a->n_floats, a->n_ints);
  for (int i = 0; i < want_f; i++)
    if (!isfinite(a->floats[i]))
      return dsp_seterr(ctx, DISPATCH_EINVAL, "%s: %s = %g is not finite",
                        opname(op), is_sgd ? sgd_names[i] : adam_names[i],
                        a->floats[i]);
  if (!is_sgd) {
    for (int i = 1; i <= 2; i++)
      if (!(a->floats[i] >= 0.0 && a->floats[i] < 1.0))
        return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: %s = %g outside [0, 1)",
                          adam_names[i], a->floats[i]);
    if (a->floats[3] < 0.0)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: eps = %g is negative",
                        a->floats[3]);
    if (a->ints[0] < 1)
      return dsp_seterr(ctx, DISPATCH_EINVAL, "adam_step: step t = %lld must be >= 1",
                        (long long)a->ints[0]);
  }
  if (!dsp_dtype_is_float(in[0].dtype))
    return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: param must be f32 or f64, got %s",
                      opname(op), dsp_dtype_name(in[0].dtype));
  for (int i = 1; i < n_in; i++) {
    if (in[i].dtype != in[0].dtype)
      return dsp_seterr(ctx, DISPATCH_EDTYPE, "%s: %s is %s but param is %s",
                        opname(op), is_sgd ? sgd_in[i] : adam_in[i],
                        dsp_dtype_name(in[i].dtype), dsp_dtype_name(in[0].dtype));
    if (!dsp_meta_equal(&in[i], &in[0])) {
      char s1[128], s2[128];
      return dsp_seterr(ctx, DISPATCH_ESHAPE, "%s: %s is %s but param is %s",
                        opname(op), is_sgd ? sgd_in[i] : adam_in[i],
                        dsp_shape_str(&in[i], s1, sizeof s1),
                        dsp_shape_str(&in[0], s2, sizeof s2));
    }
  }
  *out = in[0];
  return 0;
}


/* Updates param (and, when a caller passes a distinct `out`, writes the new
 * param there too) plus the optimizer state in place. */
int dsp__cpu_optim(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   int n_in, const dsp_attrs *a, dsp_tensor *out) {
  dsp_meta metas[4], om;
  if (n_in < 3 || n_in > 4)
    return dsp_seterr(ctx, DISPATCH_EINTERNAL, "%s: bad input count %d",
                      opname(op), n_in);
  for (int i = 0; i < n_in; i++) metas[i] = in[i]->meta;
  int rc = dsp__infer_optim(ctx, op, metas, n_in, a, &om);
  if (rc < 0) return rc;
  int f = om.dtype == DSP_F64;
  void *p = dsp_tensor_data(in[0]);
  const void *g = dsp_tensor_data(in[1]);
  int64_t n = in[0]->numel;
  if (op == DSP_OP_SGD_STEP) {
    double lr = a->floats[0], mom = a->floats[1], wd = a->floats[2];
    void *v = dsp_tensor_data(in[2]);
    for (int64_t i = 0; i < n; i++) {
      double pi = dsp__ld(p, f, i), gi = dsp__ld(g, f, i), vi = dsp__ld(v, f, i);
      vi = mom * vi + gi + wd * pi;
      dsp__st(v, f, i, vi);
      dsp__st(p, f, i, pi - lr * vi);
    }
  } else {
    double lr = a->floats[0], b1 = a->floats[1], b2 = a->floats[2],
           eps = a->floats[3];
    double t = (double)a->ints[0];
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    void *m = dsp_tensor_data(in[2]), *v = dsp_tensor_data(in[3]);
    for (int64_t i = 0; i < n; i++) {
      double pi = dsp__ld(p, f, i), gi = dsp__ld(g, f, i);
      double mi = b1 * dsp__ld(m, f, i) + (1.0 - b1) * gi;
      double vi = b2 * dsp__ld(v, f, i) + (1.0 - b2) * gi * gi;
      dsp__st(m, f, i, mi);
      dsp__st(v, f, i, vi);
      dsp__st(p, f, i, pi - lr * (mi / bc1) / (sqrt(vi / bc2) + eps));
    }
  }
  void *o = dsp_tensor_data(out);
  if (o != p) memcpy(o, p, dsp_tensor_nbytes(in[0]));
  return 0;
}
