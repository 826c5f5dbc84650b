"""Captured graphs: one step recorded on a device, replayed on fresh
inputs (remote: one message per replay). See README's "Captured graphs".

    with dev.capture() as g:
        x = dev.tensor(xb)            # tensors made from data: the inputs
        loss = model_step(x)          # runs once, for real, and is recorded
        g.output(loss)                # what each replay hands back
    (loss_k,) = g.replay(xb_k)        # numpy arrays in, numpy arrays out
"""
import numpy as np

from ._core import _NP_TO_C, _dtype, _hd, _storage, bfloat16, ffi, lib


class Graph:
    """What Device.capture() returns. The graph is made when the with
    block ends without an exception; it is freed with free(), when the
    object is collected, or with its device."""

    def __init__(self, device):
        self._dev = device
        self._h = None
        self._outs = []  # (numpy dtype, shape) of each output

    def __enter__(self):
        rc = lib.dispatch_graph_begin(self._dev._handle())
        if rc < 0:
            self._dev._raise(rc)
        return self

    def output(self, t):
        """Asks every replay for t's bytes; returns the output's index."""
        rc = lib.dispatch_graph_output(_hd(t))
        if rc < 0:
            self._dev._raise(rc)
        self._outs.append((t.dtype, tuple(t.shape)))
        return rc

    def __exit__(self, exc_type, exc, tb):
        out = ffi.new("dispatch_graph **")
        rc = lib.dispatch_graph_end(self._dev._handle(), out)
        if exc_type is not None:  # the capture goes, the exception stays
            if rc == 0:
                lib.dispatch_graph_free(out[0])
            return False
        if rc < 0:
            self._dev._raise(rc)
        st = self._dev._state
        # freed like the device's other objects: queued, then run by the
        # next call on the device (a no-op once the device is closed)
        self._h = ffi.gc(out[0], lambda p, st=st: st.pending.append(
            (st.lib.dispatch_graph_free, p)))
        return False

    def replay(self, *inputs):
        """Runs the step once on inputs (numpy arrays or what numpy turns
        into one, in the order the capture made them; a bfloat16 input as
        its raw uint16 values) and returns the outputs as new numpy arrays
        (a bfloat16 output as raw uint16 values, as Tensor.numpy)."""
        if self._h is None or self._dev.closed:
            raise ValueError("the graph was not made, was freed, or its "
                             "device is closed")
        keep = []
        ins = ffi.new("dispatch_graph_io[]", max(len(inputs), 1))
        for i, x in enumerate(inputs):
            a = np.asarray(x)
            raw_bf16 = a.dtype == bfloat16.storage
            if a.dtype not in _NP_TO_C and not raw_bf16:
                _dtype(a.dtype)  # raises, naming the supported dtypes
            if not a.flags.c_contiguous:
                a = a.copy(order="C")
            shape = ffi.new("int64_t[]", a.shape) if a.ndim else ffi.NULL
            buf = ffi.from_buffer(a)
            keep += [a, shape, buf]
            ins[i].dtype = _NP_TO_C[bfloat16 if raw_bf16 else a.dtype]
            ins[i].ndim = a.ndim
            ins[i].shape = shape
            ins[i].data = ffi.cast("void *", buf)
            ins[i].nbytes = a.nbytes
        outs = [np.empty(s, dtype=_storage(d)) for d, s in self._outs]
        oio = ffi.new("dispatch_graph_io[]", max(len(outs), 1))
        for i, o in enumerate(outs):
            buf = ffi.from_buffer(o)
            keep.append(buf)
            oio[i].data = ffi.cast("void *", buf)
            oio[i].nbytes = o.nbytes
        self._dev._handle()  # runs queued frees first
        rc = lib.dispatch_graph_replay(self._h, ins, len(inputs), oio,
                                       len(outs))
        if rc < 0:
            self._dev._raise(rc)
        return outs

    def free(self):
        if self._h is not None:
            h, self._h = self._h, None
            ffi.release(h)
            self._dev._state.drain()
