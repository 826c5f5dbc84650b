"""Optimizers: SGD, Adam and AdamW over tracked leaves, updated in place
on the device where the parameters live (remote: one Step message per
step), optionally clipped by global norm; and lr_cosine, the cosine
learning rate with warmup."""
import math

from ._core import Grads, Tensor, _hd, ffi, lib


class Optimizer:
    """Base of SGD and Adam. The C optimizer takes its own reference to
    each parameter, so the parameters' Tensor objects may go; it is freed
    when this object is collected or on free()."""

    def __init__(self, params, lr, make):
        params = list(params)
        if not params or not all(isinstance(p, Tensor) for p in params):
            raise TypeError("an optimizer needs a non-empty list of tracked "
                            "tensors")
        self._dev = params[0]._dev
        self._lr = float(lr)
        self.params = params
        arr = ffi.new("dispatch_tensor *[]", [_hd(p) for p in params])
        out = ffi.new("dispatch_optim **")
        rc = make(arr, len(params), out)
        if rc < 0:
            self._dev._raise(rc)
        self._h = ffi.gc(out[0], self._dev._state.free_optim)

    def step(self, grads=None):
        """One update of every parameter with its gradient in grads (by
        default the device's last backward). Remote: queued, errors surface
        at the next wait (a read, sync or stats)."""
        if grads is None:
            grads = self._dev._last_grads
        if not isinstance(grads, Grads) or grads._h is None:
            raise ValueError("step() needs the Grads of a backward pass")
        if self._h is None or self._dev._state.h is None:
            raise ValueError("the optimizer or its device was freed")
        rc = lib.dispatch_optim_step(self._h, grads._h)
        if rc < 0:
            self._dev._raise(rc)

    @property
    def clip(self):
        """max_norm of the global-norm clip of every later step (None: off),
        as torch.nn.utils.clip_grad_norm_(params, max_norm) before each
        step, but inside the step itself (remote: still one message)."""
        return getattr(self, "_clip", None)

    @clip.setter
    def clip(self, max_norm):
        if self._h is None or self._dev._state.h is None:
            raise ValueError("the optimizer or its device was freed")
        rc = lib.dispatch_optim_set_clip(
            self._h, 0.0 if max_norm is None else float(max_norm))
        if rc < 0:
            self._dev._raise(rc)
        self._clip = None if not max_norm else float(max_norm)

    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        if self._h is None or self._dev._state.h is None:
            raise ValueError("the optimizer or its device was freed")
        rc = lib.dispatch_optim_set_lr(self._h, float(value))
        if rc < 0:
            self._dev._raise(rc)
        self._lr = float(value)

    def free(self):
        if self._h is not None:
            h, self._h = self._h, None
            ffi.release(h)
            self._dev._state.drain()


class SGD(Optimizer):
    """v = momentum * v + grad + weight_decay * p;  p = p - lr * v."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr, lambda a, n, out: lib.dispatch_sgd_new(
            a, n, float(lr), float(momentum), float(weight_decay), out))


class Adam(Optimizer):
    """Adam with bias correction (Kingma and Ba)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        b1, b2 = betas
        super().__init__(params, lr, lambda a, n, out: lib.dispatch_adam_new(
            a, n, float(lr), float(b1), float(b2), float(eps), out))


def _groups(params, weight_decay):
    """torch's parameter groups flattened: (tensors, one decay each). params
    is a list of tensors or of dicts {"params": [...], "weight_decay": wd}
    (a group without "weight_decay" takes the default); weight_decay is one
    number or a list with one per tensor."""
    params = list(params)
    if params and all(isinstance(g, dict) for g in params):
        if not isinstance(weight_decay, (int, float)):
            raise TypeError("with parameter groups weight_decay is a number "
                            "(each group may set its own)")
        ts, wds = [], []
        for g in params:
            unknown = set(g) - {"params", "weight_decay"}
            if unknown:
                raise ValueError("AdamW: a group takes only 'params' and "
                                 "'weight_decay', not %s" % sorted(unknown))
            group = g["params"]
            group = [group] if isinstance(group, Tensor) else list(group)
            ts += group
            wds += [float(g.get("weight_decay", weight_decay))] * len(group)
        return ts, wds
    if isinstance(weight_decay, (int, float)):
        return params, [float(weight_decay)] * len(params)
    wds = [float(w) for w in weight_decay]
    if len(wds) != len(params):
        raise ValueError("AdamW: %d weight decays for %d parameters"
                         % (len(wds), len(params)))
    return params, wds


class AdamW(Optimizer):
    """torch.optim.AdamW: p *= 1 - lr * weight_decay, then Adam's update
    with bias correction. weight_decay is one number, a list with one per
    parameter, or set per group with torch's parameter groups
    ([{"params": [...], "weight_decay": 0.0}, ...]), so norms and biases can
    be left out. clip: max_norm of a global-norm gradient clip taken inside
    every step (None: none); see Optimizer.clip."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, clip=None):
        b1, b2 = betas
        params, wds = _groups(params, weight_decay)
        wd = ffi.new("double[]", wds) if wds else ffi.NULL
        super().__init__(params, lr, lambda a, n, out: lib.dispatch_adamw_new(
            a, n, float(lr), float(b1), float(b2), float(eps), wd, out))
        self.weight_decay = wds
        if clip is not None:
            self.clip = clip


def lr_cosine(step, warmup, total, lr_max, lr_min):
    """The learning rate of step (0, 1, ...): linear warmup to lr_max over
    `warmup` steps, then cosine decay to lr_min at `total`, lr_min after.
    The C library's dispatch_lr_cosine, so C and Python runs agree."""
    for name, v in (("step", step), ("warmup", warmup), ("total", total)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError("lr_cosine: %s must be an int" % name)
    if not (math.isfinite(lr_max) and math.isfinite(lr_min)):
        raise ValueError("lr_cosine: lr_max and lr_min must be finite")
    return lib.dispatch_lr_cosine(step, warmup, total, float(lr_max),
                                  float(lr_min))
