/* ew family through dsp_op: forward values on hand-checked cases,
 * broadcasting, dtype rules and error messages. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dsp.h"
#include "helpers/failalloc.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(ew, .init = setup, .fini = teardown);

static const int64_t S4[] = {4}, S23[] = {2, 3}, S3[] = {3}, S21[] = {2, 1},
                     S13[] = {1, 3}, S22[] = {2, 2};

Test(ew, add_same_shape_f32) {
  dsp_tensor *a = tu_f32(ctx, 1, S4, (float[]){1, 2, 3, 4});
  dsp_tensor *b = tu_f32(ctx, 1, S4, (float[]){10, 20, 30, 40.5f});
  dsp_tensor *o = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  tu_assert_shape(o, 1, S4);
  tu_assert_f32(o, (float[]){11, 22, 33, 44.5f}, 4, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_SUB, NULL, 2, a, b, NULL);
  tu_assert_f32(o, (float[]){-9, -18, -27, -36.5f}, 4, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_DIV, NULL, 2, b, a, NULL);
  tu_assert_f32(o, (float[]){10, 10, 10, 10.125f}, 4, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, broadcast_row_vector_and_outer_product) {
  dsp_tensor *a = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *b = tu_f32(ctx, 1, S3, (float[]){10, 20, 30});
  dsp_tensor *o = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  tu_assert_shape(o, 2, S23);
  tu_assert_f32(o, (float[]){11, 22, 33, 14, 25, 36}, 6, 0);
  dsp_tensor_unref(o);
  /* reversed order: [3] - [2,3] */
  o = tu_run(ctx, DSP_OP_SUB, NULL, 2, b, a, NULL);
  tu_assert_f32(o, (float[]){9, 18, 27, 6, 15, 24}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(a), dsp_tensor_unref(b);

  dsp_tensor *c = tu_f64(ctx, 2, S21, (double[]){2, 3});
  dsp_tensor *d = tu_f64(ctx, 2, S13, (double[]){1, 10, 100});
  o = tu_run(ctx, DSP_OP_MUL, NULL, 2, c, d, NULL);
  tu_assert_shape(o, 2, S23);
  tu_assert_f64(o, (double[]){2, 20, 200, 3, 30, 300}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(c), dsp_tensor_unref(d);
}

Test(ew, broadcast_scalar_shaped_and_rank3) {
  dsp_tensor *s = tu_f32(ctx, 0, NULL, (float[]){0.5f});
  dsp_tensor *a = tu_f32(ctx, 2, S22, (float[]){1, 2, 3, 4});
  dsp_tensor *o = tu_run(ctx, DSP_OP_MUL, NULL, 2, s, a, NULL);
  tu_assert_shape(o, 2, S22);
  tu_assert_f32(o, (float[]){0.5f, 1, 1.5f, 2}, 4, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_DIV, NULL, 2, a, s, NULL);
  tu_assert_f32(o, (float[]){2, 4, 6, 8}, 4, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(s), dsp_tensor_unref(a);

  /* [2,1,3] + [2,1] -> [2,2,3]: x[i,0,k] = 10*i + k, y[j,0] = 100*j */
  dsp_tensor *x = tu_i64(ctx, 3, (int64_t[]){2, 1, 3},
                         (int64_t[]){0, 1, 2, 10, 11, 12});
  dsp_tensor *y = tu_i64(ctx, 2, S21, (int64_t[]){0, 100});
  o = tu_run(ctx, DSP_OP_ADD, NULL, 2, x, y, NULL);
  tu_assert_shape(o, 3, (int64_t[]){2, 2, 3});
  tu_assert_i64(o, (int64_t[]){0, 1, 2, 100, 101, 102, 10, 11, 12, 110, 111, 112},
                12);
  dsp_tensor_unref(o);
  dsp_tensor_unref(x), dsp_tensor_unref(y);
}

Test(ew, broadcast_with_empty_dim_gives_empty) {
  dsp_tensor *a = tu_f32(ctx, 2, (int64_t[]){0, 3}, NULL);
  dsp_tensor *b = tu_f32(ctx, 1, S3, (float[]){1, 2, 3});
  dsp_tensor *o = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  tu_assert_shape(o, 2, (int64_t[]){0, 3});
  cr_assert_eq(o->numel, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, maximum_minimum_propagate_nan) {
  dsp_tensor *a = tu_f32(ctx, 1, S4, (float[]){1, NAN, 5, -2});
  dsp_tensor *b = tu_f32(ctx, 1, S4, (float[]){3, 0, NAN, -7});
  dsp_tensor *o = tu_run(ctx, DSP_OP_MAXIMUM, NULL, 2, a, b, NULL);
  tu_assert_f32(o, (float[]){3, NAN, NAN, -2}, 4, 0);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MINIMUM, NULL, 2, a, b, NULL);
  tu_assert_f32(o, (float[]){1, NAN, NAN, -7}, 4, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, i64_arithmetic_truncates_and_wraps) {
  dsp_tensor *a = tu_i64(ctx, 1, S4, (int64_t[]){7, -7, INT64_MIN, INT64_MAX});
  dsp_tensor *b = tu_i64(ctx, 1, S4, (int64_t[]){2, 2, -1, 1});
  dsp_tensor *o = tu_run(ctx, DSP_OP_DIV, NULL, 2, a, b, NULL);
  tu_assert_i64(o, (int64_t[]){3, -3, INT64_MIN, INT64_MAX}, 4);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL);
  tu_assert_i64(o, (int64_t[]){9, -5, INT64_MAX, INT64_MIN}, 4);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MUL, NULL, 2, a, b, NULL);
  tu_assert_i64(o, (int64_t[]){14, -14, INT64_MIN, INT64_MAX}, 4);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MAXIMUM, NULL, 2, a, b, NULL);
  tu_assert_i64(o, (int64_t[]){7, 2, -1, INT64_MAX}, 4);
  dsp_tensor_unref(o);
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, i64_division_by_zero_is_einval) {
  dsp_tensor *a = tu_i64(ctx, 1, S3, (int64_t[]){1, 2, 3});
  dsp_tensor *b = tu_i64(ctx, 1, S3, (int64_t[]){1, 0, 3});
  tu_run_fail(ctx, DSP_OP_DIV, NULL, 2, a, b, NULL, DISPATCH_EINVAL,
              "division by zero");
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, comparisons_give_bool_with_broadcast) {
  dsp_tensor *a = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *b = tu_f32(ctx, 1, S3, (float[]){2, 2, 5});
  struct { dsp_opcode op; uint8_t e[6]; } cases[] = {
      {DSP_OP_EQ, {0, 1, 0, 0, 0, 0}}, {DSP_OP_NE, {1, 0, 1, 1, 1, 1}},
      {DSP_OP_LT, {1, 0, 1, 0, 0, 0}}, {DSP_OP_LE, {1, 1, 1, 0, 0, 0}},
      {DSP_OP_GT, {0, 0, 0, 1, 1, 1}}, {DSP_OP_GE, {0, 1, 0, 1, 1, 1}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dsp_tensor *o = tu_run(ctx, cases[i].op, NULL, 2, a, b, NULL);
    tu_assert_shape(o, 2, S23);
    tu_assert_bool(o, cases[i].e, 6);
    dsp_tensor_unref(o);
  }
  dsp_tensor_unref(a), dsp_tensor_unref(b);

  dsp_tensor *x = tu_i64(ctx, 1, S3, (int64_t[]){-1, 0, 1});
  dsp_tensor *z = tu_i64(ctx, 0, NULL, (int64_t[]){0});
  dsp_tensor *o = tu_run(ctx, DSP_OP_GT, NULL, 2, x, z, NULL);
  tu_assert_bool(o, (uint8_t[]){0, 0, 1}, 3);
  dsp_tensor_unref(o), dsp_tensor_unref(x), dsp_tensor_unref(z);
}

Test(ew, bool_supports_eq_ne_only) {
  dsp_tensor *a = tu_bool(ctx, 1, S4, (uint8_t[]){0, 1, 0, 1});
  dsp_tensor *b = tu_bool(ctx, 1, S4, (uint8_t[]){0, 0, 1, 1});
  dsp_tensor *o = tu_run(ctx, DSP_OP_EQ, NULL, 2, a, b, NULL);
  tu_assert_bool(o, (uint8_t[]){1, 0, 0, 1}, 4);
  dsp_tensor_unref(o);
  tu_run_fail(ctx, DSP_OP_LT, NULL, 2, a, b, NULL, DISPATCH_EDTYPE,
              "lt: dtype bool");
  tu_run_fail(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL, DISPATCH_EDTYPE,
              "add: dtype bool");
  dsp_tensor_unref(a), dsp_tensor_unref(b);
}

Test(ew, where_broadcasts_three_ways) {
  dsp_tensor *m = tu_bool(ctx, 2, S21, (uint8_t[]){1, 0});
  dsp_tensor *a = tu_f64(ctx, 2, S23, (double[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *b = tu_f64(ctx, 0, NULL, (double[]){-1});
  dsp_tensor *o = tu_run(ctx, DSP_OP_WHERE, NULL, 3, m, a, b);
  tu_assert_shape(o, 2, S23);
  tu_assert_f64(o, (double[]){1, 2, 3, -1, -1, -1}, 6, 0);
  dsp_tensor_unref(o);
  /* same shapes everywhere: the fast path */
  dsp_tensor *m2 = tu_bool(ctx, 2, S23, (uint8_t[]){1, 0, 1, 0, 1, 0});
  dsp_tensor *z = tu_f64(ctx, 2, S23, (double[]){0, 0, 0, 0, 0, 0});
  o = tu_run(ctx, DSP_OP_WHERE, NULL, 3, m2, a, z);
  tu_assert_f64(o, (double[]){1, 0, 3, 0, 5, 0}, 6, 0);
  dsp_tensor_unref(o);
  tu_run_fail(ctx, DSP_OP_WHERE, NULL, 3, a, a, z, DISPATCH_EDTYPE,
              "mask must be bool, got f64");
  dsp_tensor *f = tu_f32(ctx, 0, NULL, (float[]){0});
  tu_run_fail(ctx, DSP_OP_WHERE, NULL, 3, m, a, f, DISPATCH_EDTYPE,
              "f64 and f32");
  dsp_tensor *m3 = tu_bool(ctx, 1, S4, (uint8_t[]){1, 1, 1, 1});
  tu_run_fail(ctx, DSP_OP_WHERE, NULL, 3, m3, a, z, DISPATCH_ESHAPE,
              "do not broadcast");
  dsp_tensor_unref(m), dsp_tensor_unref(m2), dsp_tensor_unref(m3);
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(z);
  dsp_tensor_unref(f);
}

Test(ew, scalar_forms_f32_and_f64) {
  dsp_tensor *x = tu_f32(ctx, 1, S3, (float[]){1, 2, 4});
  struct { dsp_opcode op; double s; float e[3]; } cases[] = {
      {DSP_OP_ADD_SCALAR, 1.5, {2.5f, 3.5f, 5.5f}},
      {DSP_OP_SUB_SCALAR, 1, {0, 1, 3}},
      {DSP_OP_MUL_SCALAR, -2, {-2, -4, -8}},
      {DSP_OP_DIV_SCALAR, 4, {0.25f, 0.5f, 1}},
      {DSP_OP_POW_SCALAR, 2, {1, 4, 16}},
      {DSP_OP_POW_SCALAR, 0.5, {1, 1.41421356f, 2}},
      {DSP_OP_RSUB_SCALAR, 10, {9, 8, 6}},
      {DSP_OP_RDIV_SCALAR, 8, {8, 4, 2}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dsp_attrs a = dsp_attrs_f1(cases[i].s);
    dsp_tensor *o = tu_run(ctx, cases[i].op, &a, 1, x, NULL, NULL);
    tu_assert_f32(o, cases[i].e, 3, 1e-6f);
    dsp_tensor_unref(o);
  }
  dsp_tensor_unref(x);
  dsp_tensor *y = tu_f64(ctx, 1, S3, (double[]){1, 2, 4});
  dsp_attrs a = dsp_attrs_f1(3);
  dsp_tensor *o = tu_run(ctx, DSP_OP_POW_SCALAR, &a, 1, y, NULL, NULL);
  tu_assert_f64(o, (double[]){1, 8, 64}, 3, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(y);
}

Test(ew, scalar_forms_on_i64_need_integral_scalars) {
  dsp_tensor *x = tu_i64(ctx, 1, S3, (int64_t[]){1, -2, 3});
  dsp_attrs a = dsp_attrs_f1(5);
  dsp_tensor *o = tu_run(ctx, DSP_OP_RSUB_SCALAR, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){4, 7, 2}, 3);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_MUL_SCALAR, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){5, -10, 15}, 3);
  dsp_tensor_unref(o);
  a = dsp_attrs_f1(2.5);
  tu_run_fail(ctx, DSP_OP_ADD_SCALAR, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "scalar 2.5 is not an integer");
  tu_run_fail(ctx, DSP_OP_DIV_SCALAR, &a, 1, x, NULL, NULL, DISPATCH_EDTYPE,
              "div_scalar: dtype i64");
  tu_run_fail(ctx, DSP_OP_ADD_SCALAR, NULL, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "takes 0 int and 1 float attributes, got 0 and 0");
  dsp_tensor_unref(x);
}

Test(ew, unary_math_f64_hand_values) {
  dsp_tensor *x = tu_f64(ctx, 1, S4, (double[]){-1, 0, 1, 2});
  struct { dsp_opcode op; double e[4]; } cases[] = {
      {DSP_OP_NEG, {1, -0.0, -1, -2}},
      {DSP_OP_ABS, {1, 0, 1, 2}},
      {DSP_OP_SIGN, {-1, 0, 1, 1}},
      {DSP_OP_RELU, {0, 0, 1, 2}},
      {DSP_OP_EXP, {0.36787944117144233, 1, 2.718281828459045, 7.38905609893065}},
      {DSP_OP_SIGMOID, {0.2689414213699951, 0.5, 0.7310585786300049,
                        0.8807970779778823}},
      {DSP_OP_TANH, {-0.7615941559557649, 0, 0.7615941559557649,
                     0.9640275800758169}},
      {DSP_OP_GELU, {-0.15865525393145707, 0, 0.8413447460685429,
                     1.9544997361036416}},
      {DSP_OP_SILU, {-0.2689414213699951, 0, 0.7310585786300049,
                     1.7615941559557646}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dsp_tensor *o = tu_run(ctx, cases[i].op, NULL, 1, x, NULL, NULL);
    tu_assert_f64(o, cases[i].e, 4, 1e-15);
    dsp_tensor_unref(o);
  }
  dsp_tensor *p = tu_f64(ctx, 1, S3, (double[]){1, 2, 9});
  dsp_tensor *o = tu_run(ctx, DSP_OP_LOG, NULL, 1, p, NULL, NULL);
  tu_assert_f64(o, (double[]){0, 0.6931471805599453, 2.1972245773362196}, 3,
                1e-15);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_SQRT, NULL, 1, p, NULL, NULL);
  tu_assert_f64(o, (double[]){1, 1.4142135623730951, 3}, 3, 1e-15);
  dsp_tensor_unref(o);
  dsp_tensor_unref(p), dsp_tensor_unref(x);
}

Test(ew, unary_math_f32_and_large_sigmoid_inputs) {
  dsp_tensor *x = tu_f32(ctx, 1, S4, (float[]){-100, -1, 1, 100});
  dsp_tensor *o = tu_run(ctx, DSP_OP_SIGMOID, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){3.7200760e-44f, 0.26894142f, 0.73105858f, 1}, 4,
                1e-7f);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_GELU, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-0.0f, -0.15865525f, 0.84134475f, 100}, 4, 1e-6f);
  dsp_tensor_unref(o);
  /* silu = x sigmoid(x), at both ends of f32's sigmoid */
  o = tu_run(ctx, DSP_OP_SILU, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-3.7200760e-42f, -0.26894142f, 0.73105858f, 100},
                4, 1e-6f);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_SIGN, NULL, 1, x, NULL, NULL);
  tu_assert_f32(o, (float[]){-1, -1, 1, 1}, 4, 0);
  dsp_tensor_unref(o);
  dsp_tensor_unref(x);
}

Test(ew, unary_i64_and_dtype_errors) {
  dsp_tensor *x = tu_i64(ctx, 1, S4, (int64_t[]){-5, 0, 3, INT64_MIN});
  dsp_tensor *o = tu_run(ctx, DSP_OP_ABS, NULL, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){5, 0, 3, INT64_MIN}, 4);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_SIGN, NULL, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){-1, 0, 1, -1}, 4);
  dsp_tensor_unref(o);
  o = tu_run(ctx, DSP_OP_NEG, NULL, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){5, 0, -3, INT64_MIN}, 4);
  dsp_tensor_unref(o);
  tu_run_fail(ctx, DSP_OP_EXP, NULL, 1, x, NULL, NULL, DISPATCH_EDTYPE,
              "exp: dtype i64 not supported");
  tu_run_fail(ctx, DSP_OP_SILU, NULL, 1, x, NULL, NULL, DISPATCH_EDTYPE,
              "silu: dtype i64 not supported");
  dsp_tensor *b = tu_bool(ctx, 1, S4, (uint8_t[]){0, 1, 1, 0});
  tu_run_fail(ctx, DSP_OP_LOG, NULL, 1, b, NULL, NULL, DISPATCH_EDTYPE,
              "log: dtype bool");
  tu_run_fail(ctx, DSP_OP_NEG, NULL, 1, b, NULL, NULL, DISPATCH_EDTYPE,
              "neg: dtype bool");
  dsp_attrs a = dsp_attrs_f1(1);
  tu_run_fail(ctx, DSP_OP_TANH, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "tanh: takes 0 int and 0 float attributes");
  dsp_tensor_unref(x), dsp_tensor_unref(b);
}

Test(ew, relu_and_gelu_backward) {
  dsp_tensor *g = tu_f64(ctx, 1, S4, (double[]){1, 2, 3, 4});
  dsp_tensor *x = tu_f64(ctx, 1, S4, (double[]){-1, 0, 2, 1});
  dsp_tensor *o = tu_run(ctx, DSP_OP_RELU_BACKWARD, NULL, 2, g, x, NULL);
  tu_assert_f64(o, (double[]){0, 0, 3, 4}, 4, 0);
  dsp_tensor_unref(o);
  /* gelu'(x) = Phi(x) + x phi(x): gelu'(0) = 0.5,
   * gelu'(1) = 0.8413447460685429 + 0.24197072451914337,
   * gelu'(-1) = 0.15865525393145707 - 0.24197072451914337,
   * gelu'(2) = 0.9772498680518208 + 2 * 0.05399096651318806 */
  o = tu_run(ctx, DSP_OP_GELU_BACKWARD, NULL, 2, g, x, NULL);
  tu_assert_f64(o, (double[]){-0.0833154705876863, 1.0, 3 * 1.0852318010781969,
                              4 * 1.0833154705876864},
                4, 1e-14);
  dsp_tensor_unref(o);
  dsp_tensor *x3 = tu_f64(ctx, 1, S3, (double[]){1, 2, 3});
  tu_run_fail(ctx, DSP_OP_RELU_BACKWARD, NULL, 2, g, x3, NULL, DISPATCH_ESHAPE,
              "grad shape [4] differs from input shape [3]");
  dsp_tensor *xf = tu_f32(ctx, 1, S4, (float[]){1, 2, 3, 4});
  tu_run_fail(ctx, DSP_OP_GELU_BACKWARD, NULL, 2, g, xf, NULL, DISPATCH_EDTYPE,
              "f64 and f32");
  dsp_tensor_unref(g), dsp_tensor_unref(x), dsp_tensor_unref(x3);
  dsp_tensor_unref(xf);
}

Test(ew, binary_errors_name_the_values) {
  dsp_tensor *a = tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *b = tu_f32(ctx, 1, S4, (float[]){1, 2, 3, 4});
  dsp_tensor *c = tu_f64(ctx, 1, S3, (double[]){1, 2, 3});
  tu_run_fail(ctx, DSP_OP_ADD, NULL, 2, a, b, NULL, DISPATCH_ESHAPE,
              "add: shapes [2, 3] and [4] do not broadcast");
  tu_run_fail(ctx, DSP_OP_MUL, NULL, 2, a, c, NULL, DISPATCH_EDTYPE,
              "mul: dtypes f32 and f64 differ");
  dsp_attrs at = dsp_attrs_ints(1, (int64_t[]){0});
  tu_run_fail(ctx, DSP_OP_SUB, &at, 2, a, a, NULL, DISPATCH_EINVAL,
              "sub: takes 0 int and 0 float attributes, got 1 and 0");
  tu_run_fail(ctx, DSP_OP_ADD, NULL, 1, a, NULL, NULL, DISPATCH_EINVAL,
              "add: takes 2 inputs, got 1");
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
}

/* The general broadcast path against a direct index computation on a
 * shape that exercises every loop variant (inner stride 0 on either side). */
Test(ew, general_broadcast_matches_index_arithmetic) {
  float av[4 * 5], bv[3 * 4 * 1];
  for (int i = 0; i < 20; i++) av[i] = (float)i;
  for (int i = 0; i < 12; i++) bv[i] = (float)(100 * i);
  dsp_tensor *a = tu_f32(ctx, 2, (int64_t[]){4, 5}, av);      /* [4,5] */
  dsp_tensor *b = tu_f32(ctx, 3, (int64_t[]){3, 4, 1}, bv);   /* [3,4,1] */
  dsp_tensor *o = tu_run(ctx, DSP_OP_SUB, NULL, 2, a, b, NULL);
  tu_assert_shape(o, 3, (int64_t[]){3, 4, 5});
  const float *ov = dsp_tensor_data(o);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++)
      for (int k = 0; k < 5; k++)
        cr_assert_eq(ov[(i * 4 + j) * 5 + k], av[j * 5 + k] - bv[i * 4 + j]);
  dsp_tensor_unref(o), dsp_tensor_unref(a), dsp_tensor_unref(b);
}

/* Allocation failures: failing the n-th allocation of an op gives
 * DISPATCH_ENOMEM and leaves nothing allocated. */
Test(ew_alloc, every_allocation_failure_is_enomem_without_leaks) {
  dsp_meta in[2] = {{DSP_F32, 2, {2, 3}}, {DSP_F32, 1, {3}}};
  cr_assert(failalloc_walk_op(DSP_OP_ADD, 2, in, NULL) >= 4,
            "ctx, 2 inputs and the output");
}
