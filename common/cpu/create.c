/* create family, CPU kernels (inference and the rules for values:
 * common/ops_create.c). */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "half.h"
#include "ops_plan.h"
#include "rng.h"

_Static_assert(DSP__OPS_IN_FAMILY(CREATE) == 6,
               "a new creation op needs a case in dsp__cpu_create and a row "
               "in the CPU support table (common/cpu/backend.c)");

/* Fills elements [i0, i1) of dtype dt with v (i64 checked exact by infer);
 * -1 (nothing written) for a dtype without a loop. */
static int fill(void *po, dsp_dtype dt, int64_t i0, int64_t i1, double v) {
  switch (dt) {
    case DSP_F32: { float *o = po, f = (float)v; for (int64_t i = i0; i < i1; i++) o[i] = f; break; }
    case DSP_F64: { double *o = po; for (int64_t i = i0; i < i1; i++) o[i] = v; break; }
    case DSP_I64: { int64_t *o = po, x = (int64_t)v; for (int64_t i = i0; i < i1; i++) o[i] = x; break; }
    case DSP_BOOL: memset((uint8_t *)po + i0, v != 0, (size_t)(i1 - i0)); break;
    case DSP_F16:
    case DSP_BF16: { /* one rounding from the double (common/half.h) */
      uint16_t *o = po, h = dt == DSP_F16 ? dsp_f64_to_f16(v) : dsp_f64_to_bf16(v);
      for (int64_t i = i0; i < i1; i++) o[i] = h;
      break;
    }
    default: return -1;
  }
  return 0;
}

/* Writes elements [i0, i1) of a creation op's n-element output; i0 is
 * even, so normal's pairs never straddle two calls. Every element depends
 * only on its index, so the output does not depend on the split. 0, or -1
 * (nothing written) for an op x dtype without a loop. */
static int create_range(dsp_opcode op, const dsp_attrs *a, dsp_dtype dt,
                         void *po, int64_t n, int64_t i0, int64_t i1) {
  switch (op) {
    case DSP_OP_ONES: return fill(po, dt, i0, i1, 1.0);
    case DSP_OP_FULL: return fill(po, dt, i0, i1, a->floats[0]);
    case DSP_OP_ARANGE: {
      double s = a->floats[0], st = a->floats[2];
      if (dt == DSP_I64) {
        int64_t *o = po, s0 = (int64_t)s, d = (int64_t)st;
        /* wrapping form: every value lies between start and end */
        for (int64_t i = i0; i < i1; i++)
          o[i] = (int64_t)((uint64_t)s0 + (uint64_t)i * (uint64_t)d);
      } else if (dt == DSP_F32) {
        float *o = po;
        for (int64_t i = i0; i < i1; i++) o[i] = (float)(s + (double)i * st);
      } else if (dt == DSP_F64) {
        double *o = po;
        for (int64_t i = i0; i < i1; i++) o[i] = s + (double)i * st;
      } else {
        return -1;
      }
      return 0;
    }
    case DSP_OP_UNIFORM: {
      if (dt != DSP_F32 && dt != DSP_F64) return -1;
      const uint64_t seed = (uint64_t)a->ints[1];
      const double lo = a->floats[0], hi = a->floats[1], w = hi - lo;
      if (dt == DSP_F64) {
        double *o = po;
        for (int64_t i = i0; i < i1; i++) {
          double v = lo + w * dsp_rng_uniform01(seed, (uint64_t)i);
          o[i] = (v >= hi && hi > lo) ? nextafter(hi, lo) : v;
        }
      } else {
        float *o = po;
        const float fhi = (float)hi, flo = (float)lo;
        for (int64_t i = i0; i < i1; i++) {
          float v = (float)(lo + w * dsp_rng_uniform01(seed, (uint64_t)i));
          o[i] = (v >= fhi && fhi > flo) ? nextafterf(fhi, flo) : v;
        }
      }
      return 0;
    }
    case DSP_OP_NORMAL: {
      if (dt != DSP_F32 && dt != DSP_F64) return -1;
      const uint64_t seed = (uint64_t)a->ints[1];
      const double mu = a->floats[0], sd = a->floats[1];
      for (int64_t i = i0; i < i1; i += 2) {
        double z0, z1;
        dsp_rng_normal_pair(seed, (uint64_t)i / 2, &z0, &z1);
        if (dt == DSP_F64) {
          double *o = po;
          o[i] = mu + sd * z0;
          if (i + 1 < n) o[i + 1] = mu + sd * z1;
        } else {
          float *o = po;
          o[i] = (float)(mu + sd * z0);
          if (i + 1 < n) o[i + 1] = (float)(mu + sd * z1);
        }
      }
      return 0;
    }
    default: return -1;
  }
}

/* Runs in blocks of DSP_POLL_WORK elements with a look at the cancel flag
 * before each. */
int dsp__cpu_create(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                    int n_in, const dsp_attrs *a, dsp_tensor *out) {
  void *po = dsp_tensor_data(out);
  const int64_t n = out->numel;
  const dsp_dtype dt = out->meta.dtype;
  switch (op) {
    case DSP_OP_ZEROS: return 0; /* dsp_op hands over zeroed storage */
    case DSP_OP_ONES:
    case DSP_OP_FULL:
    case DSP_OP_ARANGE:
    case DSP_OP_UNIFORM:
    case DSP_OP_NORMAL:
      break;
    default:
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  for (int64_t i0 = 0; i0 < n; i0 += DSP_POLL_WORK) {
    if (dsp_ctx_cancelled(ctx)) return dsp__cancelled_err(ctx, op);
    int64_t i1 = n - i0 < DSP_POLL_WORK ? n : i0 + DSP_POLL_WORK;
    /* the first block finds a missing loop before anything is written */
    if (create_range(op, a, dt, po, n, i0, i1) < 0)
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  return 0;
}
