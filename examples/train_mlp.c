/* train_mlp: an MLP 784-256-10 (ReLU, cross-entropy, Adam lr 1e-3, batch
 * 128, He-uniform init from a fixed seed) on Fashion-MNIST, on any device:
 *
 *   train_mlp --device local --epochs 3
 *   train_mlp --device tcp://127.0.0.1:7000 --epochs 3
 *   DISPATCH_DEVICE=tcp://127.0.0.1:7000 train_mlp
 *
 * The same code runs on both: only the device string changes. Prints a
 * progress line every 100 steps and, per epoch, the mean loss, the test
 * accuracy on the 10,000 test images and the epoch time. The model and the
 * loop are in lib/train_util.c. */
#include "train_util.h"

#define MLP_HIDDEN 256

static int mlp_init(dispatch_device *dev, uint64_t seed, tr_model *m) {
  return tr_mlp_init(dev, MLP_HIDDEN, seed, m);
}

int main(int argc, char **argv) {
  tr_opts defaults;
  tr_opts_default(&defaults, 3);
  return tr_main(argc, argv, "train_mlp", &defaults, mlp_init);
}
