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
    for (int64_t i = 0; i < n; i++) {
      double pi = dsp__ld(p, f, i), gi = dsp__ld(g, f, i), vi = dsp__ld(v, f, i);
      vi = mom * vi + gi + wd * pi;
      dsp__st(v, f, i, vi);
      dsp__st(p, f, i, pi - lr * vi);
    }
  } else if (op == DSP_OP_ADAM_STEP) {
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
  } else {
    return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  void *o = dsp_tensor_data(out);
  if (o != p) memcpy(o, p, dsp_tensor_nbytes(in[0]));
  return 0;
}
