#!/usr/bin/env bash
# Builds the libFuzzer target with clang-14 into build-fuzz/ and fuzzes the decoding of
# AttendRequest and of the Sessions requests (CreateSession, AppendKv, Step) for SECONDS (default
# 60), starting from the seed corpus in fuzz/corpus/ (read only: new inputs go to
# build-fuzz/corpus/). A crash, leak or slow input (over 10 s) fails the run; libFuzzer
# leaves the input in build-fuzz/ as crash-*, leak-* or timeout-*.
#   fuzz/run.sh          # CI: one minute
#   fuzz/run.sh 600      # ten minutes
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
build=build-fuzz
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTENTION_WITH_CUDA=OFF \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DATTENTION_FUZZ=ON >/dev/null
cmake --build "$build" --target request_decoder_fuzzer -j"$(nproc)"
mkdir -p "$build/corpus"
cd "$build"
# One job: the fuzzer shares the machine with the rest of CI.
exec ./fuzz/request_decoder_fuzzer -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 corpus ../fuzz/corpus
