/* libdispatch-client: the one public header.
 *
 * Tensors that look the same whether they live in this process (LOCAL) or
 * on a dispatch-server across TCP (REMOTE), with reverse-mode autodiff
 * (AUTODIFF wraps exactly one LOCAL or REMOTE tensor) and optimizers.
 *
 * Conventions (they hold for every function below unless it says otherwise)
 * - Functions that can fail return 0 or a negative DISPATCH_E* code
 *   (dispatch_errors.h, included below). The device keeps the detail of its
 *   last error: dispatch_device_errmsg(dev). Nothing aborts on a caller's
 *   mistake.
 * - A function that gives back a tensor through `dispatch_tensor **out`
 *   hands the caller ONE reference, or registers it in the innermost open
 *   scope of the tensor's device (see scopes). On failure *out is NULL and
 *   nothing leaks. Input tensors are borrowed: the call never consumes them.
 * - Handles are opaque. A device and everything on it is used from one
 *   thread at a time; distinct devices may be used from distinct threads.
 * - Op functions take tensors of one device; mixing devices gives
 *   DISPATCH_EDEVICE (use dispatch_to_device to copy explicitly).
 * - Every op works on every kind with the same signature: LOCAL runs now
 *   on the CPU backend; REMOTE infers the output's shape here (so shape
 *   errors are immediate) and queues the op for the server without waiting;
 *   an op with an AUTODIFF input gives an AUTODIFF output.
 * - REMOTE errors found by the server after an op was queued are deferred:
 *   they surface at the next call that waits (read, backward, sync, stats)
 *   with the server's message, and the failed op's output is poisoned
 *   (dispatch_tensor_status).
 * - Attribute conventions (dims may be negative, counted from the end)
 *   follow the op table of the dispatch core; each function below restates
 *   what it needs.
 */
#ifndef DISPATCH_CLIENT_H
#define DISPATCH_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "dispatch_errors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ */
/* version                                                             */

#define DISPATCH_VERSION_MAJOR 0
#define DISPATCH_VERSION_MINOR 1
#define DISPATCH_VERSION_PATCH 0
/* 0xMMmmpp, for compile-time comparisons */
#define DISPATCH_VERSION_HEX                                         \
  ((DISPATCH_VERSION_MAJOR << 16) | (DISPATCH_VERSION_MINOR << 8) | \
   DISPATCH_VERSION_PATCH)

/* The version of the linked library, e.g. "0.1.0" (static string). */
const char *dispatch_version(void);

/* ------------------------------------------------------------------ */
/* types                                                               */

#define DISPATCH_MAX_DIMS 8   /* highest rank of a tensor */
#define DISPATCH_MAX_INPUTS 64 /* most tensors cat/stack take */

/* Element types; the values are those of the wire protocol. */
typedef enum dispatch_dtype {
  DISPATCH_F32 = 0,
  DISPATCH_F64 = 1,
  DISPATCH_I64 = 2,
  DISPATCH_BOOL = 3 /* one byte per element, 0 or 1 */
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
 * Strings are copied by dispatch_device_open; the caller keeps its own. */
typedef struct dispatch_options {
  const char *token;       /* hello token; NULL: env DISPATCH_TOKEN or "" */
  const char *client_name; /* sent in hello; NULL: "libdispatch-client" */
  int timeout_ms;          /* connect, send and each wait for a reply;
                              0: env DISPATCH_TIMEOUT_MS or 30000 */
  /* (A wait for a reply first polls the socket for DISPATCH_SPIN_US
   * microseconds, default 50, 0 off, before it sleeps: a quick reply then
   * costs no wake-up of a sleeping thread.) */
  /* tls:// only (appended: the fields above keep their places) */
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
} dispatch_options;

/* Counters of one device. REMOTE: what the server holds for this session
 * (tensors, their bytes, ops run, errors, live gradient containers).
 * LOCAL: the same counts kept by this library. */
typedef struct dispatch_stats {
  uint64_t tensors;
  uint64_t bytes;
  uint64_t ops;
  uint64_t errors;
  uint64_t grads;
} dispatch_stats;

/* ------------------------------------------------------------------ */
/* devices                                                             */

/* Fills *opts with the defaults (all zero/NULL). */
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
 * unchanged program moves from local to remote. opts may be NULL.
 * Returns 0 and the device in *out (caller owns it: dispatch_device_close),
 * or an error: DISPATCH_EINVAL (bad spec), DISPATCH_ECONN (cannot connect
 * or no hello reply within the timeout), DISPATCH_EAUTH (token missing or
 * wrong), DISPATCH_ETLS (handshake or certificate failure, including a
 * server that requires a client certificate), DISPATCH_EVERSION,
 * DISPATCH_ENOMEM.
 * On failure *out is NULL; when errmsg is not NULL, a detail message is
 * copied into errmsg[0..errmsg_len-1] (there is no device to hold it). */
int dispatch_device_open(const char *spec, const dispatch_options *opts,
                         dispatch_device **out, char *errmsg,
                         size_t errmsg_len);

/* Closes a device: flushes queued frees, says bye to a server, and frees
 * every tensor, gradient container and optimizer still alive on it, so
 * every handle of this device becomes invalid. NULL is a no-op. */
void dispatch_device_close(dispatch_device *dev);

/* DISPATCH_KIND_LOCAL or DISPATCH_KIND_REMOTE. */
dispatch_tensor_kind dispatch_device_kind(const dispatch_device *dev);

/* The spec the device was opened with ("local", "tcp://..."); owned by
 * the device. */
const char *dispatch_device_spec(const dispatch_device *dev);

/* Detail message of the device's last error ("" if none); owned by the
 * device, valid until its next failing call. */
const char *dispatch_device_errmsg(const dispatch_device *dev);

/* Code of the device's last error (0 if none). */
int dispatch_device_errcode(const dispatch_device *dev);

/* Waits until the server ran everything queued so far (LOCAL: returns 0 at
 * once). Returns the first deferred error of the session, if any, with the
 * server's message in dispatch_device_errmsg. */
int dispatch_device_sync(dispatch_device *dev);

/* Fills *out with the device's counters (REMOTE: one Stats round trip,
 * which also surfaces a deferred error like sync). */
int dispatch_device_stats(dispatch_device *dev, dispatch_stats *out);

/* Changes the time bound of every later network wait (ms > 0). A lost
 * connection, or a server silent for that long, gives DISPATCH_ECONN
 * within it, and every later call on the device gives DISPATCH_ECONN. */
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
int dispatch_device_set_cache(dispatch_device *dev, uint64_t bytes);

/* ------------------------------------------------------------------ */
/* scopes: a training loop without a free per op                       */

/* Opens a scope on dev. Every tensor handed out on dev while it is the
 * innermost scope is registered in it instead of being owned by the
 * caller. Scopes nest. Returns 0 or DISPATCH_ENOMEM. */
int dispatch_scope_begin(dispatch_device *dev);

/* Closes the innermost scope: drops the reference of every tensor
 * registered in it that was not kept; a tensor whose last reference goes
 * is freed (REMOTE: a Free is queued, batched with later traffic).
 * DISPATCH_EINVAL when no scope is open. */
int dispatch_scope_end(dispatch_device *dev);

/* Moves t out of its scope into the enclosing scope, or, from the
 * outermost scope, to the caller (who then frees it with
 * dispatch_tensor_free). A tensor in no scope is left as it is. Returns t
 * (NULL for NULL). */
dispatch_tensor *dispatch_keep(dispatch_tensor *t);

/* ------------------------------------------------------------------ */
/* tensor handles                                                      */

/* +1 reference (the new one is the caller's, never a scope's); returns t. */
dispatch_tensor *dispatch_tensor_ref(dispatch_tensor *t);

/* Drops one reference; at zero the tensor is freed (REMOTE: a Free for
 * its id is queued) and removed from its scope. NULL is a no-op. */
void dispatch_tensor_free(dispatch_tensor *t);

/* Type guards: the kind of t (DISPATCH_KIND_*). */
dispatch_tensor_kind dispatch_kind(const dispatch_tensor *t);
/* 1 if t is AUTODIFF, else 0. */
int dispatch_is_autodiff(const dispatch_tensor *t);
/* The LOCAL or REMOTE tensor an AUTODIFF tensor wraps (t itself for a
 * LOCAL or REMOTE tensor). No copy and no new reference: the result is
 * borrowed from t (dispatch_tensor_ref it to keep it longer). */
dispatch_tensor *dispatch_inner(dispatch_tensor *t);
/* The device t lives on (borrowed). */
dispatch_device *dispatch_tensor_device(const dispatch_tensor *t);

int dispatch_tensor_ndim(const dispatch_tensor *t);
/* Pointer to the ndim sizes, owned by t. */
const int64_t *dispatch_tensor_shape(const dispatch_tensor *t);
/* Size of dim i (negative counts from the end); -1 when out of range. */
int64_t dispatch_tensor_dim(const dispatch_tensor *t, int i);
dispatch_dtype dispatch_tensor_dtype(const dispatch_tensor *t);
int64_t dispatch_tensor_numel(const dispatch_tensor *t);
size_t dispatch_tensor_nbytes(const dispatch_tensor *t);
/* 0, or the error that poisoned t (a failed REMOTE op whose error the
 * client has learnt of at a wait). */
int dispatch_tensor_status(const dispatch_tensor *t);

/* ------------------------------------------------------------------ */
/* data in and out                                                     */

/* New tensor of dtype and shape[0..ndim-1] holding a copy of `data`;
 * nbytes must equal numel * element size (DISPATCH_EINVAL otherwise).
 * REMOTE: one Upload frame carrying the bytes, no wait. */
int dispatch_tensor_from_data(dispatch_device *dev, dispatch_dtype dtype,
                              int ndim, const int64_t *shape,
                              const void *data, size_t nbytes,
                              dispatch_tensor **out);

/* Copies t's bytes (row-major) into buf; nbytes must equal
 * dispatch_tensor_nbytes(t). Works on every kind (AUTODIFF reads its
 * inner). REMOTE: one Read round trip; this is where deferred errors
 * surface. */
int dispatch_tensor_read(dispatch_tensor *t, void *buf, size_t nbytes);

/* Copies t to device dev as a new LOCAL or REMOTE tensor (never AUTODIFF;
 * wrap it again if needed). Same device: still a copy. When dev shares
 * t's session (dev is t's device or a peer of it, see
 * dispatch_device_open_peer) the server copies the bytes between its
 * devices itself, one request, nothing through this process; otherwise
 * the bytes are read here and uploaded. */
int dispatch_to_device(dispatch_tensor *t, dispatch_device *dev,
                       dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* creation (every device; REMOTE: the server creates, no bytes travel)  */

int dispatch_zeros(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                   const int64_t *shape, dispatch_tensor **out);
int dispatch_ones(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, dispatch_tensor **out);
int dispatch_full(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, double value, dispatch_tensor **out);
/* 1-D [start, end) by step (step != 0). */
int dispatch_arange(dispatch_device *dev, dispatch_dtype dtype, double start,
                    double end, double step, dispatch_tensor **out);
/* Uniform in [lo, hi) / normal(mean, std), float dtypes only. The same
 * seed gives the same bits on every device. */
int dispatch_uniform(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                     const int64_t *shape, double lo, double hi,
                     uint64_t seed, dispatch_tensor **out);
int dispatch_normal(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                    const int64_t *shape, double mean, double std,
                    uint64_t seed, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* elementwise                                                         */

/* Binary ops with numpy broadcasting; a and b of the same dtype. */
int dispatch_add(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_sub(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_mul(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_div(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_maximum(dispatch_tensor *a, dispatch_tensor *b,
                     dispatch_tensor **out);
int dispatch_minimum(dispatch_tensor *a, dispatch_tensor *b,
                     dispatch_tensor **out);
/* Comparisons: broadcasting, same dtype, bool result. */
int dispatch_eq(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_ne(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_lt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_le(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_gt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_ge(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
/* mask (bool) ? a : b, three-way broadcast. */
int dispatch_where(dispatch_tensor *mask, dispatch_tensor *a,
                   dispatch_tensor *b, dispatch_tensor **out);

/* With a scalar s: x+s, x-s, x*s, x/s, x^s, s-x, s/x. */
int dispatch_add_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_sub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_mul_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_div_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_pow_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_rsub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_rdiv_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);

/* Unary. gelu is the exact erf form. */
int dispatch_neg(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_exp(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_log(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_sqrt(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_abs(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_sign(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_relu(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_sigmoid(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_tanh(dispatch_tensor *x, dispatch_tensor **out);
int dispatch_gelu(dispatch_tensor *x, dispatch_tensor **out);
/* grad * f'(x), same shape (what autodiff uses; exposed for completeness) */
int dispatch_relu_backward(dispatch_tensor *grad, dispatch_tensor *x,
                           dispatch_tensor **out);
int dispatch_gelu_backward(dispatch_tensor *grad, dispatch_tensor *x,
                           dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* reductions                                                          */

/* Reduce over dims[0..ndims-1] (ndims 0: every dim); keepdim != 0 keeps
 * the reduced dims with size 1. */
int dispatch_sum(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
int dispatch_mean(dispatch_tensor *x, int ndims, const int64_t *dims,
                  int keepdim, dispatch_tensor **out);
int dispatch_max(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
/* ndims is 0 (flattened) or 1; i64 result; ties pick the first index. */
int dispatch_argmax(dispatch_tensor *x, int ndims, const int64_t *dims,
                    int keepdim, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* shape                                                               */

/* New shape of the same numel; one size may be -1. */
int dispatch_reshape(dispatch_tensor *x, int ndim, const int64_t *shape,
                     dispatch_tensor **out);
int dispatch_permute(dispatch_tensor *x, int ndim, const int64_t *perm,
                     dispatch_tensor **out);
int dispatch_transpose(dispatch_tensor *x, int64_t dim0, int64_t dim1,
                       dispatch_tensor **out);
/* Python-style x[start:end:step] along dim (step > 0, start/end clamped). */
int dispatch_slice(dispatch_tensor *x, int64_t dim, int64_t start,
                   int64_t end, int64_t step, dispatch_tensor **out);
/* n tensors (1..DISPATCH_MAX_INPUTS) joined along an existing dim (cat)
 * or a new one (stack). */
int dispatch_cat(dispatch_tensor *const *xs, int n, int64_t dim,
                 dispatch_tensor **out);
int dispatch_stack(dispatch_tensor *const *xs, int n, int64_t dim,
                   dispatch_tensor **out);
int dispatch_broadcast_to(dispatch_tensor *x, int ndim, const int64_t *shape,
                          dispatch_tensor **out);
/* Rows of x along dim picked by index (i64, 1-D). */
int dispatch_index_select(dispatch_tensor *x, int64_t dim,
                          dispatch_tensor *index, dispatch_tensor **out);
int dispatch_cast(dispatch_tensor *x, dispatch_dtype dtype,
                  dispatch_tensor **out);
/* Zeros of in_shape with grad placed at the slice (dim, start, end, step). */
int dispatch_slice_backward(dispatch_tensor *grad, int64_t dim,
                            int64_t start, int64_t end, int64_t step,
                            int in_ndim, const int64_t *in_shape,
                            dispatch_tensor **out);
/* Scatter-adds grad rows into zeros whose dim has size dim_size. */
int dispatch_index_select_backward(dispatch_tensor *grad,
                                   dispatch_tensor *index, int64_t dim,
                                   int64_t dim_size, dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* linear algebra                                                      */

/* numpy.matmul semantics (1-D..N-D, batch dims broadcast). */
int dispatch_matmul(dispatch_tensor *a, dispatch_tensor *b,
                    dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* neural network                                                      */

int dispatch_softmax(dispatch_tensor *x, int64_t dim, dispatch_tensor **out);
int dispatch_log_softmax(dispatch_tensor *x, int64_t dim,
                         dispatch_tensor **out);
/* (grad, y = softmax output) -> grad of the input */
int dispatch_softmax_backward(dispatch_tensor *grad, dispatch_tensor *y,
                              int64_t dim, dispatch_tensor **out);
int dispatch_log_softmax_backward(dispatch_tensor *grad, dispatch_tensor *y,
                                  int64_t dim, dispatch_tensor **out);
/* logits [N, C] float, labels [N] i64: mean loss over N (scalar). */
int dispatch_cross_entropy(dispatch_tensor *logits, dispatch_tensor *labels,
                           dispatch_tensor **out);
int dispatch_cross_entropy_backward(dispatch_tensor *grad,
                                    dispatch_tensor *logits,
                                    dispatch_tensor *labels,
                                    dispatch_tensor **out);
/* mean((a - b)^2), same shapes, scalar result. */
int dispatch_mse(dispatch_tensor *a, dispatch_tensor *b,
                 dispatch_tensor **out);
/* x [N, C, H, W], w [O, C, kh, kw], no bias. */
int dispatch_conv2d(dispatch_tensor *x, dispatch_tensor *w, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w,
                    int64_t dil_h, int64_t dil_w, dispatch_tensor **out);
/* x_shape / w_shape: the 4 dims of the forward input / weight. */
int dispatch_conv2d_backward_input(dispatch_tensor *grad, dispatch_tensor *w,
                                   int64_t stride_h, int64_t stride_w,
                                   int64_t pad_h, int64_t pad_w,
                                   int64_t dil_h, int64_t dil_w,
                                   const int64_t x_shape[4],
                                   dispatch_tensor **out);
int dispatch_conv2d_backward_weight(dispatch_tensor *grad, dispatch_tensor *x,
                                    int64_t stride_h, int64_t stride_w,
                                    int64_t pad_h, int64_t pad_w,
                                    int64_t dil_h, int64_t dil_w,
                                    const int64_t w_shape[4],
                                    dispatch_tensor **out);
/* Pools on [N, C, H, W]; avg counts padding. */
int dispatch_max_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
int dispatch_avg_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
int dispatch_max_pool2d_backward(dispatch_tensor *grad, dispatch_tensor *x,
                                 int64_t kh, int64_t kw, int64_t stride_h,
                                 int64_t stride_w, int64_t pad_h,
                                 int64_t pad_w, dispatch_tensor **out);
int dispatch_avg_pool2d_backward(dispatch_tensor *grad, dispatch_tensor *x,
                                 int64_t kh, int64_t kw, int64_t stride_h,
                                 int64_t stride_w, int64_t pad_h,
                                 int64_t pad_w, dispatch_tensor **out);
/* Keeps element i iff uniform(seed)[i] >= p (0 <= p < 1) and scales the
 * kept ones by 1/(1-p). */
int dispatch_dropout(dispatch_tensor *x, double p, uint64_t seed,
                     dispatch_tensor **out);

/* ------------------------------------------------------------------ */
/* autodiff                                                            */

/* Wraps a LOCAL or REMOTE float tensor t as AUTODIFF(t), a tracked leaf
 * (REMOTE: a Track is queued; the tape lives on the server). *out holds
 * its own reference to t. An AUTODIFF t, or a t that is already tracked
 * (wrapped before), gives DISPATCH_EDOUBLEWRAP with the message
 * "autodiff should not wrap an autodiff tensor"; a non-float t gives
 * DISPATCH_EDTYPE. */
int dispatch_autodiff(dispatch_tensor *t, dispatch_tensor **out);

/* Reverse pass from loss (AUTODIFF, one element) to every tracked leaf
 * reachable from it; the graph is released afterwards. REMOTE: one
 * Backward round trip; the gradients stay on the server. *out is the
 * caller's (dispatch_grads_free; not scoped). Errors:
 * DISPATCH_ENOTTRACKED, DISPATCH_ENOTSCALAR, DISPATCH_EGRAPHFREED. */
int dispatch_backward(dispatch_tensor *loss, dispatch_grads **out);
/* The same, keeping the graph for another backward when retain != 0. */
int dispatch_backward_ex(dispatch_tensor *loss, int retain,
                         dispatch_grads **out);

/* The gradient of leaf t (the AUTODIFF tensor given to dispatch_autodiff,
 * or the tensor it wraps) as a new plain tensor on t's device. REMOTE: a
 * Grad request (no wait); reading the result is the only transfer of
 * gradient bytes. DISPATCH_ENOGRAD if the backward did not reach t (REMOTE:
 * deferred to the next wait). */
int dispatch_grad(dispatch_grads *grads, dispatch_tensor *t,
                  dispatch_tensor **out);

/* Frees a gradient container (REMOTE: a Free is queued). NULL ok. */
void dispatch_grads_free(dispatch_grads *grads);

/* ------------------------------------------------------------------ */
/* optimizers                                                          */

/* An optimizer over params[0..n-1]: AUTODIFF leaves (from
 * dispatch_autodiff) of float dtype, all on one device. The optimizer
 * takes its own reference to each parameter and creates its state
 * (velocity; Adam moments) on that device; the caller keeps its own
 * references. *out is the caller's (dispatch_optim_free; not scoped). */
int dispatch_sgd_new(dispatch_tensor *const *params, int n, double lr,
                     double momentum, double weight_decay,
                     dispatch_optim **out);
int dispatch_adam_new(dispatch_tensor *const *params, int n, double lr,
                      double beta1, double beta2, double eps,
                      dispatch_optim **out);

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
int dispatch_optim_step(dispatch_optim *opt, dispatch_grads *grads);

/* Changes the learning rate of later steps. */
int dispatch_optim_set_lr(dispatch_optim *opt, double lr);

/* Frees the optimizer, its state and its parameter references. NULL ok. */
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
 * in the order given to dispatch_sgd_new / dispatch_adam_new):
 *   optim.<i>.momentum   SGD velocity, dtype and shape of parameter i
 *   optim.<i>.m          Adam first moment
 *   optim.<i>.v          Adam second moment
 *   optim.step           Adam's step count t, an I64 scalar (shape [])
 * and the metadata "dispatch.optim" ("sgd" or "adam") and
 * "dispatch.optim.params" (the parameter count). Hyperparameters (lr,
 * betas, ...) are not saved: the caller creates the optimizer again. */
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
 * F32, F64, I64, BOOL (DISPATCH_EDTYPE), a rank over DISPATCH_MAX_DIMS
 * (DISPATCH_EDIM), sizes that overflow (DISPATCH_EOVERFLOW), a shape whose
 * byte size differs from its offsets (DISPATCH_ESHAPE); the message names
 * the file, the tensor and the figures. REMOTE holds one tensor's bytes at
 * a time here and ends with a sync (so a refused upload fails the load; a
 * deferred error of earlier work surfaces here too, as at any wait). ck is
 * a handle of dev: free it before dispatch_device_close, which frees its
 * tensors. */
int dispatch_load(dispatch_device *dev, const char *path,
                  dispatch_checkpoint **out);

/* Number of tensors; the name and tensor of entry i (0..count-1), or NULL
 * out of range. Both are borrowed from ck: dispatch_tensor_ref a tensor to
 * keep it after dispatch_checkpoint_free. The tensors are plain (LOCAL or
 * REMOTE, never AUTODIFF) and in no scope. */
int dispatch_checkpoint_count(const dispatch_checkpoint *ck);
const char *dispatch_checkpoint_name(const dispatch_checkpoint *ck, int i);
dispatch_tensor *dispatch_checkpoint_tensor(const dispatch_checkpoint *ck,
                                            int i);
/* The tensor named name (borrowed), or NULL. */
dispatch_tensor *dispatch_checkpoint_get(const dispatch_checkpoint *ck,
                                         const char *name);
/* The __metadata__ value of key (borrowed), or NULL. */
const char *dispatch_checkpoint_meta(const dispatch_checkpoint *ck,
                                     const char *key);

/* Drops ck's reference to each of its tensors and frees it. NULL ok. */
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
int dispatch_optim_load(dispatch_optim *opt, const dispatch_checkpoint *ck);

#ifdef __cplusplus
}
#endif

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
int dispatch_device_open_peer(dispatch_device *dev, const char *device,
                              dispatch_device **out);

/* One device of a server, as its hello and Stats list them. */
typedef struct dispatch_device_info {
  char kind[16];         /* "cpu", "cuda" */
  char name[32];         /* "cpu:1": what a device string or a peer names */
  char description[96];  /* the backend's */
  uint64_t total_memory; /* the device's budget (--device-memory, else the
                            server's --max-memory) */
  uint64_t free_memory;  /* what is left of it now */
} dispatch_device_info;

/* Fills out[0..max-1] with the devices of dev's server, in the server's
 * order, and sets *n to how many it has (may be more than max); one Stats
 * round trip. LOCAL: the one in-process CPU ("cpu", "local:cpu", memory
 * 0: unbounded). Strings are cut to their fields. 0, or DISPATCH_EINVAL /
 * DISPATCH_ECONN / a deferred error of the session. */
int dispatch_device_list(dispatch_device *dev, dispatch_device_info *out,
                         int max, int *n);

#endif
