#!/bin/sh
# make fuzz: builds common/ and the server objects (not main.c) with clang
# and -fsanitize=fuzzer-no-link,address,undefined in build-fuzz/, links the
# libFuzzer targets fuzz/fuzz_{frame,session,stream}.c and runs each for
# FUZZ_SECONDS (default 60) from its seed corpus tests/fuzz_corpus/<target>/
# (read only: new inputs go to build-fuzz/corpus/<target>/, crashes to
# build-fuzz/artifacts/). One fuzzer at a time.
#   fuzz/run.sh            build + run every target (frame session stream oom)
#   fuzz/run.sh build      build only
#   fuzz/run.sh gen        rewrite the seed corpora with fuzz/gen_seeds.c
#   FUZZ_TARGETS="stream" FUZZ_SECONDS=300 fuzz/run.sh
set -eu
B=${FUZZ_BUILD:-build-fuzz}
SECS=${FUZZ_SECONDS:-60}
TARGETS=${FUZZ_TARGETS:-"frame session stream oom"}
MODE=${1:-run}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
make --no-print-directory BUILD="$B" CC=clang OPT=-O1 \
  CFLAGS="-fsanitize=fuzzer-no-link $SAN" "$B/libdspserver.a" "$B/libdspcommon.a"
LIBS="$(pkg-config --libs libuv libprotobuf-c openssl zlib libcjson libmicrohttpd) -lopenblas -lm -pthread"
INC="-Icommon -Iinclude -Iclient/include -Iserver -Ifuzz -I$B/gen -I/usr/include/x86_64-linux-gnu"
CF="-std=c11 -D_GNU_SOURCE -g -O1 -Wall -Wextra -Werror -Wno-unused-parameter"
if [ "$MODE" = gen ]; then
  clang $CF $SAN $INC fuzz/gen_seeds.c "$B/libdspserver.a" "$B/libdspcommon.a" \
    $LIBS -o "$B/gen_seeds"
  for t in frame session stream oom; do
    rm -rf "tests/fuzz_corpus/$t"
    mkdir -p "tests/fuzz_corpus/$t"
  done
  "$B/gen_seeds" tests/fuzz_corpus
  exit 0
fi
for t in $TARGETS; do
  clang $CF $SAN -fsanitize=fuzzer $INC "fuzz/fuzz_$t.c" fuzz/fz_common.c \
    "$B/libdspserver.a" "$B/libdspcommon.a" $LIBS -o "$B/fuzz_$t"
done
[ "$MODE" = build ] && exit 0
mkdir -p "$B/artifacts"
for t in $TARGETS; do
  mkdir -p "$B/corpus/$t"
  echo "== fuzz_$t for ${SECS}s"
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
    "$B/fuzz_$t" -max_total_time="$SECS" -max_len=4096 -rss_limit_mb=1024 \
    -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$B/artifacts/$t-" "$B/corpus/$t" "tests/fuzz_corpus/$t"
done
