/* Shared code of the training examples (train_mlp, train_cnn): command
 * line, the two models, and a training loop written only against the
 * public client API (dispatch_client.h), so the same program trains on
 * "local" or on a dispatch-server ("tcp://HOST:PORT").
 *
 * Every step runs inside a scope (dispatch_scope_begin/end), so the
 * intermediate tensors of a step are dropped together and nothing grows
 * across steps. Parameters are AUTODIFF leaves updated in place by an Adam
 * optimizer. Evaluation runs the forward on the plain inner tensors of the
 * parameters (no tape) and reads back only the argmax predictions.
 *
 * Errors: every function returns 0 or a negative DISPATCH_E* code and has
 * already printed "<what> failed: <code name>: <device detail>" to stderr.
 */
#ifndef EXAMPLES_TRAIN_UTIL_H
#define EXAMPLES_TRAIN_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch_client.h"
#include "idx.h"

#define TR_MAX_PARAMS 8
#define TR_IMAGE_SIZE 784 /* 28 x 28 */
#define TR_CLASSES 10

typedef struct tr_opts {
  const char *device; /* NULL: env DISPATCH_DEVICE, else "local" */
  const char *data;   /* dataset folder */
  int epochs;
  size_t limit;       /* use the first `limit` training images; 0: all */
  int batch;
  int eval_batch;
  double lr;
  uint64_t seed;      /* weight init and shuffling */
  int log_every;      /* progress line every N steps; 0: none */
  double min_acc;     /* final test accuracy (percent) below this: failure */
  int quiet;          /* 1: no progress or epoch lines (tests) */
} tr_opts;

typedef struct tr_model tr_model;
/* Computes logits [B, 10] from x [B, 784] f32 on the model's device.
 * train != 0 uses the AUTODIFF parameters (the result is AUTODIFF and a
 * backward reaches every parameter); train == 0 uses their plain inner
 * tensors so no tape is built. */
typedef int (*tr_forward_fn)(tr_model *m, dispatch_tensor *x, int train,
                             dispatch_tensor **logits);

struct tr_model {
  const char *name;
  dispatch_device *dev;
  int nparams;
  dispatch_tensor *params[TR_MAX_PARAMS]; /* AUTODIFF leaves, owned */
  int64_t nweights;                       /* total parameter elements */
  tr_forward_fn forward;
};

/* Result of one epoch. */
typedef struct tr_epoch {
  double mean_loss;    /* mean of the step losses */
  double accuracy;     /* percent of the test split classified right */
  double train_s;      /* seconds of the training steps */
  double eval_s;       /* seconds of the evaluation */
  double images_per_s; /* training throughput */
} tr_epoch;

/* Fills *o with the defaults (batch 128, lr 1e-3, seed 42, epochs given). */
void tr_opts_default(tr_opts *o, int epochs);

/* Parses --device --epochs --data --limit --batch --eval-batch --lr --seed
 * --log-every --min-acc --help. Returns 0, 1 when --help was printed, or -1
 * after printing what was wrong with which argument. */
int tr_parse_args(int argc, char **argv, const char *prog, tr_opts *o);

/* MLP 784-hidden-10 with ReLU; weights He (Kaiming) uniform from seed,
 * biases zero. On failure nothing is left allocated in *m. */
int tr_mlp_init(dispatch_device *dev, int hidden, uint64_t seed, tr_model *m);

/* CNN: conv 1->c1 3x3 pad 1, relu, max_pool 2, conv c1->c2 3x3 pad 1,
 * relu, max_pool 2, flatten, linear c2*7*7 -> 10. */
int tr_cnn_init(dispatch_device *dev, int c1, int c2, uint64_t seed,
                tr_model *m);

/* Drops the model's parameter references. */
void tr_model_free(tr_model *m);

/* Trains on train[0..n_train-1] for o->epochs epochs with Adam, and after
 * each epoch evaluates on test; fills res[0..epochs-1] when res is not
 * NULL. Prints progress unless o->quiet. */
int tr_fit(tr_model *m, const fmnist_split *train, size_t n_train,
           const fmnist_split *test, const tr_opts *o, tr_epoch *res);

/* Percent of test classified right by m, in batches of eval_batch. */
int tr_evaluate(tr_model *m, const fmnist_split *test, int eval_batch,
                double *accuracy);

/* The whole program of an example: parses argv over the defaults, opens
 * the device, loads Fashion-MNIST, builds the model with init, trains and
 * reports. Returns the process exit status (0 ok, 1 failure, 2 usage). */
typedef int (*tr_init_fn)(dispatch_device *dev, uint64_t seed, tr_model *m);
int tr_main(int argc, char **argv, const char *prog, const tr_opts *defaults,
            tr_init_fn init);

#endif
