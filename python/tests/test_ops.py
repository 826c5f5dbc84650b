"""Ops through the binding: LOCAL and REMOTE agree bit for bit (the same
kernels run in this process and in the server), and both agree with numpy:
exactly where IEEE arithmetic fixes the result (elementwise + - * /, max,
comparisons, data movement), within rounding where the order of a
reduction or a libm function may differ."""
import numpy as np
import pytest

import dispatch

rng = np.random.default_rng(1234)
A32 = rng.standard_normal((3, 4)).astype(np.float32)
B32 = rng.standard_normal((3, 4)).astype(np.float32)
R32 = rng.standard_normal((4,)).astype(np.float32)  # broadcasts over rows
M32 = rng.standard_normal((4, 5)).astype(np.float32)
A64 = A32.astype(np.float64) * 1.5
I64 = rng.integers(-50, 50, (3, 4))
POS = np.abs(A32) + 0.5

# (name, function over dispatch tensors built from the inputs, numpy
#  reference, inputs, exact against numpy?)
CASES = [
    ("add", lambda a, b: a + b, lambda a, b: a + b, (A32, B32), True),
    ("add_bcast", lambda a, b: a + b, lambda a, b: a + b, (A32, R32), True),
    ("sub", lambda a, b: a - b, lambda a, b: a - b, (A32, B32), True),
    ("mul", lambda a, b: a * b, lambda a, b: a * b, (A32, B32), True),
    ("div", lambda a, b: a / b, lambda a, b: a / b, (A32, B32), True),
    ("f64_mul", lambda a, b: a * b, lambda a, b: a * b, (A64, A64), True),
    ("i64_add", lambda a, b: a + b, lambda a, b: a + b, (I64, I64), True),
    ("scalar_ops", lambda a: (a + 2) * 3 - 1, lambda a: (a + np.float32(2))
     * np.float32(3) - np.float32(1), (A32,), True),
    ("rsub_rdiv", lambda a: (1 - a) + (2 / a), lambda a: (np.float32(1) - a)
     + (np.float32(2) / a), (A32,), True),
    ("neg", lambda a: -a, lambda a: -a, (A32,), True),
    ("abs", lambda a: abs(a), np.abs, (A32,), True),
    ("relu", lambda a: a.relu(), lambda a: np.maximum(a, 0), (A32,), True),
    ("sqrt", lambda a: a.sqrt(), np.sqrt, (POS,), True),
    ("maximum", dispatch.maximum, np.maximum, (A32, B32), True),
    ("minimum", dispatch.minimum, np.minimum, (A32, B32), True),
    ("eq", lambda a, b: a == b, lambda a, b: a == b, (A32, A32), True),
    ("lt", lambda a, b: a < b, lambda a, b: a < b, (A32, B32), True),
    ("ge", lambda a, b: a >= b, lambda a, b: a >= b, (A32, B32), True),
    ("where", lambda a, b: dispatch.where(a > b, a, b),
     lambda a, b: np.where(a > b, a, b), (A32, B32), True),
    ("max", lambda a: a.max(1), lambda a: a.max(1), (A32,), True),
    ("argmax", lambda a: a.argmax(1), lambda a: a.argmax(1), (A32,), True),
    ("reshape", lambda a: a.reshape(6, -1), lambda a: a.reshape(6, -1),
     (A32,), True),
    ("T", lambda a: a.T, lambda a: a.T, (A32,), True),
    ("getitem", lambda a: a[1:, ::2], lambda a: a[1:, ::2], (A32,), True),
    ("getitem_int", lambda a: a[-1], lambda a: a[-1], (A32,), True),
    ("cat", lambda a, b: dispatch.cat([a, b], 1),
     lambda a, b: np.concatenate([a, b], 1), (A32, B32), True),
    ("stack", lambda a, b: dispatch.stack([a, b]), lambda a, b: np.stack(
        [a, b]), (A32, B32), True),
    ("index_select", lambda a: a[[2, 0, 2]], lambda a: a[[2, 0, 2]],
     (A32,), True),
    ("cast", lambda a: a.astype(np.float64), lambda a: a.astype(np.float64),
     (A32,), True),
    ("matmul", lambda a, m: a @ m, lambda a, m: a @ m, (A32, M32), False),
    ("sum", lambda a: a.sum(), lambda a: a.sum(), (A32,), False),
    ("sum_dim", lambda a: a.sum(0, keepdim=True),
     lambda a: a.sum(0, keepdims=True), (A32,), False),
    ("mean", lambda a: a.mean(1), lambda a: a.mean(1), (A32,), False),
    ("exp", lambda a: a.exp(), np.exp, (A32,), False),
    ("log", lambda a: a.log(), np.log, (POS,), False),
    ("tanh", lambda a: a.tanh(), np.tanh, (A32,), False),
    ("silu", lambda a: a.silu(), lambda a: a / (1 + np.exp(-a)),
     (A32,), False),
    ("silu_fn", dispatch.silu, lambda a: a * (1 / (1 + np.exp(-a))),
     (A32,), False),
    ("sigmoid", lambda a: a.sigmoid(), lambda a: 1 / (1 + np.exp(-a)),
     (A32,), False),
    ("pow", lambda a: a ** 3, lambda a: a ** 3, (A32,), False),
    ("softmax", lambda a: a.softmax(1),
     lambda a: np.exp(a) / np.exp(a).sum(1, keepdims=True), (A32,), False),
    ("log_softmax", lambda a: a.log_softmax(1),
     lambda a: a - np.log(np.exp(a).sum(1, keepdims=True)), (A32,), False),
    ("mse", dispatch.mse, lambda a, b: ((a - b) ** 2).mean(), (A32, B32),
     False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_local_remote_numpy_agree(local, remote, case):
    name, fn, ref, inputs, exact = case
    got_l = fn(*[local.tensor(x) for x in inputs]).numpy()
    got_r = fn(*[remote.tensor(x) for x in inputs]).numpy()
    want = np.asarray(ref(*inputs))
    assert got_l.dtype == got_r.dtype == want.dtype, name
    assert got_l.shape == want.shape, name
    # the same kernels on both sides: bit for bit
    assert np.array_equal(got_l, got_r), name
    if exact:
        assert np.array_equal(got_l, want), name
    else:
        np.testing.assert_allclose(got_l, want, rtol=2e-6, atol=1e-6,
                                   err_msg=name)


def test_cross_entropy_and_creation_agree(local, remote):
    labels = np.array([0, 3, 1])
    outs = []
    for d in (local, remote):
        logits = d.tensor(A32)
        ce = dispatch.cross_entropy(logits, labels).numpy()
        u = d.uniform((2, 3), -1, 1, seed=7).numpy()
        n = d.normal((5,), 0, 2, seed=9, dtype=np.float64).numpy()
        ar = d.arange(0, 5, 0.5).numpy()
        fl = d.full((2,), 3.5).numpy()
        outs.append((ce, u, n, ar, fl))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
    ce, u, n, ar, fl = outs[0]
    lse = np.log(np.exp(A32).sum(1))
    want = np.mean(lse - A32[np.arange(3), labels])
    np.testing.assert_allclose(ce, want, rtol=1e-6)
    assert u.shape == (2, 3) and (u >= -1).all() and (u < 1).all()
    assert n.dtype == np.float64 and n.shape == (5,)
    assert np.array_equal(ar, np.arange(0, 5, 0.5, dtype=np.float32))
    assert np.array_equal(fl, np.full((2,), 3.5, np.float32))


def test_conv_pool_agree(local, remote):
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    outs = []
    for d in (local, remote):
        y = dispatch.conv2d(d.tensor(x), d.tensor(w), padding=1).relu()
        outs.append((dispatch.max_pool2d(y, 2).numpy(),
                     dispatch.avg_pool2d(y, 2).numpy()))
    assert np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[0][1], outs[1][1])
    # numpy reference of the convolution (pad 1, stride 1), then the pools
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((2, 4, 8, 8), np.float64)
    for i in range(3):
        for j in range(3):
            ref += np.einsum("nchw,oc->nohw", xp[:, :, i:i + 8, j:j + 8],
                             w[:, :, i, j])
    ref = np.maximum(ref, 0).reshape(2, 4, 4, 2, 4, 2)
    np.testing.assert_allclose(outs[0][0], ref.max((3, 5)), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(outs[0][1], ref.mean((3, 5)), rtol=1e-5,
                               atol=1e-5)


def test_numpy_operands_and_dtypes(dev):
    x = dev.tensor(A32)
    # an ndarray on the left goes through our reflected operator
    got = (np.ones((3, 4), np.float32) + x).numpy()
    assert np.array_equal(got, A32 + 1)
    assert x.shape == (3, 4) and x.ndim == 2 and x.size == 12 and len(x) == 3
    assert x.dtype == np.float32 and x.kind == dev.kind
    assert dev.tensor([1.5, 2]).dtype == np.float32  # Python floats
    assert dev.tensor([1, 2]).dtype == np.int64
    b = dev.tensor(np.array([True, False]))
    assert np.array_equal(b.numpy(), [True, False])
    # lists and numbers take the tensor's dtype; arrays keep theirs
    assert (x + [1, 2, 3, 4]).dtype == np.float32
    assert np.array_equal((x * [1, 2, 3, 4]).numpy(),
                          A32 * np.array([1, 2, 3, 4], np.float32))
    with pytest.raises(dispatch.EDTYPE, match="f32 and f64 differ"):
        x + np.ones(4)
    assert (x == None) is False and (x != None) is True  # noqa: E711
    z = dev.tensor(np.float64(2.5))  # 0-d
    assert z.shape == () and z.item() == 2.5 and float(z) == 2.5
    with pytest.raises(TypeError, match="not supported"):
        dev.tensor(np.zeros(3, np.int32))
    assert np.array_equal(dev.tensor(np.arange(3, dtype=np.int32),
                                     dtype="int64").numpy(), [0, 1, 2])


def test_slices_past_the_end_and_empty(dev):
    # numpy's answers, written out: a start past the end gives 0 elements
    x = dev.tensor(np.arange(10, dtype=np.float32))
    for key, want in [(np.s_[100:200], []), (np.s_[10:20], []),
                      (np.s_[3:3], []), (np.s_[5:2], []),
                      (np.s_[-100:2], [0, 1]), (np.s_[8:100:3], [8]),
                      (np.s_[-1:], [9])]:
        got = x[key]
        assert got.shape == (len(want),), (key, got.shape)
        assert np.array_equal(got.numpy(), np.array(want, np.float32)), key
        # the C API with the raw (unclamped) bounds gives the same
        raw = dispatch.slice(x, 0, key.start, key.stop, key.step or 1)
        assert raw.shape == (len(want),), (key, raw.shape)


# issue 23: loss

def _ce_case():
    r = np.random.default_rng(23)
    x = r.standard_normal((3, 5, 2, 4))
    lab = r.integers(0, 5, (3, 2, 4))
    lab[0, 1, 2] = lab[2, 0, 0] = -100
    return x, lab


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_ex_matches_torch(local, remote, reduction):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x, lab = _ce_case()
    got = []
    for d in (local, remote):
        xt = d.tensor(x, requires_grad=True)
        loss = dispatch.cross_entropy(xt, lab, reduction=reduction,
                                      label_smoothing=0.1)
        g = (loss * d.tensor(np.full(loss.shape, 0.5))).sum().backward()
        got.append((loss.numpy(), g[xt].numpy()))
    assert np.array_equal(got[0][0], got[1][0])  # LOCAL == REMOTE
    assert np.array_equal(got[0][1], got[1][1])
    xt = torch.tensor(x, requires_grad=True)
    want = F.cross_entropy(xt, torch.tensor(lab), reduction=reduction,
                           label_smoothing=0.1)
    (want * 0.5).sum().backward()
    np.testing.assert_allclose(got[0][0], want.detach().numpy(), rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_allclose(got[0][1], xt.grad.numpy(), rtol=1e-10,
                               atol=1e-14)


def test_cross_entropy_ex_ignored_and_errors(dev):
    torch = pytest.importorskip("torch")
    x = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], np.float32)
    lab = np.array([2, 0])
    for ign in (0, 2, 5):
        got = dispatch.cross_entropy_ex(dev.tensor(x), lab, ignore_index=ign,
                                        reduction="mean").item()
        want = torch.nn.functional.cross_entropy(
            torch.tensor(x), torch.tensor(lab), ignore_index=ign).item()
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # every label ignored: NaN with mean, as torch
    allig = dispatch.cross_entropy_ex(dev.tensor(x), [-100, -100]).item()
    assert np.isnan(allig)
    with pytest.raises(dispatch.EINDEX):
        dispatch.cross_entropy_ex(dev.tensor(x), [2, 3]).item()
        dev.sync()
    with pytest.raises(ValueError):
        dispatch.cross_entropy_ex(dev.tensor(x), lab, reduction="avg")


# issue 23: pools

@pytest.mark.parametrize("cip", [True, False])
def test_avg_pool2d_count_include_pad_matches_torch(local, remote, cip):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((2, 3, 7, 6))
    w = np.random.default_rng(6).standard_normal((2, 3, 4, 3))
    got = []
    for d in (local, remote):
        xt = d.tensor(x, requires_grad=True)
        y = dispatch.avg_pool2d(xt, 3, stride=2, padding=1,
                                count_include_pad=cip)
        g = (y * d.tensor(w)).sum().backward()
        got.append((y.numpy(), g[xt].numpy()))
    assert np.array_equal(got[0][0], got[1][0])
    assert np.array_equal(got[0][1], got[1][1])
    xt = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.avg_pool2d(xt, 3, stride=2, padding=1,
                                          count_include_pad=cip)
    (want * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(got[0][0], want.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(got[0][1], xt.grad.numpy(), rtol=1e-12)


def test_pool_stride_defaults_to_kernel(dev):
    x = dev.tensor(np.arange(36, dtype=np.float32).reshape(1, 1, 6, 6))
    for f in (dispatch.max_pool2d, dispatch.avg_pool2d):
        a = f(x, (3, 2)).numpy()
        b = f(x, (3, 2), stride=0).numpy()
        c = f(x, (3, 2), stride=(3, 2)).numpy()
        assert a.shape == (1, 1, 2, 3)
        assert np.array_equal(a, b) and np.array_equal(a, c)
    e = dispatch.avg_pool2d_ex(x, 2, count_include_pad=False).numpy()
    assert np.array_equal(e, dispatch.avg_pool2d(x, 2).numpy())


# issue 23: conv bias

def test_conv2d_bias_matches_torch(local, remote):
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(9)
    x = r.standard_normal((2, 3, 7, 6))
    w = r.standard_normal((4, 3, 3, 2))
    b = r.standard_normal((4,))
    gup = r.standard_normal((2, 4, 4, 7))
    got = []
    for d in (local, remote):
        ts = [d.tensor(v, requires_grad=True) for v in (x, w, b)]
        y = dispatch.conv2d(ts[0], ts[1], stride=(2, 1), padding=1,
                            bias=ts[2])
        g = (y * d.tensor(gup)).sum().backward()
        got.append([y.numpy()] + [g[t].numpy() for t in ts])
    for a, c in zip(*got):
        assert np.array_equal(a, c)  # LOCAL == REMOTE
    ts = [torch.tensor(v, requires_grad=True) for v in (x, w, b)]
    want = torch.nn.functional.conv2d(ts[0], ts[1], ts[2], stride=(2, 1),
                                      padding=1)
    (want * torch.tensor(gup)).sum().backward()
    for a, c in zip(got[0], [want.detach()] + [t.grad for t in ts]):
        np.testing.assert_allclose(a, c.numpy(), rtol=1e-10, atol=1e-12)
