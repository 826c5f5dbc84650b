/* Optimizers: in-place SGD, Adam and AdamW updates where the parameters
 * live, optionally clipped by global norm. LOCAL runs the step ops through
 * dsp_op; REMOTE sends one Step message per step carrying every parameter
 * (the kind's step). The parameters stay the same tracked leaves: an
 * in-place update never re-wraps them. Also the cosine learning-rate
 * schedule (pure arithmetic, no device). */
#include <math.h>

#include "client_internal.h"

static void optim_destroy(dispatch_optim *o) {
  for (int i = 0; i < o->n; i++)
    if (o->params) dispatch__tensor_unref(o->params[i]);
  for (int i = 0; i < o->n * o->k; i++)
    if (o->states) dispatch__tensor_unref(o->states[i]);
  if (o->norm) dispatch__tensor_unref(o->norm);
  if (o->ls_scale) dispatch__tensor_unref(o->ls_scale);
  if (o->ls_counts) dispatch__tensor_unref(o->ls_counts);
  dsp_free(o->params);
  dsp_free(o->states);
  dsp_free(o->wd);
  dsp_free(o);
}

/* Validates the parameters, takes a reference to each, and creates the
 * zeroed state tensors (unscoped: they belong to the optimizer). */
static int optim_new(dsp_opcode op, int k, dispatch_tensor *const *params,
                     int n, const double *f, int nf, dispatch_optim **out) {
  if (out) *out = NULL;
  if (!params || n < 1 || !out) return DISPATCH_EINVAL;
  const char *name = op == DSP_OP_SGD_STEP    ? "sgd"
                     : op == DSP_OP_ADAM_STEP ? "adam"
                                              : "adamw";
  dispatch_device *dev = NULL;
  for (int i = 0; i < n && !dev; i++)
    if (params[i]) dev = params[i]->dev;
  DISPATCH__GUARD(dev, name);
  for (int i = 0; i < n; i++) {
    dispatch_tensor *p = params[i];
    /* a NULL parameter is most often a failed creation: its error */
    if (!p) return dispatch__null_input(dev, name, i);
    if (p->dev != dev)
      return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                                           "%s: parameter %d lives on \"%s\", "
                                           "parameter 0 on \"%s\"",
                                           name, i, p->dev->spec, dev->spec));
    if (p->kind != DISPATCH_KIND_AUTODIFF)
      return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EKIND,
                                           "%s: parameter %d is not AUTODIFF "
                                           "(wrap it with dispatch_autodiff)",
                                           name, i));
  }
  dispatch_optim *o = dsp_calloc(1, sizeof *o);
  if (!o)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "%s: out of memory", name));
  o->dev = dev;
  o->op = op;
  o->k = k;
  o->params = dsp_calloc((size_t)n, sizeof *o->params);
  o->states = dsp_calloc((size_t)n * (size_t)k, sizeof *o->states);
  if (!o->params || !o->states) {
    optim_destroy(o);
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "%s: out of memory", name));
  }
  for (int i = 0; i < nf; i++) o->floats[i] = f[i];
  o->n_floats = nf;
  for (int i = 0; i < n; i++) {
    o->params[i] = dispatch_tensor_ref(params[i]);
    o->n = i + 1;
  }
  for (int i = 0; i < n * k; i++) {
    dispatch_tensor *p = params[i / k];
    dsp_attrs a = dsp_attrs_none();
    a.ints[a.n_ints++] = p->meta.dtype;
    for (int d = 0; d < p->meta.ndim; d++) a.ints[a.n_ints++] = p->meta.shape[d];
    int rc = dispatch__run(dev, DSP_OP_ZEROS, NULL, 0, &a, 0, &o->states[i]);
    if (rc < 0) {
      optim_destroy(o);
      return rc;
    }
  }
  o->next = dev->optims;
  if (dev->optims) dev->optims->prev = o;
  dev->optims = o;
  *out = o;
  return 0;
}

int dispatch_sgd_new(dispatch_tensor *const *params, int n, double lr,
                     double momentum, double weight_decay,
                     dispatch_optim **out) {
  double f[3] = {lr, momentum, weight_decay};
  return optim_new(DSP_OP_SGD_STEP, 1, params, n, f, 3, out);
}

int dispatch_adam_new(dispatch_tensor *const *params, int n, double lr,
                      double beta1, double beta2, double eps,
                      dispatch_optim **out) {
  double f[4] = {lr, beta1, beta2, eps};
  return optim_new(DSP_OP_ADAM_STEP, 2, params, n, f, 4, out);
}

/* The decays are checked here, where the error can name the parameter;
 * lr, betas and eps are checked by the op at the first step, as Adam's. */
int dispatch_adamw_new(dispatch_tensor *const *params, int n, double lr,
                       double beta1, double beta2, double eps,
                       const double *weight_decay, dispatch_optim **out) {
  if (out) *out = NULL;
  if (weight_decay && params && n > 0)
    for (int i = 0; i < n; i++)
      if (!isfinite(weight_decay[i])) {
        dispatch_device *dev = params[0] ? params[0]->dev : NULL;
        if (!dev) return DISPATCH_EINVAL;
        return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                             "adamw: weight_decay[%d] = %g "
                                             "is not finite",
                                             i, weight_decay[i]));
      }
  double f[4] = {lr, beta1, beta2, eps};
  int rc = optim_new(DSP_OP_ADAMW_STEP, 2, params, n, f, 4, out);
  if (rc < 0 || !weight_decay) return rc;
  dispatch_optim *o = *out;
  o->wd = dsp_calloc((size_t)n, sizeof *o->wd);
  if (!o->wd) {
    dispatch_device *dev = o->dev;
    dispatch_optim_free(o);
    *out = NULL;
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "adamw: out of memory"));
  }
  for (int i = 0; i < n; i++) o->wd[i] = weight_decay[i];
  return 0;
}

int dispatch_optim_set_clip(dispatch_optim *opt, double max_norm) {
  if (!opt) return DISPATCH_EINVAL;
  if (!(max_norm >= 0.0) || isinf(max_norm))
    return dispatch__ret(opt->dev,
                         dsp_seterr(opt->dev->ctx, DISPATCH_EINVAL,
                                    "optim_set_clip: max_norm = %g is not "
                                    "finite and >= 0",
                                    max_norm));
  if (max_norm > 0.0 && !opt->norm) {
    /* where the steps leave their norm: an f64 scalar, 0 until then */
    dsp_attrs a = dsp_attrs_none();
    a.ints[a.n_ints++] = DSP_F64;
    int rc = dispatch__run(opt->dev, DSP_OP_ZEROS, NULL, 0, &a, 0, &opt->norm);
    if (rc < 0) return rc;
  }
  opt->max_norm = max_norm;
  return 0;
}

int dispatch_optim_last_norm(dispatch_optim *opt, double *norm) {
  if (norm) *norm = NAN;
  if (!opt || !norm) return DISPATCH_EINVAL;
  if (!opt->norm)
    return dispatch__ret(opt->dev,
                         dsp_seterr(opt->dev->ctx, DISPATCH_EINVAL,
                                    "optim_last_norm: the optimizer has "
                                    "never clipped (dispatch_optim_set_clip)"));
  return dispatch_tensor_read(opt->norm, norm, sizeof *norm);
}

int dispatch_optim_set_loss_scale(dispatch_optim *opt, double init_scale,
                                  double growth, double backoff,
                                  int64_t interval) {
  if (!opt) return DISPATCH_EINVAL;
  dispatch_device *dev = opt->dev;
  DISPATCH__GUARD(dev, "optim_set_loss_scale");
  if (init_scale == 0.0) {
    dispatch__tensor_unref(opt->ls_scale);
    dispatch__tensor_unref(opt->ls_counts);
    opt->ls_scale = opt->ls_counts = NULL;
    return 0;
  }
  /* the scale is kept in f32, as torch's: it must be one */
  if (!(init_scale > 0.0) || !isfinite((float)init_scale) ||
      (float)init_scale == 0.0f || !(growth >= 1.0) || isinf(growth) ||
      !(backoff > 0.0) || backoff > 1.0 || interval < 1)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "optim_set_loss_scale: takes "
                                         "init_scale > 0 and finite in f32 "
                                         "(got %g), growth >= 1 (got %g), "
                                         "backoff in (0, 1] (got %g) and "
                                         "interval >= 1 (got %lld)",
                                         init_scale, growth, backoff,
                                         (long long)interval));
  dsp_attrs fa = dsp_attrs_none(), za = dsp_attrs_none();
  fa.ints[fa.n_ints++] = DSP_F32;
  fa.floats[fa.n_floats++] = init_scale;
  za.ints[za.n_ints++] = DSP_I64;
  za.ints[za.n_ints++] = 2;
  dispatch_tensor *sc = NULL, *counts = NULL;
  int rc = dispatch__run(dev, DSP_OP_FULL, NULL, 0, &fa, 0, &sc);
  if (rc == 0) rc = dispatch__run(dev, DSP_OP_ZEROS, NULL, 0, &za, 0, &counts);
  if (rc < 0) {
    dispatch__tensor_unref(sc);
    return rc;
  }
  dispatch__tensor_unref(opt->ls_scale);
  dispatch__tensor_unref(opt->ls_counts);
  opt->ls_scale = sc;
  opt->ls_counts = counts;
  opt->ls_growth = growth;
  opt->ls_backoff = backoff;
  opt->ls_interval = interval;
  return 0;
}

/* The scaler's tensors, or DISPATCH_EINVAL naming the caller. */
static int loss_scaler_on(dispatch_optim *opt, const char *name) {
  if (opt->ls_scale) return 0;
  return dispatch__ret(opt->dev,
                       dsp_seterr(opt->dev->ctx, DISPATCH_EINVAL,
                                  "%s: the optimizer has no loss scale "
                                  "(dispatch_optim_set_loss_scale)",
                                  name));
}

int dispatch_optim_scale_loss(dispatch_optim *opt, dispatch_tensor *loss,
                              dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!opt || !out) return DISPATCH_EINVAL;
  int rc = loss_scaler_on(opt, "optim_scale_loss");
  if (rc < 0) return rc;
  if (!loss) return dispatch__null_input(opt->dev, "optim_scale_loss", 0);
  dsp_dtype dt = loss->meta.dtype;
  if (dt != DSP_F32 && dt != DSP_F64 && dt != DSP_F16 &&
      dt != DSP_BF16)
    return dispatch__ret(opt->dev, dsp_seterr(opt->dev->ctx, DISPATCH_EDTYPE,
                                              "optim_scale_loss: the loss "
                                              "is %s, not a float",
                                              dsp_dtype_name(dt)));
  /* f32 and f64 keep their dtype; a half loss is scaled in f32, where
   * the scale itself (up to 2^127) fits */
  dsp_attrs ca = dsp_attrs_none();
  ca.ints[ca.n_ints++] = dt == DSP_F64 ? DSP_F64 : DSP_F32;
  dispatch_tensor *in[2] = {loss, opt->ls_scale}, *tmp = NULL;
  int which = dt == DSP_F64 ? 1 : dt != DSP_F32 ? 0 : -1;
  if (which >= 0) {
    rc = dispatch__run(opt->dev, DSP_OP_CAST, &in[which], 1, &ca, 0, &tmp);
    if (rc < 0) return rc;
    in[which] = tmp;
  }
  rc = dispatch__run(opt->dev, DSP_OP_MUL, in, 2, NULL, 1, out);
  dispatch__tensor_unref(tmp);
  return rc;
}

int dispatch_optim_loss_scale(dispatch_optim *opt, double *scale,
                              int64_t *skipped) {
  if (scale) *scale = NAN;
  if (skipped) *skipped = -1;
  if (!opt || !scale) return DISPATCH_EINVAL;
  int rc = loss_scaler_on(opt, "optim_loss_scale");
  if (rc < 0) return rc;
  float s;
  int64_t c[2];
  rc = dispatch_tensor_read(opt->ls_scale, &s, sizeof s);
  if (rc == 0 && skipped) rc = dispatch_tensor_read(opt->ls_counts, c, sizeof c);
  if (rc < 0) return rc;
  *scale = s;
  if (skipped) *skipped = c[1];
  return 0;
}

double dispatch_lr_cosine(int64_t step, int64_t warmup, int64_t total,
                          double lr_max, double lr_min) {
  if (step < warmup) return lr_max * (double)(step + 1) / (double)warmup;
  if (step >= total) return lr_min;
  double pi = 3.14159265358979323846;
  double frac = (double)(step - warmup) / (double)(total - warmup);
  return lr_min + 0.5 * (1.0 + cos(pi * frac)) * (lr_max - lr_min);
}

int dispatch_optim_set_lr(dispatch_optim *opt, double lr) {
  if (!opt) return DISPATCH_EINVAL;
  opt->floats[0] = lr;
  return 0;
}

int dispatch_optim_step(dispatch_optim *opt, dispatch_grads *grads) {
  if (!opt || !grads)
    return dispatch__null_input(opt ? opt->dev : grads ? grads->dev : NULL,
                                "optim_step", opt ? 1 : 0);
  dispatch_device *dev = opt->dev;
  DISPATCH__GUARD(dev, "optim_step");
  if (grads->dev != dev)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                                         "optim_step: gradients live on "
                                         "\"%s\", parameters on \"%s\"",
                                         grads->dev->spec, dev->spec));
  /* a parameter known to be poisoned fails the step here, before any
   * parameter changes and without a round trip */
  for (int i = 0; i < opt->n; i++)
    if (opt->params[i]->inner->status)
      return dispatch__poisoned_input(dev, opt->params[i]);
  dsp_attrs a = dsp_attrs_none();
  for (int i = 0; i < opt->n_floats; i++) a.floats[i] = opt->floats[i];
  a.n_floats = opt->n_floats;
  if (opt->op != DSP_OP_SGD_STEP) {
    a.ints[0] = opt->t + 1;
    a.n_ints = 1;
  }
  int rc = dev->ops->step(opt, grads, &a);
  if (rc == 0) rc = dispatch__sync_call(dev);
  if (rc < 0) return dispatch__ret(dev, rc);
  if (dev->capture) dispatch__graph_step(opt, grads, &a);
  opt->t++;
  return 0;
}

void dispatch_optim_free(dispatch_optim *opt) {
  if (!opt) return;
  dispatch_device *dev = opt->dev;
  if (opt->prev)
    opt->prev->next = opt->next;
  else
    dev->optims = opt->next;
  if (opt->next) opt->next->prev = opt->prev;
  optim_destroy(opt);
}
