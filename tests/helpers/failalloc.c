/* Failing, counting allocator for the out-of-memory tests. */
#include "failalloc.h"

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
