/* Tests written against plausible one-line bugs (issue 14 item 2); each
 * was first run against its mutation in tests/mutations.txt and failed
 * there. Every test runs on LOCAL and on REMOTE (a real dispatch-server
 * on 127.0.0.1, port 0) and checks values worked out by hand in the test,
 * never one kind against the other: slices past the end and empty
 * slices, ties in every op that selects (forward and backward),
 * several optimizer steps, the element limit exactly at the boundary,
 * and poison known to the client without a round trip. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_backward.h"
#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

#include "helpers/client_check.h"

static void start_server_args(const char *const *args) {
  check_server_start(&g_srv, args);
}
static void start_server(void) { start_server_args(NULL); }
static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_kind(int k) { return check_open(&g_srv, k); }
static const char *kname(int k) { return k ? "remote" : "local"; }

static dispatch_tensor *vec(dispatch_device *dev, const float *v, int64_t n) {
  dispatch_tensor *t;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, &n, v,
                                    (size_t)n * sizeof *v, &t));
  return t;
}

static void read_f(dispatch_device *dev, dispatch_tensor *t, float *out,
                   int64_t n) {
  cr_assert_eq(dispatch_tensor_numel(t), n, "numel %lld, want %lld",
               (long long)dispatch_tensor_numel(t), (long long)n);
  OK(dev, dispatch_tensor_read(t, out, (size_t)n * sizeof *out));
}

static void expect_f(dispatch_device *dev, dispatch_tensor *t,
                     const float *want, int64_t n, const char *what, int k) {
  float got[16];
  cr_assert_leq(n, 16);
  read_f(dev, t, got, n);
  for (int64_t i = 0; i < n; i++)
    cr_assert_float_eq(got[i], want[i], 1e-6, "%s (%s): [%lld] = %g, want %g",
                       what, kname(k), (long long)i, got[i], want[i]);
}

/* x[start:end:step] of 10 elements: past the end and empty ranges give 0
 * elements (not 1), and slice_backward of such a slice is all zeros. */
Test(guards, slices_past_end_and_empty, .init = start_server,
     .fini = stop_server) {
  static const struct {
    int64_t start, end, step, n, first;
  } cs[] = {
      {100, 200, 1, 0, 0}, {10, 20, 1, 0, 0}, {3, 3, 1, 0, 0},
      {5, 2, 1, 0, 0},     {-100, 2, 1, 2, 0}, {8, 100, 3, 1, 8},
      {-1, 100, 1, 1, 9},  {9, 10, 5, 1, 9},
  };
  float xv[10];
  for (int i = 0; i < 10; i++) xv[i] = (float)i;
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_kind(k);
    dispatch_tensor *x = vec(dev, xv, 10);
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
      dispatch_tensor *y;
      OK(dev, dispatch_slice(x, 0, cs[c].start, cs[c].end, cs[c].step, &y));
      cr_assert_eq(dispatch_tensor_numel(y), cs[c].n,
                   "x[%lld:%lld:%lld] of 10 (%s): %lld elements, want %lld",
                   (long long)cs[c].start, (long long)cs[c].end,
                   (long long)cs[c].step, kname(k),
                   (long long)dispatch_tensor_numel(y), (long long)cs[c].n);
      if (cs[c].n) {
        float v[10];
        read_f(dev, y, v, cs[c].n);
        cr_assert_eq(v[0], (float)cs[c].first, "slice value (%s): %g",
                     kname(k), v[0]);
      }
      /* the gradient of that slice back into 10 zeros */
      int64_t in_shape[1] = {10};
      dispatch_tensor *g, *gx;
      OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, &cs[c].n, &g));
      OK(dev, dispatch_slice_backward(g, 0, cs[c].start, cs[c].end,
                                      cs[c].step, 1, in_shape, &gx));
      float got[10], sum = 0;
      read_f(dev, gx, got, 10);
      for (int i = 0; i < 10; i++) sum += got[i];
      cr_assert_float_eq(sum, (float)cs[c].n, 0,
                         "slice_backward [%lld:%lld] (%s): sum %g, want %lld",
                         (long long)cs[c].start, (long long)cs[c].end,
                         kname(k), sum, (long long)cs[c].n);
      if (cs[c].n) cr_assert_eq(got[cs[c].first], 1.0f);
    }
    dispatch_device_close(dev);
  }
}

/* Ties: max_pool2d picks the first maximum and its backward sends the
 * whole gradient there; argmax picks the first index; max's backward
 * shares the gradient evenly between tied positions; maximum/minimum
 * split a tie's gradient evenly between their inputs (as PyTorch). */
Test(guards, ties_forward_and_backward, .init = start_server,
     .fini = stop_server) {
  for (int k = 0; k < 2; k++) {
    dispatch_device *dev = open_kind(k);
    /* max_pool2d, one 2x2 window of equal values */
    int64_t sh4[4] = {1, 1, 2, 2};
    dispatch_tensor *x4, *y, *g, *gx;
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 4, sh4, &x4));
    OK(dev, dispatch_max_pool2d(x4, 2, 2, 2, 2, 0, 0, &y));
    float one = 1;
    expect_f(dev, y, &one, 1, "max_pool2d", k);
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 4, (int64_t[]){1, 1, 1, 1}, &g));
    OK(dev, dispatch_max_pool2d_backward(g, x4, 2, 2, 2, 2, 0, 0, &gx));
    expect_f(dev, gx, (float[]){1, 0, 0, 0}, 4, "max_pool2d_backward tie", k);
    /* the same through autodiff */
    dispatch_tensor *xa, *ya, *la;
    dispatch_grads *gr;
    OK(dev, dispatch_autodiff(x4, &xa));
    OK(dev, dispatch_max_pool2d(xa, 2, 2, 2, 2, 0, 0, &ya));
    OK(dev, dispatch_sum(ya, 0, NULL, 0, &la));
    OK(dev, dispatch_backward(la, &gr));
    OK(dev, dispatch_grad(gr, xa, &gx));
    expect_f(dev, gx, (float[]){1, 0, 0, 0}, 4, "max_pool2d autodiff tie", k);

    /* argmax, flattened and along each dim of [[3,3],[1,3]] */
    int64_t sh2[2] = {2, 2};
    float mv[4] = {3, 3, 1, 3};
    dispatch_tensor *m, *am;
    OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sh2, mv,
                                      sizeof mv, &m));
    int64_t iv[2];
    OK(dev, dispatch_argmax(m, 0, NULL, 0, &am));
    OK(dev, dispatch_tensor_read(am, iv, sizeof iv[0]));
    cr_assert_eq(iv[0], 0, "argmax flat tie (%s): %lld", kname(k),
                 (long long)iv[0]);
    for (int64_t d = 0; d < 2; d++) {
      OK(dev, dispatch_argmax(m, 1, &d, 0, &am));
      OK(dev, dispatch_tensor_read(am, iv, sizeof iv));
      /* dim 0: columns (3,1) and the tie (3,3) both give 0; dim 1: the
       * tied row [3,3] gives 0, [1,3] gives 1 */
      int64_t want1 = d == 0 ? 0 : 1;
      cr_assert(iv[0] == 0 && iv[1] == want1,
                "argmax dim %lld tie (%s): [%lld %lld], want [0 %lld]",
                (long long)d, kname(k), (long long)iv[0], (long long)iv[1],
                (long long)want1);
    }

    /* max over [2,5,5]: the gradient split 0, 0.5, 0.5 */
    dispatch_tensor *xm, *xma, *mx;
    xm = vec(dev, (float[]){2, 5, 5}, 3);
    OK(dev, dispatch_autodiff(xm, &xma));
    OK(dev, dispatch_max(xma, 0, NULL, 0, &mx));
    expect_f(dev, mx, (float[]){5}, 1, "max", k);
    OK(dev, dispatch_backward(mx, &gr));
    OK(dev, dispatch_grad(gr, xma, &gx));
    expect_f(dev, gx, (float[]){0, 0.5f, 0.5f}, 3, "max backward tie", k);

    /* maximum / minimum with a tie at [0]: half to each input */
    for (int op = 0; op < 2; op++) {
      dispatch_tensor *a = vec(dev, (float[]){1, 2}, 2);
      dispatch_tensor *b = vec(dev, op ? (float[]){1, 0} : (float[]){1, 3}, 2);
      dispatch_tensor *aa, *ba, *z, *l, *ga, *gb;
      OK(dev, dispatch_autodiff(a, &aa));
      OK(dev, dispatch_autodiff(b, &ba));
      OK(dev, op ? dispatch_minimum(aa, ba, &z) : dispatch_maximum(aa, ba, &z));
      expect_f(dev, z, op ? (float[]){1, 0} : (float[]){1, 3}, 2,
               op ? "minimum" : "maximum", k);
      OK(dev, dispatch_sum(z, 0, NULL, 0, &l));
      OK(dev, dispatch_backward(l, &gr));
      OK(dev, dispatch_grad(gr, aa, &ga));
      OK(dev, dispatch_grad(gr, ba, &gb));
      expect_f(dev, ga, (float[]){0.5f, 0}, 2, op ? "minimum da" : "maximum da", k);
      expect_f(dev, gb, (float[]){0.5f, 1}, 2, op ? "minimum db" : "maximum db", k);
    }
    dispatch_device_close(dev);
  }
}

/* Three steps of Adam and of SGD with momentum on loss = sum(p*p), p0 =
 * [1, -2], against the update rules written out here in double. A step
 * counter stuck at 1 gives p = 0.6120 after three Adam steps where
 * 0.7016 is right. */
Test(guards, optimizer_three_steps_by_hand, .init = start_server,
     .fini = stop_server) {
  const double lr = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8, mom = 0.9;
  for (int opt_kind = 0; opt_kind < 2; opt_kind++) {
    double p[2] = {1, -2}, m[2] = {0, 0}, v[2] = {0, 0};
    for (int t = 1; t <= 3; t++)
      for (int i = 0; i < 2; i++) {
        double g = 2 * p[i];
        if (opt_kind == 0) {
          m[i] = b1 * m[i] + (1 - b1) * g;
          v[i] = b2 * v[i] + (1 - b2) * g * g;
          double mh = m[i] / (1 - pow(b1, t)), vh = v[i] / (1 - pow(b2, t));
          p[i] -= lr * mh / (sqrt(vh) + eps);
        } else {
          m[i] = mom * m[i] + g;
          p[i] -= lr * m[i];
        }
      }
    if (opt_kind == 0)
      cr_assert_float_eq(p[0], 0.7016, 1e-4, "hand Adam: %g", p[0]);
    for (int k = 0; k < 2; k++) {
      dispatch_device *dev = open_kind(k);
      dispatch_tensor *w = vec(dev, (float[]){1, -2}, 2), *wa;
      OK(dev, dispatch_autodiff(w, &wa));
      dispatch_optim *o;
      if (opt_kind == 0)
        OK(dev, dispatch_adam_new(&wa, 1, lr, b1, b2, eps, &o));
      else
        OK(dev, dispatch_sgd_new(&wa, 1, lr, mom, 0, &o));
      for (int t = 0; t < 3; t++) {
        dispatch_tensor *sq, *l;
        dispatch_grads *gr;
        OK(dev, dispatch_mul(wa, wa, &sq));
        OK(dev, dispatch_sum(sq, 0, NULL, 0, &l));
        OK(dev, dispatch_backward(l, &gr));
        OK(dev, dispatch_optim_step(o, gr));
        dispatch_grads_free(gr);
      }
      float got[2];
      OK(dev, dispatch_device_sync(dev));
      read_f(dev, w, got, 2);
      for (int i = 0; i < 2; i++)
        cr_assert_float_eq(got[i], p[i], 1e-5,
                           "%s 3 steps (%s): p[%d] = %.6f, by hand %.6f",
                           opt_kind ? "sgd" : "adam", kname(k), i, got[i], p[i]);
      dispatch_device_close(dev);
    }
  }
}

/* --max-elements 64: a tensor of exactly 64 elements is accepted, both
 * uploaded and made by an op; 65 is refused with DISPATCH_ELIMIT. */
Test(guards, element_limit_at_the_boundary, .fini = stop_server) {
  const char *args[] = {"--max-elements", "64", NULL};
  start_server_args(args);
  dispatch_device *dev = open_kind(1);
  float buf[65] = {0};
  for (int64_t n = 64; n <= 65; n++) {
    dispatch_tensor *t = NULL, *o = NULL;
    int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 1, &n, buf,
                                       (size_t)n * sizeof buf[0], &t);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (n == 64)
      cr_assert_eq(rc, 0, "upload of 64 at a limit of 64: %s: %s",
                   dispatch_err_name(rc), dispatch_device_errmsg(dev));
    else
      cr_assert_eq(rc, DISPATCH_ELIMIT, "upload of 65 at a limit of 64: %s",
                   dispatch_err_name(rc));
    rc = dispatch_ones(dev, DISPATCH_F32, 1, &n, &o);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (n == 64)
      cr_assert_eq(rc, 0, "ones(64) at a limit of 64: %s: %s",
                   dispatch_err_name(rc), dispatch_device_errmsg(dev));
    else
      cr_assert_eq(rc, DISPATCH_ELIMIT, "ones(65) at a limit of 64: %s",
                   dispatch_err_name(rc));
  }
  /* the session goes on */
  dispatch_tensor *s;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, (int64_t[]){4}, &s));
  OK(dev, dispatch_device_sync(dev));
  dispatch_device_close(dev);
}

/* --max-frame set to exactly one upload frame (message + 256 bytes of
 * bulk): that frame is accepted; the same upload with one more element
 * (its message the same size) is refused with DISPATCH_ETOOLARGE. */
Test(guards, frame_limit_at_the_boundary, .fini = stop_server) {
  int64_t n64 = 64;
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_upload(&w, 1, DSP_F32, 1, &n64);
  r->req_id = 2; /* ids below 128 all pack to one byte */
  size_t frame = dspwire__request__get_packed_size(r) + 64 * sizeof(float);
  char lim[32];
  snprintf(lim, sizeof lim, "%zu", frame);
  const char *args[] = {"--max-frame", lim, "--log-level", "error", NULL};
  start_server_args(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "guards"), 0);
  static float buf[65];
  char msg[512] = "";
  cr_assert_eq(c.next_req_id, 2, "the next request id changed: recompute");
  wire_upload(&c, 1, DSP_F32, 1, &n64, buf, 64 * sizeof(float));
  int rc = wire_sync_check(&c, msg, sizeof msg, NULL);
  cr_assert_eq(rc, 0, "a frame of exactly --max-frame %s: %s: %s", lim,
               dispatch_err_name(rc), msg);
  int64_t n65 = 65;
  wire_upload(&c, 2, DSP_F32, 1, &n65, buf, 65 * sizeof(float));
  Dspwire__Reply *rep = NULL;
  cr_assert_eq(wire_recv(&c, &rep, NULL, NULL), 0, "no reply to the refusal");
  cr_assert(rep->error, "a frame one element over --max-frame was accepted");
  cr_assert_eq(rep->error->code, DISPATCH_ETOOLARGE, "%s",
               rep->error->message);
  wire_reply_free(rep, NULL);
  wire_close(&c);
}

/* Once a wait has told the client that a tensor failed, an op on it
 * fails at once with that failure, with no round trip (issue 13 item 7:
 * it used to be queued and its output marked DISPATCH_EPOISONED). */
Test(guards, poison_known_without_round_trip, .init = start_server,
     .fini = stop_server) {
  dispatch_device *dev = open_kind(1);
  dispatch_tensor *x, *idx, *bad, *after = NULL, *later = NULL;
  x = vec(dev, (float[]){1, 2, 3}, 3);
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, (int64_t[]){1},
                                    (int64_t[]){7}, sizeof(int64_t), &idx));
  OK(dev, dispatch_index_select(x, 0, idx, &bad));
  cr_assert_eq(dispatch_device_sync(dev), DISPATCH_EINDEX);
  cr_assert_eq(dispatch_tensor_status(bad), DISPATCH_EINDEX);
  int rc = dispatch_exp(bad, &after);
  cr_assert_eq(rc, DISPATCH_EINDEX,
               "an op on a known-failed input: %s before any wait",
               dispatch_err_name(rc));
  cr_assert_null(after);
  cr_assert_eq(dispatch_add(x, bad, &later), DISPATCH_EINDEX);
  cr_assert_null(later);
  dispatch_device_close(dev);
}
