#!/usr/bin/env bash
# The Python package's install check: `make install` (which runs
# install-python: pip, offline) into a temporary DESTDIR, then, with an
# empty environment (env -i, python -I: no PYTHONPATH, no
# DISPATCH_CLIENT_LIB, no LD_LIBRARY_PATH) and only the installed site
# folder put on sys.path by the program itself,
#  - `import dispatch` loads the installed package, which finds the
#    installed PREFIX/lib/libdispatch-client.so.0 and PREFIX/share/dispatch
#    by itself, and a tiny op runs on a local device;
#  - pip's metadata has the library's version, and help(dispatch.save)
#    shows its docstring;
#  - make uninstall leaves no file of the package behind.
# BUILD (default build) names the build tree, PYTHON the interpreter
# (default /usr/bin/python3); SAN_PRELOAD (make sanitize) is preloaded into
# the interpreter so it can load the ASan library.
set -eu
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-/usr/bin/python3}
SAN_PRELOAD=${SAN_PRELOAD:-}
tmp=$(mktemp -d /tmp/dsp-pyinstall-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
prefix=/usr/local
inst=$root$prefix
fail() { echo "install-python: FAIL: $*" >&2; exit 1; }

make -s --no-print-directory install BUILD="$BUILD" DESTDIR="$root" \
  PREFIX="$prefix" PYTHON="$PYTHON" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "make install"; }
init=$(find "$inst/lib" -path '*-packages/dispatch/__init__.py')
[ "$(printf '%s\n' "$init" | wc -l)" = 1 ] && [ -n "$init" ] ||
  fail "want one installed dispatch/__init__.py under $prefix/lib, found: '$init'"
site=$(dirname "$(dirname "$init")")

clean_python() {
  env -i ${SAN_PRELOAD:+LD_PRELOAD="$SAN_PRELOAD" ASAN_OPTIONS=detect_leaks=0} \
    "$PYTHON" -I -c "import sys; sys.path.insert(0, '$site'); $1"
}
out=$(clean_python '
import importlib.metadata, pydoc
import dispatch
print(dispatch.__file__)
print(dispatch.library_path)
assert importlib.metadata.version("dispatch") == dispatch.__version__, \
    (importlib.metadata.version("dispatch"), dispatch.__version__)
assert "safetensors" in pydoc.render_doc(dispatch.save)
with dispatch.device("local") as d:
    t = d.tensor([1.0, 2.0, 3.0])
    print((t * t).sum().item())
' 2>"$tmp/py.log") || { cat "$tmp/py.log" >&2; fail "the installed package: $out"; }
expect="$site/dispatch/__init__.py
$inst/lib/libdispatch-client.so.0
14.0"
[ "$out" = "$expect" ] || fail "printed:
$out
wanted:
$expect"
echo "install-python: the package installed by pip in ${site#"$root"} imports with an empty environment, loads ${prefix}/lib/libdispatch-client.so.0 and runs an op"

make -s --no-print-directory uninstall BUILD="$BUILD" DESTDIR="$root" \
  PREFIX="$prefix" PYTHON="$PYTHON" >/dev/null 2>&1 || fail "make uninstall"
left=$(find "$root" -type f -o -type l)
[ -z "$left" ] || fail "left after make uninstall: $left"
echo "install-python: make uninstall removes every file of it"
