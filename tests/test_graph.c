/* Graph capture and replay (issue 11 item 5), on LOCAL and on a real
 * dispatch-server: a captured MLP training step (forward, loss, backward,
 * SGD step) replayed N times leaves the parameters bit-identical to the
 * same N+1 steps run op by op, on both kinds, and REMOTE replays equal
 * LOCAL ones; a wrong input shape is refused and the device goes on; an
 * error inside a replay names the op; hostile GraphDefine / GraphReplay
 * frames get errors, never a crash. Needs DISPATCH_SERVER_BIN. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void start_server(const char *const *args) {
  check_server_start(&g_srv, args);
}

static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_dev(int remote) {
  return check_open(&g_srv, remote);
}

/* ------------------------------------------------------------------ */
/* a small MLP: 12 -> 16 (relu) -> 4, batch 8, cross-entropy, SGD       */

#define B 8
#define IN 12
#define HID 16
#define OUT 4
#define STEPS 6 /* the captured step, then STEPS-1 replays */

typedef struct model {
  dispatch_device *dev;
  dispatch_tensor *p[4]; /* AUTODIFF W1 b1 W2 b2 */
  dispatch_optim *opt;
} model;

/* the optimizer of the models made next: 0 sgd, 1 adam, 2 adamw with
 * per-parameter decay and a global-norm clip */
static int g_adam;

static void model_init(model *m, dispatch_device *dev) {
  m->dev = dev;
  const int64_t s[4][2] = {{IN, HID}, {HID, 0}, {HID, OUT}, {OUT, 0}};
  for (int i = 0; i < 4; i++) {
    dispatch_tensor *t;
    cr_assert_eq(dispatch_normal(dev, DISPATCH_F32, s[i][1] ? 2 : 1, s[i],
                                 0.0, 0.5, 100 + (uint64_t)i, &t),
                 0);
    cr_assert_eq(dispatch_autodiff(t, &m->p[i]), 0);
    dispatch_keep(m->p[i]);
    dispatch_tensor_free(t);
  }
  static const double wd[4] = {0.1, 0, 0.1, 0};
  if (g_adam == 2) {
    cr_assert_eq(dispatch_adamw_new(m->p, 4, 0.01, 0.9, 0.95, 1e-8, wd,
                                    &m->opt), 0);
    cr_assert_eq(dispatch_optim_set_clip(m->opt, 0.05), 0);
  } else if (g_adam)
    cr_assert_eq(dispatch_adam_new(m->p, 4, 0.01, 0.9, 0.999, 1e-8, &m->opt),
                 0);
  else
    cr_assert_eq(dispatch_sgd_new(m->p, 4, 0.1, 0.9, 0.0, &m->opt), 0);
}

static void model_free(model *m) {
  dispatch_optim_free(m->opt);
  for (int i = 0; i < 4; i++) dispatch_tensor_free(m->p[i]);
}

static void batch(int k, float *x, int64_t *y) {
  for (int i = 0; i < B * IN; i++)
    x[i] = (float)(((i * 37 + k * 101) % 23) - 11) / 7.0f;
  for (int i = 0; i < B; i++) y[i] = (i + k) % OUT;
}

/* One training step; with `capture` the loss is named as the graph's
 * output. */
static void step(model *m, int k, int capture) {
  dispatch_device *dev = m->dev;
  float x[B * IN];
  int64_t y[B];
  batch(k, x, y);
  cr_assert_eq(dispatch_scope_begin(dev), 0);
  dispatch_tensor *X, *Y, *h0, *h1, *h2, *o0, *o1, *loss;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2,
                                         (int64_t[]){B, IN}, x, sizeof x, &X),
               0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_I64, 1, (int64_t[]){B},
                                         y, sizeof y, &Y),
               0);
  cr_assert_eq(dispatch_matmul(X, m->p[0], &h0), 0);
  cr_assert_eq(dispatch_add(h0, m->p[1], &h1), 0);
  cr_assert_eq(dispatch_relu(h1, &h2), 0);
  cr_assert_eq(dispatch_matmul(h2, m->p[2], &o0), 0);
  cr_assert_eq(dispatch_add(o0, m->p[3], &o1), 0);
  cr_assert_eq(dispatch_cross_entropy(o1, Y, &loss), 0);
  if (capture) cr_assert_eq(dispatch_graph_output(loss), 0);
  dispatch_grads *g;
  cr_assert_eq(dispatch_backward(loss, &g), 0, "%s",
               dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_optim_step(m->opt, g), 0);
  dispatch_grads_free(g);
  cr_assert_eq(dispatch_scope_end(dev), 0);
}

static void replay(model *m, dispatch_graph *gr, int k, float *loss) {
  float x[B * IN];
  int64_t y[B];
  batch(k, x, y);
  dispatch_graph_io in[2] = {
      {DISPATCH_F32, 2, (int64_t[]){B, IN}, x, sizeof x},
      {DISPATCH_I64, 1, (int64_t[]){B}, y, sizeof y}};
  dispatch_graph_io out[1] = {{DISPATCH_F32, 0, NULL, loss, sizeof *loss}};
  int rc = dispatch_graph_replay(gr, in, 2, out, 1);
  cr_assert_eq(rc, 0, "replay %d: %s (%s)", k, dispatch_device_errmsg(m->dev),
               dispatch_err_name(rc));
}

#define PBYTES ((IN * HID + HID + HID * OUT + OUT) * 4)

static void read_params(model *m, unsigned char *buf) {
  size_t off = 0;
  for (int i = 0; i < 4; i++) {
    size_t n = dispatch_tensor_nbytes(m->p[i]);
    cr_assert_eq(dispatch_tensor_read(m->p[i], buf + off, n), 0, "%s",
                 dispatch_device_errmsg(m->dev));
    off += n;
  }
  cr_assert_eq(off, (size_t)PBYTES);
}

/* The parameters after STEPS op-by-op steps and after one captured step
 * and STEPS-1 replays, on a device of one kind. */
static void run_both(int remote, unsigned char *by_ops,
                     unsigned char *by_graph) {
  dispatch_device *dev = open_dev(remote);
  model a;
  model_init(&a, dev);
  for (int k = 0; k < STEPS; k++) step(&a, k, 0);
  read_params(&a, by_ops);
  model_free(&a);

  model b;
  model_init(&b, dev);
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  step(&b, 0, 1);
  dispatch_graph *gr;
  cr_assert_eq(dispatch_graph_end(dev, &gr), 0, "%s",
               dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_graph_n_inputs(gr), 2);
  cr_assert_eq(dispatch_graph_n_outputs(gr), 1);
  float loss = -1, first = -1;
  for (int k = 1; k < STEPS; k++) {
    replay(&b, gr, k, &loss);
    if (k == 1) first = loss;
    cr_assert(loss > 0 && loss < 20, "loss %g", loss);
  }
  cr_assert_neq(first, loss, "the loss did not move over the replays");
  read_params(&b, by_graph);
  dispatch_graph_free(gr);
  model_free(&b);
  dispatch_device_close(dev);
}

static int first_diff(const unsigned char *a, const unsigned char *b) {
  for (int i = 0; i < PBYTES; i++)
    if (a[i] != b[i]) return i;
  return -1;
}

Test(graph, mlp_step_replayed_bit_identical_local) {
  unsigned char ops[PBYTES], gr[PBYTES];
  run_both(0, ops, gr);
  cr_assert_eq(first_diff(ops, gr), -1,
               "LOCAL: replayed parameters differ from op by op at byte %d",
               first_diff(ops, gr));
}

Test(graph, mlp_step_replayed_bit_identical_remote_and_local,
     .fini = stop_server) {
  start_server(NULL);
  unsigned char lops[PBYTES], lgr[PBYTES], rops[PBYTES], rgr[PBYTES];
  run_both(0, lops, lgr);
  run_both(1, rops, rgr);
  cr_assert_eq(first_diff(rops, rgr), -1,
               "REMOTE: replayed parameters differ from op by op at byte %d",
               first_diff(rops, rgr));
  cr_assert_eq(first_diff(rgr, lgr), -1,
               "REMOTE replay differs from LOCAL replay at byte %d",
               first_diff(rgr, lgr));
}

/* Adam's step count is an attribute of the recorded step: the k-th
 * replay must use the capture's count + k, as the (k+1)-th op-by-op step
 * does, or the parameters drift from the op-by-op ones. */
Test(graph, adam_step_replayed_bit_identical, .fini = stop_server) {
  start_server(NULL);
  g_adam = 1;
  unsigned char lops[PBYTES], lgr[PBYTES], rops[PBYTES], rgr[PBYTES];
  run_both(0, lops, lgr);
  run_both(1, rops, rgr);
  cr_assert_eq(first_diff(lops, lgr), -1, "LOCAL Adam: byte %d differs",
               first_diff(lops, lgr));
  cr_assert_eq(first_diff(rops, rgr), -1, "REMOTE Adam: byte %d differs",
               first_diff(rops, rgr));
  cr_assert_eq(first_diff(rgr, lgr), -1, "REMOTE/LOCAL Adam: byte %d differs",
               first_diff(rgr, lgr));
}

/* AdamW's decays and the clip travel with the captured step (GraphNode
 * max_norm, weight_decay): each replay takes the norm of its own
 * gradients, as the op-by-op step does. */
Test(graph, adamw_clipped_step_replayed_bit_identical, .fini = stop_server) {
  start_server(NULL);
  g_adam = 2;
  unsigned char lops[PBYTES], lgr[PBYTES], rops[PBYTES], rgr[PBYTES];
  run_both(0, lops, lgr);
  run_both(1, rops, rgr);
  cr_assert_eq(first_diff(lops, lgr), -1, "LOCAL AdamW: byte %d differs",
               first_diff(lops, lgr));
  cr_assert_eq(first_diff(rops, rgr), -1, "REMOTE AdamW: byte %d differs",
               first_diff(rops, rgr));
  cr_assert_eq(first_diff(rgr, lgr), -1, "REMOTE/LOCAL AdamW: byte %d differs",
               first_diff(rgr, lgr));
  cr_assert_eq(first_diff(lops, rops), -1, "op by op: byte %d differs",
               first_diff(lops, rops));
}

/* Replays leave nothing behind on the server: the session's tensor count
 * after 20 replays is what it was after the first. */
Test(graph, replays_hold_nothing_on_the_server, .fini = stop_server) {
  start_server(NULL);
  dispatch_device *dev = open_dev(1);
  model m;
  model_init(&m, dev);
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  step(&m, 0, 1);
  dispatch_graph *gr;
  cr_assert_eq(dispatch_graph_end(dev, &gr), 0);
  float loss;
  replay(&m, gr, 1, &loss);
  dispatch_stats s1 = DISPATCH_STATS_INIT, s2 = DISPATCH_STATS_INIT;
  cr_assert_eq(dispatch_device_stats(dev, &s1), 0);
  for (int k = 2; k < 22; k++) replay(&m, gr, k, &loss);
  cr_assert_eq(dispatch_device_stats(dev, &s2), 0);
  cr_assert_eq(s2.tensors, s1.tensors, "%llu tensors, then %llu",
               (unsigned long long)s1.tensors,
               (unsigned long long)s2.tensors);
  cr_assert_eq(s2.bytes, s1.bytes);
  cr_assert_eq(s2.grads, s1.grads);
  dispatch_graph_free(gr);
  model_free(&m);
  dispatch_device_close(dev);
}

/* A chain x + one + one + ... (len adds) on n floats, captured with one
 * as an external. */
static dispatch_graph *chain_graph(dispatch_device *dev, int64_t n, int len,
                                   dispatch_tensor **one) {
  int64_t shape[1] = {n};
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 1, shape, one), 0);
  float *x0 = calloc((size_t)n, sizeof *x0);
  cr_assert_not_null(x0);
  dispatch_tensor *cur;
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, x0,
                                         (size_t)n * sizeof *x0, &cur),
               0);
  for (int i = 0; i < len; i++) {
    dispatch_tensor *nx;
    cr_assert_eq(dispatch_add(cur, *one, &nx), 0);
    dispatch_tensor_free(cur);
    cur = nx;
  }
  cr_assert_geq(dispatch_graph_output(cur), 0);
  dispatch_tensor_free(cur);
  dispatch_graph *g;
  cr_assert_eq(dispatch_graph_end(dev, &g), 0, "%s",
               dispatch_device_errmsg(dev));
  free(x0);
  return g;
}

static void chain_replay(dispatch_graph *g, int64_t n, int len) {
  int64_t shape[1] = {n};
  float *x = calloc((size_t)n, sizeof *x), *y = malloc((size_t)n * 4);
  cr_assert(x && y);
  x[n - 1] = 2.0f;
  dispatch_graph_io in = {DISPATCH_F32, 1, shape, x, (size_t)n * 4};
  dispatch_graph_io out = {DISPATCH_F32, 1, shape, y, (size_t)n * 4};
  cr_assert_eq(dispatch_graph_replay(g, &in, 1, &out, 1), 0);
  cr_assert_eq(y[n - 1], 2.0f + (float)len);
  cr_assert_eq(y[0], (float)len);
  free(x);
  free(y);
}

/* From its second replay on, a graph whose last replay did little work
 * runs on the server's network thread (Stats counts its ops in
 * inline_ops, and no worker turn): the first replay measures it on a
 * worker. A graph whose work is over what the loop runs per read stays on
 * the workers. */
Test(graph, small_replays_run_on_the_network_thread, .fini = stop_server) {
  start_server(NULL);
  dispatch_device *dev = open_dev(1);
  dispatch_tensor *one;
  dispatch_graph *g = chain_graph(dev, 16, 100, &one);
  dispatch_stats s1 = DISPATCH_STATS_INIT, s2 = DISPATCH_STATS_INIT;
  chain_replay(g, 16, 100);
  cr_assert_eq(dispatch_device_stats(dev, &s1), 0);
  chain_replay(g, 16, 100);
  cr_assert_eq(dispatch_device_stats(dev, &s2), 0);
  cr_assert_eq(s2.inline_ops - s1.inline_ops, 100,
               "%llu of the second replay's 100 ops ran inline",
               (unsigned long long)(s2.inline_ops - s1.inline_ops));
  cr_assert_eq(s2.batches, s1.batches, "the second replay took a worker");
  dispatch_graph_free(g);
  dispatch_tensor_free(one);

  /* 2^21 floats an add: past the loop's allowance of 2^20 per read */
  g = chain_graph(dev, 1 << 21, 2, &one);
  chain_replay(g, 1 << 21, 2);
  cr_assert_eq(dispatch_device_stats(dev, &s1), 0);
  chain_replay(g, 1 << 21, 2);
  cr_assert_eq(dispatch_device_stats(dev, &s2), 0);
  cr_assert_eq(s2.inline_ops, s1.inline_ops, "a large replay ran inline");
  cr_assert_gt(s2.batches, s1.batches);
  dispatch_graph_free(g);
  dispatch_tensor_free(one);
  dispatch_device_close(dev);
}

/* ------------------------------------------------------------------ */
/* errors                                                              */

static void wrong_shape_then_goes_on(int remote) {
  dispatch_device *dev = open_dev(remote);
  model m;
  model_init(&m, dev);
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  step(&m, 0, 1);
  dispatch_graph *gr;
  cr_assert_eq(dispatch_graph_end(dev, &gr), 0);
  float x[B * IN] = {0}, loss;
  int64_t y[B] = {0};
  dispatch_graph_io in[2] = {
      {DISPATCH_F32, 2, (int64_t[]){B / 2, IN * 2}, x, sizeof x},
      {DISPATCH_I64, 1, (int64_t[]){B}, y, sizeof y}};
  dispatch_graph_io out[1] = {{DISPATCH_F32, 0, NULL, &loss, sizeof loss}};
  int rc = dispatch_graph_replay(gr, in, 2, out, 1);
  cr_assert_eq(rc, DISPATCH_ESHAPE, "%s", dispatch_err_name(rc));
  const char *msg = dispatch_device_errmsg(dev);
  cr_assert(strstr(msg, "input 0 is f32 [4, 24], its placeholder f32 [8, 12]"),
            "message: %s", msg);
  rc = dispatch_graph_replay(gr, in, 1, out, 1);
  cr_assert_eq(rc, DISPATCH_EINVAL, "wrong input count: %s",
               dispatch_err_name(rc));
  /* the device and the graph go on */
  replay(&m, gr, 1, &loss);
  cr_assert_eq(dispatch_device_sync(dev), 0);
  dispatch_graph_free(gr);
  model_free(&m);
  dispatch_device_close(dev);
}

Test(graph, wrong_input_shape_refused_local) { wrong_shape_then_goes_on(0); }

Test(graph, wrong_input_shape_refused_remote, .fini = stop_server) {
  start_server(NULL);
  wrong_shape_then_goes_on(1);
}

/* Labels are data: a label out of range passes the capture's shapes but
 * fails cross_entropy (op 5 of the step) inside a replay. */
static void error_names_op(int remote) {
  dispatch_device *dev = open_dev(remote);
  model m;
  model_init(&m, dev);
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  step(&m, 0, 1);
  dispatch_graph *gr;
  cr_assert_eq(dispatch_graph_end(dev, &gr), 0);
  float x[B * IN], loss;
  int64_t y[B];
  batch(1, x, y);
  y[3] = 99;
  dispatch_graph_io in[2] = {
      {DISPATCH_F32, 2, (int64_t[]){B, IN}, x, sizeof x},
      {DISPATCH_I64, 1, (int64_t[]){B}, y, sizeof y}};
  dispatch_graph_io out[1] = {{DISPATCH_F32, 0, NULL, &loss, sizeof loss}};
  int rc = dispatch_graph_replay(gr, in, 2, out, 1);
  cr_assert_lt(rc, 0);
  const char *msg = dispatch_device_errmsg(dev);
  cr_assert(strstr(msg, "graph ") && strstr(msg, ", op 5 (cross_entropy): "),
            "message: %s", msg);
  replay(&m, gr, 2, &loss); /* goes on */
  cr_assert_eq(dispatch_device_sync(dev), 0, "%s",
               dispatch_device_errmsg(dev));
  dispatch_graph_free(gr);
  model_free(&m);
  dispatch_device_close(dev);
}

Test(graph, error_inside_replay_names_op_local) { error_names_op(0); }

Test(graph, error_inside_replay_names_op_remote, .fini = stop_server) {
  start_server(NULL);
  error_names_op(1);
}

/* Gradients made before the capture cannot be replayed: refused at the
 * end of the capture, not at the first replay. */
Test(graph, capture_using_outside_gradients_refused) {
  dispatch_device *dev = open_dev(0);
  model m;
  model_init(&m, dev);
  dispatch_tensor *x, *s, *loss;
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 2, (int64_t[]){1, IN}, &x), 0);
  cr_assert_eq(dispatch_matmul(x, m.p[0], &s), 0);
  cr_assert_eq(dispatch_sum(s, 0, NULL, 0, &loss), 0);
  dispatch_grads *g;
  cr_assert_eq(dispatch_backward(loss, &g), 0);
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  cr_assert_eq(dispatch_graph_begin(dev), DISPATCH_EINVAL);
  dispatch_tensor *gw;
  cr_assert_eq(dispatch_grad(g, m.p[0], &gw), 0); /* runs, not replayable */
  dispatch_graph *gr;
  int rc = dispatch_graph_end(dev, &gr);
  cr_assert_eq(rc, DISPATCH_EINVAL);
  cr_assert_null(gr);
  cr_assert(strstr(dispatch_device_errmsg(dev), "made before"), "%s",
            dispatch_device_errmsg(dev));
  dispatch_grads_free(g);
  model_free(&m);
  dispatch_device_close(dev);
}

/* ------------------------------------------------------------------ */
/* hostile frames                                                      */

static Dspwire__Reply *recv_reply(wire_conn *c, uint64_t id, void **bulk,
                                  size_t *blen) {
  Dspwire__Reply *r = NULL;
  cr_assert_geq(wire_recv(c, &r, bulk, blen), 0, "no reply: server gone?");
  cr_assert_eq(r->req_id, id);
  return r;
}

static uint64_t send_replay(wire_conn *c, uint64_t graph, size_t n_in,
                            Dspwire__TensorMeta **metas, const void *bulk,
                            size_t blen) {
  Dspwire__GraphReplay gr = DSPWIRE__GRAPH_REPLAY__INIT;
  gr.graph = graph;
  gr.n_inputs = n_in;
  gr.inputs = metas;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  static uint64_t next = 1000;
  req.req_id = ++next;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_REPLAY;
  req.graph_replay = &gr;
  cr_assert_eq(wire_send(c, &req, bulk, blen), 0);
  return req.req_id;
}

static void send_define(wire_conn *c, Dspwire__GraphDefine *d) {
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  static uint64_t next = 5000;
  req.req_id = ++next;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_DEFINE;
  req.graph_define = d;
  cr_assert_eq(wire_send(c, &req, NULL, 0), 0);
}

static int expect_error(wire_conn *c, uint64_t id, const char *needle) {
  Dspwire__Reply *r = recv_reply(c, id, NULL, NULL);
  cr_assert_not_null(r->error, "no error for %s", needle);
  cr_assert(strstr(r->error->message, needle), "message: %s",
            r->error->message);
  int code = r->error->code;
  wire_reply_free(r, NULL);
  return code;
}

Test(graph, hostile_define_and_replay, .fini = stop_server) {
  start_server((const char *const[]){"--max-session-bytes", "8M", NULL});
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "hostile-graph"), 0);
  char msg[512];

  /* a replay of a graph that was never defined */
  uint64_t id = send_replay(&c, 77, 0, NULL, NULL, 0);
  cr_assert_eq(expect_error(&c, id, "graph 77 does not exist"), DISPATCH_ENOID);

  /* a good graph: y = x + x on f32 [4], output y */
  Dspwire__TensorMeta m4 = DSPWIRE__TENSOR_META__INIT;
  int64_t shape4[1] = {4};
  m4.dtype = 0;
  m4.n_shape = 1;
  m4.shape = shape4;
  Dspwire__TensorMeta *mp[1] = {&m4};
  Dspwire__GraphNode add = DSPWIRE__GRAPH_NODE__INIT;
  uint32_t ins[2] = {0, 0};
  add.kind = 0;
  add.op = 1; /* add */
  add.n_inputs = 2;
  add.inputs = ins;
  add.output = 1;
  Dspwire__GraphNode *np[1] = {&add};
  uint32_t outs[1] = {1};
  Dspwire__GraphDefine d;
  wire_graph_define_init(&d, 5, mp, 1, 2, np, 1, outs, 1);
  send_define(&c, &d);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  float x[4] = {1, 2, 3, 4};
  id = send_replay(&c, 5, 1, mp, x, sizeof x);
  void *bulk = NULL;
  size_t blen = 0;
  Dspwire__Reply *r = recv_reply(&c, id, &bulk, &blen);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_GRAPH);
  cr_assert_eq(blen, sizeof x);
  cr_assert_eq(((float *)bulk)[3], 8.0f);
  wire_reply_free(r, bulk);
  /* slot numbers are not session ids: session tensors 0 and 1 (the
   * numbers of the graph's input and result slots) are left alone */
  float nines[4] = {9, 9, 9, 9};
  wire_upload(&c, 0, 0, 1, shape4, nines, sizeof nines);
  wire_upload(&c, 1, 0, 1, shape4, nines, sizeof nines);
  id = send_replay(&c, 5, 1, mp, x, sizeof x);
  r = recv_reply(&c, id, &bulk, &blen);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  cr_assert_eq(((float *)bulk)[0], 2.0f);
  wire_reply_free(r, bulk);
  for (uint64_t t = 0; t < 2; t++) {
    void *d = NULL;
    size_t n = 0;
    cr_assert_eq(wire_read_tensor(&c, t, &d, &n, NULL, NULL), 0);
    cr_assert_eq(n, sizeof nines);
    cr_assert_eq(memcmp(d, nines, n), 0, "session tensor %llu changed",
                 (unsigned long long)t);
    free(d);
  }

  /* wrong input count, a shape other than the placeholder's, a huge
   * declared shape, bulk bytes that do not match */
  id = send_replay(&c, 5, 0, NULL, NULL, 0);
  cr_assert_eq(expect_error(&c, id, "0 inputs given, it has 1"),
               DISPATCH_EINVAL);
  int64_t huge[2] = {1LL << 40, 1LL << 40};
  Dspwire__TensorMeta mh = m4;
  mh.n_shape = 2;
  mh.shape = huge;
  Dspwire__TensorMeta *mhp[1] = {&mh};
  id = send_replay(&c, 5, 1, mhp, x, sizeof x);
  cr_assert_eq(expect_error(&c, id, "its placeholder f32 [4]"),
               DISPATCH_ESHAPE);
  id = send_replay(&c, 5, 1, mp, x, 8);
  cr_assert_eq(expect_error(&c, id, "8 bulk bytes, its inputs need 16"),
               DISPATCH_EINVAL);
  /* input bytes past the session's 8 MiB: refused before they are held */
  size_t big = 9u << 20;
  void *bb = calloc(1, big);
  cr_assert_not_null(bb);
  id = send_replay(&c, 5, 1, mp, bb, big);
  free(bb);
  cr_assert_eq(expect_error(&c, id, "input bytes"), DISPATCH_EQUOTA);

  /* definitions: an id in use, huge slot counts, slots out of range, a
   * slot read before it is made, an optimizer op outside a step, an input
   * shape over the element limit; each a deferred error, nothing kept */
  send_define(&c, &d);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EIDINUSE,
               "%s", msg);
  Dspwire__GraphDefine e = d;
  e.graph = 6;
  e.n_slots = 0xFFFFFFFFu;
  send_define(&c, &e);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EINVAL,
               "%s", msg);
  e.n_slots = 1u << 22; /* within the slot bound, over the session's 8M */
  send_define(&c, &e);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EQUOTA,
               "%s", msg);
  e.n_slots = 2;
  ins[1] = 9;
  send_define(&c, &e);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EINVAL,
               "%s", msg);
  cr_assert(strstr(msg, "op 0 (add): an input is slot 9"), "%s", msg);
  ins[1] = 1;
  send_define(&c, &e);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EINVAL,
               "%s", msg);
  cr_assert(strstr(msg, "nothing made before"), "%s", msg);
  ins[1] = 0;
  add.op = 110; /* sgd_step */
  send_define(&c, &e);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EINVAL,
               "%s", msg);
  add.op = 1;
  Dspwire__TensorMeta *mhp2[1] = {&mh};
  e.inputs = mhp2;
  send_define(&c, &e);
  cr_assert_lt(wire_sync_check(&c, msg, sizeof msg, NULL), 0);
  e.inputs = mp;
  uint64_t ext[1] = {424242};
  e.n_externals = 1;
  e.externals = ext;
  e.n_slots = 3;
  add.output = 2;
  ins[1] = 1; /* the external */
  outs[0] = 2;
  send_define(&c, &e); /* fine: externals are looked up at each replay */
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  id = send_replay(&c, 6, 1, mp, x, sizeof x);
  cr_assert_eq(expect_error(&c, id, "external tensor 0 (id 424242) does not "
                                    "exist"),
               DISPATCH_ENOID);

  /* Free.graphs: the graph goes, a second free is an unknown id */
  uint64_t gids[1] = {5};
  Dspwire__Free f = DSPWIRE__FREE__INIT;
  f.n_graphs = 1;
  f.graphs = gids;
  Dspwire__Request fr = DSPWIRE__REQUEST__INIT;
  fr.req_id = 9000;
  fr.body_case = DSPWIRE__REQUEST__BODY_FREE;
  fr.free = &f;
  cr_assert_eq(wire_send(&c, &fr, NULL, 0), 0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  id = send_replay(&c, 5, 1, mp, x, sizeof x);
  cr_assert_eq(expect_error(&c, id, "graph 5 does not exist"), DISPATCH_ENOID);

  /* the session is still served */
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  wire_close(&c);
  cr_assert_eq(sp_stop(&g_srv), 0, "the server did not exit cleanly");
}

/* ------------------------------------------------------------------ */
/* issue 21 item 3: a replay's reply holds each output once and is      */
/* charged to the session before it is built                            */

/* A GraphDefine naming slot `slot` as its outputs n times, over one
 * external (session tensor 1) and n_nodes adds out_k = ext + ext. */
static void define_outputs(wire_conn *c, uint64_t graph, const uint32_t *outs,
                           size_t n_out, int n_adds) {
  uint64_t ext[1] = {1};
  uint32_t ins[2] = {0, 0};
  Dspwire__GraphNode nodes[8], *np[8];
  cr_assert_leq(n_adds, 8);
  for (int k = 0; k < n_adds; k++) {
    dspwire__graph_node__init(&nodes[k]);
    nodes[k].kind = 0;
    nodes[k].op = 1; /* add */
    nodes[k].n_inputs = 2;
    nodes[k].inputs = ins;
    nodes[k].output = 1 + (uint32_t)k;
    np[k] = &nodes[k];
  }
  Dspwire__GraphDefine d = DSPWIRE__GRAPH_DEFINE__INIT;
  d.graph = graph;
  d.n_externals = 1;
  d.externals = ext;
  d.n_slots = 1 + (uint32_t)n_adds + (uint32_t)n_out;
  d.n_nodes = (size_t)n_adds;
  d.nodes = np;
  d.n_outputs = n_out;
  d.outputs = (uint32_t *)outs;
  send_define(c, &d);
}

/* A definition naming one slot twice as an output is refused (each named
 * output's bytes went into the reply again: a 64 MiB tensor named 24 times
 * made 1.5 GiB no budget counted); the session goes on. */
Test(graph, repeated_output_refused_at_define, .fini = stop_server) {
  start_server(NULL);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "repeat-graph"), 0);
  int64_t shape[1] = {4};
  float x[4] = {1, 2, 3, 4};
  wire_upload(&c, 1, 0, 1, shape, x, sizeof x);
  char msg[512];
  uint32_t twice[3] = {1, 0, 1};
  define_outputs(&c, 8, twice, 3, 1);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_EINVAL,
               "%s", msg);
  cr_assert(strstr(msg, "output 2 is slot 1, an earlier output"), "%s", msg);
  uint64_t id = send_replay(&c, 8, 0, NULL, NULL, 0);
  cr_assert_eq(expect_error(&c, id, "graph 8 does not exist"), DISPATCH_ENOID);
  /* the same outputs once each: defined and replayed */
  uint32_t once[2] = {1, 0};
  define_outputs(&c, 8, once, 2, 1);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  id = send_replay(&c, 8, 0, NULL, NULL, 0);
  void *bulk = NULL;
  size_t blen = 0;
  Dspwire__Reply *r = recv_reply(&c, id, &bulk, &blen);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  cr_assert_eq(blen, 2 * sizeof x);
  cr_assert_eq(((float *)bulk)[3], 8.0f);
  cr_assert_eq(((float *)bulk)[7], 4.0f);
  wire_reply_free(r, bulk);
  wire_close(&c);
  cr_assert_eq(sp_stop(&g_srv), 0, "the server did not exit cleanly");
}

/* The reply's bytes are charged to the session before they are copied:
 * under an 8 MiB session, four 1 MiB outputs of a 1 MiB external (1 + 4
 * of tensors, 4 of reply) are refused with EQUOTA naming the reply, where
 * the uncounted reply used to be built; two (1 + 2 + 2) replay again and
 * again, so each reply's charge goes once it is sent. */
Test(graph, reply_charged_to_the_session, .fini = stop_server) {
  start_server((const char *const[]){"--max-session-bytes", "8M", NULL});
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "charged-graph"), 0);
  int64_t shape[1] = {1 << 18}; /* 1 MiB of f32 */
  size_t nb = (size_t)shape[0] * 4;
  float *x = malloc(nb);
  cr_assert_not_null(x);
  for (int64_t i = 0; i < shape[0]; i++) x[i] = (float)(i % 7);
  wire_upload(&c, 1, 0, 1, shape, x, nb);
  char msg[512];
  uint32_t four[4] = {1, 2, 3, 4}, two[2] = {1, 2};
  define_outputs(&c, 9, four, 4, 4);
  define_outputs(&c, 10, two, 2, 2);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  uint64_t id = send_replay(&c, 9, 0, NULL, NULL, 0);
  cr_assert_eq(expect_error(&c, id, "the reply"), DISPATCH_EQUOTA);
  for (int k = 0; k < 6; k++) {
    id = send_replay(&c, 10, 0, NULL, NULL, 0);
    void *bulk = NULL;
    size_t blen = 0;
    Dspwire__Reply *r = recv_reply(&c, id, &bulk, &blen);
    cr_assert_null(r->error, "replay %d: %s", k,
                   r->error ? r->error->message : "");
    cr_assert_eq(blen, 2 * nb);
    cr_assert_eq(((float *)bulk)[5], 10.0f);
    cr_assert_eq(((float *)bulk)[(1 << 18) + 6], 12.0f);
    wire_reply_free(r, bulk);
  }
  free(x);
  wire_close(&c);
  cr_assert_eq(sp_stop(&g_srv), 0, "the server did not exit cleanly");
}

/* A captured step that names one tensor twice (and another once) keeps
 * working: the client sends each once and hands both copies back. */
static void same_output_twice(int remote) {
  if (remote) start_server(NULL);
  dispatch_device *dev = open_dev(remote);
  int64_t shape[1] = {3};
  float x0[3] = {0, 0, 0};
  dispatch_tensor *x, *y, *z;
  cr_assert_eq(dispatch_graph_begin(dev), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, x0,
                                         sizeof x0, &x), 0);
  cr_assert_eq(dispatch_add(x, x, &y), 0);
  cr_assert_eq(dispatch_mul(y, x, &z), 0);
  cr_assert_eq(dispatch_graph_output(y), 0);
  cr_assert_eq(dispatch_graph_output(z), 1);
  cr_assert_eq(dispatch_graph_output(y), 2);
  dispatch_graph *g;
  cr_assert_eq(dispatch_graph_end(dev, &g), 0, "%s",
               dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_graph_n_outputs(g), 3);
  cr_assert_eq(dispatch_graph_output_nbytes(g, 2), sizeof x0);
  for (int k = 1; k < 4; k++) {
    float in[3] = {1.0f * k, 2, 3}, o[3][3];
    memset(o, 0, sizeof o);
    dispatch_graph_io gi = {DISPATCH_F32, 1, shape, in, sizeof in};
    dispatch_graph_io go[3];
    for (int i = 0; i < 3; i++)
      go[i] = (dispatch_graph_io){DISPATCH_F32, 1, shape, o[i], sizeof o[i]};
    cr_assert_eq(dispatch_graph_replay(g, &gi, 1, go, 3), 0, "%s",
                 dispatch_device_errmsg(dev));
    for (int e = 0; e < 3; e++) {
      cr_assert_eq(o[0][e], 2 * in[e]);
      cr_assert_eq(o[1][e], 2 * in[e] * in[e]);
      cr_assert_eq(o[2][e], 2 * in[e]);
    }
  }
  dispatch_graph_free(g);
  dispatch_tensor_free(x);
  dispatch_tensor_free(y);
  dispatch_tensor_free(z);
  dispatch_device_close(dev);
}

Test(graph, same_output_twice_local) { same_output_twice(0); }

Test(graph, same_output_twice_remote, .fini = stop_server) {
  same_output_twice(1);
}
