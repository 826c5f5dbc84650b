#!/usr/bin/env bash
# Checks a built dispatch-server image without running a container (no
# container may run on the build machines): the image's configuration
# (numeric non-root user, healthcheck, entrypoint), then its root file
# system mounted (podman image mount) and entered with chroot as the
# image's user: --version, every library of the programs found in the
# image, and the server started there on 127.0.0.1 (ephemeral port) with
# certificates made by make-certs.sh --group GID, answered by the image's
# own probe over TLS with the token.
#
# With --cuda (deploy/Containerfile.cuda's image) also: the CUDA plugin is
# at /usr/local/lib/dispatch/dispatch-cuda.so (or, from a tree before the
# plugin, the server itself links the backend), each library of the server
# and the plugin resolves inside the image except the driver's
# libcuda.so.1, the CUDA ones from the image's own /usr/local/cuda/lib64;
# the default arguments are --device all, and the server started there
# without a GPU still serves cpu:0.
#
#   deploy/tests/check-image.sh [--cuda] IMAGE      (needs root and podman)
# Prints "ok: ..." / "FAILED: ..." per check; exits 1 when any failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
cuda=0
[ "${1:-}" = --cuda ] && { cuda=1; shift; }
tag=${1:?usage: check-image.sh [--cuda] IMAGE}
[ "$(id -u)" = 0 ] || { echo "check-image: needs root (podman image mount, chroot)" >&2; exit 1; }

work=$(mktemp -d)
mnt=
cleanup() {
  [ -n "$mnt" ] && podman image unmount "$tag" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT

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
check "dispatch-server --version as $user in the image" \
  chroot --userspec="$user" "$mnt" /usr/local/bin/dispatch-server --version
programs=(/usr/local/bin/dispatch-server /usr/local/bin/dispatch-probe)
if [ $cuda = 1 ]; then
  plugin=/usr/local/lib/dispatch/dispatch-cuda.so
  if [ -f "$mnt$plugin" ]; then
    echo "ok: the CUDA plugin is in the image at $plugin"
    programs+=("$plugin")
  else
    check "no plugin: the server itself links the CUDA backend (a tree before the plugin)" \
      bash -c 'chroot "$0" ldd /usr/local/bin/dispatch-server | grep -q libcudart' "$mnt"
  fi
  check "default arguments are --device all" \
    bash -c '[ "$(podman image inspect --format "{{json .Config.Cmd}}" "$0")" = "[\"--device\",\"all\"]" ]' "$tag"
fi
chroot "$mnt" ldd "${programs[@]}" >"$work/ldd" 2>&1 || true
echo "ldd in the image:"
sed 's/^/  | /' "$work/ldd"
check "every library of ${programs[*]} is found in the image (libcuda.so.1, the driver's, excepted)" \
  bash -c '! grep "not found" "$0" | grep -v "^[[:space:]]*libcuda\.so\.1 "' "$work/ldd"
if [ $cuda = 1 ]; then
  for l in libcudart libcublas libcublasLt; do
    check "$l resolves to the image's /usr/local/cuda/lib64" \
      grep -Eq "^[[:space:]]*$l\.so\.[0-9]+ => /usr/local/cuda/lib64/$l\.so" "$work/ldd"
  done
fi

# the entrypoint's file layout, with the documented modes, seen by the
# image's user: bind-mounted over /etc/dispatch in a private mount
# namespace, so neither the image nor the host changes
deploy/make-certs.sh --group "${user#*:}" "$work/etc" >/dev/null
chmod 755 "$work"
# (the probe connects to 127.0.0.1: the image has no /etc/hosts, which a
# container runtime provides); $5: extra server arguments
cat > "$work/run.sh" <<'RUN'
# $1 image root, $2 user:group, $3 files for /etc/dispatch, $4 scratch dir
set -u
mount --bind "$3" "$1/etc/dispatch" && mount -t proc proc "$1/proc" || exit 1
chroot --userspec="$2" "$1" /usr/local/bin/dispatch-server \
  --listen 127.0.0.1:0 --tls-cert /etc/dispatch/server.pem \
  --tls-key /etc/dispatch/server.key --token-file /etc/dispatch/token \
  ${5:-} >"$4/out" 2>"$4/err" &
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
if [ -n "${5:-}" ]; then
  # what the probe says of the server's first GPU (on a machine without
  # one it fails, naming what is missing; shown, not judged)
  chroot --userspec="$2" "$1" /usr/local/bin/dispatch-probe \
    --ca /etc/dispatch/ca.pem --token-file /etc/dispatch/token \
    --server-name localhost "tls://127.0.0.1:$port/cuda:0"
  echo "(exit status $?)"
fi
kill "$srv"; wait "$srv"
echo "server's log:"; sed 's/^/  | /' "$4/err"
exit $rc
RUN
extra=
[ $cuda = 1 ] && extra="--device all"
check "server${extra:+ $extra} started in the image as $user with the make-certs files, answered by the image's dispatch-probe over TLS with the token" \
  unshare -m --propagation private bash "$work/run.sh" "$mnt" "$user" "$work/etc" "$work" "$extra"
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "image $tag: $((size / 1048576)) MiB"
if [ $fail -ne 0 ]; then echo "check-image: $tag: CHECKS FAILED"; exit 1; fi
echo "check-image: $tag checked"
