/* Internal to the CPU backend (common/cpu/): the family kernels
 * cpu/backend.c dispatches to, and the refusal they share. */
#ifndef DSP_CPU_H
#define DSP_CPU_H

#include "backend.h"
#include "dsp_internal.h"

/* On x86-64 with GCC, a hot kernel loop marked DSP_CPU_CLONES is compiled
 * once per vector width (AVX-512, AVX2, baseline SSE2) and the widest the
 * CPU runs is picked when the library loads. The arithmetic is the same
 * expressions in the same order, never contracted into fused multiply-adds
 * (-std=c11 turns contraction off), so every clone gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    defined(__has_attribute)
#if __has_attribute(target_clones)
#define DSP_CPU_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef DSP_CPU_CLONES
#define DSP_CPU_CLONES
#endif

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
/* issue 23: embedding, layer_norm, rms_norm and their backward ops
 * (cpu/norm.c), reached through dsp__cpu_nn */
int dsp__cpu_norm(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out);
/* attention and attention_backward (common/cpu/attn.c), part of nn */
int dsp__cpu_attn(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out);

/* The end of every kernel dispatch: an op x dtype the CPU kernels have no
 * loop for is DISPATCH_EUNSUPPORTED naming the op, the dtypes and "cpu",
 * never a silent success with the zeroed output. */
int dsp__no_kernel(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                   int n_in, const dsp_tensor *out);

#endif
