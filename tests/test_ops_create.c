/* create family and the counter-based generator behind uniform/normal. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"
#include "rng.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(create, .init = setup, .fini = teardown);

#define INTS(...) dsp_attrs_ints(sizeof((int64_t[]){__VA_ARGS__}) / 8, \
                                 (int64_t[]){__VA_ARGS__})

static dsp_tensor *make(dsp_opcode op, dsp_attrs a) {
  return tu_run(ctx, op, &a, 0, NULL, NULL, NULL);
}
static dsp_attrs with_floats(dsp_attrs a, int n, const double *f) {
  for (int i = 0; i < n; i++) a.floats[i] = f[i];
  a.n_floats = n;
  return a;
}

Test(create, zeros_ones_full) {
  dsp_tensor *o = make(DSP_OP_ZEROS, INTS(DSP_F32, 2, 3));
  tu_assert_shape(o, 2, (int64_t[]){2, 3});
  tu_assert_f32(o, (float[]){0, 0, 0, 0, 0, 0}, 6, 0);
  dsp_tensor_unref(o);
  o = make(DSP_OP_ONES, INTS(DSP_I64, 3));
  tu_assert_i64(o, (int64_t[]){1, 1, 1}, 3);
  dsp_tensor_unref(o);
  o = make(DSP_OP_ONES, INTS(DSP_BOOL, 2));
  tu_assert_bool(o, (uint8_t[]){1, 1}, 2);
  dsp_tensor_unref(o);
  o = make(DSP_OP_FULL, with_floats(INTS(DSP_F64, 2), 1, (double[]){2.5}));
  tu_assert_f64(o, (double[]){2.5, 2.5}, 2, 0);
  dsp_tensor_unref(o);
  o = make(DSP_OP_FULL, with_floats(INTS(DSP_I64), 1, (double[]){-7}));
  cr_assert_eq(o->meta.ndim, 0);
  tu_assert_i64(o, (int64_t[]){-7}, 1);
  dsp_tensor_unref(o);
}

Test(create, creation_errors) {
  dsp_attrs a = with_floats(INTS(DSP_I64, 2), 1, (double[]){2.5});
  tu_run_fail(ctx, DSP_OP_FULL, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "full: value 2.5 is not an i64 integer");
  a = INTS(DSP_F32, 2, -3);
  tu_run_fail(ctx, DSP_OP_ZEROS, &a, 0, NULL, NULL, NULL, DISPATCH_ESHAPE,
              "zeros: negative size -3 at dim 1");
  a = INTS(9, 2);
  tu_run_fail(ctx, DSP_OP_ONES, &a, 0, NULL, NULL, NULL, DISPATCH_EDTYPE,
              "ones: invalid dtype 9");
  a = INTS(DSP_F32, 2);
  tu_run_fail(ctx, DSP_OP_FULL, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "full: takes 1 leading ints");
  a = dsp_attrs_none();
  tu_run_fail(ctx, DSP_OP_ZEROS, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "got 0 ints");
  a = INTS(DSP_F32, INT64_MAX / 2, 4);
  tu_run_fail(ctx, DSP_OP_ZEROS, &a, 0, NULL, NULL, NULL, DISPATCH_EOVERFLOW,
              "overflows");
}

Test(create, arange) {
  dsp_tensor *o = make(DSP_OP_ARANGE,
                       with_floats(INTS(DSP_F32), 3, (double[]){0, 1, 0.25}));
  tu_assert_shape(o, 1, (int64_t[]){4});
  tu_assert_f32(o, (float[]){0, 0.25f, 0.5f, 0.75f}, 4, 0);
  dsp_tensor_unref(o);
  o = make(DSP_OP_ARANGE, with_floats(INTS(DSP_I64), 3, (double[]){5, 0, -2}));
  tu_assert_i64(o, (int64_t[]){5, 3, 1}, 3);
  dsp_tensor_unref(o);
  o = make(DSP_OP_ARANGE, with_floats(INTS(DSP_F64), 3, (double[]){3, 1, 1}));
  tu_assert_shape(o, 1, (int64_t[]){0});
  dsp_tensor_unref(o);
  o = make(DSP_OP_ARANGE, with_floats(INTS(DSP_F64), 3, (double[]){1, 2.5, 0.5}));
  tu_assert_f64(o, (double[]){1, 1.5, 2}, 3, 0);
  dsp_tensor_unref(o);
  dsp_attrs a = with_floats(INTS(DSP_F32), 3, (double[]){0, 1, 0});
  tu_run_fail(ctx, DSP_OP_ARANGE, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "step != 0");
  a = with_floats(INTS(DSP_BOOL), 3, (double[]){0, 1, 1});
  tu_run_fail(ctx, DSP_OP_ARANGE, &a, 0, NULL, NULL, NULL, DISPATCH_EDTYPE,
              "arange: dtype bool");
  a = with_floats(INTS(DSP_I64), 3, (double[]){0.5, 3, 1});
  tu_run_fail(ctx, DSP_OP_ARANGE, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "integer start and step");
  a = with_floats(INTS(DSP_F64), 3, (double[]){0, 1e300, 1});
  tu_run_fail(ctx, DSP_OP_ARANGE, &a, 0, NULL, NULL, NULL, DISPATCH_EOVERFLOW,
              "too many");
}

Test(create, rng_matches_the_documented_formula) {
  /* constants from an independent implementation of the rng.h formula */
  cr_assert_eq(dsp_rng_u64(0, 0), UINT64_C(0xa706dd2f4d197e6f));
  cr_assert_eq(dsp_rng_u64(0, 1), UINT64_C(0xb382a305f4414f5e));
  cr_assert_eq(dsp_rng_u64(42, 7), UINT64_C(0xbc16a3d4cc48678e));
  cr_assert_eq(dsp_rng_u64(UINT64_MAX, UINT64_MAX), UINT64_C(0x445018e305810b78));
  cr_assert_eq(dsp_rng_uniform01(0, 0), 0.6524484863740322);
  cr_assert_eq(dsp_rng_uniform01(42, 7), 0.7347204584623639);
  double z0, z1;
  dsp_rng_normal_pair(5, 3, &z0, &z1);
  cr_assert_eq(dsp_rng_normal(5, 6), z0);
  cr_assert_eq(dsp_rng_normal(5, 7), z1);
  double u1 = dsp_rng_uniform01(5, 6), u2 = dsp_rng_uniform01(5, 7);
  cr_assert_float_eq(z0, sqrt(-2 * log(1 - u1)) * cos(2 * M_PI * u2), 1e-12);
}

Test(create, uniform_is_seeded_and_in_range) {
  double lh[2] = {-2, 3};
  dsp_tensor *a = make(DSP_OP_UNIFORM, with_floats(INTS(DSP_F64, 42, 1000), 2, lh));
  dsp_tensor *b = make(DSP_OP_UNIFORM, with_floats(INTS(DSP_F64, 42, 1000), 2, lh));
  dsp_tensor *c = make(DSP_OP_UNIFORM, with_floats(INTS(DSP_F64, 43, 1000), 2, lh));
  cr_assert_eq(memcmp(dsp_tensor_data(a), dsp_tensor_data(b), 8000), 0);
  cr_assert_neq(memcmp(dsp_tensor_data(a), dsp_tensor_data(c), 8000), 0);
  const double *v = dsp_tensor_data(a);
  double sum = 0;
  for (int i = 0; i < 1000; i++) {
    cr_assert(v[i] >= -2 && v[i] < 3);
    cr_assert_eq(v[i], -2 + 5 * dsp_rng_uniform01(42, (uint64_t)i));
    sum += v[i];
  }
  cr_assert(fabs(sum / 1000 - 0.5) < 0.25, "mean %g", sum / 1000);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  /* f32 of a 2-D shape: element i still uses counter i */
  dsp_tensor *f = make(DSP_OP_UNIFORM,
                       with_floats(INTS(DSP_F32, 7, 2, 3), 2, (double[]){0, 1}));
  tu_assert_shape(f, 2, (int64_t[]){2, 3});
  for (int i = 0; i < 6; i++)
    cr_assert_eq(((float *)dsp_tensor_data(f))[i],
                 (float)dsp_rng_uniform01(7, (uint64_t)i));
  dsp_tensor_unref(f);
}

Test(create, normal_moments_and_pairs) {
  enum { N = 4001 }; /* odd: the last element is z0 of a final pair */
  dsp_tensor *a = make(DSP_OP_NORMAL,
                       with_floats(INTS(DSP_F64, 9, N), 2, (double[]){1, 2}));
  const double *v = dsp_tensor_data(a);
  double s = 0, s2 = 0;
  for (int i = 0; i < N; i++) {
    cr_assert_eq(v[i], 1 + 2 * dsp_rng_normal(9, (uint64_t)i), "element %d", i);
    s += v[i];
    s2 += v[i] * v[i];
  }
  double mean = s / N, var = s2 / N - mean * mean;
  cr_assert(fabs(mean - 1) < 0.15, "mean %g", mean);
  cr_assert(fabs(var - 4) < 0.4, "variance %g", var);
  dsp_tensor_unref(a);
}

Test(create, random_errors) {
  dsp_attrs a = with_floats(INTS(DSP_I64, 1, 3), 2, (double[]){0, 1});
  tu_run_fail(ctx, DSP_OP_UNIFORM, &a, 0, NULL, NULL, NULL, DISPATCH_EDTYPE,
              "uniform: dtype i64 not supported");
  a = with_floats(INTS(DSP_F32, 1, 3), 2, (double[]){2, 1});
  tu_run_fail(ctx, DSP_OP_UNIFORM, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "low <= high, got 2 and 1");
  a = with_floats(INTS(DSP_F32, 1, 3), 2, (double[]){0, -1});
  tu_run_fail(ctx, DSP_OP_NORMAL, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "std >= 0");
  a = with_floats(INTS(DSP_F32), 2, (double[]){0, 1});
  tu_run_fail(ctx, DSP_OP_NORMAL, &a, 0, NULL, NULL, NULL, DISPATCH_EINVAL,
              "normal: takes 2 leading ints");
}
