#!/usr/bin/env bash
# make test-gpu / make bench-gpu, and the GPU bundle's run.sh: everything a
# GPU host runs, in one go. The CUDA backend is the plugin
# $BUILD/dispatch-cuda.so (DISPATCH_CUDA_PLUGIN, set here to that file).
#   scripts/gpu.sh test    in process through the plugin: the conformance
#                          suite (tests/test_backend_ops) and every op x
#                          dtype on the GPU against the CPU, f16 and bf16
#                          included (tests/gpu/cuda_ops); then dispatch-server --device all on
#                          127.0.0.1 (cpu:0 and every GPU) and tests/gpu/
#                          cuda_server against its cuda:0 (round trips
#                          across the staging parts, four sessions at once,
#                          moves to cpu:0 and back); then the MLP demo
#                          (examples/train_mlp, one epoch) on local:cuda:0
#                          and on the server's cuda:0; then the NCCL path
#                          of the group all-reduce (when dispatch-nccl.so
#                          is built): tests/gpu/nccl_check drives the
#                          plugin on a one-rank communicator on cuda:0,
#                          then a group of one dispatch-server --mpi
#                          --device cuda:0 (the one-rank MPI stand-in
#                          tests/gpu/mpi-single.so, see below) all-reduces
#                          cuda:0 tensors, f16 and bf16 included, and its
#                          log must show the NCCL communicator made;
#                          and again with the NCCL init made to fail (the
#                          refusal, then the host path with CUDA tensors)
#   scripts/gpu.sh bench   matmul 4096 f32 and 8192 bf16: the backend and
#                          the remote cuda:0 beside cuBLAS called directly
#                          (cublasSgemm, cublasGemmEx); bench/bulk
#                          (256 MiB upload and read beside the raw socket),
#                          bench/mlp (the MLP step remote on cuda:0 beside
#                          the same step on the local CPU) and bench/gpt
#                          (the char-GPT training step remote on cuda:0
#                          beside the local CPU), against the same server
#   scripts/gpu.sh all     test, then bench
#   scripts/gpu.sh check   no GPU expected (the bundle's check here): each
#                          program runs up to its CUDA question and prints
#                          its "cuda: skipped (no GPU)" line or the plugin's
#                          one-line refusal; the benches run at BENCH_QUICK
#                          sizes against the server's cpu:0
# Data: the GPT bench's corpus is GPT_CORPUS_DIR, else the system's
# fortunes, else $BUILD/fortunes; the MLP demo's is FASHION_MNIST_DIR, else
# Debian's dataset-fashion-mnist, else $BUILD/fashion-mnist (the copies
# make gpu-bundle packs for a host without Debian's packages).
# Open MPI is not in the bundle: Debian's build finds its runtime (orted,
# about a hundred component and PMIx plugins, help files) through the
# prefix compiled in (/usr), so a copy would need OPAL_PREFIX and PMIx
# relocation this machine cannot prove, since its own /usr holds the same
# files. A group of one needs no MPI at all, so the GPU checks run the
# server's real group code with tests/gpu/mpi-single.so in MPI's place; a
# 2-rank NCCL group needs two GPUs and mpirun on the host.
# Without a GPU (test, bench, all) it prints "cuda: skipped (no GPU):
# REASON" and exits 0, claiming nothing. Expects the programs built (the
# Makefile targets and make gpu-bundle build them first). Exits 1 when
# anything fails.
set -uo pipefail
BUILD=${BUILD:-build}
BUILD=$(cd "$BUILD" && pwd) || exit 1
mode=${1:-test}
LIMIT=${GPU_PROGRAM_TIMEOUT:-300}
export DISPATCH_CUDA_PLUGIN=${DISPATCH_CUDA_PLUGIN:-$BUILD/dispatch-cuda.so}
export DISPATCH_SERVER_BIN=$BUILD/dispatch-server
if [ -z "${GPT_CORPUS_DIR:-}" ] && [ ! -d /usr/share/games/fortunes ] &&
  [ -d "$BUILD/fortunes" ]; then
  export GPT_CORPUS_DIR=$BUILD/fortunes
fi
if [ -z "${FASHION_MNIST_DIR:-}" ] && [ ! -d /usr/share/datasets/fashion-mnist ] &&
  [ -d "$BUILD/fashion-mnist" ]; then
  export FASHION_MNIST_DIR=$BUILD/fashion-mnist
fi

case "$mode" in
  test | bench | all)
    "$BUILD/tests/gpu/cuda_ops" --probe
    rc=$?
    [ "$rc" -eq 2 ] && exit 0 # the skipped line is printed
    [ "$rc" -ne 0 ] && { echo "gpu: cuda_ops --probe failed (exit $rc)"; exit 1; }
    ;;
  check) ;;
  *)
    echo "usage: scripts/gpu.sh test|bench|all|check"
    exit 2
    ;;
esac

log=$(mktemp)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  rm -f "$log"
}
trap cleanup EXIT

# dispatch-server --device all (cpu:0, then every GPU: cuda:0 ...), or
# with the arguments given, the line of what it found printed; sets SERVER
# (tcp://127.0.0.1:PORT)
start_server() {
  [ $# -eq 0 ] && set -- --device all
  "$BUILD/dispatch-server" --listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
  pid=$!
  local port=""
  for _ in $(seq 1 200); do
    port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$log")
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  if [ -z "$port" ]; then
    echo "gpu: dispatch-server did not start:"
    cat "$log"
    pid=""
    return 1
  fi
  SERVER="tcp://127.0.0.1:$port"
  echo "== dispatch-server $*, pid $pid on 127.0.0.1:$port"
  for _ in $(seq 1 100); do # the log's devices lines follow the port
    grep -q 'devices: ' "$log" && break
    sleep 0.05
  done
  sleep 0.05
  grep 'devices: ' "$log" | sed 's/^.*info: /   /'
}
stop_server() {
  [ -z "$pid" ] && return
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
}

status=0
step() {
  echo "== $*"
  timeout "$LIMIT" "$@" || { echo "gpu: FAILED: $*"; status=1; }
}
# a program that must refuse with its one line (check mode): prints it
refuses() {
  echo "== $* (expected to refuse)"
  local out
  out=$(timeout 60 "$@" 2>&1)
  local rc=$?
  echo "$out" | tail -n 3
  [ "$rc" -ne 0 ] && echo "$out" | grep -q 'CUDA plugin' ||
    { echo "gpu: FAILED: $* (exit $rc, no CUDA plugin line)"; status=1; }
}

run_tests() {
  step "$BUILD/tests/test_backend_ops" --filter 'backend_ops/conformance'
  step "$BUILD/tests/gpu/cuda_ops"
  local epochs=${MLP_EPOCHS:-1}
  step "$BUILD/examples/train_mlp" --device local:cuda:0 --epochs "$epochs" --min-acc 60
  if start_server; then
    DISPATCH_GPU_REMOTE=$SERVER step "$BUILD/tests/gpu/cuda_server"
    step "$BUILD/examples/train_mlp" --device "$SERVER/cuda:0" --epochs "$epochs" --min-acc 60
    stop_server
  else
    status=1
  fi
  run_nccl cuda:0 ok
}

# The NCCL path (issue 25): the plugin by itself, then a group of one
# server on cuda:0 (or, check mode, on cpu:0: the host path, which refuses
# half types). Nothing when dispatch-nccl.so is not built.
run_nccl() {
  [ -f "$BUILD/dispatch-nccl.so" ] || { echo "== NCCL: dispatch-nccl.so not built, skipped"; return; }
  local dev=${1:-cuda:0} half=${2:-ok}
  step "$BUILD/tests/gpu/nccl_check" "$BUILD/dispatch-nccl.so"
  if DISPATCH_MPI_PLUGIN=$BUILD/tests/gpu/mpi-single.so \
    DISPATCH_NCCL_PLUGIN=$BUILD/dispatch-nccl.so start_server --mpi --device "$dev"; then
    step "$BUILD/tests/gpu/nccl_check" --server "$SERVER" --half "$half"
    grep -E 'group: NCCL|communicator' "$log" | sed 's/^.*: group: /   group: /'
    if [ "$half" = ok ] && ! grep -q 'communicator of 1 ranks made' "$log"; then
      echo "gpu: FAILED: the all-reduces of cuda:0 tensors did not take the NCCL path"
      status=1
    fi
    stop_server
  else
    status=1
  fi
  [ "$half" = ok ] || return
  # the NCCL init failing (the id spoiled): refused alike, then the host
  # path with the CUDA tensors staged by their worker
  if DISPATCH_MPI_PLUGIN=$BUILD/tests/gpu/mpi-single.so DISPATCH_MPI_SINGLE_SPOIL_NCCL_ID=1 \
    DISPATCH_NCCL_PLUGIN=$BUILD/dispatch-nccl.so start_server --mpi --mpi-timeout 10 --device "$dev"; then
    step "$BUILD/tests/gpu/nccl_check" --server "$SERVER" --init-fails
    stop_server
  else
    status=1
  fi
}

run_benches() {
  if start_server; then
    DISPATCH_BENCH_REMOTE=$SERVER step "$BUILD/bench/gpu/matmul_cuda"
    echo "== bench/bulk, bench/mlp and bench/gpt against the server's cuda:0"
    echo "section,metric,ours,unit,reference,ref_value,ratio,goal,met,note"
    DISPATCH_BENCH_REMOTE=$SERVER/cuda:0 step "$BUILD/bench/bulk"
    DISPATCH_BENCH_REMOTE=$SERVER/cuda:0 step "$BUILD/bench/mlp"
    echo "== bench/gpt: 'remote' is the step on cuda:0, 'local' the CPU"
    DISPATCH_BENCH_REMOTE=$SERVER/cuda:0 step "$BUILD/bench/gpt"
    stop_server
  else
    status=1
  fi
}

# No GPU here: every program starts, loads its libraries and the plugin,
# and reaches the point where it asks for cuda:0.
run_check() {
  step "$BUILD/tests/gpu/cuda_ops"
  step "$BUILD/tests/test_backend_ops" --filter 'backend_ops/conformance'
  step "$BUILD/bench/gpu/matmul_cuda"
  refuses "$BUILD/dispatch-server" --listen 127.0.0.1:0 --device cuda:0
  refuses "$BUILD/examples/train_mlp" --device local:cuda:0 --epochs 1
  if start_server; then
    grep -q 'devices: cpu:0 (cuda: plugin .* loaded, 0 GPUs' "$log" ||
      { echo "gpu: FAILED: --device all did not say what it found"; status=1; }
    # its checks need a GPU: here it only has to start
    echo "== $BUILD/tests/gpu/cuda_server (expected to stop: no cuda:0)"
    DISPATCH_GPU_REMOTE= "$BUILD/tests/gpu/cuda_server"
    [ $? -eq 1 ] || { echo "gpu: FAILED: cuda_server did not start"; status=1; }
    step "$BUILD/examples/train_mlp" --device "$SERVER" --epochs 1 --limit 2000 --log-every 0
    echo "section,metric,ours,unit,reference,ref_value,ratio,goal,met,note"
    for b in bulk mlp; do
      BENCH_QUICK=1 DISPATCH_BENCH_REMOTE=$SERVER step "$BUILD/bench/$b"
    done
    # bench/gpt's quick run takes a minute of CPU: its libraries only
    echo "== $BUILD/bench/gpt (libraries resolved, not run)"
    /lib64/ld-linux-x86-64.so.2 --list "$BUILD/bench/gpt" | grep -q 'not found' &&
      { echo "gpu: FAILED: bench/gpt misses a library"; status=1; }
    stop_server
  else
    status=1
  fi
  run_nccl all refused
}

case "$mode" in
  test) run_tests ;;
  bench) run_benches ;;
  all) run_tests; run_benches ;;
  check) run_check ;;
esac
[ "$status" -eq 0 ] && echo "gpu $mode: done" || echo "gpu $mode: FAILED"
exit "$status"
