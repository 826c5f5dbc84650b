#!/usr/bin/env bash
# make gpu-bundle: packs what a GPU host runs (scripts/gpu.sh test, bench,
# all) into $BUILD/gpu-bundle.tar.xz, for a host with the CUDA toolkit and
# the NVIDIA driver but none of the Debian packages the programs link:
#   dispatch-gpu/run.sh          ./run.sh [test|bench|all|check] (default all):
#                                sets LD_LIBRARY_PATH to lib/ and runs gpu.sh
#   dispatch-gpu/gpu.sh          a copy of scripts/gpu.sh
#   dispatch-gpu/build/...       dispatch-server, dispatch-cuda.so (the
#                                plugin), tests/gpu/*, tests/test_backend_ops,
#                                bench/gpu/matmul_cuda, bench/{bulk,mlp,gpt},
#                                examples/train_mlp, and when built
#                                dispatch-nccl.so, tests/gpu/nccl_check and
#                                tests/gpu/mpi-single.so (debug info stripped),
#                                fortunes/ (bench/gpt's corpus) and
#                                fashion-mnist/ (the MLP demo's data, cut)
#   dispatch-gpu/lib/            every shared library those load (ldd), but
#                                glibc's own (libc, libm, ld-linux, ...) and
#                                CUDA's: libcuda.so.1 is the driver's, and
#                                libcudart/libcublas/libcublasLt (over 500 MiB)
#                                are the toolkit's, found through the RUNPATH
#                                $CUDA_HOME/lib64 the plugin was linked with,
#                                and so is libnccl.so.2 (218 MiB; NCCL_HOME/
#                                lib64 when built elsewhere: a host without
#                                it gets nccl_check's one-line dlopen error)
#   no Open MPI: see scripts/gpu.sh (a group of one runs without it)
#   dispatch-gpu/examples/python/gpt_torch.py  bench/gpt's PyTorch row
# Prints the archive's size. Expects the programs built (make does that).
set -euo pipefail
BUILD=${BUILD:-build}
name=dispatch-gpu
stage=$BUILD/gpu-bundle.d
out=$BUILD/gpu-bundle.tar.xz
progs=(dispatch-server dispatch-cuda.so tests/gpu/cuda_ops tests/gpu/cuda_server
  tests/test_backend_ops bench/gpu/matmul_cuda bench/bulk bench/mlp bench/gpt
  examples/train_mlp)
# the NCCL path's plugin, its check and the one-rank MPI stand-in, when built
for p in dispatch-nccl.so tests/gpu/nccl_check tests/gpu/mpi-single.so; do
  [ -f "$BUILD/$p" ] && progs+=("$p")
done
rm -rf "$stage"
root=$stage/$name
mkdir -p "$root/lib" "$root/build" "$root/examples/python"
for p in "${progs[@]}"; do
  mkdir -p "$root/build/$(dirname "$p")"
  cp -L "$BUILD/$p" "$root/build/$p"
  strip --strip-debug "$root/build/$p"
done
ln -s dispatch-server "$root/build/dispatch-server-cuda"
cp -r "$BUILD/fortunes" "$root/build/"
# Fashion-MNIST (Debian's dataset-fashion-mnist, 30 MiB of gzip that xz
# cannot shrink): the test split whole, the training split cut to its first
# FMNIST_TRAIN images (header count rewritten), enough for the demo's epoch
src=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
mkdir -p "$root/build/fashion-mnist"
cp "$src"/t10k-*.gz "$root/build/fashion-mnist/"
"${PYTHON:-/usr/bin/python3}" - "$src" "$root/build/fashion-mnist" "${FMNIST_TRAIN:-12000}" <<'PY'
import gzip, struct, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
    raw = gzip.open(f"{src}/train-{kind}.gz").read()
    dims = raw[3]  # the IDX header: magic (its last byte the rank), sizes
    hdr = 4 + 4 * dims
    per = 1
    for d in range(1, dims):
        per *= struct.unpack(">I", raw[4 + 4 * d:8 + 4 * d])[0]
    keep = min(n, struct.unpack(">I", raw[4:8])[0])
    body = raw[:4] + struct.pack(">I", keep) + raw[8:hdr] + raw[hdr:hdr + keep * per]
    with gzip.open(f"{dst}/train-{kind}.gz", "wb", 9) as f:
        f.write(body)
PY
cp examples/python/gpt_torch.py "$root/examples/python/"
cp scripts/gpu.sh "$root/gpu.sh"
cat >"$root/run.sh" <<'RUN'
#!/usr/bin/env bash
# The GPU bundle of dispatch (make gpu-bundle): ./run.sh [test|bench|all|check]
# runs gpu.sh on the programs in build/ with the libraries in lib/; the
# CUDA toolkit's libraries come from the host (the plugin's RUNPATH, or
# LD_LIBRARY_PATH), libcuda.so.1 from its driver.
cd "$(dirname "$0")" || exit 1
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BUILD=build exec ./gpu.sh "${1:-all}"
RUN
chmod +x "$root/run.sh" "$root/gpu.sh"

# glibc's libraries and CUDA's stay out (see above)
skip='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64)\.so|^libcuda\.so|^libcudart\.so|^libcublas(Lt)?\.so|^libnccl\.so'
for p in "${progs[@]}"; do ldd "$BUILD/$p"; done |
  awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u |
  while read -r soname path; do
    [[ $soname =~ $skip ]] && continue
    cp -L "$path" "$root/lib/$soname"
    strip --strip-debug "$root/lib/$soname" 2>/dev/null || true
  done

rm -f "$out"
XZ_OPT=${XZ_OPT:--6 -T2} tar -C "$stage" --owner=0 --group=0 -cJf "$out" "$name"
rm -rf "$stage"
size=$(stat -c %s "$out")
echo "gpu-bundle: $out, $((size / 1024)) KiB ($(awk -v s="$size" 'BEGIN { printf "%.1f", s / 1048576 }') MiB)"
