/* Internal to libdispatch-client: the gradient helpers that autodiff runs
 * for each op (client/run.c). They left the public header (issue 13): a
 * user gets gradients from dispatch_backward / dispatch_grad, and keeping
 * these out of the ABI leaves the library free to change how a backward
 * rule is computed. They are compiled with hidden visibility and are not
 * in client/dispatch-client.map, so libdispatch-client.so does not export
 * them; the static archive still holds them for tests (tests/test_guards.c
 * checks their edge cases directly).
 *
 * Conventions as in dispatch_client.h: 0 or a negative DISPATCH_E* code,
 * *out is one new reference (or registered in the open scope), inputs are
 * borrowed. */
#ifndef DISPATCH_BACKWARD_H
#define DISPATCH_BACKWARD_H

#include <stdint.h>

#include "dispatch_client.h"

/* grad * f'(x), same shape */
int dispatch_relu_backward(dispatch_tensor *grad, dispatch_tensor *x,
                           dispatch_tensor **out);
int dispatch_gelu_backward(dispatch_tensor *grad, dispatch_tensor *x,
                           dispatch_tensor **out);
/* Zeros of in_shape with grad placed at the slice (dim, start, end, step). */
int dispatch_slice_backward(dispatch_tensor *grad, int64_t dim,
                            int64_t start, int64_t end, int64_t step,
                            int in_ndim, const int64_t *in_shape,
                            dispatch_tensor **out);
/* Scatter-adds grad rows into zeros whose dim has size dim_size. */
int dispatch_index_select_backward(dispatch_tensor *grad,
                                   dispatch_tensor *index, int64_t dim,
                                   int64_t dim_size, dispatch_tensor **out);
/* (grad, y = softmax output) -> grad of the input */
int dispatch_softmax_backward(dispatch_tensor *grad, dispatch_tensor *y,
                              int64_t dim, dispatch_tensor **out);
int dispatch_log_softmax_backward(dispatch_tensor *grad, dispatch_tensor *y,
                                  int64_t dim, dispatch_tensor **out);
int dispatch_cross_entropy_backward(dispatch_tensor *grad,
                                    dispatch_tensor *logits,
                                    dispatch_tensor *labels,
                                    dispatch_tensor **out);
/* x_shape / w_shape: the 4 dims of the forward input / weight. */
int dispatch_conv2d_backward_input(dispatch_tensor *grad, dispatch_tensor *w,
                                   int64_t stride_h, int64_t stride_w,
                                   int64_t pad_h, int64_t pad_w,
                                   int64_t dil_h, int64_t dil_w,
                                   const int64_t x_shape[4],
                                   dispatch_tensor **out);
int dispatch_conv2d_backward_weight(dispatch_tensor *grad, dispatch_tensor *x,
                                    int64_t stride_h, int64_t stride_w,
                                    int64_t pad_h, int64_t pad_w,
                                    int64_t dil_h, int64_t dil_w,
                                    const int64_t w_shape[4],
                                    dispatch_tensor **out);
int dispatch_max_pool2d_backward(dispatch_tensor *grad, dispatch_tensor *x,
                                 int64_t kh, int64_t kw, int64_t stride_h,
                                 int64_t stride_w, int64_t pad_h,
                                 int64_t pad_w, dispatch_tensor **out);
int dispatch_avg_pool2d_backward(dispatch_tensor *grad, dispatch_tensor *x,
                                 int64_t kh, int64_t kw, int64_t stride_h,
                                 int64_t stride_w, int64_t pad_h,
                                 int64_t pad_w, dispatch_tensor **out);

#endif
