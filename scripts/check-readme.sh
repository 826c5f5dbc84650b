#!/usr/bin/env bash
# The README's first program is examples/first_program.c, which the build
# compiles: fail when the two drift apart.
set -eu
cd "$(dirname "$0")/.."
if ! diff <(awk '/^```c$/{f=1;next} /^```$/{if(f)exit} f' README.md) \
          examples/first_program.c >/dev/null; then
  echo "README.md's first program differs from examples/first_program.c" >&2
  exit 1
fi
echo "README first program matches examples/first_program.c"
