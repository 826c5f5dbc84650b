#!/usr/bin/env bash
# make bench: starts dispatch-server and the raw-socket reference server
# (bench/raw_server) on 127.0.0.1 with free ports, runs the benchmark
# programs of $BUILD/bench against them (each prints CSV rows: our figure
# with its spread over repetitions, the reference measured in the same
# run, the ratio, the goal and the verdict), stops the servers, prints the
# rows as a table and writes them to bench/results.csv. The memory
# benchmark gets a fresh server so its baseline is not what the other
# programs left behind. Exits non-zero if a program fails; a missed goal
# is reported, not fatal.
#
# Fairness that belongs here rather than in the programs:
#  - allocator: GLIBC_TUNABLES is set once, below, for every process this
#    script starts (servers, benchmark programs, Python), so the LOCAL
#    device and the server keep or return memory alike (BENCH_GLIBC_TUNABLES
#    overrides the value; an empty one leaves glibc's defaults to all);
#  - placement: dispatch-server and raw_server are both exec'd by
#    start_proc, the same way, with the same CPU affinity (this script's,
#    or the list in BENCH_SERVER_CPUS through taskset for both alike).
#
# BENCH_QUICK=1 (make bench-quick): tiny sizes and one or two repetitions,
# no goal judged; the CSV (bench/results-quick.csv) must then hold every
# row of bench/expected-rows.txt, with numbers where numbers belong, or
# the script exits non-zero. For CI: it checks that the benchmarks still
# run, not how fast.
set -uo pipefail
BUILD=${BUILD:-build}
QUICK=${BENCH_QUICK:-0}
[ "$QUICK" = 0 ] && QUICK=""
export BENCH_QUICK=${QUICK:+1}
if [ -n "$QUICK" ]; then
  CSV=${BENCH_CSV:-bench/results-quick.csv}
  PER_PROGRAM_LIMIT=${BENCH_PROGRAM_TIMEOUT:-40}
else
  CSV=${BENCH_CSV:-bench/results.csv}
  PER_PROGRAM_LIMIT=${BENCH_PROGRAM_TIMEOUT:-240}
fi
EXPECTED=bench/expected-rows.txt
HEADER="section,metric,ours,ours_min,ours_max,unit,reference,ref_value,ratio,ratio_q1,ratio_q3,reps,goal,verdict,note"

# one allocator policy for every process: glibc keeps freed memory (no
# trim below 256 MiB, mmap only above 64 MiB) instead of returning it and
# faulting it back in on the next step
DEFAULT_TUNABLES="glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"
export GLIBC_TUNABLES=${BENCH_GLIBC_TUNABLES-$DEFAULT_TUNABLES}
echo "== allocator for every process: GLIBC_TUNABLES=${GLIBC_TUNABLES:-(unset: glibc defaults)}" >&2
PIN=()
if [ -n "${BENCH_SERVER_CPUS:-}" ]; then
  PIN=(taskset -c "$BENCH_SERVER_CPUS")
  echo "== both servers pinned to CPUs $BENCH_SERVER_CPUS" >&2
else
  echo "== both servers unpinned (this script's CPU affinity, $(taskset -pc $$ 2>/dev/null | sed 's/.*: //'))" >&2
fi

rows=$(mktemp)
log=$(mktemp)
raw_log=$(mktemp)
# the server's --checkpoint-dir; the checkpoint benchmark writes its
# client-side files there too, so both go to the same file system
ckpt_dir=$(mktemp -d)
export DISPATCH_BENCH_CKPT_DIR="$ckpt_dir"
pid=""
raw_pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null
  [ -n "$raw_pid" ] && kill "$raw_pid" 2>/dev/null
  [ -n "${tls_pid:-}" ] && kill "$tls_pid" 2>/dev/null
  [ -n "${tls_dir:-}" ] && rm -rf "$tls_dir"
  for p in ${peer_pids:-}; do kill "$p" 2>/dev/null; done
  rm -rf "$ckpt_dir" "${peer_log:-}"
  rm -f "$rows" "$log" "$raw_log"
}
trap cleanup EXIT

# wait_port LOG PID NAME: prints the port the server PID announced in LOG
# ("NAME listening on 127.0.0.1:PORT"), or nothing if it exited or said
# nothing within 5 s
wait_port() {
  local port=""
  for _ in $(seq 1 100); do
    port=$(sed -n "s/^$3 listening on 127\.0\.0\.1:\([0-9]*\)\$/\1/p" "$1")
    [ -n "$port" ] && break
    kill -0 "$2" 2>/dev/null || break
    sleep 0.05
  done
  echo "$port"
}

# start_proc LOG NAME BIN ARGS...: execs a server the one way both
# servers are started (same environment, same placement); sets proc_pid
# and proc_port, or leaves proc_port empty
start_proc() {
  local log=$1 name=$2
  shift 2
  : >"$log"
  "${PIN[@]}" "$@" >"$log" 2>&1 &
  proc_pid=$!
  proc_port=$(wait_port "$log" "$proc_pid" "$name")
  if [ -z "$proc_port" ]; then
    echo "bench: $name did not start:" >&2
    cat "$log" >&2
    kill "$proc_pid" 2>/dev/null
    proc_pid=""
  fi
}

# start_server: sets pid, raw_pid, DISPATCH_BENCH_REMOTE and
# DISPATCH_BENCH_RAW, or leaves them empty
start_server() {
  pid=""
  raw_pid=""
  export DISPATCH_BENCH_REMOTE="" DISPATCH_BENCH_SERVER_PID="" DISPATCH_BENCH_RAW=""
  if [ ! -x "$BUILD/dispatch-server" ]; then
    echo "bench: no $BUILD/dispatch-server: remote rows will be n/a" >&2
  else
    # two CPU devices for the devices benchmark; cpu:0, the first, is every
    # other program's; a checkpoint directory for the checkpoint benchmark
    start_proc "$log" dispatch-server "$BUILD/dispatch-server" \
      --listen 127.0.0.1:0 --device cpu:0 --device cpu:1 \
      --checkpoint-dir "$ckpt_dir"
    if [ -n "$proc_port" ]; then
      pid=$proc_pid
      export DISPATCH_BENCH_REMOTE="tcp://127.0.0.1:$proc_port"
      export DISPATCH_BENCH_SERVER_PID="$pid"
      echo "== dispatch-server pid $pid on 127.0.0.1:$proc_port" >&2
    fi
  fi
  start_proc "$raw_log" raw-server "$BUILD/bench/raw_server" --listen 127.0.0.1:0
  if [ -n "$proc_port" ]; then
    raw_pid=$proc_pid
    export DISPATCH_BENCH_RAW="127.0.0.1:$proc_port"
    echo "== raw-server pid $raw_pid on 127.0.0.1:$proc_port" >&2
  fi
}

stop_server() {
  local p
  for p in $pid $raw_pid; do
    kill -TERM "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  pid=""
  raw_pid=""
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
  start_proc "$tls_dir/log" dispatch-server "$BUILD/dispatch-server" \
    --listen 127.0.0.1:0 --tls-cert "$tls_dir/server.pem" \
    --tls-key "$tls_dir/server.key"
  tls_pid=$proc_pid
  if [ -n "$proc_port" ]; then
    export DISPATCH_BENCH_TLS="tls://127.0.0.1:$proc_port" DISPATCH_TLS_CA="$tls_dir/ca.pem"
  else
    echo "bench: TLS server did not start; TLS rows will be n/a" >&2
  fi
}
stop_tls_server() {
  [ -n "$tls_pid" ] && kill -TERM "$tls_pid" 2>/dev/null && wait "$tls_pid" 2>/dev/null
  tls_pid=""
  rm -rf "$tls_dir"
}

# two more servers for the peer benchmark (bench/peer.c): A, named a, and
# B, which may pull tensors from it (--peer a=A's address)
peer_pids=""
peer_log=$(mktemp -d)
start_peer_servers() {
  export DISPATCH_BENCH_PEER_A="" DISPATCH_BENCH_PEER_B=""
  start_proc "$peer_log/a" dispatch-server "$BUILD/dispatch-server" \
    --listen 127.0.0.1:0 --name a
  [ -n "$proc_port" ] || return
  local pa=$proc_port
  peer_pids=$proc_pid
  start_proc "$peer_log/b" dispatch-server "$BUILD/dispatch-server" \
    --listen 127.0.0.1:0 --peer "a=127.0.0.1:$pa"
  [ -n "$proc_port" ] || return
  peer_pids="$peer_pids $proc_pid"
  export DISPATCH_BENCH_PEER_A="tcp://127.0.0.1:$pa"
  export DISPATCH_BENCH_PEER_B="tcp://127.0.0.1:$proc_port"
  echo "== peer servers A on 127.0.0.1:$pa, B on 127.0.0.1:$proc_port" >&2
}
stop_peer_servers() {
  local p
  for p in $peer_pids; do
    kill -TERM "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  peer_pids=""
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

# BENCH_ONLY="latency bulk": those programs alone (python and memory are
# names too), for working on one benchmark; the CSV then holds their rows
only=" ${BENCH_ONLY:-latency ops bulk devices peer checkpoint matmul mlp gpt graph attention group python memory load} "
want() { [[ $only == *" $1 "* ]]; }
start=$(date +%s)
start_server
start_tls_server
# bench/group starts its own 2-rank MPI group of this build's server
srv_bin=$BUILD/dispatch-server
[[ $srv_bin = /* ]] || srv_bin=$PWD/$srv_bin
export DISPATCH_SERVER_BIN=${DISPATCH_SERVER_BIN:-$srv_bin}
for b in latency ops bulk devices checkpoint matmul mlp gpt graph attention group; do want "$b" && run "$b"; done
want python && run_python_mlp
if want peer; then
  start_peer_servers
  run peer
  stop_peer_servers
fi
stop_tls_server
stop_server
if want memory; then
  start_server
  run memory
  stop_server
fi
# the load rows start their own server (72 sessions, and a fresh RSS
# baseline); quick mode shrinks the run from 64 x 10,000 calls + 8 x 64 MiB
if want load; then
  if [ -n "$QUICK" ]; then
    LOAD_CLIENTS=4 LOAD_OPS=100 LOAD_BIG=1 LOAD_BIG_MIB=4 run load
  else
    run load
  fi
fi

mkdir -p "$(dirname "$CSV")"
{ echo "$HEADER"; cat "$rows"; } >"$CSV"

# the table: figures with their spread (ours: min..max over repetitions;
# ratio: interquartile range of the per-repetition ratios)
echo
awk -F, '
  { if (NR == 1) {
      c[1] = "section"; c[2] = "metric"; c[3] = "ours [min..max]"; c[4] = "unit"
      c[5] = "reference"; c[6] = "ref"; c[7] = "ratio [q1..q3]"; c[8] = "reps"
      c[9] = "goal"; c[10] = "verdict"
    } else {
      c[1] = $1; c[2] = $2; c[3] = $3 " [" $4 ".." $5 "]"; c[4] = $6
      c[5] = $7; c[6] = $8; c[7] = ($9 == "-") ? "-" : $9 " [" $10 ".." $11 "]"
      c[8] = $12; c[9] = $13; c[10] = $14
    }
    for (i = 1; i <= 10; i++) { t[NR, i] = c[i]; if (length(c[i]) > w[i]) w[i] = length(c[i]) }
    note[NR] = $15; n = NR }
  END {
    for (r = 1; r <= n; r++) {
      line = ""
      for (i = 1; i <= 10; i++) {
        fmt = (i == 3 || i == 6 || i == 7 || i == 8) ? "%" w[i] "s" : "%-" w[i] "s"
        line = line sprintf(fmt, t[r, i]) (i < 10 ? "  " : "")
      }
      print line
      if (r == 1) { gsub(/./, "-", line); print line }
    }
    print ""
    for (r = 2; r <= n; r++)
      if (note[r] != "") printf "note (%s / %s): %s\n", t[r, 1], t[r, 2], note[r]
  }' "$CSV"
echo
count() { awk -F, -v v="$1" 'NR > 1 && $14 == v' "$CSV" | wc -l; }
# the rows that need a look, by name
awk -F, 'NR > 1 && ($14 == "REF SUSPECT" || $14 == "unclear") {
  printf "%s: %s / %s (ratio %s [%s..%s] over %s reps)\n", $14, $1, $2, $9, $10, $11, $12 }' "$CSV"
echo "allocator: GLIBC_TUNABLES=${GLIBC_TUNABLES:-(unset)}; verdicts: $(count met) met, $(count missed) missed, $(count unclear) unclear (spread does not support a verdict), $(count 'REF SUSPECT') REF SUSPECT, $(count n/a) not measured; $(($(date +%s) - start)) s in all; rows in $CSV"

# Quick mode: every expected row present once, numbers where numbers
# belong. Sizes differ between the modes ("upload 64 MiB" here is "upload
# 1 MiB" there), so rows are compared with every number in the metric
# replaced by #, as multisets.
if [ -n "$QUICK" ] && [ -n "${BENCH_ONLY:-}" ]; then
  echo "bench-quick: BENCH_ONLY set: the CSV is not checked for completeness" >&2
elif [ -n "$QUICK" ]; then
  norm() { sed -E 's/[0-9]+(\.[0-9]+)?( ?(KiB|MiB|GiB))?/#/g' | LC_ALL=C sort; }
  want=$(grep -v '^#' "$EXPECTED" | grep -v '^$' | norm)
  got=$(awk -F, 'NR > 1 { print $1 "," $2 }' "$CSV" | norm)
  missing=$(LC_ALL=C comm -23 <(echo "$want") <(echo "$got"))
  extra=$(LC_ALL=C comm -13 <(echo "$want") <(echo "$got"))
  bad=$(awk -F, '
    function num(x) { return x ~ /^-?[0-9]+(\.[0-9]+)?(e[-+]?[0-9]+)?$/ }
    NR > 1 {
      why = ""
      if (NF != 15) why = "has " NF " fields, not 15"
      else if (!num($3) || !num($4) || !num($5)) why = "ours/min/max not numbers"
      else if ($7 != "-" && (!num($8) || !num($9) || !num($10) || !num($11)))
        why = "reference/ratio/quartiles not numbers"
      else if ($12 !~ /^[1-9][0-9]*$/) why = "no repetitions"
      if (why != "") print "  " $1 " / " $2 ": " why " (" $15 ")"
    }' "$CSV")
  if [ -n "$missing" ] || [ -n "$bad" ]; then
    echo "bench-quick: CSV incomplete:" >&2
    [ -n "$missing" ] && echo "$missing" | sed 's/^/  missing: /' >&2
    [ -n "$bad" ] && echo "$bad" >&2
    status=1
  fi
  [ -n "$extra" ] && echo "bench-quick: rows not in $EXPECTED (add them): $(echo "$extra" | tr '\n' ';')" >&2 && status=1
  [ "$status" = 0 ] && echo "bench-quick: all $(echo "$want" | wc -l) expected rows present with numeric fields"
fi
exit "$status"
