#!/usr/bin/env bash
# Builds deploy/Containerfile with podman and checks the image without
# running a container: the image's configuration (numeric non-root user,
# healthcheck, entrypoint), then its root file system mounted and entered
# with chroot as the image's user: --version, every library found, and the
# server started there on 127.0.0.1 (ephemeral port) with certificates
# made by make-certs.sh --group 10001, answered by the image's own probe.
#
#   deploy/container-build.sh            (make container)
#
# Needs root, podman and, when no local debian:12 image exists,
# debootstrap and a Debian mirror (DEBIAN_MIRROR): the base image is then
# made with debootstrap and podman import, since no image registry is
# reached from the build machines. TAG (default dispatch-server:dev) names
# the result.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${TAG:-localhost/dispatch-server:dev}
base=${BASE:-localhost/debian:12}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "container: needs root (podman image mount, chroot)" >&2; exit 1; }
command -v podman >/dev/null || { echo "container: podman missing: apt-get install podman" >&2; exit 1; }

work=$(mktemp -d)
mnt=
cleanup() {
  [ -n "$mnt" ] && podman image unmount "$tag" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT

if ! podman image exists "$base"; then
  command -v debootstrap >/dev/null ||
    { echo "container: debootstrap missing: apt-get install debootstrap" >&2; exit 1; }
  echo "container: making $base with debootstrap from $mirror"
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }
  # as Debian's own debian:12 image: security updates and stable updates
  cat > "$work/rootfs/etc/apt/sources.list" <<SRC
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
SRC
  tar -C "$work/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi

echo "container: podman build -> $tag"
podman build --isolation chroot --format docker --pull=never \
  --build-arg BASE="$base" -f deploy/Containerfile -t "$tag" .

fail=0
check() { # $1 = what, then the command
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fail=1; fi
}
user=$(podman image inspect --format '{{.Config.User}}' "$tag")
check "image user is numeric and not root ($user)" \
  bash -c '[[ "$0" =~ ^[1-9][0-9]*:[0-9]+$ ]]' "$user"
check "image has a healthcheck running dispatch-probe" \
  bash -c 'podman image inspect --format "{{json .Config.Healthcheck}}" "$0" | grep -q dispatch-probe' "$tag"

mnt=$(podman image mount "$tag")
spec=${user}
check "dispatch-server --version as $user in the image" \
  chroot --userspec="$spec" "$mnt" /usr/local/bin/dispatch-server --version
check "every library of the programs is found in the image" \
  bash -c '! chroot "$0" ldd /usr/local/bin/dispatch-server /usr/local/bin/dispatch-probe | grep "not found"' "$mnt"

# the entrypoint's file layout, with the documented modes, seen by the
# image's user: bind-mounted over /etc/dispatch in a private mount
# namespace, so neither the image nor the host changes
deploy/make-certs.sh --group "${user#*:}" "$work/etc" >/dev/null
chmod 755 "$work"
# (the probe connects to 127.0.0.1: the image has no /etc/hosts, which a
# container runtime provides)
cat > "$work/run.sh" <<'RUN'
# $1 image root, $2 user:group, $3 files for /etc/dispatch, $4 scratch dir
set -u
mount --bind "$3" "$1/etc/dispatch" && mount -t proc proc "$1/proc" || exit 1
chroot --userspec="$2" "$1" /usr/local/bin/dispatch-server \
  --listen 127.0.0.1:0 --tls-cert /etc/dispatch/server.pem \
  --tls-key /etc/dispatch/server.key --token-file /etc/dispatch/token \
  >"$4/out" 2>"$4/err" &
srv=$!
port=
for _ in $(seq 100); do
  port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$4/out")
  [ -n "$port" ] && break
  kill -0 "$srv" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "server did not start:"; cat "$4/err"; kill "$srv" 2>/dev/null; exit 1
fi
chroot --userspec="$2" "$1" /usr/local/bin/dispatch-probe \
  --ca /etc/dispatch/ca.pem --token-file /etc/dispatch/token \
  --server-name localhost "tls://127.0.0.1:$port"
rc=$?
kill "$srv"; wait "$srv"
exit $rc
RUN
check "server started in the image as $user with the make-certs files, answered by the image's dispatch-probe over TLS with the token" \
  unshare -m --propagation private bash "$work/run.sh" "$mnt" "$spec" "$work/etc" "$work"
if [ $fail -ne 0 ]; then echo "container: CHECKS FAILED"; exit 1; fi
echo "container: $tag built and checked"
