#!/usr/bin/env bash
# The build stage of deploy/Containerfile.cuda: builds the CUDA backend
# with the toolkit at CUDA_HOME (container-build.sh --cuda mounts the
# host's, read-only: the toolkit is gigabytes and is never copied into the
# build context) and lays out in OUT what the GPU image adds to the CPU
# image:
#   OUT/root/usr/local/lib/dispatch/dispatch-cuda.so  the plugin, where the
#        server looks for it (PREFIX/lib/dispatch, as make install puts it)
#   OUT/root/$CUDA_HOME/lib64/lib*.so.N  every library of the toolkit the
#        plugin loads (libcudart, libcublas, libcublasLt), found with ldd;
#        not libcuda.so.1, the driver's, which the node provides
#   OUT/root/etc/ld.so.conf.d/dispatch-cuda.conf  that folder for ld.so
#   OUT/runtime-packages  the Debian packages of its other libraries
# CUDA_ARCHS, when set, is passed to make.
#
#   CUDA_HOME=/usr/local/cuda deploy/stage-cuda.sh OUT
set -euo pipefail
out=${1:?usage: stage-cuda.sh OUT}
cuda=${CUDA_HOME:-/usr/local/cuda}
[ -x "$cuda/bin/nvcc" ] || {
  echo "stage-cuda: no $cuda/bin/nvcc (podman build -v HOST_TOOLKIT:$cuda:ro," \
       "as container-build.sh --cuda does)" >&2
  exit 1
}
mk=(make -j"$(nproc)" CUDA=1 NVCC="$cuda/bin/nvcc")
[ -n "${CUDA_ARCHS:-}" ] && mk+=(CUDA_ARCHS="$CUDA_ARCHS")
root=$out/root
"${mk[@]}" build/dispatch-cuda.so
dest=$root/usr/local/lib/dispatch/dispatch-cuda.so
install -D -m 755 build/dispatch-cuda.so "$dest"

libdir=$cuda/lib64
realdir=$(readlink -f "$libdir")
mkdir -p "$root$libdir"
n=0
for lib in $(ldd "$dest" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u); do
  case $(readlink -f "$lib") in
    "$realdir"/*) cp -L "$lib" "$root$libdir/$(basename "$lib")"; n=$((n + 1)) ;;
  esac
done
[ "$n" -gt 0 ] || { echo "stage-cuda: $dest loads no library of $libdir" >&2; exit 1; }
mkdir -p "$root/etc/ld.so.conf.d"
echo "$libdir" >"$root/etc/ld.so.conf.d/dispatch-cuda.conf"
RUNTIME_SKIP_DIR=$realdir deploy/runtime-packages.sh "$dest" >"$out/runtime-packages"
echo "stage-cuda: staged $(cd "$root" && find . -type f | sort | tr '\n' ' ')"
du -sh "$root"
