#!/usr/bin/env bash
# Tensors at the wire's speed, measured in one command on one host over loopback, each figure
# beside its anchor of the same run:
#   tcp       one TCP stream (python3 sockets, 64 MiB sends): the socket's rate
#   echo      the bare gRPC echo (bench/echo) fed the 256 MiB request's bytes, one connection
#   attend    one 256 MiB bf16 Attend at a time on one connection   (target >= 2x echo)
#   chunked   AttendChunked over --connections=4, 4 calls in flight  (target >= 1.0x tcp, >= 4 GB/s)
#   decode1g  the 1 GiB decode-shaped Attend (8 x 32k bf16 K/V, Hq 32, Hkv 8, D 128), one call at
#             a time, unary and chunked                              (target p50 <= 0.5 s)
#   check3g   a 3 GiB request (24 x 32k K/V) through AttendChunked, checked against the float64
#             reference by attn_client --check; decode-shaped (one query row per sequence), so the
#             exact reference over every row costs 24 x 32 x 32k x 128 multiply-adds, seconds
# Every JSON line goes to $OUT/wire/*.jsonl, the servers' logs beside them; the table is last.
#   bench/wire/run.sh BIN_DIR [--backend=cuda]          # the GPU host, < 4 minutes
#   SMALL=1 bench/wire/run.sh build-bins --backend=cpu  # this machine: the same steps, small
# BIN_DIR holds attention_server, attn_echo_server, attn_bench, attn_client (flat, as
# scripts/bundle_device.sh lays them out, libraries in BIN_DIR/../lib), or is a build dir.
set -uo pipefail
bin=${1:-.device/bin}
backend=${2:---backend=cuda}
out=${OUT:-/tmp/out}/wire
mkdir -p "$out"
[[ -d $bin/../lib ]] && export LD_LIBRARY_PATH=$bin/../lib:${LD_LIBRARY_PATH:-}
find_bin() {  # NAME: BIN_DIR/NAME, or its place in a build dir
  for p in "$bin/$1" "$bin/server/$1" "$bin/client/$1" "$bin/bench/echo/$1"; do
    [[ -x $p ]] && { echo "$p"; return; }
  done
  echo "run.sh: no $1 under $bin" >&2
  exit 2
}
server_bin=$(find_bin attention_server)
echo_bin=$(find_bin attn_echo_server)
bench_bin=$(find_bin attn_bench)
client_bin=$(find_bin attn_client)

# Shapes: 256 MiB = K/V [4, 16, 8192, 128] bf16 (128 MiB each) + q [4, 16, 256, 128] (4 MiB).
attend_shape=(--shape=4,16,256,128 --nk=8192)
decode_shape=(--shape=8,32,1,128 --nk=32768 --kv_heads=8)
check_shape=(--shape=24,32,1,128 --nk=32768 --kv_heads=8)
tcp_mb=64
secs=6
if [[ ${SMALL:-0} == 1 ]]; then
  attend_shape=(--shape=1,4,16,64 --nk=4096)
  decode_shape=(--shape=2,8,1,128 --nk=4096 --kv_heads=2)
  check_shape=(--shape=3,8,1,128 --nk=8192 --kv_heads=2)
  tcp_mb=8
  secs=2
fi

dir=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
"$server_bin" "$backend" --host=127.0.0.1 --port=0 --metrics_port=0 --port_file="$dir/server.port" \
  --max_message_mb=2047 --receive_memory_mb=4096 >"$out/server.log" 2>&1 &
pids+=($!)
"$echo_bin" --port=0 --port_file="$dir/echo.port" --max_message_mb=2047 >"$out/echo.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do [[ -s $dir/server.port && -s $dir/echo.port ]] && break; sleep 0.1; done
server=127.0.0.1:$(cut -d' ' -f1 "$dir/server.port")
echo_target=127.0.0.1:$(cat "$dir/echo.port")
common=(--dtype=bfloat16 --max_message_mb=2047 --progress=false --json)

# 1. One TCP stream.
python3 - "$tcp_mb" >"$out/tcp.json" <<'PY'
import json, socket, sys, threading, time
mb = int(sys.argv[1]); chunk = bytes(mb << 20); secs = 2.0
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
got = [0]
def receive():
    c, _ = srv.accept(); buf = bytearray(mb << 20); view = memoryview(buf)
    while True:
        n = c.recv_into(view)
        if n == 0: break
        got[0] += n
t = threading.Thread(target=receive); t.start()
s = socket.create_connection(srv.getsockname()); start = time.perf_counter()
while time.perf_counter() - start < secs: s.sendall(chunk)
s.shutdown(socket.SHUT_WR); t.join(); elapsed = time.perf_counter() - start
print(json.dumps({"payload_gb_per_s": got[0] / elapsed / 1e9, "bytes": got[0], "elapsed_s": elapsed}))
PY

bench() {  # NAME ARGS...: one attn_bench run; its JSON line into $out/NAME.jsonl
  local name=$1; shift
  "$bench_bin" "${common[@]}" "$@" 2>"$out/$name.log" | tail -1 >"$out/$name.jsonl"
}
# 2+3. The 256 MiB Attend, one at a time on one connection, then the echo with the same bytes.
bench attend --target="$server" --echo_target="$echo_target" "${attend_shape[@]}" \
  --concurrency=1 --warmup_s=1 --duration_s=$secs
# 4. AttendChunked on 4 connections, 4 calls in flight.
bench chunked --target="$server" "${attend_shape[@]}" --rpc=chunked --connections=4 \
  --chunk_mb=16 --concurrency=4 --warmup_s=1 --duration_s=$secs
# 5. The 1 GiB decode-shaped Attend, unary and chunked.
bench decode1g --target="$server" "${decode_shape[@]}" --causal --concurrency=1 --warmup_s=1 \
  --duration_s=$secs
bench decode1g_chunked --target="$server" "${decode_shape[@]}" --causal --rpc=chunked \
  --chunk_mb=16 --concurrency=1 --warmup_s=1 --duration_s=$secs
# 6. 3 GiB through AttendChunked, against the float64 reference.
"$client_bin" --target="$server" "${check_shape[@]}" --dtype=bfloat16 --causal --lse --check \
  --chunked_above_mb=1 --chunk_mb=16 --deadline_ms=600000 >"$out/check3g.log" 2>&1
echo "{\"exit\": $?}" >"$out/check3g.json"

python3 - "$out" <<'PY'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f: return json.loads(f.read().strip() or "null")
    except (OSError, ValueError): return None
tcp = load("tcp.json"); attend = load("attend.jsonl"); chunked = load("chunked.jsonl")
d1 = load("decode1g.jsonl"); d1c = load("decode1g_chunked.jsonl"); chk = load("check3g.json")
g = lambda r, k: (r or {}).get(k) or 0
tcp_rate = g(tcp, "payload_gb_per_s"); echo_rate = g(g(attend, "echo") or {}, "payload_gb_per_s")
check = open(os.path.join(out, "check3g.log")).read() if os.path.exists(os.path.join(out, "check3g.log")) else ""
m = re.search(r"check: (\|\|o-ref.*?),", check)
rows = [
    ("one TCP stream", f"{tcp_rate:.2f} GB/s", "anchor", ""),
    ("bare gRPC echo, 256 MiB", f"{echo_rate:.2f} GB/s", "anchor", ""),
    ("Attend 256 MiB, 1 conn", f"{g(attend, 'payload_gb_per_s'):.2f} GB/s",
     f"{g(attend, 'payload_gb_per_s') / echo_rate:.2f}x echo" if echo_rate else "-", ">= 2x echo"),
    ("AttendChunked x4 conns", f"{g(chunked, 'payload_gb_per_s'):.2f} GB/s",
     f"{g(chunked, 'payload_gb_per_s') / tcp_rate:.2f}x tcp" if tcp_rate else "-", ">= 1.0x tcp, >= 4 GB/s"),
    ("Attend 1 GiB decode, unary", f"p50 {g(d1, 'p50'):.3f} s", f"{g(d1, 'payload_gb_per_s'):.2f} GB/s", "p50 <= 0.5 s"),
    ("Attend 1 GiB decode, chunked", f"p50 {g(d1c, 'p50'):.3f} s", f"{g(d1c, 'payload_gb_per_s'):.2f} GB/s", "p50 <= 0.5 s"),
    ("AttendChunked 3 GiB --check", "PASS" if chk and chk.get("exit") == 0 else "FAIL",
     (m.group(1)[:60] if m else "no check line"), "rel. error in bound"),
]
print(f"{'what':32} {'measured':18} {'ratio':28} target")
for r in rows: print(f"{r[0]:32} {r[1]:18} {r[2]:28} {r[3]}")
PY
