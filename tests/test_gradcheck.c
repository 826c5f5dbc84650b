/* Every differentiable op's backward rule against central finite
 * differences in f64.
 *
 * The checker builds loss = sum(f(inputs) * W) with fixed random weights W
 * (so every output element matters, with a different weight), runs
 * backward, then nudges each element of each tracked input by +-eps and
 * compares (L+ - L-) / 2eps with the analytic gradient. Inputs come from
 * the UNIFORM creation op with fixed seeds; ops with kinks (relu, abs,
 * max, maximum, pooling) get inputs kept clear of them. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

#define EPS 1e-6
#define RTOL 1e-5
#define ATOL 1e-7

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(gradcheck, .init = setup, .fini = teardown);

typedef int (*fwd_fn)(dsp_tensor **in, const void *ud, dsp_tensor **out);

/* ------------------------------------------------------------ inputs */

static uint64_t g_seed = 1;

/* f64 tensor of the given shape, uniform in [lo, hi), fresh seed each call */
static dsp_tensor *rnd(int ndim, const int64_t *shape, double lo, double hi) {
  dsp_attrs a = dsp_attrs_none();
  a.ints[0] = DSP_F64;
  a.ints[1] = (int64_t)g_seed++;
  for (int i = 0; i < ndim; i++) a.ints[2 + i] = shape[i];
  a.n_ints = 2 + ndim;
  a.floats[0] = lo;
  a.floats[1] = hi;
  a.n_floats = 2;
  return tu_run(ctx, DSP_OP_UNIFORM, &a, 0, NULL, NULL, NULL);
}

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), \
                   (int64_t[]){__VA_ARGS__}

/* uniform in +-[lo, hi): magnitudes away from 0, where relu/abs kink */
static dsp_tensor *rnd_away0(int ndim, const int64_t *shape, double lo,
                             double hi) {
  dsp_tensor *t = rnd(ndim, shape, -1, 1);
  double *d = dsp_tensor_data(t);
  for (int64_t i = 0; i < t->numel; i++)
    d[i] = (d[i] < 0 ? -1 : 1) * (lo + (hi - lo) * fabs(d[i]));
  return t;
}

/* distinct values 0.1 apart in shuffled order, so max and pooling have
 * no ties within eps */
static dsp_tensor *rnd_distinct(int ndim, const int64_t *shape) {
  dsp_tensor *t = rnd(ndim, shape, 0, 1);
  double *d = dsp_tensor_data(t);
  int64_t n = t->numel;
  int64_t *rank = calloc((size_t)n, sizeof *rank);
  cr_assert_not_null(rank);
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < n; j++)
      rank[i] += d[j] < d[i] || (d[j] == d[i] && j < i);
  for (int64_t i = 0; i < n; i++) d[i] = -1 + 0.1 * (double)rank[i];
  free(rank);
  return t;
}

/* ------------------------------------------------------------ checker */

static double weighted_sum(const dsp_tensor *out, const dsp_tensor *w) {
  const double *o = dsp_tensor_data(out), *wd = dsp_tensor_data(w);
  double s = 0;
  for (int64_t i = 0; i < out->numel; i++) s += o[i] * wd[i];
  return s;
}

static double eval(fwd_fn f, dsp_tensor **in, const void *ud,
                   const dsp_tensor *w) {
  int prev = dsp_set_grad_enabled(ctx, 0);
  dsp_tensor *out;
  int rc = f(in, ud, &out);
  dsp_set_grad_enabled(ctx, prev);
  cr_assert_eq(rc, 0, "forward: %s", dsp_ctx_errmsg(ctx));
  double s = weighted_sum(out, w);
  dsp_tensor_unref(out);
  return s;
}

/* Checks d sum(f(in) * W) / d in[i] for every float input, against
 * central differences. A tensor passed twice is tracked (and checked)
 * once, so reused inputs exercise accumulation. */
static void check(const char *label, fwd_fn f, const void *ud,
                  dsp_tensor **in, int n_in) {
  int check_it[16] = {0};
  for (int i = 0; i < n_in; i++) {
    int dup = 0;
    for (int j = 0; j < i; j++) dup |= in[j] == in[i];
    if (dup || !dsp_dtype_is_float(in[i]->meta.dtype)) continue;
    check_it[i] = 1;
    cr_assert_eq(dsp_track(ctx, in[i]), 0, "%s: track", label);
  }
  dsp_tensor *out;
  int rc = f(in, ud, &out);
  cr_assert_eq(rc, 0, "%s: forward: %s (%s)", label, dispatch_err_name(rc),
               dsp_ctx_errmsg(ctx));
  cr_assert(dsp_is_tracked(out), "%s: output not tracked", label);
  cr_assert_eq(out->meta.dtype, DSP_F64);
  dsp_tensor *w = rnd(out->meta.ndim, out->meta.shape, -1, 1);
  dsp_tensor *prod = tu_run(ctx, DSP_OP_MUL, NULL, 2, out, w, NULL);
  dsp_tensor *loss = tu_run(ctx, DSP_OP_SUM, NULL, 1, prod, NULL, NULL);
  dsp_grads *g;
  rc = dsp_backward(ctx, loss, 0, &g);
  cr_assert_eq(rc, 0, "%s: backward: %s (%s)", label, dispatch_err_name(rc),
               dsp_ctx_errmsg(ctx));
  dsp_tensor_unref(loss);
  dsp_tensor_unref(prod);
  dsp_tensor_unref(out);
  for (int i = 0; i < n_in; i++) {
    if (!check_it[i]) continue;
    dsp_tensor *gi;
    rc = dsp_grads_get(ctx, g, in[i], &gi);
    cr_assert_eq(rc, 0, "%s: no gradient for input %d: %s", label, i,
                 dsp_ctx_errmsg(ctx));
    cr_assert(dsp_meta_equal(&gi->meta, &in[i]->meta),
              "%s: gradient %d has the wrong shape", label, i);
    double *x = dsp_tensor_data(in[i]);
    const double *ga = dsp_tensor_data(gi);
    for (int64_t j = 0; j < in[i]->numel; j++) {
      double keep = x[j];
      x[j] = keep + EPS;
      double lp = eval(f, in, ud, w);
      x[j] = keep - EPS;
      double lm = eval(f, in, ud, w);
      x[j] = keep;
      double num = (lp - lm) / (2 * EPS);
      double tol = ATOL + RTOL * fmax(fabs(num), fabs(ga[j]));
      cr_assert(fabs(num - ga[j]) <= tol,
                "%s: d/d in%d[%lld]: analytic %.10g, numeric %.10g", label, i,
                (long long)j, ga[j], num);
    }
    dsp_tensor_unref(gi);
  }
  dsp_grads_free(g);
  dsp_tensor_unref(w);
}

/* f = one op with fixed attrs */
typedef struct one_op {
  dsp_opcode op;
  dsp_attrs a;
  int n;
} one_op;

static int run_one(dsp_tensor **in, const void *ud, dsp_tensor **out) {
  const one_op *o = ud;
  return dsp_op(ctx, o->op, in, o->n, &o->a, out);
}

/* Runs the op checker on inputs that it frees afterwards. */
static void check_op(const char *label, dsp_opcode op, dsp_attrs a, int n,
                     dsp_tensor **in) {
  one_op o = {op, a, n};
  check(label, run_one, &o, in, n);
  for (int i = 0; i < n; i++) {
    int dup = 0;
    for (int j = 0; j < i; j++) dup |= in[j] == in[i];
    if (!dup) dsp_tensor_unref(in[i]);
  }
}

static dsp_attrs ints(int n, const int64_t *v) { return dsp_attrs_ints(n, v); }
#define INTS(...) ints((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), \
                       (int64_t[]){__VA_ARGS__})
static dsp_attrs red(dsp_attrs a, int keepdim) {
  a.floats[0] = keepdim;
  a.n_floats = 1;
  return a;
}

/* ------------------------------------------------------------ tests */

Test(gradcheck, elementwise_binary_with_broadcast) {
  static const dsp_opcode ops[] = {DSP_OP_ADD, DSP_OP_SUB, DSP_OP_MUL,
                                   DSP_OP_DIV};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    const char *nm = dsp_op_lookup(ops[k])->name;
    dsp_tensor *same[2] = {rnd(SHAPE(2, 3), -1, 1), rnd(SHAPE(2, 3), 0.5, 2)};
    check_op(nm, ops[k], dsp_attrs_none(), 2, same);
    dsp_tensor *b1[2] = {rnd(SHAPE(2, 3), -1, 1), rnd(SHAPE(3), 0.5, 2)};
    check_op(nm, ops[k], dsp_attrs_none(), 2, b1);
    dsp_tensor *b2[2] = {rnd(SHAPE(4, 1), 0.5, 2), rnd(SHAPE(2, 1, 5), 0.5, 2)};
    check_op(nm, ops[k], dsp_attrs_none(), 2, b2);
    dsp_tensor *x = rnd(SHAPE(3), 0.5, 2);
    dsp_tensor *reused[2] = {x, x};
    check_op(nm, ops[k], dsp_attrs_none(), 2, reused);
  }
}

Test(gradcheck, maximum_minimum_away_from_ties) {
  static const dsp_opcode ops[] = {DSP_OP_MAXIMUM, DSP_OP_MINIMUM};
  for (int k = 0; k < 2; k++) {
    const char *nm = dsp_op_lookup(ops[k])->name;
    dsp_tensor *a = rnd(SHAPE(3, 4), -1, 1), *b = rnd(SHAPE(4), -1, 1);
    /* keep |a - b| >= 0.05 so no tie sits within eps */
    double *ad = dsp_tensor_data(a), *bd = dsp_tensor_data(b);
    for (int i = 0; i < 12; i++)
      if (fabs(ad[i] - bd[i % 4]) < 0.05) ad[i] = bd[i % 4] + 0.1;
    dsp_tensor *in[2] = {a, b};
    check_op(nm, ops[k], dsp_attrs_none(), 2, in);
  }
}

Test(gradcheck, where_routes_to_both_branches) {
  uint8_t mv[6] = {1, 0, 0, 1, 1, 0};
  dsp_tensor *m = tu_bool(ctx, 2, (int64_t[]){2, 3}, mv);
  dsp_tensor *in[3] = {m, rnd(SHAPE(2, 3), -1, 1), rnd(SHAPE(3), -1, 1)};
  check_op("where", DSP_OP_WHERE, dsp_attrs_none(), 3, in);
}

Test(gradcheck, scalar_forms) {
  static const struct { dsp_opcode op; double s; } cases[] = {
      {DSP_OP_ADD_SCALAR, 1.5},  {DSP_OP_SUB_SCALAR, -2},
      {DSP_OP_MUL_SCALAR, -3},   {DSP_OP_DIV_SCALAR, 4},
      {DSP_OP_POW_SCALAR, 2.5},  {DSP_OP_POW_SCALAR, -1.5},
      {DSP_OP_POW_SCALAR, 0},    {DSP_OP_RSUB_SCALAR, 2},
      {DSP_OP_RDIV_SCALAR, -3},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    dsp_tensor *in[1] = {rnd(SHAPE(2, 3), 0.5, 2)};
    check_op(dsp_op_lookup(cases[k].op)->name, cases[k].op,
             dsp_attrs_f1(cases[k].s), 1, in);
  }
}

Test(gradcheck, unary) {
  static const struct { dsp_opcode op; double lo, hi; int away0; } cases[] = {
      {DSP_OP_NEG, -2, 2, 0},     {DSP_OP_EXP, -2, 2, 0},
      {DSP_OP_LOG, 0.2, 3, 0},    {DSP_OP_SQRT, 0.2, 3, 0},
      {DSP_OP_ABS, 0.05, 2, 1},   {DSP_OP_SIGN, 0.05, 2, 1},
      {DSP_OP_RELU, 0.05, 2, 1},  {DSP_OP_SIGMOID, -4, 4, 0},
      {DSP_OP_TANH, -2, 2, 0},    {DSP_OP_GELU, -3, 3, 0},
      {DSP_OP_SILU, -4, 4, 0},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    dsp_tensor *in[1] = {cases[k].away0
                             ? rnd_away0(SHAPE(3, 4), cases[k].lo, cases[k].hi)
                             : rnd(SHAPE(3, 4), cases[k].lo, cases[k].hi)};
    check_op(dsp_op_lookup(cases[k].op)->name, cases[k].op, dsp_attrs_none(),
             1, in);
  }
}

Test(gradcheck, reductions_with_dims_and_keepdim) {
  static const dsp_opcode ops[] = {DSP_OP_SUM, DSP_OP_MEAN, DSP_OP_MAX};
  for (int k = 0; k < 3; k++) {
    const char *nm = dsp_op_lookup(ops[k])->name;
    dsp_attrs as[] = {dsp_attrs_none(), red(INTS(1), 0), red(INTS(1), 1),
                      red(INTS(0, 2), 1), red(INTS(-1), 0),
                      red(INTS(0, -1), 0)};
    for (size_t j = 0; j < sizeof as / sizeof as[0]; j++) {
      dsp_tensor *in[1] = {rnd_distinct(SHAPE(2, 3, 4))};
      check_op(nm, ops[k], as[j], 1, in);
    }
  }
}

Test(gradcheck, shape_ops) {
  dsp_tensor *a[1] = {rnd(SHAPE(2, 3, 4), -1, 1)};
  check_op("reshape", DSP_OP_RESHAPE, INTS(4, -1), 1, a);
  dsp_tensor *b[1] = {rnd(SHAPE(2, 3, 4), -1, 1)};
  check_op("permute", DSP_OP_PERMUTE, INTS(2, 0, 1), 1, b);
  dsp_tensor *c[1] = {rnd(SHAPE(2, 3, 4), -1, 1)};
  check_op("transpose", DSP_OP_TRANSPOSE, INTS(0, -1), 1, c);
  dsp_tensor *d[1] = {rnd(SHAPE(5, 4), -1, 1)};
  check_op("slice", DSP_OP_SLICE, INTS(0, 1, 5, 2), 1, d);
  dsp_tensor *d2[1] = {rnd(SHAPE(3, 6), -1, 1)};
  check_op("slice clamped", DSP_OP_SLICE, INTS(-1, -4, 100, 1), 1, d2);
  dsp_tensor *e[3] = {rnd(SHAPE(2, 1), -1, 1), rnd(SHAPE(2, 3), -1, 1),
                      rnd(SHAPE(2, 2), -1, 1)};
  check_op("cat", DSP_OP_CAT, INTS(1), 3, e);
  dsp_tensor *x = rnd(SHAPE(2, 3), -1, 1);
  dsp_tensor *f[3] = {x, rnd(SHAPE(2, 3), -1, 1), x};
  check_op("stack", DSP_OP_STACK, INTS(-1), 3, f);
  dsp_tensor *h[1] = {rnd(SHAPE(4, 1), -1, 1)};
  check_op("broadcast_to", DSP_OP_BROADCAST_TO, INTS(2, 4, 5), 1, h);
  int64_t idx[4] = {3, 0, 3, 1};
  dsp_tensor *i0[2] = {rnd(SHAPE(5, 3), -1, 1),
                       tu_i64(ctx, 1, (int64_t[]){4}, idx)};
  check_op("index_select dim 0", DSP_OP_INDEX_SELECT, INTS(0), 2, i0);
  int64_t idx1[3] = {2, 2, 0};
  dsp_tensor *i1[2] = {rnd(SHAPE(2, 3, 2), -1, 1),
                       tu_i64(ctx, 1, (int64_t[]){3}, idx1)};
  check_op("index_select dim 1", DSP_OP_INDEX_SELECT, INTS(1), 2, i1);
  dsp_tensor *k[1] = {rnd(SHAPE(2, 3), -1, 1)};
  check_op("cast f64->f64", DSP_OP_CAST, INTS(DSP_F64), 1, k);
}

Test(gradcheck, matmul_all_ranks) {
  static const struct { int an, bn; int64_t as[4], bs[4]; } cases[] = {
      {2, 2, {3, 4}, {4, 5}},       {1, 2, {4}, {4, 5}},
      {2, 1, {3, 4}, {4}},          {1, 1, {4}, {4}},
      {3, 2, {2, 3, 4}, {4, 5}},    {2, 3, {3, 4}, {2, 4, 5}},
      {4, 3, {2, 1, 3, 4}, {3, 4, 2}}, {1, 3, {4}, {2, 4, 3}},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    dsp_tensor *in[2] = {rnd(cases[k].an, cases[k].as, -1, 1),
                         rnd(cases[k].bn, cases[k].bs, -1, 1)};
    check_op("matmul", DSP_OP_MATMUL, dsp_attrs_none(), 2, in);
  }
  dsp_tensor *x = rnd(SHAPE(3, 3), -1, 1);
  dsp_tensor *sq[2] = {x, x};
  check_op("matmul x@x", DSP_OP_MATMUL, dsp_attrs_none(), 2, sq);
}

Test(gradcheck, softmax_family_and_losses) {
  dsp_tensor *a[1] = {rnd(SHAPE(3, 4), -2, 2)};
  check_op("softmax", DSP_OP_SOFTMAX, INTS(1), 1, a);
  dsp_tensor *b[1] = {rnd(SHAPE(2, 3, 4), -2, 2)};
  check_op("softmax dim 0", DSP_OP_SOFTMAX, INTS(0), 1, b);
  dsp_tensor *c[1] = {rnd(SHAPE(3, 4), -2, 2)};
  check_op("log_softmax", DSP_OP_LOG_SOFTMAX, INTS(-1), 1, c);
  int64_t lab[4] = {2, 0, 4, 2};
  dsp_tensor *d[2] = {rnd(SHAPE(4, 5), -2, 2),
                      tu_i64(ctx, 1, (int64_t[]){4}, lab)};
  check_op("cross_entropy", DSP_OP_CROSS_ENTROPY, dsp_attrs_none(), 2, d);
  dsp_tensor *e[2] = {rnd(SHAPE(2, 3), -1, 1), rnd(SHAPE(2, 3), -1, 1)};
  check_op("mse", DSP_OP_MSE, dsp_attrs_none(), 2, e);
}

/* attention: q, k, v (the bool key mask is not differentiated); Tq = 3
 * against Tk = 4 and 2, causal top-left, a mask dropping keys and one
 * batch entry whose rows see no key at all (gradient 0) */
static dsp_attrs attn_attrs(int causal, int has_mask, double scale) {
  dsp_attrs a = dsp_attrs_f1(scale);
  a.ints[0] = causal;
  a.ints[1] = has_mask;
  a.n_ints = 2;
  return a;
}

Test(gradcheck, attention) {
  dsp_tensor *a[3] = {rnd(SHAPE(2, 2, 3, 4), -1, 1),
                      rnd(SHAPE(2, 2, 4, 4), -1, 1),
                      rnd(SHAPE(2, 2, 4, 3), -1, 1)};
  check_op("attention", DSP_OP_ATTENTION, attn_attrs(0, 0, 0.0), 3, a);
  dsp_tensor *b[3] = {rnd(SHAPE(1, 2, 3, 2), -1, 1),
                      rnd(SHAPE(1, 2, 2, 2), -1, 1),
                      rnd(SHAPE(1, 2, 2, 3), -1, 1)};
  check_op("attention causal Tq > Tk", DSP_OP_ATTENTION, attn_attrs(1, 0, 0.7),
           3, b);
  uint8_t m[8] = {1, 0, 1, 1, 0, 0, 0, 0};
  dsp_tensor *c[4] = {rnd(SHAPE(2, 1, 3, 2), -1, 1),
                      rnd(SHAPE(2, 1, 4, 2), -1, 1),
                      rnd(SHAPE(2, 1, 4, 2), -1, 1),
                      tu_bool(ctx, 2, (int64_t[]){2, 4}, m)};
  check_op("attention causal, key mask", DSP_OP_ATTENTION,
           attn_attrs(1, 1, 0.0), 4, c);
}

Test(gradcheck, conv2d) {
  dsp_tensor *a[2] = {rnd(SHAPE(2, 2, 5, 5), -1, 1),
                      rnd(SHAPE(3, 2, 3, 3), -1, 1)};
  check_op("conv2d default", DSP_OP_CONV2D, dsp_attrs_none(), 2, a);
  dsp_tensor *b[2] = {rnd(SHAPE(1, 2, 6, 5), -1, 1),
                      rnd(SHAPE(2, 2, 3, 2), -1, 1)};
  check_op("conv2d stride 2 pad 1", DSP_OP_CONV2D, INTS(2, 1, 1, 1), 2, b);
  dsp_tensor *c[2] = {rnd(SHAPE(1, 1, 7, 7), -1, 1),
                      rnd(SHAPE(2, 1, 2, 3), -1, 1)};
  check_op("conv2d dilation 2", DSP_OP_CONV2D, INTS(1, 2, 2, 0, 2, 2), 2, c);
}

Test(gradcheck, pooling_and_dropout) {
  dsp_tensor *a[1] = {rnd_distinct(SHAPE(1, 2, 4, 4))};
  check_op("max_pool2d", DSP_OP_MAX_POOL2D, INTS(2, 2), 1, a);
  dsp_tensor *b[1] = {rnd_distinct(SHAPE(2, 1, 5, 5))};
  check_op("max_pool2d stride 1 pad 1", DSP_OP_MAX_POOL2D,
           INTS(3, 3, 1, 1, 1, 1), 1, b);
  dsp_tensor *c[1] = {rnd(SHAPE(1, 2, 4, 4), -1, 1)};
  check_op("avg_pool2d", DSP_OP_AVG_POOL2D, INTS(2, 2), 1, c);
  dsp_tensor *d[1] = {rnd(SHAPE(2, 1, 5, 5), -1, 1)};
  check_op("avg_pool2d stride 2 pad 1", DSP_OP_AVG_POOL2D,
           INTS(3, 3, 2, 2, 1, 1), 1, d);
  dsp_attrs dp = INTS(1234);
  dp.floats[0] = 0.3;
  dp.n_floats = 1;
  dsp_tensor *e[1] = {rnd(SHAPE(4, 5), -1, 1)};
  check_op("dropout", DSP_OP_DROPOUT, dp, 1, e);
}

/* issue 23: embedding (repeated indices accumulate) and the norms' fused backward (dx, dweight, dbias sliced apart) */
static dsp_attrs with_eps(dsp_attrs a, double eps) {
  a.floats[0] = eps;
  a.n_floats = 1;
  return a;
}

Test(gradcheck, embedding_and_norms) {
  int64_t idx[6] = {3, 0, 3, 1, 4, 3};
  dsp_tensor *e[2] = {rnd(SHAPE(5, 3), -1, 1),
                      tu_i64(ctx, 2, (int64_t[]){2, 3}, idx)};
  check_op("embedding", DSP_OP_EMBEDDING, INTS(INT64_MIN), 2, e);
  /* padding_idx departs from the derivative on purpose (its row gets no
   * gradient, as in PyTorch): test_ops_norm checks it by hand */
  dsp_tensor *a[3] = {rnd(SHAPE(3, 5), -2, 2), rnd(SHAPE(5), 0.5, 1.5),
                      rnd(SHAPE(5), -1, 1)};
  check_op("layer_norm affine", DSP_OP_LAYER_NORM, with_eps(INTS(1, 1, 1), 1e-5),
           3, a);
  dsp_tensor *b[1] = {rnd(SHAPE(2, 3, 4), -2, 2)};
  check_op("layer_norm nlast 2", DSP_OP_LAYER_NORM, with_eps(INTS(2, 0, 0), 1e-5),
           1, b);
  dsp_tensor *c[2] = {rnd(SHAPE(2, 3, 4), -2, 2), rnd(SHAPE(3, 4), -1, 1)};
  check_op("layer_norm bias only", DSP_OP_LAYER_NORM,
           with_eps(INTS(2, 0, 1), 0.1), 2, c);
  dsp_tensor *d[2] = {rnd(SHAPE(4, 6), -2, 2), rnd(SHAPE(6), 0.5, 1.5)};
  check_op("rms_norm weight", DSP_OP_RMS_NORM, with_eps(INTS(1, 1), 1e-5), 2, d);
  dsp_tensor *f[1] = {rnd(SHAPE(2, 2, 3), -2, 2)};
  check_op("rms_norm nlast 3", DSP_OP_RMS_NORM, with_eps(INTS(3, 0), 1e-3), 1, f);
}

/* A composite: softmax(x @ W + b) weighted by x again through sigmoid, so
 * x feeds three ops and b is broadcast over rows. */
static int mlp_like(dsp_tensor **in, const void *ud, dsp_tensor **out) {
  (void)ud;
  dsp_tensor *x = in[0], *w = in[1], *b = in[2], *t[6] = {0};
  dsp_attrs sm = INTS(1);
  int rc;
  if ((rc = dsp_op(ctx, DSP_OP_MATMUL, (dsp_tensor *[]){x, w}, 2, NULL, &t[0])) ||
      (rc = dsp_op(ctx, DSP_OP_ADD, (dsp_tensor *[]){t[0], b}, 2, NULL, &t[1])) ||
      (rc = dsp_op(ctx, DSP_OP_SOFTMAX, &t[1], 1, &sm, &t[2])) ||
      (rc = dsp_op(ctx, DSP_OP_SIGMOID, &x, 1, NULL, &t[3])) ||
      (rc = dsp_op(ctx, DSP_OP_MUL, (dsp_tensor *[]){x, t[3]}, 2, NULL, &t[4])) ||
      (rc = dsp_op(ctx, DSP_OP_MATMUL, (dsp_tensor *[]){t[4], w}, 2, NULL, &t[5])))
    goto out;
  rc = dsp_op(ctx, DSP_OP_MUL, (dsp_tensor *[]){t[2], t[5]}, 2, NULL, out);
out:
  for (int i = 0; i < 6; i++) dsp_tensor_unref(t[i]);
  return rc;
}

Test(gradcheck, composite_graph_with_reused_inputs) {
  dsp_tensor *in[3] = {rnd(SHAPE(3, 4), -1, 1), rnd(SHAPE(4, 2), -1, 1),
                       rnd(SHAPE(2), -1, 1)};
  check("composite", mlp_like, NULL, in, 3);
  for (int i = 0; i < 3; i++) dsp_tensor_unref(in[i]);
}
