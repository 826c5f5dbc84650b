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

_Static_assert(DSP__OPS_IN_FAMILY(OPTIM) == 2,
               "a new optimizer op needs a case in dsp__cpu_optim and a row "
               "in the CPU support table (common/cpu/backend.c)");

/* One loop per element type, with no per-element type test, so the
 * compiler can keep the double arithmetic in vector registers. The
 * arithmetic is the same expression, in the same order, for both types:
 * the results do not depend on how the loop is compiled (no contraction
 * into fused multiply-adds under -std=c11). sqrt of a sum of squares is
 * never negative, so __builtin_sqrt needs no errno path. */
#define DEFINE_OPTIM_KERNELS(T, SFX)                                         \
  DSP_CPU_CLONES                                                             \
  static void sgd_##SFX(T *p, const T *g, T *v, int64_t n, double lr,        \
                        double mom, double wd) {                             \
    if (mom == 0.0 && wd == 0.0) {                                           \
      for (int64_t i = 0; i < n; i++) {                                      \
        T gi = g[i];                                                         \
        v[i] = gi;                                                           \
        p[i] = (T)((double)p[i] - lr * (double)gi);                          \
      }                                                                      \
      return;                                                                \
    }                                                                        \
    for (int64_t i = 0; i < n; i++) {                                        \
      double pi = p[i], vi = mom * (double)v[i] + (double)g[i] + wd * pi;    \
      v[i] = (T)vi;                                                          \
      p[i] = (T)(pi - lr * vi);                                              \
    }                                                                        \
  }                                                                          \
  DSP_CPU_CLONES                                                             \
  static void adam_##SFX(T *p, const T *g, T *m, T *v, int64_t n, double lr, \
                         double b1, double b2, double eps, double bc1,       \
                         double bc2) {                                       \
    for (int64_t i = 0; i < n; i++) {                                        \
      double pi = p[i], gi = g[i];                                           \
      double mi = b1 * (double)m[i] + (1.0 - b1) * gi;                       \
      double vi = b2 * (double)v[i] + (1.0 - b2) * gi * gi;                  \
      m[i] = (T)mi;                                                          \
      v[i] = (T)vi;                                                          \
      p[i] = (T)(pi - lr * (mi / bc1) / (__builtin_sqrt(vi / bc2) + eps));   \
    }                                                                        \
  }
DEFINE_OPTIM_KERNELS(float, f32)
DEFINE_OPTIM_KERNELS(double, f64)

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
    void *v = dsp_tensor_data(in[2]);
    if (f) sgd_f64(p, g, v, n, lr, mom, wd);
    else sgd_f32(p, g, v, n, lr, mom, wd);
  } else if (op == DSP_OP_ADAM_STEP) {
    double lr = a->floats[0], b1 = a->floats[1], b2 = a->floats[2],
           eps = a->floats[3];
    double t = (double)a->ints[0];
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    void *m = dsp_tensor_data(in[2]), *v = dsp_tensor_data(in[3]);
    if (f) adam_f64(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2);
    else adam_f32(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2);
  } else {
    return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  void *o = dsp_tensor_data(out);
  if (o != p) memcpy(o, p, dsp_tensor_nbytes(in[0]));
  return 0;
}
