#!/usr/bin/env bash
# A decode step through gRPC on the GPU host, over loopback: Sessions.Step on KV-resident sessions
# against Attend with the same K/V sent on every call. One attention_server --backend=cuda, then
# attn_bench runs; each run's JSON line goes to stdout and to $OUT/decode_e2e.jsonl.
#   bench/cuda/decode_e2e.sh BIN_DIR [NK] [SEQUENCES]
# SERVER=path runs that attention_server instead of BIN_DIR's; RUNS="step_c1 ..." picks the runs
# (default: step_c1 step_c4 attend_c1).
# Defaults: NK=32768 rows per session, SEQUENCES=8 sessions per Step; bfloat16, Hq 32, Hkv 8,
# D 128, one query row each, causal; each Step appends its token's K/V first. The Attend call
# carries SEQUENCES x NK x 8 x 128 x 2 x 2 bytes of K/V (1 GiB at the defaults), so both ends
# allow 2047 MiB messages.
set -uo pipefail
bin=${1:?BIN_DIR}
nk=${2:-32768}
seqs=${3:-8}
out=${OUT:-/tmp/out}
server_bin=${SERVER:-$bin/attention_server}
runs=${RUNS:-step_c1 step_c4 attend_c1}
mkdir -p "$out"
ports=$(mktemp)
"$server_bin" --backend=cuda --port=0 --metrics_port=0 --port_file="$ports" \
  --max_message_mb=2047 >"$out/decode_e2e_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $ports ]] && break; sleep 0.1; done
port=$(cut -d' ' -f1 "$ports")
common=(--target=127.0.0.1:$port --shape=$seqs,32,1,128 --nk=$nk --kv_heads=8 --dtype=bfloat16
        --causal --max_message_mb=2047 --progress=false --json)
run() {  # NAME ARGS...: one attn_bench run, its JSON line kept with NAME
  local name=$1; shift
  local json
  json=$("$bin/attn_bench" "${common[@]}" "$@" 2>"$out/decode_e2e_$name.log" | tail -1)
  echo "{\"run\": \"$name\", \"result\": ${json:-null}}" >>"$out/decode_e2e.jsonl"
  echo "$name: $json"
}
: >"$out/decode_e2e.jsonl"
for name in $runs; do
  case $name in
    step_c*)
      c=${name#step_c}
      run "$name" --mode=decode --sessions=$((seqs * c)) --concurrency=$c --warmup_s=1 --duration_s=5
      ;;
    attend_c1) run attend_c1 --concurrency=1 --warmup_s=2 --duration_s=10 ;;
    *) echo "decode_e2e.sh: unknown run $name" >&2 ;;
  esac
done
