#!/usr/bin/env bash
# A model's greedy decode with attention and KV on the service beside local FlashAttention-3
# (bench/torch/decode_bench.py: an 8B-shaped Llama, batches 8/32/64, contexts 1024/4096, the
# service's transports), the server on the same GPU as the model, in another process. Logs and
# the JSON lines go to $OUT; the ratio table prints last.
#   bench/torch/run_decode.sh [BIN_DIR] [decode_bench.py flags...]
# BIN_DIR (default .device/bin) holds attention_server. The Python stubs: GEN (default
# build/tests/python/gen, carried with the working tree) or an installed attention_client.
# PYTHON (default python3) needs torch, numpy, grpcio and protobuf; the anchor needs the fa3-fwd
# wheel (docs/gpu-host.md), installed from .whl/ when that folder is there. BACKEND=cpu runs the
# server on the CPU (a trial with small flags and --device=cpu --attn=sdpa,unary).
# PROFILE=1 samples the model's process with py-spy (its wheel in .whl/) into decode_client.svg.
# MPS=1 runs the server and the model under a CUDA MPS control daemon of their own (started here,
# stopped at exit), as co-located deployments should (README.md, co-located clients): without it
# the GPU switches between the two processes' contexts at every layer call.
# SERVER_FLAGS adds flags to attention_server's (e.g. SERVER_FLAGS=--malloc_keep_mb=0).
set -uo pipefail
bin=${1:-.device/bin}
shift || true
out=${OUT:-/tmp/out}
gen=${GEN:-build/tests/python/gen}
python=${PYTHON:-python3}
mkdir -p "$out"
[[ -d .device/lib ]] && export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if compgen -G ".whl/fa3_fwd-*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --target /tmp/fa3-site .whl/fa3_fwd-*.whl &&
    export PYTHONPATH=/tmp/fa3-site${PYTHONPATH:+:$PYTHONPATH}
fi
ports=$(mktemp)
mps_stop=:
if [[ -n ${MPS:-} ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  if ! nvidia-cuda-mps-control -d; then
    echo "run_decode.sh: the MPS control daemon did not start"
    exit 1
  fi
  mps_stop='echo quit | nvidia-cuda-mps-control'
  echo "run_decode.sh: under MPS (pipe directory $CUDA_MPS_PIPE_DIRECTORY)" >&2
fi
# The model process keeps its weights and, for the local anchors, its own KV cache on the same
# GPU: the server holds a quarter of the device as KV pages (16 layers x 64 sequences x 4096 rows
# need 17 GB) and a tenth for request buffers.
"$bin/attention_server" --backend="${BACKEND:-cuda}" --host=127.0.0.1 --port=0 --metrics_port=0 \
  --port_file="$ports" --max_message_mb=2047 --allow_shared_memory --socket_port=0 \
  --device_memory_fraction=0.1 --kv_cache_fraction=0.25 --session_ttl_s=3600 ${SERVER_FLAGS:-} \
  >"$out/decode_bench_server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; eval "$mps_stop"' EXIT
for _ in $(seq 100); do [[ -s $ports ]] && break; sleep 0.1; done
[[ -s $ports ]] || { echo "run_decode.sh: attention_server did not start"; cat "$out/decode_bench_server.log"; exit 1; }
port=$(cut -d' ' -f1 "$ports")
# PROFILE=1: the model's process under py-spy (a wheel in .whl/), sampled with its native frames,
# as a flame graph in $OUT/decode_client.svg: where the client's part of a layer call goes.
profiler=()
if [[ -n ${PROFILE:-} ]] && compgen -G ".whl/py_spy-*.whl" >/dev/null &&
  "$python" -m pip install -q --no-index --no-deps --target /tmp/py-spy-site .whl/py_spy-*.whl; then
  profiler=(/tmp/py-spy-site/bin/py-spy record --native --rate 250 -o "$out/decode_client.svg" --)
fi
PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/client/python:$PWD/$gen${PYTHONPATH:+:$PYTHONPATH} \
  "${profiler[@]}" "$python" bench/torch/decode_bench.py --target=127.0.0.1:$port "$@" \
  2>"$out/decode_bench.log" | tee "$out/decode_bench.txt"
rc=${PIPESTATUS[0]}
[[ $rc == 0 ]] || tail -20 "$out/decode_bench.log"
exit "$rc"
