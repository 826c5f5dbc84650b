"""The package against the library it loaded: every function the .so
exports is declared in the package's cdef (so Python can call it), and
every op of the table (ops.txt, from DSP_OP_MAP) is reachable from the
package."""
import os
import shutil
import subprocess

import dispatch
from dispatch import _core
from dispatch._lib import lib as clib, ops as table

# the API rows that are not functions of the package, and where they are
ELSEWHERE = {"cast": (dispatch.Tensor, "astype"),
             "zeros": (dispatch.Device, "zeros"),
             "ones": (dispatch.Device, "ones"),
             "full": (dispatch.Device, "full"),
             "arange": (dispatch.Device, "arange"),
             "uniform": (dispatch.Device, "uniform"),
             "normal": (dispatch.Device, "normal")}


def exported_functions(path):
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to list the library's exports"
    out = subprocess.run([nm, "-D", "--defined-only", os.path.realpath(path)],
                         check=True, capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "T":
            names.add(parts[2].split("@")[0])
    return names


def test_every_export_is_in_the_cdef():
    exported = exported_functions(dispatch.library_path)
    assert len(exported) > 100, sorted(exported)
    missing = sorted(n for n in exported if not hasattr(clib, n))
    assert not missing, ("exported by the library but not declared in the "
                         f"package's cdef: {missing}")


def test_every_api_row_is_exported_and_declared():
    exported = exported_functions(dispatch.library_path)
    rows = [name for name, sig, api in table if api == "API"]
    assert len(rows) > 50
    assert not [n for n in rows if "dispatch_" + n not in exported]
    assert not [n for n in rows if not hasattr(clib, "dispatch_" + n)]
    # the internal rows are neither
    internal = [name for name, sig, api in table if api != "API"]
    assert "relu_backward" in internal
    assert not [n for n in internal if "dispatch_" + n in exported]


def test_every_api_row_has_a_python_function():
    for name, sig, api in table:
        if api != "API":
            continue
        if name in ELSEWHERE:
            owner, attr = ELSEWHERE[name]
            assert callable(getattr(owner, attr)), name
            continue
        assert callable(getattr(dispatch, name, None)), name
        assert dispatch.__dict__[name] is _core.op_functions[name]
        if _core._MAKERS.get(sig, (None, False))[1]:
            assert callable(getattr(dispatch.Tensor, name, None)), name


def test_made_functions_run():
    x = dispatch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert dispatch.relu(x).tolist() == [[1.0, 0.0], [3.0, 4.0]]
    assert x.neg().tolist() == [[-1.0, 2.0], [-3.0, -4.0]]
    assert dispatch.add_scalar(x, 1).tolist() == [[2.0, -1.0], [4.0, 5.0]]
    assert x.sum(0, keepdim=True).tolist() == [[4.0, 2.0]]
    assert dispatch.stack([x, x], 0).shape == (2, 2, 2)
    assert "dispatch_relu" in dispatch.relu.__doc__
