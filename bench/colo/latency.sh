#!/usr/bin/env bash
# Per-call latency of co-located clients on the GPU host, in one command (about 7 minutes), each
# figure beside the bare transport's of the same run:
#   bench/colo/latency.sh [BIN_DIR]   # BIN_DIR: attention_server, attn_bench, attn_echo_server,
#                                     # attn_echo_client, colo_bench (default .device/bin; libs in
#                                     # ../lib)
# 1. The bare transport: attn_echo_client, one EchoStream message at a time, of a Step's bytes
#    (64 KiB of q and 2 x 16 KiB of new K/V in, 64 KiB out) and of the small Attend's (3 x 128 KiB
#    in, 128 KiB out), against attn_echo_server on gRPC's callback API and on its sync API, over
#    TCP loopback and a Unix domain socket, from a client on the callback API, on the sync API and
#    polling (the async API, its thread polling its completion queue without sleeping). Then the
#    echo replying DELAY_US (default 250) later, from a spinning thread (the transport around a
#    job): on the callback API, and on the async API polled by one server thread (--poll).
# 2. StepStream, 8 sessions x 32k rows, bf16, Hq 32, Hkv 8, D 128, one query each, causal, each
#    Step appending its token, one Step in flight (target p50 <= kernel + 100 us) and four (target
#    >= 1.5 x 3,233 Steps/s), over TCP and the Unix socket (--unix_socket), from attn_bench on
#    each client API (--stream_api), with where the time goes (ServerTiming).
# 3. Small Attend (1x8x128x64 fp16) on AttendStream, one in flight, against the echo server's
#    EchoStream on the same transport and client API (target p50 <= echo p50 + 50 us).
# 4. On a server that serves shared memory, over TCP (shared memory is not served on a Unix socket
#    without a token): the one-in-flight StepStream of 2. with q, the new K/V rows and o by
#    reference (attn_bench --shm: no tensor byte in the messages), beside the bare echo of a
#    near-empty message; and CUDA IPC Attend, bf16 B4 H16 N4096 D128 (colo_bench --mode=ipc;
#    target e2e <= kernel + 100 us).
# 5. The one-in-flight StepStreams (tensors in the messages and by reference) and the CUDA IPC
#    Attend again, on a server with --worker_spin_us=SPIN_US (default 1000): the queue's thread hop
#    without a wake-up.
# Logs and JSON lines under $OUT/latency (OUT defaults to /tmp/out); the table comes last.
# A CPU try: BACKEND=cpu NK=256 SHAPE=1,4,256,64 DURATION_S=1 bench/colo/latency.sh BIN_DIR
# NAME_target, NAME_metrics and NAME_pid are set by lib.sh's start_attention and start_echo.
# shellcheck disable=SC2154
set -uo pipefail
bin=${1:-.device/bin}
out=${OUT:-/tmp/out}/latency
backend=${BACKEND:-cuda}
nk=${NK:-32768}
shape=${SHAPE:-4,16,4096,128}
dur=${DURATION_S:-2}
here=$(dirname "$0")
# shellcheck source=bench/colo/lib.sh
source "$here/lib.sh"
colo_setup
results=$out/latency.jsonl
: >"$results"

# 1. The bare transport, and (delay: 1b.) around a job of DELAY_US.
delay_us=${DELAY_US:-250}
start_echo echo_cb --unix_socket="$dir/echo_cb.sock"
start_echo echo_sync --unix_socket="$dir/echo_sync.sock" --sync
start_echo echo_delay --unix_socket="$dir/echo_delay.sock" --reply_delay_us="$delay_us"
# The same on the async API with one thread polling it (attn_echo_server --poll): one core busy.
start_echo echo_delaypoll --unix_socket="$dir/echo_delaypoll.sock" --reply_delay_us="$delay_us" \
  --poll
for size in "step 65536 16384" "small 131072 131072" "empty 64 64"; do
  read -r what q kv <<<"$size"
  for server in cb sync delay delaypoll; do
    [[ $server == delay* && $what == small ]] && continue
    tcp_var=echo_${server}_target
    for transport in tcp unix; do
      t=${!tcp_var}
      [[ $transport == unix ]] && t=unix:$dir/echo_$server.sock
      for api in callback sync poll; do
        keep "echo_${what}_${server}_${transport}_${api}" "$("$bin/attn_echo_client" --target="$t" \
          --api="$api" --q_bytes="$q" --kv_bytes="$kv" --warmup_s=0.3 --duration_s=1 \
          2>>"$out/echo_client.log")"
      done
    done
  done
done
stop_server "$echo_delay_pid"
stop_server "$echo_delaypoll_pid"

# 2 and 3. The service, on TCP and a Unix socket, against the callback echo server.
start_attention server --unix_socket="$dir/server.sock" --max_message_mb=2047 --worker_spin_us=0
decode=(--mode=decode --shape=8,32,1,128 --nk="$nk" --kv_heads=8 --dtype=bfloat16 --causal
  --max_message_mb=2047 --warmup_s=1 --duration_s="$dur" --rpc=stream --concurrency=1,4
  --sessions=32)
small=(--shape=1,8,128,64 --dtype=float16 --concurrency=1 --warmup_s=0.5 --duration_s="$dur"
  --rpc=stream)
for transport in tcp unix; do
  t=$server_target e=$echo_cb_target
  [[ $transport == unix ]] && t=unix:$dir/server.sock e=unix:$dir/echo_cb.sock
  for api in callback sync poll; do
    # One line per concurrency, 1 then 4.
    lines=$("$bin/attn_bench" --target="$t" --stream_api="$api" --progress=false --json \
      "${decode[@]}" 2>"$out/step_${transport}_$api.log" | tail -2)
    keep "step_${transport}_${api}_c1" "$(head -1 <<<"$lines")"
    keep "step_${transport}_${api}_c4" "$(tail -1 <<<"$lines" | grep '"requests"')"
    keep "small_${transport}_$api" "$("$bin/attn_bench" --target="$t" --echo_target="$e" \
      --stream_api="$api" --progress=false --json "${small[@]}" \
      2>"$out/small_${transport}_$api.log" | tail -1)"
  done
done
stop_server "$server_pid"

# one_step KEY TARGET FLAGS...: the one-in-flight StepStream of 2. over TCP on each client API.
one_step() {
  local key=$1 target=$2 api
  shift 2
  for api in callback sync poll; do
    keep "${key}_tcp_${api}_c1" "$("$bin/attn_bench" --target="$target" "$@" \
      --stream_api="$api" --progress=false --json "${decode[@]/--concurrency=1,4/--concurrency=1}" \
      2>"$out/${key}_tcp_$api.log" | tail -1)"
  done
}
# ipc_attend KEY TARGET: the CUDA IPC Attend, bf16 $shape.
ipc_attend() {
  keep "$1" "$("$bin/colo_bench" --target="$2" --mode=ipc --shape="$shape" --iters=20 \
    2>"$out/$1.log" | tail -1)"
}

# 4. StepStream by reference and CUDA IPC Attend, on a server that serves shared memory (TCP only).
start_attention ipc_server --allow_shared_memory --max_message_mb=2047 --worker_spin_us=0
one_step step_shm "$ipc_server_target" --shm
ipc_attend ipc "$ipc_server_target"
stop_server "$ipc_server_pid"

# 5. The one-in-flight StepStreams of 2. and 4. and CUDA IPC Attend again, on a server whose idle
#    workers poll the queue for SPIN_US (default 1000) before they sleep (--worker_spin_us).
spin_us=${SPIN_US:-1000}
start_attention spin_server --allow_shared_memory --max_message_mb=2047 \
  --worker_spin_us="$spin_us"
one_step step_spin "$spin_server_target"
one_step step_spin_shm "$spin_server_target" --shm
ipc_attend ipc_spin "$spin_server_target"

python3 - "$results" "$here" "$delay_us" "$spin_us" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
from colo_table import breakdown, load

r, ok = load(sys.argv[1])

variants = [(t, a) for t in ("tcp", "unix") for a in ("callback", "sync", "poll")]
head = [f"{'TCP' if t == 'tcp' else 'Unix'}, {a} client" for t, a in variants]
rest = [""] * (len(variants) - 1)  # the cells of a row measured once
rows = []
for what, size in (("step", "Step's bytes"), ("small", "small Attend's bytes"),
                   ("empty", "64-byte tensors")):
    for server in ("cb", "sync"):
        cells = []
        for t, a in variants:
            x = ok(f"echo_{what}_{server}_{t}_{a}")
            cells.append(f"{x['p50_us']:.0f} us" if x else "error")
        api = "callback" if server == "cb" else "sync"
        rows.append([f"bare echo, {size}, {api} server: p50"] + cells + ["anchor", "-"])
    if what == "small":
        continue
    for server, api in (("delay", "callback server"),
                        ("delaypoll", "polled async server (--poll)")):
        cells = []
        for t, a in variants:
            x = ok(f"echo_{what}_{server}_{t}_{a}")
            cells.append(f"{sys.argv[3]} + {x['p50_us'] - float(sys.argv[3]):.0f} us"
                         if x else "error")
        rows.append([f"bare echo, {size}, {api} replying {sys.argv[3]} us later: p50"] + cells +
                     ["anchor", "-"])

any_step = next((ok(f"step_{t}_{a}_c1") for t, a in variants if ok(f"step_{t}_{a}_c1")), {})
steps = f"8 x {any_step.get('config', {}).get('nk', '?')}"

def step_cells(c, fmt):
    cells, met = [], []
    for t, a in variants:
        s = ok(f"step_{t}_{a}_{c}")
        if not s:
            cells.append("error")
            continue
        text, g = fmt(s)
        cells.append(text)
        met.append(g)
    return cells, ("yes" if any(met) else "NO") if met else "NO"

cells, met = step_cells("c1", lambda s: (
    f"{s['p50'] * 1e3:.3f} ms = kernel {s['compute_us_p50']:.0f} + "
    f"{s['p50'] * 1e6 - s['compute_us_p50']:.0f} us",
    s["p50"] * 1e6 - s["compute_us_p50"] <= 100))
rows.append([f"StepStream {steps}, 1 in flight: p50"] + cells + ["<= kernel + 100 us", met])
cells, met = [], []
for t, a in variants:
    s = ok(f"step_shm_{t}_{a}_c1")
    if t != "tcp":
        cells.append("-")  # shared memory is served over TCP here
    elif not s:
        cells.append("error")
    else:
        extra = s["p50"] * 1e6 - s["compute_us_p50"]
        cells.append(f"{s['p50'] * 1e3:.3f} ms = kernel {s['compute_us_p50']:.0f} + {extra:.0f} us")
        met.append(extra <= 100)
rows.append([f"StepStream {steps}, 1 in flight, tensors by reference (--shm): p50"] + cells +
            ["<= kernel + 100 us", ("yes" if any(met) else "NO") if met else "NO"])
for key, what in (("step_spin", "tensors in the messages"),
                  ("step_spin_shm", "tensors by reference")):
    cells, met = [], []
    for t, a in variants:
        s = ok(f"{key}_{t}_{a}_c1")
        if t != "tcp":
            cells.append("-")  # measured over TCP only
        elif not s:
            cells.append("error")
        else:
            extra = s["p50"] * 1e6 - s["compute_us_p50"]
            cells.append(
                f"{s['p50'] * 1e3:.3f} ms = kernel {s['compute_us_p50']:.0f} + {extra:.0f} us")
            met.append(extra <= 100)
    rows.append([f"StepStream {steps}, 1 in flight, {what}, --worker_spin_us={sys.argv[4]}: p50"] +
                cells + ["<= kernel + 100 us", ("yes" if any(met) else "NO") if met else "NO"])
cells, met = step_cells("c4", lambda s: (
    f"{s['requests_per_s']:.0f} Steps/s ({s['requests_per_s'] / 3233:.2f}x)",
    s["requests_per_s"] >= 1.5 * 3233))
rows.append([f"StepStream {steps}, 4 in flight"] + cells + [">= 1.5x 3,233 Steps/s", met])
cells, met = [], []
for t, a in variants:
    s = ok(f"small_{t}_{a}")
    if not s or "echo" not in s:
        cells.append("error")
        continue
    d = s["p50_minus_echo_s"] * 1e6
    cells.append(f"{s['p50'] * 1e3:.3f} ms = echo {s['echo']['p50'] * 1e3:.3f} ms + {d:.0f} us")
    met.append(d <= 50)
rows.append(["small Attend, AttendStream, 1 in flight: p50"] + cells +
            ["<= echo + 50 us", ("yes" if any(met) else "NO") if met else "NO"])
for key, server in (("ipc", ""), ("ipc_spin", f", --worker_spin_us={sys.argv[4]}")):
    ipc = ok(key)
    if ipc:
        extra = ipc["p50_ms"] * 1e3 - ipc["compute_us_p50"]
        rows.append([f"CUDA IPC Attend bf16 4x16x4096x128 (TCP{server}): p50",
                     f"{ipc['p50_ms']:.3f} ms = kernel {ipc['compute_us_p50']:.0f} + {extra:.0f} us"
                     f" (server {ipc['server_total_us_p50']:.0f} us)",
                     *rest, "<= kernel + 100 us", "yes" if extra <= 100 else "NO"])
    else:
        rows.append([f"CUDA IPC Attend (TCP{server})", str(r.get(key)), *rest,
                     "<= kernel + 100 us", "NO"])

print("\nWhere a Step's p50 goes (one in flight):")
for t, a in variants:
    s = ok(f"step_{t}_{a}_c1")
    if s:
        print(f"- {t}, {a} client: {breakdown(s)}")
    s = ok(f"step_shm_{t}_{a}_c1")
    if s:
        print(f"- {t}, {a} client, tensors by reference: {breakdown(s)}")
    for key, what in (("step_spin", ""), ("step_spin_shm", ", tensors by reference")):
        s = ok(f"{key}_{t}_{a}_c1")
        if s:
            print(f"- {t}, {a} client{what}, --worker_spin_us={sys.argv[4]}: {breakdown(s)}")
print("\n| measure | " + " | ".join(head) + " | target | met (best) |")
print("|---" * (len(head) + 3) + "|")
for x in rows:
    print("| " + " | ".join(str(c) for c in x) + " |")
PY
