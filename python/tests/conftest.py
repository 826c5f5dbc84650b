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
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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


def server_binary():
    """$DISPATCH_SERVER_BIN, else build/dispatch-server of this checkout."""
    return os.environ.get("DISPATCH_SERVER_BIN") or \
        str(ROOT / "build" / "dispatch-server")


class Server:
    """A running dispatch-server child; .spec is its tcp:// address."""

    def __init__(self, extra=()):
        binary = server_binary()
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


# ------------------------------------------------------------ MPI groups

def mpi_missing():
    """Why a group of dispatch-servers cannot start here (None: it can):
    no mpirun on the path ($MPIRUN names another), or no MPI plugin
    (dispatch-mpi.so beside the server binary, or $DISPATCH_MPI_PLUGIN)."""
    mpirun = os.environ.get("MPIRUN") or "mpirun"
    if not shutil.which(mpirun):
        return f"{mpirun} is not installed (make deps: openmpi-bin)"
    plugin = os.environ.get("DISPATCH_MPI_PLUGIN") or os.path.join(
        os.path.dirname(server_binary()), "dispatch-mpi.so")
    if not os.path.exists(plugin):
        return (f"no MPI plugin at {plugin} (make deps: libopenmpi-dev, "
                "then make build/dispatch-mpi.so)")
    return None


RANK = re.compile(rb"^dispatch-server: MPI rank (\d+) of (\d+) \(pid (\d+)\)$")
RANK_PORT = re.compile(rb"^dispatch-server listening on 127\.0\.0\.1:(\d+)$")


class MpiGroup:
    """n dispatch-servers started as one MPI job, exactly as
    tests/helpers/group_proc.c starts them: mpirun --allow-run-as-root with
    every MPI channel on loopback (btl self,tcp; btl_tcp_if_include and
    oob_tcp_if_include lo), each rank on 127.0.0.1 with an ephemeral port
    (--listen 127.0.0.1:0), in a process group of its own. .specs are the
    ranks' tcp:// addresses in the order they announced them (not by
    rank: a Group numbers its members itself), .rank_pid the ranks' pids
    by rank."""

    def __init__(self, n=2, extra=()):
        env = dict(os.environ)
        if "ASAN_OPTIONS" in env:  # as gp_rank_env: Open MPI's own leaks
            env["ASAN_OPTIONS"] += ":detect_leaks=0"
        mpirun = os.environ.get("MPIRUN") or "mpirun"
        self.proc = subprocess.Popen(
            [mpirun, "--allow-run-as-root", "--oversubscribe",
             "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
             "--mca", "oob_tcp_if_include", "lo", "-np", str(n),
             server_binary(), "--mpi", "--listen", "127.0.0.1:0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=_die_with_parent)
        self.n = n
        self.specs, self.rank_pid = [], {}
        try:
            self._read_announcements(60)
        except Exception:
            self.stop()
            raise

    def _read_announcements(self, seconds):
        until = time.monotonic() + seconds
        buf = b""
        while len(self.specs) < self.n or len(self.rank_pid) < self.n:
            left = until - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(left, 0))[0]
            chunk = os.read(self.proc.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                raise RuntimeError(f"mpirun did not start {self.n} ranks "
                                   f"(ranks {self.rank_pid}, {self.specs})")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                m, p = RANK.match(line), RANK_PORT.match(line)
                if m and int(m.group(1)) < self.n:
                    self.rank_pid[int(m.group(1))] = int(m.group(3))
                elif p:
                    self.specs.append(f"tcp://127.0.0.1:{int(p.group(1))}")

    def stop(self):
        """SIGTERM to mpirun (it ends the ranks), at most 20 s, then
        SIGKILL to the whole process group; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            status = None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a rank left behind
        except ProcessLookupError:
            pass
        if status is None:
            status = self.proc.wait()
        self.proc.stdout.close()
        return status


@pytest.fixture(scope="module")
def mpi_group():
    """A 2-rank group for a test module (skipped, with the reason, where
    mpirun or the MPI plugin is missing)."""
    why = mpi_missing()
    if why:
        pytest.skip(why)
    g = MpiGroup(2, ["--mpi-timeout", "5", "--threads", "2",
                     "--log-level", "warn"])
    yield g
    g.stop()
