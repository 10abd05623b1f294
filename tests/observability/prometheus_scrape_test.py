#!/usr/bin/env python3
"""The observability stack against a real server: a real Prometheus scrapes a real
attention_server on loopback while attn_client sends a known set of requests; then every PromQL
expression of the Grafana dashboard and of the alerting rules is run through Prometheus's HTTP
API and must return data that agrees with what the client sent.

  prometheus_scrape_test.py --server=BIN --client=BIN --prometheus=BIN --promtool=BIN --deploy=DIR

Checks:
  - `promtool check metrics` reports nothing on a scrape taken while requests run;
  - Prometheus loads deploy/prometheus/rules and evaluates every rule without error;
  - attention_requests_total by (rpc, code), the FLOPs, tokens and payload counts equal what the
    client sent;
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

    def __init__(self, client, target):
        self.client = client
        self.target = target
        self.sent = {}  # (rpc, code) -> requests
        self.round_trip_min = math.inf
        self.round_trip_max = 0.0

    def count(self, rpc, code, n=1):
        self.sent[(rpc, code)] = self.sent.get((rpc, code), 0) + n

    def start_attend(self):
        shape = ",".join(map(str, SHAPE))
        return subprocess.Popen([self.client, f"--target={self.target}", f"--shape={shape}",
                                 f"--repeat={REPEAT}"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish_attend(self, process):
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise Failure(f"attn_client failed ({process.returncode}):\n{output}")
        low, high = parse_round_trips(output)
        self.round_trip_min = min(self.round_trip_min, low)
        self.round_trip_max = max(self.round_trip_max, high)
        self.count("Attend", "OK", REPEAT)

    def invalid(self):
        # 8 query heads over 3 key/value heads: Hq % Hkv != 0, INVALID_ARGUMENT.
        result = subprocess.run([self.client, f"--target={self.target}"] + INVALID_ARGS,
                                capture_output=True, text=True, timeout=60)
        if result.returncode != 1 or "INVALID_ARGUMENT" not in result.stderr:
            raise Failure(f"expected INVALID_ARGUMENT from attn_client:\n{result.stdout}"
                          f"{result.stderr}")
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
    """Latency quantiles and means within the client's range; ratios within [0, 1]."""
    if expr.startswith("histogram_quantile(") and "_seconds_bucket" in expr:
        high = bucket_ceil(load.round_trip_max)
        # Server time is the client's round trip less transport; allow it to be half.
        low = bucket_floor(load.round_trip_min / 2)
        for labels, value in samples:
            if "stage" in labels:  # a part of the request: [0, the whole]
                if not 0 <= value <= high:
                    raise Failure(f"{title}: {expr}: stage {labels['stage']} at {value} s, outside "
                                  f"[0, {high}] (client max {load.round_trip_max} s)")
            elif labels.get("rpc") == "Attend" or "rpc" not in labels:
                if not low <= value <= high:
                    raise Failure(f"{title}: {expr}: {value} s outside [{low}, {high}] (client "
                                  f"round trips {load.round_trip_min}..{load.round_trip_max} s)")
    if "_seconds_sum" in expr:  # mean times: each within [0, the client's longest round trip]
        for labels, value in samples:
            if not 0 <= value <= load.round_trip_max:
                raise Failure(f"{title}: {expr}: mean {value} s outside [0, "
                              f"{load.round_trip_max}] ({labels})")
    if "busy_ratio" in expr or "/ attention_device_memory_total_bytes" in expr:
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
    expected = {
        "attention_flops_total": ok * 4 * h * d * n * n * b,
        "attention_tokens_total": ok * b * n,
        'attention_request_duration_seconds_count{rpc="Attend"}': attend,
        'attention_request_bytes_count{rpc="Attend"}': attend,
        'attention_stage_duration_seconds_count{stage="compute"}': ok,
        "attention_batch_size_count": ok,
    }
    for series, want in expected.items():
        selector = series.replace("}", f',instance="{instance}"}}') if "{" in series else \
            series + sel
        values = prom.query(f"sum({selector})", at)
        if len(values) != 1 or values[0][1] != want:
            raise Failure(f"{series}: Prometheus has {values}, the client sent {want}")
    # Each request carries its q, k and v (float32) and a few hundred bytes of framing.
    tensor_bytes = ok * 3 * (4 * b * h * n * d) + (attend - ok) * INVALID_TENSOR_BYTES
    got_bytes = prom.query(f'sum(attention_request_bytes_sum{{rpc="Attend",instance="{instance}"}})',
                           at)[0][1]
    if not tensor_bytes <= got_bytes <= tensor_bytes + 1024 * attend:
        raise Failure(f"attention_request_bytes_sum {got_bytes}, tensors alone {tensor_bytes}")
    log(f"counts agree: {load.sent}; FLOPs {expected['attention_flops_total']:.4g}")


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
                                       "--backend=cpu", "--workers=2"],
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

            load = Load(args.client, f"127.0.0.1:{grpc_port}")
            load_start = time.time()
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
            load_end = time.time()
            log(f"sent {load.sent} in {rounds} rounds, {load_end - load_start:.1f} s; round trips "
                f"{load.round_trip_min * 1e3:.2f}..{load.round_trip_max * 1e3:.2f} ms")

            # Wait until a scrape after the load has landed, then evaluate just after it.
            total = sum(load.sent.values())
            wait_for("Prometheus to see every request", lambda: prom.query(
                f'sum(attention_requests_total{{instance="{instance}"}}) == {total}', time.time()),
                timeout_s=15)
            at = time.time()
            window_s = math.ceil(at - load_start) + 2 * SCRAPE_INTERVAL_S
            variables = {"__rate_interval": f"{window_s}s", "instance": instance, "device": "cpu"}

            check_counts(prom, load, at, instance)
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
