"""Optimizer steps against hand computations. The kernels compute each
update in double and round once to the parameter's dtype, so the same
formulas in numpy give the same bits, from the gradients the library
itself returned."""
import numpy as np
import pytest

import dispatch

rng = np.random.default_rng(3)
X = rng.standard_normal((4, 2))
P0 = rng.standard_normal((2, 3))


def loss_of(dev, x, p):
    return ((x @ p) ** 2).sum() * 0.5


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sgd_matches_hand_computation(dev, dtype):
    lr, mom, wd = 0.1, 0.9, 0.01
    x = dev.tensor(X.astype(dtype))
    p = dev.tensor(P0.astype(dtype), requires_grad=True)
    opt = dispatch.SGD([p], lr=lr, momentum=mom, weight_decay=wd)
    want_p = P0.astype(dtype)
    v = np.zeros_like(want_p)
    for _ in range(2):
        grads = loss_of(dev, x, p).backward()
        g = grads[p].numpy()
        # the gradient itself: d/dp 0.5*|xp|^2 = x^T x p
        np.testing.assert_allclose(
            g, X.T @ (X @ want_p.astype(np.float64)), rtol=1e-5)
        opt.step(grads)
        # the kernel: v = mom*v + g + wd*p; p = p - lr*v, in double,
        # v and p each rounded once when stored
        pd = want_p.astype(np.float64)
        vd = mom * v.astype(np.float64) + g.astype(np.float64) + wd * pd
        want_p = (pd - lr * vd).astype(dtype)
        v = vd.astype(dtype)
        got = p.numpy()
        assert got.dtype == dtype
        assert np.array_equal(got, want_p)
    # the parameter is still the same tracked leaf
    assert p.requires_grad


def test_plain_sgd_step_by_hand(dev):
    # the simplest case, written out: loss = sum(w * c), grad = c
    w = dev.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    c = dev.tensor(np.array([0.5, -1.0, 2.0]))
    opt = dispatch.SGD([w], lr=0.25)
    opt.step((w * c).sum().backward())
    assert w.numpy().tolist() == [1.0 - 0.125, 2.0 + 0.25, 3.0 - 0.5]
    opt.lr = 0.5
    opt.step((w * c).sum().backward())
    assert w.numpy().tolist() == [0.875 - 0.25, 2.25 + 0.5, 2.5 - 1.0]


def test_adam_matches_hand_computation(dev):
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    x = dev.tensor(X)
    p = dev.tensor(P0, requires_grad=True)
    opt = dispatch.Adam([p], lr=lr, betas=(b1, b2), eps=eps)
    want, m, v = P0.copy(), np.zeros_like(P0), np.zeros_like(P0)
    for t in (1, 2, 3):
        loss_of(dev, x, p).backward()
        g = p.grad.numpy()
        opt.step()  # the device's last backward
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        want = want - lr * (m / (1.0 - b1 ** t)) / (
            np.sqrt(v / (1.0 - b2 ** t)) + eps)
        assert np.array_equal(p.numpy(), want)


def test_local_and_remote_train_alike(local, remote):
    res = []
    for d in (local, remote):
        x = d.tensor(X)
        p = d.tensor(P0, requires_grad=True)
        opt = dispatch.Adam([p], lr=0.05)
        for _ in range(5):
            opt.step(loss_of(d, x, p).backward())
        res.append(p.numpy())
    assert np.array_equal(res[0], res[1])


def test_step_without_backward(dev):
    w = dev.tensor(np.ones(2), requires_grad=True)
    opt = dispatch.SGD([w], lr=0.1)
    with pytest.raises(ValueError, match="needs the Grads"):
        opt.step()
    with pytest.raises(TypeError):
        dispatch.SGD([], lr=0.1)
