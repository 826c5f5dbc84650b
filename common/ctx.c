/* The per-context error detail buffer and grad mode. */
#include <stdarg.h>
#include <stdio.h>

#include "dsp_internal.h"

dsp_ctx *dsp_ctx_new(const dsp_backend *be) {
  if (!be) return NULL;
  dsp_ctx *ctx = dsp_calloc(1, sizeof *ctx);
  if (!ctx) return NULL;
  ctx->backend = ctx->home = be;
  ctx->grad_enabled = 1;
  atomic_init(&ctx->cancel, 0);
  return ctx;
}

void dsp_ctx_free(dsp_ctx *ctx) {
  if (!ctx) return;
  dsp_budget_unref(ctx->budget);
  dsp_free(ctx);
}

const char *dsp_ctx_errmsg(const dsp_ctx *ctx) { return ctx ? ctx->err : ""; }

const dsp_backend *dsp_ctx_backend(const dsp_ctx *ctx) { return ctx->backend; }

void dsp_ctx_set_backend(dsp_ctx *ctx, const dsp_backend *be) {
  ctx->backend = be ? be : ctx->home;
}

int dsp_seterr(dsp_ctx *ctx, int code, const char *fmt, ...) {
  if (ctx) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
    va_end(ap);
  }
  return code;
}

void dsp_clearerr(dsp_ctx *ctx) {
  if (ctx) ctx->err[0] = '\0';
}

int dsp_set_grad_enabled(dsp_ctx *ctx, int enabled) {
  int prev = ctx->grad_enabled;
  ctx->grad_enabled = enabled != 0;
  return prev;
}

int dsp_grad_enabled(const dsp_ctx *ctx) { return ctx->grad_enabled; }

void dsp_ctx_set_max_elements(dsp_ctx *ctx, int64_t n) {
  ctx->max_span = n > 0 ? n : 0;
}

/* The flag is only ever raised: a ctx whose work was cancelled belongs to a
 * session that is going away, so no op on it should start again. */
void dsp_ctx_cancel(dsp_ctx *ctx) {
  if (ctx) atomic_store_explicit(&ctx->cancel, 1, memory_order_relaxed);
}

int dsp_ctx_cancelled(const dsp_ctx *ctx) {
  return ctx && atomic_load_explicit(&ctx->cancel, memory_order_relaxed);
}

void dsp_ctx_set_max_op_cost(dsp_ctx *ctx, uint64_t max_cost) {
  ctx->max_op_cost = max_cost;
}

uint64_t dsp_ctx_work(const dsp_ctx *ctx) { return ctx->work; }
