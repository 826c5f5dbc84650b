/* Dynamic loss scaling inside the optimizer step
 * (dispatch_optim_set_loss_scale): a scaled run gives the unscaled run's
 * bits (power-of-two scales are exact), an inf or NaN gradient skips the
 * step (parameters and state bit-unchanged, the scale backed off, Adam's
 * step count not advanced), the scale grows after `interval` clean steps,
 * LOCAL and REMOTE agree bit for bit, and the argument errors. f32
 * parameters throughout. Needs DISPATCH_SERVER_BIN for the REMOTE runs. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;
static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

enum { N = 4 };
static const float g_p0[N] = {1.0f, -2.0f, 0.5f, 0.25f};
static const float g_c[N] = {0.3f, -0.7f, 2.0f, 1.5f};

static dispatch_tensor *f32(dispatch_device *dev, const float *v) {
  int64_t sh[1] = {N};
  dispatch_tensor *t;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, sh, v,
                                    sizeof(float) * N, &t));
  return t;
}

/* One step of loss = sum(p * p * c) (its gradient changes every step), or
 * with c's first element replaced by `poison` (inf or NaN) when poison is
 * not 0. With a scaler the backward starts from the scaled loss. */
static void one_step(dispatch_device *dev, dispatch_optim *opt,
                     dispatch_tensor *p, int scaled, float poison) {
  float c[N];
  memcpy(c, g_c, sizeof c);
  if (poison != 0.0f) c[0] = poison;
  OK(dev, dispatch_scope_begin(dev));
  dispatch_tensor *ct = f32(dev, c), *t, *loss;
  OK(dev, dispatch_mul(p, p, &t));
  OK(dev, dispatch_mul(t, ct, &t));
  OK(dev, dispatch_sum(t, 0, NULL, 0, &loss));
  if (scaled) OK(dev, dispatch_optim_scale_loss(opt, loss, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(opt, g));
  dispatch_grads_free(g);
  dispatch_tensor_free(ct);
  OK(dev, dispatch_scope_end(dev));
}

typedef struct run_cfg {
  double scale; /* 0: no loss scaling */
  int64_t interval;
  double max_norm;
  int steps;
  int poison_at; /* the step given a non-finite gradient, -1: none */
  float poison;
} run_cfg;

typedef struct run_out {
  float p[N];
  double scale;
  int64_t skipped;
} run_out;

static void run(dispatch_device *dev, const run_cfg *c, run_out *o) {
  dispatch_tensor *t = f32(dev, g_p0), *p;
  OK(dev, dispatch_autodiff(t, &p));
  dispatch_tensor_free(t);
  dispatch_optim *opt;
  double wd[1] = {0.1};
  OK(dev, dispatch_adamw_new(&p, 1, 0.05, 0.9, 0.95, 1e-8, wd, &opt));
  OK(dev, dispatch_optim_set_clip(opt, c->max_norm));
  if (c->scale > 0)
    OK(dev, dispatch_optim_set_loss_scale(opt, c->scale, 2.0, 0.5,
                                          c->interval));
  for (int s = 0; s < c->steps; s++)
    one_step(dev, opt, p, c->scale > 0, s == c->poison_at ? c->poison : 0.0f);
  OK(dev, dispatch_tensor_read(p, o->p, sizeof o->p));
  o->scale = -1;
  o->skipped = -1;
  if (c->scale > 0) OK(dev, dispatch_optim_loss_scale(opt, &o->scale, &o->skipped));
  dispatch_optim_free(opt);
  dispatch_tensor_free(p);
}

static void same_bits(const float *a, const float *b, const char *what) {
  for (int i = 0; i < N; i++)
    cr_assert_eq(memcmp(&a[i], &b[i], sizeof a[i]), 0,
                 "%s: element %d: %.9g vs %.9g", what, i, (double)a[i],
                 (double)b[i]);
}

/* LOCAL (r 0) or the test's server (r 1) */
static dispatch_device *open_dev(int r) { return check_open(&g_srv, r); }

Test(loss_scale, scaled_run_has_the_unscaled_bits, .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  run_out plain[2], scaled[2];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    /* the clip is active (|g| ~ 4.6 > 1) and taken on the unscaled norm */
    run_cfg c = {0, 0, 1.0, 6, -1, 0};
    run(dev, &c, &plain[r]);
    c.scale = 1024;
    c.interval = 1000;
    run(dev, &c, &scaled[r]);
    cr_assert_eq(scaled[r].scale, 1024.0);
    cr_assert_eq(scaled[r].skipped, 0);
    same_bits(scaled[r].p, plain[r].p, r ? "remote" : "local");
    dispatch_device_close(dev);
  }
  same_bits(plain[0].p, plain[1].p, "local vs remote");
  same_bits(scaled[0].p, scaled[1].p, "local vs remote, scaled");
}

/* An inf (then a NaN) gradient at step 2: that step changes nothing, the
 * scale halves, and Adam's t does not count it, so the run equals a run
 * one step shorter without the poisoned step, bit for bit. */
Test(loss_scale, non_finite_gradient_skips_the_step, .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  const float poisons[2] = {INFINITY, NAN};
  run_out got[2][2];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    run_out ref, before;
    run_cfg c = {65536, 2000, 0, 2, -1, 0};
    run(dev, &c, &before); /* the parameters at the poisoned step */
    c.scale = 0;
    c.steps = 3;
    run(dev, &c, &ref); /* three clean unscaled steps */
    for (int k = 0; k < 2; k++) {
      run_cfg pc = {65536, 2000, 0, 3, 2, poisons[k]};
      run(dev, &pc, &got[r][k]);
      /* the poisoned step was the last: nothing moved from step 2 on */
      same_bits(got[r][k].p, before.p, "after the skipped step");
      cr_assert_eq(got[r][k].scale, 32768.0, "scale %g", got[r][k].scale);
      cr_assert_eq(got[r][k].skipped, 1);
      pc.steps = 4; /* one clean step after it: the clean run's third */
      run_out after;
      run(dev, &pc, &after);
      same_bits(after.p, ref.p, "the step after a skip");
      cr_assert_eq(after.scale, 32768.0);
    }
    dispatch_device_close(dev);
  }
  for (int k = 0; k < 2; k++)
    same_bits(got[0][k].p, got[1][k].p, "local vs remote");
}

/* growth after `interval` clean steps in a row; a skip restarts the count */
Test(loss_scale, grows_after_interval_clean_steps, .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    run_out o;
    run_cfg c = {8, 3, 0, 2, -1, 0};
    run(dev, &c, &o);
    cr_assert_eq(o.scale, 8.0, "2 clean steps of 3: %g", o.scale);
    c.steps = 3;
    run(dev, &c, &o);
    cr_assert_eq(o.scale, 16.0, "3 clean steps of 3: %g", o.scale);
    c.steps = 7;
    run(dev, &c, &o);
    cr_assert_eq(o.scale, 32.0, "6 of 3, then one: %g", o.scale);
    /* clean, skip (8 -> 4), clean x3 (-> 8), clean */
    run_cfg k = {8, 3, 0, 6, 1, INFINITY};
    run(dev, &k, &o);
    cr_assert_eq(o.scale, 8.0, "%g", o.scale);
    cr_assert_eq(o.skipped, 1);
    dispatch_device_close(dev);
  }
}

/* A checkpoint holds the scale and its counts: 3 steps, save, load into a
 * new optimizer (its scale set afresh, as a resuming program does), 4
 * more steps give the bits, scale and skip count of 7 steps straight.
 * The skip at step 1 and interval 3 put the scale (8 -> 4 -> 8 at step 4)
 * and the clean-step count mid-way at the save. */
Test(loss_scale, resumes_from_a_checkpoint, .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  char path[64];
  snprintf(path, sizeof path, "/tmp/dsp_ls_ck_%d.safetensors", (int)getpid());
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = open_dev(r);
    run_out want;
    run_cfg c = {8, 3, 0, 7, 1, INFINITY};
    run(dev, &c, &want);
    cr_assert_eq(want.skipped, 1);
    double wd[1] = {0.1};
    dispatch_tensor *t = f32(dev, g_p0), *p;
    OK(dev, dispatch_autodiff(t, &p));
    dispatch_tensor_free(t);
    dispatch_optim *opt;
    OK(dev, dispatch_adamw_new(&p, 1, 0.05, 0.9, 0.95, 1e-8, wd, &opt));
    OK(dev, dispatch_optim_set_loss_scale(opt, 8, 2.0, 0.5, 3));
    for (int s = 0; s < 3; s++) one_step(dev, opt, p, 1, s == 1 ? INFINITY : 0);
    const char *name = "p";
    OK(dev, dispatch_save(dev, path, &name, &p, 1, opt));
    dispatch_optim_free(opt);
    dispatch_tensor_free(p);
    dispatch_checkpoint *ck;
    OK(dev, dispatch_load(dev, path, &ck));
    cr_assert_not_null(dispatch_checkpoint_get(ck, "optim.loss_scale"));
    OK(dev, dispatch_autodiff(dispatch_checkpoint_get(ck, "p"), &p));
    OK(dev, dispatch_adamw_new(&p, 1, 0.05, 0.9, 0.95, 1e-8, wd, &opt));
    OK(dev, dispatch_optim_set_loss_scale(opt, 8, 2.0, 0.5, 3));
    OK(dev, dispatch_optim_load(opt, ck));
    for (int s = 3; s < 7; s++) one_step(dev, opt, p, 1, 0);
    run_out got;
    OK(dev, dispatch_tensor_read(p, got.p, sizeof got.p));
    OK(dev, dispatch_optim_loss_scale(opt, &got.scale, &got.skipped));
    same_bits(got.p, want.p, "resumed vs straight");
    cr_assert_eq(got.scale, want.scale, "scale %g, straight %g", got.scale,
                 want.scale);
    cr_assert_eq(got.skipped, want.skipped);
    dispatch_optim_free(opt);
    dispatch_tensor_free(p);
    dispatch_checkpoint_free(ck);
    dispatch_device_close(dev);
    remove(path);
  }
}

Test(loss_scale, argument_errors) {
  dispatch_device *dev = check_open(&g_srv, 0);
  dispatch_tensor *t = f32(dev, g_p0), *p;
  OK(dev, dispatch_autodiff(t, &p));
  dispatch_optim *opt;
  OK(dev, dispatch_adam_new(&p, 1, 0.01, 0.9, 0.999, 1e-8, &opt));
  double s = 0;
  cr_assert_eq(dispatch_optim_loss_scale(opt, &s, NULL), DISPATCH_EINVAL);
  cr_assert(isnan(s));
  cr_assert(strstr(dispatch_device_errmsg(dev), "no loss scale"));
  dispatch_tensor *out = (dispatch_tensor *)&out;
  cr_assert_eq(dispatch_optim_scale_loss(opt, t, &out), DISPATCH_EINVAL);
  cr_assert_null(out);
  const struct {
    double init, growth, backoff;
    int64_t interval;
  } bad[] = {{-1, 2, 0.5, 10},  {NAN, 2, 0.5, 10}, {1e39, 2, 0.5, 10},
             {1e-50, 2, 0.5, 10}, {8, 0.5, 0.5, 10}, {8, INFINITY, 0.5, 10},
             {8, 2, 0, 10},      {8, 2, 1.5, 10},  {8, 2, 0.5, 0}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_eq(dispatch_optim_set_loss_scale(opt, bad[i].init, bad[i].growth,
                                               bad[i].backoff,
                                               bad[i].interval),
                 DISPATCH_EINVAL, "case %zu", i);
    cr_assert(strstr(dispatch_device_errmsg(dev), "optim_set_loss_scale"));
  }
  OK(dev, dispatch_optim_set_loss_scale(opt, 4, 2, 0.5, 10));
  /* the scaled loss keeps f32 and is the loss times 4 */
  float v[N];
  OK(dev, dispatch_optim_scale_loss(opt, t, &out));
  OK(dev, dispatch_tensor_read(out, v, sizeof v));
  for (int i = 0; i < N; i++) cr_assert_eq(v[i], 4.0f * g_p0[i]);
  dispatch_tensor_free(out);
  int64_t sh[1] = {2}, iv[2] = {1, 2};
  dispatch_tensor *it;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, sh, iv, sizeof iv,
                                    &it));
  cr_assert_eq(dispatch_optim_scale_loss(opt, it, &out), DISPATCH_EDTYPE);
  /* an f64 loss is scaled in f64 */
  double dv[2] = {0.5, -3}, dr[2];
  dispatch_tensor *dt;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F64, 1, sh, dv, sizeof dv,
                                    &dt));
  OK(dev, dispatch_optim_scale_loss(opt, dt, &out));
  cr_assert_eq(dispatch_tensor_dtype(out), DISPATCH_F64);
  OK(dev, dispatch_tensor_read(out, dr, sizeof dr));
  cr_assert_eq(dr[0], 2.0);
  cr_assert_eq(dr[1], -12.0);
  dispatch_tensor_free(out);
  /* a scaled step cannot be captured in a graph */
  OK(dev, dispatch_graph_begin(dev));
  one_step(dev, opt, p, 1, 0.0f);
  dispatch_graph *g = NULL;
  cr_assert_eq(dispatch_graph_end(dev, &g), DISPATCH_EUNSUPPORTED);
  cr_assert(strstr(dispatch_device_errmsg(dev), "loss scaling"), "%s",
            dispatch_device_errmsg(dev));
  /* off again: scale_loss refuses */
  OK(dev, dispatch_optim_set_loss_scale(opt, 0, 0, 0, 0));
  cr_assert_eq(dispatch_optim_scale_loss(opt, t, &out), DISPATCH_EINVAL);
  dispatch_tensor_free(it), dispatch_tensor_free(dt);
  dispatch_optim_free(opt);
  dispatch_tensor_free(p), dispatch_tensor_free(t);
  dispatch_device_close(dev);
}
