"""Socket streams (attention.v1.Sockets, --socket_port) against the real attention_server (CPU
backend), through the Python client and through raw sockets as a hostile client would use them:

- packed Steps over the socket equal the unary ones bit for bit (test_packed_steps checks them
  against per-session Steps and the float64 reference), and so do AttendStream's requests;
- a connection whose hello is wrong is closed, one whose nonce no call brings is closed after
  the hello timeout, and the server serves on; an Open with a nonce of the wrong size, an
  unknown method, or beyond --max_sockets is refused by name; an Open whose connection never
  comes ends DEADLINE_EXCEEDED;
- a request longer than the server's largest message ends the stream RESOURCE_EXHAUSTED before its
  bytes come; a request that does not parse ends it INVALID_ARGUMENT; the end frame and the Open
  call both carry the status;
- a client that stops reading its answers is cut off after --socket_stall_timeout_s
  (DEADLINE_EXCEEDED), and a client killed mid-Step leaves the server serving with its socket
  closed (attention_socket_streams back to 0); SIGTERM ends a served socket UNAVAILABLE and the
  server exits.

Run by ctest (label "python"). Exits 77 (skipped) when grpcio or numpy is missing.
"""
import os
import signal
import socket
import struct
import textwrap
import time
import unittest
import urllib.request

from test_attention_client import SEED, ServerTest, caller_killed_on_exit

import grpc
import numpy as np
from attention_client import AttentionError, Client
from attention_client._stubs import attention_pb2 as pb
from attention_client.client import _attend_request
from attention_client._stubs import attention_pb2_grpc as pb_grpc
from attention_client.socket_stream import END_BIT, MAGIC, NONCE_BYTES

LENGTH = struct.Struct("<Q")


def attend_bytes(q, k, v, *, causal, request_id=""):
    """A serialized AttendRequest of float32 q, k, v [B, H, N, D], as Client.attend builds it."""
    request, _ = _attend_request(q, k, v, causal=causal, softmax_scale=None, window_left=None,
                                 window_right=None, layout="bhsd", return_lse=False,
                                 cu_seqlens_q=None, cu_seqlens_k=None, bfloat16_bits=False,
                                 request_id=request_id, mask_alignment="bottom_right")
    return request.SerializeToString()


class RawSocket:
    """A socket stream driven by hand: the Open call (a future), the connection and its frames."""

    def __init__(self, test, method=pb.RING_METHOD_STEP, nonce=None, hello=None):
        self.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        stub = pb_grpc.SocketsStub(test.client._channel)
        self.call = stub.Open.future(pb.OpenSocketRequest(method=method, nonce=self.nonce))
        self.sock = socket.create_connection(("127.0.0.1", test.socket_port), timeout=30)
        self.sock.sendall(MAGIC + self.nonce if hello is None else hello)

    def send(self, data):
        self.sock.sendall(LENGTH.pack(len(data)) + data)

    def read_exactly(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    def frame(self):
        """(None, message bytes) for a response; (code, message) for the end frame."""
        (length,) = LENGTH.unpack(self.read_exactly(8))
        if length & END_BIT:
            body = self.read_exactly(length & ~END_BIT)
            return int.from_bytes(body[:4], "little"), body[4:].decode()
        return None, self.read_exactly(length)

    def call_status(self):
        """The Open call's status code and details, once it is answered."""
        try:
            self.call.result(timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()

    def close(self):
        self.sock.close()
        self.call.cancel()


class SocketStreamTest(ServerTest):
    SERVER_FLAGS = ["--socket_port=0", "--max_sockets=4", "--socket_stall_timeout_s=1",
                    "--max_message_mb=16"]
    HQ, HKV, D = 8, 2, 32

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.socket_port = cls.client.server_info().socket_port
        cls.metrics_port = int(open(os.path.join(cls.test_server.dir, "port")).read().split()[1])

    def sockets_served(self):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("attention_socket_streams "):
                return float(line.split()[1])
        raise AssertionError("attention_socket_streams is not among the metrics")

    def wait_served(self, count):
        deadline = time.monotonic() + 20
        while self.sockets_served() != count and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.sockets_served(), count)

    def own_client(self):
        """A Client of this test alone: its socket stream closes with it, at the test's end."""
        client = Client(f"127.0.0.1:{self.port}", timeout=60)
        self.addCleanup(client.close)
        return client

    def test_steps_over_the_socket_equal_unary_ones_bit_for_bit(self):
        self.assertGreater(self.socket_port, 0)
        client = self.own_client()
        rows = [(self.normal(self.HKV, 5, self.D), self.normal(self.HKV, 5, self.D))
                for _ in range(3)]
        unary = [client.session(k=k, v=v) for k, v in rows]
        over_socket = [client.session(k=k, v=v) for k, v in rows]
        for step in range(3):
            q = self.normal(3, self.HQ, 1, self.D)
            k = self.normal(3, self.HKV, 1, self.D)
            v = self.normal(3, self.HKV, 1, self.D)
            want_o, want_lse = client.step_batch(unary, q, k, v, causal=True, return_lse=True)
            got_o, got_lse = client.step_batch(over_socket, q, k, v, causal=True,
                                               return_lse=True, stream="socket")
            self.assertTrue(np.array_equal(got_o, want_o), f"step {step}: o (seed {SEED})")
            self.assertTrue(np.array_equal(got_lse, want_lse), f"step {step}: lse (seed {SEED})")
        self.assertEqual([s.length for s in over_socket], [s.length for s in unary])
        self.wait_served(1)  # the client's one socket, kept open

    def test_steps_posted_without_waiting_equal_unary_ones_read_in_any_order(self):
        # Two micro-batches' Steps in flight at once on one socket (step_batch(wait=False)), read
        # back last first: each answer is kept for its own result().
        client = self.own_client()
        rows = [(self.normal(self.HKV, 7, self.D), self.normal(self.HKV, 7, self.D))
                for _ in range(4)]
        unary = [client.session(k=k, v=v) for k, v in rows]
        posted = [client.session(k=k, v=v) for k, v in rows]
        halves = (posted[:2], posted[2:])
        for step in range(3):
            q = self.normal(4, self.HQ, 1, self.D)
            k = self.normal(4, self.HKV, 1, self.D)
            v = self.normal(4, self.HKV, 1, self.D)
            want = client.step_batch(unary, q, k, v, causal=True)
            first = client.step_batch(halves[0], q[:2], k[:2], v[:2], causal=True, wait=False,
                                      stream="socket")
            second = client.step_batch(halves[1], q[2:], k[2:], v[2:], causal=True, wait=False,
                                       stream="socket")
            got = np.concatenate([second.result(), first.result()][::-1])
            self.assertTrue(np.array_equal(got, want), f"step {step} (seed {SEED})")
        self.assertEqual([s.length for s in posted], [s.length for s in unary])
        # A Step that fails ends the socket: every Step in flight on it raises its failure.
        good = client.step_batch(halves[0], q[:2], k[:2], v[:2], causal=True, wait=False,
                                 stream="socket")
        bad = client.step_batch(halves[1], q[2:, :, :, :-1], k[2:, :, :, :-1],
                                v[2:, :, :, :-1], causal=True, wait=False, stream="socket")
        with self.assertRaises(AttentionError) as e:
            bad.result()
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        try:
            good.result()  # answered before the failure, or refused with it
        except AttentionError as failed:
            self.assertEqual(failed.code, grpc.StatusCode.INVALID_ARGUMENT)
        # The next Step opens another socket.
        o = client.step_batch(halves[0], q[:2], k[:2], v[:2], causal=True, stream="socket")
        self.assertEqual(o.shape, (2, self.HQ, 1, self.D))

    def test_attend_requests_over_a_raw_socket_are_answered_as_attend(self):
        q, k, v = self.qkv(b=1, hq=2, hkv=1, nq=9, nk=13, d=16)
        want = self.client.attend(q, k, v, causal=True)
        raw = RawSocket(self, method=pb.RING_METHOD_ATTEND)
        try:
            raw.send(attend_bytes(q, k, v, causal=True, request_id="raw-1"))
            code, data = raw.frame()
            self.assertIsNone(code, data)
            response = pb.AttendResponse.FromString(data)
            self.assertEqual(response.request_id, "raw-1")
            got = np.frombuffer(response.o.data, np.float32).reshape(q.shape)
            self.assertTrue(np.array_equal(got, want))
            raw.sock.shutdown(socket.SHUT_WR)  # the client's end: OK, then the connection closes
            self.assertEqual(raw.frame(), (0, ""))
            self.assertEqual(raw.sock.recv(1), b"")
            self.assertEqual(raw.call_status(), (grpc.StatusCode.OK, ""))
            self.assertEqual(raw.call.result().requests, 1)
        finally:
            raw.close()

    def test_a_wrong_hello_is_closed_and_the_server_serves_on(self):
        for hello in (b"ATTNSOCX" + os.urandom(NONCE_BYTES),
                      b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 20):
            with self.subTest(hello=hello[:8]):
                sock = socket.create_connection(("127.0.0.1", self.socket_port), timeout=30)
                sock.sendall(hello)
                try:
                    self.assertEqual(sock.recv(64), b"")  # closed, nothing said
                except ConnectionResetError:
                    pass  # closed with the hello's extra bytes unread
                sock.close()
        # A connection with another nonce than the call's leaves the call waiting for its own,
        # which then works.
        raw = RawSocket(self, hello=MAGIC + os.urandom(NONCE_BYTES))
        try:
            good = socket.create_connection(("127.0.0.1", self.socket_port), timeout=30)
            good.sendall(MAGIC + raw.nonce)
            good.shutdown(socket.SHUT_WR)
            raw.sock.close()
            raw.sock = good
            self.assertEqual(raw.frame(), (0, ""))
            self.assertEqual(raw.call_status()[0], grpc.StatusCode.OK)
        finally:
            raw.close()
        self.wait_served(0)

    def test_bad_opens_are_refused_by_name(self):
        stub = pb_grpc.SocketsStub(self.client._channel)
        for request, code, text in (
                (pb.OpenSocketRequest(method=pb.RING_METHOD_STEP, nonce=b"short"),
                 grpc.StatusCode.INVALID_ARGUMENT, "nonce: expected 32 bytes, got 5"),
                (pb.OpenSocketRequest(nonce=os.urandom(NONCE_BYTES)),
                 grpc.StatusCode.INVALID_ARGUMENT,
                 "method: expected RING_METHOD_ATTEND or RING_METHOD_STEP, got "
                 "RING_METHOD_UNSPECIFIED")):
            with self.subTest(text=text):
                with self.assertRaises(grpc.RpcError) as e:
                    stub.Open(request, timeout=30)
                self.assertEqual(e.exception.code(), code)
                self.assertIn(text, e.exception.details())
        # --max_sockets=4: four calls wait for their connections; a fifth is refused.
        nonces = [os.urandom(NONCE_BYTES) for _ in range(4)]
        waiting = [stub.Open.future(pb.OpenSocketRequest(method=pb.RING_METHOD_STEP, nonce=n))
                   for n in nonces]
        try:
            self.wait_served(4)
            with self.assertRaises(grpc.RpcError) as e:
                stub.Open(pb.OpenSocketRequest(method=pb.RING_METHOD_STEP,
                                               nonce=os.urandom(NONCE_BYTES)), timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("at most 4 at once (--max_sockets)", e.exception.details())
        finally:
            for call in waiting:
                call.cancel()
        self.wait_served(0)

    def test_an_open_and_a_connection_that_never_meet_end_within_the_hello_timeout(self):
        # A connection whose nonce no call brings is closed, and a call whose connection never
        # comes ends DEADLINE_EXCEEDED, both after the hello timeout (10 s).
        stray = socket.create_connection(("127.0.0.1", self.socket_port), timeout=30)
        stray.sendall(MAGIC + os.urandom(NONCE_BYTES))
        stub = pb_grpc.SocketsStub(self.client._channel)
        start = time.monotonic()
        with self.assertRaises(grpc.RpcError) as e:
            stub.Open(pb.OpenSocketRequest(method=pb.RING_METHOD_STEP,
                                           nonce=os.urandom(NONCE_BYTES)), timeout=60)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("no connection brought this call's nonce", e.exception.details())
        self.assertLess(time.monotonic() - start, 30)
        self.assertEqual(stray.recv(64), b"")
        stray.close()
        self.wait_served(0)

    def test_a_request_over_the_message_limit_ends_the_stream_before_its_bytes(self):
        raw = RawSocket(self)
        try:
            raw.sock.sendall(LENGTH.pack(17 << 20))  # --max_message_mb=16; no bytes follow
            code, message = raw.frame()
            self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message)
            self.assertIn(f"length {17 << 20} exceeds the server's largest message, "
                          f"{16 << 20} bytes (--max_message_mb)", message)
            self.assertEqual(raw.call_status()[0], grpc.StatusCode.RESOURCE_EXHAUSTED)
        finally:
            raw.close()
        self.wait_served(0)

    def test_a_request_that_does_not_parse_ends_the_stream_invalid_argument(self):
        raw = RawSocket(self)
        try:
            raw.send(b"\xff" * 40)
            code, message = raw.frame()
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT.value[0], message)
            self.assertEqual(raw.call_status()[0], grpc.StatusCode.INVALID_ARGUMENT)
        finally:
            raw.close()

    def test_a_client_that_stops_reading_is_cut_off(self):
        # AttendStream requests whose answers (o as large as q, 2 MiB each) fill the socket's
        # buffers while the client reads none: the answer waiting longer than
        # --socket_stall_timeout_s=1 ends the socket DEADLINE_EXCEEDED.
        q, k, v = self.qkv(b=1, hq=8, hkv=1, nq=1 << 14, nk=8, d=4)
        raw = RawSocket(self, method=pb.RING_METHOD_ATTEND)
        try:
            raw.sock.settimeout(2)
            data = attend_bytes(q, k, v, causal=False)
            try:
                for _ in range(16):
                    raw.send(data)
            except OSError:
                pass  # the server stopped reading (its window is full, or it cut us off)
            code, details = raw.call_status()
            self.assertEqual(code, grpc.StatusCode.DEADLINE_EXCEEDED, details)
            self.assertIn("--socket_stall_timeout_s", details)
        finally:
            raw.close()
        self.wait_served(0)

    def test_a_client_killed_mid_step_leaves_the_server_serving(self):
        caller = textwrap.dedent(f"""
            import numpy as np
            from attention_client import Client
            c = Client("127.0.0.1:{self.port}", timeout=60)
            rng = np.random.default_rng(0)
            b, hq, hkv, d = 4, 8, 2, 32
            sessions = [c.session(k=rng.standard_normal((hkv, 200, d), dtype=np.float32),
                                  v=rng.standard_normal((hkv, 200, d), dtype=np.float32))
                        for _ in range(b)]
            q = rng.standard_normal((b, hq, 1, d), dtype=np.float32)
            k = rng.standard_normal((b, hkv, 1, d), dtype=np.float32)
            for step in range(100000):
                c.step_batch(sessions, q, k, k, causal=True, stream="socket")
                if step == 3:
                    print("running", flush=True)
            """)
        with caller_killed_on_exit(caller):
            self.wait_served(1)
            time.sleep(0.2)  # Steps in flight
        self.wait_served(0)
        client = self.own_client()
        with client.session(k=self.normal(self.HKV, 5, self.D),
                            v=self.normal(self.HKV, 5, self.D)) as s:
            o = client.step_batch([s], self.normal(1, self.HQ, 1, self.D),
                                  self.normal(1, self.HKV, 1, self.D),
                                  self.normal(1, self.HKV, 1, self.D), causal=True,
                                  stream="socket")
        self.assertEqual(o.shape, (1, self.HQ, 1, self.D))


class DrainTest(unittest.TestCase):
    def test_sigterm_ends_a_served_socket_unavailable_and_the_server_exits(self):
        from test_attention_client import TestServer
        server = TestServer(["--socket_port=0", "--shutdown_grace_s=5"])
        rng = np.random.default_rng(SEED)
        with Client(f"127.0.0.1:{server.port}", timeout=60) as client:
            s = client.session(k=rng.standard_normal((2, 5, 16), dtype=np.float32),
                               v=rng.standard_normal((2, 5, 16), dtype=np.float32))
            q = rng.standard_normal((1, 4, 1, 16), dtype=np.float32)
            k = rng.standard_normal((1, 2, 1, 16), dtype=np.float32)
            client.step_batch([s], q, k, k, stream="socket")
            start = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            with self.assertRaises(AttentionError) as e:
                while time.monotonic() - start < 30:
                    client.step_batch([s], q, k, k, stream="socket")
                    time.sleep(0.05)
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn("server is shutting down", e.exception.details)
        server.stop()  # exits 0
        self.assertLess(time.monotonic() - start, 30)


class WithoutSocketsTest(ServerTest):
    def test_a_socket_step_on_a_server_without_sockets_is_unimplemented_by_name(self):
        self.assertEqual(self.client.server_info().socket_port, 0)
        with self.client.session(k=self.normal(2, 3, 16), v=self.normal(2, 3, 16)) as s:
            with self.assertRaises(AttentionError) as e:
                self.client.step_batch([s], self.normal(1, 4, 1, 16), self.normal(1, 2, 1, 16),
                                       self.normal(1, 2, 1, 16), stream="socket")
            self.assertEqual(e.exception.code, grpc.StatusCode.UNIMPLEMENTED)
            self.assertIn("--socket_port", str(e.exception))


if __name__ == "__main__":
    unittest.main()
