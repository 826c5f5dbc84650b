#!/usr/bin/env bash
# make mutate: applies each mutation of tests/mutations.txt, one at a time,
# to a scratch copy of this tree (the checkout it runs from is never
# written), rebuilds there, runs only the suites the entry names, and prints
# a table: KILLED (the first suite that failed) or SURVIVED. Exits 1 when a
# mutation survived or could not be applied or built, so a list that goes
# stale (a snippet no longer in its file) shows up rather than passing.
#
# List format (tests/mutations.txt): blocks separated by blank lines,
# '#' lines are comments; each block has
#   name:   a short id
#   file:   path from the repository root
#   from:   an exact snippet that occurs exactly once in that file
#   to:     its replacement
#   suites: test binaries under build/tests to run (space separated)
# Usage: scripts/mutate.sh [LIST] [NAME...]   (names: run only those)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
list=${1:-$root/tests/mutations.txt}
shift || true
only=" $* "
jobs=${MUTATE_JOBS:-2}
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dispatch-mutate.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

# the tracked and untracked-but-not-ignored files: what a clean clone plus
# local edits would build from
(cd "$root" && git ls-files -z -c -o --exclude-standard |
   xargs -0 tar cf - 2>/dev/null) | (cd "$scratch" && tar xf -) || {
  echo "mutate: could not copy the tree to $scratch" >&2; exit 2; }

build() { make -C "$scratch" -s -j"$jobs" CUDA="${MUTATE_CUDA:-0}" "$@" >"$scratch/.build.log" 2>&1; }

echo "mutate: scratch copy $scratch; baseline build"
if ! build all build/dispatch-server; then
  tail -20 "$scratch/.build.log"; echo "mutate: baseline build failed" >&2; exit 2
fi

names=() files=() froms=() tos=() suites=()
flush() {
  if [ -n "${n_name:-}" ]; then
    names+=("$n_name") files+=("$n_file") froms+=("$n_from") tos+=("$n_to")
    suites+=("$n_suites")
  fi
  n_name= n_file= n_from= n_to= n_suites=
}
n_name=
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in
    '#'*) continue ;;
    '') flush ;;
    name:*) n_name=${line#name:}; n_name=${n_name# } ;;
    file:*) n_file=${line#file:}; n_file=${n_file# } ;;
    from:*) n_from=${line#from:}; n_from=${n_from# } ;;
    to:*) n_to=${line#to:}; n_to=${n_to# } ;;
    suites:*) n_suites=${line#suites:}; n_suites=${n_suites# } ;;
    *) echo "mutate: unparsed line in $list: $line" >&2; exit 2 ;;
  esac
done <"$list"
flush

# Replaces the one occurrence of FROM in FILE by TO (python: no escaping
# pitfalls of sed); exit 3 when FROM occurs zero or several times.
apply() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:4]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(3)
open(path, "w").write(s.replace(old, new))
PY
}

bad=0 rows=()
for i in "${!names[@]}"; do
  nm=${names[$i]} f=${files[$i]}
  if [ "$only" != "  " ] && [[ "$only" != *" $nm "* ]]; then continue; fi
  cp -p "$scratch/$f" "$scratch/.orig"
  if ! apply "$scratch/$f" "${froms[$i]}" "${tos[$i]}"; then
    res="NOT APPLIED (snippet not found exactly once in $f)"; bad=1
  else
    touch "$scratch/$f"
    bins=""
    for s in ${suites[$i]}; do bins="$bins build/tests/$s"; done
    if ! build build/dispatch-server $bins; then
      res="BUILD FAILED (see the mutation)"; bad=1
    else
      res="SURVIVED"
      for s in ${suites[$i]}; do
        if ! (cd "$scratch" && DISPATCH_SERVER_BIN="$scratch/build/dispatch-server" \
              timeout 300 "build/tests/$s" --jobs "$jobs" >"$scratch/.suite.log" 2>&1); then
          res="KILLED by $s"
          # the first failure's message, so the table says what broke
          why=$(grep -m1 -A2 -e 'Assertion Failed' -e 'CRASH' -e 'Timed out' \
                  "$scratch/.suite.log" | grep -v -e '^\[----\] *$' | tail -1 |
                sed 's/^\[----\] *//' | cut -c1-90)
          [ -n "$why" ] && res="$res: $why"
          break
        fi
      done
      [ "$res" = SURVIVED ] && bad=1
    fi
  fi
  cp -p "$scratch/.orig" "$scratch/$f"; touch "$scratch/$f"
  printf '%-34s %s\n' "$nm" "$res"
  rows+=("$(printf '%-34s %s' "$nm" "$res")")
done
echo
echo "mutation                           result"
printf '%s\n' "${rows[@]}"
if [ $bad -ne 0 ]; then echo "MUTATE: SURVIVORS OR BROKEN ENTRIES"; exit 1; fi
echo "MUTATE: ALL KILLED"
