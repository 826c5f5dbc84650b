/* attention and attention_backward (LOCAL, CPU): hand values for a tiny
 * case, the fused op against the unfused composition matmul, softmax,
 * matmul of dispatch itself (forward and the gradients autodiff takes
 * through both), causal with Tq != Tk both ways, the key mask, rows that
 * see no key, and the validation errors with their codes and messages. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(attn, .init = setup, .fini = teardown);

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double urand(void) { /* xorshift64 in [-1, 1) */
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static dsp_tensor *rnd(dsp_dtype dt, int64_t a, int64_t b, int64_t c,
                       int64_t d) {
  dsp_meta m = {dt, 4, {a, b, c, d}};
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int64_t i = 0; i < t->numel; i++) {
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)urand();
    else ((double *)dsp_tensor_data(t))[i] = urand();
  }
  return t;
}

static dsp_tensor *zeros(dsp_dtype dt, int nd, const int64_t *shape) {
  dsp_meta m = {dt, nd, {0}};
  memcpy(m.shape, shape, sizeof(int64_t) * (size_t)nd);
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  return t;
}

static double at(const dsp_tensor *t, int64_t i) {
  return t->meta.dtype == DSP_F32 ? ((const float *)dsp_tensor_data(t))[i]
                                  : ((const double *)dsp_tensor_data(t))[i];
}

static dsp_attrs aattrs(int causal, int has_mask, double scale) {
  dsp_attrs a = dsp_attrs_f1(scale);
  a.ints[0] = causal;
  a.ints[1] = has_mask;
  a.n_ints = 2;
  return a;
}

static int attn_rc(dsp_tensor *q, dsp_tensor *k, dsp_tensor *v,
                   dsp_tensor *mask, int causal, double scale,
                   dsp_tensor **out) {
  dsp_tensor *in[4] = {q, k, v, mask};
  dsp_attrs a = aattrs(causal, mask != NULL, scale);
  return dsp_op(ctx, DSP_OP_ATTENTION, in, mask ? 4 : 3, &a, out);
}

static dsp_tensor *attn(dsp_tensor *q, dsp_tensor *k, dsp_tensor *v,
                        dsp_tensor *mask, int causal, double scale) {
  dsp_tensor *o = NULL;
  int rc = attn_rc(q, k, v, mask, causal, scale, &o);
  cr_assert_eq(rc, 0, "attention: %s (%s)", dispatch_err_name(rc),
               dsp_ctx_errmsg(ctx));
  return o;
}

/* The unfused composition: softmax(scale q k^T + bias) v with bias 0 where
 * query i may see key j and -inf elsewhere. */
static dsp_tensor *reference(dsp_tensor *q, dsp_tensor *k, dsp_tensor *v,
                             const uint8_t *mask, int causal, double scale) {
  int64_t B = q->meta.shape[0], Tq = q->meta.shape[2], Tk = k->meta.shape[2];
  int64_t tr[2] = {-2, -1}, last = -1;
  dsp_attrs ta = dsp_attrs_ints(2, tr), sa = dsp_attrs_f1(scale),
            da = dsp_attrs_ints(1, &last);
  dsp_tensor *kt = tu_run(ctx, DSP_OP_TRANSPOSE, &ta, 1, k, NULL, NULL);
  dsp_tensor *s = tu_run(ctx, DSP_OP_MATMUL, NULL, 2, q, kt, NULL);
  dsp_tensor *ss = tu_run(ctx, DSP_OP_MUL_SCALAR, &sa, 1, s, NULL, NULL);
  dsp_meta bm = {q->meta.dtype, 4, {B, 1, Tq, Tk}};
  dsp_tensor *bias;
  cr_assert_eq(dsp_tensor_new(ctx, &bm, &bias), 0);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < Tq; i++)
      for (int64_t j = 0; j < Tk; j++) {
        int ok = (!mask || mask[b * Tk + j]) && (!causal || j <= i);
        int64_t e = (b * Tq + i) * Tk + j;
        if (bm.dtype == DSP_F32)
          ((float *)dsp_tensor_data(bias))[e] = ok ? 0.0f : -INFINITY;
        else
          ((double *)dsp_tensor_data(bias))[e] = ok ? 0.0 : -INFINITY;
      }
  dsp_tensor *sb = tu_run(ctx, DSP_OP_ADD, NULL, 2, ss, bias, NULL);
  dsp_tensor *p = tu_run(ctx, DSP_OP_SOFTMAX, &da, 1, sb, NULL, NULL);
  dsp_tensor *o = tu_run(ctx, DSP_OP_MATMUL, NULL, 2, p, v, NULL);
  dsp_tensor *tmp[] = {kt, s, ss, bias, sb, p};
  for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++) dsp_tensor_unref(tmp[i]);
  return o;
}

static void assert_near(const dsp_tensor *got, const dsp_tensor *want,
                        double tol, const char *what) {
  cr_assert(dsp_meta_equal(&got->meta, &want->meta), "%s: shapes differ", what);
  for (int64_t i = 0; i < got->numel; i++)
    cr_assert(fabs(at(got, i) - at(want, i)) <= tol * (1 + fabs(at(want, i))),
              "%s: element %lld: %.12g, want %.12g", what, (long long)i,
              at(got, i), at(want, i));
}

static dsp_tensor *clone(dsp_tensor *t) {
  dsp_tensor *c;
  cr_assert_eq(dsp_tensor_from_data(ctx, &t->meta, dsp_tensor_data(t),
                                    dsp_tensor_nbytes(t), &c), 0);
  return c;
}

static dsp_tensor *mask_of(int64_t B, int64_t Tk, const uint8_t *m) {
  return tu_bool(ctx, 2, (int64_t[]){B, Tk}, m);
}

/* ---- hand values -------------------------------------------------- */

/* q = k = [[1], [0]], v = [[1], [3]], d = 1 (scale 1): row 0 scores
 * (1, 0), row 1 (0, 0). */
Test(attn, tiny_case_by_hand) {
  int64_t s[4] = {1, 1, 2, 1};
  dsp_tensor *q = tu_f64(ctx, 4, s, (double[]){1, 0});
  dsp_tensor *k = tu_f64(ctx, 4, s, (double[]){1, 0});
  dsp_tensor *v = tu_f64(ctx, 4, s, (double[]){1, 3});
  const double e = exp(1.0);
  dsp_tensor *o = attn(q, k, v, NULL, 0, 0.0);
  tu_assert_shape(o, 4, s);
  tu_assert_f64(o, (double[]){(e + 3) / (e + 1), 2.0}, 2, 1e-15);
  dsp_tensor *oc = attn(q, k, v, NULL, 1, 0.0); /* row 0 sees key 0 only */
  tu_assert_f64(oc, (double[]){1.0, 2.0}, 2, 1e-15);
  dsp_tensor *m = mask_of(1, 2, (uint8_t[]){1, 0});
  dsp_tensor *om = attn(q, k, v, m, 0, 0.0); /* key 1 dropped */
  tu_assert_f64(om, (double[]){1.0, 1.0}, 2, 1e-15);
  dsp_tensor *o2 = attn(q, k, v, NULL, 0, 2.0); /* scores (2, 0) */
  tu_assert_f64(o2, (double[]){(e * e + 3) / (e * e + 1), 2.0}, 2, 1e-15);
  dsp_tensor *ts[] = {q, k, v, o, oc, m, om, o2};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* The backward op of the tiny case at row 1 (p = (1/2, 1/2)) with dO = 1:
 * dv = sum over queries of p, dq_1 = scale sum_j p_j (v_j - O_1) k_j. */
Test(attn, tiny_backward_by_hand) {
  int64_t s[4] = {1, 1, 2, 1};
  dsp_tensor *q = tu_f64(ctx, 4, s, (double[]){1, 0});
  dsp_tensor *k = tu_f64(ctx, 4, s, (double[]){1, 0});
  dsp_tensor *v = tu_f64(ctx, 4, s, (double[]){1, 3});
  dsp_tensor *g = tu_f64(ctx, 4, s, (double[]){0, 1});
  dsp_attrs a = aattrs(0, 0, 0.0);
  dsp_tensor *in[4] = {g, q, k, v}, *out;
  cr_assert_eq(dsp_op(ctx, DSP_OP_ATTENTION_BACKWARD, in, 4, &a, &out), 0,
               "%s", dsp_ctx_errmsg(ctx));
  tu_assert_shape(out, 1, (int64_t[]){6});
  /* row 0 has dO = 0; row 1: p = (.5, .5), O = 2, dP = dO v = (1, 3),
   * D = 2, dS = p (dP - D) = (-.5, .5); dq_1 = dS . k = -.5,
   * dk = dS q_1 = (0, 0), dv = p dO = (.5, .5) */
  tu_assert_f64(out, (double[]){0, -0.5, 0, 0, 0.5, 0.5}, 6, 1e-15);
  dsp_tensor *ts[] = {q, k, v, g, out};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* ---- against the unfused composition ------------------------------ */

typedef struct shape_case {
  int64_t B, H, Tq, Tk, d, dv;
  int causal, masked;
  double scale;
} shape_case;

/* Tq = 70 and 130 span two and three query blocks; Tq < Tk and Tq > Tk
 * check causal's top-left alignment. */
static const shape_case g_cases[] = {
    {2, 3, 70, 50, 8, 5, 0, 0, 0.0},  {2, 3, 70, 50, 8, 5, 1, 0, 0.0},
    {2, 2, 40, 90, 6, 7, 1, 0, 0.3},  {2, 2, 130, 33, 4, 4, 0, 1, 0.0},
    {2, 2, 65, 65, 5, 3, 1, 1, -0.7}, {1, 1, 1, 1, 3, 2, 1, 0, 0.0},
};

/* a mask keeping key 0 always (so every row sees a key in the reference,
 * whose softmax over nothing is NaN) and dropping about a third */
static uint8_t *make_mask(int64_t B, int64_t Tk) {
  uint8_t *m = malloc((size_t)(B * Tk));
  cr_assert_not_null(m);
  for (int64_t i = 0; i < B * Tk; i++) m[i] = i % Tk == 0 || urand() > -0.33;
  return m;
}

static void forward_case(dsp_dtype dt, const shape_case *c, double tol) {
  dsp_tensor *q = rnd(dt, c->B, c->H, c->Tq, c->d);
  dsp_tensor *k = rnd(dt, c->B, c->H, c->Tk, c->d);
  dsp_tensor *v = rnd(dt, c->B, c->H, c->Tk, c->dv);
  uint8_t *mb = c->masked ? make_mask(c->B, c->Tk) : NULL;
  dsp_tensor *m = mb ? mask_of(c->B, c->Tk, mb) : NULL;
  double sc = c->scale != 0.0 ? c->scale : 1.0 / sqrt((double)c->d);
  dsp_tensor *o = attn(q, k, v, m, c->causal, c->scale);
  dsp_tensor *r = reference(q, k, v, mb, c->causal, sc);
  assert_near(o, r, tol, "forward");
  /* deterministic: a second run gives the same bits */
  dsp_tensor *o2 = attn(q, k, v, m, c->causal, c->scale);
  cr_assert_eq(memcmp(dsp_tensor_data(o), dsp_tensor_data(o2),
                      dsp_tensor_nbytes(o)), 0);
  dsp_tensor *ts[] = {q, k, v, m, o, r, o2};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
  free(mb);
}

Test(attn, forward_matches_unfused_f64) {
  for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++)
    forward_case(DSP_F64, &g_cases[i], 1e-12);
}

Test(attn, forward_matches_unfused_f32) {
  for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++)
    forward_case(DSP_F32, &g_cases[i], 2e-6);
}

/* Gradients of sum(out * W) w.r.t. fresh tracked copies of q, k, v, with
 * out the fused op (fused != 0) or the reference. */
static void grads(int fused, dsp_tensor *q0, dsp_tensor *k0, dsp_tensor *v0,
                  const uint8_t *mb, const shape_case *c, dsp_tensor *W,
                  dsp_tensor *g[3]) {
  dsp_tensor *x[3] = {clone(q0), clone(k0), clone(v0)};
  for (int i = 0; i < 3; i++) cr_assert_eq(dsp_track(ctx, x[i]), 0);
  double sc = c->scale != 0.0 ? c->scale : 1.0 / sqrt((double)c->d);
  dsp_tensor *m = mb ? mask_of(c->B, c->Tk, mb) : NULL;
  dsp_tensor *o = fused ? attn(x[0], x[1], x[2], m, c->causal, c->scale)
                        : reference(x[0], x[1], x[2], mb, c->causal, sc);
  dsp_tensor *p = tu_run(ctx, DSP_OP_MUL, NULL, 2, o, W, NULL);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, p, NULL, NULL);
  dsp_grads *gr;
  cr_assert_eq(dsp_backward(ctx, l, 0, &gr), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(dsp_grads_get(ctx, gr, x[i], &g[i]), 0, "%s",
                 dsp_ctx_errmsg(ctx));
    dsp_tensor_unref(x[i]);
  }
  dsp_grads_free(gr);
  dsp_tensor *ts[] = {m, o, p, l};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

static void backward_case(dsp_dtype dt, const shape_case *c, double tol) {
  dsp_tensor *q = rnd(dt, c->B, c->H, c->Tq, c->d);
  dsp_tensor *k = rnd(dt, c->B, c->H, c->Tk, c->d);
  dsp_tensor *v = rnd(dt, c->B, c->H, c->Tk, c->dv);
  dsp_tensor *W = rnd(dt, c->B, c->H, c->Tq, c->dv);
  uint8_t *mb = c->masked ? make_mask(c->B, c->Tk) : NULL;
  dsp_tensor *gf[3], *gr[3];
  grads(1, q, k, v, mb, c, W, gf);
  grads(0, q, k, v, mb, c, W, gr);
  static const char *const names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; i++) {
    assert_near(gf[i], gr[i], tol, names[i]);
    dsp_tensor_unref(gf[i]);
    dsp_tensor_unref(gr[i]);
  }
  dsp_tensor *ts[] = {q, k, v, W};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
  free(mb);
}

Test(attn, backward_matches_unfused_f64) {
  for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++)
    backward_case(DSP_F64, &g_cases[i], 1e-11);
}

Test(attn, backward_matches_unfused_f32) {
  for (size_t i = 0; i < sizeof g_cases / sizeof g_cases[0]; i++)
    backward_case(DSP_F32, &g_cases[i], 2e-5);
}

/* ---- rows that see no key ----------------------------------------- */

/* Batch entry 1 masks every key: its rows are 0 and pass no gradient;
 * entry 0 is untouched by it. */
Test(attn, all_masked_rows_give_zero_and_no_gradient) {
  const shape_case c = {2, 2, 5, 4, 3, 2, 0, 1, 0.0};
  uint8_t mb[8] = {1, 1, 0, 1, 0, 0, 0, 0};
  dsp_tensor *q = rnd(DSP_F64, 2, 2, 5, 3), *k = rnd(DSP_F64, 2, 2, 4, 3),
             *v = rnd(DSP_F64, 2, 2, 4, 2), *W = rnd(DSP_F64, 2, 2, 5, 2);
  dsp_tensor *m = mask_of(2, 4, mb);
  dsp_tensor *o = attn(q, k, v, m, 0, 0.0);
  const int64_t half = 2 * 5 * 2; /* entry 1 starts here */
  for (int64_t i = half; i < o->numel; i++) cr_assert_eq(at(o, i), 0.0);
  double sc = 1.0 / sqrt(3.0);
  dsp_tensor *r = reference(q, k, v, mb, 0, sc);
  for (int64_t i = 0; i < half; i++)
    cr_assert(fabs(at(o, i) - at(r, i)) < 1e-12);
  dsp_tensor *g[3];
  grads(1, q, k, v, mb, &c, W, g);
  const int64_t per[3] = {2 * 5 * 3, 2 * 4 * 3, 2 * 4 * 2};
  for (int t = 0; t < 3; t++) {
    for (int64_t i = per[t]; i < g[t]->numel; i++)
      cr_assert_eq(at(g[t], i), 0.0, "grad %d element %lld", t, (long long)i);
    dsp_tensor_unref(g[t]);
  }
  dsp_tensor *ts[] = {q, k, v, W, m, o, r};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* No keys at all (Tk = 0): every output row is 0, so is dq. */
Test(attn, no_keys_gives_zero) {
  dsp_tensor *q = rnd(DSP_F32, 1, 2, 3, 4), *k = rnd(DSP_F32, 1, 2, 0, 4),
             *v = rnd(DSP_F32, 1, 2, 0, 5);
  dsp_tensor *o = attn(q, k, v, NULL, 1, 0.0);
  tu_assert_shape(o, 4, (int64_t[]){1, 2, 3, 5});
  for (int64_t i = 0; i < o->numel; i++) cr_assert_eq(at(o, i), 0.0);
  dsp_tensor *g = rnd(DSP_F32, 1, 2, 3, 5), *out;
  dsp_attrs a = aattrs(1, 0, 0.0);
  dsp_tensor *in[4] = {g, q, k, v};
  cr_assert_eq(dsp_op(ctx, DSP_OP_ATTENTION_BACKWARD, in, 4, &a, &out), 0);
  tu_assert_shape(out, 1, (int64_t[]){24});
  for (int64_t i = 0; i < out->numel; i++) cr_assert_eq(at(out, i), 0.0);
  dsp_tensor *ts[] = {q, k, v, o, g, out};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* ---- errors ------------------------------------------------------- */

static void expect(int code, const char *sub, dsp_opcode op, dsp_tensor **in,
                   int n, dsp_attrs a) {
  dsp_tensor *out = (dsp_tensor *)1;
  int rc = dsp_op(ctx, op, in, n, &a, &out);
  tu_assert_err(ctx, rc, code, sub);
  cr_assert_null(out);
}

Test(attn, bad_shapes_dtypes_and_attributes) {
  dsp_tensor *q = rnd(DSP_F32, 2, 3, 4, 5), *k = rnd(DSP_F32, 2, 3, 6, 5),
             *v = rnd(DSP_F32, 2, 3, 6, 7), *v64 = rnd(DSP_F64, 2, 3, 6, 7),
             *kd = rnd(DSP_F32, 2, 3, 6, 4), *vt = rnd(DSP_F32, 2, 3, 5, 7),
             *kh = rnd(DSP_F32, 2, 2, 6, 5);
  dsp_tensor *q3 = zeros(DSP_F32, 3, (int64_t[]){3, 4, 5});
  dsp_tensor *qi = zeros(DSP_I64, 4, (int64_t[]){2, 3, 4, 5});
  uint8_t mb[12] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  dsp_tensor *m = mask_of(2, 6, mb), *m5 = mask_of(2, 5, mb);
  dsp_tensor *mf = zeros(DSP_F32, 2, (int64_t[]){2, 6});
  dsp_attrs ok = aattrs(0, 0, 0.0), okm = aattrs(0, 1, 0.0);
#define IN(...) (dsp_tensor *[]){__VA_ARGS__}
  expect(DISPATCH_ESHAPE, "q is [3, 4, 5], want [B, H, Tq, d]",
         DSP_OP_ATTENTION, IN(q3, k, v), 3, ok);
  expect(DISPATCH_EDTYPE, "q must be f32 or f64, got i64", DSP_OP_ATTENTION,
         IN(qi, k, v), 3, ok);
  expect(DISPATCH_EDTYPE, "q is f32 but v is f64", DSP_OP_ATTENTION,
         IN(q, k, v64), 3, ok);
  expect(DISPATCH_ESHAPE, "do not fit", DSP_OP_ATTENTION, IN(q, kd, v), 3, ok);
  expect(DISPATCH_ESHAPE, "do not fit", DSP_OP_ATTENTION, IN(q, k, vt), 3, ok);
  expect(DISPATCH_ESHAPE, "do not fit", DSP_OP_ATTENTION, IN(q, kh, v), 3, ok);
  expect(DISPATCH_ESHAPE, "key_mask is [2, 5], want [B, Tk] = [2, 6]",
         DSP_OP_ATTENTION, IN(q, k, v, m5), 4, okm);
  expect(DISPATCH_EDTYPE, "key_mask must be bool, got f32", DSP_OP_ATTENTION,
         IN(q, k, v, mf), 4, okm);
  expect(DISPATCH_EINVAL, "has_mask = 0 but 4 tensor inputs",
         DSP_OP_ATTENTION, IN(q, k, v, m), 4, ok);
  expect(DISPATCH_EINVAL, "has_mask = 1 but 3 tensor inputs",
         DSP_OP_ATTENTION, IN(q, k, v), 3, okm);
  expect(DISPATCH_EINVAL, "takes 3 or 4 inputs", DSP_OP_ATTENTION,
         IN(q, k), 2, ok);
  expect(DISPATCH_EINVAL, "causal = 2, want 0 or 1", DSP_OP_ATTENTION,
         IN(q, k, v), 3, aattrs(2, 0, 0.0));
  expect(DISPATCH_EINVAL, "scale inf is not finite", DSP_OP_ATTENTION,
         IN(q, k, v), 3, aattrs(0, 0, INFINITY));
  expect(DISPATCH_EINVAL, "attributes", DSP_OP_ATTENTION, IN(q, k, v), 3,
         dsp_attrs_none());
  /* backward: the grad must be the output's shape and dtype */
  dsp_tensor *g = rnd(DSP_F32, 2, 3, 4, 7), *gb = rnd(DSP_F32, 2, 3, 4, 6),
             *g64 = rnd(DSP_F64, 2, 3, 4, 7);
  expect(DISPATCH_ESHAPE, "grad is f32 [2, 3, 4, 6] but the attention output "
         "is f32 [2, 3, 4, 7]", DSP_OP_ATTENTION_BACKWARD, IN(gb, q, k, v), 4,
         ok);
  expect(DISPATCH_EDTYPE, "grad is f64", DSP_OP_ATTENTION_BACKWARD,
         IN(g64, q, k, v), 4, ok);
  expect(DISPATCH_EINVAL, "the grad and 3 or 4 inputs",
         DSP_OP_ATTENTION_BACKWARD, IN(g, q, k), 3, ok);
#undef IN
  dsp_tensor *ts[] = {q, k, v, v64, kd, vt, kh, q3, qi, m, m5, mf, g, gb, g64};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* The backward op has no rule of its own (no second-order gradients). */
Test(attn, backward_op_is_not_differentiable) {
  dsp_tensor *q = rnd(DSP_F64, 1, 1, 2, 2), *k = rnd(DSP_F64, 1, 1, 2, 2),
             *v = rnd(DSP_F64, 1, 1, 2, 2), *g = rnd(DSP_F64, 1, 1, 2, 2);
  cr_assert_eq(dsp_track(ctx, g), 0);
  dsp_attrs a = aattrs(0, 0, 0.0);
  dsp_tensor *in[4] = {g, q, k, v}, *out;
  cr_assert_eq(dsp_op(ctx, DSP_OP_ATTENTION_BACKWARD, in, 4, &a, &out), 0);
  dsp_tensor *l = tu_run(ctx, DSP_OP_SUM, NULL, 1, out, NULL, NULL);
  dsp_grads *gr = NULL;
  int rc = dsp_backward(ctx, l, 0, &gr);
  tu_assert_err(ctx, rc, DISPATCH_EUNSUPPORTED, "has no gradient rule");
  dsp_grads_free(gr);
  dsp_tensor *ts[] = {q, k, v, g, out, l};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dsp_tensor_unref(ts[i]);
}

/* ---- the client function, LOCAL against REMOTE --------------------- */

/* dispatch_attention with a key mask, causal, then the gradients of
 * sum(out * w) through dispatch_backward: every byte read back. */
static size_t client_program(dispatch_device *dev, unsigned char *buf,
                             size_t cap) {
  enum { B = 2, H = 2, TQ = 70, TK = 9, D = 4, DV = 3 };
  static float q[B * H * TQ * D], k[B * H * TK * D], v[B * H * TK * DV],
      w[B * H * TQ * DV];
  float *all[4] = {q, k, v, w};
  size_t lens[4] = {B * H * TQ * D, B * H * TK * D, B * H * TK * DV,
                    B * H * TQ * DV};
  g_rng = 12345;
  for (int t = 0; t < 4; t++)
    for (size_t i = 0; i < lens[t]; i++) all[t][i] = (float)urand();
  uint8_t mb[B * TK];
  for (int i = 0; i < B * TK; i++) mb[i] = i % 3 != 1;
  int64_t sq[4] = {B, H, TQ, D}, sk[4] = {B, H, TK, D}, sv[4] = {B, H, TK, DV},
          so[4] = {B, H, TQ, DV}, sm[2] = {B, TK};
  dispatch_tensor *tq, *tk, *tv, *tw, *tm, *aq, *ak, *av, *o, *p, *l, *g;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 4, sq, q, sizeof q, &tq));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 4, sk, k, sizeof k, &tk));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 4, sv, v, sizeof v, &tv));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 4, so, w, sizeof w, &tw));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_BOOL, 2, sm, mb, sizeof mb, &tm));
  OK(dev, dispatch_autodiff(tq, &aq));
  OK(dev, dispatch_autodiff(tk, &ak));
  OK(dev, dispatch_autodiff(tv, &av));
  OK(dev, dispatch_attention(aq, ak, av, tm, 1, 0.0, &o));
  OK(dev, dispatch_mul(o, tw, &p));
  OK(dev, dispatch_sum(p, 0, NULL, 0, &l));
  dispatch_grads *gr;
  OK(dev, dispatch_backward(l, &gr));
  size_t n = 0;
  dispatch_tensor *outs[4] = {o, aq, ak, av};
  for (int t = 0; t < 4; t++) {
    dispatch_tensor *r = outs[t];
    if (t) {
      OK(dev, dispatch_grad(gr, outs[t], &g));
      r = g;
    }
    size_t nb = dispatch_tensor_nbytes(r);
    cr_assert_leq(n + nb, cap);
    OK(dev, dispatch_tensor_read(r, buf + n, nb));
    n += nb;
    if (t) dispatch_tensor_free(g);
  }
  /* a mask of the wrong dtype fails at the call, on both kinds */
  dispatch_tensor *bad = NULL;
  cr_assert_eq(dispatch_attention(tq, tk, tv, tw, 0, 0.0, &bad),
               DISPATCH_EDTYPE);
  cr_assert_null(bad);
  cr_assert(strstr(dispatch_device_errmsg(dev), "key_mask must be bool"));
  dispatch_grads_free(gr);
  dispatch_tensor *ts[] = {tq, tk, tv, tw, tm, aq, ak, av, o, p, l};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) dispatch_tensor_free(ts[i]);
  return n;
}

Test(attn_client, local_and_remote_bit_identical) {
  sp_server srv;
  check_server_start(&srv, NULL);
  static unsigned char a[65536], b[65536];
  dispatch_device *loc = check_open(&srv, 0), *rem = check_open(&srv, 1);
  size_t na = client_program(loc, a, sizeof a);
  size_t nb = client_program(rem, b, sizeof b);
  cr_assert_eq(na, nb);
  cr_assert_eq(memcmp(a, b, na), 0, "LOCAL and REMOTE differ");
  /* the fused op's result is not all zeros (a mask bug could hide) */
  size_t nz = 0;
  for (size_t i = 0; i < na; i++) nz += a[i] != 0;
  cr_assert_gt(nz, na / 2);
  dispatch_device_close(loc);
  dispatch_device_close(rem);
  sp_stop(&srv);
}
