/* bench graph: captured graphs replayed (issue 11 item 5; rows of item 6).
 *
 * Chain: 1,000 dependent adds on 16 floats (x + 1 + 1 + ...) followed by
 * one read of the result. The reference is that chain run op by op on the
 * LOCAL device in this process; ours is the same chain captured once on
 * the REMOTE device and replayed: one GraphReplay message carrying the 64
 * input bytes, one reply carrying the 64 result bytes. Rates are adds per
 * second over whole chains (the read included). Goal: at least 0.8 of
 * LOCAL's rate. A LOCAL replay of the same graph is a row of its own
 * (no goal), to tell the executor from the wire.
 *
 * MLP: one training step of the 784-256-10 MLP of bench/mlp.c (relu,
 * cross-entropy, SGD, batch 128, data resident on the device), timed to
 * the loss being read, four ways from the same seeds, in blocks whose
 * order rotates every round (as bench/mlp.c does): LOCAL op by op with 1
 * and with 2 OpenBLAS threads, REMOTE op by op (one Step message for the
 * update), and REMOTE as a replayed graph (one message per step). Rows:
 * the graph step beside the best LOCAL step, and beside the op-by-op
 * REMOTE step. No goal for either (the issue sets none). The four final
 * losses must agree (same math), which checks that every model trained.
 */
#include <cblas.h>

#include "bench.h"

#define CHAIN 1000
#define CHAIN_BUDGET 0.3 /* seconds per variant per repetition */
#define MIN_REPS 5
#define MAX_REPS 11
#define TOTAL_BUDGET 25.0

#define BATCH 128
#define NIN 784
#define NHID 256
#define NOUT 10
#define LR 0.05
#define WARMUP 3
#define MAX_ROUNDS 30
#define MIN_ROUNDS 8
#define BLOCK 6
#define GAP_US 100000
#define MLP_BUDGET 25.0

/* ------------------------------------------------------------------ */
/* the chain                                                           */

typedef struct chain {
  dispatch_device *dev;
  dispatch_tensor *one;  /* the constant added at every link */
  dispatch_graph *graph; /* NULL: op by op */
  int n;
  char err[512];
} chain;

static int chain_fail(chain *c, int rc, const char *what) {
  snprintf(c->err, sizeof c->err, "%s: %s: %s", what, dispatch_err_name(rc),
           dispatch_device_errmsg(c->dev));
  return rc;
}

/* Runs the chain on x0 op by op (or, inside a capture, records it);
 * *last is the caller's. */
static int chain_ops(chain *c, const float *x0, dispatch_tensor **last,
                     int capture) {
  int64_t shape[1] = {16};
  dispatch_tensor *cur;
  int rc = dispatch_tensor_from_data(c->dev, DISPATCH_F32, 1, shape, x0,
                                     16 * sizeof(float), &cur);
  for (int i = 0; i < c->n && rc == 0; i++) {
    dispatch_tensor *nx;
    rc = dispatch_add(cur, c->one, &nx);
    dispatch_tensor_free(cur);
    cur = rc == 0 ? nx : NULL;
  }
  if (rc == 0 && capture) rc = dispatch_graph_output(cur) < 0 ? -1 : 0;
  *last = cur;
  return rc;
}

static int chain_init(chain *c, const char *spec, int n, int as_graph) {
  c->n = n;
  c->dev = bench_open(spec, c->err, sizeof c->err);
  if (!c->dev) return -1;
  int64_t shape[1] = {16};
  int rc = dispatch_ones(c->dev, DISPATCH_F32, 1, shape, &c->one);
  if (rc < 0) return chain_fail(c, rc, "ones");
  if (!as_graph) return 0;
  float x0[16] = {0};
  dispatch_tensor *last = NULL;
  rc = dispatch_graph_begin(c->dev);
  if (rc == 0) rc = chain_ops(c, x0, &last, 1);
  dispatch_tensor_free(last);
  if (rc == 0) rc = dispatch_graph_end(c->dev, &c->graph);
  return rc < 0 ? chain_fail(c, rc, "capture") : 0;
}

/* One whole chain and its read; checks the result. */
static int chain_run(chain *c, float start) {
  float x0[16], out[16];
  for (int i = 0; i < 16; i++) x0[i] = start + (float)i;
  int rc;
  if (c->graph) {
    int64_t shape[1] = {16};
    dispatch_graph_io in = {DISPATCH_F32, 1, shape, x0, sizeof x0};
    dispatch_graph_io o = {DISPATCH_F32, 1, shape, out, sizeof out};
    rc = dispatch_graph_replay(c->graph, &in, 1, &o, 1);
    if (rc < 0) return chain_fail(c, rc, "replay");
  } else {
    dispatch_tensor *last = NULL;
    rc = chain_ops(c, x0, &last, 0);
    if (rc == 0) rc = dispatch_tensor_read(last, out, sizeof out);
    dispatch_tensor_free(last);
    if (rc < 0) return chain_fail(c, rc, "chain");
  }
  if (out[15] != start + 15.0f + (float)c->n) {
    snprintf(c->err, sizeof c->err, "chain gave %g, expected %g",
             (double)out[15], (double)(start + 15.0f + (float)c->n));
    return -1;
  }
  return 0;
}

/* Adds per second over whole chains for about CHAIN_BUDGET seconds. */
static double chain_rate(chain *c) {
  if (c->err[0]) return NAN;
  long links = 0;
  double t0 = bench_now(), t;
  int k = 0;
  do {
    if (chain_run(c, (float)(k++ % 7)) < 0) return NAN;
    links += c->n;
    t = bench_now() - t0;
  } while (t < (bench_quick() ? 0.01 : CHAIN_BUDGET));
  return (double)links / t;
}

static void chain_free(chain *c) {
  dispatch_graph_free(c->graph);
  dispatch_tensor_free(c->one);
  dispatch_device_close(c->dev);
}

static void bench_chain(void) {
  int quick = bench_quick(), n = quick ? 100 : CHAIN;
  enum { LOCAL, RGRAPH, LGRAPH, ROPS, NVAR };
  chain cs[NVAR];
  memset(cs, 0, sizeof cs);
  const char *remote = bench_remote_spec();
  chain_init(&cs[LOCAL], "local", n, 0);
  chain_init(&cs[LGRAPH], "local", n, 1);
  if (remote) {
    chain_init(&cs[RGRAPH], remote, n, 1);
    chain_init(&cs[ROPS], remote, n, 0);
  } else {
    snprintf(cs[RGRAPH].err, sizeof cs[RGRAPH].err,
             "no server (DISPATCH_BENCH_REMOTE)");
    snprintf(cs[ROPS].err, sizeof cs[ROPS].err,
             "no server (DISPATCH_BENCH_REMOTE)");
  }
  static double v[NVAR][MAX_REPS];
  char metric[128], lmetric[128], ometric[128];
  snprintf(metric, sizeof metric,
           "chain %d adds 16xf32 + read: replayed graph remote", n);
  snprintf(lmetric, sizeof lmetric,
           "chain %d adds 16xf32 + read: replayed graph local", n);
  snprintf(ometric, sizeof ometric,
           "chain %d adds 16xf32 + read: remote op by op (pipelined)", n);
  bench_def dr = {"graph", metric, "ops/s", 0, "same chain LOCAL op by op",
                  0, BENCH_GOAL_RATIO_GE, 0.8};
  bench_def dl = {"graph", lmetric, "ops/s", 0, "same chain LOCAL op by op",
                  0, BENCH_GOAL_NONE, 0};
  /* the chain sent op by op: each add is pipelined behind the last, one
   * read waits at the end (issue 11: at least half LOCAL's rate) */
  bench_def dop = {"graph", ometric, "ops/s", 0, "same chain LOCAL op by op",
                   1, BENCH_GOAL_RATIO_GE, 0.5};
  int reps = 0;
  double start = bench_now();
  for (int r = 0;; r++) {
    if (!bench_more(reps, quick ? 1 : MIN_REPS, quick ? 1 : MAX_REPS,
                    bench_now() - start, TOTAL_BUDGET,
                    bench_unsettled(&dr, v[RGRAPH], v[LOCAL], reps) ||
                        bench_unsettled(&dop, v[ROPS], v[LOCAL], reps)))
      break;
    for (int k = 0; k < NVAR; k++) {
      int i = bench_turn(r, k, NVAR);
      v[i][reps] = chain_rate(&cs[i]);
    }
    reps++;
  }
  for (int i = 0; i < NVAR; i++)
    if (cs[i].err[0]) fprintf(stderr, "graph: chain: %s\n", cs[i].err);
  char note[1100];
  snprintf(note, sizeof note, "%s%s%s", cs[RGRAPH].err,
           cs[RGRAPH].err[0] && cs[LOCAL].err[0] ? "; " : "", cs[LOCAL].err);
  bench_emit(&dr, v[RGRAPH], v[LOCAL], reps, note[0] ? "%s" : NULL, note);
  bench_emit(&dl, v[LGRAPH], v[LOCAL], reps, cs[LGRAPH].err[0] ? "%s" : NULL,
             cs[LGRAPH].err);
  bench_emit(&dop, v[ROPS], v[LOCAL], reps, cs[ROPS].err[0] ? "%s" : NULL,
             cs[ROPS].err);
  for (int i = 0; i < NVAR; i++) chain_free(&cs[i]);
}

/* ------------------------------------------------------------------ */
/* the MLP step                                                        */

typedef struct model {
  const char *name;
  dispatch_device *dev;
  dispatch_tensor *x, *y;
  dispatch_tensor *p[4]; /* AUTODIFF leaves */
  dispatch_optim *opt;
  dispatch_graph *graph; /* NULL: op by op */
  double t[BLOCK];
  float loss;
  char err[512];
} model;

static int fail(model *m, int rc, const char *what) {
  snprintf(m->err, sizeof m->err, "%s %s: %s: %s", m->name, what,
           dispatch_err_name(rc), dispatch_device_errmsg(m->dev));
  return rc;
}

static int sizes_(int *b, int *in, int *hid) {
  int q = bench_quick();
  *b = q ? 16 : BATCH;
  *in = q ? 64 : NIN;
  *hid = q ? 32 : NHID;
  return 0;
}

/* The step's ops; inside a capture the loss becomes the graph's output
 * (and is not read: reads are not recorded). */
static int step_ops(model *m, int capture) {
  dispatch_tensor *h1, *h1b, *h, *l, *lb, *loss;
  dispatch_grads *g = NULL;
  int rc = dispatch_scope_begin(m->dev);
  if (rc < 0) return fail(m, rc, "scope");
  int r = dispatch_matmul(m->x, m->p[0], &h1);
  if (r == 0) r = dispatch_add(h1, m->p[1], &h1b);
  if (r == 0) r = dispatch_relu(h1b, &h);
  if (r == 0) r = dispatch_matmul(h, m->p[2], &l);
  if (r == 0) r = dispatch_add(l, m->p[3], &lb);
  if (r == 0) r = dispatch_cross_entropy(lb, m->y, &loss);
  if (r == 0 && capture && dispatch_graph_output(loss) < 0) r = -1;
  if (r == 0) r = dispatch_backward(loss, &g);
  if (r == 0) r = dispatch_optim_step(m->opt, g);
  if (r == 0 && !capture)
    r = dispatch_tensor_read(loss, &m->loss, sizeof m->loss);
  dispatch_grads_free(g);
  rc = dispatch_scope_end(m->dev);
  if (r < 0) return fail(m, r, "step");
  return rc < 0 ? fail(m, rc, "scope_end") : 0;
}

static int model_init(model *m, const char *spec, int as_graph) {
  m->dev = bench_open(spec, m->err, sizeof m->err);
  if (!m->dev) return -1;
  int b, nin, nhid;
  sizes_(&b, &nin, &nhid);
  float *xs = malloc(sizeof(float) * (size_t)(b * nin));
  int64_t *ys = malloc(sizeof(int64_t) * (size_t)b);
  if (!xs || !ys) {
    free(xs);
    free(ys);
    snprintf(m->err, sizeof m->err, "out of memory");
    return -1;
  }
  for (int i = 0; i < b * nin; i++)
    xs[i] = (float)((i * 2654435761u) % 1000) / 1000.0f;
  for (int i = 0; i < b; i++) ys[i] = (i * 7) % NOUT;
  int64_t xshape[2] = {b, nin}, yshape[1] = {b};
  int rc = dispatch_tensor_from_data(m->dev, DISPATCH_F32, 2, xshape, xs,
                                     sizeof(float) * (size_t)(b * nin), &m->x);
  if (rc == 0)
    rc = dispatch_tensor_from_data(m->dev, DISPATCH_I64, 1, yshape, ys,
                                   sizeof(int64_t) * (size_t)b, &m->y);
  free(xs);
  free(ys);
  if (rc < 0) return fail(m, rc, "upload");
  const int64_t shapes[4][2] = {{nin, nhid}, {nhid, 0}, {nhid, NOUT}, {NOUT, 0}};
  for (int i = 0; i < 4 && rc == 0; i++) {
    dispatch_tensor *t = NULL;
    rc = dispatch_normal(m->dev, DISPATCH_F32, shapes[i][1] ? 2 : 1,
                         shapes[i], 0.0, i % 2 ? 0.01 : 0.05,
                         100 + (uint64_t)i, &t);
    if (rc == 0) rc = dispatch_autodiff(t, &m->p[i]);
    dispatch_tensor_free(t);
  }
  if (rc == 0) rc = dispatch_sgd_new(m->p, 4, LR, 0.0, 0.0, &m->opt);
  if (rc < 0) return fail(m, rc, "init");
  if (as_graph) {
    /* the captured step is a real step: every model takes one here, so
     * all four stay at the same step count */
    rc = dispatch_graph_begin(m->dev);
    if (rc < 0) return fail(m, rc, "graph_begin");
    if (step_ops(m, 1) < 0) return -1;
    rc = dispatch_graph_end(m->dev, &m->graph);
    if (rc < 0) return fail(m, rc, "graph_end");
  } else if (step_ops(m, 0) < 0) {
    return -1;
  }
  rc = dispatch_device_sync(m->dev);
  return rc < 0 ? fail(m, rc, "sync") : 0;
}

static int step(model *m, double *t) {
  double t0 = bench_now();
  if (m->graph) {
    dispatch_graph_io o = {DISPATCH_F32, 0, NULL, &m->loss, sizeof m->loss};
    int rc = dispatch_graph_replay(m->graph, NULL, 0, &o, 1);
    if (rc < 0) return fail(m, rc, "replay");
  } else if (step_ops(m, 0) < 0) {
    return -1;
  }
  if (t) *t = bench_now() - t0;
  if (!isfinite(m->loss)) {
    snprintf(m->err, sizeof m->err, "%s: loss is %g", m->name,
             (double)m->loss);
    return -1;
  }
  return 0;
}

static void model_free(model *m) {
  dispatch_graph_free(m->graph);
  dispatch_optim_free(m->opt);
  for (int i = 0; i < 4; i++) dispatch_tensor_free(m->p[i]);
  dispatch_tensor_free(m->x);
  dispatch_tensor_free(m->y);
  dispatch_device_close(m->dev);
}

enum { LOCAL1, LOCAL2, REMOTE, RGRAPH, NMODEL };

static int run_block(model *ms, int i, int n, int record) {
  if (i == LOCAL1 || i == LOCAL2) bench_threads(i == LOCAL1 ? 1 : 2);
  for (int k = 0; k < n; k++)
    if (step(&ms[i], record ? &ms[i].t[k] : NULL) < 0) return -1;
  return 0;
}

static void bench_mlp(void) {
  int quick = bench_quick();
  int block = quick ? 1 : BLOCK, min_rounds = quick ? 2 : MIN_ROUNDS,
      max_rounds = quick ? 2 : MAX_ROUNDS, gap = quick ? 1000 : GAP_US;
  model ms[NMODEL] = {{.name = "local (1 BLAS thread)"},
                      {.name = "local (2 BLAS threads)"},
                      {.name = "remote op by op"},
                      {.name = "remote graph"}};
  const char *remote = bench_remote_spec();
  int live[NMODEL];
  for (int i = 0; i < NMODEL; i++) {
    const char *spec = i == LOCAL1 || i == LOCAL2 ? "local" : remote;
    if (!spec) {
      snprintf(ms[i].err, sizeof ms[i].err, "no server (DISPATCH_BENCH_REMOTE)");
      live[i] = 0;
      continue;
    }
    live[i] = model_init(&ms[i], spec, i == RGRAPH) == 0;
  }
  for (int i = 0; i < NMODEL; i++)
    if (live[i] && run_block(ms, i, WARMUP, 0) < 0) live[i] = 0;
  static double med[NMODEL][MAX_ROUNDS];
  int b, nin, nhid;
  sizes_(&b, &nin, &nhid);
  char m1[128], m2[128];
  snprintf(m1, sizeof m1, "train step %d-%d-10 b%d remote: replayed graph",
           nin, nhid, b);
  snprintf(m2, sizeof m2, "train step remote: replayed graph vs op by op");
  bench_def d_loc = {"graph", m1, "ms", 1,
                     "best LOCAL step (1 or 2 BLAS threads)", 0,
                     BENCH_GOAL_NONE, 0};
  bench_def d_ops = {"graph", m2, "ms", 1, "REMOTE op by op (optim_step)", 0,
                     BENCH_GOAL_NONE, 0};
  int rounds = 0;
  double start = bench_now();
  for (int r = 0;; r++) {
    if (!bench_more(rounds, min_rounds, max_rounds, bench_now() - start,
                    MLP_BUDGET, 0))
      break;
    for (int k = 0; k < NMODEL; k++) {
      int i = bench_turn(r, k, NMODEL);
      usleep((useconds_t)gap);
      if (live[i] && run_block(ms, i, block, 1) < 0) live[i] = 0;
      med[i][rounds] = live[i] ? bench_median(ms[i].t, block) * 1e3 : NAN;
    }
    rounds++;
  }
  for (int i = 0; i < NMODEL; i++) {
    if (ms[i].err[0]) fprintf(stderr, "graph: mlp: %s\n", ms[i].err);
    else
      fprintf(stderr, "graph: mlp: %s: final loss %.6f\n", ms[i].name,
              (double)ms[i].loss);
  }
  /* same seeds, same steps: REMOTE op by op and the REMOTE graph run the
   * same kernels in the same order, so their losses are equal */
  char agree[256] = "";
  if (live[REMOTE] && live[RGRAPH] && ms[REMOTE].loss != ms[RGRAPH].loss)
    snprintf(agree, sizeof agree, "losses differ: op by op %.9g graph %.9g",
             (double)ms[REMOTE].loss, (double)ms[RGRAPH].loss);
  double *lv[2] = {med[LOCAL1], med[LOCAL2]};
  int best = bench_best_variant(lv, 2, rounds);
  char n1[1600], n2[1200];
  snprintf(n1, sizeof n1, "%s%s%s%sreference: LOCAL with %d BLAS thread(s)",
           ms[RGRAPH].err, ms[RGRAPH].err[0] ? "; " : "", agree,
           agree[0] ? "; " : "", best + 1);
  snprintf(n2, sizeof n2, "%s%s%s", ms[REMOTE].err,
           ms[REMOTE].err[0] && agree[0] ? "; " : "", agree);
  bench_emit(&d_loc, med[RGRAPH], lv[best], rounds, "%s", n1);
  bench_emit(&d_ops, med[RGRAPH], med[REMOTE], rounds, n2[0] ? "%s" : NULL,
             n2);
  for (int i = 0; i < NMODEL; i++) model_free(&ms[i]);
}

int main(void) {
  bench_chain();
  bench_mlp();
  return 0;
}
