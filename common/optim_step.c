/* Optimizer steps: the arithmetic every runner of a step shares (see
 * "optimizer steps" in dsp.h). The norm is summed here on the host in one
 * fixed order, so the LOCAL device and a server agree bit for bit; on a
 * backend whose memory is not host memory the gradients are copied out
 * first (one copy of every gradient per clipped step). */
#include <math.h>

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
