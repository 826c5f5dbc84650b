"""Indexing and assignment as torch's (issue 26 item 5): ints, slices
with negative steps, None, Ellipsis, int64 tensor indices, bool masks,
and __setitem__ with numbers and broadcast tensors, each compared with
torch 1.13 on local and remote, gradients through both, and LOCAL ==
REMOTE bit for bit. A bool mask is the one index that is read back (its
nonzero positions); the indexed tensor never is: the server's counters
check it."""
import numpy as np
import pytest

import dispatch

try:  # python3-torch is optional (make deps): numpy is the reference then
    import torch
except ImportError:
    torch = None

A = np.arange(60, dtype=np.float32).reshape(3, 4, 5) - 30.0
I64 = np.arange(12, dtype=np.int64).reshape(3, 4) - 6


def same(got, want):
    want = want.numpy() if hasattr(want, "numpy") else np.asarray(want)
    g = got.numpy()
    assert g.dtype == want.dtype and g.shape == want.shape, \
        (g.dtype, g.shape, want.dtype, want.shape)
    assert np.array_equal(g, want), (g, want)


M2 = A[:, :, 0] > -5  # a [3, 4] mask


def keys():
    m = M2
    return [
        1, -1, (0, 2), (0, -1, 4), slice(1, None), slice(None, None, -1),
        (slice(None), slice(None, None, -2)), (slice(None, 1, -1),),
        (Ellipsis, 1), (None, 0), (0, None, Ellipsis, None),
        (slice(None), None, 2), (Ellipsis,), (slice(4, 1),),
        (slice(None, None, 2), Ellipsis, slice(None, None, -3)),
        [2, 0, -1], np.array([[0, 1], [2, 2]]), (slice(None), [3, 0]),
        (Ellipsis, np.array([-1, 0])), A > 0, m, (m, slice(1, 3)),
        (slice(None), A[0, :, 0] > -25), (1, A[1, :, 0] > -10),
    ]


def negative_step(k):
    if isinstance(k, tuple):
        return any(negative_step(e) for e in k)
    return isinstance(k, slice) and (k.step or 1) < 0


def as_torch(k):
    if isinstance(k, tuple):
        return tuple(as_torch(e) for e in k)
    if isinstance(k, (list, np.ndarray)):
        return torch.from_numpy(np.asarray(k))
    return k


def as_dispatch(k, dev, tensors):
    """k with its arrays as device tensors when `tensors`, else as they
    are (lists and arrays are accepted too)."""
    if isinstance(k, tuple):
        return tuple(as_dispatch(e, dev, tensors) for e in k)
    if tensors and isinstance(k, (list, np.ndarray)):
        return dev.tensor(np.asarray(k))
    return k


@pytest.mark.parametrize("tensors", [False, True], ids=["arrays", "tensors"])
def test_getitem_as_torch(dev, tensors):
    x, t = dev.tensor(A), torch.from_numpy(A)
    for k in keys():
        got = x[as_dispatch(k, dev, tensors)]
        same(got, A[k])  # numpy: torch takes no negative step
        if torch and not negative_step(k) and not (isinstance(k, tuple) and
                                          k[0] is M2):
            # (torch refuses a 2-d mask followed by a slice; numpy and
            # dispatch index the dim after the mask's dims)
            same(got, t[as_torch(k)])
    i = dev.tensor(I64)
    same(i[::-1, 1], I64[::-1, 1])
    same(i[i > 0], I64[I64 > 0])


def test_getitem_errors(dev):
    x = dev.tensor(A)
    with pytest.raises(IndexError):
        x[3]
    with pytest.raises(IndexError):
        x[0, 0, 0, 0]
    with pytest.raises(IndexError):
        x[..., ...]
    with pytest.raises(IndexError):
        x[[0], [1]]  # two tensor indices
    with pytest.raises(IndexError):
        x[dev.tensor(np.ones((2, 2), bool))]  # a mask of the wrong shape
    with pytest.raises(dispatch.EINDEX):
        x[[3]].numpy()
    with pytest.raises(IndexError):
        x[dev.tensor(np.array([1.0]))]


def test_getitem_gradients(dev):
    pytest.importorskip("torch")
    w = dev.tensor(A, requires_grad=True)
    tw = torch.from_numpy(A).requires_grad_()
    m = A > 3
    loss = (w[::-1, 1:, None, ::-2] ** 2).sum() + w[[2, 0, 2]].sum() \
        + (w[dev.tensor(m)] * 3).sum()
    tl = (tw.flip(0)[:, 1:, None].flip(-1)[..., ::2] ** 2).sum() \
        + tw[[2, 0, 2]].sum() + (tw[torch.from_numpy(m)] * 3).sum()
    tl.backward()
    same(loss.backward()[w], tw.grad)


def assign_cases():
    return [
        (1, 7.0), (-1, np.float32(-2)), ((0, 2), np.arange(5, dtype=np.float32)),
        ((slice(None), slice(None, None, -2)), 5.0),
        ((slice(None), slice(None, None, -2), 1),
         np.array([1.0, 2.0], np.float32)),
        ((Ellipsis, 0), np.arange(4, dtype=np.float32)),
        ((None, 1, slice(1, 3)), np.ones((1, 2, 1), np.float32)),
        (slice(None), 0.5), ((slice(4, 1),), 3.0), ((1, 2, 3), -9.0),
        (A > 10, 0.0), (A > 10, np.float32([4.0])),
        (A[:, :, 0] > -5, np.arange(5, dtype=np.float32)),
        (A[:, :, 0] > 20, np.arange(5 * int((A[:, :, 0] > 20).sum()),
                                    dtype=np.float32).reshape(-1, 5)),
        (A > 0, np.arange(int((A > 0).sum()), dtype=np.float32)),
        ([2, 0], 1.5), ([-1, 0], np.arange(5, dtype=np.float32)),
        (np.array([1]), np.ones((1, 4, 5), np.float32)),
    ]


@pytest.mark.parametrize("tensor_value", [False, True], ids=["py", "tensor"])
def test_setitem_as_torch(dev, tensor_value):
    for k, v in assign_cases():
        x, a = dev.tensor(A), A.copy()
        before = x
        dv = v
        if tensor_value and isinstance(v, (np.ndarray, np.generic)):
            dv = dev.tensor(v)
        x[as_dispatch(k, dev, True)] = dv
        a[k] = v  # numpy's assignment: torch's where both have the key
        assert x is before
        same(x, a)
        if torch and not negative_step(k):
            t = torch.from_numpy(A.copy())
            t[as_torch(k)] = torch.from_numpy(np.asarray(v, np.float32))
            same(x, t)
    i = dev.tensor(I64)
    ti = I64.copy()
    i[i < 0] = 0
    ti[ti < 0] = 0
    i[:, 1] = dev.tensor(np.array([7.9, -1.5, 2.0]))  # cast to int64
    ti[:, 1] = np.array([7.9, -1.5, 2.0]).astype(np.int64)
    same(i, ti)
    b = dev.tensor(I64 > 0)
    b[0] = True
    tb = I64 > 0
    tb[0] = True
    same(b, tb)


def test_setitem_rules(dev):
    x = dev.tensor(A)
    y = x.inner  # another Tensor object on the old values
    x[0] = 1.0
    assert np.array_equal(y.numpy(), A)  # dispatch has no views
    w = dev.tensor(A, requires_grad=True)
    with pytest.raises(dispatch.EINVAL, match="leaf"):
        w[0] = 0.0
    with dispatch.no_grad():
        w[0] = 0.0  # as torch's initialisations: still a tracked leaf
    assert w.requires_grad and w.is_leaf and w.numpy()[0].sum() == 0
    assert np.array_equal(w.numpy()[1:], A[1:])
    g = (w * 2).sum().backward()
    assert np.array_equal(g[w].numpy(), np.full(A.shape, 2, np.float32))
    with pytest.raises(IndexError):
        x[0, [1]] = 0.0  # a tensor index in a tuple
    with pytest.raises(ValueError):
        x[0] = np.ones(3, np.float32)  # does not broadcast to [4, 5]


def test_setitem_gradients_as_torch(dev):
    pytest.importorskip("torch")
    a = dev.tensor(A, requires_grad=True)
    v = dev.tensor(np.arange(4, dtype=np.float32), requires_grad=True)
    y = a * 1.0
    y[1, :, ::-2] = (v * 2)[:, None]
    y[y > 20] = 0.0
    loss = (y * y).sum()
    ta = torch.from_numpy(A).requires_grad_()
    tv = torch.arange(4, dtype=torch.float32).requires_grad_()
    ty = ta * 1.0
    ty[1, :, ::2] = (tv * 2)[:, None]  # torch slices take no negative step
    ty[ty > 20] = 0.0
    (ty * ty).sum().backward()
    g = loss.backward()
    same(g[a], ta.grad)
    same(g[v], tv.grad)


def test_indexing_reads_only_the_mask(remote, monkeypatch):
    x = remote.tensor(np.ones((64, 64), np.float32))
    m = remote.tensor(np.eye(64, dtype=bool))
    reads = []
    numpy = dispatch.Tensor.numpy

    def counted(t):
        reads.append((t.dtype, t.shape))
        return numpy(t)
    monkeypatch.setattr(dispatch.Tensor, "numpy", counted)
    s = x[::-1, None, 2:][m[:, 2:].sum(1) >= 0]
    x[m] = 2.0
    x[3:9, ::-3] = remote.tensor(np.float32(5))
    x[[1, 2]] = remote.tensor(np.full((2, 64), 7, np.float32))
    assert reads == [(np.dtype(bool), (64,))]  # the getitem's mask only
    monkeypatch.undo()
    want = np.ones((64, 64), np.float32)
    ref = want[::-1, None, 2:].copy()
    want[np.eye(64, dtype=bool)] = 2
    want[3:9, ::-3] = 5
    want[[1, 2]] = 7
    assert np.array_equal(s.numpy(), ref) and np.array_equal(x.numpy(), want)


def test_assignment_in_a_captured_step(dev):
    # basic keys are ops on the device (arange, comparisons, where), so a
    # captured step holds them: its replay matches running it again
    def step(xt):
        y = xt * 2.0
        y[1:, ::-2] = 0.5
        y[0, 1] = xt[2, 1, ::-1]
        y[..., 3] = y[..., 4] + 1.0
        return y
    with dev.capture() as g:
        g.output(step(dev.tensor(A)))
    b = A + 1.0
    got = g.replay(b)[0]
    want = step(dev.tensor(b)).numpy()
    assert got.tobytes() == want.tobytes()
    ref = b * 2
    ref[1:, ::-2] = 0.5
    ref[0, 1] = b[2, 1, ::-1]
    ref[..., 3] = ref[..., 4] + 1
    assert np.array_equal(got, ref)


def test_local_and_remote_agree_bit_for_bit(local, remote):
    def run(d):
        x = d.tensor(A)
        outs = [x[k] for k in keys()[:16]]
        x[A > 0] = d.tensor(np.arange(int((A > 0).sum()), dtype=np.float32))
        x[:, ::-2] = 0.25
        outs.append(x)
        w = d.tensor(A, requires_grad=True)
        outs.append((w[[2, 0, 2], ::-1] ** 2).sum().backward()[w])
        return [o.numpy() for o in outs]
    for a, b in zip(run(local), run(remote)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
