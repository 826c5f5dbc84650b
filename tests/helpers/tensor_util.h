/* Test helpers: make small tensors from C arrays and compare contents.
 *
 * Constructors return a new tensor (the caller unrefs it) or NULL when the
 * tensor could not be made (bad shape, out of memory); shape may be NULL
 * when ndim is 0. The tu_assert_* helpers fail the running Criterion test
 * (with the element index in the message) when a value differs; a NULL
 * tensor, a dtype different from the helper's, or a numel != n fails too. */
#ifndef TENSOR_UTIL_H
#define TENSOR_UTIL_H

#include <stdint.h>

#include "dsp.h"

dsp_tensor *tu_f32(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const float *data);
dsp_tensor *tu_f64(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const double *data);
dsp_tensor *tu_i64(dsp_ctx *ctx, int ndim, const int64_t *shape,
                   const int64_t *data);
/* data holds 0/1 bytes */
dsp_tensor *tu_bool(dsp_ctx *ctx, int ndim, const int64_t *shape,
                    const uint8_t *data);

/* Element i of an f32 or f64 tensor as a double, and its store (any
 * other dtype is read and written as f64). */
double tu_at(const dsp_tensor *t, int64_t i);
void tu_set(dsp_tensor *t, int64_t i, double v);

/* |got - expect| <= tol elementwise (NaN matches NaN). */
void tu_assert_f32(const dsp_tensor *t, const float *expect, int n, float tol);
void tu_assert_f64(const dsp_tensor *t, const double *expect, int n,
                   double tol);
void tu_assert_i64(const dsp_tensor *t, const int64_t *expect, int n);
void tu_assert_bool(const dsp_tensor *t, const uint8_t *expect, int n);
/* t has exactly this rank and these sizes. */
void tu_assert_shape(const dsp_tensor *t, int ndim, const int64_t *shape);

/* Runs op with 1..3 inputs and returns the output, failing the test with
 * the ctx's message if the op fails. */
dsp_tensor *tu_run(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n_in,
                   dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2);

/* t's gradient in g (a new reference), failing the test if it has none. */
dsp_tensor *tu_grad(dsp_ctx *ctx, const dsp_grads *g, const dsp_tensor *t);

/* The attributes DSP_OP_ATTENTION (and its backward op) read: ints
 * {causal, has_mask}, floats {scale} (0 = 1/sqrt(d)). */
dsp_attrs tu_attn_attrs(int causal, int has_mask, double scale);

/* rc must equal code and dsp_ctx_errmsg(ctx) must contain substr. */
void tu_assert_err(dsp_ctx *ctx, int rc, int code, const char *substr);

/* Runs op with 0..3 inputs expecting it to fail with code and a message
 * containing substr; also checks no output was returned. */
void tu_run_fail(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int n_in,
                 dsp_tensor *x0, dsp_tensor *x1, dsp_tensor *x2, int code,
                 const char *substr);

#endif
