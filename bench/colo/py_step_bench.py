"""One-in-flight Steps from the Python client (client/python): --sessions sessions of --nk rows
(bf16, Hq 32, Hkv 8, D 128, or --heads and --head_dim), one query each per Step, causal, each
Step appending its token: the shape of attn_bench --mode=decode --shape=8,32,1,128 --nk=32768
--kv_heads=8. The tensors travel in the messages: the Python client's Steps take none by
reference.

    PYTHONPATH=client/python:build/tests/python/gen python3 bench/colo/py_step_bench.py \
        --target=127.0.0.1:50051 [--nk=32768] [--warmup_s=1] [--duration_s=2]

For each of unary Step, StepStream (stream=True) and the request ring (stream="ring": needs a
server with --allow_shared_memory) prints one JSON line: end-to-end p50/p90 us, the server's
compute (kernel) and total p50, p50 - kernel, and the sessions' rows before and after; a variant
that fails prints {"rpc": ..., "error": ...} and the next goes on.

--layers=L instead steps a model's layer calls as bench/torch/decode_bench.py's packed attentions
send them: --sessions sessions of L layers each (Client.session(layers=L)), and each Step one
packed Step (Client.step_batch) over all of them for one layer, layer by layer, appending one row
to each. Its JSON lines add the server's stages' p50s (decode_us: arrival to queued, parse and
the sessions' look-ups included; prepare_us: the leases, the append and the launch plan; run_us:
the executor's run, compute_us its kernel; answer_us: total_us less the others, the hand-offs
and the work after the run up to the answer: leases released, metrics). With --nk small, few
heads and the CPU backend the kernel is small and the rest is the server's host path (a
development machine's figures: compare servers in alternating runs of the same command):

    build/server/attention_server --backend=cpu --threads=1 --kv_cache_bytes=4294967296 &
    PYTHONPATH=client/python:build/tests/python/gen python3 bench/colo/py_step_bench.py \
        --layers=4 --nk=16 --heads=4,1 --head_dim=16 --sessions=64 --variants=unary --duration_s=5
"""
import argparse
import json
import time

import numpy as np

from attention_client import AttentionError, Client, float32_to_bfloat16_bits
from attention_client.session import step_many

VARIANTS = (("unary", False), ("stream", True), ("ring", "ring"))


def percentile(values, p):
    return float(np.percentile(values, p))


def timed(step, more, warmup_s, duration_s):
    """Calls step(i) (i = 0, 1, ...; it returns the call's ServerTiming) one at a time while
    more(i): for warmup_s, then duration_s timed. (e2e us, ServerTiming) of the timed calls."""
    e2e, timings = [], []
    start = time.monotonic()
    end_warmup, end = start + warmup_s, start + warmup_s + duration_s
    call = 0
    while more(call):
        t0 = time.perf_counter_ns()
        timing = step(call)
        t1 = time.perf_counter_ns()
        now = time.monotonic()
        if now >= end:
            break
        if now >= end_warmup:
            e2e.append((t1 - t0) / 1e3)
            timings.append(timing)
        call += 1
    return e2e, timings


def run(client, sessions, stream, warmup_s, duration_s, room_rows, rng, heads, d):
    """Steps one at a time for warmup_s, then duration_s timed, or until the sessions have grown
    by room_rows (the pool's room): (e2e us, ServerTiming) of the timed ones."""
    q, k, v = (float32_to_bfloat16_bits(rng.standard_normal((h, 1, d), dtype=np.float32))
               for h in (heads[0], heads[1], heads[1]))
    items = [(s, q, k, v) for s in sessions]
    first = sessions[0].length
    return timed(lambda _: step_many(client, items, causal=True, return_info=True,
                                     stream=stream)[0].timing,
                 lambda _: sessions[0].length - first < room_rows, warmup_s, duration_s)


def run_packed(client, sessions, layers, stream, warmup_s, duration_s, room_rows, rng, heads,
               d):
    """As run, but each Step is one packed Step over `sessions` for one layer (decode_bench's
    packed layer call), layers in turn; stops when every layer has grown by room_rows."""
    batch = len(sessions)
    q, k, v = (float32_to_bfloat16_bits(rng.standard_normal((batch, h, 1, d), dtype=np.float32))
               for h in (heads[0], heads[1], heads[1]))
    return timed(lambda call: client.step_batch(sessions, q, k, v, causal=True,
                                                layer=call % layers, return_info=True,
                                                stream=stream).timing,
                 lambda call: call < room_rows * layers, warmup_s, duration_s)


def stages(timings):
    """The p50s of the server's stages (the file comment) over `timings`."""
    p50 = {name: percentile([getattr(t, name) for t in timings], 50)
           for name in ("decode_us", "parse_us", "prepare_us", "run_us", "compute_us",
                        "queue_us", "total_us")}
    answers = [t.total_us - t.decode_us - t.queue_us - t.prepare_us - t.run_us for t in timings]
    return {f"server_{name}_p50": value for name, value in p50.items()} | {
        "server_answer_us_p50": percentile(answers, 50)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--sessions", type=int, default=8, help="sessions per Step")
    ap.add_argument("--nk", type=int, default=32768, help="each session's first rows")
    ap.add_argument("--heads", default="32,8", help="Hq,Hkv (fewer: a cheaper CPU kernel)")
    ap.add_argument("--head_dim", type=int, default=128, help="D (smaller: a cheaper CPU kernel)")
    ap.add_argument("--layers", type=int, default=0,
                    help="> 0: sessions of this many layers, packed Steps layer by layer")
    ap.add_argument("--warmup_s", type=float, default=1.0)
    ap.add_argument("--duration_s", type=float, default=2.0)
    ap.add_argument("--variants", default="unary,stream,ring",
                    help="comma-separated: unary, stream, ring")
    a = ap.parse_args()
    a.heads = [int(h) for h in a.heads.split(",")]
    hkv = a.heads[1]
    chosen = a.variants.split(",")
    unknown = set(chosen) - {name for name, _ in VARIANTS}
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}")

    rng = np.random.default_rng(1)
    # Every session starts from the same rows (as attn_bench's): values do not change the time.
    k0, v0 = (float32_to_bfloat16_bits(
        rng.standard_normal((hkv, a.nk, a.head_dim), dtype=np.float32)) for _ in range(2))
    with Client(a.target) as client:
        sessions = []
        try:
            layers = max(a.layers, 1)
            for _ in range(a.sessions):
                if a.layers == 0:
                    sessions.append(client.session(dtype="bfloat16", k=k0, v=v0,
                                                   bfloat16_bits=True))
                    continue
                sessions.append(client.session(dtype="bfloat16", kv_heads=hkv, head_dim=a.head_dim,
                                               layers=a.layers, bfloat16_bits=True))
                for layer in range(a.layers):
                    sessions[-1].append(k0, v0, layer=layer)
            # Appended rows stop at what the pool has left, less a page per session (and layer)
            # for the pages the sessions have partly filled.
            pool = client.list_sessions()
            row_bytes = 2 * hkv * a.head_dim * 2  # one row of K and V, bf16
            room_bytes = (pool.pages_free - a.sessions * layers) * pool.page_bytes
            room_rows = max(0, room_bytes // (a.sessions * layers * row_bytes)) // len(chosen)
            for name, stream in VARIANTS:
                if name not in chosen:
                    continue
                rows = sessions[0].length
                try:
                    if a.layers > 0:
                        e2e, timings = run_packed(client, sessions, a.layers, stream, a.warmup_s,
                                                  a.duration_s, room_rows, rng, a.heads, a.head_dim)
                    else:
                        e2e, timings = run(client, sessions, stream, a.warmup_s, a.duration_s,
                                           room_rows, rng, a.heads, a.head_dim)
                except (AttentionError, NotImplementedError) as e:
                    print(json.dumps({"rpc": name, "error": str(e)}), flush=True)
                    continue
                if not e2e:
                    print(json.dumps({"rpc": name, "error": f"no timed Step: the KV pool had "
                                      f"room for {room_rows} more rows per session"}), flush=True)
                    continue
                kernel = percentile([t.compute_us for t in timings], 50)
                p50 = percentile(e2e, 50)
                print(json.dumps({
                    "rpc": name, "sessions": a.sessions, "steps": len(e2e),
                    "rows": [rows, sessions[0].length],
                    "p50_us": p50, "p90_us": percentile(e2e, 90),
                    "compute_us_p50": kernel,
                    "server_total_us_p50": percentile([t.total_us for t in timings], 50),
                    "queue_us_p50": percentile([t.queue_us for t in timings], 50),
                    "p50_minus_kernel_us": p50 - kernel}
                    | (stages(timings) if a.layers > 0 else {})), flush=True)
        finally:
            for s in sessions:
                s.drop()


if __name__ == "__main__":
    main()
