"""dispatch.GradScaler (loss scaling inside the optimizer step) and
dispatch.autocast: a scaled run has the unscaled run's bits, an inf or
NaN gradient skips the step and halves the scale, the scale grows after
growth_interval clean steps, and autocast sets and restores the device's
policy."""
import numpy as np
import pytest

import dispatch
from dispatch._lib import ffi, lib

P0 = np.array([1.0, -2.0, 0.5, 0.25], np.float32)
C = np.array([0.3, -0.7, 2.0, 1.5], np.float32)


def _run(dev, steps, scaler=None, poison_at=-1, poison=np.inf):
    p = dev.tensor(P0.copy(), requires_grad=True)
    opt = dispatch.AdamW([p], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1,
                         clip=1.0)
    for s in range(steps):
        c = C.copy()
        if s == poison_at:
            c[0] = poison
        loss = (p * p * dev.tensor(c)).sum()
        if scaler is not None:
            loss = scaler.scale(loss)
        grads = loss.backward()
        if scaler is not None:
            scaler.step(opt, grads)
            scaler.update()
        else:
            opt.step(grads)
    return p.numpy(), opt


def test_scaled_run_has_the_unscaled_bits(dev):
    want, _ = _run(dev, 5)
    scaler = dispatch.GradScaler(init_scale=1024.0, growth_interval=1000)
    got, _ = _run(dev, 5, scaler)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert scaler.get_scale() == 1024.0
    assert scaler.skipped_steps == 0


@pytest.mark.parametrize("poison", [np.inf, np.nan])
def test_non_finite_gradient_skips_the_step(dev, poison):
    before, _ = _run(dev, 2)
    scaler = dispatch.GradScaler()
    got, _ = _run(dev, 3, scaler, poison_at=2, poison=poison)
    assert np.array_equal(got.view(np.uint32), before.view(np.uint32))
    assert scaler.get_scale() == 32768.0
    assert scaler.skipped_steps == 1
    # the step after the skip is the clean run's third (Adam's t too)
    clean, _ = _run(dev, 3)
    scaler = dispatch.GradScaler()
    after, _ = _run(dev, 4, scaler, poison_at=2, poison=poison)
    assert np.array_equal(after.view(np.uint32), clean.view(np.uint32))


def test_scale_grows_after_interval(dev):
    scaler = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    assert scaler.get_scale() == 8.0  # before any step: init_scale
    _run(dev, 2, scaler)
    assert scaler.get_scale() == 8.0
    scaler = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    _run(dev, 3, scaler)
    assert scaler.get_scale() == 16.0


def test_scaler_state_survives_a_checkpoint(dev, tmp_path):
    """3 steps (a skip at step 1), save, load into a new optimizer and a
    scaler attached before the load, 4 more: the bits, scale and skip
    count of 7 steps straight; the scale is not a model tensor."""
    scaler = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    want, _ = _run(dev, 7, scaler, poison_at=1)
    scaler = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    p = dev.tensor(P0.copy(), requires_grad=True)
    opt = dispatch.AdamW([p], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1,
                         clip=1.0)

    def step(p, opt, scaler, poison=False):
        c = C.copy()
        if poison:
            c[0] = np.inf
        loss = scaler.scale((p * p * dev.tensor(c)).sum())
        scaler.step(opt, loss.backward())
        scaler.update()

    for s in range(3):
        step(p, opt, scaler, s == 1)
    path = tmp_path / "ck.safetensors"
    dispatch.save(path, {"p": p}, optimizer=opt)
    state = dispatch.load(path, dev)
    assert list(state) == ["p"]
    p = state["p"].track()
    opt = dispatch.AdamW([p], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1,
                         clip=1.0)
    scaler = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    scaler.attach(opt)
    dispatch.load(path, dev, optimizer=opt)
    for s in range(3, 7):
        step(p, opt, scaler)
    assert np.array_equal(p.numpy().view(np.uint32), want.view(np.uint32))
    assert scaler.skipped_steps == 1
    straight = dispatch.GradScaler(init_scale=8.0, growth_interval=3)
    _run(dev, 7, straight, poison_at=1)
    assert scaler.get_scale() == straight.get_scale()


def test_scaler_errors_and_disabled(local):
    with pytest.raises(ValueError):
        dispatch.GradScaler(backoff_factor=0.0)
    scaler = dispatch.GradScaler(enabled=False)
    want, _ = _run(local, 2)
    got, _ = _run(local, 2, scaler)
    assert np.array_equal(got, want)
    assert scaler.get_scale() == 1.0
    scaler = dispatch.GradScaler()
    _, opt = _run(local, 1, scaler)
    p = local.tensor(P0.copy(), requires_grad=True)
    other = dispatch.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        scaler.step(other, ((p * p).sum()).backward())
    with pytest.raises(NotImplementedError):
        scaler.update(new_scale=2.0)
    with pytest.raises(NotImplementedError):
        scaler.unscale_(opt)


def _policy(dev):
    """The device's autocast dtype code (set back as it was)."""
    prev = ffi.new("dispatch_dtype *")
    h = dev._state.h
    assert lib.dispatch_autocast(h, lib.DISPATCH_F32, prev) == 0
    assert lib.dispatch_autocast(h, prev[0], ffi.NULL) == 0
    return prev[0]


def test_autocast_sets_and_restores(local):
    assert _policy(local) == lib.DISPATCH_F32
    with dispatch.autocast(dtype="bfloat16", device=local):
        assert _policy(local) == lib.DISPATCH_BF16
        with dispatch.autocast(dtype=np.float16, device=local):
            assert _policy(local) == lib.DISPATCH_F16
        with dispatch.autocast(enabled=False, device=local):
            assert _policy(local) == lib.DISPATCH_F32
        assert _policy(local) == lib.DISPATCH_BF16
    assert _policy(local) == lib.DISPATCH_F32
    with dispatch.autocast(dtype="float16"):  # every open device
        assert _policy(local) == lib.DISPATCH_F16
    assert _policy(local) == lib.DISPATCH_F32
    with pytest.raises(TypeError, match="not bfloat16"):
        dispatch.autocast(dtype=np.int64)


def test_autocast_leaves_f64_matmul_alone(dev):
    a = dev.tensor(np.eye(2))
    with dispatch.autocast(dtype="bfloat16", device=dev):
        y = a @ a
    assert y.dtype == np.float64
    assert np.array_equal(y.numpy(), np.eye(2))


@pytest.mark.skipif(not hasattr(dispatch, "bfloat16"),
                    reason="this package has no half dtypes (issue 24's "
                    "Python half support)")
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_autocast_matmul_in_half_grads_in_f32(dev, half):
    x = dev.tensor(np.array([[1.0, 2.0]], np.float32))
    w = dev.tensor(np.array([[0.5], [0.25]], np.float32), requires_grad=True)
    with dispatch.autocast(dtype=half, device=dev):
        y = x @ w
        assert y.dtype == getattr(dispatch, half)
        loss = y.sum()
    assert loss.dtype == np.float32
    grads = loss.backward()
    assert grads[w].dtype == np.float32
    assert grads[w].numpy().tolist() == [[1.0], [2.0]]
