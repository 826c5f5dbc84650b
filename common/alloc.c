/* The one replaceable allocator every layer allocates through. */
#include <stdlib.h>
#include <string.h>

#include "dsp.h"

static void *default_malloc(size_t size, void *ud) {
  (void)ud;
  return malloc(size);
}
static void *default_realloc(void *p, size_t size, void *ud) {
  (void)ud;
  return realloc(p, size);
}
static void default_free(void *p, void *ud) {
  (void)ud;
  free(p);
}

static dsp_allocator g_alloc = {default_malloc, default_realloc,
                                default_free, NULL};

void dsp_set_allocator(const dsp_allocator *a) {
  if (a == NULL) {
    g_alloc = (dsp_allocator){default_malloc, default_realloc, default_free,
                              NULL};
  } else {
    g_alloc = *a;
  }
}

void *dsp_malloc(size_t size) {
  return g_alloc.malloc_fn(size ? size : 1, g_alloc.ud);
}

void *dsp_calloc(size_t n, size_t size) {
  if (size != 0 && n > SIZE_MAX / size) return NULL;
  void *p = dsp_malloc(n * size);
  if (p) memset(p, 0, n * size);
  return p;
}

void *dsp_realloc(void *ptr, size_t size) {
  return g_alloc.realloc_fn(ptr, size ? size : 1, g_alloc.ud);
}

void dsp_free(void *ptr) {
  if (ptr) g_alloc.free_fn(ptr, g_alloc.ud);
}

char *dsp_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = dsp_malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}
