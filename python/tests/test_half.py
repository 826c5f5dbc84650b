"""The half dtypes in Python: dispatch.float16 is numpy's float16 in and
out; dispatch.bfloat16 tensors read as raw uint16 values, with
bf16_to_f32 / f32_to_bf16 to convert (round to nearest even, checked
against torch 1.13's bits when torch is importable); .half(),
.bfloat16(), .float() and .to(dtype) as torch's; torch's promotion
between the float dtypes; every bit pattern survives a round trip on
local and remote devices alike."""
import numpy as np
import pytest

import dispatch
from dispatch._core import _promote_types

try:
    import torch
except ImportError:  # the torch comparisons are skipped, not the rest
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not importable")


def f32_specials():
    """float32 values that exercise the rounding: ties to even both ways,
    just above and below a tie, subnormals of f32 (bf16's too), values
    that round up past the largest finite half, infinities, signed zero,
    and random values of every exponent."""
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties, near
            0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals
            0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,  # near max
            0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
            0x477FF000, 0x477FEFFF, 0x33800000, 0x33000000,  # f16 edges
            0x33000001, 0x387FC000, 0x38800000]
    rng = np.random.default_rng(24)
    rnd = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    a = np.concatenate([np.array(bits, np.uint32), rnd]).view(np.float32)
    return a[~np.isnan(a)]


def test_dtypes_are_named_and_sized():
    assert dispatch.float16 == np.float16 and dispatch.half is dispatch.float16
    assert dispatch.bfloat16.name == "bfloat16"
    assert dispatch.bfloat16.itemsize == 2 and dispatch.bfloat16.kind == "f"
    assert repr(dispatch.bfloat16) == "dispatch.bfloat16"
    assert dispatch.bfloat16 != np.uint16  # never mistaken for an integer
    t = dispatch.tensor(np.zeros(3, np.float16), device="local")
    assert t.dtype == dispatch.float16 and t.numpy().dtype == np.float16
    with pytest.raises(TypeError, match="bfloat16"):
        dispatch.tensor(np.zeros(2, np.uint16), device="local")


def test_bf16_helpers_round_to_nearest_even():
    # exact cases by hand: a tie goes to the even neighbour
    assert dispatch.f32_to_bf16(np.array([1 + 2 ** -8], np.float32))[0] \
        == 0x3F80
    assert dispatch.f32_to_bf16(np.array([1 + 3 * 2 ** -8], np.float32))[0] \
        == 0x3F82
    assert dispatch.f32_to_bf16([np.float32(3.4e38)])[0] == 0x7F80  # inf
    back = dispatch.bf16_to_f32(np.array([0x3F80, 0xC049, 0x0001], np.uint16))
    assert back.dtype == np.float32
    assert back.tolist() == [1.0, -3.140625, np.float32(2.0 ** -133)]
    nan = dispatch.f32_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(dispatch.bf16_to_f32(nan)).all()
    assert (nan >> 15).tolist() == [0, 1], "a NaN keeps its sign"
    with pytest.raises(TypeError, match="uint16"):
        dispatch.bf16_to_f32(np.zeros(2, np.float32))


@needs_torch
def test_bf16_helpers_match_torch_bits():
    x = f32_specials()
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy() \
        .view(np.uint16)
    got = dispatch.f32_to_bf16(x)
    assert got.dtype == np.uint16
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got[i]),
                            hex(want[i])) for i in bad[:5]]
    wide = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float()
    assert dispatch.bf16_to_f32(got).tobytes() == wide.numpy().tobytes()


def test_float16_round_trip_is_bit_exact(dev):
    bits = np.array([0x3C00, 0xC100, 0x7BFF, 0x0001, 0x8000, 0x7C00, 0xFC00,
                     0x7E00, 0x7D01, 0x3555], np.uint16)
    t = dev.tensor(bits.view(np.float16).reshape(2, 5))
    assert t.dtype == dispatch.float16 and t.shape == (2, 5)
    assert t.numpy().view(np.uint16).tobytes() == bits.tobytes()


def test_bfloat16_takes_raw_values_or_numbers(dev):
    raw = np.array([0x3F80, 0xC049, 0x7F7F, 0xFF80, 0x7FC1, 0x0001], np.uint16)
    t = dev.tensor(raw, dtype=dispatch.bfloat16)
    assert t.dtype is dispatch.bfloat16
    got = t.numpy()
    assert got.dtype == np.uint16 and got.tobytes() == raw.tobytes()
    n = dev.tensor([1.0, -3.140625, 2.5], dtype="bfloat16")
    assert n.numpy().tolist() == [0x3F80, 0xC049, 0x4020]
    assert n.tolist() == [1.0, -3.140625, 2.5]  # values, not bits
    assert dev.tensor([0.5], dtype=dispatch.bfloat16)[0].item() == 0.5
    s = n.sum()
    assert s.shape == () and s.dtype is dispatch.bfloat16
    assert repr(s).startswith("tensor(0.359375,") and s.item() == 0.359375
    assert dispatch.bf16_to_f32(np.uint16(0x3F80)).shape == ()
    assert "dtype=dispatch.bfloat16" in repr(n) and "3.14" in repr(n)


def values(dev):
    return dev.tensor(f32_specials()[:600])


def test_half_and_bfloat16_methods_round_as_numpy_and_torch(dev):
    x = values(dev)
    xs = x.numpy()
    h = x.half()
    assert h.dtype == dispatch.float16
    # numpy's float32 -> float16 rounds to nearest even too
    with np.errstate(over="ignore"):  # past 65504: inf, as intended
        assert h.numpy().tobytes() == xs.astype(np.float16).tobytes()
    b = x.bfloat16()
    assert b.dtype is dispatch.bfloat16
    assert b.numpy().tobytes() == dispatch.f32_to_bf16(xs).tobytes()
    assert b.float().numpy().tobytes() == \
        dispatch.bf16_to_f32(b.numpy()).tobytes()
    assert h.float().numpy().tobytes() == \
        h.numpy().astype(np.float32).tobytes()
    assert x.to(dispatch.bfloat16).numpy().tobytes() == b.numpy().tobytes()
    assert x.to("float16").numpy().tobytes() == h.numpy().tobytes()
    assert h.half() is h and b.bfloat16() is b
    assert x.to("half").dtype == dispatch.float16


@needs_torch
def test_casts_match_torch_bits(dev):
    xs = f32_specials()
    x = dev.tensor(xs)
    tx = torch.from_numpy(xs)
    assert x.half().numpy().tobytes() == tx.half().numpy().tobytes()
    assert x.bfloat16().numpy().tobytes() == \
        tx.bfloat16().view(torch.int16).numpy().tobytes()
    d = dev.tensor(xs.astype(np.float64) * (1 + 2.0 ** -30))
    # float64 -> half rounds once from the float64 (torch goes through
    # float32 on the CPU: the two differ only where float32 lands on a tie)
    got = d.half().numpy()
    with np.errstate(over="ignore"):
        want = np.array([np.float16(v) for v in d.numpy()], np.float16)
    assert got.tobytes() == want.tobytes()


def test_promotion_is_torch_s():
    f16, bf16 = dispatch.float16, dispatch.bfloat16
    f32, f64, i64, b = (dispatch.float32, dispatch.float64, dispatch.int64,
                        dispatch.bool_)
    assert _promote_types(f16, f32) == f32
    assert _promote_types(bf16, f64) == f64
    assert _promote_types(f16, bf16) == f32
    assert _promote_types(bf16, f16) == f32
    assert _promote_types(i64, bf16) is bf16
    assert _promote_types(f16, b) == f16
    if torch is not None:
        td = {f16: torch.float16, bf16: torch.bfloat16, f32: torch.float32,
              f64: torch.float64, i64: torch.int64, b: torch.bool}
        back = {v: k for k, v in td.items()}
        for x in td:
            for y in td:
                assert _promote_types(x, y) == \
                    back[torch.promote_types(td[x], td[y])], (x, y)


def test_operators_promote_mixed_float_dtypes(dev):
    h = dev.tensor(np.array([1.5, -2.0], np.float16))
    b = dev.tensor([0.25, 4.0], dtype=dispatch.bfloat16)
    f = dev.tensor(np.array([1.0, 1.0], np.float32))
    s = h + f
    assert s.dtype == dispatch.float32 and s.tolist() == [2.5, -1.0]
    m = h * b
    assert m.dtype == dispatch.float32 and m.tolist() == [0.375, -8.0]


def test_checkpoint_keeps_torch_bf16_state(local, tmp_path):
    """A bfloat16 state dict written the way torch's safetensors writes it
    (raw values, "BF16") loads as bfloat16 with the same bits, and saves
    back identically."""
    import json
    import struct
    raw = np.array([[0x3F80, 0xC049], [0x7F7F, 0x0001]], np.uint16)
    if torch is not None:  # the bits torch itself gives these values
        tv = torch.tensor([[1.0, -3.140625], [3.3895313892515355e38,
                                              9.183549615799121e-41]],
                          dtype=torch.bfloat16)
        assert tv.view(torch.int16).numpy().view(np.uint16).tobytes() == \
            raw.tobytes()
    h = np.array([0.1, 65504], np.float16)
    hdr = {"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
           "h": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]}}
    js = json.dumps(hdr).encode()
    js += b" " * (-len(js) % 8)
    path = tmp_path / "torch.safetensors"
    path.write_bytes(struct.pack("<Q", len(js)) + js + raw.tobytes() +
                     h.tobytes())
    back = dispatch.load(path, local)
    assert back["w"].dtype is dispatch.bfloat16
    assert back["w"].numpy().tobytes() == raw.tobytes()
    assert back["h"].dtype == dispatch.float16
    assert back["h"].numpy().tobytes() == h.tobytes()
    dispatch.save(tmp_path / "again.safetensors", back)
    again = dispatch.load(tmp_path / "again.safetensors", local)
    assert again["w"].numpy().tobytes() == raw.tobytes()


def test_captured_graph_takes_and_gives_half(dev):
    """A captured step with a float16 input and a bfloat16 output: a replay
    takes numpy float16 and raw bfloat16 values, and gives raw uint16
    values, the same bits as the step run op by op."""
    def run(h, b):
        y = (h.float() * 2 + b.float()).bfloat16()
        return y

    h0 = np.array([1.5, -0.1, 3e4], np.float16)
    b0 = dispatch.f32_to_bf16([0.5, 0.25, 1e30])
    with dev.capture() as g:
        with dev.scope():
            y = run(dev.tensor(h0), dev.tensor(b0, dtype=dispatch.bfloat16))
            g.output(y)
    h1 = np.array([0.125, 7, -65504], np.float16)
    b1 = dispatch.f32_to_bf16([1, -1, 2.5])
    (got,) = g.replay(h1, b1)
    assert got.dtype == np.uint16
    want = run(dev.tensor(h1), dev.tensor(b1, dtype=dispatch.bfloat16))
    assert got.tobytes() == want.numpy().tobytes()
    assert dispatch.bf16_to_f32(got).tolist() == [1.25, 13.0, -131072.0]


def test_assignment_norms_and_numbers_take_bfloat16(dev):
    """The package's own number-to-tensor paths (t[k] = v, as_tensor(like=),
    rms_norm's default eps) know bfloat16, which numpy has no dtype for."""
    b = dev.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dispatch.bfloat16)
    b[0, 0] = 5
    assert b.dtype is dispatch.bfloat16 and b.tolist() == [[5, 2], [3, 4]]
    assert dispatch.as_tensor(2.5, like=b).dtype is dispatch.bfloat16
    r = dispatch.nn.functional.rms_norm(b, (2,))
    want = dispatch.nn.functional.rms_norm(b.float(), (2,), eps=2.0 ** -7)
    assert r.dtype is dispatch.bfloat16
    assert r.numpy().tobytes() == want.bfloat16().numpy().tobytes()
    h = dev.tensor(np.ones((2, 2), np.float16))
    h[1] = 3
    assert h.numpy().tolist() == [[1, 1], [3, 3]]
