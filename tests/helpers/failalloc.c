/* Failing, counting allocator for the out-of-memory tests. */
#include "failalloc.h"

#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "dsp.h"

static atomic_long g_count, g_live, g_failed;
static long g_fail_at;

/* True when this attempt is the one chosen to fail. */
static int should_fail(void) {
  long n = atomic_fetch_add(&g_count, 1) + 1;
  if (g_fail_at > 0 && n == g_fail_at) {
    atomic_fetch_add(&g_failed, 1);
    return 1;
  }
  return 0;
}

static void *fa_malloc(size_t size, void *ud) {
  (void)ud;
  if (should_fail()) return NULL;
  void *p = malloc(size);
  if (p) atomic_fetch_add(&g_live, 1);
  return p;
}

static void *fa_realloc(void *ptr, size_t size, void *ud) {
  (void)ud;
  if (should_fail()) return NULL;
  void *p = realloc(ptr, size);
  if (p && !ptr) atomic_fetch_add(&g_live, 1);
  return p;
}

static void fa_free(void *ptr, void *ud) {
  (void)ud;
  if (!ptr) return;
  atomic_fetch_sub(&g_live, 1);
  free(ptr);
}

void failalloc_install(long fail_at) {
  atomic_store(&g_count, 0);
  atomic_store(&g_live, 0);
  atomic_store(&g_failed, 0);
  g_fail_at = fail_at;
  dsp_allocator a = {fa_malloc, fa_realloc, fa_free, NULL};
  dsp_set_allocator(&a);
}

void failalloc_remove(void) { dsp_set_allocator(NULL); }
long failalloc_count(void) { return atomic_load(&g_count); }
long failalloc_live(void) { return atomic_load(&g_live); }
long failalloc_failed(void) { return atomic_load(&g_failed); }

int failalloc_walk_op(int op, int n_in, const dsp_meta *in,
                      const dsp_attrs *a) {
  int enomem = 0;
  for (long k = 1;; k++) {
    failalloc_install(k);
    dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
    dsp_tensor *t[DSP_MAX_INPUTS] = {0}, *out = NULL;
    int rc = ctx ? 0 : DISPATCH_ENOMEM;
    for (int i = 0; i < n_in && rc == 0; i++)
      rc = dsp_tensor_new(ctx, &in[i], &t[i]);
    if (rc == 0) rc = dsp_op(ctx, (dsp_opcode)op, t, n_in, a, &out);
    int done = rc == 0;
    if (!done) {
      cr_assert_eq(rc, DISPATCH_ENOMEM, "%s, allocation %ld failing: %s",
                   dsp_op_lookup(op)->name, k, dispatch_err_name(rc));
      cr_assert_null(out);
      enomem++;
    }
    dsp_tensor_unref(out);
    for (int i = 0; i < n_in; i++) dsp_tensor_unref(t[i]);
    dsp_ctx_free(ctx);
    long live = failalloc_live();
    failalloc_remove();
    cr_assert_eq(live, 0, "%s, allocation %ld failing: %ld blocks leaked",
                 dsp_op_lookup(op)->name, k, live);
    if (done) return enomem;
  }
}
