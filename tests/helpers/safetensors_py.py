#!/usr/bin/python3
"""An independent safetensors reader and writer (json + numpy only) that
tests/test_checkpoint.c runs against dispatch's checkpoints.

  safetensors_py.py read FILE   checks FILE holds exactly the tensors of
                                expected() with their values; exit 0 if so
  safetensors_py.py write FILE  writes expected() to FILE, header keys in
                                another order than the data, with metadata

The tensors and their values must match interop_tensors() in
tests/test_checkpoint.c.
"""
import json
import struct
import sys

import numpy as np

# BF16 has no numpy dtype: its values are kept as their raw 2-byte
# patterns (uint16), as the dispatch package keeps them
DTYPES = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "BOOL": "|b1",
          "F16": "<f2", "BF16": "<u2"}

# bf16 bits of 1, -3.140625, the largest finite bf16, -inf
BF16_BITS = [0x3F80, 0xC049, 0x7F7F, 0xFF80]


def bf16_from_torch():
    """The bf16 tensor as torch makes it when torch is importable (its bits
    must be BF16_BITS), else from the bits themselves: the writer's, so a
    file laid out with torch's bf16 bits is what dispatch reads."""
    bits = np.array(BF16_BITS, dtype="<u2")
    try:
        import torch
    except ImportError:
        return bits
    vals = [1.0, -3.140625, 3.3895313892515355e38, float("-inf")]
    t = torch.tensor(vals, dtype=torch.bfloat16).view(torch.int16)
    got = t.numpy().view("<u2")
    if not np.array_equal(got, bits):
        sys.exit("torch's bf16 bits %r, want %r" % (got, bits))
    return got


def expected():
    return {
        "w": ((np.arange(12) - 5) * 0.25).astype("<f4").reshape(3, 4),
        "b": (np.arange(5) / 3.0).astype("<f8"),
        "idx": (np.arange(6, dtype="<i8") * 1000003 - 7).reshape(2, 3),
        "mask": (np.arange(7) % 3 == 0),
        "empty": np.zeros((0, 4), dtype="<f4"),
        "scalar": np.array(42.5, dtype="<f4"),
        # numpy's own float16 rounding: 1/3 -> 0x3555, nan -> 0x7e00
        "half": np.array([1, -2.5, 65504, 2.0 ** -24, -0.0, np.inf, np.nan,
                          1 / 3], dtype="<f2").reshape(2, 4),
        "brain": np.array(BF16_BITS, dtype="<u2"),
    }


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    if meta.get("format") != "dispatch":
        sys.exit("metadata %r lacks format=dispatch" % (meta,))
    want = expected()
    if sorted(header) != sorted(want):
        sys.exit("names %s, want %s" % (sorted(header), sorted(want)))
    end = 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        b, e_ = e["data_offsets"]
        if b != end:
            sys.exit("%s starts at %d, previous data ends at %d" % (name, b, end))
        end = e_
        arr = np.frombuffer(data[b:e_], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        if arr.dtype != want[name].dtype or arr.shape != want[name].shape:
            sys.exit("%s: %s %s, want %s %s" % (name, arr.dtype, arr.shape,
                                                want[name].dtype, want[name].shape))
        # bytes, not values: NaN and -0 must come back as the same bits
        if arr.tobytes() != want[name].tobytes():
            sys.exit("%s: values %r, want %r" % (name, arr, want[name]))
    if end != len(data):
        sys.exit("data section has %d bytes, offsets cover %d" % (len(data), end))
    print("python read %d tensors: %s" % (len(header), " ".join(sorted(header))))


def write(path):
    want = expected()
    want["brain"] = bf16_from_torch()
    rev = {v: k for k, v in DTYPES.items()}
    # data in reverse name order, header keys in name order: a reader must
    # follow the offsets, not the key order
    header, chunks, off = {}, [], 0
    for name in sorted(want, reverse=True):
        raw = want[name].tobytes()
        header[name] = {"dtype": rev[want[name].dtype.str], "shape": list(want[name].shape),
                        "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    header = dict(sorted(header.items()))
    header["__metadata__"] = {"writer": "numpy"}
    js = json.dumps(header).encode("utf-8")
    js += b" " * (-len(js) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)))
        f.write(js)
        for c in chunks:
            f.write(c)
    print("python wrote %d tensors" % len(want))


if __name__ == "__main__":
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2])
