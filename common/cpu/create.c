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
    default: return -1;
  }
  return 0;
}

/* Writes elements [i0, i1) of a creation op's n-element output, element
 * i at po[i - base]; i0 is even, so normal's pairs never straddle two
 * calls. Every element depends only on its index, so the output does not
 * depend on the split. 0, or -1 (nothing written) for an op x dtype
 * without a loop. */
static int create_range(dsp_opcode op, const dsp_attrs *a, dsp_dtype dt,
                         void *po, int64_t n, int64_t i0, int64_t i1,
                         int64_t base) {
  switch (op) {
    case DSP_OP_ONES: return fill(po, dt, i0 - base, i1 - base, 1.0);
    case DSP_OP_FULL: return fill(po, dt, i0 - base, i1 - base, a->floats[0]);
    case DSP_OP_ARANGE: {
      double s = a->floats[0], st = a->floats[2];
      if (dt == DSP_I64) {
        int64_t *o = po, s0 = (int64_t)s, d = (int64_t)st;
        /* wrapping form: every value lies between start and end */
        for (int64_t i = i0; i < i1; i++)
          o[i - base] = (int64_t)((uint64_t)s0 + (uint64_t)i * (uint64_t)d);
      } else if (dt == DSP_F32) {
        float *o = po;
        for (int64_t i = i0; i < i1; i++) o[i - base] = (float)(s + (double)i * st);
      } else if (dt == DSP_F64) {
        double *o = po;
        for (int64_t i = i0; i < i1; i++) o[i - base] = s + (double)i * st;
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
          o[i - base] = (v >= hi && hi > lo) ? nextafter(hi, lo) : v;
        }
      } else {
        float *o = po;
        const float fhi = (float)hi, flo = (float)lo;
        for (int64_t i = i0; i < i1; i++) {
          float v = (float)(lo + w * dsp_rng_uniform01(seed, (uint64_t)i));
          o[i - base] = (v >= fhi && fhi > flo) ? nextafterf(fhi, flo) : v;
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
          o[i - base] = mu + sd * z0;
          if (i + 1 < n) o[i + 1 - base] = mu + sd * z1;
        } else {
          float *o = po;
          o[i - base] = (float)(mu + sd * z0);
          if (i + 1 < n) o[i + 1 - base] = (float)(mu + sd * z1);
        }
      }
      return 0;
    }
    default: return -1;
  }
}

/* The largest half below h's value (h finite and not the most negative):
 * one step toward minus infinity. */
static uint16_t half_below(uint16_t h) {
  if (h == 0) return 0x8001; /* +0: the negative smallest subnormal */
  return (h & 0x8000) ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/* create_range for f16 / bf16: each value computed in double as the f64
 * loop does and rounded once (arange's start + i * step is not rounded to
 * f32 first); uniform keeps its upper bound exclusive as the f32 loop does,
 * against hi rounded to the half dtype. */
static int create_half(dsp_opcode op, const dsp_attrs *a, dsp_dtype dt,
                       void *po, int64_t n, int64_t i0, int64_t i1) {
  enum { B = 512 }; /* even: normal's pairs stay whole */
  double buf[B];
  uint16_t *o = po;
  const int f16 = dt == DSP_F16;
  for (int64_t j0 = i0; j0 < i1; j0 += B) {
    const int64_t j1 = i1 - j0 < B ? i1 : j0 + B;
    if (create_range(op, a, DSP_F64, buf, n, j0, j1, j0) < 0) return -1;
    for (int64_t j = j0; j < j1; j++)
      o[j] = f16 ? dsp_f64_to_f16(buf[j - j0]) : dsp_f64_to_bf16(buf[j - j0]);
    if (op != DSP_OP_UNIFORM) continue;
    const double lo = a->floats[0], hi = a->floats[1];
    const uint16_t hh = f16 ? dsp_f64_to_f16(hi) : dsp_f64_to_bf16(hi),
                   hl = f16 ? dsp_f64_to_f16(lo) : dsp_f64_to_bf16(lo);
    const float vh = f16 ? dsp_f16_to_f32(hh) : dsp_bf16_to_f32(hh),
                vl = f16 ? dsp_f16_to_f32(hl) : dsp_bf16_to_f32(hl);
    for (int64_t j = j0; j < j1 && vh > vl; j++) {
      float v = f16 ? dsp_f16_to_f32(o[j]) : dsp_bf16_to_f32(o[j]);
      if (v >= vh) o[j] = half_below(hh);
    }
  }
  return 0;
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
    if ((dsp_dtype_is_half(dt) ? create_half(op, a, dt, po, n, i0, i1)
                               : create_range(op, a, dt, po, n, i0, i1, 0)) < 0)
      return dsp__no_kernel(ctx, op, in, n_in, out);
  }
  return 0;
}
