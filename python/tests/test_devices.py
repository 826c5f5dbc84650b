"""The bindings of a server's devices: dispatch.device_list, Device.peer
(an in-server device on the same session), and Device.set_timeout."""
import numpy as np
import pytest

import dispatch
from conftest import Server

MEM = 64 << 20


@pytest.fixture(scope="module")
def two_devices():
    """A server with two CPU devices, cpu:0 and cpu:1, MEM bytes each."""
    s = Server(["--device", "cpu:0", "--device", "cpu:1",
                "--device-memory", str(MEM)])
    yield s
    assert s.stop() == 0, s.stderr()


def test_device_list_names_each_device_of_the_server(two_devices):
    with dispatch.device(two_devices.spec) as d:
        infos = dispatch.device_list(d)
    assert [i.name for i in infos] == ["cpu:0", "cpu:1"]
    assert [i.kind for i in infos] == ["cpu", "cpu"]
    assert all(i.total_memory == MEM for i in infos)
    assert all(0 < i.free_memory <= MEM for i in infos)
    assert all(isinstance(i.description, str) and i.description
               for i in infos)


def test_device_list_of_local_is_the_process_cpu(local):
    (info,) = dispatch.device_list(local)
    assert (info.kind, info.name, info.total_memory) == \
        ("cpu", "local:cpu", 0)


def test_device_list_sees_memory_taken_on_a_device(two_devices):
    with dispatch.device(two_devices.spec) as d:
        before = {i.name: i.free_memory for i in dispatch.device_list(d)}
        t = d.zeros((1 << 18,))  # 1 MiB on cpu:0
        after = {i.name: i.free_memory for i in dispatch.device_list(d)}
        assert before["cpu:0"] - after["cpu:0"] >= t.size * 4
        assert after["cpu:1"] == before["cpu:1"]


def test_peer_runs_on_the_other_device_and_moves_inside_the_server(
        two_devices):
    v = np.arange(4096, dtype=np.float32) * 0.25 - 7
    with dispatch.device(two_devices.spec) as d0:
        d1 = d0.peer("cpu:1")
        assert d1.kind == "remote" and d1.spec.endswith("/cpu:1")
        free1 = {i.name: i.free_memory for i in dispatch.device_list(d0)}
        a = d0.tensor(v)
        b = a.to(d1)  # copied inside the server
        assert b.device is d1
        d1.sync()
        free2 = {i.name: i.free_memory for i in dispatch.device_list(d0)}
        assert free1["cpu:1"] - free2["cpu:1"] >= v.nbytes
        assert (b.numpy() == v).all()
        # the same program on both devices gives the same bits
        r0 = ((a * a).sum()).numpy()
        r1 = ((b * b).sum()).numpy()
        assert r0.tobytes() == r1.tobytes()
        # inputs of two devices: EDEVICE naming both, no implicit copy
        with pytest.raises(dispatch.EDEVICE) as e:
            a + b
        assert "/cpu:0" in e.value.message or "/cpu:1" in e.value.message
        d1.close()
        assert d1.closed and not d0.closed
        assert (a.numpy() == v).all()  # d0 goes on


def test_peer_errors(two_devices, local):
    with pytest.raises(dispatch.EUNSUPPORTED):
        local.peer("cpu:1")
    with dispatch.device(two_devices.spec) as d:
        with pytest.raises(dispatch.EDEVICE) as e:
            d.peer("cpu:7")
        assert "cpu:0" in e.value.message and "cpu:1" in e.value.message
        with pytest.raises(TypeError):
            d.peer(1)


def test_peer_closed_after_its_parent(two_devices):
    d0 = dispatch.device(two_devices.spec)
    d1 = d0.peer("cpu:1")
    t = d1.ones((3,))
    d0.close()  # allowed first
    assert (t.numpy() == 1).all()
    d1.close()


def test_set_timeout_refuses_a_negative_bound(dev):
    # (a bound that makes a wait time out: test_errors.py's
    # test_wait_that_times_out_raises_timeout_error[set_timeout])
    with pytest.raises(dispatch.EINVAL):
        dev.set_timeout(-1)
    dev.set_timeout(0)
    assert (dev.ones((2,)).numpy() == 1).all()


def test_to_another_server_moves_server_to_server():
    """t.to(device of server B) with B set up to pull from A (A --name a,
    B --peer a=...): the bytes arrive bit for bit, A served them to B, and
    a peer B does not know raises dispatch.EPEER."""
    a = Server(["--name", "a", "--log-level", "info"])
    b = Server(["--peer", f"a=127.0.0.1:{a.port}"])
    c = Server(["--peer", "other=127.0.0.1:1"])
    try:
        with dispatch.device(a.spec) as da, dispatch.device(b.spec) as db, \
                dispatch.device(c.spec) as dc:
            v = np.arange(3 * 257, dtype=np.float32).reshape(3, 257) / 7
            t = da.tensor(v)
            u = t.to(db)
            assert u.device is db
            assert (u.numpy() == v).all()
            assert "peer fetch of tensor" in a.stderr()
            with pytest.raises(dispatch.EPEER) as e:
                t.to(dc)
            assert e.value.code == dispatch.codes["EPEER"] == -38
            assert "no peer 'a'" in e.value.message
    finally:
        for s in (c, b, a):
            assert s.stop() == 0, s.stderr()


def test_error_codes_past_a_gap_in_the_table():
    """The codes after a gap of the table have their classes too."""
    assert dispatch.ECAPABILITY.__name__ == "ECAPABILITY"
    assert dispatch.codes["ECAPABILITY"] == -37
    assert issubclass(dispatch.EPEER, dispatch.DispatchError)
