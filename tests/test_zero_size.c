/* Empty tensors beside huge dims, bool bytes, and arity messages.
 *
 * A tensor with one zero-size dim has no elements whatever its other dims
 * are, so before the fix a client could admit f32 [2^40, 0] (or
 * [2^63-1, 0]) and make a kernel walk the huge dim doing nothing: a worker
 * spun for hours and SIGTERM never finished. Now every meta is bounded by
 * its span (the product of its sizes with zeros counted as 1), the server
 * holds spans to --max-elements, and the op runner skips the kernel of an
 * empty result. Each op family runs here on [2^40, 0]-style shapes, once
 * in process (dsp_op) and once through a real dispatch-server on 127.0.0.1
 * whose --max-elements admits them; each must come back with the right
 * empty (or all-zero / NaN) result or a clear DISPATCH_E* error, the
 * session must answer a sync afterwards and the server must exit on
 * SIGTERM. A spinning kernel shows up as a Criterion timeout (a safety
 * net, not a timing check).
 *
 * Also: bool uploads with a byte other than 0 or 1 are refused the same
 * way in process, through the client library and on the wire; and the
 * arity message of a variadic op names its real range. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#define H (INT64_C(1) << 40)
#define I64MAX INT64_MAX

static sp_server g_srv;

static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

/* A server whose element limit (2^50, the most it takes) admits the
 * [2^40, 0]-style shapes below. */
static void start_wide(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2",
                        "--max-elements", "1125899906842624", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

/* The default element limit (2^31). */
static void start_default(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "zero-size"), 0);
}

/* ------------------------------------------------------------------ */
/* the cases                                                           */

typedef struct zin {
  int dtype;
  int ndim;
  int64_t shape[DSP_MAX_DIMS];
  const void *data; /* NULL for an empty tensor */
  size_t nbytes;
} zin;

typedef struct zcase {
  const char *name;
  int op;
  int n_in;
  zin in[4];
  int n_ints;
  int64_t ints[DSP_MAX_ATTR_INTS];
  int n_floats;
  double floats[DSP_MAX_ATTR_FLOATS];
  int local_only; /* in-place optimizer ops travel as a Step, not an Op */
  int want_rc;    /* 0, or the DISPATCH_E* code of the refusal */
  int ndim;       /* expected result shape when want_rc is 0 */
  int64_t shape[DSP_MAX_DIMS];
  double fill; /* every element of a non-empty f32 result (NaN: NaN) */
} zcase;

static const int64_t k_ix3[3] = {0, 1, 2};
/* the bytes of a small non-empty input given without data: all zero */
static const uint8_t k_zero_bytes[1024];
static const int64_t k_ixbad[1] = {H + 1};

#define F32(...) {DSP_F32, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, NULL, 0}
#define F64(...) {DSP_F64, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, NULL, 0}
#define BOOLT(...) {DSP_BOOL, sizeof((int64_t[]){__VA_ARGS__}) / 8, {__VA_ARGS__}, NULL, 0}
#define IX3 {DSP_I64, 1, {3}, k_ix3, sizeof k_ix3}
#define IXBAD {DSP_I64, 1, {1}, k_ixbad, sizeof k_ixbad}
#define IX0 {DSP_I64, 1, {0}, NULL, 0}
#define INTS(...) .n_ints = sizeof((int64_t[]){__VA_ARGS__}) / 8, .ints = {__VA_ARGS__}
#define FLOATS(...) .n_floats = sizeof((double[]){__VA_ARGS__}) / 8, .floats = {__VA_ARGS__}
#define OUT(...) .ndim = sizeof((int64_t[]){__VA_ARGS__}) / 8, .shape = {__VA_ARGS__}

static const zcase k_cases[] = {
    /* nn: softmax family, each along the empty and the huge dim */
    {"softmax dim 1", DSP_OP_SOFTMAX, 1, {F32(H, 0)}, INTS(1), OUT(H, 0)},
    {"softmax dim 0", DSP_OP_SOFTMAX, 1, {F32(H, 0)}, INTS(0), OUT(H, 0)},
    {"log_softmax", DSP_OP_LOG_SOFTMAX, 1, {F32(0, H)}, INTS(-1), OUT(0, H)},
    {"softmax_backward", DSP_OP_SOFTMAX_BACKWARD, 2, {F32(H, 0), F32(H, 0)},
     INTS(1), OUT(H, 0)},
    {"log_softmax_backward", DSP_OP_LOG_SOFTMAX_BACKWARD, 2,
     {F32(H, 0, 3), F32(H, 0, 3)}, INTS(0), OUT(H, 0, 3)},
    {"mse", DSP_OP_MSE, 2, {F32(H, 0), F32(H, 0)},
     .want_rc = DISPATCH_ESHAPE},
    {"cross_entropy", DSP_OP_CROSS_ENTROPY, 2, {F32(0, H), IX0},
     .want_rc = DISPATCH_ESHAPE},
    {"dropout", DSP_OP_DROPOUT, 1, {F32(H, 0)}, INTS(7), FLOATS(0.5),
     OUT(H, 0)},
    {"max_pool2d", DSP_OP_MAX_POOL2D, 1, {F32(H, 0, 4, 4)}, INTS(2, 2),
     OUT(H, 0, 2, 2)},
    {"avg_pool2d", DSP_OP_AVG_POOL2D, 1, {F32(0, H, 4, 4)}, INTS(2, 2),
     OUT(0, H, 2, 2)},
    {"max_pool2d_backward", DSP_OP_MAX_POOL2D_BACKWARD, 2,
     {F32(H, 0, 2, 2), F32(H, 0, 4, 4)}, INTS(2, 2), OUT(H, 0, 4, 4)},
    {"avg_pool2d_backward", DSP_OP_AVG_POOL2D_BACKWARD, 2,
     {F32(0, H, 2, 2), F32(0, H, 4, 4)}, INTS(2, 2), OUT(0, H, 4, 4)},
    {"conv2d empty batch", DSP_OP_CONV2D, 2, {F32(0, 3, 4, 4), F32(2, 3, 3, 3)},
     OUT(0, 2, 2, 2)},
    {"conv2d no channels", DSP_OP_CONV2D, 2, {F32(2, 0, 4, 4), F32(3, 0, 3, 3)},
     OUT(2, 3, 2, 2), .fill = 0},
    /* shape family */
    {"slice huge dim", DSP_OP_SLICE, 1, {F32(H, 0)}, INTS(0, 0, H, 1),
     OUT(H, 0)},
    {"slice empty dim", DSP_OP_SLICE, 1, {F32(H, 0)}, INTS(1, 0, 5, 1),
     OUT(H, 0)},
    {"slice_backward", DSP_OP_SLICE_BACKWARD, 1, {F32(H, 0)},
     INTS(0, 0, H, 1, H, 0), OUT(H, 0)},
    {"cat dim 0", DSP_OP_CAT, 2, {F32(H, 0), F32(5, 0)}, INTS(0),
     OUT(H + 5, 0)},
    {"cat dim 1", DSP_OP_CAT, 2, {F32(H, 0), F32(H, 0)}, INTS(1), OUT(H, 0)},
    {"stack dim 0", DSP_OP_STACK, 2, {F32(H, 0), F32(H, 0)}, INTS(0),
     OUT(2, H, 0)},
    {"stack dim 2", DSP_OP_STACK, 2, {F32(H, 0), F32(H, 0)}, INTS(2),
     OUT(H, 0, 2)},
    {"index_select huge dim", DSP_OP_INDEX_SELECT, 2, {F32(H, 0), IX3},
     INTS(0), OUT(3, 0)},
    {"index_select empty index", DSP_OP_INDEX_SELECT, 2, {F32(H, 0), IX0},
     INTS(1), OUT(H, 0)},
    /* an empty result does not hide an index out of range */
    {"index_select bad index", DSP_OP_INDEX_SELECT, 2, {F32(H, 0), IXBAD},
     INTS(0), .want_rc = DISPATCH_EINDEX},
    {"index_select_backward", DSP_OP_INDEX_SELECT_BACKWARD, 2,
     {F32(3, 0), IX3}, INTS(0, H), OUT(H, 0)},
    {"permute", DSP_OP_PERMUTE, 1, {F32(H, 0, 2)}, INTS(2, 1, 0),
     OUT(2, 0, H)},
    {"transpose", DSP_OP_TRANSPOSE, 1, {F32(H, 0)}, INTS(0, 1), OUT(0, H)},
    {"reshape", DSP_OP_RESHAPE, 1, {F32(H, 0)}, INTS(0, 7, H), OUT(0, 7, H)},
    {"broadcast_to", DSP_OP_BROADCAST_TO, 1, {F32(1, 0)}, INTS(H, 0),
     OUT(H, 0)},
    {"cast", DSP_OP_CAST, 1, {F32(H, 0)}, INTS(DSP_F64), OUT(H, 0)},
    /* elementwise */
    {"add", DSP_OP_ADD, 2, {F32(H, 0), F32(H, 0)}, OUT(H, 0)},
    {"add broadcast", DSP_OP_ADD, 2, {F32(H, 1, 0), F32(1, 5, 1)},
     OUT(H, 5, 0)},
    {"eq", DSP_OP_EQ, 2, {F64(0, H), F64(1)}, OUT(0, H)},
    {"where", DSP_OP_WHERE, 3, {BOOLT(H, 0), F32(H, 0), F32(1)}, OUT(H, 0)},
    {"exp", DSP_OP_EXP, 1, {F32(H, 0)}, OUT(H, 0)},
    {"mul_scalar", DSP_OP_MUL_SCALAR, 1, {F32(0, H)}, FLOATS(2.0), OUT(0, H)},
    {"relu_backward", DSP_OP_RELU_BACKWARD, 2, {F32(H, 0), F32(H, 0)},
     OUT(H, 0)},
    /* reductions: an empty reduction of sum/mean is 0/NaN, of max an error */
    {"sum all", DSP_OP_SUM, 1, {F32(H, 0)}, OUT(), .fill = 0},
    {"sum dim 0", DSP_OP_SUM, 1, {F32(H, 0)}, INTS(0), OUT(0)},
    {"sum keepdim", DSP_OP_SUM, 1, {F32(H, 0, 2)}, INTS(2), FLOATS(1),
     OUT(H, 0, 1)},
    {"mean all", DSP_OP_MEAN, 1, {F32(0, H)}, OUT(), .fill = NAN},
    {"max empty dim", DSP_OP_MAX, 1, {F32(H, 0)}, INTS(1),
     .want_rc = DISPATCH_ESHAPE},
    {"argmax huge dim", DSP_OP_ARGMAX, 1, {F32(H, 0)}, INTS(0), OUT(0)},
    /* matmul: empty batch, and an empty inner dim giving zeros */
    {"matmul batch", DSP_OP_MATMUL, 2, {F32(H, 0, 2), F32(2, 3)},
     OUT(H, 0, 3)},
    {"matmul inner 0", DSP_OP_MATMUL, 2, {F32(2, 0), F32(0, 3)}, OUT(2, 3),
     .fill = 0},
    /* creation */
    {"zeros", DSP_OP_ZEROS, 0, {{0}}, INTS(DSP_F32, 0, H, 0), OUT(0, H, 0)},
    {"ones", DSP_OP_ONES, 0, {{0}}, INTS(DSP_F64, H, 0), OUT(H, 0)},
    {"full", DSP_OP_FULL, 0, {{0}}, INTS(DSP_I64, 0, H), FLOATS(3),
     OUT(0, H)},
    {"uniform", DSP_OP_UNIFORM, 0, {{0}}, INTS(DSP_F32, 1, H, 0),
     FLOATS(0, 1), OUT(H, 0)},
    {"normal", DSP_OP_NORMAL, 0, {{0}}, INTS(DSP_F32, 1, 0, H), FLOATS(0, 1),
     OUT(0, H)},
    /* the issue's examples: spans past int64 are refused */
    {"zeros [0, 2^63-1, 0]", DSP_OP_ZEROS, 0, {{0}},
     INTS(DSP_F32, 0, I64MAX, 0), .want_rc = DISPATCH_EOVERFLOW},
    {"broadcast_to past int64", DSP_OP_BROADCAST_TO, 1, {F32(1, 0)},
     INTS(I64MAX, 2, 0), .want_rc = DISPATCH_EOVERFLOW},
    {"reshape past int64", DSP_OP_RESHAPE, 1, {F32(H, 0)},
     INTS(I64MAX, 0, 2), .want_rc = DISPATCH_EOVERFLOW},
    /* in-place optimizer update of an empty parameter */
    {"sgd_step", DSP_OP_SGD_STEP, 3, {F32(H, 0), F32(H, 0), F32(H, 0)},
     FLOATS(0.1, 0.9, 0), .local_only = 1, OUT(H, 0)},
    {"adam_step", DSP_OP_ADAM_STEP, 4,
     {F32(0, H), F32(0, H), F32(0, H), F32(0, H)}, INTS(1),
     FLOATS(1e-3, 0.9, 0.999, 1e-8), .local_only = 1, OUT(0, H)},
};
#define N_CASES (int)(sizeof k_cases / sizeof k_cases[0])

static int64_t shape_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

/* The bytes of input z: its data, or zeros for a small one given without. */
static void input_bytes(const zin *z, const void **p, size_t *nb) {
  *p = z->data;
  *nb = z->nbytes;
  if (z->data) return;
  dsp_meta m = {(dsp_dtype)z->dtype, z->ndim, {0}};
  *nb = (size_t)shape_numel(z->ndim, z->shape) * dsp_dtype_size(m.dtype);
  cr_assert_leq(*nb, sizeof k_zero_bytes);
  *p = *nb ? k_zero_bytes : NULL;
}

/* Every element of a non-empty f32 result equals c->fill. */
static void check_values(const zcase *c, const float *v, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    if (isnan(c->fill))
      cr_assert(isnan(v[i]), "%s: element %lld is %g, want NaN", c->name,
                (long long)i, (double)v[i]);
    else
      cr_assert_eq(v[i], (float)c->fill, "%s: element %lld is %g, want %g",
                   c->name, (long long)i, (double)v[i], c->fill);
  }
}

/* ------------------------------------------------------------------ */
/* in process                                                          */

static dsp_attrs case_attrs(const zcase *c) {
  dsp_attrs a = dsp_attrs_ints(c->n_ints, c->ints);
  a.n_floats = c->n_floats;
  for (int i = 0; i < c->n_floats; i++) a.floats[i] = c->floats[i];
  return a;
}

Test(zero_size, every_family_in_process, .timeout = 120) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cr_assert_not_null(ctx);
  for (int k = 0; k < N_CASES; k++) {
    const zcase *c = &k_cases[k];
    dsp_tensor *in[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    for (int i = 0; i < c->n_in; i++) {
      dsp_meta m = {(dsp_dtype)c->in[i].dtype, c->in[i].ndim, {0}};
      memcpy(m.shape, c->in[i].shape, sizeof m.shape);
      const void *p;
      size_t nb;
      input_bytes(&c->in[i], &p, &nb);
      int rc = dsp_tensor_from_data(ctx, &m, p, nb, &in[i]);
      cr_assert_eq(rc, 0, "%s: input %d: %s", c->name, i,
                   dsp_ctx_errmsg(ctx));
    }
    dsp_attrs a = case_attrs(c);
    int rc = dsp_op(ctx, (dsp_opcode)c->op, in, c->n_in, &a, &out);
    cr_assert_eq(rc, c->want_rc, "%s: rc %d (%s), want %d", c->name, rc,
                 dsp_ctx_errmsg(ctx), c->want_rc);
    if (rc == 0) {
      cr_assert_eq(out->meta.ndim, c->ndim, "%s: rank", c->name);
      for (int d = 0; d < c->ndim; d++)
        cr_assert_eq(out->meta.shape[d], c->shape[d], "%s: dim %d", c->name,
                     d);
      cr_assert_eq(out->numel, shape_numel(c->ndim, c->shape));
      if (out->numel > 0) check_values(c, dsp_tensor_data(out), out->numel);
    } else {
      cr_assert_null(out);
      cr_assert_gt(strlen(dsp_ctx_errmsg(ctx)), 0, "%s: no message", c->name);
    }
    dsp_tensor_unref(out);
    for (int i = 0; i < c->n_in; i++) dsp_tensor_unref(in[i]);
  }
  dsp_ctx_free(ctx);
}

/* Autodiff through empty tensors: the forward and every backward op run on
 * [2^40, 0] shapes and the gradient is an empty tensor of the leaf's
 * shape. */
Test(zero_size, backward_in_process, .timeout = 120) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cr_assert_not_null(ctx);
  dsp_meta m = {DSP_F32, 2, {H, 0}};
  dsp_tensor *x, *y, *l;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, NULL, 0, &x), 0);
  cr_assert_eq(dsp_track(ctx, x), 0);
  dsp_attrs a1 = dsp_attrs_ints(1, (int64_t[]){1}), none = dsp_attrs_none();
  cr_assert_eq(dsp_op(ctx, DSP_OP_LOG_SOFTMAX, &x, 1, &a1, &y), 0);
  cr_assert_eq(dsp_op(ctx, DSP_OP_SUM, &y, 1, &none, &l), 0);
  dsp_grads *g;
  cr_assert_eq(dsp_backward(ctx, l, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_tensor *gx;
  cr_assert_eq(dsp_grads_get(ctx, g, x, &gx), 0);
  cr_assert(dsp_meta_equal(&gx->meta, &m));
  dsp_tensor_unref(gx);
  dsp_grads_free(g);
  dsp_tensor_unref(l);
  dsp_tensor_unref(y);
  dsp_tensor_unref(x);
  dsp_ctx_free(ctx);
}

/* The span is bounded in every meta, not only the element count: the
 * stride of dim 0 of [0, 2^63-1, 2] does not fit int64. */
Test(zero_size, meta_span_is_bounded) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t n = -1;
  dsp_meta ok = {DSP_F32, 2, {H, 0}};
  cr_assert_eq(dsp_meta_numel(ctx, &ok, &n), 0);
  cr_assert_eq(n, 0);
  const dsp_meta bad[] = {
      {DSP_F32, 3, {0, I64MAX, 2}},
      {DSP_F32, 2, {I64MAX, 0}},
      {DSP_BOOL, 3, {0, INT64_C(1) << 62, 4}},
      {DSP_F64, 2, {0, INT64_C(1) << 61}},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_eq(dsp_meta_numel(ctx, &bad[i], &n), DISPATCH_EOVERFLOW,
                 "case %zu", i);
    cr_assert(strstr(dsp_ctx_errmsg(ctx), "span"), "%s", dsp_ctx_errmsg(ctx));
    dsp_tensor *t = NULL;
    cr_assert_eq(dsp_tensor_new(ctx, &bad[i], &t), DISPATCH_EOVERFLOW);
    cr_assert_null(t);
  }
  dsp_ctx_free(ctx);
}

/* ------------------------------------------------------------------ */
/* through dispatch-server                                             */

/* Runs one case on the session: uploads the inputs as ids 1..n, the op
 * into id 10, then checks the error of the sync (the case's code or none)
 * and the result's shape and values by a Read; frees every id. */
static void run_remote_case(wire_conn *w, const zcase *c) {
  uint64_t ids[4] = {1, 2, 3, 4};
  for (int i = 0; i < c->n_in; i++) {
    const void *p;
    size_t nb;
    input_bytes(&c->in[i], &p, &nb);
    cr_assert_neq(wire_upload(w, ids[i], c->in[i].dtype, c->in[i].ndim,
                              c->in[i].shape, p, nb),
                  0);
  }
  char msg[700] = "";
  cr_assert_eq(wire_sync_check(w, msg, sizeof msg, NULL), 0, "%s: upload: %s",
               c->name, msg);
  wire_op(w, c->op, ids, c->n_in, 10, c->ints, c->n_ints, c->floats,
          c->n_floats);
  int rc = wire_sync_check(w, msg, sizeof msg, NULL);
  cr_assert_eq(rc, c->want_rc, "%s: rc %d (%s), want %d", c->name, rc, msg,
               c->want_rc);
  if (rc == 0) {
    void *data = NULL;
    size_t nb = 0;
    int ndim = -1;
    int64_t shape[DSP_MAX_DIMS];
    cr_assert_eq(wire_read_tensor(w, 10, &data, &nb, &ndim, shape), 0,
                 "%s: read", c->name);
    cr_assert_eq(ndim, c->ndim, "%s: rank", c->name);
    for (int d = 0; d < c->ndim; d++)
      cr_assert_eq(shape[d], c->shape[d], "%s: dim %d", c->name, d);
    int64_t n = shape_numel(c->ndim, c->shape);
    if (n > 0) {
      cr_assert_eq(nb, (size_t)n * sizeof(float), "%s: bytes", c->name);
      check_values(c, data, n);
    } else {
      cr_assert_eq(nb, 0);
    }
    free(data);
  } else {
    cr_assert(strstr(msg, dsp_op_lookup(c->op)->name), "%s: %s", c->name,
              msg);
  }
  uint64_t all[5] = {1, 2, 3, 4, 10};
  all[c->n_in] = 10;
  wire_free(w, all, c->n_in + 1, NULL, 0);
}

Test(zero_size, every_family_through_the_server, .init = start_wide,
     .fini = stop_checked, .timeout = 120) {
  wire_conn w;
  connect_hello(&w);
  for (int k = 0; k < N_CASES; k++)
    if (!k_cases[k].local_only) run_remote_case(&w, &k_cases[k]);
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  wire_close(&w);
}

Test(zero_size, backward_through_the_server, .init = start_wide,
     .fini = stop_checked, .timeout = 120) {
  wire_conn w;
  connect_hello(&w);
  int64_t s[2] = {H, 0};
  wire_upload(&w, 1, DSP_F32, 2, s, NULL, 0);
  wire_track(&w, 1);
  uint64_t x = 1, y = 2;
  int64_t dim = 1;
  wire_op(&w, DSP_OP_SOFTMAX, &x, 1, 2, &dim, 1, NULL, 0);
  wire_op(&w, DSP_OP_SUM, &y, 1, 3, NULL, 0, NULL, 0);
  uint64_t rid = wire_backward(&w, 3, 1, 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&w, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  wire_reply_free(r, NULL);
  wire_grad(&w, 1, 1, 4);
  char msg[700] = "";
  int rc = wire_sync_check(&w, msg, sizeof msg, NULL);
  cr_assert_eq(rc, 0, "rc %d: %s", rc, msg);
  void *data = NULL;
  size_t nb = 1;
  int ndim;
  int64_t shape[DSP_MAX_DIMS];
  cr_assert_eq(wire_read_tensor(&w, 4, &data, &nb, &ndim, shape), 0);
  cr_assert_eq(ndim, 2);
  cr_assert_eq(shape[0], H);
  cr_assert_eq(shape[1], 0);
  cr_assert_eq(nb, 0);
  free(data);
  wire_close(&w);
}

/* Expects the next sync to report code with `want` in its message. */
static void expect_sync_error(wire_conn *w, int code, const char *want) {
  char msg[700] = "";
  int rc = wire_sync_check(w, msg, sizeof msg, NULL);
  cr_assert_eq(rc, code, "rc %d (%s), want %d", rc, msg, code);
  cr_assert(strstr(msg, want), "message: %s", msg);
}

/* The issue's examples against the server: each refused with a clear
 * error, the session goes on, and the server exits on SIGTERM. */
Test(zero_size, issue_examples_are_refused, .init = start_default,
     .fini = stop_checked, .timeout = 120) {
  wire_conn w;
  connect_hello(&w);
  /* f32 [2^63-1, 0] with no bytes, then softmax over dim 1 */
  int64_t s1[2] = {I64MAX, 0};
  wire_upload(&w, 1, DSP_F32, 2, s1, NULL, 0);
  expect_sync_error(&w, DISPATCH_EOVERFLOW, "span");
  uint64_t x = 1;
  int64_t dim = 1;
  wire_op(&w, DSP_OP_SOFTMAX, &x, 1, 2, &dim, 1, NULL, 0);
  expect_sync_error(&w, DISPATCH_EPOISONED, "softmax");
  /* zeros [0, 2^63-1, 0] */
  int64_t z[4] = {DSP_F32, 0, I64MAX, 0};
  wire_op(&w, DSP_OP_ZEROS, NULL, 0, 3, z, 4, NULL, 0);
  expect_sync_error(&w, DISPATCH_EOVERFLOW, "zeros");
  /* sum over f32 [0, 2^63-1, 2]: the stride of dim 0 overflows int64 */
  int64_t s3[3] = {0, I64MAX, 2};
  wire_upload(&w, 4, DSP_F32, 3, s3, NULL, 0);
  expect_sync_error(&w, DISPATCH_EOVERFLOW, "span");
  /* spans that fit int64 but pass --max-elements (2^31): an upload, a
   * creation shape, and shapes taken from attributes */
  int64_t s5[2] = {H, 0};
  wire_upload(&w, 5, DSP_F32, 2, s5, NULL, 0);
  expect_sync_error(&w, DISPATCH_ELIMIT, "spans");
  int64_t z6[3] = {DSP_F32, 0, H};
  wire_op(&w, DSP_OP_ZEROS, NULL, 0, 6, z6, 3, NULL, 0);
  expect_sync_error(&w, DISPATCH_ELIMIT, "spans");
  int64_t s7[2] = {1, 0};
  wire_upload(&w, 7, DSP_F32, 2, s7, NULL, 0);
  uint64_t e = 7;
  int64_t bt[2] = {H, 0};
  wire_op(&w, DSP_OP_BROADCAST_TO, &e, 1, 8, bt, 2, NULL, 0);
  expect_sync_error(&w, DISPATCH_ELIMIT, "spans");
  int64_t sb[6] = {0, 0, 1, 1, H, 0};
  wire_op(&w, DSP_OP_SLICE_BACKWARD, &e, 1, 9, sb, 6, NULL, 0);
  expect_sync_error(&w, DISPATCH_ELIMIT, "spans");
  int64_t rs[3] = {0, 1, H};
  wire_op(&w, DSP_OP_RESHAPE, &e, 1, 11, rs, 3, NULL, 0);
  expect_sync_error(&w, DISPATCH_ELIMIT, "spans");
  /* within the limit the same kind of shape is fine */
  int64_t s12[2] = {1 << 20, 0};
  wire_upload(&w, 12, DSP_F32, 2, s12, NULL, 0);
  uint64_t t12 = 12;
  wire_op(&w, DSP_OP_SOFTMAX, &t12, 1, 13, &dim, 1, NULL, 0);
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  wire_close(&w);
}

/* Backward intermediates go through the same element limit as named
 * results: a [1,8,8] x [8,8,1] product (inputs and result 64 elements)
 * builds an [8,8,8] gradient intermediate in backward, over a limit of 100
 * (the issue's [1,512,512] x [512,512,1] case, scaled down). */
static void start_100(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2",
                        "--max-elements", "100", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}

Test(zero_size, backward_intermediates_are_bounded_in_process) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_ctx_set_max_elements(ctx, 100);
  static const float v[64];
  dsp_meta ma = {DSP_F32, 3, {1, 8, 8}}, mb = {DSP_F32, 3, {8, 8, 1}};
  dsp_tensor *in[2], *y, *l;
  cr_assert_eq(dsp_tensor_from_data(ctx, &ma, v, sizeof v, &in[0]), 0);
  cr_assert_eq(dsp_tensor_from_data(ctx, &mb, v, sizeof v, &in[1]), 0);
  cr_assert_eq(dsp_track(ctx, in[0]), 0);
  dsp_attrs none = dsp_attrs_none();
  cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, &none, &y), 0);
  cr_assert_eq(dsp_op(ctx, DSP_OP_SUM, &y, 1, &none, &l), 0);
  dsp_grads *g = NULL;
  cr_assert_eq(dsp_backward(ctx, l, 0, &g), DISPATCH_ELIMIT, "%s",
               dsp_ctx_errmsg(ctx));
  cr_assert_null(g);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "spans 512 elements"), "%s",
            dsp_ctx_errmsg(ctx));
  dsp_tensor_unref(l);
  dsp_tensor_unref(y);
  dsp_tensor_unref(in[0]);
  dsp_tensor_unref(in[1]);
  dsp_ctx_free(ctx);
}

Test(zero_size, backward_intermediates_are_bounded_on_the_server,
     .init = start_100, .fini = stop_checked) {
  wire_conn w;
  connect_hello(&w);
  static const float v[64];
  int64_t sa[3] = {1, 8, 8}, sb[3] = {8, 8, 1};
  wire_upload(&w, 1, DSP_F32, 3, sa, v, sizeof v);
  wire_upload(&w, 2, DSP_F32, 3, sb, v, sizeof v);
  wire_track(&w, 1);
  uint64_t ab[2] = {1, 2}, y = 3;
  wire_op(&w, DSP_OP_MATMUL, ab, 2, 3, NULL, 0, NULL, 0);
  wire_op(&w, DSP_OP_SUM, &y, 1, 4, NULL, 0, NULL, 0);
  uint64_t rid = wire_backward(&w, 4, 1, 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&w, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_not_null(r->error, "backward passed the element limit");
  cr_assert_eq(r->error->code, DISPATCH_ELIMIT, "%s", r->error->message);
  cr_assert(strstr(r->error->message, "over the limit of 100"), "%s",
            r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  wire_close(&w);
}

/* ------------------------------------------------------------------ */
/* item 11: bool bytes other than 0 and 1                              */

static const uint8_t k_bad_bool[5] = {0, 1, 1, 7, 0};

Test(bool_upload, refused_in_process) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta m = {DSP_BOOL, 1, {5}};
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, k_bad_bool, 5, &t),
               DISPATCH_EINVAL);
  cr_assert_null(t);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "byte 3 is 7"), "%s",
            dsp_ctx_errmsg(ctx));
  const uint8_t good[5] = {0, 1, 1, 0, 1};
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, good, 5, &t), 0);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
}

/* LOCAL and REMOTE devices of the client library refuse the same bytes
 * with the same code and message, at the call. */
static void client_refuses(const char *spec) {
  dispatch_device *dev;
  char msg[256];
  cr_assert_eq(dispatch_device_open(spec, NULL, &dev, msg, sizeof msg), 0,
               "%s", msg);
  dispatch_tensor *t = NULL;
  int64_t s[1] = {5};
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_BOOL, 1, s, k_bad_bool,
                                         5, &t),
               DISPATCH_EINVAL);
  cr_assert_null(t);
  cr_assert(strstr(dispatch_device_errmsg(dev), "byte 3 is 7"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_device_sync(dev), 0);
  dispatch_device_close(dev);
}

Test(bool_upload, refused_by_the_client_library, .init = start_default,
     .fini = stop_checked) {
  client_refuses("local");
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  client_refuses(spec);
}

/* A raw client's upload is refused by the server: the session goes on, and
 * ops never see a bool byte other than 0 or 1. */
Test(bool_upload, refused_on_the_wire, .init = start_default,
     .fini = stop_checked) {
  wire_conn w;
  connect_hello(&w);
  int64_t s[1] = {5};
  wire_upload(&w, 1, DSP_BOOL, 1, s, k_bad_bool, 5);
  expect_sync_error(&w, DISPATCH_EINVAL, "byte 3 is 7");
  uint64_t b = 1;
  int64_t to_f32 = DSP_F32;
  wire_op(&w, DSP_OP_CAST, &b, 1, 2, &to_f32, 1, NULL, 0);
  expect_sync_error(&w, DISPATCH_EPOISONED, "upload");
  const uint8_t good[5] = {1, 0, 1, 1, 0};
  wire_upload(&w, 3, DSP_BOOL, 1, s, good, 5);
  b = 3;
  wire_op(&w, DSP_OP_CAST, &b, 1, 4, &to_f32, 1, NULL, 0);
  void *data;
  size_t nb;
  cr_assert_eq(wire_read_tensor(&w, 4, &data, &nb, NULL, NULL), 0);
  const float want[5] = {1, 0, 1, 1, 0};
  cr_assert_eq(nb, sizeof want);
  cr_assert_arr_eq(data, want, sizeof want);
  free(data);
  wire_close(&w);
}

/* ------------------------------------------------------------------ */
/* item 12: arity messages                                             */

Test(arity, variadic_ops_name_their_range) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta m = {DSP_F32, 1, {2}}, out;
  dsp_attrs a = dsp_attrs_ints(1, (int64_t[]){0});
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_CAT, &m, 0, &a, &out),
               DISPATCH_EINVAL);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "cat: takes 1 to 64 inputs, got 0");
  dsp_meta many[DSP_MAX_INPUTS + 1];
  for (int i = 0; i <= DSP_MAX_INPUTS; i++) many[i] = m;
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_STACK, many, DSP_MAX_INPUTS + 1, &a,
                            &out),
               DISPATCH_EINVAL);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "stack: takes 1 to 64 inputs, got 65");
  dsp_attrs none = dsp_attrs_none();
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_EXP, many, 2, &none, &out),
               DISPATCH_EINVAL);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "exp: takes 1 input, got 2");
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_ZEROS, many, 1, &none, &out),
               DISPATCH_EINVAL);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx), "zeros: takes no inputs, got 1");
  dsp_ctx_free(ctx);
}

Test(arity, variadic_message_on_the_wire, .init = start_default,
     .fini = stop_checked) {
  wire_conn w;
  connect_hello(&w);
  int64_t dim = 0;
  wire_op(&w, DSP_OP_CAT, NULL, 0, 1, &dim, 1, NULL, 0);
  expect_sync_error(&w, DISPATCH_EINVAL, "cat: takes 1 to 64 inputs, got 0");
  wire_close(&w);
}
