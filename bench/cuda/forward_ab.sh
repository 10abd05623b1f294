#!/usr/bin/env bash
# Forward kernels of several builds timed alternately in one call, so drift on the host hits each
# alike: for each shape (B = 16384/N, H = 2048/D, as the FlashAttention grid) and round, every
# build's `cuda_attention_bench one` in turn; prints each build's median ms and TFLOP/s per shape.
#   bench/cuda/forward_ab.sh ROUNDS NAME=BENCH_BINARY [NAME=BENCH_BINARY ...]
# A BENCH_BINARY may carry the bench's flags, split on spaces (quote the NAME=... argument), e.g.
# "softcap=build/bench/cuda/cuda_attention_bench --option softcap": the same build with an option.
# SHAPES="dtype:D:N:causal ..." overrides the shapes (default: bf16 and f16, D 64/128/256, N 4096,
# causal and not).
set -uo pipefail
rounds=${1:?ROUNDS}; shift
shapes=${SHAPES:-}
if [[ -z $shapes ]]; then
  for dtype in bfloat16 float16; do
    for d in 64 128 256; do
      for causal in false true; do shapes+=" $dtype:$d:4096:$causal"; done
    done
  done
fi
out=${OUT:-/tmp/out}
mkdir -p "$out"
: >"$out/forward_ab.jsonl"
for shape in $shapes; do
  IFS=: read -r dtype d n causal <<<"$shape"
  for r in $(seq "$rounds"); do
    for build in "$@"; do
      name=${build%%=*}
      read -ra cmd <<<"${build#*=}"
      line=$("${cmd[@]}" one "$dtype" "$d" "$n" "$causal" 2>/dev/null | tail -1)
      echo "{\"build\": \"$name\", \"round\": $r, \"result\": ${line:-null}}" >>"$out/forward_ab.jsonl"
    done
  done
done
python3 - "$out/forward_ab.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
builds = list(dict.fromkeys(r["build"] for r in rows))
table = {}
for r in rows:
    res = r["result"]
    if not res:
        continue
    key = (res["dtype"], res["d"], res["N"], res["causal"])
    table.setdefault(key, {}).setdefault(r["build"], []).append((res["ms"], res["TFLOPs"]))
print("| dtype | D | N | causal | " + " | ".join(f"{b} ms (TFLOP/s)" for b in builds) +
      " | " + " | ".join(f"speed {b} / {builds[0]}" for b in builds[1:]) + " |")
print("|" + "---|" * (4 + 2 * len(builds) - 1))
for key, per in table.items():
    med = {b: statistics.median(m for m, _ in v) for b, v in per.items()}
    tf = {b: statistics.median(t for _, t in v) for b, v in per.items()}
    cells = [f"{med[b]:.4f} ({tf[b]:.0f})" if b in med else "-" for b in builds]
    ratios = [f"{med[builds[0]] / med[b]:.3f}" if b in med and builds[0] in med else "-"
              for b in builds[1:]]
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " | " +
          " | ".join(ratios) + " |")
PY
