#!/usr/bin/env bash
# The install check: `make install` into a temporary DESTDIR, then, using
# nothing but the installed tree,
#  - the README's two compile lines (pkg-config, plain -I/-L) build
#    tests/install/prog.c, which runs against the installed library;
#  - a CMake project (tests/install/cmake) finds the package with
#    find_package(dispatch-client 0.1), builds against the shared and the
#    static library and runs; asking for another major version fails;
#  - the installed dispatch-server prints the version;
#  - the man pages render with groff -man -ww (no warning, a NAME section);
#  - make uninstall leaves no file behind.
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

make -s --no-print-directory install BUILD="$BUILD" DESTDIR="$root" \
  PREFIX="$prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "make install"; }
version=$(sed -n 's/^Version: //p' "$inst/lib/pkgconfig/dispatch-client.pc")
[ -n "$version" ] || fail "no Version in the installed .pc"
for f in bin/dispatch-server include/dispatch_client.h \
         include/dispatch_errors.h include/dispatch_version.h \
         lib/libdispatch-client.a "lib/libdispatch-client.so.$version" \
         lib/cmake/dispatch-client/dispatch-clientConfig.cmake \
         share/man/man1/dispatch-server.1 share/man/man3/libdispatch-client.3
do [ -f "$inst/$f" ] || fail "$prefix/$f not installed"; done
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
  PREFIX="$prefix" >/dev/null 2>&1 || fail "make uninstall"
left=$(find "$root" -type f -o -type l)
[ -z "$left" ] || fail "left after make uninstall: $left"
echo "install: $version installs, builds programs (pkg-config, -I/-L, CMake) and uninstalls"
