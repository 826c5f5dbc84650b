"""Gradients from backward() against central finite differences of the
same forward on a small float64 graph, on LOCAL and REMOTE (where the tape
lives on the server), and the two devices' gradients bit for bit."""
import numpy as np
import pytest

import dispatch

rng = np.random.default_rng(7)
X = rng.standard_normal((5, 3))
Y = np.array([0, 2, 1, 1, 0])
PARAMS = {"W": rng.standard_normal((3, 4)) * 0.5,
          "b": rng.standard_normal((4,)) * 0.1,
          "V": rng.standard_normal((4, 3)) * 0.5}


def forward(dev, p):
    """A graph through most op families: matmul, broadcast add, tanh,
    gelu, sigmoid, slice/cat, index_select, softmax, cross-entropy, mse,
    a scalar power and a mean."""
    x = dev.tensor(X)
    h = (x @ p["W"] + p["b"]).tanh()
    h = dispatch.cat([h[:, :2].gelu(), h[:, 2:].sigmoid()], 1)
    logits = h @ p["V"]
    ce = dispatch.cross_entropy(logits, Y)
    sm = logits.softmax(1)[[0, 3]]
    reg = dispatch.mse(sm, dev.zeros((2, 3), np.float64))
    return ce + reg * 0.5 + (p["W"] ** 2).mean() * 0.1


def fd_grads(dev, eps=1e-5):
    out = {}
    for name, val in PARAMS.items():
        g = np.zeros_like(val)
        for i in np.ndindex(val.shape):
            vals = []
            for s in (eps, -eps):
                q = {k: v.copy() for k, v in PARAMS.items()}
                q[name][i] += s
                p = {k: dev.tensor(v) for k, v in q.items()}
                vals.append(forward(dev, p).item())
            g[i] = (vals[0] - vals[1]) / (2 * eps)
        out[name] = g
    return out


def backward_grads(dev):
    p = {k: dev.tensor(v, requires_grad=True) for k, v in PARAMS.items()}
    loss = forward(dev, p)
    assert loss.requires_grad and loss.kind == "autodiff"
    grads = loss.backward()
    return {k: grads[t].numpy() for k, t in p.items()}, p


def test_gradients_match_finite_differences(local, remote):
    fd = fd_grads(local)
    gl, _ = backward_grads(local)
    gr, _ = backward_grads(remote)
    for k in PARAMS:
        assert gl[k].shape == PARAMS[k].shape
        assert np.array_equal(gl[k], gr[k]), k  # same kernels both sides
        np.testing.assert_allclose(gl[k], fd[k], rtol=1e-6, atol=1e-8,
                                   err_msg=k)


def test_grad_property_and_retain(dev):
    w = dev.tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    assert w.requires_grad and w.grad is None
    loss = (w * w).sum()
    loss.backward(retain_graph=True)
    assert np.array_equal(w.grad.numpy(), [2.0, -4.0, 6.0])
    # the graph was kept: a second backward works and gives the same
    g2 = loss.backward()
    assert np.array_equal(g2[w].numpy(), [2.0, -4.0, 6.0])
    # the inner tensor records nothing
    assert not w.inner.requires_grad and w.inner.kind == dev.kind
    with pytest.raises(dispatch.EGRAPHFREED):
        loss.backward()
        dev.sync()
