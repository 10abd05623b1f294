#!/usr/bin/env bash
# Profiles the forward kernel with Nsight Compute on a GPU host, one shape of the FlashAttention
# grid at a time (B = 16384/N, H = 2048/D, as cuda_attention_bench `one` runs it): the kernel's
# duration (at ncu's locked clocks, so longer than the bench's), SM throughput, tensor-pipe
# utilisation (sm__pipe_tensor_op_hmma: on Hopper it counts wgmma too, HGMMA and QGMMA alike),
# issue-slot use and its five largest warp stall reasons per issued instruction, a table row per
# shape. The default shapes are rows that missed 1.0x cuDNN on 2026-12-01
# (bench/results/2026-12-01-forward-profile-ncu.md) and
# two that met it, for contrast.
# Raw ncu CSV per shape goes to $OUT. VARIANT=NAME forces the variant (default: the plan's).
#   bench/cuda/profile_forward.sh BENCH_BINARY [dtype:D:N:causal ...]
set -uo pipefail
bin=${1:?BENCH_BINARY}
shift
shapes=("$@")
if [[ ${#shapes[@]} -eq 0 ]]; then
  shapes=(bfloat16:64:1024:true bfloat16:128:1024:false bfloat16:128:1024:true
          bfloat16:256:1024:false bfloat16:256:1024:true bfloat16:64:2048:true
          bfloat16:128:4096:false bfloat16:128:16384:true)
fi
out=${OUT:-/tmp/out}
mkdir -p "$out"
command -v ncu >/dev/null || { echo "ncu not found"; exit 1; }
metrics=gpu__time_duration.sum
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_issued.avg.pct_of_peak_sustained_active
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
variant=()
[[ -n ${VARIANT:-} ]] && variant=(--variant "$VARIANT")
for shape in "${shapes[@]}"; do
  IFS=: read -r dtype d n causal <<<"$shape"
  # The bench's 3 warm-up launches are skipped; the first timed one is profiled.
  ncu --kernel-name regex:FlashForward --launch-skip 3 --launch-count 1 --metrics "$metrics" \
    --csv --page raw "$bin" "${variant[@]}" one "$dtype" "$d" "$n" "$causal" \
    >"$out/ncu_${dtype}_${d}_${n}_${causal}.csv" 2>"$out/ncu_${dtype}_${d}_${n}_${causal}.err"
  echo "$shape rc=$?" >>"$out/ncu_runs.log"
done
python3 - "$out" "${shapes[@]}" <<'PY'
import csv, io, os, sys
out, shapes = sys.argv[1], sys.argv[2:]
print("| shape | kernel | us | SM % | tensor pipe % | issue % | DRAM % | top stalls (warps per issue) |")
print("|---|---|---|---|---|---|---|---|")
for shape in shapes:
    dtype, d, n, causal = shape.split(":")
    path = os.path.join(out, f"ncu_{dtype}_{d}_{n}_{causal}.csv")
    text = open(path).read() if os.path.exists(path) else ""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if len(lines) < 3:
        err = os.path.join(out, f"ncu_{dtype}_{d}_{n}_{causal}.err")
        why = open(err).read().strip().splitlines()[-1:] if os.path.exists(err) else ["no output"]
        print(f"| {shape} | - | ncu failed: {why[0] if why else '?'} |")
        continue
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    head, units, values = rows[0], rows[1], rows[2]
    m = dict(zip(head, values))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(
        dict(zip(head, units)).get("gpu__time_duration.sum", ""), float("nan"))
    def num(key):
        try:
            return float(m[key].replace(",", ""))
        except (KeyError, ValueError):
            return float("nan")
    stalls = sorted(((num(k), k) for k in m if k.startswith("smsp__average_warps_issue_stalled_")),
                    reverse=True)[:5]
    stall_text = ", ".join(
        f"{k.removeprefix('smsp__average_warps_issue_stalled_').removesuffix('_per_issue_active.ratio')} {v:.2f}"
        for v, k in stalls)
    kernel = m.get("Kernel Name", "?").split("<")[0]
    print(f"| {shape} | {kernel} | {num('gpu__time_duration.sum') * scale:.1f} | "
          f"{num('sm__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} | "
          f"{num('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):.0f} | "
          f"{num('sm__inst_issued.avg.pct_of_peak_sustained_active'):.0f} | "
          f"{num('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} | {stall_text} |")
PY
