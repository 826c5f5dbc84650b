/* AUTODIFF tensors: the one-wrap rule, backward and gradients. LOCAL
 * tensors use common's engine in the device's ctx; REMOTE ones keep the
 * tape and the gradients on the server (the kind's row, local.c and
 * remote.c). */
#include "client_internal.h"

int dispatch_autodiff(dispatch_tensor *t, dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!out) return DISPATCH_EINVAL;
  if (!t) return dispatch__null_input(NULL, "autodiff", 0);
  dispatch_device *dev = t->dev;
  DISPATCH__GUARD(dev, "autodiff");
  if (dispatch_tensor_status(t)) return dispatch__poisoned_input(dev, t);
  if (t->kind == DISPATCH_KIND_AUTODIFF)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDOUBLEWRAP,
                                         "autodiff should not wrap an "
                                         "autodiff tensor"));
  if (t->tracked)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDOUBLEWRAP,
                                         "autodiff should not wrap an "
                                         "autodiff tensor (this tensor is "
                                         "already wrapped)"));
  if (!dsp_dtype_is_float(t->meta.dtype))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDTYPE,
                                         "autodiff: only float tensors can "
                                         "be tracked, got %s",
                                         dsp_dtype_name(t->meta.dtype)));
  dispatch_tensor *w;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_AUTODIFF, &t->meta, 0, &w);
  if (rc < 0) return dispatch__ret(dev, rc);
  if ((rc = dev->ops->track(t)) == 0) rc = dispatch__sync_call(dev);
  if (rc < 0) {
    dispatch__tensor_unref(w);
    return dispatch__ret(dev, rc);
  }
  t->tracked = 1;
  w->inner = dispatch_tensor_ref(t);
  if (dev->capture) dispatch__graph_track(t);
  dispatch__scope_adopt(w);
  *out = w;
  return 0;
}

static int grads_new(dispatch_device *dev, dispatch_grads **out) {
  *out = NULL;
  dispatch_grads *g = dsp_calloc(1, sizeof *g);
  if (!g)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "backward: out of memory");
  g->dev = dev;
  *out = g;
  return 0;
}

static void grads_link(dispatch_grads *g) {
  dispatch_device *dev = g->dev;
  g->next = dev->grads;
  if (dev->grads) dev->grads->prev = g;
  dev->grads = g;
}

int dispatch_backward_ex(dispatch_tensor *loss, int retain,
                         dispatch_grads **out) {
  if (out) *out = NULL;
  if (!out) return DISPATCH_EINVAL;
  if (!loss) return dispatch__null_input(NULL, "backward", 0);
  dispatch_device *dev = loss->dev;
  DISPATCH__GUARD(dev, "backward");
  /* REMOTE: known failed, so no Backward round trip */
  if (dispatch_tensor_status(loss))
    return dispatch__poisoned_input(dev, loss);
  if (loss->kind != DISPATCH_KIND_AUTODIFF)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOTTRACKED,
                                         "backward: the loss is not an "
                                         "AUTODIFF tensor"));
  if (loss->numel != 1)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOTSCALAR,
                                         "backward: the loss has %lld "
                                         "elements, needs one",
                                         (long long)loss->numel));
  dispatch_grads *g;
  int rc = grads_new(dev, &g);
  if (rc < 0) return dispatch__ret(dev, rc);
  rc = dev->ops->backward(loss->inner, retain, g);
  if (rc < 0) {
    dsp_free(g);
    return dispatch__ret(dev, rc);
  }
  grads_link(g);
  if (dev->capture) dispatch__graph_backward(loss->inner, retain, g);
  *out = g;
  return 0;
}

int dispatch_backward(dispatch_tensor *loss, dispatch_grads **out) {
  return dispatch_backward_ex(loss, 0, out);
}

int dispatch_grad(dispatch_grads *grads, dispatch_tensor *t,
                  dispatch_tensor **out) {
  if (out) *out = NULL;
  if (!out) return DISPATCH_EINVAL;
  if (!grads || !t)
    return dispatch__null_input(grads ? grads->dev : t ? t->dev : NULL,
                                "grad", grads ? 1 : 0);
  dispatch_device *dev = grads->dev;
  DISPATCH__GUARD(dev, "grad");
  if (t->dev != dev)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                                         "grad: the tensor lives on \"%s\", "
                                         "the gradients on \"%s\"",
                                         t->dev->spec, dev->spec));
  dispatch_tensor *leaf = dispatch_inner(t);
  if (leaf->status) return dispatch__poisoned_input(dev, t);
  if (!leaf->tracked)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOTTRACKED,
                                         "grad: the tensor is not tracked "
                                         "(wrap it with dispatch_autodiff)"));
  dispatch_tensor *r;
  int rc = dev->ops->grad(grads, leaf, &r);
  if (rc < 0) return dispatch__ret(dev, rc);
  if ((rc = dispatch__sync_call(dev)) < 0) { /* REMOTE: its id is poisoned */
    dispatch__tensor_unref(r);
    return dispatch__ret(dev, rc);
  }
  dispatch__scope_adopt(r);
  if (dev->capture) dispatch__graph_grad(grads, leaf, r);
  *out = r;
  return 0;
}

void dispatch_grads_free(dispatch_grads *g) {
  if (!g) return;
  dispatch_device *dev = g->dev;
  if (g->prev)
    g->prev->next = g->next;
  else
    dev->grads = g->next;
  if (g->next) g->next->prev = g->prev;
  if (g->gslot && dev->capture) dispatch__graph_forget_grads(g);
  dev->ops->grads_free(g);
  dsp_free(g);
}
