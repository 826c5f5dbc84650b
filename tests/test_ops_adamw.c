/* AdamW, global-norm gradient clipping and the cosine learning rate:
 * the adamw_step op against the formula written out here, the gradient
 * scale every step op takes, the norm and scale helpers the step runners
 * share, the client optimizer over several parameters (per-parameter
 * weight decay, clip active and inactive) against the same formula, and
 * LOCAL against REMOTE bit for bit over several clipped steps, and a
 * clipped step as one Step request (the server's request histogram). Needs
 * DISPATCH_SERVER_BIN for the REMOTE tests. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "graph.h"
#include "helpers/client_check.h"
#include "helpers/http.h"
#include "helpers/server_proc.h"
#include "helpers/tensor_util.h"

/* ------------------------------------------------------------------ */
/* the op                                                              */

static dsp_tensor *mk(dsp_ctx *ctx, dsp_dtype dt, int n, const double *v) {
  dsp_meta m = {dt, 1, {n}};
  dsp_tensor *t = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  for (int i = 0; i < n; i++) {
    if (dt == DSP_F32) ((float *)dsp_tensor_data(t))[i] = (float)v[i];
    else ((double *)dsp_tensor_data(t))[i] = v[i];
  }
  return t;
}

static dsp_attrs adamw_attrs(double lr, double wd, int64_t t, int scaled,
                             double scale) {
  dsp_attrs a = dsp_attrs_none();
  double f[5] = {lr, 0.9, 0.999, 1e-8, wd};
  for (int i = 0; i < 5; i++) a.floats[i] = f[i];
  a.n_floats = 5;
  if (scaled) a.floats[a.n_floats++] = scale;
  a.n_ints = 1;
  a.ints[0] = t;
  return a;
}

static int run4(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a,
                dsp_tensor *p, dsp_tensor *g, dsp_tensor *m, dsp_tensor *v) {
  dsp_tensor *in[4] = {p, g, m, v}, *out = NULL;
  int rc = dsp_op(ctx, op, in, 4, a, &out);
  if (rc == 0) {
    cr_assert_eq(out, p, "the output is the parameter itself");
    dsp_tensor_unref(out);
  }
  return rc;
}

/* torch.optim.AdamW's update of one element, in double */
static void ref_adamw(double *p, double *m, double *v, double g, double lr,
                      double b1, double b2, double eps, double wd, int t) {
  *p *= 1.0 - lr * wd;
  *m = b1 * *m + (1.0 - b1) * g;
  *v = b2 * *v + (1.0 - b2) * g * g;
  double mh = *m / (1.0 - pow(b1, t)), vh = *v / (1.0 - pow(b2, t));
  *p -= lr * mh / (sqrt(vh) + eps);
}

Test(adamw_op, three_steps_match_the_formula) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    double pv[3] = {1, -2, 0.5}, gv[3] = {0.3, -0.7, 2}, z[3] = {0};
    dsp_tensor *p = mk(ctx, dt, 3, pv), *g = mk(ctx, dt, 3, gv),
               *m = mk(ctx, dt, 3, z), *v = mk(ctx, dt, 3, z);
    double rp[3] = {1, -2, 0.5}, rm[3] = {0}, rv[3] = {0};
    for (int t = 1; t <= 3; t++) {
      dsp_attrs a = adamw_attrs(0.01, 0.1, t, 0, 1);
      cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &a, p, g, m, v), 0, "%s",
                   dsp_ctx_errmsg(ctx));
      for (int i = 0; i < 3; i++) {
        ref_adamw(&rp[i], &rm[i], &rv[i], gv[i], 0.01, 0.9, 0.999, 1e-8, 0.1,
                  t);
        double tol = d ? 1e-14 : 1e-6;
        cr_assert_float_eq(tu_at(p, i), rp[i], tol, "t %d p[%d] %.17g vs %.17g",
                           t, i, tu_at(p, i), rp[i]);
        cr_assert_float_eq(tu_at(m, i), rm[i], tol);
        cr_assert_float_eq(tu_at(v, i), rv[i], tol);
      }
    }
    /* step 1 by hand: m = 0.1 g, v = 0.001 g^2, so the bias-corrected
     * step is lr * g / (|g| + eps) = lr * sign(g) (almost) */
    cr_assert_float_eq(tu_at(g, 0), 0.3, 1e-7, "grad untouched");
    dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(m),
        dsp_tensor_unref(v);
  }
  dsp_ctx_free(ctx);
}

Test(adamw_op, step_one_by_hand) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double pv[1] = {2}, gv[1] = {0.5}, z[1] = {0};
  dsp_tensor *p = mk(ctx, DSP_F64, 1, pv), *g = mk(ctx, DSP_F64, 1, gv),
             *m = mk(ctx, DSP_F64, 1, z), *v = mk(ctx, DSP_F64, 1, z);
  dsp_attrs a = adamw_attrs(0.1, 0.5, 1, 0, 1);
  cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &a, p, g, m, v), 0);
  /* decay: 2 * (1 - 0.05) = 1.9; m = 0.05, v = 0.00025; mh = 0.5,
   * vh = 0.25; p = 1.9 - 0.1 * 0.5 / (0.5 + 1e-8) */
  cr_assert_float_eq(tu_at(p, 0), 1.9 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);
  cr_assert_float_eq(tu_at(m, 0), 0.05, 1e-16);
  cr_assert_float_eq(tu_at(v, 0), 0.00025, 1e-18);
  dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(m),
      dsp_tensor_unref(v);
  dsp_ctx_free(ctx);
}

/* adamw with decay 0 is adam, bit for bit; a scale of 1 changes no bit;
 * a scale of 0.5 is the same as a gradient halved (exact in binary) */
Test(adamw_op, decay_zero_is_adam_and_the_scale_reads_g_times_scale) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  enum { N = 37 };
  double pv[N], gv[N], hv[N], z[N] = {0};
  for (int i = 0; i < N; i++) {
    pv[i] = sin(i + 1.0), gv[i] = cos(3.0 * i), hv[i] = gv[i] * 0.5;
  }
  for (int d = 0; d < 2; d++) {
    dsp_dtype dt = d ? DSP_F64 : DSP_F32;
    dsp_tensor *p[4], *m[4], *v[4];
    for (int k = 0; k < 4; k++)
      p[k] = mk(ctx, dt, N, pv), m[k] = mk(ctx, dt, N, z),
      v[k] = mk(ctx, dt, N, z);
    dsp_tensor *g = mk(ctx, dt, N, gv), *h = mk(ctx, dt, N, hv);
    for (int t = 1; t <= 2; t++) {
      dsp_attrs adam = adamw_attrs(0.01, 0, t, 0, 1);
      adam.n_floats = 4;
      dsp_attrs w0 = adamw_attrs(0.01, 0, t, 0, 1);
      dsp_attrs w1 = adamw_attrs(0.01, 0, t, 1, 1.0);
      dsp_attrs half = adamw_attrs(0.01, 0, t, 1, 0.5);
      cr_assert_eq(run4(ctx, DSP_OP_ADAM_STEP, &adam, p[0], g, m[0], v[0]), 0);
      cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &w0, p[1], g, m[1], v[1]), 0);
      cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &w1, p[2], g, m[2], v[2]), 0);
      /* p[3] with the halved gradient and no scale vs p[2]'s path: the
       * same as adamw over g with scale 0.5 */
      cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &half, p[3], g, m[3], v[3]),
                   0);
    }
    size_t nb = dsp_tensor_nbytes(p[0]);
    cr_assert_eq(memcmp(dsp_tensor_data(p[0]), dsp_tensor_data(p[1]), nb), 0,
                 "adamw wd 0 differs from adam");
    cr_assert_eq(memcmp(dsp_tensor_data(p[1]), dsp_tensor_data(p[2]), nb), 0,
                 "a scale of 1 changed bits");
    /* the halved gradient, unscaled */
    dsp_tensor *q = mk(ctx, dt, N, pv), *qm = mk(ctx, dt, N, z),
               *qv = mk(ctx, dt, N, z);
    for (int t = 1; t <= 2; t++) {
      dsp_attrs w0 = adamw_attrs(0.01, 0, t, 0, 1);
      cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &w0, q, h, qm, qv), 0);
    }
    cr_assert_eq(memcmp(dsp_tensor_data(q), dsp_tensor_data(p[3]), nb), 0,
                 "scale 0.5 is not g * 0.5");
    dsp_tensor_unref(q), dsp_tensor_unref(qm), dsp_tensor_unref(qv);
    for (int k = 0; k < 4; k++)
      dsp_tensor_unref(p[k]), dsp_tensor_unref(m[k]), dsp_tensor_unref(v[k]);
    dsp_tensor_unref(g), dsp_tensor_unref(h);
  }
  dsp_ctx_free(ctx);
}

/* sgd's and adam's scale too: sgd over g with scale 0.25 == sgd over
 * g / 4 (momentum and weight decay on, and the plain loop) */
Test(adamw_op, sgd_reads_the_scale) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double pv[3] = {1, 2, 3}, gv[3] = {0.5, -1, 4}, qv[3] = {0.125, -0.25, 1},
         z[3] = {0};
  for (int plain = 0; plain < 2; plain++) {
    dsp_tensor *p1 = mk(ctx, DSP_F64, 3, pv), *p2 = mk(ctx, DSP_F64, 3, pv),
               *g = mk(ctx, DSP_F64, 3, gv), *q = mk(ctx, DSP_F64, 3, qv),
               *v1 = mk(ctx, DSP_F64, 3, z), *v2 = mk(ctx, DSP_F64, 3, z);
    dsp_attrs a = dsp_attrs_none(), s;
    a.n_floats = 3;
    a.floats[0] = 0.1, a.floats[1] = plain ? 0 : 0.9,
    a.floats[2] = plain ? 0 : 0.01;
    s = a;
    s.floats[s.n_floats++] = 0.25;
    for (int k = 0; k < 2; k++) {
      dsp_tensor *i1[3] = {p1, g, v1}, *i2[3] = {p2, q, v2}, *o;
      cr_assert_eq(dsp_op(ctx, DSP_OP_SGD_STEP, i1, 3, &s, &o), 0, "%s",
                   dsp_ctx_errmsg(ctx));
      dsp_tensor_unref(o);
      cr_assert_eq(dsp_op(ctx, DSP_OP_SGD_STEP, i2, 3, &a, &o), 0);
      dsp_tensor_unref(o);
    }
    cr_assert_eq(memcmp(dsp_tensor_data(p1), dsp_tensor_data(p2), 24), 0);
    cr_assert_eq(memcmp(dsp_tensor_data(v1), dsp_tensor_data(v2), 24), 0);
    dsp_tensor_unref(p1), dsp_tensor_unref(p2), dsp_tensor_unref(g),
        dsp_tensor_unref(q), dsp_tensor_unref(v1), dsp_tensor_unref(v2);
  }
  dsp_ctx_free(ctx);
}

static void expect(dsp_ctx *ctx, int rc, int code, const char *sub) {
  cr_assert_eq(rc, code, "rc %s, want %s (%s)", dispatch_err_name(rc),
               dispatch_err_name(code), dsp_ctx_errmsg(ctx));
  cr_assert(strstr(dsp_ctx_errmsg(ctx), sub), "message '%s' lacks '%s'",
            dsp_ctx_errmsg(ctx), sub);
}

Test(adamw_op, errors) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double z[3] = {0};
  dsp_tensor *p = mk(ctx, DSP_F32, 3, z), *g = mk(ctx, DSP_F32, 3, z),
             *m = mk(ctx, DSP_F32, 3, z), *v2 = mk(ctx, DSP_F32, 2, z),
             *vd = mk(ctx, DSP_F64, 3, z);
  dsp_attrs a = adamw_attrs(0.1, 0.1, 1, 0, 1), bad = a;
  bad.n_floats = 4;
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "takes 5 float and 1 int");
  bad = a;
  bad.floats[4] = NAN;
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "weight_decay = nan is not finite");
  bad = adamw_attrs(0.1, 0.1, 1, 1, INFINITY);
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "gradient scale = inf is not finite and >= 0");
  bad = adamw_attrs(0.1, 0.1, 1, 1, -0.5);
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "gradient scale = -0.5");
  bad = a;
  bad.floats[2] = 1;
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "adamw_step: beta2 = 1 outside [0, 1)");
  bad = a;
  bad.ints[0] = 0;
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &bad, p, g, m, m), DISPATCH_EINVAL,
         "step t = 0");
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &a, p, g, m, v2), DISPATCH_ESHAPE,
         "v is [2] but param is [3]");
  expect(ctx, run4(ctx, DSP_OP_ADAMW_STEP, &a, p, g, m, vd), DISPATCH_EDTYPE,
         "v is f64 but param is f32");
  /* a NaN scale (the clip of a NaN norm) is accepted and propagates */
  dsp_attrs nan_s = adamw_attrs(0.1, 0, 1, 1, NAN);
  cr_assert_eq(run4(ctx, DSP_OP_ADAMW_STEP, &nan_s, p, g, m, m), 0, "%s",
               dsp_ctx_errmsg(ctx));
  cr_assert(isnan(tu_at(p, 0)));
  dsp_tensor_unref(p), dsp_tensor_unref(g), dsp_tensor_unref(m),
      dsp_tensor_unref(v2), dsp_tensor_unref(vd);
  dsp_ctx_free(ctx);
}

/* ------------------------------------------------------------------ */
/* the shared norm and scale                                           */

Test(clip, sqnorm_over_tensors_of_both_float_dtypes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  double a[3] = {3, 4, 0}, b[11];
  for (int i = 0; i < 11; i++) b[i] = i; /* 0^2 + ... + 10^2 = 385 */
  dsp_tensor *g[2] = {mk(ctx, DSP_F32, 3, a), mk(ctx, DSP_F64, 11, b)};
  double sq = -1;
  cr_assert_eq(dsp_grads_sqnorm(ctx, g, 2, &sq), 0);
  cr_assert_eq(sq, 25.0 + 385.0);
  cr_assert_eq(dsp_grads_sqnorm(ctx, g, 0, &sq), 0);
  cr_assert_eq(sq, 0.0);
  dsp_meta im = {DSP_I64, 1, {2}};
  dsp_tensor *it = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &im, &it), 0);
  dsp_tensor *bad[2] = {g[0], it};
  expect(ctx, dsp_grads_sqnorm(ctx, bad, 2, &sq), DISPATCH_EDTYPE,
         "gradient 1 is i64");
  dsp_tensor_unref(it), dsp_tensor_unref(g[0]), dsp_tensor_unref(g[1]);
  dsp_ctx_free(ctx);
}

Test(clip, scale_is_torchs) {
  cr_assert_eq(dsp_clip_scale(1.0, 0.5), 1.0, "under the bound: none");
  cr_assert_eq(dsp_clip_scale(1.0, 1.0), 1.0 / (1.0 + 1e-6));
  cr_assert_eq(dsp_clip_scale(2.0, 8.0), 2.0 / (8.0 + 1e-6));
  cr_assert_eq(dsp_clip_scale(1.0, INFINITY), 0.0);
  cr_assert(isnan(dsp_clip_scale(1.0, NAN)));
  cr_assert_eq(dsp_step_states(DSP_OP_SGD_STEP), 1);
  cr_assert_eq(dsp_step_states(DSP_OP_ADAMW_STEP), 2);
  cr_assert_eq(dsp_step_states(DSP_OP_ADD), 0);
  cr_assert_eq(dsp_step_states(-7), 0);
}

Test(clip, param_attrs_append_decay_then_scale) {
  dsp_attrs base = dsp_attrs_none(), out;
  base.n_floats = 4;
  base.floats[0] = 0.1;
  base.n_ints = 1;
  base.ints[0] = 3;
  double wd[2] = {0.1, 0};
  dsp_step_param_attrs(DSP_OP_ADAMW_STEP, &base, wd, 0, 1, 0.25, &out);
  cr_assert_eq(out.n_floats, 6);
  cr_assert_eq(out.floats[4], 0.1);
  cr_assert_eq(out.floats[5], 0.25);
  cr_assert_eq(out.ints[0], 3);
  dsp_step_param_attrs(DSP_OP_ADAMW_STEP, &base, NULL, 1, 0, 0.25, &out);
  cr_assert_eq(out.n_floats, 5);
  cr_assert_eq(out.floats[4], 0.0);
  base.n_floats = 3;
  dsp_step_param_attrs(DSP_OP_SGD_STEP, &base, wd, 1, 1, 0.5, &out);
  cr_assert_eq(out.n_floats, 4);
  cr_assert_eq(out.floats[3], 0.5);
}

Test(lr_cosine, warmup_cosine_and_floor) {
  /* warmup: lr_max (step+1)/warmup */
  cr_assert_float_eq(dispatch_lr_cosine(0, 100, 2000, 3e-3, 3e-4), 3e-5,
                     1e-18);
  cr_assert_float_eq(dispatch_lr_cosine(99, 100, 2000, 3e-3, 3e-4), 3e-3,
                     1e-18);
  /* the cosine starts at lr_max, halves the span midway, ends at lr_min */
  cr_assert_float_eq(dispatch_lr_cosine(100, 100, 2000, 3e-3, 3e-4), 3e-3,
                     1e-18);
  cr_assert_float_eq(dispatch_lr_cosine(1050, 100, 2000, 3e-3, 3e-4),
                     3e-4 + 0.5 * (3e-3 - 3e-4), 1e-15);
  cr_assert_float_eq(dispatch_lr_cosine(575, 100, 2000, 3e-3, 3e-4),
                     3e-4 + 0.5 * (1 + cos(M_PI * 0.25)) * 2.7e-3, 1e-15);
  cr_assert_eq(dispatch_lr_cosine(2000, 100, 2000, 3e-3, 3e-4), 3e-4);
  cr_assert_eq(dispatch_lr_cosine(5000, 100, 2000, 3e-3, 3e-4), 3e-4);
  /* no warmup */
  cr_assert_eq(dispatch_lr_cosine(0, 0, 10, 1.0, 0.0), 1.0);
  cr_assert_float_eq(dispatch_lr_cosine(5, 0, 10, 1.0, 0.0), 0.5, 1e-15);
}

/* A graph's STEP node carries the clip and decays as a Step does, and
 * the definition check judges them (the server runs it on what arrives) */
static int check_step_graph(int op, int flags_node, double max_norm,
                            const double *wd, uint32_t n_wd,
                            const char *want) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_graph *g = dsp_graph_new();
  g->n_ext = 4, g->n_slots = 5; /* loss, param, m, v; the gradients */
  uint32_t bw[1] = {0}, st[4] = {4, 1, 2, 3};
  cr_assert_eq(dsp_graph_add(g, DSP_G_BACKWARD, 0, 0, bw, 1, 4, NULL), 0);
  if (flags_node) /* the extras set on the backward node instead */
    cr_assert_eq(dsp_graph_set_step(g, max_norm, wd, n_wd), 0);
  dsp_attrs a = dsp_attrs_none();
  cr_assert_eq(dsp_graph_add(g, DSP_G_STEP, op, 0, st,
                             op == DSP_OP_SGD_STEP ? 3 : 4, 0, &a), 0);
  if (!flags_node) cr_assert_eq(dsp_graph_set_step(g, max_norm, wd, n_wd), 0);
  int rc = dsp_graph_check(ctx, g);
  if (want)
    cr_assert(rc == DISPATCH_EINVAL && strstr(dsp_ctx_errmsg(ctx), want),
              "rc %d, message '%s' lacks '%s'", rc, dsp_ctx_errmsg(ctx), want);
  else
    cr_assert_eq(rc, 0, "%s", dsp_ctx_errmsg(ctx));
  dsp_graph_free(g);
  dsp_ctx_free(ctx);
  return rc;
}

Test(clip, graph_step_extras_checked_at_definition) {
  double one[1] = {0.1}, two[2] = {0.1, 0}, bad[1] = {INFINITY};
  check_step_graph(DSP_OP_ADAMW_STEP, 0, 1.0, one, 1, NULL);
  check_step_graph(DSP_OP_ADAMW_STEP, 0, 0.0, NULL, 0, NULL);
  check_step_graph(DSP_OP_SGD_STEP, 0, 1.0, NULL, 0, NULL);
  check_step_graph(DSP_OP_ADAMW_STEP, 0, 1.0, two, 2,
                   "2 weight decays for 1 params");
  check_step_graph(DSP_OP_SGD_STEP, 0, 0.0, one, 1,
                   "1 weight decays for 1 params (adamw only");
  check_step_graph(DSP_OP_ADAMW_STEP, 0, -1.0, NULL, 0,
                   "max_norm = -1 is not finite and >= 0");
  check_step_graph(DSP_OP_ADAMW_STEP, 0, NAN, NULL, 0, "max_norm = nan");
  check_step_graph(DSP_OP_ADAMW_STEP, 0, 0.0, bad, 1,
                   "weight decay 0 = inf is not finite");
  check_step_graph(DSP_OP_ADAMW_STEP, 1, 1.0, NULL, 0,
                   "a clip or weight decays outside a step");
}

/* ------------------------------------------------------------------ */
/* the client optimizer                                                */

static sp_server g_srv;
static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_dev(int remote) {
  char spec[64], msg[256] = "";
  if (remote) snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  else snprintf(spec, sizeof spec, "local");
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s", spec, msg);
  return dev;
}

enum { NA = 3, NB = 2 };
static const double g_a0[NA] = {1, -2, 0.5}, g_b0[NB] = {0.25, 3};
static const double g_ca[NA] = {0.3, -0.7, 2}, g_cb[NB] = {1.5, -0.5};

static dispatch_tensor *leaf(dispatch_device *dev, int n, const double *v) {
  int64_t sh[1] = {n};
  dispatch_tensor *t, *a;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F64, 1, sh, v,
                                    sizeof(double) * (size_t)n, &t));
  OK(dev, dispatch_autodiff(t, &a));
  return a;
}

/* loss = sum(a * ca) + sum(b * cb) (linear: the gradients are ca and cb
 * exactly) or, quadratic, sum(a * a * ca) + sum(b * b * cb) */
static void one_step(dispatch_device *dev, dispatch_optim *opt,
                     dispatch_tensor *a, dispatch_tensor *b,
                     dispatch_tensor *ca, dispatch_tensor *cb, int quad) {
  OK(dev, dispatch_scope_begin(dev));
  dispatch_tensor *ta, *tb, *sa, *sb, *loss;
  OK(dev, dispatch_mul(a, ca, &ta));
  OK(dev, dispatch_mul(b, cb, &tb));
  if (quad) {
    OK(dev, dispatch_mul(ta, a, &ta));
    OK(dev, dispatch_mul(tb, b, &tb));
  }
  OK(dev, dispatch_sum(ta, 0, NULL, 0, &sa));
  OK(dev, dispatch_sum(tb, 0, NULL, 0, &sb));
  OK(dev, dispatch_add(sa, sb, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(opt, g));
  dispatch_grads_free(g);
  OK(dev, dispatch_scope_end(dev));
}

static dispatch_tensor *plain(dispatch_device *dev, int n, const double *v) {
  int64_t sh[1] = {n};
  dispatch_tensor *t;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F64, 1, sh, v,
                                    sizeof(double) * (size_t)n, &t));
  return t;
}

/* Runs `steps` AdamW steps (wd {0.1, 0}, clip max_norm: 0 off) and leaves
 * the parameters in pa, pb. */
static void run_adamw(dispatch_device *dev, int steps, double max_norm,
                      int quad, double *pa, double *pb) {
  dispatch_tensor *a = leaf(dev, NA, g_a0), *b = leaf(dev, NB, g_b0);
  dispatch_tensor *ca = plain(dev, NA, g_ca), *cb = plain(dev, NB, g_cb);
  dispatch_tensor *ps[2] = {a, b};
  double wd[2] = {0.1, 0};
  dispatch_optim *opt;
  OK(dev, dispatch_adamw_new(ps, 2, 0.01, 0.9, 0.999, 1e-8, wd, &opt));
  OK(dev, dispatch_optim_set_clip(opt, max_norm));
  for (int s = 0; s < steps; s++) {
    OK(dev, dispatch_optim_set_lr(opt, dispatch_lr_cosine(s, 2, steps, 0.01,
                                                          0.001)));
    one_step(dev, opt, a, b, ca, cb, quad);
  }
  OK(dev, dispatch_tensor_read(a, pa, sizeof(double) * NA));
  OK(dev, dispatch_tensor_read(b, pb, sizeof(double) * NB));
  dispatch_optim_free(opt);
  dispatch_tensor_free(a), dispatch_tensor_free(b);
  dispatch_tensor_free(ca), dispatch_tensor_free(cb);
}

/* the same steps by the formula: constant gradients ca, cb */
static void ref_run(int steps, double max_norm, double *pa, double *pb) {
  double p[NA + NB], m[NA + NB] = {0}, v[NA + NB] = {0}, c[NA + NB];
  for (int i = 0; i < NA; i++) p[i] = g_a0[i], c[i] = g_ca[i];
  for (int i = 0; i < NB; i++) p[NA + i] = g_b0[i], c[NA + i] = g_cb[i];
  double sq = 0;
  for (int i = 0; i < NA + NB; i++) sq += c[i] * c[i];
  double scale = 1.0;
  if (max_norm > 0 && max_norm / (sqrt(sq) + 1e-6) < 1)
    scale = max_norm / (sqrt(sq) + 1e-6);
  for (int s = 0; s < steps; s++) {
    double lr = dispatch_lr_cosine(s, 2, steps, 0.01, 0.001);
    for (int i = 0; i < NA + NB; i++)
      ref_adamw(&p[i], &m[i], &v[i], c[i] * scale, lr, 0.9, 0.999, 1e-8,
                i < NA ? 0.1 : 0.0, s + 1);
  }
  for (int i = 0; i < NA; i++) pa[i] = p[i];
  for (int i = 0; i < NB; i++) pb[i] = p[NA + i];
}

static void assert_close(const double *got, const double *want, int n,
                         const char *what) {
  for (int i = 0; i < n; i++)
    cr_assert_float_eq(got[i], want[i], 1e-13, "%s[%d]: %.17g vs %.17g", what,
                       i, got[i], want[i]);
}

Test(adamw_client, per_param_decay_and_clip_match_the_formula) {
  dispatch_device *dev = open_dev(0);
  /* |c| = sqrt(0.09 + 0.49 + 4 + 2.25 + 0.25) = sqrt(7.08) ~ 2.66: a
   * max_norm of 1 clips, one of 10 does not */
  const double norms[3] = {0, 1.0, 10.0};
  double pa[NA], pb[NB], ra[NA], rb[NB], na[NA], nb[NB];
  for (int k = 0; k < 3; k++) {
    run_adamw(dev, 5, norms[k], 0, pa, pb);
    ref_run(5, norms[k], ra, rb);
    assert_close(pa, ra, NA, "a"), assert_close(pb, rb, NB, "b");
    if (k == 0) memcpy(na, pa, sizeof na), memcpy(nb, pb, sizeof nb);
    if (k == 2) {
      /* an inactive clip changes no bit */
      cr_assert_eq(memcmp(na, pa, sizeof na), 0);
      cr_assert_eq(memcmp(nb, pb, sizeof nb), 0);
    }
    /* Adam is almost blind to a constant scale of constant gradients
     * (only eps sees it): the clip shows in the low bits */
    if (k == 1) cr_assert_neq(memcmp(na, pa, sizeof na), 0, "no clip effect");
  }
  /* b has no decay: with clipping off it moved by Adam alone; a decays */
  dispatch_device_close(dev);
}

Test(adamw_client, argument_errors) {
  dispatch_device *dev = open_dev(0);
  dispatch_tensor *a = leaf(dev, NA, g_a0);
  dispatch_optim *opt = (dispatch_optim *)&opt;
  double wd[1] = {INFINITY};
  cr_assert_eq(dispatch_adamw_new(&a, 1, 0.01, 0.9, 0.999, 1e-8, wd, &opt),
               DISPATCH_EINVAL);
  cr_assert_null(opt);
  cr_assert(strstr(dispatch_device_errmsg(dev), "weight_decay[0] = inf"));
  OK(dev, dispatch_adamw_new(&a, 1, 0.01, 0.9, 0.999, 1e-8, NULL, &opt));
  cr_assert_eq(dispatch_optim_set_clip(opt, -1), DISPATCH_EINVAL);
  cr_assert_eq(dispatch_optim_set_clip(opt, NAN), DISPATCH_EINVAL);
  cr_assert_eq(dispatch_optim_set_clip(opt, INFINITY), DISPATCH_EINVAL);
  cr_assert_eq(dispatch_optim_set_clip(NULL, 1), DISPATCH_EINVAL);
  OK(dev, dispatch_optim_set_clip(opt, 0));
  dispatch_optim_free(opt);
  dispatch_tensor_free(a);
  dispatch_device_close(dev);
}

/* clipping works for sgd and adam too (clip inactive: bits as without) */
Test(adamw_client, clip_applies_to_sgd_and_adam) {
  dispatch_device *dev = open_dev(0);
  for (int kind = 0; kind < 2; kind++) {
    double out[2][NA];
    for (int clip = 0; clip < 2; clip++) {
      dispatch_tensor *a = leaf(dev, NA, g_a0), *b = leaf(dev, NB, g_b0);
      dispatch_tensor *ca = plain(dev, NA, g_ca), *cb = plain(dev, NB, g_cb);
      dispatch_tensor *ps[2] = {a, b};
      dispatch_optim *opt;
      if (kind) OK(dev, dispatch_adam_new(ps, 2, 0.01, 0.9, 0.999, 1e-8, &opt));
      else OK(dev, dispatch_sgd_new(ps, 2, 0.1, 0, 0, &opt));
      OK(dev, dispatch_optim_set_clip(opt, clip ? 1.0 : 0));
      one_step(dev, opt, a, b, ca, cb, 0);
      OK(dev, dispatch_tensor_read(a, out[clip], sizeof out[clip]));
      dispatch_optim_free(opt);
      dispatch_tensor_free(a), dispatch_tensor_free(b);
      dispatch_tensor_free(ca), dispatch_tensor_free(cb);
    }
    double s = 1.0 / (sqrt(7.08) + 1e-6);
    for (int i = 0; i < NA; i++) {
      if (!kind) /* sgd: p - lr * g * s */
        cr_assert_float_eq(out[1][i], g_a0[i] - 0.1 * (g_ca[i] * s), 1e-15);
      else /* adam's first step is lr * sign(g) whatever the scale */
        cr_assert_float_eq(out[1][i], out[0][i], 1e-9);
    }
  }
  dispatch_device_close(dev);
}

Test(adamw_client, local_and_remote_bit_identical_with_clipping,
     .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  double pa[2][NA], pb[2][NB];
  uint64_t ops[2];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    dispatch_stats s0 = DISPATCH_STATS_INIT, s1 = DISPATCH_STATS_INIT;
    OK(dev, dispatch_device_stats(dev, &s0));
    /* quadratic loss: the gradients and so the clip change every step */
    run_adamw(dev, 6, 1.0, 1, pa[r], pb[r]);
    OK(dev, dispatch_device_stats(dev, &s1));
    cr_assert_eq(s1.errors, s0.errors);
    ops[r] = s1.ops - s0.ops;
    dispatch_device_close(dev);
  }
  /* the server ran what LOCAL ran: one update per parameter per step (the
   * norm is no op of its own; the step went as one Step message) */
  cr_assert_eq(ops[0], ops[1], "local %llu ops, remote %llu",
               (unsigned long long)ops[0], (unsigned long long)ops[1]);
  cr_assert_eq(memcmp(pa[0], pa[1], sizeof pa[0]), 0, "a differs");
  cr_assert_eq(memcmp(pb[0], pb[1], sizeof pb[0]), 0, "b differs");
}

/* "dispatch-server metrics on 127.0.0.1:P", the line after the listening
 * one (as tests/test_metrics.c reads it) */
static int metrics_port(int fd) {
  char line[256];
  size_t len = 0;
  while (len < sizeof line - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 60000);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    if (read(fd, line + len, 1) <= 0) return -1;
    if (line[len] == '\n') break;
    len++;
  }
  line[len] = '\0';
  const char *prefix = "dispatch-server metrics on 127.0.0.1:";
  if (strncmp(line, prefix, strlen(prefix)) != 0) return -1;
  return atoi(line + strlen(prefix));
}

/* Step requests the server has finished (its request histogram's count) */
static double steps_done(int port) {
  char *body = NULL, why[256];
  int st = http_request(port, "GET", "/metrics", &body, why, sizeof why);
  cr_assert_eq(st, 200, "GET /metrics: %d %s", st, why);
  const char *series = "dispatch_request_duration_seconds_count{kind=\"step\"} ";
  const char *p = strstr(body, series);
  cr_assert_not_null(p, "no step count in the metrics");
  double v = strtod(p + strlen(series), NULL);
  free(body);
  return v;
}

/* A clipped AdamW step over two parameters is one Step request: the norm
 * is the server's, not a round trip of the gradients */
Test(adamw_client, clipped_step_is_one_message, .fini = stop_server) {
  const char *args[] = {"--metrics-listen", "127.0.0.1:0", NULL};
  check_server_start(&g_srv, args);
  int port = metrics_port(g_srv.out_fd);
  cr_assert_gt(port, 0, "no metrics line");
  dispatch_device *dev = open_dev(1);
  double pa[NA], pb[NB];
  double before = steps_done(port);
  run_adamw(dev, 5, 1.0, 1, pa, pb); /* ends with reads: every step ran */
  cr_assert_eq(steps_done(port) - before, 5.0);
  dispatch_device_close(dev);
}

/* the last clipped step's norm, read back from the device: before the
 * clip, torch's clip_grad_norm_ return value; LOCAL and REMOTE alike */
Test(adamw_client, last_norm_is_the_unclipped_global_norm,
     .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  double got[2];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    dispatch_tensor *a = leaf(dev, NA, g_a0), *b = leaf(dev, NB, g_b0);
    dispatch_tensor *ca = plain(dev, NA, g_ca), *cb = plain(dev, NB, g_cb);
    dispatch_tensor *ps[2] = {a, b};
    dispatch_optim *opt;
    OK(dev, dispatch_adamw_new(ps, 2, 0.01, 0.9, 0.999, 1e-8, NULL, &opt));
    double v = 0;
    cr_assert_eq(dispatch_optim_last_norm(opt, &v), DISPATCH_EINVAL);
    cr_assert(isnan(v));
    cr_assert(strstr(dispatch_device_errmsg(dev), "never clipped"));
    OK(dev, dispatch_optim_set_clip(opt, 1.0));
    OK(dev, dispatch_optim_last_norm(opt, &v));
    cr_assert_eq(v, 0.0, "0 before the first clipped step");
    one_step(dev, opt, a, b, ca, cb, 0);
    OK(dev, dispatch_optim_last_norm(opt, &got[r]));
    /* the linear loss's gradients are ca, cb: sqrt(7.08) */
    cr_assert_float_eq(got[r], sqrt(7.08), 1e-15, "%.17g", got[r]);
    /* clipping off: the norm stays the last clipped step's */
    OK(dev, dispatch_optim_set_clip(opt, 0));
    one_step(dev, opt, a, b, ca, cb, 1);
    OK(dev, dispatch_optim_last_norm(opt, &v));
    cr_assert_eq(v, got[r]);
    dispatch_optim_free(opt);
    dispatch_tensor_free(a), dispatch_tensor_free(b);
    dispatch_tensor_free(ca), dispatch_tensor_free(cb);
    dispatch_device_close(dev);
  }
  cr_assert_eq(memcmp(&got[0], &got[1], sizeof got[0]), 0);
}

/* With loss scaling too (issue 24) the step stays one Step request: the
 * scale's check, skip and update run inside it on the server */
Test(adamw_client, loss_scaled_step_is_one_message, .fini = stop_server) {
  const char *args[] = {"--metrics-listen", "127.0.0.1:0", NULL};
  check_server_start(&g_srv, args);
  int port = metrics_port(g_srv.out_fd);
  cr_assert_gt(port, 0, "no metrics line");
  dispatch_device *dev = open_dev(1);
  dispatch_tensor *a = leaf(dev, NA, g_a0), *b = leaf(dev, NB, g_b0);
  dispatch_tensor *ca = plain(dev, NA, g_ca), *cb = plain(dev, NB, g_cb);
  dispatch_tensor *ps[2] = {a, b};
  dispatch_optim *opt;
  OK(dev, dispatch_adamw_new(ps, 2, 0.01, 0.9, 0.999, 1e-8, NULL, &opt));
  OK(dev, dispatch_optim_set_clip(opt, 1.0));
  OK(dev, dispatch_optim_set_loss_scale(opt, 1024, 2, 0.5, 2));
  double before = steps_done(port), s = 0, pa[NA];
  for (int i = 0; i < 3; i++) one_step(dev, opt, a, b, ca, cb, 1);
  OK(dev, dispatch_tensor_read(a, pa, sizeof pa)); /* every step ran */
  cr_assert_eq(steps_done(port) - before, 3.0);
  OK(dev, dispatch_optim_loss_scale(opt, &s, NULL));
  cr_assert_eq(s, 2048.0, "grown once after 2 clean steps: %g", s);
  dispatch_optim_free(opt);
  dispatch_tensor_free(a), dispatch_tensor_free(b);
  dispatch_tensor_free(ca), dispatch_tensor_free(cb);
  dispatch_device_close(dev);
}
