"""Loads libdispatch-client.so with cffi in ABI mode (no compiler needed).

The declarations are the library's public header itself, not a copy: the
build preprocesses client/include/dispatch_client.h into dispatch_cdef.h
(cffi's cdef takes no macros, attributes or system headers; the comments
stay, for the docstrings), and writes ops.txt, one line "name signature
surface" per row of the op table (DSP_OP_MAP in common/dsp.h), from which
_core makes the op functions and Tensor methods. Both files lie beside
the library: in gen/ of a build tree (build/gen, made with the library),
or in share/dispatch/ of the prefix it is installed in (make install).

dispatch_options and dispatch_stats start with their size, set by _core
from cffi's sizeof, so the library reads and writes only the fields the
header it was built with declares. The *_backward helpers are not in the
header (not exported): autodiff calls them inside.
"""
import os
import pathlib
import re

import cffi

LIB_NAME = "libdispatch-client"


def _installed_library(here):
    """PREFIX/lib/libdispatch-client.so.0 for a package installed under
    PREFIX (make install-python puts it in PREFIX/lib/python3.X/...
    beside make install's library): the library of the same prefix,
    found from this file's place, so no loader path or environment
    variable is needed (a staged DESTDIR tree works alike). None when
    the package is not below a lib folder (the nearest one counts)."""
    for anc in here.parents:
        if anc.name in ("lib", "lib64"):
            return str(anc / (LIB_NAME + ".so.0"))
    return None


def _candidates():
    """Where the library is looked for, first match wins: the path in
    DISPATCH_CLIENT_LIB, the build/ folder of the checkout this package
    sits in, the lib folder of the prefix it is installed in (make
    install-python), then the system loader's search path."""
    env = os.environ.get("DISPATCH_CLIENT_LIB")
    if env:
        return [env]
    here = pathlib.Path(__file__).resolve().parent
    found = []
    if here.parent.name == "python":  # python/dispatch of a checkout
        found.append(str(here.parents[1] / "build" / (LIB_NAME + ".so")))
    installed = _installed_library(here)
    if installed:
        found.append(installed)
    return found + [LIB_NAME + ".so.0"]


def _loaded_path(name):
    """The file the system loader opened for `name` (a soname), read from
    this process's mappings once it is loaded."""
    cffi.FFI().dlopen(name)  # raises OSError when the loader has none
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(None, 5)[-1]
            if os.path.basename(path).startswith(LIB_NAME + ".so"):
                return path
    return name


def _data_dirs(lib_path):
    """Where the build put dispatch_cdef.h and ops.txt for this library."""
    d = os.path.dirname(os.path.realpath(lib_path))
    return [os.path.join(d, "gen"),
            os.path.normpath(os.path.join(d, "..", "share", "dispatch"))]


def _read_data(lib_path):
    for d in _data_dirs(lib_path):
        cdef, ops = (os.path.join(d, f) for f in ("dispatch_cdef.h", "ops.txt"))
        if os.path.exists(cdef) and os.path.exists(ops):
            with open(cdef) as f, open(ops) as g:
                return f.read(), g.read()
    raise ImportError(
        f"dispatch: no dispatch_cdef.h and ops.txt beside {lib_path} (looked "
        f"in {', '.join(_data_dirs(lib_path))}); `make` writes them into "
        "build/gen, `make install` into PREFIX/share/dispatch")


def _parse_ops(text):
    """ops.txt as a list of (name, signature, surface), in table order."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            name, sig, api = line.split()
            rows.append((name, sig, api))
    return rows


_COMMENT_OR_DECL = re.compile(
    r"/\*(.*?)\*/|^[^\n;/]*?\b(dispatch_[a-z0-9_]+)\s*\(", re.S | re.M)


def _docs(cdef):
    """The header's comment for each function: the last comment before
    its declaration (a group of declarations shares the one above it)."""
    docs, last = {}, ""
    for m in _COMMENT_OR_DECL.finditer(cdef):
        if m.group(1) is not None:
            text = m.group(1)
            if not text.strip().startswith("---"):
                last = "\n".join(l.strip().lstrip("*").strip()
                                 for l in text.strip().splitlines()).strip()
        else:
            docs.setdefault(m.group(2), last)
    return docs


def _load():
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            real = path if os.sep in path else _loaded_path(path)
        except OSError as e:
            errors.append(str(e))
            continue
        cdef, ops = _read_data(real)
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        try:
            return ffi, ffi.dlopen(path), path, _parse_ops(ops), _docs(cdef)
        except OSError as e:
            errors.append(str(e))
    raise ImportError(
        "dispatch: cannot load libdispatch-client (build it with `make`, "
        "or set DISPATCH_CLIENT_LIB to its path): " + "; ".join(errors))


ffi, lib, path, ops, docs = _load()
