/* Asserting a libdispatch-client call in a Criterion test: on failure the
 * message names the call, the code and the device's detail message. Also
 * the suites' shared steps for their dispatch-server: find it (a suite
 * that cannot fails, never skips), start it, open a device on it. */
#ifndef TESTS_CLIENT_CHECK_H
#define TESTS_CLIENT_CHECK_H

#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "helpers/server_proc.h"

#define OK(dev, call)                                                  \
  do {                                                                 \
    int rc_ = (call);                                                  \
    cr_assert_eq(rc_, 0, "%s: %s: %s", #call, dispatch_err_name(rc_),  \
                 dispatch_device_errmsg(dev));                         \
  } while (0)

/* DISPATCH_SERVER_BIN; fails the test when it is not set. */
static inline const char *check_server_bin(void) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin)
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs "
                   "dispatch-server (make test sets it); failing rather "
                   "than skipping");
  return bin;
}

/* out = the folder of dispatch-server + "/" + name: a file of the build
 * tree beside it (build/NAME) */
static inline void beside_server(const char *name, char *out, size_t len) {
  const char *b = check_server_bin();
  const char *slash = strrchr(b, '/');
  int n = slash ? (int)(slash - b) : 1;
  snprintf(out, len, "%.*s/%s", n, slash ? b : ".", name);
}

/* Starts dispatch-server into s with args (sp_start), or fails. */
static inline void check_server_start(sp_server *s, const char *const *args) {
  check_server_bin();
  cr_assert_eq(sp_start(s, args), 0, "dispatch-server did not start");
}

/* Opens "local" (remote 0) or s's server on 127.0.0.1, or fails. */
static inline dispatch_device *check_open(const sp_server *s, int remote) {
  char spec[64], msg[256] = "";
  if (remote)
    snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", s->port);
  else
    snprintf(spec, sizeof spec, "local");
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

/* a and b (any devices, both read) have the same dtype, shape and bytes;
 * what names the pair in the failure message. */
static inline void check_same(dispatch_tensor *a, dispatch_tensor *b,
                              const char *what) {
  cr_assert_not_null(a, "%s: missing", what);
  cr_assert_not_null(b, "%s: missing", what);
  cr_assert_eq(dispatch_tensor_dtype(a), dispatch_tensor_dtype(b), "%s dtype",
               what);
  cr_assert_eq(dispatch_tensor_ndim(a), dispatch_tensor_ndim(b), "%s rank",
               what);
  for (int d = 0; d < dispatch_tensor_ndim(a); d++)
    cr_assert_eq(dispatch_tensor_shape(a)[d], dispatch_tensor_shape(b)[d],
                 "%s dim %d", what, d);
  size_t n = dispatch_tensor_nbytes(a);
  cr_assert_eq(n, dispatch_tensor_nbytes(b), "%s nbytes", what);
  void *pa = malloc(n ? n : 1), *pb = malloc(n ? n : 1);
  cr_assert(pa && pb);
  OK(dispatch_tensor_device(a), dispatch_tensor_read(a, pa, n));
  OK(dispatch_tensor_device(b), dispatch_tensor_read(b, pb, n));
  cr_assert_eq(memcmp(pa, pb, n), 0, "%s: bytes differ", what);
  free(pa);
  free(pb);
}

#endif
