"""attn_bench against the real attention_server and attn_echo_server: a short run in each RPC
mode must finish without errors and print, as its last line, one JSON object with the keys
dashboards read (p50, p99 in seconds, requests_per_s), for both phases. Also a target listing two
addresses (round-robin), the open-loop --rate mode, and the echo server's delayed and polled EchoStreams.

Run by ctest (label "python"), which sets ATTENTION_SERVER_BINARY, ATTN_BENCH_BINARY and
ATTN_ECHO_SERVER_BINARY. Needs only the standard library.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest


def start(args, port_file):
    """Starts a server writing its port to port_file; returns (process, port)."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{args[0]} did not start")
        time.sleep(0.05)
    return proc, int(open(port_file).read().split()[0])


class AttnBenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_bench_test_")
        cls.server, cls.port = start(
            [os.environ["ATTENTION_SERVER_BINARY"], "--backend=cpu", "--host=127.0.0.1",
             "--port=0", "--metrics_port=0", f"--port_file={cls.dir}/server",
             "--allow_shared_memory"], f"{cls.dir}/server")
        cls.echo, cls.echo_port = start(
            [os.environ["ATTN_ECHO_SERVER_BINARY"], "--port=0", f"--port_file={cls.dir}/echo"],
            f"{cls.dir}/echo")

    @classmethod
    def tearDownClass(cls):
        for proc in (cls.server, cls.echo):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        shutil.rmtree(cls.dir, ignore_errors=True)

    def bench(self, *flags, returncode=0):
        p = subprocess.run(
            [os.environ["ATTN_BENCH_BINARY"], "--progress=false", "--json", "--warmup_s=0.2",
             "--shape=1,4,64,64", *flags],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, returncode, p.stderr)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def check_phase(self, result, requests):
        self.assertEqual(result["errors"], {})
        self.assertEqual(result["requests"], requests)
        for key in ("requests_per_s", "payload_gb_per_s", "tflop_per_s", "p50", "p99", "max"):
            self.assertGreater(result[key], 0, key)
        self.assertLessEqual(result["p50"], result["p99"])
        self.assertLessEqual(result["p99"], result["max"])

    def test_unary_and_stream_with_echo(self):
        for rpc, api in (("unary", "callback"), ("stream", "callback"), ("stream", "sync"),
                         ("stream", "poll")):
            r = self.bench(f"--target=127.0.0.1:{self.port}",
                           f"--echo_target=127.0.0.1:{self.echo_port}", f"--rpc={rpc}",
                           f"--stream_api={api}", "--concurrency=4", "--requests=40")
            self.check_phase(r, 40)
            self.check_phase(r["echo"], 40)
            self.assertGreater(r["payload_ratio_vs_echo"], 0)
            self.assertGreater(r["compute_us_p50"], 0)

    def test_echo_server_modes(self):
        # attn_echo_server replying 50 us late with read-ahead (4 streams: a next request can
        # arrive before the last reply's write has completed), on the callback API and with
        # --poll (EchoStream on the async API, its queue polled by one thread; unary Echo on the
        # callback API in the same server), and --poll bare.
        for name, flags in (("callback_delay", ("--reply_delay_us=50", "--read_ahead")),
                            ("polled", ("--poll",)),
                            ("polled_delay", ("--poll", "--reply_delay_us=50", "--read_ahead"))):
            echo, port = start(
                [os.environ["ATTN_ECHO_SERVER_BINARY"], "--port=0",
                 f"--port_file={self.dir}/{name}", *flags], f"{self.dir}/{name}")
            try:
                for rpc in ("unary", "stream"):
                    r = self.bench(f"--target=127.0.0.1:{self.port}",
                                   f"--echo_target=127.0.0.1:{port}", f"--rpc={rpc}",
                                   "--concurrency=4", "--requests=40")
                    self.check_phase(r["echo"], 40)
            finally:
                echo.send_signal(signal.SIGTERM)
                self.assertEqual(echo.wait(timeout=60), 0, name)

    def test_tensors_in_shared_memory(self):
        for rpc in ("unary", "stream"):
            r = self.bench(f"--target=127.0.0.1:{self.port}", "--shm", f"--rpc={rpc}",
                           "--concurrency=2", "--requests=20")
            self.check_phase(r, 20)

    def test_decode_steps_in_shared_memory(self):
        # StepStream and unary Steps whose entries refer to q, the new K/V rows and o in a region.
        for rpc in ("unary", "stream"):
            r = self.bench(f"--target=127.0.0.1:{self.port}", "--mode=decode", "--shm",
                           f"--rpc={rpc}", "--shape=2,4,1,64", "--nk=64", "--kv_heads=2",
                           "--causal", "--concurrency=2", "--requests=20")
            self.check_phase(r, 20)

    def test_round_robin_targets_and_rate(self):
        r = self.bench(f"--target=127.0.0.1:{self.port},localhost:{self.port}", "--rate=100",
                       "--concurrency=4", "--duration_s=0.5")
        self.assertEqual(r["errors"], {})
        self.assertGreater(r["requests"], 20)

    def test_errors_are_counted_by_code(self):
        # Hq % Hkv != 0: every call fails with INVALID_ARGUMENT, and the run exits 1.
        r = self.bench(f"--target=127.0.0.1:{self.port}", "--kv_heads=3", "--requests=5",
                       returncode=1)
        self.assertEqual(r["errors"], {"INVALID_ARGUMENT": 5})


if __name__ == "__main__":
    unittest.main()
