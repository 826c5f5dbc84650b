/* MATMUL with the attributes {ta, tb}: op(a) @ op(b), op(x) = x^T (last
 * two dims) where the flag is set, run as gemm with BLAS's transpose
 * flags (no transposing copy). The matmul backward rule uses it for g b^T
 * and a^T g. It must agree with transpose + matmul, count the work of the
 * product it runs against the limits, refuse bad attributes with
 * DISPATCH_EINVAL (also from a client over the wire), and carry its own
 * gradient. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/tensor_util.h"
#include "helpers/wire.h"

static uint64_t g_rng = 88172645463325252ull;
static double urand(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static dsp_tensor *mkn(dsp_ctx *ctx, dsp_dtype dt, int nd, const int64_t *s) {
  dsp_meta m = {dt, nd, {0}};
  memcpy(m.shape, s, sizeof(int64_t) * (size_t)nd);
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int64_t i = 0; i < t->numel; i++) {
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)urand();
    else ((double *)dsp_tensor_data(t))[i] = urand();
  }
  return t;
}

static dsp_tensor *mk(dsp_ctx *ctx, dsp_dtype dt, int64_t r, int64_t c) {
  const int64_t s[2] = {r, c};
  return mkn(ctx, dt, 2, s);
}

static dsp_tensor *tr(dsp_ctx *ctx, dsp_tensor *x) {
  int64_t v[2] = {-2, -1};
  dsp_attrs a = dsp_attrs_ints(2, v);
  dsp_tensor *in[1] = {x}, *out = NULL;
  cr_assert_eq(dsp_op(ctx, DSP_OP_TRANSPOSE, in, 1, &a, &out), 0, "%s",
               dsp_ctx_errmsg(ctx));
  return out;
}

static int mm_t(dsp_ctx *ctx, dsp_tensor *a, int ta, dsp_tensor *b, int tb,
                dsp_tensor **out) {
  int64_t v[2] = {ta, tb};
  dsp_attrs at2 = dsp_attrs_ints(2, v);
  dsp_tensor *in[2] = {a, b};
  return dsp_op(ctx, DSP_OP_MATMUL, in, 2, &at2, out);
}

/* out == transpose + matmul of the same operands, within tol */
static void check_against_copy(dsp_ctx *ctx, dsp_tensor *a, int ta,
                               dsp_tensor *b, int tb, const char *what) {
  dsp_tensor *out = NULL, *ref = NULL;
  cr_assert_eq(mm_t(ctx, a, ta, b, tb, &out), 0, "%s: %s", what,
               dsp_ctx_errmsg(ctx));
  dsp_tensor *in[2] = {ta ? tr(ctx, a) : dsp_tensor_ref(a),
                       tb ? tr(ctx, b) : dsp_tensor_ref(b)};
  cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, NULL, &ref), 0);
  cr_assert(dsp_meta_equal(&out->meta, &ref->meta), "%s: shape", what);
  double tol = a->meta.dtype == DSP_F64 ? 1e-12 : 1e-5;
  for (int64_t i = 0; i < ref->numel; i++)
    cr_assert(fabs(tu_at(out, i) - tu_at(ref, i)) <= tol * (1 + fabs(tu_at(ref, i))),
              "%s ta=%d tb=%d [%lld]: %g vs %g", what, ta, tb, (long long)i,
              tu_at(out, i), tu_at(ref, i));
  dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  dsp_tensor_unref(out), dsp_tensor_unref(ref);
}

Test(matmul_t, agrees_with_transpose_then_matmul) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_set_grad_enabled(ctx, 0);
  const int64_t sizes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 1, 9}, {64, 33, 10}};
  for (int d = 0; d < 2; d++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      for (int f = 0; f < 4; f++) {
        dsp_dtype dt = d ? DSP_F64 : DSP_F32;
        int ta = f & 1, tb = f >> 1;
        int64_t M = sizes[s][0], K = sizes[s][1], N = sizes[s][2];
        dsp_tensor *a = ta ? mk(ctx, dt, K, M) : mk(ctx, dt, M, K);
        dsp_tensor *b = tb ? mk(ctx, dt, N, K) : mk(ctx, dt, K, N);
        char what[64];
        snprintf(what, sizeof what, "%s %lldx%lldx%lld", d ? "f64" : "f32",
                 (long long)M, (long long)K, (long long)N);
        check_against_copy(ctx, a, ta, b, tb, what);
        dsp_tensor_unref(a), dsp_tensor_unref(b);
      }
  dsp_ctx_free(ctx);
}

/* batched operands: per-entry gemms with the flags, a broadcast batch, a
 * shared right operand (the folded single gemm when a is not transposed) */
Test(matmul_t, batched_and_broadcast) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_set_grad_enabled(ctx, 0);
  const int64_t s3a[3] = {3, 5, 4}, s3b[3] = {3, 6, 5}, s4a[4] = {2, 1, 5, 4},
                s3c[3] = {3, 5, 6}, s2[2] = {6, 5}, s2b[2] = {5, 6};
  for (int f = 0; f < 4; f++) {
    int ta = f & 1, tb = f >> 1;
    /* a: [3,5,4] is [3,4,5]^T or [3,5,4]; b: [3,6,5] is [3,5,6]^T */
    dsp_tensor *a = mkn(ctx, DSP_F64, 3, s3a);
    dsp_tensor *b = tb ? mkn(ctx, DSP_F64, 3, s3b) : mkn(ctx, DSP_F64, 3, s3c);
    if (!ta) {
      const int64_t s[3] = {3, 4, 5};
      dsp_tensor_unref(a);
      a = mkn(ctx, DSP_F64, 3, s);
    }
    check_against_copy(ctx, a, ta, b, tb, "batched");
    dsp_tensor_unref(b);
    /* a shared 2-D right operand */
    b = tb ? mkn(ctx, DSP_F64, 2, s2) : mkn(ctx, DSP_F64, 2, s2b);
    check_against_copy(ctx, a, ta, b, tb, "shared b");
    dsp_tensor_unref(a), dsp_tensor_unref(b);
  }
  /* a batch that broadcasts: [2,1,5,4]^T @ [3,5,6] */
  dsp_tensor *a = mkn(ctx, DSP_F32, 4, s4a), *b = mkn(ctx, DSP_F32, 3, s3c);
  check_against_copy(ctx, a, 1, b, 0, "broadcast");
  dsp_tensor_unref(a), dsp_tensor_unref(b);
  dsp_ctx_free(ctx);
}

Test(matmul_t, empty_inner_dim_gives_zeros) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_set_grad_enabled(ctx, 0);
  dsp_tensor *a = mk(ctx, DSP_F32, 0, 3), *b = mk(ctx, DSP_F32, 0, 4), *out;
  cr_assert_eq(mm_t(ctx, a, 1, b, 0, &out), 0);
  cr_assert_eq(out->numel, 12);
  for (int i = 0; i < 12; i++) cr_assert(tu_at(out, i) == 0.0);
  dsp_tensor_unref(out), dsp_tensor_unref(a), dsp_tensor_unref(b);
  dsp_ctx_free(ctx);
}

Test(matmul_t, refusals_and_limits) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_tensor *a = mk(ctx, DSP_F32, 4, 3), *b = mk(ctx, DSP_F32, 4, 5), *out;
  /* inner dims that do not match: the matmul's own error */
  cr_assert_eq(mm_t(ctx, a, 0, b, 0, &out), DISPATCH_ESHAPE);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "inner dims"), "%s",
            dsp_ctx_errmsg(ctx));
  /* flags other than 0 and 1, other attribute counts, a 1-D operand
   * transposed: refused before anything runs */
  dsp_tensor *in[2] = {a, b};
  const int64_t bad[][2] = {{2, 0}, {0, -1}, {1, 7}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    dsp_attrs x = dsp_attrs_ints(2, bad[i]);
    cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, &x, &out), DISPATCH_EINVAL);
    cr_assert(strstr(dsp_ctx_errmsg(ctx), "not 0 or 1"), "%s",
              dsp_ctx_errmsg(ctx));
    cr_assert_null(out);
  }
  const int64_t one[3] = {1, 0, 0};
  dsp_attrs x1 = dsp_attrs_ints(1, one), x3 = dsp_attrs_ints(3, one),
            xf = dsp_attrs_f1(1.0);
  cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, &x1, &out), DISPATCH_EINVAL);
  cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, &x3, &out), DISPATCH_EINVAL);
  cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, &xf, &out), DISPATCH_EINVAL);
  dsp_meta m1 = {DSP_F32, 1, {4}};
  dsp_tensor *v = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m1, &v), 0);
  cr_assert_eq(mm_t(ctx, v, 1, b, 0, &out), DISPATCH_EINVAL);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "rank >= 2"), "%s",
            dsp_ctx_errmsg(ctx));
  /* a 1-D operand that is not transposed is promoted as without flags */
  cr_assert_eq(mm_t(ctx, v, 0, a, 0, &out), 0, "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(out->meta.ndim, 1);
  cr_assert_eq(out->meta.shape[0], 3);
  dsp_tensor_unref(out);
  dsp_tensor_unref(v);
  /* the work counted is that of the product run, K = a's rows here: the
   * same as transpose + matmul */
  dsp_meta ma = a->meta, mb = b->meta, om;
  int64_t fl[2] = {1, 0};
  dsp_attrs t10 = dsp_attrs_ints(2, fl);
  dsp_meta ms[2] = {ma, mb};
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_MATMUL, ms, 2, &t10, &om), 0);
  cr_assert_eq(om.ndim, 2);
  cr_assert_eq(om.shape[0], 3);
  cr_assert_eq(om.shape[1], 5);
  dsp_meta mt[2] = {{DSP_F32, 2, {3, 4}}, mb};
  dsp_attrs none = dsp_attrs_none();
  cr_assert_eq(dsp_op_cost(DSP_OP_MATMUL, ms, 2, &t10, &om),
               dsp_op_cost(DSP_OP_MATMUL, mt, 2, &none, &om));
  cr_assert_eq(dsp_op_cost(DSP_OP_MATMUL, ms, 2, &t10, &om), 15 * 4 + 15);
  /* the per-op cost limit applies */
  dsp_ctx_set_max_op_cost(ctx, 10);
  cr_assert_eq(mm_t(ctx, a, 1, b, 0, &out), DISPATCH_ELIMIT);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "max-op-cost"), "%s",
            dsp_ctx_errmsg(ctx));
  dsp_ctx_set_max_op_cost(ctx, 0);
  /* so does cancellation */
  dsp_ctx_cancel(ctx);
  cr_assert_lt(mm_t(ctx, a, 1, b, 0, &out), 0);
  cr_assert_null(out);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
  dsp_ctx_free(ctx);
}

/* A tracked MATMUL with flags has the gradient of op(a) @ op(b): the same
 * as the gradient through transpose + matmul, for every flag pair and a
 * batched case. */
static void grads_of(dsp_ctx *ctx, dsp_tensor *a, int ta, dsp_tensor *b,
                     int tb, int copy, dsp_tensor **ga, dsp_tensor **gb) {
  dsp_tensor *la = NULL, *lb = NULL, *out = NULL, *loss = NULL;
  dsp_meta m;
  m = a->meta;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, dsp_tensor_data(a),
                                    dsp_tensor_nbytes(a), &la), 0);
  m = b->meta;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, dsp_tensor_data(b),
                                    dsp_tensor_nbytes(b), &lb), 0);
  cr_assert_eq(dsp_track(ctx, la), 0);
  cr_assert_eq(dsp_track(ctx, lb), 0);
  if (copy) {
    dsp_tensor *in[2] = {ta ? tr(ctx, la) : dsp_tensor_ref(la),
                         tb ? tr(ctx, lb) : dsp_tensor_ref(lb)};
    cr_assert_eq(dsp_op(ctx, DSP_OP_MATMUL, in, 2, NULL, &out), 0);
    dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  } else {
    cr_assert_eq(mm_t(ctx, la, ta, lb, tb, &out), 0, "%s", dsp_ctx_errmsg(ctx));
  }
  /* loss = sum(out * w) with a fixed w, so every element's gradient differs */
  dsp_tensor *w = mkn(ctx, out->meta.dtype, out->meta.ndim, out->meta.shape);
  dsp_tensor *in2[2] = {out, w}, *pw = NULL;
  cr_assert_eq(dsp_op(ctx, DSP_OP_MUL, in2, 2, NULL, &pw), 0);
  dsp_tensor *in1[1] = {pw};
  cr_assert_eq(dsp_op(ctx, DSP_OP_SUM, in1, 1, NULL, &loss), 0,
               "%s", dsp_ctx_errmsg(ctx));
  dsp_grads *g = NULL;
  cr_assert_eq(dsp_backward(ctx, loss, 0, &g), 0, "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(dsp_grads_get(ctx, g, la, ga), 0);
  cr_assert_eq(dsp_grads_get(ctx, g, lb, gb), 0);
  dsp_grads_free(g);
  dsp_tensor_unref(loss), dsp_tensor_unref(pw), dsp_tensor_unref(w);
  dsp_tensor_unref(out), dsp_tensor_unref(la), dsp_tensor_unref(lb);
}

static void same(const dsp_tensor *x, const dsp_tensor *y, const char *what) {
  cr_assert(dsp_meta_equal(&x->meta, &y->meta), "%s: shape", what);
  for (int64_t i = 0; i < x->numel; i++)
    cr_assert(fabs(tu_at(x, i) - tu_at(y, i)) <= 1e-12 * (1 + fabs(tu_at(y, i))),
              "%s [%lld]: %.17g vs %.17g", what, (long long)i, tu_at(x, i),
              tu_at(y, i));
}

Test(matmul_t, gradient_of_transposed_operands) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  const int64_t shapes[][2][3] = {
      /* {a stored, b stored} for ta, tb chosen below; rank 3 = batched */
      {{4, 3, 0}, {4, 5, 0}}, {{3, 4, 0}, {5, 4, 0}},
      {{4, 3, 0}, {5, 4, 0}}, {{3, 4, 0}, {4, 5, 0}}};
  const int flags[][2] = {{1, 0}, {0, 1}, {1, 1}, {0, 0}};
  for (int c = 0; c < 4; c++)
    for (int batched = 0; batched < 2; batched++) {
      int ta = flags[c][0], tb = flags[c][1];
      int64_t sa[3] = {2, shapes[c][0][0], shapes[c][0][1]},
              sb[3] = {2, shapes[c][1][0], shapes[c][1][1]};
      dsp_tensor *a = batched ? mkn(ctx, DSP_F64, 3, sa)
                              : mkn(ctx, DSP_F64, 2, sa + 1);
      dsp_tensor *b = mkn(ctx, DSP_F64, 2, sb + 1);
      uint64_t seed = g_rng;
      dsp_tensor *ga, *gb, *ra, *rb;
      grads_of(ctx, a, ta, b, tb, 0, &ga, &gb);
      g_rng = seed; /* the same w */
      grads_of(ctx, a, ta, b, tb, 1, &ra, &rb);
      char what[48];
      snprintf(what, sizeof what, "ta=%d tb=%d batched=%d d/da", ta, tb,
               batched);
      same(ga, ra, what);
      what[strlen(what) - 1] = 'b';
      same(gb, rb, what);
      dsp_tensor_unref(ga), dsp_tensor_unref(gb);
      dsp_tensor_unref(ra), dsp_tensor_unref(rb);
      dsp_tensor_unref(a), dsp_tensor_unref(b);
    }
  dsp_ctx_free(ctx);
}

/* A client's MATMUL attributes are checked by the server like any other:
 * bad ones fail the op with DISPATCH_EINVAL, the session goes on, and good
 * ones give the transposed product. */
Test(matmul_t, attributes_from_the_wire) {
  sp_server srv;
  const char *args[] = {"--log-level", "error", "--threads", "1", NULL};
  cr_assert_eq(sp_start(&srv, args), 0, "server did not start");
  wire_conn w;
  cr_assert_eq(wire_connect(&w, srv.port), 0);
  cr_assert_eq(wire_hello(&w, "matmul-t"), 0);
  const float av[6] = {1, 2, 3, 4, 5, 6}; /* [3,2] */
  const float bv[6] = {1, 0, 2, 1, 0, 3}; /* [3,2] */
  const int64_t s[2] = {3, 2};
  cr_assert_neq(wire_upload(&w, 1, DSP_F32, 2, s, av, sizeof av), 0);
  cr_assert_neq(wire_upload(&w, 2, DSP_F32, 2, s, bv, sizeof bv), 0);
  const uint64_t ids[2] = {1, 2};
  const int64_t bad[][3] = {{2, 0, 0}, {0, -5, 0}, {1, 1, 1}};
  const int nbad[] = {2, 2, 3};
  for (int i = 0; i < 3; i++) {
    wire_op(&w, DSP_OP_MATMUL, ids, 2, 10 + (uint64_t)i, bad[i], nbad[i],
            NULL, 0);
    char msg[512] = "";
    cr_assert_eq(wire_sync_check(&w, msg, sizeof msg, NULL), DISPATCH_EINVAL,
                 "%s", msg);
    cr_assert(strstr(msg, "matmul"), "%s", msg);
  }
  /* a^T @ b: [2,3] @ [3,2] */
  const int64_t t10[2] = {1, 0};
  wire_op(&w, DSP_OP_MATMUL, ids, 2, 20, t10, 2, NULL, 0);
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  void *data = NULL;
  size_t nb = 0;
  int ndim = 0;
  int64_t shape[DSP_MAX_DIMS];
  cr_assert_eq(wire_read_tensor(&w, 20, &data, &nb, &ndim, shape), 0);
  cr_assert_eq(ndim, 2);
  cr_assert_eq(shape[0], 2);
  cr_assert_eq(shape[1], 2);
  const float want[4] = {1 * 1 + 3 * 2 + 5 * 0, 1 * 0 + 3 * 1 + 5 * 3,
                         2 * 1 + 4 * 2 + 6 * 0, 2 * 0 + 4 * 1 + 6 * 3};
  cr_assert_eq(nb, sizeof want);
  cr_assert_eq(memcmp(data, want, sizeof want), 0);
  free(data);
  wire_close(&w);
  cr_assert_eq(sp_stop(&srv), 0, "server exit status");
}
