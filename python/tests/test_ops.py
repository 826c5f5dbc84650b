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
    ("max", lambda a: a.max(1).values, lambda a: a.max(1), (A32,), True),
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
    # issue 23: elementwise and reductions
    ("softplus", dispatch.softplus,
     lambda a: np.where(a > 20, a, np.log1p(np.exp(a))), (A32 * 12,), False),
    ("gelu_tanh", lambda a: a.gelu_tanh(), lambda a: 0.5 * a * (1 + np.tanh(
        np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3))), (A64,), False),
    ("gelu_approximate", lambda a: dispatch.gelu(a, approximate="tanh")
     - a.gelu_tanh() + a.gelu(approximate="none") - dispatch.gelu(a),
     lambda a: np.zeros_like(a), (A32,), True),
    ("clamp", lambda a: a.clamp(-0.5, 0.7),
     lambda a: np.clip(a, np.float32(-0.5), np.float32(0.7)), (A32,), True),
    ("clamp_min_only", lambda a: dispatch.clamp(a, min=0),
     lambda a: np.maximum(a, np.float32(0)), (A32,), True),
    ("clamp_i64", lambda a: a.clamp(-10, 20), lambda a: np.clip(a, -10, 20),
     (I64,), True),
    ("masked_fill", lambda a, b: a.masked_fill(b > 0, -1.5),
     lambda a, b: np.where(b > 0, np.float32(-1.5), a), (A32, B32), True),
    ("masked_fill_bcast", lambda a, r: dispatch.masked_fill(a, r > 0, 7),
     lambda a, r: np.where(r > 0, np.float32(7), a), (A32, R32), True),
    ("min", lambda a: a.min(1).values, lambda a: a.min(1), (A32,), True),
    ("min_all", dispatch.min, lambda a: a.min(), (I64,), True),
    ("argmin", lambda a: a.argmin(0), lambda a: a.argmin(0), (A32,), True),
    ("var", lambda a: a.var(1), lambda a: a.var(1, ddof=1), (A64,), False),
    ("var_all_pop", lambda a: dispatch.var(a, correction=0),
     lambda a: a.var(), (A64,), False),
    ("std_keepdim", lambda a: a.std(0, keepdim=True),
     lambda a: a.std(0, ddof=1, keepdims=True), (A64,), False),
    ("std_f32", lambda a: a.std((0, 1), correction=2),
     lambda a: np.sqrt(((a.astype(np.float64) - a.mean(dtype=np.float64))
                        ** 2).sum() / (a.size - 2)).astype(np.float32),
     (A32,), False),
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
    # operators promote mixed dtypes as torch (the functions do not)
    assert (x + np.ones(4)).dtype == np.float64
    with pytest.raises(dispatch.EDTYPE, match="f32 and f64 differ"):
        dispatch.add(x, np.ones(4))
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


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_torch(local, remote, training):
    torch = _torch()
    x = rng.standard_normal((4, 3, 5)) * 2 + 1
    w = rng.standard_normal((3,)) + 1
    b = rng.standard_normal((3,))
    g = rng.standard_normal((4, 3, 5))
    rm0, rv0 = rng.standard_normal((3,)), rng.random((3,)) + 0.5
    res = []
    for d in (local, remote):
        rm, rv = d.tensor(rm0), d.tensor(rv0)
        y, (gx, gw, gb) = _fwd_bwd(
            d, lambda xt, wt, bt: dispatch.batch_norm(
                xt, rm, rv, wt, bt, training=training, momentum=0.2),
            [x, w, b], g)
        res.append((y, gx, gw, gb, rm.numpy(), rv.numpy()))
    for a, c in zip(*res):
        assert np.array_equal(a, c)
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    trm, trv = torch.tensor(rm0), torch.tensor(rv0)
    ty = torch.nn.functional.batch_norm(ts[0], trm, trv, ts[1], ts[2],
                                        training=training, momentum=0.2)
    (ty * torch.tensor(g)).sum().backward()
    want = [ty.detach().numpy()] + [t.grad.numpy() for t in ts] + \
        [trm.numpy(), trv.numpy()]
    for got, w_ in zip(res[0], want):
        np.testing.assert_allclose(got, w_, rtol=1e-12, atol=1e-12)
    with pytest.raises(dispatch.EINVAL, match="needs running_mean"):
        dispatch.batch_norm(local.tensor(x), None, None)
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


@pytest.mark.parametrize("tq,tk", [(3, 5), (6, 4)])
def test_attention_causal_alignment_is_torchs(local, tq, tk):
    """torch 1.13 has no public scaled_dot_product_attention; its private
    one's is_causal is top-left aligned when Tq != Tk, as ours."""
    torch = pytest.importorskip("torch")
    sdpa = getattr(torch.nn.functional, "_scaled_dot_product_attention", None)
    if sdpa is None:
        pytest.skip("torch without _scaled_dot_product_attention")
    q = rng.standard_normal((2, 2, tq, 4))
    k, v = rng.standard_normal((2, 2, tk, 4)), rng.standard_normal((2, 2, tk, 3))
    got = dispatch.attention(local.tensor(q), local.tensor(k), local.tensor(v),
                             is_causal=True).numpy()
    want = sdpa(*(torch.from_numpy(x) for x in (q, k, v)), None, 0.0, False,
                True)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_attention_errors(local):
    q = local.tensor(np.zeros((1, 1, 2, 3), np.float32))
    with pytest.raises(dispatch.EDTYPE):  # v of another dtype
        dispatch.attention(q, q, local.tensor(np.zeros((1, 1, 2, 3))))
    with pytest.raises(dispatch.ESHAPE):
        dispatch.attention(q, q, q, key_mask=[[True, False, True]])


# issue 23: the gradients of the new ops and of maximum's ties, LOCAL and
# REMOTE bit for bit, against their formulas

def _grad(dev, fn, x, *rest):
    t = dev.tensor(x, requires_grad=True)
    w = dev.tensor(np.linspace(-1, 1, x.size).reshape(x.shape))
    (fn(t, *rest) * w).sum().backward()
    return t.grad.numpy(), np.linspace(-1, 1, x.size).reshape(x.shape)


def test_issue23_gradients(local, remote):
    x = np.array([[-2.0, -0.5, 0.0, 0.7], [1.0, 3.0, 25.0, -1.0]])
    k = np.sqrt(2 / np.pi)
    th = np.tanh(k * (x + 0.044715 * x ** 3))
    cases = [
        (lambda t: t.clamp(-0.5, 1.0),  # both bounds pass the gradient
         ((x >= -0.5) & (x <= 1.0)).astype(float)),
        (lambda t: t.masked_fill(x > 0.5, 9.0), (x <= 0.5).astype(float)),
        (dispatch.softplus, np.where(x > 20, 1.0, 1 / (1 + np.exp(-x)))),
        (dispatch.gelu_tanh, 0.5 * (1 + th) + 0.5 * x * (1 - th ** 2) * k
         * (1 + 3 * 0.044715 * x ** 2)),
    ]
    for fn, dfdx in cases:
        gl, w = _grad(local, fn, x)
        gr, _ = _grad(remote, fn, x)
        assert np.array_equal(gl, gr)
        np.testing.assert_allclose(gl, w * dfdx, rtol=1e-12, atol=1e-15)
    # var / std over dim 1 (keepdim, so the weights broadcast): 2 (x -
    # mean) / (N - 1), and that over 2 std
    m = x.mean(1, keepdims=True)
    sd = x.std(1, ddof=1, keepdims=True)
    for fn, dfdx in ((lambda t: t.var(1, keepdim=True), 2 * (x - m) / 3),
                     (lambda t: t.std(1, keepdim=True), (x - m) / (3 * sd))):
        for d in (local, remote):
            t = d.tensor(x, requires_grad=True)
            wr = np.array([[0.5], [-2.0]])
            (fn(t) * d.tensor(wr)).sum().backward()
            np.testing.assert_allclose(t.grad.numpy(), wr * dfdx, rtol=1e-12,
                                       atol=1e-15)
    # maximum / minimum split a tie's gradient evenly, as PyTorch
    for d in (local, remote):
        a = d.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        b = d.tensor(np.array([1.0, 5.0, 0.0]), requires_grad=True)
        (dispatch.maximum(a, b) + dispatch.minimum(a, b) * 2).sum().backward()
        assert np.array_equal(a.grad.numpy(), [1.5, 2.0, 1.0])
        assert np.array_equal(b.grad.numpy(), [1.5, 1.0, 2.0])


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
