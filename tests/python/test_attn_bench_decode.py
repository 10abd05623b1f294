"""attn_bench --mode=decode against the real attention_server: a short run creates its sessions,
steps them (several per Step call) without errors, drops them, and prints as its last line one JSON
object with the keys of the attend mode (p50, p99 in seconds, requests_per_s) plus steps_per_s
and tokens_per_s.

Run by ctest (label "python"), which sets ATTENTION_SERVER_BINARY and ATTN_BENCH_BINARY. Needs only
the standard library.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import unittest

from test_attn_bench import start


class AttnBenchDecodeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="attn_bench_decode_test_")
        cls.server, cls.port = start(
            [os.environ["ATTENTION_SERVER_BINARY"], "--backend=cpu", "--host=127.0.0.1",
             "--port=0", "--metrics_port=0", "--allow_shared_memory",
             f"--port_file={cls.dir}/server"], f"{cls.dir}/server")

    @classmethod
    def tearDownClass(cls):
        cls.server.send_signal(signal.SIGTERM)
        cls.server.wait(timeout=60)
        shutil.rmtree(cls.dir, ignore_errors=True)

    def bench(self, *flags):
        out = subprocess.run(
            [os.environ["ATTN_BENCH_BINARY"], f"--target=127.0.0.1:{self.port}", "--mode=decode",
             "--progress=false", "--json", "--warmup_s=0.2", *flags],
            capture_output=True, text=True, timeout=120, check=True).stdout
        return out, json.loads(out.strip().splitlines()[-1])

    def test_decode_steps_and_drops_its_sessions(self):
        # 6 sessions of 200 rows, 3 per Step (sessions per Step, query heads, tokens, D), 2 in
        # flight.
        out, r = self.bench("--sessions=6", "--nk=200", "--shape=3,8,1,64", "--kv_heads=2",
                            "--dtype=float16", "--causal", "--concurrency=2", "--requests=30")
        self.assertEqual(r["errors"], {})
        self.assertEqual(r["requests"], 30)
        for key in ("requests_per_s", "steps_per_s", "tokens_per_s", "payload_gb_per_s",
                    "tflop_per_s", "p50", "p90", "p99", "p999", "max"):
            self.assertGreater(r[key], 0, key)
        self.assertAlmostEqual(r["steps_per_s"], 3 * r["requests_per_s"], delta=1e-3 * r["steps_per_s"])
        self.assertAlmostEqual(r["tokens_per_s"], r["steps_per_s"], delta=1e-3 * r["steps_per_s"])
        self.assertLessEqual(r["p50"], r["p99"])
        self.assertLessEqual(r["p99"], r["max"])
        self.assertIn("created 6 sessions of 200 rows", out)
        self.assertIn("dropped 6 sessions, 0 failed", out)

    def test_decode_steps_over_step_streams(self):
        # ring: each slot's Steps through a request ring of its own (SharedMemory.OpenRing).
        for api in ("callback", "sync", "poll", "ring"):
            out, r = self.bench("--sessions=4", "--nk=100", "--shape=2,4,1,32", "--kv_heads=2",
                                "--dtype=bfloat16", "--causal", "--rpc=stream", "--concurrency=2",
                                f"--stream_api={api}", "--requests=30")
            self.assertEqual(r["errors"], {})
            self.assertEqual(r["requests"], 30)
            self.assertEqual(r["config"]["rpc"], "stream")
            self.assertEqual(r["config"]["stream_api"], api)
            self.assertGreater(r["compute_us_p50"], 0)
            # The worker's part of each Step: its leases and append, then the device run.
            self.assertGreater(r["server_p50_us"]["prepare"], 0)
            self.assertGreaterEqual(r["server_p50_us"]["run"], r["compute_us_p50"])
            # The parse, a part of the decode before the queue.
            self.assertGreater(r["server_p50_us"]["parse"], 0)
            self.assertLessEqual(r["server_p50_us"]["parse"], r["server_p50_us"]["decode"])
            self.assertIn("dropped 4 sessions, 0 failed", out)

    def test_extend_steps_without_append(self):
        out, r = self.bench("--sessions=2", "--nk=64", "--shape=1,4,4,32", "--append_kv=false",
                            "--dtype=float32", "--concurrency=2", "--duration_s=0.5", "--lse")
        self.assertEqual(r["errors"], {})
        self.assertGreater(r["requests"], 0)
        self.assertAlmostEqual(r["tokens_per_s"], 4 * r["steps_per_s"], delta=1e-3 * r["tokens_per_s"])

    def test_too_few_sessions_is_a_flag_error(self):
        p = subprocess.run(
            [os.environ["ATTN_BENCH_BINARY"], f"--target=127.0.0.1:{self.port}", "--mode=decode",
             "--sessions=3", "--shape=2,4,1,64", "--concurrency=2", "--requests=1"],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)


if __name__ == "__main__":
    unittest.main()
