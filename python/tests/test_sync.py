"""Errors where they happen (issue 21 item 11): in sync mode
(dispatch.device(spec, sync=True) or env DISPATCH_SYNC=1) a remote error
that only the server finds is raised at the line that caused it, as on a
local device; without it, at the next call that waits. grads[h] of a
non-leaf raises at once on both kinds, with the same message."""
import numpy as np
import pytest

import dispatch


def _gather(d):
    # the client infers shapes, not values: index 7 of 3 is the server's
    x = d.tensor(np.array([1, 2, 3], np.float32))
    return dispatch.index_select(x, 0, [0, 7])


def test_sync_option_raises_at_the_offending_line(server):
    with dispatch.device(server.spec, sync=True) as d:
        with pytest.raises(dispatch.EINDEX) as ei:
            _gather(d)
        assert isinstance(ei.value, IndexError)
        assert "index_select" in ei.value.message
        # raised by the index_select call itself (not by a later call)
        assert "index_select" in [e.name for e in ei.traceback]
        d.sync()  # the error was that call's: nothing is left over
        assert (d.tensor([1.0, 2.0]) * 2).numpy().tolist() == [2, 4]


def test_env_dispatch_sync_raises_at_the_offending_line(server, monkeypatch):
    monkeypatch.setenv("DISPATCH_SYNC", "1")
    with dispatch.device(server.spec) as d:
        with pytest.raises(dispatch.EINDEX):
            _gather(d)
        d.sync()


def test_without_sync_the_error_comes_at_the_next_wait(remote):
    y = _gather(remote)  # queued
    with pytest.raises(dispatch.EINDEX, match="index_select"):
        remote.sync()
    with pytest.raises(dispatch.EINDEX):
        y.numpy()


def test_grad_of_a_non_leaf_raises_at_once(local, remote):
    msgs = []
    for d in (local, remote):
        x = d.tensor(np.array([1, -2, 3], np.float32)).track()
        h = x * 2
        g = h.sum().backward()
        with pytest.raises(dispatch.ENOGRAD) as ei:
            g[h]
        msgs.append(ei.value.message)
        assert g[x].numpy().tolist() == [2, 2, 2]
        d.sync()
    assert msgs[0] == msgs[1]
    assert "leaves only" in msgs[0]
