"""Sessions moved between two real attention_servers (CPU backend): Sessions.Export on one,
Sessions.Import on the other, through the Python client (Session.export, Client.import_session,
Session.move_to).

An imported session equals the exported one bit for bit: the exported rows are the rows appended
(raw bytes compared), and the same Steps on both servers give the same bytes. Sessions of several
layers, after fork and truncate, of float32, float16 and bfloat16 rows; every refusal of Import
names its field and leaves no session and no pages behind, as does a cancelled import. An Export
with seal leaves the session refusing AppendKv, Step, Truncate and Fork UNAVAILABLE by name (the
client retrying until its deadline), still exportable and droppable; one without changes nothing.
Inputs are
fresh random each run; the seed is printed, and a failure message repeats it.

Run by ctest (label "python") like test_attention_client.py. Exits 77 (skipped) when grpcio or
numpy is missing.
"""
import threading
import time
import unittest

from test_attention_client import SEED, ServerTest, TestServer

import grpc
import numpy as np
from attention_client._stubs import attention_pb2 as pb
from attention_client import AttentionError, Client, float32_to_bfloat16_bits

# (dtype name, numpy dtype of the wire bytes, rows of it from float32).
DTYPES = [("float32", np.float32, lambda x: x), ("float16", np.float16,
                                                 lambda x: x.astype(np.float16)),
          ("bfloat16", np.uint16, float32_to_bfloat16_bits)]
WIRE = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_FLOAT16: np.float16, pb.DTYPE_BFLOAT16: np.uint16}


def exported_rows(chunks):
    """The header and each layer's k [Hkv, N, D] and v [Hkv, N, Dv] (raw: bfloat16 as uint16
    bits) of an export's chunks, checking their order on the way."""
    header = chunks[0].header
    headers = [c.HasField("header") for c in chunks]
    assert headers == [True] + [False] * (len(chunks) - 1), headers
    layers = max(1, header.layers)
    dv = header.v_head_dim or header.head_dim
    k = [np.zeros((header.kv_heads, 0, header.head_dim), WIRE[header.dtype]) for _ in range(layers)]
    v = [np.zeros((header.kv_heads, 0, dv), WIRE[header.dtype]) for _ in range(layers)]
    for c in chunks[1:]:
        assert c.first_row == k[c.layer].shape[1], (c.layer, c.first_row)
        for out, t in ((k, c.k), (v, c.v)):
            rows = np.frombuffer(t.data, WIRE[t.dtype]).reshape(tuple(t.shape))
            out[c.layer] = np.concatenate([out[c.layer], rows], axis=1)
    return header, k, v


class SessionTransferTest(ServerTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.peer_server = TestServer()
        cls.peer = Client(f"127.0.0.1:{cls.peer_server.port}", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.peer.close()
        cls.peer_server.stop()
        super().tearDownClass()

    def tearDown(self):
        # Nothing left behind on either server: no session and every page free.
        for client in (self.client, self.peer):
            for info in client.list_sessions().sessions:
                client._sessions_stub.DropSession(pb.DropSessionRequest(session_id=info.session_id))
        self.assertEmpty(self.peer)

    def assertEmpty(self, client):
        deadline = time.monotonic() + 10
        while True:
            listed = client.list_sessions()
            if (not listed.sessions and listed.pages_free == listed.pages_total) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.assertEqual([s.session_id for s in listed.sessions], [])
        self.assertEqual(listed.pages_free, listed.pages_total)

    def assertSame(self, a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        self.assertEqual(a.dtype, b.dtype, what)
        self.assertTrue(np.array_equal(a.view(np.uint8), b.view(np.uint8)),
                        f"{what}: not equal bit for bit (seed {SEED})")

    def rows(self, convert, hkv, n, d):
        return (convert(self.rng.standard_normal((hkv, n, d)).astype(np.float32)),
                convert(self.rng.standard_normal((hkv, n, d)).astype(np.float32)))

    def test_import_equals_the_export_bit_for_bit_in_every_dtype(self):
        hq, hkv, d = 8, 2, 64
        for name, _, convert in DTYPES:
            with self.subTest(dtype=name):
                bits = name == "bfloat16"
                k, v = self.rows(convert, hkv, 150, d)
                with self.client.session(k=k, v=v, bfloat16_bits=bits) as s:
                    k1, v1 = self.rows(convert, hkv, 9, d)
                    s.append(k1, v1)
                    k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
                    chunks = list(s.export(chunk_rows=16))
                    self.assertEqual(len(chunks), 1 + 10)  # the header, then 159 rows by 16
                    header, ek, ev = exported_rows(chunks)
                    self.assertEqual((header.session_id, header.kv_heads, header.head_dim,
                                      list(header.layer_lengths)), (s.id, hkv, d, [159]))
                    self.assertSame(ek[0], k, f"{name}: exported k")
                    self.assertSame(ev[0], v, f"{name}: exported v")
                    with self.peer.import_session(chunks, bfloat16_bits=bits) as t:
                        self.assertEqual((t.id, t.length, t.dtype), (s.id, 159, header.dtype))
                        # The same Steps on both: an extend step, then a decode step.
                        for nq in (5, 1):
                            q = self.rows(convert, hq, nq, d)[0]
                            k2, v2 = self.rows(convert, hkv, nq, d)
                            o_s, lse_s = s.step(q, k2, v2, causal=True, return_lse=True)
                            o_t, lse_t = t.step(q, k2, v2, causal=True, return_lse=True)
                            self.assertSame(o_t, o_s, f"{name}: o after {nq} queries")
                            self.assertSame(lse_t, lse_s, f"{name}: lse after {nq} queries")
                        self.assertEqual(t.length, s.length)

    def test_a_session_of_its_own_v_head_dim_moves_bit_for_bit(self):
        # MLA's expanded cache (QK 192, V 128): the header names v_head_dim, v comes as
        # [Hkv, n, Dv], and the imported session steps as the exported one.
        hq, hkv, d, dv = 4, 2, 192, 128
        k = self.rng.standard_normal((hkv, 70, d)).astype(np.float32)
        v = self.rng.standard_normal((hkv, 70, dv)).astype(np.float32)
        with self.client.session(k=k, v=v) as s:
            chunks = list(s.export(chunk_rows=32))
            header, ek, ev = exported_rows(chunks)
            self.assertEqual((header.head_dim, header.v_head_dim), (d, dv))
            self.assertSame(ek[0], k, "exported k")
            self.assertSame(ev[0], v, "exported v")
            with self.peer.import_session(chunks) as t:
                self.assertEqual((t.length, t.head_dim, t.v_head_dim), (70, d, dv))
                for nq in (3, 1):
                    q = self.rng.standard_normal((hq, nq, d)).astype(np.float32)
                    k1 = self.rng.standard_normal((hkv, nq, d)).astype(np.float32)
                    v1 = self.rng.standard_normal((hkv, nq, dv)).astype(np.float32)
                    o_s = s.step(q, k1, v1, causal=True)
                    o_t = t.step(q, k1, v1, causal=True)
                    self.assertEqual(o_t.shape, (hq, nq, dv))
                    self.assertSame(o_t, o_s, f"o after {nq} queries")

    def test_move_a_session_of_several_layers(self):
        hq, hkv, d, layers = 4, 2, 32, 3
        convert = DTYPES[0][2]
        s = self.client.session(dtype="float32", kv_heads=hkv, head_dim=d, layers=layers)
        appended = []
        for layer, n in enumerate((40, 0, 77)):  # layer 1 stays empty
            k, v = self.rows(convert, hkv, n, d)
            if n:
                s.append(k, v, layer=layer)
            appended.append((k, v))
        header, ek, ev = exported_rows(list(s.export(chunk_rows=30)))
        self.assertEqual((header.layers, list(header.layer_lengths)), (layers, [40, 0, 77]))
        for layer, (k, v) in enumerate(appended):
            self.assertSame(ek[layer], k, f"layer {layer} k")
            self.assertSame(ev[layer], v, f"layer {layer} v")
        q = self.rows(convert, hq, 1, d)[0]
        before = [s.step(q, layer=layer) for layer in (0, 2)]
        old_id = s.id
        with s.move_to(self.peer, chunk_rows=7) as moved:
            self.assertEqual(s.id, "")  # dropped on its old server
            self.assertNotIn(old_id, [i.session_id for i in self.client.list_sessions().sessions])
            self.assertEqual((moved.id, moved.layers, moved.layer_lengths),
                             (old_id, layers, [40, 0, 77]))
            for layer, o in zip((0, 2), before):
                self.assertSame(moved.step(q, layer=layer), o, f"layer {layer}: o")

    def test_sessions_after_fork_and_truncate(self):
        hq, hkv, d = 4, 1, 64
        convert = DTYPES[1][2]
        k, v = self.rows(convert, hkv, 100, d)
        with self.client.session(k=k, v=v) as s, s.fork(70) as child:
            s.truncate(40)
            k1, v1 = self.rows(convert, hkv, 5, d)
            child.append(k1, v1)
            expected = {s.id: (k[:, :40], v[:, :40]),
                        child.id: (np.concatenate([k[:, :70], k1], axis=1),
                                   np.concatenate([v[:, :70], v1], axis=1))}
            for source in (s, child):
                chunks = list(source.export())
                _, ek, ev = exported_rows(chunks)
                self.assertSame(ek[0], expected[source.id][0], "exported k")
                self.assertSame(ev[0], expected[source.id][1], "exported v")
                # Under a new id of the peer's making.
                with self.peer.import_session(chunks, session_id="") as t:
                    self.assertNotEqual(t.id, source.id)
                    self.assertEqual(t.length, source.length)
                    q = self.rows(convert, hq, 3, d)[0]
                    self.assertSame(t.step(q, causal=True), source.step(q, causal=True), "o")

    def header(self, lengths, dtype=pb.DTYPE_FLOAT32, session_id=""):
        return pb.SessionChunk(header=pb.SessionHeader(
            session_id=session_id, dtype=dtype, kv_heads=2, head_dim=16, layers=len(lengths),
            layer_lengths=lengths))

    def chunk(self, layer, first_row, n, dtype=pb.DTYPE_FLOAT32):
        data = self.rng.standard_normal((2, n, 16)).astype(WIRE[dtype] if dtype != pb.DTYPE_BFLOAT16
                                                           else np.float32)
        t = pb.Tensor(dtype=dtype, shape=[2, n, 16], data=data.tobytes())
        return pb.SessionChunk(layer=layer, first_row=first_row, k=t, v=t)

    def assertRefused(self, chunks, code, pattern):
        with self.assertRaises(AttentionError) as raised:
            self.peer.import_session(chunks)
        self.assertEqual(raised.exception.code, code, raised.exception.details)
        self.assertRegex(raised.exception.details, pattern)
        self.assertEmpty(self.peer)

    def test_refusals_leave_nothing_behind(self):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        h = self.header
        self.assertRefused([self.chunk(0, 0, 3)], invalid, "^header: expected the session's header")
        self.assertRefused([], invalid, "^header:")
        self.assertRefused([h([3], dtype=pb.DTYPE_FLOAT32), self.chunk(0, 0, 3, pb.DTYPE_FLOAT16)],
                           invalid, r"^k\.dtype: expected DTYPE_FLOAT32 .*got DTYPE_FLOAT16")
        self.assertRefused([h([3]), self.chunk(0, 0, 4)], invalid,
                           r"^k\.shape: expected 1\.\.3 rows .*got 4")
        self.assertRefused([h([3]), self.chunk(0, 0, 2), self.chunk(0, 1, 1)], invalid,
                           "^first_row: expected 2 .*got 1")
        self.assertRefused([h([3, 2]), self.chunk(1, 0, 2)], invalid,
                           r"^layer: expected 0 \(layers in order")
        self.assertRefused([h([3, 2]), self.chunk(0, 0, 3), self.chunk(2, 0, 1)], invalid,
                           r"^layer: expected 0\.\.1 .*got 2")
        self.assertRefused([h([3, 2]), self.chunk(0, 0, 3), self.chunk(1, 0, 1)], invalid,
                           "^stream: expected every declared row before the end, got 1 of layer 1")
        self.assertRefused([h([2]), self.chunk(0, 0, 2), h([2])], invalid,
                           "^header: expected it in the first message only")
        self.assertRefused([h([2], session_id="not-an-id")], invalid, "^header.session_id:")
        self.assertRefused([h([2, 2]), pb.SessionChunk(layer=0, first_row=0)], invalid,
                           "^k: expected a tensor")
        self.assertRefused([h([1, 2], dtype=pb.DTYPE_FLOAT8_E4M3)],
                           grpc.StatusCode.UNIMPLEMENTED, "^header.dtype:")
        self.assertRefused([pb.SessionChunk(header=pb.SessionHeader(
            dtype=pb.DTYPE_FLOAT32, kv_heads=2, head_dim=16, layers=2, layer_lengths=[1]))],
                           invalid, "^header.layer_lengths: expected 2 lengths")
        # An id that exists: ALREADY_EXISTS, and the session there is untouched.
        with self.peer.session(dtype="float32", kv_heads=2, head_dim=16) as there:
            with self.assertRaises(AttentionError) as raised:
                self.peer.import_session([h([2], session_id=there.id), self.chunk(0, 0, 2)])
            self.assertEqual(raised.exception.code, grpc.StatusCode.ALREADY_EXISTS)
            self.assertRegex(raised.exception.details, "^session_id: expected an id no session has")
            self.assertEqual(there.info().length, 0)

    def test_export_refusals(self):
        with self.client.session(dtype="float32", kv_heads=2, head_dim=16) as s:
            with self.assertRaises(AttentionError) as raised:
                list(s.export(chunk_rows=1 << 40))
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertRegex(raised.exception.details, r"^chunk_rows: expected 0\.\.\d+ ")
        with self.assertRaises(AttentionError) as raised:
            s.id = "0" * 32  # an id of no session of the caller's
            list(s.export())
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEmpty(self.client)

    def test_an_export_reads_the_session_as_it_was_when_it_started(self):
        convert = DTYPES[0][2]
        k, v = self.rows(convert, 2, 50, 16)
        with self.client.session(k=k, v=v) as s:
            export = s.export(chunk_rows=8)
            chunks = [next(export)]  # the header: the snapshot is taken
            self.assertEqual(list(chunks[0].header.layer_lengths), [50])
            s.truncate(3)  # the session changes meanwhile; the export does not
            k1, v1 = self.rows(convert, 2, 60, 16)
            s.append(k1, v1)
            chunks += list(export)
            _, ek, ev = exported_rows(chunks)
            self.assertSame(ek[0], k, "exported k")
            self.assertSame(ev[0], v, "exported v")
            self.assertEqual(s.info().length, 63)
            # Only the session is left: the export's snapshot went with it.
            self.assertEqual([i.session_id for i in self.client.list_sessions().sessions], [s.id])

    def test_a_sealed_export_refuses_changes_until_dropped(self):
        # An Export with seal: the session refuses every call that would change it or read rows
        # for its new owner, UNAVAILABLE naming it; Export again, ListSessions and DropSession
        # still work. An Export without seal changes nothing.
        from attention_client.client import SEALED_MARKER, _to_tensor
        convert = DTYPES[0][2]
        k, v = self.rows(convert, 2, 20, 16)
        k1, v1 = self.rows(convert, 2, 1, 16)
        q = self.rng.standard_normal((4, 1, 16)).astype(np.float32)
        stub = self.client._sessions_stub
        with self.client.session(k=k, v=v) as s:
            _, ek, _ = exported_rows(list(s.export(chunk_rows=8)))  # no seal
            self.assertSame(ek[0], k, "exported k")
            self.assertEqual(s.append(k1, v1), 21)
            s.step(q, causal=True)
            self.assertEqual(s.truncate(20), 20)
            with s.fork():
                pass
            _, ek, _ = exported_rows(list(s.export(chunk_rows=8, seal=True)))
            self.assertSame(ek[0], k, "sealed export's k")
            tk, tv = _to_tensor(k1, "k", False)[0], _to_tensor(v1, "v", False)[0]
            calls = {
                "AppendKv": lambda: stub.AppendKv(pb.AppendKvRequest(session_id=s.id, k=tk, v=tv)),
                "Step": lambda: stub.Step(pb.StepRequest(entries=[pb.StepEntry(
                    session_id=s.id, q=_to_tensor(q, "q", False)[0])])),
                "Step with k, v": lambda: stub.Step(pb.StepRequest(entries=[pb.StepEntry(
                    session_id=s.id, q=_to_tensor(q, "q", False)[0], k=tk, v=tv)])),
                "Truncate": lambda: stub.Truncate(pb.TruncateRequest(session_id=s.id, length=1)),
                "Fork": lambda: stub.Fork(pb.ForkRequest(session_id=s.id)),
            }
            for name, call in calls.items():
                with self.assertRaises(grpc.RpcError, msg=name) as raised:
                    call()
                self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAVAILABLE, name)
                self.assertTrue(raised.exception.details().startswith(
                    f"{SEALED_MARKER}session '{s.id}' was sealed by an Export for a move to "
                    "another replica"), f"{name}: {raised.exception.details()}")
            # The client retries the refusal while the next wait (10, 20, 40, 80 ms) fits the
            # call's deadline, then raises it.
            started = time.monotonic()
            with self.assertRaises(AttentionError) as raised:
                s.append(k1, v1, timeout=0.3)
            self.assertGreaterEqual(time.monotonic() - started, 0.15)
            self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn(SEALED_MARKER, raised.exception.details)
            # Nothing changed it: it exports the same rows again, and lists as it was.
            _, ek, ev = exported_rows(list(s.export(chunk_rows=8)))
            self.assertSame(ek[0], k, "k exported again")
            self.assertEqual(s.info().length, 20)
        self.assertEmpty(self.client)  # dropped

    def test_an_empty_session_moves(self):
        with self.client.session(dtype="bfloat16", kv_heads=4, head_dim=8) as s:
            chunks = list(s.export())
            self.assertEqual(len(chunks), 1)
            with self.peer.import_session(chunks) as t:
                self.assertEqual((t.length, t.kv_heads, t.head_dim, t.dtype),
                                 (0, 4, 8, pb.DTYPE_BFLOAT16))

    def test_cancelled_import_and_abandoned_export_leave_nothing(self):
        k, v = self.rows(DTYPES[0][2], 2, 64, 16)
        with self.client.session(k=k, v=v) as s:
            chunks = list(s.export(chunk_rows=8))
            # An abandoned export: its snapshot goes with it.
            export = s.export(chunk_rows=8)
            next(export)
            next(export)
            export.close()
            deadline = time.monotonic() + 10
            while len(self.client.list_sessions().sessions) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual([i.session_id for i in self.client.list_sessions().sessions], [s.id])
            # An import cancelled halfway: the session it made goes, with its pages.
            release = threading.Event()

            def halfway():
                yield from chunks[:4]
                release.wait(30)

            call = self.peer._sessions_stub.Import.future(halfway(), timeout=60)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                listed = self.peer.list_sessions().sessions
                if listed and listed[0].length == 24:
                    break
                time.sleep(0.05)
            self.assertEqual([(i.session_id, i.length) for i in listed], [(s.id, 24)])
            call.cancel()
            release.set()
            with self.assertRaises(grpc.FutureCancelledError):
                call.result()
            self.assertEmpty(self.peer)


if __name__ == "__main__":
    print(f"python_session_transfer: seed {SEED}", flush=True)
    unittest.main()
