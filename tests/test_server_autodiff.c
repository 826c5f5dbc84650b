/* dispatch-server integration: track, backward, grad and optimizer steps
 * over the wire give exactly the bytes the in-process engine gives; and
 * the worker pool serves sessions fairly. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void start_default(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}
static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "autodiff-test"), 0);
}

/* The same model on both sides: loss = cross_entropy(relu(x @ w) * 1.5,
 * labels), x [4,3], w [3,5], labels [4]. */
enum { ID_X = 1, ID_W, ID_L, ID_Y, ID_R, ID_S, ID_LOSS, ID_G = 50,
       ID_GX = 60, ID_GW };
static float g_x[12], g_w[15];
static int64_t g_lab[4] = {0, 4, 2, 1};

static void fill_data(void) {
  for (int i = 0; i < 12; i++) g_x[i] = (float)(i % 5) * 0.37f - 0.6f;
  for (int i = 0; i < 15; i++) g_w[i] = (float)((i * 7) % 11) * 0.21f - 0.9f;
}

static dsp_tensor *run(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *a,
                       dsp_tensor *b, const dsp_attrs *at) {
  dsp_tensor *in[2] = {a, b}, *out;
  cr_assert_eq(dsp_op(ctx, op, in, b ? 2 : 1, at, &out), 0, "%s",
               dsp_ctx_errmsg(ctx));
  return out;
}

typedef struct local_model {
  dsp_ctx *ctx;
  dsp_tensor *x, *w, *lab, *loss, *gx, *gw;
  dsp_grads *g;
} local_model;

static void local_forward_backward(local_model *m) {
  fill_data();
  m->ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta mx = {DSP_F32, 2, {4, 3}}, mw = {DSP_F32, 2, {3, 5}},
           ml = {DSP_I64, 1, {4}};
  cr_assert_eq(dsp_tensor_from_data(m->ctx, &mx, g_x, sizeof g_x, &m->x), 0);
  cr_assert_eq(dsp_tensor_from_data(m->ctx, &mw, g_w, sizeof g_w, &m->w), 0);
  cr_assert_eq(dsp_tensor_from_data(m->ctx, &ml, g_lab, sizeof g_lab, &m->lab),
               0);
  cr_assert_eq(dsp_track(m->ctx, m->x), 0);
  cr_assert_eq(dsp_track(m->ctx, m->w), 0);
  dsp_attrs none = dsp_attrs_none(), sc = dsp_attrs_f1(1.5);
  dsp_tensor *y = run(m->ctx, DSP_OP_MATMUL, m->x, m->w, &none);
  dsp_tensor *r = run(m->ctx, DSP_OP_RELU, y, NULL, &none);
  dsp_tensor *s = run(m->ctx, DSP_OP_MUL_SCALAR, r, NULL, &sc);
  m->loss = run(m->ctx, DSP_OP_CROSS_ENTROPY, s, m->lab, &none);
  cr_assert_eq(dsp_backward(m->ctx, m->loss, 0, &m->g), 0, "%s",
               dsp_ctx_errmsg(m->ctx));
  cr_assert_eq(dsp_grads_get(m->ctx, m->g, m->x, &m->gx), 0);
  cr_assert_eq(dsp_grads_get(m->ctx, m->g, m->w, &m->gw), 0);
  dsp_tensor_unref(y);
  dsp_tensor_unref(r);
  dsp_tensor_unref(s);
}

static void local_free(local_model *m) {
  dsp_tensor_unref(m->gx);
  dsp_tensor_unref(m->gw);
  dsp_grads_free(m->g);
  dsp_tensor_unref(m->loss);
  dsp_tensor_unref(m->x);
  dsp_tensor_unref(m->w);
  dsp_tensor_unref(m->lab);
  dsp_ctx_free(m->ctx);
}

/* Sends the same forward pass (pipelined, no replies) and a backward. */
static uint64_t remote_forward_backward(wire_conn *c) {
  fill_data();
  int64_t sx[2] = {4, 3}, sw[2] = {3, 5}, sl[1] = {4};
  wire_upload(c, ID_X, DSP_F32, 2, sx, g_x, sizeof g_x);
  wire_upload(c, ID_W, DSP_F32, 2, sw, g_w, sizeof g_w);
  wire_upload(c, ID_L, DSP_I64, 1, sl, g_lab, sizeof g_lab);
  wire_track(c, ID_X);
  wire_track(c, ID_W);
  uint64_t xw[2] = {ID_X, ID_W}, y[1] = {ID_Y}, r[1] = {ID_R},
           sl2[2] = {ID_S, ID_L};
  double k = 1.5;
  wire_op(c, DSP_OP_MATMUL, xw, 2, ID_Y, NULL, 0, NULL, 0);
  wire_op(c, DSP_OP_RELU, y, 1, ID_R, NULL, 0, NULL, 0);
  wire_op(c, DSP_OP_MUL_SCALAR, r, 1, ID_S, NULL, 0, &k, 1);
  wire_op(c, DSP_OP_CROSS_ENTROPY, sl2, 2, ID_LOSS, NULL, 0, NULL, 0);
  uint64_t rid = wire_backward(c, ID_LOSS, ID_G, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(c, &rep, NULL, NULL), 0);
  cr_assert_eq(rep->req_id, rid);
  cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
  wire_reply_free(rep, NULL);
  wire_grad(c, ID_G, ID_X, ID_GX);
  wire_grad(c, ID_G, ID_W, ID_GW);
  return rid;
}

static void assert_remote_equals(wire_conn *c, uint64_t id,
                                 const dsp_tensor *t) {
  void *got;
  size_t n;
  int nd;
  int64_t sh[8];
  cr_assert_eq(wire_read_tensor(c, id, &got, &n, &nd, sh), 0, "read %llu",
               (unsigned long long)id);
  cr_assert_eq(n, dsp_tensor_nbytes(t));
  cr_assert_eq(nd, t->meta.ndim);
  for (int i = 0; i < nd; i++) cr_assert_eq(sh[i], t->meta.shape[i]);
  cr_assert_eq(memcmp(got, dsp_tensor_data(t), n), 0,
               "id %llu differs from the in-process result",
               (unsigned long long)id);
  free(got);
}

TestSuite(server_autodiff, .init = start_default, .fini = stop_checked);

Test(server_autodiff, backward_over_wire_equals_in_process) {
  local_model m;
  local_forward_backward(&m);
  wire_conn c;
  connect_hello(&c);
  remote_forward_backward(&c);
  assert_remote_equals(&c, ID_LOSS, m.loss);
  assert_remote_equals(&c, ID_GX, m.gx);
  assert_remote_equals(&c, ID_GW, m.gw);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.grads, 1);
  cr_assert_eq(st.errors, 0);
  /* the graph was released: a second backward through it fails */
  uint64_t rid = wire_backward(&c, ID_LOSS, ID_G + 1, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(&c, &rep, NULL, NULL), 0);
  cr_assert_eq(rep->req_id, rid);
  cr_assert_not_null(rep->error);
  cr_assert_eq(rep->error->code, DISPATCH_EGRAPHFREED, "%s",
               rep->error->message);
  cr_assert_eq(rep->error->failed_req_id, rid);
  wire_reply_free(rep, NULL);
  uint64_t gs[1] = {ID_G};
  wire_free(&c, NULL, 0, gs, 1);
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.grads, 0);
  wire_close(&c);
  local_free(&m);
}

/* 1.3: a Backward sent with no_reply gets no reply; when it fails, the
 * failure is the next wait's error (as an op's), its gradients id holds a
 * failed container (a Grad from it fails with DISPATCH_EPOISONED), and a
 * Free of that id succeeds. */
Test(server_autodiff, backward_without_reply_defers_its_failure) {
  local_model m;
  local_forward_backward(&m);
  wire_conn c;
  connect_hello(&c);
  remote_forward_backward(&c);
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_backward(&w, ID_LOSS, ID_G + 1, 0);
  w.body.backward.no_reply = 1;
  req->req_id = 900;
  cr_assert_eq(wire_send(&c, req, NULL, 0), 0); /* the graph was released */
  char msg[700];
  uint64_t failed = 0;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed),
               DISPATCH_EGRAPHFREED, "%s", msg);
  cr_assert_eq(failed, 900);
  wire_grad(&c, ID_G + 1, ID_X, 901);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EPOISONED,
               "%s", msg);
  cr_assert(strstr(msg, "backward that was to make it failed"), "%s", msg);
  uint64_t gs[2] = {ID_G, ID_G + 1};
  wire_free(&c, NULL, 0, gs, 2);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.grads, 0);
  /* one that succeeds answers nothing either (the next reply is the
   * sync's) and its gradients are there */
  int64_t s4[1] = {4};
  static const float v4[4] = {1, 2, 3, 4};
  wire_upload(&c, 200, DSP_F32, 1, s4, v4, sizeof v4);
  wire_track(&c, 200);
  uint64_t in[1] = {200};
  wire_op(&c, DSP_OP_SUM, in, 1, 201, NULL, 0, NULL, 0);
  req = dsp_wreq_backward(&w, 201, 202, 0);
  w.body.backward.no_reply = 1;
  req->req_id = 902;
  cr_assert_eq(wire_send(&c, req, NULL, 0), 0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  wire_grad(&c, 202, 200, 203);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 203, &got, &n, NULL, NULL), 0);
  cr_assert_eq(n, sizeof v4);
  cr_assert_eq(((float *)got)[3], 1.0f);
  free(got);
  wire_close(&c);
  local_free(&m);
}

Test(server_autodiff, track_refuses_a_second_wrap) {
  wire_conn c;
  connect_hello(&c);
  float d[3] = {1, 2, 3};
  int64_t s[1] = {3};
  char msg[700];
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  wire_track(&c, 1);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  wire_track(&c, 1);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL),
               DISPATCH_EDOUBLEWRAP);
  cr_assert(strstr(msg, "autodiff should not wrap an autodiff tensor"), "%s",
            msg);
  uint64_t in[1] = {1};
  wire_op(&c, DSP_OP_NEG, in, 1, 2, NULL, 0, NULL, 0);
  wire_track(&c, 2); /* an op's tracked output */
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL),
               DISPATCH_EDOUBLEWRAP, "%s", msg);
  int64_t li[3] = {1, 2, 3};
  wire_upload(&c, 3, DSP_I64, 1, s, li, sizeof li);
  wire_track(&c, 3);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EDTYPE,
               "%s", msg);
  wire_close(&c);
}

Test(server_autodiff, backward_errors_reply_directly) {
  wire_conn c;
  connect_hello(&c);
  float d[3] = {1, 2, 3};
  int64_t s[1] = {3};
  wire_upload(&c, 1, DSP_F32, 1, s, d, sizeof d);
  struct { uint64_t loss, grads; int code; } cases[] = {
      {1, 10, DISPATCH_ENOTTRACKED}, {77, 10, DISPATCH_ENOID}};
  for (int i = 0; i < 2; i++) {
    uint64_t rid = wire_backward(&c, cases[i].loss, cases[i].grads, 0);
    Dspwire__Reply *rep;
    cr_assert_eq(wire_recv(&c, &rep, NULL, NULL), 0);
    cr_assert_eq(rep->req_id, rid);
    cr_assert_not_null(rep->error);
    cr_assert_eq(rep->error->code, cases[i].code, "%s", rep->error->message);
    wire_reply_free(rep, NULL);
  }
  /* a non-scalar loss */
  wire_track(&c, 1);
  uint64_t in[1] = {1};
  wire_op(&c, DSP_OP_RELU, in, 1, 2, NULL, 0, NULL, 0);
  uint64_t rid = wire_backward(&c, 2, 10, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(&c, &rep, NULL, NULL), 0);
  cr_assert_eq(rep->req_id, rid);
  cr_assert_not_null(rep->error);
  cr_assert_eq(rep->error->code, DISPATCH_ENOTSCALAR, "%s",
               rep->error->message);
  wire_reply_free(rep, NULL);
  wire_close(&c);
}

Test(server_autodiff, sgd_and_adam_steps_equal_in_process) {
  local_model m;
  local_forward_backward(&m);
  wire_conn c;
  connect_hello(&c);
  remote_forward_backward(&c);
  /* SGD with momentum on x and w, velocities zero */
  float zx[12] = {0}, zw[15] = {0};
  int64_t sx[2] = {4, 3}, sw[2] = {3, 5};
  wire_upload(&c, 80, DSP_F32, 2, sx, zx, sizeof zx);
  wire_upload(&c, 81, DSP_F32, 2, sw, zw, sizeof zw);
  uint64_t params[2] = {ID_X, ID_W}, states[2] = {80, 81};
  double fl[3] = {0.1, 0.9, 0.01};
  cr_assert_neq(wire_step(&c, DSP_OP_SGD_STEP, ID_G, params, 2, states, 2,
                          NULL, 0, fl, 3),
                0);
  char msg[700];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);

  dsp_meta mx = {DSP_F32, 2, {4, 3}}, mw = {DSP_F32, 2, {3, 5}};
  dsp_tensor *vx, *vw, *out;
  cr_assert_eq(dsp_tensor_from_data(m.ctx, &mx, zx, sizeof zx, &vx), 0);
  cr_assert_eq(dsp_tensor_from_data(m.ctx, &mw, zw, sizeof zw, &vw), 0);
  dsp_attrs a = dsp_attrs_none();
  a.n_floats = 3;
  for (int i = 0; i < 3; i++) a.floats[i] = fl[i];
  dsp_set_grad_enabled(m.ctx, 0);
  dsp_tensor *ix[3] = {m.x, m.gx, vx}, *iw[3] = {m.w, m.gw, vw};
  cr_assert_eq(dsp_op(m.ctx, DSP_OP_SGD_STEP, ix, 3, &a, &out), 0, "%s",
               dsp_ctx_errmsg(m.ctx));
  dsp_tensor_unref(out);
  cr_assert_eq(dsp_op(m.ctx, DSP_OP_SGD_STEP, iw, 3, &a, &out), 0);
  dsp_tensor_unref(out);
  assert_remote_equals(&c, ID_X, m.x);
  assert_remote_equals(&c, ID_W, m.w);
  assert_remote_equals(&c, 80, vx);

  /* Adam on w alone: states m, v; step t = 1 */
  wire_upload(&c, 90, DSP_F32, 2, sw, zw, sizeof zw);
  wire_upload(&c, 91, DSP_F32, 2, sw, zw, sizeof zw);
  uint64_t p1[1] = {ID_W}, s2[2] = {90, 91};
  double af[4] = {0.01, 0.9, 0.999, 1e-8};
  int64_t ai[1] = {1};
  cr_assert_neq(wire_step(&c, DSP_OP_ADAM_STEP, ID_G, p1, 1, s2, 2, ai, 1,
                          af, 4),
                0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  dsp_tensor *am, *av;
  cr_assert_eq(dsp_tensor_from_data(m.ctx, &mw, zw, sizeof zw, &am), 0);
  cr_assert_eq(dsp_tensor_from_data(m.ctx, &mw, zw, sizeof zw, &av), 0);
  dsp_attrs b = dsp_attrs_ints(1, ai);
  b.n_floats = 4;
  for (int i = 0; i < 4; i++) b.floats[i] = af[i];
  dsp_tensor *ia[4] = {m.w, m.gw, am, av};
  cr_assert_eq(dsp_op(m.ctx, DSP_OP_ADAM_STEP, ia, 4, &b, &out), 0, "%s",
               dsp_ctx_errmsg(m.ctx));
  dsp_tensor_unref(out);
  assert_remote_equals(&c, ID_W, m.w);
  assert_remote_equals(&c, 91, av);

  /* a wrong state count is refused before anything changes */
  uint64_t rid = wire_step(&c, DSP_OP_ADAM_STEP, ID_G, p1, 1, s2, 1, ai, 1,
                           af, 4);
  cr_assert_neq(rid, 0);
  uint64_t failed;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed), DISPATCH_EINVAL,
               "%s", msg);
  cr_assert_eq(failed, rid);
  assert_remote_equals(&c, ID_W, m.w);
  dsp_tensor_unref(vx);
  dsp_tensor_unref(vw);
  dsp_tensor_unref(am);
  dsp_tensor_unref(av);
  wire_close(&c);
  local_free(&m);
}

/* ------------------------------------------------------------ fairness */

static void start_one_thread(void) {
  const char *args[] = {"--log-level", "error", "--threads", "1", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

TestSuite(server_fairness, .init = start_one_thread, .fini = stop_checked);

/* With one worker, a read of session B runs after at most the op of A
 * that is running (sessions take turns), so when B's stats reply arrives
 * most of A's long queue of matmuls is still waiting. No clocks involved:
 * the order of completion is what is checked. */
Test(server_fairness, long_queue_does_not_starve_other_session) {
  wire_conn a, b;
  connect_hello(&a);
  connect_hello(&b);
  Dspwire__StatsReply base, st;
  cr_assert_eq(wire_get_stats(&b, &base), 0);
  enum { N = 256, OPS = 30 };
  float *d = calloc(N * N, sizeof *d);
  for (int i = 0; i < N * N; i++) d[i] = (float)(i % 13) * 0.01f;
  int64_t s[2] = {N, N};
  wire_upload(&a, 1, DSP_F32, 2, s, d, (size_t)N * N * 4);
  /* A's input is in before anything else: otherwise B's small upload can
   * overtake A's 256 KiB one and the count below underflows */
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  uint64_t in[2] = {1, 1};
  for (int i = 0; i < OPS; i++)
    wire_op(&a, DSP_OP_MATMUL, in, 2, 100 + (uint64_t)i, NULL, 0, NULL, 0);
  /* queued behind all of A's matmuls: answered last */
  uint64_t rid = wire_read(&a, 100);
  float one[1] = {42};
  int64_t s1[1] = {1};
  wire_upload(&b, 7, DSP_F32, 1, s1, one, 4);
  void *got;
  size_t n;
  cr_assert_eq(wire_read_tensor(&b, 7, &got, &n, NULL, NULL), 0);
  cr_assert_eq(*(float *)got, 42.0f);
  free(got);
  cr_assert_eq(wire_get_stats(&b, &st), 0);
  /* A holds its input plus the matmuls done so far; B holds one */
  cr_assert_geq(st.server_tensors, base.server_tensors + 2);
  uint64_t a_done = st.server_tensors - base.server_tensors - 2;
  cr_assert_lt(a_done, OPS, "session B waited for all %d of A's ops", OPS);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&a, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_null(r->error);
  wire_reply_free(r, bulk);
  cr_assert_eq(wire_sync_check(&a, NULL, 0, NULL), 0);
  free(d);
  wire_close(&a);
  wire_close(&b);
}
