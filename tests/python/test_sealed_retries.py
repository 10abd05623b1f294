"""A session moved between two real attention_servers (CPU backend, --replica_name r1 and r2,
shared memory allowed) while the Python client steps it through a router, over every Step path
the CPU backend serves: the request ring (wait=True, and wait=False answered by the next post; one
ring per owner, Steps of two owners' sessions in turn), a unary Step with wait=False (a future),
and the StepStream (a stream open on the old replica before the move, one idle through the move,
whose replica refuses the session dropped there as moved, and one idle while its replica
stopped).

The router is a small gRPC proxy in this process (OwnerRouter): each call goes, as raw bytes, to
the replica its attention-session-owner header names through an owner map, as deploy/haproxy does
(whose request rings would not reach one server: regions belong to the proxy's connection). A move
is a drain's: the session exported sealed from r1 and imported into r2 under its id, then after a
pause the owner map points r1 at r2 and the session is dropped on r1. Each Step is sent after the
seal: r1 refuses it (UNAVAILABLE, SEALED_MARKER) until the switch, and the client retries it where
the router sends it then, so it answers after the pause, matches the float64 reference of every row
appended (each Step appends a row, once) and leaves the session's length on r2 those rows. Inputs
are fresh random each run; the seed is printed, and a failure message repeats it.

Run by ctest (label "python") like test_attention_client.py. Exits 77 (skipped) when grpcio or
numpy is missing.
"""
import concurrent.futures
import threading
import time
import unittest

from test_attention_client import (F32_BOUND, SEED, reference, rel_error, start_replicas,
                                   stop_replicas)

import grpc
import numpy as np
from attention_client import Client
from attention_client._stubs import attention_pb2 as pb
from attention_client.session import OWNER_HEADER, export_session, import_session

HQ, HKV, D = 4, 2, 32
PAUSE_S = 0.3  # from the seal to the switch: how long the Steps are refused


class OwnerRouter(grpc.GenericRpcHandler):
    """A gRPC proxy on a free port: each call goes, its messages as raw bytes, to the replica
    named by owners[its attention-session-owner header], else to `default`; ending either side
    ends the other. replicas: {name: "host:port"}."""

    # The methods that stream (the rest are unary), by their name's end.
    _KINDS = {"/StepStream": "stream_stream", "/AttendStream": "stream_stream",
              "/AttendChunked": "stream_stream", "/Export": "unary_stream",
              "/Import": "stream_unary"}

    def __init__(self, replicas, default):
        options = [("grpc.max_send_message_length", 1 << 30),
                   ("grpc.max_receive_message_length", 1 << 30)]
        self.channels = {name: grpc.insecure_channel(address, options=options)
                         for name, address in replicas.items()}
        self.owners = {name: name for name in replicas}
        self.default = default
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(32), options=options)
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def service(self, details):
        kind = next((k for end, k in self._KINDS.items() if details.method.endswith(end)),
                    "unary_unary")
        metadata = [(key, value) for key, value in details.invocation_metadata
                    if key != "user-agent"]
        owner = dict(metadata).get(OWNER_HEADER, "")
        channel = self.channels[self.owners.get(owner, self.default)]
        forward = getattr(channel, kind)(details.method)  # no (de)serializers: bytes

        def left(context):  # the call's deadline (a call without one reports ~2^63 s)
            seconds = context.time_remaining()
            return seconds if seconds < 1e9 else None

        def unary(request, context):  # a unary answer: unary_unary and stream_unary
            future = forward.future(request, metadata=metadata, timeout=left(context))
            context.add_callback(future.cancel)
            try:
                return future.result()
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        def streamed(request, context):  # answers streamed: unary_stream and stream_stream
            responses = forward(request, metadata=metadata, timeout=left(context))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        handler = getattr(grpc, f"{kind}_rpc_method_handler")
        return handler(streamed if kind.endswith("_stream") else unary)

    def stop(self):
        self.server.stop(grace=None)
        for channel in self.channels.values():
            channel.close()


class SealedRetryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(SEED)
        cls.servers, cls.direct = start_replicas(("r1", "r2", "r3"), ["--allow_shared_memory"])
        cls.router, cls.client = None, None
        try:
            cls.router = OwnerRouter({n: f"127.0.0.1:{s.port}" for n, s in cls.servers.items()},
                                     default="r1")
            cls.client = Client(f"127.0.0.1:{cls.router.port}", timeout=60)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.client is not None:
            cls.client.close()
        if cls.router is not None:
            cls.router.stop()
        stop_replicas(cls.servers, cls.direct)

    def setUp(self):
        self.router.owners = {name: name for name in self.servers}
        self.router.default = "r1"
        # The client's request ring and StepStreams stay on the replica they were opened on
        # (by an earlier test's owner map): each test opens its own.
        for ring in self.client._step_rings.values():
            ring.close()
        self.client._step_rings.clear()
        for stream in self.client._step_streams.values():
            stream.close()
        self.client._step_streams.clear()

    def normal(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def new_session(self, n=40):
        """A session through the router (on its default replica) and its rows [k, v]."""
        k, v = self.normal(HKV, n, D), self.normal(HKV, n, D)
        return self.client.session(k=k, v=v), [k, v]

    def decode_inputs(self, rows):
        """A decode step's q [Hq, 2, D] and new row k1, v1 [Hkv, 1, D], appended to rows, and
        the float64 reference o of q over every row."""
        q, k1, v1 = self.normal(HQ, 2, D), self.normal(HKV, 1, D), self.normal(HKV, 1, D)
        rows[0] = np.concatenate([rows[0], k1], axis=1)
        rows[1] = np.concatenate([rows[1], v1], axis=1)
        return q, k1, v1, reference(q[None], rows[0][None], rows[1][None], causal=True)[0][0]

    def assertWithin(self, o, ref, what):
        err = rel_error(np.asarray(o), ref)
        self.assertLessEqual(err, F32_BOUND, f"{what}: relative error {err:.3g} (seed {SEED})")

    def move(self, session, source, target):
        """A drain of `session` from replica `source` to `target`: exported sealed and imported
        now; after PAUSE_S the owner map sends `source`'s sessions to `target` and the session
        is dropped on `source` (returns that timer's thread)."""
        import_session(self.direct[target], export_session(self.direct[source], session.id,
                                                           seal=True))

        def switch():
            time.sleep(PAUSE_S)
            self.router.owners[source] = target
            self.direct[source]._sessions_stub.DropSession(
                pb.DropSessionRequest(session_id=session.id))

        thread = threading.Thread(target=switch)
        thread.start()
        return thread

    def assertMoved(self, session, rows, target, switch, started):
        """The Step sent at `started` waited for the switch; the session holds `rows` on
        `target` and nowhere else."""
        switch.join()
        self.assertGreaterEqual(time.monotonic() - started, PAUSE_S * 0.9,
                                "answered before the switch: the sealed copy took it")
        held = {name: [i.length for i in c.list_sessions().sessions if i.session_id == session.id]
                for name, c in self.direct.items() if self.servers[name].process.poll() is None}
        self.assertEqual({n: h for n, h in held.items() if h}, {target: [rows[0].shape[1]]})

    def test_a_ring_step_goes_unary_and_the_next_opens_a_ring_on_the_new_owner(self):
        s, rows = self.new_session()
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream="ring"), ref, "before")
        ring = self.client._step_rings.get("r1")
        switch = self.move(s, "r1", "r2")
        started = time.monotonic()
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream="ring"), ref, "moving")
        self.assertMoved(s, rows, "r2", switch, started)
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream="ring"), ref, "after")
        self.assertIsNot(self.client._step_rings.get("r1"), ring)  # the refusal ended r1's ring
        self.assertEqual(s.info().length, rows[0].shape[1])
        s.drop()

    def test_ring_steps_of_two_owners_go_through_a_ring_each(self):
        # A ring stays on the replica that opened it: Steps of sessions of r1 and r2 in turn, one
        # posted without waiting, each through its owner's ring (a single ring would have sent
        # r2's Steps to r1, which does not hold the session: NOT_FOUND).
        a, rows_a = self.new_session()
        self.router.default = "r2"
        b, rows_b = self.new_session()
        self.assertEqual((a.id.split(".")[0], b.id.split(".")[0]), ("r1", "r2"))
        for turn in range(3):
            first = self.decode_inputs(rows_a)
            posted = self.client.step_batch([a], first[0][None], first[1][None], first[2][None],
                                            causal=True, stream="ring", wait=False)
            q, k1, v1, ref = self.decode_inputs(rows_b)
            self.assertWithin(b.step(q, k=k1, v=v1, causal=True, stream="ring"), ref,
                              f"r2's Step {turn}")
            self.assertWithin(posted.result()[0], first[3], f"r1's posted Step {turn}")
        self.assertEqual(sorted(self.client._step_rings), ["r1", "r2"])
        self.assertEqual((a.info().length, b.info().length),
                         (rows_a[0].shape[1], rows_b[0].shape[1]))
        a.drop()
        b.drop()

    def test_a_posted_ring_step_is_answered_before_the_next_post(self):
        # wait=False on the ring: the refusal is found by the next Step's post, which sends the
        # refused Step again (unary) before its own: the rows land in the order posted.
        s, rows = self.new_session()
        self.client.step_batch([s], self.normal(1, HQ, 1, D), stream="ring")  # opens the ring
        switch = self.move(s, "r1", "r2")
        started = time.monotonic()
        first = self.decode_inputs(rows)
        posted = self.client.step_batch([s], first[0][None], first[1][None], first[2][None],
                                        causal=True, stream="ring", wait=False)
        second = self.decode_inputs(rows)
        o2 = self.client.step_batch([s], second[0][None], second[1][None], second[2][None],
                                    causal=True, stream="ring")
        self.assertWithin(posted.result()[0], first[3], "the posted Step")
        self.assertWithin(o2[0], second[3], "the Step after it")
        self.assertMoved(s, rows, "r2", switch, started)
        s.drop()

    def test_a_unary_step_with_wait_false_retries(self):
        s, rows = self.new_session()
        switch = self.move(s, "r1", "r2")
        started = time.monotonic()
        q, k1, v1, ref = self.decode_inputs(rows)
        future = self.client.step_batch([s], q[None], k1[None], v1[None], causal=True,
                                        wait=False)
        self.assertIsInstance(future, concurrent.futures.Future)
        self.assertWithin(future.result(timeout=30)[0], ref, "future")
        self.assertMoved(s, rows, "r2", switch, started)
        s.drop()

    def stepped_on_a_stream(self):
        """A new session (of the router's default replica) and its rows, stepped once over the
        client's StepStream of its owner, and that stream."""
        s, rows = self.new_session()
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream=True), ref, "before")
        return s, rows, self.client._step_streams[self.router.default]

    def test_a_stream_on_the_old_replica_is_opened_again(self):
        s, rows, old = self.stepped_on_a_stream()
        switch = self.move(s, "r1", "r2")
        started = time.monotonic()
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream=True), ref, "moving")
        self.assertMoved(s, rows, "r2", switch, started)
        self.assertIsNot(self.client._step_streams["r1"], old)
        s.drop()

    def test_a_stream_idle_through_the_move_is_refused_as_moved_and_opened_again(self):
        # Stepped before the move only, its replica still up: the session was dropped there, but
        # the replica refuses it as sealed (moved away), not NOT_FOUND, and the client opens
        # another stream, which the router sends to the new owner.
        s, rows, old = self.stepped_on_a_stream()
        self.move(s, "r1", "r2").join()
        self.assertFalse(old.ended())
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream=True), ref, "after")
        self.assertIsNot(self.client._step_streams["r1"], old)
        self.assertEqual(s.info().length, rows[0].shape[1])
        s.drop()

    def test_a_stream_idle_while_its_replica_stopped_is_opened_again(self):
        # Stepped before the move only: its replica's stop ends it, and the next Step opens
        # another (on the new owner) instead of failing on the ended one.
        self.router.default = "r3"
        s, rows, stream = self.stepped_on_a_stream()
        self.move(s, "r3", "r2").join()
        self.servers["r3"].stop()
        deadline = time.monotonic() + 10
        while not stream.ended() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(stream.ended(), "r3's stop did not end its stream")
        q, k1, v1, ref = self.decode_inputs(rows)
        self.assertWithin(s.step(q, k=k1, v=v1, causal=True, stream=True), ref, "after")
        self.assertEqual(s.info().length, rows[0].shape[1])
        s.drop()


if __name__ == "__main__":
    unittest.main()
