#!/usr/bin/env bash
# Prints the Debian packages that hold the shared libraries the given
# programs load (one a line, sorted), so the container's runtime stage
# installs exactly those. Fails when a library belongs to no package: the
# runtime image would then lack it. RUNTIME_SKIP_DIR names a folder whose
# libraries are left out (deploy/stage-cuda.sh copies the CUDA toolkit's
# into the image itself: no Debian package holds them).
set -euo pipefail
for lib in $(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do
  real=$(readlink -f "$lib")
  [ -n "${RUNTIME_SKIP_DIR:-}" ] && [[ "$real" == "$RUNTIME_SKIP_DIR"/* ]] && continue
  # with merged /usr a file may be recorded as /lib/... or /usr/lib/...
  pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null ||
        dpkg -S "$lib" 2>/dev/null) || {
    echo "runtime-packages: no package holds $lib ($real)" >&2
    exit 1
  }
  echo "${pkg%%:*}"
done | sort -u
