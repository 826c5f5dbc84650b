#!/usr/bin/env bash
# Builds deploy/Containerfile with podman and checks the image without
# running a container (deploy/tests/check-image.sh: the image's
# configuration, then its file system mounted and entered with chroot as
# the image's user: every library found, the server started on 127.0.0.1
# and answered by the image's own probe over TLS with the token).
# With --cuda it then builds deploy/Containerfile.cuda on top of that image
# (the CUDA plugin and the toolkit's runtime libraries; the host's toolkit,
# CUDA_HOME, default /usr/local/cuda, mounted read-only for its build
# stage) and checks it the same way, with every library of the server and
# the plugin resolved in the image but the driver's libcuda.so.1.
#
#   deploy/container-build.sh            (make container)
#   deploy/container-build.sh --cuda     (make container-cuda)
#
# Needs root, podman and, when no local debian:12 image exists,
# debootstrap and a Debian mirror (DEBIAN_MIRROR): the base image is then
# made with debootstrap and podman import, since no image registry is
# reached from the build machines. TAG (default
# localhost/dispatch-server:dev) and CUDA_TAG (default
# localhost/dispatch-server-cuda:dev) name the results; CUDA_ARCHS, when
# set, narrows the GPU architectures built.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=0
[ "${1:-}" = --cuda ] && cuda=1
tag=${TAG:-localhost/dispatch-server:dev}
cuda_tag=${CUDA_TAG:-localhost/dispatch-server-cuda:dev}
cuda_home=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
base=${BASE:-localhost/debian:12}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "container: needs root (podman image mount, chroot)" >&2; exit 1; }
command -v podman >/dev/null || { echo "container: podman missing: apt-get install podman" >&2; exit 1; }
if [ $cuda = 1 ] && [ ! -x "$cuda_home/bin/nvcc" ]; then
  echo "container: --cuda needs NVIDIA's toolkit at CUDA_HOME ($cuda_home/bin/nvcc missing)" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

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
deploy/tests/check-image.sh "$tag"
[ $cuda = 1 ] || exit 0

echo "container: podman build -> $cuda_tag (toolkit $cuda_home mounted read-only)"
podman build --isolation chroot --format docker --pull=never \
  --build-arg BASE="$base" --build-arg CPU_IMAGE="$tag" \
  --build-arg CUDA_ARCHS="${CUDA_ARCHS:-}" \
  -v "$cuda_home:/usr/local/cuda:ro" \
  -f deploy/Containerfile.cuda -t "$cuda_tag" .
deploy/tests/check-image.sh --cuda "$cuda_tag"
