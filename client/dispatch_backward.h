/* Internal to libdispatch-client: the gradient helpers that autodiff runs
 * for each op (client/run.c). They left the public header (issue 13): a
 * user gets gradients from dispatch_backward / dispatch_grad, and keeping
 * these out of the ABI leaves the library free to change how a backward
 * rule is computed. They are compiled with hidden visibility and are not
 * in the version script, so libdispatch-client.so does not export them;
 * the static archive still holds them for tests (tests/test_guards.c
 * checks their edge cases directly).
 *
 * They are the rows of DSP_OP_MAP (common/dsp.h) whose surface is BWD:
 * each is declared here from its row's signature (client/op_sigs.h), the
 * two irregular (HAND) ones by hand below.
 *   relu_backward, gelu_backward, softplus_backward, gelu_tanh_backward
 *     (grad, x): grad * f'(x), same shape
 *   softmax_backward, log_softmax_backward (grad, y = the forward output,
 *     dim): the grad of the input
 *   cross_entropy_backward (grad, logits, labels)
 *   conv2d_backward_input (grad, w, conv ints, the 4 dims of the forward
 *     input), conv2d_backward_weight (grad, x, conv ints, the 4 dims of
 *     the weight)
 *   max_pool2d_backward, avg_pool2d_backward (grad, x, pool ints; the
 *     op also takes avg_pool2d_ex's count_include_pad as a 7th int, which
 *     autodiff passes and this helper does not)
 *   cross_entropy_ex_backward (grad, logits, labels, the forward's
 *     ignore_index, label_smoothing, reduction)
 *
 * Conventions as in dispatch_client.h: 0 or a negative DISPATCH_E* code,
 * *out is one new reference (or registered in the open scope), inputs are
 * borrowed. */
#ifndef DISPATCH_BACKWARD_H
#define DISPATCH_BACKWARD_H

#include <stdint.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "op_sigs.h"

#define DISPATCH__BWD_ROW_(NAME, code, name, nin, fam, sig, api) \
  DISPATCH__DECL_BWD(api, sig, name)
DSP_OP_MAP(DISPATCH__BWD_ROW_)
#undef DISPATCH__BWD_ROW_

/* Zeros of in_shape with grad placed at the slice (dim, start, end, step). */
int dispatch_slice_backward(dispatch_tensor *grad, int64_t dim,
                            int64_t start, int64_t end, int64_t step,
                            int in_ndim, const int64_t *in_shape,
                            dispatch_tensor **out);
/* Scatter-adds grad rows into zeros whose dim has size dim_size. */
int dispatch_index_select_backward(dispatch_tensor *grad,
                                   dispatch_tensor *index, int64_t dim,
                                   int64_t dim_size, dispatch_tensor **out);

/* issue 23: loss. The gradient of cross_entropy_ex w.r.t. the logits;
 * grad has the forward output's shape, the other arguments are the
 * forward's. */
int dispatch_cross_entropy_ex_backward(dispatch_tensor *grad,
                                       dispatch_tensor *logits,
                                       dispatch_tensor *labels,
                                       int64_t ignore_index,
                                       double label_smoothing, int reduction,
                                       dispatch_tensor **out);

#endif
