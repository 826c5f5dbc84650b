/* Internal to common/: geometry shared by the nn family's inference
 * (common/ops_nn.c) and its conv kernels (common/kern_nn_conv.c). */
#ifndef KERN_NN_H
#define KERN_NN_H

#include "dsp.h"

/* conv2d(x [N,C,H,W], w [O,C,KH,KW]) -> [N,O,OH,OW]; every size has been
 * validated, and C*KH*KW, OH*OW and O fit in an int. */
typedef struct dsp_conv_geo {
  int64_t N, C, H, W, O, KH, KW, OH, OW;
  int64_t sh, sw, ph, pw, dh, dw;
} dsp_conv_geo;

/* pool on [N,C,H,W] with a KHxKW window -> [N,C,OH,OW] */
typedef struct dsp_pool_geo {
  int64_t N, C, H, W, KH, KW, OH, OW;
  int64_t sh, sw, ph, pw;
} dsp_pool_geo;

/* Runs conv2d (a = x, b = w), conv2d_backward_input (a = grad, b = w) or
 * conv2d_backward_weight (a = grad, b = x) into the zeroed output `out`
 * (f64 when f64 is set, else f32). Returns 0, or DISPATCH_ENOMEM with
 * nothing leaked when the im2col buffer cannot be allocated, or
 * DISPATCH_ECANCELED (output partly written) when ctx was cancelled. */
int dsp__kern_conv2d(dsp_ctx *ctx, dsp_opcode op, const dsp_conv_geo *g,
                     int f64, const void *a, const void *b, void *out);

#endif
