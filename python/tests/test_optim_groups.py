"""Optimizers with torch's parameter groups, nn.utils.clip_grad_norm_ and
the lr_scheduler classes against torch 1.13 on the same parameters and
gradients (within 1e-6), and the one-message step counted on a server's
request metrics."""
import re
import urllib.request

import numpy as np
import pytest

import dispatch
import dispatch.nn as nn
import dispatch.nn.functional as F
from dispatch.optim import lr_scheduler

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

rng = np.random.default_rng(7)
X = rng.standard_normal((8, 5)).astype(np.float32)
Y = np.array([0, 2, 1, 3, 3, 0, 1, 2])


def build(lib, dev=None):
    kw = {} if lib is not nn else {"device": dev}
    return lib.Sequential(lib.Linear(5, 12, **kw), lib.GELU(),
                          lib.LayerNorm(12, **kw), lib.Linear(12, 4, **kw))


def groups_of(model):
    """torch's recipe: decay the matrices only."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")
             and len(p.shape) == 2]
    rest = [p for n, p in model.named_parameters() if not
            (n.endswith("weight") and len(p.shape) == 2)]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0}]


def torch_train(opt_name, kwargs, steps, clip=None, sched=None):
    torch.manual_seed(3)
    tm = build(torch.nn)
    state = {k: v.clone() for k, v in tm.state_dict().items()}
    params = groups_of(tm) if opt_name == "AdamW" else \
        [{"params": list(tm.parameters())}]
    opt = getattr(torch.optim, opt_name)(params, **kwargs)
    s = sched(torch.optim.lr_scheduler, opt) if sched else None
    norms, lrs = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(tm(torch.from_numpy(X)),
                                                 torch.from_numpy(Y))
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                tm.parameters(), clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if s:
            s.step()
    return state, {n: p.detach().numpy() for n, p in tm.named_parameters()}, \
        norms, lrs


def dispatch_train(dev, state, opt_name, kwargs, steps, clip=None,
                   sched=None):
    m = build(nn, dev)
    m.load_state_dict(state)
    params = groups_of(m) if opt_name == "AdamW" else \
        [{"params": list(m.parameters())}]
    opt = getattr(dispatch.optim, opt_name)(params, **kwargs)
    s = sched(lr_scheduler, opt) if sched else None
    norms, lrs, x, y = [], [], dev.tensor(X), dev.tensor(Y)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(m.parameters(), clip) if clip \
            else None
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if norm is not None:
            norms.append(float(norm))
        if s:
            s.step()
    return {n: p.numpy() for n, p in m.named_parameters()}, norms, lrs


def warm_cos(mod, opt):
    if mod is lr_scheduler:
        return mod.CosineWithWarmup(opt, 2, 6, lr_min=1e-3)
    base = opt.param_groups[0]["lr"]
    return mod.LambdaLR(opt, lambda e: dispatch.optim.lr_cosine(
        e, 2, 6, base, 1e-3) / base)


CASES = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, None, None),
    ("Adam", {"lr": 0.01, "betas": (0.8, 0.99)}, 0.5, None),
    ("AdamW", {"lr": 0.02, "betas": (0.9, 0.95)}, 0.5, warm_cos),
    ("SGD", {"lr": 0.2}, 1e3,
     lambda mod, opt: mod.StepLR(opt, step_size=2, gamma=0.5)),
]


@needs_torch
@pytest.mark.parametrize("case", CASES, ids=[c[0] + str(i) for i, c in
                                             enumerate(CASES)])
def test_training_matches_torch(dev, case):
    name, kwargs, clip, sched = case
    state, want, tnorms, tlrs = torch_train(name, kwargs, 6, clip, sched)
    got, norms, lrs = dispatch_train(dev, state, name, kwargs, 6, clip, sched)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-6,
                                   err_msg=n)
    np.testing.assert_allclose(norms, tnorms, rtol=1e-6)
    if clip == 0.5:
        assert min(tnorms) > 0.5  # the clip was active
    np.testing.assert_allclose(lrs, tlrs, rtol=1e-12)


@needs_torch
def test_step_lr_is_torchs_to_the_bit(local):
    w = local.tensor(np.ones(2, np.float32), requires_grad=True)
    opt = dispatch.optim.SGD([w], lr=0.3)
    tw = torch.ones(2, requires_grad=True)
    topt = torch.optim.SGD([tw], lr=0.3)
    s = lr_scheduler.StepLR(opt, 3, gamma=0.7)
    ts = torch.optim.lr_scheduler.StepLR(topt, 3, gamma=0.7)
    for _ in range(10):
        assert s.get_last_lr() == ts.get_last_lr()
        assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"]
        topt.step()
        s.step()
        ts.step()


def test_group_rules(local):
    a = local.tensor(np.ones(2), requires_grad=True)
    b = local.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match="differ in 'lr'"):
        dispatch.optim.AdamW([{"params": [a], "lr": 0.1}, {"params": [b]}])
    with pytest.raises(ValueError, match="differ in 'momentum'"):
        dispatch.optim.SGD([{"params": [a], "momentum": 0.9},
                            {"params": [b]}], lr=0.1)
    with pytest.raises(ValueError, match="more than once"):
        dispatch.optim.SGD([{"params": [a]}, {"params": [a, b]}], lr=0.1)
    with pytest.raises(ValueError, match="not \\['foo'\\]"):
        dispatch.optim.Adam([{"params": [a], "foo": 1}])
    with pytest.raises(NotImplementedError, match="nesterov"):
        dispatch.optim.SGD([a], lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(NotImplementedError, match="AdamW decays"):
        dispatch.optim.Adam([a], weight_decay=0.1)
    opt = dispatch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1,
                             momentum=0.5)
    grads = ((a * a).sum() + (b * b).sum()).backward()
    opt.param_groups[1]["lr"] = 0.2
    with pytest.raises(ValueError, match="different learning rates"):
        opt.step(grads)
    for g in opt.param_groups:
        g["lr"] = 0.25
    opt.step(grads)  # a changed lr reaches the step
    assert opt.lr == 0.25
    assert a.numpy().tolist() == [0.5, 0.5]  # 1 - 0.25 * 2
    opt.param_groups[0]["momentum"] = 0.1
    with pytest.raises(ValueError, match="'momentum' of a parameter group"):
        opt.step(grads)


def test_clip_grad_norm_needs_its_optimizer(local):
    m = build(nn, local)
    ps = list(m.parameters())
    with pytest.raises(ValueError, match="no optimizer holds exactly"):
        nn.utils.clip_grad_norm_(ps, 1.0)
    opt = dispatch.optim.SGD(ps, lr=0.0)
    with pytest.raises(ValueError, match="no optimizer holds exactly"):
        nn.utils.clip_grad_norm_(ps[:2], 1.0)
    with pytest.raises(NotImplementedError):
        nn.utils.clip_grad_norm_(ps, 1.0, norm_type=1.0)
    grads = F.cross_entropy(m(local.tensor(X)), local.tensor(Y)).backward()
    norm = nn.utils.clip_grad_norm_(ps, 1e-3)
    with pytest.raises(RuntimeError, match="after optimizer.step"):
        float(norm)
    opt.step(grads)
    want = np.sqrt(sum((grads[p].numpy().astype(np.float64) ** 2).sum()
                       for p in ps))
    assert float(norm) == pytest.approx(want, rel=1e-12)
    assert f"{norm:.3e}" == f"{want:.3e}"
    assert opt.clip is None  # for that step only
    nn.utils.clip_grad_norm_(ps, 1e-3)
    opt.step(grads)
    assert float(norm) == pytest.approx(want, rel=1e-12)  # remembered


# ---------------------------------------------------------------- messages

def _request_counts(port):
    """{request kind: requests finished} from the server's metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                  timeout=60).read().decode()
    return {k: int(float(v)) for k, v in re.findall(
        r'dispatch_request_duration_seconds_count\{kind="(\w+)"\} (\S+)',
        body)}


def test_each_step_is_one_message():
    # a server of its own, with its metrics endpoint on a free port
    from conftest import Server
    server = Server(["--metrics-listen", "127.0.0.1:0"])
    try:
        line = server.proc.stdout.readline().decode()
        m = re.match(r"dispatch-server metrics on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        port = int(m.group(1))
        with dispatch.device(server.spec) as dev:
            model = build(nn, dev)
            opt = dispatch.optim.AdamW(groups_of(model), lr=0.01)
            sched = lr_scheduler.CosineWithWarmup(opt, 2, 10)
            x, y = dev.tensor(X), dev.tensor(Y)
            for step in range(3):
                grads = F.cross_entropy(model(x), y).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                dev.sync()
                before = _request_counts(port)
                opt.step(grads)
                sched.step()
                dev.sync()
                after = _request_counts(port)
                delta = {k: after[k] - before.get(k, 0) for k in after
                         if after[k] != before.get(k, 0)}
                # the step, and the sync that waited for it; the clip's
                # norm holder is made at the first clipped step
                want = {"step": 1, "sync": 1}
                if step == 0:
                    delta.pop("ops", None)
                assert delta == want, delta
    finally:
        assert server.stop() == 0, server.stderr()
