/* Training loop, models and command line shared by the examples. Written
 * only against the public client API: nothing here knows whether the
 * device is local or a server. */
#include "train_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ */
/* errors and small helpers                                            */

/* Prints one line naming the failed call, the code and the device's
 * detail message; returns rc unchanged so call sites stay one line. */
static int tr_report(dispatch_device *dev, int rc, const char *what) {
  if (rc < 0)
    fprintf(stderr, "%s failed: %s (%s): %s\n", what, dispatch_err_name(rc),
            dispatch_strerror(rc), dev ? dispatch_device_errmsg(dev) : "");
  return rc;
}

/* The one check after a run of calls written without checks: a failed
 * call makes every later call given its NULL output fail with the same
 * error, and the device keeps the first. Reports that first error and
 * clears it, so the next run starts clean; returns it, or 0. */
static int tr_check(dispatch_device *dev, const char *what) {
  const char *msg;
  int rc = dispatch_device_error(dev, &msg);
  if (rc < 0) {
    fprintf(stderr, "%s failed: %s (%s): %s\n", what, dispatch_err_name(rc),
            dispatch_strerror(rc), msg);
    dispatch_device_clear_error(dev);
  }
  return rc;
}

static double tr_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64: a fixed, documented sequence so shuffles are reproducible on
 * every machine. */
static uint64_t tr_rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Fisher-Yates over perm[0..n-1]; the order depends only on seed. */
static void tr_shuffle(uint32_t *perm, size_t n, uint64_t seed) {
  uint64_t st = seed;
  for (size_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
  for (size_t i = n; i > 1; i--) {
    size_t j = (size_t)(tr_rng_next(&st) % i);
    uint32_t t = perm[i - 1];
    perm[i - 1] = perm[j];
    perm[j] = t;
  }
}

/* ------------------------------------------------------------------ */
/* options                                                             */

void tr_opts_default(tr_opts *o, int epochs) {
  memset(o, 0, sizeof *o);
  o->device = NULL;
  o->data = fmnist_default_dir();
  o->epochs = epochs;
  o->limit = 0;
  o->batch = 128;
  o->eval_batch = 1000;
  o->lr = 1e-3;
  o->seed = 42;
  o->log_every = 100;
  o->min_acc = 0;
  o->quiet = 0;
}

static void tr_usage(FILE *f, const char *prog, const tr_opts *d) {
  fprintf(f,
          "usage: %s [options]\n"
          "  --device SPEC   local | tcp://HOST:PORT (default: env "
          "DISPATCH_DEVICE, else local)\n"
          "  --epochs N      training epochs (default %d)\n"
          "  --data DIR      Fashion-MNIST folder (default %s)\n"
          "  --limit N       use only the first N training images\n"
          "  --batch N       batch size (default %d)\n"
          "  --eval-batch N  test images per evaluation batch (default %d)\n"
          "  --lr X          Adam learning rate (default %g)\n"
          "  --seed N        init and shuffle seed (default %llu)\n"
          "  --log-every N   progress line every N steps, 0: none "
          "(default %d)\n"
          "  --min-acc PCT   exit 1 if the final test accuracy is below PCT\n",
          prog, d->epochs, d->data, d->batch, d->eval_batch, d->lr,
          (unsigned long long)d->seed, d->log_every);
}

/* Parses a whole decimal integer in [lo, hi]; -1 if it is not one. */
static int tr_parse_ll(const char *s, long long lo, long long hi,
                       long long *v) {
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (errno || end == s || *end || x < lo || x > hi) return -1;
  *v = x;
  return 0;
}

int tr_parse_args(int argc, char **argv, const char *prog, tr_opts *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      tr_usage(stdout, prog, o);
      return 1;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "%s: unknown option or missing value: %s\n", prog, a);
      tr_usage(stderr, prog, o);
      return -1;
    }
    const char *v = argv[++i];
    long long n;
    if (!strcmp(a, "--device")) {
      o->device = v;
    } else if (!strcmp(a, "--data")) {
      o->data = v;
    } else if (!strcmp(a, "--epochs")) {
      if (tr_parse_ll(v, 1, 1000, &n) < 0) goto bad;
      o->epochs = (int)n;
    } else if (!strcmp(a, "--limit")) {
      if (tr_parse_ll(v, 1, 1LL << 40, &n) < 0) goto bad;
      o->limit = (size_t)n;
    } else if (!strcmp(a, "--batch")) {
      if (tr_parse_ll(v, 1, 65536, &n) < 0) goto bad;
      o->batch = (int)n;
    } else if (!strcmp(a, "--eval-batch")) {
      if (tr_parse_ll(v, 1, 65536, &n) < 0) goto bad;
      o->eval_batch = (int)n;
    } else if (!strcmp(a, "--seed")) {
      if (tr_parse_ll(v, 0, INT64_MAX, &n) < 0) goto bad;
      o->seed = (uint64_t)n;
    } else if (!strcmp(a, "--log-every")) {
      if (tr_parse_ll(v, 0, 1 << 30, &n) < 0) goto bad;
      o->log_every = (int)n;
    } else if (!strcmp(a, "--lr") || !strcmp(a, "--min-acc")) {
      char *end;
      errno = 0;
      double x = strtod(v, &end);
      if (errno || end == v || *end || !isfinite(x) || x < 0) goto bad;
      if (a[2] == 'l') {
        if (x <= 0) goto bad;
        o->lr = x;
      } else {
        o->min_acc = x;
      }
    } else {
      fprintf(stderr, "%s: unknown option %s\n", prog, a);
      tr_usage(stderr, prog, o);
      return -1;
    }
    continue;
  bad:
    fprintf(stderr, "%s: bad value for %s: '%s'\n", prog, a, v);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------ */
/* models                                                              */

/* One AUTODIFF leaf of shape[0..ndim-1]: uniform in [-bound, bound) from
 * seed, or zeros for bound 0. Created outside any step scope, so the
 * caller owns it. */
static int tr_param(dispatch_device *dev, int ndim, const int64_t *shape,
                    double bound, uint64_t seed, dispatch_tensor **out) {
  dispatch_tensor *t = NULL;
  int rc;
  *out = NULL;
  if (bound > 0)
    rc = tr_report(dev,
                   dispatch_uniform(dev, DISPATCH_F32, ndim, shape, -bound,
                                    bound, seed, &t),
                   "dispatch_uniform");
  else
    rc = tr_report(dev, dispatch_zeros(dev, DISPATCH_F32, ndim, shape, &t),
                   "dispatch_zeros");
  if (rc < 0) return rc;
  rc = tr_report(dev, dispatch_autodiff(t, out), "dispatch_autodiff");
  dispatch_tensor_free(t); /* the AUTODIFF leaf holds its own reference */
  return rc;
}

/* He (Kaiming) uniform bound for ReLU layers: sqrt(6 / fan_in). */
static double tr_he_bound(int64_t fan_in) { return sqrt(6.0 / (double)fan_in); }

static int tr_model_add(tr_model *m, int ndim, const int64_t *shape,
                        double bound, uint64_t seed) {
  dispatch_tensor *p;
  int rc = tr_param(m->dev, ndim, shape, bound, seed, &p);
  if (rc < 0) return rc;
  m->params[m->nparams++] = p;
  m->nweights += dispatch_tensor_numel(p);
  return 0;
}

void tr_model_free(tr_model *m) {
  for (int i = 0; i < m->nparams; i++) dispatch_tensor_free(m->params[i]);
  m->nparams = 0;
  m->nweights = 0;
}

/* The parameter as the forward uses it: AUTODIFF when training, else the
 * plain tensor it wraps (borrowed, no copy). */
static dispatch_tensor *tr_p(tr_model *m, int i, int train) {
  return train ? m->params[i] : dispatch_inner(m->params[i]);
}

/* Must run inside a scope: every intermediate is registered there. No
 * check per call: after a failure the later calls return the same first
 * error, so the last call's result is the whole forward's. */
static int tr_mlp_forward(tr_model *m, dispatch_tensor *x, int train,
                          dispatch_tensor **logits) {
  dispatch_tensor *h, *o;
  dispatch_matmul(x, tr_p(m, 0, train), &h);
  dispatch_add(h, tr_p(m, 1, train), &h);
  dispatch_relu(h, &h);
  dispatch_matmul(h, tr_p(m, 2, train), &o);
  return dispatch_add(o, tr_p(m, 3, train), logits);
}

int tr_mlp_init(dispatch_device *dev, int hidden, uint64_t seed,
                tr_model *m) {
  memset(m, 0, sizeof *m);
  m->name = "mlp";
  m->dev = dev;
  m->forward = tr_mlp_forward;
  const int64_t w1[2] = {TR_IMAGE_SIZE, hidden}, b1[1] = {hidden};
  const int64_t w2[2] = {hidden, TR_CLASSES}, b2[1] = {TR_CLASSES};
  int rc;
  if ((rc = tr_model_add(m, 2, w1, tr_he_bound(TR_IMAGE_SIZE), seed)) < 0 ||
      (rc = tr_model_add(m, 1, b1, 0, 0)) < 0 ||
      (rc = tr_model_add(m, 2, w2, tr_he_bound(hidden), seed + 1)) < 0 ||
      (rc = tr_model_add(m, 1, b2, 0, 0)) < 0)
    tr_model_free(m);
  return rc;
}

/* conv 3x3 stride 1 pad 1, plus a [1, C, 1, 1] bias by broadcasting
 * (conv2d has no bias argument), then relu and a 2x2 max pool. */
static int tr_conv_block(tr_model *m, dispatch_tensor *x, int wi, int train,
                         dispatch_tensor **out) {
  dispatch_tensor *c;
  dispatch_conv2d(x, tr_p(m, wi, train), 1, 1, 1, 1, 1, 1, &c);
  dispatch_add(c, tr_p(m, wi + 1, train), &c);
  dispatch_relu(c, &c);
  return dispatch_max_pool2d(c, 2, 2, 2, 2, 0, 0, out);
}

static int tr_cnn_forward(tr_model *m, dispatch_tensor *x, int train,
                          dispatch_tensor **logits) {
  dispatch_tensor *h, *o;
  const int64_t img[4] = {-1, 1, 28, 28};
  const int64_t flat[2] = {-1, dispatch_tensor_dim(m->params[4], 0)};
  dispatch_reshape(x, 4, img, &h);
  tr_conv_block(m, h, 0, train, &h);
  tr_conv_block(m, h, 2, train, &h);
  dispatch_reshape(h, 2, flat, &h);
  dispatch_matmul(h, tr_p(m, 4, train), &o);
  return dispatch_add(o, tr_p(m, 5, train), logits);
}

int tr_cnn_init(dispatch_device *dev, int c1, int c2, uint64_t seed,
                tr_model *m) {
  memset(m, 0, sizeof *m);
  m->name = "cnn";
  m->dev = dev;
  m->forward = tr_cnn_forward;
  const int64_t w1[4] = {c1, 1, 3, 3}, b1[4] = {1, c1, 1, 1};
  const int64_t w2[4] = {c2, c1, 3, 3}, b2[4] = {1, c2, 1, 1};
  const int64_t w3[2] = {(int64_t)c2 * 7 * 7, TR_CLASSES},
                b3[1] = {TR_CLASSES};
  int rc;
  if ((rc = tr_model_add(m, 4, w1, tr_he_bound(9), seed)) < 0 ||
      (rc = tr_model_add(m, 4, b1, 0, 0)) < 0 ||
      (rc = tr_model_add(m, 4, w2, tr_he_bound((int64_t)c1 * 9), seed + 1)) <
          0 ||
      (rc = tr_model_add(m, 4, b2, 0, 0)) < 0 ||
      (rc = tr_model_add(m, 2, w3, tr_he_bound(w3[0]), seed + 2)) < 0 ||
      (rc = tr_model_add(m, 1, b3, 0, 0)) < 0)
    tr_model_free(m);
  return rc;
}

/* ------------------------------------------------------------------ */
/* training and evaluation                                             */

/* One optimizer step on the batch in xb/yb (b rows), written straight
 * through with one check at the end; the step's tensors live in one scope.
 * *loss is the batch's mean cross-entropy as read back from the device. */
static int tr_step(tr_model *m, dispatch_optim *opt, const float *xb,
                   const int64_t *yb, int64_t b, float *loss) {
  dispatch_device *dev = m->dev;
  dispatch_grads *grads = NULL;
  dispatch_tensor *x, *y, *logits, *l;
  const int64_t xs[2] = {b, TR_IMAGE_SIZE};
  int rc = tr_report(dev, dispatch_scope_begin(dev), "dispatch_scope_begin");
  if (rc < 0) return rc;
  dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, xb,
                            (size_t)b * TR_IMAGE_SIZE * sizeof *xb, &x);
  dispatch_tensor_from_data(dev, DISPATCH_I64, 1, &b, yb,
                            (size_t)b * sizeof *yb, &y);
  m->forward(m, x, 1, &logits);
  dispatch_cross_entropy(logits, y, &l);
  dispatch_backward(l, &grads);
  dispatch_optim_step(opt, grads);
  /* REMOTE: the read waits for the step too, so a deferred error of this
   * step surfaces here rather than steps later */
  dispatch_tensor_read(l, loss, sizeof *loss);
  rc = tr_check(dev, "training step");
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  return rc;
}

int tr_evaluate(tr_model *m, const fmnist_split *test, int eval_batch,
                double *accuracy) {
  dispatch_device *dev = m->dev;
  size_t n = test->n, right = 0;
  int64_t *pred = malloc((size_t)eval_batch * sizeof *pred);
  int rc = 0;
  *accuracy = 0;
  if (!pred) {
    fprintf(stderr, "evaluate: out of memory for %d predictions\n",
            eval_batch);
    return DISPATCH_ENOMEM;
  }
  for (size_t s = 0; s < n; s += (size_t)eval_batch) {
    int64_t b = (int64_t)(n - s < (size_t)eval_batch ? n - s
                                                     : (size_t)eval_batch);
    const int64_t xs[2] = {b, TR_IMAGE_SIZE};
    const int64_t dim1 = 1;
    dispatch_tensor *x, *logits, *am;
    rc = tr_report(dev, dispatch_scope_begin(dev), "dispatch_scope_begin");
    if (rc < 0) break;
    dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs,
                              test->images + s * TR_IMAGE_SIZE,
                              (size_t)b * TR_IMAGE_SIZE * sizeof(float), &x);
    m->forward(m, x, 0, &logits);
    dispatch_argmax(logits, 1, &dim1, 0, &am);
    dispatch_tensor_read(am, pred, (size_t)b * sizeof *pred);
    rc = tr_check(dev, "evaluation");
    for (int64_t i = 0; rc == 0 && i < b; i++)
      right += pred[i] == test->labels[s + i];
    dispatch_scope_end(dev);
    if (rc < 0) break;
  }
  free(pred);
  if (rc == 0 && n > 0) *accuracy = 100.0 * (double)right / (double)n;
  return rc;
}

int tr_fit(tr_model *m, const fmnist_split *train, size_t n_train,
           const fmnist_split *test, const tr_opts *o, tr_epoch *res) {
  dispatch_device *dev = m->dev;
  dispatch_optim *opt = NULL;
  size_t bs = (size_t)o->batch;
  uint32_t *perm = malloc((n_train ? n_train : 1) * sizeof *perm);
  float *xb = malloc(bs * TR_IMAGE_SIZE * sizeof *xb);
  int64_t *yb = malloc(bs * sizeof *yb);
  int rc = 0;
  if (!perm || !xb || !yb) {
    fprintf(stderr, "fit: out of memory for the batch buffers\n");
    rc = DISPATCH_ENOMEM;
    goto out;
  }
  if (n_train == 0 || n_train > train->n) {
    fprintf(stderr, "fit: %zu training images asked, %zu available\n",
            n_train, train->n);
    rc = DISPATCH_EINVAL;
    goto out;
  }
  rc = tr_report(dev, dispatch_adam_new(m->params, m->nparams, o->lr, 0.9,
                                        0.999, 1e-8, &opt),
                 "dispatch_adam_new");
  if (rc < 0) goto out;
  size_t steps = (n_train + bs - 1) / bs;
  for (int e = 0; e < o->epochs; e++) {
    tr_shuffle(perm, n_train, o->seed * 1000003u + (uint64_t)e + 1);
    double t0 = tr_now(), tw = t0, sum = 0, wsum = 0;
    size_t wimg = 0;
    for (size_t s = 0; s < steps; s++) {
      size_t b = n_train - s * bs < bs ? n_train - s * bs : bs;
      for (size_t i = 0; i < b; i++) {
        uint32_t k = perm[s * bs + i];
        memcpy(xb + i * TR_IMAGE_SIZE, train->images + (size_t)k * TR_IMAGE_SIZE,
               TR_IMAGE_SIZE * sizeof *xb);
        yb[i] = train->labels[k];
      }
      float loss;
      rc = tr_step(m, opt, xb, yb, (int64_t)b, &loss);
      if (rc < 0) {
        fprintf(stderr, "training stopped at epoch %d step %zu/%zu\n", e + 1,
                s + 1, steps);
        goto out;
      }
      if (!isfinite(loss)) {
        fprintf(stderr, "epoch %d step %zu: loss is %f, training diverged\n",
                e + 1, s + 1, (double)loss);
        rc = DISPATCH_EINTERNAL;
        goto out;
      }
      sum += loss;
      wsum += loss;
      wimg += b;
      if (!o->quiet && o->log_every > 0 &&
          ((s + 1) % (size_t)o->log_every == 0)) {
        double now = tr_now();
        printf("  epoch %d step %4zu/%zu  loss %.4f  %6.0f img/s\n", e + 1,
               s + 1, steps, wsum / (double)o->log_every,
               (double)wimg / (now - tw));
        fflush(stdout);
        tw = now;
        wsum = 0;
        wimg = 0;
      }
    }
    double t1 = tr_now();
    tr_epoch ep = {.mean_loss = sum / (double)steps,
                   .train_s = t1 - t0,
                   .images_per_s = (double)n_train / (t1 - t0)};
    if (test && test->n > 0) {
      rc = tr_evaluate(m, test, o->eval_batch, &ep.accuracy);
      if (rc < 0) {
        fprintf(stderr, "evaluation after epoch %d failed\n", e + 1);
        goto out;
      }
    }
    ep.eval_s = tr_now() - t1;
    if (res) res[e] = ep;
    if (!o->quiet) {
      printf("epoch %d/%d  mean loss %.4f  test accuracy %.2f%%  time %.1f s "
             "(train %.1f s, %.0f img/s; eval %.1f s)\n",
             e + 1, o->epochs, ep.mean_loss, ep.accuracy,
             ep.train_s + ep.eval_s, ep.train_s, ep.images_per_s, ep.eval_s);
      fflush(stdout);
    }
  }
out:
  dispatch_optim_free(opt);
  free(perm);
  free(xb);
  free(yb);
  return rc;
}

/* ------------------------------------------------------------------ */
/* the program                                                         */

int tr_main(int argc, char **argv, const char *prog, const tr_opts *defaults,
            tr_init_fn init) {
  tr_opts o = *defaults;
  int pr = tr_parse_args(argc, argv, prog, &o);
  if (pr != 0) return pr > 0 ? 0 : 2;

  dispatch_device *dev = NULL;
  fmnist_split train = {0}, test = {0};
  tr_model m = {0};
  tr_epoch *res = NULL;
  int status = 1, rc;
  char err[512] = "";

  double t0 = tr_now();
  if (fmnist_load(o.data, 1, &train, err, sizeof err) < 0 ||
      fmnist_load(o.data, 0, &test, err, sizeof err) < 0) {
    fprintf(stderr, "%s: cannot load Fashion-MNIST: %s\n", prog, err);
    goto out;
  }
  size_t n_train = o.limit && o.limit < train.n ? o.limit : train.n;
  rc = dispatch_device_open(o.device, NULL, &dev, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "%s: cannot open device '%s': %s: %s\n", prog,
            o.device ? o.device : "(default)", dispatch_err_name(rc), err);
    goto out;
  }
  if (init(dev, o.seed, &m) < 0) goto out;
  res = calloc((size_t)o.epochs, sizeof *res);
  if (!res) {
    fprintf(stderr, "%s: out of memory\n", prog);
    goto out;
  }
  printf("%s: device %s, model %s (%lld parameters), %zu train / %zu test "
         "images, batch %d, Adam lr %g, %d epochs (data loaded in %.1f s)\n",
         prog, dispatch_device_spec(dev), m.name, (long long)m.nweights,
         n_train, test.n, o.batch, o.lr, o.epochs, tr_now() - t0);
  fflush(stdout);

  double tf = tr_now();
  if (tr_fit(&m, &train, n_train, &test, &o, res) < 0) goto out;
  double total = tr_now() - tf;

  dispatch_stats st = DISPATCH_STATS_INIT;
  rc = tr_report(dev, dispatch_device_stats(dev, &st), "dispatch_device_stats");
  if (rc < 0) goto out;
  double acc = res[o.epochs - 1].accuracy;
  printf("%s: final test accuracy %.2f%% after %d epochs on %s, training "
         "time %.1f s; device holds %llu tensors (%llu bytes), %llu ops run\n",
         prog, acc, o.epochs, dispatch_device_spec(dev), total,
         (unsigned long long)st.tensors, (unsigned long long)st.bytes,
         (unsigned long long)st.ops);
  if (acc < o.min_acc) {
    fprintf(stderr, "%s: test accuracy %.2f%% is below --min-acc %.2f%%\n",
            prog, acc, o.min_acc);
    goto out;
  }
  status = 0;
out:
  free(res);
  tr_model_free(&m);
  dispatch_device_close(dev);
  fmnist_free(&train);
  fmnist_free(&test);
  return status;
}
