#!/usr/bin/env bash
# The ABI check: what libdispatch-client.so exports must be exactly
# tests/abi/exported.txt (one "name@@VERSION_NODE" per line, sorted), and
# every function declared DISPATCH_API in include/ and client/include/
# must be in the version script. An accidental export (a generated
# dspwire__ symbol, a dispatch__ internal, a dsp_ function, a helper that
# lost its static) or a public function that vanished fails here with the
# difference.
#   tests/abi/check-exports.sh [path/to/libdispatch-client.so]
set -eu
cd "$(dirname "$0")/../.."
lib=${1:-build/libdispatch-client.so}
want=tests/abi/exported.txt
[ -f "$lib" ] || { echo "abi: $lib not built" >&2; exit 1; }
fail=0

# nm -D prints "ADDRESS TYPE NAME"; the version node itself is an
# absolute symbol of the same list.
got=$(nm -D --defined-only "$lib" | awk '{print $NF}' | LC_ALL=C sort)
if ! d=$(diff -u --label "$want (expected)" --label "$lib (nm -D)" \
           "$want" <(printf '%s\n' "$got")); then
  echo "abi: the exported symbols of $lib differ from $want:" >&2
  printf '%s\n' "$d" >&2
  echo "abi: a new public function goes into client/dispatch-client.map" \
       "and $want; anything else must not be exported" >&2
  fail=1
fi

# The header and the version script name the same functions.
# (DISPATCH_API stands on its own line, the declaration on the next)
hdr=$(awk 'prev == "DISPATCH_API" && match($0, /dispatch_[a-z0-9_]+\(/) {
             print substr($0, RSTART, RLENGTH - 1) }
           { prev = $0 }' include/*.h client/include/*.h | LC_ALL=C sort)
# a declaration that lost its DISPATCH_API would be hidden: programs
# could not link it
bare=$(awk 'prev != "DISPATCH_API" &&
            /^(const )?[a-z_0-9]+ \**dispatch_[a-z0-9_]+\(/ { print FILENAME ": " $0 }
            { prev = $0 }' include/*.h client/include/*.h)
if [ -n "$bare" ]; then
  echo "abi: public declarations without DISPATCH_API:" >&2
  printf '%s\n' "$bare" >&2
  fail=1
fi
map=$(grep -Eo '^ *dispatch_[a-z0-9_]+;' client/dispatch-client.map |
      tr -d ' ;' | LC_ALL=C sort)
if ! d=$(diff -u --label "DISPATCH_API in include, client/include" \
           --label client/dispatch-client.map \
           <(printf '%s\n' "$hdr") <(printf '%s\n' "$map")); then
  echo "abi: the public headers and the version script disagree:" >&2
  printf '%s\n' "$d" >&2
  fail=1
fi

[ $fail -eq 0 ] || exit 1
echo "abi: $(printf '%s\n' "$got" | wc -l) exported symbols match $want"
