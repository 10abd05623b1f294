"""Sessions routed across three real attention_server replicas (CPU backend, --replica_name r1, r2
and r3) through a real HAProxy rendered from deploy/haproxy/haproxy.cfg.template, with the Python
client; then one replica drained while a thread steps every session through the proxy.

Through the proxy: new sessions spread over the replicas (leastconn), their ids name their owner
and each is held by that replica alone; appends and Steps (the owner header routes them) match
the float64 reference; a Step over sessions of two owners is refused by name. Then the replica
holding the first session is drained as an operator would (deploy/haproxy/haproxy_routing.py
drain: out of the pool, its sessions exported and imported into a peer under their ids, the
owner map pointed at the peer over HAProxy's runtime API, the sessions dropped on it) and
stopped, while a thread steps every session through the proxy the whole time, each Step a decode
step appending a new k/v row, sent unary and as a wait=False future in turn: the drain's export
seals each session on the drained replica, so its Steps there are refused (the client retries
them until the proxy sends them to the peer); no Step fails, every answer matches the float64
reference of every row the client appended, and each session's length on its owner afterwards
is those rows. Afterwards the moved sessions take
appends and Steps through the proxy (against the reference) and new sessions avoid the drained
replica. Inputs are fresh random each run (the seed is printed).

Run by ctest (label "deploy") with the Python client's environment. Exits 77 (skipped) when
haproxy is not on PATH (scripts/install_deps.sh test installs it) or grpcio or numpy is missing.
"""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

if shutil.which("haproxy") is None:
    print("deploy.replica_routing: skipped: haproxy is not on PATH "
          "(scripts/install_deps.sh test installs Debian's haproxy)")
    sys.exit(77)

from test_attention_client import (F32_BOUND, SEED, reference, rel_error, start_replicas,
                                   stop_replicas)

import numpy as np
from attention_client import Client
from attention_client.session import session_owner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "haproxy_routing", os.path.join(ROOT, "deploy", "haproxy", "haproxy_routing.py"))
haproxy_routing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(haproxy_routing)

HQ, HKV, D = 4, 2, 32
SESSIONS = 6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """HAProxy in the foreground on a free port, configured by haproxy_routing.render for
    `replicas` [(name, "host:port")]; stop() ends it."""

    def __init__(self, replicas):
        self.dir = tempfile.mkdtemp(prefix="replica_routing_")
        self.port = free_port()
        self.admin_socket = os.path.join(self.dir, "admin.sock")
        self.owner_map = os.path.join(self.dir, "owners.map")
        config, owners = haproxy_routing.render(
            replicas, bind=f"127.0.0.1:{self.port}", admin_socket=self.admin_socket,
            owner_map=self.owner_map)
        with open(self.owner_map, "w") as f:
            f.write(owners)
        path = os.path.join(self.dir, "haproxy.cfg")
        with open(path, "w") as f:
            f.write(config)
        check = subprocess.run(["haproxy", "-c", "-f", path], capture_output=True, text=True)
        assert check.returncode == 0, f"haproxy -c refused the config:\n{check.stdout}{check.stderr}"
        self.log = open(os.path.join(self.dir, "haproxy.log"), "w+")
        self.process = subprocess.Popen(["haproxy", "-db", "-f", path], stdout=self.log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("haproxy did not start:\n" + self.output())
            time.sleep(0.05)

    def _listening(self):
        if not os.path.exists(self.admin_socket):
            return False
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# How a decode Step is sent: a unary Step or a packed Step with wait=False (a future). Not over a
# StepStream: HAProxy 2.6 hands the client a StepStream that the server ends with an error (a
# sealed refusal among them) as CANCELLED (RST_STREAM), without the server's status, so the
# client cannot tell the refusal from a Step cut off, and does not retry it (deploy/README.md).
HOW = ("unary", "future")


def decode_step(session, rows, rng, how="unary"):
    """One decode Step of session through the proxy, sent `how` (HOW): a new k/v row appended
    (to rows, k, v [Hkv, N, D], once the Step answered) and two queries attending, checked
    against the float64 reference of every row appended. Returns what was wrong ("": nothing)."""
    q, k1, v1 = (rng.standard_normal(shape).astype(np.float32)
                 for shape in ((HQ, 2, D), (HKV, 1, D), (HKV, 1, D)))
    if how == "future":
        o = session._client.step_batch([session], q[None], k1[None], v1[None], causal=True,
                                       wait=False).result()[0]
    else:
        o = session.step(q, k=k1, v=v1, causal=True)
    rows[0] = np.concatenate([rows[0], k1], axis=1)
    rows[1] = np.concatenate([rows[1], v1], axis=1)
    ref_o, _ = reference(q[None], rows[0][None], rows[1][None], causal=True)
    err = rel_error(o, ref_o[0])
    if err > F32_BOUND:
        return f"{session.id}: o's relative error {err:.3g} over {F32_BOUND} (seed {SEED})"
    if session.length != rows[0].shape[1]:
        return f"{session.id}: {session.length} rows, {rows[0].shape[1]} appended"
    return ""


class ReplicaRoutingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(SEED)
        cls.names = ["r1", "r2", "r3"]
        cls.servers, cls.direct = start_replicas(cls.names)
        cls.proxy, cls.client = None, None
        try:
            cls.proxy = Proxy([(n, f"127.0.0.1:{cls.servers[n].port}") for n in cls.names])
            cls.client = Client(f"127.0.0.1:{cls.proxy.port}", timeout=60)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.client is not None:
            cls.client.close()
        if cls.proxy is not None:
            cls.proxy.stop()
        stop_replicas(cls.servers, cls.direct)

    def normal(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def check_step(self, session, rows, what):
        """One Step of session (appending a row) through the proxy against the reference of its
        rows (k, v [Hkv, N, D], grown here)."""
        self.assertEqual(decode_step(session, rows, self.rng), "", what)

    def assertWithin(self, err, what):
        self.assertLessEqual(err, F32_BOUND, f"{what}: relative error {err:.3g} (seed {SEED})")

    def held_by(self, names):
        """Each replica's session ids, asked directly."""
        return {name: {info.session_id for info in self.direct[name].list_sessions().sessions}
                for name in names}

    def test_sessions_route_to_their_owner_and_survive_a_drain(self):
        for name in self.names:
            self.assertEqual(self.direct[name].server_info().replica_name, name)
        self.assertIn(self.client.server_info().replica_name, self.names)

        # Sessions through the proxy: created on some replica, then appended to and stepped.
        sessions, rows = [], {}
        for _ in range(SESSIONS):
            k, v = self.normal(HKV, 40, D), self.normal(HKV, 40, D)
            s = self.client.session(k=k, v=v)
            k2, v2 = self.normal(HKV, 7, D), self.normal(HKV, 7, D)
            self.assertEqual(s.append(k2, v2), 47)
            sessions.append(s)
            rows[s.id] = [np.concatenate([k, k2], axis=1), np.concatenate([v, v2], axis=1)]
            self.check_step(s, rows[s.id], "after create")
        owners = {s.id: session_owner(s.id) for s in sessions}
        self.assertGreater(len(set(owners.values())), 1, f"every session on one replica: {owners}")
        held = self.held_by(self.names)
        for s in sessions:
            self.assertTrue(s.id.startswith(owners[s.id] + "."), s.id)
            self.assertEqual([n for n in self.names if s.id in held[n]], [owners[s.id]])
            self.assertEqual(s.info().length, rows[s.id][0].shape[1])  # ListSessions routed too
        two = next(t for t in sessions if owners[t.id] != owners[sessions[0].id])
        q = self.normal(HQ, 1, D)
        with self.assertRaises(ValueError) as e:
            self.client.step_many([(sessions[0], q), (two, q)])
        for name in (owners[sessions[0].id], owners[two.id]):
            self.assertIn(repr(name), str(e.exception))
        with self.assertRaises(ValueError):
            self.client.step_batch([sessions[0], two], self.normal(2, HQ, 1, D))

        # Decode Steps (each appending a row) before, during and after the drain, unary and as
        # futures in turn: the drain's sealed export makes the source refuse them from the
        # export on (the client retries), so every row lands on the session's one owner and
        # every answer matches the reference.
        failures, rounds = [], [0]
        stop = threading.Event()
        stepper_rng = np.random.default_rng(self.rng.integers(1 << 62))

        def step_all():
            while not stop.is_set():
                for i, s in enumerate(sessions):
                    how = HOW[(rounds[0] + i) % len(HOW)]
                    try:
                        wrong = decode_step(s, rows[s.id], stepper_rng, how)
                    except Exception as e:  # noqa: BLE001: every failure is the test's finding
                        wrong = f"{s.id} ({how}, round {rounds[0]}): {e!r}"
                    if wrong:
                        failures.append(wrong)
                        return  # whether its row landed is unknown: the rows are no reference
                rounds[0] += 1

        stepper = threading.Thread(target=step_all)
        stepper.start()
        try:
            while rounds[0] < 3 and not failures:
                time.sleep(0.01)
            drained = owners[sessions[0].id]
            peer = next(n for n in self.names if n != drained)
            on_drained = {s.id for s in sessions if owners[s.id] == drained}
            moved = haproxy_routing.drain(
                self.direct[drained], self.direct[peer], owner=drained, to=peer,
                admin_socket=self.proxy.admin_socket, owner_map=self.proxy.owner_map)
            self.assertEqual(set(moved), on_drained)
            self.assertEqual(self.held_by([drained])[drained], set())
            at_stop = rounds[0]
            self.servers[drained].stop()
            while rounds[0] < at_stop + 5 and not failures:
                time.sleep(0.01)
        finally:
            stop.set()
            stepper.join()
        self.assertEqual(failures, [], f"Steps through the proxy during the drain (seed {SEED})")
        self.assertGreaterEqual(rounds[0], 3 + 5)
        with open(self.proxy.owner_map) as f:
            self.assertIn(f"{drained} {peer}\n", f.read())  # a reload keeps the route

        # The moved sessions live on the peer under their ids, take appends and Steps through
        # the proxy; new sessions go to the replicas left.
        alive = [n for n in self.names if n != drained]
        held = self.held_by(alive)
        for s in sessions:
            where = peer if owners[s.id] == drained else owners[s.id]
            self.assertEqual([n for n in alive if s.id in held[n]], [where], s.id)
            # Every row the client appended, before, during and after the drain, is there.
            self.assertEqual(s.info().length, rows[s.id][0].shape[1], s.id)
            k2, v2 = self.normal(HKV, 3, D), self.normal(HKV, 3, D)
            rows[s.id] = [np.concatenate([rows[s.id][0], k2], axis=1),
                          np.concatenate([rows[s.id][1], v2], axis=1)]
            self.assertEqual(s.append(k2, v2), rows[s.id][0].shape[1])
            self.check_step(s, rows[s.id], "after the drain")
        fresh = [self.client.session(dtype="float32", kv_heads=HKV, head_dim=D)
                 for _ in range(4)]
        self.assertTrue({session_owner(s.id) for s in fresh} <= set(alive),
                        [s.id for s in fresh])
        for s in sessions + fresh:
            s.drop()
        for name in alive:
            self.assertEqual(self.held_by([name])[name], set())


if __name__ == "__main__":
    unittest.main()
