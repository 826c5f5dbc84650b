"""Graph capture and replay from Python: a captured SGD step replayed on
new batches leaves the parameters bit-identical to the same steps run op
by op, on both kinds; a wrong input shape raises and the graph goes on."""
import numpy as np
import pytest

import dispatch

rng = np.random.default_rng(5)
BATCHES = [(rng.standard_normal((6, 4)).astype(np.float32),
            rng.integers(0, 3, 6).astype(np.int64)) for _ in range(4)]


def model(dev):
    w = dev.normal((4, 3), std=0.5, seed=1).track()
    b = dev.zeros((3,)).track()
    return [w, b], dispatch.SGD([w, b], lr=0.1, momentum=0.9)


def step(dev, params, opt, x, y, graph=None):
    with dev.scope():
        xt, yt = dev.tensor(x), dev.tensor(y)
        loss = dispatch.cross_entropy(xt @ params[0] + params[1], yt)
        if graph is not None:
            graph.output(loss)
        opt.step(loss.backward())


def test_replay_matches_op_by_op(dev):
    pa, oa = model(dev)
    for x, y in BATCHES:
        step(dev, pa, oa, x, y)
    pb, ob = model(dev)
    with dev.capture() as g:
        step(dev, pb, ob, *BATCHES[0], graph=g)
    losses = [g.replay(x, y)[0] for x, y in BATCHES[1:]]
    assert all(l.shape == () and np.isfinite(l) for l in losses)
    for a, b in zip(pa, pb):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    with pytest.raises(dispatch.ESHAPE, match="placeholder"):
        g.replay(BATCHES[0][0][:3], BATCHES[0][1])
    g.replay(*BATCHES[0])  # goes on
    g.free()
