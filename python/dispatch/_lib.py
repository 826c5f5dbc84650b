"""Loads libdispatch-client.so with cffi in ABI mode (no compiler needed).

The declarations below restate the parts of client/include/dispatch_client.h
that the package calls; cffi checks nothing against the header, so a change
of a signature there must be made here too (python/tests check every call
they make against a real library and server). The *_backward helpers are
not part of the library's ABI (not exported): autodiff calls them inside.
dispatch_options and dispatch_stats start with their size, set below from
cffi's sizeof, so the library reads and writes only the fields declared
here.
"""
import os
import pathlib

import cffi

CDEF = """
const char *dispatch_version(void);
const char *dispatch_err_name(int code);
const char *dispatch_strerror(int code);

typedef enum dispatch_dtype {
  DISPATCH_F32 = 0, DISPATCH_F64 = 1, DISPATCH_I64 = 2, DISPATCH_BOOL = 3
} dispatch_dtype;
typedef enum dispatch_tensor_kind {
  DISPATCH_KIND_LOCAL = 1, DISPATCH_KIND_REMOTE = 2, DISPATCH_KIND_AUTODIFF = 3
} dispatch_tensor_kind;

typedef struct dispatch_device dispatch_device;
typedef struct dispatch_tensor dispatch_tensor;
typedef struct dispatch_grads dispatch_grads;
typedef struct dispatch_optim dispatch_optim;

typedef struct dispatch_options {
  size_t size;
  const char *token;
  const char *client_name;
  int timeout_ms;
  const char *ca_file;
  const char *cert_file;
  const char *key_file;
  const char *server_name;
  int no_resume;
  int resume_timeout_ms;
  int sync;
} dispatch_options;

typedef struct dispatch_stats {
  size_t size;
  uint64_t tensors;
  uint64_t bytes;
  uint64_t ops;
  uint64_t errors;
  uint64_t grads;
  uint64_t held_bytes;
  uint64_t session_limit;
  uint64_t queued_bytes;
  uint64_t batches;
  uint64_t sessions;
  uint64_t server_tensors;
  uint64_t server_bytes;
  uint64_t server_held_bytes;
  uint64_t server_limit;
  uint64_t protocol_errors;
  uint64_t limit_violations;
  uint64_t devices;
  uint64_t sessions_detached;
  uint64_t sessions_resumed;
  uint64_t sessions_expired;
  uint64_t inline_ops;
  uint64_t handoffs;
  uint64_t returns;
} dispatch_stats;

void dispatch_options_init(dispatch_options *opts);
int dispatch_device_open(const char *spec, const dispatch_options *opts,
                         dispatch_device **out, char *errmsg,
                         size_t errmsg_len);
void dispatch_device_close(dispatch_device *dev);
dispatch_tensor_kind dispatch_device_kind(const dispatch_device *dev);
const char *dispatch_device_spec(const dispatch_device *dev);
const char *dispatch_device_errmsg(const dispatch_device *dev);
int dispatch_device_errcode(const dispatch_device *dev);
int dispatch_device_sync(dispatch_device *dev);
int dispatch_device_stats(dispatch_device *dev, dispatch_stats *out);
int dispatch_device_set_timeout(dispatch_device *dev, int timeout_ms);
int dispatch_device_set_cache(dispatch_device *dev, uint64_t bytes);

dispatch_tensor *dispatch_tensor_ref(dispatch_tensor *t);
void dispatch_tensor_free(dispatch_tensor *t);
dispatch_tensor_kind dispatch_kind(const dispatch_tensor *t);
int dispatch_is_autodiff(const dispatch_tensor *t);
dispatch_tensor *dispatch_inner(dispatch_tensor *t);
int dispatch_tensor_ndim(const dispatch_tensor *t);
const int64_t *dispatch_tensor_shape(const dispatch_tensor *t);
dispatch_dtype dispatch_tensor_dtype(const dispatch_tensor *t);
int64_t dispatch_tensor_numel(const dispatch_tensor *t);
size_t dispatch_tensor_nbytes(const dispatch_tensor *t);
int dispatch_tensor_status(const dispatch_tensor *t);

int dispatch_tensor_from_data(dispatch_device *dev, dispatch_dtype dtype,
                              int ndim, const int64_t *shape,
                              const void *data, size_t nbytes,
                              dispatch_tensor **out);
int dispatch_tensor_read(dispatch_tensor *t, void *buf, size_t nbytes);
int dispatch_to_device(dispatch_tensor *t, dispatch_device *dev,
                       dispatch_tensor **out);

int dispatch_zeros(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                   const int64_t *shape, dispatch_tensor **out);
int dispatch_ones(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, dispatch_tensor **out);
int dispatch_full(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                  const int64_t *shape, double value, dispatch_tensor **out);
int dispatch_arange(dispatch_device *dev, dispatch_dtype dtype, double start,
                    double end, double step, dispatch_tensor **out);
int dispatch_uniform(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                     const int64_t *shape, double lo, double hi,
                     uint64_t seed, dispatch_tensor **out);
int dispatch_normal(dispatch_device *dev, dispatch_dtype dtype, int ndim,
                    const int64_t *shape, double mean, double std,
                    uint64_t seed, dispatch_tensor **out);

int dispatch_add(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_sub(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_mul(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_div(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_maximum(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_minimum(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_eq(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_ne(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_lt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_le(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_gt(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_ge(dispatch_tensor *a, dispatch_tensor *b, dispatch_tensor **out);
int dispatch_where(dispatch_tensor *mask, dispatch_tensor *a,
                   dispatch_tensor *b, dispatch_tensor **out);

int dispatch_add_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_sub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_mul_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_div_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_pow_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_rsub_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);
int dispatch_rdiv_scalar(dispatch_tensor *x, double s, dispatch_tensor **out);

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

int dispatch_sum(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
int dispatch_mean(dispatch_tensor *x, int ndims, const int64_t *dims,
                  int keepdim, dispatch_tensor **out);
int dispatch_max(dispatch_tensor *x, int ndims, const int64_t *dims,
                 int keepdim, dispatch_tensor **out);
int dispatch_argmax(dispatch_tensor *x, int ndims, const int64_t *dims,
                    int keepdim, dispatch_tensor **out);

int dispatch_reshape(dispatch_tensor *x, int ndim, const int64_t *shape,
                     dispatch_tensor **out);
int dispatch_permute(dispatch_tensor *x, int ndim, const int64_t *perm,
                     dispatch_tensor **out);
int dispatch_transpose(dispatch_tensor *x, int64_t dim0, int64_t dim1,
                       dispatch_tensor **out);
int dispatch_slice(dispatch_tensor *x, int64_t dim, int64_t start,
                   int64_t end, int64_t step, dispatch_tensor **out);
int dispatch_cat(dispatch_tensor *const *xs, int n, int64_t dim,
                 dispatch_tensor **out);
int dispatch_stack(dispatch_tensor *const *xs, int n, int64_t dim,
                   dispatch_tensor **out);
int dispatch_broadcast_to(dispatch_tensor *x, int ndim, const int64_t *shape,
                          dispatch_tensor **out);
int dispatch_index_select(dispatch_tensor *x, int64_t dim,
                          dispatch_tensor *index, dispatch_tensor **out);
int dispatch_cast(dispatch_tensor *x, dispatch_dtype dtype,
                  dispatch_tensor **out);

int dispatch_matmul(dispatch_tensor *a, dispatch_tensor *b,
                    dispatch_tensor **out);

int dispatch_softmax(dispatch_tensor *x, int64_t dim, dispatch_tensor **out);
int dispatch_log_softmax(dispatch_tensor *x, int64_t dim,
                         dispatch_tensor **out);
int dispatch_cross_entropy(dispatch_tensor *logits, dispatch_tensor *labels,
                           dispatch_tensor **out);
int dispatch_mse(dispatch_tensor *a, dispatch_tensor *b,
                 dispatch_tensor **out);
int dispatch_conv2d(dispatch_tensor *x, dispatch_tensor *w, int64_t stride_h,
                    int64_t stride_w, int64_t pad_h, int64_t pad_w,
                    int64_t dil_h, int64_t dil_w, dispatch_tensor **out);
int dispatch_max_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
int dispatch_avg_pool2d(dispatch_tensor *x, int64_t kh, int64_t kw,
                        int64_t stride_h, int64_t stride_w, int64_t pad_h,
                        int64_t pad_w, dispatch_tensor **out);
int dispatch_dropout(dispatch_tensor *x, double p, uint64_t seed,
                     dispatch_tensor **out);

int dispatch_autodiff(dispatch_tensor *t, dispatch_tensor **out);
int dispatch_backward_ex(dispatch_tensor *loss, int retain,
                         dispatch_grads **out);
int dispatch_grad(dispatch_grads *grads, dispatch_tensor *t,
                  dispatch_tensor **out);
void dispatch_grads_free(dispatch_grads *grads);

int dispatch_sgd_new(dispatch_tensor *const *params, int n, double lr,
                     double momentum, double weight_decay,
                     dispatch_optim **out);
int dispatch_adam_new(dispatch_tensor *const *params, int n, double lr,
                      double beta1, double beta2, double eps,
                      dispatch_optim **out);
int dispatch_optim_step(dispatch_optim *opt, dispatch_grads *grads);
int dispatch_optim_set_lr(dispatch_optim *opt, double lr);
void dispatch_optim_free(dispatch_optim *opt);

typedef struct dispatch_graph dispatch_graph;
typedef struct dispatch_graph_io {
  dispatch_dtype dtype;
  int ndim;
  const int64_t *shape;
  void *data;
  size_t nbytes;
} dispatch_graph_io;
int dispatch_graph_begin(dispatch_device *dev);
int dispatch_graph_output(dispatch_tensor *t);
int dispatch_graph_end(dispatch_device *dev, dispatch_graph **out);
int dispatch_graph_replay(dispatch_graph *g, const dispatch_graph_io *in,
                          int n_in, const dispatch_graph_io *out, int n_out);
void dispatch_graph_free(dispatch_graph *g);
"""


def _candidates():
    """Where the library is looked for, first match wins: the path in
    DISPATCH_CLIENT_LIB, the build/ folder of the checkout this package
    sits in, then the system loader's search path (make install)."""
    env = os.environ.get("DISPATCH_CLIENT_LIB")
    if env:
        return [env]
    root = pathlib.Path(__file__).resolve().parents[2]
    return [str(root / "build" / "libdispatch-client.so"),
            "libdispatch-client.so.0"]


def _load():
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ffi, ffi.dlopen(path), path
        except OSError as e:
            errors.append(str(e))
    raise ImportError(
        "dispatch: cannot load libdispatch-client (build it with `make`, "
        "or set DISPATCH_CLIENT_LIB to its path): " + "; ".join(errors))


ffi, lib, path = _load()
