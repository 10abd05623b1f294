#!/usr/bin/env bash
# Builds the CPU-only tree with sanitizers and runs the test suite there (GPU tests excluded):
#   scripts/sanitize.sh asan   # AddressSanitizer + UndefinedBehaviorSanitizer (and LeakSanitizer)
#   scripts/sanitize.sh tsan   # ThreadSanitizer
# into build-asan/ or build-tsan/. Any report fails the run. The end-to-end tests start the
# sanitized attention_server binary, so the server is checked under real gRPC traffic too.
# Extra arguments go to ctest, e.g. -L reliability or -E soak.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-asan}"
shift || true
case "$kind" in
  asan)
    sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
    export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_init_order=1:detect_stack_use_after_return=1"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp"
    ;;
  tsan)
    # Runs, but does not pass yet: Debian's abseil is not built with TSan, so the locking inside
    # absl::Mutex is invisible to it and data guarded by one (the scheduler's queue, the stream
    # reactor's state) is reported as racing.
    sanitize="-fsanitize=thread"
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
    ;;
  *)
    echo "usage: $0 asan|tsan [ctest arguments]" >&2
    exit 2
    ;;
esac
build="build-$kind"
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DATTENTION_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="-O1 -fno-omit-frame-pointer $sanitize" \
  -DCMAKE_EXE_LINKER_FLAGS="$sanitize" >/dev/null
cmake --build "$build" -j"$(nproc)"
built=$(date +%s)
ctest --test-dir "$build" --output-on-failure -j"$(nproc)" --timeout 900 -LE gpu "$@"
echo "sanitize $kind: build $((built - start)) s, tests $(($(date +%s) - built)) s"
