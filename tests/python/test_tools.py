"""The command-line tools fail loudly: attention_server, attn_echo_server, attn_client and
attn_bench, run as real binaries.

- --help lists each tool's own flags with their usage lines, by their path in the source tree
  (never the build machine's).
- Bad flags and bad values exit 2 with the reason (client/README.md), from one --shape parser.
- attn_bench: failed calls exit 1 and print their messages, a dead target is backed off, p95,
  --csv, a --concurrency sweep, the configuration in the JSON, an ETA in the progress lines.
- attn_client: .npy inputs give the shape and dtype, a request over --max_message_mb is refused
  before it is built, --check says it computes the reference and on how many threads, and checks
  float8_e4m3 (with descales) against the reference on the dequantised inputs.

Run by ctest (label "python"), which sets ATTENTION_SERVER_BINARY, ATTN_ECHO_SERVER_BINARY,
ATTN_CLIENT_BINARY and ATTN_BENCH_BINARY. Needs only the standard library.
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

from test_attn_bench import start

BINARIES = {
    "attention_server": os.environ.get("ATTENTION_SERVER_BINARY"),
    "attn_echo_server": os.environ.get("ATTN_ECHO_SERVER_BINARY"),
    "attn_client": os.environ.get("ATTN_CLIENT_BINARY"),
    "attn_bench": os.environ.get("ATTN_BENCH_BINARY"),
}


def run(tool, *args, timeout=60):
    return subprocess.run([BINARIES[tool], *args], capture_output=True, text=True,
                          timeout=timeout)


class HelpTest(unittest.TestCase):
    # A flag of each tool and a piece of its usage line.
    CASES = {
        "attention_server": ("--max_queue", "--backend"),
        "attn_echo_server": ("--port_file", "Port; 0 picks a free one."),
        "attn_client": ("--check", "compare with the float64 reference"),
        "attn_bench": ("--concurrency", "requests in flight at most"),
    }

    def test_help_lists_own_flags_without_build_paths(self):
        for tool, (flag, usage) in self.CASES.items():
            with self.subTest(tool=tool):
                p = run(tool, "--help")
                text = p.stdout + p.stderr
                self.assertNotIn("No flags matched", text)
                self.assertIn(flag + " (", text)
                self.assertIn(usage, text)
                # Flags are listed under their source file, relative to the source tree.
                self.assertRegex(text, r"Flags from (server|client|bench)/[\w/]+\.cc:")
                self.assertIsNone(re.search(r"Flags from /|/work/|/home/|/build/", text), text)


class BadFlagsTest(unittest.TestCase):
    def test_bad_shapes_exit_2_with_the_reason(self):
        for tool in ("attn_client", "attn_bench"):
            for shape, reason in (("1,-8,64,64", "'-8' is not a positive integer"),
                                  ("1,8,0,64", "'0' is not a positive integer"),
                                  ("1,8,x,64", "'x' is not a positive integer"),
                                  ("1,8,1.5,64", "'1.5' is not a positive integer"),
                                  ("1,8,64", "got 3 values")):
                with self.subTest(tool=tool, shape=shape):
                    # No server at the target: the shape must be refused before any call.
                    p = run(tool, f"--shape={shape}", "--target=127.0.0.1:1", "--progress=false"
                            if tool == "attn_bench" else "--repeat=1")
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(reason, p.stderr)
                    self.assertNotIn("terminate called", p.stderr)

    def test_unknown_flags_and_bad_values_exit_2(self):
        for tool in ("attn_client", "attn_bench"):
            for args, reason in ((["--no_such_flag=1"], "unknown flag --no_such_flag"),
                                 (["--kv_heads=-2"], "--kv_heads and --nk must be positive"),
                                 (["--deadline_ms=soon" if tool == "attn_client"
                                   else "--rate=fast"], "Illegal value")):
                with self.subTest(tool=tool, args=args):
                    p = run(tool, "--target=127.0.0.1:1", *args)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(reason, p.stderr)


class ServerTest(unittest.TestCase):
    """Tests against one real attention_server (CPU backend)."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="tools_test_")
        cls.server, port = start(
            [BINARIES["attention_server"], "--backend=cpu", "--host=127.0.0.1", "--port=0",
             "--metrics_port=0", f"--port_file={cls.dir}/server"], f"{cls.dir}/server")
        cls.target = f"--target=127.0.0.1:{port}"

    @classmethod
    def tearDownClass(cls):
        cls.server.send_signal(signal.SIGTERM)
        cls.server.wait(timeout=60)
        shutil.rmtree(cls.dir, ignore_errors=True)


class BenchTest(ServerTest):
    def bench(self, *flags):
        return run("attn_bench", "--progress=false", "--warmup_s=0.1", "--shape=1,2,16,32",
                   *flags, timeout=120)

    def test_dead_target_fails_loudly_and_backs_off(self):
        start_time = time.monotonic()
        p = self.bench("--target=127.0.0.1:1", "--concurrency=4", "--duration_s=2", "--json")
        self.assertLess(time.monotonic() - start_time, 10)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("call failed: UNAVAILABLE:", p.stderr)
        errors = json.loads(p.stdout.strip().splitlines()[-1])["errors"]
        # Backing off per slot from 10 ms to 1 s: a few tries each, not thousands.
        self.assertGreater(errors["UNAVAILABLE"], 0)
        self.assertLess(errors["UNAVAILABLE"], 100)

    def test_rejected_calls_exit_1_with_the_message(self):
        p = self.bench(self.target, "--shape=1,2,16,300", "--requests=5", "--json")
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertRegex(p.stderr, r"call failed: INVALID_ARGUMENT: .*\S")
        self.assertEqual(p.stderr.count("call failed: INVALID_ARGUMENT"), 1)  # distinct ones
        self.assertEqual(json.loads(p.stdout.strip().splitlines()[-1])["errors"],
                         {"INVALID_ARGUMENT": 5})

    def test_sweep_csv_json_config_p95(self):
        p = self.bench(self.target, "--concurrency=1,2", "--requests=8", "--json", "--csv",
                       "--dtype=float32")
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.strip().splitlines()
        runs = [json.loads(line) for line in lines[-2:]]
        self.assertEqual([r["config"]["concurrency"] for r in runs], [1, 2])
        for r in runs:
            self.assertEqual(r["requests"], 8)
            self.assertLessEqual(r["p90"], r["p95"])
            self.assertLessEqual(r["p95"], r["p99"])
            self.assertEqual(r["config"]["shape"], [1, 2, 16, 32])
            self.assertEqual(r["config"]["dtype"], "float32")
            self.assertEqual(r["config"]["mode"], "attend")
        rows = list(csv.DictReader(lines[-5:-2]))
        self.assertEqual([row["concurrency"] for row in rows], ["1", "2"])
        self.assertEqual([row["requests"] for row in rows], ["8", "8"])
        self.assertGreater(float(rows[0]["p95"]), 0)
        self.assertEqual(len(re.findall(r"latency ms p50 .* p95 ", p.stdout)), 2)

    def test_progress_has_an_eta(self):
        p = run("attn_bench", self.target, "--shape=1,2,16,32", "--warmup_s=0",
                "--duration_s=2.5", "--progress=true")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stderr, r"\[attention c=1 .* eta \d+s")


class ClientTest(ServerTest):
    def test_npy_inputs_give_shape_and_dtype(self):
        o16 = f"{self.dir}/o16.npy"
        p = run("attn_client", self.target, "--shape=1,2,24,32", "--dtype=float16", f"--out={o16}")
        self.assertEqual(p.returncode, 0, p.stderr)
        # A '<f2' file [1, 2, 24, 32] as q, k and v, with neither --shape nor --dtype.
        p = run("attn_client", self.target, f"--q={o16}", f"--k={o16}", f"--v={o16}", "--check")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("Nq=24 Nk=24 Hq=2 Hkv=2", p.stdout)
        self.assertIn("D=32 float16", p.stdout)
        self.assertIn("o: float16 [1, 2, 24, 32]", p.stdout)

    def test_too_large_request_refused_before_it_is_built(self):
        start_time = time.monotonic()
        p = run("attn_client", self.target, "--shape=64,32,4096,128", "--max_message_mb=64")
        self.assertLess(time.monotonic() - start_time, 5)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("the request would be 12288.0 MiB, over --max_message_mb=64", p.stderr)

    def test_check_says_what_it_does(self):
        p = run("attn_client", self.target, "--shape=2,4,40,64", "--kv_heads=2", "--nk=70",
                "--causal", "--lse", "--dtype=bfloat16", "--check")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("computing the float64 reference", p.stderr)
        self.assertRegex(p.stdout, r"every row, reference on \d+ threads\): PASS")

    def test_float8_check_against_the_dequantised_reference(self):
        # e4m3 inputs with descales (none a power of two), GQA, Nq != Nk, causal, LSE: o comes
        # back in bfloat16 and --check compares it with the reference on q * q_descale, ...
        p = run("attn_client", self.target, "--shape=2,4,33,64", "--kv_heads=2", "--nk=70",
                "--causal", "--lse", "--dtype=float8_e4m3", "--q_descale=0.37",
                "--k_descale=1.7", "--v_descale=0.011", "--check")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("float8_e4m3", p.stdout)
        self.assertIn("q_descale=0.37", p.stdout)
        self.assertIn("o: bfloat16 [2, 4, 33, 64]", p.stdout)
        self.assertRegex(p.stdout, r"\): PASS")
        # A descale with other inputs is the server's INVALID_ARGUMENT, naming the field.
        p = run("attn_client", self.target, "--shape=1,2,8,32", "--dtype=bfloat16",
                "--v_descale=2")
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("v_descale: expected only with DTYPE_FLOAT8_E4M3 inputs", p.stderr)

    def test_top_left_mask_alignment(self):
        for nk in (70, 25):  # Nq < Nk and Nq > Nk: the two alignments differ
            p = run("attn_client", self.target, "--shape=1,2,40,32", f"--nk={nk}", "--causal",
                    "--lse", "--mask_alignment=top_left", "--check")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("top_left", p.stdout + p.stderr)
            self.assertRegex(p.stdout, r"\): PASS")
        p = run("attn_client", self.target, "--mask_alignment=diagonal")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--mask_alignment must be bottom_right or top_left, got diagonal", p.stderr)


if __name__ == "__main__":
    unittest.main()
