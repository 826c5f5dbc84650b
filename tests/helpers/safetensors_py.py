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

DTYPES = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "BOOL": "|b1"}


def expected():
    return {
        "w": ((np.arange(12) - 5) * 0.25).astype("<f4").reshape(3, 4),
        "b": (np.arange(5) / 3.0).astype("<f8"),
        "idx": (np.arange(6, dtype="<i8") * 1000003 - 7).reshape(2, 3),
        "mask": (np.arange(7) % 3 == 0),
        "empty": np.zeros((0, 4), dtype="<f4"),
        "scalar": np.array(42.5, dtype="<f4"),
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
        if not np.array_equal(arr, want[name]):
            sys.exit("%s: values %r, want %r" % (name, arr, want[name]))
    if end != len(data):
        sys.exit("data section has %d bytes, offsets cover %d" % (len(data), end))
    print("python read %d tensors: %s" % (len(header), " ".join(sorted(header))))


def write(path):
    want = expected()
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
