#!/usr/bin/env bash
# The ABI check: what libdispatch-client.so exports must be exactly
# the build's exported list (one "name@@VERSION_NODE" per line, sorted:
# tests/abi/exported.txt plus one line per API row of the op table), and
# every function declared DISPATCH_API in include/ and client/include/
# must be in the version script the library was linked with
# (client/dispatch-client.map plus the API rows), and the other way round. An accidental export (a
# generated dspwire__ symbol, a dispatch__ internal, a dsp_ function, a
# helper that lost its static), a public function that vanished, or an op
# row whose declaration is missing from the header fails here with the
# difference.
#   tests/abi/check-exports.sh [path/to/libdispatch-client.so]
# The generated lists are read from gen/ beside the library (the build
# tree's $(BUILD)/gen), or from ABI_GEN.
set -eu
cd "$(dirname "$0")/../.."
lib=${1:-build/libdispatch-client.so}
[ -f "$lib" ] || { echo "abi: $lib not built" >&2; exit 1; }
gen=${ABI_GEN:-$(dirname "$lib")/gen}
want=$gen/exported.txt
vmap=$gen/dispatch-client.map
for f in "$want" "$vmap"; do
  [ -f "$f" ] || { echo "abi: $f not built (make builds it with the library)" >&2; exit 1; }
done
fail=0

# nm -D prints "ADDRESS TYPE NAME"; the version node itself is an
# absolute symbol of the same list.
got=$(nm -D --defined-only "$lib" | awk '{print $NF}' | LC_ALL=C sort)
if ! d=$(diff -u --label "$want (expected)" --label "$lib (nm -D)" \
           "$want" <(printf '%s\n' "$got")); then
  echo "abi: the exported symbols of $lib differ from $want:" >&2
  printf '%s\n' "$d" >&2
  echo "abi: a new op is a row of DSP_OP_MAP (common/dsp.h) declared" \
       "DISPATCH_API in client/include/dispatch_client.h; any other public" \
       "function goes into client/dispatch-client.map and" \
       "tests/abi/exported.txt; nothing else may be exported" >&2
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
map=$(grep -Eo '^ *dispatch_[a-z0-9_]+;' "$vmap" | tr -d ' ;' | LC_ALL=C sort)
if ! d=$(diff -u --label "DISPATCH_API in include, client/include" \
           --label "$vmap (client/dispatch-client.map and the API rows)" \
           <(printf '%s\n' "$hdr") <(printf '%s\n' "$map")); then
  echo "abi: the public headers and the version script disagree:" >&2
  printf '%s\n' "$d" >&2
  fail=1
fi

# An op is listed from its row only: written into a hand list too it would
# be there twice.
if [ -f "$gen/ops.txt" ]; then
  twice=$(awk 'NR == FNR { if ($3 == "API") op["dispatch_" $1] = 1; next }
               { sub(/@@.*/, ""); gsub(/[ ;]/, "") }
               $0 in op { print FILENAME ": " $0 }' \
            "$gen/ops.txt" client/dispatch-client.map tests/abi/exported.txt)
  if [ -n "$twice" ]; then
    echo "abi: ops of DSP_OP_MAP listed by hand (the build adds them):" >&2
    printf '%s\n' "$twice" >&2
    fail=1
  fi
else
  echo "abi: $gen/ops.txt not built" >&2
  fail=1
fi

[ $fail -eq 0 ] || exit 1
echo "abi: $(printf '%s\n' "$got" | wc -l) exported symbols match $want"
