/* Errors where they happen, and threads (issue 21 item 11).
 *
 * Sync mode (dispatch_options.sync, env DISPATCH_SYNC=1): a REMOTE error
 * only the server can find (an index out of range: the client infers
 * shapes, not values) is returned by the op call that caused it, naming
 * the op, with *out NULL, as on LOCAL; without sync mode it surfaces at the
 * next wait. dispatch_grad of a non-leaf fails at the call on REMOTE as on
 * LOCAL, with the same code and message, sync mode or not.
 *
 * Threads: a call entered from a second thread while a call on the same
 * device is in flight fails at once with DISPATCH_EBUSY (REMOTE and LOCAL)
 * and the device stays usable. The first thread is held inside its call
 * deterministically: an allocator that blocks the first allocation made by
 * an armed thread until the test lets it go (no timing anywhere).
 * Needs DISPATCH_SERVER_BIN. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;

static void start_server(void) { check_server_start(&g_srv, NULL); }

static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  unsetenv("DISPATCH_SYNC");
}

static dispatch_device *open_spec(const char *spec, int sync_opt) {
  char msg[256] = "";
  dispatch_options o;
  dispatch_options_init(&o);
  o.sync = sync_opt;
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

static dispatch_device *open_remote(int sync_opt) {
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  return open_spec(spec, sync_opt);
}

/* x = [1 2 3], idx = [0 7]: index_select(x, 0, idx) passes the client's
 * shape inference and fails on the server with DISPATCH_EINDEX. */
static void bad_gather(dispatch_device *dev, int *rc_op,
                       dispatch_tensor **out) {
  float xv[3] = {1, 2, 3};
  int64_t iv[2] = {0, 7}, xs[1] = {3}, is[1] = {2};
  dispatch_tensor *x, *idx;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, xs, xv, sizeof xv,
                                    &x));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, is, iv, sizeof iv,
                                    &idx));
  *rc_op = dispatch_index_select(x, 0, idx, out);
}

/* ------------------------------------------------------------------ */
/* sync mode                                                           */

TestSuite(sync_mode, .init = start_server, .fini = stop_server,
          .timeout = 60);

/* On a sync-mode device: the bad gather's own call returns the server's
 * error, naming the op, and nothing is left for the next wait (the
 * handle's Free took the poisoned id off the server). */
static void error_at_the_call(dispatch_device *dev) {
  dispatch_tensor *y = (dispatch_tensor *)&y;
  int rc;
  bad_gather(dev, &rc, &y);
  cr_assert_eq(rc, DISPATCH_EINDEX, "index_select gave %s (%s); want "
               "DISPATCH_EINDEX at the call", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert_null(y, "a failed call leaves *out NULL, as on LOCAL");
  cr_assert(strstr(dispatch_device_errmsg(dev), "index_select"),
            "the message names the op: %s", dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_device_error(dev, NULL), DISPATCH_EINDEX);
  OK(dev, dispatch_device_sync(dev));
  dispatch_device_close(dev);
}

/* DISPATCH_SYNC=1, read at open. */
Test(sync_mode, env_makes_the_op_call_return_the_server_error) {
  setenv("DISPATCH_SYNC", "1", 1);
  dispatch_device *dev = open_remote(0);
  unsetenv("DISPATCH_SYNC");
  error_at_the_call(dev);
}

/* The option field does the same without the environment. */
Test(sync_mode, option_makes_the_op_call_return_the_server_error) {
  error_at_the_call(open_remote(1));
}

/* Without sync mode the op is queued and the error is the next wait's. */
Test(sync_mode, without_it_the_error_waits_for_a_wait) {
  dispatch_device *dev = open_remote(0);
  dispatch_tensor *y;
  int rc;
  bad_gather(dev, &rc, &y);
  cr_assert_eq(rc, 0, "queued: %s", dispatch_err_name(rc));
  cr_assert_not_null(y);
  rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_EINDEX, "sync gave %s", dispatch_err_name(rc));
  cr_assert_eq(dispatch_tensor_status(y), DISPATCH_EINDEX);
  dispatch_device_close(dev);
}

/* Backward and a step whose errors only the server finds (a second
 * backward through a released tape; a step over a parameter the backward
 * did not reach): in sync mode each is the call's own error, as on LOCAL. */
static void backward_step_errors(dispatch_device *dev, int *rc_bw,
                                 int *rc_step) {
  int64_t s[1] = {2};
  float v[2] = {1, 2};
  dispatch_tensor *w1, *w2, *l;
  dispatch_grads *g, *g2 = (dispatch_grads *)&g2;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s, v, sizeof v,
                                    &w1));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s, v, sizeof v,
                                    &w2));
  OK(dev, dispatch_autodiff(w1, &w1));
  OK(dev, dispatch_autodiff(w2, &w2));
  OK(dev, dispatch_sum(w1, 0, NULL, 0, &l)); /* w2 is not reached */
  OK(dev, dispatch_backward(l, &g));
  *rc_bw = dispatch_backward(l, &g2); /* the tape was released */
  cr_assert_null(g2);
  dispatch_tensor *params[2] = {w1, w2};
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(params, 2, 0.5, 0, 0, &opt));
  *rc_step = dispatch_optim_step(opt, g);
  float r[2];
  OK(dev, dispatch_tensor_read(w1, r, sizeof r));
  cr_assert(r[0] == 1 && r[1] == 2, "a failed step changed w1: %g %g", r[0],
            r[1]);
  OK(dev, dispatch_device_sync(dev)); /* nothing is left over */
  dispatch_optim_free(opt);
  dispatch_grads_free(g);
}

Test(sync_mode, backward_and_step_errors_come_at_the_call) {
  int lbw, lstep, rbw, rstep;
  dispatch_device *loc = open_spec("local", 0);
  backward_step_errors(loc, &lbw, &lstep);
  dispatch_device_close(loc);
  dispatch_device *rem = open_remote(1);
  backward_step_errors(rem, &rbw, &rstep);
  dispatch_device_close(rem);
  cr_assert_eq(lbw, DISPATCH_EGRAPHFREED, "local: %s", dispatch_err_name(lbw));
  cr_assert_eq(lstep, DISPATCH_ENOGRAD, "local: %s", dispatch_err_name(lstep));
  cr_assert_eq(rbw, lbw, "sync-mode backward gave %s at the call, local %s",
               dispatch_err_name(rbw), dispatch_err_name(lbw));
  cr_assert_eq(rstep, lstep, "sync-mode step gave %s at the call, local %s",
               dispatch_err_name(rstep), dispatch_err_name(lstep));
}

/* ------------------------------------------------------------------ */
/* grads[h] of a non-leaf                                              */

static void nonleaf_grad(dispatch_device *dev, int *rc, char *msg,
                         size_t len) {
  int64_t s[1] = {3};
  float v[3] = {1, -2, 3};
  dispatch_tensor *x, *h, *l, *g = (dispatch_tensor *)&g;
  dispatch_grads *gr;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s, v, sizeof v, &x));
  OK(dev, dispatch_autodiff(x, &x));
  OK(dev, dispatch_mul_scalar(x, 2.0, &h));
  OK(dev, dispatch_sum(h, 0, NULL, 0, &l));
  OK(dev, dispatch_backward(l, &gr));
  *rc = dispatch_grad(gr, h, &g);
  cr_assert_null(g, "a failed grad leaves *out NULL");
  snprintf(msg, len, "%s", dispatch_device_errmsg(dev));
  /* the leaf's gradient is still there, and nothing is deferred */
  OK(dev, dispatch_grad(gr, x, &g));
  float r[3];
  OK(dev, dispatch_tensor_read(g, r, sizeof r));
  cr_assert(r[0] == 2 && r[1] == 2 && r[2] == 2);
  OK(dev, dispatch_device_sync(dev));
}

Test(sync_mode, grad_of_a_non_leaf_fails_at_the_call_as_on_local) {
  char lmsg[512], rmsg[512];
  int lrc, rrc;
  dispatch_device *loc = open_spec("local", 0);
  nonleaf_grad(loc, &lrc, lmsg, sizeof lmsg);
  dispatch_device_close(loc);
  dispatch_device *rem = open_remote(0); /* not sync mode: always */
  nonleaf_grad(rem, &rrc, rmsg, sizeof rmsg);
  dispatch_device_close(rem);
  cr_assert_eq(lrc, DISPATCH_ENOGRAD, "local: %s", dispatch_err_name(lrc));
  cr_assert_eq(rrc, lrc, "remote grad(non-leaf) gave %s at the call, local "
               "%s", dispatch_err_name(rrc), dispatch_err_name(lrc));
  cr_assert_str_eq(rmsg, lmsg);
}

/* ------------------------------------------------------------------ */
/* two threads on one device                                           */

/* The first allocation of an armed thread blocks until released. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static int g_inside, g_go;
static _Thread_local int t_armed;

static void *hold_malloc(size_t n, void *ud) {
  (void)ud;
  if (t_armed) {
    t_armed = 0;
    pthread_mutex_lock(&g_mu);
    g_inside = 1;
    pthread_cond_broadcast(&g_cv);
    while (!g_go) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
  }
  return malloc(n);
}
static void *hold_realloc(void *p, size_t n, void *ud) {
  (void)ud;
  return realloc(p, n);
}
static void hold_free(void *p, void *ud) {
  (void)ud;
  free(p);
}

typedef struct held {
  dispatch_device *dev;
  dispatch_tensor *t;
  int rc;
} held;

/* Thread A, held at its first allocation inside the call. REMOTE: a read,
 * held inside its wait for the reply (the reply's message buffer), where a
 * second thread's request would take its reply; LOCAL: an op (its result's
 * storage). */
static void *reader(void *arg) {
  held *h = arg;
  float r[4];
  t_armed = 1;
  if (dispatch_device_kind(h->dev) == DISPATCH_KIND_REMOTE) {
    h->rc = dispatch_tensor_read(h->t, r, sizeof r);
  } else {
    dispatch_tensor *e;
    h->rc = dispatch_exp(h->t, &e);
    dispatch_tensor_free(e);
  }
  return NULL;
}

/* Starts thread A on h and returns once it is held inside its call. */
static pthread_t hold_start(held *h) {
  g_inside = g_go = 0;
  dsp_allocator a = {hold_malloc, hold_realloc, hold_free, NULL};
  dsp_set_allocator(&a);
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, reader, h), 0);
  pthread_mutex_lock(&g_mu);
  while (!g_inside) pthread_cond_wait(&g_cv, &g_mu);
  pthread_mutex_unlock(&g_mu);
  return th;
}

/* Lets thread A finish its call and waits for it. */
static void hold_release(pthread_t th) {
  pthread_mutex_lock(&g_mu);
  g_go = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  pthread_join(th, NULL);
  dsp_set_allocator(NULL);
}

static void second_thread_gets_ebusy(dispatch_device *dev) {
  int64_t s[1] = {4};
  dispatch_tensor *t, *u = NULL;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &t));
  OK(dev, dispatch_device_sync(dev));
  held h = {dev, t, 1};
  pthread_t th = hold_start(&h);
  /* thread A is inside dispatch_tensor_read: every call here is refused
   * at once and touches nothing */
  int rc_op = dispatch_ones(dev, DISPATCH_F32, 1, s, &u);
  int rc_sync = dispatch_device_sync(dev);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", dispatch_device_errmsg(dev));
  int code = dispatch_device_errcode(dev);
  hold_release(th);
  cr_assert_eq(rc_op, DISPATCH_EBUSY, "op from a second thread gave %s; "
               "want DISPATCH_EBUSY at once", dispatch_err_name(rc_op));
  cr_assert_null(u);
  cr_assert_eq(rc_sync, DISPATCH_EBUSY, "sync from a second thread: %s",
               dispatch_err_name(rc_sync));
  cr_assert_eq(code, DISPATCH_EBUSY);
  cr_assert(strstr(msg, "another thread"), "message: %s", msg);
  /* thread A's call was not disturbed, and the device is free again */
  cr_assert_eq(h.rc, 0, "the first thread's read: %s",
               dispatch_err_name(h.rc));
  cr_assert_eq(dispatch_device_error(dev, NULL), 0,
               "the refusal is not the device's error");
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &u));
  OK(dev, dispatch_device_sync(dev));
  dispatch_tensor_free(u);
  dispatch_tensor_free(t);
}

TestSuite(threads, .init = start_server, .fini = stop_server, .timeout = 60);

Test(threads, remote_device_from_a_second_thread_is_ebusy_at_once) {
  dispatch_device *dev = open_remote(0);
  second_thread_gets_ebusy(dev);
  dispatch_device_close(dev);
}

Test(threads, local_device_from_a_second_thread_is_ebusy_at_once) {
  dispatch_device *dev = open_spec("local", 0);
  second_thread_gets_ebusy(dev);
  dispatch_device_close(dev);
}

/* A peer shares its device's connection: it is refused too. */
Test(threads, a_peer_of_a_busy_device_is_ebusy) {
  dispatch_device *dev = open_remote(0), *peer;
  OK(dev, dispatch_device_open_peer(dev, "cpu", &peer));
  int64_t s[1] = {4};
  dispatch_tensor *t, *u = NULL;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &t));
  held h = {dev, t, 1};
  pthread_t th = hold_start(&h);
  int rc = dispatch_zeros(peer, DISPATCH_F32, 1, s, &u);
  hold_release(th);
  cr_assert_eq(rc, DISPATCH_EBUSY, "peer: %s", dispatch_err_name(rc));
  cr_assert_eq(h.rc, 0);
  OK(peer, dispatch_zeros(peer, DISPATCH_F32, 1, s, &u));
  OK(peer, dispatch_device_sync(peer));
  dispatch_device_close(peer);
  dispatch_device_close(dev);
}
