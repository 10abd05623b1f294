#!/usr/bin/env bash
# Two GPUs against one, in one command on a two-GPU host (about 5 minutes), each pair measured in
# the same run:
#   bench/multi/run.sh [BIN_DIR]       # BIN_DIR: attention_server, attn_bench, colo_bench,
#                                      # cuda_device_loss_tests (default .device/bin; libs in ../lib)
# 1. Compute-heavy Attend, bf16 B4 H16 N4096 D128, 8 clients with q, k, v and o in system shared
#    memory (colo_bench shm): the server with --devices=0, then with --devices=0,1, three runs
#    each; requests/s and the ratio of the medians. Target: >= 1.9x.
# 2. Decode: 64 sessions of 32k rows (bf16 Hq 32 Hkv 8 D 128, one new token, causal) created
#    one after another, so they alternate over the devices (a new session goes to the device with
#    the most free pages); 4 Steps in flight, each over 16 consecutive sessions, so each Step has
#    entries on both devices (one launch per device, run at once). Steps/s on 1 and on 2 devices
#    and the ratio. Target: >= 1.8x.
# 3. The device-loss fault-injection test with two GPUs (cuda_device_loss_tests,
#    WithTwoDevicesTheOtherKeepsServing): GPU 0's context is corrupted under load from 4 clients;
#    the only failed requests are GPU 0's and GPU 1 serves every request afterwards.
# Logs and JSON lines under $OUT (default /tmp/out); the table comes last.
# A CPU try of the plumbing (--devices=0,1 on the CPU backend: two CPU devices sharing the cores,
# so no speed-up is expected; without colo_bench, a build without CUDA, attn_bench --shm stands in
# for part 1; part 3 is skipped without the CUDA test binary):
#   BACKEND=cpu SHAPE=1,4,256,64 SESSIONS=8 NK=512 DURATION_S=1 ITERS=4 bench/multi/run.sh DIR
# NAME_target and NAME_pid are set by lib.sh's start_attention.
# shellcheck disable=SC2154
set -uo pipefail
bin=${1:-.device/bin}
out=${OUT:-/tmp/out}
backend=${BACKEND:-cuda}
shape=${SHAPE:-4,16,4096,128}
sessions=${SESSIONS:-64}
nk=${NK:-32768}
dur=${DURATION_S:-10}
iters=${ITERS:-40}
here=$(dirname "$0")
# shellcheck source=bench/colo/lib.sh
source "$here/../colo/lib.sh"
colo_setup
results=$out/multi.jsonl
: >"$results"
[[ $backend == cuda ]] && nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader

inflight=4
decode=(--mode=decode "--shape=$((sessions / inflight)),32,1,128" --nk="$nk" --kv_heads=8
        --dtype=bfloat16 --causal --max_message_mb=2047 --rpc=unary --concurrency="$inflight"
        --sessions="$sessions" --warmup_s=1 --duration_s="$dur" --progress=false --json)

launches() {  # METRICS_PORT: decode launches per device so far, a JSON object
  python3 - "$1" <<'PY'
import json, re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
counts = {}
for line in text.splitlines():
    m = re.match(r'attention_decode_step_duration_seconds_count\{.*device="([^"]+)".*\} (\S+)', line)
    if m:
        counts[m[1]] = counts.get(m[1], 0) + float(m[2])
print(json.dumps(counts))
PY
}
attend() {  # TARGET: one run of 8 clients through shared memory; a JSON line with requests_per_s
  if [[ -x $bin/colo_bench ]]; then
    "$bin/colo_bench" --target="$1" --mode=shm --shape="$shape" --clients=8 --iters="$iters"
  else  # a build without CUDA has no colo_bench: 8 in flight on one connection instead
    "$bin/attn_bench" --target="$1" --shm --shape="$shape" --dtype=bfloat16 --concurrency=8 \
      --requests=$((8 * iters)) --warmup_s=1 --max_message_mb=2047 --progress=false --json
  fi
}

for devices in 0 0,1; do
  name=gpus_${devices/,/_}
  start_attention "$name" --devices="$devices" --allow_shared_memory --max_message_mb=2047
  target_var=${name}_target pid_var=${name}_pid
  for run in 1 2 3; do
    keep "attend_${name}_run$run" "$(attend "${!target_var}" 2>"$out/attend_${name}_run$run.log" |
      tail -1)"
  done
  keep "decode_$name" "$("$bin/attn_bench" --target="${!target_var}" "${decode[@]}" \
    2>"$out/decode_$name.log" | tail -1)"
  metrics_var=${name}_metrics
  keep "launches_$name" "$(launches "${!metrics_var}")"
  stop_server "${!pid_var}"
done

if [[ -x $bin/cuda_device_loss_tests ]]; then
  "$bin/cuda_device_loss_tests" --gtest_filter='*WithTwoDevicesTheOtherKeepsServing' \
    >"$out/device_loss.log" 2>&1
  echo "device loss test: rc=$?"
  loss=$(grep -E '^two devices:|^\[  (PASSED|FAILED|SKIPPED)' "$out/device_loss.log" | tr '\n' ' ')
else
  loss="skipped: no $bin/cuda_device_loss_tests"
fi

python3 - "$results" "$loss" "$shape" "$sessions" "$nk" <<'PY'
import json, statistics, sys
shape, sessions, nk = sys.argv[3], sys.argv[4], sys.argv[5]
r = {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    r[row["run"]] = row["result"]

def rate(name, key="requests_per_s"):
    return r[name][key] if r.get(name) else None

print(f"\n{'what':44} {'1 device':>12} {'2 devices':>12} {'ratio':>7} {'target':>7}")
one = [rate(f"attend_gpus_0_run{i}") for i in (1, 2, 3)]
two = [rate(f"attend_gpus_0_1_run{i}") for i in (1, 2, 3)]
def fmt(runs):
    return "/".join("fail" if x is None else f"{x:.1f}" for x in runs)
print(f"Attend shm x8, req/s runs: {fmt(one)} | {fmt(two)}")
if None not in one and None not in two:
    a, b = statistics.median(one), statistics.median(two)
    print(f"{'Attend bf16 ' + shape + ', 8 clients, req/s':44} {a:12.1f} {b:12.1f} {b / a:6.2f}x {'1.9x':>7}")
d1, d2 = rate("decode_gpus_0"), rate("decode_gpus_0_1")
if d1 and d2:
    what = f"Decode Steps/s, {sessions} x {nk} rows, 4 in flight"
    print(f"{what:44} {d1:12.1f} {d2:12.1f} {d2 / d1:6.2f}x {'1.8x':>7}")
    s1, s2 = rate("decode_gpus_0", "steps_per_s"), rate("decode_gpus_0_1", "steps_per_s")
    print(f"{'  session-steps/s':44} {s1:12.1f} {s2:12.1f}")
    print(f"  decode launches per device (2 devices, warm-up included): {r.get('launches_gpus_0_1')}")
else:
    print(f"decode: 1 device {d1}, 2 devices {d2} (see decode_*.log)")
print(f"device loss, two devices: {sys.argv[2]}")
PY
