#!/usr/bin/env bash
# make test-gpu / make bench-gpu: everything a GPU host runs, in one go.
#   scripts/gpu.sh test    the conformance suite with the CUDA backend in
#                          process, every op x dtype on the GPU against the
#                          CPU (tests/gpu/cuda_ops), then dispatch-server-cuda
#                          on 127.0.0.1 with cuda:0 as its first device and
#                          tests/gpu/cuda_server against it (round trips
#                          across the staging parts, four sessions at once,
#                          moves to cpu:0 and back)
#   scripts/gpu.sh bench   matmul 4096 f32: the backend and the remote
#                          cuda:0 beside cuBLAS called directly; bench/bulk
#                          (256 MiB upload and read beside the raw socket)
#                          and bench/mlp (the MLP step remote on cuda:0
#                          beside the same step on the local CPU), both
#                          against dispatch-server-cuda on cuda:0, and
#                          bench/gpt (the char-GPT training step remote on
#                          cuda:0 beside the same step on the local CPU;
#                          its corpus is GPT_CORPUS_DIR, else the system's
#                          fortunes, else the copy make puts in
#                          $BUILD/fortunes for a host without Debian's)
# Without a GPU (or without the backend) it prints "cuda: skipped (no GPU):
# REASON" and exits 0, claiming nothing. Expects the programs built (the
# Makefile targets build them first). Exits 1 when anything fails.
set -uo pipefail
BUILD=${BUILD:-build}
mode=${1:-test}
LIMIT=${GPU_PROGRAM_TIMEOUT:-300}

"$BUILD/tests/gpu/cuda_ops" --probe
rc=$?
[ "$rc" -eq 2 ] && exit 0 # the skipped line is printed
[ "$rc" -ne 0 ] && { echo "gpu: cuda_ops --probe failed (exit $rc)"; exit 1; }

log=$(mktemp)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  rm -f "$log"
}
trap cleanup EXIT

# dispatch-server-cuda with cuda:0 first (the device of a client that names
# none) and cpu:0 for moves; sets DISPATCH_GPU_REMOTE
start_server() {
  "$BUILD/dispatch-server-cuda" --listen 127.0.0.1:0 --device cuda:0 \
    --device cpu:0 >"$log" 2>&1 &
  pid=$!
  local port=""
  for _ in $(seq 1 200); do
    port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$log")
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  if [ -z "$port" ]; then
    echo "gpu: dispatch-server-cuda did not start:"
    cat "$log"
    pid=""
    return 1
  fi
  export DISPATCH_GPU_REMOTE="tcp://127.0.0.1:$port"
  echo "== dispatch-server-cuda pid $pid on 127.0.0.1:$port (cuda:0, cpu:0)"
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

case "$mode" in
  test)
    DISPATCH_SERVER_BIN=$PWD/$BUILD/dispatch-server \
      step "$BUILD/tests/test_backend_ops" --filter 'backend_ops/conformance'
    step "$BUILD/tests/gpu/cuda_ops"
    if start_server; then
      step "$BUILD/tests/gpu/cuda_server"
      stop_server
    else
      status=1
    fi
    ;;
  bench)
    if start_server; then
      DISPATCH_BENCH_REMOTE=$DISPATCH_GPU_REMOTE step "$BUILD/bench/gpu/matmul_cuda"
      echo "== bench/bulk and bench/mlp with the server's default device cuda:0"
      echo "section,metric,ours,unit,reference,ref_value,ratio,goal,met,note"
      DISPATCH_BENCH_REMOTE=$DISPATCH_GPU_REMOTE step "$BUILD/bench/bulk"
      DISPATCH_BENCH_REMOTE=$DISPATCH_GPU_REMOTE step "$BUILD/bench/mlp"
      if [ -z "${GPT_CORPUS_DIR:-}" ] && [ ! -d /usr/share/games/fortunes ] &&
        [ -d "$BUILD/fortunes" ]; then
        export GPT_CORPUS_DIR=$PWD/$BUILD/fortunes
      fi
      echo "== bench/gpt: 'remote' is the step on cuda:0, 'local' the CPU"
      DISPATCH_BENCH_REMOTE=$DISPATCH_GPU_REMOTE step "$BUILD/bench/gpt"
      stop_server
    else
      status=1
    fi
    ;;
  *)
    echo "usage: scripts/gpu.sh test|bench"
    exit 2
    ;;
esac
[ "$status" -eq 0 ] && echo "gpu $mode: done" || echo "gpu $mode: FAILED"
exit "$status"
