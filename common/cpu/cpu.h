/* Internal to the CPU backend (common/cpu/): the family kernels
 * cpu/backend.c dispatches to, and the refusal they share. */
#ifndef DSP_CPU_H
#define DSP_CPU_H

#include "dsp_internal.h"

#define DSP_CPU_FAMILY_DECL_(fam)                                            \
  int dsp__cpu_##fam(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,     \
                     int n_in, const dsp_attrs *a, dsp_tensor *out);
DSP_CPU_FAMILY_DECL_(ew)
DSP_CPU_FAMILY_DECL_(red)
DSP_CPU_FAMILY_DECL_(shape)
DSP_CPU_FAMILY_DECL_(linalg)
DSP_CPU_FAMILY_DECL_(nn)
DSP_CPU_FAMILY_DECL_(create)
DSP_CPU_FAMILY_DECL_(optim)
#undef DSP_CPU_FAMILY_DECL_

/* 1 when the CPU kernels implement op for key dtype `key`
 * (dsp__op_key_dtype): the CPU backend's supports_op table, which the
 * CUDA backend claims as its own. */
int dsp__cpu_has_kernel(dsp_opcode op, dsp_dtype key);

/* The end of every kernel dispatch: an op x dtype the CPU kernels have no
 * loop for is DISPATCH_EUNSUPPORTED naming the op, the dtypes and "cpu",
 * never a silent success with the zeroed output. */
int dsp__no_kernel(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   int n_in, const dsp_tensor *out);

#endif
