"""A server's devices: dispatch.device_list (dispatch_device_list) and
Device.peer (dispatch_device_open_peer), which opens another device of
the same server on the same connection and session, so that
t.to(peer) moves the bytes inside the server."""
from typing import List, NamedTuple, Optional

from ._core import Device, default_device, ffi, lib

__all__ = ["DeviceInfo", "device_list"]


class DeviceInfo(NamedTuple):
    """One device of a server, as dispatch_device_list reports it."""
    kind: str           #: "cpu" or "cuda"
    name: str           #: "cpu:1": what Device.peer takes
    description: str    #: the backend's
    total_memory: int   #: the device's budget in bytes (0: unbounded)
    free_memory: int    #: what is left of it now


def device_list(device: Optional[Device] = None) -> List[DeviceInfo]:
    """The devices of device's server (default: the default device), in
    the server's order; one round trip. A local device lists the one
    in-process CPU ("cpu", "local:cpu", memory 0: unbounded). Raises
    ECONN, or a deferred error of the session, as any wait does.

        for d in dispatch.device_list(dev):
            print(d.name, d.kind, d.free_memory)
    """
    dev = device if device is not None else default_device()
    if not isinstance(dev, Device):
        raise TypeError(f"device_list(): a dispatch Device, not "
                        f"{type(dev).__name__}")
    cap = 8
    while True:
        info = ffi.new("dispatch_device_info[]", cap)
        info[0].size = ffi.sizeof("dispatch_device_info")
        n = ffi.new("int *")
        rc = lib.dispatch_device_list(dev._handle(), info, cap, n)
        if rc < 0:
            dev._raise(rc)
        if n[0] <= cap:
            break
        cap = n[0]  # more than we had room for: ask again with room
    return [DeviceInfo(ffi.string(i.kind).decode(errors="replace"),
                       ffi.string(i.name).decode(errors="replace"),
                       ffi.string(i.description).decode(errors="replace"),
                       int(i.total_memory), int(i.free_memory))
            for i in (info[k] for k in range(n[0]))]


def _peer(self: Device, name: str) -> Device:
    """Opens device `name` ("cpu:1", "cuda:0": see device_list) of this
    device's server as a new Device on the same connection and session:
    t.to(peer) between them copies inside the server, never through this
    process. Uploads and creation ops on the peer land on `name`; an op
    runs on its inputs' device, and inputs of two devices are EDEVICE.
    Close the peer like any device (closing this one first is allowed);
    both share the session's deferred error. Raises EUNSUPPORTED (this
    device is local), EINVAL (a bad name), EDEVICE (no such device on the
    server: the message names the ones it has), ECONN."""
    if not isinstance(name, str):
        raise TypeError(f"peer(): a device name such as 'cpu:1', not "
                        f"{type(name).__name__}")
    out = ffi.new("dispatch_device **")
    rc = lib.dispatch_device_open_peer(self._handle(), name.encode(), out)
    if rc < 0:
        self._raise(rc)
    peer = Device.__new__(Device)
    peer._init_handle(out[0])
    return peer


Device.peer = _peer
