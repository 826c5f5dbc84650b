"""dispatch.nn against torch.nn: models built with both (an MLP, a small
CNN, a transformer block), the torch weights copied in through
load_state_dict, give the same outputs and gradients within the stated
tolerance (float32: 1e-5 absolute and relative; the kernels differ in
summation order); LOCAL and REMOTE give the same bits; state_dicts
round-trip with torch's key names. The Module API without torch below."""
import numpy as np
import pytest

import dispatch
import dispatch.nn as nn
import dispatch.nn.functional as F

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- models
# Each model exists twice, with the same structure and parameter names:
# make(nn) builds it from dispatch.nn or from torch.nn.

def mlp(lib, dev=None):
    kw = {} if lib is not nn else {"device": dev}
    return lib.Sequential(lib.Linear(6, 16, **kw), lib.ReLU(),
                          lib.Linear(16, 16, **kw), lib.GELU("tanh"),
                          lib.Linear(16, 5, bias=False, **kw))


def cnn(lib, dev=None):
    kw = {} if lib is not nn else {"device": dev}

    class CNN(lib.Module):
        def __init__(self):
            super().__init__()
            self.conv = lib.Conv2d(2, 4, 3, padding=1, **kw)
            self.conv2 = lib.Conv2d(4, 3, 3, stride=2, bias=False, **kw)
            self.act = lib.SiLU()
            self.fc = lib.Linear(3 * 3 * 3, 5, **kw)

        def forward(self, x):
            h = self.act(self.conv(x))
            h = self.act(self.conv2(h))
            return self.fc(h.reshape(x.shape[0], 27))
    return CNN()


class TorchCausalSelfAttention(torch.nn.Module if torch else object):
    """The torch twin of nn.CausalSelfAttention (torch 1.13 has no fused
    scaled_dot_product_attention: the unfused formula)."""

    def __init__(self, d, h):
        super().__init__()
        self.num_heads = h
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, torch.nn.Linear(d, d))

    def forward(self, x):
        B, T, D = x.shape
        H = self.num_heads

        def heads(p):
            return p(x).reshape(B, T, H, D // H).permute(0, 2, 1, 3)
        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        s = q @ k.transpose(-1, -2) / (D // H) ** 0.5
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        a = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v
        return self.out_proj(a.permute(0, 2, 1, 3).reshape(B, T, D))


def block(lib, dev=None):
    kw = {} if lib is not nn else {"device": dev}
    attn = (nn.CausalSelfAttention(16, 4, **kw) if lib is nn
            else TorchCausalSelfAttention(16, 4))

    class Block(lib.Module):
        def __init__(self):
            super().__init__()
            self.wte = lib.Embedding(11, 16, padding_idx=0, **kw)
            self.ln1 = lib.LayerNorm(16, **kw)
            self.attn = attn
            self.ln2 = lib.LayerNorm(16, **kw)
            self.mlp = lib.Sequential(lib.Linear(16, 32, **kw), lib.GELU(),
                                      lib.Linear(32, 16, **kw))
            self.head = lib.Linear(16, 11, **kw)

        def forward(self, idx):
            x = self.wte(idx)
            x = x + self.attn(self.ln1(x))
            x = x + self.mlp(self.ln2(x))
            return self.head(x)
    return Block()


rng = np.random.default_rng(26)
INPUTS = {
    mlp: (rng.standard_normal((4, 6)).astype(np.float32),
          np.array([0, 4, 2, 1])),
    cnn: (rng.standard_normal((2, 2, 7, 7)).astype(np.float32),
          np.array([3, 0])),
    block: (np.array([[1, 5, 0, 7, 2, 2], [3, 0, 9, 10, 4, 1]]),
            np.array([5, 0, 7, 2, 2, 8, 0, 9, 10, 4, 1, 6])),
}


def torch_run(make):
    torch.manual_seed(0)
    tm = make(torch.nn)
    x, y = INPUTS[make]
    out = tm(torch.from_numpy(x))
    loss = torch.nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]), torch.from_numpy(y))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in tm.named_parameters()}
    return tm, out.detach().numpy(), float(loss), grads


def dispatch_run(make, dev, state):
    m = make(nn, dev)
    m.load_state_dict(state)
    x, y = INPUTS[make]
    out = m(dev.tensor(x))
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), dev.tensor(y))
    grads = loss.backward()
    return m, out.numpy(), loss.item(), \
        {n: grads[p].numpy() for n, p in m.named_parameters()}


@needs_torch
@pytest.mark.parametrize("make", [mlp, cnn, block])
def test_outputs_and_gradients_match_torch(dev, make):
    tm, tout, tloss, tgrads = torch_run(make)
    m, out, loss, grads = dispatch_run(make, dev, tm.state_dict())
    assert [n for n, _ in m.named_parameters()] == \
        [n for n, _ in tm.named_parameters()]
    np.testing.assert_allclose(out, tout, **TOL)
    assert loss == pytest.approx(tloss, rel=1e-5)
    for n in tgrads:
        np.testing.assert_allclose(grads[n], tgrads[n], err_msg=n, **TOL)
    if make is block:  # the padding row gets no gradient, as in torch
        assert not grads["wte.weight"][0].any()


@needs_torch
@pytest.mark.parametrize("make", [mlp, cnn, block])
def test_local_and_remote_bit_identical(local, remote, make):
    tm = torch_run(make)[0]
    a = dispatch_run(make, local, tm.state_dict())
    b = dispatch_run(make, remote, tm.state_dict())
    assert np.array_equal(a[1], b[1]) and a[2] == b[2]
    for n in a[3]:
        assert np.array_equal(a[3][n], b[3][n]), n


@needs_torch
@pytest.mark.parametrize("make", [mlp, cnn, block])
def test_state_dict_round_trips_with_torch_names(local, make):
    torch.manual_seed(1)
    tm = make(torch.nn)
    m = make(nn, local)  # its own initialisation
    assert list(m.state_dict()) == list(tm.state_dict())
    tm.load_state_dict({k: torch.from_numpy(v.numpy())
                        for k, v in m.state_dict().items()})
    for k, v in tm.state_dict().items():
        assert np.array_equal(v.numpy(), m.state_dict()[k].numpy()), k
    # and back: a second dispatch model from torch's state_dict
    m2 = make(nn, local)
    m2.load_state_dict(tm.state_dict())
    x = INPUTS[make][0]
    assert np.array_equal(m(local.tensor(x)).numpy(),
                          m2(local.tensor(x)).numpy())


@needs_torch
def test_rms_norm_and_gelu_variants_match_torch(dev):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    norm = nn.RMSNorm(8, eps=1e-6, device=dev)
    w = rng.standard_normal(8).astype(np.float32)
    norm.load_state_dict({"weight": w})
    tx = torch.from_numpy(x)
    want = tx / torch.sqrt((tx * tx).mean(-1, keepdim=True) + 1e-6) * \
        torch.from_numpy(w)
    np.testing.assert_allclose(norm(dev.tensor(x)).numpy(), want.numpy(),
                               **TOL)
    for approx in ("none", "tanh"):
        np.testing.assert_allclose(
            nn.GELU(approx)(dev.tensor(x)).numpy(),
            torch.nn.GELU(approximate=approx)(tx).numpy(), **TOL)
    np.testing.assert_allclose(F.log_softmax(dev.tensor(x), 1).numpy(),
                               torch.log_softmax(tx, 1).numpy(), **TOL)


@needs_torch
def test_repr_is_torchs(local):
    assert repr(mlp(nn, local)) == repr(mlp(torch.nn))
    assert repr(nn.Conv2d(2, 4, 3, padding=1, bias=False, device=local)) \
        == repr(torch.nn.Conv2d(2, 4, 3, padding=1, bias=False))
    assert repr(nn.Embedding(11, 16, padding_idx=0, device=local)) == \
        repr(torch.nn.Embedding(11, 16, padding_idx=0))


# ---------------------------------------------------------------- Module

def test_parameters_children_and_modes(local):
    m = block(nn, local)
    names = [n for n, _ in m.named_parameters()]
    assert names[:3] == ["wte.weight", "ln1.weight", "ln1.bias"]
    assert "attn.q_proj.weight" in names and names[-1] == "head.bias"
    assert all(isinstance(p, nn.Parameter) and p.requires_grad
               for p in m.parameters())
    assert [n for n, _ in m.named_children()] == \
        ["wte", "ln1", "attn", "ln2", "mlp", "head"]
    assert len(list(m.modules())) == 14  # attn: 1 + 4 Linear, mlp: 1 + 3
    assert m.training and all(c.training for c in m.modules())
    m.eval()
    assert not any(c.training for c in m.modules())
    m.train()
    assert all(c.training for c in m.modules())
    # a shared module is listed once, as torch
    lin = nn.Linear(2, 2, device=local)
    seq = nn.Sequential(lin, lin)
    assert len(list(seq.parameters())) == 2
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "1.weight",
                                      "1.bias"]


def test_default_initialisation(local):
    nn.init.manual_seed(5)
    lin = nn.Linear(64, 32, device=local)
    w, b = lin.weight.numpy(), lin.bias.numpy()
    bound = 1 / 8.0  # 1 / sqrt(in_features)
    assert w.shape == (32, 64) and b.shape == (32,)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert np.abs(b).max() <= bound
    assert abs(w.mean()) < 0.01
    nn.init.manual_seed(5)
    assert np.array_equal(nn.Linear(64, 32, device=local).weight.numpy(), w)
    assert not np.array_equal(nn.Linear(64, 32, device=local).weight.numpy(),
                              w)
    conv = nn.Conv2d(3, 8, (3, 5), device=local)
    assert conv.weight.shape == (8, 3, 3, 5)
    assert np.abs(conv.weight.numpy()).max() <= 1 / np.sqrt(45)
    emb = nn.Embedding(100, 40, padding_idx=-1, device=local).weight.numpy()
    assert 0.9 < emb[:-1].std() < 1.1 and not emb[-1].any()
    ln = nn.LayerNorm(7, device=local)
    assert ln.weight.numpy().tolist() == [1.0] * 7
    assert ln.bias.numpy().tolist() == [0.0] * 7


def test_dropout_train_and_eval(dev):
    x = dev.ones((64, 64))
    d = nn.Dropout(0.25)
    y = d(x).numpy()
    kept = y != 0
    assert 0.7 < kept.mean() < 0.8
    assert np.all(y[kept] == np.float32(1 / 0.75))
    assert not np.array_equal(d(x).numpy(), y)  # a new mask per call
    d.eval()
    assert d(x) is x
    with pytest.raises(ValueError):
        nn.Dropout(1.0)


def test_load_state_dict_errors(local):
    m = mlp(nn, local)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    del sd["0.bias"]
    sd["extra"] = np.zeros(1)
    with pytest.raises(KeyError, match="0.bias.*extra"):
        m.load_state_dict(sd)
    r = m.load_state_dict(sd, strict=False)
    assert r.missing_keys == ["0.bias"] and r.unexpected_keys == ["extra"]
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    before = m[0].weight.numpy()
    sd["0.weight"] = np.zeros((16, 7), np.float32)
    sd["2.weight"] = np.zeros((16, 16), np.float32)
    with pytest.raises(ValueError, match="0.weight has shape"):
        m.load_state_dict(sd)
    # nothing was loaded: the check comes before any parameter changes
    assert np.array_equal(m[0].weight.numpy(), before)
    assert m[2].weight.numpy().any()


def test_to_moves_parameters_and_keeps_them(local, remote):
    m = mlp(nn, local)
    params = list(m.parameters())
    x = np.ones((2, 6), np.float32)
    want = m(local.tensor(x)).numpy()
    opt = dispatch.SGD(m.parameters(), lr=0.1)
    assert m.to(remote) is m
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert all(p.device is remote and p.requires_grad for p in params)
    out = m(remote.tensor(x))
    assert np.array_equal(out.numpy(), want)
    grads = out.sum().backward()
    assert grads[params[0]].shape == (16, 6)
    with pytest.raises(ValueError, match="make the optimizer after"):
        opt.step(grads)
    m.zero_grad()
    assert params[0].grad is None


def test_parameter_and_registration(local):
    p = nn.Parameter(local.tensor(np.arange(3.0)))
    assert isinstance(p, dispatch.Tensor) and p.requires_grad
    assert (p * 2).sum().item() == 6.0
    m = nn.Module()
    m.w = p
    m.sub = nn.Linear(3, 1, device=local)
    m.note = "not registered"
    assert [n for n, _ in m.named_parameters()] == ["w", "sub.weight",
                                                   "sub.bias"]
    m.sub = None
    assert [n for n, _ in m.named_parameters()] == ["w"]
    del m.w
    assert list(m.parameters()) == []
    with pytest.raises(NotImplementedError):
        m(1)


def test_functional_refusals(local):
    q = local.ones((1, 1, 2, 4))
    with pytest.raises(NotImplementedError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=q)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="reduction"):
        F.mse_loss(q, q, reduction="avg")
    a = local.tensor(np.array([1.0, 2.0, 4.0], np.float32))
    b = local.tensor(np.array([0.0, 0.0, 1.0], np.float32))
    assert F.mse_loss(a, b).item() == pytest.approx(14.0 / 3)
    assert F.mse_loss(a, b, "sum").item() == 14.0
    assert nn.MSELoss("none")(a, b).numpy().tolist() == [1.0, 4.0, 9.0]
