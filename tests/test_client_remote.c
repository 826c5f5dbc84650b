/* libdispatch-client against a real dispatch-server (started on
 * 127.0.0.1 port 0 through tests/helpers/server_proc): the same tensor
 * programs on LOCAL and REMOTE give bit-identical results, gradients
 * included; the one-wrap rule on both kinds; deferred errors; a killed
 * server; scopes keeping the server's tensor count flat over 100 steps.
 * Needs DISPATCH_SERVER_BIN (make test sets it); without it every test
 * here fails (a missing server must not pass as "Tested: 0"). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/failalloc.h"
#include "helpers/server_proc.h"

static sp_server g_srv;

static void start_server(void) {
  check_server_start(&g_srv, NULL);
}

static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_dev(const char *kind) {
  char spec[64], msg[256] = "";
  if (strcmp(kind, "local") == 0)
    snprintf(spec, sizeof spec, "local");
  else
    snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}


/* ------------------------------------------------------------------ */
/* the same program on every device                                    */

#define MAX_BLOBS 96
typedef struct blobs {
  int n;
  const char *name[MAX_BLOBS];
  void *data[MAX_BLOBS];
  size_t len[MAX_BLOBS];
  int dtype[MAX_BLOBS];
} blobs;

static void rec(blobs *b, const char *name, dispatch_tensor *t) {
  cr_assert_lt(b->n, MAX_BLOBS);
  size_t n = dispatch_tensor_nbytes(t);
  void *p = malloc(n ? n : 1);
  int rc = dispatch_tensor_read(t, p, n);
  cr_assert_eq(rc, 0, "read %s: %s", name,
               dispatch_device_errmsg(dispatch_tensor_device(t)));
  b->name[b->n] = name;
  b->data[b->n] = p;
  b->len[b->n] = n;
  b->dtype[b->n] = dispatch_tensor_dtype(t);
  b->n++;
}

static void blobs_free(blobs *b) {
  for (int i = 0; i < b->n; i++) free(b->data[i]);
  b->n = 0;
}

/* Forward chains across every op family, two backward passes (dense and
 * conv), and three SGD steps; every intermediate is recorded. */
static void program(dispatch_device *dev, blobs *b) {
  OK(dev, dispatch_scope_begin(dev));
  int64_t xs[2] = {4, 6}, ws[2] = {6, 3}, bs[1] = {3}, ls[1] = {4};
  float bias_v[3] = {0.5f, -0.25f, 0.125f};
  int64_t lab_v[4] = {0, 2, 1, 2};
  dispatch_tensor *x, *w, *bias, *lab, *y, *t, *u, *v;
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, xs, -1, 1, 11, &x));
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 2, ws, 0, 1, 12, &w));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, bs, bias_v,
                                    sizeof bias_v, &bias));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ls, lab_v,
                                    sizeof lab_v, &lab));
  rec(b, "x", x);
  rec(b, "w", w);
  /* linalg + elementwise */
  OK(dev, dispatch_matmul(x, w, &t));
  OK(dev, dispatch_add(t, bias, &y));
  rec(b, "y", y);
  OK(dev, dispatch_relu(y, &t)); rec(b, "relu", t);
  OK(dev, dispatch_sigmoid(y, &t)); rec(b, "sigmoid", t);
  OK(dev, dispatch_tanh(y, &t)); rec(b, "tanh", t);
  OK(dev, dispatch_gelu(y, &t)); rec(b, "gelu", t);
  OK(dev, dispatch_abs(y, &u));
  OK(dev, dispatch_neg(u, &t));
  OK(dev, dispatch_exp(t, &t)); rec(b, "exp", t);
  OK(dev, dispatch_add_scalar(u, 1.0, &t));
  OK(dev, dispatch_sqrt(t, &v)); rec(b, "sqrt", v);
  OK(dev, dispatch_log(v, &t)); rec(b, "log", t);
  OK(dev, dispatch_pow_scalar(y, 2.0, &t)); rec(b, "pow", t);
  OK(dev, dispatch_rsub_scalar(y, 3.0, &t)); rec(b, "rsub", t);
  OK(dev, dispatch_rdiv_scalar(v, 2.0, &t)); rec(b, "rdiv", t);
  OK(dev, dispatch_div(y, v, &t)); rec(b, "div", t);
  OK(dev, dispatch_mul_scalar(y, -0.5, &u));
  OK(dev, dispatch_maximum(y, u, &t)); rec(b, "maximum", t);
  OK(dev, dispatch_minimum(y, u, &t)); rec(b, "minimum", t);
  OK(dev, dispatch_sign(y, &t)); rec(b, "sign", t);
  dispatch_tensor *mask;
  OK(dev, dispatch_gt(y, u, &mask)); rec(b, "gt", mask);
  OK(dev, dispatch_where(mask, y, u, &t)); rec(b, "where", t);
  OK(dev, dispatch_eq(y, y, &t)); rec(b, "eq", t);
  /* reductions */
  int64_t d1 = 1, d0 = 0;
  OK(dev, dispatch_sum(y, 1, &d1, 0, &t)); rec(b, "sum1", t);
  OK(dev, dispatch_mean(y, 0, NULL, 0, &t)); rec(b, "mean", t);
  OK(dev, dispatch_max(y, 1, &d0, 1, &t)); rec(b, "max0k", t);
  OK(dev, dispatch_argmax(y, 1, &d1, 0, &t)); rec(b, "argmax", t);
  /* shape */
  int64_t rs[2] = {2, 6}, perm[2] = {1, 0}, bsh[3] = {2, 4, 3};
  OK(dev, dispatch_reshape(y, 2, rs, &t)); rec(b, "reshape", t);
  OK(dev, dispatch_permute(y, 2, perm, &t)); rec(b, "permute", t);
  OK(dev, dispatch_transpose(x, 0, 1, &t)); rec(b, "transpose", t);
  OK(dev, dispatch_slice(x, 1, 1, 5, 2, &t)); rec(b, "slice", t);
  dispatch_tensor *pair[2] = {y, u};
  OK(dev, dispatch_cat(pair, 2, 0, &t)); rec(b, "cat", t);
  OK(dev, dispatch_stack(pair, 2, -1, &t)); rec(b, "stack", t);
  OK(dev, dispatch_broadcast_to(y, 3, bsh, &t)); rec(b, "broadcast", t);
  int64_t idx_v[3] = {3, 0, 3}, is[1] = {3};
  dispatch_tensor *idx;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, is, idx_v,
                                    sizeof idx_v, &idx));
  OK(dev, dispatch_index_select(y, 0, idx, &t)); rec(b, "index_select", t);
  OK(dev, dispatch_cast(y, DISPATCH_F64, &t)); rec(b, "cast", t);
  /* nn */
  OK(dev, dispatch_softmax(y, 1, &t)); rec(b, "softmax", t);
  OK(dev, dispatch_log_softmax(y, -1, &t)); rec(b, "log_softmax", t);
  OK(dev, dispatch_cross_entropy(y, lab, &t)); rec(b, "cross_entropy", t);
  OK(dev, dispatch_mse(y, u, &t)); rec(b, "mse", t);
  int64_t is4[4] = {1, 2, 6, 6}, ks4[4] = {3, 2, 3, 3};
  dispatch_tensor *img, *ker, *c;
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 4, is4, -1, 1, 21, &img));
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 4, ks4, 0, 0.5, 22, &ker));
  OK(dev, dispatch_conv2d(img, ker, 1, 1, 1, 1, 1, 1, &c)); rec(b, "conv", c);
  OK(dev, dispatch_max_pool2d(c, 2, 2, 2, 2, 0, 0, &t)); rec(b, "maxpool", t);
  OK(dev, dispatch_avg_pool2d(c, 3, 3, 1, 1, 1, 1, &t)); rec(b, "avgpool", t);
  OK(dev, dispatch_dropout(c, 0.3, 5, &t)); rec(b, "dropout", t);
  /* creation */
  OK(dev, dispatch_zeros(dev, DISPATCH_F64, 2, rs, &t)); rec(b, "zeros", t);
  OK(dev, dispatch_ones(dev, DISPATCH_I64, 1, is, &t)); rec(b, "ones", t);
  OK(dev, dispatch_full(dev, DISPATCH_F32, 2, rs, 2.5, &t)); rec(b, "full", t);
  OK(dev, dispatch_arange(dev, DISPATCH_F32, 0, 5, 0.5, &t));
  rec(b, "arange", t);

  /* backward through a dense model */
  dispatch_tensor *ax, *aw, *logits, *ce, *th, *reg, *loss, *g;
  OK(dev, dispatch_autodiff(x, &ax));
  OK(dev, dispatch_autodiff(w, &aw));
  OK(dev, dispatch_matmul(ax, aw, &t));
  OK(dev, dispatch_add(t, bias, &logits));
  OK(dev, dispatch_cross_entropy(logits, lab, &ce));
  OK(dev, dispatch_tanh(logits, &th));
  OK(dev, dispatch_mean(th, 0, NULL, 0, &reg));
  OK(dev, dispatch_add(ce, reg, &loss));
  cr_assert_eq(dispatch_kind(loss), DISPATCH_KIND_AUTODIFF);
  rec(b, "loss", loss);
  dispatch_grads *grads;
  OK(dev, dispatch_backward(loss, &grads));
  OK(dev, dispatch_grad(grads, aw, &g)); rec(b, "grad_w", g);
  OK(dev, dispatch_grad(grads, ax, &g)); rec(b, "grad_x", g);
  dispatch_grads_free(grads);

  /* backward through conv, pooling and slicing */
  dispatch_tensor *ak, *cc;
  OK(dev, dispatch_autodiff(ker, &ak));
  OK(dev, dispatch_conv2d(img, ak, 1, 1, 1, 1, 1, 1, &cc));
  OK(dev, dispatch_relu(cc, &t));
  OK(dev, dispatch_max_pool2d(t, 2, 2, 2, 2, 0, 0, &t));
  OK(dev, dispatch_slice(t, 1, 0, 2, 1, &t));
  OK(dev, dispatch_mean(t, 0, NULL, 0, &t));
  OK(dev, dispatch_backward(t, &grads));
  OK(dev, dispatch_grad(grads, ak, &g)); rec(b, "grad_conv_w", g);
  dispatch_grads_free(grads);

  /* three optimizer steps */
  dispatch_tensor *params[2] = {aw, ak};
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(params, 1, 0.1, 0.9, 0.01, &opt));
  dispatch_optim *adam;
  OK(dev, dispatch_adam_new(params + 1, 1, 0.01, 0.9, 0.999, 1e-8, &adam));
  for (int step = 0; step < 3; step++) {
    OK(dev, dispatch_matmul(ax, aw, &t));
    OK(dev, dispatch_cross_entropy(t, lab, &loss));
    OK(dev, dispatch_backward(loss, &grads));
    OK(dev, dispatch_optim_step(opt, grads));
    dispatch_grads_free(grads);
    OK(dev, dispatch_conv2d(img, ak, 1, 1, 0, 0, 1, 1, &t));
    OK(dev, dispatch_mean(t, 0, NULL, 0, &loss));
    OK(dev, dispatch_backward(loss, &grads));
    OK(dev, dispatch_optim_step(adam, grads));
    dispatch_grads_free(grads);
  }
  rec(b, "w_after_sgd", aw);
  rec(b, "k_after_adam", ak);
  dispatch_optim_free(opt);
  dispatch_optim_free(adam);
  OK(dev, dispatch_device_sync(dev));
  OK(dev, dispatch_scope_end(dev));
}

Test(client_remote, local_and_remote_bit_identical, .fini = stop_server) {
  start_server();
  const char *kinds[2] = {"local", "remote"};
  blobs res[2];
  memset(res, 0, sizeof res);
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_dev(kinds[k]);
    program(dev, &res[k]);
    dispatch_device_close(dev);
  }
  cr_assert_eq(res[0].n, res[1].n);
  cr_assert_gt(res[0].n, 50);
  for (int i = 0; i < res[0].n; i++) {
    cr_assert_str_eq(res[0].name[i], res[1].name[i]);
    cr_assert_eq(res[0].len[i], res[1].len[i], "%s", res[0].name[i]);
    cr_assert_eq(memcmp(res[0].data[i], res[1].data[i], res[0].len[i]), 0,
                 "%s differs between LOCAL and REMOTE", res[0].name[i]);
  }
  blobs_free(&res[0]);
  blobs_free(&res[1]);
}

Test(client_remote, one_wrap_rule_on_both_kinds, .fini = stop_server) {
  start_server();
  const char *kinds[2] = {"local", "remote"};
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_dev(kinds[k]);
    int64_t sh[1] = {4};
    dispatch_tensor *x, *ax, *bad = NULL, *y;
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &x));
    cr_assert_eq(dispatch_kind(x), k == 0 ? DISPATCH_KIND_LOCAL
                                          : DISPATCH_KIND_REMOTE);
    OK(dev, dispatch_autodiff(x, &ax));
    cr_assert_eq(dispatch_kind(ax), DISPATCH_KIND_AUTODIFF);
    cr_assert_eq(dispatch_inner(ax), x);
    cr_assert_eq(dispatch_autodiff(ax, &bad), DISPATCH_EDOUBLEWRAP);
    cr_assert_null(bad);
    cr_assert_str_eq(dispatch_device_errmsg(dev),
                     "autodiff should not wrap an autodiff tensor");
    cr_assert_eq(dispatch_autodiff(x, &bad), DISPATCH_EDOUBLEWRAP);
    OK(dev, dispatch_exp(ax, &y));
    cr_assert_eq(dispatch_kind(y), DISPATCH_KIND_AUTODIFF);
    cr_assert_eq(dispatch_kind(dispatch_inner(y)),
                 k == 0 ? DISPATCH_KIND_LOCAL : DISPATCH_KIND_REMOTE);
    cr_assert_eq(dispatch_autodiff(y, &bad), DISPATCH_EDOUBLEWRAP);
    /* the wrapped tensor stays readable through either handle */
    float v[4];
    OK(dev, dispatch_tensor_read(ax, v, sizeof v));
    cr_assert_eq(v[3], 1.0f);
    OK(dev, dispatch_device_sync(dev)); /* the server accepted one Track */
    dispatch_device_close(dev);
  }
}

/* An op on unwrapped tensors records nothing on either kind, even when the
 * tensor underneath is tracked: its result can be wrapped as a new leaf. */
Test(client_remote, ops_on_inner_tensors_record_nothing_on_both_kinds,
     .fini = stop_server) {
  start_server();
  const char *kinds[2] = {"local", "remote"};
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_dev(kinds[k]);
    int64_t sh[1] = {3};
    dispatch_tensor *p, *ap, *s, *q, *aq, *loss;
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &p));
    OK(dev, dispatch_autodiff(p, &ap));
    OK(dev, dispatch_full(dev, DISPATCH_F32, 1, sh, 0.5, &s));
    OK(dev, dispatch_sub(dispatch_inner(ap), s, &q)); /* untracked */
    cr_assert_eq(dispatch_is_autodiff(q), 0);
    OK(dev, dispatch_autodiff(q, &aq)); /* a fresh leaf, not a double wrap */
    OK(dev, dispatch_sum(aq, 0, NULL, 0, &loss));
    dispatch_grads *g;
    OK(dev, dispatch_backward(loss, &g));
    dispatch_tensor *gq;
    OK(dev, dispatch_grad(g, aq, &gq));
    float v[3];
    OK(dev, dispatch_tensor_read(gq, v, sizeof v));
    cr_assert_eq(v[0], 1.0f, "%s", kinds[k]);
    dispatch_grads_free(g);
    OK(dev, dispatch_device_sync(dev));
    dispatch_device_close(dev);
  }
}

/* A step over a parameter the backward did not reach changes no
 * parameter on either kind (the server checks every gradient before the
 * first update), and both kinds count one error and no op for it. */
Test(client_remote, failed_step_changes_no_parameter_on_both_kinds,
     .fini = stop_server) {
  start_server();
  const char *kinds[2] = {"local", "remote"};
  dispatch_stats st[2] = {DISPATCH_STATS_INIT, DISPATCH_STATS_INIT};
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_dev(kinds[k]);
    int64_t sh[1] = {2};
    dispatch_tensor *w1, *w2, *a1, *a2, *loss;
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &w1));
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &w2));
    OK(dev, dispatch_autodiff(w1, &a1));
    OK(dev, dispatch_autodiff(w2, &a2));
    OK(dev, dispatch_sum(a1, 0, NULL, 0, &loss)); /* w2 is not reached */
    dispatch_grads *g;
    OK(dev, dispatch_backward(loss, &g));
    dispatch_tensor *params[2] = {a1, a2};
    dispatch_optim *opt;
    OK(dev, dispatch_sgd_new(params, 2, 0.5, 0, 0, &opt));
    dispatch_stats before = DISPATCH_STATS_INIT;
    OK(dev, dispatch_device_stats(dev, &before));
    int rc = dispatch_optim_step(opt, g);
    if (k == 1) {
      cr_assert_eq(rc, 0); /* queued; the server's error comes at a wait */
      rc = dispatch_device_sync(dev);
    }
    cr_assert_eq(rc, DISPATCH_ENOGRAD, "%s: %s", kinds[k],
                 dispatch_err_name(rc));
    float v[2];
    OK(dev, dispatch_tensor_read(a1, v, sizeof v));
    cr_assert_eq(v[0], 1.0f, "%s: parameter 0 changed by a failed step (%g)",
                 kinds[k], v[0]);
    OK(dev, dispatch_device_stats(dev, &st[k]));
    st[k].ops -= before.ops;
    st[k].errors -= before.errors;
    dispatch_optim_free(opt);
    dispatch_grads_free(g);
    dispatch_device_close(dev);
  }
  cr_assert_eq(st[0].ops, st[1].ops, "ops: local %llu, remote %llu",
               (unsigned long long)st[0].ops, (unsigned long long)st[1].ops);
  cr_assert_eq(st[0].errors, st[1].errors, "errors: local %llu, remote %llu",
               (unsigned long long)st[0].errors,
               (unsigned long long)st[1].errors);
}

Test(client_remote, deferred_error_surfaces_at_next_wait, .fini = stop_server) {
  start_server();
  dispatch_device *dev = open_dev("remote");
  int64_t sh[1] = {3};
  int64_t idx_v[2] = {0, 7}, is[1] = {2};
  dispatch_tensor *x, *idx, *bad, *after;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &x));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, is, idx_v,
                                    sizeof idx_v, &idx));
  /* index 7 is out of range: only the server's kernel can know */
  OK(dev, dispatch_index_select(x, 0, idx, &bad));
  OK(dev, dispatch_exp(bad, &after)); /* queued, no wait */
  cr_assert_eq(dispatch_tensor_status(bad), 0, "not known before a wait");
  int rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_EINDEX, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  const char *m = dispatch_device_errmsg(dev);
  cr_assert(strstr(m, "server") && strstr(m, "index_select"), "%s", m);
  cr_assert_eq(dispatch_tensor_status(bad), DISPATCH_EINDEX);
  /* the server poisoned what was computed from it: reading says so and
   * marks the handle; the session goes on */
  float v[2];
  cr_assert_eq(dispatch_tensor_read(after, v, sizeof v), DISPATCH_EPOISONED,
               "%s", dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_tensor_status(after), DISPATCH_EPOISONED);
  cr_assert_lt(dispatch_tensor_read(bad, v, sizeof v), 0);
  OK(dev, dispatch_device_sync(dev));
  float xv[3];
  OK(dev, dispatch_tensor_read(x, xv, sizeof xv));
  cr_assert_eq(xv[0], 1.0f);
  dispatch_device_close(dev);
}

/* A 1.3 server's backward is pipelined: a second backward through a
 * released graph returns at once, the next wait reports
 * DISPATCH_EGRAPHFREED, a gradient taken from it fails (poisoned), and
 * freeing its container leaves no error behind; a good backward's
 * gradients are right. */
Test(client_remote, backward_failure_surfaces_at_next_wait,
     .fini = stop_server) {
  start_server();
  dispatch_device *dev = open_dev("remote");
  int64_t sh[1] = {3};
  dispatch_tensor *x, *w, *sq, *loss;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &x));
  OK(dev, dispatch_autodiff(x, &w));
  OK(dev, dispatch_mul(w, w, &sq));
  OK(dev, dispatch_sum(sq, 0, NULL, 0, &loss));
  dispatch_grads *g1, *g2;
  OK(dev, dispatch_backward(loss, &g1));
  int rc = dispatch_backward(loss, &g2); /* the graph is gone */
  cr_assert_eq(rc, 0, "pipelined, yet %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  dispatch_tensor *bad;
  OK(dev, dispatch_grad(g2, w, &bad));
  rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_EGRAPHFREED, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  float v[3];
  cr_assert_lt(dispatch_tensor_read(bad, v, sizeof v), 0);
  dispatch_tensor *good;
  OK(dev, dispatch_grad(g1, w, &good));
  OK(dev, dispatch_tensor_read(good, v, sizeof v));
  cr_assert_eq(v[2], 2.0f);
  dispatch_tensor_free(bad);
  dispatch_grads_free(g2);
  dispatch_grads_free(g1);
  OK(dev, dispatch_device_sync(dev)); /* freeing g2 left no error */
  dispatch_tensor_free(good);
  dispatch_tensor_free(loss);
  dispatch_tensor_free(sq);
  dispatch_tensor_free(w);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

/* One small training step; returns the first error. */
static int remote_step(dispatch_device *dev, dispatch_tensor *ax,
                       dispatch_tensor *aw, dispatch_tensor *lab,
                       dispatch_optim *opt) {
  int rc = dispatch_scope_begin(dev);
  if (rc < 0) return rc;
  dispatch_tensor *h, *loss;
  dispatch_grads *g = NULL;
  if ((rc = dispatch_matmul(ax, aw, &h)) == 0 &&
      (rc = dispatch_relu(h, &h)) == 0 &&
      (rc = dispatch_cross_entropy(h, lab, &loss)) == 0 &&
      (rc = dispatch_backward(loss, &g)) == 0)
    rc = dispatch_optim_step(opt, g);
  dispatch_grads_free(g);
  int rc2 = dispatch_scope_end(dev);
  return rc ? rc : rc2;
}

static void make_model(dispatch_device *dev, dispatch_tensor **ax,
                       dispatch_tensor **aw, dispatch_tensor **lab) {
  int64_t xs[2] = {8, 5}, ws[2] = {5, 4}, ls[1] = {8};
  int64_t lv[8] = {0, 1, 2, 3, 3, 2, 1, 0};
  dispatch_tensor *x, *w;
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, xs, -1, 1, 1, &x));
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 2, ws, 0, 0.5, 2, &w));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ls, lv, sizeof lv,
                                    lab));
  OK(dev, dispatch_autodiff(x, ax));
  OK(dev, dispatch_autodiff(w, aw));
}

Test(client_remote, killed_server_gives_econn_and_keeps_it,
     .fini = stop_server) {
  start_server();
  dispatch_device *dev = open_dev("remote");
  OK(dev, dispatch_device_set_timeout(dev, 5000));
  dispatch_tensor *ax, *aw, *lab;
  make_model(dev, &ax, &aw, &lab);
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(&aw, 1, 0.1, 0.9, 0, &opt));
  for (int i = 0; i < 3; i++) OK(dev, remote_step(dev, ax, aw, lab, opt));
  cr_assert_eq(sp_signal(&g_srv, SIGKILL), 0);
  sp_wait(&g_srv);
  g_srv.pid = 0;
  int rc = 0;
  /* a step queues everything (the backward too, since protocol 1.3): the
   * wait that ends it is where the lost server shows */
  for (int i = 0; i < 5 && rc == 0; i++) {
    rc = remote_step(dev, ax, aw, lab, opt);
    if (rc == 0) rc = dispatch_device_sync(dev);
  }
  cr_assert_eq(rc, DISPATCH_ECONN, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "lost") != NULL);
  /* every later call keeps saying so, waiting or not */
  cr_assert_eq(remote_step(dev, ax, aw, lab, opt), DISPATCH_ECONN);
  cr_assert_eq(dispatch_device_sync(dev), DISPATCH_ECONN);
  dispatch_tensor *t = NULL;
  cr_assert_eq(dispatch_exp(ax, &t), DISPATCH_ECONN);
  cr_assert_null(t);
  float v[40];
  cr_assert_eq(dispatch_tensor_read(ax, v, sizeof v), DISPATCH_ECONN);
  dispatch_stats st = DISPATCH_STATS_INIT;
  cr_assert_eq(dispatch_device_stats(dev, &st), DISPATCH_ECONN);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
}

Test(client_remote, hundred_steps_in_scopes_leave_server_counts_flat,
     .fini = stop_server) {
  start_server();
  dispatch_device *dev = open_dev("remote");
  dispatch_tensor *ax, *aw, *lab;
  make_model(dev, &ax, &aw, &lab);
  dispatch_optim *opt;
  OK(dev, dispatch_adam_new(&aw, 1, 0.01, 0.9, 0.999, 1e-8, &opt));
  OK(dev, remote_step(dev, ax, aw, lab, opt)); /* warm: states exist */
  dispatch_stats st0 = DISPATCH_STATS_INIT, st1 = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st0));
  for (int i = 0; i < 100; i++) OK(dev, remote_step(dev, ax, aw, lab, opt));
  OK(dev, dispatch_device_stats(dev, &st1));
  cr_assert_eq(st1.tensors, st0.tensors, "tensors %llu -> %llu",
               (unsigned long long)st0.tensors,
               (unsigned long long)st1.tensors);
  cr_assert_eq(st1.bytes, st0.bytes);
  cr_assert_eq(st1.grads, 0);
  cr_assert_eq(st1.errors, 0);
  /* 4 ops + 1 Step per step: a step over the parameters is one message */
  cr_assert_eq(st1.ops - st0.ops, 100 * 4, "ops %llu -> %llu",
               (unsigned long long)st0.ops, (unsigned long long)st1.ops);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
}

Test(client_remote, env_moves_an_unchanged_program_to_the_server,
     .fini = stop_server) {
  start_server();
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  setenv("DISPATCH_DEVICE", spec, 1);
  dispatch_device *dev = NULL;
  char msg[256];
  int rc = dispatch_device_open(NULL, NULL, &dev, msg, sizeof msg);
  unsetenv("DISPATCH_DEVICE");
  cr_assert_eq(rc, 0, "%s", msg);
  cr_assert_eq(dispatch_device_kind(dev), DISPATCH_KIND_REMOTE);
  dispatch_tensor *t;
  int64_t sh[1] = {2};
  OK(dev, dispatch_full(dev, DISPATCH_F64, 1, sh, 4.0, &t));
  OK(dev, dispatch_sqrt(t, &t));
  double v[2];
  OK(dev, dispatch_tensor_read(t, v, sizeof v));
  cr_assert_eq(v[1], 2.0);
  dispatch_device_close(dev);
}

/* One remote training step from open to close; the first error. */
static int remote_program(const char *spec) {
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, NULL, 0);
  if (rc < 0) return rc;
  int64_t xs[2] = {3, 4}, ws[2] = {4, 2};
  float xv[12] = {0};
  float gv[8];
  dispatch_tensor *x, *w, *aw, *y, *loss, *g;
  dispatch_grads *grads = NULL;
  dispatch_optim *opt = NULL;
  if ((rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, xv,
                                      sizeof xv, &x)) < 0 ||
      (rc = dispatch_normal(dev, DISPATCH_F32, 2, ws, 0, 1, 4, &w)) < 0 ||
      (rc = dispatch_autodiff(w, &aw)) < 0 ||
      (rc = dispatch_sgd_new(&aw, 1, 0.1, 0.9, 0, &opt)) < 0 ||
      (rc = dispatch_scope_begin(dev)) < 0 ||
      (rc = dispatch_matmul(x, aw, &y)) < 0 ||
      (rc = dispatch_sum(y, 0, NULL, 0, &loss)) < 0 ||
      (rc = dispatch_backward(loss, &grads)) < 0 ||
      (rc = dispatch_grad(grads, aw, &g)) < 0 ||
      (rc = dispatch_tensor_read(g, gv, sizeof gv)) < 0 ||
      (rc = dispatch_optim_step(opt, grads)) < 0 ||
      (rc = dispatch_scope_end(dev)) < 0)
    goto out;
  rc = dispatch_device_sync(dev);
out:
  dispatch_grads_free(grads);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
  return rc;
}

Test(client_remote, every_allocation_failure_is_enomem_without_leaks,
     .fini = stop_server) {
  start_server();
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  failalloc_install(0);
  int rc0 = remote_program(spec);
  long total = failalloc_count(), live0 = failalloc_live();
  failalloc_remove();
  cr_assert_eq(rc0, 0, "%s", dispatch_err_name(rc0));
  cr_assert_eq(live0, 0);
  cr_assert_gt(total, 10);
  for (long n = 1; n <= total; n++) {
    failalloc_install(n);
    int rc = remote_program(spec);
    long live = failalloc_live(), failed = failalloc_failed();
    failalloc_remove();
    if (!failed) continue; /* this run allocated less (fewer frees queued) */
    cr_assert_eq(rc, DISPATCH_ENOMEM, "allocation %ld of %ld: got %s", n,
                 total, dispatch_err_name(rc));
    cr_assert_eq(live, 0, "allocation %ld of %ld leaked %ld blocks", n, total,
                 live);
  }
}

/* ------------------------------------------------------------------ */
/* waits that time out on a busy server (issue 21 item 5)              */

#define MM_N 1024

static dispatch_device *open_with_timeout(int timeout_ms) {
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_options o = DISPATCH_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

/* Queues k products x @ x whose results go at once (the server still
 * runs each: a pipeline it is busy with). */
static void queue_matmuls(dispatch_device *dev, dispatch_tensor *x, int k) {
  for (int i = 0; i < k; i++) {
    dispatch_tensor *y;
    OK(dev, dispatch_matmul(x, x, &y));
    dispatch_tensor_free(y);
  }
}

/* x is 1/N everywhere, so every element of x @ x is N * 2^-20 = 1/N:
 * exact in f32 whatever the order of the sums. */
static void expect_all(dispatch_device *dev, dispatch_tensor *t, float want) {
  size_t n = dispatch_tensor_nbytes(t);
  float *buf = malloc(n);
  cr_assert(buf);
  int rc, again = 0;
  while ((rc = dispatch_tensor_read(t, buf, n)) == DISPATCH_ETIMEDOUT)
    cr_assert_lt(++again, 1000);
  OK(dev, rc);
  for (size_t i = 0; i < n / sizeof *buf; i++)
    cr_assert_eq(buf[i], want, "element %zu: %g, not %g", i, buf[i], want);
  free(buf);
}

/* A sync behind more work than its timeout: DISPATCH_ETIMEDOUT, not a
 * lost connection (the server says it is alive while it works). The
 * session is intact: waiting again gets the same sync's reply, a read
 * after another timed-out sync works, nothing was resumed, and the
 * timeout is no first error of the device. The work doubles until a
 * sync gives up on it, so a fast machine tests the same. */
Test(client_remote, wait_that_times_out_leaves_the_session_usable,
     .fini = stop_server) {
  start_server();
  dispatch_device *dev = open_with_timeout(600);
  int64_t shape[2] = {MM_N, MM_N};
  const float one_n = 1.0f / MM_N;
  dispatch_tensor *x, *keep = NULL;
  OK(dev, dispatch_full(dev, DISPATCH_F32, 2, shape, one_n, &x));
  OK(dev, dispatch_device_sync(dev));
  int rc = 0, k;
  for (k = 8; k <= 8192; k *= 2) {
    queue_matmuls(dev, x, k);
    OK(dev, dispatch_matmul(x, x, &keep));
    rc = dispatch_device_sync(dev);
    if (rc == DISPATCH_ETIMEDOUT) break;
    cr_assert_eq(rc, 0, "sync after %d matmuls: %s: %s", k,
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    dispatch_tensor_free(keep);
    keep = NULL;
    /* a wait that outlived its timeout by reconnecting instead lost the
     * connection on the way */
    dispatch_stats st = DISPATCH_STATS_INIT;
    OK(dev, dispatch_device_stats(dev, &st));
    cr_assert_eq(st.sessions_resumed, 0, "sync after %d matmuls resumed",
                 k);
  }
  cr_assert_eq(rc, DISPATCH_ETIMEDOUT, "no sync timed out (%d matmuls)", k);
  cr_assert_eq(dispatch_device_error(dev, NULL), 0,
               "a timeout became the device's first error");
  /* an upload too large to copy into the replay log is acknowledged by a
   * Sync before it returns: on the busy server that Sync times out too,
   * yet the upload is handed over and the caller's buffer may go */
  queue_matmuls(dev, x, k);
  size_t nb = (size_t)MM_N * MM_N * sizeof(float);
  float *up = malloc(nb);
  cr_assert(up);
  for (size_t i = 0; i < nb / sizeof *up; i++) up[i] = 0.25f;
  dispatch_tensor *u;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, up, nb, &u));
  memset(up, 0xff, nb);
  free(up);
  /* waiting again: the same sync, as often as it takes */
  int again = 0;
  while ((rc = dispatch_device_sync(dev)) == DISPATCH_ETIMEDOUT)
    cr_assert_lt(++again, 1000);
  OK(dev, rc);
  expect_all(dev, keep, one_n);
  expect_all(dev, x, one_n);
  expect_all(dev, u, 0.25f);
  dispatch_tensor_free(u);
  /* another backlog: a read (another request) waits for the pending
   * sync first, then for itself */
  queue_matmuls(dev, x, k);
  rc = dispatch_device_sync(dev);
  cr_assert(rc == 0 || rc == DISPATCH_ETIMEDOUT, "%s", dispatch_err_name(rc));
  expect_all(dev, keep, one_n);
  /* one session all along: the connection was never lost */
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  cr_assert_eq(st.sessions_resumed, 0, "the session was resumed %llu times",
               (unsigned long long)st.sessions_resumed);
  cr_assert_eq(st.sessions, 1);
  cr_assert_eq(st.errors, 0);
  /* 0: no limit; the wait lasts as long as the work */
  queue_matmuls(dev, x, k);
  OK(dev, dispatch_device_set_timeout(dev, 0));
  OK(dev, dispatch_device_sync(dev));
  dispatch_tensor_free(keep);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

static void stop_stopped_server(void) {
  if (g_srv.pid) kill(g_srv.pid, SIGCONT);
  stop_server();
}

/* A server that says nothing at all (stopped: its kernel still accepts
 * the reconnect) is a lost connection: the wait resumes, the resume
 * hears nothing either, and the device gives DISPATCH_ECONN from then
 * on. */
Test(client_remote, silent_server_is_a_lost_connection,
     .fini = stop_stopped_server) {
  start_server();
  dispatch_device *dev = open_with_timeout(300);
  int64_t shape[2] = {4, 4};
  dispatch_tensor *x, *y;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 2, shape, &x));
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(kill(g_srv.pid, SIGSTOP), 0);
  int rc = dispatch_matmul(x, x, &y);
  if (rc == 0) rc = dispatch_device_sync(dev);
  int later = dispatch_device_sync(dev);
  kill(g_srv.pid, SIGCONT);
  cr_assert_eq(rc, DISPATCH_ECONN, "%s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert_eq(later, DISPATCH_ECONN, "%s", dispatch_err_name(later));
  dispatch_device_close(dev);
}

/* Retries a stats wait that timed out; the server-wide resume count. */
static uint64_t resumed_so_far(dispatch_device *dev) {
  dispatch_stats st = DISPATCH_STATS_INIT;
  int rc, again = 0;
  while ((rc = dispatch_device_stats(dev, &st)) == DISPATCH_ETIMEDOUT)
    cr_assert_lt(++again, 1000);
  OK(dev, rc);
  return st.sessions_resumed;
}

/* A send the busy server does not read (it stops reading a session with
 * --max-queued requests waiting until they ran) waits as long
 * as the server says it is alive: the uploads behind the matmuls block
 * in the socket for longer than the timeout, and the session is never
 * taken for lost (no resume). The work doubles until a sync behind a
 * quarter of what held up the uploads times out, so the block outlasted
 * the timeout. */
Test(client_remote, send_held_up_by_a_busy_server_keeps_the_session,
     .fini = stop_server) {
  const char *args[] = {"--max-queued", "4", NULL};
  check_server_start(&g_srv, args);
  dispatch_device *dev = open_with_timeout(600);
  int64_t shape[2] = {MM_N, MM_N}, ushape[2] = {512, 512};
  const float one_n = 1.0f / MM_N;
  dispatch_tensor *x, *u = NULL;
  OK(dev, dispatch_full(dev, DISPATCH_F32, 2, shape, one_n, &x));
  OK(dev, dispatch_device_sync(dev));
  size_t nb = 512 * 512 * sizeof(float); /* 1 MiB: copied into the log */
  float *up = malloc(nb);
  cr_assert(up);
  for (size_t i = 0; i < nb / sizeof *up; i++) up[i] = 0.25f;
  int rc = 0, k;
  for (k = 8; k <= 8192; k *= 2) {
    /* four times the work a sync times out behind: the uploads wait */
    queue_matmuls(dev, x, 4 * k);
    for (int i = 0; i < 32; i++) {
      if (u) dispatch_tensor_free(u);
      OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, ushape, up, nb,
                                        &u));
    }
    cr_assert_eq(resumed_so_far(dev), 0, "uploads after %d matmuls resumed",
                 k);
    queue_matmuls(dev, x, k);
    rc = dispatch_device_sync(dev);
    if (rc == DISPATCH_ETIMEDOUT) break;
    OK(dev, rc);
  }
  cr_assert_eq(rc, DISPATCH_ETIMEDOUT, "no sync timed out (%d matmuls)", k);
  free(up);
  expect_all(dev, u, 0.25f);
  cr_assert_eq(resumed_so_far(dev), 0);
  dispatch_tensor_free(u);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

/* A deferred error that the timed-out sync's reply carries is the next
 * wait's answer, whatever that wait is (a read here: not sent, so it
 * reads nothing), and is reported once: the read after it works. Each
 * round queues matmuls and an op the server refuses (a 4 GiB tensor, past
 * its session limit); the work doubles until the sync times out. */
Test(client_remote, deferred_error_behind_a_timed_out_wait_is_reported_once,
     .fini = stop_server) {
  const char *args[] = {"--max-session-bytes", "1073741824", NULL};
  check_server_start(&g_srv, args);
  /* opened with 30 s (keepalives every 7.5 s), then 600 ms: the next
   * waiting request asks the server for keepalives every 150 ms */
  dispatch_device *dev = open_with_timeout(30000);
  OK(dev, dispatch_device_set_timeout(dev, 600));
  int64_t shape[2] = {MM_N, MM_N}, huge[2] = {1 << 15, 1 << 15};
  const float one_n = 1.0f / MM_N;
  dispatch_tensor *x, *bad;
  OK(dev, dispatch_full(dev, DISPATCH_F32, 2, shape, one_n, &x));
  OK(dev, dispatch_device_sync(dev));
  int rc = 0, code = 0, k;
  for (k = 8; k <= 8192; k *= 2) {
    queue_matmuls(dev, x, 8); /* 8 in flight at most: 32 MiB */
    OK(dev, dispatch_full(dev, DISPATCH_F32, 2, huge, 1.0, &bad));
    dispatch_tensor_free(bad);
    queue_matmuls(dev, x, k);
    rc = dispatch_device_sync(dev);
    if (rc == DISPATCH_ETIMEDOUT) break;
    cr_assert_lt(rc, 0, "the 4 GiB tensor was made");
    cr_assert(code == 0 || rc == code, "%s, then %s", dispatch_err_name(code),
              dispatch_err_name(rc));
    code = rc;
  }
  cr_assert_eq(rc, DISPATCH_ETIMEDOUT, "no sync timed out (%d matmuls)", k);
  size_t n = dispatch_tensor_nbytes(x);
  float *buf = malloc(n);
  cr_assert(buf);
  int again = 0;
  while ((rc = dispatch_tensor_read(x, buf, n)) == DISPATCH_ETIMEDOUT)
    cr_assert_lt(++again, 1000);
  /* the refused op's code (the earlier rounds' syncs gave it, if any) */
  cr_assert(code ? rc == code
                 : rc < 0 && rc != DISPATCH_ECONN && rc != DISPATCH_ETIMEDOUT,
            "the read after the timed-out sync: %s (%s)",
            dispatch_err_name(rc), dispatch_device_errmsg(dev));
  OK(dev, dispatch_tensor_read(x, buf, n));
  for (size_t i = 0; i < n / sizeof *buf; i++)
    cr_assert_eq(buf[i], one_n, "element %zu", i);
  free(buf);
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(resumed_so_far(dev), 0);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}
