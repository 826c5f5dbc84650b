"""Mixed precision: autocast, as torch.autocast, and GradScaler, as
torch.cuda.amp.GradScaler, over the C library's dispatch_autocast and the
loss scaling inside the optimizer step (dispatch_optim_set_loss_scale).

    with dispatch.autocast(dtype="bfloat16"):
        loss = model(x).cross_entropy(y)        # matmuls in bf16
    scaler = dispatch.GradScaler()              # f16: scale the loss
    grads = scaler.scale(loss).backward()
    scaler.step(opt, grads)                     # skip on inf, unscale, step
    scaler.update()                             # (done inside the step)
"""
import numpy as np

from ._core import Tensor, _error, _hd, _open_states, ffi, lib

_EINVAL = lib.DISPATCH_EINVAL
_HALF_NAMES = {"bfloat16": lib.DISPATCH_BF16, "bf16": lib.DISPATCH_BF16,
               "float16": lib.DISPATCH_F16, "f16": lib.DISPATCH_F16,
               "half": lib.DISPATCH_F16, "float32": lib.DISPATCH_F32,
               "f32": lib.DISPATCH_F32}


def _half_code(dtype):
    """The C dtype of autocast's dtype argument: a name ("bfloat16",
    "float16", ...), numpy's float16 / float32, or an object whose str or
    name is one of those names (dispatch.bfloat16)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = getattr(dtype, "name", str(dtype))
    code = _HALF_NAMES.get(str(name).lower())
    if code is None:
        raise TypeError(f"autocast: dtype {dtype!r} is not bfloat16, "
                        "float16 or float32")
    return code


class autocast:
    """Within the block, the ops of `device` (a Device; default: every open
    device) follow the mixed-precision policy: matmul, conv2d and attention
    cast float32 inputs to `dtype` (bfloat16 or float16) and run in it;
    reductions, norms, softmax, exp/log and the losses run in float32;
    elementwise ops of mixed float dtypes compute in the widest. The casts
    are ops of the autodiff tape, so gradients reach float32 parameters
    in float32. Nests (the previous policy comes back at the end), and
    enabled=False turns the policy off inside the block. Devices opened
    inside the block are not affected."""

    def __init__(self, dtype="bfloat16", enabled=True, device=None):
        self._code = _half_code(dtype) if enabled else lib.DISPATCH_F32
        self._device = device
        self._saved = []

    def _states(self):
        if self._device is not None:
            return [self._device._state]
        return [st for st in list(_open_states) if st.h is not None]

    def __enter__(self):
        prev = ffi.new("dispatch_dtype *")
        for st in self._states():
            rc = lib.dispatch_autocast(st.h, self._code, prev)
            if rc < 0:
                self.__exit__(None, None, None)
                msg = ffi.string(lib.dispatch_device_errmsg(st.h)).decode(
                    errors="replace")
                raise _error(rc, msg)
            self._saved.append((st, prev[0]))
        return self

    def __exit__(self, *exc):
        saved, self._saved = self._saved, []
        for st, code in reversed(saved):
            if st.h is not None:
                lib.dispatch_autocast(st.h, code, ffi.NULL)
        return False


class GradScaler:
    """torch.cuda.amp.GradScaler for f16 training, with the unscale, the
    inf/NaN check and the scale's update inside the optimizer's one-message
    step: a step whose gradients hold an inf or NaN changes nothing and
    multiplies the scale by backoff_factor; otherwise the gradients are
    read divided by the scale (a clip set on the optimizer, or
    nn.utils.clip_grad_norm_, takes the unscaled norm), the update runs,
    and after growth_interval such steps in a row the scale is multiplied
    by growth_factor. One scaler serves one optimizer (the first given to
    step()). The scale lives on the device: get_scale() reads it (remote:
    one round trip)."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, enabled=True):
        if not (init_scale > 0 and growth_factor >= 1 and
                0 < backoff_factor <= 1 and int(growth_interval) >= 1):
            raise ValueError("GradScaler: init_scale > 0, growth_factor >= "
                             "1, 0 < backoff_factor <= 1 and "
                             "growth_interval >= 1")
        self._init = float(init_scale)
        self._growth = float(growth_factor)
        self._backoff = float(backoff_factor)
        self._interval = int(growth_interval)
        self._enabled = bool(enabled)
        self._opt = None

    def is_enabled(self):
        return self._enabled

    def scale(self, outputs):
        """outputs (the loss) times the current scale, on its device; a
        float16 / bfloat16 loss is scaled in float32."""
        if not self._enabled:
            return outputs
        if not isinstance(outputs, Tensor):
            raise TypeError("GradScaler.scale takes a dispatch Tensor")
        if self._opt is None:
            # no step yet: the scale is still init_scale
            if outputs.dtype not in (np.float32, np.float64):
                outputs = outputs.float()
            return outputs * self._init
        out = ffi.new("dispatch_tensor **")
        rc = lib.dispatch_optim_scale_loss(self._opt._live(),
                                           _hd(outputs), out)
        if rc < 0:
            self._opt._dev._raise(rc)
        return outputs._dev._adopt(out[0])

    def attach(self, optimizer):
        """Binds the scaler to optimizer now (its first step() does it
        otherwise) with the scale set to init_scale. A resume calls it
        before dispatch.load(path, device, optimizer=optimizer), which then
        restores the saved scale and counts."""
        if self._enabled:
            self._attach(optimizer)

    def _attach(self, optimizer):
        if self._opt is optimizer:
            return
        if self._opt is not None:
            raise ValueError("GradScaler: this scaler already serves "
                             "another optimizer; use one scaler per "
                             "optimizer")
        rc = lib.dispatch_optim_set_loss_scale(
            optimizer._live(), self._init, self._growth, self._backoff,
            self._interval)
        if rc < 0:
            optimizer._dev._raise(rc)
        self._opt = optimizer

    def step(self, optimizer, grads=None):
        """optimizer.step(grads) with the loss scaling inside the step (a
        skipped step is not an error: see skipped_steps)."""
        if not self._enabled:
            return optimizer.step(grads)
        self._attach(optimizer)
        return optimizer.step(grads)

    def update(self, new_scale=None):
        """Nothing to do: the step updated the scale on the device.
        new_scale is not supported (it would restart the skip count Adam's
        step count relies on)."""
        if new_scale is not None:
            raise NotImplementedError("GradScaler.update(new_scale): the "
                                      "scale is updated inside the step")

    def unscale_(self, optimizer):
        raise NotImplementedError(
            "GradScaler.unscale_: the step unscales the gradients itself; "
            "set optimizer.clip (or call nn.utils.clip_grad_norm_) and the "
            "clip takes the unscaled norm")

    def _read(self):
        s = ffi.new("double *")
        k = ffi.new("int64_t *")
        rc = lib.dispatch_optim_loss_scale(self._opt._live(), s, k)
        if rc < 0:
            self._opt._dev._raise(rc)
        return s[0], k[0]

    def get_scale(self):
        """The current scale (1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init if self._opt is None else self._read()[0]

    @property
    def skipped_steps(self):
        """Steps skipped for an inf or NaN gradient so far."""
        return 0 if self._opt is None else int(self._read()[1])

    def get_growth_factor(self):
        return self._growth

    def get_backoff_factor(self):
        return self._backoff

    def get_growth_interval(self):
        return self._interval
