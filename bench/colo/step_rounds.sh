#!/usr/bin/env bash
# The one-in-flight StepStream (8 sessions x 32k rows, bf16, Hq 32, Hkv 8, D 128, causal, each Step
# appending its token) in ROUNDS interleaved rounds (default 3) of each variant, medians last: a
# single 2-second run of one variant on the H200 host moves by +-50 us from run to run, more than
# the differences measured, so each variant is run in every round, one after the other.
#   bench/colo/step_rounds.sh [BIN_DIR]   # attention_server, attn_bench, attn_echo_server,
#                                         # attn_echo_client, colo_bench (default .device/bin)
# Variants: tensors by reference (--shm) from a polling client and a sync client, tensors in the
# messages from a polling client, and both through a request ring instead of the stream
# (--stream_api=ring: SharedMemory.OpenRing, no gRPC message per Step); and the anchor beside them, the bare echo of 64-byte tensors
# replying DELAY_US (default 250) after the read, from a polling client, with the next read
# started after the reply (the echo's way) and before it (--read_ahead, the attention server's).
# Then four Steps in flight (tensors in the messages, 32 sessions; polled streams and rings),
# Steps/s; and the CUDA IPC
# Attend (colo_bench --mode=ipc, bf16 SHAPE, default 4,16,4096,128: q, k, v and o in one
# cudaMalloc of the client, the kernel reading and writing them in place) one call at a time, as
# unary calls, as messages of one AttendStream from a polling client (--rpc=stream) and through a
# request ring (--rpc=ring). (Four such clients at once: bench/colo/ipc_clients.sh.)
# The one-in-flight Steps of 8 sessions from the Python client too (py_step_bench.py: unary Step,
# StepStream and request ring, tensors in the messages), run by PYTHON (default python3) with
# client/python and the stubs PY_GEN (default build/tests/python/gen) on its path; skipped,
# saying why, when that Python cannot import attention_client.
# The server runs with --worker_spin_us=SPIN_US (default 1000; 0 for none). SERVERS (default
# "callback") names the stream transports to run, each on a server of its own, every variant
# against each in every round: "callback" (gRPC's callback API), "polled" (--poll_streams:
# the async API, one thread polling its completions), "lockstep" (polled, with --stream_window=1:
# each stream reads its next message only once the last answer is written), or several side by
# side ("callback polled lockstep").
# Logs and JSON lines under $OUT/rounds (OUT defaults to /tmp/out); the table comes last.
# A CPU try: BACKEND=cpu NK=256 DURATION_S=1 ROUNDS=1 bench/colo/step_rounds.sh BIN_DIR
# NAME_target and NAME_pid are set by lib.sh's start_attention and start_echo.
# shellcheck disable=SC2154
set -uo pipefail
bin=${1:-.device/bin}
out=${OUT:-/tmp/out}/rounds
backend=${BACKEND:-cuda}
nk=${NK:-32768}
dur=${DURATION_S:-2}
rounds=${ROUNDS:-3}
delay_us=${DELAY_US:-250}
shape=${SHAPE:-4,16,4096,128}
spin_us=${SPIN_US:-1000}
servers=${SERVERS:-callback}
python=${PYTHON:-python3}
here=$(dirname "$0")
root=$(cd "$here/../.." && pwd)
py_path=$root/client/python:${PY_GEN:-$root/build/tests/python/gen}${PYTHONPATH:+:$PYTHONPATH}
# shellcheck source=bench/colo/lib.sh
source "$here/lib.sh"
colo_setup
results=$out/rounds.jsonl
: >"$results"

for server in $servers; do
  case $server in
    callback) start_attention callback --allow_shared_memory --max_message_mb=2047 \
      --worker_spin_us="$spin_us" ;;
    polled) start_attention polled --allow_shared_memory --max_message_mb=2047 \
      --worker_spin_us="$spin_us" --poll_streams ;;
    lockstep) start_attention lockstep --allow_shared_memory --max_message_mb=2047 \
      --worker_spin_us="$spin_us" --poll_streams --stream_window=1 ;;
    *) echo "step_rounds.sh: SERVERS: expected callback, polled or lockstep, got $server" >&2
      exit 2 ;;
  esac
done
if ! PYTHONPATH=$py_path "$python" -c 'import attention_client' 2>"$out/py_import.log"; then
  echo "step_rounds.sh: $python cannot import attention_client with PYTHONPATH=$py_path" \
    "(set PYTHON, PY_GEN): the Python Steps are skipped:" >&2
  cat "$out/py_import.log" >&2
  python=
fi
start_echo echo --reply_delay_us="$delay_us"
start_echo echo_ahead --reply_delay_us="$delay_us" --read_ahead
decode=(--mode=decode --shape=8,32,1,128 --nk="$nk" --kv_heads=8 --dtype=bfloat16 --causal
  --max_message_mb=2047 --warmup_s=1 --duration_s="$dur" --rpc=stream --concurrency=1 --sessions=8
  --progress=false --json)
for round in $(seq "$rounds"); do
  for server in $servers; do
    target=${server}_target
    for variant in "shm poll --shm" "shm sync --shm" "bytes poll" "shm ring --shm" "bytes ring"; do
      read -r what api flag <<<"$variant"
      keep "step_${server}_${what}_${api}_$round" "$("$bin/attn_bench" --target="${!target}" \
        "${decode[@]}" --stream_api="$api" ${flag:+"$flag"} 2>>"$out/bench.log" | tail -1)"
    done
    if [[ -n $python ]]; then
      # One line per variant, kept by its "rpc".
      while read -r line; do
        [[ $line =~ \"rpc\":\ \"([a-z]+)\" ]] &&
          keep "py_${server}_${BASH_REMATCH[1]}_$round" "$line"
      done < <(PYTHONPATH=$py_path "$python" "$here/py_step_bench.py" --target="${!target}" \
        --nk="$nk" --warmup_s=1 --duration_s="$dur" 2>>"$out/py_step.log")
    fi
    # Four Steps in flight (one stream each, 32 sessions), tensors in the messages: what a
    # transport leaves of the decode kernel's rate.
    for api in poll ring; do
      keep "four_${server}_${api}_$round" "$("$bin/attn_bench" --target="${!target}" \
        "${decode[@]/--concurrency=1/--concurrency=4}" --sessions=32 --stream_api="$api" \
        2>>"$out/bench.log" | tail -1)"
    done
    for rpc in unary stream ring; do
      keep "ipc_${server}_${rpc}_$round" "$("$bin/colo_bench" --target="${!target}" --mode=ipc \
        --shape="$shape" --iters=20 --rpc="$rpc" 2>>"$out/colo.log" | tail -1)"
    done
  done
  for echo in echo echo_ahead; do
    target=${echo}_target
    keep "${echo}_$round" "$("$bin/attn_echo_client" --target="${!target}" --api=poll \
      --q_bytes=64 --kv_bytes=64 --warmup_s=0.3 --duration_s=1 2>>"$out/echo_client.log")"
  done
done

python3 - "$results" "$here" "$rounds" "$delay_us" "$spin_us" "$servers" <<'PY'
import os
import statistics
import sys
sys.path.insert(0, sys.argv[2])
from colo_table import load

r, ok = load(sys.argv[1])
rounds, delay, spin, servers = int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6].split()

def results(name):
    """The rounds' results of run `name` that succeeded, and the first error (or "no result")."""
    runs = [r.get(f"{name}_{i}") for i in range(1, rounds + 1)]
    good = [x for x in runs if isinstance(x, dict) and "error" not in x]
    err = next((x["error"] for x in runs if isinstance(x, dict) and "error" in x), "no result")
    return good, err

fields = ("decode", "queue", "prepare", "run", "total")
names = {"callback": "callback API", "polled": "--poll_streams",
         "lockstep": "--poll_streams --stream_window=1"}
print(f"\n{rounds} rounds, servers with --worker_spin_us={spin}; medians over the rounds (each "
      "round's figure a p50)")
print("\n| StepStream transport | variant | p50 - kernel | kernel | gRPC and client | decode (parse) "
      "| queue | prepare | run (host side) | answer |")
print("|---|---|---|---|---|---|---|---|---|---|")
variants = (("shm", "poll", "tensors by reference, polling client"),
            ("shm", "sync", "tensors by reference, sync client"),
            ("bytes", "poll", "tensors in the messages, polling client"),
            ("shm", "ring", "tensors by reference, request ring"),
            ("bytes", "ring", "tensors in the messages, request ring"))
for server, (what, api, name) in ((s, v) for v in variants for s in servers):
    transport = names[server]
    runs = [ok(f"step_{server}_{what}_{api}_{i}") for i in range(1, rounds + 1)]
    runs = [s for s in runs if s]
    if not runs:
        print(f"| {transport} | {name} | error | | | | | | | |")
        continue
    med = lambda f: statistics.median(f(s) for s in runs)
    k = med(lambda s: s["compute_us_p50"])
    srv = {f: med(lambda s: s["server_p50_us"][f]) for f in fields}
    srv.update({f: med(lambda s: s["server_p50_us"].get(f, 0)) for f in ("h2d", "d2h", "parse")})
    host = srv["run"] - srv["h2d"] - k - srv["d2h"]
    answer = srv["total"] - srv["decode"] - srv["queue"] - srv["prepare"] - srv["run"]
    extras = ", ".join(f"{s['p50'] * 1e6 - s['compute_us_p50']:.0f}" for s in runs)
    print(f"| {transport} | {name} | {med(lambda s: s['p50'] * 1e6 - s['compute_us_p50']):.0f} us "
          f"({extras}) "
          f"| {k:.0f} | {med(lambda s: s['p50'] * 1e6 - s['server_p50_us']['total']):.0f} "
          f"| {srv['decode']:.0f} ({srv['parse']:.0f}) | {srv['queue']:.0f} | {srv['prepare']:.0f} "
          f"| {srv['run']:.0f} ({host:.0f}) | {answer:.0f} |")
py_names = {"unary": "Python client, unary Step", "stream": "Python client, StepStream",
            "ring": "Python client, request ring"}
for server, rpc in ((s, rpc) for rpc in py_names for s in servers):
    name = py_names[rpc] + ", tensors in the messages"
    good, err = results(f"py_{server}_{rpc}")
    if not good:
        logs = os.path.join(os.path.dirname(sys.argv[1]), "py_*.log")
        print(f"| {names[server]} | {name} | error: {err} (see {logs}) | | | | | | | |")
        continue
    med = lambda f: statistics.median(f(x) for x in good)
    each = ", ".join(f"{x['p50_minus_kernel_us']:.0f}" for x in good)
    print(f"| {names[server]} | {name} | {med(lambda x: x['p50_minus_kernel_us']):.0f} us "
          f"({each}) | {med(lambda x: x['compute_us_p50']):.0f} "
          f"| {med(lambda x: x['p50_us'] - x['server_total_us_p50']):.0f} "
          f"| | {med(lambda x: x['queue_us_p50']):.0f} | | | |")
ipc_names = {"unary": "CUDA IPC Attend, unary calls",
             "stream": "CUDA IPC Attend, AttendStream, polling client",
             "ring": "CUDA IPC Attend, request ring"}
for server, rpc in ((s, rpc) for rpc in ipc_names for s in servers):
    transport = names[server]
    name = ipc_names[rpc]
    good, err = results(f"ipc_{server}_{rpc}")
    if not good:
        print(f"| {transport} | {name} | error: {err} | | | | | | | |")
        continue
    med = lambda f: statistics.median(f(x) for x in good)
    over = lambda x: x["p50_ms"] * 1e3 - x["compute_us_p50"]
    each = ", ".join(f"{over(x):.0f}" for x in good)
    k = med(lambda x: x["compute_us_p50"])
    print(f"| {transport} | {name} | {med(over):.0f} us ({each}) | {k:.0f} "
          f"| {med(lambda x: x['p50_ms'] * 1e3 - x['server_total_us_p50']):.0f} "
          f"| | {med(lambda x: x['queue_us_p50']):.0f} | | server total - kernel "
          f"{med(lambda x: x['server_total_us_p50'] - x['compute_us_p50']):.0f} | |")
for server, api in ((s, api) for api in ("poll", "ring") for s in servers):
    runs = [ok(f"four_{server}_{api}_{i}") for i in range(1, rounds + 1)]
    rates = [x["requests_per_s"] for x in runs if x]  # Step calls (8 sessions each) a second
    if rates:
        each = ", ".join(f"{x:.0f}" for x in rates)
        clients = "polling clients" if api == "poll" else "request rings"
        print(f"| {names[server]} | Steps/s with 4 in flight (32 sessions, {clients}) | "
              f"{statistics.median(rates):.0f} ({each}) | | | | | | | |")
for echo, name in (("echo", "next read after the reply"), ("echo_ahead", "next read before it")):
    runs = [ok(f"{echo}_{i}") for i in range(1, rounds + 1)]
    runs = [x["p50_us"] for x in runs if x]
    if runs:
        each = ", ".join(f"{x - float(delay):.0f}" for x in runs)
        print(f"| anchor | bare echo, 64-byte tensors, polling client, reply {delay} us later, "
              f"{name} | {delay} + {statistics.median(runs) - float(delay):.0f} us ({each}) "
              "| | | | | | | |")
PY
