#!/usr/bin/env bash
# make bench: starts dispatch-server on 127.0.0.1 with a free port, runs the
# benchmark programs of $BUILD/bench against it (each prints CSV rows: our
# figure, the reference measured in the same run, the ratio, the goal and
# whether it is met), stops the server, prints the rows as a table and
# writes them to bench/results.csv. The memory benchmark gets a fresh
# server so its baseline is not what the other programs left behind.
# Exits non-zero if a program fails; a missed goal is reported, not fatal.
set -uo pipefail
BUILD=${BUILD:-build}
CSV=${BENCH_CSV:-bench/results.csv}
PER_PROGRAM_LIMIT=${BENCH_PROGRAM_TIMEOUT:-150}
HEADER="section,metric,ours,unit,reference,ref_value,ratio,goal,met,note"

rows=$(mktemp)
log=$(mktemp)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  [ -n "${tls_pid:-}" ] && kill "$tls_pid" 2>/dev/null
  [ -n "${tls_dir:-}" ] && rm -rf "$tls_dir"
  rm -f "$rows" "$log"
}
trap cleanup EXIT

# wait_port LOG PID: prints the port the server PID announced in LOG, or
# nothing if it exited or said nothing within 5 s
wait_port() {
  local port=""
  for _ in $(seq 1 100); do
    port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$1")
    [ -n "$port" ] && break
    kill -0 "$2" 2>/dev/null || break
    sleep 0.05
  done
  echo "$port"
}

# start_server: sets pid and DISPATCH_BENCH_REMOTE, or leaves them empty
start_server() {
  pid=""
  export DISPATCH_BENCH_REMOTE="" DISPATCH_BENCH_SERVER_PID=""
  if [ ! -x "$BUILD/dispatch-server" ]; then
    echo "bench: no $BUILD/dispatch-server: remote rows will be n/a" >&2
    return
  fi
  : >"$log"
  # two CPU devices for the devices benchmark; cpu:0, the first, is every
  # other program's
  "$BUILD/dispatch-server" --listen 127.0.0.1:0 --device cpu:0 --device cpu:1 \
    >"$log" 2>&1 &
  pid=$!
  local port
  port=$(wait_port "$log" "$pid")
  if [ -z "$port" ]; then
    echo "bench: server did not start; remote rows will be n/a:" >&2
    cat "$log" >&2
    kill "$pid" 2>/dev/null
    pid=""
    return
  fi
  export DISPATCH_BENCH_REMOTE="tcp://127.0.0.1:$port"
  export DISPATCH_BENCH_SERVER_PID="$pid"
  echo "== dispatch-server pid $pid on 127.0.0.1:$port" >&2
}

stop_server() {
  [ -z "$pid" ] && return
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pid=""
}

status=0
run() {
  local name=$1 bin="$BUILD/bench/$1" t0 rc
  if [ ! -x "$bin" ]; then
    echo "bench: $bin missing (make BUILD=$BUILD all)" >&2
    status=1
    return
  fi
  echo "== $name" >&2
  t0=$EPOCHREALTIME
  timeout "$PER_PROGRAM_LIMIT" "$bin" >>"$rows"
  rc=$?
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v n="$name" -v rc="$rc" \
    'BEGIN { printf "   %s took %.1f s (exit %d)\n", n, b - a, rc }' >&2
  [ "$rc" -ne 0 ] && status=1
}

# a second server with TLS (certificates from deploy/make-certs.sh) for the
# TLS rows of the bulk benchmark
tls_pid=""
tls_dir=$(mktemp -d)
start_tls_server() {
  export DISPATCH_BENCH_TLS=""
  deploy/make-certs.sh "$tls_dir" >/dev/null 2>&1 || {
    echo "bench: could not make certificates: TLS rows will be n/a" >&2
    return
  }
  "$BUILD/dispatch-server" --listen 127.0.0.1:0 --tls-cert "$tls_dir/server.pem" \
    --tls-key "$tls_dir/server.key" >"$tls_dir/log" 2>&1 &
  tls_pid=$!
  local port
  port=$(wait_port "$tls_dir/log" "$tls_pid")
  if [ -n "$port" ]; then
    export DISPATCH_BENCH_TLS="tls://127.0.0.1:$port" DISPATCH_TLS_CA="$tls_dir/ca.pem"
  else
    echo "bench: TLS server did not start; TLS rows will be n/a" >&2
  fi
}
stop_tls_server() {
  [ -n "$tls_pid" ] && kill -TERM "$tls_pid" 2>/dev/null && wait "$tls_pid" 2>/dev/null
  tls_pid=""
  rm -rf "$tls_dir"
}

# The MLP step driven from Python (python/bench/mlp_step.py) against the
# same step driven from C, which the script runs in turns with its own in
# `$BUILD/bench/mlp --steps-on-stdin`.
run_python_mlp() {
  local t0 rc lib="$BUILD/libdispatch-client.so"
  [[ $lib = /* ]] || lib="$PWD/$lib"
  echo "== python mlp" >&2
  t0=$EPOCHREALTIME
  BUILD="$BUILD" DISPATCH_CLIENT_LIB="$lib" \
    timeout "$PER_PROGRAM_LIMIT" "${PYTHON:-/usr/bin/python3}" python/bench/mlp_step.py >>"$rows"
  rc=$?
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v rc="$rc" \
    'BEGIN { printf "   python mlp took %.1f s (exit %d)\n", b - a, rc }' >&2
  [ "$rc" -ne 0 ] && status=1
}

start=$(date +%s)
start_server
start_tls_server
for b in latency ops bulk devices matmul mlp; do run "$b"; done
run_python_mlp
stop_tls_server
stop_server
start_server
run memory
stop_server

mkdir -p "$(dirname "$CSV")"
{ echo "$HEADER"; cat "$rows"; } >"$CSV"

echo
awk -F, '
  { for (i = 1; i <= 9; i++) { c[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) }
    note[NR] = $10; n = NR }
  END {
    for (r = 1; r <= n; r++) {
      line = ""
      for (i = 1; i <= 9; i++) {
        fmt = (i == 3 || i == 6 || i == 7) ? "%" w[i] "s" : "%-" w[i] "s"
        line = line sprintf(fmt, c[r, i]) (i < 9 ? "  " : "")
      }
      print line
      if (r == 1) { gsub(/./, "-", line); print line }
    }
    print ""
    for (r = 2; r <= n; r++)
      if (note[r] != "") printf "note (%s / %s): %s\n", c[r, 1], c[r, 2], note[r]
  }' "$CSV"
echo
met=$(awk -F, 'NR > 1 && $9 == "yes"' "$CSV" | wc -l)
missed=$(awk -F, 'NR > 1 && $9 == "NO"' "$CSV" | wc -l)
na=$(awk -F, 'NR > 1 && $9 == "n/a"' "$CSV" | wc -l)
echo "goals: $met met, $missed missed, $na not measured; $(($(date +%s) - start)) s in all; rows in $CSV"
exit "$status"
