/* train_cnn: a small CNN on Fashion-MNIST, on any device:
 *
 *   conv 1->16 3x3 pad 1, relu, max_pool 2   [B, 16, 14, 14]
 *   conv 16->32 3x3 pad 1, relu, max_pool 2  [B, 32, 7, 7]
 *   flatten, linear 32*7*7 -> 10
 *
 * conv2d has no bias argument: each conv adds a [1, C, 1, 1] bias by
 * broadcasting. Adam lr 1e-3, batch 128, He-uniform init from a fixed seed,
 * 3 epochs (about 89% test accuracy; 1.5-2.5 min on 2 busy cores).
 * Same options and output as train_mlp (--device, --epochs, --data,
 * --limit, ...). The model and the loop are in lib/train_util.c. */
#include "train_util.h"

#define CNN_C1 16
#define CNN_C2 32
#define CNN_EPOCHS 3

static int cnn_init(dispatch_device *dev, uint64_t seed, tr_model *m) {
  return tr_cnn_init(dev, CNN_C1, CNN_C2, seed, m);
}

int main(int argc, char **argv) {
  tr_opts defaults;
  tr_opts_default(&defaults, CNN_EPOCHS);
  /* conv2's im2col buffer grows with the batch (1000 images: 113 MB, a
   * fresh mmap and page faults per call); 100 evaluates faster */
  defaults.eval_batch = 100;
  return tr_main(argc, argv, "train_cnn", &defaults, cnn_init);
}
