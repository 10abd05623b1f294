#!/usr/bin/env bash
# The README's test command: installs the dependencies, builds everything, runs the whole suite.
# GPU tests (label "gpu") skip with a message on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh "$@"
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600
