"""Errors surface as exceptions carrying the code, its name and the
detail message of the library or, for a deferred remote error, of the
server; the device stays usable afterwards."""
import numpy as np
import pytest

import dispatch


def test_shape_mismatch(dev):
    a = dev.tensor(np.ones((2, 3), np.float32))
    b = dev.tensor(np.ones((4, 5), np.float32))
    with pytest.raises(dispatch.DispatchError) as ei:
        a + b
    e = ei.value
    assert type(e) is dispatch.ESHAPE and isinstance(e, ValueError)
    assert e.code == -3 and e.name == "DISPATCH_ESHAPE"
    # remote infers shapes in the client, so the error is immediate there too
    assert e.message == "add: shapes [2, 3] and [4, 5] do not broadcast"
    assert str(e) == "DISPATCH_ESHAPE: " + e.message
    with pytest.raises(dispatch.ESHAPE, match=r"matmul"):
        a @ a
    # the session goes on
    assert np.array_equal((a + a).numpy(), np.full((2, 3), 2, np.float32))


def test_double_autodiff_wrap(dev):
    leaf = dev.tensor(np.ones(3)).track()
    with pytest.raises(dispatch.EDOUBLEWRAP) as ei:
        leaf.track()  # wrapping an AUTODIFF tensor
    assert ei.value.code == -7 and ei.value.name == "DISPATCH_EDOUBLEWRAP"
    assert ei.value.message == "autodiff should not wrap an autodiff tensor"
    with pytest.raises(dispatch.EDOUBLEWRAP) as ei:
        leaf.inner.track()  # the plain tensor it already wraps
    assert ei.value.message.startswith(
        "autodiff should not wrap an autodiff tensor")
    with pytest.raises(dispatch.EDTYPE, match="only float tensors"):
        dev.tensor([1, 2]).track()
    assert (leaf * 2).sum().backward()[leaf].numpy().tolist() == [2, 2, 2]


def test_deferred_server_error_has_servers_message(remote):
    logits = remote.tensor(np.zeros((2, 3), np.float32))
    # valid shapes, so the client queues it; the server finds the bad label
    loss = dispatch.cross_entropy(logits, [0, 7])
    with pytest.raises(dispatch.EINDEX) as ei:
        loss.numpy()
    e = ei.value
    assert e.code == -13 and e.name == "DISPATCH_EINDEX"
    assert e.message.startswith("server: request ")
    assert "label 7 at row 1 out of range for 3 classes" in e.message
    assert loss.status == -13  # the output is poisoned
    assert remote.tensor([1.0]).item() == 1.0  # and the session goes on


def test_same_error_local(local):
    logits = local.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(dispatch.EINDEX,
                       match="label 7 at row 1 out of range for 3 classes"):
        dispatch.cross_entropy(logits, [0, 7])


def test_backward_errors(dev):
    with pytest.raises(dispatch.ENOTTRACKED, match="not an AUTODIFF"):
        dev.ones((1,)).sum().backward()
    with pytest.raises(dispatch.ENOTSCALAR, match="has 3 elements"):
        dev.ones((3,), np.float64).track().backward()


def test_device_open_errors(server):
    with pytest.raises(dispatch.EINVAL, match="unknown spec"):
        dispatch.device("bogus")
    # a port nothing listens on: the server's, once it is stopped, would
    # race with other tests; port 1 needs root to listen on
    with pytest.raises(dispatch.ECONN, match="cannot connect") as ei:
        dispatch.device("tcp://127.0.0.1:1", timeout_ms=2000)
    assert isinstance(ei.value, ConnectionError)


def test_unsupported_dtype_op(dev):
    with pytest.raises(dispatch.EDTYPE) as ei:
        dev.tensor([1, 2]).exp()  # no int64 exp kernel
    assert isinstance(ei.value, TypeError)
    assert ei.value.message == "exp: dtype i64 not supported"


@pytest.mark.parametrize("how", ["timeout_ms", "set_timeout"])
def test_wait_that_times_out_raises_timeout_error(how):
    # the bound given when the device is opened, or by dev.set_timeout:
    # a sync behind more work than its timeout: the server is alive (it
    # sends keepalives), so the wait raises TimeoutError and the session
    # goes on; the work doubles until a sync gives up on it. Its own
    # server: a batch of ops holds its results until the batch is sent
    # (up to 256 of 1 MiB), past the shared server's 64 MiB
    from conftest import Server
    server = Server(["--max-session-bytes", str(1 << 30),
                     "--max-memory", str(1 << 30)])
    try:
        run_until_a_sync_times_out(server.spec, how)
    finally:
        assert server.stop() == 0, server.stderr()


def run_until_a_sync_times_out(spec, how="timeout_ms"):
    with dispatch.device(spec, timeout_ms=600 if how == "timeout_ms"
                         else None) as d:
        if how == "set_timeout":
            d.set_timeout(600)
        x = d.full((512, 512), 1.0 / 512)
        k = 16
        while True:
            for _ in range(k):
                x @ x
            try:
                d.sync()
            except TimeoutError as e:
                assert isinstance(e, dispatch.ETIMEDOUT)
                assert "stays queued" in e.message
                break
            k *= 2
            assert k <= 1 << 14, "no sync timed out"
        d.set_timeout(0)  # no limit: waits as long as the work
        d.sync()
        assert (x.numpy() == np.float32(1.0 / 512)).all()
        assert d.stats()["sessions_resumed"] == 0
