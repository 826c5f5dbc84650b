/* Core: error table, dtypes, shape arithmetic, tensors, op table. */
#include <criterion/criterion.h>
#include <string.h>

#include "dsp.h"

Test(errors, names_and_messages_come_from_one_table) {
  cr_assert_str_eq(dispatch_err_name(DISPATCH_ESHAPE), "DISPATCH_ESHAPE");
  cr_assert_str_eq(dispatch_strerror(DISPATCH_EDOUBLEWRAP),
                   "autodiff should not wrap an autodiff tensor");
  cr_assert_str_eq(dispatch_err_name(12345), "DISPATCH_EUNKNOWN");
  cr_assert(DISPATCH_ENOMEM < 0);
}

/* common/ picks no backend: a ctx uses the one it was made with, and
 * dsp_ctx_set_backend(NULL) returns to that one, not to the CPU's. */
Test(ctx, uses_the_backend_it_was_made_with) {
  cr_assert_null(dsp_ctx_new(NULL));
  dsp_backend *cpu1 = dsp_cpu_backend_new("cpu:1");
  cr_assert_not_null(cpu1);
  dsp_ctx *ctx = dsp_ctx_new(cpu1);
  cr_assert_not_null(ctx);
  cr_assert_eq(dsp_ctx_backend(ctx), cpu1);
  dsp_ctx_set_backend(ctx, dsp_cpu_backend());
  cr_assert_eq(dsp_ctx_backend(ctx), dsp_cpu_backend());
  dsp_ctx_set_backend(ctx, NULL);
  cr_assert_eq(dsp_ctx_backend(ctx), cpu1);
  dsp_meta m = {DSP_F32, 1, {4}};
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &t), 0, "%s", dsp_ctx_errmsg(ctx));
  cr_assert_eq(t->storage->backend, cpu1);
  dsp_tensor_unref(t);
  dsp_ctx_free(ctx);
  dsp_cpu_backend_free(cpu1);
}

Test(shape, numel_rejects_overflow_and_negative_sizes) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta m = {DSP_F32, 2, {INT64_MAX / 2, 3}};
  int64_t n;
  cr_assert_eq(dsp_meta_numel(ctx, &m, &n), DISPATCH_EOVERFLOW);
  m.shape[0] = -1;
  cr_assert_eq(dsp_meta_numel(ctx, &m, &n), DISPATCH_ESHAPE);
  m = (dsp_meta){DSP_F64, 3, {2, 3, 4}};
  cr_assert_eq(dsp_meta_numel(ctx, &m, &n), 0);
  cr_assert_eq(n, 24);
  m.ndim = 9;
  cr_assert_eq(dsp_meta_numel(ctx, &m, &n), DISPATCH_EDIM);
  m = (dsp_meta){(dsp_dtype)7, 1, {2}};
  cr_assert_eq(dsp_meta_numel(ctx, &m, &n), DISPATCH_EDTYPE);
  dsp_ctx_free(ctx);
}

Test(shape, broadcast_follows_numpy) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta a = {DSP_F32, 3, {4, 1, 3}}, b = {DSP_F32, 2, {5, 1}}, r;
  cr_assert_eq(dsp_broadcast_shapes(ctx, "add", &a, &b, &r), 0);
  cr_assert_eq(r.ndim, 3);
  cr_assert_eq(r.shape[0], 4);
  cr_assert_eq(r.shape[1], 5);
  cr_assert_eq(r.shape[2], 3);
  b = (dsp_meta){DSP_F32, 1, {2}};
  cr_assert_eq(dsp_broadcast_shapes(ctx, "add", &a, &b, &r), DISPATCH_ESHAPE);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx),
                   "add: shapes [4, 1, 3] and [2] do not broadcast");
  dsp_ctx_free(ctx);
}

Test(tensor, from_data_checks_byte_count_and_alias_shares_storage) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  float v[6] = {1, 2, 3, 4, 5, 6};
  dsp_meta m = {DSP_F32, 2, {2, 3}};
  dsp_tensor *t, *al;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, v, 5 * sizeof(float), &t),
               DISPATCH_EINVAL);
  cr_assert_null(t);
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, v, sizeof v, &t), 0);
  dsp_meta m2 = {DSP_F32, 1, {6}};
  cr_assert_eq(dsp_tensor_alias(ctx, t, &m2, &al), 0);
  cr_assert_eq(dsp_tensor_data(al), dsp_tensor_data(t));
  dsp_tensor_unref(t);
  cr_assert_float_eq(((float *)dsp_tensor_data(al))[5], 6.0f, 0);
  dsp_tensor_unref(al);
  dsp_ctx_free(ctx);
}

Test(ops, lookup_refuses_unknown_codes) {
  cr_assert_null(dsp_op_lookup(-1));
  cr_assert_null(dsp_op_lookup(9999));
  cr_assert_str_eq(dsp_op_lookup(DSP_OP_MATMUL)->name, "matmul");
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta in[1] = {{DSP_F32, 1, {3}}}, out;
  dsp_attrs a = dsp_attrs_none();
  cr_assert_eq(dsp_op_infer(ctx, (dsp_opcode)9999, in, 1, &a, &out),
               DISPATCH_EUNSUPPORTED);
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_ADD, in, 1, &a, &out), DISPATCH_EINVAL);
  dsp_ctx_free(ctx);
}

Test(ops, too_many_attribute_ints_are_refused_not_truncated) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  int64_t v[DSP_MAX_ATTR_INTS + 1];
  for (int i = 0; i <= DSP_MAX_ATTR_INTS; i++) v[i] = 1;
  dsp_attrs a = dsp_attrs_ints(DSP_MAX_ATTR_INTS + 1, v);
  cr_assert_eq(a.n_ints, DSP_MAX_ATTR_INTS + 1);
  dsp_meta in[1] = {{DSP_F32, 1, {1}}}, out;
  cr_assert_eq(dsp_op_infer(ctx, DSP_OP_RESHAPE, in, 1, &a, &out),
               DISPATCH_EINVAL);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "attribute") != NULL, "%s",
            dsp_ctx_errmsg(ctx));
  dsp_ctx_free(ctx);
}
