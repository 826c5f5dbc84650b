/* Internal to common/: the ctx layout and hooks between the op runner and
 * the autodiff engine. server/ and client/ include dsp.h only. */
#ifndef DSP_INTERNAL_H
#define DSP_INTERNAL_H

#include "dsp.h"

struct dsp_ctx {
  const dsp_backend *backend;
  dsp_budget *budget; /* NULL: unlimited */
  int grad_enabled;
  int64_t max_span; /* dsp_ctx_set_max_elements; 0: no limit */
  char err[512];
};

/* Kernel scratch of n bytes charged to ctx's budget: 0, or
 * DISPATCH_EQUOTA / DISPATCH_ENOMEM with the detail in ctx and *out NULL.
 * Free with the same n on the same ctx. */
int dsp__scratch_alloc(dsp_ctx *ctx, size_t n, const char *what, void **out);
void dsp__scratch_free(dsp_ctx *ctx, void *p, size_t n);

/* Called by dsp_op after a successful kernel when grad mode is on and at
 * least one input is tracked: records the op so `out` becomes tracked.
 * On failure out is left untouched (the caller drops it). */
int dsp__autodiff_record(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                         int n_in, const dsp_attrs *a, dsp_tensor *out);
/* Drops a node reference (called when a tracked tensor is freed). */
void dsp__node_unref(struct dsp_node *n);

/* Infer helper of the op families: exactly n_ints int and n_floats float
 * attributes, else DISPATCH_EINVAL naming the op and all four counts. */
int dsp__want_attrs(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                    int n_ints, int n_floats);

/* Element i of a float buffer (f64 != 0: double, else float) as double,
 * and the store back; for kernels that compute in double for both. */
static inline double dsp__ld(const void *p, int f64, int64_t i) {
  return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
static inline void dsp__st(void *p, int f64, int64_t i, double v) {
  if (f64)
    ((double *)p)[i] = v;
  else
    ((float *)p)[i] = (float)v;
}

#endif
