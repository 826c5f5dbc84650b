#!/usr/bin/env bash
# make gpu-bundle-check: $BUILD/gpu-bundle.tar.xz as a GPU host without the
# Debian packages would see it, on this machine (no GPU):
#  1. unpacked into an empty folder;
#  2. every program and the plugin listed by the dynamic loader with the
#     bundle's lib/ as the library path and its cache off (--inhibit-cache):
#     each library must resolve into the bundle, to the CUDA toolkit
#     (/usr/local/cuda*) or to glibc's own libraries; one found anywhere
#     else (a Debian package of this machine) is a library the bundle lacks;
#  3. run.sh check with a bare environment (env -i): each program runs from
#     the unpacked copy up to its "cuda: skipped (no GPU)" line or the
#     plugin's one-line refusal.
# Exits 1 on any failure.
set -uo pipefail
BUILD=${BUILD:-build}
archive=$(cd "$BUILD" && pwd)/gpu-bundle.tar.xz
[ -f "$archive" ] || { echo "gpu-bundle-check: no $archive (make gpu-bundle)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$archive" || exit 1
root=$tmp/dispatch-gpu
echo "== unpacked $(basename "$archive") ($(du -sh "$root" | cut -f1) in $tmp)"
fail=0
glibc='^(libc|libm|libdl|libpthread|librt|libresolv|libutil)\.so|^ld-linux-x86-64\.so|^linux-vdso'
n=0
while read -r f; do
  out=$(env -i /lib64/ld-linux-x86-64.so.2 --inhibit-cache --library-path "$root/lib" \
    --list "$f" 2>&1) || { echo "$f: $out"; fail=1; continue; }
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    case "$path" in
      "$root"/*) ;;
      /usr/local/cuda*) ;;
      *)
        if ! [[ $soname =~ $glibc ]]; then
          echo "gpu-bundle-check: ${f#"$root"/}: $soname from $path (not in the bundle)"
          fail=1
        fi
        ;;
    esac
  done <<<"$out"
  n=$((n + 1))
done < <(find "$root/build" -type f \( -perm -u+x -o -name '*.so' \) | sort)
echo "== $n programs and the plugin: every library from the bundle, the CUDA toolkit or glibc"
log=$tmp/run.log
env -i PATH=/usr/bin:/bin HOME="$tmp" "$root/run.sh" check >"$log" 2>&1
rc=$?
grep -E '^== |cuda: skipped|CUDA plugin|devices: |gpu check|FAILED' "$log" | sed "s|$tmp|<tmp>|g"
[ "$rc" -eq 0 ] || { echo "gpu-bundle-check: run.sh check exited $rc:"; tail -n 40 "$log"; fail=1; }
skips=$(grep -c '^cuda: skipped (no GPU)' "$log")
[ "$skips" -ge 3 ] || { echo "gpu-bundle-check: $skips 'cuda: skipped (no GPU)' lines, want 3"; fail=1; }
[ "$fail" -eq 0 ] && echo "gpu-bundle-check: passed" || echo "gpu-bundle-check: FAILED"
exit "$fail"
