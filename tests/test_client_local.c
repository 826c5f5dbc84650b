/* libdispatch-client on the LOCAL device: device specs, kinds and the
 * one-wrap rule, values of op chains and gradients, device mixing,
 * scopes (allocation counts back to baseline), optimizers, and every
 * allocation failure of a training step coming back as ENOMEM. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/failalloc.h"

static dispatch_device *open_local(void) {
  dispatch_device *dev = NULL;
  char msg[256];
  int rc = dispatch_device_open("local", NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open local: %s", msg);
  return dev;
}

static dispatch_tensor *f32(dispatch_device *dev, int ndim,
                            const int64_t *shape, const float *v, size_t n) {
  dispatch_tensor *t = NULL;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, ndim, shape, v,
                                     n * sizeof(float), &t);
  cr_assert_eq(rc, 0, "from_data: %s", dispatch_device_errmsg(dev));
  return t;
}

static void read_f32(dispatch_tensor *t, float *out, size_t n) {
  int rc = dispatch_tensor_read(t, out, n * sizeof(float));
  cr_assert_eq(rc, 0, "read: %s",
               dispatch_device_errmsg(dispatch_tensor_device(t)));
}


Test(client_local, version) {
  /* the library built from this tree reports this tree's header version
   * (dispatch_version.h is the one place it is defined) */
  cr_assert_str_eq(dispatch_version(), DISPATCH_VERSION);
}

Test(client_local, device_specs) {
  dispatch_device *dev = NULL;
  char msg[256] = "";
  unsetenv("DISPATCH_DEVICE");
  cr_assert_eq(dispatch_device_open(NULL, NULL, &dev, msg, sizeof msg), 0);
  cr_assert_eq(dispatch_device_kind(dev), DISPATCH_KIND_LOCAL);
  dispatch_device_close(dev);

  setenv("DISPATCH_DEVICE", "local", 1);
  cr_assert_eq(dispatch_device_open("", NULL, &dev, msg, sizeof msg), 0);
  cr_assert_str_eq(dispatch_device_spec(dev), "local");
  dispatch_device_close(dev);
  unsetenv("DISPATCH_DEVICE");

  /* tls:// is a remote spec: nothing listens on port 1 */
  cr_assert_eq(dispatch_device_open("tls://127.0.0.1:1", NULL, &dev, msg,
                                    sizeof msg),
               DISPATCH_ECONN);
  cr_assert_null(dev);
  cr_assert(strstr(msg, "tls://127.0.0.1:1") != NULL, "%s", msg);
  cr_assert_eq(dispatch_device_open("tls://nohost", NULL, &dev, msg,
                                    sizeof msg),
               DISPATCH_EINVAL);
  cr_assert_eq(dispatch_device_open("gpu0", NULL, &dev, msg, sizeof msg),
               DISPATCH_EINVAL);
  cr_assert(strstr(msg, "gpu0") != NULL, "%s", msg);
  cr_assert_eq(dispatch_device_open("tcp://127.0.0.1:http", NULL, &dev, msg,
                                    sizeof msg),
               DISPATCH_EINVAL);
  cr_assert_eq(dispatch_device_open("tcp://127.0.0.1:99999", NULL, &dev, msg,
                                    sizeof msg),
               DISPATCH_EINVAL);
}

Test(client_local, values_of_an_op_chain) {
  dispatch_device *dev = open_local();
  int64_t s23[2] = {2, 3}, s32[2] = {3, 2};
  float av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {1, 0, 0, 1, 1, 1};
  dispatch_tensor *a = f32(dev, 2, s23, av, 6), *b = f32(dev, 2, s32, bv, 6);
  dispatch_tensor *c, *d, *e;
  OK(dev, dispatch_matmul(a, b, &c)); /* [[4,5],[10,11]] */
  OK(dev, dispatch_sub_scalar(c, 5.0, &d)); /* [[-1,0],[5,6]] */
  OK(dev, dispatch_relu(d, &e));
  float got[4];
  read_f32(e, got, 4);
  float want[4] = {0, 0, 5, 6};
  cr_assert_eq(memcmp(got, want, sizeof want), 0);
  cr_assert_eq(dispatch_tensor_ndim(e), 2);
  cr_assert_eq(dispatch_tensor_shape(e)[1], 2);
  cr_assert_eq(dispatch_tensor_dim(e, -1), 2);
  cr_assert_eq(dispatch_tensor_numel(e), 4);
  cr_assert_eq(dispatch_tensor_dtype(e), DISPATCH_F32);
  cr_assert_eq(dispatch_kind(e), DISPATCH_KIND_LOCAL);

  int64_t dim1 = 1;
  dispatch_tensor *s;
  OK(dev, dispatch_sum(e, 1, &dim1, 0, &s));
  float sv[2];
  read_f32(s, sv, 2);
  cr_assert_eq(sv[0], 0.0f);
  cr_assert_eq(sv[1], 11.0f);

  /* shape errors come back at once, naming the op */
  dispatch_tensor *bad = NULL;
  cr_assert_eq(dispatch_matmul(a, a, &bad), DISPATCH_ESHAPE);
  cr_assert_null(bad);
  cr_assert(strstr(dispatch_device_errmsg(dev), "matmul") != NULL, "%s",
            dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_device_errcode(dev), DISPATCH_ESHAPE);
  /* a wrong read size is refused */
  cr_assert_eq(dispatch_tensor_read(s, sv, 4), DISPATCH_EINVAL);
  dispatch_device_close(dev); /* frees everything left */
}

Test(client_local, one_wrap_rule) {
  dispatch_device *dev = open_local();
  int64_t sh[1] = {3};
  float v[3] = {1, -2, 3};
  dispatch_tensor *x = f32(dev, 1, sh, v, 3), *ax, *aax = NULL, *again = NULL;
  OK(dev, dispatch_autodiff(x, &ax));
  cr_assert_eq(dispatch_kind(ax), DISPATCH_KIND_AUTODIFF);
  cr_assert(dispatch_is_autodiff(ax));
  cr_assert(!dispatch_is_autodiff(x));
  cr_assert_eq(dispatch_inner(ax), x, "inner unwraps without a copy");
  cr_assert_eq(dispatch_inner(x), x);

  cr_assert_eq(dispatch_autodiff(ax, &aax), DISPATCH_EDOUBLEWRAP);
  cr_assert_null(aax);
  cr_assert_str_eq(dispatch_device_errmsg(dev),
                   "autodiff should not wrap an autodiff tensor");
  cr_assert_eq(dispatch_autodiff(x, &again), DISPATCH_EDOUBLEWRAP);
  cr_assert_null(again);

  /* an op with an AUTODIFF input is AUTODIFF; on the inner it is not */
  dispatch_tensor *y, *z, *cmp;
  OK(dev, dispatch_mul(ax, ax, &y));
  cr_assert_eq(dispatch_kind(y), DISPATCH_KIND_AUTODIFF);
  cr_assert_eq(dispatch_kind(dispatch_inner(y)), DISPATCH_KIND_LOCAL);
  OK(dev, dispatch_mul(x, x, &z));
  cr_assert_eq(dispatch_kind(z), DISPATCH_KIND_LOCAL);
  cr_assert_eq(dispatch_autodiff(y, &aax), DISPATCH_EDOUBLEWRAP);
  /* non-float results carry no gradient */
  OK(dev, dispatch_gt(ax, ax, &cmp));
  cr_assert_eq(dispatch_kind(cmp), DISPATCH_KIND_LOCAL);

  int64_t ish[1] = {2};
  int64_t iv[2] = {0, 1};
  dispatch_tensor *it;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ish, iv, sizeof iv,
                                    &it));
  cr_assert_eq(dispatch_autodiff(it, &aax), DISPATCH_EDTYPE);
  dispatch_device_close(dev);
}

Test(client_local, backward_and_grad) {
  dispatch_device *dev = open_local();
  int64_t sh[1] = {3};
  float v[3] = {1, -2, 3};
  dispatch_tensor *x = f32(dev, 1, sh, v, 3), *ax, *sq, *loss, *g;
  OK(dev, dispatch_autodiff(x, &ax));
  OK(dev, dispatch_mul(ax, ax, &sq));
  OK(dev, dispatch_sum(sq, 0, NULL, 0, &loss));
  dispatch_grads *grads = NULL;
  cr_assert_eq(dispatch_backward(sq, &grads), DISPATCH_ENOTSCALAR);
  cr_assert_eq(dispatch_backward(x, &grads), DISPATCH_ENOTTRACKED);
  OK(dev, dispatch_backward(loss, &grads));
  OK(dev, dispatch_grad(grads, ax, &g));
  cr_assert_eq(dispatch_kind(g), DISPATCH_KIND_LOCAL);
  float gv[3];
  read_f32(g, gv, 3);
  for (int i = 0; i < 3; i++) cr_assert_eq(gv[i], 2 * v[i]);
  /* the inner tensor names the same leaf */
  dispatch_tensor *g2;
  OK(dev, dispatch_grad(grads, x, &g2));
  read_f32(g2, gv, 3);
  cr_assert_eq(gv[2], 6.0f);
  dispatch_grads_free(grads);
  dispatch_device_close(dev);
}

Test(client_local, mixing_devices_is_an_error) {
  dispatch_device *d1 = open_local(), *d2 = open_local();
  int64_t sh[1] = {2};
  float v[2] = {1, 2};
  dispatch_tensor *a = f32(d1, 1, sh, v, 2), *b = f32(d2, 1, sh, v, 2), *c;
  cr_assert_eq(dispatch_add(a, b, &c), DISPATCH_EDEVICE);
  cr_assert_null(c);
  dispatch_tensor *b1;
  OK(d1, dispatch_to_device(b, d1, &b1));
  cr_assert_eq(dispatch_tensor_device(b1), d1);
  OK(d1, dispatch_add(a, b1, &c));
  float got[2];
  read_f32(c, got, 2);
  cr_assert_eq(got[1], 4.0f);
  dispatch_device_close(d1);
  dispatch_device_close(d2);
}

/* Tensors made inside a scope go at its end; a kept one survives to the
 * caller and the allocation count comes back to its baseline. */
Test(client_local, scope_rule_allocations_back_to_baseline) {
  failalloc_install(0);
  dispatch_device *dev = open_local();
  /* counts blocks, so freed ones must not wait in the storage cache
   * (test_alloc checks the cache's own bound and release) */
  OK(dev, dispatch_device_set_cache(dev, 0));
  int64_t sh[2] = {4, 4};
  dispatch_tensor *w;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 2, sh, &w));
  long base = failalloc_live();
  dispatch_stats st0 = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st0));
  dispatch_tensor *kept = NULL;
  for (int step = 0; step < 20; step++) {
    OK(dev, dispatch_scope_begin(dev));
    dispatch_tensor *x, *y, *z, *aw, *loss;
    OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, sh, -1, 1, step, &x));
    OK(dev, dispatch_matmul(x, w, &y));
    OK(dev, dispatch_tanh(y, &z));
    if (step == 7) {
      OK(dev, dispatch_scope_begin(dev)); /* nested: keep moves one level */
      dispatch_tensor *k;
      OK(dev, dispatch_exp(z, &k));
      dispatch_keep(k);
      OK(dev, dispatch_scope_end(dev));
      kept = dispatch_keep(k); /* now the caller's */
    }
    OK(dev, dispatch_autodiff(x, &aw));
    OK(dev, dispatch_mean(aw, 0, NULL, 0, &loss));
    dispatch_grads *g;
    OK(dev, dispatch_backward(loss, &g));
    dispatch_grads_free(g);
    OK(dev, dispatch_scope_end(dev));
  }
  cr_assert_eq(dispatch_scope_end(dev), DISPATCH_EINVAL);
  cr_assert_not_null(kept);
  float kv[16];
  read_f32(kept, kv, 16);
  dispatch_stats st1 = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st1));
  cr_assert_eq(st1.tensors, st0.tensors + 1);
  dispatch_tensor_free(kept);
  cr_assert_eq(failalloc_live(), base, "live %ld, baseline %ld",
               failalloc_live(), base);
  OK(dev, dispatch_device_stats(dev, &st1));
  cr_assert_eq(st1.tensors, st0.tensors);
  cr_assert_eq(st1.bytes, st0.bytes);
  cr_assert_eq(st1.grads, 0);
  cr_assert_gt(st1.ops, st0.ops);
  dispatch_tensor_free(w);
  dispatch_device_close(dev);
  cr_assert_eq(failalloc_live(), 0);
  failalloc_remove();
}

Test(client_local, sgd_updates_in_place_and_keeps_the_leaf) {
  dispatch_device *dev = open_local();
  int64_t sh[1] = {2};
  float pv[2] = {1, 2};
  dispatch_tensor *p = f32(dev, 1, sh, pv, 2), *ap;
  OK(dev, dispatch_autodiff(p, &ap));
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(&ap, 1, 0.1, 0.0, 0.0, &opt));
  for (int step = 0; step < 3; step++) {
    OK(dev, dispatch_scope_begin(dev));
    dispatch_tensor *sq, *loss;
    OK(dev, dispatch_mul(ap, ap, &sq));
    OK(dev, dispatch_sum(sq, 0, NULL, 0, &loss));
    dispatch_grads *g;
    OK(dev, dispatch_backward(loss, &g));
    OK(dev, dispatch_optim_step(opt, g));
    dispatch_grads_free(g);
    OK(dev, dispatch_scope_end(dev));
    cr_assert_eq(dispatch_kind(ap), DISPATCH_KIND_AUTODIFF);
    cr_assert_eq(dispatch_inner(ap), p);
  }
  /* p <- p - 0.1 * 2p three times: p * 0.8^3 */
  float got[2];
  read_f32(p, got, 2);
  float want0 = 1.0f, want1 = 2.0f;
  for (int i = 0; i < 3; i++) {
    want0 = want0 - (float)0.1 * (2 * want0);
    want1 = want1 - (float)0.1 * (2 * want1);
  }
  cr_assert_float_eq(got[0], want0, 1e-6);
  cr_assert_float_eq(got[1], want1, 1e-6);
  dispatch_optim_free(opt);

  dispatch_optim *adam;
  OK(dev, dispatch_adam_new(&ap, 1, 0.01, 0.9, 0.999, 1e-8, &adam));
  dispatch_tensor *sq, *loss;
  OK(dev, dispatch_mul(ap, ap, &sq));
  OK(dev, dispatch_sum(sq, 0, NULL, 0, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(adam, g));
  float after[2];
  read_f32(p, after, 2);
  /* the first Adam step moves each element by lr against the sign */
  cr_assert_float_eq(after[0], got[0] - 0.01f, 1e-5);
  cr_assert_float_eq(after[1], got[1] - 0.01f, 1e-5);
  dispatch_grads_free(g);
  dispatch_optim_free(adam);

  dispatch_tensor *plain = p;
  dispatch_optim *bad = NULL;
  cr_assert_eq(dispatch_sgd_new(&plain, 1, 0.1, 0, 0, &bad), DISPATCH_EKIND);
  cr_assert_null(bad);
  dispatch_device_close(dev);
}

/* One training step, start to end, used by the allocation-failure walk. */
static int train_step_program(void) {
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open("local", NULL, &dev, NULL, 0);
  if (rc < 0) return rc;
  int64_t xs[2] = {3, 4}, ws[2] = {4, 2};
  dispatch_tensor *x = NULL, *w = NULL, *aw = NULL, *y = NULL, *loss = NULL,
                  *g = NULL;
  dispatch_grads *grads = NULL;
  dispatch_optim *opt = NULL;
  if ((rc = dispatch_uniform(dev, DISPATCH_F32, 2, xs, -1, 1, 3, &x)) < 0)
    goto out;
  if ((rc = dispatch_normal(dev, DISPATCH_F32, 2, ws, 0, 1, 4, &w)) < 0)
    goto out;
  if ((rc = dispatch_autodiff(w, &aw)) < 0) goto out;
  if ((rc = dispatch_sgd_new(&aw, 1, 0.1, 0.9, 0.01, &opt)) < 0) goto out;
  if ((rc = dispatch_scope_begin(dev)) < 0) goto out;
  if ((rc = dispatch_matmul(x, aw, &y)) < 0) goto out;
  if ((rc = dispatch_tanh(y, &y)) < 0) goto out;
  if ((rc = dispatch_mean(y, 0, NULL, 0, &loss)) < 0) goto out;
  if ((rc = dispatch_backward(loss, &grads)) < 0) goto out;
  if ((rc = dispatch_grad(grads, aw, &g)) < 0) goto out;
  if ((rc = dispatch_optim_step(opt, grads)) < 0) goto out;
  rc = dispatch_scope_end(dev);
out:
  dispatch_grads_free(grads);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
  return rc;
}

Test(client_local, every_allocation_failure_is_enomem_without_leaks) {
  failalloc_install(0);
  cr_assert_eq(train_step_program(), 0);
  long total = failalloc_count();
  cr_assert_eq(failalloc_live(), 0);
  failalloc_remove();
  cr_assert_gt(total, 10);
  for (long n = 1; n <= total; n++) {
    failalloc_install(n);
    int rc = train_step_program();
    long live = failalloc_live(), failed = failalloc_failed();
    failalloc_remove();
    cr_assert_eq(failed, 1, "allocation %ld of %ld was not reached", n, total);
    cr_assert_eq(rc, DISPATCH_ENOMEM, "allocation %ld of %ld: got %s", n,
                 total, dispatch_err_name(rc));
    cr_assert_eq(live, 0, "allocation %ld of %ld leaked %ld blocks", n, total,
                 live);
  }
}
