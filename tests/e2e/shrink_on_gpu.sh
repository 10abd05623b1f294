#!/usr/bin/env bash
# The shrunk-object tests of tests/e2e/shared_memory_test.cc on a GPU host. Against --backend=cuda,
# where system regions are pinned (cudaHostRegister) and copied by DMA, the one that shrinks the
# object before a request: the requests must fail FAILED_PRECONDITION, the server must survive, and
# Unregister (cudaHostUnregister after the shrink) must succeed. (The one shrinking during a
# request needs a request running for a second: on the CPU backend only.) Then both on the CPU
# backend with the same binaries. About 30 s. Logs in $OUT; a table last.
#   tests/e2e/shrink_on_gpu.sh [BIN_DIR]   # default .device/bin, from scripts/bundle_device.sh
#     with attention_server and shared_memory_tests
set -uo pipefail
bin=${1:-$PWD/.device/bin}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
rows=()
for run in "cuda SharedMemoryShrinkE2E.*Before*" "cpu SharedMemoryShrinkE2E.*"; do
  read -r backend filter <<<"$run"
  log=$out/shrink_$backend.log
  ATTENTION_E2E_SERVER=$bin/attention_server ATTENTION_E2E_EXTRA_FLAGS=--backend=$backend \
    timeout 200 "$bin/shared_memory_tests" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  rows+=("$backend|$rc|$(grep -cE '^\[ +OK ' "$log")|$(grep -oE '^\[ +FAILED +\] [A-Z][A-Za-z0-9_.]+' "$log" | sort -u | wc -l)")
  grep -E "Failure|exited with code|^\[ +FAILED" -A3 "$log" | head -30
done
printf '%-8s %-4s %-6s %s\n' backend rc passed failed
for r in "${rows[@]}"; do IFS='|' read -r b rc p f <<<"$r"; printf '%-8s %-4s %-6s %s\n' "$b" "$rc" "$p" "$f"; done
