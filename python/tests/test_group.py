"""dispatch.distributed against real dispatch-servers started as one MPI
job (conftest.MpiGroup: mpirun on loopback, as tests/helpers/group_proc.c
does; the module is skipped where mpirun or the MPI plugin is missing):

- all_reduce of several float32 tensors and a float64 one, sum and mean,
  lands on both members bit for bit equal to numpy's sum (halved for the
  mean); int64 sums;
- members holding other shapes both raise dispatch.EGROUP at their next
  wait and keep their tensors, and the group goes on;
- argument errors are raised at once with the library's message;
- all_reduce_grads leaves the mean of the members' gradients in both
  Grads;
- a data-parallel MLP trained with Group.step (and GroupOptimizer) has the
  same parameters, bit for bit, on both members after every step, within
  a derived bound of one server's step on the whole batch;
- opening a plain server, or too few ranks, is refused;
- a member killed while the group works gives the client an error (Open
  MPI ends the whole job), never a hang."""
import os
import signal

import numpy as np
import pytest

import dispatch
import dispatch.nn as nn
import dispatch.nn.functional as F
from dispatch.distributed import Group, ReduceOp
from conftest import MpiGroup, mpi_missing


@pytest.fixture
def group(mpi_group):
    # the ranks in the reverse of the order they announced themselves: a
    # Group numbers its members by MPI rank, whatever order it is given
    with Group(mpi_group.specs[::-1]) as g:
        yield g


def _data(seed, *shape, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-1, 1, shape) * 10.0 ** rng.integers(-3, 4, shape)
            ).astype(dtype)


def test_group_members_and_size(group, mpi_group):
    assert group.size == len(group) == 2
    assert [d.kind for d in group.devices] == ["remote", "remote"]
    assert {d.spec for d in group.devices} == set(mpi_group.specs)
    assert group.device(-1) is group.devices[1]
    with pytest.raises(IndexError):
        group.device(2)
    assert "Group([" in repr(group)


@pytest.mark.parametrize("op", ["sum", ReduceOp.SUM, "mean", ReduceOp.AVG])
def test_all_reduce_is_numpys_sum_bit_for_bit(group, op):
    mean = op in ("mean", ReduceOp.AVG)
    a = [_data(10 + r, 3, 4) for r in range(2)]
    b = [_data(20 + r, 5) for r in range(2)]
    c = [np.array([0.1, 1e16, -2.5]), np.array([0.2, 1.0, 7.25])]  # float64
    ta = [d.tensor(x) for d, x in zip(group.devices, a)]
    tb = [d.tensor(x) for d, x in zip(group.devices, b)]
    tc = [d.tensor(x) for d, x in zip(group.devices, c)]
    group.all_reduce([[ta[0], tb[0]], [ta[1], tb[1]]], op)  # two each
    group.all_reduce(tc, op=op)                              # one each
    for want_of, ts in ((a, ta), (b, tb), (c, tc)):
        want = want_of[0] + want_of[1]
        if mean:
            want = want / want.dtype.type(2)
        assert want.dtype == want_of[0].dtype
        for r in range(2):
            got = ts[r].numpy()
            assert got.dtype == want.dtype
            assert got.tobytes() == want.tobytes(), (r, got, want)


def test_broadcast_gives_every_member_srcs_bytes(group):
    """src 1's float32 and int64 tensors (one call mixes them) land on
    member 0 bit for bit; a model built from different seeds is the same
    on both after a broadcast of its parameters."""
    a = [_data(40 + r, 3, 4) for r in range(2)]
    b = [np.array([r, -7 * r, 1 << 50], np.int64) for r in range(2)]
    ta = [d.tensor(x) for d, x in zip(group.devices, a)]
    tb = [d.tensor(x) for d, x in zip(group.devices, b)]
    group.broadcast([[ta[0], tb[0]], [ta[1], tb[1]]], src=1)
    for r in range(2):
        assert ta[r].numpy().tobytes() == a[1].tobytes(), r
        assert tb[r].numpy().tobytes() == b[1].tobytes(), r
    models = [_mlp(d, 100 + r) for r, d in enumerate(group.devices)]
    ps = [list(m.parameters()) for m in models]
    assert ps[0][0].numpy().tobytes() != ps[1][0].numpy().tobytes()
    group.broadcast(ps)  # src 0
    for p0, p1 in zip(*ps):
        assert p0.numpy().tobytes() == p1.numpy().tobytes()
    with pytest.raises(ValueError):
        group.broadcast(ta, src=2)


def test_all_reduce_sums_int64(group):
    xs = [np.array([1, -2, 3 << 40], np.int64), np.array([5, 7, -1], np.int64)]
    ts = [d.tensor(x) for d, x in zip(group.devices, xs)]
    group.all_reduce(ts)
    for t in ts:
        assert t.numpy().tolist() == [6, 5, (3 << 40) - 1]


def test_other_shapes_raise_egroup_on_both_and_keep_the_tensors(group):
    v = _data(3, 12)
    ts = [group.device(0).tensor(v.reshape(3, 4)),
          group.device(1).tensor(v.reshape(4, 3))]
    group.all_reduce(ts)  # queued: the servers compare, then refuse
    for r, d in enumerate(group.devices):
        with pytest.raises(dispatch.EGROUP) as ei:
            d.sync()
        e = ei.value
        assert isinstance(e, RuntimeError) and e.code == dispatch.codes[
            "EGROUP"], r
        assert "disagree" in e.message and "shape" in e.message, e.message
        assert ts[r].numpy().ravel().tobytes() == v.tobytes(), r
    # the group goes on
    us = [d.tensor(v) for d in group.devices]
    group.all_reduce(us)
    assert us[1].numpy().tobytes() == (v + v).tobytes()


def test_other_dtypes_raise_egroup(group):
    ts = [group.device(0).tensor(np.ones(4, np.float32)),
          group.device(1).tensor(np.ones(4, np.float64))]
    group.all_reduce(ts, "mean")
    with pytest.raises(dispatch.EGROUP, match="disagree"):
        group.sync()
    with pytest.raises(dispatch.EGROUP, match="disagree"):
        group.device(1).sync()
    assert ts[0].numpy().tolist() == [1.0] * 4
    assert ts[1].numpy().tolist() == [1.0] * 4


def test_argument_errors_are_raised_at_once(group):
    t0 = group.device(0).ones((2,))
    t1 = group.device(1).ones((2,))
    with pytest.raises(ValueError, match="1 entries for a group of 2"):
        group.all_reduce([t0])
    with pytest.raises(ValueError, match="op 'max'"):
        group.all_reduce([t0, t1], "max")
    with pytest.raises(ValueError, match=r"same number.*\[1, 2\]"):
        group.all_reduce([[t0], [t1, t1]])
    # rank 1's entry on rank 0's device: the library's check and message
    with pytest.raises(dispatch.EDEVICE) as ei:
        group.all_reduce([t0, t0])
    assert "tensor 0 of rank 1 lives on" in ei.value.message, ei.value.message
    with pytest.raises(TypeError):
        group.all_reduce([t0, np.ones(2, np.float32)])
    group.all_reduce([t0, t1])
    assert t0.numpy().tolist() == [2.0, 2.0]


def test_opening_what_is_not_a_group_is_refused(server, mpi_group):
    with pytest.raises(dispatch.EUNSUPPORTED, match="--mpi"):
        Group([server.spec])
    with pytest.raises(dispatch.EGROUP, match="2 ranks") as ei:
        Group(mpi_group.specs[:1])
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(TypeError):
        Group([])


def test_closing_the_group_closes_its_members(mpi_group):
    g = Group(",".join(mpi_group.specs))  # one comma-separated string too
    t = g.device(0).ones((2,))
    g.device(1).close()  # a member's close closes the whole group
    assert g.closed and all(d.closed for d in g.devices)
    with pytest.raises(dispatch.EINVAL, match="freed"):
        t.numpy()
    g.close()  # twice is fine


def _mlp(dev, seed):
    nn.init.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, device=dev), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT, device=dev))


IN, HIDDEN, OUT, BATCH, LR, STEPS = 20, 16, 4, 8, 0.5, 3


def _batch(step):
    rng = np.random.default_rng(100 + step)
    return (rng.uniform(0, 1, (BATCH, IN)).astype(np.float32),
            rng.integers(0, OUT, BATCH).astype(np.int64))


def _params(model):
    return [p.numpy() for p in model.parameters()]


def _step_bound(ps):
    """How far one SGD step of the members can move from the whole-batch
    step on one server, from the parameters ps = [W1, b1, W2, b2] before
    it (examples/train_mlp_dp.c's derivation): every gradient element is a
    sum of A worth of terms evaluated in another order, so each run is
    within gamma_K * A of the exact value, gamma_K = K u / (1 - K u), u =
    2^-24, K = B + IN + HIDDEN + OUT + 16 the longest chain of roundings.
    With x in [0, 1) and |softmax - onehot| summing to at most 2 a row,
    A <= 2 max|W2| (W1, b1), 2 (IN max|W1| + max|b1|) (W2), 2 (b2); the
    mean over the members divides by 2, which is exact. The step moves
    the two runs apart by at most lr * 2 gamma_K * max A."""
    u = 2.0 ** -24
    k = BATCH + IN + HIDDEN + OUT + 16
    gamma = k * u / (1 - k * u)
    w1, b1, w2 = (float(np.abs(p).max()) for p in ps[:3])
    amax = 2 * max(w2, IN * w1 + b1, 1.0)
    return LR * 2 * gamma * amax


@pytest.mark.parametrize("how", ["step", "optimizer"])
def test_a_data_parallel_step_matches_the_whole_batch(group, remote, how):
    members = [_mlp(d, 7) for d in group.devices]
    ref = _mlp(remote, 7)
    opts = [dispatch.optim.SGD(m.parameters(), lr=LR) for m in members]
    ref_opt = dispatch.optim.SGD(ref.parameters(), lr=LR)
    gopt = group.optimizer(opts) if how == "optimizer" else None
    assert [p.tobytes() for p in _params(members[0])] == \
        [p.tobytes() for p in _params(ref)]
    half = BATCH // 2
    bound = 0.0
    for step in range(STEPS):
        bound += _step_bound(_params(ref))
        x, y = _batch(step)
        grads = []
        for r, (m, d) in enumerate(zip(members, group.devices)):
            rows = slice(r * half, (r + 1) * half)
            loss = F.cross_entropy(m(d.tensor(x[rows])), d.tensor(y[rows]))
            grads.append(loss.backward())
        if gopt is not None:
            gopt.step()  # each member's last backward
        else:
            group.step(opts, grads)  # op="mean" by default
        ref_opt.step(F.cross_entropy(ref(remote.tensor(x)),
                                     remote.tensor(y)).backward())
        p0, p1, pr = (_params(m) for m in (*members, ref))
        for a, b in zip(p0, p1):
            assert a.tobytes() == b.tobytes(), f"members differ at {step}"
        diff = max(float(np.abs(a.astype(np.float64) - b).max())
                   for a, b in zip(p0, pr))
        assert diff <= bound, (step, diff, bound)


def test_all_reduce_grads_leaves_the_mean_in_both(group):
    members = [_mlp(d, 3) for d in group.devices]
    x, y = _batch(0)
    grads, before = [], []
    for r, (m, d) in enumerate(zip(members, group.devices)):
        rows = slice(r * 4, r * 4 + 4)
        g = F.cross_entropy(m(d.tensor(x[rows])), d.tensor(y[rows])).backward()
        grads.append(g)
        before.append([g[p].numpy() for p in m.parameters()])
    group.all_reduce_grads(grads, members, op=ReduceOp.AVG)
    for r, m in enumerate(members):
        for i, p in enumerate(m.parameters()):
            want = (before[0][i] + before[1][i]) / np.float32(2)
            assert grads[r][p].numpy().tobytes() == want.tobytes(), (r, i)
    assert any((before[0][i] != before[1][i]).any() for i in range(4))


def test_a_step_with_another_members_optimizer_is_refused(group):
    members = [_mlp(d, 5) for d in group.devices]
    opts = [dispatch.optim.SGD(m.parameters(), lr=0.1) for m in members]
    for m, d in zip(members, group.devices):
        m(d.ones((1, IN))).sum().backward()
    with pytest.raises(dispatch.EDEVICE, match="optimizer 0 is not over"):
        group.step(opts[::-1])
    with pytest.raises(ValueError, match="1 optimizers for a group of 2"):
        group.step(opts[:1])
    # the library's own check, its message taken from the member it is
    # recorded on (rank 1's device, not rank 0's)
    fewer = dispatch.optim.SGD(list(members[1].parameters())[:2], lr=0.1)
    with pytest.raises(dispatch.EINVAL, match="rank 1 needs an optimizer"):
        group.step([opts[0], fewer])


def test_a_killed_member_raises_an_error_not_a_hang(monkeypatch):
    why = mpi_missing()
    if why:
        pytest.skip(why)
    # the job ends with the member (Open MPI 4.1), so there is no session
    # to resume: without this the client would retry for its resume
    # timeout (30 s by default) before raising ECONN
    monkeypatch.setenv("DISPATCH_RESUME", "0")
    job = MpiGroup(2, ["--mpi-timeout", "2", "--log-level", "error"])
    try:
        with Group(job.specs) as g:
            ts = [d.tensor(np.ones(4, np.float32)) for d in g.devices]
            g.device(0).sync()
            os.kill(job.rank_pid[1], signal.SIGKILL)
            try:  # rank 1's socket may be found closed already
                g.all_reduce(ts)
            except ConnectionError:
                pass
            with pytest.raises((dispatch.ECONN, dispatch.EGROUP,
                                dispatch.ESHUTDOWN)) as ei:
                ts[0].numpy()
            assert ei.value.message, ei.value
    finally:
        job.stop()
