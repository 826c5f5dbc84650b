"""Module and Parameter: PyTorch's module system over dispatch tensors.

A Parameter is a tracked leaf (an autodiff Tensor) that a Module
registers when it is assigned as an attribute; sub-modules register the
same way. Names, order and state_dict keys follow torch.nn.Module, so a
torch model's state_dict loads into the same architecture written with
dispatch.nn and the other way round.

There is no in-place write into a tensor: load_state_dict and to()
give each Parameter a new tracked leaf under the same Python object. An
optimizer made before that still holds the old leaves and says so at its
next step (see dispatch.optim); make it after loading, as in torch's
advice for to().
"""
from collections import OrderedDict, namedtuple

import numpy as np

from .._core import Tensor, default_device, track


class Parameter(Tensor):
    """A tracked leaf that Module registers as a parameter. Parameter(data)
    tracks data (a Tensor, whose storage it shares, or anything
    dispatch.tensor takes; an autodiff tensor's inner tensor is used).
    It is a Tensor: every op and method takes it."""
    __slots__ = ()

    def __new__(cls, data, device=None):
        if not isinstance(data, Tensor):
            data = (device or default_device()).tensor(data)
        elif data.requires_grad:
            data = data.detach()
        p = Tensor.__new__(cls)
        p._dev = data._dev
        p._h = None
        p._shape = None
        p._take(track(data))
        return p

    def __init__(self, *args, **kwargs):
        pass  # everything is done in __new__ (Tensor.__init__ refuses)

    def _take(self, leaf):
        """Moves the C reference of the tracked leaf `leaf` (a fresh Tensor
        no one else holds) into this object, which keeps its identity; the
        reference this object held before goes to the collector."""
        self._h, leaf._h = leaf._h, None  # a scope that held leaf skips it
        self._dev = leaf._dev
        self._shape = None

    def __repr__(self):
        return "Parameter containing:\n" + Tensor.__repr__(self)


_IncompatibleKeys = namedtuple("IncompatibleKeys",
                               ["missing_keys", "unexpected_keys"])


def _to_numpy(v):
    """A state_dict value as a numpy array: a dispatch Tensor, a torch
    tensor (duck-typed, so torch is not imported) or an array-like."""
    if isinstance(v, Tensor):
        return v.numpy()
    if hasattr(v, "detach") and hasattr(v, "cpu"):
        if str(getattr(v, "dtype", "")) == "torch.bfloat16":
            v = v.float()  # numpy has no bfloat16; exact, rounded back
        return v.detach().cpu().numpy()
    return np.asarray(v)


class Module:
    """Base class of every layer, as torch.nn.Module: assign Parameters and
    Modules as attributes in __init__ (after super().__init__()) and
    write forward(); calling the module calls forward."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    # -- registration

    def __setattr__(self, name, value):
        params = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError("cannot assign to a Module before "
                                 "Module.__init__() was called")
        mods = self.__dict__["_modules"]
        for d in (params, mods):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self.__dict__.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            self.__dict__.pop(name, None)
            mods[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        d = self.__dict__
        for key in ("_parameters", "_modules"):
            if key in d and name in d[key]:
                return d[key][name]
        raise AttributeError(f"{type(self).__name__!r} object has no "
                             f"attribute {name!r}")

    def __delattr__(self, name):
        for key in ("_parameters", "_modules"):
            if name in self.__dict__[key]:
                del self.__dict__[key][name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name, param):
        """As assigning param (a Parameter, or None for an absent one, which
        state_dict leaves out) to self.name."""
        if param is None:
            self.__dict__["_parameters"].pop(name, None)
            object.__setattr__(self, name, None)
            return
        if not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: {name} must be a "
                            f"Parameter, not {type(param).__name__}")
        setattr(self, name, param)

    def add_module(self, name, module):
        if not isinstance(module, Module):
            raise TypeError(f"add_module: {name} must be a Module, not "
                            f"{type(module).__name__}")
        setattr(self, name, module)

    # -- walking

    def named_children(self):
        yield from self._modules.items()

    def children(self):
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix=""):
        """(dotted name, module) for self ('') and every sub-module, depth
        first in registration order, each module once."""
        seen = set()

        def walk(m, pre):
            if id(m) in seen:
                return
            seen.add(id(m))
            yield pre, m
            for n, c in m._modules.items():
                yield from walk(c, pre + ("." if pre else "") + n)
        yield from walk(self, prefix)

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix="", recurse=True):
        """(dotted name, Parameter) in torch's order: a module's own
        parameters in assignment order, then each sub-module's; a
        parameter shared by two modules appears once."""
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for pre, m in mods:
            for n, p in m._parameters.items():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield (pre + "." if pre else "") + n, p

    def parameters(self, recurse=True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    # -- state

    def state_dict(self):
        """OrderedDict of dotted name -> a plain (untracked) Tensor sharing
        the parameter's storage, with torch's key names."""
        return OrderedDict((n, p.detach()) for n, p in
                           self._all_named_parameters())

    def _all_named_parameters(self, prefix=""):
        # state_dict lists a shared parameter or module under every name,
        # as torch's does (no deduplication)
        for n, p in self._parameters.items():
            yield prefix + n, p
        for n, m in self._modules.items():
            yield from m._all_named_parameters(prefix + n + ".")

    def load_state_dict(self, state_dict, strict=True):
        """Copies state_dict's values (dispatch Tensors, numpy arrays or
        torch tensors) into the parameters of the same names: each
        Parameter gets a new tracked leaf on its device with the value
        converted to its dtype. strict: missing or unexpected keys raise
        KeyError; a shape mismatch always raises ValueError. Returns
        (missing_keys, unexpected_keys). Make optimizers after loading."""
        own = OrderedDict(self._all_named_parameters())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError("load_state_dict: missing keys %s, unexpected "
                           "keys %s" % (missing, unexpected))
        staged = []
        for k, p in own.items():
            if k not in state_dict:
                continue
            v = state_dict[k]
            if isinstance(v, Tensor) and v._dev is p._dev \
                    and v.dtype == p.dtype:
                t = v.detach() if v.requires_grad else v
            else:
                t = p._dev.tensor(_to_numpy(v), dtype=p.dtype)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_state_dict: {k} has shape "
                                 f"{tuple(t.shape)}, the parameter "
                                 f"{tuple(p.shape)}")
            staged.append((p, t))
        for p, t in staged:  # only once every value fits
            p._take(track(_copy(t)))
        return _IncompatibleKeys(missing, unexpected)

    # -- modes and devices

    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def to(self, device):
        """Moves every parameter to device (a Device), each staying the same
        Parameter object and a tracked leaf. Returns self."""
        for p in self.parameters():
            if p._dev is not device:
                p._take(track(p.detach().to(device)))
        return self

    def zero_grad(self, set_to_none=True):
        """Drops the gradients of the last backward on the parameters'
        devices (they live in one container per backward, not per
        parameter): afterwards p.grad is None, and their memory is freed
        unless the caller still holds the Grads."""
        for dev in {id(p._dev): p._dev for p in self.parameters()}.values():
            dev._last_grads = None

    # -- calling

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # -- printing

    def extra_repr(self):
        return ""

    def __repr__(self):
        lines = []
        for n, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"({n}): {sub}")
        head = type(self).__name__ + "(" + self.extra_repr()
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"


def _copy(t):
    """A new tensor holding t's values (not sharing its storage), so a
    loaded parameter never aliases the caller's tensor."""
    return t.reshape(t.shape)
