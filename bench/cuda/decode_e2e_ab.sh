#!/usr/bin/env bash
# Two servers' decode Step through gRPC, measured alternately in one call (base, new, base, ...),
# so drift on the host hits both alike: each round starts a fresh server and runs decode_e2e.sh's
# step_c1 (8 sessions x 32k rows, one Step in flight, 5 s). Prints each run's p50 and both medians.
#   bench/cuda/decode_e2e_ab.sh BIN_DIR BASE_SERVER [ROUNDS]
# BIN_DIR holds the new attention_server and attn_bench; BASE_SERVER is the other server binary.
set -uo pipefail
bin=${1:?BIN_DIR}
base=${2:?BASE_SERVER}
rounds=${3:-3}
out=${OUT:-/tmp/out}
here=$(dirname "$0")
: >"$out/decode_ab.jsonl"
for r in $(seq "$rounds"); do
  for which in base new; do
    server=$bin/attention_server
    [[ $which == base ]] && server=$base
    OUT="$out/ab_$which" SERVER=$server RUNS=step_c1 "$here/decode_e2e.sh" "$bin" >/dev/null
    line=$(tail -1 "$out/ab_$which/decode_e2e.jsonl")
    echo "{\"which\": \"$which\", \"round\": $r, \"step\": $line}" >>"$out/decode_ab.jsonl"
  done
done
python3 - "$out/decode_ab.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
p50 = {}
for r in rows:
    res = r["step"]["result"] or {}
    v = res["p50"] * 1e3 if "p50" in res else None  # attn_bench reports seconds
    p50.setdefault(r["which"], []).append(v)
    print(f'{r["which"]} round {r["round"]}: p50 {v} ms')
for k, v in p50.items():
    vals = [x for x in v if x is not None]
    print(f'{k}: median p50 {statistics.median(vals) if vals else None} ms over {len(vals)} runs')
if all(p50.get(k) for k in ("base", "new")):
    b = statistics.median([x for x in p50["base"] if x is not None])
    n = statistics.median([x for x in p50["new"] if x is not None])
    print(f"new / base p50: {n / b:.3f}")
PY
