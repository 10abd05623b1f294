#!/usr/bin/env bash
# The README's test command: installs the dependencies, builds everything, checks the sources
# against .clang-format (scripts/format.sh --check), runs the whole suite.
# GPU tests (label "gpu") skip with a message on machines without a GPU.
# CI extras, off unless set: ATTENTION_CI_SANITIZE=1 also runs the suite under AddressSanitizer +
# UndefinedBehaviorSanitizer (scripts/sanitize.sh asan); ATTENTION_CI_FUZZ_S=N fuzzes request
# decoding (Attend and Sessions requests) for N seconds (fuzz/run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh "$@"
./scripts/format.sh --check
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600
if [ "${ATTENTION_CI_SANITIZE:-0}" = 1 ]; then
  ./scripts/sanitize.sh asan
fi
if [ "${ATTENTION_CI_FUZZ_S:-0}" -gt 0 ]; then
  ./fuzz/run.sh "$ATTENTION_CI_FUZZ_S"
fi
