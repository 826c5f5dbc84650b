"""Optimizers: SGD, Adam and AdamW over tracked leaves, updated in place
on the device where the parameters live (remote: ONE Step message per
step, whatever the number of parameters or groups), optionally clipped by
global norm inside that step; torch's parameter groups; lr_cosine, the
cosine learning rate with warmup; and the schedulers of lr_scheduler.

What the one-message step imposes: one learning rate (and one momentum,
betas, eps) for every parameter of an optimizer, so parameter groups may
differ only in what the C step takes per parameter (AdamW's
weight_decay); groups differing in anything else are refused with the
reason, rather than silently sent as several steps."""
import math
import weakref

from .._core import Grads, Tensor, _hd, ffi, lib

# id(parameter) -> (weak reference to it, the optimizers over it, weakly),
# for nn.utils.clip_grad_norm_ (keyed by id: a Tensor's == is elementwise)
_owners = {}


def _register(opt, p):
    key = id(p)
    entry = _owners.get(key)
    if entry is None or entry[0]() is not p:
        def gone(ref, key=key):
            if _owners.get(key, (None,))[0] is ref:
                del _owners[key]
        entry = _owners[key] = (weakref.ref(p, gone), weakref.WeakSet())
    entry[1].add(opt)


def owners(p):
    """The live optimizers over tensor p."""
    entry = _owners.get(id(p))
    if entry is None or entry[0]() is not p:
        return []
    return [o for o in entry[1] if o._h is not None]


def _param_groups(name, params, defaults, per_param):
    """torch's params argument (tensors, or dicts with "params" and
    overrides of defaults) as a list of complete group dicts, checked: the
    keys are known, the tensors unique, and every group agrees on every
    hyperparameter not in per_param."""
    params = list(params)
    if not params:
        raise TypeError(f"{name}: an optimizer needs a non-empty list of "
                        "tracked tensors")
    if not all(isinstance(g, dict) for g in params):
        params = [{"params": params}]
    groups = []
    for g in params:
        unknown = set(g) - {"params"} - set(defaults)
        if unknown:
            raise ValueError(f"{name}: a parameter group takes 'params' and "
                             f"{sorted(defaults)}, not {sorted(unknown)}")
        ps = g.get("params")
        ps = [ps] if isinstance(ps, Tensor) else list(ps or ())
        if not ps or not all(isinstance(p, Tensor) for p in ps):
            raise TypeError(f"{name}: each parameter group needs a non-empty "
                            "list of tracked tensors under 'params'")
        full = dict(defaults)
        full.update(g)
        full["params"] = ps
        if "betas" in full:
            full["betas"] = tuple(full["betas"])
        groups.append(full)
    flat = [p for g in groups for p in g["params"]]
    if len({id(p) for p in flat}) != len(flat):
        raise ValueError(f"{name}: a parameter appears more than once")
    for k in defaults:
        if k in per_param:
            continue
        vals = [g[k] for g in groups]
        if any(v != vals[0] for v in vals):
            raise ValueError(
                f"{name}: the parameter groups differ in {k!r} ({vals}); the "
                "one-message step takes one value for every parameter (only "
                f"{sorted(per_param) or 'nothing'} may differ per group): "
                "use one optimizer per setting")
    return groups, flat


class Optimizer:
    """Base of SGD, Adam and AdamW. param_groups are torch's: a scheduler
    or the caller may change a group's "lr" (every group to the same
    value) and the next step uses it; the other hyperparameters are fixed
    at construction. The C optimizer takes its own reference to each
    parameter, so the parameters' Tensor objects may go; it is freed when
    this object is collected or on free()."""

    _PER_PARAM = ()  # hyperparameters the C step takes per parameter

    def __init__(self, params, defaults, make):
        name = type(self).__name__
        groups, flat = _param_groups(name, params, defaults, self._PER_PARAM)
        self.defaults = dict(defaults)
        self.param_groups = groups
        self.params = flat
        self._dev = flat[0]._dev
        self._made = [(p, p._h) for p in flat]
        self._fixed = [{k: g[k] for k in defaults if k != "lr"}
                       for g in groups]
        self._lr = float(groups[0]["lr"])
        self._clip = None       # the max_norm of every step (clip property)
        self._clip_once = None  # nn.utils.clip_grad_norm_'s, next step only
        self._c_clip = 0.0      # what the C optimizer has now
        self._clipped = 0       # clipped steps run (for GradNorm)
        arr = ffi.new("dispatch_tensor *[]", [_hd(p) for p in flat])
        out = ffi.new("dispatch_optim **")
        rc = make(arr, len(flat), out, groups)
        if rc < 0:
            self._dev._raise(rc)
        self._h = ffi.gc(out[0], self._dev._state.free_optim)
        for p in flat:
            _register(self, p)

    def _live(self):
        if self._h is None or self._dev._state.h is None:
            raise ValueError("the optimizer or its device was freed")
        return self._h

    def _sync_groups(self):
        """Hands the groups' lr to the C optimizer; refuses what it cannot
        follow (lrs that differ, other hyperparameters changed)."""
        name = type(self).__name__
        lrs = [g["lr"] for g in self.param_groups]
        if any(v != lrs[0] for v in lrs):
            raise ValueError(f"{name}: the parameter groups have different "
                             f"learning rates {lrs}; one step takes one")
        for g, fixed in zip(self.param_groups, self._fixed):
            for k, v in fixed.items():
                if g[k] != v:
                    raise ValueError(f"{name}: {k!r} of a parameter group "
                                     f"changed from {v} to {g[k]} after "
                                     "construction; only 'lr' may change")
        if float(lrs[0]) != self._lr:
            self.lr = lrs[0]
        for i, (p, h) in enumerate(self._made):
            if p._h is not h:
                raise ValueError(
                    f"{name}: parameter {i} was given a new tensor (Module."
                    "load_state_dict or to() after this optimizer was "
                    "made), which the optimizer does not hold: make the "
                    "optimizer after loading or moving the model")

    def step(self, grads=None):
        """One update of every parameter with its gradient in grads (by
        default the device's last backward). Remote: one Step message,
        queued; errors surface at the next wait (a read, sync or stats)."""
        h, grads, clip = self._prepare(grads)
        rc = lib.dispatch_optim_step(h, grads._h)
        if rc < 0:
            self._dev._raise(rc)
        self._stepped(clip)

    def _prepare(self, grads):
        """Everything a step does before the C call (also for a group's
        step, dispatch.distributed): the Grads (default: the device's
        last), the groups' lr handed over, this step's clip set. Returns
        (the C optimizer, the Grads, the clip of this step)."""
        if grads is None:
            grads = self._dev._last_grads
        if not isinstance(grads, Grads) or grads._h is None:
            raise ValueError("step() needs the Grads of a backward pass")
        h = self._live()
        self._sync_groups()
        clip = self._clip_once if self._clip_once is not None else self._clip
        self._clip_once = None
        if (clip or 0.0) != self._c_clip:
            self._set_clip(clip or 0.0)
        return h, grads, clip

    def _stepped(self, clip):
        """After a step the C library took (GradNorm counts clipped ones)."""
        if clip:
            self._clipped += 1

    def zero_grad(self, set_to_none=True):
        """Drops the device's last gradients (p.grad becomes None; their
        memory is freed unless the caller holds the Grads). Gradients are
        not accumulated across backward passes here, so this is only about
        memory and p.grad; a step always uses the Grads it is given."""
        self._dev._last_grads = None

    def _set_clip(self, max_norm):
        rc = lib.dispatch_optim_set_clip(self._live(), float(max_norm))
        if rc < 0:
            self._dev._raise(rc)
        self._c_clip = float(max_norm)

    @property
    def clip(self):
        """max_norm of the global-norm clip of every later step (None: off),
        as torch.nn.utils.clip_grad_norm_(params, max_norm) before each
        step, but inside the step itself (remote: still one message)."""
        return self._clip

    @clip.setter
    def clip(self, max_norm):
        self._set_clip(0.0 if max_norm is None else max_norm)
        self._clip = None if not max_norm else float(max_norm)

    @property
    def last_norm(self):
        """The global gradient norm of the last clipped step, before
        clipping (what torch.nn.utils.clip_grad_norm_ returns); 0.0 before
        the first. Read from the device: remote, one round trip."""
        v = ffi.new("double *")
        rc = lib.dispatch_optim_last_norm(self._live(), v)
        if rc < 0:
            self._dev._raise(rc)
        return v[0]

    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        rc = lib.dispatch_optim_set_lr(self._live(), float(value))
        if rc < 0:
            self._dev._raise(rc)
        self._lr = float(value)
        for g in self.param_groups:
            g["lr"] = value

    def free(self):
        if self._h is not None:
            h, self._h = self._h, None
            ffi.release(h)
            self._dev._state.drain()


class SGD(Optimizer):
    """torch.optim.SGD without dampening or nesterov (the C step has
    neither): v = momentum * v + grad + weight_decay * p; p = p - lr * v."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False):
        if dampening or nesterov:
            raise NotImplementedError("SGD: dampening and nesterov are not "
                                      "supported by the C step")
        defaults = {"lr": lr, "momentum": momentum,
                    "weight_decay": weight_decay}

        def make(a, n, out, groups):
            g = groups[0]  # every group agrees (_param_groups)
            return lib.dispatch_sgd_new(a, n, float(g["lr"]),
                                        float(g["momentum"]),
                                        float(g["weight_decay"]), out)
        super().__init__(params, defaults, make)


class Adam(Optimizer):
    """torch.optim.Adam with bias correction (Kingma and Ba); its L2
    weight_decay and amsgrad are not supported (AdamW decays)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False):
        if weight_decay or amsgrad:
            raise NotImplementedError("Adam: weight_decay (L2) and amsgrad "
                                      "are not supported; AdamW decays")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps}

        def make(a, n, out, groups):
            g = groups[0]
            b1, b2 = g["betas"]
            return lib.dispatch_adam_new(a, n, float(g["lr"]), float(b1),
                                         float(b2), float(g["eps"]), out)
        super().__init__(params, defaults, make)


class AdamW(Optimizer):
    """torch.optim.AdamW: p *= 1 - lr * weight_decay, then Adam's update
    with bias correction. weight_decay is one number, a list with one per
    parameter, or set per group with torch's parameter groups
    ([{"params": [...], "weight_decay": 0.0}, ...]), so norms and biases can
    be left out. clip: max_norm of a global-norm gradient clip taken inside
    every step (None: none); see Optimizer.clip."""

    _PER_PARAM = ("weight_decay",)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, clip=None):
        params = list(params)
        if not isinstance(weight_decay, (int, float)):
            if params and all(isinstance(g, dict) for g in params):
                raise TypeError("AdamW: with parameter groups weight_decay "
                                "is a number (each group may set its own)")
            wds = [float(w) for w in weight_decay]
            if len(wds) != len(params):
                raise ValueError("AdamW: %d weight decays for %d parameters"
                                 % (len(wds), len(params)))
            params = [{"params": [p], "weight_decay": w}
                      for p, w in zip(params, wds)]
            weight_decay = 0.0
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay}

        def make(a, n, out, groups):
            g = groups[0]
            b1, b2 = g["betas"]
            wds = [float(gr["weight_decay"]) for gr in groups
                   for _ in gr["params"]]
            return lib.dispatch_adamw_new(a, n, float(g["lr"]), float(b1),
                                          float(b2), float(g["eps"]),
                                          ffi.new("double[]", wds), out)
        super().__init__(params, defaults, make)
        self.weight_decay = [float(g["weight_decay"]) for g in
                             self.param_groups for _ in g["params"]]
        if clip is not None:
            self.clip = clip


def lr_cosine(step, warmup, total, lr_max, lr_min):
    """The learning rate of step (0, 1, ...): linear warmup to lr_max over
    `warmup` steps, then cosine decay to lr_min at `total`, lr_min after.
    The C library's dispatch_lr_cosine, so C and Python runs agree."""
    for name, v in (("step", step), ("warmup", warmup), ("total", total)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError("lr_cosine: %s must be an int" % name)
    if not (math.isfinite(lr_max) and math.isfinite(lr_min)):
        raise ValueError("lr_cosine: lr_max and lr_min must be finite")
    return lib.dispatch_lr_cosine(step, warmup, total, float(lr_max),
                                  float(lr_min))


from . import lr_scheduler  # noqa: E402,F401 (dispatch.optim.lr_scheduler)
