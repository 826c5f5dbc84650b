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


# issue 23: embedding/norm, against torch (1.13, CPU) where it has the op

def _torch():
    return pytest.importorskip("torch")


def _fwd_bwd(dev, fn, arrays, g):
    """fn over tracked tensors of arrays, and the gradients of
    sum(fn(...) * g) of each array (None for non-float inputs)."""
    ts = [dev.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    y = fn(*ts)
    grads = (y * dev.tensor(g)).sum().backward()
    return y.numpy(), [grads[t].numpy() if a.dtype.kind == "f" else None
                       for t, a in zip(ts, arrays)]


def test_embedding_matches_torch(local, remote):
    torch = _torch()
    w = rng.standard_normal((6, 4))
    idx = np.array([[1, 5, 1], [0, 1, 3]])
    g = rng.standard_normal((2, 3, 4))
    for pad in (None, 1, -1):
        res = [_fwd_bwd(d, lambda wt, it: dispatch.embedding(it, wt, pad),
                        [w, idx], g) for d in (local, remote)]
        assert np.array_equal(res[0][0], res[1][0])
        assert np.array_equal(res[0][1][0], res[1][1][0])
        tw = torch.tensor(w, requires_grad=True)
        ty = torch.nn.functional.embedding(torch.tensor(idx), tw,
                                           padding_idx=pad)
        (ty * torch.tensor(g)).sum().backward()
        np.testing.assert_array_equal(res[0][0], ty.detach().numpy())
        np.testing.assert_allclose(res[0][1][0], tw.grad.numpy(), rtol=1e-15,
                                   atol=1e-15)
    with pytest.raises(dispatch.EINDEX, match="embedding: index 6"):
        dispatch.embedding([6], local.tensor(w)).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("affine", ["none", "weight", "both", "bias"])
def test_layer_norm_matches_torch(local, remote, dtype, affine):
    torch = _torch()
    x = (rng.standard_normal((3, 2, 5)) * 3 + 2).astype(dtype)
    w = (rng.standard_normal((2, 5)) + 1).astype(dtype)
    b = rng.standard_normal((2, 5)).astype(dtype)
    g = rng.standard_normal((3, 2, 5)).astype(dtype)
    use_w, use_b = affine in ("weight", "both"), affine in ("bias", "both")
    arrays = [x] + ([w] if use_w else []) + ([b] if use_b else [])

    def fn(xt, *rest):
        it = iter(rest)
        wt = next(it) if use_w else None
        bt = next(it) if use_b else None
        return dispatch.layer_norm(xt, (2, 5), wt, bt, eps=1e-5)

    res = [_fwd_bwd(d, fn, arrays, g) for d in (local, remote)]
    assert np.array_equal(res[0][0], res[1][0])
    for a, c in zip(res[0][1], res[1][1]):
        assert np.array_equal(a, c)
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    it = iter(ts[1:])
    ty = torch.nn.functional.layer_norm(ts[0], (2, 5),
                                        next(it) if use_w else None,
                                        next(it) if use_b else None, 1e-5)
    (ty * torch.tensor(g)).sum().backward()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(res[0][0], ty.detach().numpy(), rtol=tol,
                               atol=tol)
    for got, t in zip(res[0][1], ts):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=tol, atol=tol)


def test_rms_norm_matches_numpy_and_errors(local, remote):
    torch = _torch()
    x = rng.standard_normal((4, 6))
    w = rng.standard_normal((6,)) + 1
    g = rng.standard_normal((4, 6))
    res = [_fwd_bwd(d, lambda xt, wt: dispatch.rms_norm(xt, 6, wt, 1e-6),
                    [x, w], g) for d in (local, remote)]
    assert np.array_equal(res[0][0], res[1][0])
    assert np.array_equal(res[0][1][0], res[1][1][0])
    assert np.array_equal(res[0][1][1], res[1][1][1])
    # torch 1.13 has no rms_norm: its autograd over the formula
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    ty = tx / torch.sqrt((tx * tx).mean(-1, keepdim=True) + 1e-6) * tw
    (ty * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(res[0][0], ty.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(res[0][1][0], tx.grad.numpy(), rtol=1e-10,
                               atol=1e-12)
    np.testing.assert_allclose(res[0][1][1], tw.grad.numpy(), rtol=1e-10,
                               atol=1e-12)
    with pytest.raises(ValueError, match="normalized_shape"):
        dispatch.layer_norm(local.tensor(x), 4)
    with pytest.raises(dispatch.ESHAPE, match="weight has shape"):
        dispatch.rms_norm(local.tensor(x), 6, np.ones(5))


# issue 23: attention

def _attn_ref(q, k, v, mask, causal, scale):
    """numpy: softmax(scale q k^T + bias) v and its vjp for dO = w, in f64,
    bias -inf where a key is not attended; rows attending nothing give 0."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    tq, tk = q.shape[2], k.shape[2]
    ok = np.ones((q.shape[0], 1, tq, tk), bool)
    if mask is not None:
        ok &= mask[:, None, None, :]
    if causal:
        ok &= np.tril(np.ones((tq, tk), bool))
    s = np.where(ok, scale * q @ k.swapaxes(-1, -2), -np.inf)
    mx = np.where(ok.any(-1, keepdims=True), s.max(-1, keepdims=True), 0)
    e = np.where(ok, np.exp(s - mx), 0)
    den = e.sum(-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    return p, p @ v


def _attn_grads(q, k, v, mask, causal, scale, w):
    p, _ = _attn_ref(q, k, v, mask, causal, scale)
    q, k, v, w = (x.astype(np.float64) for x in (q, k, v, w))
    dv = p.swapaxes(-1, -2) @ w
    dp = w @ v.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, dv


@pytest.mark.parametrize("dt,causal,masked,tol", [
    (np.float32, False, False, 2e-5), (np.float32, True, True, 2e-5),
    (np.float64, True, False, 1e-12), (np.float64, False, True, 1e-12)])
def test_attention_against_numpy(local, remote, dt, causal, masked, tol):
    b, h, tq, tk, d, dv = 2, 3, 70, 20, 8, 5
    q = rng.standard_normal((b, h, tq, d)).astype(dt)
    k = rng.standard_normal((b, h, tk, d)).astype(dt)
    v = rng.standard_normal((b, h, tk, dv)).astype(dt)
    w = rng.standard_normal((b, h, tq, dv)).astype(dt)
    mask = rng.random((b, tk)) > 0.3 if masked else None
    if masked:
        mask[1] = False  # batch entry 1 attends nothing: 0, no gradient
    scale = 1 / np.sqrt(d)
    got = []
    for dev in (local, remote):
        ts = [dev.tensor(x, requires_grad=True) for x in (q, k, v)]
        o = dispatch.attention(*ts, key_mask=mask, is_causal=causal)
        grads = (o * dev.tensor(w)).sum().backward()
        got.append([o.numpy()] + [grads[t].numpy() for t in ts])
    for a, c in zip(*got):
        assert a.dtype == dt and np.array_equal(a, c)  # LOCAL == REMOTE
    _, want_o = _attn_ref(q, k, v, mask, causal, scale)
    want = [want_o, *_attn_grads(q, k, v, mask, causal, scale, w)]
    for name, a, c in zip(("out", "dq", "dk", "dv"), got[0], want):
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol, err_msg=name)
    if masked:
        assert not got[0][0][1].any() and not got[0][1][1].any()


def test_attention_matches_torch_composition(local):
    torch = pytest.importorskip("torch")
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    got = dispatch.attention(local.tensor(q), local.tensor(k),
                             local.tensor(v), is_causal=True,
                             scale=0.3).numpy()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    s = (tq @ tk.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(),
                      float("-inf"))
    np.testing.assert_allclose(got, (s.softmax(-1) @ tv).numpy(), rtol=1e-12)


def test_attention_errors(local):
    q = local.tensor(np.zeros((1, 1, 2, 3), np.float32))
    with pytest.raises(dispatch.EDTYPE):  # v of another dtype
        dispatch.attention(q, q, local.tensor(np.zeros((1, 1, 2, 3))))
    with pytest.raises(dispatch.ESHAPE):
        dispatch.attention(q, q, q, key_mask=[[True, False, True]])
