/* dispatch-server integration: a worker runs a session's queued requests as
 * one batch (issue 11 item 1). Pipelined requests must take fewer worker
 * turns than there are requests, and batching must keep the deferred-error
 * rules: the first failure in a long pipelined chain is the one reported,
 * exactly the ops that depend on it are poisoned, and the rest run. */
#include <criterion/criterion.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void start(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2",
                        "--max-session-bytes", "67108864", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

TestSuite(batch, .init = start, .fini = stop_checked);

static const float k_one[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                1, 1, 1, 1, 1, 1, 1, 1};

/* N dependent adds sent back to back, then Stats: the session's worker
 * turns ("batches") must be fewer than its requests. The old pool took one
 * request per turn, so it reported one batch per request. */
Test(batch, pipelined_ops_take_fewer_turns_than_ops) {
  enum { N = 1000 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "batch"), 0);
  int64_t s16[1] = {16};
  cr_assert_neq(wire_upload(&c, 1, DSP_F32, 1, s16, k_one, sizeof k_one), 0);
  for (uint64_t i = 0; i < N; i++) {
    uint64_t in[2] = {i + 1, 1}; /* x_{i+1} = x_i + 1 */
    cr_assert_neq(wire_op(&c, DSP_OP_ADD, in, 2, i + 2, NULL, 0, NULL, 0), 0);
  }
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, N + 1, &got, &n, NULL, NULL), 0);
  cr_assert_eq(n, sizeof k_one);
  cr_assert_eq(((float *)got)[15], (float)(N + 1));
  free(got);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, N);
  /* upload + N ops + read: N + 2 requests ran on a worker */
  cr_assert_gt(st.batches, 0, "no batches counted");
  cr_assert_lt(st.batches, N + 2,
               "%llu worker turns for %d pipelined requests: one per request",
               (unsigned long long)st.batches, N + 2);
  cr_log_info("%d pipelined requests ran in %llu worker turns", N + 2,
              (unsigned long long)st.batches);
  wire_close(&c);
}

/* A pipelined chain x_{i+1} = x_i + 1 of N adds, with an independent op
 * after every link (y_i = one + one) and a failing op (a matmul of
 * mismatched shapes) in place of link K: the wait reports that failure and
 * no other, links K..N are poisoned naming it, links before K and every
 * y_i hold their values, and the session goes on. */
Test(batch, chain_error_poisons_exactly_its_dependents) {
  enum { N = 300, K = 150, Y = 100000 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "batch"), 0);
  int64_t s16[1] = {16}, s23[2] = {2, 3};
  static const float d6[6] = {1, 2, 3, 4, 5, 6};
  wire_upload(&c, 1, DSP_F32, 1, s16, k_one, sizeof k_one);
  wire_upload(&c, 2, DSP_F32, 2, s23, d6, sizeof d6);
  uint64_t bad = 0;
  for (uint64_t i = 1; i <= N; i++) { /* x_i has id 10 + i */
    uint64_t prev = i == 1 ? 1 : 10 + i - 1;
    if (i == K) {
      uint64_t mm[2] = {2, 2}; /* [2,3] @ [2,3]: shape error */
      bad = wire_op(&c, DSP_OP_MATMUL, mm, 2, 10 + i, NULL, 0, NULL, 0);
    } else {
      uint64_t in[2] = {prev, 1};
      wire_op(&c, DSP_OP_ADD, in, 2, 10 + i, NULL, 0, NULL, 0);
    }
    uint64_t ind[2] = {1, 1};
    wire_op(&c, DSP_OP_ADD, ind, 2, Y + i, NULL, 0, NULL, 0);
  }
  cr_assert_neq(bad, 0);
  char msg[700];
  uint64_t failed = 0;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed), DISPATCH_ESHAPE,
               "%s", msg);
  cr_assert_eq(failed, bad, "reported request %llu, the failure was %llu",
               (unsigned long long)failed, (unsigned long long)bad);
  cr_assert(strstr(msg, "matmul"), "%s", msg);
  /* the poisoned links were deferred failures too, but only the first is
   * reported: the next wait is clean */
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);

  void *got;
  size_t n;
  /* before the failure: x_i = 1 + i */
  for (uint64_t i = 1; i < K; i++) {
    cr_assert_eq(wire_read_tensor(&c, 10 + i, &got, &n, NULL, NULL), 0,
                 "link %llu before the failure", (unsigned long long)i);
    cr_assert_eq(((float *)got)[0], (float)(1 + i));
    free(got);
  }
  /* the failed link and every later one: poisoned, naming the failure */
  for (uint64_t i = K; i <= N; i++) {
    uint64_t rid = wire_read(&c, 10 + i);
    Dspwire__Reply *r;
    cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
    cr_assert_eq(r->req_id, rid);
    cr_assert_not_null(r->error, "link %llu is not poisoned",
                       (unsigned long long)i);
    cr_assert_eq(r->error->code, DISPATCH_EPOISONED, "link %llu: %s",
                 (unsigned long long)i, r->error->message);
    /* the failed link names the failure; each later one the link it
     * depends on, which names its own cause in turn */
    char cause[64];
    if (i == K) snprintf(cause, sizeof cause, "inner dims 3 and 2 differ");
    else snprintf(cause, sizeof cause, "input 0 id %llu is poisoned",
                  (unsigned long long)(10 + i - 1));
    cr_assert(strstr(r->error->message, cause), "link %llu: %s",
              (unsigned long long)i, r->error->message);
    wire_reply_free(r, NULL);
  }
  /* the independent ops all ran */
  for (uint64_t i = 1; i <= N; i++) {
    cr_assert_eq(wire_read_tensor(&c, Y + i, &got, &n, NULL, NULL), 0,
                 "independent op %llu", (unsigned long long)i);
    cr_assert_eq(((float *)got)[7], 2.0f);
    free(got);
  }
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, (uint64_t)(N - 1 - (N - K)) + N,
               "ops %llu", (unsigned long long)st.ops);
  /* the session goes on */
  uint64_t in[2] = {1, 1};
  wire_op(&c, DSP_OP_ADD, in, 2, 5, NULL, 0, NULL, 0);
  cr_assert_eq(wire_read_tensor(&c, 5, &got, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)got)[0], 2.0f);
  free(got);
  wire_close(&c);
}

/* Sends a Step and returns the error message of the sync after it. */
static int step_error(wire_conn *c, int op, const uint64_t *params, int n_p,
                      const uint64_t *states, int n_s, const double *fl,
                      int n_fl, char *msg, size_t len) {
  cr_assert_neq(wire_step(c, op, 50, params, n_p, states, n_s, NULL, 0, fl,
                          n_fl),
                0);
  return wire_sync_check(c, msg, len, NULL);
}

/* The error labels are built only when a lookup fails (issue 11 item 3):
 * they must still name the op and input, the step's param and state, as
 * they did when every op formatted them up front. */
Test(batch, lazy_labels_name_the_failing_id) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "labels"), 0);
  int64_t s16[1] = {16};
  wire_upload(&c, 1, DSP_F32, 1, s16, k_one, sizeof k_one);
  uint64_t in[2] = {1, 999};
  wire_op(&c, DSP_OP_ADD, in, 2, 2, NULL, 0, NULL, 0);
  char msg[700];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_ENOID);
  cr_assert(strstr(msg, "add: input 1 id 999 does not exist"), "%s", msg);

  wire_track(&c, 1);
  uint64_t one[1] = {1};
  wire_op(&c, DSP_OP_SUM, one, 1, 3, NULL, 0, NULL, 0);
  uint64_t rid = wire_backward(&c, 3, 50, 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  wire_reply_free(r, NULL);

  double fl[3] = {0.1, 0.9, 0.0};
  uint64_t params[2] = {1, 777}, states[2] = {4, 4};
  int64_t s16b[1] = {16};
  static const float z[16] = {0};
  wire_upload(&c, 4, DSP_F32, 1, s16b, z, sizeof z);
  cr_assert_eq(step_error(&c, DSP_OP_SGD_STEP, params, 2, states, 2, fl, 3,
                          msg, sizeof msg),
               DISPATCH_ENOID);
  cr_assert(strstr(msg, ": param 1 id 777 does not exist"), "%s", msg);
  uint64_t p1[1] = {1}, s1[1] = {888};
  cr_assert_eq(step_error(&c, DSP_OP_SGD_STEP, p1, 1, s1, 1, fl, 3, msg,
                          sizeof msg),
               DISPATCH_ENOID);
  cr_assert(strstr(msg, ": state 0 of param 0 id 888 does not exist"), "%s",
            msg);
  wire_close(&c);
}

/* A client that pipelines a long chain and disconnects mid-batch: the
 * worker sees the cancel flag between jobs, hands the rest back unrun and
 * still runs the teardown, so the server ends up holding what it held
 * before the session (checked from another session, bounded wait). */
Test(batch, disconnect_mid_batch_releases_everything) {
  wire_conn watch, a;
  cr_assert_eq(wire_connect(&watch, g_srv.port), 0);
  cr_assert_eq(wire_hello(&watch, "watch"), 0);
  Dspwire__StatsReply base, st;
  cr_assert_eq(wire_get_stats(&watch, &base), 0);
  cr_assert_eq(wire_connect(&a, g_srv.port), 0);
  cr_assert_eq(wire_hello(&a, "gone"), 0);
  int64_t s16[1] = {16};
  wire_upload(&a, 1, DSP_F32, 1, s16, k_one, sizeof k_one);
  for (uint64_t i = 0; i < 3000; i++) {
    uint64_t in[2] = {i + 1, 1};
    wire_op(&a, DSP_OP_ADD, in, 2, i + 2, NULL, 0, NULL, 0);
  }
  wire_close(&a);
  int back = 0;
  for (int i = 0; i < 2000 && !back; i++) {
    cr_assert_eq(wire_get_stats(&watch, &st), 0);
    back = st.sessions == base.sessions &&
           st.server_tensors == base.server_tensors &&
           st.server_held_bytes == base.server_held_bytes;
    if (!back) poll(NULL, 0, 5);
  }
  cr_assert(back, "server still holds %llu tensors, %llu bytes",
            (unsigned long long)st.server_tensors,
            (unsigned long long)st.server_held_bytes);
  wire_close(&watch);
}

/* One training step through the library (two products, relu,
 * cross-entropy, a backward and an SGD step, then reading the loss) goes
 * out as one socket write, and must cost the server one hand-off each
 * way: the network thread hands all its requests to the workers at once,
 * and the worker hands them back once, with the reply, although the step
 * took several turns (each product and the backward and the step end
 * one). Handing each request over as it was decoded woke a worker for a
 * Free alone and again for the rest; handing back at every turn's end
 * woke the network thread three times for nothing. */
Test(batch, a_training_step_costs_one_handoff_each_way) {
  char spec[64], err[256];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  cr_assert_eq(dispatch_device_open(spec, NULL, &dev, err, sizeof err), 0,
               "open %s: %s", spec, err);
  int64_t xs[2] = {64, 256}, w1s[2] = {256, 256}, w2s[2] = {256, 16},
          ys[1] = {64};
  int64_t labels[64];
  for (int i = 0; i < 64; i++) labels[i] = (i * 7) % 16;
  dispatch_tensor *x = NULL, *y = NULL, *p[2] = {NULL, NULL};
  cr_assert_eq(dispatch_normal(dev, DISPATCH_F32, 2, xs, 0, 1, 1, &x), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ys, labels,
                                         sizeof labels, &y), 0);
  const int64_t *ws[2] = {w1s, w2s};
  for (int i = 0; i < 2; i++) {
    dispatch_tensor *t = NULL;
    cr_assert_eq(dispatch_normal(dev, DISPATCH_F32, 2, ws[i], 0, 0.05,
                                 2 + (uint64_t)i, &t), 0);
    cr_assert_eq(dispatch_autodiff(t, &p[i]), 0);
    dispatch_tensor_free(t);
  }
  dispatch_optim *opt = NULL;
  cr_assert_eq(dispatch_sgd_new(p, 2, 0.1, 0, 0, &opt), 0);
  for (int step = 0; step < 3; step++) {
    cr_assert_eq(dispatch_device_sync(dev), 0);
    dispatch_stats s1 = DISPATCH_STATS_INIT, s2 = DISPATCH_STATS_INIT;
    cr_assert_eq(dispatch_device_stats(dev, &s1), 0);
    cr_assert_eq(dispatch_scope_begin(dev), 0);
    dispatch_tensor *h = NULL, *r = NULL, *l = NULL, *loss = NULL;
    dispatch_grads *g = NULL;
    cr_assert_eq(dispatch_matmul(x, p[0], &h), 0);
    cr_assert_eq(dispatch_relu(h, &r), 0);
    cr_assert_eq(dispatch_matmul(r, p[1], &l), 0);
    cr_assert_eq(dispatch_cross_entropy(l, y, &loss), 0);
    cr_assert_eq(dispatch_backward(loss, &g), 0);
    cr_assert_eq(dispatch_optim_step(opt, g), 0);
    float lv = 0;
    cr_assert_eq(dispatch_tensor_read(loss, &lv, sizeof lv), 0);
    cr_assert(isfinite(lv) && lv > 0, "loss %g", (double)lv);
    /* before the scope's frees: nothing else is queued */
    cr_assert_eq(dispatch_device_stats(dev, &s2), 0);
    dispatch_grads_free(g);
    cr_assert_eq(dispatch_scope_end(dev), 0);
    cr_assert_geq(s2.batches - s1.batches, 3,
                  "step %d: %llu worker turns; the step should take several",
                  step, (unsigned long long)(s2.batches - s1.batches));
    cr_assert_eq(s2.handoffs - s1.handoffs, 1,
                 "step %d: %llu hand-offs to the workers for one write",
                 step, (unsigned long long)(s2.handoffs - s1.handoffs));
    cr_assert_eq(s2.returns - s1.returns, 1,
                 "step %d: %llu hand-offs back for one reply", step,
                 (unsigned long long)(s2.returns - s1.returns));
  }
  dispatch_optim_free(opt);
  for (int i = 0; i < 2; i++) dispatch_tensor_free(p[i]);
  dispatch_tensor_free(x);
  dispatch_tensor_free(y);
  dispatch_device_close(dev);
}
