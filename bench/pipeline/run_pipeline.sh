#!/usr/bin/env bash
# The GPU pipeline's measurements, in one pass on a GPU host (two GPUs for the scaling rows), from a
# bundle made by scripts/bundle_device.sh .device-pipe (attention_server, attn_bench,
# pipeline_bench, cuda_pipeline_tests, cuda_kernel_tests):
#   1. tests: cuda_pipeline_tests, cuda_kernel_tests, compute-sanitizer memcheck on the pipeline tests;
#   2. pipeline_bench (executors + scheduler, no gRPC) beside the pinned copy rate and the kernel's
#      own rate;
#   3. attention_server driven by attn_bench over loopback, with the server's metrics scraped
#      before and after each case (GPU busy = compute seconds / wall seconds).
# Every result is one JSON line in $OUT/results.jsonl; logs go to $OUT.
#   bench/pipeline/run_pipeline.sh [tests|direct|grpc|all] [seconds per case]
set -uo pipefail
what=${1:-all}
secs=${2:-6}
out=${OUT:-/tmp/out}
mkdir -p "$out"
bundle=${BUNDLE:-$PWD/.device-pipe}
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$bundle/bin
results=$out/results.jsonl
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader

compute=(--shape=4,16,4096,128 --dtype=bfloat16)
copy=(--shape=1024,16,16,128 --dtype=bfloat16)
small=(--shape=1,8,128,64 --dtype=bfloat16)

if [[ $what == tests || $what == all ]]; then
  "$bin/cuda_pipeline_tests" --gtest_brief=1 >"$out/pipeline_tests.log" 2>&1
  echo "cuda_pipeline_tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/pipeline_tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure|seed" "$out/pipeline_tests.log" | head -20
  "$bin/cuda_kernel_tests" --gtest_brief=1 >"$out/kernel_tests.log" 2>&1
  echo "cuda_kernel_tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/kernel_tests.log" | tr '\n' ' ')"
  # The CUDA-error test's deliberate out-of-memory is an API error, not a memory error.
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$bin/cuda_pipeline_tests" --gtest_brief=1 \
    --gtest_filter='*gqa8_causal_bshd_bfloat16:*varlen*float16:CudaPipelineTest.*' >"$out/memcheck.log" 2>&1
  echo "memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tr '\n' ' ')"
fi

direct() {  # label, pipeline_bench flags...
  local label=$1; shift
  local line
  line=$(timeout 60 "$bin/pipeline_bench" --duration_s="$secs" "$@" 2>>"$out/direct.log" | tail -1)
  echo "{\"case\":\"$label\",\"path\":\"direct\",${line#\{}" | tee -a "$results"
}

if [[ $what == direct || $what == all ]]; then
  CUDA_VISIBLE_DEVICES=0 direct compute_1gpu_pageable "${compute[@]}" --clients=16
  CUDA_VISIBLE_DEVICES=0 direct compute_1gpu_pinned "${compute[@]}" --clients=16 --pinned_inputs
  direct compute_2gpu_pinned "${compute[@]}" --clients=16 --pinned_inputs --gpus=2
  direct compute_2gpu_pageable "${compute[@]}" --clients=16 --gpus=2
  CUDA_VISIBLE_DEVICES=0 direct copy_1gpu_pinned "${copy[@]}" --clients=8 --pinned_inputs
  CUDA_VISIBLE_DEVICES=0 direct copy_1gpu_pageable "${copy[@]}" --clients=8
  CUDA_VISIBLE_DEVICES=0 direct small_batch_off "${small[@]}" --clients=64 --max_batch=1
  for batch in 8 16 32; do
    CUDA_VISIBLE_DEVICES=0 direct small_batch_on_$batch "${small[@]}" --clients=64 \
      --max_batch=$batch --max_queue_delay_us=50
  done
fi

# Sum of a metric's samples whose labels contain $2, from the server's /metrics.
scrape() {
  python3 - "$1" "$2" "$3" <<'EOF'
import sys, urllib.request
port, name, label = sys.argv[1], sys.argv[2], sys.argv[3]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
total = 0.0
for line in text.splitlines():
    if line.startswith(name) and label in line:
        total += float(line.rsplit(" ", 1)[1])
print(total)
EOF
}

grpc() {  # label, server flags (space-separated string), attn_bench flags...
  local label=$1 server_flags=$2; shift 2
  rm -f /tmp/pipe_ports
  # shellcheck disable=SC2086
  "$bin/attention_server" --backend=cuda --host=127.0.0.1 --port=0 --metrics_port=0 \
    --port_file=/tmp/pipe_ports $server_flags >>"$out/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do [[ -s /tmp/pipe_ports ]] && break; sleep 0.1; done
  local port metrics
  read -r port metrics </tmp/pipe_ports
  local c0 t0 c1 t1 line
  c0=$(scrape "$metrics" attention_stage_duration_seconds_sum 'stage="compute"')
  t0=$(date +%s.%N)
  line=$(timeout 90 "$bin/attn_bench" --target=127.0.0.1:"$port" --duration_s="$secs" \
    --warmup_s=1 --progress=false --json "$@" 2>>"$out/attn_bench.log" | tail -1)
  t1=$(date +%s.%N)
  c1=$(scrape "$metrics" attention_stage_duration_seconds_sum 'stage="compute"')
  local busy
  busy=$(python3 -c "print(round(($c1-$c0)/($t1-$t0), 4))")
  echo "{\"case\":\"$label\",\"path\":\"grpc\",\"server\":\"$server_flags\",\"compute_s_over_wall_s\":$busy,${line#\{}" \
    | tee -a "$results"
  kill "$server"; wait "$server" 2>/dev/null
}

if [[ $what == grpc || $what == all ]]; then
  grpc compute_1gpu "--devices=0" "${compute[@]}" --concurrency=16
  grpc compute_2gpu "--devices=0,1" "${compute[@]}" --concurrency=16
  grpc copy_1gpu "--devices=0" "${copy[@]}" --concurrency=8
  grpc small_batch_off "--devices=0 --max_batch=1" "${small[@]}" --concurrency=64
  grpc small_batch_on_8 "--devices=0 --max_batch=8" "${small[@]}" --concurrency=64
  grpc small_batch_on_32 "--devices=0 --max_batch=32 --max_queue_delay_us=100" "${small[@]}" \
    --concurrency=64
fi
exit 0
