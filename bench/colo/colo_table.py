"""Pieces of the co-located benches' tables (bench/colo/run.sh, latency.sh and step_rounds.sh)."""
import json

# attention_device_busy_ratio covers at least this many seconds (kBusyWindow,
# server/metrics/metrics.h).
BUSY_WINDOW_S = 10


def load(path):
    """The results kept by lib.sh's `keep` (one JSON line each), by run name, and `ok(name)`: a
    run's result when it is one that succeeded (a JSON object without "error"), else None."""
    r = {}
    for line in open(path):
        d = json.loads(line)
        r[d["run"]] = d["result"]

    def ok(name):
        x = r.get(name)
        return x if isinstance(x, dict) and "error" not in x else None

    return r, ok


def breakdown(s):
    """Where a Step's p50 goes, from one attn_bench JSON result: the client's side and gRPC (its
    p50 less the server's total), then the server's ServerTiming p50s (each field's own p50, so
    the parts add up only roughly)."""
    srv, k = s["server_p50_us"], s["compute_us_p50"]
    gpu = srv["h2d"] + k + srv["d2h"]
    run = srv.get("run", 0) or gpu
    rest = srv["total"] - srv.get("decode", 0) - srv["queue"] - srv.get("prepare", 0) - run
    return (f"gRPC and client {s['p50'] * 1e6 - srv['total']:.0f}; server {srv['total']:.0f} ="
            f" decode {srv.get('decode', 0):.0f} (parse {srv.get('parse', 0):.0f}) + queue and hop {srv['queue']:.0f} + prepare "
            f"(leases, K/V append, plan) {srv.get('prepare', 0):.0f} + run {run:.0f} (q in "
            f"{srv['h2d']:.0f}, kernel {k:.0f}, out {srv['d2h']:.0f}, host side {run - gpu:.0f})"
            f" + answer {rest:.0f}")


def kernel_rate(many, alone):
    """The share of the kernel's own rate that several clients at once kept, from colo_bench
    results: their requests/s x the kernel's time alone (compute_us p50 of one client's run)."""
    return many["requests_per_s"] * alone["compute_us_p50"] * 1e-6


def busy_note(run):
    """What a busy ratio scraped right after colo_bench's `run` takes in beyond its calls: "" when
    they lasted past the ratio's window (and a second of busy_poll's period)."""
    if run["wall_s"] >= BUSY_WINDOW_S + 1:
        return ""
    return (f" (takes in more than the calls: they took {run['wall_s']:.1f} s, the ratio covers "
            f"at least {BUSY_WINDOW_S} s)")
