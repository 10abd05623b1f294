#!/usr/bin/env bash
# Installs the dependencies (idempotent) and builds everything into build/ (Release).
# Extra arguments go to CMake's configure step, e.g. -DATTENTION_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j"$(nproc)"
