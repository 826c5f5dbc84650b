"""Data-parallel training across dispatch-servers: a thin binding of the
C library's groups (dispatch_group_open, _allreduce, _allreduce_grads,
_step; README "Data-parallel training across servers").

The servers of one MPI job (mpirun -np N dispatch-server --mpi --listen
HOST:BASE, rank r on port BASE + r) form a group. One client process opens
them all as a Group and drives every member: it makes each member's
tensors on that member's device, and the servers all-reduce among
themselves with MPI; no tensor byte passes through the client.

    with dispatch.distributed.Group(["tcp://127.0.0.1:7070",
                                     "tcp://127.0.0.1:7071"]) as g:
        ts = [d.tensor(x[r]) for r, d in enumerate(g.devices)]
        g.all_reduce(ts, op="sum")          # every ts[r] is now the sum

Names follow torch.distributed where the idea is the same (all_reduce,
ReduceOp.SUM / ReduceOp.AVG, a group's size); what differs is that one
process holds every member's tensors, so each call takes a list with one
entry per member (rank order), where torch's takes this process's one.
"""
import enum
from typing import Any, Optional, Sequence, Union

from ._core import (Device, Grads, Tensor, _DeviceState, _REDUCTIONS, _cstr,
                    _error, _hd, _options, codes, ffi, lib)

__all__ = ["Group", "GroupOptimizer", "ReduceOp", "init_group"]


class ReduceOp(enum.Enum):
    """How all_reduce combines the members' tensors: SUM, or AVG (also
    MEAN), the sum divided by the group's size. The strings "sum", "mean"
    and "avg" are accepted wherever a ReduceOp is."""
    SUM = "sum"
    AVG = "mean"
    MEAN = "mean"  # an alias of AVG (the C library's name)


def _reduce_code(op, fn):
    if isinstance(op, ReduceOp):
        op = op.value
    if isinstance(op, str) and op.lower() in ("sum", "mean", "avg"):
        return _REDUCTIONS["mean" if op.lower() == "avg" else op.lower()]
    raise ValueError(f"{fn}: op {op!r} is not ReduceOp.SUM or ReduceOp.AVG "
                     "(\"sum\" or \"mean\")")


class _GroupState:
    """Owns the C group (which owns its members' devices). Closing it
    closes every member: their states drop the handles first, so no
    Tensor, Grads or optimizer of a member calls into C afterwards."""
    __slots__ = ("h", "lib", "members", "__weakref__")

    def __init__(self, h):
        self.h = h
        self.lib = lib  # kept: module globals may be gone at exit
        self.members = []

    def close(self):
        h, self.h = self.h, None
        for m in self.members:
            m.h = None
            m.pending = []  # the group's close frees everything in C
        if h is not None:
            self.lib.dispatch_group_close(h)

    def __del__(self):
        self.close()


class _MemberState(_DeviceState):
    """A member device's state: the handle is the group's (borrowed), so
    closing a member closes the whole group, which closes the handle. A
    member's tensors keep the group open (they hold this state)."""
    __slots__ = ("group",)

    def __init__(self, h, group):
        super().__init__(h)
        self.group = group

    def close(self):
        self.group.close()


def _split(specs):
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s]
    specs = list(specs)
    if not specs or not all(isinstance(s, str) for s in specs):
        raise TypeError("Group: a list of device strings (\"tcp://HOST:PORT\""
                        ", one per rank of the MPI job)")
    return specs


def _row(entry, r, fn):
    """Member r's entry as a list: a Tensor, a list or tuple of them, or a
    module (its parameters())."""
    if isinstance(entry, Tensor):
        return [entry]
    if isinstance(entry, (list, tuple)):
        return list(entry)
    if callable(getattr(entry, "parameters", None)):
        return list(entry.parameters())
    raise TypeError(f"{fn}: rank {r}'s entry is a {type(entry).__name__}, "
                    "not a Tensor, a list of them or a module")


class Group:
    """The dispatch-servers of one MPI job, opened together: specs holds
    the device string of every rank (a list, or one comma-separated
    string), in any order; the members are then numbered by their MPI
    rank. The keywords are dispatch.device()'s (token, timeout_ms,
    ca_file, cert_file, key_file, server_name, client_name), the same for
    every member.

    Raises dispatch.EUNSUPPORTED (a spec is not a server started with
    --mpi, or one older than protocol 1.7), dispatch.EGROUP (the specs are
    not all the ranks of one job), or the open's own error (ECONN, EAUTH,
    ...); the message is the library's. Nothing stays open on failure.

    A context manager: closing the group closes every member device (and
    so every tensor, Grads and optimizer of them); closing one member's
    Device closes the whole group."""

    def __init__(self, specs: Union[str, Sequence[str]], *,
                 token: Optional[str] = None,
                 timeout_ms: Optional[int] = None,
                 ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None,
                 key_file: Optional[str] = None,
                 server_name: Optional[str] = None,
                 client_name: Optional[str] = None) -> None:
        specs = _split(specs)
        opts, keep = _options(token=token, timeout_ms=timeout_ms,
                              ca_file=ca_file, cert_file=cert_file,
                              key_file=key_file, server_name=server_name,
                              client_name=client_name)
        arr = ffi.new("char *[]", [_cstr(s, keep) for s in specs])
        out = ffi.new("dispatch_group **")
        msg = ffi.new("char[512]")
        rc = lib.dispatch_group_open(arr, len(specs), opts, out, msg, 512)
        if rc < 0:
            raise _error(rc, ffi.string(msg).decode(errors="replace"))
        self._state = _GroupState(out[0])
        devices = []
        for r in range(len(specs)):
            h = lib.dispatch_group_device(out[0], r)
            st = _MemberState(h, self._state)
            self._state.members.append(st)
            dev = Device.__new__(Device)
            dev._init_handle(h, st)
            dev._remember()  # t.to("tcp://...") of a member finds it
            devices.append(dev)
        self._devices = tuple(devices)

    # -- the members

    @property
    def size(self) -> int:
        """The number of members (MPI ranks)."""
        return len(self._devices)

    def __len__(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> "tuple[Device, ...]":
        """The members' devices, by rank."""
        return self._devices

    def device(self, rank: int) -> Device:
        """The device of member `rank` (0 .. size - 1; negative counts
        from the end). Make each member's tensors, model and optimizer on
        its own device."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"device(): a rank, not {type(rank).__name__}")
        if not -self.size <= rank < self.size:
            raise IndexError(f"device(): rank {rank} of a group of "
                             f"{self.size}")
        return self._devices[rank]

    @property
    def closed(self) -> bool:
        return self._state.h is None

    def close(self) -> None:
        """Closes every member (each says bye). Closing twice is fine."""
        for d in self._devices:
            d._last_grads = None
            d._scopes = []
        self._state.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        specs = ", ".join(repr(d.spec) for d in self._devices)
        return (f"dispatch.distributed.Group([{specs}]"
                f"{', closed' if self.closed else ''})")

    def sync(self) -> None:
        """Waits on every member in rank order (Device.sync): raises the
        first deferred error met (dispatch.EGROUP for an all-reduce the
        members refused or that failed)."""
        for d in self._devices:
            d.sync()

    # -- collectives

    def _handle(self):
        if self._state.h is None:
            raise _error(codes["EINVAL"], "the group is closed")
        for d in self._devices:
            d._handle()  # runs each member's queued frees
        return self._state.h

    def _per_member(self, items, fn, what):
        items = list(items)
        if len(items) != self.size:
            raise ValueError(f"{fn}: {len(items)} {what} for a group of "
                             f"{self.size} (one per member, by rank)")
        return items

    def _raise(self, rc, before):
        """Raises rc with the message of the member the library recorded
        it on: the one whose last error changed during the call."""
        errs = self._last_errors()
        for now, was in zip(errs, before):
            if now != was and now[0] == rc:
                raise _error(rc, now[1])
        for now in errs:
            if now[0] == rc:
                raise _error(rc, now[1])
        raise _error(rc, errs[0][1])

    def _last_errors(self):
        return [(lib.dispatch_device_errcode(st.h),
                 ffi.string(lib.dispatch_device_errmsg(st.h)).decode(
                     errors="replace"))
                for st in self._state.members]

    def _call(self, cfn, *args):
        before = self._last_errors()
        rc = cfn(*args)
        if rc < 0:
            self._raise(rc, before)

    def all_reduce(self, tensors: Sequence[Any],
                   op: Union[str, ReduceOp] = ReduceOp.SUM) -> None:
        """All-reduces in place, as torch.distributed.all_reduce: tensors
        has one entry per member (rank order), each a Tensor of that
        member's device or a list of them (the same count, dtypes and
        shapes on every member). Afterwards every member's tensor i holds
        the sum over the members (op "sum", ReduceOp.SUM) or that sum
        divided by the group's size ("mean", ReduceOp.AVG), the same bits
        on every member. float32 and float64 (sum or mean), int64 (sum);
        the tensors of one call share a dtype. Tracked leaves may be given.

        Queued like an op: returns at once; what the servers find surfaces
        at each member's next wait (t.numpy(), dev.sync(), group.sync()).
        Members holding other shapes or dtypes all refuse with
        dispatch.EGROUP (the message names both sides) and keep their
        tensors; the group goes on. Errors found here (a tensor of
        another device: EDEVICE; a bad op: ValueError) are raised at once
        and nothing is sent."""
        code = _reduce_code(op, "all_reduce")
        arr, k = self._tensor_rows(tensors, "all_reduce", "tensors")
        h = self._handle()
        self._call(lib.dispatch_group_allreduce, h, arr, k, code)

    def broadcast(self, tensors: Sequence[Any], src: int = 0) -> None:
        """Broadcasts member src's tensors to every member, in place, as
        torch.distributed.broadcast: tensors as in all_reduce (one entry
        per member, the same count, dtypes and shapes on every member;
        float32, float64, int64, float16 and bfloat16, which one call may
        mix). Afterwards every member's tensor i holds src's bytes: the
        way a data-parallel run starts its members from one model.
        Queued and checked as all_reduce; src outside 0 .. size-1 raises
        ValueError."""
        src = int(src)
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast: src {src} is not a rank of this "
                             f"group of {self.size}")
        arr, k = self._tensor_rows(tensors, "broadcast", "tensors")
        h = self._handle()
        self._call(lib.dispatch_group_broadcast, h, arr, k, src)

    def _tensor_rows(self, entries, fn, what):
        """The members' entries (_row) as the library's rank-major array
        and the count per member. Every member's tensors are Tensors of
        its own device, the same number on each, checked before anything
        is sent (the library sends each member its part in turn, so a
        member found wrong after another was sent its part would leave
        that one waiting for --mpi-timeout)."""
        rows = [_row(e, r, fn) for r, e in enumerate(
            self._per_member(entries, fn, "entries"))]
        k = len(rows[0])
        if k == 0 or any(len(row) != k for row in rows):
            raise ValueError(f"{fn}: every member needs the same number (at "
                             f"least one) of {what}, not "
                             f"{[len(row) for row in rows]}")
        for r, row in enumerate(rows):
            for i, t in enumerate(row):
                if not isinstance(t, Tensor):
                    raise TypeError(f"{fn}: tensor {i} of rank {r} is a "
                                    f"{type(t).__name__}, not a Tensor")
                if t._dev._state is not self._state.members[r]:
                    raise _error(codes["EDEVICE"],
                                 f"{fn}: tensor {i} of rank {r} lives on "
                                 f"\"{t._dev.spec}\", not on "
                                 f"\"{self._devices[r].spec}\"")
        return ffi.new("dispatch_tensor *[]",
                       [_hd(t) for row in rows for t in row]), k

    def all_reduce_grads(self, grads: Sequence[Grads],
                         params: Sequence[Any],
                         op: Union[str, ReduceOp] = ReduceOp.SUM) -> None:
        """All-reduces gradients in place, inside their Grads: grads[r] is
        member r's Grads (a backward on its device), params[r] the
        tracked parameters whose gradients to reduce (a list, or a module:
        its parameters()), the same count and shapes on every member.
        Afterwards grads[r][p] is the sum (or mean) over the members on
        every member. Queued and checked as all_reduce."""
        code = _reduce_code(op, "all_reduce_grads")
        grads = self._per_member(grads, "all_reduce_grads", "Grads")
        parr, k = self._tensor_rows(params, "all_reduce_grads",
                                    "parameters")
        self._check_grads(grads, "all_reduce_grads")
        h = self._handle()
        garr = ffi.new("dispatch_grads *[]", [g._h for g in grads])
        self._call(lib.dispatch_group_allreduce_grads, h, garr, parr, k, code)

    def _check_grads(self, grads, fn):
        for r, g in enumerate(grads):
            if not isinstance(g, Grads) or g._h is None:
                raise ValueError(f"{fn}: rank {r} needs the Grads of a "
                                 "backward pass")
            if g._state is not self._state.members[r]:
                raise _error(codes["EDEVICE"],
                             f"{fn}: rank {r}'s gradients are on another "
                             "device")

    def step(self, optimizers: Sequence[Any],
             grads: Optional[Sequence[Optional[Grads]]] = None,
             op: Union[str, ReduceOp] = ReduceOp.AVG) -> None:
        """One data-parallel step: optimizers[r] (an SGD, Adam or AdamW
        of member r's parameters, the same count on every member) steps
        with the gradients of grads[r] (default: each member device's
        last backward) all-reduced through the group first: "mean"
        (ReduceOp.AVG, the default) for a loss averaged over each member's
        share of the batch. Each member gets ONE Step message queued
        behind its backward, so backward, all-reduce and update run on
        the servers with no round trip; errors surface at the next wait,
        as all_reduce's. Each optimizer's learning rate, groups and clip
        (Optimizer.clip, nn.utils.clip_grad_norm_) apply as in its own
        step()."""
        code = _reduce_code(op, "step")
        opts = self._per_member(optimizers, "step", "optimizers")
        grads = self._per_member(grads if grads is not None
                                 else [None] * self.size, "step", "Grads")
        for r, o in enumerate(opts):
            if not hasattr(o, "_prepare"):
                raise TypeError(f"step: optimizer {r} is a "
                                f"{type(o).__name__}, not a dispatch "
                                "optimizer")
            if o._dev._state is not self._state.members[r]:
                raise _error(codes["EDEVICE"],
                             f"step: optimizer {r} is not over rank {r}'s "
                             f"device {self._devices[r].spec}")
        prepared = [o._prepare(g) for o, g in zip(opts, grads)]
        self._check_grads([g for _, g, _ in prepared], "step")
        h = self._handle()
        oarr = ffi.new("dispatch_optim *[]", [p[0] for p in prepared])
        garr = ffi.new("dispatch_grads *[]", [p[1]._h for p in prepared])
        self._call(lib.dispatch_group_step, h, oarr, garr, code)
        for o, (_, _, clip) in zip(opts, prepared):
            o._stepped(clip)

    def optimizer(self, optimizers: Sequence[Any],
                  op: Union[str, ReduceOp] = ReduceOp.AVG
                  ) -> "GroupOptimizer":
        """The members' optimizers as one (see GroupOptimizer)."""
        return GroupOptimizer(self, optimizers, op)


class GroupOptimizer:
    """One optimizer per member driven as one, for a training loop that
    reads like torch's: step(grads=None) is group.step(optimizers, grads,
    op); lr reads and sets every member's; zero_grad() each one's.

        opt = group.optimizer([dispatch.optim.SGD(m.parameters(), lr=0.1)
                               for m in models])
        for r, m in enumerate(models): F.cross_entropy(...).backward()
        opt.step()
    """

    def __init__(self, group: Group, optimizers: Sequence[Any],
                 op: Union[str, ReduceOp] = ReduceOp.AVG) -> None:
        self.group = group
        self.optimizers = group._per_member(optimizers, "optimizer",
                                            "optimizers")
        _reduce_code(op, "optimizer")
        self.op = op

    def step(self, grads: Optional[Sequence[Optional[Grads]]] = None
             ) -> None:
        self.group.step(self.optimizers, grads, self.op)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    @property
    def lr(self) -> float:
        return self.optimizers[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for o in self.optimizers:
            o.lr = value


def init_group(specs: Union[str, Sequence[str]], **options: Any) -> Group:
    """Group(specs, **options): opens the servers of one MPI job."""
    return Group(specs, **options)

