"""Optimizer steps against hand computations. The kernels compute each
update in double and round once to the parameter's dtype, so the same
formulas in numpy give the same bits, from the gradients the library
itself returned."""
import math

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


# ---------------------------------------------------------------- AdamW
try:  # the comparisons need torch (1.13 on the lead's machine)
    import torch
except ImportError:  # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

B0 = rng.standard_normal(3)


def _model_loss(x, w, b):
    # the same expression in dispatch and in torch
    return (((x @ w) + b) ** 2).sum() * 0.5


def _torch_run(steps, dtype, wd, clip, lr_of):
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    x = torch.tensor(X.astype(dtype), dtype=tdt)
    w = torch.tensor(P0.astype(dtype), dtype=tdt, requires_grad=True)
    b = torch.tensor(B0.astype(dtype), dtype=tdt, requires_grad=True)
    opt = torch.optim.AdamW(
        [{"params": [w], "weight_decay": wd}, {"params": [b],
                                               "weight_decay": 0.0}],
        lr=lr_of(0), betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_of(s)
        opt.zero_grad()
        _model_loss(x, w, b).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_([w, b], clip)))
        opt.step()
    return w.detach().numpy(), b.detach().numpy(), norms


def _dispatch_run(dev, steps, dtype, wd, clip, lr_of, groups=True):
    x = dev.tensor(X.astype(dtype))
    w = dev.tensor(P0.astype(dtype), requires_grad=True)
    b = dev.tensor(B0.astype(dtype), requires_grad=True)
    if groups:
        params = [{"params": [w], "weight_decay": wd},
                  {"params": [b], "weight_decay": 0.0}]
        opt = dispatch.AdamW(params, lr=lr_of(0), betas=(0.9, 0.95),
                             eps=1e-8, clip=clip)
    else:
        opt = dispatch.optim.AdamW([w, b], lr=lr_of(0), betas=(0.9, 0.95),
                                   weight_decay=[wd, 0.0], clip=clip)
    for s in range(steps):
        opt.lr = lr_of(s)
        opt.step(_model_loss(x, w, b).backward())
    return w.numpy(), b.numpy(), (opt.last_norm if clip else None)


def _sched(s):
    return dispatch.optim.lr_cosine(s, 2, 8, 0.05, 0.005)


@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("clip", [None, 0.5, 1e6])
def test_adamw_and_clip_match_torch(dev, dtype, clip):
    tw, tb, norms = _torch_run(8, dtype, 0.1, clip, _sched)
    if clip == 0.5:
        assert min(norms) > 0.5  # the clip is active at every step
    w, b, last_norm = _dispatch_run(dev, 8, dtype, 0.1, clip, _sched)
    tol = 1e-11 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(w, tw, rtol=tol, atol=tol)
    np.testing.assert_allclose(b, tb, rtol=tol, atol=tol)
    if clip is not None:  # clip_grad_norm_'s return value, last step
        assert last_norm == pytest.approx(norms[-1], rel=tol)


def test_adamw_decay_list_equals_groups(local):
    a = _dispatch_run(local, 4, np.float64, 0.1, 0.5, _sched, groups=True)
    b = _dispatch_run(local, 4, np.float64, 0.1, 0.5, _sched, groups=False)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_adamw_clipped_local_and_remote_bit_identical(local, remote):
    res = [_dispatch_run(d, 6, np.float32, 0.1, 0.5, _sched)
           for d in (local, remote)]
    assert np.array_equal(res[0][0], res[1][0])
    assert np.array_equal(res[0][1], res[1][1])


@needs_torch
def test_clip_on_sgd_matches_torch(dev):
    w = dev.tensor(P0, requires_grad=True)
    x = dev.tensor(X)
    opt = dispatch.SGD([w], lr=0.1)
    opt.clip = 1.0
    assert opt.clip == 1.0
    opt.step(loss_of(dev, x, w).backward())
    tw = torch.tensor(P0, requires_grad=True)
    loss_of(None, torch.tensor(X), tw).backward()
    torch.nn.utils.clip_grad_norm_([tw], 1.0)
    with torch.no_grad():
        tw -= 0.1 * tw.grad
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-13)
    opt.clip = None
    assert opt.clip is None


def test_adamw_argument_errors(dev):
    w = dev.tensor(np.ones(2), requires_grad=True)
    with pytest.raises(ValueError, match="2 weight decays for 1"):
        dispatch.AdamW([w], weight_decay=[0.1, 0.2])
    with pytest.raises(ValueError, match="not \\['momentum'\\]"):
        dispatch.AdamW([{"params": [w], "momentum": 0.1}])
    assert dispatch.AdamW([{"params": [w], "lr": 0.1}]).lr == 0.1
    with pytest.raises(dispatch.EINVAL, match="not finite"):
        dispatch.AdamW([w], weight_decay=float("inf"))
    opt = dispatch.AdamW([w])
    assert opt.weight_decay == [0.01]  # torch's default
    with pytest.raises(dispatch.EINVAL, match="never clipped"):
        opt.last_norm
    with pytest.raises(dispatch.EINVAL, match="max_norm"):
        opt.clip = -1.0


def test_lr_cosine_formula():
    lr = dispatch.optim.lr_cosine
    assert lr(0, 100, 2000, 3e-3, 3e-4) == pytest.approx(3e-5, abs=1e-18)
    assert lr(99, 100, 2000, 3e-3, 3e-4) == pytest.approx(3e-3)
    for s in (100, 700, 1999):
        want = 3e-4 + 0.5 * (1 + math.cos(math.pi * (s - 100) / 1900)) * 2.7e-3
        assert lr(s, 100, 2000, 3e-3, 3e-4) == pytest.approx(want, rel=1e-14)
    assert lr(2000, 100, 2000, 3e-3, 3e-4) == 3e-4
    assert lr(10 ** 6, 100, 2000, 3e-3, 3e-4) == 3e-4
    with pytest.raises(TypeError):
        lr(1.5, 100, 2000, 3e-3, 3e-4)
