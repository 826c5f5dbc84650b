"""Device.stats() returns every counter of dispatch_stats: the session's
and, for a remote device, the server-wide ones the Stats reply carries."""
import numpy as np
import pytest

import dispatch


def test_remote_stats_carry_server_wide_counters(server, remote):
    with dispatch.device(server.spec) as other:
        keep = other.tensor(np.ones(64, np.float32))
        other.sync()
        t = remote.tensor(np.ones(256, np.float32))
        st = remote.stats()
        assert st["tensors"] == 1 and st["bytes"] == 256 * 4
        assert st["sessions"] >= 2
        assert st["server_tensors"] >= 2
        assert st["server_bytes"] >= (256 + 64) * 4
        assert st["server_held_bytes"] >= st["held_bytes"] >= st["bytes"]
        assert st["devices"] >= 1
        del t, keep


def test_local_stats_have_the_same_keys(local, remote):
    ls, rs = local.stats(), remote.stats()
    assert set(ls) == set(rs)
    assert ls["devices"] == 1 and ls["sessions"] == 0


def test_set_cache_bounds_a_local_device_and_is_refused_remote(local, remote):
    local.set_cache(1 << 20)
    a = local.tensor(np.arange(1024, dtype=np.float32))
    assert np.array_equal((a + a).numpy(), 2 * np.arange(1024, dtype=np.float32))
    local.set_cache(0)  # off: what it held is freed, the device goes on
    assert np.array_equal((a * a).numpy(), np.arange(1024, dtype=np.float32) ** 2)
    with pytest.raises(NotImplementedError) as ei:
        remote.set_cache(1 << 20)
    assert ei.value.name == "DISPATCH_EUNSUPPORTED"
    assert "--session-cache" in str(ei.value)
    with pytest.raises(ValueError):
        local.set_cache(-1)
