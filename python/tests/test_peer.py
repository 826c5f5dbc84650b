"""t.to(device of another server) from Python takes the server-to-server
path when the servers are peers (README "Server-to-server transfers"):
A (--name a) serves the bytes to B (--peer a=A's address) itself, which A
logs, and they arrive bit for bit; between servers that are not set up
for it the same call copies through this process, and A serves no peer
fetch. A refusal raises the library's error on the target device."""
import numpy as np
import pytest

import dispatch
from conftest import Server


@pytest.fixture(scope="module")
def servers():
    a = Server(["--name", "a", "--log-level", "info"])
    b = c = None
    try:
        b = Server(["--peer", f"a=127.0.0.1:{a.port}"])
        c = Server([])  # no peers: pulls from no one
        yield a, b, c
    finally:
        for s in (c, b, a):
            if s is not None:
                assert s.stop() == 0, s.stderr()


def _fetches(server):
    return server.stderr().count("peer fetch of tensor")


def test_to_a_peer_moves_the_bytes_server_to_server(servers):
    a, b, _ = servers
    x = np.arange(300 * 17, dtype=np.float32).reshape(300, 17) * 0.25 - 7
    with dispatch.device(a.spec) as da, dispatch.device(b.spec) as db:
        t = da.tensor(x)
        before = _fetches(a)
        u = t.to(db)
        assert u._dev is db and u.kind == "remote"
        assert _fetches(a) == before + 1, "A served no peer fetch"
        assert u.numpy().tobytes() == x.tobytes()
        # by spec, and a tracked tensor's values: a new capability each time
        w = t.track().to(b.spec, dispatch.float64)
        assert _fetches(a) == before + 2
        assert w.dtype == np.float64 and not w.requires_grad
        assert (w.numpy() == x.astype(np.float64)).all()


def test_without_peers_the_bytes_go_through_this_process(servers):
    a, _, c = servers
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    with dispatch.device(a.spec) as da, dispatch.device(c.spec) as dc:
        before = _fetches(a)
        u = da.tensor(x).to(dc)
        assert u.numpy().tobytes() == x.tobytes()
        assert _fetches(a) == before, "C has no peers, yet A served one"


def test_a_refused_pull_raises_the_error_of_the_target(servers):
    _, b, _ = servers
    z = Server(["--name", "z"])  # a source B does not list
    try:
        with dispatch.device(z.spec) as dz, dispatch.device(b.spec) as db:
            t = dz.tensor([1.0, 2.0])
            with pytest.raises(dispatch.EPEER) as ei:
                t.to(db)
            assert "has no peer 'z'" in ei.value.message, ei.value.message
            assert db.tensor([3.0]).item() == 3.0  # B's session goes on
    finally:
        assert z.stop() == 0, z.stderr()
