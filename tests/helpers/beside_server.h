/* Test helper (Criterion suites): files of the build tree, found beside
 * the dispatch-server that $DISPATCH_SERVER_BIN names (make test sets it
 * to build/dispatch-server). A suite without it fails rather than skips. */
#ifndef BESIDE_SERVER_H
#define BESIDE_SERVER_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline const char *server_bin(void) {
  const char *b = getenv("DISPATCH_SERVER_BIN");
  if (!b || !*b)
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs "
                   "dispatch-server (make test sets it); failing rather "
                   "than skipping");
  return b;
}

/* out = the folder of dispatch-server + "/" + name (build/NAME) */
static inline void beside_server(const char *name, char *out, size_t len) {
  const char *b = server_bin();
  const char *slash = strrchr(b, '/');
  int n = slash ? (int)(slash - b) : 1;
  snprintf(out, len, "%.*s/%s", n, slash ? b : ".", name);
}

#endif
