/* libdispatch-client: the one public header.
 *
 * Tensors that look the same whether they live in this process (LOCAL) or
 * on a dispatch-server across TCP (REMOTE), with reverse-mode autodiff
 * (AUTODIFF wraps exactly one LOCAL or REMOTE tensor) and optimizers.
 *
 * Conventions (they hold for every function below unless it says otherwise)
 * - Functions that can fail return 0 or a negative DISPATCH_E* code
 *   (dispatch_errors.h, included below). The device keeps the detail of its
 *   last error (dispatch_device_errmsg) and, until the caller clears it,
 *   its FIRST error (dispatch_device_error). Nothing aborts on a caller's
 *   mistake.
 * - Straight-line code: a call given a NULL input (the *out of a call that
 *   failed) returns the device's first error, code and message, and a call
 *   given an input known to be poisoned returns the error that poisoned it;
 *   neither does any work. So a forward pass can be a run of calls with one
 *   check at the end (dispatch_device_error), as examples/first_program.c
 *   does. Calls whose inputs are all valid run as usual, error or not.
 * - A function that gives back a tensor through `dispatch_tensor **out`
 *   hands the caller ONE reference, the same with or without a scope: the
 *   caller may always drop it with dispatch_tensor_free; when a scope of
 *   the tensor's device was open at the call, the scope drops it at its
 *   end if the caller has not (see scopes). On failure *out is NULL and
 *   nothing leaks. Input tensors are borrowed: the call never consumes them.
 * - Handles are opaque. A device and everything on it is used from one
 *   thread at a time; distinct devices may be used from distinct threads.
 *   Devices are not thread-safe, and the library checks it rather than
 *   locks: a call (one that returns an error code) entered from a second
 *   thread while a call on the same device, or on a peer of it
 *   (dispatch_device_open_peer), is in flight fails at once with
 *   DISPATCH_EBUSY and changes nothing; that thread reads the message
 *   with dispatch_device_errmsg. Calls without an error code (frees,
 *   close, the queries) are not checked: give each thread its own device.
 * - Op functions take tensors of one device; mixing devices gives
 *   DISPATCH_EDEVICE (use dispatch_to_device to copy explicitly).
 * - Every op works on every kind with the same signature: LOCAL runs now
 *   on the CPU backend; REMOTE infers the output's shape here (so shape
 *   errors are immediate) and queues the op for the server without waiting;
 *   an op with an AUTODIFF input gives an AUTODIFF output.
 * - REMOTE errors found by the server after an op was queued are deferred:
 *   they surface at the next call that waits (read, backward, sync, stats)
 *   with the server's message, and the failed op's output is poisoned
 *   (dispatch_tensor_status). In sync mode (dispatch_options.sync, env
 *   DISPATCH_SYNC=1) every call waits instead, so the error comes back at
 *   the call that caused it, as on LOCAL.
 * - Attribute conventions (dims may be negative, counted from the end)
 *   follow the op table of the dispatch core; each function below restates
 *   what it needs.
 */
#ifndef DISPATCH_CLIENT_H
#define DISPATCH_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch_errors.h"
#include "dispatch_version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ */
/* version                                                             */

/* DISPATCH_VERSION, DISPATCH_VERSION_MAJOR/MINOR/PATCH/HEX (the header
 * compiled against) come from dispatch_version.h. */

/* The version of the linked library, e.g. "0.1.0" (static string). */
DISPATCH_API
const char *dispatch_version(void);

/* ------------------------------------------------------------------ */
/* types                                                               */

#define DISPATCH_MAX_DIMS 8   /* highest rank of a tensor */
#define DISPATCH_MAX_INPUTS 64 /* most tensors cat/stack take */

/* Element types; the values are those of the wire protocol. The half
 * types F16 and BF16 take 2 bytes an element (little-endian, like the
 * rest) and are computed in f32, never accumulated in half; a REMOTE
 * device needs a server of protocol 1.7 for them (an older one is refused
 * with DISPATCH_EDTYPE before anything is sent). dispatch_convert turns
 * them into f32 and back in the caller's memory. */
typedef enum dispatch_dtype {
  DISPATCH_F32 = 0,
  DISPATCH_F64 = 1,
  DISPATCH_I64 = 2,
  DISPATCH_BOOL = 3, /* one byte per element, 0 or 1 */
  DISPATCH_F16 = 4,  /* IEEE binary16, 2 bytes (numpy's float16) */
  DISPATCH_BF16 = 5  /* bfloat16: the top 16 bits of an f32 */
} dispatch_dtype;

/* What a tensor handle is. AUTODIFF always wraps exactly one LOCAL or
 * REMOTE tensor (dispatch_inner), never another AUTODIFF. */
typedef enum dispatch_tensor_kind {
  DISPATCH_KIND_LOCAL = 1,
  DISPATCH_KIND_REMOTE = 2,
  DISPATCH_KIND_AUTODIFF = 3
} dispatch_tensor_kind;

typedef struct dispatch_device dispatch_device;
typedef struct dispatch_tensor dispatch_tensor;
typedef struct dispatch_grads dispatch_grads;
typedef struct dispatch_optim dispatch_optim;

/* Options for dispatch_device_open; start from dispatch_options_init.
 * Strings are copied by dispatch_device_open; the caller keeps its own.
 *
 * size is the struct's size as the caller was compiled (set by
 * dispatch_options_init / DISPATCH_OPTIONS_INIT). The library reads only
 * the fields that lie within it, so a program built against an older
 * header, whose struct ends earlier, runs on a newer library unchanged:
 * the fields it does not have take their defaults. New fields are only
 * ever appended. A size smaller than the size field itself (an options
 * struct never initialised) is DISPATCH_EINVAL. */
typedef struct dispatch_options {
  size_t size;             /* sizeof(dispatch_options) of the caller */
  const char *token;       /* hello token; NULL: env DISPATCH_TOKEN or "" */
  const char *client_name; /* sent in hello; NULL: "libdispatch-client" */
  int timeout_ms;          /* connect, send and each wait for a reply
                              (see dispatch_device_set_timeout); 0: env
                              DISPATCH_TIMEOUT_MS ("0": no bound) or
                              30000 */
  /* (A wait for a reply first polls the socket for DISPATCH_SPIN_US
   * microseconds, default 50, 0 off, before it sleeps: a quick reply then
   * costs no wake-up of a sleeping thread.) */
  /* tls:// only */
  const char *ca_file;     /* PEM CA(s) that signed the server's certificate;
                              NULL: env DISPATCH_TLS_CA, else the system
                              trust store */
  const char *cert_file;   /* client certificate for mutual TLS (PEM chain);
                              NULL: env DISPATCH_TLS_CERT, else none */
  const char *key_file;    /* its private key; NULL: env DISPATCH_TLS_KEY,
                              else cert_file */
  const char *server_name; /* name the server's certificate must carry (and
                              SNI); NULL: env DISPATCH_TLS_SERVER_NAME, else
                              HOST of the spec. Always verified. */
  /* session resume (appended): after a dropped connection the library
   * reconnects with exponential backoff and resumes the same session
   * (tensors, tape, gradients, optimizer state), each request run once */
  int no_resume;           /* 1: a dropped connection ends the session;
                              0: env DISPATCH_RESUME=0 also turns it off */
  int resume_timeout_ms;   /* total time reconnecting may take; 0: env
                              DISPATCH_RESUME_TIMEOUT_MS, else timeout_ms;
                              never past the server's --session-grace */
  /* (appended) sync mode, like CUDA_LAUNCH_BLOCKING: every call that
   * sends a request (an op, an upload, autodiff, grad, backward, a step)
   * waits for the server's answer, so an error the server finds is
   * returned by the call that caused it, naming the op, with *out NULL,
   * as on a LOCAL device; slower (a round trip per call), for debugging */
  int sync;                /* 1: on; 0: env DISPATCH_SYNC=1 turns it on */
} dispatch_options;

/* The defaults (everything NULL/0) with size set, for an initialiser:
 *   dispatch_options o = DISPATCH_OPTIONS_INIT; */
#define DISPATCH_OPTIONS_INIT \
  {sizeof(dispatch_options), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* Counters of one device, filled by dispatch_device_stats.
 *
 * size is the struct's size as the caller was compiled: declare it with
 * DISPATCH_STATS_INIT (or set size = sizeof(dispatch_stats)). The library
 * writes only the fields that lie within size and never past it, so a
 * program built against an older, shorter struct runs on a newer library
 * that knows more counters. New counters are only ever appended.
 *
 * Session counters (REMOTE: what the server holds for this session;
 * LOCAL: the same counts kept by this library): */
typedef struct dispatch_stats {
  size_t size;              /* sizeof(dispatch_stats) of the caller */
  uint64_t tensors;         /* live tensors */
  uint64_t bytes;           /* their bytes */
  uint64_t ops;             /* ops run */
  uint64_t errors;          /* failed requests */
  uint64_t grads;           /* live gradient containers */
  /* REMOTE only (0 on LOCAL): what the session makes the server hold,
   * in all (tensors named or not, the tape, gradients, kernel scratch,
   * ids, uploads being read), and the server's --max-session-bytes */
  uint64_t held_bytes;
  uint64_t session_limit;   /* 0: no limit */
  uint64_t queued_bytes;    /* decoded requests not yet run
                               (--max-queued-bytes) */
  uint64_t batches;         /* worker turns the session has had; each
                               runs every queued request up to a bound */
  /* REMOTE only (0 on LOCAL): server-wide */
  uint64_t sessions;        /* open sessions */
  uint64_t server_tensors;  /* tensors of every session */
  uint64_t server_bytes;    /* their bytes */
  uint64_t server_held_bytes; /* everything all sessions and their
                                 queues hold */
  uint64_t server_limit;    /* --max-memory (0: none) */
  uint64_t protocol_errors; /* malformed frames or requests refused */
  uint64_t limit_violations; /* requests refused by a limit */
  uint64_t devices;         /* devices of the server (LOCAL: 1); their
                               memory: dispatch_device_list */
  /* session resume (appended; LOCAL: 0): sessions of the server waiting
   * for a resume now, resumed so far, and freed because none came within
   * --session-grace */
  uint64_t sessions_detached;
  uint64_t sessions_resumed;
  uint64_t sessions_expired;
  uint64_t inline_ops;      /* (appended) of this session's ops, those the
                               server ran on its network thread
                               (--inline-cost); LOCAL: 0 */
  /* (appended) thread hand-offs inside the server for this session, each
   * at most one wake-up (LOCAL: 0): times the network thread handed its
   * requests to a worker (what one socket read decoded goes together),
   * and times a worker handed finished requests back (at a reply, or at
   * the end of its run of the session) */
  uint64_t handoffs;
  uint64_t returns;
} dispatch_stats;

/* A dispatch_stats ready for dispatch_device_stats:
 *   dispatch_stats st = DISPATCH_STATS_INIT; */
#define DISPATCH_STATS_INIT {sizeof(dispatch_stats), 0, 0, 0, 0, 0, 0, 0, 0, \
                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* ------------------------------------------------------------------ */
/* devices                                                             */

/* Fills *opts with the defaults (all zero/NULL) and sets opts->size to
 * sizeof(dispatch_options) as this header declares it. NULL is a no-op. */
DISPATCH_API
void dispatch_options_init(dispatch_options *opts);

/* Opens a device from a spec string:
 *   "local"            in-process CPU (also "local:cpu"; "local:cuda:N" is
 *                      DISPATCH_EUNSUPPORTED on a build without CUDA)
 *   "tcp://HOST:PORT"  a dispatch-server (connects and says hello now)
 *   "tls://HOST:PORT"  the same over TLS (1.2 at least, 1.3 preferred):
 *                      the server's certificate must chain to ca_file (or
 *                      the system store) and name server_name (or HOST; an
 *                      IP literal is matched against IP SANs); otherwise
 *                      DISPATCH_ETLS with the verify reason in errmsg
 *   "tcp://HOST:PORT/DEVICE", "tls://HOST:PORT/DEVICE"
 *                      the same, the session's tensors on the server's
 *                      device DEVICE ("cpu", "cpu:1", "cuda:0"; a bare
 *                      kind is its first device); without /DEVICE the
 *                      server's first device. A device the server does not
 *                      have: DISPATCH_EDEVICE naming the ones it has
 * spec NULL (or "") takes env DISPATCH_DEVICE, else "local", so an
 * unchanged program moves from local to remote. opts may be NULL (every
 * default); otherwise it is read up to opts->size (see dispatch_options)
 * and borrowed only for the call.
 * Returns 0 and the device in *out (caller owns it: dispatch_device_close),
 * or an error: DISPATCH_EINVAL (bad spec), DISPATCH_ECONN (cannot connect
 * or no hello reply within the timeout), DISPATCH_EAUTH (token missing or
 * wrong), DISPATCH_ETLS (handshake or certificate failure, including a
 * server that requires a client certificate), DISPATCH_EVERSION,
 * DISPATCH_ENOMEM.
 * On failure *out is NULL; when errmsg is not NULL, a detail message is
 * copied into errmsg[0..errmsg_len-1] (there is no device to hold it). */
DISPATCH_API
int dispatch_device_open(const char *spec, const dispatch_options *opts,
                         dispatch_device **out, char *errmsg,
                         size_t errmsg_len);

/* Closes a device: flushes queued frees, says bye to a server, and frees
 * every tensor, gradient container and optimizer still alive on it, so
 * every handle of this device becomes invalid. NULL is a no-op. */
DISPATCH_API
void dispatch_device_close(dispatch_device *dev);

/* DISPATCH_KIND_LOCAL or DISPATCH_KIND_REMOTE. */
DISPATCH_API
dispatch_tensor_kind dispatch_device_kind(const dispatch_device *dev);

/* The spec the device was opened with ("local", "tcp://..."); owned by
 * the device. */
DISPATCH_API
const char *dispatch_device_spec(const dispatch_device *dev);

/* Detail message of the device's last error ("" if none): the error the
 * latest failing call on it returned. Owned by the device, valid until its
 * next failing call. */
DISPATCH_API
const char *dispatch_device_errmsg(const dispatch_device *dev);

/* Code of the device's last error (0 if none). */
DISPATCH_API
int dispatch_device_errcode(const dispatch_device *dev);

/* The device's first error since it was opened or last cleared: its code
 * (0 if none; DISPATCH_EINVAL for a NULL dev), and in *msg (when msg is
 * not NULL) its message, "" if none. The message is owned by the device,
 * unchanged by later failures, valid until dispatch_device_clear_error or
 * dispatch_device_close. Later failures never replace it: a call given a
 * NULL input answers with it (a call with no argument naming a device, such
 * as dispatch_relu(NULL, &y), answers with the first error of the device
 * that last failed on this thread, and changes no device's errcode or
 * errmsg). REMOTE: an error the server finds becomes known at the next
 * wait (read, sync, backward, stats), which records it here like any
 * other: check after a wait. */
DISPATCH_API
int dispatch_device_error(const dispatch_device *dev, const char **msg);

/* Forgets the first error (dispatch_device_error gives 0 again), so the
 * next failure is the new first and a NULL input with none is again
 * DISPATCH_EINVAL "input N is NULL". The last error (errcode, errmsg) is
 * left as it is; poisoned tensors stay poisoned; a REMOTE error the server
 * has not reported yet still surfaces at the next wait. NULL is a no-op. */
DISPATCH_API
void dispatch_device_clear_error(dispatch_device *dev);

/* Waits until the server ran everything queued so far (LOCAL: returns 0 at
 * once). Returns the first deferred error of the session, if any, with the
 * server's message in dispatch_device_errmsg; DISPATCH_ETIMEDOUT when the
 * server is still at work past the timeout (dispatch_device_set_timeout:
 * call it again to wait on). */
DISPATCH_API
int dispatch_device_sync(dispatch_device *dev);

/* Fills the fields of *out that lie within out->size (see dispatch_stats)
 * with the device's counters; bytes past out->size are never touched.
 * REMOTE: one Stats round trip, which also surfaces a deferred error like
 * sync. DISPATCH_EINVAL when out->size does not cover the first counter
 * (a struct not declared with DISPATCH_STATS_INIT). The caller owns *out. */
DISPATCH_API
int dispatch_device_stats(dispatch_device *dev, dispatch_stats *out);

/* Changes the time bound of every later network wait (ms; 0: no bound).
 * A wait whose reply is not there within it, from a server that is alive
 * and working on the session (a 1.4 server says so with keepalives),
 * gives DISPATCH_ETIMEDOUT and changes nothing: the request stays queued
 * and still runs, and the next wait (a sync, a read, ...) waits for its
 * reply first; asked the same again (a sync, a read of the same tensor,
 * a replay of the same graph and inputs, with nothing sent in between)
 * the timed-out request's reply is that call's (another wait first takes
 * it and drops what it carried: a read's bytes, a replay's outputs; an
 * error it carried, the session's deferred error, is that wait's answer
 * and the wait's own request is not sent). A timeout is never the
 * device's first error (dispatch_device_error). A server that sends
 * nothing at all for that long is a lost connection: the library
 * reconnects and resumes the session (see dispatch_options), and when
 * that fails too the wait, and every later call on the device, gives
 * DISPATCH_ECONN. (An older server sends no keepalives: a reply not
 * there in time then gives DISPATCH_ECONN that way.) A server that stops
 * on purpose (SIGTERM: it answers what it had read, then says goodbye)
 * gives DISPATCH_ESHUTDOWN instead, the same way. 0, or DISPATCH_EINVAL
 * (negative). */
DISPATCH_API
int dispatch_device_set_timeout(dispatch_device *dev, int timeout_ms);

/* LOCAL: bounds the device's storage cache at `bytes`. Freed tensor
 * storage and headers are kept in lists by size class for the next tensor
 * of that size, so a loop that frees and makes the same shapes again
 * neither calls malloc nor faults in fresh pages; the oldest kept blocks
 * make room for newer ones. 0 turns the cache off and frees what it
 * holds. The default is env DISPATCH_LOCAL_CACHE at open (bytes, suffix
 * K, M or G allowed; 0: off), else 256 MiB. REMOTE: DISPATCH_EUNSUPPORTED
 * (a server sets its sessions' with dispatch-server --session-cache).
 * 0, DISPATCH_EINVAL (dev NULL) or DISPATCH_ENOMEM. */
DISPATCH_API
int dispatch_device_set_cache(dispatch_device *dev, uint64_t bytes);

/* ------------------------------------------------------------------ */
/* scopes: a training loop without a free per op                       */

/* Opens a scope on dev. Every tensor handed out on dev while it is the
 * innermost scope is registered in it: the scope drops the reference the
 * call handed out at its end, unless the caller dropped it first
 * (dispatch_tensor_free, which also takes the tensor out of the scope) or
 * moved it out (dispatch_keep). So code that frees what it does not return
 * is right with or without a scope, and code that frees nothing needs one.
 * Scopes nest. Returns 0 or DISPATCH_ENOMEM. */
DISPATCH_API
int dispatch_scope_begin(dispatch_device *dev);

/* Closes the innermost scope: drops the handed-out reference of every
 * tensor still registered in it; a tensor whose last reference goes is
 * freed (REMOTE: a Free is queued, batched with later traffic). References
 * taken with dispatch_tensor_ref are not touched. DISPATCH_EINVAL when no
 * scope is open. */
DISPATCH_API
int dispatch_scope_end(dispatch_device *dev);

/* Moves t out of its scope into the enclosing scope, or, from the
 * outermost scope, to the caller (who then frees it with
 * dispatch_tensor_free). A tensor in no scope is left as it is. Returns t
 * (NULL for NULL). */
DISPATCH_API
dispatch_tensor *dispatch_keep(dispatch_tensor *t);

/* ------------------------------------------------------------------ */
/* tensor handles                                                      */

/* +1 reference (the new one is the caller's, never a scope's); returns t. */
DISPATCH_API
dispatch_tensor *dispatch_tensor_ref(dispatch_tensor *t);

/* Drops one reference; at zero the tensor is freed (REMOTE: a Free for
 * its id is queued). A tensor still registered in a scope leaves it: the
 * reference dropped is the one the call handed out, which the scope would
 * otherwise drop at its end. So `y = f(x); k = dispatch_tensor_ref(y);
 * dispatch_tensor_free(y);` leaves the caller k, scope or not. NULL is a
 * no-op. */
DISPATCH_API
void dispatch_tensor_free(dispatch_tensor *t);

/* Type guards: the kind of t (DISPATCH_KIND_*). */
DISPATCH_API
dispatch_tensor_kind dispatch_kind(const dispatch_tensor *t);
/* 1 if t is AUTODIFF, else 0. */
DISPATCH_API
int dispatch_is_autodiff(const dispatch_tensor *t);
/* The LOCAL or REMOTE tensor an AUTODIFF tensor wraps (t itself for a
 * LOCAL or REMOTE tensor). No copy and no new reference: the result is
 * borrowed from t (dispatch_tensor_ref it to keep it longer). */
DISPATCH_API
dispatch_tensor *dispatch_inner(dispatch_tensor *t);
/* The device t lives on (borrowed). */
DISPATCH_API
dispatch_device *dispatch_tensor_device(const dispatch_tensor *t);

DISPATCH_API
int dispatch_tensor_ndim(const dispatch_tensor *t);
/* Pointer to the ndim sizes, owned by t. */
DISPATCH_API
const int64_t *dispatch_tensor_shape(const dispatch_tensor *t);
/* Size of dim i (negative counts from the end); -1 when out of range. */
DISPATCH_API
int64_t dispatch_tensor_dim(const dispatch_tensor *t, int i);
DISPATCH_API
dispatch_dtype dispatch_tensor_dtype(const dispatch_tensor *t);
DISPATCH_API
int64_t dispatch_tensor_numel(const dispatch_tensor *t);
DISPATCH_API
size_t dispatch_tensor_nbytes(const dispatch_tensor *t);
/* 0, or the error that poisoned t (a failed REMOTE op whose error the
 * client has learnt of at a wait). An op, read, backward, autodiff or
 * to_device given a poisoned tensor returns that error and its message at
 * once, without a round trip. */
DISPATCH_API
int dispatch_tensor_status(const dispatch_tensor *t);

/* ------------------------------------------------------------------ */
/* data in and out                                                     */

/* New tensor of dtype and shape[0..ndim-1] holding a copy of `data`;
 * nbytes must equal numel * element size (DISPATCH_EINVAL otherwise).
 * REMOTE: one Upload frame carrying the bytes, no wait. */
DISPATCH_API
int dispatch_tensor_from_data(dispatch_device *dev, dispatch_dtype dtype,
                              int ndim, const int64_t *shape,
                              const void *data, size_t nbytes,
                              dispatch_tensor **out);

/* Copies t's bytes (row-major) into buf; nbytes must equal
 * dispatch_tensor_nbytes(t). Works on every kind (AUTODIFF reads its
 * inner). REMOTE: one Read round trip; this is where deferred errors
 * surface. */
DISPATCH_API
int dispatch_tensor_read(dispatch_tensor *t, void *buf, size_t nbytes);

/* Converts n elements of src_dtype at src into dst_dtype at dst, in the
 * caller's memory (no device): F32, F64, F16 and BF16, either way. A
 * narrowing rounds once, to nearest with ties to even, from the source
 * value itself (f64 -> f16 is not f64 -> f32 -> f16); values past the
 * largest finite half become infinities, subnormals are kept, a NaN stays
 * a NaN of its sign (quiet). Widening is exact. These are the bits
 * dispatch_cast gives on every device. src and dst must not overlap
 * unless the dtypes are the same (then it is a memmove). Returns 0,
 * DISPATCH_EDTYPE for a dtype that is not one of the four (I64, BOOL),
 * DISPATCH_EINVAL for a NULL pointer with n > 0, DISPATCH_EOVERFLOW for
 * an n whose byte count cannot be a size_t. Nothing is allocated;
 * the caller owns both buffers (dst holds n elements of dst_dtype). */
DISPATCH_API
int dispatch_convert(void *dst, dispatch_dtype dst_dtype, const void *src,
                     dispatch_dtype src_dtype, size_t n);

/* Copies t to device dev as a new LOCAL or REMOTE tensor (never AUTODIFF;
 * wrap it again if needed). Same device: still a copy. When dev shares
 * t's session (dev is t's device or a peer of it, see
 * dispatch_device_open_peer) the server copies the bytes between its
 * devices itself, one request, nothing through this process. Between two
 * servers of protocol 1.7 whose source has a --name, the destination
 * pulls the bytes from the source itself (a single-use capability the
 * source grants, two small round trips here; README "Server-to-server
 * transfers"): a refusal or a dropped transfer returns its error
 * (DISPATCH_EPEER, DISPATCH_ECAPABILITY, DISPATCH_EQUOTA, DISPATCH_ECONN,
 * ...) and leaves no tensor. Otherwise the bytes are read here and
 * uploaded. */
DISPATCH_API
int dispatch_to_device(dispatch_tensor *t, dispatch_device *dev,
                       dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* creation (every device; REMOTE: the server creates, no bytes travel)  */

DISPATCH_API
int dispatch_zeros(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                   const int64_t *shape, dispatch_tensor **out);
DISPATCH_API
int dispatch_ones(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, dispatch_tensor **out);
DISPATCH_API
int dispatch_full(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, double value, dispatch_tensor **out);
/* 1-D [start, end) by step (step != 0). */
DISPATCH_API
int dispatch_arange(dispatch_device *dev, dispatch_dtype dtype, double start,
                    double end, double step, dispatch_tensor **out);
/* Uniform in [lo, hi) / normal(mean, std), float dtypes only. The same
 * seed gives the same bits on every device. */
DISPATCH_API
int dispatch_uniform(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                     const int64_t *shape, double lo, double hi,
                     uint64_t seed, dispatch_tensor **out);
DISPATCH_API
int dispatch_normal(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                    const int64_t *shape, double mean, double std,
                    uint64_t seed, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* elementwise                                                         */

/* Binary ops with numpy broadcasting; a and b of the same dtype. */
DISPATCH_API
int dispatch_add(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_sub(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_mul(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_div(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
/* maximum and minimum propagate a NaN (a's first). Their gradient, as
 * PyTorch's: where a == b each input gets half of it (g/2), elsewhere the
 * larger (maximum) or smaller (minimum) input gets all of it. */
DISPATCH_API
int dispatch_maximum(dispatch_tensor *a, dispatch_tensor *b,
                     dispatch_tensor **out);
DISPATCH_API
int dispatch_minimum(dispatch_tensor *a, dispatch_tensor *b,
                     dispatch_tensor **out);
/* Comparisons: broadcasting, same dtype, bool result. */
DISPATCH_API
int dispatch_eq(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_ne(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_lt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_le(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_gt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
DISPATCH_API
int dispatch_ge(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
/* mask (bool) ? a : b, three-way broadcast. */
DISPATCH_API
int dispatch_where(dispatch_tensor *mask, dispatch_tensor *a,
                   dispatch_tensor *b, dispatch_tensor **out);

/* With a scalar s: x+s, x-s, x*s, x/s, x^s, s-x, s/x. */
DISPATCH_API
int dispatch_add_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_sub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_mul_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_div_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_pow_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_rsub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
DISPATCH_API
int dispatch_rdiv_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);

/* Unary. gelu is the exact erf form; silu (swish) is x * sigmoid(x).
 * exp, log, sqrt, sigmoid, tanh, gelu and silu take f32 and f64 only. */
DISPATCH_API
int dispatch_neg(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_exp(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_log(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_sqrt(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_abs(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_sign(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_relu(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_sigmoid(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_tanh(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_gelu(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_silu(dispatch_tensor *x, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* reductions                                                          */

/* Reduce over dims[0..ndims-1] (ndims 0: every dim); keepdim != 0 keeps
 * the reduced dims with size 1. */
DISPATCH_API
int dispatch_sum(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
DISPATCH_API
int dispatch_mean(dispatch_tensor *x, int ndims, const int64_t *dims,
                  int keepdim, dispatch_tensor **out);
DISPATCH_API
int dispatch_max(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
/* ndims is 0 (flattened) or 1; i64 result; ties pick the first index. */
DISPATCH_API
int dispatch_argmax(dispatch_tensor *x, int ndims, const int64_t *dims,
                    int keepdim, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* shape                                                               */

/* New shape of the same numel; one size may be -1. */
DISPATCH_API
int dispatch_reshape(dispatch_tensor *x, int ndim, const int64_t *shape,
                     dispatch_tensor **out);
DISPATCH_API
int dispatch_permute(dispatch_tensor *x, int ndim, const int64_t *perm,
                     dispatch_tensor **out);
DISPATCH_API
int dispatch_transpose(dispatch_tensor *x, int64_t dim0, int64_t dim1,
                       dispatch_tensor **out);
/* Python-style x[start:end:step] along dim (step > 0, start/end clamped). */
DISPATCH_API
int dispatch_slice(dispatch_tensor *x, int64_t dim, int64_t start,
                   int64_t end, int64_t step, dispatch_tensor **out);
/* n tensors (1..DISPATCH_MAX_INPUTS) joined along an existing dim (cat)
 * or a new one (stack). */
DISPATCH_API
int dispatch_cat(dispatch_tensor *const *xs, int n, int64_t dim,
                 dispatch_tensor **out);
DISPATCH_API
int dispatch_stack(dispatch_tensor *const *xs, int n, int64_t dim,
                   dispatch_tensor **out);
DISPATCH_API
int dispatch_broadcast_to(dispatch_tensor *x, int ndim, const int64_t *shape,
                          dispatch_tensor **out);
/* Rows of x along dim picked by index (i64, 1-D). */
DISPATCH_API
int dispatch_index_select(dispatch_tensor *x, int64_t dim,
                          dispatch_tensor *index, dispatch_tensor **out);
DISPATCH_API
int dispatch_cast(dispatch_tensor *x, dispatch_dtype dtype,
                  dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* linear algebra                                                      */

/* numpy.matmul semantics (1-D..N-D, batch dims broadcast). */
DISPATCH_API
int dispatch_matmul(dispatch_tensor *a, dispatch_tensor *b,
                    dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* neural network                                                      */

DISPATCH_API
int dispatch_softmax(dispatch_tensor *x, int64_t dim, dispatch_tensor **out);
DISPATCH_API
int dispatch_log_softmax(dispatch_tensor *x, int64_t dim,
                         dispatch_tensor **out);
/* logits [N, C] float, labels [N] i64: mean loss over N (scalar). */
DISPATCH_API
int dispatch_cross_entropy(dispatch_tensor *logits, dispatch_tensor *labels,
                           dispatch_tensor **out);
/* mean((a - b)^2), same shapes, scalar result. */
DISPATCH_API
int dispatch_mse(dispatch_tensor *a, dispatch_tensor *b,
                 dispatch_tensor **out);
/* x [N, C, H, W], w [O, C, kh, kw], no bias (dispatch_conv2d_bias has
 * one). */
DISPATCH_API
int dispatch_conv2d(dispatch_tensor *x, dispatch_tensor *w, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w,
                    int64_t dil_h, int64_t dil_w, dispatch_tensor **out);
/* Pools on [N, C, H, W] with a kh x kw window; a stride of 0 is the
 * kernel size (PyTorch's default), padding at most half the kernel. avg
 * counts padding in the divisor (dispatch_avg_pool2d_ex can leave it
 * out). */
DISPATCH_API
int dispatch_max_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
DISPATCH_API
int dispatch_avg_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
/* Keeps element i iff uniform(seed)[i] >= p (0 <= p < 1) and scales the
 * kept ones by 1/(1-p). */
DISPATCH_API
int dispatch_dropout(dispatch_tensor *x, double p, uint64_t seed,
                     dispatch_tensor **out);

/* issue 23: embedding/norm */

/* No padding index for dispatch_embedding (PyTorch's padding_idx=None). */
#define DISPATCH_NO_INDEX INT64_MIN

/* Rows of a table: out = weight[idx], shape idx.shape + [D], for weight
 * [V, D] f32 or f64 and idx i64 of any shape (rank at most
 * DISPATCH_MAX_DIMS - 1; an empty idx gives an empty result). An index
 * outside [0, V) is DISPATCH_EINDEX naming it and its position (REMOTE: at
 * the next wait, as any op the server refuses). padding_idx is
 * DISPATCH_NO_INDEX or a row in [-V, V) (negative counts from the end;
 * else DISPATCH_EINVAL); that row is looked up as any other but gets no
 * gradient, as in PyTorch. The gradient of weight adds the grad rows of
 * repeated indices in index order (bit-identical run to run, LOCAL and
 * REMOTE); idx gets none. Borrows weight and idx; *out is a new
 * reference. */
DISPATCH_API
int dispatch_embedding(dispatch_tensor *weight, dispatch_tensor *idx,
                       int64_t padding_idx, dispatch_tensor **out);
/* Layer normalisation over the last nlast dims of x (1 <= nlast <=
 * rank): y = (x - mean) / sqrt(var + eps) * weight + bias, mean and the
 * biased variance (divided by the count, as PyTorch) taken per slice of
 * the last nlast dims. weight and bias are NULL or of shape
 * x.shape[-nlast:] and x's dtype (f32 or f64). The statistics are computed
 * in double for both dtypes, in two passes (the mean, then the mean of
 * squared deviations: no E[x^2] - E[x]^2 cancellation), and the result is
 * rounded once. eps must be finite and >= 0 (PyTorch's default is 1e-5).
 * Gradients reach x, weight and bias through one fused backward op.
 * Errors: DISPATCH_EDTYPE, DISPATCH_ESHAPE (weight/bias shape), DISPATCH_EDIM
 * (nlast), DISPATCH_EINVAL (eps). Borrows its inputs; *out is a new
 * reference of x's shape. */
DISPATCH_API
int dispatch_layer_norm(dispatch_tensor *x, int nlast, dispatch_tensor *weight,
                        dispatch_tensor *bias, double eps,
                        dispatch_tensor **out);
/* RMS normalisation over the last nlast dims: y = x / sqrt(mean(x^2) +
 * eps) * weight, weight NULL or of shape x.shape[-nlast:]. Same
 * conventions, precision and errors as dispatch_layer_norm. */
DISPATCH_API
int dispatch_rms_norm(dispatch_tensor *x, int nlast, dispatch_tensor *weight,
                      double eps, dispatch_tensor **out);
/* Batch normalisation of x [N, C, ...] (f32 or f64) per channel, over N
 * and the trailing dims, as torch.nn.functional.batch_norm: y = (x -
 * mean) / sqrt(var + eps) * weight + bias, every per-channel tensor
 * (running_mean, running_var, weight, bias) of shape [C] and x's dtype,
 * weight and bias NULL ok, running_mean and running_var both or neither.
 * training != 0: the batch's mean and biased variance normalise (more
 * than one value per channel, else DISPATCH_EINVAL), and the running
 * statistics, when given, are updated IN PLACE on their device: r = (1 -
 * momentum) r + momentum * batch statistic, with the unbiased variance
 * (REMOTE: on the server, in the op's turn; a read in flight keeps the old
 * bytes). training == 0: the running statistics normalise (required). The
 * gradient reaches x (through the batch statistics in training), weight
 * and bias, never the running statistics. Statistics in double, two
 * passes, as dispatch_layer_norm. momentum in [0, 1], eps finite >= 0
 * (PyTorch: 0.1 and 1e-5). Borrows its inputs; *out is a new reference of
 * x's shape. */
DISPATCH_API
int dispatch_batch_norm(dispatch_tensor *x, dispatch_tensor *running_mean,
                        dispatch_tensor *running_var, dispatch_tensor *weight,
                        dispatch_tensor *bias, int training, double momentum,
                        double eps, dispatch_tensor **out);
/* issue 23: attention */

/* Fused scaled dot-product attention, softmax(scale q k^T + mask) v, per
 * batch entry and head, in one op (its gradient is one fused op too):
 *   q [B, H, Tq, d], k [B, H, Tk, d], v [B, H, Tk, dv], all f32 or all
 *   f64 -> *out [B, H, Tq, dv] of the same dtype.
 * key_mask: bool [B, Tk], true = attend (a padding mask shared by every
 *   head and query); NULL for none. It is never differentiated.
 * causal != 0: query i attends keys j <= i only, top-left aligned when
 *   Tq != Tk (as torch.tril(ones(Tq, Tk)) and PyTorch's
 *   scaled_dot_product_attention(is_causal=True): torch 1.13's private
 *   _scaled_dot_product_attention and PyTorch 2's public one).
 * scale: the factor on q k^T; 0 means 1/sqrt(d).
 * A query that attends no key (all its keys masked, or Tk = 0) gives an
 * output row of 0 and passes no gradient; PyTorch gives NaN there.
 * Memory: no [Tq, Tk] matrix per head; the CPU kernel holds scores for 64
 * query rows at a time (min(64, Tq) * Tk elements, twice that for the
 * gradient) in each of its threads (DISPATCH_CPU_THREADS: heads run in
 * parallel), the CUDA kernels one row's running softmax in registers (the
 * gradient 16 bytes a query row of scratch).
 * Inputs are borrowed, *out is a new reference (scoped). Errors:
 * DISPATCH_EDTYPE (not float, mixed dtypes, key_mask not bool),
 * DISPATCH_ESHAPE (ranks or sizes that do not fit the shapes above),
 * DISPATCH_EINVAL (scale not finite), DISPATCH_EOVERFLOW (a dim over
 * INT_MAX). */
DISPATCH_API
int dispatch_attention(dispatch_tensor *q, dispatch_tensor *k,
                       dispatch_tensor *v, dispatch_tensor *key_mask,
                       int causal, double scale, dispatch_tensor **out);
/* issue 23: elementwise and reductions */

/* softplus(x) = log(1 + e^x), and x itself where x > 20 (PyTorch's
 * softplus with beta 1, threshold 20; its gradient there is 1, elsewhere
 * e^x / (1 + e^x)). gelu_tanh is PyTorch's gelu(approximate='tanh'):
 * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). f32 and f64 only
 * (DISPATCH_EDTYPE). */
DISPATCH_API
int dispatch_softplus(dispatch_tensor *x, dispatch_tensor **out);
DISPATCH_API
int dispatch_gelu_tanh(dispatch_tensor *x, dispatch_tensor **out);

/* min(max(x, lo), hi) elementwise, as PyTorch's clamp: lo > hi gives hi
 * everywhere, a NaN x stays NaN; -INFINITY / INFINITY leave that side
 * open. f32, f64 (the bounds rounded to x's dtype) and i64 (finite bounds
 * must be integers; DISPATCH_EINVAL otherwise); a NaN bound is
 * DISPATCH_EINVAL, bool DISPATCH_EDTYPE. Gradient: g where lo <= x <= hi
 * (both ends inclusive), 0 outside (and 0 everywhere when lo > hi). */
DISPATCH_API
int dispatch_clamp(dispatch_tensor *x, double lo, double hi,
                   dispatch_tensor **out);

/* x with value where mask is true: mask is bool and broadcasts to x's
 * shape, which is the output's (DISPATCH_EDTYPE, DISPATCH_ESHAPE
 * otherwise). f32, f64 (value rounded to the dtype; -inf and NaN fine)
 * and i64 (value an exact integer, DISPATCH_EINVAL otherwise). Gradient to
 * x: g where mask is false, 0 where it is true; the mask gets none. */
DISPATCH_API
int dispatch_masked_fill(dispatch_tensor *x, dispatch_tensor *mask,
                         double value, dispatch_tensor **out);

/* min and argmin mirror dispatch_max and dispatch_argmax: NaN wins (the
 * first one), an empty reduced dim is DISPATCH_ESHAPE, argmin takes
 * ndims 0 (flattened) or 1 and gives i64 with ties at the first index;
 * min's gradient is split evenly between tied minima. */
DISPATCH_API
int dispatch_min(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
DISPATCH_API
int dispatch_argmin(dispatch_tensor *x, int ndims, const int64_t *dims,
                    int keepdim, dispatch_tensor **out);

/* Variance over dims[0..ndims-1] (ndims 0: every dim) with a correction,
 * as PyTorch's var(dim, correction=, keepdim=): sum((x - mean)^2) /
 * max(0, N - correction), N the count of reduced elements (correction 1:
 * the unbiased estimate, PyTorch's default; 0: the population variance).
 * N - correction <= 0 divides by 0 and gives inf, or NaN where the sum
 * is 0 (one element with correction 1, an empty reduction), as PyTorch.
 * Computed in double (mean first, then the squared deviations; f32 is
 * rounded once). std is the square root. f32 and f64 only
 * (DISPATCH_EDTYPE). Gradients: var 2 (x - mean) g / (N - correction),
 * std that over 2 std (NaN where std is 0, as PyTorch). */
DISPATCH_API
int dispatch_var(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int64_t correction, int keepdim, dispatch_tensor **out);
DISPATCH_API
int dispatch_std(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int64_t correction, int keepdim, dispatch_tensor **out);
/* issue 23: loss, conv bias, pools */

/* The reductions of dispatch_cross_entropy_ex. */
#define DISPATCH_REDUCE_NONE 0
#define DISPATCH_REDUCE_SUM 1
#define DISPATCH_REDUCE_MEAN 2

/* Cross entropy as torch.nn.functional.cross_entropy (PyTorch 1.13) with
 * class indices: logits [N, C] or [N, C, d1, ...] (f32 or f64; also [C]
 * with a 0-D label), labels i64 [N] or [N, d1, ...] (the logits' shape
 * without the class dim 1). Per position with label y != ignore_index,
 * loss = (1 - eps) (lse - x_y) + eps (lse - mean_c x_c) with lse the
 * log-sum-exp of its C logits and eps = label_smoothing in [0, 1] (the
 * second term is torch's eps/C sum_c -log p_c); a position whose label
 * is ignore_index (-100 in PyTorch; any value, also a class index) has
 * loss 0 and gradient 0. reduction: DISPATCH_REDUCE_NONE gives the
 * per-position losses (the labels' shape, 0 where ignored),
 * DISPATCH_REDUCE_SUM their sum, DISPATCH_REDUCE_MEAN their sum divided
 * by the number of non-ignored labels (a scalar). A batch whose labels
 * are all ignored (or that has none) gives NaN with MEAN (0/0, as
 * PyTorch), 0 with SUM, and a zero gradient. Errors: DISPATCH_EINDEX
 * for a label outside [0, C) that is not ignore_index (message names the
 * label and its flat position); DISPATCH_ESHAPE for mismatched shapes or
 * C = 0; DISPATCH_EDTYPE for non-float logits or non-i64 labels;
 * DISPATCH_EINVAL for a reduction outside 0..2 or a smoothing outside
 * [0, 1]. Differentiable in logits through one fused backward op.
 * dispatch_cross_entropy(logits, labels) is the same as
 * dispatch_cross_entropy_ex(logits, labels, -100, 0, DISPATCH_REDUCE_MEAN)
 * for [N, C] logits and labels in [0, C), bit for bit. */
DISPATCH_API
int dispatch_cross_entropy_ex(dispatch_tensor *logits, dispatch_tensor *labels,
                              int64_t ignore_index, double label_smoothing,
                              int reduction, dispatch_tensor **out);

/* avg_pool2d as torch.nn.functional.avg_pool2d (ceil_mode False):
 * dispatch_avg_pool2d with count_include_pad; nonzero (PyTorch's default,
 * and dispatch_avg_pool2d's) divides every window by kh * kw, 0 by the
 * number of its elements inside the input (never 0: padding is at most
 * half the kernel). A stride of 0 is the kernel size. Differentiable;
 * errors as dispatch_avg_pool2d's (DISPATCH_EINVAL for the kernel,
 * stride, padding; DISPATCH_ESHAPE for an input that is not 4-D or an
 * empty output). */
DISPATCH_API
int dispatch_avg_pool2d_ex(dispatch_tensor *x, int64_t kh, int64_t kw,
                           int64_t stride_h, int64_t stride_w, int64_t pad_h,
                           int64_t pad_w, int count_include_pad,
                           dispatch_tensor **out);

/* dispatch_conv2d plus a bias: out[n, o] = conv2d(x, w)[n, o] + bias[o],
 * as torch.nn.functional.conv2d(x, w, bias) (groups 1). bias is [O] of
 * w's dtype, or NULL (then this is dispatch_conv2d, the same op on the
 * wire). One op; differentiable in x, w and bias (the bias gradient is
 * the sum of the output gradient over N, H and W). Errors as
 * dispatch_conv2d's, and DISPATCH_ESHAPE / DISPATCH_EDTYPE for a bias
 * that is not [O] of the same dtype. */
DISPATCH_API
int dispatch_conv2d_bias(dispatch_tensor *x, dispatch_tensor *w,
                         dispatch_tensor *bias, int64_t stride_h,
                         int64_t stride_w, int64_t pad_h, int64_t pad_w,
                         int64_t dil_h, int64_t dil_w, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* mixed precision                                                     */

/* Autocast, torch.autocast's policy for the device's later ops (LOCAL and
 * REMOTE alike; the casts are ordinary CAST ops, sent like any op):
 *   - matmul, conv2d (with or without bias) and attention cast their f32
 *     inputs to `dtype` and run in it (f64 inputs stay);
 *   - sum, mean, var, std, softmax, log_softmax, cross_entropy (both),
 *     mse, layer_norm, rms_norm, batch_norm, exp, log, pow_scalar and
 *     softplus cast f16 / bf16 inputs to f32;
 *   - an elementwise op (and cat, stack) of several inputs of different
 *     float dtypes casts them to the widest (f16 with bf16: f32), as
 *     torch's type promotion;
 *   - every other op runs in its inputs' dtype.
 * A tracked input gives a tracked cast, so gradients flow back through
 * the casts and reach f32 leaves (the master weights) in f32; the
 * optimizer and its state stay in f32. dtype: DISPATCH_BF16 or
 * DISPATCH_F16 to turn it on, DISPATCH_F32 to turn it off (the default);
 * anything else: DISPATCH_EINVAL. *prev (NULL ok) gets the policy it
 * replaces, for nesting. The policy is the device's (its peers keep
 * theirs) and is not captured by a graph: a graph records the casts it
 * saw. */
DISPATCH_API
int dispatch_autocast(dispatch_device *dev, dispatch_dtype dtype,
                      dispatch_dtype *prev);

/* ------------------------------------------------------------------ */
/* autodiff                                                            */

/* Wraps a LOCAL or REMOTE float tensor t as AUTODIFF(t), a tracked leaf
 * (REMOTE: a Track is queued; the tape lives on the server). *out holds
 * its own reference to t. An AUTODIFF t, or a t that is already tracked
 * (wrapped before), gives DISPATCH_EDOUBLEWRAP with the message
 * "autodiff should not wrap an autodiff tensor"; a non-float t gives
 * DISPATCH_EDTYPE. */
DISPATCH_API
int dispatch_autodiff(dispatch_tensor *t, dispatch_tensor **out);

/* Reverse pass from loss (AUTODIFF, one element) to every tracked leaf
 * reachable from it; the graph is released afterwards. REMOTE: one
 * Backward request, the gradients staying on the server; with a server of
 * protocol 1.3 or later it is pipelined like an op (no round trip), so a
 * failure the server finds (DISPATCH_EGRAPHFREED, DISPATCH_EQUOTA, ...)
 * is reported by the next call that waits, and the gradients made from
 * *out then fail with DISPATCH_EPOISONED; older servers answer it at once.
 * *out is the caller's (dispatch_grads_free; not scoped). Errors:
 * DISPATCH_ENOTTRACKED, DISPATCH_ENOTSCALAR, DISPATCH_EGRAPHFREED. */
DISPATCH_API
int dispatch_backward(dispatch_tensor *loss, dispatch_grads **out);
/* The same, keeping the graph for another backward when retain != 0. */
DISPATCH_API
int dispatch_backward_ex(dispatch_tensor *loss, int retain,
                         dispatch_grads **out);

/* The gradient of leaf t (the AUTODIFF tensor given to dispatch_autodiff,
 * or the tensor it wraps) as a new plain tensor on t's device. REMOTE: a
 * Grad request (no wait); reading the result is the only transfer of
 * gradient bytes. DISPATCH_ENOGRAD if the backward did not reach t (REMOTE:
 * deferred to the next wait, unless in sync mode), and at once, on both
 * kinds, when t is not a leaf (an op's output). */
DISPATCH_API
int dispatch_grad(dispatch_grads *grads, dispatch_tensor *t,
                  dispatch_tensor **out);

/* Frees a gradient container (REMOTE: a Free is queued). NULL ok. */
DISPATCH_API
void dispatch_grads_free(dispatch_grads *grads);

/* ------------------------------------------------------------------ */
/* optimizers                                                          */

/* An optimizer over params[0..n-1]: AUTODIFF leaves (from
 * dispatch_autodiff) of float dtype, all on one device. The optimizer
 * takes its own reference to each parameter and creates its state
 * (velocity; Adam moments) on that device; the caller keeps its own
 * references. *out is the caller's (dispatch_optim_free; not scoped). */
DISPATCH_API
int dispatch_sgd_new(dispatch_tensor *const *params, int n, double lr,
                     double momentum, double weight_decay,
                     dispatch_optim **out);
DISPATCH_API
int dispatch_adam_new(dispatch_tensor *const *params, int n, double lr,
                      double beta1, double beta2, double eps,
                      dispatch_optim **out);
/* AdamW (torch.optim.AdamW): decoupled weight decay, then Adam's update
 * with the same bias correction: p *= 1 - lr * wd[i]; m = b1 m + (1-b1) g;
 * v = b2 v + (1-b2) g^2; p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) +
 * eps), in double, rounded once into the parameter's dtype. weight_decay
 * holds n values, one per parameter (copied; 0 excludes a norm's gain or
 * a bias), NULL: all 0. A non-finite decay is DISPATCH_EINVAL here; lr,
 * betas ([0, 1)) and eps (>= 0) are checked at the first step, as Adam's.
 * State: m and v in the parameter's dtype. REMOTE needs a server of
 * protocol 1.5 (an older one: DISPATCH_EUNSUPPORTED at the step). */
DISPATCH_API
int dispatch_adamw_new(dispatch_tensor *const *params, int n, double lr,
                       double beta1, double beta2, double eps,
                       const double *weight_decay, dispatch_optim **out);

/* One update of every parameter in place, on the device where it lives,
 * with its gradient from grads. Parameters stay the same AUTODIFF leaves
 * (still tracked, never re-wrapped), ready for the next forward.
 * REMOTE: ONE Step message carrying every parameter, no wait (errors
 * surface at the next wait). A parameter the backward did not reach
 * gives DISPATCH_ENOGRAD (REMOTE: at the next wait) and no parameter
 * changes. Adam's step count t advances when the step is queued: after a
 * REMOTE step that the server refused, later updates use a t one higher
 * than a LOCAL run that failed the same step would (LOCAL does not
 * advance t on failure). */
DISPATCH_API
int dispatch_optim_step(dispatch_optim *opt, dispatch_grads *grads);

/* ---- Groups: data-parallel training across servers (protocol 1.7) ----
 *
 * The dispatch-servers of one MPI job (mpirun -np N dispatch-server --mpi
 * --listen HOST:BASE; rank r listens on BASE + r) form a group. A client
 * opens all of them as one group and all-reduces tensors or gradients
 * through it: the servers sum them with MPI among themselves, and no
 * tensor byte passes through the client. Each all-reduce is queued like an
 * op (no wait; a failure is the next wait's error on that member, as
 * DISPATCH_EGROUP for a member that disagreed, lacked the request, failed
 * or timed out, within 3 x the servers' --mpi-timeout). */
typedef struct dispatch_group dispatch_group;

/* Opens specs[0..n-1], the devices of every rank of one MPI job in any
 * order, as a group; opts as for dispatch_device_open (NULL: defaults).
 * Each must be a server of protocol 1.7 started with --mpi, all from one
 * mpirun, n its number of ranks. *out is the caller's
 * (dispatch_group_close, which closes its devices). On failure *out is
 * NULL, nothing stays open and err[0..err_len-1] (may be NULL) says why:
 * DISPATCH_EUNSUPPORTED (not a server, an older one, or one without
 * --mpi), DISPATCH_EGROUP (n is not the job's size, or the devices are
 * not the ranks of one job), or the open's own error. */
DISPATCH_API
int dispatch_group_open(const char *const *specs, int n,
                        const dispatch_options *opts, dispatch_group **out,
                        char *err, size_t err_len);

/* Closes every device of g (their tensors, gradients and optimizers) and
 * frees g. NULL is a no-op. */
DISPATCH_API
void dispatch_group_close(dispatch_group *g);

/* The number of members (0 for NULL). */
DISPATCH_API
int dispatch_group_size(const dispatch_group *g);

/* The device of rank `rank` (0 .. size-1), borrowed: g owns it. Make each
 * member's tensors on its own device. NULL when out of range. */
DISPATCH_API
dispatch_device *dispatch_group_device(dispatch_group *g, int rank);

/* All-reduces k tensors per member in place: tensors[r * k + i] is tensor
 * i of rank r, on dispatch_group_device(g, r) (REMOTE or AUTODIFF of
 * one). Afterwards every member's tensor i holds the sum over the ranks
 * (DISPATCH_REDUCE_SUM) or that sum divided by the group's size
 * (DISPATCH_REDUCE_MEAN), the same bits on every member. One request
 * reduces one dtype: f32 or f64 (sum or mean), i64 (sum). The members
 * check that they hold the same dtype, number of tensors and shapes, and
 * all refuse otherwise (DISPATCH_EGROUP, the message naming both sides).
 * Queued (no wait); the argument checks here fail at once. */
DISPATCH_API
int dispatch_group_allreduce(dispatch_group *g, dispatch_tensor *const *tensors,
                             size_t k, int reduce);

/* Broadcasts rank root's k tensors to every member, in place: tensors as
 * in dispatch_group_allreduce; afterwards every member's tensor i holds
 * rank root's bytes (a data-parallel run starts its members from one
 * model this way). Any dtype of the all-reduce (f32, f64, i64, f16,
 * bf16); the members check dtypes, count and shapes as there, and refuse
 * alike (DISPATCH_EGROUP). root outside 0 .. size-1: DISPATCH_EINVAL. A
 * server older than 0.4.0 refuses it (DISPATCH_EINVAL at the next wait).
 * Queued (no wait); the argument checks here fail at once. */
DISPATCH_API
int dispatch_group_broadcast(dispatch_group *g, dispatch_tensor *const *tensors,
                             size_t k, int root);

/* The same for gradients: the gradients of params[r * k + i] in container
 * grads[r] (on rank r's device), in place in the container. */
DISPATCH_API
int dispatch_group_allreduce_grads(dispatch_group *g,
                                   dispatch_grads *const *grads,
                                   dispatch_tensor *const *params, size_t k,
                                   int reduce);

/* One data-parallel step: on every rank r, opts[r] (an optimizer of rank
 * r's parameters, the same count on each) steps with the gradients of
 * grads[r] all-reduced through the group first (DISPATCH_REDUCE_MEAN for
 * a loss averaged over each member's share of the batch). Each member
 * gets ONE Step message, queued behind its backward: the backward, the
 * all-reduce and the update run on the servers without a round trip. */
DISPATCH_API
int dispatch_group_step(dispatch_group *g, dispatch_optim *const *opts,
                        dispatch_grads *const *grads, int reduce);

/* Changes the learning rate of later steps. */
DISPATCH_API
int dispatch_optim_set_lr(dispatch_optim *opt, double lr);

/* Clips later steps by global norm (any optimizer), as
 * torch.nn.utils.clip_grad_norm_ before the step: norm = sqrt(sum over
 * every parameter of the optimizer of sum g^2), accumulated in double,
 * parameter by parameter in the optimizer's order; when c = max_norm /
 * (norm + 1e-6) is below 1 every gradient is read as g * c (in double,
 * inside the update: the gradient tensors themselves are not changed).
 * The norm is taken inside the step: REMOTE still one Step message, the
 * server computes it over every gradient before the first update, and
 * LOCAL and REMOTE give the same bits. A non-finite norm is not an
 * error and nothing is skipped (PyTorch without error_if_nonfinite): a NaN
 * norm scales by NaN, so every parameter becomes NaN; an infinite one
 * scales by 0. max_norm 0 turns clipping off; negative, NaN or infinite:
 * DISPATCH_EINVAL. REMOTE needs a server of protocol 1.5 (an older one:
 * DISPATCH_EUNSUPPORTED at the step). A captured step keeps the clip
 * (and AdamW's decays) it was captured with, and each replay takes the
 * norm of that replay's gradients. */
DISPATCH_API
int dispatch_optim_set_clip(dispatch_optim *opt, double max_norm);

/* *norm = the global gradient norm (before clipping) of the last clipped
 * step, as torch.nn.utils.clip_grad_norm_ returns it; 0 before the first
 * one. It stays on the device (the first dispatch_optim_set_clip > 0
 * makes an f64 scalar there that each clipped step overwrites, inside the
 * same Step message): REMOTE, this read is one round trip, so call it
 * only when logging. A replayed graph does not update it. An optimizer
 * that never clipped: DISPATCH_EINVAL (*norm NaN). */
DISPATCH_API
int dispatch_optim_last_norm(dispatch_optim *opt, double *norm);

/* Dynamic loss scaling for f16 training, as torch.cuda.amp.GradScaler,
 * with its unscale, skip and update inside each step (REMOTE: still one
 * Step message). Multiply the loss by the scale before the backward
 * (dispatch_optim_scale_loss); each later dispatch_optim_step then looks
 * at every gradient:
 *   - an inf or NaN anywhere: no parameter or optimizer state changes,
 *     the scale is multiplied by backoff (torch: 0.5);
 *   - else each gradient is read as g / scale (the clip of
 *     dispatch_optim_set_clip, and dispatch_optim_last_norm, take the
 *     unscaled norm), the update runs, and after `interval` (torch: 2000)
 *     such steps in a row the scale is multiplied by growth (torch: 2).
 * Adam's step count counts the updates that ran, as torch's. The scale
 * and its counts live in two small tensors on the device (an f32 scale:
 * init_scale must be finite in f32; torch's default is 65536), made here
 * and freed with the optimizer; calling again starts over from
 * init_scale, and init_scale 0 turns scaling off. With a power-of-two
 * scale, growth and backoff (the defaults) the unscaled gradients have
 * exactly the bits an unscaled backward gives, unless one overflowed or
 * underflowed. growth >= 1, backoff in (0, 1], interval >= 1, else
 * DISPATCH_EINVAL. REMOTE needs a server of protocol 1.7
 * (DISPATCH_EUNSUPPORTED at the step); a step with loss scaling cannot be
 * captured in a graph (DISPATCH_EUNSUPPORTED at dispatch_graph_end).
 * Checkpoints hold the scale and its counts (optim.loss_scale,
 * optim.loss_scale.counts): dispatch_optim_load on an optimizer given a
 * loss scale again restores them (growth, backoff and interval are the
 * ones given again); a checkpoint without them leaves the new scale as
 * set. The optimizer's saved step count includes the skipped steps. */
DISPATCH_API
int dispatch_optim_set_loss_scale(dispatch_optim *opt, double init_scale,
                                  double growth, double backoff,
                                  int64_t interval);

/* *out = loss times the optimizer's current loss scale, computed on the
 * device (no wait; tracked when loss is, so a backward from *out gives
 * scaled gradients). f32 and f64 losses keep their dtype; an f16 or bf16
 * loss is cast to f32 first (the scale may exceed f16's range). *out is
 * scoped like an op's result. No loss scale set: DISPATCH_EINVAL; a loss
 * that is not a float: DISPATCH_EDTYPE. */
DISPATCH_API
int dispatch_optim_scale_loss(dispatch_optim *opt, dispatch_tensor *loss,
                              dispatch_tensor **out);

/* *scale = the current loss scale and, when skipped is not NULL,
 * *skipped = the steps skipped since dispatch_optim_set_loss_scale. A read
 * of the device (REMOTE: one round trip, which also waits for the steps
 * queued before it). No loss scale set: DISPATCH_EINVAL (*scale NaN). */
DISPATCH_API
int dispatch_optim_loss_scale(dispatch_optim *opt, double *scale,
                              int64_t *skipped);

/* Cosine learning rate with linear warmup, for step = 0, 1, ...:
 *   step < warmup:   lr_max * (step + 1) / warmup
 *   step >= total:   lr_min
 *   otherwise:       lr_min + 0.5 (1 + cos(pi (step - warmup) /
 *                    (total - warmup))) (lr_max - lr_min)
 * Pure arithmetic (no device, no error). Pass it to
 * dispatch_optim_set_lr before each step. */
DISPATCH_API
double dispatch_lr_cosine(int64_t step, int64_t warmup, int64_t total,
                          double lr_max, double lr_min);

/* Frees the optimizer, its state and its parameter references. NULL ok. */
DISPATCH_API
void dispatch_optim_free(dispatch_optim *opt);

/* ------------------------------------------------------------------ */
/* checkpoints (safetensors files)                                     */

/* The file format is safetensors: an 8-byte little-endian header length
 * N, N bytes of JSON {"NAME": {"dtype": "F32"|"F64"|"I64"|"BOOL",
 * "shape": [...], "data_offsets": [BEGIN, END]}, ..., "__metadata__":
 * {"KEY": "VALUE", ...}}, then the raw little-endian bytes, offsets
 * relative to the data section, contiguous and in order. numpy,
 * safetensors and PyTorch read and write it.
 *
 * Optimizer state goes under these names (parameter i of the optimizer,
 * in the order given to dispatch_sgd_new / dispatch_adam_new /
 * dispatch_adamw_new):
 *   optim.<i>.momentum   SGD velocity, dtype and shape of parameter i
 *   optim.<i>.m          Adam (and AdamW) first moment
 *   optim.<i>.v          Adam (and AdamW) second moment
 *   optim.step           their step count t, an I64 scalar (shape [])
 *   optim.loss_scale     the dynamic loss scale, an F32 scalar, and
 *   optim.loss_scale.counts  its counts, I64 [2] (clean steps since the
 *                        scale last changed, steps skipped), when the
 *                        optimizer has one (dispatch_optim_set_loss_scale)
 * and the metadata "dispatch.optim" ("sgd", "adam" or "adamw") and
 * "dispatch.optim.params" (the parameter count). Hyperparameters (lr,
 * betas, weight decays, the clip's max_norm, ...) are not saved: the
 * caller creates the optimizer again. */
typedef struct dispatch_checkpoint dispatch_checkpoint;

/* Writes tensors[0..n-1] under names[0..n-1] (unique, non-empty, UTF-8,
 * not "__metadata__"), and, when opt is not NULL, opt's state under the
 * names above, to the file at path. Every tensor (AUTODIFF: its inner)
 * and opt live on dev; the call borrows them all. The file is written as
 * PATH.tmp.PID.N, fsync-ed and renamed over path, so path holds the old
 * file or the whole new one. REMOTE tensors stream through the client in
 * pieces of at most 1 MiB (whole rows of dim 0; one row when a row is
 * larger), each read from the server with one round trip: a save never
 * holds a second copy of the model here, and a deferred error surfaces
 * as at any read. Returns 0, DISPATCH_EINVAL (NULL, empty or reserved
 * name, a name twice), DISPATCH_EDEVICE, DISPATCH_EIO (file system; the
 * temporary file is removed), or the error of a read. */
DISPATCH_API
int dispatch_save(dispatch_device *dev, const char *path,
                  const char *const *names, dispatch_tensor *const *tensors,
                  int n, const dispatch_optim *opt);

/* Reads the checkpoint at path into new tensors on dev (LOCAL or REMOTE):
 * *out is the caller's (dispatch_checkpoint_free), holding one tensor per
 * name, in the file's data order. The whole header is checked before the
 * first tensor is made, and a failure frees every tensor made so far: a
 * refused file leaves nothing behind. Refused: a file shorter than its
 * header or data says (truncated), a header length over 100 MiB
 * (DISPATCH_ETOOLARGE), a header that is not UTF-8 or not one JSON object,
 * entries missing dtype/shape/data_offsets, offsets that overlap, leave a
 * gap or run past the end, bytes after the last tensor, duplicate names,
 * BOOL bytes other than 0/1 (DISPATCH_EINVAL for these), a dtype other than
 * F32, F64, I64, BOOL, F16, BF16 (DISPATCH_EDTYPE), a rank over DISPATCH_MAX_DIMS
 * (DISPATCH_EDIM), sizes that overflow (DISPATCH_EOVERFLOW), a shape whose
 * byte size differs from its offsets (DISPATCH_ESHAPE); the message names
 * the file, the tensor and the figures. REMOTE holds one tensor's bytes at
 * a time here and ends with a sync (so a refused upload fails the load; a
 * deferred error of earlier work surfaces here too, as at any wait). ck is
 * a handle of dev: free it before dispatch_device_close, which frees its
 * tensors. */
DISPATCH_API
int dispatch_load(dispatch_device *dev, const char *path,
                  dispatch_checkpoint **out);

/* Checkpoints the server writes and reads itself, for a REMOTE device
 * whose server runs with --checkpoint-dir DIR: a model of tens of GiB on
 * a GPU host is saved next to it, and loaded from there, without its
 * bytes crossing the network. The file is the one dispatch_save writes
 * (safetensors; optimizer state under the same names), so a file the
 * server wrote is one dispatch_load reads from DIR, and a file
 * dispatch_save wrote and someone copied into DIR is one
 * dispatch_load_on_server reads.
 *
 * file names a file inside DIR: relative, at most 1024 bytes, components
 * joined by '/' (the directories must exist on the server), none empty,
 * "." or "..", no control character, UTF-8; the server follows no
 * symbolic link anywhere on the way (the last component included) and
 * refuses all of these with DISPATCH_EINVAL, creating nothing.
 *
 * dispatch_save_on_server: as dispatch_save (same arguments and checks,
 * every tensor and opt live on dev, borrowed), but the server writes the
 * tensors' bytes from its own memory: a temporary file in the file's
 * directory, fsync-ed, renamed over file, the directory fsync-ed. One
 * round trip, which the server spends on a worker thread (other sessions
 * go on); an earlier deferred error of the session is returned instead,
 * as at any wait. Returns 0, DISPATCH_EINVAL (a name above, or a tensor
 * name dispatch_save refuses), DISPATCH_EDEVICE, DISPATCH_ENOTREMOTE (a
 * LOCAL dev), DISPATCH_EUNSUPPORTED (a server older than protocol 1.6, or
 * without --checkpoint-dir: nothing is sent), DISPATCH_EIO (the server's
 * file system; no file is left), DISPATCH_EPOISONED (a tensor a failed
 * request made). */
DISPATCH_API
int dispatch_save_on_server(dispatch_device *dev, const char *file,
                            const char *const *names,
                            dispatch_tensor *const *tensors, int n,
                            const dispatch_optim *opt);

/* dispatch_load_on_server: as dispatch_load, but the server reads file
 * (named as above) into new tensors of dev's session; *out is the
 * caller's (dispatch_checkpoint_free), its tensors REMOTE on dev, in the
 * file's data order. The server checks the whole header first, as
 * dispatch_load does (same codes), and makes every tensor or none: a
 * missing file is DISPATCH_EIO, tensors past the session's
 * --max-session-bytes DISPATCH_EQUOTA, each leaving nothing behind. Also
 * DISPATCH_ENOTREMOTE and DISPATCH_EUNSUPPORTED as above. */
DISPATCH_API
int dispatch_load_on_server(dispatch_device *dev, const char *file,
                            dispatch_checkpoint **out);

/* Number of tensors; the name and tensor of entry i (0..count-1), or NULL
 * out of range. Both are borrowed from ck: dispatch_tensor_ref a tensor to
 * keep it after dispatch_checkpoint_free. The tensors are plain (LOCAL or
 * REMOTE, never AUTODIFF) and in no scope. */
DISPATCH_API
int dispatch_checkpoint_count(const dispatch_checkpoint *ck);
DISPATCH_API
const char *dispatch_checkpoint_name(const dispatch_checkpoint *ck, int i);
DISPATCH_API
dispatch_tensor *dispatch_checkpoint_tensor(const dispatch_checkpoint *ck,
                                            int i);
/* The tensor named name (borrowed), or NULL. */
DISPATCH_API
dispatch_tensor *dispatch_checkpoint_get(const dispatch_checkpoint *ck,
                                         const char *name);
/* The __metadata__ value of key (borrowed), or NULL. */
DISPATCH_API
const char *dispatch_checkpoint_meta(const dispatch_checkpoint *ck,
                                     const char *key);

/* Drops ck's reference to each of its tensors and frees it. NULL ok. */
DISPATCH_API
void dispatch_checkpoint_free(dispatch_checkpoint *ck);

/* Replaces opt's state with the checkpoint's (see the names above; same
 * optimizer kind, parameter count, and each state's dtype and shape equal
 * to its parameter's), and Adam's step count with optim.step. Everything
 * is checked before anything changes: on failure opt is as it was
 * (DISPATCH_EINVAL, DISPATCH_ESHAPE, DISPATCH_EDEVICE). The optimizer
 * takes its own reference to the checkpoint's state tensors, which its
 * later steps update in place. To resume: load, wrap the parameters from
 * the checkpoint with dispatch_autodiff, create the optimizer over them
 * with the same hyperparameters, then dispatch_optim_load. */
DISPATCH_API
int dispatch_optim_load(dispatch_optim *opt, const dispatch_checkpoint *ck);

/* ------------------------------------------------------------------ */
/* captured graphs: one step recorded once, replayed with one message   */

/* A graph records the ops of one step on a device (forward, loss,
 * backward, gradients, the optimizer step) between dispatch_graph_begin
 * and dispatch_graph_end. The captured step runs as it is recorded (its
 * results are real). Then each dispatch_graph_replay runs the same step
 * again on fresh input bytes: REMOTE as ONE GraphReplay message whose
 * reply carries the requested outputs, LOCAL in process through the same
 * executor, so both give the same bits as the step run op by op.
 *
 * What the graph sees:
 * - inputs: every tensor made by dispatch_tensor_from_data (or
 *   dispatch_graph_input) on the device during the capture, in that order;
 *   a replay binds new bytes of the same dtype and shape to each.
 * - parameters: tensors made before the capture that its ops use
 *   (weights, optimizer state). They keep their identity: a replay's step
 *   updates them in place, as the op-by-op step does. The graph holds a
 *   reference to each until dispatch_graph_free.
 * - outputs: tensors named with dispatch_graph_output; a replay copies
 *   their bytes out.
 * Everything else made inside the graph is private to one replay and
 * released at its end (REMOTE: under no id of the session, so replays
 * never collide with the session's tensors).
 * Not recorded: reads, syncs, work on other devices. Creation ops with a
 * seed (uniform, normal, dropout) repeat the same bits on every replay.
 * Adam and AdamW: the k-th replay updates with step count t+k, t the
 * count the capture used; the optimizer handle's own count does not move.
 * The learning rate, AdamW's decays and the clip's max_norm are those of
 * the capture (dispatch_optim_set_lr after it does not reach a replay);
 * a clipped step's norm is taken over each replay's own gradients.
 * One capture at a time per device; a graph belongs to its device and is
 * used from its thread. */
typedef struct dispatch_graph dispatch_graph;

/* One input's bytes for a replay (dtype and shape must be those of the
 * placeholder), or one output's destination (only data and nbytes are
 * read: nbytes must equal the output's byte size). */
typedef struct dispatch_graph_io {
  dispatch_dtype dtype;
  int ndim;
  const int64_t *shape;
  void *data;    /* input: read only, borrowed for the call; output: filled */
  size_t nbytes;
} dispatch_graph_io;

/* Starts recording on dev. DISPATCH_EINVAL when a capture is open there
 * already; DISPATCH_ENOMEM. */
DISPATCH_API
int dispatch_graph_begin(dispatch_device *dev);

/* dispatch_tensor_from_data that also says "this is a graph input":
 * DISPATCH_EINVAL when dev has no open capture. Ownership as there. */
DISPATCH_API
int dispatch_graph_input(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                         const int64_t *shape, const void *data,
                         size_t nbytes, dispatch_tensor **out);

/* Asks every replay for t's bytes (AUTODIFF: its inner); t is borrowed
 * and must live on a device with an open capture. Returns the output's
 * index (0, 1, ... in call order) or DISPATCH_EINVAL. A tensor named
 * twice is two outputs with the same bytes (a REMOTE replay's reply
 * carries them once). */
DISPATCH_API
int dispatch_graph_output(dispatch_tensor *t);

/* Ends the capture of dev and makes the graph: *out is the caller's
 * (dispatch_graph_free, or the device's close). REMOTE: the definition
 * goes to the server and this waits for it (one round trip), so a refused
 * definition, or an error of the captured step itself, surfaces here. On
 * failure *out is NULL and the capture is gone all the same. Errors:
 * DISPATCH_EINVAL (no capture open; the capture used gradients made
 * before it), DISPATCH_ENOMEM, a deferred error, the server's refusal. */
DISPATCH_API
int dispatch_graph_end(dispatch_device *dev, dispatch_graph **out);

/* Counts of the graph's inputs and outputs, and the byte size of output
 * i (0 out of range). */
DISPATCH_API
int dispatch_graph_n_inputs(const dispatch_graph *g);
DISPATCH_API
int dispatch_graph_n_outputs(const dispatch_graph *g);
DISPATCH_API
size_t dispatch_graph_output_nbytes(const dispatch_graph *g, int i);

/* Runs the graph once: in[0..n_in-1] bound to its inputs, the outputs'
 * bytes written to out[0..n_out-1].data. Both arrays are borrowed. REMOTE:
 * one message and its reply; a deferred error of earlier work surfaces
 * here as at any wait. Errors: DISPATCH_EINVAL (counts, byte sizes),
 * DISPATCH_ESHAPE (an input's dtype or shape differs from its
 * placeholder; nothing runs), or the error of a node, whose message names
 * it: "graph 3, op 7 (matmul): ...". Nodes before a failing one have run
 * (a step before it has updated its parameters). The device goes on
 * either way. */
DISPATCH_API
int dispatch_graph_replay(dispatch_graph *g, const dispatch_graph_io *in,
                          int n_in, const dispatch_graph_io *out, int n_out);

/* Frees the graph (REMOTE: a Free for it is queued) and drops its
 * parameter references. NULL ok. */
DISPATCH_API
void dispatch_graph_free(dispatch_graph *g);

/* ------------------------------------------------------------------ */
/* several devices of one server (protocol 1.1)                        */

/* Opens device `device` ("cpu:1", "cuda:0") of dev's server as a peer of
 * dev: one connection and one session, so dispatch_to_device between dev
 * and the peer moves the bytes inside the server, each tensor charged to
 * the memory of the device it is on. The peer's uploads and creation ops
 * land on `device`; an op runs on its inputs' device, and inputs of two
 * devices are DISPATCH_EDEVICE (no implicit copies). The peer is used
 * from dev's thread only; close it like any device (its tensors are freed
 * on the server, dev goes on); closing dev first is allowed. dev and its
 * peers share the session's deferred error: it surfaces on whichever of
 * them waits next (sync, read, backward). Errors:
 * DISPATCH_EUNSUPPORTED (dev is not remote), DISPATCH_EINVAL (bad name),
 * DISPATCH_EDEVICE (the server has no such device: the message names the
 * ones it has), DISPATCH_ECONN, DISPATCH_ENOMEM. *out is the caller's. */
DISPATCH_API
int dispatch_device_open_peer(dispatch_device *dev, const char *device,
                              dispatch_device **out);

/* One device of a server, as its hello and Stats list them. size: as in
 * dispatch_stats, the struct's size as the caller was compiled (see
 * dispatch_device_list); fields are only ever appended. */
typedef struct dispatch_device_info {
  size_t size;           /* sizeof(dispatch_device_info) of the caller */
  char kind[16];         /* "cpu", "cuda" */
  char name[32];         /* "cpu:1": what a device string or a peer names */
  char description[96];  /* the backend's */
  uint64_t total_memory; /* the device's budget (--device-memory, else the
                            server's --max-memory) */
  uint64_t free_memory;  /* what is left of it now */
} dispatch_device_info;

/* The first element of an array for dispatch_device_list:
 *   dispatch_device_info info[4] = {DISPATCH_DEVICE_INFO_INIT}; */
#define DISPATCH_DEVICE_INFO_INIT \
  {sizeof(dispatch_device_info), "", "", "", 0, 0}

/* Fills out[0..max-1] with the devices of dev's server, in the server's
 * order, and sets *n to how many it has (may be more than max); one Stats
 * round trip. LOCAL: the one in-process CPU ("cpu", "local:cpu", memory
 * 0: unbounded). Strings are cut to their fields. out[0].size (set by
 * DISPATCH_DEVICE_INFO_INIT) is taken as the size of every element: the
 * array is walked with that stride and each element gets only the fields
 * within it, so an older, shorter struct is never overrun. 0, or
 * DISPATCH_EINVAL (out[0].size too small to hold kind) / DISPATCH_ENOMEM /
 * DISPATCH_ECONN / a deferred error of the session. The caller owns out. */
DISPATCH_API
int dispatch_device_list(dispatch_device *dev, dispatch_device_info *out,
                         int max, int *n);

#ifdef __cplusplus
}
#endif

#endif
