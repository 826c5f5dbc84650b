"""The package itself: which copy is under test (make python-test: the
one pip installed), its version beside the library's, and the docstrings
and type hints help() shows for the public API."""
import pathlib
import pydoc
import sys
import tomllib
import typing

import dispatch
from conftest import INSTALLED, PACKAGE_DIR, ROOT


def test_the_package_under_test_is_the_installed_one_when_asked():
    where = pathlib.Path(dispatch.__file__).resolve()
    if INSTALLED:  # make python-test: pip's copy in the virtual environment
        assert where.is_relative_to(pathlib.Path(sys.prefix).resolve())
        assert not where.is_relative_to(ROOT / "python")
    else:
        assert PACKAGE_DIR == ROOT / "python"


def test_package_version_is_the_library_version():
    with open(ROOT / "python" / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    assert meta["project"]["version"] == dispatch.__version__


def test_help_shows_the_docstrings_of_the_new_api():
    for fn, words in ((dispatch.save, "safetensors"),
                      (dispatch.load, "optimizer"),
                      (dispatch.device_list, "devices"),
                      (dispatch.Device.peer, "same connection"),
                      (dispatch.Device.set_timeout, "timeout"),
                      (dispatch.distributed.Group, "MPI job"),
                      (dispatch.distributed.Group.all_reduce, "torch"),
                      (dispatch.distributed.Group.step, "data-parallel")):
        assert words in pydoc.render_doc(fn), fn.__name__


def test_public_functions_have_type_hints():
    for fn in (dispatch.save, dispatch.load, dispatch.device_list,
               dispatch.Device.peer, dispatch.tensor, dispatch.zeros,
               dispatch.device, dispatch.distributed.Group.all_reduce,
               dispatch.distributed.Group.all_reduce_grads,
               dispatch.distributed.Group.step,
               dispatch.distributed.init_group):
        hints = typing.get_type_hints(fn)
        assert "return" in hints, fn.__name__
