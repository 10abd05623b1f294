#!/usr/bin/env bash
# Installs what the build needs (idempotent) and builds into build/ (Release).
#   scripts/build.sh                # everything: server, clients, tests, benchmarks, fuzz targets
#   scripts/build.sh --server-only  # the server and the clients alone (fewer packages, no tests)
# Other arguments go to CMake's configure step, e.g. -DATTENTION_WITH_CUDA=OFF. Neither installs
# what only the tests use (torch, transformers, Prometheus, linters): scripts/test.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
level=build
tests=ON
if [ "${1:-}" = --server-only ]; then
  level=server
  tests=OFF
  shift
fi
./scripts/install_deps.sh "$level"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTENTION_BUILD_TESTS="$tests" "$@"
cmake --build build -j"$(nproc)"
