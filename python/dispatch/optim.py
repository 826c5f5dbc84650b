"""Optimizers: SGD and Adam over tracked leaves, updated in place on the
device where the parameters live (remote: one Step message per step)."""
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
