"""dispatch.nn.utils.clip_grad_norm_: torch's global-norm clip, taken
inside the optimizer's next step (remote: still one message)."""
from .._core import Tensor
from .. import optim as _optim


class GradNorm:
    """The total gradient norm of the step a clip_grad_norm_ call armed,
    as torch's return value: known once that step has run (float(norm) or
    norm.item(); remote: one round trip, then remembered). Reading it
    before the step raises RuntimeError, after a later clipped step of the
    same optimizer too (the device keeps only the last norm)."""

    def __init__(self, opt, max_norm):
        self._opt = opt
        self._step = opt._clipped + 1
        self.max_norm = max_norm
        self._value = None

    def item(self):
        if self._value is None:
            done = self._opt._clipped
            if done < self._step:
                raise RuntimeError(
                    "clip_grad_norm_: the norm is taken inside the "
                    "optimizer's next step; read it after optimizer.step()")
            if done > self._step:
                raise RuntimeError("clip_grad_norm_: a later clipped step "
                                   "replaced this norm; read it right after "
                                   "its own step")
            self._value = self._opt.last_norm
        return self._value

    def __float__(self):
        return float(self.item())

    def __format__(self, spec):
        return format(float(self), spec)

    def __repr__(self):
        if self._value is None and self._opt._clipped < self._step:
            return f"GradNorm(<after the next step>, max_norm={self.max_norm})"
        return f"GradNorm({self.item()!r})"


def clip_grad_norm_(parameters, max_norm, norm_type=2.0,
                    error_if_nonfinite=False):
    """Clips the gradients of parameters by their global 2-norm, as
    torch.nn.utils.clip_grad_norm_ called between backward() and step():
    every gradient of the next step of the optimizer over exactly these
    parameters is scaled by max_norm / (norm + 1e-6) when that is below 1.
    The clip happens inside that step (gradients are not modified in
    place), for that step only (Optimizer.clip sets one for every step).
    Returns a GradNorm, the norm once the step ran. Parameters that are
    not exactly one optimizer's raise ValueError."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    params = list(parameters)
    if norm_type != 2.0:
        raise NotImplementedError("clip_grad_norm_: only the 2-norm is "
                                  "taken inside the step")
    if error_if_nonfinite:
        raise NotImplementedError("clip_grad_norm_: error_if_nonfinite is "
                                  "not supported (a NaN norm makes every "
                                  "parameter NaN, as torch's default)")
    max_norm = float(max_norm)
    if not max_norm > 0.0 or max_norm == float("inf"):
        raise ValueError(f"clip_grad_norm_: max_norm {max_norm} is not "
                         "finite and > 0")
    want = {id(p) for p in params}
    cands = set()
    for p in params:
        cands |= set(_optim.owners(p))
    opts = [o for o in cands if
            {id(p) for p in o.params} == want and len(o.params) == len(params)]
    if not opts:
        raise ValueError("clip_grad_norm_: the clip runs inside an "
                         "optimizer's step, and no optimizer holds exactly "
                         f"these {len(params)} parameters: make the "
                         "optimizer first, and pass all of its parameters")
    if len(opts) > 1:
        raise ValueError("clip_grad_norm_: several optimizers hold exactly "
                         "these parameters; set optimizer.clip instead")
    opt = opts[0]
    opt._clip_once = max_norm
    return GradNorm(opt, max_norm)
