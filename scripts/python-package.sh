#!/usr/bin/env bash
# The Python package (python/) installed with pip, offline, for $PYTHON:
#
#   scripts/python-package.sh install PREFIX [DESTDIR]
#       pip install --no-build-isolation --no-deps --no-index of python/
#       into PREFIX's site-packages folder for $PYTHON (under DESTDIR when
#       given), where the
#       package finds PREFIX/lib/libdispatch-client.so.0 of make install
#       by itself. Built from a copy of python/ in a temporary folder, so
#       pip's build leaves nothing in the source tree.
#   scripts/python-package.sh uninstall PREFIX [DESTDIR]
#       removes exactly the files the install wrote (the RECORD pip keeps
#       in dispatch-*.dist-info), then the folders that are left empty.
#   scripts/python-package.sh venv DIR
#       a throwaway virtual environment at DIR (--system-site-packages:
#       numpy, cffi, pytest and torch come from Debian) with the package
#       installed into it; make python-test runs the suite with DIR's
#       interpreter.
#
# Needs python3-pip, python3-setuptools, python3-wheel, python3-venv (make
# deps). PYTHON defaults to /usr/bin/python3.
set -eu
PYTHON=${PYTHON:-/usr/bin/python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIP_FLAGS="--no-build-isolation --no-deps --no-index --no-cache-dir
--disable-pip-version-check --no-warn-script-location -q"

stage() {  # a copy of the package's source in a new temporary folder
  local src
  src=$(mktemp -d)
  cp -r "$ROOT/python/pyproject.toml" "$ROOT/python/README.md" \
    "$ROOT/python/dispatch" "$src/"
  find "$src" -name __pycache__ -prune -exec rm -rf {} +
  echo "$src"
}

# The folder of PREFIX that $PYTHON searches for packages: on Debian
# (whose python3 has the deb_system scheme) PREFIX/lib/python3.X/
# dist-packages, /usr/lib/python3/dist-packages for PREFIX=/usr; elsewhere
# the posix_prefix scheme's PREFIX/lib/python3.X/site-packages. (pip's own
# --prefix would put it in PREFIX/local/... on Debian, off the path.)
site_dir() {
  "$PYTHON" - "$1" <<'EOF'
import sys
import sysconfig
prefix = sys.argv[1].rstrip("/") or "/"
where = {"base": prefix, "platbase": prefix}
if "deb_system" not in sysconfig.get_scheme_names():
    print(sysconfig.get_path("purelib", "posix_prefix", vars=where))
elif prefix == "/usr":
    print(sysconfig.get_path("purelib", "deb_system", vars=where))
else:
    print("%s/lib/python%d.%d/dist-packages" % ((prefix,) + sys.version_info[:2]))
EOF
}

cmd=${1:-}
case "$cmd" in
install)
  prefix=${2:?usage: $0 install PREFIX [DESTDIR]}
  destdir=${3:-}
  src=$(stage)
  trap 'rm -rf "$src"' EXIT
  site="$destdir$(site_dir "$prefix")"
  # --target: into that folder only (pip's RECORD lists the files
  # relative to it, for uninstall); --upgrade replaces an older install
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install $PIP_FLAGS --root-user-action=ignore --upgrade \
    --target "$site" "$src"
  echo "python: dispatch installed in $site"
  ;;
uninstall)
  prefix=${2:?usage: $0 uninstall PREFIX [DESTDIR]}
  destdir=${3:-}
  site="$destdir$(site_dir "$prefix")"
  "$PYTHON" - "$site" <<'EOF'
import csv, glob, os, sys
site = sys.argv[1]
records = glob.glob(os.path.join(site, "dispatch-*.dist-info", "RECORD"))
dirs = set()
for record in records:
    with open(record, newline="") as f:
        rows = [r[0] for r in csv.reader(f) if r]
    for rel in rows:
        path = os.path.normpath(os.path.join(site, rel))
        if os.path.lexists(path):
            os.remove(path)
        d = os.path.dirname(path)
        while d.startswith(site + os.sep):
            dirs.add(d)
            d = os.path.dirname(d)
# the package's folders, deepest first, where the install left them empty
for d in sorted(dirs, key=len, reverse=True):
    try:
        os.rmdir(d)
    except OSError:
        pass
print(f"python: dispatch removed from {site}" if records else
      f"python: no dispatch installed in {site}")
EOF
  ;;
venv)
  dir=${2:?usage: $0 venv DIR}
  rm -rf "$dir"
  "$PYTHON" -m venv --system-site-packages --without-pip "$dir"
  src=$(stage)
  trap 'rm -rf "$src"' EXIT
  # the venv's interpreter runs Debian's pip (a system site package),
  # which installs into the venv
  # shellcheck disable=SC2086
  "$dir/bin/python" -m pip install $PIP_FLAGS "$src"
  ;;
*)
  echo "usage: $0 install|uninstall PREFIX [DESTDIR] | venv DIR" >&2
  exit 2
  ;;
esac
