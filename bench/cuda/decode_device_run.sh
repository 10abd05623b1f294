#!/usr/bin/env bash
# One pass of the paged KV work on a GPU host, from a bundle made by
# ../shared/device/bundle.sh .device-kv (cuda_paged_kv_tests, decode_bench, optionally
# decode_tile_sweep and decode_bench_base, a decode_bench of an earlier version): the tests,
# compute-sanitizer memcheck and racecheck on small filters, the tile sweep, then the decode bench
# beside torch and the earlier version (table last). Logs go to $OUT.
#   bench/cuda/decode_device_run.sh [BUNDLE_DIR]
set -uo pipefail
bundle=${1:-.device-kv}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/$bundle/bin
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader

"$bin/cuda_paged_kv_tests" --gtest_brief=1 >"$out/tests.log" 2>&1
summary+=("cuda_paged_kv_tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests.log" | tr '\n' ' ')")
grep -E "^\[  FAILED|Failure|error|seed" "$out/tests.log" | head -40
filter='*ragged_lengths*float16*:*nq_causal*bfloat16*:*long_5000*bfloat16*:*d64_pages128*float16*:*d256*float16*:*window_both*float32*:*Merge*bfloat16*:*Errors*'
compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/cuda_paged_kv_tests" \
  --gtest_brief=1 --gtest_filter="$filter" >"$out/sanitizer_memcheck.log" 2>&1
summary+=("compute-sanitizer memcheck: rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_memcheck.log" | tr '\n' ' ')")
compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/cuda_paged_kv_tests" \
  --gtest_brief=1 --gtest_filter='*ragged_lengths*bfloat16*:*nq_causal*float16*:*Merge*float16*' \
  >"$out/sanitizer_racecheck.log" 2>&1
summary+=("compute-sanitizer racecheck: rc=$? $(grep -E 'RACECHECK SUMMARY|PASSED|FAILED' "$out/sanitizer_racecheck.log" | tr '\n' ' ')")

if [[ -x $bin/decode_tile_sweep ]]; then
  "$bin/decode_tile_sweep" >"$out/sweep.log" 2>&1
  summary+=("decode_tile_sweep: rc=$?")
fi

baseline=()
[[ -x $bin/decode_bench_base ]] && baseline=(--baseline "$bin/decode_bench_base")
PYTHONUNBUFFERED=1 python3 bench/cuda/decode_bench.py "$bin/decode_bench" --out "$out" \
  "${baseline[@]}" >"$out/bench.log" 2>&1
summary+=("decode bench: rc=$?")

printf '%s\n' "${summary[@]}"
[[ -f $out/sweep.log ]] && sed 's/"page_bytes": 262144, "page_rows": 64, //' "$out/sweep.log"
grep -E "^\||^GPU|^#" "$out/bench.log"
exit 0
