#!/usr/bin/env bash
# The install check: `make install` into a temporary DESTDIR, then, using
# nothing but the installed tree,
#  - the README's two compile lines (pkg-config, plain -I/-L) build
#    tests/install/prog.c, which runs against the installed library;
#  - a CMake project (tests/install/cmake) finds the package with
#    find_package(dispatch-client 0.1), builds against the shared and the
#    static library and runs; asking for another major version fails;
#  - the installed dispatch-server prints the version and serves on
#    127.0.0.1, and the installed dispatch-probe passes against it;
#  - the CUDA plugin, when this build has one, is at lib/dispatch/;
#  - the docs are installed, and every Documentation= of the installed
#    systemd unit names an installed file or man page;
#  - the man pages render with groff -man -ww (no warning, a NAME section);
#  - ldconfig (LDCONFIG, a stand-in here) runs when installing into the
#    running system (DESTDIR empty) as root, and only then; the unit's
#    paths follow PREFIX;
#  - make uninstall leaves no file and no folder of ours behind.
# Prints the installed files.
# BUILD (default build) names the build tree; SAN_FLAGS are added to
# every compile and link (make sanitize installs the ASan build).
set -eu
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
SAN_FLAGS=${SAN_FLAGS:-}
CC=${CC:-cc}
CXX=${CXX:-c++}
tmp=$(mktemp -d /tmp/dsp-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
prefix=/usr/local
inst=$root$prefix
fail() { echo "install: FAIL: $*" >&2; exit 1; }

# a stand-in for ldconfig that records each call
cat >"$tmp/ldconfig" <<EOF
#!/bin/sh
echo "ldconfig \$*" >>"$tmp/ldconfig.calls"
EOF
chmod +x "$tmp/ldconfig"
ldconfig_calls() { if [ -f "$tmp/ldconfig.calls" ]; then wc -l <"$tmp/ldconfig.calls"; else echo 0; fi; }

make -s --no-print-directory install BUILD="$BUILD" DESTDIR="$root" \
  PREFIX="$prefix" LDCONFIG="$tmp/ldconfig" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "make install"; }
[ "$(ldconfig_calls)" = 0 ] || fail "make install DESTDIR=... ran ldconfig"
echo "install: files under DESTDIR$prefix:"
(cd "$inst" && find . -type f -o -type l | sed 's|^\./|  |' | sort)
version=$(sed -n 's/^Version: //p' "$inst/lib/pkgconfig/dispatch-client.pc")
[ -n "$version" ] || fail "no Version in the installed .pc"
docdir=share/doc/dispatch
for f in bin/dispatch-server bin/dispatch-probe include/dispatch_client.h \
         include/dispatch_errors.h include/dispatch_version.h \
         lib/libdispatch-client.a "lib/libdispatch-client.so.$version" \
         lib/cmake/dispatch-client/dispatch-clientConfig.cmake \
         share/man/man1/dispatch-server.1 share/man/man3/libdispatch-client.3 \
         $docdir/README.md $docdir/server.md $docdir/deploy/README.md \
         $docdir/deploy/make-certs.sh $docdir/deploy/dispatch-server.service
do [ -f "$inst/$f" ] || fail "$prefix/$f not installed"; done
[ -x "$inst/$docdir/deploy/make-certs.sh" ] || fail "make-certs.sh installed without x"

# each plugin when this build has it, else none: the CUDA backend (make
# CUDA=1) and the MPI group of dispatch-server --mpi (Open MPI's
# development files present)
for kind in cuda mpi; do
  plugin=lib/dispatch/dispatch-$kind.so
  if [ -f "$BUILD/dispatch-$kind.so" ]; then
    cmp -s "$BUILD/dispatch-$kind.so" "$inst/$plugin" || fail "$prefix/$plugin is not $BUILD/dispatch-$kind.so"
    echo "install: the $kind plugin is $prefix/$plugin"
  else
    [ ! -e "$inst/$plugin" ] || fail "$prefix/$plugin installed, but $BUILD has no $kind plugin"
    echo "install: $BUILD/dispatch-$kind.so not built: none installed"
  fi
done

# every Documentation= of the installed unit is installed (man:NAME(S), or
# file://PATH), and its ExecStart is the installed server
unit=$inst/$docdir/deploy/dispatch-server.service
docs=$(sed -n 's/^Documentation=//p' "$unit" | tr ' ' '\n' | sed '/^$/d')
[ -n "$docs" ] || fail "the installed unit has no Documentation="
for d in $docs; do
  case $d in
    man:*) page=${d#man:}; sec=${page##*(}; sec=${sec%)}; page=${page%(*}
           [ -f "$inst/share/man/man$sec/$page.$sec" ] || fail "unit's $d is not installed" ;;
    file://*) [ -f "$root${d#file://}" ] || fail "unit's $d is not installed" ;;
    *) fail "unit's Documentation=$d is neither man: nor file://" ;;
  esac
done
grep -q "^ExecStart=$prefix/bin/dispatch-server " "$unit" || fail "unit's ExecStart is not $prefix/bin/dispatch-server"
echo "install: the unit's Documentation= ($(echo $docs)) all installed"
major=${version%%.*}
[ "$(readlink "$inst/lib/libdispatch-client.so")" = "libdispatch-client.so.$major" ] ||
  fail "libdispatch-client.so does not point at the soname"
soname=$(readelf -d "$inst/lib/libdispatch-client.so.$version" |
         sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libdispatch-client.so.$major" ] || fail "soname is '$soname'"
! grep -rlE '@[A-Z]+@' "$inst/include" "$inst/lib/pkgconfig" \
    "$inst/lib/cmake" "$inst/share" || fail "an unsubstituted @VAR@ left"

# The README's compile lines, exactly as written there, with the prefix
# moved into the staging tree.
lines=$(grep -E '^cc prog\.c ' README.md) || fail "README shows no compile line"
[ "$(printf '%s\n' "$lines" | wc -l)" -ge 2 ] || fail "README: want the pkg-config and the -I/-L line"
export PKG_CONFIG_PATH="$inst/lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root"
n=0
while IFS= read -r line; do
  n=$((n + 1))
  cmd=${line#cc }
  cmd=${cmd//-I\/usr\/local/-I$inst}
  cmd=${cmd//-L\/usr\/local/-L$inst}
  cmd=${cmd//-o prog/-o $tmp/prog$n}
  (cd tests/install && eval "$CC -std=c11 -Wall -Wextra -Werror $cmd $SAN_FLAGS") \
    >"$tmp/cc.log" 2>&1 || { cat "$tmp/cc.log" >&2; fail "README line '$line'"; }
  out=$(LD_LIBRARY_PATH="$inst/lib" "$tmp/prog$n") || fail "prog$n: $out"
  [ "$out" = "prog: ok $version" ] || fail "prog$n printed '$out'"
  LD_LIBRARY_PATH="$inst/lib" ldd "$tmp/prog$n" |
    grep -q "libdispatch-client.so.$major => $inst/lib/" ||
    fail "prog$n does not load the installed libdispatch-client.so.$major"
  echo "install: README line $n builds and runs: $out"
done <<<"$lines"

# Each public header compiles on its own, as C and as C++, with nothing
# but the installed include directory; prog.c built as C++ links (every
# function has C linkage) and runs.
for h in "$inst"/include/*.h; do
  printf '#include <%s>\nint main(void) { return 0; }\n' "$(basename "$h")" \
    >"$tmp/h.c"
  "$CC" -std=c11 -Wall -Wextra -Werror -pedantic -fsyntax-only \
    -I"$inst/include" "$tmp/h.c" 2>"$tmp/h.log" ||
    { cat "$tmp/h.log" >&2; fail "$(basename "$h") alone does not compile as C"; }
  "$CXX" -std=c++11 -Wall -Wextra -Werror -pedantic -fsyntax-only -x c++ \
    -I"$inst/include" "$tmp/h.c" 2>"$tmp/h.log" ||
    { cat "$tmp/h.log" >&2; fail "$(basename "$h") alone does not compile as C++"; }
done
"$CXX" -std=c++11 -Wall -Wextra -Werror -x c++ tests/install/prog.c -x none \
  -I"$inst/include" -L"$inst/lib" -ldispatch-client -o "$tmp/prog_cxx" \
  $SAN_FLAGS 2>"$tmp/cxx.log" ||
  { cat "$tmp/cxx.log" >&2; fail "prog.c as C++ does not build"; }
out=$(LD_LIBRARY_PATH="$inst/lib" "$tmp/prog_cxx") || fail "prog_cxx: $out"
[ "$out" = "prog: ok $version" ] || fail "prog_cxx printed '$out'"
echo "install: each header compiles alone as C11 and C++11; a C++ program links and runs"

# CMake: find_package from the installed package files only.
cm() {
  cmake -S tests/install/cmake -B "$1" -DCMAKE_PREFIX_PATH="$inst" \
    -DCMAKE_C_FLAGS="$SAN_FLAGS" -DCMAKE_EXE_LINKER_FLAGS="$SAN_FLAGS" \
    "${@:2}" >"$1.log" 2>&1
}
cm "$tmp/cmake" || { cat "$tmp/cmake.log" >&2; fail "cmake configure"; }
cmake --build "$tmp/cmake" >"$tmp/cmake-build.log" 2>&1 ||
  { cat "$tmp/cmake-build.log" >&2; fail "cmake build"; }
for p in prog_shared prog_static; do
  out=$(LD_LIBRARY_PATH="$inst/lib" "$tmp/cmake/$p") || fail "$p: $out"
  [ "$out" = "prog: ok $version" ] || fail "$p printed '$out'"
done
echo "install: find_package(dispatch-client 0.1) builds and runs (shared and static)"
if cm "$tmp/cmake-v" -DWANT_VERSION=$((major + 1)).0; then
  fail "find_package(dispatch-client $((major + 1)).0) accepted $version"
fi

out=$("$inst/bin/dispatch-server" --version)
[ "$out" = "dispatch-server $version" ] || fail "dispatch-server --version: '$out'"
# the installed server on loopback, the installed probe against it
"$inst/bin/dispatch-server" --listen 127.0.0.1:0 >"$tmp/srv.out" 2>"$tmp/srv.err" &
srv=$!
port=
for _ in $(seq 200); do
  port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$tmp/srv.out")
  [ -n "$port" ] && break
  kill -0 "$srv" 2>/dev/null || break
  sleep 0.05
done
[ -n "$port" ] || { kill "$srv" 2>/dev/null; cat "$tmp/srv.err" >&2; fail "the installed server did not start"; }
out=$("$inst/bin/dispatch-probe" "tcp://127.0.0.1:$port" 2>&1) && rc=0 || rc=$?
kill "$srv"; wait "$srv" 2>/dev/null || true
[ $rc = 0 ] || fail "installed dispatch-probe against the installed server: rc $rc, $out"
echo "install: the installed dispatch-probe passes against the installed server ($out)"

for m in man1/dispatch-server.1 man3/libdispatch-client.3; do
  warn=$(LC_ALL=C.UTF-8 groff -man -Tutf8 -ww -z "$inst/share/man/$m" 2>&1)
  [ -z "$warn" ] || fail "groff warns on $m: $warn"
  LC_ALL=C.UTF-8 groff -man -Tutf8 -P-cbou "$inst/share/man/$m" 2>/dev/null |
    grep -q "^NAME" || fail "$m renders no NAME section"
done
echo "install: man pages render without warnings"

# dispatch-server(1) documents every option --help lists, so an option added
# to the server without its man page entry fails here.
undoc=""
for o in $("$inst/bin/dispatch-server" --help | grep -o -- '--[a-z][a-z-]*' | sort -u); do
  sed 's/\\-/-/g' "$inst/share/man/man1/dispatch-server.1" | grep -q -- "$o" ||
    undoc="$undoc $o"
done
[ -z "$undoc" ] || fail "dispatch-server(1) lacks options --help lists:$undoc"
echo "install: dispatch-server(1) documents every option of --help"

make -s --no-print-directory uninstall BUILD="$BUILD" DESTDIR="$root" \
  PREFIX="$prefix" LDCONFIG="$tmp/ldconfig" >/dev/null 2>&1 || fail "make uninstall"
[ "$(ldconfig_calls)" = 0 ] || fail "make uninstall DESTDIR=... ran ldconfig"
left=$(find "$root" -type f -o -type l)
[ -z "$left" ] || fail "left after make uninstall: $left"
left=$(find "$inst" -type d -name '*dispatch*')
[ -z "$left" ] || fail "folders left after make uninstall: $left"

# into the running system (DESTDIR empty), as root: ldconfig once after
# install and once after uninstall; the unit's paths follow PREFIX
if [ "$(id -u)" = 0 ]; then
  sys=$tmp/sys
  make -s --no-print-directory install BUILD="$BUILD" PREFIX="$sys" \
    LDCONFIG="$tmp/ldconfig" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log" >&2; fail "make install PREFIX=$sys"; }
  [ "$(ldconfig_calls)" = 1 ] ||
    fail "make install as root with DESTDIR empty: ldconfig ran $(ldconfig_calls) times"
  sysunit=$sys/$docdir/deploy/dispatch-server.service
  grep -q "^ExecStart=$sys/bin/dispatch-server " "$sysunit" &&
    grep -q "^Documentation=file://$sys/$docdir/deploy/README.md\$" "$sysunit" ||
    fail "the unit installed with PREFIX=$sys does not name $sys"
  make -s --no-print-directory uninstall BUILD="$BUILD" PREFIX="$sys" \
    LDCONFIG="$tmp/ldconfig" >/dev/null 2>&1 || fail "make uninstall PREFIX=$sys"
  [ "$(ldconfig_calls)" = 2 ] || fail "make uninstall as root with DESTDIR empty: ldconfig not run"
  left=$(find "$sys" -type f -o -type l)
  [ -z "$left" ] || fail "left after make uninstall PREFIX=$sys: $left"
  echo "install: as root with DESTDIR empty, ldconfig runs after install and after uninstall" \
       "(with DESTDIR: never); the unit's paths follow PREFIX"
fi
echo "install: $version installs, builds programs (pkg-config, -I/-L, CMake) and uninstalls"
