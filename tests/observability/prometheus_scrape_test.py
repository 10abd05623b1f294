#!/usr/bin/env python3
"""The observability stack against a real server: a real Prometheus scrapes a real
attention_server on loopback while attn_client sends a known set of requests and attn_bench
--mode=decode steps KV-resident sessions; then every PromQL expression of the Grafana dashboard and
of the alerting rules is run through Prometheus's HTTP API and must return data that agrees with
what the clients sent.

  prometheus_scrape_test.py --server=BIN --client=BIN --bench=BIN --prometheus=BIN --promtool=BIN
      --deploy=DIR

Checks:
  - `promtool check metrics` reports nothing on a scrape taken while requests run;
  - Prometheus loads deploy/prometheus/rules and evaluates every rule without error;
  - attention_requests_total by (rpc, code), the FLOPs, tokens and payload counts equal what the
    clients sent;
  - the sessions: decode launches equal the Steps answered, expirations the sessions whose drop
    found them expired; while the load ran all decode sessions were resident, and after it no
    session and no KV page is held;
  - every dashboard and rule expression returns at least one finite value; latency quantiles lie
    within the client-measured round-trip range, widened to the histogram's bucket bounds;
  - the dashboard's template variables (label_values) find this server and its device.

Exit status 0 pass, 1 fail, 77 skip (no prometheus/promtool installed).
"""

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

SKIP = 77

# The request every attn_client call sends: B, H, N, D. FLOPs per request: 4 * H * D * N * N.
SHAPE = (1, 4, 1024, 32)
REPEAT = 6  # requests per attn_client call
# The invalid request: q [1, 8, 64, 64], k and v [1, 3, 64, 64], float32.
INVALID_ARGS = ["--shape=1,8,64,64", "--kv_heads=3"]
INVALID_TENSOR_BYTES = 4 * (8 * 64 * 64 + 2 * 3 * 64 * 64)
LOAD_SECONDS = 6.0  # keep sending rounds at least this long (several scrapes at 1 s)
SCRAPE_INTERVAL_S = 1

# Sessions, beside the Attend rounds: attn_bench --mode=decode holds DECODE_SESSIONS sessions of
# 100 rows for the load's length, stepping 4 of them per Step (each step appends a row) at 40
# Steps/s, then drops them. A second attn_bench steps one session once and waits twice the
# server's --session_ttl_s (its --rate) before dropping it, so the session expires and the drop
# gets NOT_FOUND. The TTL leaves the decode sessions room to be made: all eight are created
# before the first Step, and under ASan on two busy cores that took 2.2 s once (their creation
# waits behind the Attend rounds), so a 2 s TTL expired the first one before its first Step.
SESSION_TTL_S = 5
KV_PAGE_BYTES = 65536
DECODE_SESSIONS = 8
DECODE_ARGS = ["--nk=100", "--shape=4,8,1,64", "--kv_heads=2", "--dtype=float16", "--causal",
               "--concurrency=2", "--rate=40", f"--duration_s={LOAD_SECONDS}"]
EXPIRING_ARGS = ["--nk=16", "--shape=1,2,1,32", "--kv_heads=1", "--dtype=float32",
                 "--concurrency=1", f"--rate={1 / (2 * SESSION_TTL_S)}", "--requests=1"]

# The server's duration buckets (server/metrics.cc): 20 us doubling.
BUCKET_FIRST_S = 20e-6


class Failure(Exception):
    pass


def log(*args):
    print(*args, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def wait_for(what, predicate, timeout_s, interval_s=0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise Failure(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Prometheus:
    def __init__(self, address):
        self.base = f"http://{address}"

    def api(self, path, **params):
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            body = http_get(f"{self.base}/api/v1/{path}?{query}")
        except urllib.error.HTTPError as e:  # 400/422 carry the PromQL error in the body
            body = e.read().decode()
        reply = json.loads(body)
        if reply.get("status") != "success":
            raise Failure(f"/api/v1/{path} {params}: {reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]

    def query(self, expr, at):
        data = self.api("query", query=expr, time=f"{at:.3f}")
        if data["resultType"] != "vector":
            raise Failure(f"{expr}: expected an instant vector, got {data['resultType']}")
        return [(sample["metric"], float(sample["value"][1])) for sample in data["result"]]

    def ready(self):
        try:
            return http_get(f"{self.base}/-/ready", timeout=1.0) is not None
        except (urllib.error.URLError, ConnectionError, OSError):
            return False


# ---------------------------------------------------------------------------------------------
# Expressions from deploy/


def dashboard_targets(dashboard):
    """(panel title, expr) for every query of every panel, rows included."""
    found = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def dashboard_variables(dashboard):
    """(name, query) of the dashboard's query variables."""
    return [(v["name"], v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
            for v in dashboard["templating"]["list"] if v["type"] == "query"]


def rule_exprs(rules_text):
    """(rule name, expr) for each rule of a Prometheus rules file. A minimal reader for the file's
    shape (alert:/record: followed by expr:, plain or a '|' block), standard library only."""
    found = []
    name = None
    lines = rules_text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*-\s*(alert|record):\s*(\S+)", line)
        if m:
            name = m.group(2)
        m = re.match(r"(\s*)expr:\s*(.*)$", line)
        if m:
            indent, rest = len(m.group(1)), m.group(2).strip()
            if rest in ("|", "|-", ">", ">-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or
                                          len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                found.append((name, " ".join(b for b in block if b)))
                continue
            found.append((name, rest))
        i += 1
    return found


def split_threshold(expr):
    """'<quantity> > 0.05' -> ('<quantity>', '> 0.05'); (expr, None) when there is no trailing
    comparison with a number."""
    m = re.match(r"^(.*\S)\s*(==|!=|>=|<=|>|<)\s*([-+]?[0-9.]+(?:[eE][-+]?\d+)?)\s*$", expr, re.S)
    if not m:
        return expr, None
    return m.group(1), f"{m.group(2)} {m.group(3)}"


def substitute(expr, variables):
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    if "$" in expr:
        raise Failure(f"unsubstituted variable in {expr}")
    return expr


# ---------------------------------------------------------------------------------------------
# Load


def parse_round_trips(output):
    """(min, max) seconds of the round trips attn_client printed."""
    m = re.search(r"round trip: ([0-9.]+) ms(?: median, ([0-9.]+) min, [0-9.]+ mean, "
                  r"([0-9.]+) max)?", output)
    if not m:
        raise Failure(f"no round-trip line in attn_client output:\n{output}")
    median = float(m.group(1)) / 1e3
    if m.group(2) is None:
        return median, median
    return float(m.group(2)) / 1e3, float(m.group(3)) / 1e3


def bucket_floor(seconds):
    """The largest duration bucket bound <= seconds (0 below the first)."""
    if seconds < BUCKET_FIRST_S:
        return 0.0
    return BUCKET_FIRST_S * 2 ** math.floor(math.log2(seconds / BUCKET_FIRST_S) + 1e-9)


def bucket_ceil(seconds):
    """The smallest duration bucket bound >= seconds."""
    if seconds <= BUCKET_FIRST_S:
        return BUCKET_FIRST_S
    return BUCKET_FIRST_S * 2 ** math.ceil(math.log2(seconds / BUCKET_FIRST_S) - 1e-9)


class Load:
    """Sends rounds of requests and counts what was sent."""

    def __init__(self, client, bench, target):
        self.client = client
        self.bench = bench
        self.target = target
        self.sent = {}  # (rpc, code) -> requests
        self.round_trips = {}  # rpc -> [min, max] seconds, as the clients measured them
        self.steps_ok = 0  # Step calls answered: one decode launch each (one shape per Step)
        # What the answered Steps computed: query tokens exactly; FLOPs between the bounds their
        # sessions' lengths allow (each Step appends a row to the sessions it steps first).
        self.step_tokens = 0
        self.step_flops = [0, 0]
        self.sessions_expired = 0  # sessions whose drop found them expired

    def count(self, rpc, code, n=1):
        self.sent[(rpc, code)] = self.sent.get((rpc, code), 0) + n

    def round_trip(self, rpc, low, high):
        seen = self.round_trips.setdefault(rpc, [math.inf, 0.0])
        seen[0], seen[1] = min(seen[0], low), max(seen[1], high)

    def round_trip_max(self):
        return max(high for _, high in self.round_trips.values())

    def start_attend(self):
        shape = ",".join(map(str, SHAPE))
        return subprocess.Popen([self.client, f"--target={self.target}", f"--shape={shape}",
                                 f"--repeat={REPEAT}"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish_attend(self, process):
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise Failure(f"attn_client failed ({process.returncode}):\n{output}")
        self.round_trip("Attend", *parse_round_trips(output))
        self.count("GetServerInfo", "OK")  # attn_client reads the FLOP limit first
        self.count("Attend", "OK", REPEAT)

    def start_decode(self, sessions, args):
        process = subprocess.Popen(
            [self.bench, f"--target={self.target}", "--mode=decode", "--progress=false", "--json",
             "--warmup_s=0", f"--sessions={sessions}"] + args,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return process, sessions, args

    def finish_decode(self, started):
        """Counts what an attn_bench --mode=decode run sent: its sessions' CreateSession, its Step
        calls by code (from its JSON line) and its sessions' DropSession (NOT_FOUND: expired)."""
        process, sessions, args = started
        output, errors = process.communicate(timeout=120)
        dropped = re.search(r"dropped (\d+) sessions, (\d+) failed", output)
        if process.returncode != 0 or not dropped:
            raise Failure(f"attn_bench --mode=decode failed ({process.returncode}):\n"
                          f"{output}{errors}")
        result = json.loads(output.strip().splitlines()[-1])
        self.count("CreateSession", "OK", sessions)
        self.count("Step", "OK", result["requests"])
        for code, n in result["errors"].items():
            self.count("Step", code, n)
        expired = int(dropped.group(2))
        self.count("DropSession", "OK", sessions - expired)
        if expired:
            self.count("DropSession", "NOT_FOUND", expired)
        self.sessions_expired += expired
        self.steps_ok += result["requests"]
        flags = dict(a.split("=", 1) for a in args if "=" in a)
        b, h, n, d = map(int, flags["--shape"].split(","))  # entries, Hq, queries, D per Step
        nk, steps = int(flags["--nk"]), result["requests"]
        self.step_tokens += steps * b * n
        # n queries at the end of a causal sequence of `length` keys see n * length - n(n-1)/2.
        per_length = lambda length: steps * b * 4 * h * d * (n * length - n * (n - 1) // 2)
        self.step_flops[0] += per_length(nk + 1)
        self.step_flops[1] += per_length(nk + steps)
        if result["requests"]:  # latencies from the scheduled send time: an upper bound
            self.round_trip("Step", 0.0, result["max"])

    def invalid(self):
        # 8 query heads over 3 key/value heads: Hq % Hkv != 0, INVALID_ARGUMENT.
        result = subprocess.run([self.client, f"--target={self.target}"] + INVALID_ARGS,
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 1 or "INVALID_ARGUMENT" not in result.stderr:
            raise Failure(f"expected INVALID_ARGUMENT from attn_client:\n{result.stdout}"
                          f"{result.stderr}")
        self.count("GetServerInfo", "OK")
        self.count("Attend", "INVALID_ARGUMENT")

    def info(self):
        result = subprocess.run([self.client, f"--target={self.target}", "--info"],
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise Failure(f"attn_client --info failed:\n{result.stdout}{result.stderr}")
        self.count("GetServerInfo", "OK")


# ---------------------------------------------------------------------------------------------
# Checks


def check_metrics_text(promtool, text):
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60)
    report = (result.stdout + result.stderr).strip()
    if result.returncode != 0 or report:
        raise Failure(f"promtool check metrics (rc {result.returncode}):\n{report}")
    log(f"promtool check metrics: clean ({len(text.splitlines())} lines scraped under load)")


def check_value_ranges(title, expr, samples, load):
    """Latency quantiles and means within the clients' ranges; ratios within [0, 1]."""
    if expr.startswith("histogram_quantile(") and "_seconds_bucket" in expr:
        attend_min, attend_max = load.round_trips["Attend"]
        for labels, value in samples:
            # The server's part of a request measured by a client: within [low, the bucket
            # bound at or above the client's longest round trip].
            low, rpc = 0.0, labels.get("rpc", "Attend")
            if "attention_decode_step_duration_seconds" in expr:
                rpc = "Step"  # a decode launch is a part of a Step
            elif "stage" in labels:
                pass  # a stage is a part of an Attend request
            elif rpc == "Attend":
                # Server time is the client's round trip less transport; allow it to be half.
                low = bucket_floor(attend_min / 2)
            if rpc not in load.round_trips:
                continue  # not timed by a client (GetServerInfo, CreateSession, ...)
            high = bucket_ceil(load.round_trips[rpc][1])
            if not low <= value <= high:
                raise Failure(f"{title}: {expr}: {value} s outside [{low}, {high}] for {labels} "
                              f"(client round trips {load.round_trips})")
    if "_seconds_sum" in expr:  # mean times: each within [0, the clients' longest round trip]
        for labels, value in samples:
            if not 0 <= value <= load.round_trip_max():
                raise Failure(f"{title}: {expr}: mean {value} s outside [0, "
                              f"{load.round_trip_max()}] ({labels})")
    if any(ratio in expr for ratio in ("busy_ratio", "/ attention_device_memory_total_bytes",
                                       "/ attention_kv_pages_capacity")):
        for labels, value in samples:
            if not 0 <= value <= 1:
                raise Failure(f"{title}: {expr}: {value} outside [0, 1]")


def run_expressions(prom, exprs, variables, at, load):
    checked = 0
    for title, raw in exprs:
        expr = substitute(raw, variables)
        quantity, threshold = split_threshold(expr) if title.startswith("rule ") else (expr, None)
        samples = prom.query(quantity, at)
        finite = [(labels, v) for labels, v in samples if math.isfinite(v)]
        if not finite:
            raise Failure(f"{title}: no finite value from {quantity} at {at}: {samples}")
        check_value_ranges(title, quantity, finite, load)
        if threshold is not None:
            prom.query(expr, at)  # the alert condition itself must evaluate
        checked += 1
        shown = ", ".join(f"{v:.4g}" for _, v in finite[:4])
        log(f"  ok  {title}: {shown}{' ...' if len(finite) > 4 else ''}")
    return checked


def check_counts(prom, load, at, instance):
    sel = f'{{instance="{instance}"}}'
    got = {(m["rpc"], m["code"]): round(v)
           for m, v in prom.query(f"sum by (rpc, code) (attention_requests_total{sel})", at)}
    if got != load.sent:
        raise Failure(f"attention_requests_total {got} != sent {load.sent}")
    ok = load.sent[("Attend", "OK")]
    attend = ok + load.sent.get(("Attend", "INVALID_ARGUMENT"), 0)
    b, h, n, d = SHAPE
    attend_flops = ok * 4 * h * d * n * n * b
    # Steps take the same path: their tokens, stages and launches count with Attend's; a
    # CreateSession's write into the pool is a job too, with its stages (and no launch).
    creates = load.sent.get(("CreateSession", "OK"), 0)
    expected = {
        "attention_tokens_total": ok * b * n + load.step_tokens,
        'attention_request_duration_seconds_count{rpc="Attend"}': attend,
        'attention_request_bytes_count{rpc="Attend"}': attend,
        'attention_stage_duration_seconds_count{stage="compute"}': ok + load.steps_ok + creates,
        "attention_batch_size_count": ok + load.steps_ok,
    }
    for series, want in expected.items():
        selector = series.replace("}", f',instance="{instance}"}}') if "{" in series else \
            series + sel
        values = prom.query(f"sum({selector})", at)
        if len(values) != 1 or values[0][1] != want:
            raise Failure(f"{series}: Prometheus has {values}, the client sent {want}")
    flops = prom.query(f"sum(attention_flops_total{sel})", at)
    low, high = attend_flops + load.step_flops[0], attend_flops + load.step_flops[1]
    if len(flops) != 1 or not low <= flops[0][1] <= high:
        raise Failure(f"attention_flops_total: Prometheus has {flops}, the client sent Attend "
                      f"{attend_flops} and Steps {load.step_flops[0]}..{load.step_flops[1]}")
    # Each request carries its q, k and v (float32) and a few hundred bytes of framing.
    tensor_bytes = ok * 3 * (4 * b * h * n * d) + (attend - ok) * INVALID_TENSOR_BYTES
    got_bytes = prom.query(f'sum(attention_request_bytes_sum{{rpc="Attend",instance="{instance}"}})',
                           at)[0][1]
    if not tensor_bytes <= got_bytes <= tensor_bytes + 1024 * attend:
        raise Failure(f"attention_request_bytes_sum {got_bytes}, tensors alone {tensor_bytes}")
    log(f"counts agree: {load.sent}; FLOPs {flops[0][1]:.4g} (Attend {attend_flops:.4g})")


def check_sessions(prom, load, at, instance, window_s):
    sel = f'{{instance="{instance}"}}'

    def value(expr):
        values = prom.query(expr, at)
        if len(values) != 1:
            raise Failure(f"{expr}: expected one value, Prometheus has {values}")
        return values[0][1]

    expected = {
        # Each Step carried sessions of one shape: one decode launch.
        f"sum(attention_decode_step_duration_seconds_count{sel})": load.steps_ok,
        f"sum(attention_session_expirations_total{sel})": load.sessions_expired,
        # Every session was dropped or expired: none is held, and every page is free again.
        f"sum(attention_sessions_resident{sel})": 0,
        f"sum(attention_session_resident_bytes{sel})": 0,
        f"sum(attention_kv_pages_capacity{sel}) - sum(attention_kv_pages_free{sel})": 0,
    }
    for expr, want in expected.items():
        if value(expr) != want:
            raise Failure(f"{expr}: Prometheus has {value(expr)}, expected {want}")
    # While the load ran: the decode sessions (and, early on, the expiring one), each holding at
    # least one page.
    most = value(f"max_over_time(attention_sessions_resident{sel}[{window_s}s])")
    if not DECODE_SESSIONS <= most <= DECODE_SESSIONS + 1:
        raise Failure(f"at most {most} sessions resident during the load, expected "
                      f"{DECODE_SESSIONS} or {DECODE_SESSIONS + 1}")
    most_bytes = value(f"max_over_time(attention_session_resident_bytes{sel}[{window_s}s])")
    if most_bytes < DECODE_SESSIONS * KV_PAGE_BYTES or most_bytes % KV_PAGE_BYTES:
        raise Failure(f"at most {most_bytes} bytes resident, not whole pages of {KV_PAGE_BYTES} "
                      f"for {DECODE_SESSIONS} sessions")
    log(f"sessions agree: {load.steps_ok} decode launches, {load.sessions_expired} expired, "
        f"at most {most:.0f} resident ({most_bytes / 2**20:.2f} MiB), none left")


def check_rules_loaded(prom):
    def all_evaluated():
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] == "ok" for r in rules) else None

    try:
        rules = wait_for("every rule evaluated", all_evaluated, timeout_s=10)
    except Failure:
        bad = [(r["name"], r["health"], r.get("lastError"))
               for g in prom.api("rules")["groups"] for r in g["rules"] if r["health"] != "ok"]
        raise Failure(f"rules not healthy: {bad}")
    log(f"Prometheus evaluates all {len(rules)} rules without error")


def check_variables(prom, dashboard, variables, start, end):
    for name, query in dashboard_variables(dashboard):
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        if not m:
            raise Failure(f"variable {name}: unsupported query {query}")
        selector, label = substitute(m.group(1), variables), m.group(2)
        values = prom.api(f"label/{label}/values", **{"match[]": selector, "start": f"{start:.3f}",
                                                      "end": f"{end:.3f}"})
        if variables[name] not in values:
            raise Failure(f"variable {name}: {query} gives {values}, not {variables[name]}")
        log(f"  ok  variable {name}: {values}")


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--bench", required=True)
    parser.add_argument("--prometheus", default="")
    parser.add_argument("--promtool", default="")
    parser.add_argument("--deploy", required=True)
    args = parser.parse_args()
    for tool in ("prometheus", "promtool"):
        if not getattr(args, tool) or not os.access(getattr(args, tool), os.X_OK):
            log(f"SKIP: {tool} not installed (scripts/install_deps.sh installs Debian's prometheus)")
            return SKIP

    dashboard = json.load(open(os.path.join(args.deploy, "grafana/dashboards/attention.json")))
    rules_dir = os.path.join(args.deploy, "prometheus/rules")
    exprs = [(f"panel '{t}'", e) for t, e in dashboard_targets(dashboard)]
    for name in sorted(os.listdir(rules_dir)):
        if name.endswith((".yml", ".yaml")):
            exprs += [(f"rule {r}", e) for r, e in rule_exprs(open(os.path.join(rules_dir, name)).read())]
    log(f"{len(exprs)} expressions from the dashboard and the rules")

    processes = []
    with tempfile.TemporaryDirectory(prefix="attention-observability-") as tmp:
        try:
            port_file = os.path.join(tmp, "ports")
            server = subprocess.Popen([args.server, "--host=127.0.0.1", "--port=0",
                                       "--metrics_port=0", f"--port_file={port_file}",
                                       "--backend=cpu", "--workers=2",
                                       f"--session_ttl_s={SESSION_TTL_S}",
                                       f"--kv_page_bytes={KV_PAGE_BYTES}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(server)

            def ports():
                if server.poll() is not None:
                    raise Failure(f"attention_server exited with {server.returncode}")
                try:
                    return tuple(map(int, open(port_file).read().split()))
                except (OSError, ValueError):
                    return None

            grpc_port, metrics_port = wait_for("the server's port file", ports, timeout_s=30)
            instance = f"127.0.0.1:{metrics_port}"

            prom_address = f"127.0.0.1:{free_port()}"
            config = os.path.join(tmp, "prometheus.yml")
            with open(config, "w") as f:
                f.write(f"""global:
  scrape_interval: {SCRAPE_INTERVAL_S}s
  evaluation_interval: 1s
rule_files:
  - {rules_dir}/*.yml
scrape_configs:
  - job_name: attention
    static_configs:
      - targets: ["{instance}"]
""")
            prom_process = subprocess.Popen(
                [args.prometheus, f"--config.file={config}",
                 f"--storage.tsdb.path={os.path.join(tmp, 'data')}",
                 f"--web.listen-address={prom_address}", "--log.level=error"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "prometheus.log"), "w"))
            processes.append(prom_process)
            prom = Prometheus(prom_address)
            wait_for("Prometheus to be ready",
                     lambda: prom_process.poll() is None and prom.ready(), timeout_s=30)
            wait_for("the first scrape", lambda: prom.query(
                f'up{{instance="{instance}"}} == 1', time.time()), timeout_s=15)

            load = Load(args.client, args.bench, f"127.0.0.1:{grpc_port}")
            load_start = time.time()
            decoders = [load.start_decode(DECODE_SESSIONS, DECODE_ARGS),
                        load.start_decode(1, EXPIRING_ARGS)]
            rounds = 0
            while rounds < 2 or time.time() - load_start < LOAD_SECONDS:
                clients = [load.start_attend(), load.start_attend()]
                if rounds == 1:  # a scrape while two clients run
                    check_metrics_text(args.promtool, http_get(f"http://{instance}/metrics"))
                if rounds % 2 == 0:
                    load.invalid()
                load.info()
                for c in clients:
                    load.finish_attend(c)
                rounds += 1
            for d in decoders:
                load.finish_decode(d)
            load_end = time.time()
            # (attn_bench reports no shortest Step: 0 stands for it.)
            trips = ", ".join(f"{rpc} {low * 1e3:.2f}..{high * 1e3:.2f} ms"
                              for rpc, (low, high) in load.round_trips.items())
            log(f"sent {load.sent} in {rounds} rounds, {load_end - load_start:.1f} s; round trips "
                f"{trips}")

            # Wait until a scrape after the load has landed, then evaluate just after it.
            total = sum(load.sent.values())
            wait_for("Prometheus to see every request", lambda: prom.query(
                f'sum(attention_requests_total{{instance="{instance}"}}) == {total}', time.time()),
                timeout_s=15)
            at = time.time()
            window_s = math.ceil(at - load_start) + 2 * SCRAPE_INTERVAL_S
            variables = {"__rate_interval": f"{window_s}s", "instance": instance, "device": "cpu"}

            check_counts(prom, load, at, instance)
            check_sessions(prom, load, at, instance, window_s)
            check_rules_loaded(prom)
            check_variables(prom, dashboard, variables, load_start, at)
            checked = run_expressions(prom, exprs, variables, at, load)
            log(f"PASS: {checked} expressions return data that agrees with the client")
            return 0
        except Failure as e:
            log(f"FAIL: {e}")
            prom_log = os.path.join(tmp, "prometheus.log")
            if os.path.exists(prom_log):
                log("prometheus log:\n" + open(prom_log).read()[-4000:])
            return 1
        finally:
            for p in reversed(processes):
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()


if __name__ == "__main__":
    sys.exit(main())
