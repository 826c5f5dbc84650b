"""Checkpoints: dispatch.save and dispatch.load over the library's
dispatch_save / dispatch_load / dispatch_optim_load.

The file is the library's own safetensors file (the same bytes a C
program writes with dispatch_save), so numpy, safetensors, PyTorch and a
C program read it, and a file a C program wrote loads here. An
optimizer's state (SGD's velocities, Adam's and AdamW's two moments and
step count) goes in under the names "optim.<i>.m", "optim.<i>.v",
"optim.<i>.momentum" and "optim.step", with the metadata
"dispatch.optim"; with a GradScaler attached to the optimizer, also its
scale and counts ("optim.loss_scale", "optim.loss_scale.counts"). The
hyperparameters do not: make the optimizer (and the scaler) again, with
the same ones, over the loaded parameters, attach the scaler
(GradScaler.attach) and hand the optimizer to load.
"""
import os
from collections.abc import Mapping
from typing import Dict, Iterable, Optional, Union

from ._core import Device, Tensor, _hd, ffi, lib

__all__ = ["save", "load"]

_PathLike = Union[str, bytes, "os.PathLike[str]"]


def _named(tensors) -> Dict[str, Tensor]:
    """name -> Tensor from a dict, an object with state_dict() (a
    dispatch.nn.Module), or a sequence of tensors (named "0", "1", ...)."""
    if hasattr(tensors, "state_dict") and not isinstance(tensors, Mapping):
        tensors = tensors.state_dict()
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, Tensor):
        raise TypeError("save() takes a dict of tensors (or a list), not one "
                        "Tensor: save(path, {'name': t})")
    else:
        items = [(str(i), t) for i, t in enumerate(tensors)]
    for name, t in items:
        if not isinstance(name, str):
            raise TypeError(f"save(): tensor names are str, not "
                            f"{type(name).__name__} ({name!r})")
        if not isinstance(t, Tensor):
            raise TypeError(f"save(): {name!r} is a {type(t).__name__}, not a "
                            "dispatch Tensor")
    return dict(items)


def _optim_handle(optimizer):
    h = getattr(optimizer, "_h", None)
    dev = getattr(optimizer, "_dev", None)
    if h is None or not isinstance(dev, Device):
        raise TypeError(f"optimizer: a live dispatch optimizer (SGD, Adam, "
                        f"AdamW), not {optimizer!r}")
    if dev.closed:
        raise ValueError("optimizer: its device is closed")
    return h, dev


def save(path: _PathLike,
         tensors: Union[Mapping, Iterable[Tensor]],
         optimizer=None, *, on_server: bool = False) -> None:
    """Writes tensors, and optimizer's state when given, to the
    safetensors file at path.

    tensors: a dict name -> Tensor (a model's state dict), an object with
    a state_dict() method, or a list of tensors (saved as "0", "1", ...).
    Names are unique, non-empty and not "__metadata__". Tracked tensors
    are saved as their values. Every tensor and the optimizer must live on
    one device (else EDEVICE). A remote tensor streams through this
    process in pieces of at most 1 MiB.

    optimizer: an SGD, Adam or AdamW whose state (velocities, moments,
    step count) is saved too; restore it with load(..., optimizer=opt).

    The file is written beside path under a temporary name and renamed
    over it, so path holds the old file or the whole new one. Raises
    dispatch.EIO (file system), EINVAL (bad name), EDEVICE, or the error
    of a read of a remote tensor.

    on_server=True: the server writes the file from its own memory, in
    the directory it was started with (--checkpoint-dir DIR); path is a
    name relative to DIR (no "..", no absolute path, no symbolic link
    followed: EINVAL) and no tensor byte crosses the network. Raises
    ENOTREMOTE on a local device and EUNSUPPORTED when the server has no
    --checkpoint-dir (or is older than protocol 1.6).

        dispatch.save("model.safetensors", {"w": w, "b": b}, optimizer=opt)
    """
    named = _named(tensors)
    handles = [_hd(t) for t in named.values()]
    opt_h, dev = ffi.NULL, None
    if optimizer is not None:
        opt_h, dev = _optim_handle(optimizer)
    if dev is None:
        if not named:
            raise ValueError("save(): nothing to save (no tensors and no "
                             "optimizer)")
        dev = next(iter(named.values()))._dev
    names = [ffi.new("char[]", n.encode()) for n in named]
    c_names = ffi.new("char *[]", names) if names else ffi.NULL
    c_tensors = ffi.new("dispatch_tensor *[]", handles) if handles \
        else ffi.NULL
    fn = lib.dispatch_save_on_server if on_server else lib.dispatch_save
    rc = fn(dev._handle(), os.fsencode(path), c_names, c_tensors,
            len(handles), opt_h)
    if rc < 0:
        dev._raise(rc)


def _is_optim_state(name: str) -> bool:
    return name in ("optim.step", "optim.loss_scale",
                    "optim.loss_scale.counts") or (
        name.startswith("optim.") and
        name.rsplit(".", 1)[-1] in ("m", "v", "momentum"))


def load(path: _PathLike, device: Device,
         optimizer=None, *, on_server: bool = False) -> Dict[str, Tensor]:
    """Reads the safetensors file at path (written by save() or by a C
    program's dispatch_save) into new tensors on device, and returns them
    as a dict name -> Tensor in the file's order. The tensors are plain
    (not tracked): track() the parameters to train them.

    The optimizer's state entries of the file ("optim.*", see the module
    docstring) are left out of the dict when the file holds an
    optimizer's state. With optimizer (an SGD, Adam or AdamW on device,
    made over the parameters in the order they had when saved, with the
    same hyperparameters) that state replaces the optimizer's: its later
    steps continue bit for bit where the saved run stopped. So a resume
    reads the file twice:

        state = dispatch.load(path, dev)
        params = {k: v.track() for k, v in state.items()}
        opt = dispatch.Adam(list(params.values()), lr=1e-3)
        dispatch.load(path, dev, optimizer=opt)

    Raises dispatch.EIO (no such file, unreadable), EINVAL (a malformed
    file; the message names the file, the tensor and the figures),
    EDTYPE, ESHAPE, ETOOLARGE, and, for the optimizer, EINVAL (another
    kind of optimizer or parameter count) or ESHAPE / EDEVICE (its
    parameters differ from the saved ones, or live on another device).
    Nothing is left behind on a failure, and the optimizer is unchanged.

    on_server=True: the server reads path, a name inside its
    --checkpoint-dir (see save), into new tensors of the session without
    sending their bytes here; a load past the session's memory limit is
    EQUOTA and leaves nothing behind.
    """
    if not isinstance(device, Device):
        raise TypeError(f"load(): device is a dispatch Device, not "
                        f"{type(device).__name__}")
    opt_h = None
    if optimizer is not None:
        opt_h, opt_dev = _optim_handle(optimizer)
        if opt_dev is not device:
            raise ValueError(
                f"load(): the optimizer lives on {opt_dev.spec}, not on "
                f"{device.spec}, where the file is loaded")
    out = ffi.new("dispatch_checkpoint **")
    fn = lib.dispatch_load_on_server if on_server else lib.dispatch_load
    rc = fn(device._handle(), os.fsencode(path), out)
    if rc < 0:
        device._raise(rc)
    ck = out[0]
    try:
        if opt_h is not None:
            rc = lib.dispatch_optim_load(opt_h, ck)
            if rc < 0:
                device._raise(rc)
        has_optim = lib.dispatch_checkpoint_meta(ck, b"dispatch.optim") \
            != ffi.NULL
        result = {}
        for i in range(lib.dispatch_checkpoint_count(ck)):
            name = ffi.string(lib.dispatch_checkpoint_name(ck, i)).decode()
            if has_optim and _is_optim_state(name):
                continue
            p = lib.dispatch_tensor_ref(lib.dispatch_checkpoint_tensor(ck, i))
            result[name] = device._adopt(p)
        return result
    finally:
        lib.dispatch_checkpoint_free(ck)
