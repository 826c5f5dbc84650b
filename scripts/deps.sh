#!/usr/bin/env bash
# Installs the Debian packages dispatch needs to build, test and run its demo.
# As root it runs apt-get; otherwise it prints the exact command and fails.
set -eu
pkgs="gcc make pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
libssl-dev openssl libcriterion-dev libopenblas-dev zlib1g-dev libcjson-dev
libmicrohttpd-dev prometheus
systemd python3-yaml python3-jsonschema
dataset-fashion-mnist clang libclang-rt-14-dev valgrind
python3 python3-cffi python3-numpy python3-pytest
python3-pip python3-setuptools python3-wheel python3-venv
binutils cmake g++ groff-base
libopenmpi-dev openmpi-bin
fortunes fortunes-min"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# optional: PyTorch for bench/gpt.c's reference row (skipped without it)
dpkg-query -W -f='${Status}' python3-torch 2>/dev/null | grep -q "install ok installed" ||
  echo "deps: optional python3-torch not installed (bench/gpt.c skips its PyTorch row)" >&2
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
  echo "deps: installing$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing
else
  echo "deps: missing packages; run as root:" >&2
  echo "  apt-get update && apt-get install -y$missing" >&2
  exit 1
fi
