#!/usr/bin/env bash
# The deploy test (make deploy-test, part of make test). It checks that
# deploy/ works as deploy/README.md documents it:
#
#  systemd  the unit passes `systemd-analyze verify` with no warning (its
#           ExecStart pointed at a copy of this build's server), loads the
#           key, certificate and token with LoadCredential= and passes
#           them as %d paths, runs as DynamicUser=, and keeps its
#           hardening (`systemd-analyze security --offline` exposure at
#           most 2.0); its TimeoutStopSec= exceeds its explicit
#           --drain-timeout by at least 10 s. dispatch-server-gpu.conf
#           passes verify as its drop-in, its ExecStart the unit's plus
#           --device all. Its ExecStart line, %d expanded to a directory laid
#           out as systemd lays out credentials (dir 0500, files 0400,
#           owned by the service's user), is started as nobody and serves;
#           its ExecReload sends SIGHUP, after which the server takes the
#           token then in %d/token and refuses the one it had.
#  files    deploy/make-certs.sh with a comma list of names puts them all in
#           the certificate; make-certs.sh --group nogroup writes server.key and
#           token 0640 root:nogroup, ca.key and client.key 0600, the
#           certificates 0644; another user (daemon) can read neither the
#           key nor the token, and a server started as daemon stops with
#           "Permission denied".
#  server   dispatch-server started as nobody:nogroup (setpriv, no
#           supplementary groups) with those files on 127.0.0.1, port 0;
#           examples/first_program over tls://localhost:PORT with
#           DISPATCH_TLS_CA and DISPATCH_TOKEN prints what it prints
#           locally; dispatch-probe passes with the token file and fails
#           with a wrong token.
#  k8s      deploy/tests/check_k8s.py (see there).
#  group    deploy/tests/check_group.py: the MPI group's MPIJob and
#           NetworkPolicy (deploy/group; see there).
#
# Needs root (to switch users, as CI runs); otherwise it says it could not
# run and fails. Prints "deploy: N passed, M failed".
set -u
cd "$(dirname "$0")/../.."
root=$PWD
build=${BUILD:-build}
server=$root/$build/dispatch-server
probe=$root/$build/dispatch-probe
prog=$root/$build/examples/first_program

if [ "$(id -u)" != 0 ]; then
  echo "deploy: NOT RUN: needs root to start the server as another user" \
       "(setpriv); 0 passed, 1 failed"
  exit 1
fi
for f in "$server" "$probe" "$prog"; do
  [ -x "$f" ] || { echo "deploy: $f missing (make deploy-test builds it)"; exit 1; }
done

passed=0
failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; failed=$((failed + 1)); }
check() { # $1 = what, then the command; its output is shown on failure
  local what=$1 out
  shift
  if out=$("$@" 2>&1); then ok "$what"; else bad "$what"; printf '%s\n' "$out" | tail -n 15 | sed 's/^/  | /'; fi
}

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
# other users must reach the files below tmp; the server binary is copied
# there, since the checkout's path may not be open to them
chmod 755 "$tmp"
mkdir "$tmp/bin"
cp "$server" "$probe" "$tmp/bin/"
chmod 755 "$tmp/bin" "$tmp/bin/"*

as_nobody=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
as_daemon=(setpriv --reuid=daemon --regid=daemon --clear-groups)

# start_server NAME CMD...: runs the server in the background with stdout
# in $tmp/NAME.out and stderr in $tmp/NAME.err; sets port (empty when it
# never announced one) and spid. Waits at most 10 s.
start_server() {
  local name=$1
  shift
  "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  spid=$!
  pids+=("$spid")
  port=
  for _ in $(seq 200); do
    port=$(sed -n 's/^dispatch-server listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$tmp/$name.out")
    [ -n "$port" ] && return 0
    kill -0 "$spid" 2>/dev/null || return 0
    sleep 0.05
  done
}
stop_server() { kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }
uid_of() { awk '/^Uid:/ {print $2}' "/proc/$1/status" 2>/dev/null; }

# ------------------------------------------------------------ systemd
unit=deploy/dispatch-server.service
sed "s|/usr/local/bin/dispatch-server|$tmp/bin/dispatch-server|" "$unit" >"$tmp/dispatch-server.service"
verify_quiet() { # no warning either: systemd-analyze exits 0 on unknown keys
  local out
  out=$(systemd-analyze verify --man=no "$1" 2>&1) || { echo "$out"; return 1; }
  [ -z "$out" ] || { echo "$out"; return 1; }
}
check "systemd-analyze verify $unit: no error, no warning" verify_quiet "$tmp/dispatch-server.service"
for c in server.pem server.key token; do
  check "$unit loads $c with LoadCredential=" grep -q "^LoadCredential=$c:/etc/dispatch/$c\$" "$unit"
done
execstart=$(sed -n '/^ExecStart=/,/[^\\]$/p' "$tmp/dispatch-server.service" | sed 's/\\$//' | tr -s ' \n' ' ' | sed 's/^ExecStart=//')
check "ExecStart reads key, certificate and token from %d" \
  bash -c '[[ "$0" == *"--tls-cert %d/server.pem"* && "$0" == *"--tls-key %d/server.key"* && "$0" == *"--token-file %d/token"* ]]' "$execstart"
check "$unit runs as DynamicUser=yes" grep -q '^DynamicUser=yes$' "$unit"
drain=$(sed -n 's/.*--drain-timeout \([0-9][0-9]*\).*/\1/p' <<<"$execstart")
stop=$(sed -n 's/^TimeoutStopSec=\([0-9][0-9]*\)$/\1/p' "$unit")
check "TimeoutStopSec ($stop s) is an explicit --drain-timeout ($drain s) plus at least 10 s" \
  bash -c '[ -n "$0" ] && [ -n "$1" ] && [ "$1" -ge $(($0 + 10)) ]' "$drain" "$stop"
check "systemd-analyze security --offline: exposure at most 2.0" \
  systemd-analyze security --offline=yes --threshold=20 "$tmp/dispatch-server.service"
# the GPU host's drop-in: verified with the unit, and its ExecStart is the
# unit's with --device all added (the two cannot drift apart)
gpu=deploy/dispatch-server-gpu.conf
mkdir "$tmp/dispatch-server.service.d"
sed "s|/usr/local/bin/dispatch-server|$tmp/bin/dispatch-server|" "$gpu" \
  >"$tmp/dispatch-server.service.d/gpu.conf"
check "systemd-analyze verify with $gpu as a drop-in: no error, no warning" \
  verify_quiet "$tmp/dispatch-server.service"
gpu_exec=$(sed -n '/^ExecStart=./,/[^\\]$/p' "$tmp/dispatch-server.service.d/gpu.conf" |
           sed 's/\\$//' | tr -s ' \n' ' ' | sed 's/^ExecStart=//')
check "$gpu: ExecStart= reset, then the unit's ExecStart plus --device all" \
  bash -c 'grep -q "^ExecStart=\$" "$2" && [ "${0% }" = "${1% } --device all" ] ||
           { echo "drop-in: $0"; echo "unit:    $1"; exit 1; }' "$gpu_exec" "$execstart" "$gpu"

# ------------------------------------------------------------ files
certs=$tmp/etc
check "make-certs.sh --group nogroup" deploy/make-certs.sh --group nogroup "$certs" localhost
mode_is() { [ "$(stat -c '%a %U:%G' "$1")" = "$2" ] || { stat -c '%n: %a %U:%G, want '"$2" "$1"; return 1; }; }
check "server.key is 640 root:nogroup" mode_is "$certs/server.key" "640 root:nogroup"
check "token is 640 root:nogroup" mode_is "$certs/token" "640 root:nogroup"
check "ca.key is 600" mode_is "$certs/ca.key" "600 root:root"
check "client.key is 600" mode_is "$certs/client.key" "600 root:root"
check "server.pem is 644" mode_is "$certs/server.pem" "644 root:root"
# a comma list of names: every one in the one certificate (the pods of a
# StatefulSet sharing its Secret, deploy/README.md section 4)
check "make-certs.sh with a comma list puts every name in the certificate" \
  bash -c 'deploy/make-certs.sh "$0/multi" a-0.svc,a-1.svc >/dev/null &&
           openssl x509 -in "$0/multi/server.pem" -noout -ext subjectAltName |
           grep -q "DNS:a-0.svc, DNS:a-1.svc, DNS:localhost"' "$tmp"
check "another user (daemon) cannot read server.key" bash -c '! "$@" cat "$0" >/dev/null 2>&1' "$certs/server.key" "${as_daemon[@]}"
check "another user (daemon) cannot read token" bash -c '! "$@" cat "$0" >/dev/null 2>&1' "$certs/token" "${as_daemon[@]}"
srv_args=(--listen 127.0.0.1:0 --tls-cert "$certs/server.pem" --tls-key "$certs/server.key" --token-file "$certs/token")
start_server daemon "${as_daemon[@]}" "$tmp/bin/dispatch-server" "${srv_args[@]}"
wait "$spid" 2>/dev/null
check "a server started as daemon stops: Permission denied" \
  bash -c '[ -z "$0" ] && grep -q "Permission denied" "$1" || { echo "port: $0"; cat "$1"; exit 1; }' "$port" "$tmp/daemon.err"

# ------------------------------------------------------------ server
start_server nobody "${as_nobody[@]}" "$tmp/bin/dispatch-server" "${srv_args[@]}"
check "dispatch-server as nobody:nogroup serves with the make-certs files" \
  bash -c '[ -n "$0" ] || { cat "$1"; exit 1; }' "$port" "$tmp/nobody.err"
check "the server process runs as uid 65534" bash -c '[ "$0" = 65534 ]' "$(uid_of "$spid")"
if [ -n "$port" ]; then
  want=$(DISPATCH_DEVICE=local "$prog" 2>&1)
  got=$(DISPATCH_DEVICE="tls://localhost:$port" DISPATCH_TLS_CA="$certs/ca.pem" \
        DISPATCH_TOKEN="$(cat "$certs/token")" "$prog" 2>&1)
  check "first_program over TLS with the token prints what it prints locally ($want)" \
    bash -c '[ "$0" = "$1" ] || { echo "remote: $0"; echo "local: $1"; exit 1; }' "$got" "$want"
  check "dispatch-probe with --token-file and --ca passes" \
    "$tmp/bin/dispatch-probe" --ca "$certs/ca.pem" --token-file "$certs/token" "tls://localhost:$port"
  echo wrong >"$tmp/wrong-token"
  check "dispatch-probe with a wrong token fails (authentication)" \
    bash -c 'out=$("$@" 2>&1); rc=$?; echo "$out"; [ $rc = 1 ] && [[ "$out" == *auth* ]]' _ \
    "$tmp/bin/dispatch-probe" --ca "$certs/ca.pem" --token-file "$tmp/wrong-token" "tls://localhost:$port"
fi
stop_server

# the unit's own command line, credentials laid out as systemd does
cred=$tmp/credentials
mkdir "$cred"
cp "$certs/server.pem" "$certs/server.key" "$certs/token" "$cred/"
chown -R nobody:nogroup "$cred"
chmod 0400 "$cred"/*
chmod 0500 "$cred"
unit_cmd=${execstart//%d/$cred}
unit_cmd=$(sed -E 's/--listen [^ ]+/--listen 127.0.0.1:0/' <<<"$unit_cmd")
read -r -a unit_argv <<<"$unit_cmd"
start_server unit "${as_nobody[@]}" "${unit_argv[@]}"
check "the unit's ExecStart (%d a credentials dir, 0500/0400) as nobody serves" \
  bash -c '[ -n "$0" ] || { cat "$1"; exit 1; }' "$port" "$tmp/unit.err"
if [ -n "$port" ]; then
  check "dispatch-probe against the unit's server" \
    "$tmp/bin/dispatch-probe" --ca "$certs/ca.pem" --token-file "$certs/token" "tls://localhost:$port"
  # systemctl reload: the unit's ExecReload sends SIGHUP, and the server
  # reads %d/token again. systemd 252 never rewrites that copy while the
  # service runs (deploy/README.md, section 2); here the copy is replaced
  # by hand, as a systemd that refreshes credentials on reload would.
  check "$unit: ExecReload= sends SIGHUP to the main process" \
    grep -q '^ExecReload=/bin/kill -HUP \$MAINPID$' "$unit"
  head -c 32 /dev/urandom | base64 >"$tmp/new-token"
  install -m 0400 -o nobody -g nogroup "$tmp/new-token" "$cred/token"
  kill -HUP "$spid"
  for _ in $(seq 200); do
    grep -q 'reload (SIGHUP): done:' "$tmp/unit.err" && break
    sleep 0.05
  done
  check "after SIGHUP the unit's server takes the token now in %d/token" \
    "$tmp/bin/dispatch-probe" --ca "$certs/ca.pem" --token-file "$tmp/new-token" "tls://localhost:$port"
  check "after SIGHUP the unit's server refuses the token it had" \
    bash -c '! "$@" >/dev/null 2>&1' _ \
    "$tmp/bin/dispatch-probe" --ca "$certs/ca.pem" --token-file "$certs/token" "tls://localhost:$port"
fi
stop_server

# ------------------------------------------------------------ k8s
# py_checks SCRIPT DIR: each line of its output is one check, counted here
py_checks() {
  local out rc
  out=$(DISPATCH_SERVER_BIN="$server" "${PYTHON:-/usr/bin/python3}" "deploy/tests/$1" "$2" 2>&1)
  rc=$?
  printf '%s\n' "$out"
  passed=$((passed + $(grep -c '^ok: ' <<<"$out")))
  failed=$((failed + $(grep -c '^FAILED: ' <<<"$out")))
  [ $rc = 0 ] || grep -q '^FAILED: ' <<<"$out" || bad "$1 exited $rc"
}
py_checks check_k8s.py deploy/k8s

# the MPI group's manifests, the same way
py_checks check_group.py deploy/group

echo "deploy: $passed passed, $failed failed"
[ "$failed" = 0 ]
