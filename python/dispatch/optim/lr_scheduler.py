"""Learning-rate schedules that drive an optimizer's param_groups' "lr",
as torch.optim.lr_scheduler: made after the optimizer (which sets the
first step's rate), then scheduler.step() after each optimizer.step().
The optimizer hands the rate to its next step (no message of its own)."""
import math

from .. import optim as _optim


class LRScheduler:
    """Base: get_lr() gives the rates of epoch self.last_epoch (0 for the
    first step), one per group."""

    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(optimizer, _optim.Optimizer):
            raise TypeError(f"{type(self).__name__}: "
                            f"{type(optimizer).__name__} is not a "
                            "dispatch optimizer")
        self.optimizer = optimizer
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def get_lr(self):
        raise NotImplementedError

    def step(self):
        self.last_epoch += 1
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self):
        return list(self._last_lr)


class LambdaLR(LRScheduler):
    """lr = initial lr * lr_lambda(epoch)."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        self.lr_lambda = lr_lambda
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [b * self.lr_lambda(self.last_epoch) for b in self.base_lrs]


class StepLR(LRScheduler):
    """lr times gamma every step_size epochs (torch's recursive form, so
    the rates are torch's to the bit)."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        if not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"StepLR: step_size {step_size!r} is not an "
                             "int >= 1")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        if self.last_epoch == 0 or self.last_epoch % self.step_size:
            return [g["lr"] for g in groups]
        return [g["lr"] * self.gamma for g in groups]


class CosineWithWarmup(LRScheduler):
    """Linear warmup to the initial lr over warmup_steps, then cosine
    decay to lr_min at total_steps, lr_min after: dispatch_lr_cosine
    (dispatch.optim.lr_cosine), the C examples' schedule, bit for bit."""

    def __init__(self, optimizer, warmup_steps, total_steps, lr_min=0.0,
                 last_epoch=-1):
        for name, v in (("warmup_steps", warmup_steps),
                        ("total_steps", total_steps)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CosineWithWarmup: {name} {v!r} is not an "
                                 "int >= 0")
        if total_steps <= warmup_steps:
            raise ValueError(f"CosineWithWarmup: total_steps {total_steps} "
                             f"must exceed warmup_steps {warmup_steps}")
        if not math.isfinite(lr_min):
            raise ValueError("CosineWithWarmup: lr_min must be finite")
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.lr_min = lr_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [_optim.lr_cosine(self.last_epoch, self.warmup_steps,
                                 self.total_steps, b, self.lr_min)
                for b in self.base_lrs]
