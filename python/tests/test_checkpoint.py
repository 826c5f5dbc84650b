"""dispatch.save / dispatch.load: bit-exact round trips of every dtype,
the safetensors layout as an independent json + numpy reader sees it,
files exchanged with a C program (build/tests/ckpt_tool, tests/ckpt_tool.c)
both ways with Adam's state, a run saved, killed, loaded in a fresh
process and resumed bit-identically, and the errors."""
import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

import dispatch
from conftest import PACKAGE_ENV, ROOT

TOOL = os.environ.get("DISPATCH_CKPT_TOOL") or \
    str(ROOT / "build" / "tests" / "ckpt_tool")
RESUME = str(pathlib.Path(__file__).with_name("ckpt_resume.py"))


def spec_of(dev):
    return "local" if dev.kind == "local" else dev.spec


def sample(dev):
    return {
        "f32": dev.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 7),
        "f64": dev.tensor(np.array([np.pi, -0.0, 1e-300])),
        "i64": dev.tensor(np.array([[-(2 ** 62), 5]], np.int64)),
        "mask": dev.tensor(np.array([True, False, True])),
        "scalar": dev.tensor(np.float32(2.5)),
        "empty": dev.zeros((0, 3)),
        # the half dtypes: numpy's float16 (a subnormal, -0, inf, NaN) and
        # bfloat16's raw values (1, -inf, a NaN with payload, a subnormal)
        "f16": dev.tensor(np.array([1 / 3, 2.0 ** -24, -0.0, np.inf, np.nan],
                                   np.float16)),
        "bf16": dev.tensor(np.array([0x3F80, 0xFF80, 0x7FC1, 0x0001],
                                    np.uint16), dtype=dispatch.bfloat16),
    }


def test_round_trip_is_bit_exact_in_order(dev, tmp_path):
    ts = sample(dev)
    path = tmp_path / "m.safetensors"
    dispatch.save(path, ts)
    back = dispatch.load(path, dev)
    assert list(back) == list(ts)
    for k, t in ts.items():
        a, b = t.numpy(), back[k].numpy()
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        assert a.tobytes() == b.tobytes(), k
        assert back[k].device is dev and not back[k].requires_grad


def test_file_is_safetensors_as_json_and_numpy_read_it(local, tmp_path):
    ts = sample(local)
    ts["w"] = local.ones((2, 2)).track()  # a tracked tensor: its value
    path = tmp_path / "m.safetensors"
    dispatch.save(str(path), ts)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    np_dtype = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "BOOL": "?",
                "F16": "<f2", "BF16": "<u2"}
    for k, t in ts.items():
        e = header[k]
        begin, end = e["data_offsets"]
        got = np.frombuffer(data[begin:end], np_dtype[e["dtype"]]) \
            .reshape(e["shape"])
        assert got.tobytes() == t.numpy().tobytes() and got.shape == t.shape, k
    assert header["w"]["dtype"] == "F32"
    assert (header["f16"]["dtype"], header["bf16"]["dtype"]) == ("F16", "BF16")


def test_a_list_is_saved_under_its_indices(local, tmp_path):
    a, b = local.ones((2,)), local.zeros((3,))
    dispatch.save(tmp_path / "l.safetensors", [a, b])
    back = dispatch.load(tmp_path / "l.safetensors", local)
    assert list(back) == ["0", "1"]
    assert back["1"].shape == (3,)


def run(*args, env=None):
    if not os.path.exists(TOOL) and args[0] == TOOL:
        pytest.fail(f"{TOOL} is missing: make {os.path.relpath(TOOL, ROOT)}"
                    " (make python-test builds it)")
    r = subprocess.run(list(args), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, f"{args}: {r.stdout}\n{r.stderr}"
    return r.stdout.splitlines()


def entries(lines):
    """ckpt_tool's NAME DTYPE SHAPE HEX lines (and loss lines) as a dict."""
    out = {}
    for line in lines:
        f = line.split()
        if f[0] == "loss":
            out[f"loss {f[1]}"] = f[2]
        elif f[0] == "meta":
            out[f"meta {f[1]}"] = f[2]
        else:
            out[f[0]] = (f[1], f[2], f[3])
    return out


def as_entry(a):
    names = {np.float32: "F32", np.float64: "F64", np.int64: "I64",
             np.bool_: "BOOL"}
    shape = "x".join(map(str, a.shape)) or "-"
    return (names[a.dtype.type], shape, a.tobytes().hex())


# ckpt_tool's model (tests/ckpt_tool.c), built from the same numbers
def c_model(dev):
    x = dev.tensor((np.arange(8) % 5 * np.float32(0.5) - np.float32(1))
                   .astype(np.float32).reshape(2, 4))
    w = dev.tensor((np.arange(12) % 7 * np.float32(0.25) - np.float32(0.5))
                   .astype(np.float32).reshape(4, 3)).track()
    b = dev.tensor(np.float32(0.1) * np.arange(3, dtype=np.float32)).track()
    return x, w, b


def c_train(x, w, b, opt, n):
    losses = []
    for _ in range(n):
        y = x @ w + b
        loss = (y * y).sum()
        opt.step(loss.backward())
        losses.append(np.float32(loss.item()).tobytes().hex())
    return losses


def test_python_writes_c_reads_and_resumes_adam(dev, tmp_path):
    path = str(tmp_path / "py.safetensors")
    x, w, b = c_model(dev)
    opt = dispatch.Adam([w, b], lr=0.01)
    c_train(x, w, b, opt, 3)
    dispatch.save(path, {"w": w, "b": b}, optimizer=opt)
    # every entry as C reads it: the same bytes as here
    got = entries(run(TOOL, "dump", spec_of(dev), path))
    mine = dispatch.load(path, dev)
    assert set(got) == {"w", "b", "optim.0.m", "optim.0.v", "optim.1.m",
                        "optim.1.v", "optim.step", "meta dispatch.optim"}
    assert got["meta dispatch.optim"] == "adam"
    assert got["w"] == as_entry(w.numpy()) == as_entry(mine["w"].numpy())
    assert got["b"] == as_entry(b.numpy())
    assert got["optim.step"] == as_entry(np.array(3, np.int64))
    assert got["optim.0.m"][:2] == ("F32", "4x3")
    # C goes on from Python's file: the same bits as Python going on
    c = entries(run(TOOL, "resume", spec_of(dev), path, "2"))
    losses = c_train(x, w, b, opt, 2)
    assert [c["loss 0"], c["loss 1"]] == losses
    assert c["w"] == as_entry(w.numpy()) and c["b"] == as_entry(b.numpy())


def test_c_writes_python_loads_and_resumes_adam(dev, tmp_path):
    path = str(tmp_path / "c.safetensors")
    first = entries(run(TOOL, "write", spec_of(dev), path, "3"))
    whole = entries(run(TOOL, "write", spec_of(dev),
                        str(tmp_path / "c5.safetensors"), "5"))
    state = dispatch.load(path, dev)
    assert list(state) == ["w", "b"]  # Adam's state is not a parameter
    assert as_entry(state["w"].numpy()) == first["w"]
    assert as_entry(state["b"].numpy()) == first["b"]
    w, b = state["w"].track(), state["b"].track()
    opt = dispatch.Adam([w, b], lr=0.01)
    dispatch.load(path, dev, optimizer=opt)
    x, _, _ = c_model(dev)
    losses = c_train(x, w, b, opt, 2)
    assert losses == [whole["loss 3"], whole["loss 4"]]
    assert as_entry(w.numpy()) == whole["w"]
    assert as_entry(b.numpy()) == whole["b"]
    # without the optimizer's state the same start goes elsewhere
    again = dispatch.load(path, dev)  # (the steps above updated state's)
    w2, b2 = again["w"].track(), again["b"].track()
    fresh = dispatch.Adam([w2, b2], lr=0.01)
    assert c_train(x, w2, b2, fresh, 2)[0] == whole["loss 3"]
    assert as_entry(w2.numpy()) != whole["w"]


def test_save_killed_load_resume_in_a_fresh_process_is_bit_identical(
        dev, tmp_path):
    spec, folder = spec_of(dev), str(tmp_path)
    full = run(sys.executable, RESUME, spec, folder, "full", "10",
               env=PACKAGE_ENV)
    stopped = subprocess.run(
        [sys.executable, RESUME, spec, folder, "stop", "6"],
        capture_output=True, text=True, timeout=120, env=PACKAGE_ENV)
    assert stopped.returncode == -9, stopped.stderr  # SIGKILL, after save
    resumed = run(sys.executable, RESUME, spec, folder, "resume", "10",
                  env=PACKAGE_ENV)
    assert len(full) == 14 and full[-4].startswith("param w1")
    assert stopped.stdout.splitlines() + resumed == full
    # the losses went down: the run really trained
    losses = [float(line.split()[2]) for line in full[:10]]
    assert losses[-1] < losses[0]


def test_optimizer_kinds_and_shapes_are_checked(local, tmp_path):
    path = tmp_path / "sgd.safetensors"
    w = local.ones((2, 2)).track()
    sgd = dispatch.SGD([w], lr=0.1, momentum=0.9)
    dispatch.save(path, {"w": w}, optimizer=sgd)
    adam = dispatch.Adam([local.ones((2, 2)).track()], lr=0.1)
    with pytest.raises(dispatch.EINVAL) as e:
        dispatch.load(path, local, optimizer=adam)
    assert "sgd" in e.value.message
    other = dispatch.SGD([local.ones((3,)).track()], lr=0.1, momentum=0.9)
    with pytest.raises(dispatch.ESHAPE):
        dispatch.load(path, local, optimizer=other)


def test_errors_are_clear(dev, tmp_path):
    missing = tmp_path / "none.safetensors"
    with pytest.raises(dispatch.EIO) as e:
        dispatch.load(missing, dev)
    assert str(missing) in e.value.message
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(dispatch.EINVAL) as e:
        dispatch.load(bad, dev)
    assert str(bad) in e.value.message
    with pytest.raises(dispatch.EINVAL):
        dispatch.save(tmp_path / "x", {"": dev.ones((1,))})
    with pytest.raises(TypeError):
        dispatch.save(tmp_path / "x", {"a": np.ones(2)})
    with pytest.raises(TypeError):
        dispatch.save(tmp_path / "x", dev.ones((1,)))
    with pytest.raises(TypeError):
        dispatch.load(tmp_path / "x", "local")
    with pytest.raises(ValueError):
        dispatch.save(tmp_path / "x", {})
    assert not (tmp_path / "x").exists()


def test_wrong_device_is_refused(server, tmp_path):
    with dispatch.device("local") as a, dispatch.device(server.spec) as b:
        with pytest.raises(dispatch.EDEVICE):
            dispatch.save(tmp_path / "x", {"a": a.ones((1,)),
                                           "b": b.ones((1,))})
        w = a.ones((2,)).track()
        opt = dispatch.Adam([w], lr=0.1)
        dispatch.save(tmp_path / "a", {"w": w}, optimizer=opt)
        with pytest.raises(ValueError) as e:
            dispatch.load(tmp_path / "a", b, optimizer=opt)
        assert "local" in str(e.value)
        with pytest.raises(dispatch.EDEVICE):
            dispatch.save(tmp_path / "y", {"w": b.ones((2,))}, optimizer=opt)
    assert not (tmp_path / "x").exists()


def test_on_server_writes_in_its_directory_and_reads_back(tmp_path):
    """save/load(on_server=True): the server writes the file inside its
    --checkpoint-dir (the same layout: a local load of that file reads the
    same bits), loads it back with Adam's state, and refuses a name that
    leaves the directory; a server without the option and a local device
    refuse with their codes."""
    from conftest import Server
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    srv = Server(["--checkpoint-dir", str(ckdir)])
    try:
        with dispatch.device(srv.spec) as dev, \
                dispatch.device("local") as loc:
            ts = sample(dev)
            w = dev.tensor(np.array([1.0, -2.0], np.float32)).track()
            opt = dispatch.Adam([w], lr=0.1)
            opt.step((w * w).sum().backward())
            dispatch.save("a.safetensors",
                          dict(ts, w=w), optimizer=opt, on_server=True)
            assert (ckdir / "a.safetensors").is_file()
            here = dispatch.load(ckdir / "a.safetensors", loc)
            back = dispatch.load("a.safetensors", dev, on_server=True)
            assert list(back) == list(ts) + ["w"] == list(here)
            for k in back:
                a, b = back[k].numpy(), here[k].numpy()
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k
            for k, t in ts.items():
                assert back[k].numpy().tobytes() == t.numpy().tobytes(), k
            # Adam's moments and step come back: the next step is the same
            w2 = back["w"].track()
            opt2 = dispatch.Adam([w2], lr=0.1)
            dispatch.load("a.safetensors", dev, optimizer=opt2,
                          on_server=True)
            opt.step((w * w).sum().backward())
            opt2.step((w2 * w2).sum().backward())
            assert w.numpy().tobytes() == w2.numpy().tobytes()
            for bad in ("../x", "/etc/passwd", "a/../../x", ""):
                with pytest.raises(dispatch.EINVAL):
                    dispatch.save(bad, {"w": w}, on_server=True)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
            with pytest.raises(dispatch.EIO):
                dispatch.load("missing.safetensors", dev, on_server=True)
            with pytest.raises(dispatch.ENOTREMOTE):
                dispatch.save("b", {"x": loc.ones((1,))}, on_server=True)
    finally:
        assert srv.stop() == 0, srv.stderr()


def test_on_server_without_a_checkpoint_dir_is_unsupported(remote):
    with pytest.raises(dispatch.EUNSUPPORTED):
        dispatch.save("a", {"x": remote.ones((1,))}, on_server=True)
    with pytest.raises(dispatch.EUNSUPPORTED):
        dispatch.load("a", remote, on_server=True)
