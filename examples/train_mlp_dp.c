/* train_mlp_dp: the MLP of train_mlp (784-256-10, ReLU, cross-entropy,
 * He-uniform init from a fixed seed) trained data-parallel on a group of
 * dispatch-servers, each taking an equal share of every batch, beside a
 * reference device that takes the whole batch:
 *
 *   mpirun -np 2 dispatch-server --mpi --listen 127.0.0.1:7070 &
 *   train_mlp_dp --group tcp://127.0.0.1:7070,tcp://127.0.0.1:7071
 *
 * Each step sends every member its share, its forward, backward and ONE
 * grouped SGD step (dispatch_group_step: the gradients averaged through
 * the group by MPI, then the update), pipelined: the client waits once per
 * step, for the loss. After every step it reads all parameters back and
 * checks two things, printing both figures:
 *
 * 1. the members' parameters are identical, bit for bit (the all-reduce
 *    gives every member the same bits and each updates alike);
 * 2. they equal the reference's within a bound derived from float
 *    reassociation. With u = 2^-24 and K = B + 784 + 256 + 10 + 16 (the
 *    longest chain of sums an element of a gradient goes through: the
 *    batch, the two layers' dot products, the softmax, and a margin for
 *    the few other roundings), each of the two runs computes every
 *    gradient element within gamma_K * A of the exact value (gamma_K =
 *    K u / (1 - K u), the classic bound for a sum evaluated in any order,
 *    first order in u), where A is the sum of the absolute values of the
 *    element's terms. For a mean cross-entropy over B rows, x in [0, 1]
 *    and |softmax - onehot| summing to at most 2 per row: A <= 2 max|W2|
 *    for W1 and b1, A <= 2 Hmax for W2 (Hmax = 784 max|W1| + max|b1|
 *    bounds a hidden unit) and A <= 2 for b2; the shares' means are
 *    averaged with divisions by powers of two, which are exact. So one SGD
 *    step moves the two runs apart by at most lr * 2 gamma_K * Amax, and
 *    the bound after t steps is the sum of those. It is first order: it
 *    leaves out how later gradients amplify an earlier difference (a
 *    factor 1 + lr L per step), which the looseness of A covers by orders
 *    of magnitude on this model (the printed figures show the margin).
 *
 * Exit status 0 when every step passed both checks. The reference device
 * is "local" unless --reference names another. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train_util.h"

#define DP_MAX 8
#define DP_HIDDEN 256

typedef struct dp_opts {
  char *group; /* comma-separated device strings (owned copy) */
  const char *reference;
  const char *data;
  int steps, batch, log_every;
  double lr;
  uint64_t seed;
} dp_opts;

static int usage(FILE *f) {
  fprintf(f,
          "usage: train_mlp_dp --group SPEC,SPEC[,...] [--reference SPEC]\n"
          "       [--steps N] [--batch B] [--lr LR] [--seed S] [--data DIR]\n"
          "       [--log-every N]\n"
          "  --group       the devices of every rank of one mpirun job of\n"
          "                dispatch-server --mpi\n"
          "  --reference   the whole-batch run's device (default local)\n"
          "  --steps       SGD steps (default 20); --batch (default 128, a\n"
          "                multiple of the group's size); --lr (0.05)\n");
  return 2;
}

static int parse(int argc, char **argv, dp_opts *o) {
  *o = (dp_opts){NULL, "local", NULL, 20, 128, 5, 0.05, 42};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help")) return usage(stdout), 1;
    if (!v) return usage(stderr), -1;
    if (!strcmp(a, "--group")) o->group = strdup(v);
    else if (!strcmp(a, "--reference")) o->reference = v;
    else if (!strcmp(a, "--data")) o->data = v;
    else if (!strcmp(a, "--steps")) o->steps = atoi(v);
    else if (!strcmp(a, "--batch")) o->batch = atoi(v);
    else if (!strcmp(a, "--log-every")) o->log_every = atoi(v);
    else if (!strcmp(a, "--lr")) o->lr = atof(v);
    else if (!strcmp(a, "--seed")) o->seed = (uint64_t)atoll(v);
    else return usage(stderr), -1;
    i++;
  }
  if (!o->group || o->steps < 1 || o->batch < 1 || !(o->lr > 0))
    return usage(stderr), -1;
  return 0;
}

/* forward, loss and backward of rows [0, b) of xb/yb on m's device, in
 * the device's open scope; *grads and *loss are the caller's */
static int share(tr_model *m, const float *xb, const int64_t *yb, int64_t b,
                 dispatch_grads **grads, dispatch_tensor **loss) {
  dispatch_tensor *x, *y, *logits;
  const int64_t xs[2] = {b, TR_IMAGE_SIZE};
  dispatch_tensor_from_data(m->dev, DISPATCH_F32, 2, xs, xb,
                            (size_t)b * TR_IMAGE_SIZE * sizeof *xb, &x);
  dispatch_tensor_from_data(m->dev, DISPATCH_I64, 1, &b, yb,
                            (size_t)b * sizeof *yb, &y);
  m->forward(m, x, 1, &logits);
  dispatch_cross_entropy(logits, y, loss);
  return dispatch_backward(*loss, grads);
}

static int fail(dispatch_device *dev, const char *what) {
  const char *msg = "";
  int rc = dispatch_device_error(dev, &msg);
  fprintf(stderr, "train_mlp_dp: %s on %s: %s: %s\n", what,
          dispatch_device_spec(dev), dispatch_err_name(rc), msg);
  return rc < 0 ? rc : DISPATCH_EINTERNAL;
}

static double max_abs(const float *v, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)v[i]));
  return m;
}

int main(int argc, char **argv) {
  dp_opts o;
  int pr = parse(argc, argv, &o);
  if (pr != 0) return pr > 0 ? 0 : 2;
  const char *specs[DP_MAX];
  int n = 0;
  for (char *s = strtok(o.group, ","); s && n < DP_MAX; s = strtok(NULL, ","))
    specs[n++] = s;
  if (n < 1 || o.batch % n) {
    fprintf(stderr, "train_mlp_dp: --batch %d is not a multiple of the %d "
                    "members\n", o.batch, n);
    return 2;
  }
  fmnist_split train = {0};
  char err[512] = "";
  if (!o.data) o.data = fmnist_default_dir();
  if (fmnist_load(o.data, 1, &train, err, sizeof err) < 0) {
    fprintf(stderr, "train_mlp_dp: cannot load Fashion-MNIST: %s\n", err);
    return 1;
  }
  size_t need = (size_t)o.steps * (size_t)o.batch;
  if (need > train.n) {
    fprintf(stderr, "train_mlp_dp: %d steps of %d need %zu images, %zu "
                    "available\n", o.steps, o.batch, need, train.n);
    return 2;
  }
  dispatch_group *g = NULL;
  dispatch_device *ref = NULL;
  int rc = dispatch_group_open(specs, n, NULL, &g, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "train_mlp_dp: group: %s: %s\n", dispatch_err_name(rc), err);
    return 1;
  }
  rc = dispatch_device_open(o.reference, NULL, &ref, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "train_mlp_dp: reference: %s\n", err);
    dispatch_group_close(g);
    return 1;
  }
  tr_model m[DP_MAX], mr;
  dispatch_optim *opt[DP_MAX], *optr = NULL;
  int status = 1;
  memset(m, 0, sizeof m);
  memset(&mr, 0, sizeof mr);
  for (int r = 0; r < n; r++) {
    if (tr_mlp_init(dispatch_group_device(g, r), DP_HIDDEN, o.seed, &m[r]) < 0 ||
        dispatch_sgd_new(m[r].params, m[r].nparams, o.lr, 0, 0, &opt[r]) < 0)
      return fail(dispatch_group_device(g, r), "model"), 1;
  }
  if (tr_mlp_init(ref, DP_HIDDEN, o.seed, &mr) < 0 ||
      dispatch_sgd_new(mr.params, mr.nparams, o.lr, 0, 0, &optr) < 0)
    return fail(ref, "reference model"), 1;
  int64_t total = mr.nweights;
  float *pr0 = malloc((size_t)total * sizeof *pr0);
  float *prr = malloc((size_t)total * sizeof *prr);
  float *pro = malloc((size_t)total * sizeof *pro);
  if (!pr0 || !prr || !pro) return fprintf(stderr, "out of memory\n"), 1;
  const double u = ldexp(1.0, -24);
  const double K = o.batch + TR_IMAGE_SIZE + DP_HIDDEN + TR_CLASSES + 16;
  const double gamma = K * u / (1 - K * u);
  double bound = 0, worst_ratio = 0;
  int64_t share_rows = o.batch / n;
  printf("train_mlp_dp: %d members (%s ...), reference %s, batch %d (%lld "
         "each), SGD lr %g, %d steps\n",
         n, specs[0], o.reference, o.batch, (long long)share_rows, o.lr,
         o.steps);
  for (int s = 0; s < o.steps; s++) {
    const float *xb = train.images + (size_t)s * o.batch * TR_IMAGE_SIZE;
    const int64_t *yb = train.labels + (size_t)s * o.batch;
    /* the bound's A from the parameters before this step (read below at
     * the end of the previous step; the init's at step 0) */
    if (s == 0) {
      int64_t at = 0;
      for (int i = 0; i < mr.nparams; i++) {
        int64_t k = dispatch_tensor_numel(mr.params[i]);
        dispatch_tensor_read(mr.params[i], prr + at, (size_t)k * sizeof *prr);
        at += k;
      }
    }
    int64_t n1 = (int64_t)TR_IMAGE_SIZE * DP_HIDDEN, nb1 = DP_HIDDEN,
            n2 = (int64_t)DP_HIDDEN * TR_CLASSES;
    double w1 = max_abs(prr, n1), b1 = max_abs(prr + n1, nb1),
           w2 = max_abs(prr + n1 + nb1, n2);
    double hmax = TR_IMAGE_SIZE * w1 + b1;
    double amax = 2 * fmax(fmax(w2, hmax), 1.0);
    bound += o.lr * 2 * gamma * amax;

    dispatch_grads *grads[DP_MAX] = {0}, *gref = NULL;
    dispatch_tensor *loss[DP_MAX], *lref;
    for (int r = 0; r < n; r++) {
      dispatch_scope_begin(m[r].dev);
      share(&m[r], xb + (size_t)r * share_rows * TR_IMAGE_SIZE,
            yb + (size_t)r * share_rows, share_rows, &grads[r], &loss[r]);
    }
    /* one Step per member: the all-reduce of the gradients (mean: the
     * shares are equal, so the mean of their mean losses' gradients is
     * the whole batch's) and the update */
    dispatch_group_step(g, opt, grads, DISPATCH_REDUCE_MEAN);
    dispatch_scope_begin(ref);
    share(&mr, xb, yb, o.batch, &gref, &lref);
    dispatch_optim_step(optr, gref);
    float l0 = 0, lr_ = 0, lsum = 0;
    for (int r = 0; r < n; r++) {
      if (dispatch_tensor_read(loss[r], &l0, sizeof l0) < 0)
        return fail(m[r].dev, "training step"), 1;
      lsum += l0;
    }
    if (dispatch_tensor_read(lref, &lr_, sizeof lr_) < 0)
      return fail(ref, "reference step"), 1;
    /* the parameters, flattened in order, of every member and the
     * reference */
    int ident = 1;
    double diff = 0;
    for (int r = 0; r < n; r++) {
      int64_t at = 0;
      for (int i = 0; i < m[r].nparams; i++) {
        int64_t k = dispatch_tensor_numel(m[r].params[i]);
        if (dispatch_tensor_read(m[r].params[i], (r ? pro : pr0) + at,
                                 (size_t)k * sizeof(float)) < 0)
          return fail(m[r].dev, "reading the parameters"), 1;
        at += k;
      }
      if (r && memcmp(pr0, pro, (size_t)total * sizeof(float)) != 0) ident = 0;
    }
    int64_t at = 0;
    for (int i = 0; i < mr.nparams; i++) {
      int64_t k = dispatch_tensor_numel(mr.params[i]);
      dispatch_tensor_read(mr.params[i], prr + at, (size_t)k * sizeof *prr);
      at += k;
    }
    for (int64_t i = 0; i < total; i++)
      diff = fmax(diff, fabs((double)pr0[i] - (double)prr[i]));
    worst_ratio = fmax(worst_ratio, diff / bound);
    int ok = ident && diff <= bound;
    if (!ok || (o.log_every && (s + 1) % o.log_every == 0) || s == 0)
      printf("step %3d: loss %.6f (reference %.6f); members %s; max |member "
             "- reference| = %.3g <= bound %.3g: %s\n",
             s + 1, lsum / n, lr_, ident ? "identical" : "DIFFER", diff, bound,
             diff <= bound ? "yes" : "NO");
    for (int r = 0; r < n; r++) {
      dispatch_grads_free(grads[r]);
      dispatch_scope_end(m[r].dev);
    }
    dispatch_grads_free(gref);
    dispatch_scope_end(ref);
    if (!ok) goto out;
  }
  printf("train_mlp_dp: %d steps, members identical after every step, "
         "largest difference from the reference %.3g of the bound\n",
         o.steps, worst_ratio);
  status = 0;
out:
  free(pr0);
  free(prr);
  free(pro);
  for (int r = 0; r < n; r++) tr_model_free(&m[r]);
  tr_model_free(&mr);
  dispatch_device_close(ref);
  dispatch_group_close(g);
  fmnist_free(&train);
  free(o.group);
  return status;
}
