/* What a graph replay and a Free cost (issue 21 items 1, 2, 4, 7), against
 * a real dispatch-server on 127.0.0.1 port 0 and, for the executor
 * itself, in process:
 * - a replay counts its nodes, whatever their tensors: one of thousands
 *   of ops on empty tensors, or of grad nodes (no op at all), is past the
 *   network thread's allowance and runs on a worker (Stats handoffs);
 * - a replay stops at a node boundary once its ctx is cancelled, whatever
 *   the node, and a drain's deadline cuts off a queue of long replays;
 * - --max-replay-cost bounds a replay's total work: the op that would
 *   pass it fails the replay with DISPATCH_ELIMIT before it runs, and a
 *   definition whose nodes alone pass it is refused;
 * - a Free of a large graph, or of the last tensor of a long tape, is
 *   costed by what it frees and goes to a worker.
 * Assertions are on counters, error codes and messages, never on time. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "graph.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"
#include "wire_req.h"

static sp_server g_srv;

static void start(const char *const *args) {
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

static void stop(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static uint64_t g_req = 1u << 20;

/* A graph definition built node by node, sent with define_send. */
typedef struct gdef {
  Dspwire__GraphNode *nodes;
  Dspwire__GraphNode **np;
  uint32_t *ins; /* 2 per node */
  size_t n, cap;
  uint32_t n_slots;
} gdef;

static void gdef_init(gdef *d, size_t cap, uint32_t first_free_slot) {
  memset(d, 0, sizeof *d);
  d->cap = cap;
  d->nodes = calloc(cap, sizeof *d->nodes);
  d->np = calloc(cap, sizeof *d->np);
  d->ins = calloc(cap * 2, sizeof *d->ins);
  cr_assert(d->nodes && d->np && d->ins);
  d->n_slots = first_free_slot;
}

static void gdef_free(gdef *d) {
  free(d->nodes);
  free(d->np);
  free(d->ins);
}

/* Appends a node of kind with operands a (and b when n_in is 2); a node
 * that makes a value gets the next fresh slot, returned. */
static uint32_t node(gdef *d, int kind, int op, uint32_t n_in, uint32_t a,
                     uint32_t b) {
  cr_assert_lt(d->n, d->cap);
  Dspwire__GraphNode *n = &d->nodes[d->n];
  dspwire__graph_node__init(n);
  n->kind = kind;
  n->op = op;
  n->n_inputs = n_in;
  n->inputs = &d->ins[2 * d->n];
  n->inputs[0] = a;
  n->inputs[1] = b;
  uint32_t out = 0;
  if (kind == DSP_G_OP || kind == DSP_G_BACKWARD || kind == DSP_G_GRAD)
    n->output = out = d->n_slots++;
  d->np[d->n++] = n;
  return out;
}

static Dspwire__TensorMeta g_meta;
static int64_t g_shape[1];
static Dspwire__TensorMeta *g_metas[1] = {&g_meta};

/* One f32 input of n elements */
static void input_f32(int64_t n) {
  dspwire__tensor_meta__init(&g_meta);
  g_meta.dtype = DSP_F32;
  g_meta.n_shape = 1;
  g_shape[0] = n;
  g_meta.shape = g_shape;
}

/* Sends the definition of graph gid (one input, as input_f32 set it; the
 * given output slot, if any) and returns its Sync's code; msg gets the
 * message. */
static int define_send(wire_conn *c, uint64_t gid, gdef *d, int has_out,
                       uint32_t out, char *msg, size_t len) {
  Dspwire__GraphDefine gd = DSPWIRE__GRAPH_DEFINE__INIT;
  gd.graph = gid;
  gd.n_inputs = 1;
  gd.inputs = g_metas;
  gd.n_slots = d->n_slots;
  gd.n_nodes = d->n;
  gd.nodes = d->np;
  gd.n_outputs = has_out ? 1 : 0;
  gd.outputs = &out;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.req_id = ++g_req;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_DEFINE;
  req.graph_define = &gd;
  cr_assert_eq(wire_send(c, &req, NULL, 0), 0);
  return wire_sync_check(c, msg, len, NULL);
}

/* define_send of d with output out that must be accepted; d is freed. */
static void define_ok(wire_conn *c, uint64_t gid, gdef *d, uint32_t out) {
  char msg[512];
  cr_assert_eq(define_send(c, gid, d, 1, out, msg, sizeof msg), 0,
               "graph %llu: %s", (unsigned long long)gid, msg);
  gdef_free(d);
}

/* Encodes one replay of gid (input bytes bulk, blen) at buf; returns its
 * size. */
static size_t replay_encode(uint8_t *buf, uint64_t gid, const void *bulk,
                            size_t blen, uint64_t *id) {
  Dspwire__GraphReplay gr = DSPWIRE__GRAPH_REPLAY__INIT;
  gr.graph = gid;
  gr.n_inputs = 1;
  gr.inputs = g_metas;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.req_id = *id = ++g_req;
  req.body_case = DSPWIRE__REQUEST__BODY_GRAPH_REPLAY;
  req.graph_replay = &gr;
  size_t n = dsp_req_frame_encode(&req, blen, buf);
  if (blen) memcpy(buf + n, bulk, blen);
  return n + blen;
}

/* One replay of gid; its reply's error code (0: none), msg its message. */
static int replay(wire_conn *c, uint64_t gid, const void *bulk, size_t blen,
                  char *msg, size_t len) {
  uint8_t *buf = malloc(4096 + blen);
  cr_assert_not_null(buf);
  uint64_t id;
  size_t n = replay_encode(buf, gid, bulk, blen, &id);
  cr_assert_eq(wire_send_raw(c, buf, n), 0);
  free(buf);
  Dspwire__Reply *r;
  void *b;
  size_t bl;
  cr_assert_eq(wire_recv(c, &r, &b, &bl), 0, "no reply to the replay");
  cr_assert_eq(r->req_id, id);
  int code = r->error ? r->error->code : 0;
  if (msg) snprintf(msg, len, "%s", r->error ? r->error->message : "");
  wire_reply_free(r, b);
  return code;
}

/* A chain of n adds on an empty f32 [0] input: no element anywhere */
static void empty_chain(gdef *d, size_t n, uint32_t *last) {
  gdef_init(d, n, 1);
  uint32_t cur = 0;
  for (size_t i = 0; i < n; i++) cur = node(d, DSP_G_OP, DSP_OP_ADD, 2, 0, 0);
  *last = cur;
}

/* track x, sum it, backward, then n grad nodes reading x's gradient: n
 * nodes that run no op */
static void grad_nodes(gdef *d, size_t n, uint32_t *last) {
  gdef_init(d, n + 3, 1);
  node(d, DSP_G_TRACK, 0, 1, 0, 0);
  uint32_t loss = node(d, DSP_G_OP, DSP_OP_SUM, 1, 0, 0);
  uint32_t grads = node(d, DSP_G_BACKWARD, 0, 1, loss, 0);
  uint32_t cur = 0;
  for (size_t i = 0; i < n; i++)
    cur = node(d, DSP_G_GRAD, 0, 2, grads, 0);
  *last = cur;
}

/* The second replay of gid (the first tells the loop what it costs):
 * the hand-offs and inline ops it took */
static void second_replay(wire_conn *c, uint64_t gid, const void *bulk,
                          size_t blen, uint64_t *handoffs,
                          uint64_t *inline_ops) {
  char msg[512];
  cr_assert_eq(replay(c, gid, bulk, blen, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(wire_sync_check(c, NULL, 0, NULL), 0);
  Dspwire__StatsReply s0, s1;
  cr_assert_eq(wire_get_stats(c, &s0), 0);
  cr_assert_eq(replay(c, gid, bulk, blen, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(wire_get_stats(c, &s1), 0);
  *handoffs = s1.handoffs - s0.handoffs;
  *inline_ops = s1.inline_ops - s0.inline_ops;
}

/* Item 1: 4096 adds on empty tensors each did no kernel work, so a
 * replay measured 0 (1) and ran on the network thread: 300,000 such nodes
 * and 20 replays in one write held every other session 3-4.6 s. Counted
 * DSP_WORK_PER_OP each, 4096 nodes are 2M, past the 2^20 a read may
 * spend on the loop: the replay goes to a worker. So do 4096 grad nodes,
 * which run no op at all. */
Test(replay_cost, nodes_of_no_work_still_cost, .fini = stop) {
  start((const char *const[]){"--log-level", "error", NULL});
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "nodes"), 0);
  gdef d;
  uint32_t last;
  uint64_t h, in;

  input_f32(0);
  empty_chain(&d, 4096, &last);
  define_ok(&c, 1, &d, last);
  second_replay(&c, 1, NULL, 0, &h, &in);
  cr_assert_eq(in, 0, "%llu ops of a replay of 4096 empty adds ran on the "
               "network thread", (unsigned long long)in);
  cr_assert_gt(h, 0, "the replay of 4096 empty adds took no worker");

  float x[1] = {2.0f};
  input_f32(1);
  grad_nodes(&d, 4096, &last);
  define_ok(&c, 2, &d, last);
  second_replay(&c, 2, x, sizeof x, &h, &in);
  cr_assert_eq(in, 0, "the replay of 4096 grad nodes ran on the network "
               "thread (%llu ops)", (unsigned long long)in);
  cr_assert_gt(h, 0, "the replay of 4096 grad nodes took no worker");

  /* and a small graph still runs on the loop */
  input_f32(0);
  empty_chain(&d, 16, &last);
  define_ok(&c, 3, &d, last);
  second_replay(&c, 3, NULL, 0, &h, &in);
  cr_assert_eq(in, 16, "%llu of a small replay's 16 ops ran inline",
               (unsigned long long)in);
  wire_close(&c);
}

/* Item 2, the executor: a cancelled ctx stops a replay before its next
 * node whatever the node runs. A graph of a track and a free runs no op,
 * so before the check at each node it ran to its end on a cancelled ctx
 * (as a long graph of such nodes would, past a drain's deadline). */
Test(replay_cost, cancelled_run_stops_at_a_node) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_graph *g = dsp_graph_new();
  cr_assert(ctx && g);
  g->n_inputs = 1;
  g->n_slots = 1;
  g->input_meta = calloc(1, sizeof(dsp_meta));
  g->outputs = calloc(1, sizeof(uint32_t));
  cr_assert(g->input_meta && g->outputs);
  g->input_meta[0].dtype = DSP_F32;
  g->input_meta[0].ndim = 1;
  g->input_meta[0].shape[0] = 1;
  uint32_t s0 = 0;
  cr_assert_eq(dsp_graph_add(g, DSP_G_TRACK, 0, 0, &s0, 1, 0, NULL), 0);
  cr_assert_eq(dsp_graph_add(g, DSP_G_FREE, 0, 0, &s0, 1, 0, NULL), 0);
  cr_assert_eq(dsp_graph_check(ctx, g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *x;
  cr_assert_eq(dsp_tensor_new(ctx, &g->input_meta[0], &x), 0);
  uint64_t n_ops = 0;
  cr_assert_eq(dsp_graph_run(ctx, g, &x, NULL, 0, NULL, &n_ops), 0, "%s",
               dsp_ctx_errmsg(ctx));
  uint64_t w0 = dsp_ctx_work(ctx);
  cr_assert_geq(w0, (uint64_t)DSP_WORK_PER_OP,
                "a graph of two nodes counted %llu work",
                (unsigned long long)w0);
  dsp_tensor_unref(x);
  cr_assert_eq(dsp_tensor_new(ctx, &g->input_meta[0], &x), 0);
  dsp_ctx_cancel(ctx);
  int rc = dsp_graph_run(ctx, g, &x, NULL, 0, NULL, &n_ops);
  cr_assert_eq(rc, DISPATCH_ECANCELED, "a cancelled run returned %s",
               dispatch_err_name(rc));
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "op 0 (track): cancelled"), "%s",
            dsp_ctx_errmsg(ctx));
  cr_assert(!dsp_is_tracked(x), "the track node ran after the cancel");
  dsp_tensor_unref(x);
  dsp_graph_free(g);
  dsp_ctx_free(ctx);
}

/* Item 2, the server: 200 replays of 300,000 empty adds in one write,
 * then SIGTERM with --drain-timeout 1. They ran on the network thread,
 * which handled the signal only after the last (5.4-6.3 s, minutes for a
 * longer queue): every replay was answered and the goodbye said so. On a
 * worker, the deadline cancels the running replay at a node and drops
 * the rest: the goodbye says they were cut off, most never ran, and the
 * exit status is 0. */
Test(replay_cost, drain_deadline_cuts_a_queue_of_replays, .fini = stop,
     .timeout = 600) {
  start((const char *const[]){"--log-level", "error", "--drain-timeout",
                              "1", NULL});
  enum { NODES = 300000, N = 200 };
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "drain-replays"), 0);
  char msg[512];
  gdef d;
  uint32_t last;
  input_f32(0);
  empty_chain(&d, NODES, &last);
  define_ok(&c, 1, &d, last);
  cr_assert_eq(replay(&c, 1, NULL, 0, msg, sizeof msg), 0, "%s", msg);
  /* a Sync heads the write: its reply means the server read the rest */
  uint8_t *buf = malloc(64 + (size_t)N * 64);
  cr_assert_not_null(buf);
  dsp_wreq w;
  Dspwire__Request *sync = dsp_wreq_sync(&w);
  sync->req_id = ++g_req;
  uint64_t sync_id = sync->req_id;
  size_t n = dsp_req_frame_encode(sync, 0, buf);
  uint64_t id;
  for (int i = 0; i < N; i++) n += replay_encode(buf + n, 1, NULL, 0, &id);
  cr_assert_eq(wire_send_raw(&c, buf, n), 0);
  free(buf);
  Dspwire__Reply *r;
  void *b;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &b, &bl), 0, "no reply to the sync");
  cr_assert_eq(r->req_id, sync_id);
  wire_reply_free(r, b);
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);
  /* the goodbye is offered, not owed: a socket that does not take it at
   * once is closed without it */
  int answered = 0, goodbye = 0;
  char bye[512] = "";
  while (!goodbye && wire_recv(&c, &r, &b, &bl) == 0) {
    if (r->req_id == 0) {
      cr_assert_not_null(r->error);
      cr_assert_eq(r->error->code, DISPATCH_ESHUTDOWN);
      snprintf(bye, sizeof bye, "%s", r->error->message);
      goodbye = 1;
    } else {
      answered++;
    }
    wire_reply_free(r, b);
  }
  cr_assert_lt(answered, N / 2, "%d of %d replays were answered (%s)",
               answered, N, bye);
  if (goodbye)
    cr_assert(strstr(bye, "cut off"), "goodbye after %d of %d replays: %s",
              answered, N, bye);
  wire_close(&c);
  cr_assert_eq(sp_wait(&g_srv), 0, "exit status after the cut-off drain");
  g_srv.pid = 0;
}

/* Item 4: --max-replay-cost bounds a replay's work as a whole (each op
 * was bounded, the replay not at all). 32 adds of 4096 floats cost
 * 8192 + DSP_WORK_PER_OP (512) each, 33 slots 33: with a bound of 90000
 * ops 0-9 run and op 10 is refused before it runs. A definition of 200
 * adds on empty tensors (at least 200 * 512 + 201 a replay) is refused at
 * once; 16 of them pass. */
Test(replay_cost, max_replay_cost_bounds_a_replay, .fini = stop) {
  start((const char *const[]){"--log-level", "error", "--max-replay-cost",
                              "90000", NULL});
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "bound"), 0);
  char msg[512];
  gdef d;
  enum { N = 4096 };
  input_f32(N);
  gdef_init(&d, 32, 1);
  uint32_t cur = 0;
  for (int i = 0; i < 32; i++)
    cur = node(&d, DSP_G_OP, DSP_OP_ADD, 2, cur, cur);
  define_ok(&c, 1, &d, cur);
  float *x = calloc(N, sizeof *x);
  cr_assert_not_null(x);
  int rc = replay(&c, 1, x, N * sizeof *x, msg, sizeof msg);
  free(x);
  cr_assert_eq(rc, DISPATCH_ELIMIT, "a replay of 278k: %s (%s)",
               dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "op 10 (add)"), "%s", msg);
  cr_assert(strstr(msg, "over the per-replay limit of 90000"), "%s", msg);
  cr_assert(strstr(msg, "--max-replay-cost"), "%s", msg);

  input_f32(0);
  uint32_t last;
  empty_chain(&d, 200, &last);
  rc = define_send(&c, 2, &d, 1, last, msg, sizeof msg);
  gdef_free(&d);
  cr_assert_eq(rc, DISPATCH_ELIMIT, "a definition of 200 nodes: %s (%s)",
               dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "--max-replay-cost"), "%s", msg);
  cr_assert_eq(replay(&c, 2, NULL, 0, msg, sizeof msg), DISPATCH_ENOID,
               "the refused graph was kept: %s", msg);

  empty_chain(&d, 16, &last);
  define_ok(&c, 3, &d, last);
  cr_assert_eq(replay(&c, 3, NULL, 0, msg, sizeof msg), 0, "%s", msg);
  wire_close(&c);
}

static uint64_t free_handoffs(wire_conn *c, const uint64_t *tensors, int nt,
                              const uint64_t *graphs, int ng) {
  cr_assert_eq(wire_sync_check(c, NULL, 0, NULL), 0);
  Dspwire__StatsReply s0, s1;
  cr_assert_eq(wire_get_stats(c, &s0), 0);
  Dspwire__Free f = DSPWIRE__FREE__INIT;
  f.n_tensors = (size_t)nt;
  f.tensors = (uint64_t *)tensors;
  f.n_graphs = (size_t)ng;
  f.graphs = (uint64_t *)graphs;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  req.req_id = ++g_req;
  req.body_case = DSPWIRE__REQUEST__BODY_FREE;
  req.free = &f;
  cr_assert_eq(wire_send(c, &req, NULL, 0), 0);
  cr_assert_eq(wire_sync_check(c, NULL, 0, NULL), 0);
  cr_assert_eq(wire_get_stats(c, &s1), 0);
  return s1.handoffs - s0.handoffs;
}

/* Item 7: a Free costed only its tensor ids: freeing 3M graph nodes held
 * the other sessions 0.22-0.28 s, the last tensor of a 600k-node tape
 * 0.18 s, on the network thread. A graph costs its nodes, a last
 * reference its tape: a graph of 4096 nodes and a tape of 300 go to a
 * worker; a small graph and an untracked tensor stay on the loop. */
Test(replay_cost, frees_of_graphs_and_tapes_are_costed, .fini = stop) {
  start((const char *const[]){"--log-level", "error", NULL});
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "frees"), 0);
  gdef d;
  uint32_t last;
  input_f32(0);
  empty_chain(&d, 4096, &last);
  define_ok(&c, 1, &d, last);
  empty_chain(&d, 4, &last);
  define_ok(&c, 2, &d, last);
  uint64_t g2[1] = {2}, g1[1] = {1};
  cr_assert_eq(free_handoffs(&c, NULL, 0, g2, 1), 0,
               "the free of a 4-node graph took a worker");
  cr_assert_gt(free_handoffs(&c, NULL, 0, g1, 1), 0,
               "the free of a 4096-node graph ran on the network thread");

  /* x tracked, y_k = y_{k-1} + x, each y_{k-1} freed as it goes: only the
   * last y holds the 300-node tape */
  float one[1] = {1.0f};
  int64_t sh[1] = {1};
  wire_upload(&c, 1, DSP_F32, 1, sh, one, sizeof one);
  wire_upload(&c, 2, DSP_F32, 1, sh, one, sizeof one);
  wire_track(&c, 1);
  uint64_t prev = 1;
  for (uint64_t k = 0; k < 300; k++) {
    uint64_t in[2] = {prev, 1};
    wire_op(&c, DSP_OP_ADD, in, 2, 100 + k, NULL, 0, NULL, 0);
    if (prev != 1) wire_free(&c, &prev, 1, NULL, 0);
    prev = 100 + k;
  }
  uint64_t untracked[1] = {2};
  cr_assert_eq(free_handoffs(&c, untracked, 1, NULL, 0), 0,
               "the free of an untracked tensor took a worker");
  cr_assert_gt(free_handoffs(&c, &prev, 1, NULL, 0), 0,
               "the free of the last tensor of a 300-node tape ran on the "
               "network thread");
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 1, "%llu tensors left", (unsigned long long)st.tensors);
  wire_close(&c);
}
