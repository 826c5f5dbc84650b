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
