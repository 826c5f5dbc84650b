/* issue 23: loss. The per-position math of the CUDA cross_entropy_ex
 * kernels (common/cuda/loss.cu), written once for host and device like
 * cuda_math.h, so tests/test_cuda_host.c replays the kernels with these
 * very functions. The formulas are the CPU kernel's (common/cpu/loss.c):
 * only the order of the row sums differs (a block tree of log-sum-exp and
 * compensated sums). */
#ifndef DSP_CUDA_LOSS_MATH_H
#define DSP_CUDA_LOSS_MATH_H

#include "cuda_math.h"

/* The loss of one non-ignored position: lse of its logits, sx their sum,
 * xy the label's logit; eps the smoothing over C classes. */
DSP_HD double dsp__cu_ce_loss(double lse, double sx, double xy, int64_t C,
                              double eps) {
  double nll = lse - xy;
  if (eps > 0.0) return (1.0 - eps) * nll + eps * (lse - sx / (double)C);
  return nll;
}

/* d loss / d x of one logit x of a non-ignored position (is_y: x is the
 * label's), the position's loss weighted by w. */
DSP_HD double dsp__cu_ce_grad(double x, double lse, int is_y, int64_t C,
                              double eps, double w) {
  double p = exp(x - lse);
  double t = is_y ? 1.0 - eps : 0.0;
  return w * (p - t - eps / (double)C);
}

/* conv2d_bias: one output element v of channel plane with bias b, as the
 * CPU kernel adds it (in double, rounded once when stored) */
DSP_HD double dsp__cu_bias_add(double v, double b) { return v + b; }

#endif
