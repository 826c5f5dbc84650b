/* Internal to the CPU backend: the conv kernels (common/cpu/kern_nn_conv.c)
 * the nn family's kernels (common/cpu/nn.c) call; the geometry comes from
 * the shared plan (common/ops_plan.h). */
#ifndef KERN_NN_H
#define KERN_NN_H

#include "ops_plan.h"

/* Runs conv2d (a = x, b = w), conv2d_backward_input (a = grad, b = w) or
 * conv2d_backward_weight (a = grad, b = x) into the zeroed output `out`
 * (f64 when f64 is set, else f32). Returns 0, or DISPATCH_ENOMEM with
 * nothing leaked when the im2col buffer cannot be allocated, or
 * DISPATCH_ECANCELED (output partly written) when ctx was cancelled. */
int dsp__kern_conv2d(dsp_ctx *ctx, dsp_opcode op, const dsp_conv_geo *g,
                     int f64, const void *a, const void *b, void *out);

#endif
