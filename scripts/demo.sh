#!/usr/bin/env bash
# make demo: start dispatch-server on 127.0.0.1 with a free port, train the
# example MLP through it, train the same model on the local device for
# comparison, stop the server. Exits non-zero if any step fails.
set -euo pipefail
BUILD=${BUILD:-build}
EPOCHS=${EPOCHS:-3}
log=$(mktemp)
"$BUILD/dispatch-server" --listen 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; rm -f "$log"; }
trap cleanup EXIT
port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$log")
  [ -n "$port" ] && break
  sleep 0.05
done
if [ -z "$port" ]; then
  echo "demo: server did not start:" >&2
  cat "$log" >&2
  exit 1
fi
echo "== dispatch-server pid $pid on 127.0.0.1:$port"
echo "== training on tcp://127.0.0.1:$port"
"$BUILD/examples/train_mlp" --device "tcp://127.0.0.1:$port" --epochs "$EPOCHS"
echo "== same training on the local device"
"$BUILD/examples/train_mlp" --device local --epochs "$EPOCHS"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
trap - EXIT
rm -f "$log"
echo "== dispatch-server exited with status $status"
exit "$status"
