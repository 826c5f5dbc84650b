"""Fixtures: a real dispatch-server on 127.0.0.1 with an ephemeral port
(started once per test session, its port read from the line it prints on
stdout, as tests/helpers/server_proc.c does), and devices on it and local.

The server binary is $DISPATCH_SERVER_BIN, else build/dispatch-server of
this checkout; the library is found as the package finds it
($DISPATCH_CLIENT_LIB, else build/libdispatch-client.so).

The package under test: with DISPATCH_TEST_INSTALLED=1 (make python-test,
which pip-installs python/ into a virtual environment and runs the suite
with its interpreter) the one the interpreter has installed, and the run
stops at once if that is the source tree's; otherwise python/ of this
checkout, put first on the path. Child processes get PACKAGE_ENV, which
points them at the same package."""
import ctypes
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("DISPATCH_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, str(ROOT / "python"))

import dispatch  # noqa: E402

# the folder the package under test was imported from
PACKAGE_DIR = pathlib.Path(dispatch.__file__).resolve().parents[1]
if INSTALLED and PACKAGE_DIR == ROOT / "python":
    raise RuntimeError(f"DISPATCH_TEST_INSTALLED=1 but dispatch comes from "
                       f"the source tree ({dispatch.__file__})")
# for child Python processes: the same package as this one
PACKAGE_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(PACKAGE_DIR)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))

# small budgets: the suite's tensors are tiny, and the machine is shared
SERVER_ARGS = ["--max-session-bytes", str(64 << 20),
               "--max-memory", str(256 << 20),
               "--storage-cache", "0", "--threads", "2",
               "--log-level", "warn"]
LINE = re.compile(rb"^dispatch-server listening on 127\.0\.0\.1:(\d+)\n$")


def _die_with_parent():
    # In the child before exec: SIGTERM when the test process dies, even
    # abruptly (a sanitizer abort, SIGKILL), so no server outlives its run.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """A running dispatch-server child; .spec is its tcp:// address."""

    def __init__(self, extra=()):
        binary = os.environ.get("DISPATCH_SERVER_BIN") or \
            str(ROOT / "build" / "dispatch-server")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", *SERVER_ARGS, *extra],
            stdout=subprocess.PIPE, stderr=self.log,
            preexec_fn=_die_with_parent)
        line = b""
        # bounded wait for the one line; the server prints it once bound
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], 60)
            if not ready:
                break
            c = os.read(self.proc.stdout.fileno(), 1)
            if not c:
                break
            line += c
        m = LINE.match(line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"dispatch-server did not start: {line!r} "
                               f"{self.stderr()}")
        self.port = int(m.group(1))
        self.spec = f"tcp://127.0.0.1:{self.port}"

    def stderr(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self):
        """SIGTERM, then the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.stdout.close()


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    status = s.stop()
    assert status == 0, f"dispatch-server exited {status}: {s.stderr()}"


@pytest.fixture
def local():
    with dispatch.device("local") as d:
        yield d


@pytest.fixture
def remote(server):
    with dispatch.device(server.spec) as d:
        yield d


@pytest.fixture(params=["local", "remote"])
def dev(request):
    """Each test that takes `dev` runs once per device kind."""
    return request.getfixturevalue(request.param)
