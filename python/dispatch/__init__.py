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
# the half dtypes (issue 24): float16 is numpy's; bfloat16's arrays hold
# raw uint16 values, converted by bf16_to_f32 / f32_to_bf16
from ._core import (  # noqa: F401
    bf16_to_f32, bfloat16, f32_to_bf16, float16, half)
# torch-like tensors (issue 26): grad mode, seeds, the operators' functions
from ._core import (  # noqa: F401
    MaxMin, all, any, enable_grad, floor_divide, is_grad_enabled,
    manual_seed, no_grad, pow, remainder, set_grad_enabled)
from ._core import _resolve_device
# the op functions, one per row of the op table (dispatch.add, .relu,
# .sum, .conv2d, ...): see _core.op_functions
from ._core import op_functions as _op_functions
from ._core import _as_tensor
from ._lib import ffi as _ffi, lib as _lib, path as library_path
from .optim import SGD, Adam, AdamW, Optimizer, lr_cosine  # noqa: F401
from .checkpoint import load, save  # noqa: F401
from .amp import GradScaler, autocast  # noqa: F401
from .devices import DeviceInfo, device_list  # noqa: F401
# dispatch.amp, .distributed, .nn, .optim
from . import amp, distributed, nn, optim  # noqa: F401,E402

# the public functions' annotations
_Shape = Union[int, Sequence[int]]
_DType = Any  # a numpy dtype or type, dispatch.bfloat16, or a name ("float32")
_DevArg = Union[None, str, Device]  # a Device or a spec such as "local"

__version__: str = _ffi.string(_lib.dispatch_version()).decode()

globals().update(_op_functions)
# one exception class per error code: dispatch.ESHAPE, dispatch.EDOUBLEWRAP..
globals().update(error_classes)


def tensor(data: Any, dtype: _DType = None, requires_grad: bool = False,
           device: _DevArg = None) -> Tensor:
    """A tensor holding a copy of data on device (a Device or a spec;
    default: the device of env DISPATCH_DEVICE, else local). See
    Device.tensor."""
    return _dev(device).tensor(data, dtype, requires_grad)


def _dev(device: _DevArg) -> Device:
    return default_device() if device is None else _resolve_device(device)


def zeros(*size: _Shape, dtype: _DType = float32, device: _DevArg = None,
          requires_grad: bool = False) -> Tensor:
    """zeros(3, 4) or zeros((3, 4)) on device (a Device or a spec; default:
    the default device)."""
    return _dev(device).zeros(*size, dtype=dtype, requires_grad=requires_grad)


def ones(*size: _Shape, dtype: _DType = float32, device: _DevArg = None,
         requires_grad: bool = False) -> Tensor:
    """ones(3, 4) or ones((3, 4)) on device (see zeros)."""
    return _dev(device).ones(*size, dtype=dtype, requires_grad=requires_grad)


empty = zeros


def full(size: _Shape, fill_value: float, dtype: _DType = float32,
         device: _DevArg = None, requires_grad: bool = False) -> Tensor:
    """A tensor of size filled with fill_value on device."""
    return _dev(device).full(size, fill_value, dtype, requires_grad)


def arange(start: float, end: Optional[float] = None, step: float = 1,
           dtype: _DType = None, device: _DevArg = None) -> Tensor:
    """start, start + step, ... up to end, excluded; int64 when all three
    are ints and no dtype is given, as torch's."""
    return _dev(device).arange(start, end, step, dtype)


def rand(*size: _Shape, dtype: _DType = float32, device: _DevArg = None,
         seed: Optional[int] = None, requires_grad: bool = False) -> Tensor:
    """Uniform in [0, 1), from manual_seed's stream unless seed is given
    (the same numbers on every device; not torch's numbers)."""
    return _dev(device).rand(*size, dtype=dtype, seed=seed,
                             requires_grad=requires_grad)


def randn(*size: _Shape, dtype: _DType = float32, device: _DevArg = None,
          seed: Optional[int] = None, requires_grad: bool = False) -> Tensor:
    """Standard normal, from manual_seed's stream unless seed is given."""
    return _dev(device).randn(*size, dtype=dtype, seed=seed,
                              requires_grad=requires_grad)


def randint(low: int, high: Any = None, size: _Shape = (), dtype: _DType = int64,
            device: _DevArg = None, seed: Optional[int] = None) -> Tensor:
    """randint(high, size) or randint(low, high, size), as torch's."""
    if high is not None and not isinstance(high, int) and size == ():
        low, high, size = 0, low, high  # randint(high, size)
    return _dev(device).randint(low, high, size, dtype, seed)


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
