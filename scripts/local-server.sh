# Sourced by the demo scripts (demo.sh, demo-gpt.sh): one dispatch-server
# on 127.0.0.1 with a free port for the length of a demo.
#   local_server_start NAME   starts "$BUILD/dispatch-server", sets pid and
#                             port, and stops it on exit; exits 1 (printing
#                             the server's log) if it does not come up
#   local_server_stop         SIGTERM, wait, print and set its exit status
local_server_start() {
  log=$(mktemp)
  "$BUILD/dispatch-server" --listen 127.0.0.1:0 >"$log" 2>&1 &
  pid=$!
  trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
  port=""
  for _ in $(seq 1 100); do
    port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$log")
    [ -n "$port" ] && break
    sleep 0.05
  done
  if [ -z "$port" ]; then
    echo "$1: server did not start:" >&2
    cat "$log" >&2
    exit 1
  fi
  echo "== dispatch-server pid $pid on 127.0.0.1:$port"
}

local_server_stop() {
  kill -TERM "$pid"
  status=0
  wait "$pid" || status=$?
  trap - EXIT
  rm -f "$log"
  echo "== dispatch-server exited with status $status"
}
