#!/usr/bin/env bash
# make demo: start dispatch-server on 127.0.0.1 with a free port, train the
# example MLP through it, train the same model on the local device for
# comparison, stop the server. Exits non-zero if any step fails.
set -euo pipefail
BUILD=${BUILD:-build}
EPOCHS=${EPOCHS:-3}
. "$(dirname "$0")/local-server.sh"
local_server_start demo
echo "== training on tcp://127.0.0.1:$port"
"$BUILD/examples/train_mlp" --device "tcp://127.0.0.1:$port" --epochs "$EPOCHS"
echo "== same training on the local device"
"$BUILD/examples/train_mlp" --device local --epochs "$EPOCHS"
local_server_stop
exit "$status"
