/* dispatch error codes: one table generates the enum, the name and the
 * message functions. Codes are part of the wire protocol and of the public
 * API: never renumber one, only append.
 *
 * This header is public (installed beside dispatch_client.h, which
 * includes it) and needs only dispatch_version.h; the server and common/
 * include it from here too, so there is one copy of the table. */
#ifndef DISPATCH_ERRORS_H
#define DISPATCH_ERRORS_H

#include "dispatch_version.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DISPATCH_ERRNO_MAP(X)                                                \
  X(OK, 0, "success")                                                        \
  X(ENOMEM, -1, "out of memory")                                             \
  X(EINVAL, -2, "invalid argument")                                          \
  X(ESHAPE, -3, "shape mismatch")                                            \
  X(EDTYPE, -4, "unsupported or mismatched dtype")                           \
  X(EDIM, -5, "dimension out of range")                                      \
  X(EOVERFLOW, -6, "size arithmetic overflows")                              \
  X(EDOUBLEWRAP, -7, "autodiff should not wrap an autodiff tensor")          \
  X(ENOTTRACKED, -8, "tensor is not tracked for autodiff")                   \
  X(ENOTSCALAR, -9, "backward needs a one-element tensor")                   \
  X(ENOGRAD, -10, "backward did not reach this tensor")                      \
  X(EGRAPHFREED, -11, "graph was released by an earlier backward")           \
  X(EUNSUPPORTED, -12, "operation not supported")                            \
  X(EINDEX, -13, "index out of range")                                       \
  X(EPROTO, -14, "protocol error")                                           \
  X(EVERSION, -15, "protocol version mismatch")                              \
  X(EAUTH, -16, "authentication failed")                                     \
  X(EQUOTA, -17, "quota exceeded")                                           \
  X(ENOID, -18, "unknown id")                                                \
  X(EIDINUSE, -19, "id already in use")                                      \
  X(ECONN, -20, "connection lost")                                           \
  X(ETIMEDOUT, -21, "timed out")                                             \
  X(EDEVICE, -22, "tensors live on different devices")                       \
  X(EPOISONED, -23, "tensor poisoned by an earlier failed request")          \
  X(ETOOLARGE, -24, "message or tensor too large")                           \
  X(ELIMIT, -25, "server limit exceeded")                                    \
  X(ETLS, -26, "TLS error")                                                  \
  X(EIO, -27, "I/O error")                                                   \
  X(EINTERNAL, -28, "internal error")                                        \
  X(ENOTREMOTE, -29, "operation needs a remote tensor")                      \
  X(EKIND, -30, "wrong dispatch kind for this operation")                   \
  X(ECANCELED, -31, "cancelled: the session closed or the server is stopping") \
  X(ESHUTDOWN, -32, "server is shutting down")                              \
  X(ESESSION, -33, "session expired or unknown: it cannot be resumed")     \
  X(EBUSY, -34, "device in use by another thread")                        \
  X(ECAPABILITY, -37, "transfer capability unknown, expired, used or revoked") \
  X(EPEER, -38, "peer server unknown, unreachable or refused the transfer") \
  X(EGROUP, -40, "the server group failed, timed out or disagreed")

typedef enum dispatch_errno {
#define DISPATCH_ERRNO_ENUM_(name, code, msg) DISPATCH_##name = (code),
  DISPATCH_ERRNO_MAP(DISPATCH_ERRNO_ENUM_)
#undef DISPATCH_ERRNO_ENUM_
} dispatch_errno;

/* Returns the constant name of an error code ("DISPATCH_ESHAPE"), or
 * "DISPATCH_EUNKNOWN". The string is static; the caller owns nothing. */
DISPATCH_API
const char *dispatch_err_name(int code);

/* Returns the generic message of an error code. The string is static. */
DISPATCH_API
const char *dispatch_strerror(int code);

#ifdef __cplusplus
}
#endif

#endif
