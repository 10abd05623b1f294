#!/usr/bin/env bash
# One pass of the paged KV work on a GPU host, from a bundle made by
# scripts/bundle_device.sh .device-kv (cuda_paged_kv_tests, decode_bench, optionally
# decode_tile_sweep and decode_bench_base, a decode_bench of an earlier version): the tests (as
# planned, and with 2 splits, as the bench's shapes run, and 3, merged in clusters on a Hopper GPU,
# and with 2 splits merged through tickets), compute-sanitizer memcheck and racecheck on small
# filters (as planned and with 2 splits), the tile sweep, then the decode bench
# beside torch and the earlier version, then both versions twice more alternately (the planned
# 512 KiB rows: confirm.log; table last). Logs go to $OUT.
#   bench/cuda/decode_device_run.sh [BUNDLE_DIR] [--no-sanitizers]
set -uo pipefail
bundle=${1:-.device-kv}
sanitizers=1
[[ ${2:-} == --no-sanitizers ]] && sanitizers=0
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/$bundle/bin
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader

: >"$out/tests.log"
for run in "" 2 3 2:0; do  # splits[:clusters]; "": the planner's
  export ATTENTION_TEST_SPLITS=${run%%:*}
  export ATTENTION_TEST_CLUSTERS=${run#*:}
  [[ $run == *:* ]] || unset ATTENTION_TEST_CLUSTERS
  echo "=== splits=${run:-planned}" >>"$out/tests.log"
  timeout 120 "$bin/cuda_paged_kv_tests" --gtest_brief=1 >>"$out/tests.log" 2>&1
  rc=$?
  summary+=("cuda_paged_kv_tests splits=${run:-planned}: rc=$rc $(grep -E '^\[  (PASSED|FAILED)' "$out/tests.log" | tail -1)")
  ((rc == 124)) && break  # a hung step: the rest would hang too
done
unset ATTENTION_TEST_CLUSTERS
grep -E "^===|^\[  FAILED|Failure|error|seed" "$out/tests.log" | head -40
if ((sanitizers)); then
  filter='*ragged_lengths*float16*:*nq_causal*bfloat16*:*long_5000*bfloat16*:*d64_pages128*float16*:*d256*float16*:*window_both*float32*:*sinks_large*bfloat16*:*softcap50_ragged*float16*:*chunk_nq_gt_nk*float32*:*Merge*bfloat16*:*Errors*'
  : >"$out/sanitizer_memcheck.log"
  : >"$out/sanitizer_racecheck.log"
  for splits in "" 2; do
    export ATTENTION_TEST_SPLITS=$splits
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$bin/cuda_paged_kv_tests" --gtest_brief=1 --gtest_filter="$filter" \
      >>"$out/sanitizer_memcheck.log" 2>&1
    summary+=("compute-sanitizer memcheck splits=${splits:-planned}: rc=$? $(grep -E 'ERROR SUMMARY' "$out/sanitizer_memcheck.log" | tail -1)")
    timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 \
      "$bin/cuda_paged_kv_tests" --gtest_brief=1 \
      --gtest_filter='*ragged_lengths*bfloat16*:*nq_causal*float16*:*long_5000*bfloat16*:*Merge*float16*' \
      >>"$out/sanitizer_racecheck.log" 2>&1
    summary+=("compute-sanitizer racecheck splits=${splits:-planned}: rc=$? $(grep -E 'RACECHECK SUMMARY' "$out/sanitizer_racecheck.log" | tail -1)")
  done
fi
unset ATTENTION_TEST_SPLITS

if [[ -x $bin/decode_tile_sweep ]]; then
  timeout 300 "$bin/decode_tile_sweep" 4096 8192 16384 32768 131072 >"$out/sweep.log" 2>&1
  summary+=("decode_tile_sweep: rc=$?")
fi

baseline=()
[[ -x $bin/decode_bench_base ]] && baseline=(--baseline "$bin/decode_bench_base")
PYTHONUNBUFFERED=1 timeout 400 python3 bench/cuda/decode_bench.py "$bin/decode_bench" --out "$out" \
  "${baseline[@]}" >"$out/bench.log" 2>&1
summary+=("decode bench: rc=$?")

# Run-to-run spread of ours against the earlier version: both twice more, alternately.
if [[ -x $bin/decode_bench_base ]]; then
  for rep in 1 2; do
    for b in decode_bench_base decode_bench; do
      timeout 120 "$bin/$b" 4096 32768 131072 2>&1 |
        grep '"page_bytes": 524288' | grep '"forced_splits": false' | grep -v '"flush": "clean"' |
        sed "s/^/$b rep$rep: /" >>"$out/confirm.log"
    done
  done
fi

printf '%s\n' "${summary[@]}"
[[ -f $out/sweep.log ]] && sed 's/"page_bytes": 262144, "page_rows": 64, //' "$out/sweep.log"
grep -E "^\||^GPU|^#|^After" "$out/bench.log"
[[ -f $out/confirm.log ]] && sed -E 's/"page_bytes": 524288, "page_rows": 128, //; s/, "kv_tbps": [0-9.]+//' "$out/confirm.log"
exit 0
