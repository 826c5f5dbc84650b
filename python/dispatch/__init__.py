"""dispatch: tensors and autodiff on this process or a dispatch-server.

    import numpy as np, dispatch
    dev = dispatch.device("tcp://127.0.0.1:7070")   # or "local"
    x = dev.tensor(np.ones((2, 2), np.float32))
    w = dev.ones((2, 2)).track()                    # a tracked leaf
    loss = (x @ w).sum()
    grads = loss.backward()
    print(grads[w].numpy())

A binding over libdispatch-client (cffi, ABI mode). See python/README.md.
"""
from ._core import (  # noqa: F401
    Device, DispatchError, Grads, Scope, Tensor, bool_, codes,
    default_device, device, error_classes, float32, float64, int64, keep,
    track)
# the op functions, one per row of the op table (dispatch.add, .relu,
# .sum, .conv2d, ...): see _core.op_functions
from ._core import op_functions as _op_functions
from ._core import _as_tensor
from ._lib import ffi as _ffi, lib as _lib, path as library_path
from .optim import SGD, Adam, AdamW, Optimizer, lr_cosine  # noqa: F401
from . import nn, optim  # noqa: F401,E402 (dispatch.nn, dispatch.optim)

__version__ = _ffi.string(_lib.dispatch_version()).decode()

globals().update(_op_functions)
# one exception class per error code: dispatch.ESHAPE, dispatch.EDOUBLEWRAP..
globals().update(error_classes)


def tensor(data, dtype=None, requires_grad=False, device=None):
    """A tensor holding a copy of data on device (default: the device of
    env DISPATCH_DEVICE, else local). See Device.tensor."""
    return (device or default_device()).tensor(data, dtype, requires_grad)


def zeros(shape, dtype=float32, device=None):
    return (device or default_device()).zeros(shape, dtype)


def ones(shape, dtype=float32, device=None):
    return (device or default_device()).ones(shape, dtype)


def full(shape, value, dtype=float32, device=None):
    return (device or default_device()).full(shape, value, dtype)


def arange(start, end=None, step=1, dtype=float32, device=None):
    return (device or default_device()).arange(start, end, step, dtype)


def uniform(shape, low=0.0, high=1.0, seed=0, dtype=float32, device=None):
    return (device or default_device()).uniform(shape, low, high, seed, dtype)


def normal(shape, mean=0.0, std=1.0, seed=0, dtype=float32, device=None):
    return (device or default_device()).normal(shape, mean, std, seed, dtype)


def scope(device=None):
    """Context manager: see Device.scope."""
    return (device or default_device()).scope()


def as_tensor(x, like=None):
    """x as a Tensor (a Tensor is returned as it is); numbers and arrays go
    to like's device and, for numbers, its dtype."""
    return _as_tensor(x, like)
