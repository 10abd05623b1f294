#!/usr/bin/env bash
# The README's test command: installs the dependencies of the tests too (scripts/install_deps.sh
# test), builds everything, checks the sources against .clang-format (scripts/format.sh --check),
# runs the whole suite, and ends with a summary of each stage (so the list of GPU tests skipped on
# a machine without a GPU does not bury the pass line).
# GPU tests (label "gpu") skip with a message on machines without a GPU.
# CI extras, off unless set: ATTENTION_CI_SANITIZE=1 also runs the suite under AddressSanitizer +
# UndefinedBehaviorSanitizer (scripts/sanitize.sh asan); ATTENTION_CI_FUZZ_S=N fuzzes request
# decoding (Attend and Sessions requests) for N seconds (fuzz/run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh test
./scripts/build.sh "$@"
./scripts/format.sh --check
logs="build/test-logs"
mkdir -p "$logs"
summary=()

# ctest_summary LOG: the pass line of a ctest log and how many tests did not run.
ctest_summary() {
  local passed skipped
  passed=$(grep -E '^[0-9]+% tests passed' "$1" | tail -n 1)
  skipped=$(grep -cE '^\s+[0-9]+ - .*\((Skipped|Disabled)\)' "$1" || true)
  echo "$passed; $skipped skipped"
}

ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600 2>&1 | tee "$logs/ctest.log"
summary+=("suite:     $(ctest_summary "$logs/ctest.log") (GPU tests skip without a GPU)")
if [ "${ATTENTION_CI_SANITIZE:-0}" = 1 ]; then
  ./scripts/sanitize.sh asan 2>&1 | tee "$logs/asan.log"
  summary+=("asan+ubsan: $(ctest_summary "$logs/asan.log")")
fi
if [ "${ATTENTION_CI_FUZZ_S:-0}" -gt 0 ]; then
  ./fuzz/run.sh "$ATTENTION_CI_FUZZ_S" 2>&1 | tee "$logs/fuzz.log"
  summary+=("fuzz:      $(grep -E '^Done [0-9]+ runs' "$logs/fuzz.log" | tail -n 1), no crash")
fi
echo
echo "test.sh: every stage passed (logs in $logs/)"
printf '  %s\n' "${summary[@]}"
