#!/usr/bin/env bash
# The bytes of a batch-64 decode Step (768 KiB up, 512 KiB back) over loopback without attention:
# a raw TCP round trip (bench/echo/py_echo.py --tcp), then attn_echo_server with glibc's malloc
# defaults and with freed memory kept (as attention_server's --malloc_keep_mb=64 sets it), each
# driven by attn_echo_client (C++) and by grpcio (py_echo.py, one connection and four). One JSON
# line per measurement, each labelled.
#   bench/echo/step_bytes.sh BIN_DIR      # BIN_DIR holds attn_echo_server and attn_echo_client
# PYTHON (default python3) needs grpcio and protobuf (py_echo.py encodes with the Python client).
set -euo pipefail
bin=${1:?usage: step_bytes.sh BIN_DIR}
here=$(dirname "$0")
python=${PYTHON:-python3}
dir=$(mktemp -d)
trap 'kill $echo_pid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
echo_pid=
label() { sed "s/^{/{\"server_malloc\": \"$1\", /"; }
"$python" "$here/py_echo.py" --tcp | label none
for malloc in defaults kept; do
  rm -f "$dir/echo.port"
  if [[ $malloc == kept ]]; then
    env MALLOC_TRIM_THRESHOLD_=67108864 MALLOC_MMAP_THRESHOLD_=33554432 \
      "$bin/attn_echo_server" --port=0 --port_file="$dir/echo.port" >"$dir/echo.log" 2>&1 &
  else
    "$bin/attn_echo_server" --port=0 --port_file="$dir/echo.port" >"$dir/echo.log" 2>&1 &
  fi
  echo_pid=$!
  for _ in $(seq 100); do [[ -s $dir/echo.port ]] && break; sleep 0.1; done
  target=127.0.0.1:$(cat "$dir/echo.port")
  printf '%s\n' "$("$bin/attn_echo_client" --target="$target" --q_bytes=524288 --kv_bytes=131072 \
    --duration_s=3)" | label "$malloc"
  for parts in 1 4; do "$python" "$here/py_echo.py" --target="$target" --parts=$parts | label "$malloc"; done
  kill $echo_pid
  wait $echo_pid 2>/dev/null || true
done
