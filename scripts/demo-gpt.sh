#!/usr/bin/env bash
# make demo-gpt: start dispatch-server on 127.0.0.1 with a free port, train
# the character-level GPT (examples/train_gpt.c) through it for GPT_STEPS
# steps (default 2000), stop the server. GPT_LOCAL=1 then trains the same
# model on the local device too, whose losses must be the REMOTE ones.
# Exits non-zero if any step fails.
set -euo pipefail
BUILD=${BUILD:-build}
STEPS=${GPT_STEPS:-2000}
. "$(dirname "$0")/local-server.sh"
local_server_start demo-gpt
echo "== training the GPT on tcp://127.0.0.1:$port for $STEPS steps"
start=$SECONDS
"$BUILD/examples/train_gpt" --device "tcp://127.0.0.1:$port" --steps "$STEPS"
echo "== $STEPS steps, validation and sample through the server: $((SECONDS - start)) s"
local_server_stop
if [ "${GPT_LOCAL:-0}" = 1 ]; then
  echo "== the same training on the local device"
  "$BUILD/examples/train_gpt" --device local --steps "$STEPS"
fi
exit "$status"
