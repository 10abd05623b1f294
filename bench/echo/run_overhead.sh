#!/usr/bin/env bash
# Service overhead against the echo anchor: starts attention_server (CPU backend) and
# attn_echo_server on free loopback ports, runs attn_bench on the large-payload and small-request
# cases ROUNDS times each (attention phase, then echo phase, in one attn_bench run), prints each
# run's JSON line and the medians. Usage: bench/echo/run_overhead.sh BUILD_DIR [ROUNDS]
set -euo pipefail
build=${1:?usage: run_overhead.sh BUILD_DIR [ROUNDS]}
rounds=${2:-3}
dir=$(mktemp -d)
trap 'kill $server_pid $echo_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
"$build/server/attention_server" --backend=cpu --host=127.0.0.1 --port=0 --metrics_port=0 \
  --port_file="$dir/server.port" >"$dir/server.log" 2>&1 &
server_pid=$!
"$build/bench/echo/attn_echo_server" --port=0 --port_file="$dir/echo.port" >"$dir/echo.log" 2>&1 &
echo_pid=$!
for _ in $(seq 100); do [ -s "$dir/server.port" ] && [ -s "$dir/echo.port" ] && break; sleep 0.1; done
server=127.0.0.1:$(cut -d' ' -f1 "$dir/server.port")
echo=127.0.0.1:$(cat "$dir/echo.port")

# name | attn_bench flags
cases=(
  "f32_16MiB|--shape=512,16,8,64 --dtype=float32 --concurrency=2 --warmup_s=2 --duration_s=8"
  "f32_64MiB|--shape=2048,16,8,64 --dtype=float32 --concurrency=2 --warmup_s=3 --duration_s=10"
  "f16_small_c32|--shape=1,8,128,64 --dtype=float16 --concurrency=32 --warmup_s=1 --duration_s=5"
  "f16_small_c1|--shape=1,8,128,64 --dtype=float16 --concurrency=1 --warmup_s=0.5 --duration_s=4"
)
for c in "${cases[@]}"; do
  name=${c%%|*}
  flags=${c#*|}
  for r in $(seq "$rounds"); do
    # shellcheck disable=SC2086
    line=$("$build/client/attn_bench" --target="$server" --echo_target="$echo" $flags \
      --progress=false --json | tail -1)
    echo "$name $r $line"
    echo "$line" >>"$dir/$name.jsonl"
  done
  python3 - "$name" "$dir/$name.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[2])]
med = lambda f: statistics.median(f(r) for r in runs)
print(f"{sys.argv[1]} median of {len(runs)}: "
      f"attention {med(lambda r: r['payload_gb_per_s']):.3f} GB/s, "
      f"echo {med(lambda r: r['echo']['payload_gb_per_s']):.3f} GB/s, "
      f"ratio {med(lambda r: r['payload_ratio_vs_echo']):.3f}; "
      f"p50 {med(lambda r: r['p50']) * 1e3:.3f} ms, echo p50 {med(lambda r: r['echo']['p50']) * 1e3:.3f} ms, "
      f"p50 - echo p50 {med(lambda r: r['p50_minus_echo_s']) * 1e6:.0f} us, "
      f"server compute p50 {med(lambda r: r['compute_us_p50']):.0f} us")
PY
done
