/* Straight-line client code (issue 13 item 7): a forward pass written as
 * a sequence of calls with one check at the end. Every test runs on LOCAL
 * and on REMOTE (a real dispatch-server on 127.0.0.1, port 0):
 * - the device keeps its first error; a later call given a NULL input (the
 *   output of a failed call) or a poisoned input returns that first error's
 *   code and leaves the first error's message in place;
 * - REMOTE: a tensor the client knows is poisoned fails the op at once,
 *   without a round trip (the server never sees it);
 * - an independent valid op still works; clearing restores the normal
 *   "input N is NULL" behaviour;
 * - freeing what a call returned is right with or without a scope. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;

static void start_server(void) {
  check_server_start(&g_srv, NULL);
}

static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static const char *kname(int k) { return k ? "remote" : "local"; }

static dispatch_device *open_kind(int k) { return check_open(&g_srv, k); }

static dispatch_tensor *mat(dispatch_device *dev, int64_t r, int64_t c,
                            const float *v) {
  int64_t sh[2] = {r, c};
  dispatch_tensor *t;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sh, v,
                                    (size_t)(r * c) * sizeof *v, &t));
  return t;
}

static uint64_t live(dispatch_device *dev) {
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  return st.tensors;
}

#define FIRST_MSG "matmul: inner dims 3 and 4 differ"

/* The call returned the first error's code, gave no tensor, and the
 * device's messages are still the first op's. A call that names no device
 * (all its inputs NULL) cannot touch a device's last error: only the first
 * is checked then. */
static void expect_first(dispatch_device *dev, int rc, dispatch_tensor *out,
                         const char *call, int k) {
  const char *first = NULL;
  cr_assert_eq(rc, DISPATCH_ESHAPE, "%s (%s): got %s, want the first "
               "error DISPATCH_ESHAPE; message \"%s\"", call, kname(k),
               dispatch_err_name(rc), dispatch_device_errmsg(dev));
  cr_assert_null(out, "%s (%s): a tensor after a failure", call, kname(k));
  cr_assert_eq(dispatch_device_error(dev, &first), DISPATCH_ESHAPE,
               "%s (%s)", call, kname(k));
  cr_assert_str_eq(first, FIRST_MSG, "%s (%s)", call, kname(k));
  if (strstr(call, "(NULL)")) return;
  cr_assert_eq(dispatch_device_errcode(dev), DISPATCH_ESHAPE, "%s (%s)",
               call, kname(k));
  cr_assert_str_eq(dispatch_device_errmsg(dev), FIRST_MSG,
                   "%s (%s): message \"%s\", want the first op's",
                   call, kname(k), dispatch_device_errmsg(dev));
}

/* A chain whose 2nd op fails, then three more ops on its output and on a
 * NULL: each returns the first code and keeps the first message. */
Test(straight, chain_keeps_first_error, .init = start_server,
     .fini = stop_server) {
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_kind(k);
    OK(dev, dispatch_scope_begin(dev));
    float xv[6] = {1, -2, 3, -4, 5, -6}, wv[20] = {0}, bv[5] = {1, 1, 1, 1, 1};
    dispatch_tensor *x = mat(dev, 2, 3, xv), *w = mat(dev, 4, 5, wv);
    dispatch_tensor *b = mat(dev, 1, 5, bv);
    dispatch_tensor *a, *h = NULL, *h2 = (dispatch_tensor *)1, *h3, *h4;
    OK(dev, dispatch_relu(x, &a));                 /* 1st op: fine */
    int rc = dispatch_matmul(a, w, &h);            /* 2nd: [2,3] @ [4,5] */
    expect_first(dev, rc, h, "matmul", k);
    h3 = h4 = (dispatch_tensor *)1;
    rc = dispatch_add(h, b, &h2);                  /* NULL input 0 */
    expect_first(dev, rc, h2, "add(NULL, b)", k);
    rc = dispatch_mul(b, h2, &h3);                 /* NULL input 1 */
    expect_first(dev, rc, h3, "mul(b, NULL)", k);
    rc = dispatch_relu(h3, &h4);                   /* no device named */
    expect_first(dev, rc, h4, "relu(NULL)", k);
    /* the rest of a training step written straight on: the same answer */
    dispatch_grads *g = (dispatch_grads *)1;
    rc = dispatch_backward(h4, &g);
    expect_first(dev, rc, NULL, "backward(NULL)", k);
    cr_assert_null(g);
    float v[2];
    rc = dispatch_tensor_read(h4, v, sizeof v);
    expect_first(dev, rc, NULL, "tensor_read(NULL)", k);

    /* an independent valid op still runs, and the first error stays */
    dispatch_tensor *s;
    OK(dev, dispatch_add(x, x, &s));
    float sv[6];
    OK(dev, dispatch_tensor_read(s, sv, sizeof sv));
    cr_assert_eq(sv[4], 10.0f, "%s: %g", kname(k), sv[4]);
    const char *msg = NULL;
    cr_assert_eq(dispatch_device_error(dev, &msg), DISPATCH_ESHAPE, "%s",
                 kname(k));
    cr_assert_str_eq(msg, FIRST_MSG, "%s", kname(k));

    /* a later independent failure is the last error, not the first */
    int64_t n6 = 6, iv[6] = {0};
    dispatch_tensor *ix, *bad;
    OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, &n6, iv,
                                      sizeof iv, &ix));
    rc = dispatch_add(x, ix, &bad); /* f32 + i64 */
    cr_assert_eq(rc, DISPATCH_EDTYPE, "%s: %s", kname(k),
                 dispatch_err_name(rc));
    cr_assert_eq(dispatch_device_errcode(dev), DISPATCH_EDTYPE);
    cr_assert_eq(dispatch_device_error(dev, &msg), DISPATCH_ESHAPE);
    cr_assert_str_eq(msg, FIRST_MSG, "%s", kname(k));
    rc = dispatch_exp(bad, &h4); /* its NULL still answers the first */
    expect_first(dev, rc, h4, "exp(NULL) after a second failure", k);

    /* clearing restores the normal answer to a NULL input */
    dispatch_device_clear_error(dev);
    cr_assert_eq(dispatch_device_error(dev, &msg), 0, "%s", kname(k));
    cr_assert_str_eq(msg, "");
    rc = dispatch_relu(NULL, &h4);
    cr_assert_eq(rc, DISPATCH_EINVAL, "%s: relu(NULL) after clear: %s",
                 kname(k), dispatch_err_name(rc));
    rc = dispatch_mul(b, NULL, &h4);
    cr_assert_eq(rc, DISPATCH_EINVAL, "%s", kname(k));
    cr_assert_str_eq(dispatch_device_errmsg(dev), "mul: input 1 is NULL");
    cr_assert_eq(dispatch_device_error(dev, &msg), DISPATCH_EINVAL);
    cr_assert_str_eq(msg, "mul: input 1 is NULL");
    dispatch_device_clear_error(dev);
    dispatch_tensor *xt, *p;
    OK(dev, dispatch_transpose(x, 0, 1, &xt));
    OK(dev, dispatch_matmul(x, xt, &p)); /* [2,3] @ [3,2] */
    float pv[4];
    OK(dev, dispatch_tensor_read(p, pv, sizeof pv));
    cr_assert_eq(pv[0], 14.0f, "%s: %g", kname(k), pv[0]);
    cr_assert_eq(dispatch_device_error(dev, NULL), 0);
    OK(dev, dispatch_scope_end(dev));
    cr_assert_eq(live(dev), 0, "%s: the scope left tensors", kname(k));
    dispatch_device_close(dev);
  }
}

/* REMOTE learns of a server-side failure at a wait; LOCAL fails at the
 * call. Either way, ops on the failed output then return that error at
 * once, and on REMOTE the server never sees them: its error count does
 * not move and no new deferred error is waiting. */
Test(straight, poisoned_input_fails_without_round_trip, .init = start_server,
     .fini = stop_server) {
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_kind(k);
    float xv[3] = {1, 2, 3};
    int64_t n3 = 3, idx_v[1] = {7}, n1 = 1;
    dispatch_tensor *x, *idx, *bad = NULL, *o1 = NULL, *o2 = NULL;
    OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, &n3, xv,
                                      sizeof xv, &x));
    OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, &n1, idx_v,
                                      sizeof idx_v, &idx));
    /* index 7 of 3: only the kernel can tell (REMOTE: on the server) */
    int rc = dispatch_index_select(x, 0, idx, &bad);
    if (k == 1) {
      cr_assert_eq(rc, 0, "remote queues it: %s", dispatch_err_name(rc));
      rc = dispatch_device_sync(dev);
      cr_assert_eq(dispatch_tensor_status(bad), DISPATCH_EINDEX);
    }
    cr_assert_eq(rc, DISPATCH_EINDEX, "%s: %s", kname(k),
                 dispatch_err_name(rc));
    char first[512];
    snprintf(first, sizeof first, "%s", dispatch_device_errmsg(dev));
    cr_assert(strstr(first, "index"), "%s: %s", kname(k), first);
    dispatch_stats before = DISPATCH_STATS_INIT;
    OK(dev, dispatch_device_stats(dev, &before));

    rc = dispatch_exp(bad, &o1);
    cr_assert_eq(rc, DISPATCH_EINDEX, "exp (%s): got %s: %s", kname(k),
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    cr_assert_null(o1);
    rc = dispatch_add(x, bad, &o2);
    cr_assert_eq(rc, DISPATCH_EINDEX, "add (%s): got %s: %s", kname(k),
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    cr_assert_null(o2);
    cr_assert_str_eq(dispatch_device_errmsg(dev), first, "%s", kname(k));
    if (k == 1) {
      float v[1];
      rc = dispatch_tensor_read(bad, v, sizeof v);
      cr_assert_eq(rc, DISPATCH_EINDEX, "read: got %s: %s",
                   dispatch_err_name(rc), dispatch_device_errmsg(dev));
      cr_assert_str_eq(dispatch_device_errmsg(dev), first);
    }
    dispatch_stats after = DISPATCH_STATS_INIT;
    rc = dispatch_device_stats(dev, &after);
    cr_assert_eq(rc, 0, "%s: stats found a deferred error: %s: %s", kname(k),
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    cr_assert_eq(after.errors, before.errors,
                 "%s: %llu errors before, %llu after: the ops on the "
                 "poisoned input reached the backend", kname(k),
                 (unsigned long long)before.errors,
                 (unsigned long long)after.errors);
    cr_assert_eq(after.ops, before.ops, "%s", kname(k));
    dispatch_device_close(dev);
  }
}

/* A helper that returns a new reference and frees the tensor it got: the
 * same code is right with or without a scope. */
static dispatch_tensor *relu_ref(dispatch_device *dev, dispatch_tensor *x) {
  dispatch_tensor *t;
  OK(dev, dispatch_relu(x, &t));
  dispatch_tensor *mine = dispatch_tensor_ref(t);
  dispatch_tensor_free(t); /* what the call returned */
  return mine;
}

Test(straight, free_what_a_call_returned_with_or_without_scope,
     .init = start_server, .fini = stop_server) {
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_kind(k);
    float xv[2] = {-1, 2};
    for (int scoped = 0; scoped < 2; scoped++) {
      dispatch_tensor *x = mat(dev, 1, 2, xv); /* outside any scope */
      uint64_t base = live(dev);
      if (scoped) OK(dev, dispatch_scope_begin(dev));
      dispatch_tensor *r = relu_ref(dev, x);
      if (scoped) OK(dev, dispatch_scope_end(dev));
      cr_assert_eq(live(dev), base + 1,
                   "%s, %s: %llu tensors, want %llu (the helper's reference "
                   "was dropped by the scope's end)",
                   kname(k), scoped ? "scope" : "no scope",
                   (unsigned long long)live(dev),
                   (unsigned long long)base + 1);
      float rv[2];
      OK(dev, dispatch_tensor_read(r, rv, sizeof rv));
      cr_assert_eq(rv[0], 0.0f);
      cr_assert_eq(rv[1], 2.0f);
      dispatch_tensor_free(r);
      dispatch_tensor_free(x);
      cr_assert_eq(live(dev), base - 1, "%s", kname(k));
    }
    dispatch_device_close(dev);
  }
}

/* REMOTE: a parameter whose creation failed on the server, known to the
 * client after a wait, fails the optimizer step at once: no Step request,
 * no parameter changes on the server. */
Test(straight, step_with_poisoned_parameter_fails_here, .init = start_server,
     .fini = stop_server) {
  dispatch_device *dev = open_kind(1);
  float xv[3] = {1, 2, 3};
  int64_t n3 = 3, n1 = 1, idx_v[1] = {7};
  dispatch_tensor *x, *idx, *bad, *p, *q, *qa, *loss;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, &n3, xv,
                                    sizeof xv, &x));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, &n1, idx_v,
                                    sizeof idx_v, &idx));
  OK(dev, dispatch_index_select(x, 0, idx, &bad)); /* fails on the server */
  OK(dev, dispatch_autodiff(bad, &p));              /* queued: not known */
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(&p, 1, 0.1, 0, 0, &opt));
  cr_assert_eq(dispatch_device_sync(dev), DISPATCH_EINDEX);
  dispatch_device_clear_error(dev);
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, &n3, xv,
                                    sizeof xv, &q));
  OK(dev, dispatch_autodiff(q, &qa));
  OK(dev, dispatch_sum(qa, 0, NULL, 0, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  dispatch_stats before = DISPATCH_STATS_INIT, after = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &before));
  int rc = dispatch_optim_step(opt, g);
  cr_assert_eq(rc, DISPATCH_EINDEX, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "index_select"), "%s",
            dispatch_device_errmsg(dev));
  rc = dispatch_device_stats(dev, &after);
  cr_assert_eq(rc, 0, "the step reached the server: %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(dev));
  cr_assert_eq(after.errors, before.errors);
  dispatch_grads_free(g);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
}
