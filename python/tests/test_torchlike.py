"""Tensors that behave like torch's (issue 26 item 5): grad mode, the
reductions' dtypes, division / floor division / remainder / powers, max
and min with a dim, shape methods, creation with *size, seeded random
tensors, .to(), the size()/dim() accessors and repr. Each result is
compared with torch 1.13 (or numpy) on the device kind of `dev`, and the
*_agree tests check LOCAL == REMOTE bit for bit."""
import numpy as np
import pytest

import dispatch

torch = pytest.importorskip("torch")

I = np.array([-7, 7, -3, 5, 0, -6, 9, -1], np.int64)
J = np.array([2, -2, 3, -4, 5, 4, -3, 7], np.int64)
F = np.array([-7.5, 7.25, -3.0, 5.5, 0.0, -6.75, 9.0, -1.5], np.float32)
G = np.array([2.0, -2.0, 0.5, -4.0, 3.0, 4.0, -3.5, 7.0], np.float32)


def T(a):
    return torch.from_numpy(np.array(a))


def same(got, want):
    """got (a dispatch tensor) equals want (a torch tensor): dtype, shape
    and values (NaN where NaN)."""
    want = want.numpy() if hasattr(want, "numpy") else np.asarray(want)
    g = got.numpy()
    assert g.dtype == want.dtype, (g.dtype, want.dtype)
    assert g.shape == want.shape, (g.shape, want.shape)
    assert np.array_equal(g, want, equal_nan=g.dtype.kind == "f"), (g, want)


# ---------------------------------------------------------------- grad mode

def test_no_grad_results_are_plain_and_backward_still_works(dev):
    w = dev.tensor(F, requires_grad=True)
    assert w.requires_grad and w.is_leaf and dispatch.is_grad_enabled()
    with dispatch.no_grad():
        assert not dispatch.is_grad_enabled()
        y = w * 2 + 1
        assert not y.requires_grad and y.kind == dev.kind
        with dispatch.no_grad():  # nesting
            assert not (w * w).requires_grad
        assert not dispatch.is_grad_enabled()
        with dispatch.enable_grad():
            assert (w * 3).requires_grad
        assert not (w.sum()).requires_grad
    assert dispatch.is_grad_enabled()
    loss = (w * w).sum()
    assert loss.requires_grad and not loss.is_leaf
    # backward inside no_grad (a graph built outside) works, as in torch
    with dispatch.no_grad():
        g = loss.backward()[w]
    assert np.array_equal(g.numpy(), 2 * F)
    # optimizers are made and step inside no_grad too
    with dispatch.no_grad():
        opt = dispatch.SGD([w], lr=0.5)
        loss = (w * w).sum()
    with dispatch.enable_grad():
        loss = (w * w).sum()
    with dispatch.no_grad():
        opt.step(loss.backward())
    assert np.array_equal(w.numpy(), F - np.float32(0.5) * 2 * F)
    # the values computed inside no_grad are the same as outside
    with dispatch.no_grad():
        assert np.array_equal((w * 2 + 1).numpy(), (w * 2 + 1).numpy())


def test_no_grad_as_decorator_and_set_grad_enabled(dev):
    w = dev.tensor(F, requires_grad=True)

    @dispatch.no_grad()
    def f(t):
        return t * t

    @dispatch.no_grad
    def g(t):
        return t + 1

    assert not f(w).requires_grad and not g(w).requires_grad
    assert f.__name__ == "f" and dispatch.is_grad_enabled()
    prev = dispatch.set_grad_enabled(False)
    try:
        assert not dispatch.is_grad_enabled() and not (w * 1).requires_grad
    finally:
        dispatch.set_grad_enabled(True)
    assert prev is not None and dispatch.is_grad_enabled()
    with dispatch.set_grad_enabled(False):
        assert not (w * 1).requires_grad
    assert dispatch.is_grad_enabled()
    # an exception inside still restores the mode
    with pytest.raises(ZeroDivisionError):
        with dispatch.no_grad():
            1 / 0
    assert dispatch.is_grad_enabled()


def test_grad_mode_is_per_thread():
    import threading
    seen = []
    with dispatch.no_grad():
        t = threading.Thread(target=lambda: seen.append(
            dispatch.is_grad_enabled()))
        t.start()
        t.join()
        assert not dispatch.is_grad_enabled()
    assert seen == [True]


def test_requires_grad_in_place(dev):
    x = dev.tensor(F)
    assert not x.requires_grad and x.is_leaf and x.grad is None
    assert x.requires_grad_() is x and x.requires_grad and x.is_leaf
    (x * x).sum().backward()
    assert np.array_equal(x.grad.numpy(), 2 * F)
    x.requires_grad = False
    assert not x.requires_grad and np.array_equal(x.numpy(), F)
    y = dev.tensor(F, requires_grad=True) * 2
    with pytest.raises(dispatch.EINVAL, match="leaf"):
        y.requires_grad_(False)
    with pytest.raises(dispatch.EDTYPE):
        dev.tensor(I).requires_grad_()
    z = dispatch.zeros(2, 3, device=dev, requires_grad=True)
    assert z.requires_grad and z.is_leaf and z.shape == (2, 3)


# ---------------------------------------------------------------- reductions

def test_sum_mean_dtypes_as_torch(dev):
    pred, y = dev.tensor(I % 3), dev.tensor(J % 3)
    got = (pred == y).sum()
    want = (T(I) % 3 == T(J) % 3).sum()
    same(got, want)
    b = dev.tensor(I > 0)
    same(b.sum(), T(I > 0).sum())
    same(b.sum(0, keepdim=True), T(I > 0).sum(0, keepdim=True))
    same(dev.tensor(I).sum(), T(I).sum())
    same(dev.tensor(F).sum(dtype=dispatch.float64),
         T(F).sum(dtype=torch.float64))
    same(dev.tensor(I).mean(dtype=dispatch.float32),
         T(I).mean(dtype=torch.float32))
    for bad in (I, I > 0):
        with pytest.raises(dispatch.EDTYPE, match="mean"):
            dev.tensor(bad).mean()
        with pytest.raises(RuntimeError):
            T(bad).mean()  # torch refuses it too


def test_any_all_as_torch(dev):
    for a in (I > 0, I, F, np.zeros((0, 3), np.float32),
              np.array([[True, True], [False, True]])):
        x, t = dev.tensor(a), T(a)
        for name in ("any", "all"):
            same(getattr(x, name)(), getattr(t, name)())
            if a.ndim == 2:
                for d in (0, 1):
                    same(getattr(dispatch, name)(x, d, True),
                         getattr(torch, name)(t, d, keepdim=True))


def test_max_min_with_dim_named_tuple(dev):
    a = np.array([[3.0, -1.0, 7.0], [2.0, 9.0, -4.0]], np.float32)
    for name in ("max", "min"):
        for dim, keep in ((0, False), (1, False), (1, True), (-1, True)):
            got = getattr(dev.tensor(a), name)(dim, keepdim=keep)
            want = getattr(T(a), name)(dim, keepdim=keep)
            vals, idx = got  # unpacks as (values, indices)
            same(vals, want.values)
            same(idx, want.indices)
            same(got.values, want[0])
            same(getattr(dispatch, name)(dev.tensor(a), dim, keep).indices,
                 want.indices)
        same(getattr(dev.tensor(a), name)(), getattr(T(a), name)())
        same(getattr(dev.tensor(a), "arg" + name)(),
             getattr(T(a), "arg" + name)())
        same(getattr(dev.tensor(a), "arg" + name)(1, keepdim=True),
             getattr(T(a), "arg" + name)(1, keepdim=True))
    same(dev.tensor(a).max((0, 1)), torch.amax(T(a), (0, 1)))
    same(dev.tensor(a).min([1], keepdim=True), torch.amin(T(a), [1], True))
    b = np.array([[True, False], [False, False]])
    same(dev.tensor(b).max(), T(b).max())
    same(dev.tensor(b).max(1).values, T(b).max(1).values)
    # max(other) is the elementwise maximum, as torch's
    same(dev.tensor(a).max(dev.tensor(a[::-1].copy())),
         T(a).max(T(a[::-1].copy())))


# ---------------------------------------------------------------- arithmetic

def _ops():
    return [
        ("truediv", lambda x, y: x / y),
        ("floordiv", lambda x, y: x // y),
        ("mod", lambda x, y: x % y),
        ("add", lambda x, y: x + y),
        ("sub", lambda x, y: x - y),
        ("mul", lambda x, y: x * y),
        ("lt", lambda x, y: x < y),
        ("eq", lambda x, y: x == y),
    ]


@pytest.mark.parametrize("a,b,numbers", [(I, J, (3, -3, 2.5, -2.5)),
                                          (F, G, (2, -2, 0.5, -4.0))],
                         ids=["int64", "float32"])
@pytest.mark.parametrize("name,op", _ops(), ids=[n for n, _ in _ops()])
def test_operators_as_torch(dev, name, op, a, b, numbers):
    x, y = dev.tensor(a), dev.tensor(b)
    same(op(x, y), op(T(a), T(b)))
    for s in numbers:
        same(op(x, s), op(T(a), s))
        # torch's s / t is t.reciprocal() * s (off by an ulp at times): the
        # reference is torch's division of a 0-d tensor, which rounds once
        same(op(s, y), op(torch.tensor(s), T(b)))


def test_mixed_dtype_promotion_as_torch(dev):
    f64 = F.astype(np.float64)
    b = I > 0
    pairs = [(I, F), (F, f64), (b, I), (b, F), (I, f64)]
    for a, c in pairs:
        for op in (lambda x, y: x + y, lambda x, y: x * y,
                   lambda x, y: x / y, lambda x, y: x > y):
            same(op(dev.tensor(a), dev.tensor(c)), op(T(a), T(c)))
            same(op(dev.tensor(c), dev.tensor(a)), op(T(c), T(a)))
    # a 0-d tensor of a higher category sets the dtype; of the same, not
    same(dev.tensor(I) + dev.tensor(np.float64(1.5)),
         T(I) + T(np.float64(1.5)))
    same(dev.tensor(F) + dev.tensor(np.float64(1.5)),
         T(F) + T(np.float64(1.5)))
    same(dev.tensor(b) + 1, T(b) + 1)
    same(dev.tensor(b) * 1.5, T(b) * 1.5)


def test_operator_dtype_grid_as_torch(dev):
    """Every operator on every pair of bool / int64 / float32 / float64
    tensors, 0-d tensors and numbers that torch accepts: torch's dtype,
    shape and values (floats within 1e-6: s / t and ** differ in the last
    bits, see the README)."""
    vals = [np.array([True, False, True]), np.array([-7, 3, 5]),
            np.array([-2.5, 0.5, 3.0], np.float32), np.array([1.5, -3.25, 2.0])]
    operands = []
    for v in vals:
        operands.append((dev.tensor(v), T(v)))
        z = v[1:2].reshape(())
        operands.append((dev.tensor(z), T(z)))
    operands += [(n, n) for n in (2, -3, 1.5, True)]
    ops = [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b,
           lambda a, b: a / b, lambda a, b: a // b, lambda a, b: a % b,
           lambda a, b: a < b, lambda a, b: a >= b, lambda a, b: a == b,
           lambda a, b: a ** b]
    checked = 0
    for (da, ta), (db, tb) in ((p, q) for p in operands for q in operands):
        if not (isinstance(da, dispatch.Tensor) or
                isinstance(db, dispatch.Tensor)):
            continue
        for op in ops:
            try:
                want = op(ta, tb)
            except RuntimeError:
                continue  # torch refuses it (bool - bool, int ** -1)
            got = op(da, db).numpy()
            w = want.numpy()
            assert got.dtype == w.dtype and got.shape == w.shape
            if w.dtype.kind == "f":
                np.testing.assert_allclose(got, w, rtol=1e-6)
            else:
                assert np.array_equal(got, w), (got, w)
            checked += 1
    assert checked > 1000


def test_floor_division_and_remainder_signs(dev):
    # torch's rules: // rounds toward -inf and % takes the divisor's sign
    # (C's / and % truncate and take the dividend's sign)
    x, y = dev.tensor(I), dev.tensor(J)
    assert (x // y).tolist() == [a // b for a, b in zip(I.tolist(), J.tolist())]
    assert (x % y).tolist() == [a % b for a, b in zip(I.tolist(), J.tolist())]
    assert (dev.tensor([-7]) % 2).tolist() == [1]
    assert (dev.tensor([7]) % -2).tolist() == [-1]
    assert (dev.tensor([-7.5]) % 2.0).tolist() == [0.5]
    assert (dev.tensor([-7.5]) // 2.0).tolist() == [-4.0]
    with pytest.raises(dispatch.EINVAL):
        (x // dev.tensor(np.zeros(8, np.int64))).numpy()
    z = np.array([1.0, -1.0, 0.0, np.inf, np.nan, 1e30], np.float32)
    same(dev.tensor(z) // 0.0, T(z) // 0.0)
    same(dev.tensor(z) // 3.0, T(z) // 3.0)
    same(dev.tensor(z) % 3.0, T(z) % 3.0)


def test_remainder_gradient_as_torch(dev):
    a = dev.tensor(F, requires_grad=True)
    b = dev.tensor(G, requires_grad=True)
    grads = (a % b).sum().backward()
    ta, tb = T(F).requires_grad_(), T(G).requires_grad_()
    (ta % tb).sum().backward()
    same(grads[a], ta.grad)
    same(grads[b], tb.grad)
    assert not (a // b).requires_grad


def test_powers_as_torch(dev):
    x = np.array([2.0, 3.0, 0.5, -2.0, -2.0, 0.0, 0.0, 4.0], np.float32)
    e = np.array([3.0, -2.0, 2.5, 3.0, 2.0, 0.0, 2.0, 0.5], np.float32)
    want = T(x) ** T(e)
    got = dev.tensor(x) ** dev.tensor(e)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert np.isnan((dev.tensor([-2.0]) ** dev.tensor([0.5])).item())
    same(dev.tensor(x) ** 2, T(x) ** 2)
    np.testing.assert_allclose((2.0 ** dev.tensor(e)).numpy(),
                               (2.0 ** T(e)).numpy(), rtol=1e-6)
    same(dev.tensor(I) ** 2, T(I) ** 2)
    same(dev.tensor(np.abs(I)) ** dev.tensor(np.abs(J)),
         T(np.abs(I)) ** T(np.abs(J)))
    with pytest.raises(dispatch.EINVAL, match="negative"):
        dev.tensor(I) ** -1
    # the gradient of a ** b for a positive base
    a = dev.tensor(x[:3], requires_grad=True)
    b = dev.tensor(e[:3], requires_grad=True)
    grads = (a ** b).sum().backward()
    ta, tb = T(x[:3]).requires_grad_(), T(e[:3]).requires_grad_()
    (ta ** tb).sum().backward()
    np.testing.assert_allclose(grads[a].numpy(), ta.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(grads[b].numpy(), tb.grad.numpy(), rtol=1e-5)


def test_bool_logic(dev):
    p, q = I > 0, J > 0
    same(~dev.tensor(p), ~T(p))
    same(dev.tensor(p) & dev.tensor(q), T(p) & T(q))
    same(dev.tensor(p) | dev.tensor(q), T(p) | T(q))
    same(dev.tensor(p) ^ dev.tensor(q), T(p) ^ T(q))
    with pytest.raises(dispatch.EDTYPE):
        ~dev.tensor(I)


# ---------------------------------------------------------------- shapes

def test_shape_methods_as_torch(dev):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x, t = dev.tensor(a), T(a)
    same(x.view(6, 4), t.view(6, 4))
    same(x.view(-1), t.view(-1))
    same(x.reshape((4, 6)), t.reshape((4, 6)))
    for args in ((), (1,), (0, 1), (-2, -1)):
        same(x.flatten(*args), t.flatten(*args))
    for d in (0, 1, 3, -1, -4):
        same(x.unsqueeze(d), t.unsqueeze(d))
    y = dev.tensor(a.reshape(2, 1, 12, 1))
    ty = T(a.reshape(2, 1, 12, 1))
    for d in (None, 1, 0, -1):
        same(y.squeeze(d) if d is not None else y.squeeze(),
             ty.squeeze(d) if d is not None else ty.squeeze())
    same(x.permute(2, 0, 1), t.permute(2, 0, 1))
    same(x.transpose(0, 2), t.transpose(0, 2))
    same(x[0].T, t[0].T)
    same(dev.tensor(a[:, :1]).expand(2, 3, 4), T(a[:, :1]).expand(2, 3, 4))
    same(dev.tensor(a[:, :1]).expand(-1, 5, -1), T(a[:, :1]).expand(-1, 5, -1))
    with pytest.raises(IndexError):
        x.unsqueeze(4)
    assert x.size() == (2, 3, 4) and x.size(1) == 3 and x.size(-1) == 4
    assert x.size == 24 and x.numel() == 24  # numpy's size still an int
    assert x.dim() == 3 and x.ndim == 3 and len(x) == 2
    assert x.dtype == dispatch.float32 and x.shape == (2, 3, 4)


def test_creation_with_sizes(dev):
    for fn in ("zeros", "ones", "empty"):
        for args in ((3, 4), ((3, 4),), ([3, 4],)):
            t = getattr(dispatch, fn)(*args, device=dev)
            assert t.shape == (3, 4) and t.dtype == np.float32
        t = getattr(dev, fn)(2, dtype=dispatch.int64)
        assert t.shape == (2,) and t.dtype == np.int64
    assert dev.zeros((2, 2), dispatch.int64).dtype == np.int64  # old form
    assert dispatch.zeros(device=dev).shape == ()
    same(dispatch.full((2, 3), 7, dtype=dispatch.int64, device=dev),
         torch.full((2, 3), 7, dtype=torch.int64))
    same(dispatch.arange(5, device=dev), torch.arange(5))
    same(dispatch.arange(1, 2, 0.25, device=dev), torch.arange(1, 2, 0.25))
    with pytest.raises(TypeError):
        dispatch.zeros(2, 2.5, device=dev)


def test_random_tensors(dev):
    dispatch.manual_seed(5)
    a = dispatch.randn(3, 4, device=dev)
    b = dispatch.randn(3, 4, device=dev)
    dispatch.manual_seed(5)
    a2 = dispatch.randn(3, 4, device=dev)
    assert a.shape == (3, 4) and a.dtype == np.float32
    assert np.array_equal(a.numpy(), a2.numpy())
    assert not np.array_equal(a.numpy(), b.numpy())  # the stream moves on
    r = dispatch.rand((1000,), device=dev, seed=3).numpy()
    assert r.min() >= 0 and r.max() < 1 and 0.4 < r.mean() < 0.6
    assert np.array_equal(r, dev.rand(1000, seed=3).numpy())
    n = dev.randn(4000, seed=1, dtype=dispatch.float64).numpy()
    assert n.dtype == np.float64 and abs(n.mean()) < 0.1 and \
        0.9 < n.std() < 1.1
    i = dispatch.randint(-3, 4, (2000,), device=dev, seed=2)
    assert i.dtype == np.int64 and i.shape == (2000,)
    assert set(i.numpy().tolist()) == set(range(-3, 4))
    j = dispatch.randint(10, (50,), device=dev)
    assert j.numpy().min() >= 0 and j.numpy().max() < 10
    assert dispatch.randn(2, device=dev, requires_grad=True).is_leaf


def test_to_numpy_item_tolist(dev, local):
    x = dev.tensor(F)
    assert x.to(dev) is x and x.to(dispatch.float32) is x
    h = x.to("local")
    assert h.device.kind == "local" and np.array_equal(h.numpy(), F)
    assert x.cpu().device is h.device
    assert x.to(dev.spec).device is dev
    d = x.to(dispatch.float64)
    assert d.dtype == np.float64 and d.device is dev
    same(x.to(local, "int64"), T(F).to(torch.int64))
    same(x.to(dev.tensor(I)), T(F).to(torch.int64))
    same(x.long(), T(F).long())
    same(dev.tensor(I).float(), T(I).float())
    same(dev.tensor(I).double(), T(I).double())
    same(dev.tensor(I).bool(), T(I).bool())
    assert dev.tensor([[1.5]]).item() == 1.5
    assert [10, 11, 12][dev.tensor(2)] == 12 and list(range(dev.tensor([3]))) \
        == [0, 1, 2]
    with pytest.raises(TypeError):
        [1][dev.tensor(0.0)]
    assert dev.tensor(I).tolist() == I.tolist()
    assert [t.item() for t in dev.tensor(I)] == I.tolist()
    with pytest.raises(TypeError):
        iter(dev.tensor(3.0))


def test_repr_shows_values_dtype_device_grad(dev):
    x = dev.tensor([[1.0, 2.5], [3.0, 4.0]], requires_grad=True)
    r = repr(x)
    assert r.startswith("tensor([[1. , 2.5],\n        [3. , 4. ]]"), r
    assert f"device='{dev.spec}'" in r and "dtype=dispatch.float32" in r
    assert r.endswith("requires_grad=True)")
    r = repr(dev.tensor(I))
    assert "[-7,  7, -3" in r and "dtype=dispatch.int64" in r
    assert "requires_grad" not in r
    big = repr(dev.arange(5000))
    assert "..." in big and len(big) < 400
    assert repr(dev.tensor(np.bool_(True))).startswith("tensor(True,")


def test_local_and_remote_agree_bit_for_bit(local, remote):
    def run(d):
        x, y = d.tensor(F), d.tensor(G)
        i, j = d.tensor(I), d.tensor(J)
        w = d.tensor(F[:3], requires_grad=True)
        e = d.tensor(G[:3])
        outs = [x / y, x // y, x % y, i / j, i // j, i % j, 7 // j,
                7.5 % y, x ** y, 2.0 ** y, i ** 3, (i == j).sum(),
                x.max(0).indices, x.min(0).values, i.sum(),
                x.mean(), d.randn(3, 4, seed=9), d.rand(5, seed=2),
                d.randint(-5, 5, (7,), seed=4), x.unsqueeze(0).flatten(),
                (d.tensor(I > 0) & d.tensor(J > 0))]
        g = ((w.abs() + 1.0) ** e).sum().backward()
        outs.append(g[w])
        with dispatch.no_grad():
            outs.append(w * 3)
        return [o.numpy() for o in outs]
    for a, b in zip(run(local), run(remote)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
