/* Internal to libdispatch-client: the C signature of each signature kind
 * of the op table (the sixth column of DSP_OP_MAP, common/dsp.h), so that
 * the client functions of the table's rows are declared
 * (client/dispatch_backward.h) and defined (client/run.c) from the rows
 * themselves. The exported ones are also declared by hand, with their doc
 * comments, in client/include/dispatch_client.h; run.c includes that
 * header, so a row whose signature disagrees with its declaration there
 * does not compile.
 *
 * DISPATCH__SIG_<kind>(name) is the function's head without the `;`.
 * Parameter names are the ones run.c's bodies use. */
#ifndef DISPATCH_OP_SIGS_H
#define DISPATCH_OP_SIGS_H

#include <stdint.h>

#include "dispatch_client.h"

#define DISPATCH__SIG_UNARY(name) \
  int dispatch_##name(dispatch_tensor *x, dispatch_tensor **out)
#define DISPATCH__SIG_BINARY(name)                               \
  int dispatch_##name(dispatch_tensor *a, dispatch_tensor *b, \
                      dispatch_tensor **out)
#define DISPATCH__SIG_TERNARY(name)                              \
  int dispatch_##name(dispatch_tensor *a, dispatch_tensor *b, \
                      dispatch_tensor *c, dispatch_tensor **out)
#define DISPATCH__SIG_SCALAR(name) \
  int dispatch_##name(dispatch_tensor *x, double s, dispatch_tensor **out)
#define DISPATCH__SIG_RED(name)                                       \
  int dispatch_##name(dispatch_tensor *x, int ndims, const int64_t *dims, \
                      int keepdim, dispatch_tensor **out)
#define DISPATCH__SIG_SHAPEV(name)                                   \
  int dispatch_##name(dispatch_tensor *x, int ndim, const int64_t *v, \
                      dispatch_tensor **out)
#define DISPATCH__SIG_DIM(name) \
  int dispatch_##name(dispatch_tensor *x, int64_t dim, dispatch_tensor **out)
#define DISPATCH__SIG_BINARY_DIM(name)                                   \
  int dispatch_##name(dispatch_tensor *a, dispatch_tensor *b, int64_t dim, \
                      dispatch_tensor **out)
#define DISPATCH__SIG_MANY(name)                                   \
  int dispatch_##name(dispatch_tensor *const *xs, int n, int64_t dim, \
                      dispatch_tensor **out)
#define DISPATCH__SIG_POOL(name)                                         \
  int dispatch_##name(dispatch_tensor *x, int64_t kh, int64_t kw,         \
                      int64_t stride_h, int64_t stride_w, int64_t pad_h, \
                      int64_t pad_w, dispatch_tensor **out)
#define DISPATCH__SIG_POOL_BWD(name)                                       \
  int dispatch_##name(dispatch_tensor *grad, dispatch_tensor *x, int64_t kh, \
                      int64_t kw, int64_t stride_h, int64_t stride_w,       \
                      int64_t pad_h, int64_t pad_w, dispatch_tensor **out)
#define DISPATCH__SIG_CONV_BWD(name)                                       \
  int dispatch_##name(dispatch_tensor *grad, dispatch_tensor *t,           \
                      int64_t stride_h, int64_t stride_w, int64_t pad_h,   \
                      int64_t pad_w, int64_t dil_h, int64_t dil_w,         \
                      const int64_t shape[4], dispatch_tensor **out)
#define DISPATCH__SIG_CREATE(name)                                       \
  int dispatch_##name(dispatch_device *dev, dispatch_dtype dtype, int ndim, \
                      const int64_t *shape, dispatch_tensor **out)
#define DISPATCH__SIG_RANDOM(name)                                       \
  int dispatch_##name(dispatch_device *dev, dispatch_dtype dtype, int ndim, \
                      const int64_t *shape, double f0, double f1,         \
                      uint64_t seed, dispatch_tensor **out)

/* The declaration of a row's function when it is a backward helper (api
 * BWD) whose signature is not HAND (those are declared by hand); nothing
 * for any other row. client/dispatch_backward.h expands the table with it. */
#define DISPATCH__DECL_BWD(api, sig, name) DISPATCH__DECL_BWD_##api(sig, name)
#define DISPATCH__DECL_BWD_BWD(sig, name) DISPATCH__PROTO_##sig(name)
#define DISPATCH__DECL_BWD_API(sig, name)
#define DISPATCH__DECL_BWD_NONE(sig, name)
#define DISPATCH__PROTO_HAND(name)
#define DISPATCH__PROTO_NONE(name)
#define DISPATCH__PROTO_UNARY(name) DISPATCH__SIG_UNARY(name);
#define DISPATCH__PROTO_BINARY(name) DISPATCH__SIG_BINARY(name);
#define DISPATCH__PROTO_TERNARY(name) DISPATCH__SIG_TERNARY(name);
#define DISPATCH__PROTO_SCALAR(name) DISPATCH__SIG_SCALAR(name);
#define DISPATCH__PROTO_RED(name) DISPATCH__SIG_RED(name);
#define DISPATCH__PROTO_SHAPEV(name) DISPATCH__SIG_SHAPEV(name);
#define DISPATCH__PROTO_DIM(name) DISPATCH__SIG_DIM(name);
#define DISPATCH__PROTO_BINARY_DIM(name) DISPATCH__SIG_BINARY_DIM(name);
#define DISPATCH__PROTO_MANY(name) DISPATCH__SIG_MANY(name);
#define DISPATCH__PROTO_POOL(name) DISPATCH__SIG_POOL(name);
#define DISPATCH__PROTO_POOL_BWD(name) DISPATCH__SIG_POOL_BWD(name);
#define DISPATCH__PROTO_CONV_BWD(name) DISPATCH__SIG_CONV_BWD(name);
#define DISPATCH__PROTO_CREATE(name) DISPATCH__SIG_CREATE(name);
#define DISPATCH__PROTO_RANDOM(name) DISPATCH__SIG_RANDOM(name);

#endif
