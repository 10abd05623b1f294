"""The Python package (client/python) installs and builds without protoc, offline.

- The stubs it ships (attention_client/_gen) are those the proto gives now: regenerated with the
  package's own generator and compared byte for byte.
- `pip install client/python` into a fresh virtual environment whose PATH has no protoc (and no
  grpcio-tools anywhere) installs it, and the installed package computes an attention call on
  the real server, checked against a float64 numpy reference.
- `python -m build` makes an sdist and a wheel (from that sdist, as pip does), both holding the
  stubs.

Run by ctest (label "python") with the Debian python3, which sets ATTENTION_SERVER_BINARY and
ATTENTION_SOURCE_DIR. Needs python3-venv, python3-build (scripts/install_deps.sh) and the Debian
grpcio, protobuf and numpy; no network: the environments use --system-site-packages, pip runs
with --no-index, and builds run with --no-isolation (setuptools from Debian).
"""
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

from test_attn_bench import start

SOURCE_DIR = os.environ.get("ATTENTION_SOURCE_DIR")
PACKAGE = os.path.join(SOURCE_DIR or "", "client", "python")
STUBS = ["attention/v1/attention_pb2.py", "attention/v1/attention_pb2_grpc.py"]


def check(args, **kwargs):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    if p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


class PackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="package_test_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_shipped_stubs_match_the_proto(self):
        out = os.path.join(self.dir, "gen")
        check([sys.executable, os.path.join(PACKAGE, "attention_client", "_protoc.py"), out])
        for stub in STUBS:
            with self.subTest(stub=stub):
                self.assertTrue(
                    filecmp.cmp(os.path.join(out, stub),
                                os.path.join(PACKAGE, "attention_client", "_gen", stub),
                                shallow=False),
                    f"{stub} differs from the proto: run "
                    "client/python/attention_client/_protoc.py client/python/attention_client/_gen")

    def test_pip_install_without_protoc_then_a_call(self):
        venv = os.path.join(self.dir, "venv")
        check([sys.executable, "-m", "venv", "--system-site-packages", venv])
        # A PATH with the environment's own tools only: no protoc, no grpc_python_plugin.
        env = dict(os.environ, PATH=os.path.join(venv, "bin"))
        env.pop("PYTHONPATH", None)
        python = os.path.join(venv, "bin", "python")
        self.assertIsNone(shutil.which("protoc", path=env["PATH"]))
        # A copy, so the build leaves nothing in the source tree.
        source = os.path.join(self.dir, "src")
        shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        check([python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-q", source], env=env, cwd=self.dir)
        server, port = start(
            [os.environ["ATTENTION_SERVER_BINARY"], "--backend=cpu", "--host=127.0.0.1",
             "--port=0", "--metrics_port=0", f"--port_file={self.dir}/server"],
            f"{self.dir}/server")
        try:
            script = f"""
import numpy as np, attention_client
assert "/venv/" in attention_client.__file__, attention_client.__file__
rng = np.random.default_rng(7)
q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 9, 16), (1, 2, 13, 16),
                                                                (1, 2, 13, 16)))
o = attention_client.Client("127.0.0.1:{port}").attend(q, k, v)
s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) / 4.0
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
err = np.linalg.norm(o - ref) / np.linalg.norm(ref)
assert err < 1e-5, err
print("relative error", err)
"""
            p = check([python, "-c", script], env=env, cwd=self.dir)
            self.assertIn("relative error", p.stdout)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)

    def test_python_m_build_makes_an_sdist_and_a_wheel_with_the_stubs(self):
        source = os.path.join(self.dir, "build_src")
        shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        dist = os.path.join(self.dir, "dist")
        # A PATH with python3 alone: no protoc (the wheel is built from the sdist, as pip does).
        tools = os.path.join(self.dir, "tools")
        os.makedirs(tools)
        os.symlink(sys.executable, os.path.join(tools, "python3"))
        env = dict(os.environ, PATH=tools)
        env.pop("PYTHONPATH", None)
        check([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source],
              env=env, cwd=self.dir)
        wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
        sdists = [f for f in os.listdir(dist) if f.endswith(".tar.gz")]
        self.assertEqual(len(wheels), 1, os.listdir(dist))
        self.assertEqual(len(sdists), 1, os.listdir(dist))
        names = zipfile.ZipFile(os.path.join(dist, wheels[0])).namelist()
        for stub in STUBS:
            self.assertIn(f"attention_client/_gen/{stub}", names)
        with tarfile.open(os.path.join(dist, sdists[0])) as sdist:
            names = sdist.getnames()
        for stub in STUBS:
            self.assertTrue(any(n.endswith(f"attention_client/_gen/{stub}") for n in names), names)


if __name__ == "__main__":
    unittest.main()
