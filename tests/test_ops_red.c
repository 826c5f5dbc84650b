/* red family: sum, mean, max, argmax over dims and over all. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(red, .init = setup, .fini = teardown);

static const int64_t S23[] = {2, 3};

/* attrs: n dims then keepdim */
static dsp_attrs dims(int n, const int64_t *d, int keep) {
  dsp_attrs a = dsp_attrs_ints(n, d);
  a.floats[0] = keep;
  a.n_floats = 1;
  return a;
}

static dsp_tensor *iota234(void) {
  float v[24];
  for (int i = 0; i < 24; i++) v[i] = (float)i; /* x[i,j,k] = 12i + 4j + k */
  return tu_f32(ctx, 3, (int64_t[]){2, 3, 4}, v);
}

Test(red, sum_all_and_per_dim) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *o = tu_run(ctx, DSP_OP_SUM, NULL, 1, x, NULL, NULL);
  cr_assert_eq(o->meta.ndim, 0);
  tu_assert_f32(o, (float[]){21}, 1, 0);
  dsp_tensor_unref(o);
  dsp_attrs a = dims(1, (int64_t[]){0}, 0);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 1, (int64_t[]){3});
  tu_assert_f32(o, (float[]){5, 7, 9}, 3, 0);
  dsp_tensor_unref(o);
  a = dims(1, (int64_t[]){-1}, 1);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){2, 1});
  tu_assert_f32(o, (float[]){6, 15}, 2, 0);
  dsp_tensor_unref(o);
  a = dims(2, (int64_t[]){1, 0}, 1);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){1, 1});
  tu_assert_f32(o, (float[]){21}, 1, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(x);
}

Test(red, sum_rank3_middle_and_outer_dims) {
  dsp_tensor *x = iota234();
  /* dim 1: out[i,k] = 36i + 12 + 3k */
  dsp_attrs a = dims(1, (int64_t[]){1}, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){2, 4});
  tu_assert_f32(o, (float[]){12, 15, 18, 21, 48, 51, 54, 57}, 8, 0);
  dsp_tensor_unref(o);
  /* dims {0, 2}: out[j] = 32j + 60 */
  a = dims(2, (int64_t[]){0, 2}, 0);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 1, (int64_t[]){3});
  tu_assert_f32(o, (float[]){60, 92, 124}, 3, 0);
  dsp_tensor_unref(o);
  /* dims {0, 1}: out[k] = 6 * 4 ... sum_{i,j} 12i + 4j + k = 12*3 + 4*3*2 + 6k */
  a = dims(2, (int64_t[]){0, 1}, 1);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 3, (int64_t[]){1, 1, 4});
  tu_assert_f32(o, (float[]){60, 66, 72, 78}, 4, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(x);
}

Test(red, f32_sum_accumulates_in_double) {
  /* in float, 1e8 + 1 rounds back to 1e8 and the result would be 1 */
  dsp_tensor *x = tu_f32(ctx, 1, (int64_t[]){4}, (float[]){1e8f, 1, -1e8f, 1});
  dsp_tensor *o = tu_run(ctx, DSP_OP_SUM, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){2}, 1, 0);
  dsp_tensor_unref(o);
  dsp_tensor *y = tu_f32(ctx, 2, (int64_t[]){4, 1},
                         (float[]){1e8f, 1, -1e8f, 1});
  dsp_attrs a = dims(1, (int64_t[]){0}, 0);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, y, NULL, NULL);
  tu_assert_f32(o, (float[]){2}, 1, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x), dsp_tensor_unref(y);
}

Test(red, sum_i64_and_empty) {
  dsp_tensor *x = tu_i64(ctx, 2, S23, (int64_t[]){1, 2, 3, 4, 5, 6});
  dsp_attrs a = dims(1, (int64_t[]){1}, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){6, 15}, 2);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  dsp_tensor *e = tu_f64(ctx, 2, (int64_t[]){2, 0}, NULL);
  o = tu_run(ctx, DSP_OP_SUM, &a, 1, e, NULL, NULL);
  tu_assert_f64(o, (double[]){0, 0}, 2, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MEAN, &a, 1, e, NULL, NULL);
  tu_assert_f64(o, (double[]){NAN, NAN}, 2, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(e);
}

Test(red, mean_float_only) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 7});
  dsp_attrs a = dims(1, (int64_t[]){1}, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_MEAN, &a, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){2, 16.0f / 3}, 2, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MEAN, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){22.0f / 6}, 1, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 2});
  tu_run_fail(ctx, DSP_OP_MEAN, NULL, 1, i, NULL, NULL, DISPATCH_EDTYPE,
              "mean: dtype i64 not supported");
  dsp_tensor_unref(i);
}

Test(red, max_per_dim_propagates_nan) {
  dsp_tensor *x = tu_f64(ctx, 2, S23, (double[]){1, 9, 3, NAN, 2, 8});
  dsp_attrs a = dims(1, (int64_t[]){1}, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_MAX, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){9, NAN}, 2, 0);
  dsp_tensor_unref(o);
  a = dims(1, (int64_t[]){0}, 1);
  o = tu_run(ctx, DSP_OP_MAX, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){1, 3});
  tu_assert_f64(o, (double[]){NAN, 9, 8}, 3, 0);
  dsp_tensor_unref(o);
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){3}, (int64_t[]){-4, -2, -9});
  o = tu_run(ctx, DSP_OP_MAX, NULL, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){-2}, 1);
  dsp_tensor_unref(o), dsp_tensor_unref(i), dsp_tensor_unref(x);
}

Test(red, argmax_ties_pick_first) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 5, 5, 7, 2, 7});
  dsp_attrs a = dims(1, (int64_t[]){1}, 0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_ARGMAX, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, 0}, 2);
  dsp_tensor_unref(o);
  a = dims(1, (int64_t[]){0}, 0);
  o = tu_run(ctx, DSP_OP_ARGMAX, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, 0, 1}, 3);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_ARGMAX, NULL, 1, x, NULL, NULL); /* flattened */
  cr_assert_eq(o->meta.ndim, 0);
  tu_assert_i64(o, (int64_t[]){3}, 1);
  dsp_tensor_unref(o);
  a = dims(0, NULL, 1);
  o = tu_run(ctx, DSP_OP_ARGMAX, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){1, 1});
  tu_assert_i64(o, (int64_t[]){3}, 1);
  dsp_tensor_unref(o), dsp_tensor_unref(x);
  /* rank 3 over the middle dim and a NaN winning */
  dsp_tensor *y = iota234();
  ((float *)dsp_tensor_data(y))[13] = NAN; /* [1,0,1] */
  a = dims(1, (int64_t[]){1}, 0);
  o = tu_run(ctx, DSP_OP_ARGMAX, &a, 1, y, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){2, 2, 2, 2, 2, 0, 2, 2}, 8);
  dsp_tensor_unref(o), dsp_tensor_unref(y);
}

Test(red, errors) {
  dsp_tensor *x = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_attrs a = dims(1, (int64_t[]){2}, 0);
  tu_run_fail(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL, DISPATCH_EDIM,
              "sum: dim 2 out of range for rank 2");
  a = dims(2, (int64_t[]){1, -1}, 0);
  tu_run_fail(ctx, DSP_OP_MAX, &a, 1, x, NULL, NULL, DISPATCH_EDIM,
              "max: dim -1 repeated");
  tu_run_fail(ctx, DSP_OP_ARGMAX, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "argmax: takes one dim or none, got 2");
  a = dims(1, (int64_t[]){0}, 0);
  a.n_floats = 2;
  tu_run_fail(ctx, DSP_OP_SUM, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "at most 1 float");
  dsp_tensor *e = tu_f32(ctx, 2, (int64_t[]){0, 3}, NULL);
  a = dims(1, (int64_t[]){0}, 0);
  tu_run_fail(ctx, DSP_OP_MAX, &a, 1, e, NULL, NULL, DISPATCH_ESHAPE,
              "max: cannot reduce over empty dim 0");
  tu_run_fail(ctx, DSP_OP_ARGMAX, NULL, 1, e, NULL, NULL, DISPATCH_ESHAPE,
              "empty dim");
  dsp_tensor *b = tu_bool(ctx, 1, (int64_t[]){2}, (uint8_t[]){0, 1});
  tu_run_fail(ctx, DSP_OP_SUM, NULL, 1, b, NULL, NULL, DISPATCH_EDTYPE,
              "sum: dtype bool");
  dsp_tensor_unref(x), dsp_tensor_unref(e), dsp_tensor_unref(b);
}

Test(red, blocked_and_general_paths_agree_on_wide_tensors) {
  /* [3, 600] summed over dim 0 uses the blocked path across 3 blocks of
   * columns; the same data as [3, 600, 1] with dims {0, 2} goes through
   * the general path; both must give identical bits. */
  enum { R = 3, Q = 600 };
  static float v[R * Q];
  for (int i = 0; i < R * Q; i++) v[i] = (float)((i * 37) % 101) / 7.0f;
  dsp_tensor *x = tu_f32(ctx, 2, (int64_t[]){R, Q}, v);
  dsp_tensor *y = tu_f32(ctx, 3, (int64_t[]){R, Q, 1}, v);
  dsp_attrs a = dims(1, (int64_t[]){0}, 0);
  dsp_attrs b = dims(2, (int64_t[]){0, 2}, 0);
  dsp_opcode ops[] = {DSP_OP_SUM, DSP_OP_MEAN, DSP_OP_MAX};
  for (int k = 0; k < 3; k++) {
    dsp_tensor *o1 = tu_run(ctx, ops[k], &a, 1, x, NULL, NULL);
    dsp_tensor *o2 = tu_run(ctx, ops[k], &b, 1, y, NULL, NULL);
    cr_assert_eq(o1->numel, Q);
    cr_assert_eq(memcmp(dsp_tensor_data(o1), dsp_tensor_data(o2),
                        dsp_tensor_nbytes(o1)), 0, "op %d", (int)ops[k]);
    if (ops[k] == DSP_OP_SUM) {
      const float *s = dsp_tensor_data(o1);
      for (int j = 0; j < Q; j++)
        cr_assert_eq(s[j], (float)((double)v[j] + v[Q + j] + v[2 * Q + j]));
    }
    dsp_tensor_unref(o1), dsp_tensor_unref(o2);
  }
  /* argmax takes one dim: check the blocked path against a direct scan */
  dsp_tensor *o = tu_run(ctx, DSP_OP_ARGMAX, &a, 1, x, NULL, NULL);
  const int64_t *ix = dsp_tensor_data(o);
  for (int j = 0; j < Q; j++) {
    int best = 0;
    for (int r = 1; r < R; r++)
      if (v[r * Q + j] > v[best * Q + j]) best = r;
    cr_assert_eq(ix[j], best, "column %d", j);
  }
  dsp_tensor_unref(o);
  dsp_tensor_unref(x), dsp_tensor_unref(y);
}
