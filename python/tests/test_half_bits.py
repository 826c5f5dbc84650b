"""The C library's half conversions against numpy and torch, bit for bit.

dispatch_cast on a LOCAL device (through the library's C functions: cffi,
raw bytes) turns structured f32 and f64 patterns (every exponent, the
rounding points of both formats, NaNs, infinities, subnormals) into f16
and bf16; numpy's float16 and torch's bfloat16 are the references. NaN
payloads differ between libraries (torch drops the sign of a bf16 NaN),
so a NaN is checked as a NaN of the same kind, every other value bit for
bit. f64 -> f16 is numpy's direct conversion (one rounding), which the
library matches; there is no f64 -> bf16 in torch without a first
rounding to f32, so that pair is left to tests/test_half.c's oracle."""
import numpy as np
import pytest

from dispatch._lib import ffi, lib

F16, BF16, F32, F64 = lib.DISPATCH_F16, lib.DISPATCH_BF16, lib.DISPATCH_F32, lib.DISPATCH_F64


def patterns():
    fr = np.array([0, 1, 2, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x400001, 0x1000, 0xFFF,
                   0x1001, 0x3000, 0x2000, 0x8000, 0x7FFF, 0x8001, 0x18000,
                   0x17FFF, 0x18001, 0x10000, 0x7FE000, 0x7FF000, 0x7FEFFF,
                   0x7FF001], dtype=np.uint32)
    e = np.arange(256, dtype=np.uint32)
    bits = ((e[:, None] << 23) | fr[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    rng = np.random.default_rng(24)
    bits = np.concatenate([bits, rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)])
    return bits.view(np.float32)


def local_cast(x, src, dst, out_dtype):
    """x (numpy, of dtype src) cast to dst on a LOCAL device; the raw result."""
    dev = ffi.new("dispatch_device **")
    err = ffi.new("char[256]")
    assert lib.dispatch_device_open(b"local", ffi.NULL, dev, err, 256) == 0
    try:
        shape = ffi.new("int64_t[1]", [x.size])
        t = ffi.new("dispatch_tensor **")
        y = ffi.new("dispatch_tensor **")
        buf = np.ascontiguousarray(x)
        assert lib.dispatch_tensor_from_data(dev[0], src, 1, shape, ffi.from_buffer(buf),
                                             buf.nbytes, t) == 0
        assert lib.dispatch_cast(t[0], dst, y) == 0, ffi.string(lib.dispatch_device_errmsg(dev[0]))
        out = np.empty(x.size, dtype=out_dtype)
        assert lib.dispatch_tensor_read(y[0], ffi.from_buffer(out), out.nbytes) == 0
        lib.dispatch_tensor_free(y[0])
        lib.dispatch_tensor_free(t[0])
        return out
    finally:
        lib.dispatch_device_close(dev[0])


def check(got_bits, want_bits, want_nan, what):
    bad = np.nonzero(~want_nan & (got_bits != want_bits))[0]
    assert bad.size == 0, f"{what}: {bad.size} differ, first input #{bad[0]}: " \
        f"{got_bits[bad[0]]:#06x} want {want_bits[bad[0]]:#06x}"


def test_f32_to_f16_matches_numpy():
    x = patterns()
    got = local_cast(x, F32, F16, np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    check(got, want.view(np.uint16), nan, "f32 -> f16")
    assert np.all((got[nan] & 0x7C00) == 0x7C00) and np.all(got[nan] & 0x03FF)
    assert np.array_equal(got[nan] >> 15, (x[nan].view(np.uint32) >> 31).astype(np.uint16))


def test_f64_to_f16_matches_numpy_rounding_once():
    with np.errstate(invalid="ignore"):  # signalling NaNs
        x = patterns().astype(np.float64)
    x = np.concatenate([x, np.nextafter(x, np.inf), np.nextafter(x, -np.inf)])
    got = local_cast(x, F64, F16, np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    check(got, want, np.isnan(x), "f64 -> f16")


def test_f16_to_f32_every_pattern_matches_numpy():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = local_cast(h, F16, F32, np.float32)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.all(np.isnan(got[nan]))


def test_f32_to_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    x = patterns()
    got = local_cast(x, F32, BF16, np.uint16)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    check(got, want, nan, "f32 -> bf16")
    assert np.all((got[nan] & 0x7FC0) == 0x7FC0)
    back = local_cast(got, BF16, F32, np.float32)
    tback = torch.from_numpy(want.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert np.array_equal(back[~nan].view(np.uint32), tback[~nan].view(np.uint32))
