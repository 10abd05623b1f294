"""The Python client (client/python) against the real attention_server (CPU backend).

Each result is compared with a numpy float64 reference of the API's semantics (bottom-right
aligned masks, GQA, LSE, varlen) by relative error ||o - ref|| / ||ref||, within the API's
bounds: 1e-5 for float32, 1e-2 for float16 and bfloat16, 4e-2 for float8. Inputs are fresh random each run; the
seed is printed, and a failure message repeats it.

Run by ctest (label "python"), which sets PYTHONPATH (the package and its generated stubs) and
ATTENTION_SERVER_BINARY. Exits 77 (skipped) when grpcio or numpy is missing.
"""
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

try:
    import numpy as np
    import attention_client
    from attention_client import AttentionError, Client
    import grpc
except ImportError as e:  # the Debian packages of scripts/install_deps.sh are missing
    print(f"python_client: skipped: {e}")
    sys.exit(77)

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
try:
    import torch
except ImportError:
    torch = None

SEED = random.SystemRandom().randrange(1 << 32)
print(f"python_client: seed {SEED}", flush=True)

F32_BOUND = 1e-5
F16_BOUND = 1e-2
F8_BOUND = 4e-2  # the API's float8 bound (P may be rounded to e4m3 on Hopper)


def reference(q, k, v, causal=False, scale=None, window_left=None, window_right=None,
              sinks=None, softcap=None, chunk_size=None):
    """float64 attention for BHSD q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv].

    Returns o [B, Hq, Nq, Dv] and lse [B, Hq, Nq]; a row that sees no key has o = 0, lse = -inf
    (with sinks: the head's sink). sinks [Hq]: one more logit per head in the denominator;
    softcap: logits s -> softcap * tanh(s / softcap) before the mask; chunk_size: a query sees
    only the keys of its diagonal key's chunk.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    group = hq // hkv
    k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    v = np.repeat(v, group, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    right = 0 if causal else window_right
    visible = np.ones((nq, nk), dtype=bool)
    if window_left is not None:
        visible &= j >= i + nk - nq - window_left
    if right is not None:
        visible &= j <= i + nk - nq + right
    if chunk_size is not None:
        visible &= j // chunk_size == (i + nk - nq) // chunk_size
    s = np.where(visible, s, -np.inf)
    if sinks is not None:  # one more logit per head, with no value: appended, then dropped
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (b, hq, nq, 1))
        s = np.concatenate([s, sink], axis=-1)
        v = np.concatenate([v, np.zeros((b, hq, 1, v.shape[-1]))], axis=2)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v) / np.where(l > 0, l, 1.0)
    with np.errstate(divide="ignore"):
        lse = (np.log(l) + m_safe)[..., 0]
    lse = np.where(l[..., 0] > 0, lse, -np.inf)
    return o, lse


def rel_error(out, ref):
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)


def lse_error(out, ref):
    """Relative error over the finite entries; -inf must match exactly."""
    out = np.asarray(out, dtype=np.float64)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isneginf(out), np.isneginf(ref)):
        return np.inf
    return rel_error(out[finite], ref[finite])


class TestServer:
    """A CPU attention_server on a free port learnt from its port file, in a temporary
    directory; stop() ends it with SIGTERM and checks that it exited 0."""

    def __init__(self, flags=()):
        self.dir = tempfile.mkdtemp(prefix="python_client_")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "server.log"), "w+")
        self.process = subprocess.Popen(
            [os.environ["ATTENTION_SERVER_BINARY"], "--backend=cpu", "--host=127.0.0.1",
             "--port=0", "--metrics_port=0", "--threads=2", f"--port_file={port_file}", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.log.seek(0)
                raise RuntimeError("attention_server did not start:\n" + self.log.read())
            time.sleep(0.05)
        self.port = int(open(port_file).read().split()[0])

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        assert code == 0, f"attention_server exited with {code}"


@contextlib.contextmanager
def caller_killed_on_exit(script):
    """A Python process running `script` (given the test's environment), which prints "running"
    once it is in the middle of its calls: entered once it has said so, killed on exit, as a
    caller that dies mid-call."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             env=dict(os.environ))
    try:
        said = child.stdout.readline().strip()
        if said != b"running":
            raise AssertionError(f"the caller said {said!r}, expected b'running'")
        yield child
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()


def start_replicas(names, flags=()):
    """A TestServer per name, run with --replica_name=NAME and `flags`, and a Client calling
    each directly: ({name: server}, {name: client}) (servers and clients, name by name). Stops
    what it started when one fails to start."""
    servers, clients = {}, {}
    try:
        for name in names:
            servers[name] = TestServer([f"--replica_name={name}", *flags])
            clients[name] = Client(f"127.0.0.1:{servers[name].port}", timeout=60)
    except BaseException:
        stop_replicas(servers, clients)
        raise
    return servers, clients


def stop_replicas(servers, clients):
    """Closes the clients and stops the servers (of start_replicas) still running."""
    for client in clients.values():
        client.close()
    for server in servers.values():
        if server.process.poll() is None:
            server.stop()


class ServerTest(unittest.TestCase):
    """One CPU server for the whole class."""

    SERVER_FLAGS = []  # more flags for the class's server

    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(SEED)
        cls.test_server = TestServer(cls.SERVER_FLAGS)
        cls.port = cls.test_server.port
        cls.client = Client(f"127.0.0.1:{cls.port}", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.test_server.stop()

    def normal(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def qkv(self, b=2, hq=4, hkv=2, nq=37, nk=53, d=64):
        return self.normal(b, hq, nq, d), self.normal(b, hkv, nk, d), self.normal(b, hkv, nk, d)

    def assertWithin(self, err, bound, what):
        self.assertLessEqual(err, bound, f"{what}: relative error {err:.3g} > {bound} (seed {SEED})")


class Float32Test(ServerTest):
    def test_dense_gqa_with_lse(self):
        q, k, v = self.qkv()
        o, lse = self.client.attend(q, k, v, return_lse=True)
        self.assertEqual(o.dtype, np.float32)
        self.assertEqual(o.shape, q.shape)
        self.assertEqual(lse.shape, q.shape[:3])
        ref_o, ref_lse = reference(q, k, v)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "lse")

    def test_chunked_above_the_threshold(self):
        q, k, v = self.qkv(nk=300)
        with Client(f"127.0.0.1:{self.port}", chunked_above_bytes=1000,
                    chunk_bytes=7777) as client:
            o, lse = client.attend(q, k, v, return_lse=True, causal=True)
        ref_o, ref_lse = reference(q, k, v, causal=True)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "lse")

    def test_several_connections(self):
        # Calls spread round-robin over three channels (every one READY once it carried a
        # call), chunked and unary, each equal to the reference.
        q, k, v = self.qkv(nk=300)
        ref_o, _ = reference(q, k, v, causal=True)
        with Client(f"127.0.0.1:{self.port}", connections=3, chunked_above_bytes=50000,
                    chunk_bytes=7777) as client:
            self.assertEqual(len(client._attend_stubs), 3)
            for _ in range(3):
                self.assertWithin(rel_error(client.attend(q, k, v, causal=True), ref_o),
                                  F32_BOUND, "o")
            small = [x[:, :, :20] for x in (q, k, v)]
            o = client.attend(*small)
            self.assertWithin(rel_error(o, reference(*small)[0]), F32_BOUND, "o small")
            for channel in [client._channel] + client._more_channels:
                self.assertEqual(channel._channel.check_connectivity_state(False), 2,
                                 "a channel never connected (2 = READY)")

    def test_causal_nq_greater_than_nk_has_empty_rows(self):
        # Bottom-right alignment: with Nq > Nk the first Nq - Nk rows see no key.
        q, k, v = self.qkv(b=1, hq=2, hkv=2, nq=40, nk=24, d=32)
        o, lse = self.client.attend(q, k, v, causal=True, return_lse=True)
        ref_o, ref_lse = reference(q, k, v, causal=True)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "lse")
        self.assertTrue(np.all(o[:, :, :16] == 0) and np.all(np.isneginf(lse[:, :, :16])))

    def test_window_and_scale(self):
        q, k, v = self.qkv(nq=64, nk=64)
        o = self.client.attend(q, k, v, window_left=7, window_right=3, softmax_scale=0.3)
        ref_o, _ = reference(q, k, v, window_left=7, window_right=3, scale=0.3)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o")

    def test_bshd_layout(self):
        q, k, v = self.qkv()
        o = self.client.attend(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), layout="bshd")
        ref_o, _ = reference(q, k, v)
        self.assertWithin(rel_error(o.transpose(0, 2, 1, 3), ref_o), F32_BOUND, "o")

    def test_varlen_with_lse(self):
        lens_q, lens_k = [5, 33, 1], [17, 8, 40]
        hq, hkv, d = 4, 1, 64
        cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
        q = self.normal(cu_q[-1], hq, d)
        k = self.normal(cu_k[-1], hkv, d)
        v = self.normal(cu_k[-1], hkv, d)
        o, lse = self.client.attend(q, k, v, causal=True, return_lse=True, cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k)
        self.assertEqual(o.shape, q.shape)
        self.assertEqual(lse.shape, (hq, cu_q[-1]))
        ref_o = np.zeros(q.shape)
        ref_lse = np.zeros((hq, cu_q[-1]))
        for b in range(len(lens_q)):
            sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            # packed [n, H, D] -> [1, H, n, D]
            item = [x[s].transpose(1, 0, 2)[None] for x, s in ((q, sq), (k, sk), (v, sk))]
            ob, lb = reference(*item, causal=True)
            ref_o[sq] = ob[0].transpose(1, 0, 2)
            ref_lse[:, sq] = lb[0]
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "lse")

    def test_errors_carry_the_status_code(self):
        q, k, v = self.qkv()
        with self.assertRaises(AttentionError) as caught:
            self.client.attend(q, k[:, :, :, :32], v)
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_several_addresses_round_robin(self):
        q, k, v = self.qkv(b=1, nq=16, nk=16)
        with Client(f"127.0.0.1:{self.port},localhost:{self.port}") as client:
            for _ in range(3):
                o = client.attend(q, k, v)
                self.assertWithin(rel_error(o, reference(q, k, v)[0]), F32_BOUND, "o")

    def test_module_level_attend(self):
        q, k, v = self.qkv(b=1, nq=16, nk=16)
        o = attention_client.attend(q, k, v, target=f"127.0.0.1:{self.port}")
        self.assertWithin(rel_error(o, reference(q, k, v)[0]), F32_BOUND, "o")


class HalfPrecisionTest(ServerTest):
    def test_float16(self):
        q, k, v = (x.astype(np.float16) for x in self.qkv())
        o, lse = self.client.attend(q, k, v, causal=True, return_lse=True)
        self.assertEqual(o.dtype, np.float16)
        ref_o, ref_lse = reference(q, k, v, causal=True)
        self.assertWithin(rel_error(o, ref_o), F16_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F16_BOUND, "lse")

    def test_bfloat16_bits(self):
        # Without ml_dtypes or torch: uint16 bfloat16 bits in and out.
        q, k, v = (attention_client.float32_to_bfloat16_bits(x) for x in self.qkv())
        o = self.client.attend(q, k, v, bfloat16_bits=True)
        self.assertEqual(o.dtype, np.uint16)
        ref_o, _ = reference(*(attention_client.bfloat16_bits_to_float32(x) for x in (q, k, v)))
        self.assertWithin(rel_error(attention_client.bfloat16_bits_to_float32(o), ref_o),
                          F16_BOUND, "o")

    @unittest.skipIf(ml_dtypes is None, "ml_dtypes is not installed")
    def test_bfloat16_ml_dtypes(self):
        q, k, v = (x.astype(ml_dtypes.bfloat16) for x in self.qkv())
        o = self.client.attend(q, k, v)
        self.assertEqual(o.dtype, np.dtype(ml_dtypes.bfloat16))
        ref_o, _ = reference(*(x.astype(np.float32) for x in (q, k, v)))
        self.assertWithin(rel_error(o.astype(np.float32), ref_o), F16_BOUND, "o")

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_bfloat16_and_float16(self):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = (torch.from_numpy(x).to(dtype) for x in self.qkv())
            o, lse = self.client.attend(q, k, v, causal=True, return_lse=True)
            self.assertIsInstance(o, torch.Tensor)
            self.assertEqual(o.dtype, dtype)
            ref_o, ref_lse = reference(*(x.float().numpy() for x in (q, k, v)), causal=True)
            self.assertWithin(rel_error(o.float().numpy(), ref_o), F16_BOUND, f"o {dtype}")
            self.assertWithin(lse_error(lse.numpy(), ref_lse), F16_BOUND, f"lse {dtype}")

    def test_float8_bits_with_descales(self):
        # Without ml_dtypes or torch: uint8 e4m3 bits in, uint16 bfloat16 bits out; attention on
        # the dequantised inputs (bits' values times their descales).
        q, k, v = (attention_client.float32_to_float8_e4m3_bits(x) for x in self.qkv())
        descales = dict(q_descale=0.37, k_descale=1.7, v_descale=0.011)
        o, lse = self.client.attend(q, k, v, causal=True, return_lse=True, float8_bits=True,
                                    **descales)
        self.assertEqual(o.dtype, np.uint16)
        self.assertEqual(o.shape, q.shape)
        values = [attention_client.float8_e4m3_bits_to_float32(x) * np.float32(descales[n])
                  for x, n in ((q, "q_descale"), (k, "k_descale"), (v, "v_descale"))]
        ref_o, ref_lse = reference(*values, causal=True)
        self.assertWithin(rel_error(attention_client.bfloat16_bits_to_float32(o), ref_o),
                          F8_BOUND, "o")
        self.assertWithin(lse_error(lse, ref_lse), F8_BOUND, "lse")
        with self.assertRaises(AttentionError) as e:  # descales are for float8 inputs only
            self.client.attend(*self.qkv(), v_descale=2.0)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("v_descale: expected only with DTYPE_FLOAT8_E4M3", e.exception.details)

    @unittest.skipIf(torch is None or not hasattr(torch, "float8_e4m3fn"),
                     "torch with float8_e4m3fn is not installed")
    def test_torch_float8(self):
        q, k, v = (torch.from_numpy(x).to(torch.float8_e4m3fn) for x in self.qkv())
        o = self.client.attend(q, k, v, k_descale=0.5)
        self.assertEqual(o.dtype, torch.bfloat16)
        ref_o, _ = reference(q.float().numpy(), k.float().numpy() * 0.5, v.float().numpy())
        self.assertWithin(rel_error(o.float().numpy(), ref_o), F8_BOUND, "o")

    def test_float8_rounding_matches_nearest_even(self):
        x = np.array([1.0625, 1.1875, 448.0, 464.0, 465.0, -3.0 / 1024, 1.0 / 1024, np.inf],
                     dtype=np.float32)
        bits = attention_client.float32_to_float8_e4m3_bits(x)
        # 1 + 2^-4 is a tie and rounds to even (1.0), 1 + 3 * 2^-4 up to 1.25; 464 is 448's tie
        # with the next step and rounds to 448, anything above becomes NaN (no inf); -3 * 2^-10
        # ties to -2^-8 (the even subnormal), 2^-10 to 0.
        np.testing.assert_array_equal(bits, np.array([0x38, 0x3A, 0x7E, 0x7E, 0x7F, 0x82, 0x00,
                                                      0x7F], dtype=np.uint8))
        self.assertTrue(np.isnan(attention_client.float8_e4m3_bits_to_float32(bits[4])))
        np.testing.assert_array_equal(attention_client.float8_e4m3_bits_to_float32(bits[[0, 1, 2, 5]]),
                                      np.array([1.0, 1.25, 448.0, -1.0 / 256], dtype=np.float32))

    def test_bfloat16_rounding_matches_nearest_even(self):
        x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], dtype=np.float32)
        bits = attention_client.float32_to_bfloat16_bits(x)
        # 1 + 2^-8 is a tie and rounds to even (1.0); 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
        np.testing.assert_array_equal(attention_client.bfloat16_bits_to_float32(bits)[:4],
                                      np.array([1.0, 1.0, 1.015625, -2.5], dtype=np.float32))


class ImportTest(ServerTest):
    """Importing the package must not import torch: it takes seconds, and a broken install raises
    on import. Each check runs a fresh interpreter with a stand-in torch package first on the
    path."""

    def run_python(self, fake_torch_body, code):
        with tempfile.TemporaryDirectory() as fake:
            os.makedirs(os.path.join(fake, "torch"))
            with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
                f.write(fake_torch_body)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([fake, env.get("PYTHONPATH", "")])
            return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, timeout=120)

    def test_import_does_not_import_torch(self):
        done = self.run_python("", "import sys, attention_client\n"
                                   "assert 'torch' not in sys.modules, 'torch was imported'\n")
        self.assertEqual(done.returncode, 0, done.stderr)

    def test_a_torch_that_fails_to_import_leaves_numpy_use_working(self):
        code = (
            "import sys, numpy as np, attention_client\n"
            f"client = attention_client.Client('127.0.0.1:{self.port}')\n"
            "q = np.ones((1, 2, 3, 8), np.float32)\n"
            "o = client.attend(q, q, q)\n"
            "assert o.shape == q.shape and np.allclose(o, 1), o\n")
        done = self.run_python("raise OSError('libtorch_cuda.so: cannot open shared object')\n",
                               code)
        self.assertEqual(done.returncode, 0, done.stderr)


class HealthAndInfoTest(ServerTest):
    def test_health_is_serving(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("attention.v1.Attention"), "SERVING")
        with self.assertRaises(AttentionError) as raised:
            self.client.health("no.such.Service")
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_attend_result_carries_timing_and_device(self):
        q, k, v = self.qkv()
        r = self.client.attend(q, k, v, causal=True, return_lse=True, return_info=True,
                               request_id="with-info")
        ref_o, ref_lse = reference(q, k, v, causal=True)
        self.assertWithin(rel_error(r.o, ref_o), F32_BOUND, "o")
        self.assertWithin(lse_error(r.lse, ref_lse), F32_BOUND, "lse")
        self.assertEqual(r.device, "cpu")
        self.assertEqual(r.request_id, "with-info")
        self.assertIsInstance(r.timing, attention_client.ServerTiming)
        self.assertGreater(r.timing.compute_us, 0)
        self.assertGreaterEqual(r.timing.total_us, r.timing.compute_us)
        self.assertIsNone(self.client.attend(q, k, v, return_info=True).lse)


class OpenModelOptionsTest(ServerTest):
    """Sinks, softcap, chunk_size and a V head dim of its own on Attend (the CPU backend serves
    them all), against the float64 reference; refusals name the field."""

    def check(self, q, k, v, **options):
        o, lse = self.client.attend(q, k, v, return_lse=True, **options)
        self.assertEqual(o.shape, q.shape[:3] + v.shape[3:])
        ref_options = dict(options)
        ref_options["scale"] = ref_options.pop("softmax_scale", None)
        ref_o, ref_lse = reference(q, k, v, **ref_options)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"o with {sorted(options)}")
        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, f"lse with {sorted(options)}")

    def test_each_option_and_all_together(self):
        q, k, v = self.qkv(nq=37, nk=53, d=32)
        sinks = self.normal(q.shape[1]) * 2
        self.check(q, k, v, causal=True, sinks=sinks)
        self.check(q, k, v, softcap=1.5, softmax_scale=0.8)
        self.check(q, k, v, causal=True, chunk_size=8)
        self.check(q, k, v, chunk_size=5, window_left=7)
        _, _, v_own = self.qkv(nq=37, nk=53, d=12)  # MLA: V's head dim 12, QK's 32
        self.check(q, k, v_own, causal=True)
        self.check(q, k, v_own, causal=True, sinks=sinks, softcap=2.0, chunk_size=16)

    def test_server_info_lists_the_options_per_device(self):
        device = self.client.server_info().devices[0]
        self.assertEqual(sorted(device.attend_options),
                         ["chunk_size", "sinks", "softcap", "v_head_dim"])
        self.assertEqual(sorted(device.step_options),
                         ["chunk_size", "sinks", "softcap", "v_from_k", "v_head_dim"])

    def test_bad_options_name_the_field(self):
        q, k, v = self.qkv()
        for options, field in [(dict(sinks=[0.0]), "sinks"),
                               (dict(sinks=[0.0, 1.0, float("nan"), 2.0]), r"sinks\[2\]"),
                               (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"),
                               (dict(chunk_size=0), "chunk_size")]:
            with self.assertRaises(AttentionError) as raised:
                self.client.attend(q, k, v, **options)
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertRegex(raised.exception.details, f"^{field}:")


class AsyncClientTest(ServerTest):
    """attention_client.aio.AsyncClient: calls in flight at once over one grpc.aio channel."""

    def test_concurrent_attends_and_errors(self):
        import asyncio

        from attention_client.aio import AsyncClient

        inputs = [self.qkv(nq=5 + i, nk=20 + 3 * i) for i in range(4)]

        async def run():
            async with AsyncClient(f"127.0.0.1:{self.port}") as client:
                outs = await asyncio.gather(
                    *(client.attend(q, k, v, causal=True, return_lse=True) for q, k, v in inputs))
                info = await client.server_info()
                with self.assertRaises(AttentionError) as caught:
                    q, k, v = inputs[0]
                    await client.attend(q, k[..., :7], v[..., :7])  # D differs from q's
                return outs, info, caught.exception

        outs, info, error = asyncio.run(run())
        for (q, k, v), (o, lse) in zip(inputs, outs):
            ref_o, ref_lse = reference(q, k, v, causal=True)
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "async o")
            self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "async lse")
        self.assertEqual(info.backend, "cpu")
        self.assertEqual(error.code, grpc.StatusCode.INVALID_ARGUMENT)


if __name__ == "__main__":
    unittest.main()
