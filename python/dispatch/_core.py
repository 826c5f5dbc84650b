"""Devices, tensors, gradients, scopes and errors over libdispatch-client.

Ownership, in one place:
- Every Tensor object owns exactly one reference to its C tensor, dropped
  when the object is garbage collected (ffi.gc) or when the Python scope it
  was made in ends. The binding never opens a C scope, so every C call hands
  the binding its own reference and nothing else can free it underneath.
- A device's C handle belongs to a _DeviceState that every Tensor, Grads and
  optimizer of the device keeps alive (their destructors are its methods),
  so the device is closed only after the last of them is gone, or when the
  user closes it; after that the destructors do nothing, because closing a
  device frees everything on it in C.
- Destructors only queue their frees; the device's next call runs them
  (see _DeviceState), so dropping an object is never a call into C.
- As in C, a device and everything on it is used from one thread at a time.
"""
import atexit
import builtins
import collections
import functools
import math
import numbers
import threading
import weakref

import numpy as np

from ._lib import docs as _docs, ffi, lib, ops as _ops

# ---------------------------------------------------------------- dtypes

float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)
float16 = np.dtype(np.float16)  # IEEE binary16, numpy's own
half = float16


class _BFloat16:
    """dispatch.bfloat16, the dtype of a bfloat16 tensor (f32's upper 16
    bits). numpy has no bfloat16: arrays of one hold the raw 2-byte values
    as uint16 (t.numpy() gives them, dev.tensor(bits, dtype=bfloat16) takes
    a uint16 array as such), and bf16_to_f32 / f32_to_bf16 convert. Like a
    numpy dtype it has .name, .kind ("f": a float dtype) and .itemsize."""
    __slots__ = ()
    name = "bfloat16"
    kind = "f"
    itemsize = 2
    storage = np.dtype(np.uint16)  # what its numpy arrays hold

    def __repr__(self):
        return "dispatch.bfloat16"

    __str__ = __repr__

    def __reduce__(self):
        return "bfloat16"  # pickles as the module's one instance


bfloat16 = _BFloat16()

_NP_TO_C = {float32: lib.DISPATCH_F32, float64: lib.DISPATCH_F64,
            int64: lib.DISPATCH_I64, bool_: lib.DISPATCH_BOOL,
            float16: lib.DISPATCH_F16, bfloat16: lib.DISPATCH_BF16}
_C_TO_NP = {v: k for k, v in _NP_TO_C.items()}
_KIND_NAMES = {lib.DISPATCH_KIND_LOCAL: "local",
               lib.DISPATCH_KIND_REMOTE: "remote",
               lib.DISPATCH_KIND_AUTODIFF: "autodiff"}
# the counters of dispatch_stats after its size, in the header's order
_STATS_FIELDS = tuple(name for name, _ in ffi.typeof("dispatch_stats").fields
                      if name != "size")


def _dtype(d):
    """The dtype for d (a numpy dtype or type, dispatch.bfloat16, or a name
    such as "float32", "half", "bfloat16"); TypeError for one dispatch has
    no element type for."""
    if d is bfloat16 or (isinstance(d, str) and d == "bfloat16"):
        return bfloat16
    try:
        nd = np.dtype(d)
    except TypeError:
        raise TypeError(f"dispatch: not a dtype: {d!r}") from None
    if nd not in _NP_TO_C:
        raise TypeError(f"dispatch: dtype {nd} is not supported (float32, "
                        "float64, float16, bfloat16, int64 and bool are)")
    return nd


def _storage(dt):
    """The numpy dtype of an array holding a tensor of dtype dt."""
    return dt.storage if dt is bfloat16 else dt


def _convert(arr, to_c, from_c, out_dtype):
    """lib.dispatch_convert over a whole array (its shape kept: 0-d too)."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    out = np.empty(arr.shape, dtype=out_dtype)
    rc = lib.dispatch_convert(ffi.from_buffer(out), to_c,
                              ffi.from_buffer(arr), from_c, arr.size)
    if rc < 0:
        raise _error(rc, "dispatch_convert failed")
    return out


def bf16_to_f32(bits):
    """float32 values of bfloat16 raw values (a uint16 array, or anything
    np.asarray makes one of): exact, as torch's .float() of a bfloat16
    tensor (a NaN stays a NaN)."""
    a = np.asarray(bits)
    if a.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32: raw bfloat16 values are uint16, not "
                        f"{a.dtype}")
    return _convert(a, lib.DISPATCH_F32, lib.DISPATCH_BF16, float32)


def f32_to_bf16(values):
    """bfloat16 raw values (uint16) of values taken as float32 (a float64
    array is rounded to float32 first, as torch does when it makes a
    bfloat16 tensor from Python floats), rounded to nearest even as
    torch's .bfloat16(); a NaN stays a NaN of its sign (torch 1.13 writes
    0xffff for every NaN)."""
    a = np.asarray(values, dtype=float32)
    return _convert(a, lib.DISPATCH_BF16, lib.DISPATCH_F32, np.uint16)


# ---------------------------------------------------------------- errors

class DispatchError(Exception):
    """A failed dispatch call. .code is the negative DISPATCH_E* number,
    .name its constant ("DISPATCH_ESHAPE"), .message the detail the library
    or the server gave (the device's error message)."""
    __module__ = "dispatch"

    def __init__(self, code, message):
        self.code = code
        self.name = ffi.string(lib.dispatch_err_name(code)).decode()
        self.message = message
        super().__init__(f"{self.name}: {message}")


# Python's own exception types that a code also is, so that code written
# for numpy (except ValueError, except IndexError, ...) catches ours too.
_ALSO = {"ENOMEM": MemoryError, "EINVAL": ValueError, "ESHAPE": ValueError,
         "EDTYPE": TypeError, "EDIM": IndexError, "EINDEX": IndexError,
         "EOVERFLOW": OverflowError, "ECONN": ConnectionError,
         "ESHUTDOWN": ConnectionError,
         "ETIMEDOUT": TimeoutError, "EUNSUPPORTED": NotImplementedError,
         "EGROUP": RuntimeError}

_ERROR_CLASSES = {}
error_classes = {}  # "ESHAPE" -> class, for the package namespace


def _make_error_classes():
    # the table may have gaps (codes are appended in ranges set aside for
    # work done in parallel), so every code down to -255 is asked for
    for code in range(-1, -256, -1):
        full = ffi.string(lib.dispatch_err_name(code)).decode()
        if full == "DISPATCH_EUNKNOWN":
            continue
        short = full[len("DISPATCH_"):]
        bases = (DispatchError,) + ((_ALSO[short],) if short in _ALSO else ())
        cls = type(short, bases, {
            "__doc__": ffi.string(lib.dispatch_strerror(code)).decode()
                       + f" ({full}, code {code})",
            "__module__": "dispatch"})
        _ERROR_CLASSES[code] = cls
        error_classes[short] = cls


_make_error_classes()
# error codes by short name ("ESHAPE" -> -3), read from the library's table
codes = {cls.__name__: code for code, cls in _ERROR_CLASSES.items()}
_EINVAL = codes["EINVAL"]


def _error(code, message):
    cls = _ERROR_CLASSES.get(code, DispatchError)
    return cls(code, message)


def _freed_error(what="tensor"):
    return _error(_EINVAL, f"{what} was freed: its scope ended, it was "
                  "freed explicitly, or its device closed")


# ---------------------------------------------------------------- devices

_open_states = weakref.WeakSet()


class _DeviceState:
    """Holds a device's C handle. The destructors of every C object of the
    device are methods of this object, so it outlives them all; h is None
    once the device is closed, after which they are no-ops.

    A destructor does not call into C: it queues the free, and the next
    call of the binding on the device (any op, creation, read, sync, stats,
    scope end) runs the queue. The collector may run a destructor on any
    thread, even while another thread is inside a C call on this device
    (cffi releases the GIL around calls); the C library allows one thread
    at a time per device, and this way only the user's calls, which keep
    that rule, ever touch it."""
    __slots__ = ("h", "lib", "pending", "__weakref__")

    def __init__(self, h):
        self.h = h
        self.lib = lib  # kept: module globals may be gone at exit
        self.pending = []
        _open_states.add(self)

    def close(self):
        h, self.h = self.h, None
        self.pending = []  # closing frees everything of the device in C
        if h is not None:
            self.lib.dispatch_device_close(h)

    def __del__(self):
        self.close()

    def drain(self):
        """Runs the queued frees (from a user's call only)."""
        pending = self.pending
        while pending:  # list.pop is atomic: destructors may append
            fn, p = pending.pop()
            if self.h is not None:
                fn(p)

    def free_tensor(self, p):
        self.pending.append((self.lib.dispatch_tensor_free, p))

    def free_grads(self, p):
        self.pending.append((self.lib.dispatch_grads_free, p))

    def free_optim(self, p):
        self.pending.append((self.lib.dispatch_optim_free, p))


@atexit.register
def _close_all():
    # Closes devices while the interpreter still works, so a server gets
    # its bye instead of a dropped connection.
    for st in list(_open_states):
        st.close()


def _cstr(s, keep):
    """s (str or bytes) as a C string that lives as long as keep."""
    b = ffi.new("char[]", s.encode() if isinstance(s, str) else s)
    keep.append(b)
    return b


def _options(token=None, timeout_ms=None, ca_file=None, cert_file=None,
             key_file=None, server_name=None, client_name=None, sync=False):
    """A dispatch_options from dispatch.device()'s keywords (None: the
    library's default, from the environment), and the list that keeps its
    strings alive: hold both until the open returns."""
    keep = []

    def cstr(s):
        return ffi.NULL if s is None else _cstr(s, keep)

    opts = ffi.new("dispatch_options *")
    lib.dispatch_options_init(opts)
    opts.token = cstr(token)
    opts.client_name = cstr(client_name or "dispatch-python")
    opts.timeout_ms = int(timeout_ms or 0)
    opts.ca_file = cstr(ca_file)
    opts.cert_file = cstr(cert_file)
    opts.key_file = cstr(key_file)
    opts.server_name = cstr(server_name)
    opts.sync = 1 if sync else 0
    return opts, keep


class Device:
    """A dispatch device: "local" (this process) or "tcp://HOST:PORT" /
    "tls://HOST:PORT" (a dispatch-server). Open it with dispatch.device().
    Usable as a context manager, which closes it at the end.

    sync=True (or env DISPATCH_SYNC=1) is sync mode, for debugging: every
    call waits for the server, so a remote error the server finds is raised
    at the line that caused it, as on a local device, not at a later call.
    A device is not thread-safe: a call on it from a second thread while
    one is in flight raises EBUSY at once; give each thread its own."""

    def __init__(self, spec=None, *, token=None, timeout_ms=None,
                 ca_file=None, cert_file=None, key_file=None,
                 server_name=None, client_name=None, sync=False):
        opts, keep = _options(token=token, timeout_ms=timeout_ms,
                              ca_file=ca_file, cert_file=cert_file,
                              key_file=key_file, server_name=server_name,
                              client_name=client_name, sync=sync)
        out = ffi.new("dispatch_device **")
        msg = ffi.new("char[512]")
        cspec = ffi.NULL if spec is None else _cstr(spec, keep)
        rc = lib.dispatch_device_open(cspec, opts, out, msg, 512)
        if rc < 0:
            raise _error(rc, ffi.string(msg).decode(errors="replace"))
        self._init_handle(out[0])
        self._remember()

    def _remember(self):
        """Makes this the device t.to(self.spec) finds, unless an open one
        of that spec already is."""
        known = _devices_by_spec.get(self.spec)
        if known is None or known.closed:
            _devices_by_spec[self.spec] = self  # for t.to(spec)

    def _init_handle(self, h, state=None) -> None:
        """Makes this Device the owner of the open dispatch_device h (as
        dispatch_device_open or dispatch_device_open_peer gave it), or,
        given state, its user through that state (a group's member, whose
        handle the group owns: see dispatch.distributed)."""
        self._state = _DeviceState(h) if state is None else state
        self._scopes = []       # Python scopes, innermost last
        self._last_grads = None  # for Tensor.grad
        self.spec = ffi.string(lib.dispatch_device_spec(h)).decode()

    # -- state

    @property
    def kind(self) -> str:
        """"local" or "remote"."""
        return _KIND_NAMES[lib.dispatch_device_kind(self._handle())]

    @property
    def closed(self):
        return self._state.h is None

    def _handle(self):
        st = self._state
        if st.h is None:
            raise _error(_EINVAL, f"device {self.spec} is closed")
        if st.pending:
            st.drain()
        return st.h

    def _raise(self, rc):
        h = self._state.h
        msg = ffi.string(lib.dispatch_device_errmsg(h)).decode(
            errors="replace") if h is not None else ""
        raise _error(rc, msg)

    def close(self) -> None:
        """Closes the device (a remote one says bye): every tensor, grads
        and optimizer of it becomes unusable. Closing twice is fine."""
        self._last_grads = None
        self._scopes = []
        self._state.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"dispatch.Device({self.spec!r}{', closed' if self.closed else ''})"

    def sync(self) -> None:
        """Waits until the server ran everything queued; raises the first
        deferred error of the session. Local: returns at once."""
        rc = lib.dispatch_device_sync(self._handle())
        if rc < 0:
            self._raise(rc)

    def stats(self) -> "dict[str, int]":
        """The device's counters as a dict (remote: one round trip): the
        session's tensors, bytes, ops, errors, grads, held_bytes,
        session_limit, queued_bytes, batches, and the server-wide
        sessions, server_tensors, server_bytes, server_held_bytes,
        server_limit, protocol_errors, limit_violations, devices,
        sessions_detached, sessions_resumed, sessions_expired, inline_ops,
        handoffs, returns (0 on a local device, but devices, which is 1)."""
        s = ffi.new("dispatch_stats *")
        # the library writes only what lies within size: our struct
        s.size = ffi.sizeof("dispatch_stats")
        rc = lib.dispatch_device_stats(self._handle(), s)
        if rc < 0:
            self._raise(rc)
        return {k: getattr(s, k) for k in _STATS_FIELDS}

    def set_timeout(self, timeout_ms: int) -> None:
        """Bounds every later network wait at timeout_ms (0: no bound;
        negative: EINVAL). A wait past it on a server that is alive and
        busy raises TimeoutError (dispatch.ETIMEDOUT) and the session goes
        on: the request stays queued and the next wait waits for it; a
        server that sends nothing that long is a lost connection."""
        rc = lib.dispatch_device_set_timeout(self._handle(), int(timeout_ms))
        if rc < 0:
            self._raise(rc)

    def set_cache(self, nbytes):
        """Local: bounds the device's storage cache (freed blocks kept by
        size class for the next tensor of that size) at nbytes; 0 turns it
        off and frees what it holds. Remote: raises the library's
        DISPATCH_EUNSUPPORTED (a server sets its sessions' cache with
        dispatch-server --session-cache)."""
        n = int(nbytes)
        if n < 0:
            raise ValueError(f"set_cache: {n} bytes is negative")
        rc = lib.dispatch_device_set_cache(self._handle(), n)
        if rc < 0:
            self._raise(rc)

    # -- making tensors

    def _adopt(self, p):
        """Wraps a C tensor the caller got a reference to (a C call's
        output) as a Tensor that owns that reference."""
        st = self._state
        if st.pending:
            st.drain()
        t = Tensor.__new__(Tensor)
        t._h = ffi.gc(p, st.free_tensor)
        t._dev = self
        t._shape = None
        t._leaf = False
        if self._scopes:
            self._scopes[-1]._add(t)
        return t

    def _new(self, cfn, *args):
        out = ffi.new("dispatch_tensor **")
        rc = cfn(self._handle(), *args, out)
        if rc < 0:
            self._raise(rc)
        return self._adopt(out[0])

    def tensor(self, data, dtype=None,
               requires_grad: bool = False) -> "Tensor":
        """A tensor holding a copy of data (a numpy array, a nested list or
        a number). A C-contiguous numpy array of a supported dtype is handed
        to the library as it is (its buffer is read once, no copy in
        Python); anything else is converted first. Without dtype, numpy
        arrays keep theirs and Python floats become float32. dtype
        bfloat16: a uint16 array is taken as the raw values (what
        t.numpy() of a bfloat16 tensor gives), anything else as numbers,
        rounded through float32 (f32_to_bf16). With requires_grad, returns
        the tracked leaf (see Tensor.track)."""
        if isinstance(data, Tensor):
            t = data.to(self) if dtype is None else data.to(self).astype(dtype)
            return t.track() if requires_grad else t
        if dtype is not None and _dtype(dtype) is bfloat16:
            arr = np.asarray(data)
            if arr.dtype != bfloat16.storage:
                arr = f32_to_bf16(arr)
            dtype_c = lib.DISPATCH_BF16
        elif dtype is not None:
            arr = np.asarray(data, dtype=_dtype(dtype))
        elif isinstance(data, (np.ndarray, np.generic)):
            arr = np.asarray(data)
        else:
            arr = np.asarray(data)
            if arr.dtype.kind == "f":
                arr = arr.astype(float32)
            elif arr.dtype.kind in "iu":
                arr = arr.astype(int64)
        if dtype is None or _dtype(dtype) is not bfloat16:
            if arr.dtype not in _NP_TO_C:
                _dtype(arr.dtype)  # raises, naming the supported dtypes
            dtype_c = _NP_TO_C[arr.dtype]
        if not arr.flags.c_contiguous:
            # (np.ascontiguousarray would also turn a 0-d array into 1-d)
            arr = arr.copy(order="C")
        if arr.ndim > 8:
            raise _error(_EINVAL,
                         f"{arr.ndim} dims: a tensor has at most 8")
        shape = ffi.new("int64_t[]", arr.shape) if arr.ndim else ffi.NULL
        t = self._new(lib.dispatch_tensor_from_data, dtype_c,
                      arr.ndim, shape, ffi.from_buffer(arr), arr.nbytes)
        return t.track() if requires_grad else t

    def zeros(self, *size, dtype=float32, requires_grad=False):
        """Zeros of shape size: zeros(3, 4) or zeros((3, 4)) (a dtype
        after the shape tuple also works: zeros((3, 4), int64))."""
        shape, dtype = _size_args(size, dtype)
        return _leaf_if(self._new(lib.dispatch_zeros, _NP_TO_C[_dtype(dtype)],
                                  *_shape_arg(shape)), requires_grad)

    def ones(self, *size, dtype=float32, requires_grad=False):
        shape, dtype = _size_args(size, dtype)
        return _leaf_if(self._new(lib.dispatch_ones, _NP_TO_C[_dtype(dtype)],
                                  *_shape_arg(shape)), requires_grad)

    empty = zeros  # dispatch has no uninitialised memory: empty is zeros

    def full(self, shape, value, dtype=float32, requires_grad=False):
        return _leaf_if(self._new(lib.dispatch_full, _NP_TO_C[_dtype(dtype)],
                                  *_shape_arg(shape), float(value)),
                        requires_grad)

    def arange(self, start, end=None, step=1, dtype=None):
        """1-D [start, end) by step, as numpy.arange (one argument: end);
        dtype None: int64 when start, end and step are ints, else float32
        (torch's rule)."""
        if end is None:
            start, end = 0, start
        if dtype is None:
            ints = builtins.all(isinstance(v, numbers.Integral)
                                for v in (start, end, step))
            dtype = int64 if ints else float32
        return self._new(lib.dispatch_arange, _NP_TO_C[_dtype(dtype)],
                         float(start), float(end), float(step))

    def uniform(self, shape, low=0.0, high=1.0, seed=0, dtype=float32):
        """Uniform in [low, high); the same seed gives the same bits on
        every device."""
        return self._new(lib.dispatch_uniform, _NP_TO_C[_dtype(dtype)],
                         *_shape_arg(shape), float(low), float(high),
                         int(seed))

    def normal(self, shape, mean=0.0, std=1.0, seed=0, dtype=float32):
        return self._new(lib.dispatch_normal, _NP_TO_C[_dtype(dtype)],
                         *_shape_arg(shape), float(mean), float(std),
                         int(seed))

    def rand(self, *size, dtype=float32, seed=None, requires_grad=False):
        """Uniform in [0, 1) as torch.rand, from dispatch.manual_seed's
        stream (or the given seed). Not torch's numbers: see the README."""
        shape, dtype = _size_args(size, dtype)
        return _leaf_if(self.uniform(shape, 0.0, 1.0, _seed(seed), dtype),
                        requires_grad)

    def randn(self, *size, dtype=float32, seed=None, requires_grad=False):
        """Standard normal as torch.randn (the stream of rand)."""
        shape, dtype = _size_args(size, dtype)
        return _leaf_if(self.normal(shape, 0.0, 1.0, _seed(seed), dtype),
                        requires_grad)

    def randint(self, low, high=None, size=(), dtype=int64, seed=None):
        """Integers uniform in [low, high) as torch.randint (one bound:
        [0, low)), made on the device: a float64 uniform in [0, high -
        low), truncated, clamped below high - low, plus low."""
        if high is None:
            low, high = 0, low
        low, high = int(low), int(high)
        if high <= low:
            raise ValueError(f"randint: empty range [{low}, {high})")
        u = self.uniform(size, 0.0, float(high - low), _seed(seed), float64)
        i = clamp(u.astype(int64), None, high - low - 1)
        i = i + low if low else i
        return i if _dtype(dtype) == int64 else i.astype(dtype)

    def scope(self):
        """A context manager: tensors made on this device inside it are
        freed when it ends, except those passed to keep()."""
        return Scope(self)

    def capture(self):
        """A context manager recording one step into a dispatch.Graph
        (see dispatch/graph.py): `with dev.capture() as g: ...`, then
        g.replay(*inputs)."""
        from .graph import Graph
        return Graph(self)


def _shape_arg(shape):
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    return len(shape), (ffi.new("int64_t[]", shape) if shape else ffi.NULL)


def _is_shape(v):
    return isinstance(v, (tuple, list)) or (
        isinstance(v, np.ndarray) and v.ndim == 1)


def _size_args(size, dtype):
    """(shape, dtype) from the *size of zeros(3, 4) or zeros((3, 4)), or
    zeros((3, 4), dtype) as the binding always took it."""
    if size and _is_shape(size[0]):
        if len(size) > 2:
            raise TypeError(f"a shape, then at most a dtype: got {size!r}")
        if len(size) == 2:
            dtype = size[1]
        size = size[0]
    for d in size:
        if not isinstance(d, numbers.Integral):
            raise TypeError(f"size must be ints or one tuple of ints, got "
                            f"{d!r} in {tuple(size)!r}")
    return tuple(int(d) for d in size), dtype


def _leaf_if(t, requires_grad):
    return t.requires_grad_(True) if requires_grad else t


# the random stream of rand / randn / randint without a seed: manual_seed
# sets its start; each call takes the next seed from it
class _Rng:
    seed = 0
    count = 0


def manual_seed(seed):
    """Restarts the stream of seeds that rand, randn, randint (and
    dispatch.nn's initialisations) draw from when given no seed, as
    torch.manual_seed. The numbers are dispatch's (the same on every
    device), not torch's."""
    _Rng.seed = int(seed) & (2 ** 64 - 1)
    _Rng.count = 0


def _seed(seed=None):
    """seed, or the next seed of manual_seed's stream (splitmix64 of the
    seed and a counter, below 2^63)."""
    if seed is not None:
        return int(seed)
    _Rng.count += 1
    z = (_Rng.seed + _Rng.count * 0x9E3779B97F4A7C15) & (2 ** 64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2 ** 64 - 1)
    return (z ^ (z >> 31)) >> 1


# open devices by spec, for t.to("tcp://...") and t.to("local")
_devices_by_spec = weakref.WeakValueDictionary()


def _resolve_device(d):
    """A Device for d: a Device, or a spec string: an open device of that
    spec, else a newly opened one (the shared one for "local")."""
    if isinstance(d, Device):
        return d
    if not isinstance(d, str):
        raise TypeError(f"not a device: {d!r}")
    dev = _devices_by_spec.get(d)
    if dev is None or dev.closed:
        dev = Device(d)
        _devices_by_spec[dev.spec] = dev
        _devices_by_spec[d] = dev
        _opened_by_name.append(dev)
    return dev


_opened_by_name = []  # devices .to("spec") opened: kept open until exit


_default = None


def default_device():
    """The device of env DISPATCH_DEVICE, else "local" (opened once)."""
    global _default
    if _default is None or _default.closed:
        _default = Device(None)
    return _default


def device(spec: "str | None" = None, **options) -> Device:
    """Opens a device. spec: "local", "tcp://HOST:PORT", "tls://HOST:PORT",
    or None for env DISPATCH_DEVICE, else "local". options: token,
    timeout_ms, ca_file, cert_file, key_file, server_name, client_name."""
    return Device(spec, **options)


# ---------------------------------------------------------------- scopes

class Scope:
    """Frees, at its end, every tensor made on its device while it was the
    innermost scope, except kept ones. A freed Tensor object raises
    DispatchError (EINVAL) when used. Scopes nest; they are not tied to
    threads or to the C library's own scopes (the binding never opens
    those)."""

    def __init__(self, dev):
        self._dev = dev
        self._tensors = []
        self._kept = set()

    def _add(self, t):
        self._tensors.append(t)

    def keep(self, *tensors):
        """Keeps tensors past this scope: they move to the enclosing scope,
        or, from the outermost one, to plain garbage collection. Returns
        its argument (the one tensor, or the tuple)."""
        for t in tensors:
            self._kept.add(id(t))
        return tensors[0] if len(tensors) == 1 else tensors

    def __enter__(self):
        self._dev._scopes.append(self)
        return self

    def __exit__(self, *exc):
        scopes = self._dev._scopes
        if scopes and scopes[-1] is self:
            scopes.pop()
        elif self in scopes:
            scopes.remove(self)
        outer = scopes[-1] if scopes else None
        for t in self._tensors:
            if id(t) in self._kept:
                if outer is not None:
                    outer._add(t)
            elif t._h is not None:
                h, t._h = t._h, None
                ffi.release(h)  # runs the destructor now: queues our free
        self._tensors = []
        self._kept = set()
        self._dev._state.drain()
        return False


def keep(*tensors):
    """Keeps tensors past the innermost scope of their device that holds
    them; see Scope.keep."""
    for t in tensors:
        for s in reversed(t._dev._scopes):
            if builtins.any(x is t for x in s._tensors):
                s.keep(t)
                break
    return tensors[0] if len(tensors) == 1 else tensors


# ---------------------------------------------------------------- ops

# ---------------------------------------------------------------- grad mode

class _GradMode(threading.local):
    on = True  # per thread, as torch's


_grad_mode = _GradMode()


def is_grad_enabled():
    """False inside no_grad() (on this thread), else True."""
    return _grad_mode.on


class _GradModeContext:
    """Sets the grad mode for a with block, or, as a decorator, for each
    call of a function; the previous mode comes back at the end."""
    _mode = True

    def __enter__(self):
        self._prev = _grad_mode.on
        _grad_mode.on = self._mode
        return self

    def __exit__(self, *exc):
        _grad_mode.on = self._prev
        return False

    def __call__(self, fn):
        mode = self._mode

        @functools.wraps(fn)
        def wrapper(*a, **k):
            prev = _grad_mode.on
            _grad_mode.on = mode
            try:
                return fn(*a, **k)
            finally:
                _grad_mode.on = prev
        return wrapper


class no_grad(_GradModeContext):
    """Context manager and decorator (with or without parentheses): ops
    inside record nothing on the tape, so their results are plain tensors
    (requires_grad False) even from tracked inputs, as torch.no_grad. The
    ops run on the tensors the tracked ones wrap (Tensor.inner), as the C
    library and a server do for an op sent with no_grad. Nests; per
    thread. backward() and optimizer steps work inside it."""
    _mode = False

    def __new__(cls, fn=None):
        self = super().__new__(cls)
        return self if fn is None else self(fn)  # @no_grad

    def __init__(self, fn=None):
        pass


class enable_grad(_GradModeContext):
    """Turns recording back on inside a no_grad block, as
    torch.enable_grad (a context manager or decorator)."""
    _mode = True


class set_grad_enabled(_GradModeContext):
    """As torch.set_grad_enabled(mode): called, it sets this thread's mode
    at once; as a context manager it restores the previous one at the end;
    as a decorator it sets mode for each call only."""

    def __init__(self, mode):
        self._prev = _grad_mode.on
        self._mode = bool(mode)
        _grad_mode.on = self._mode

    def __enter__(self):
        return self

    def __call__(self, fn):
        _grad_mode.on = self._prev
        return super().__call__(fn)


def _hraw(t):
    """The live C handle of Tensor t (AUTODIFF ones as they are), or
    raises."""
    h = t._h
    if h is None or t._dev._state.h is None:
        raise _freed_error()
    return h


# _hd: the handle as it is, for what must see the AUTODIFF tensor itself
# (optimizers, graphs, checkpoints); the op functions take theirs by _hin
_hd = _hraw


def _hin(t):
    """The live C handle of Tensor t as an op's input, or raises: inside
    no_grad, the tensor an AUTODIFF one wraps (borrowed), so the op records
    nothing."""
    h = t._h
    if h is None or t._dev._state.h is None:
        raise _freed_error()
    if not _grad_mode.on:
        return lib.dispatch_inner(h)
    return h


def _fail(rc, t):
    t._dev._raise(rc)


def _out():
    return ffi.new("dispatch_tensor **")


def _scalar_op(cfn, x, s):
    out = _out()
    rc = cfn(_hin(x), float(s), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _as_tensor(x, like=None):
    """x as a Tensor: a Tensor as it is; anything else is uploaded to the
    device of `like` (else the default device). Numbers and lists take
    like's dtype, having none of their own; a numpy array keeps its dtype,
    so a mismatch is an EDTYPE error rather than a silent conversion."""
    if isinstance(x, Tensor):
        return x
    if like is None:
        return default_device().tensor(x)
    if isinstance(x, (numbers.Number, np.generic, list, tuple)):
        return like._dev.tensor(x, dtype=like.dtype)
    return like._dev.tensor(x)


def _pair(a, b):
    if isinstance(a, Tensor):
        return a, _as_tensor(b, a)
    b = _as_tensor(b)
    return _as_tensor(a, b), b


def _dims_arg(dim):
    if dim is None:
        return 0, ffi.NULL
    if isinstance(dim, numbers.Integral):
        dim = (dim,)
    dim = tuple(int(d) for d in dim)
    return len(dim), ffi.new("int64_t[]", dim)


def _reduce(cfn, x, dim, keepdim):
    x = _as_tensor(x)
    n, dims = _dims_arg(dim)
    out = _out()
    rc = cfn(_hin(x), n, dims, 1 if keepdim else 0, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _dim_op(cfn, x, dim):
    x = _as_tensor(x)
    out = _out()
    rc = cfn(_hin(x), int(dim), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _shape_op(cfn, x, shape):
    x = _as_tensor(x)
    n, s = _shape_arg(shape)
    out = _out()
    rc = cfn(_hin(x), n, s, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _join(cfn, tensors, dim):
    tensors = list(tensors)
    if not tensors:
        raise _error(_EINVAL, "no tensors to join")
    first = _as_tensor(tensors[0])
    ts = [first] + [_as_tensor(t, first) for t in tensors[1:]]
    arr = ffi.new("dispatch_tensor *[]", [_hin(t) for t in ts])
    out = _out()
    rc = cfn(arr, len(ts), int(dim), out)
    if rc < 0:
        _fail(rc, first)
    return first._dev._adopt(out[0])


def _pair2(v):
    if isinstance(v, numbers.Integral):
        return int(v), int(v)
    a, b = v
    return int(a), int(b)


def conv2d(x, w, stride=1, padding=0, dilation=1, bias=None):
    """x [N, C, H, W], w [O, C, kh, kw]; bias [O] or None (conv2d_bias)."""
    if bias is not None:
        return conv2d_bias(x, w, bias, stride, padding, dilation)
    x, w = _pair(x, w)
    sh, sw = _pair2(stride)
    ph, pw = _pair2(padding)
    dh, dw = _pair2(dilation)
    out = _out()
    rc = lib.dispatch_conv2d(_hin(x), _hin(w), sh, sw, ph, pw, dh, dw, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _pool(cfn, x, kernel, stride, padding):
    x = _as_tensor(x)
    kh, kw = _pair2(kernel)
    sh, sw = _pair2(kernel if stride is None else stride)
    ph, pw = _pair2(padding)
    out = _out()
    rc = cfn(_hin(x), kh, kw, sh, sw, ph, pw, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


# The op functions of the op table: one maker per signature kind (the
# sixth column of DSP_OP_MAP, read from ops.txt, see _lib), called with
# the row's C function. Every API row of these kinds becomes a function of
# the package (a new row needs nothing here); the rows of the other kinds
# (creation, irregular signatures) are written out below and in Device.
# The kinds marked True are Tensor methods too (t.relu(), t.sum(0)).

def _unary(cfn):
    def op(x):
        x = _as_tensor(x)
        out = _out()
        rc = cfn(_hin(x), out)
        if rc < 0:
            _fail(rc, x)
        return x._dev._adopt(out[0])
    return op


def _binary(cfn):
    def op(a, b):
        a, b = _pair(a, b)
        out = _out()
        rc = cfn(_hin(a), _hin(b), out)
        if rc < 0:
            _fail(rc, a)
        return a._dev._adopt(out[0])
    return op


def _ternary(cfn):
    def op(a, b, c):
        first = next((t for t in (a, b, c) if isinstance(t, Tensor)), None)
        a, b, c = (_as_tensor(t, first) for t in (a, b, c))
        out = _out()
        rc = cfn(_hin(a), _hin(b), _hin(c), out)
        if rc < 0:
            _fail(rc, a)
        return a._dev._adopt(out[0])
    return op


def _scalar(cfn):
    def op(x, s):
        return _scalar_op(cfn, _as_tensor(x), s)
    return op


def _reducer(cfn):
    def op(x, dim=None, keepdim=False):
        return _reduce(cfn, x, dim, keepdim)
    return op


def _shaper(cfn):
    def op(x, shape):
        return _shape_op(cfn, x, shape)
    return op


def _along(cfn):
    def op(x, dim=-1):
        return _dim_op(cfn, x, dim)
    return op


def _joiner(cfn):
    def op(tensors, dim=0):
        return _join(cfn, tensors, dim)
    return op


def _pooler(cfn):
    def op(x, kernel, stride=None, padding=0):
        return _pool(cfn, x, kernel, stride, padding)
    return op


_MAKERS = {"UNARY": (_unary, True), "BINARY": (_binary, True),
           "TERNARY": (_ternary, False), "SCALAR": (_scalar, False),
           "RED": (_reducer, True), "SHAPEV": (_shaper, True),
           "DIM": (_along, True), "MANY": (_joiner, False),
           "POOL": (_pooler, False)}


def _make_ops():
    made = {}
    for name, sig, api in _ops:
        if api != "API" or sig not in _MAKERS:
            continue
        cname = "dispatch_" + name
        try:
            cfn = getattr(lib, cname)
        except AttributeError:
            raise ImportError(f"dispatch: {cname} (a row of the op table) "
                              "is not declared in the library's header") from None
        fn = _MAKERS[sig][0](cfn)
        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = f"{_docs.get(cname) or name}\n\n(C: {cname}, {sig})"
        made[name] = fn
    return made


globals().update(_make_ops())


# ---- the rows the makers do not cover, and overrides of made ones that
# take more than tensors (a mask, labels, the dims keyword)

def where(mask, a, b):
    """mask (bool) ? a : b, three-way broadcast."""
    a, b = _pair(a, b)
    if not isinstance(mask, Tensor):
        mask = a._dev.tensor(np.asarray(mask, dtype=bool_))
    out = _out()
    rc = lib.dispatch_where(_hin(mask), _hin(a), _hin(b), out)
    if rc < 0:
        _fail(rc, a)
    return a._dev._adopt(out[0])


def cross_entropy(logits, labels, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0):
    """logits [N, C] float, labels [N] int64: the mean loss (a scalar).
    With any of torch's ignore_index, reduction or label_smoothing given
    (or logits [N, C, d1, ...]) it is cross_entropy_ex."""
    logits = _as_tensor(logits)
    if (ignore_index != -100 or reduction != "mean" or label_smoothing != 0
            or len(logits.shape) != 2):
        return cross_entropy_ex(logits, labels, ignore_index,
                                label_smoothing, reduction)
    if not isinstance(labels, Tensor):
        labels = logits._dev.tensor(np.asarray(labels), dtype=int64)
    out = _out()
    rc = lib.dispatch_cross_entropy(_hin(logits), _hin(labels), out)
    if rc < 0:
        _fail(rc, logits)
    return logits._dev._adopt(out[0])


def permute(x, dims):
    return _shape_op(lib.dispatch_permute, x, dims)


def transpose(x, dim0=0, dim1=1):
    x = _as_tensor(x)
    out = _out()
    rc = lib.dispatch_transpose(_hin(x), int(dim0), int(dim1), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def slice(x, dim, start=0, end=None, step=1):  # noqa: A001
    """x[start:end:step] along dim, Python style (step > 0, clamped)."""
    x = _as_tensor(x)
    if end is None:
        end = 2 ** 62
    out = _out()
    rc = lib.dispatch_slice(_hin(x), int(dim), int(start), int(end), int(step),
                            out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def index_select(x, dim, index):
    """Rows of x along dim picked by index (int64, 1-D)."""
    x = _as_tensor(x)
    if not isinstance(index, Tensor):
        index = x._dev.tensor(np.asarray(index), dtype=int64)
    out = _out()
    rc = lib.dispatch_index_select(_hin(x), int(dim), _hin(index), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def dropout(x, p, seed):
    """Keeps element i iff uniform(seed)[i] >= p, scaled by 1/(1-p)."""
    x = _as_tensor(x)
    out = _out()
    rc = lib.dispatch_dropout(_hin(x), float(p), int(seed), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


# issue 23: attention

def attention(q, k, v, key_mask=None, is_causal=False, scale=None):
    """Fused softmax(scale q k^T + mask) v: q [B, H, Tq, d], k [B, H, Tk, d],
    v [B, H, Tk, dv] (one float dtype) -> [B, H, Tq, dv]. key_mask: bool
    [B, Tk], True = attend (None: every key). is_causal: query i attends
    keys j <= i (top-left aligned, as PyTorch's is_causal). scale: None or
    0 for 1/sqrt(d). A query that attends no key gives 0 (PyTorch: NaN)."""
    q = _as_tensor(q)
    k, v = _as_tensor(k, q), _as_tensor(v, q)
    if key_mask is not None and not isinstance(key_mask, Tensor):
        key_mask = q._dev.tensor(np.asarray(key_mask, dtype=bool_))
    out = _out()
    rc = lib.dispatch_attention(_hin(q), _hin(k), _hin(v),
                                _hin(key_mask) if key_mask is not None
                                else ffi.NULL, 1 if is_causal else 0,
                                float(scale or 0.0), out)
    if rc < 0:
        _fail(rc, q)
    return q._dev._adopt(out[0])


def track(t):
    """AUTODIFF(t): a tracked leaf wrapping t (float, not already tracked;
    otherwise EDOUBLEWRAP / EDTYPE). A new Tensor; t is unchanged."""
    out = _out()
    rc = lib.dispatch_autodiff(_hraw(t), out)
    if rc < 0:
        _fail(rc, t)
    leaf = t._dev._adopt(out[0])
    leaf._leaf = True
    return leaf


# issue 23: embedding/norm

_NO_INDEX = -(2 ** 63)  # DISPATCH_NO_INDEX (INT64_MIN)


def embedding(input, weight, padding_idx=None):  # noqa: A002
    """Rows of weight [V, D] picked by input (int64, any shape): shape
    input.shape + (D,), as torch.nn.functional.embedding. padding_idx
    (None, or a row in [-V, V)) only stops that row's gradient."""
    weight = _as_tensor(weight)
    if not isinstance(input, Tensor):
        input = weight._dev.tensor(np.asarray(input), dtype=int64)
    pad = _NO_INDEX if padding_idx is None else int(padding_idx)
    out = _out()
    rc = lib.dispatch_embedding(_hin(weight), _hin(input), pad, out)
    if rc < 0:
        _fail(rc, weight)
    return weight._dev._adopt(out[0])


def _nlast(x, normalized_shape):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) \
        else tuple(int(d) for d in normalized_shape)
    if not shape or tuple(x.shape[len(x.shape) - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} is not the last dims of "
                         f"x's shape {tuple(x.shape)}")
    return len(shape)


def _affine(x, t):
    return None if t is None else _as_tensor(t, x)


def layer_norm(input, normalized_shape, weight=None, bias=None,  # noqa: A002
               eps=1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dims
    normalized_shape (an int or a tuple), biased variance, as
    torch.nn.functional.layer_norm."""
    x = _as_tensor(input)
    n = _nlast(x, normalized_shape)
    w, b = _affine(x, weight), _affine(x, bias)
    out = _out()
    rc = lib.dispatch_layer_norm(_hin(x), n, _hin(w) if w is not None else
                                 ffi.NULL, _hin(b) if b is not None else
                                 ffi.NULL, float(eps), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def rms_norm(input, normalized_shape, weight=None, eps=None):  # noqa: A002
    """x / sqrt(mean(x^2) + eps) * weight over the last dims
    normalized_shape, as torch.nn.functional.rms_norm (eps None: the
    dtype's machine epsilon)."""
    x = _as_tensor(input)
    n = _nlast(x, normalized_shape)
    if eps is None:  # bfloat16's is torch.finfo's: 2^-7
        eps = 2.0 ** -7 if x.dtype is bfloat16 else float(np.finfo(x.dtype).eps)
    w = _affine(x, weight)
    out = _out()
    rc = lib.dispatch_rms_norm(_hin(x), n, _hin(w) if w is not None else
                               ffi.NULL, float(eps), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def batch_norm(input, running_mean, running_var, weight=None,  # noqa: A002
               bias=None, training=False, momentum=0.1, eps=1e-5):
    """Per-channel normalisation of input [N, C, ...], as
    torch.nn.functional.batch_norm: training uses the batch statistics and
    updates running_mean / running_var (Tensors, or None) in place on
    their device; otherwise the running statistics normalise."""
    x = _as_tensor(input)
    rm, rv = (None if t is None else _as_tensor(t, x)
              for t in (running_mean, running_var))
    w, b = _affine(x, weight), _affine(x, bias)
    out = _out()
    rc = lib.dispatch_batch_norm(
        _hin(x), *(_hin(t) if t is not None else ffi.NULL
                  for t in (rm, rv, w, b)),
        int(bool(training)), float(momentum), float(eps), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


# issue 23: elementwise and reductions

def clamp(x, min=None, max=None):  # noqa: A002 (PyTorch's names)
    """min(max(x, min), max) elementwise, as torch.clamp; None leaves a
    side open. Gradient 1 on [min, max] (inclusive), 0 outside."""
    x = _as_tensor(x)
    lo = -math.inf if min is None else float(min)
    hi = math.inf if max is None else float(max)
    out = _out()
    rc = lib.dispatch_clamp(_hin(x), lo, hi, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def masked_fill(x, mask, value):
    """x with value where mask (bool, broadcast to x's shape) is true, as
    torch.masked_fill; no gradient flows through the filled positions."""
    x = _as_tensor(x)
    if not isinstance(mask, Tensor):
        mask = x._dev.tensor(np.asarray(mask, dtype=bool_))
    out = _out()
    rc = lib.dispatch_masked_fill(_hin(x), _hin(mask), float(value), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _moments(cfn, x, dim, correction, keepdim):
    x = _as_tensor(x)
    n, dims = _dims_arg(dim)
    out = _out()
    rc = cfn(_hin(x), n, dims, int(correction), 1 if keepdim else 0, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def var(x, dim=None, correction=1, keepdim=False):
    """Variance over dim (an int, a tuple or None: every dim), as
    torch.var(dim, correction=, keepdim=): sum((x - mean)^2) /
    max(0, N - correction); N - correction <= 0 gives inf or NaN."""
    return _moments(lib.dispatch_var, x, dim, correction, keepdim)


def std(x, dim=None, correction=1, keepdim=False):
    """The square root of var(x, dim, correction, keepdim)."""
    return _moments(lib.dispatch_std, x, dim, correction, keepdim)


_gelu_exact = gelu  # noqa: F821 (made from the op table above)


def gelu(x, approximate="none"):
    """GELU as torch.nn.functional.gelu: the exact erf form, or with
    approximate='tanh' the tanh approximation (the gelu_tanh op)."""
    if approximate == "tanh":
        return gelu_tanh(x)  # noqa: F821
    if approximate != "none":
        raise _error(_EINVAL, "gelu: approximate must be 'none' or 'tanh', "
                     f"got {approximate!r}")
    return _gelu_exact(x)


_ISSUE23_METHODS = ("clamp", "masked_fill", "var", "std", "gelu")


# issue 23: loss

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def cross_entropy_ex(logits, labels, ignore_index=-100, label_smoothing=0.0,
                     reduction="mean"):
    """torch.nn.functional.cross_entropy with class indices: logits [N, C]
    or [N, C, d1, ...] (or [C]), labels int64 [N] or [N, d1, ...];
    reduction "none" (the labels' shape, 0 where ignored), "sum" or
    "mean" (over the labels that are not ignore_index; NaN when all are),
    label_smoothing in [0, 1]."""
    logits = _as_tensor(logits)
    if not isinstance(labels, Tensor):
        labels = logits._dev.tensor(np.asarray(labels), dtype=int64)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy_ex: reduction {reduction!r} is not "
                         "'none', 'sum' or 'mean'")
    out = _out()
    rc = lib.dispatch_cross_entropy_ex(_hin(logits), _hin(labels),
                                       int(ignore_index),
                                       float(label_smoothing),
                                       _REDUCTIONS[reduction], out)
    if rc < 0:
        _fail(rc, logits)
    return logits._dev._adopt(out[0])


# issue 23: pools (stride None or 0 is the kernel size, as torch's default)

def avg_pool2d_ex(x, kernel, stride=None, padding=0, count_include_pad=True):
    """torch.nn.functional.avg_pool2d: count_include_pad False divides each
    window by its elements inside the input, True by kh * kw."""
    x = _as_tensor(x)
    kh, kw = _pair2(kernel)
    sh, sw = _pair2(0 if stride is None else stride)
    ph, pw = _pair2(padding)
    out = _out()
    rc = lib.dispatch_avg_pool2d_ex(_hin(x), kh, kw, sh, sw, ph, pw,
                                    1 if count_include_pad else 0, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def avg_pool2d(x, kernel, stride=None, padding=0, count_include_pad=True):
    """The avg pool; with count_include_pad False it is avg_pool2d_ex."""
    if not count_include_pad:
        return avg_pool2d_ex(x, kernel, stride, padding, False)
    return _pool(lib.dispatch_avg_pool2d, x, kernel, stride, padding)


# issue 23: conv bias

def conv2d_bias(x, w, bias, stride=1, padding=0, dilation=1):
    """conv2d(x, w) + bias[o] on each output channel o, one op; bias None
    is conv2d."""
    if bias is None:
        return conv2d(x, w, stride, padding, dilation)
    x, w = _pair(x, w)
    bias = _as_tensor(bias, x)
    sh, sw = _pair2(stride)
    ph, pw = _pair2(padding)
    dh, dw = _pair2(dilation)
    out = _out()
    rc = lib.dispatch_conv2d_bias(_hin(x), _hin(w), _hin(bias), sh, sw, ph, pw,
                                  dh, dw, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


# ---------------------------------------------------------------- torch-like
# (issue 26): reductions with torch's dtypes, max/min with a dim, the
# operators' dtype promotion, floor division, remainder and powers, each
# composed of the op table's ops on the device.

_EDTYPE = codes["EDTYPE"]
_sum_op, _mean_op, _max_op, _min_op = sum, mean, max, min  # noqa: F821
_argmax_op, _argmin_op = argmax, argmin  # noqa: F821


def _cast(x, dt):
    return x if x.dtype == dt else x.astype(dt)


def sum(x, dim=None, keepdim=False, dtype=None):  # noqa: A001
    """Sum over dim (an int, a tuple, None: all), as torch.sum: bool sums
    as int64 (so (pred == y).sum() counts), int64 stays int64, floats keep
    their dtype; dtype casts the input first."""
    x = _as_tensor(x)
    if dtype is not None:
        x = _cast(x, _dtype(dtype))
    elif x.dtype == bool_:
        x = x.astype(int64)
    return _sum_op(x, dim, keepdim)


def mean(x, dim=None, keepdim=False, dtype=None):
    """Mean over dim, as torch.mean: floats only; an int64 or bool input
    is an error (dispatch.EDTYPE, a TypeError), as in torch, unless dtype
    names a float dtype to cast it to first."""
    x = _as_tensor(x)
    if dtype is not None:
        x = _cast(x, _dtype(dtype))
    if x.dtype.kind != "f":
        raise _error(_EDTYPE, "mean(): could not infer output dtype. Input "
                     "dtype must be a floating point dtype. Got: "
                     f"{x.dtype.name} (pass dtype=dispatch.float32, or cast "
                     "with .astype / .to)")
    return _mean_op(x, dim, keepdim)


def _nonzero_count(x, dim, keepdim, want):
    x = _as_tensor(x)
    b = x if x.dtype == bool_ else ne(x, x._dev.full((), 0, x.dtype))  # noqa
    if not want:
        b = eq(b, x._dev.full((), 0, bool_))  # noqa: F821
    return _sum_op(b.astype(int64), dim, keepdim)


def any(x, dim=None, keepdim=False):  # noqa: A001
    """True where some element over dim is nonzero, as torch.any (bool;
    an empty reduction is False)."""
    c = _nonzero_count(x, dim, keepdim, True)
    return gt(c, c._dev.full((), 0, int64))  # noqa: F821


def all(x, dim=None, keepdim=False):  # noqa: A001
    """True where every element over dim is nonzero, as torch.all (bool;
    an empty reduction is True)."""
    c = _nonzero_count(x, dim, keepdim, False)
    return eq(c, c._dev.full((), 0, int64))  # noqa: F821


# torch.return_types.max / .min: a named tuple (values, indices)
MaxMin = collections.namedtuple("MaxMin", ["values", "indices"])


def _extreme(op, argop, pair, x, dim, keepdim):
    if isinstance(dim, (Tensor, np.ndarray)):
        return _binop(pair, x, dim)  # t.max(other): maximum
    x = _as_tensor(x)
    is_bool = x.dtype == bool_
    v = x.astype(int64) if is_bool else x
    if dim is None:
        r = op(v)
        return r.astype(bool_) if is_bool else r
    if not isinstance(dim, numbers.Integral):  # dims: values only (amax)
        r = op(v, tuple(dim), keepdim)
        return r.astype(bool_) if is_bool else r
    values = op(v, dim, keepdim)
    return MaxMin(values.astype(bool_) if is_bool else values,
                  argop(v, dim, keepdim))


def max(x, dim=None, keepdim=False):  # noqa: A001
    """As torch.max: without dim the largest element (a 0-d tensor); with
    an int dim the named tuple (values, indices) (ties: the first index);
    with a tensor, the elementwise maximum. A tuple of dims gives the
    values alone, as torch.amax."""
    return _extreme(_max_op, _argmax_op, "maximum", x, dim, keepdim)


def min(x, dim=None, keepdim=False):  # noqa: A001
    """As torch.min (see max)."""
    return _extreme(_min_op, _argmin_op, "minimum", x, dim, keepdim)


def argmax(x, dim=None, keepdim=False):
    """As torch.argmax: int64 indices (ties: the first); dim None: the
    index in the flattened tensor."""
    return _argmax_op(x, dim, keepdim)


def argmin(x, dim=None, keepdim=False):
    """As torch.argmin."""
    return _argmin_op(x, dim, keepdim)


# torch's type promotion between {bool, int64, float16, bfloat16, float32,
# float64}: a higher category wins; within the floats the wider one, and
# float16 with bfloat16 (neither holds the other) gives float32
_CATEGORY = {bool_: 0, int64: 1, float16: 2, bfloat16: 2, float32: 2,
             float64: 2}
_FLOAT_RANK = {float16: 0, bfloat16: 0, float32: 1, float64: 2}


def _promote_types(a, b):
    if a == b:
        return a
    ca, cb = _CATEGORY[a], _CATEGORY[b]
    if ca != cb:
        return a if ca > cb else b
    ra, rb = _FLOAT_RANK[a], _FLOAT_RANK[b]
    if ra == rb:
        return float32  # float16 and bfloat16
    return a if ra > rb else b


def _number_dtype(v):
    if isinstance(v, (bool, np.bool_)):
        return bool_
    if isinstance(v, numbers.Integral):
        return int64
    if isinstance(v, numbers.Real):
        return float32  # torch's default dtype
    raise TypeError(f"unsupported operand {v!r}")


def _result_dtype(a, b):
    """torch.result_type(a, b) for a Tensor and a Tensor or a number: a
    0-d tensor or a number sets the dtype only when it is of a higher
    category (bool < int < float) than the other operand."""
    if isinstance(b, Tensor) and isinstance(a, Tensor):
        za, zb = a.ndim == 0, b.ndim == 0
        if za == zb:
            return _promote_types(a.dtype, b.dtype)
        dimmed, zero = (a, b) if zb else (b, a)
        if _CATEGORY[zero.dtype] > _CATEGORY[dimmed.dtype]:
            return zero.dtype
        return dimmed.dtype
    t, n = (a, b) if isinstance(a, Tensor) else (b, a)
    nd = _number_dtype(n)
    return nd if _CATEGORY[nd] > _CATEGORY[t.dtype] else t.dtype


def _is_number(v):
    return isinstance(v, (numbers.Number, np.bool_)) or (
        isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype != object)


# operator -> (scalar op for x OP s, for s OP x, takes int64)
_SCALAR_FORMS = {
    "add": (lib.dispatch_add_scalar, lib.dispatch_add_scalar, True),
    "sub": (lib.dispatch_sub_scalar, lib.dispatch_rsub_scalar, True),
    "mul": (lib.dispatch_mul_scalar, lib.dispatch_mul_scalar, True),
    "div": (lib.dispatch_div_scalar, lib.dispatch_rdiv_scalar, False),
}
_FLOATS = (float32, float64, float16, bfloat16)


def _binop(name, a, b, dt=None):
    """a OP b for the operators (a or b a Tensor): both are promoted to one
    dtype as torch does (dt: that dtype instead), a number uses the op's
    scalar form where the dtype has one, else a 0-d tensor made on the
    device (full); a numpy array or list is uploaded."""
    fn = globals()[name]
    if dt is None:  # the common cases first: same dtypes, float and number
        if type(a) is Tensor:
            da = a.dtype
            if type(b) is Tensor:
                if b.dtype == da and da is not bool_:
                    return fn(a, b)
            elif type(b) is float and da in _FLOATS and name in _SCALAR_FORMS:
                return _scalar_op(_SCALAR_FORMS[name][0], a, b)
        elif type(a) is float and type(b) is Tensor and b.dtype in _FLOATS \
                and name in _SCALAR_FORMS:
            return _scalar_op(_SCALAR_FORMS[name][1], b, a)
    t = a if isinstance(a, Tensor) else b
    other = b if t is a else a
    if not isinstance(other, Tensor) and not _is_number(other):
        other = _as_tensor(np.asarray(other) if isinstance(other, list)
                           else other, t)
        return _binop(name, t, other, dt) if t is a \
            else _binop(name, other, t, dt)
    if isinstance(other, Tensor):
        dt = dt or _result_dtype(a, b)
        return _apply(name, fn, _cast(a, dt), _cast(b, dt))
    if isinstance(other, np.ndarray):
        other = other.item()
    dt = dt or _result_dtype(t, other)
    x = _cast(t, dt)
    forms = _SCALAR_FORMS.get(name)
    if forms is not None and (dt.kind == "f" or forms[2]) \
            and dt != bool_:
        return _scalar_op(forms[0 if t is a else 1], x, other)
    s = x._dev.full((), other, dt)
    return _apply(name, fn, x, s) if t is a else _apply(name, fn, s, x)


def _apply(name, fn, a, b):
    """fn(a, b) for two tensors of one dtype; bool ones (which the C ops
    take only for eq / ne) as torch's: + is or, * is and, the comparisons
    and maximum / minimum as on 0 and 1."""
    if a.dtype != bool_ or name in ("eq", "ne"):
        return fn(a, b)
    if name == "sub":
        raise _error(_EDTYPE, "sub: subtraction of two bool tensors is not "
                     "supported (as in torch): use ^ or ~")
    r = fn(a.astype(int64), b.astype(int64))
    return r if r.dtype == bool_ else r.astype(bool_)


def _true_div(a, b):
    """a / b as torch: int64 and bool operands divide as float32."""
    dt = _result_dtype(a, b)
    return _binop("div", a, b, dt if dt.kind == "f" else float32)


def _full_like0(x, v):
    return x._dev.full((), v, x.dtype)


def _floor(x):
    """floor of a float tensor, composed: truncation through int64 (exact
    below 2^23 / 2^52, where floats have a fraction), one less where that
    is above x; larger values, inf and NaN are their own floor."""
    big = 2.0 ** (23 if x.dtype == float32 else 52)
    t = x.astype(int64).astype(x.dtype)
    f = t - lt(x, t).astype(x.dtype)  # noqa: F821
    return where(lt(abs(x), _full_like0(x, big)), f, x)  # noqa: F821


def _floor_div_same(a, b):
    """floor(a / b) for two tensors of one dtype, recording nothing."""
    with no_grad():
        if a.dtype.kind == "f":
            # torch's float // goes through fmod: inf // finite is NaN
            q = _floor(div(a, b))  # noqa: F821
            nan = _full_like0(q, math.nan)
            return where(eq(abs(a), _full_like0(a, math.inf)),  # noqa: F821
                         where(eq(b, _full_like0(b, 0)), q, nan), q)  # noqa
        if a.dtype == bool_:
            a, b = a.astype(int64), b.astype(int64)
        q = div(a, b)  # noqa: F821  (truncates toward zero)
        r = sub(a, mul(q, b))  # noqa: F821
        # one less where the remainder is not 0 and its sign is not b's
        return add(q, minimum(mul(sign(r), sign(b)),  # noqa: F821
                              _full_like0(q, 0)))


def _operands(a, b, dt=None):
    """a and b as two Tensors of their promoted dtype (or dt)."""
    t = a if isinstance(a, Tensor) else b
    o = b if t is a else a
    if not isinstance(o, Tensor):
        if _is_number(o):
            o = np.asarray(o).item()
            dt = dt or _result_dtype(t, o)
            o = t._dev.full((), o, dt)
        else:
            o = _as_tensor(np.asarray(o) if isinstance(o, list) else o, t)
    a, b = (t, o) if t is a else (o, t)
    dt = dt or _result_dtype(a, b)
    return _cast(a, dt), _cast(b, dt)


def floor_divide(a, b):
    """a // b with torch's floor rounding (toward -inf, also for
    negative int64 operands; an int64 division by zero is EINVAL). The
    result is not tracked (torch has no gradient for it either)."""
    return _floor_div_same(*_operands(a, b))


def remainder(a, b):
    """a % b as torch.remainder: a - floor(a / b) * b, so the result has
    the sign of the divisor (C's % and math.fmod take the dividend's).
    Gradient as torch's: 1 for a, -floor(a / b) for b."""
    a, b = _operands(a, b)
    q = _floor_div_same(a, b)
    if a.dtype == bool_:
        a, b, q = a.astype(int64), b.astype(int64), q
    return sub(a, mul(q, b))  # noqa: F821


def pow(a, b):  # noqa: A001
    """a ** b as torch.pow. A number exponent of a float tensor is the
    pow_scalar op; int64 ** int >= 0 is computed in float64 and cast back
    (exact below 2^53); a negative int64 tensor exponent gives torch's
    integer results (1 for a base of 1, +-1 for -1, else 0). A tensor exponent (or base number, s ** t) is
    composed: exp(b log|a|) computed in float64, negated for a negative
    base with an odd integer exponent, NaN for a negative base with a
    fractional one, 1 for b == 0; float32 results are rounded from it."""
    if isinstance(a, Tensor) and _is_number(b) and not isinstance(b, Tensor):
        b = np.asarray(b).item()
        dt = _result_dtype(a, b)
        if dt.kind != "f":  # int64 (or bool) ** int
            if b < 0:
                raise _error(_EINVAL, "Integers to negative integer powers "
                             "are not allowed")
            r = _scalar_op(lib.dispatch_pow_scalar, a.astype(float64), b)
            return r.astype(int64)
        return _scalar_op(lib.dispatch_pow_scalar, _cast(a, dt), b)
    a, b = _operands(a, b)
    dt = a.dtype
    if dt.kind != "f":
        if dt == bool_:
            a, b = a.astype(int64), b.astype(int64)
        r = _pow_f64(a.astype(float64), b.astype(float64))
        with no_grad():  # an exact integer, up to the rounding of exp/log
            r = _floor(r + 0.5).astype(int64)
            # a negative exponent: torch's integer pow gives 1 for a base
            # of 1, +-1 for -1 (the exponent's parity), else 0
            zero, one = _full_like0(a, 0), _full_like0(a, 1)
            odd = ne(remainder(b, 2), zero)  # noqa: F821
            small = where(eq(a, one), one, where(  # noqa: F821
                eq(a, -one), where(odd, -one, one), zero))  # noqa: F821
            return where(ge(b, zero), r, small)  # noqa: F821
    return _pow_f64(a.astype(float64), b.astype(float64)).astype(dt)


def _pow_f64(a, b):
    zero = _full_like0(a, 0.0)
    mag = exp(mul(b, log(abs(a))))  # noqa: F821
    with no_grad():
        fb = _floor(b)
        is_int = eq(fb, b)  # noqa: F821
        odd = ne(_floor(b * 0.5) * 2.0, fb)  # noqa: F821
        negative = lt(a, zero)  # noqa: F821
    r = where(negative, where(is_int, where(odd, -mag, mag),
                              _full_like0(a, math.nan)), mag)
    return where(eq(b, zero), _full_like0(a, 1.0), r)  # noqa: F821


# ---------------------------------------------------------------- tensor

class Tensor:
    """A tensor on a Device: local, remote, or autodiff wrapping one of
    those. Made by Device.tensor / zeros / ... or by ops; never directly.
    Operators: + - * / // % @ **, unary -, abs(), ~ & | ^ on bool, and
    the comparisons, which give bool tensors (so == is elementwise and a
    Tensor hashes by identity, as in numpy and torch); mixed dtypes promote
    as in torch."""
    __slots__ = ("_h", "_dev", "_shape", "_leaf", "__weakref__")
    # numpy: let our reflected operators handle ndarray op Tensor
    __array_ufunc__ = None

    def __init__(self, *a, **k):
        raise TypeError("make tensors with dispatch.tensor() or a Device")

    # -- what it is

    @property
    def device(self) -> Device:
        return self._dev

    @property
    def shape(self) -> "tuple[int, ...]":
        s = self._shape
        if s is None:
            h = _hin(self)
            n = lib.dispatch_tensor_ndim(h)
            p = lib.dispatch_tensor_shape(h)
            s = self._shape = tuple(p[i] for i in range(n))
        return s

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self):
        """The number of elements, as numpy's size; called, the shape, as
        torch's: t.size() is t.shape, t.size(d) is t.shape[d]."""
        return _Size(lib.dispatch_tensor_numel(_hin(self)), self.shape)

    def numel(self):
        return lib.dispatch_tensor_numel(_hin(self))

    def dim(self):
        """The number of dims (ndim), as torch's t.dim()."""
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return _C_TO_NP[lib.dispatch_tensor_dtype(_hin(self))]

    @property
    def kind(self) -> str:
        """"local", "remote" or "autodiff"."""
        return _KIND_NAMES[lib.dispatch_kind(_hraw(self))]

    @property
    def requires_grad(self):
        """True for an autodiff tensor (a tracked leaf, or an op's output
        with a tracked input made outside no_grad). Setting it True on a
        float tensor makes this object a tracked leaf (requires_grad_)."""
        return bool(lib.dispatch_is_autodiff(_hraw(self)))

    @requires_grad.setter
    def requires_grad(self, flag):
        self.requires_grad_(flag)

    @property
    def is_leaf(self):
        """True for a tensor that is not an op's tracked output: a plain
        tensor, or a leaf made by track / requires_grad, as torch's."""
        return self._leaf or not self.requires_grad

    def requires_grad_(self, requires_grad=True):
        """As torch's, in place: True makes this Tensor object a tracked
        leaf (the C tensor it held is wrapped, as by track(), and this
        object now holds the wrapper); False on a leaf makes it the plain
        tensor again (an op's tracked output: dispatch.EINVAL, as torch
        refuses it; use detach()). Returns self."""
        h = _hraw(self)
        if bool(requires_grad) == bool(lib.dispatch_is_autodiff(h)):
            return self
        if requires_grad:
            out = _out()
            rc = lib.dispatch_autodiff(h, out)
            if rc < 0:
                _fail(rc, self)
            new, leaf = out[0], True
        else:
            if not self._leaf:
                raise _error(_EINVAL, "requires_grad_(False): you can only "
                             "change requires_grad flags of leaf tensors; "
                             "use detach() for an op's output")
            new, leaf = lib.dispatch_tensor_ref(lib.dispatch_inner(h)), False
        self._h = ffi.gc(new, self._dev._state.free_tensor)
        self._leaf = leaf
        return self

    def _become(self, t):
        """Makes this Tensor object hold t's C tensor (t is emptied): the
        in-place operations (__setitem__) are a new tensor on the device
        that takes the old one's place."""
        if t is self:
            return
        self._h, t._h = t._h, None
        self._shape = t._shape
        self._leaf = t._leaf

    @property
    def status(self):
        """0, or the error code that poisoned this tensor (a failed remote
        op whose error has surfaced at a wait)."""
        return lib.dispatch_tensor_status(_hin(self))

    def __len__(self):
        s = self.shape
        if not s:
            raise TypeError("len() of a 0-d tensor")
        return s[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self):
        """tensor([...], device='...', dtype=..., requires_grad=True) as
        torch's, with numpy's formatting (abbreviated past 1000 elements);
        remote: reads the values (one round trip)."""
        if self._h is None or self._dev.closed:
            return "dispatch.Tensor(<freed>)"
        tail = f"device={self._dev.spec!r}, dtype=dispatch.{self.dtype.name}"
        if self.requires_grad:
            tail += ", requires_grad=True"
        try:
            a = self._values()
        except DispatchError as e:
            return (f"tensor(<{e.name}: {e.message}>, shape={self.shape}, "
                    f"{tail})")
        body = np.array2string(a, separator=", ", prefix="tensor(",
                               threshold=1000, edgeitems=3)
        return f"tensor({body}, {tail})"

    __hash__ = object.__hash__

    # -- data out

    def numpy(self) -> np.ndarray:
        """A fresh numpy array with a copy of the data (remote: one read
        round trip, where deferred errors surface). float16: numpy's
        float16; bfloat16: the raw values as uint16 (bf16_to_f32 gives
        their float32 values, t.float().numpy() does it on the device)."""
        h = _hin(self)
        arr = np.empty(self.shape, dtype=_storage(self.dtype))
        rc = lib.dispatch_tensor_read(h, ffi.from_buffer(arr), arr.nbytes)
        if rc < 0:
            _fail(rc, self)
        return arr

    def __array__(self, dtype=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def _values(self):
        """numpy() with bfloat16 as its float32 values: what item, tolist
        and repr show."""
        a = self.numpy()
        return bf16_to_f32(a) if self.dtype is bfloat16 else a

    def item(self) -> "float | int | bool":
        if self.size != 1:
            raise ValueError(f"item() needs one element, not {self.size}")
        return self._values().reshape(()).item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        """A one-element int64 (or bool) tensor as a Python index, as
        torch's (reads it)."""
        if self.dtype.kind not in "ib":
            raise TypeError("only integer tensors of a single element can "
                            "be converted to an index")
        return int(self.item())

    def __bool__(self):
        if self.size != 1:
            raise ValueError("the truth value of a tensor of more than one "
                             "element is ambiguous")
        return bool(self.item())

    def tolist(self):
        return self._values().tolist()

    def to(self, *args, device=None, dtype=None):
        """As torch's: t.to(device), t.to(dtype), t.to(device, dtype),
        t.to(other_tensor); device a Device or a spec ("local",
        "tcp://HOST:PORT": self's device when its spec is that, else an
        open device of that spec, else one opened for it and kept until
        exit). self when nothing changes; a copy to another device is
        never autodiff (track it again if needed)."""
        for a in args:
            if isinstance(a, Tensor):
                device, dtype = a._dev, a.dtype
            elif isinstance(a, Device) or (isinstance(a, str) and (
                    a == "local" or "://" in a)):
                device = a
            else:
                dtype = a
        t = self
        if device is not None:
            dev = self._dev if isinstance(device, str) and \
                device == self._dev.spec else _resolve_device(device)
            if dev is not self._dev:
                out = _out()
                rc = lib.dispatch_to_device(_hin(self), dev._handle(), out)
                if rc < 0:  # the library keeps the message on the target
                    dev._raise(rc)
                t = dev._adopt(out[0])
        if dtype is not None:
            t = _cast(t, _dtype(dtype))
        return t

    def cpu(self):
        """t.to("local"): t itself on a local device, else a copy on one."""
        return self.to("local")

    def float(self):  # noqa: A003
        return _cast(self, float32)

    def half(self):
        """As torch's: a float16 copy (self when it is one), rounded to
        nearest even."""
        return _cast(self, float16)

    def bfloat16(self):
        """As torch's: a bfloat16 copy (self when it is one)."""
        return _cast(self, bfloat16)

    def double(self):
        return _cast(self, float64)

    def long(self):
        return _cast(self, int64)

    def bool(self):  # noqa: A003
        return _cast(self, bool_)

    def astype(self, dtype):
        out = _out()
        rc = lib.dispatch_cast(_hin(self), _NP_TO_C[_dtype(dtype)], out)
        if rc < 0:
            _fail(rc, self)
        return self._dev._adopt(out[0])

    def keep(self):
        """keep(self): outlives the innermost scope holding it."""
        return keep(self)

    # -- autodiff

    track = track

    @property
    def inner(self):
        """The local or remote tensor an autodiff tensor wraps (self's own
        for a plain one), as a new Tensor sharing the storage: ops on it are
        not recorded."""
        return self._dev._adopt(
            lib.dispatch_tensor_ref(lib.dispatch_inner(_hraw(self))))

    def detach(self):
        return self.inner

    def backward(self, retain_graph: bool = False) -> "Grads":
        """Reverse pass from this one-element autodiff tensor to every
        tracked leaf reachable from it. Returns the Grads (remote: one
        request, pipelined like an op by a server of protocol 1.3, whose
        failure the next wait raises; the gradients stay on the server
        until read). The device also remembers them for Tensor.grad, until
        its next backward."""
        h = _hraw(self)
        # Let go of the previous gradients before this pass makes new ones:
        # unless the caller still holds them, they are freed first (the
        # drain in _handle), so a loop holds one set at a time, as a C loop
        # that frees its grads each step does (remote: the session's quota
        # need not fit two; the server reuses their memory).
        self._dev._last_grads = None
        self._dev._handle()
        out = ffi.new("dispatch_grads **")
        rc = lib.dispatch_backward_ex(h, 1 if retain_graph else 0, out)
        if rc < 0:
            _fail(rc, self)
        g = Grads(self._dev, out[0])
        self._dev._last_grads = g
        return g

    @property
    def grad(self):
        """This leaf's gradient from the device's last backward (None when
        there was none). Remote: a leaf the backward did not reach raises
        ENOGRAD when the result is read."""
        g = self._dev._last_grads
        return None if g is None else g[self]

    # -- methods that mirror the functions: those of the op table are
    # added after the class (_add_methods); these take other arguments

    def transpose(self, dim0=0, dim1=1): return transpose(self, dim0, dim1)
    def index_select(self, dim, index): return index_select(self, dim, index)

    def reshape(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = shape[0]
        return reshape(self, shape)

    def view(self, *shape):
        """reshape: dispatch has no views, so the result is a copy (a write
        into it does not reach self)."""
        return self.reshape(*shape)

    def flatten(self, start_dim=0, end_dim=-1):
        """Dims start_dim..end_dim merged into one, as torch.flatten."""
        s = self.shape
        if not s:
            return reshape(self, (1,))
        a, b = (_norm_dim(d, len(s)) for d in (start_dim, end_dim))
        if a > b:
            raise IndexError("flatten: start_dim comes after end_dim")
        return reshape(self, s[:a] + (math.prod(s[a:b + 1]),) + s[b + 1:])

    def unsqueeze(self, dim):
        """A size-1 dim inserted at dim (in [-ndim-1, ndim])."""
        s = self.shape
        d = _norm_dim(dim, len(s) + 1)
        return reshape(self, s[:d] + (1,) + s[d:])

    def squeeze(self, dim=None):
        """Size-1 dims removed (dim: only that one, if its size is 1)."""
        s = self.shape
        if dim is None:
            return reshape(self, tuple(n for n in s if n != 1))
        if not s:
            _norm_dim(dim, 1)
            return reshape(self, s)
        d = _norm_dim(dim, len(s))
        return reshape(self, s[:d] + s[d + 1:] if s[d] == 1 else s)

    def expand(self, *sizes):
        """broadcast_to, -1 keeping a dim's size, as torch's expand (a
        copy, not a view)."""
        if len(sizes) == 1 and _is_shape(sizes[0]):
            sizes = sizes[0]
        s = self.shape
        lead = len(sizes) - len(s)
        shape = tuple(s[i - lead] if n == -1 and i >= lead else int(n)
                      for i, n in enumerate(sizes))
        return broadcast_to(self, shape)  # noqa: F821

    def any(self, dim=None, keepdim=False):  # noqa: A003
        return any(self, dim, keepdim)

    def all(self, dim=None, keepdim=False):  # noqa: A003
        return all(self, dim, keepdim)

    def view_as(self, other):
        return reshape(self, other.shape)

    reshape_as = view_as

    def expand_as(self, other):
        return broadcast_to(self, other.shape)  # noqa: F821

    def permute(self, *dims):
        if len(dims) == 1 and not isinstance(dims[0], numbers.Integral):
            dims = dims[0]
        return permute(self, dims)

    @property
    def T(self):
        """The reverse of the dims (a transpose for 2-D)."""
        return permute(self, tuple(range(self.ndim - 1, -1, -1)))

    def __getitem__(self, key):
        """Indexing as torch's: ints, slices (negative steps too), None,
        Ellipsis, and one advanced index: an int64 tensor or list (any
        shape; negative entries count from the end) or a bool mask over
        one or more dims. Every result is a new tensor (a copy, dispatch
        has no views) made by ops on the device (slice, index_select,
        reshape); a bool mask is the one thing read back: its nonzero
        positions decide the result's shape."""
        return _getitem(self, key)

    def __setitem__(self, key, value):
        """t[key] = value as torch's, with the keys of __getitem__ (at most
        one advanced index: a bool mask over the leading dims, or a 1-D
        int64 index on the first) and a number or a tensor broadcast to the
        selected region. Done on the device as a new tensor (where /
        masked_fill / index_select) that takes this object's place: other
        Tensor objects (t.inner, an earlier copy) keep the old values. A
        tracked leaf refuses it (as torch's, outside no_grad); inside
        no_grad it becomes a new tracked leaf (make optimizers after)."""
        leaf = self.requires_grad and self._leaf
        if leaf and _grad_mode.on:
            raise _error(_EINVAL, "a leaf tensor that requires grad is "
                         "being used in an in-place operation (use "
                         "`with dispatch.no_grad():`)")
        with no_grad() if leaf else _nullcontext():
            new = _setitem(self, key, value)
        if leaf:
            new = track(new)
        self._become(new)

    # -- operators (mixed dtypes promote as torch's; see _binop)

    def __add__(self, o): return _binop("add", self, o)
    def __radd__(self, o): return _binop("add", o, self)
    def __sub__(self, o): return _binop("sub", self, o)
    def __rsub__(self, o): return _binop("sub", o, self)
    def __mul__(self, o): return _binop("mul", self, o)
    def __rmul__(self, o): return _binop("mul", o, self)
    def __truediv__(self, o): return _true_div(self, o)
    def __rtruediv__(self, o): return _true_div(o, self)
    def __floordiv__(self, o): return floor_divide(self, o)
    def __rfloordiv__(self, o): return floor_divide(o, self)
    def __mod__(self, o): return remainder(self, o)
    def __rmod__(self, o): return remainder(o, self)
    def __pow__(self, o): return pow(self, o)
    def __rpow__(self, o): return pow(o, self)
    def __matmul__(self, o): return matmul(self, o)  # noqa: F821
    def __rmatmul__(self, o): return matmul(o, self)  # noqa: F821
    def __neg__(self): return neg(self)  # noqa: F821
    def __pos__(self): return self
    def __abs__(self): return abs(self)  # noqa: F821

    def __invert__(self):
        """~t: logical not of a bool tensor (as torch's)."""
        if self.dtype != bool_:
            raise _error(_EDTYPE, f"~ takes a bool tensor, not {self.dtype}")
        return eq(self, self._dev.full((), 0, bool_))  # noqa: F821

    def __and__(self, o): return _logical(self, o, "and")
    def __rand__(self, o): return _logical(o, self, "and")
    def __or__(self, o): return _logical(self, o, "or")
    def __ror__(self, o): return _logical(o, self, "or")
    def __xor__(self, o): return _logical(self, o, "xor")
    def __rxor__(self, o): return _logical(o, self, "xor")

    def __eq__(self, o):
        if not isinstance(o, _OPERANDS):
            return NotImplemented  # t == None is False, as in Python
        return _binop("eq", self, o)

    def __ne__(self, o):
        if not isinstance(o, _OPERANDS):
            return NotImplemented
        return _binop("ne", self, o)

    def __lt__(self, o): return _binop("lt", self, o)
    def __le__(self, o): return _binop("le", self, o)
    def __gt__(self, o): return _binop("gt", self, o)
    def __ge__(self, o): return _binop("ge", self, o)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Size(int):
    """Tensor.size: the element count (numpy's size), which called gives
    the shape (torch's size()): t.size() == t.shape, t.size(0)."""

    def __new__(cls, n, shape):
        self = super().__new__(cls, n)
        self.shape = shape
        return self

    def __call__(self, dim=None):
        return self.shape if dim is None else self.shape[dim]


def _norm_dim(d, n):
    """d in [-n, n) as a dim in [0, n), else IndexError."""
    d = int(d)
    if not -n <= d < n:
        raise IndexError(f"dim {d} is out of range for {n} dims "
                         f"([-{n}, {n - 1}])")
    return d + n if d < 0 else d


def _logical(a, b, op):
    """and / or / xor of bool tensors (a number is a bool of the same
    device), composed of casts and int64 arithmetic."""
    a, b = _operands(a, b)
    if a.dtype != bool_:
        raise _error(_EDTYPE, f"{op}: & | ^ take bool tensors here, not "
                     f"{a.dtype} (dispatch has no bitwise int64 ops)")
    if op == "xor":
        return ne(a, b)  # noqa: F821
    ia, ib = a.astype(int64), b.astype(int64)
    return (mul(ia, ib) if op == "and" else add(ia, ib)).astype(bool_)  # noqa


# ---- indexing

def _index_items(x, key):
    """key as a list of (kind, value): "int", "slice", "none", "index" (an
    int64 Tensor), "mask" (a bool Tensor), Ellipsis expanded to full
    slices, padded with full slices to x's dims."""
    if not isinstance(key, tuple):
        key = (key,)
    items, used, ell = [], 0, None
    for k in key:
        if k is None:
            items.append(("none", None))
        elif k is Ellipsis:
            if ell is not None:
                raise IndexError("an index can only have one ellipsis")
            ell = len(items)
        elif isinstance(k, (bool, np.bool_)):
            raise IndexError("a bool scalar index is not supported")
        elif isinstance(k, numbers.Integral):
            items.append(("int", int(k)))
            used += 1
        elif isinstance(k, _slice_type):
            items.append(("slice", k))
            used += 1
        else:
            if not isinstance(k, Tensor):
                arr = np.asarray(k)
                if arr.dtype != bool_ and arr.dtype.kind not in "iu":
                    raise IndexError(f"unsupported index {k!r}")
                k = x._dev.tensor(arr if arr.dtype == bool_
                                  else arr.astype(np.int64))
            if k.dtype == bool_:
                items.append(("mask", k))
                used += builtins.max(k.ndim, 1)
            elif k.dtype == int64:
                items.append(("index", k))
                used += 1
            else:
                raise IndexError(f"tensors used as indices must be int64 or "
                                 f"bool, not {k.dtype}")
    if builtins.sum(kind in ("index", "mask") for kind, _ in items) > 1:
        raise IndexError("more than one tensor index is not supported "
                         "(dispatch: combine them into one)")
    if used > x.ndim:
        raise IndexError(f"too many indices for a {x.ndim}-d tensor: "
                         f"{used} given")
    fill = [("slice", _full_slice)] * (x.ndim - used)
    if ell is None:
        return items + fill
    return items[:ell] + fill + items[ell:]


def _int_pos(i, n, d):
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of range for dim {d} of size {n}")
    return i + n if i < 0 else i


def _wrap_index(idx, n):
    """idx (int64) with negative entries counted from the end (n)."""
    return where(lt(idx, idx._dev.full((), 0, int64)),  # noqa: F821
                 idx + n, idx) if n else idx


def _mask_positions(mask):
    """The flat nonzero positions of a bool mask: the one index step that
    reads data back (the mask, never the indexed tensor)."""
    return np.flatnonzero(mask.numpy()).astype(np.int64)


def _merge_dims(t, d, m):
    """t with dims d..d+m-1 merged into one."""
    s = t.shape
    return reshape(t, s[:d] + (math.prod(s[d:d + m]),) + s[d + m:])


def _getitem(x, key):
    if type(key) is _slice_type and x.shape and (key.step or 1) > 0:
        start, stop, step = key.indices(x.shape[0])  # the common x[a:b]
        if (start, stop, step) != (0, x.shape[0], 1):
            return slice(x, 0, start, stop, step)
    items = _index_items(x, key)
    t, d, out = x, 0, []
    for kind, k in items:
        if kind == "none":
            out.append(1)
            continue
        n = t.shape[d]
        if kind == "int":
            i = _int_pos(k, n, d)
            t = slice(t, d, i, i + 1, 1)
        elif kind == "slice":
            start, stop, step = k.indices(n)
            if step < 0:
                idx = t._dev.arange(start, stop, step, int64)
                t = index_select(t, d, idx)
            elif (start, stop, step) != (0, n, 1):
                t = slice(t, d, start, stop, step)
            out.append(t.shape[d])
        elif kind == "index":
            flat = k if k.ndim == 1 else reshape(k, (-1,))
            t = index_select(t, d, _wrap_index(flat, n))
            out.extend(k.shape)
        else:  # mask over dims d..d+m-1
            m = builtins.max(k.ndim, 1)
            if tuple(t.shape[d:d + m]) != tuple(k.shape or (1,))                     and k.ndim:
                raise IndexError(f"the mask's shape {k.shape} does not match "
                                 f"the indexed dims {t.shape[d:d + m]} at "
                                 f"dim {d}")
            if k.ndim == 0:  # t[True-tensor]: a new dim of size 0 or 1
                t = reshape(t, t.shape[:d] + (1,) + t.shape[d:])
            elif m > 1:
                t = _merge_dims(t, d, m)
            pos = _mask_positions(k)
            t = index_select(t, d, t._dev.tensor(pos))
            out.append(len(pos))
        d += 1
    out.extend(t.shape[d:])
    out = tuple(out)
    if t is not x and out == t.shape:
        return t
    return reshape(t, out)  # (a copy of x when no op ran)


def _value_for(x, value):
    """value as a tensor of x's dtype on x's device."""
    if isinstance(value, Tensor):
        return _cast(value, x.dtype)
    return x._dev.tensor(value, dtype=x.dtype)


def _fill(x, mask, value):
    """x with the number value where mask: masked_fill, or for a bool x
    (which masked_fill does not take) where with a 0-d value."""
    v = np.asarray(value).item()
    if x.dtype == bool_:
        return where(mask, x._dev.full((), v, bool_), x)  # noqa: F821
    return masked_fill(x, mask, v)


def _setitem(x, key, value):
    """The new tensor for x[key] = value (see Tensor.__setitem__)."""
    items = _index_items(x, key)
    adv = [(i, it) for i, it in enumerate(items) if it[0] in ("mask", "index")]
    if adv:
        return _setitem_advanced(x, items, adv[0], value)
    shape, dev = x.shape, x._dev
    region, keep = [], []  # torch's x[key].shape; the same with kept dims
    pos_of = []  # per dim of x: its selected positions (None: all)
    d = 0
    for kind, k in items:
        if kind == "none":
            region.append(1)
            continue
        n = shape[d]
        if kind == "int":
            p = [_int_pos(k, n, d)]
        else:
            r = range(*k.indices(n))
            p = None if r == range(n) else list(r)
            region.append(len(r))
        keep.append(n if p is None else len(p))
        pos_of.append(p)
        d += 1
    picked = [(d, p) for d, p in enumerate(pos_of) if p is not None]
    if builtins.any(not p for _, p in picked):
        return x  # an empty selection: nothing changes
    # the mask of the selected positions: the per-dim ones broadcast and
    # and-ed; each dim's also says which region row a position takes
    mask, srcs = None, []
    for d, p in picked:
        m, src = _pick(dev, shape[d], p)
        srcs.append(src)
        m = reshape(m, (1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
        mask = m if mask is None else mask & m
    if _is_number(value):
        if mask is None:
            return dev.full(shape, np.asarray(value).item(), x.dtype)
        return _fill(x, mask, value)
    v = _value_for(x, value)
    v = reshape(broadcast_to(v, tuple(region)), tuple(keep))  # noqa: F821
    for (d, _), src in zip(picked, srcs):  # spread the region over x
        v = index_select(v, d, src)
    if mask is None:
        return v
    return where(mask, v, x)  # noqa: F821


def _pick(dev, n, p):
    """For the positions p (range(...) of a slice or [i], not empty) of a
    dim of size n, made on the device from arange: the bool [n] of the
    picked positions and the int64 [n] of the region row each takes (an
    index of the region, whatever it is elsewhere). No data travels, so a
    captured step can hold it."""
    first, count = p[0], len(p)
    step = p[1] - p[0] if count > 1 else 1
    ar = dev.arange(0, n, 1, int64)
    off = ar - first if step > 0 else first - ar  # steps from first
    step = builtins.abs(step)
    if step == 1:
        row, picked = off, (off >= 0) & (off < count)
    else:
        row = div(off, dev.full((), step, int64))  # noqa: F821 (off >= 0)
        picked = (off >= 0) & (off - row * step == 0) & (row < count)
    return picked, clamp(row, 0, count - 1)


def _setitem_advanced(x, items, adv, value):
    i, (kind, k) = adv
    if builtins.any(it != ("slice", _full_slice)
                    for j, it in enumerate(items) if j != i) or i != 0:
        raise IndexError("assignment with a tensor index takes it alone "
                         "(x[mask] = v, x[idx] = v; dispatch)")
    shape, dev = x.shape, x._dev
    if kind == "mask":
        m = builtins.max(k.ndim, 1)
        if tuple(shape[:m]) != tuple(k.shape):
            raise IndexError(f"the mask's shape {k.shape} does not match the "
                             f"leading dims {shape[:m]}")
        mb = reshape(k, k.shape + (1,) * (len(shape) - m))
        if _is_number(value):
            return _fill(x, mb, value)
        v = _value_for(x, value)
        if v.size == 1:
            return where(mb, reshape(v, ()), x)  # noqa: F821
        pos = _mask_positions(k)
        v = broadcast_to(v, (len(pos),) + shape[m:])  # noqa: F821
        src = np.zeros(math.prod(k.shape), np.int64)
        src[pos] = np.arange(len(pos))
        v = reshape(index_select(v, 0, dev.tensor(src)), shape)
        return where(mb, v, x)  # noqa: F821
    # a 1-D int64 index on dim 0, all on the device: row r is assigned
    # where some idx[j] == r (value row j; the first such j)
    n = shape[0]
    if k.ndim != 1:
        raise IndexError("assignment takes a 1-D int64 index")
    idx = _wrap_index(k, n)
    hits = eq(reshape(dev.arange(0, n, 1, int64), (n, 1)),  # noqa: F821
              reshape(idx, (1, -1))).astype(int64)
    rows = reshape(_max_op(hits, 1).astype(bool_),
                   (n,) + (1,) * (len(shape) - 1))
    v = _value_for(x, value)
    v = broadcast_to(v, (k.shape[0],) + shape[1:])  # noqa: F821
    v = index_select(v, 0, _argmax_op(hits, 1))
    return where(rows, v, x)  # noqa: F821


_OPERANDS = (Tensor, numbers.Number, np.ndarray, np.generic, list, tuple)
_slice_type = builtins.slice
_full_slice = _slice_type(None)


def _add_methods():
    """Each op function of a method kind as a Tensor method (t.relu(),
    t.sum(0), t.matmul(w)), unless the class has its own."""
    for name, sig, api in _ops:
        if api == "API" and _MAKERS.get(sig, (None, False))[1] \
                and name not in Tensor.__dict__:
            setattr(Tensor, name, globals()[name])


_add_methods()
for _name in _ISSUE23_METHODS:  # written out above, Tensor methods too
    setattr(Tensor, _name, globals()[_name])
# every op function of the package (made or written out), by name, for
# the package namespace
op_functions = {name: globals()[name] for name, sig, api in _ops
                if api == "API" and callable(globals().get(name))}


# ---------------------------------------------------------------- grads

class Grads:
    """The gradients of one backward pass. grads[leaf] is the gradient of
    a tracked leaf (or of the tensor it wraps) as a new plain tensor.
    Freed when collected (remote: the server drops them then)."""
    # The device remembers its last Grads (for Tensor.grad), so a Grads
    # refers to its device only weakly: a strong reference both ways would
    # leave a device and everything on it to the cycle collector.
    __slots__ = ("_h", "_state", "_devref")

    def __init__(self, dev, p):
        self._state = dev._state
        self._devref = weakref.ref(dev)
        self._h = ffi.gc(p, dev._state.free_grads)

    def __getitem__(self, t):
        if self._h is None or self._state.h is None:
            raise _freed_error("gradient container")
        out = _out()
        rc = lib.dispatch_grad(self._h, _hraw(t), out)
        if rc < 0:
            _fail(rc, t)
        return t._dev._adopt(out[0])

    get = __getitem__

    def free(self):
        """Frees the gradients now rather than at collection."""
        if self._h is not None:
            h, self._h = self._h, None
            ffi.release(h)
            self._state.drain()
        dev = self._devref()
        if dev is not None and dev._last_grads is self:
            dev._last_grads = None
