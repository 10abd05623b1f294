"""An operator's server: the real attention_server and attn_client binaries, over real sockets.

- A second server on a gRPC port in use fails at start, naming the port (gRPC's SO_REUSEPORT is
  off, so two servers never share one silently), and the first keeps serving; a metrics port in
  use fails the start naming it; ports outside 0..65535, or one port for both, are refused.
- --version prints the project version, the git commit the source tree is at and the build type.
- /metrics answers a scrape within 2 s while a few dozen connections trickle their headers, a
  byte at a time, reconnecting when dropped.
- attn_client refuses a request over the server's FLOP limit (ServerInfo) before building it,
  refuses --q without --k and --v, and says what to do when TLS is on one side only, when nothing
  listens and when a call passes its deadline.

Run by ctest (label "python"), which sets ATTENTION_SERVER_BINARY, ATTN_CLIENT_BINARY,
ATTENTION_SOURCE_DIR and ATTENTION_BUILD_TYPE. Needs only the standard library and, for the TLS
cases, the openssl CLI.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

from test_attn_bench import start

SERVER = os.environ.get("ATTENTION_SERVER_BINARY")
CLIENT = os.environ.get("ATTN_CLIENT_BINARY")
SOURCE_DIR = os.environ.get("ATTENTION_SOURCE_DIR")


def run(binary, *args, timeout=60):
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)


class Server:
    """One attention_server (CPU backend) on free ports; stopped with SIGTERM."""

    def __init__(self, *flags):
        self.dir = tempfile.mkdtemp(prefix="operator_test_")
        port_file = f"{self.dir}/ports"
        self.proc, self.port = start(
            [SERVER, "--backend=cpu", "--host=127.0.0.1", "--port=0", "--metrics_port=0",
             f"--port_file={port_file}", *flags], port_file)
        self.metrics_port = int(open(port_file).read().split()[1])
        self.target = f"--target=127.0.0.1:{self.port}"

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class PortsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_grpc_port_in_use_fails_the_start_and_the_first_serves_on(self):
        p = run(SERVER, "--backend=cpu", "--host=127.0.0.1", f"--port={self.server.port}",
                "--metrics_port=0", timeout=30)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(f"cannot listen on 127.0.0.1:{self.server.port} for gRPC: another process "
                      "holds the port", p.stderr)
        health = run(CLIENT, self.server.target, "--health")
        self.assertEqual(health.returncode, 0, health.stderr)

    def test_metrics_port_in_use_fails_the_start_naming_it(self):
        p = run(SERVER, "--backend=cpu", "--host=127.0.0.1", "--port=0",
                f"--metrics_port={self.server.metrics_port}", timeout=30)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(f"metrics: cannot listen on 127.0.0.1:{self.server.metrics_port} "
                      "(--metrics_port)", p.stderr)

    def test_bad_ports_and_values_are_refused(self):
        for flags, reason in (
                (["--port=65536"], "--port: expected a TCP port 0..65535 (0 picks a free one), "
                                   "got 65536"),
                (["--port=-1"], "--port: expected a TCP port 0..65535"),
                (["--metrics_port=70000"], "--metrics_port: expected a TCP port 0..65535"),
                (["--malloc_keep_mb=-1"], "--malloc_keep_mb: expected >= 0, got -1"),
                (["--socket_port=70000"], "--socket_port: expected -1 (none), 0 (a free one) or "
                                          "a port to 65535, got 70000"),
                (["--socket_port=0", "--max_sockets=0"],
                 "--max_sockets and --socket_stall_timeout_s: expected >= 1, got 0 and 30"),
                (["--socket_port=0", "--tls_cert=/no/cert", "--tls_key=/no/key"],
                 "--socket_port with --tls_cert: socket streams carry their bytes in the clear"),
                (["--port=9999", "--metrics_port=9999"],
                 "--port and --metrics_port: expected two different ports, got 9999 for both")):
            with self.subTest(flags=flags):
                p = run(SERVER, "--backend=cpu", "--host=127.0.0.1", *flags, timeout=30)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(reason, p.stderr)


class VersionTest(unittest.TestCase):
    def test_version_commit_and_build_type(self):
        p = run(SERVER, "--version")
        self.assertEqual(p.returncode, 0, p.stderr)
        version = re.search(r"project\(attention_service VERSION ([\d.]+)",
                            open(f"{SOURCE_DIR}/CMakeLists.txt").read()).group(1)
        self.assertIn(f"attention_server {version}\n", p.stdout)
        self.assertIn(f"build type {os.environ['ATTENTION_BUILD_TYPE'] or 'none'}\n", p.stdout)
        self.assertNotIn("Debug build (NDEBUG", p.stdout)  # abseil's guess
        commit = re.search(r"^commit (\S+)$", p.stdout, re.M).group(1)
        head = subprocess.run(["git", "-C", SOURCE_DIR, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True) if shutil.which("git") else None
        if head is not None and head.returncode == 0:
            # The tree's commit (the build may have been before a later commit: rebuild first).
            self.assertRegex(commit, rf"^{head.stdout.strip()}(-dirty)?$")
        else:
            self.assertEqual(commit, "unknown")


class MetricsSlowClientsTest(unittest.TestCase):
    TRICKLERS = 48  # a few dozen

    def test_scrape_within_2s_while_connections_trickle_headers(self):
        server = Server()
        stop = threading.Event()

        def trickle():
            # "GET /metrics HTTP/1.1\r\n..." one byte every 200 ms, never finished; a new
            # connection whenever the server drops this one.
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
            while not stop.is_set():
                try:
                    with socket.create_connection(("127.0.0.1", server.metrics_port)) as s:
                        for byte in request:
                            if stop.is_set():
                                return
                            s.sendall(bytes([byte]))
                            time.sleep(0.2)
                except OSError:
                    time.sleep(0.05)

        threads = [threading.Thread(target=trickle) for _ in range(self.TRICKLERS)]
        try:
            for t in threads:
                t.start()
            time.sleep(1.5)  # every trickler connected and holding a worker
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            for _ in range(4):
                begin = time.monotonic()
                body = urllib.request.urlopen(url, timeout=30).read().decode()
                elapsed = time.monotonic() - begin
                self.assertIn("attention_build_info", body)
                self.assertLess(elapsed, 2.0)
                time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
            server.stop()


def make_certificates(directory):
    """A CA and a server certificate it signed for 127.0.0.1 (openssl CLI)."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=test-ca")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    with open(f"{directory}/ext", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "ext")


class AttnClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--max_request_flops=1e6")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_over_the_flop_limit_refused_before_it_is_built(self):
        # 4 * Hq * D * Nq * Nk = 4 * 2 * 32 * 64 * 64 = 1.05e6 > 1e6.
        p = run(CLIENT, self.server.target, "--shape=1,2,64,32", "--seed=1")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("the request would need 1.04858e+06 FLOPs", p.stderr)
        self.assertIn("over the server's limit of 1e+06 per request", p.stderr)
        self.assertNotIn("problem:", p.stdout)  # nothing drawn, nothing sent
        # Under the mask it is within the limit (64 * 65 / 2 pairs), and computed right.
        p = run(CLIENT, self.server.target, "--shape=1,2,64,32", "--causal", "--check",
                "--seed=1")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("PASS", p.stdout)

    def test_q_without_k_and_v_refused(self):
        for given in (["--q"], ["--q", "--k"], ["--v"]):
            with self.subTest(given=given):
                # The files need not exist: the flags are refused before anything is read.
                p = run(CLIENT, self.server.target, *(f"{flag}=/nonexistent.npy" for flag in given))
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn("--q, --k and --v go together (each tensor from its file), got "
                              f"{' '.join(given)} only", p.stderr)
                self.assertNotIn("problem:", p.stdout)

    def test_deadline_and_dead_target_say_what_to_do(self):
        # A call of ~4 GFLOPs, which no CPU answers within 1 ms (the class's server, limited to
        # 1e6 FLOPs a request, answered one small enough for it in under 1 ms at times): a server
        # of its own, without that limit.
        unlimited = Server()
        try:
            p = run(CLIENT, unlimited.target, "--shape=1,8,2048,64", "--causal", "--deadline_ms=1")
        finally:
            unlimited.stop()
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("DEADLINE_EXCEEDED", p.stderr)
        self.assertIn("the call took longer than --deadline_ms=1: raise it", p.stderr)
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        p = run(CLIENT, f"--target=127.0.0.1:{free}", "--health", "--deadline_ms=5000")
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn(f"nothing listens at --target=127.0.0.1:{free}", p.stderr)

    @unittest.skipUnless(shutil.which("openssl"), "needs the openssl CLI")
    def test_tls_on_one_side_only_says_what_to_do(self):
        directory = tempfile.mkdtemp(prefix="operator_tls_")
        try:
            make_certificates(directory)
            tls = Server(f"--tls_cert={directory}/server.pem", f"--tls_key={directory}/server.key")
            try:
                # Plaintext client, TLS server.
                p = run(CLIENT, tls.target, "--health", "--deadline_ms=5000")
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertIn("if it serves TLS (started with --tls_cert), pass --tls_ca=CA.pem",
                              p.stderr)
                p = run(CLIENT, tls.target, "--health", f"--tls_ca={directory}/ca.pem")
                self.assertEqual(p.returncode, 0, p.stderr)
            finally:
                tls.stop()
            # TLS client, plaintext server.
            p = run(CLIENT, self.server.target, "--health", f"--tls_ca={directory}/ca.pem",
                    "--deadline_ms=5000")
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn("if the server serves plaintext (started without --tls_cert), leave out "
                          "--tls, --tls_ca and --tls_cert", p.stderr)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
