#!/usr/bin/env bash
# Greedy decode of a ~1B-parameter Llama-shaped model (random weights, bf16, context 4096, batch 1
# and 8) with its KV cache on the attention service (sessions, one Step per layer per token;
# the server on the same GPU, beside the model process) against local SDPA with a local cache:
# bench/torch/decode_bench.py. Logs and the JSON lines go to $OUT; the table prints last.
#   bench/torch/run_decode.sh [BIN_DIR] [decode_bench.py flags...]
# BIN_DIR (default .device/bin) holds attention_server. The Python stubs: GEN (default
# build/tests/python/gen, carried with the working tree) or an installed attention_client.
# PYTHON (default python3) needs torch, numpy, grpcio and protobuf. BACKEND=cpu runs the server
# on the CPU (for trying it out with small flags here).
set -uo pipefail
bin=${1:-.device/bin}
shift || true
out=${OUT:-/tmp/out}
gen=${GEN:-build/tests/python/gen}
mkdir -p "$out"
[[ -d .device/lib ]] && export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ports=$(mktemp)
"$bin/attention_server" --backend="${BACKEND:-cuda}" --host=127.0.0.1 --port=0 --metrics_port=0 \
  --port_file="$ports" --max_message_mb=2047 >"$out/decode_bench_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $ports ]] && break; sleep 0.1; done
[[ -s $ports ]] || { echo "run_decode.sh: attention_server did not start"; cat "$out/decode_bench_server.log"; exit 1; }
port=$(cut -d' ' -f1 "$ports")
PYTHONPATH=$PWD/client/python:$PWD/$gen${PYTHONPATH:+:$PYTHONPATH} "${PYTHON:-python3}" \
  bench/torch/decode_bench.py --target=127.0.0.1:$port "$@" 2>"$out/decode_bench.log" \
  | tee "$out/decode_bench.txt"
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] || tail -20 "$out/decode_bench.log"
exit "$rc"
