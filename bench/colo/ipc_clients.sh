#!/usr/bin/env bash
# Four clients at once with their tensors in CUDA IPC regions (colo_bench --mode=ipc --clients=4:
# bf16 SHAPE, default 4,16,4096,128, q, k, v and o in each client's own cudaMalloc, the kernel
# reading and writing them in place), against the kernel alone in the same command, ROUNDS rounds
# (default 2), about 40 s each on the H200 host:
#   bench/colo/ipc_clients.sh [BIN_DIR]   # attention_server, colo_bench, cuda_attention_bench
#                                         # (default .device/bin)
# Each round: the kernel alone rested (cuda_attention_bench one, median of 30 runs after 3), one
# client on a request ring (the server's compute_us), four clients on request rings for
# ITERS calls each (default 4000, ~15 s: attention_device_busy_ratio covers at least 10 s, so it
# is scraped every second meanwhile and read at the end, over their calls alone), and the kernel
# alone sustained (--sustain_s 15: back to back first, as the four clients keep it). A GPU held
# busy reaches its power limit and lowers its clock (the H200 here: 1980 MHz rested, ~1620 at
# 690 W), so the four clients' kernel rate (requests/s x the kernel's time) is shown against both.
# Targets: busy ratio and kernel rate >= 0.9. The GPU's clocks and power, sampled every 250 ms,
# are in $OUT/ipc/smi.csv. Logs and JSON lines under $OUT/ipc (OUT defaults to /tmp/out).
# shellcheck disable=SC2154  # NAME_target and NAME_metrics are set by lib.sh's start_attention
set -uo pipefail
bin=${1:-.device/bin}
out=${OUT:-/tmp/out}/ipc
# shellcheck disable=SC2034  # lib.sh's start_attention reads it
backend=cuda
shape=${SHAPE:-4,16,4096,128}
rounds=${ROUNDS:-2}
iters=${ITERS:-4000}
here=$(dirname "$0")
# shellcheck source=bench/colo/lib.sh
source "$here/lib.sh"
colo_setup
results=$out/ipc.jsonl
: >"$results"
IFS=, read -r b h n d <<<"$shape"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -lms 250 >"$out/smi.csv" 2>&1 &
colo_pids+=("$!")
start_attention srv --allow_shared_memory --max_message_mb=2047
alone() {  # NAME FLAGS...: the kernel alone on SHAPE (B = 16384 / N and H = 2048 / D in the grid)
  local name=$1
  shift
  keep "$name" "$("$bin/cuda_attention_bench" "$@" one bfloat16 "$d" "$n" false \
    2>>"$out/alone.log" | tail -1)"
}
if ((b * n != 16384 || h * d != 2048)); then
  echo "ipc_clients.sh: SHAPE must be B=16384/N, H=2048/D (cuda_attention_bench's grid)" >&2
  exit 2
fi
for round in $(seq "$rounds"); do
  sleep 5  # rested: the clock back up
  alone "rested_$round"
  keep "one_$round" "$("$bin/colo_bench" --target="$srv_target" --mode=ipc --shape="$shape" \
    --iters=40 --rpc=ring 2>>"$out/colo.log" | tail -1)"
  busy_poll "$srv_metrics" &
  poll=$!
  keep "four_$round" "$("$bin/colo_bench" --target="$srv_target" --mode=ipc --clients=4 \
    --shape="$shape" --iters="$iters" --rpc=ring 2>>"$out/colo.log" | tail -1)"
  kill "$poll" 2>/dev/null
  wait "$poll" 2>/dev/null
  keep "busy_$round" "$(busy "$srv_metrics")"
  alone "sustained_$round" --sustain_s 15
done

python3 - "$results" "$here" "$rounds" <<'PY'
import statistics
import sys
sys.path.insert(0, sys.argv[2])
from colo_table import busy_note, load

r, ok = load(sys.argv[1])
rounds = int(sys.argv[3])
runs = [(ok(f"four_{i}"), ok(f"one_{i}"), ok(f"rested_{i}"), ok(f"sustained_{i}"),
         r.get(f"busy_{i}")) for i in range(1, rounds + 1)]
runs = [x for x in runs if all(v is not None for v in x)]
if not runs:
    sys.exit("ipc_clients.sh: no round ran whole (see the logs)")
each = lambda xs, f: f"{statistics.median(xs):{f}} ({', '.join(f'{x:{f}}' for x in xs)})"
met = lambda xs: "yes" if statistics.median(xs) >= 0.9 else "no"
per_s = [four["requests_per_s"] for four, *_ in runs]
print("| measure (medians; each round) | value | target | met |")
print("|---|---|---|---|")
print(f"| 4 CUDA IPC clients on request rings: requests/s | {each(per_s, '.0f')} | | |")
for name, key in (("one client (server compute_us)", 1), ("kernel alone, rested", 2),
                  ("kernel alone, sustained 15 s", 3)):
    ms = [x[key]["compute_us_p50"] / 1e3 if key == 1 else x[key]["ms"] for x in runs]
    rates = [four["requests_per_s"] * m / 1e3 for (four, *_), m in zip(runs, ms)]
    print(f"| kernel rate against the {name}: {each(ms, '.3f')} ms | {each(rates, '.2f')} "
          f"| >= 0.9 | {met(rates)} |")
busies = [x[4] for x in runs]
note = busy_note(runs[0][0])
print(f"| attention_device_busy_ratio{note} | {each(busies, '.2f')} | >= 0.9 | {met(busies)} |")
PY
