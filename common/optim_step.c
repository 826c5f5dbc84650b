/* Optimizer steps: the arithmetic every runner of a step shares (see
 * "optimizer steps" in dsp.h). The norm is summed here on the host in one
 * fixed order, so the LOCAL device and a server agree bit for bit; on a
 * backend whose memory is not host memory the gradients are copied out
 * first (one copy of every gradient per clipped step). */
#include <math.h>
#include <string.h>

#include "dsp_internal.h"

int dsp_step_states(int op) {
  switch (op) {
    case DSP_OP_SGD_STEP: return 1;
    case DSP_OP_ADAM_STEP:
    case DSP_OP_ADAMW_STEP: return 2;
    default: return 0;
  }
}

/* Sum of squares of n elements, eight partial sums combined in a fixed
 * order: the same bits whatever the compiler vectorises, and no chain of
 * dependent adds as long as the gradient. */
#define DEFINE_SUMSQ(T, SFX)                                          \
  static double sumsq_##SFX(const T *x, int64_t n) {                  \
    double s[8] = {0};                                                \
    int64_t i = 0;                                                    \
    for (; i + 8 <= n; i += 8)                                        \
      for (int j = 0; j < 8; j++) {                                   \
        double v = (double)x[i + j];                                  \
        s[j] += v * v;                                                \
      }                                                               \
    for (int j = 0; i < n; i++, j++) {                                \
      double v = (double)x[i];                                        \
      s[j] += v * v;                                                  \
    }                                                                 \
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); \
  }
DEFINE_SUMSQ(float, f32)
DEFINE_SUMSQ(double, f64)

int dsp_grads_sqnorm(dsp_ctx *ctx, dsp_tensor *const *g, size_t n,
                     double *sq) {
  double total = 0.0;
  for (size_t i = 0; i < n; i++) {
    const dsp_tensor *t = g[i];
    int f64 = t->meta.dtype == DSP_F64;
    if (!f64 && t->meta.dtype != DSP_F32)
      return dsp_seterr(ctx, DISPATCH_EDTYPE,
                        "clip: gradient %zu is %s, not f32 or f64", i,
                        dsp_dtype_name(t->meta.dtype));
    size_t nb = dsp_tensor_nbytes(t);
    const void *data = dsp_tensor_data(t);
    void *copy = NULL;
    if (!(dsp_backend_caps(t->storage->backend) & DSP_CAP_HOST_MEMORY) &&
        nb > 0) {
      copy = dsp_malloc(nb);
      if (!copy)
        return dsp_seterr(ctx, DISPATCH_ENOMEM,
                          "clip: out of memory reading gradient %zu", i);
      int rc = dsp_tensor_read(ctx, t, copy, nb);
      if (rc < 0) {
        dsp_free(copy);
        return rc;
      }
      data = copy;
    }
    total += f64 ? sumsq_f64(data, t->numel) : sumsq_f32(data, t->numel);
    dsp_free(copy);
  }
  *sq = total;
  return 0;
}

/* t is `numel` elements of dtype dt, or an error naming `what`. */
static int check_small(dsp_ctx *ctx, const dsp_tensor *t, dsp_dtype dt,
                       int64_t numel, const char *what) {
  if (t->meta.dtype == dt && t->numel == numel) return 0;
  return dsp_seterr(ctx, t->meta.dtype != dt ? DISPATCH_EDTYPE
                                             : DISPATCH_ESHAPE,
                    "step: %s must be %lld %s, got %s of %lld elements",
                    what, (long long)numel, dsp_dtype_name(dt),
                    dsp_dtype_name(t->meta.dtype), (long long)t->numel);
}

int dsp_step_store_norm(dsp_ctx *ctx, dsp_tensor *t, double norm) {
  int rc = check_small(ctx, t, DSP_F64, 1, "the norm's tensor");
  return rc < 0 ? rc : dsp_tensor_write(ctx, t, &norm, sizeof norm);
}

double dsp_clip_scale(double max_norm, double norm) {
  double c = max_norm / (norm + 1e-6);
  /* a NaN c fails c < 1 but must still apply, as torch's clamp keeps it */
  return c < 1.0 || isnan(c) ? c : 1.0;
}

void dsp_step_param_attrs(int op, const dsp_attrs *base, const double *wd,
                          size_t i, int clip, double scale, dsp_attrs *out) {
  *out = *base;
  if (op == DSP_OP_ADAMW_STEP && out->n_floats < DSP_MAX_ATTR_FLOATS)
    out->floats[out->n_floats++] = wd ? wd[i] : 0.0;
  if (clip && out->n_floats < DSP_MAX_ATTR_FLOATS)
    out->floats[out->n_floats++] = scale;
}

int dsp_step_check_scaler(dsp_ctx *ctx, const dsp_step_scaler *sc) {
  int rc = check_small(ctx, sc->scale, DSP_F32, 1, "the loss scale");
  if (rc == 0)
    rc = check_small(ctx, sc->counts, DSP_I64, 2, "the loss scale's counts");
  if (rc < 0) return rc;
  if (!(sc->growth >= 1.0) || isinf(sc->growth) || !(sc->backoff > 0.0) ||
      sc->backoff > 1.0 || sc->interval < 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "step: loss scaling takes growth >= 1 (got %g), "
                      "backoff in (0, 1] (got %g) and interval >= 1 (got "
                      "%lld)",
                      sc->growth, sc->backoff, (long long)sc->interval);
  return 0;
}

int dsp_step_prepare(dsp_ctx *ctx, dsp_tensor *const *g, size_t n,
                     double max_norm, dsp_tensor *norm_t,
                     const dsp_step_scaler *sc, dsp_attrs *base,
                     dsp_step_plan *p) {
  int clip = max_norm > 0.0;
  memset(p, 0, sizeof *p);
  p->extra = clip || sc;
  p->factor = 1.0;
  p->scale = 1.0;
  if (sc) {
    float s;
    int rc = dsp_step_check_scaler(ctx, sc);
    if (rc == 0) rc = dsp_tensor_read(ctx, sc->scale, &s, sizeof s);
    if (rc == 0)
      rc = dsp_tensor_read(ctx, sc->counts, p->counts, sizeof p->counts);
    if (rc < 0) return rc;
    if (!(s > 0.0f) || isinf(s) || p->counts[0] < 0 || p->counts[1] < 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "step: the loss scale %g (counts %lld, %lld) is not "
                        "a positive finite scale with counts >= 0",
                        (double)s, (long long)p->counts[0],
                        (long long)p->counts[1]);
    p->scale = s;
    /* Adam's t counts the updates that ran, as torch's state["step"] */
    if (base && base->n_ints >= 1) base->ints[0] -= p->counts[1];
  }
  if (!clip && !norm_t && !sc) return 0;
  double sq;
  int rc = dsp_grads_sqnorm(ctx, g, n, &sq);
  if (rc < 0) return rc;
  /* scaling by a power of two is exact: the unscaled norm has the bits
   * an unscaled step would take */
  double norm = sqrt(sq) / p->scale;
  if (norm_t && (rc = dsp_step_store_norm(ctx, norm_t, norm)) < 0) return rc;
  /* the squares are summed in double: only an inf or NaN element makes
   * the sum non-finite */
  if (sc && !isfinite(sq)) {
    p->skip = 1;
    return 0;
  }
  p->factor = (clip ? dsp_clip_scale(max_norm, norm) : 1.0) / p->scale;
  return 0;
}

int dsp_step_finish(dsp_ctx *ctx, const dsp_step_scaler *sc,
                    const dsp_step_plan *p) {
  if (!sc) return 0;
  float s = (float)p->scale;
  int64_t c[2] = {p->counts[0] + 1, p->counts[1]};
  if (p->skip) {
    s = (float)(p->scale * sc->backoff);
    c[0] = 0;
    c[1]++;
  } else if (c[0] >= sc->interval) {
    float grown = (float)(p->scale * sc->growth);
    if (isfinite(grown)) s = grown;
    c[0] = 0;
  }
  int rc = dsp_tensor_write(ctx, sc->counts, c, sizeof c);
  return rc < 0 ? rc : dsp_tensor_write(ctx, sc->scale, &s, sizeof s);
}
