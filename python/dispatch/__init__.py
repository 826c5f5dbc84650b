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
from typing import Any, Optional, Sequence, Union

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
from .checkpoint import load, save  # noqa: F401
from .devices import DeviceInfo, device_list  # noqa: F401
from . import nn, optim  # noqa: F401,E402 (dispatch.nn, dispatch.optim)

# the public functions' annotations
_Shape = Union[int, Sequence[int]]
_DType = Any  # a numpy dtype or type, or a name such as "float32"

__version__: str = _ffi.string(_lib.dispatch_version()).decode()

globals().update(_op_functions)
# one exception class per error code: dispatch.ESHAPE, dispatch.EDOUBLEWRAP..
globals().update(error_classes)


def tensor(data: Any, dtype: _DType = None, requires_grad: bool = False,
           device: Optional[Device] = None) -> Tensor:
    """A tensor holding a copy of data on device (default: the device of
    env DISPATCH_DEVICE, else local). See Device.tensor."""
    return (device or default_device()).tensor(data, dtype, requires_grad)


def zeros(shape: _Shape, dtype: _DType = float32,
          device: Optional[Device] = None) -> Tensor:
    """A tensor of zeros (see Device.zeros)."""
    return (device or default_device()).zeros(shape, dtype)


def ones(shape: _Shape, dtype: _DType = float32,
         device: Optional[Device] = None) -> Tensor:
    """A tensor of ones (see Device.ones)."""
    return (device or default_device()).ones(shape, dtype)


def full(shape: _Shape, value: float, dtype: _DType = float32,
         device: Optional[Device] = None) -> Tensor:
    """A tensor filled with value (see Device.full)."""
    return (device or default_device()).full(shape, value, dtype)


def arange(start: float, end: Optional[float] = None, step: float = 1,
           dtype: _DType = float32,
           device: Optional[Device] = None) -> Tensor:
    """start, start + step, ... up to end, excluded (see Device.arange)."""
    return (device or default_device()).arange(start, end, step, dtype)


def uniform(shape: _Shape, low: float = 0.0, high: float = 1.0,
            seed: int = 0, dtype: _DType = float32,
            device: Optional[Device] = None) -> Tensor:
    """Uniform in [low, high) from seed (see Device.uniform)."""
    return (device or default_device()).uniform(shape, low, high, seed, dtype)


def normal(shape: _Shape, mean: float = 0.0, std: float = 1.0,
           seed: int = 0, dtype: _DType = float32,
           device: Optional[Device] = None) -> Tensor:
    """Normal(mean, std) from seed (see Device.normal)."""
    return (device or default_device()).normal(shape, mean, std, seed, dtype)


def scope(device: Optional[Device] = None) -> Scope:
    """Context manager: see Device.scope."""
    return (device or default_device()).scope()


def as_tensor(x: Any, like: Optional[Tensor] = None) -> Tensor:
    """x as a Tensor (a Tensor is returned as it is); numbers and arrays go
    to like's device and, for numbers, its dtype."""
    return _as_tensor(x, like)
