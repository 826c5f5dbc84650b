/* The GPT model, its training step, validation loss and sampling, written
 * only against the public client API (gpt_model.h). */
#include "gpt_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parameter indices: 2 embeddings, GR_BLOCK per block, then the head. */
#define GM_WTE 0
#define GM_WPE 1
#define GM_BLOCK 16
#define GM_HEAD (2 + GM_BLOCK * GR_N_LAYER) /* lnf.w lnf.b wout bout */

static int gm_report(dispatch_device *dev, int rc, const char *what) {
  if (rc < 0)
    fprintf(stderr, "%s failed: %s (%s): %s\n", what, dispatch_err_name(rc),
            dispatch_strerror(rc), dev ? dispatch_device_errmsg(dev) : "");
  return rc;
}

/* The one check after a run of unchecked calls (a failed call makes the
 * later ones fail with the same first error, which the device keeps):
 * reports and clears it; returns it, or 0. */
static int gm_check(dispatch_device *dev, const char *what) {
  const char *msg;
  int rc = dispatch_device_error(dev, &msg);
  if (rc < 0) {
    fprintf(stderr, "%s failed: %s (%s): %s\n", what, dispatch_err_name(rc),
            dispatch_strerror(rc), msg);
    dispatch_device_clear_error(dev);
  }
  return rc;
}

static int64_t gm_numel(const gr_param_spec *s) {
  return s->shape[0] * (s->ndim == 2 ? s->shape[1] : 1);
}

/* One AUTODIFF leaf filled by gr_param_fill; the caller owns it. */
static int gm_param(gm_model *m, const gr_param_spec *s, uint64_t *rng,
                    dispatch_tensor **out) {
  int64_t n = gm_numel(s);
  float *buf = malloc((size_t)n * sizeof *buf);
  dispatch_tensor *t = NULL;
  *out = NULL;
  if (!buf) {
    fprintf(stderr, "gpt: out of memory for parameter %s\n", s->name);
    return DISPATCH_ENOMEM;
  }
  gr_param_fill(s, rng, buf);
  int rc = gm_report(m->dev,
                     dispatch_tensor_from_data(m->dev, DISPATCH_F32, s->ndim,
                                               s->shape, buf,
                                               (size_t)n * sizeof *buf, &t),
                     "dispatch_tensor_from_data");
  free(buf);
  if (rc < 0) return rc;
  rc = gm_report(m->dev, dispatch_autodiff(t, out), "dispatch_autodiff");
  dispatch_tensor_free(t); /* the leaf holds its own reference */
  return rc;
}

int gm_init(dispatch_device *dev, int nvocab, gm_model *m) {
  double wd[GR_NPARAMS];
  uint64_t rng = GR_INIT_SEED;
  int rc = 0;
  memset(m, 0, sizeof *m);
  m->dev = dev;
  m->nvocab = nvocab;
  gr_param_specs(nvocab, m->spec);
  for (int i = 0; i < GR_NPARAMS && rc == 0; i++) {
    rc = gm_param(m, &m->spec[i], &rng, &m->p[i]);
    m->nweights += gm_numel(&m->spec[i]);
    /* decay on matrices and embeddings only, not on biases or norms */
    wd[i] = m->spec[i].ndim == 2 ? GR_WEIGHT_DECAY : 0.0;
  }
  if (rc == 0)
    rc = gm_report(dev,
                   dispatch_adamw_new(m->p, GR_NPARAMS, GR_LR_MAX, GR_BETA1,
                                      GR_BETA2, GR_ADAM_EPS, wd, &m->opt),
                   "dispatch_adamw_new");
  if (rc == 0)
    rc = gm_report(dev, dispatch_optim_set_clip(m->opt, GR_CLIP),
                   "dispatch_optim_set_clip");
  if (rc < 0) gm_free(m);
  return rc;
}

int gm_set_precision(gm_model *m, const char *precision) {
  dispatch_dtype dt;
  if (!strcmp(precision, "f32")) dt = DISPATCH_F32;
  else if (!strcmp(precision, "bf16")) dt = DISPATCH_BF16;
  else if (!strcmp(precision, "f16")) dt = DISPATCH_F16;
  else {
    fprintf(stderr, "gpt: precision '%s' is not f32, bf16 or f16\n",
            precision);
    return DISPATCH_EINVAL;
  }
  int rc = gm_report(m->dev, dispatch_autocast(m->dev, dt, NULL),
                     "dispatch_autocast");
  m->scaled = dt == DISPATCH_F16;
  if (rc == 0)
    rc = gm_report(m->dev,
                   dispatch_optim_set_loss_scale(m->opt,
                                                 m->scaled ? 65536.0 : 0.0,
                                                 2.0, 0.5, 2000),
                   "dispatch_optim_set_loss_scale");
  return rc;
}

void gm_free(gm_model *m) {
  dispatch_optim_free(m->opt);
  m->opt = NULL;
  for (int i = 0; i < GR_NPARAMS; i++) {
    dispatch_tensor_free(m->p[i]);
    m->p[i] = NULL;
  }
}

/* The parameter as the forward uses it: AUTODIFF when training, else the
 * plain tensor it wraps (borrowed). */
static dispatch_tensor *gm_p(gm_model *m, int i, int train) {
  return train ? m->p[i] : dispatch_inner(m->p[i]);
}

/* x @ w + b for x [.., in] and w [in, out]. */
static int gm_linear(gm_model *m, dispatch_tensor *x, int wi, int train,
                     dispatch_tensor **out) {
  dispatch_tensor *y;
  dispatch_matmul(x, gm_p(m, wi, train), &y);
  return dispatch_add(y, gm_p(m, wi + 1, train), out);
}

/* [B, T, D] -> linear -> [B, H, T, D / H]. */
static int gm_heads(gm_model *m, dispatch_tensor *h, int wi, int train,
                    int64_t B, int64_t T, dispatch_tensor **out) {
  const int64_t split[4] = {B, T, GR_N_HEAD, GR_D_MODEL / GR_N_HEAD};
  const int64_t perm[4] = {0, 2, 1, 3};
  dispatch_tensor *y;
  gm_linear(m, h, wi, train, &y);
  dispatch_reshape(y, 4, split, &y);
  return dispatch_permute(y, 4, perm, out);
}

/* x + attention(ln1(x)) then x + mlp(ln2(x)), block parameters from b. */
static int gm_block(gm_model *m, dispatch_tensor *x, int b, int train,
                    int64_t B, int64_t T, dispatch_tensor **out) {
  const int64_t merge[3] = {B, T, GR_D_MODEL};
  const int64_t perm[4] = {0, 2, 1, 3};
  dispatch_tensor *h, *q, *k, *v, *a;
  dispatch_layer_norm(x, 1, gm_p(m, b, train), gm_p(m, b + 1, train),
                      GR_LN_EPS, &h);
  gm_heads(m, h, b + 2, train, B, T, &q);
  gm_heads(m, h, b + 4, train, B, T, &k);
  gm_heads(m, h, b + 6, train, B, T, &v);
  dispatch_attention(q, k, v, NULL, 1, 0.0, &a);
  dispatch_permute(a, 4, perm, &a);
  dispatch_reshape(a, 3, merge, &a);
  gm_linear(m, a, b + 8, train, &a);
  dispatch_add(x, a, &x);
  dispatch_layer_norm(x, 1, gm_p(m, b + 10, train), gm_p(m, b + 11, train),
                      GR_LN_EPS, &h);
  gm_linear(m, h, b + 12, train, &h);
  dispatch_gelu(h, &h);
  gm_linear(m, h, b + 14, train, &h);
  return dispatch_add(x, h, out);
}

/* idx [B, T] i64 (T <= GR_CTX) -> logits [B * T, V]. Must run inside a
 * scope; unchecked calls, the last one's result is the forward's. */
static int gm_forward(gm_model *m, dispatch_tensor *idx, int train,
                      dispatch_tensor **logits) {
  int64_t B = dispatch_tensor_dim(idx, 0), T = dispatch_tensor_dim(idx, 1);
  const int64_t flat[2] = {B * T, m->nvocab};
  dispatch_tensor *x, *pos;
  dispatch_embedding(gm_p(m, GM_WTE, train), idx, DISPATCH_NO_INDEX, &x);
  dispatch_slice(gm_p(m, GM_WPE, train), 0, 0, T, 1, &pos);
  dispatch_add(x, pos, &x);
  for (int l = 0; l < GR_N_LAYER; l++)
    gm_block(m, x, 2 + GM_BLOCK * l, train, B, T, &x);
  dispatch_layer_norm(x, 1, gm_p(m, GM_HEAD, train),
                      gm_p(m, GM_HEAD + 1, train), GR_LN_EPS, &x);
  gm_linear(m, x, GM_HEAD + 2, train, &x);
  return dispatch_reshape(x, 2, flat, logits);
}

/* Windows x, y [nwin, GR_CTX] as device tensors: x [nwin, GR_CTX], y
 * flat [nwin * GR_CTX]. */
static void gm_upload(gm_model *m, const int64_t *xb, const int64_t *yb,
                      int64_t nwin, dispatch_tensor **x, dispatch_tensor **y) {
  const int64_t xs[2] = {nwin, GR_CTX}, ys[1] = {nwin * GR_CTX};
  size_t bytes = (size_t)(nwin * GR_CTX) * sizeof(int64_t);
  dispatch_tensor_from_data(m->dev, DISPATCH_I64, 2, xs, xb, bytes, x);
  dispatch_tensor_from_data(m->dev, DISPATCH_I64, 1, ys, yb, bytes, y);
}

int gm_step(gm_model *m, int64_t step, const int64_t *xb, const int64_t *yb,
            float *loss) {
  dispatch_device *dev = m->dev;
  dispatch_grads *grads = NULL;
  dispatch_tensor *x, *y, *logits, *l;
  int rc = gm_report(dev, dispatch_scope_begin(dev), "dispatch_scope_begin");
  if (rc < 0) return rc;
  gm_upload(m, xb, yb, GR_BATCH, &x, &y);
  gm_forward(m, x, 1, &logits);
  dispatch_cross_entropy(logits, y, &l);
  if (m->scaled) {
    dispatch_tensor *ls;
    dispatch_optim_scale_loss(m->opt, l, &ls);
    dispatch_backward(ls, &grads);
  } else {
    dispatch_backward(l, &grads);
  }
  dispatch_optim_set_lr(m->opt, dispatch_lr_cosine(step, GR_WARMUP, GR_TOTAL,
                                                   GR_LR_MAX, GR_LR_MIN));
  dispatch_optim_step(m->opt, grads);
  /* REMOTE: the read waits for the step, so its errors surface here */
  dispatch_tensor_read(l, loss, sizeof *loss);
  rc = gm_check(dev, "training step");
  dispatch_grads_free(grads);
  dispatch_scope_end(dev);
  return rc;
}

int gm_val_loss(gm_model *m, const gr_corpus *c, double *loss) {
  size_t off[GR_VAL_WINDOWS];
  int64_t xb[GR_BATCH * GR_CTX], yb[GR_BATCH * GR_CTX];
  double sum = 0;
  int rc = 0;
  gr_val_offsets(c, off);
  for (int w = 0; w < GR_VAL_WINDOWS && rc == 0; w += GR_BATCH) {
    int nwin = GR_VAL_WINDOWS - w < GR_BATCH ? GR_VAL_WINDOWS - w : GR_BATCH;
    dispatch_tensor *x, *y, *logits, *l;
    float lv = 0;
    gr_windows(c, c->n_train, off + w, nwin, xb, yb);
    rc = gm_report(m->dev, dispatch_scope_begin(m->dev),
                   "dispatch_scope_begin");
    if (rc < 0) break;
    gm_upload(m, xb, yb, nwin, &x, &y);
    gm_forward(m, x, 0, &logits);
    dispatch_cross_entropy(logits, y, &l);
    dispatch_tensor_read(l, &lv, sizeof lv);
    rc = gm_check(m->dev, "validation");
    dispatch_scope_end(m->dev);
    sum += (double)lv * nwin;
  }
  *loss = sum / GR_VAL_WINDOWS;
  return rc;
}

/* The softmax (double) of the last row of logits [T, V] read back. */
static int gm_last_probs(gm_model *m, dispatch_tensor *logits, int64_t T,
                         double *probs) {
  float lg[256];
  dispatch_tensor *last;
  dispatch_slice(logits, 0, T - 1, T, 1, &last);
  dispatch_tensor_read(last, lg, (size_t)m->nvocab * sizeof *lg);
  int rc = gm_check(m->dev, "sampling");
  if (rc < 0) return rc;
  double mx = lg[0], sum = 0;
  for (int i = 1; i < m->nvocab; i++)
    if (lg[i] > mx) mx = lg[i];
  for (int i = 0; i < m->nvocab; i++) sum += probs[i] = exp(lg[i] - mx);
  for (int i = 0; i < m->nvocab; i++) probs[i] /= sum;
  return 0;
}

int gm_sample(gm_model *m, const gr_corpus *c, int n, char *out) {
  int64_t *ctx = malloc((size_t)(n + 1) * sizeof *ctx);
  double probs[256];
  uint64_t rng = GR_SAMPLE_SEED;
  int rc = 0;
  if (!ctx) return DISPATCH_ENOMEM;
  ctx[0] = 0;
  for (int i = 0; i < c->nvocab; i++)
    if (c->vocab[i] == '\n') ctx[0] = i;
  for (int i = 0; i < n && rc == 0; i++) {
    int64_t len = i + 1 < GR_CTX ? i + 1 : GR_CTX;
    const int64_t shape[2] = {1, len};
    dispatch_tensor *x, *logits;
    rc = gm_report(m->dev, dispatch_scope_begin(m->dev),
                   "dispatch_scope_begin");
    if (rc < 0) break;
    dispatch_tensor_from_data(m->dev, DISPATCH_I64, 2, shape,
                              ctx + (i + 1 - len),
                              (size_t)len * sizeof *ctx, &x);
    gm_forward(m, x, 0, &logits);
    rc = gm_last_probs(m, logits, len, probs);
    dispatch_scope_end(m->dev);
    if (rc < 0) break;
    int t = gr_sample_pick(&rng, probs, m->nvocab);
    ctx[i + 1] = t;
    out[i] = (char)c->vocab[t];
  }
  free(ctx);
  return rc;
}
