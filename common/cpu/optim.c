/* optim family, CPU kernels (validation: common/ops_optim.c).
 *
 * The parameter is inputs[0]; dsp_op hands that same tensor in as `out`.
 * Each element reads param, grad and state before writing, and the update
 * is computed in double and rounded once, so f32 and f64 behave alike and
 * results are bit-identical run to run. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"

#define opname dsp__opname

_Static_assert(DSP__OPS_IN_FAMILY(OPTIM) == 3,
               "a new optimizer op needs a case in dsp__cpu_optim and a row "
               "in the CPU support table (common/cpu/backend.c)");

/* One loop per element type, with no per-element type test, so the
 * compiler can keep the double arithmetic in vector registers. The
 * arithmetic is the same expression, in the same order, for both types:
 * the results do not depend on how the loop is compiled (no contraction
 * into fused multiply-adds under -std=c11). sqrt of a sum of squares is
 * never negative, so __builtin_sqrt needs no errno path. gs is the clip's
 * gradient scale (1 when none: g * 1.0 is g exactly, so an unclipped step
 * gives the bits it gave before the scale existed). adamw's decay factor
 * dk = 1 - lr*wd is computed once, as torch's p.mul_(1 - lr*wd). */
#define DEFINE_OPTIM_KERNELS(T, SFX)                                         \
  DSP_CPU_CLONES                                                             \
  static void sgd_##SFX(T *p, const T *g, T *v, int64_t n, double lr,        \
                        double mom, double wd, double gs) {                  \
    if (mom == 0.0 && wd == 0.0) {                                           \
      for (int64_t i = 0; i < n; i++) {                                      \
        double gi = (double)g[i] * gs;                                       \
        v[i] = (T)gi;                                                        \
        p[i] = (T)((double)p[i] - lr * gi);                                  \
      }                                                                      \
      return;                                                                \
    }                                                                        \
    for (int64_t i = 0; i < n; i++) {                                        \
      double pi = p[i], vi = mom * (double)v[i] + (double)g[i] * gs + wd * pi; \
      v[i] = (T)vi;                                                          \
      p[i] = (T)(pi - lr * vi);                                              \
    }                                                                        \
  }                                                                          \
  DSP_CPU_CLONES                                                             \
  static void adam_##SFX(T *p, const T *g, T *m, T *v, int64_t n, double lr, \
                         double b1, double b2, double eps, double bc1,       \
                         double bc2, double dk, double gs) {                 \
    for (int64_t i = 0; i < n; i++) {                                        \
      double pi = (double)p[i] * dk, gi = (double)g[i] * gs;                 \
      double mi = b1 * (double)m[i] + (1.0 - b1) * gi;                       \
      double vi = b2 * (double)v[i] + (1.0 - b2) * gi * gi;                  \
      m[i] = (T)mi;                                                          \
      v[i] = (T)vi;                                                          \
      p[i] = (T)(pi - lr * (mi / bc1) / (__builtin_sqrt(vi / bc2) + eps));   \
    }                                                                        \
  }
DEFINE_OPTIM_KERNELS(float, f32)
DEFINE_OPTIM_KERNELS(double, f64)

/* the clip's gradient scale: the float after the op's own, 1 when absent */
static double grad_scale(const dsp_attrs *a, int n_own) {
  return a->n_floats > n_own ? a->floats[n_own] : 1.0;
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
  if (om.dtype != DSP_F32 && om.dtype != DSP_F64)
    return dsp__no_kernel(ctx, op, in, n_in, out);
  int f = om.dtype == DSP_F64;
  void *p = dsp_tensor_data(in[0]);
  const void *g = dsp_tensor_data(in[1]);
  int64_t n = in[0]->numel;
  if (op == DSP_OP_SGD_STEP) {
    double lr = a->floats[0], mom = a->floats[1], wd = a->floats[2];
    double gs = grad_scale(a, 3);
    void *v = dsp_tensor_data(in[2]);
    if (f) sgd_f64(p, g, v, n, lr, mom, wd, gs);
    else sgd_f32(p, g, v, n, lr, mom, wd, gs);
  } else if (op == DSP_OP_ADAM_STEP || op == DSP_OP_ADAMW_STEP) {
    int w = op == DSP_OP_ADAMW_STEP;
    double lr = a->floats[0], b1 = a->floats[1], b2 = a->floats[2],
           eps = a->floats[3];
    /* adam: dk = 1 exactly, so p * dk is p and adam's bits are unchanged */
    double dk = w ? 1.0 - lr * a->floats[4] : 1.0;
    double gs = grad_scale(a, 4 + w);
    double t = (double)a->ints[0];
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    void *m = dsp_tensor_data(in[2]), *v = dsp_tensor_data(in[3]);
    if (f) adam_f64(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2, dk, gs);
    else adam_f32(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2, dk, gs);
  } else {
    return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  void *o = dsp_tensor_data(out);
  if (o != p) memcpy(o, p, dsp_tensor_nbytes(in[0]));
  return 0;
}
