#!/usr/bin/env bash
# make demo-gpt: start dispatch-server on 127.0.0.1 with a free port, train
# the character-level GPT (examples/train_gpt.c) through it for GPT_STEPS
# steps (default 2000), stop the server. GPT_LOCAL=1 then trains the same
# model on the local device too, whose losses must be the REMOTE ones.
# Exits non-zero if any step fails.
set -euo pipefail
BUILD=${BUILD:-build}
STEPS=${GPT_STEPS:-2000}
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
  echo "demo-gpt: server did not start:" >&2
  cat "$log" >&2
  exit 1
fi
echo "== dispatch-server pid $pid on 127.0.0.1:$port"
echo "== training the GPT on tcp://127.0.0.1:$port for $STEPS steps"
"$BUILD/examples/train_gpt" --device "tcp://127.0.0.1:$port" --steps "$STEPS"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
trap - EXIT
rm -f "$log"
echo "== dispatch-server exited with status $status"
if [ "${GPT_LOCAL:-0}" = 1 ]; then
  echo "== the same training on the local device"
  "$BUILD/examples/train_gpt" --device local --steps "$STEPS"
fi
exit "$status"
