/* dispatch_autocast: the device's mixed-precision policy, on LOCAL and
 * REMOTE devices alike. Elementwise ops of mixed float dtypes promote to
 * the widest (and their gradients come back in each input's own dtype
 * through the casts' rule), f64 inputs of a matmul stay f64, the policy's
 * argument errors and nesting. Needs DISPATCH_SERVER_BIN. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;
static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_tensor *mk(dispatch_device *dev, dispatch_dtype dt,
                           const void *v, int track) {
  int64_t sh[1] = {2};
  size_t es = dt == DISPATCH_F64 ? 8 : 4;
  dispatch_tensor *t, *a;
  OK(dev, dispatch_tensor_from_data(dev, dt, 1, sh, v, 2 * es, &t));
  if (!track) return t;
  OK(dev, dispatch_autodiff(t, &a));
  dispatch_tensor_free(t);
  return a;
}

Test(autocast, mixed_float_inputs_promote_and_grads_keep_dtypes,
     .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = check_open(&g_srv, r);
    const float av[2] = {1.5f, -2.0f};
    const double bv[2] = {0.25, 3.0};
    dispatch_tensor *a = mk(dev, DISPATCH_F32, av, 1);
    dispatch_tensor *b = mk(dev, DISPATCH_F64, bv, 1), *y = NULL, *l;
    /* off: kernels take one dtype */
    cr_assert_eq(dispatch_mul(a, b, &y), DISPATCH_EDTYPE);
    dispatch_device_clear_error(dev);
    dispatch_dtype prev = (dispatch_dtype)-1;
    OK(dev, dispatch_autocast(dev, DISPATCH_BF16, &prev));
    cr_assert_eq(prev, DISPATCH_F32);
    OK(dev, dispatch_mul(a, b, &y));
    cr_assert_eq(dispatch_tensor_dtype(y), DISPATCH_F64);
    OK(dev, dispatch_sum(y, 0, NULL, 0, &l));
    dispatch_grads *g;
    OK(dev, dispatch_backward(l, &g));
    dispatch_tensor *ga, *gb;
    OK(dev, dispatch_grad(g, a, &ga));
    OK(dev, dispatch_grad(g, b, &gb));
    cr_assert_eq(dispatch_tensor_dtype(ga), DISPATCH_F32, "a's grad dtype");
    cr_assert_eq(dispatch_tensor_dtype(gb), DISPATCH_F64, "b's grad dtype");
    float gav[2];
    double yv[2], gbv[2];
    OK(dev, dispatch_tensor_read(y, yv, sizeof yv));
    OK(dev, dispatch_tensor_read(ga, gav, sizeof gav));
    OK(dev, dispatch_tensor_read(gb, gbv, sizeof gbv));
    for (int i = 0; i < 2; i++) {
      cr_assert_eq(yv[i], (double)av[i] * bv[i]);
      cr_assert_eq(gav[i], (float)bv[i]);
      cr_assert_eq(gbv[i], (double)av[i]);
    }
    /* an f64 matmul is left in f64 */
    const double m[4] = {1, 2, 3, 4};
    int64_t sh[2] = {2, 2};
    dispatch_tensor *mt, *mm;
    OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F64, 2, sh, m, sizeof m,
                                      &mt));
    OK(dev, dispatch_matmul(mt, mt, &mm));
    cr_assert_eq(dispatch_tensor_dtype(mm), DISPATCH_F64);
    OK(dev, dispatch_autocast(dev, DISPATCH_F32, &prev));
    cr_assert_eq(prev, DISPATCH_BF16);
    dispatch_grads_free(g);
    dispatch_tensor_free(ga), dispatch_tensor_free(gb);
    dispatch_tensor_free(y), dispatch_tensor_free(l);
    dispatch_tensor_free(mt), dispatch_tensor_free(mm);
    dispatch_tensor_free(a), dispatch_tensor_free(b);
    dispatch_device_close(dev);
  }
}

Test(autocast, argument_errors) {
  cr_assert_eq(dispatch_autocast(NULL, DISPATCH_BF16, NULL), DISPATCH_EINVAL);
  dispatch_device *dev = check_open(&g_srv, 0);
  dispatch_dtype prev = DISPATCH_F64;
  cr_assert_eq(dispatch_autocast(dev, DISPATCH_I64, &prev), DISPATCH_EINVAL);
  cr_assert_eq(prev, DISPATCH_F64, "prev untouched on error");
  cr_assert(strstr(dispatch_device_errmsg(dev), "not f16, bf16 or f32"));
  cr_assert_eq(dispatch_autocast(dev, DISPATCH_F64, NULL), DISPATCH_EINVAL);
  OK(dev, dispatch_autocast(dev, DISPATCH_F16, NULL));
  OK(dev, dispatch_autocast(dev, DISPATCH_F32, &prev));
  cr_assert_eq(prev, DISPATCH_F16);
  dispatch_device_close(dev);
}

/* bf16 and f16 (issue 24): a matmul of f32 inputs runs in the half type,
 * its sum in f32, and the backward brings f32 gradients to the f32
 * leaves; values chosen exact in both half types, so the gradients are
 * the f32 ones exactly. LOCAL and REMOTE give the same bits. */
Test(autocast, matmul_in_half_gradients_in_f32, .fini = stop_server) {
  check_server_start(&g_srv, NULL);
  const dispatch_dtype halves[2] = {DISPATCH_BF16, DISPATCH_F16};
  const float xv[6] = {1, 2, -0.5f, 0.25f, 3, -1}; /* [2, 3] */
  const float wv[6] = {0.5f, -2, 1, 0.125f, 4, -0.75f}; /* [3, 2] */
  float got[2][2][6];
  for (int h = 0; h < 2; h++)
    for (int r = 0; r < 2; r++) {
      dispatch_device *dev = check_open(&g_srv, r);
      int64_t xs[2] = {2, 3}, ws[2] = {3, 2};
      dispatch_tensor *xt, *wt, *x, *w, *y, *l;
      OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, xv,
                                        sizeof xv, &xt));
      OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, ws, wv,
                                        sizeof wv, &wt));
      OK(dev, dispatch_autodiff(xt, &x));
      OK(dev, dispatch_autodiff(wt, &w));
      OK(dev, dispatch_autocast(dev, halves[h], NULL));
      OK(dev, dispatch_matmul(x, w, &y));
      cr_assert_eq(dispatch_tensor_dtype(y), halves[h]);
      OK(dev, dispatch_mul(y, y, &y)); /* one dtype: stays half */
      cr_assert_eq(dispatch_tensor_dtype(y), halves[h]);
      OK(dev, dispatch_sum(y, 0, NULL, 0, &l));
      cr_assert_eq(dispatch_tensor_dtype(l), DISPATCH_F32, "sum in f32");
      OK(dev, dispatch_autocast(dev, DISPATCH_F32, NULL));
      dispatch_grads *g;
      OK(dev, dispatch_backward(l, &g));
      dispatch_tensor *gx, *gw;
      OK(dev, dispatch_grad(g, x, &gx));
      OK(dev, dispatch_grad(g, w, &gw));
      cr_assert_eq(dispatch_tensor_dtype(gx), DISPATCH_F32);
      cr_assert_eq(dispatch_tensor_dtype(gw), DISPATCH_F32);
      OK(dev, dispatch_tensor_read(gx, got[h][r], sizeof got[h][r]));
      /* d sum((xw)^2)/dx = 2 (xw) w^T, in f32 from the exact values */
      float yv[4];
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
          yv[i * 2 + j] = 0;
          for (int k = 0; k < 3; k++) yv[i * 2 + j] += xv[i * 3 + k] * wv[k * 2 + j];
        }
      for (int i = 0; i < 2; i++)
        for (int k = 0; k < 3; k++) {
          float want = 0;
          for (int j = 0; j < 2; j++)
            want += 2 * yv[i * 2 + j] * wv[k * 2 + j];
          cr_assert_eq(got[h][r][i * 3 + k], want, "dx[%d][%d] %g vs %g", i,
                       k, (double)got[h][r][i * 3 + k], (double)want);
        }
      dispatch_grads_free(g);
      dispatch_tensor_free(gx), dispatch_tensor_free(gw);
      dispatch_tensor_free(y), dispatch_tensor_free(l);
      dispatch_tensor_free(x), dispatch_tensor_free(w);
      dispatch_tensor_free(xt), dispatch_tensor_free(wt);
      dispatch_device_close(dev);
    }
  for (int h = 0; h < 2; h++)
    cr_assert_eq(memcmp(got[h][0], got[h][1], sizeof got[h][0]), 0,
                 "local vs remote");
}
