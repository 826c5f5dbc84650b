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
import math
import numbers
import weakref

import numpy as np

from ._lib import docs as _docs, ffi, lib, ops as _ops

# ---------------------------------------------------------------- dtypes

float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)

_NP_TO_C = {float32: lib.DISPATCH_F32, float64: lib.DISPATCH_F64,
            int64: lib.DISPATCH_I64, bool_: lib.DISPATCH_BOOL}
_C_TO_NP = {v: k for k, v in _NP_TO_C.items()}
_KIND_NAMES = {lib.DISPATCH_KIND_LOCAL: "local",
               lib.DISPATCH_KIND_REMOTE: "remote",
               lib.DISPATCH_KIND_AUTODIFF: "autodiff"}
# the counters of dispatch_stats after its size, in the header's order
_STATS_FIELDS = tuple(name for name, _ in ffi.typeof("dispatch_stats").fields
                      if name != "size")


def _dtype(d):
    """The numpy dtype for d (a numpy dtype or type, or a name such as
    "float32"); TypeError for one dispatch has no element type for."""
    try:
        nd = np.dtype(d)
    except TypeError:
        raise TypeError(f"dispatch: not a dtype: {d!r}") from None
    if nd not in _NP_TO_C:
        raise TypeError(f"dispatch: dtype {nd} is not supported (float32, "
                        "float64, int64 and bool are)")
    return nd


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
         "ETIMEDOUT": TimeoutError, "EUNSUPPORTED": NotImplementedError}

_ERROR_CLASSES = {}
error_classes = {}  # "ESHAPE" -> class, for the package namespace


def _make_error_classes():
    code = -1
    while True:
        full = ffi.string(lib.dispatch_err_name(code)).decode()
        if full == "DISPATCH_EUNKNOWN" or code < -1000:
            break
        short = full[len("DISPATCH_"):]
        bases = (DispatchError,) + ((_ALSO[short],) if short in _ALSO else ())
        cls = type(short, bases, {
            "__doc__": ffi.string(lib.dispatch_strerror(code)).decode()
                       + f" ({full}, code {code})",
            "__module__": "dispatch"})
        _ERROR_CLASSES[code] = cls
        error_classes[short] = cls
        code -= 1


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
        keep = []

        def cstr(s):
            if s is None:
                return ffi.NULL
            b = ffi.new("char[]", s.encode() if isinstance(s, str) else s)
            keep.append(b)
            return b

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
        out = ffi.new("dispatch_device **")
        msg = ffi.new("char[512]")
        rc = lib.dispatch_device_open(cstr(spec), opts, out, msg, 512)
        if rc < 0:
            raise _error(rc, ffi.string(msg).decode(errors="replace"))
        self._state = _DeviceState(out[0])
        self._scopes = []       # Python scopes, innermost last
        self._last_grads = None  # for Tensor.grad
        self.spec = ffi.string(lib.dispatch_device_spec(out[0])).decode()

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
        arrays keep theirs and Python floats become float32. With
        requires_grad, returns the tracked leaf (see Tensor.track)."""
        if isinstance(data, Tensor):
            t = data.to(self) if dtype is None else data.to(self).astype(dtype)
            return t.track() if requires_grad else t
        if dtype is not None:
            arr = np.asarray(data, dtype=_dtype(dtype))
        elif isinstance(data, (np.ndarray, np.generic)):
            arr = np.asarray(data)
        else:
            arr = np.asarray(data)
            if arr.dtype.kind == "f":
                arr = arr.astype(float32)
            elif arr.dtype.kind in "iu":
                arr = arr.astype(int64)
        if arr.dtype not in _NP_TO_C:
            _dtype(arr.dtype)  # raises, naming the supported dtypes
        if not arr.flags.c_contiguous:
            # (np.ascontiguousarray would also turn a 0-d array into 1-d)
            arr = arr.copy(order="C")
        if arr.ndim > 8:
            raise _error(_EINVAL,
                         f"{arr.ndim} dims: a tensor has at most 8")
        shape = ffi.new("int64_t[]", arr.shape) if arr.ndim else ffi.NULL
        t = self._new(lib.dispatch_tensor_from_data, _NP_TO_C[arr.dtype],
                      arr.ndim, shape, ffi.from_buffer(arr), arr.nbytes)
        return t.track() if requires_grad else t

    def zeros(self, shape, dtype=float32):
        return self._new(lib.dispatch_zeros, _NP_TO_C[_dtype(dtype)],
                         *_shape_arg(shape))

    def ones(self, shape, dtype=float32):
        return self._new(lib.dispatch_ones, _NP_TO_C[_dtype(dtype)],
                         *_shape_arg(shape))

    def full(self, shape, value, dtype=float32):
        return self._new(lib.dispatch_full, _NP_TO_C[_dtype(dtype)],
                         *_shape_arg(shape), float(value))

    def arange(self, start, end=None, step=1, dtype=float32):
        """1-D [start, end) by step, as numpy.arange (one argument: end)."""
        if end is None:
            start, end = 0, start
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
            if any(x is t for x in s._tensors):
                s.keep(t)
                break
    return tensors[0] if len(tensors) == 1 else tensors


# ---------------------------------------------------------------- ops

def _hd(t):
    """The live C handle of Tensor t, or raises."""
    h = t._h
    if h is None or t._dev._state.h is None:
        raise _freed_error()
    return h


def _fail(rc, t):
    t._dev._raise(rc)


def _out():
    return ffi.new("dispatch_tensor **")


def _scalar_op(cfn, x, s):
    out = _out()
    rc = cfn(_hd(x), float(s), out)
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
        return like._dev.tensor(np.asarray(x, dtype=like.dtype))
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
    rc = cfn(_hd(x), n, dims, 1 if keepdim else 0, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _dim_op(cfn, x, dim):
    x = _as_tensor(x)
    out = _out()
    rc = cfn(_hd(x), int(dim), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _shape_op(cfn, x, shape):
    x = _as_tensor(x)
    n, s = _shape_arg(shape)
    out = _out()
    rc = cfn(_hd(x), n, s, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _join(cfn, tensors, dim):
    tensors = list(tensors)
    if not tensors:
        raise _error(_EINVAL, "no tensors to join")
    first = _as_tensor(tensors[0])
    ts = [first] + [_as_tensor(t, first) for t in tensors[1:]]
    arr = ffi.new("dispatch_tensor *[]", [_hd(t) for t in ts])
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
    rc = lib.dispatch_conv2d(_hd(x), _hd(w), sh, sw, ph, pw, dh, dw, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _pool(cfn, x, kernel, stride, padding):
    x = _as_tensor(x)
    kh, kw = _pair2(kernel)
    sh, sw = _pair2(kernel if stride is None else stride)
    ph, pw = _pair2(padding)
    out = _out()
    rc = cfn(_hd(x), kh, kw, sh, sw, ph, pw, out)
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
        rc = cfn(_hd(x), out)
        if rc < 0:
            _fail(rc, x)
        return x._dev._adopt(out[0])
    return op


def _binary(cfn):
    def op(a, b):
        a, b = _pair(a, b)
        out = _out()
        rc = cfn(_hd(a), _hd(b), out)
        if rc < 0:
            _fail(rc, a)
        return a._dev._adopt(out[0])
    return op


def _ternary(cfn):
    def op(a, b, c):
        first = next((t for t in (a, b, c) if isinstance(t, Tensor)), None)
        a, b, c = (_as_tensor(t, first) for t in (a, b, c))
        out = _out()
        rc = cfn(_hd(a), _hd(b), _hd(c), out)
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
    rc = lib.dispatch_where(_hd(mask), _hd(a), _hd(b), out)
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
    rc = lib.dispatch_cross_entropy(_hd(logits), _hd(labels), out)
    if rc < 0:
        _fail(rc, logits)
    return logits._dev._adopt(out[0])


def permute(x, dims):
    return _shape_op(lib.dispatch_permute, x, dims)


def transpose(x, dim0=0, dim1=1):
    x = _as_tensor(x)
    out = _out()
    rc = lib.dispatch_transpose(_hd(x), int(dim0), int(dim1), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def slice(x, dim, start=0, end=None, step=1):  # noqa: A001
    """x[start:end:step] along dim, Python style (step > 0, clamped)."""
    x = _as_tensor(x)
    if end is None:
        end = 2 ** 62
    out = _out()
    rc = lib.dispatch_slice(_hd(x), int(dim), int(start), int(end), int(step),
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
    rc = lib.dispatch_index_select(_hd(x), int(dim), _hd(index), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def dropout(x, p, seed):
    """Keeps element i iff uniform(seed)[i] >= p, scaled by 1/(1-p)."""
    x = _as_tensor(x)
    out = _out()
    rc = lib.dispatch_dropout(_hd(x), float(p), int(seed), out)
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
    rc = lib.dispatch_attention(_hd(q), _hd(k), _hd(v),
                                _hd(key_mask) if key_mask is not None
                                else ffi.NULL, 1 if is_causal else 0,
                                float(scale or 0.0), out)
    if rc < 0:
        _fail(rc, q)
    return q._dev._adopt(out[0])


def track(t):
    """AUTODIFF(t): a tracked leaf wrapping t (float, not already tracked;
    otherwise EDOUBLEWRAP / EDTYPE). A new Tensor; t is unchanged."""
    out = _out()
    rc = lib.dispatch_autodiff(_hd(t), out)
    if rc < 0:
        _fail(rc, t)
    return t._dev._adopt(out[0])


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
    rc = lib.dispatch_embedding(_hd(weight), _hd(input), pad, out)
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
    rc = lib.dispatch_layer_norm(_hd(x), n, _hd(w) if w is not None else
                                 ffi.NULL, _hd(b) if b is not None else
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
    if eps is None:
        eps = float(np.finfo(x.dtype).eps)
    w = _affine(x, weight)
    out = _out()
    rc = lib.dispatch_rms_norm(_hd(x), n, _hd(w) if w is not None else
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
        _hd(x), *(_hd(t) if t is not None else ffi.NULL
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
    rc = lib.dispatch_clamp(_hd(x), lo, hi, out)
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
    rc = lib.dispatch_masked_fill(_hd(x), _hd(mask), float(value), out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


def _moments(cfn, x, dim, correction, keepdim):
    x = _as_tensor(x)
    n, dims = _dims_arg(dim)
    out = _out()
    rc = cfn(_hd(x), n, dims, int(correction), 1 if keepdim else 0, out)
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
    rc = lib.dispatch_cross_entropy_ex(_hd(logits), _hd(labels),
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
    rc = lib.dispatch_avg_pool2d_ex(_hd(x), kh, kw, sh, sw, ph, pw,
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
    rc = lib.dispatch_conv2d_bias(_hd(x), _hd(w), _hd(bias), sh, sw, ph, pw,
                                  dh, dw, out)
    if rc < 0:
        _fail(rc, x)
    return x._dev._adopt(out[0])


# ---------------------------------------------------------------- tensor

class Tensor:
    """A tensor on a Device: local, remote, or autodiff wrapping one of
    those. Made by Device.tensor / zeros / ... or by ops; never directly.
    Operators: + - * / @ ** (scalar exponent), unary -, abs(), and the
    comparisons, which give bool tensors (so == is elementwise and a Tensor
    hashes by identity, as in numpy and torch)."""
    __slots__ = ("_h", "_dev", "_shape", "__weakref__")
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
            h = _hd(self)
            n = lib.dispatch_tensor_ndim(h)
            p = lib.dispatch_tensor_shape(h)
            s = self._shape = tuple(p[i] for i in range(n))
        return s

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self):
        """Number of elements."""
        return lib.dispatch_tensor_numel(_hd(self))

    @property
    def dtype(self) -> np.dtype:
        return _C_TO_NP[lib.dispatch_tensor_dtype(_hd(self))]

    @property
    def kind(self) -> str:
        """"local", "remote" or "autodiff"."""
        return _KIND_NAMES[lib.dispatch_kind(_hd(self))]

    @property
    def requires_grad(self):
        """True for an autodiff tensor (a tracked leaf or an op's output
        with a tracked input)."""
        return bool(lib.dispatch_is_autodiff(_hd(self)))

    @property
    def status(self):
        """0, or the error code that poisoned this tensor (a failed remote
        op whose error has surfaced at a wait)."""
        return lib.dispatch_tensor_status(_hd(self))

    def __len__(self):
        s = self.shape
        if not s:
            raise TypeError("len() of a 0-d tensor")
        return s[0]

    def __repr__(self):
        if self._h is None or self._dev.closed:
            return "dispatch.Tensor(<freed>)"
        return (f"dispatch.Tensor({self.kind}, {self.dtype}, "
                f"shape={self.shape}, device={self._dev.spec!r})")

    __hash__ = object.__hash__

    # -- data out

    def numpy(self) -> np.ndarray:
        """A fresh numpy array with a copy of the data (remote: one read
        round trip, where deferred errors surface)."""
        h = _hd(self)
        arr = np.empty(self.shape, dtype=self.dtype)
        rc = lib.dispatch_tensor_read(h, ffi.from_buffer(arr), arr.nbytes)
        if rc < 0:
            _fail(rc, self)
        return arr

    def __array__(self, dtype=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def item(self) -> "float | int | bool":
        if self.size != 1:
            raise ValueError(f"item() needs one element, not {self.size}")
        return self.numpy().reshape(()).item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        if self.size != 1:
            raise ValueError("the truth value of a tensor of more than one "
                             "element is ambiguous")
        return bool(self.item())

    def tolist(self):
        return self.numpy().tolist()

    def to(self, device):
        """A copy on device (never autodiff: track it again if needed)."""
        out = _out()
        rc = lib.dispatch_to_device(_hd(self), device._handle(), out)
        if rc < 0:
            _fail(rc, self)
        return device._adopt(out[0])

    def astype(self, dtype):
        out = _out()
        rc = lib.dispatch_cast(_hd(self), _NP_TO_C[_dtype(dtype)], out)
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
            lib.dispatch_tensor_ref(lib.dispatch_inner(_hd(self))))

    def detach(self):
        return self.inner

    def backward(self, retain_graph: bool = False) -> "Grads":
        """Reverse pass from this one-element autodiff tensor to every
        tracked leaf reachable from it. Returns the Grads (remote: one
        request, pipelined like an op by a server of protocol 1.3, whose
        failure the next wait raises; the gradients stay on the server
        until read). The device also remembers them for Tensor.grad, until
        its next backward."""
        h = _hd(self)
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

    def permute(self, *dims):
        if len(dims) == 1 and not isinstance(dims[0], numbers.Integral):
            dims = dims[0]
        return permute(self, dims)

    @property
    def T(self):
        """The reverse of the dims (a transpose for 2-D)."""
        return permute(self, tuple(range(self.ndim - 1, -1, -1)))

    def __getitem__(self, key):
        """Basic indexing: ints, slices with a positive step, Ellipsis, and
        an int64 tensor or list on the first dim (index_select). Every
        result is a new tensor (a copy), not a view."""
        if isinstance(key, (Tensor, list, np.ndarray)):
            return index_select(self, 0, key)
        if not isinstance(key, tuple):
            key = (key,)
        shape = self.shape
        if key.count(Ellipsis) > 1:
            raise IndexError("an index can only have one ellipsis")
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (_full_slice,) * (len(shape) - len(key) + 1) \
                + key[i + 1:]
        if len(key) > len(shape):
            raise IndexError(f"too many indices for a {len(shape)}-d tensor")
        t, drop = self, []
        for d, k in enumerate(key):
            if isinstance(k, numbers.Integral):
                n = shape[d]
                i = int(k) + n if k < 0 else int(k)
                if not 0 <= i < n:
                    raise IndexError(f"index {k} is out of range for dim {d} "
                                     f"of size {n}")
                t = slice(t, d, i, i + 1, 1)
                drop.append(d)
            elif isinstance(k, _slice_type):
                start, stop, step = k.indices(shape[d])
                if step <= 0:
                    raise IndexError("slices need a positive step")
                if (start, stop, step) != (0, shape[d], 1):
                    t = slice(t, d, start, stop, step)
            else:
                raise IndexError(f"unsupported index {k!r}")
        if drop:
            t = reshape(t, tuple(s for d, s in enumerate(t.shape)
                                 if d not in drop))
        elif t is self:
            t = reshape(self, shape)  # a copy, as every other result is
        return t

    # -- operators

    def __add__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_add_scalar, self, o)
        return add(self, o)

    def __radd__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_add_scalar, self, o)
        return add(o, self)

    def __sub__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_sub_scalar, self, o)
        return sub(self, o)

    def __rsub__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_rsub_scalar, self, o)
        return sub(o, self)

    def __mul__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_mul_scalar, self, o)
        return mul(self, o)

    def __rmul__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_mul_scalar, self, o)
        return mul(o, self)

    def __truediv__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_div_scalar, self, o)
        return div(self, o)

    def __rtruediv__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_rdiv_scalar, self, o)
        return div(o, self)

    def __pow__(self, o):
        if isinstance(o, numbers.Number):
            return _scalar_op(lib.dispatch_pow_scalar, self, o)
        return NotImplemented

    def __matmul__(self, o):
        return matmul(self, o)

    def __rmatmul__(self, o):
        return matmul(o, self)

    def __neg__(self):
        return neg(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return abs(self)

    def __eq__(self, o):
        if not isinstance(o, _OPERANDS):
            return NotImplemented  # t == None is False, as in Python
        return eq(self, o)

    def __ne__(self, o):
        if not isinstance(o, _OPERANDS):
            return NotImplemented
        return ne(self, o)

    def __lt__(self, o):
        return lt(self, o)

    def __le__(self, o):
        return le(self, o)

    def __gt__(self, o):
        return gt(self, o)

    def __ge__(self, o):
        return ge(self, o)


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
        rc = lib.dispatch_grad(self._h, _hd(t), out)
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
