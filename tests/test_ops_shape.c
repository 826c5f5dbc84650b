/* shape family: reshape, permute, transpose, slice, cat, stack,
 * broadcast_to, index_select, cast and the backward helpers. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "dsp.h"
#include "helpers/tensor_util.h"

static dsp_ctx *ctx;
static void setup(void) { ctx = dsp_ctx_new(dsp_cpu_backend()); }
static void teardown(void) { dsp_ctx_free(ctx); }
TestSuite(shape_ops, .init = setup, .fini = teardown);

static const int64_t S23[] = {2, 3};
#define INTS(...) dsp_attrs_ints(sizeof((int64_t[]){__VA_ARGS__}) / 8, \
                                 (int64_t[]){__VA_ARGS__})

static dsp_tensor *f23(void) {
  return tu_f32(ctx, 2, S23, (float[]){1, 2, 3, 4, 5, 6});
}

Test(shape_ops, reshape_with_minus_one) {
  dsp_tensor *x = f23();
  dsp_attrs a = INTS(3, -1);
  dsp_tensor *o = tu_run(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){3, 2});
  tu_assert_f32(o, (float[]){1, 2, 3, 4, 5, 6}, 6, 0);
  dsp_tensor_unref(o);
  a = INTS(-1, -1);
  tu_run_fail(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "more than one -1");
  a = INTS(4, -1);
  tu_run_fail(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "cannot infer -1 for 6 elements of [2, 3]");
  a = INTS(7);
  tu_run_fail(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "6 elements of [2, 3] do not fit 7");
  a = INTS(0, -1);
  tu_run_fail(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "cannot infer -1");
  a = dsp_attrs_none(); /* to a 0-d tensor: needs one element */
  tu_run_fail(ctx, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "do not fit 1");
  dsp_tensor_unref(x);
}

Test(shape_ops, transpose_and_permute) {
  dsp_tensor *x = f23();
  dsp_attrs a = INTS(0, -1);
  dsp_tensor *o = tu_run(ctx, DSP_OP_TRANSPOSE, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){3, 2});
  tu_assert_f32(o, (float[]){1, 4, 2, 5, 3, 6}, 6, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(x);

  int64_t v[24];
  for (int i = 0; i < 24; i++) v[i] = i; /* x[i,j,k] = 12i + 4j + k */
  dsp_tensor *y = tu_i64(ctx, 3, (int64_t[]){2, 3, 4}, v);
  a = INTS(2, 0, 1);
  o = tu_run(ctx, DSP_OP_PERMUTE, &a, 1, y, NULL, NULL);
  tu_assert_shape(o, 3, (int64_t[]){4, 2, 3});
  /* out[k,i,j] = 12i + 4j + k */
  tu_assert_i64(o, (int64_t[]){0, 4, 8, 12, 16, 20, 1, 5, 9, 13, 17, 21,
                               2, 6, 10, 14, 18, 22, 3, 7, 11, 15, 19, 23}, 24);
  dsp_tensor_unref(o);
  a = INTS(0, 0, 1);
  tu_run_fail(ctx, DSP_OP_PERMUTE, &a, 1, y, NULL, NULL, DISPATCH_EDIM,
              "permute: dim 0 repeated");
  a = INTS(1, 0);
  tu_run_fail(ctx, DSP_OP_PERMUTE, &a, 1, y, NULL, NULL, DISPATCH_EINVAL,
              "permute: takes 3 int");
  a = INTS(0, 3);
  tu_run_fail(ctx, DSP_OP_TRANSPOSE, &a, 1, y, NULL, NULL, DISPATCH_EDIM,
              "transpose: dim 3 out of range for rank 3");
  dsp_tensor_unref(y);
}

Test(shape_ops, slice_clamps_like_python) {
  int64_t v[10];
  for (int i = 0; i < 10; i++) v[i] = i;
  dsp_tensor *x = tu_i64(ctx, 1, (int64_t[]){10}, v);
  dsp_attrs a = INTS(0, 1, 8, 3);
  dsp_tensor *o = tu_run(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, 4, 7}, 3);
  dsp_tensor_unref(o);
  a = INTS(0, -3, 100, 1);
  o = tu_run(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){7, 8, 9}, 3);
  dsp_tensor_unref(o);
  a = INTS(-1, -100, -8, 1);
  o = tu_run(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){0, 1}, 2);
  dsp_tensor_unref(o);
  a = INTS(0, 6, 2, 1);
  o = tu_run(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 1, (int64_t[]){0});
  dsp_tensor_unref(o);
  a = INTS(0, 0, 10, INT64_MAX);
  o = tu_run(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){0}, 1);
  dsp_tensor_unref(o);
  a = INTS(0, 0, 5, 0);
  tu_run_fail(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "slice: step must be > 0, got 0");
  a = INTS(0, 0, 5);
  tu_run_fail(ctx, DSP_OP_SLICE, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "slice: takes 4 int");
  dsp_tensor_unref(x);
  dsp_tensor *y = f23();
  a = INTS(1, 1, 3, 1);
  o = tu_run(ctx, DSP_OP_SLICE, &a, 1, y, NULL, NULL);
  tu_assert_shape(o, 2, (int64_t[]){2, 2});
  tu_assert_f32(o, (float[]){2, 3, 5, 6}, 4, 0);
  dsp_tensor_unref(o), dsp_tensor_unref(y);
}

Test(shape_ops, cat_and_stack) {
  dsp_tensor *a = tu_f32(ctx, 2, (int64_t[]){1, 2}, (float[]){1, 2});
  dsp_tensor *b = tu_f32(ctx, 2, (int64_t[]){2, 2}, (float[]){3, 4, 5, 6});
  dsp_tensor *in[3] = {a, b, NULL};
  dsp_attrs at = INTS(0);
  dsp_tensor *o;
  cr_assert_eq(dsp_op(ctx, DSP_OP_CAT, in, 2, &at, &o), 0);
  tu_assert_shape(o, 2, (int64_t[]){3, 2});
  tu_assert_f32(o, (float[]){1, 2, 3, 4, 5, 6}, 6, 0);
  dsp_tensor_unref(o);
  at = INTS(1);
  tu_run_fail(ctx, DSP_OP_CAT, &at, 2, a, b, NULL, DISPATCH_ESHAPE,
              "cat: input 1 has shape [2, 2], input 0 has [1, 2]");
  dsp_tensor *c = tu_f32(ctx, 2, (int64_t[]){2, 1}, (float[]){7, 8});
  o = tu_run(ctx, DSP_OP_CAT, &at, 2, b, c, NULL);
  tu_assert_f32(o, (float[]){3, 4, 7, 5, 6, 8}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor *d = tu_f64(ctx, 2, (int64_t[]){2, 1}, (double[]){7, 8});
  tu_run_fail(ctx, DSP_OP_CAT, &at, 2, b, d, NULL, DISPATCH_EDTYPE,
              "input 1 has dtype f64, input 0 has f32");

  dsp_tensor *p = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 2});
  dsp_tensor *q = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){3, 4});
  at = INTS(0);
  o = tu_run(ctx, DSP_OP_STACK, &at, 2, p, q, NULL);
  tu_assert_shape(o, 2, (int64_t[]){2, 2});
  tu_assert_i64(o, (int64_t[]){1, 2, 3, 4}, 4);
  dsp_tensor_unref(o);
  at = INTS(-1);
  o = tu_run(ctx, DSP_OP_STACK, &at, 3, p, q, p);
  tu_assert_shape(o, 2, (int64_t[]){2, 3});
  tu_assert_i64(o, (int64_t[]){1, 3, 1, 2, 4, 2}, 6);
  dsp_tensor_unref(o);
  at = INTS(2);
  tu_run_fail(ctx, DSP_OP_STACK, &at, 2, p, q, NULL, DISPATCH_EDIM,
              "stack: dim 2 out of range for rank 2");
  at = INTS(0);
  tu_run_fail(ctx, DSP_OP_STACK, &at, 2, p, a, NULL, DISPATCH_EDTYPE,
              "stack: input 1 has dtype f32");
  dsp_tensor_unref(a), dsp_tensor_unref(b), dsp_tensor_unref(c);
  dsp_tensor_unref(d), dsp_tensor_unref(p), dsp_tensor_unref(q);
}

Test(shape_ops, broadcast_to) {
  dsp_tensor *x = tu_f32(ctx, 1, (int64_t[]){3}, (float[]){1, 2, 3});
  dsp_attrs a = INTS(2, 3);
  dsp_tensor *o = tu_run(ctx, DSP_OP_BROADCAST_TO, &a, 1, x, NULL, NULL);
  tu_assert_shape(o, 2, S23);
  tu_assert_f32(o, (float[]){1, 2, 3, 1, 2, 3}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor *y = tu_bool(ctx, 2, (int64_t[]){2, 1}, (uint8_t[]){1, 0});
  o = tu_run(ctx, DSP_OP_BROADCAST_TO, &a, 1, y, NULL, NULL);
  tu_assert_bool(o, (uint8_t[]){1, 1, 1, 0, 0, 0}, 6);
  dsp_tensor_unref(o);
  a = INTS(2, 4);
  tu_run_fail(ctx, DSP_OP_BROADCAST_TO, &a, 1, x, NULL, NULL, DISPATCH_ESHAPE,
              "broadcast_to: [3] does not broadcast to [2, 4]");
  a = dsp_attrs_none();
  tu_run_fail(ctx, DSP_OP_BROADCAST_TO, &a, 1, x, NULL, NULL, DISPATCH_EINVAL,
              "target rank 0");
  dsp_tensor_unref(x), dsp_tensor_unref(y);
}

Test(shape_ops, index_select_and_range_errors) {
  dsp_tensor *x = tu_f32(ctx, 2, (int64_t[]){3, 2}, (float[]){1, 2, 3, 4, 5, 6});
  dsp_tensor *ix = tu_i64(ctx, 1, (int64_t[]){3}, (int64_t[]){2, 0, 2});
  dsp_attrs a = INTS(0);
  dsp_tensor *o = tu_run(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, ix, NULL);
  tu_assert_shape(o, 2, (int64_t[]){3, 2});
  tu_assert_f32(o, (float[]){5, 6, 1, 2, 5, 6}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor *j = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){1, 1});
  a = INTS(-1);
  o = tu_run(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, j, NULL);
  tu_assert_f32(o, (float[]){2, 2, 4, 4, 6, 6}, 6, 0);
  dsp_tensor_unref(o);
  dsp_tensor *bad = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){0, 5});
  a = INTS(0);
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, bad, NULL, DISPATCH_EINDEX,
              "index 5 (position 1) out of range for dim 0 of size 3");
  ((int64_t *)dsp_tensor_data(bad))[1] = -1;
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, bad, NULL, DISPATCH_EINDEX,
              "index -1");
  dsp_tensor *fi = tu_f32(ctx, 1, (int64_t[]){1}, (float[]){0});
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, fi, NULL, DISPATCH_EDTYPE,
              "index must be i64, got f32");
  dsp_tensor *i2 = tu_i64(ctx, 2, (int64_t[]){1, 1}, (int64_t[]){0});
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, i2, NULL, DISPATCH_ESHAPE,
              "index must be 1-D, got rank 2");
  a = INTS(2);
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT, &a, 2, x, ix, NULL, DISPATCH_EDIM,
              "dim 2 out of range");
  dsp_tensor_unref(x), dsp_tensor_unref(ix), dsp_tensor_unref(j);
  dsp_tensor_unref(bad), dsp_tensor_unref(fi), dsp_tensor_unref(i2);
}

Test(shape_ops, cast_between_all_dtypes) {
  dsp_tensor *x = tu_f32(ctx, 1, (int64_t[]){5},
                         (float[]){1.7f, -1.7f, NAN, 1e30f, 0});
  dsp_attrs a = INTS(DSP_I64);
  dsp_tensor *o = tu_run(ctx, DSP_OP_CAST, &a, 1, x, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){1, -1, 0, INT64_MAX, 0}, 5);
  dsp_tensor_unref(o);
  a = INTS(DSP_BOOL);
  o = tu_run(ctx, DSP_OP_CAST, &a, 1, x, NULL, NULL);
  tu_assert_bool(o, (uint8_t[]){1, 1, 1, 1, 0}, 5);
  dsp_tensor_unref(o);
  a = INTS(DSP_F64);
  o = tu_run(ctx, DSP_OP_CAST, &a, 1, x, NULL, NULL);
  tu_assert_f64(o, (double[]){(double)1.7f, (double)-1.7f, NAN, (double)1e30f, 0},
                5, 0);
  dsp_tensor *back;
  a = INTS(DSP_F32);
  back = tu_run(ctx, DSP_OP_CAST, &a, 1, o, NULL, NULL);
  tu_assert_f32(back, (float[]){1.7f, -1.7f, NAN, 1e30f, 0}, 5, 0);
  dsp_tensor_unref(back), dsp_tensor_unref(o), dsp_tensor_unref(x);
  dsp_tensor *b = tu_bool(ctx, 1, (int64_t[]){2}, (uint8_t[]){1, 0});
  a = INTS(DSP_F32);
  o = tu_run(ctx, DSP_OP_CAST, &a, 1, b, NULL, NULL);
  tu_assert_f32(o, (float[]){1, 0}, 2, 0);
  dsp_tensor_unref(o);
  dsp_tensor *i = tu_i64(ctx, 1, (int64_t[]){2}, (int64_t[]){-3, 0});
  a = INTS(DSP_BOOL);
  o = tu_run(ctx, DSP_OP_CAST, &a, 1, i, NULL, NULL);
  tu_assert_bool(o, (uint8_t[]){1, 0}, 2);
  dsp_tensor_unref(o);
  a = INTS(DSP_I64);
  o = tu_run(ctx, DSP_OP_CAST, &a, 1, i, NULL, NULL);
  tu_assert_i64(o, (int64_t[]){-3, 0}, 2);
  dsp_tensor_unref(o);
  a = INTS(7);
  tu_run_fail(ctx, DSP_OP_CAST, &a, 1, i, NULL, NULL, DISPATCH_EDTYPE,
              "cast: invalid target dtype 7");
  dsp_tensor_unref(b), dsp_tensor_unref(i);
}

Test(shape_ops, slice_backward_places_grad) {
  dsp_tensor *g = tu_f64(ctx, 1, (int64_t[]){2}, (double[]){7, 9});
  dsp_attrs a = INTS(0, 1, 5, 2, 5);
  dsp_tensor *o = tu_run(ctx, DSP_OP_SLICE_BACKWARD, &a, 1, g, NULL, NULL);
  tu_assert_shape(o, 1, (int64_t[]){5});
  tu_assert_f64(o, (double[]){0, 7, 0, 9, 0}, 5, 0);
  dsp_tensor_unref(o);
  dsp_tensor *g2 = tu_f32(ctx, 2, (int64_t[]){2, 1}, (float[]){1, 2});
  a = INTS(1, -1, 3, 1, 2, 3);
  o = tu_run(ctx, DSP_OP_SLICE_BACKWARD, &a, 1, g2, NULL, NULL);
  tu_assert_f32(o, (float[]){0, 0, 1, 0, 0, 2}, 6, 0);
  dsp_tensor_unref(o);
  a = INTS(0, 0, 5, 1, 5);
  tu_run_fail(ctx, DSP_OP_SLICE_BACKWARD, &a, 1, g, NULL, NULL, DISPATCH_ESHAPE,
              "grad shape [2], slice shape [5]");
  a = INTS(0, 0, 5, 1);
  tu_run_fail(ctx, DSP_OP_SLICE_BACKWARD, &a, 1, g, NULL, NULL, DISPATCH_EINVAL,
              "slice_backward: takes 4 ints plus the input shape");
  dsp_tensor_unref(g), dsp_tensor_unref(g2);
}

Test(shape_ops, index_select_backward_scatter_adds) {
  dsp_tensor *g = tu_f32(ctx, 2, (int64_t[]){3, 2}, (float[]){1, 1, 2, 2, 3, 3});
  dsp_tensor *ix = tu_i64(ctx, 1, (int64_t[]){3}, (int64_t[]){2, 0, 2});
  dsp_attrs a = INTS(0, 4);
  dsp_tensor *o = tu_run(ctx, DSP_OP_INDEX_SELECT_BACKWARD, &a, 2, g, ix, NULL);
  tu_assert_shape(o, 2, (int64_t[]){4, 2});
  tu_assert_f32(o, (float[]){2, 2, 0, 0, 4, 4, 0, 0}, 8, 0);
  dsp_tensor_unref(o);
  a = INTS(0, 2);
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT_BACKWARD, &a, 2, g, ix, NULL,
              DISPATCH_EINDEX, "index 2 (position 0) out of range for dim 0 of size 2");
  a = INTS(1, 4);
  tu_run_fail(ctx, DSP_OP_INDEX_SELECT_BACKWARD, &a, 2, g, ix, NULL,
              DISPATCH_ESHAPE, "3 indices for grad size 2 at dim 1");
  dsp_tensor_unref(g), dsp_tensor_unref(ix);
}
