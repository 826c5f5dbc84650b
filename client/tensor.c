/* Tensor handles: lifetime, queries, data in and out. */
#include <string.h>

#include "client_internal.h"

static size_t meta_nbytes(const dsp_meta *m, int64_t numel) {
  return (size_t)numel * dsp_dtype_size(m->dtype);
}

int dispatch__tensor_new(dispatch_device *dev, dispatch_tensor_kind kind,
                         const dsp_meta *m, int scoped,
                         dispatch_tensor **out) {
  *out = NULL;
  int64_t numel;
  int rc = dsp_meta_numel(dev->ctx, m, &numel);
  if (rc < 0) return rc;
  dispatch_tensor *t = dsp_calloc(1, sizeof *t);
  if (!t)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "out of memory (tensor handle)");
  t->refcount = 1;
  t->kind = kind;
  t->dev = dev;
  t->meta = *m;
  t->numel = numel;
  t->anext = dev->all;
  if (dev->all) dev->all->aprev = t;
  dev->all = t;
  if (kind == DISPATCH_KIND_LOCAL) {
    dev->local_stats.tensors++;
    dev->local_stats.bytes += meta_nbytes(m, numel);
  }
  if (scoped) dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

void dispatch__tensor_destroy(dispatch_tensor *t) {
  dispatch_device *dev = t->dev;
  if (t->kind == DISPATCH_KIND_LOCAL) {
    dsp_tensor_unref(t->local);
    dev->local_stats.tensors--;
    dev->local_stats.bytes -= meta_nbytes(&t->meta, t->numel);
  }
  dsp_free(t->poison_msg);
  dsp_free(t);
}

dispatch_tensor *dispatch_tensor_ref(dispatch_tensor *t) {
  if (t) t->refcount++;
  return t;
}

/* At the last reference: leave the scope and the device's list, release
 * the backing (REMOTE: queue a Free), then drop the wrapper's reference to
 * the wrapped tensor, which stays in its scope while others remain (the
 * wrapper's reference was never the scope's). */
void dispatch__tensor_unref(dispatch_tensor *t) {
  while (t && --t->refcount <= 0) {
    dispatch_device *dev = t->dev;
    dispatch__scope_forget(t);
    if (t->aprev)
      t->aprev->anext = t->anext;
    else
      dev->all = t->anext;
    if (t->anext) t->anext->aprev = t->aprev;
    if (t->kind == DISPATCH_KIND_REMOTE && t->id)
      dispatch__remote_free(dev, t->id, 0);
    if (t->gslot && dev->capture) dispatch__graph_forget(t);
    dispatch_tensor *inner = t->inner;
    dispatch__tensor_destroy(t);
    t = inner; /* iterative: drop the wrapper's reference to its inner */
  }
}

/* The reference a call hands out is the one a scope holds while the
 * tensor is registered there, so the caller's free takes the tensor out of
 * its scope: freeing what a call returned is then right whether or not a
 * scope was open, and a reference the caller added with dispatch_tensor_ref
 * is never dropped by the scope's end. */
void dispatch_tensor_free(dispatch_tensor *t) {
  if (!t) return;
  dispatch__scope_forget(t); /* the scope's reference is the one dropped */
  dispatch__tensor_unref(t);
}

dispatch_tensor_kind dispatch_kind(const dispatch_tensor *t) { return t->kind; }

int dispatch_is_autodiff(const dispatch_tensor *t) {
  return t && t->kind == DISPATCH_KIND_AUTODIFF;
}

dispatch_tensor *dispatch_inner(dispatch_tensor *t) {
  if (t && t->kind == DISPATCH_KIND_AUTODIFF) return t->inner;
  return t;
}

dispatch_device *dispatch_tensor_device(const dispatch_tensor *t) {
  return t ? t->dev : NULL;
}

int dispatch_tensor_ndim(const dispatch_tensor *t) { return t->meta.ndim; }

const int64_t *dispatch_tensor_shape(const dispatch_tensor *t) {
  return t->meta.shape;
}

int64_t dispatch_tensor_dim(const dispatch_tensor *t, int i) {
  int nd = t->meta.ndim;
  if (i < 0) i += nd;
  if (i < 0 || i >= nd) return -1;
  return t->meta.shape[i];
}

dispatch_dtype dispatch_tensor_dtype(const dispatch_tensor *t) {
  return (dispatch_dtype)t->meta.dtype;
}

int64_t dispatch_tensor_numel(const dispatch_tensor *t) { return t->numel; }

size_t dispatch_tensor_nbytes(const dispatch_tensor *t) {
  return meta_nbytes(&t->meta, t->numel);
}

int dispatch_tensor_status(const dispatch_tensor *t) {
  if (!t) return DISPATCH_EINVAL;
  if (t->kind == DISPATCH_KIND_AUTODIFF) return t->inner->status;
  return t->status;
}

static int make_meta(dispatch_device *dev, const char *fn, int dtype,
                     int ndim, const int64_t *shape, dsp_meta *m) {
  memset(m, 0, sizeof *m);
  if (!dsp_dtype_valid(dtype))
    return dsp_seterr(dev->ctx, DISPATCH_EDTYPE, "%s: dtype %d is not valid",
                      fn, dtype);
  if (ndim < 0 || ndim > DSP_MAX_DIMS || (ndim > 0 && !shape))
    return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "%s: rank %d is outside 0..%d", fn, ndim, DSP_MAX_DIMS);
  m->dtype = (dsp_dtype)dtype;
  m->ndim = ndim;
  for (int i = 0; i < ndim; i++) m->shape[i] = shape[i];
  return dsp_meta_check(dev->ctx, m);
}

/* LOCAL copies the bytes into a fresh dsp tensor; REMOTE queues one
 * Upload frame whose bulk part is the bytes. */
int dispatch_tensor_from_data(dispatch_device *dev, dispatch_dtype dtype,
                              int ndim, const int64_t *shape,
                              const void *data, size_t nbytes,
                              dispatch_tensor **out) {
  if (!dev || !out) return DISPATCH_EINVAL;
  *out = NULL;
  DISPATCH__GUARD(dev, "tensor_from_data");
  dsp_meta m;
  int rc = make_meta(dev, "tensor_from_data", (int)dtype, ndim, shape, &m);
  if (rc < 0) return dispatch__ret(dev, rc);
  int64_t numel;
  dsp_meta_numel(dev->ctx, &m, &numel);
  if (nbytes != meta_nbytes(&m, numel) || (nbytes && !data)) {
    char sb[128];
    return dispatch__ret(
        dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "tensor_from_data: got %zu bytes, %s %s needs %zu",
                        nbytes, dsp_dtype_name(m.dtype),
                        dsp_shape_str(&m, sb, sizeof sb),
                        meta_nbytes(&m, numel)));
  }
  /* checked here, not left to the server, so LOCAL and REMOTE refuse the
   * same bytes at the call with the same message */
  if (m.dtype == DSP_BOOL && (rc = dsp_check_bool_bytes(dev->ctx, data, nbytes)) < 0)
    return dispatch__ret(dev, rc);
  if (dev->kind == DISPATCH_KIND_LOCAL) {
    dsp_tensor *lt;
    rc = dsp_tensor_from_data(dev->ctx, &m, data, nbytes, &lt);
    if (rc < 0) return dispatch__ret(dev, rc);
    dispatch_tensor *t;
    rc = dispatch__tensor_new(dev, DISPATCH_KIND_LOCAL, &m, 1, &t);
    if (rc < 0) {
      dsp_tensor_unref(lt);
      return dispatch__ret(dev, rc);
    }
    t->local = lt;
    if (dev->capture) dispatch__graph_input(t);
    *out = t;
    return 0;
  }
  dispatch_tensor *t;
  rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &m, 0, &t);
  if (rc < 0) return dispatch__ret(dev, rc);
  t->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_upload(dev, t->id, &m, data, nbytes);
  if (rc < 0) {
    t->id = 0; /* never reached the server: nothing to Free */
    dispatch__tensor_unref(t);
    return dispatch__ret(dev, rc);
  }
  if ((rc = dispatch__sync_call(dev)) < 0) { /* sync mode: its answer */
    dispatch__tensor_unref(t);
    return dispatch__ret(dev, rc);
  }
  dispatch__scope_adopt(t);
  if (dev->capture) dispatch__graph_input(t);
  *out = t;
  return 0;
}

int dispatch_tensor_read(dispatch_tensor *t, void *buf, size_t nbytes) {
  if (!t) return dispatch__null_input(NULL, "tensor_read", 0);
  dispatch_device *dev = t->dev;
  DISPATCH__GUARD(dev, "tensor_read");
  dispatch_tensor *c = dispatch_inner(t);
  /* known poisoned: the answer is here, no Read round trip */
  if (c->status) return dispatch__poisoned_input(dev, t);
  size_t need = dispatch_tensor_nbytes(c);
  if (nbytes != need || (nbytes && !buf))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "tensor_read: buffer of %zu bytes, "
                                         "tensor has %zu",
                                         nbytes, need));
  if (c->kind == DISPATCH_KIND_LOCAL) {
    if (!nbytes) return 0;
    int rc = dsp_tensor_read(dev->ctx, c->local, buf, nbytes);
    if (rc < 0)
      return dispatch__ret(
          dev, dsp_seterr(dev->ctx, rc, "tensor_read: copy out failed"));
    return 0;
  }
  return dispatch__ret(dev, dispatch__remote_read(dev, c->id, buf, nbytes));
}

/* Between two devices of one session (a device and its peers) the server
 * copies: one ToDevice request, no bytes through the client. */
static int move_in_server(dispatch_tensor *c, dispatch_device *dev,
                          dispatch_tensor **out) {
  const char *target = dev->device ? dev->device : dev->conn->server_device;
  if (!target)
    return dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                      "to_device: the server named no session device");
  dispatch_tensor *t;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &c->meta, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  rc = dispatch__remote_to_device(dev, c->id, t->id, target);
  if (rc < 0) {
    t->id = 0;
    dispatch__tensor_unref(t);
    return rc;
  }
  if ((rc = dispatch__sync_call(dev)) < 0) {
    dispatch__tensor_unref(t);
    return rc;
  }
  dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

int dispatch_to_device(dispatch_tensor *t, dispatch_device *dev,
                       dispatch_tensor **out) {
  if (!dev || !out) return DISPATCH_EINVAL;
  *out = NULL;
  DISPATCH__GUARD(dev, "to_device");
  if (!t) return dispatch__null_input(dev, "to_device", 0);
  dispatch_tensor *c = dispatch_inner(t);
  if (c->status) return dispatch__poisoned_input(dev, t);
  if (c->kind == DISPATCH_KIND_REMOTE && dev->kind == DISPATCH_KIND_REMOTE &&
      c->dev->conn == dev->conn)
    return dispatch__ret(dev, move_in_server(c, dev, out));
  size_t n = dispatch_tensor_nbytes(t);
  void *tmp = dsp_malloc(n);
  if (!tmp)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "to_device: out of memory (%zu bytes)",
                                         n));
  int rc = dispatch_tensor_read(t, tmp, n);
  if (rc < 0) {
    dsp_free(tmp);
    if (t->dev != dev)
      dsp_seterr(dev->ctx, rc, "to_device: reading the source failed: %s",
                 dsp_ctx_errmsg(t->dev->ctx));
    return dispatch__ret(dev, rc);
  }
  rc = dispatch_tensor_from_data(dev, (dispatch_dtype)t->meta.dtype,
                                 t->meta.ndim, t->meta.shape, tmp, n, out);
  dsp_free(tmp);
  return rc;
}
