"""Packed Steps (StepRequest.session_ids: a layer's whole batch as q [B, Hq, Nq, D] and k, v
[B, Hkv, n, D]) through the Python client against the real attention_server (CPU backend,
--allow_shared_memory): equal bit for bit to the same Steps sent as one entry per session, over
every transport (unary, StepStream, request ring, socket stream) and with tensors by reference in
a shared-memory region; bad buffers refused by name with nothing appended. The request
step_batch writes by hand (q, k, v joined onto the wire from their buffers:
attention_client._wire.WireMessage) parses as the protobuf-built one and is answered bit for bit
alike, its bad buffers are refused by name, and a resend sends its first bytes. Fresh random inputs; the seed is printed.

Run by ctest (label "python"). Exits 77 (skipped) when grpcio or numpy is missing.
"""
import gc
import textwrap
import time
import unittest
from multiprocessing import shared_memory

from test_attention_client import (F32_BOUND, SEED, ServerTest, caller_killed_on_exit,
                                   rel_error)
from test_sessions import session_reference

import grpc
import numpy as np
from attention_client import AttentionError, Client, float32_to_bfloat16_bits
from attention_client._stubs import attention_pb2 as pb
from attention_client._wire import WireMessage


class PackedStepTest(ServerTest):
    SERVER_FLAGS = ["--allow_shared_memory", "--socket_port=0"]
    HQ, HKV, D = 8, 2, 32
    LENGTHS = (1, 17, 64, 3, 130)  # around the CPU kernel's tiles; one row, primes

    def region(self, name):
        """A 1 MiB shared-memory region registered as `name`, released after the test (the
        arrays over it first: an exception's traceback may still hold some)."""
        shm = shared_memory.SharedMemory(create=True, size=1 << 20)

        def release():
            gc.collect()
            shm.close()
            shm.unlink()

        self.addCleanup(release)
        region = self.client.register_shared_memory(name, shm)
        self.addCleanup(region.unregister)
        return region

    def two_batches(self):
        """Two lists of sessions holding the same random K/V (one stepped per entry, one
        packed), and that K/V [B][Hkv, N_b, D]."""
        kv = [(self.normal(self.HKV, n, self.D), self.normal(self.HKV, n, self.D))
              for n in self.LENGTHS]
        batches = [[self.client.session(k=k, v=v) for k, v in kv] for _ in range(2)]
        for batch in batches:
            for s in batch:
                self.addCleanup(s.drop)
        return batches, kv

    def check_equal_to_entries(self, stream, by_ref, wait=True):
        (per_entry, packed), kv = self.two_batches()
        b = len(self.LENGTHS)
        region = None
        if by_ref:
            region = self.region(f"packed-{stream}")
        for step, rows_q in enumerate((1, 1, 2)):  # decode twice, then a two-row extend
            q = self.normal(b, self.HQ, rows_q, self.D)
            k1 = self.normal(b, self.HKV, rows_q, self.D)
            v1 = self.normal(b, self.HKV, rows_q, self.D)
            want = self.client.step_many(
                [(s, q[i], k1[i], v1[i]) for i, s in enumerate(per_entry)], causal=True,
                return_lse=True)
            out = lse_out = None
            if region is not None:
                at = 0
                arrays = []
                for shape in (q.shape, k1.shape, v1.shape, q.shape, q.shape[:3]):
                    arrays.append(region.array(shape, np.float32, offset=at))
                    at += (int(np.prod(shape)) * 4 + 63) // 64 * 64
                for a, x in zip(arrays, (q, k1, v1)):
                    a[...] = x
                q_in, k_in, v_in, out, lse_out = arrays
                out[...] = np.nan  # poisoned: every element must be written
                lse_out[...] = np.nan
            else:
                q_in, k_in, v_in = q, k1, v1
            got = self.client.step_batch(packed, q_in, k_in, v_in, causal=True, return_lse=True,
                                         out=out, lse_out=lse_out, stream=stream,
                                         return_info=True, wait=wait)
            if not wait:
                got = got.result(timeout=60)
            self.assertEqual(got.o.shape, q.shape)
            self.assertEqual(got.lse.shape, q.shape[:3])
            for i in range(b):
                self.assertTrue(np.array_equal(got.o[i], want[i][0]),
                                f"step {step} sequence {i}: o differs (seed {SEED})")
                self.assertTrue(np.array_equal(got.lse[i], want[i][1]),
                                f"step {step} sequence {i}: lse differs (seed {SEED})")
            self.assertEqual(got.lengths, [s.length for s in per_entry])
            self.assertEqual([s.length for s in packed], [s.length for s in per_entry])
            # And right, not only equal: the last sequence against the float64 reference.
            k, v = kv[-1]
            kv[-1] = (np.concatenate([k, k1[-1]], 1), np.concatenate([v, v1[-1]], 1))
            ref_o, _ = session_reference(q[-1], *kv[-1], causal=True)
            self.assertLessEqual(rel_error(got.o[-1], ref_o), F32_BOUND, f"seed {SEED}")
            del got, out, lse_out, q_in, k_in, v_in

    def test_unary_equals_entries(self):
        self.check_equal_to_entries(False, by_ref=False)

    def test_stream_equals_entries(self):
        self.check_equal_to_entries(True, by_ref=False)

    def test_ring_equals_entries(self):
        self.check_equal_to_entries("ring", by_ref=False)

    def test_by_reference_equals_entries(self):
        self.check_equal_to_entries(False, by_ref=True)

    def test_socket_equals_entries(self):
        self.check_equal_to_entries("socket", by_ref=False)

    def test_socket_by_reference_equals_entries(self):
        self.check_equal_to_entries("socket", by_ref=True)

    def test_future_equals_entries(self):
        self.check_equal_to_entries(False, by_ref=False, wait=False)

    def test_sessions_whose_v_is_ks_first_features_step_as_with_that_v_sent(self):
        # MLA's latent cache (Client.session(v_from_k=True)): created, appended and stepped with
        # k alone, a packed Step answers bit for bit what sessions given v = k[..., :Dv] answer;
        # a v sent to them is refused by name.
        d, dv, lengths = self.D + 8, self.D, (1, 17, 64)
        ks = [self.normal(self.HKV, n, d) for n in lengths]
        latent = [self.client.session(k=k, v_head_dim=dv, v_from_k=True) for k in ks]
        given = [self.client.session(k=k, v=np.ascontiguousarray(k[..., :dv])) for k in ks]
        for s in latent + given:
            self.addCleanup(s.drop)
        self.assertTrue(latent[0].v_from_k)
        self.assertEqual((latent[0].head_dim, latent[0].v_head_dim), (d, dv))
        k_more = self.normal(self.HKV, 3, d)
        latent[0].append(k_more)
        given[0].append(k_more, np.ascontiguousarray(k_more[..., :dv]))
        b = len(lengths)
        for step in range(2):
            q = self.normal(b, self.HQ, 1, d)
            k1 = self.normal(b, self.HKV, 1, d)
            got = self.client.step_batch(latent, q, k1, causal=True, return_lse=True)
            want = self.client.step_batch(given, q, k1, np.ascontiguousarray(k1[..., :dv]),
                                          causal=True, return_lse=True)
            self.assertEqual(got[0].shape, (b, self.HQ, 1, dv))
            self.assertTrue(np.array_equal(got[0], want[0]), f"step {step} (seed {SEED})")
            self.assertTrue(np.array_equal(got[1], want[1]), f"step {step} (seed {SEED})")
        with self.assertRaises(AttentionError) as refused:
            self.client.step_batch(latent, q, k1, np.ascontiguousarray(k1[..., :dv]))
        self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("v: expected none", refused.exception.details)
        with self.assertRaisesRegex(ValueError, "v: expected none"):
            latent[1].append(k_more, k_more[..., :dv])

    def test_futures_of_two_micro_batches_in_flight_at_once(self):
        (first, second), _ = self.two_batches()
        b = len(self.LENGTHS)
        q = self.normal(b, self.HQ, 1, self.D)
        k1, v1 = self.normal(b, self.HKV, 1, self.D), self.normal(b, self.HKV, 1, self.D)
        futures = [self.client.step_batch(batch, q, k1, v1, causal=True, wait=False)
                   for batch in (first, second)]
        a, b_out = (f.result(timeout=60) for f in futures)
        self.assertTrue(np.array_equal(a, b_out), f"seed {SEED}")  # the same K/V and inputs
        self.assertEqual([s.length for s in first], [n + 1 for n in self.LENGTHS])
        with self.assertRaises(ValueError):
            self.client.step_batch(first, q, stream=True, wait=False)

    def test_ring_steps_posted_without_waiting(self):
        # Each Step returns once posted; the next post reads the one before's answer, and a
        # failed one raises there (and from its result()), naming what failed.
        (first, second), _ = self.two_batches()
        b = len(self.LENGTHS)
        q = self.normal(b, self.HQ, 1, self.D)
        k1, v1 = self.normal(b, self.HKV, 1, self.D), self.normal(b, self.HKV, 1, self.D)
        posted = [self.client.step_batch(batch, q, k1, v1, causal=True, wait=False,
                                         stream="ring") for batch in (first, second)]
        self.assertIsNone(posted[0].o)  # host tensors: o comes in the answer
        want = self.client.step_batch(first, q, causal=True)  # the unary path, after both
        a, b_out = (p.result() for p in posted)
        self.assertTrue(np.array_equal(a, b_out), f"seed {SEED}")
        self.assertEqual([s.length for s in second], [n + 1 for n in self.LENGTHS])
        again = self.client.step_batch(first, q, causal=True, wait=False, stream="ring")
        self.assertTrue(np.array_equal(again.result(), want), f"seed {SEED}")
        # A Step the server refuses (q's head dim is not the sessions') fails after the call
        # returned.
        wrong = self.normal(b, self.HQ, 1, self.D + 8)
        failed = self.client.step_batch(second, wrong, causal=True, wait=False, stream="ring")
        with self.assertRaises(AttentionError) as e:
            self.client.step_batch(first, q, causal=True, wait=False, stream="ring")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT, e.exception.details)
        self.assertIn("q", e.exception.details)
        with self.assertRaises(AttentionError) as again_failed:
            failed.result()
        self.assertEqual(again_failed.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        # The next Step opens a new ring.
        self.assertTrue(np.array_equal(
            self.client.step_batch(first, q, causal=True, wait=False, stream="ring").result(),
            want), f"seed {SEED}")

    def test_the_hand_encoded_request_is_the_protobuf_built_one(self):
        # step_batch joins q, k and v onto the wire from their buffers (WireMessage); the same
        # Step built through protobuf (each tensor's bytes copied into its message) parses to an
        # equal request, and the server answers the two bit for bit alike, in each dtype the
        # sessions hold, with head fields numbered below the tensors' (layer) and above them (a
        # done_counter, refused by name on a Step in host memory).
        b = len(self.LENGTHS)
        for dtype, bits in (("float32", False), ("bfloat16", True)):
            wire = float32_to_bfloat16_bits if bits else (lambda x: x)
            kv = [(wire(self.normal(self.HKV, n, self.D)), wire(self.normal(self.HKV, n, self.D)))
                  for n in self.LENGTHS]
            hand, built = ([self.client.session(dtype=dtype, kv_heads=self.HKV, head_dim=self.D,
                                                layers=2, bfloat16_bits=bits) for _ in kv]
                           for _ in range(2))
            for pair in zip(hand, built, kv):
                for s in pair[:2]:
                    self.addCleanup(s.drop)
                    for layer in (0, 1):
                        s.append(*pair[2], layer=layer)
            wire_dtype = pb.DTYPE_BFLOAT16 if bits else pb.DTYPE_FLOAT32
            for step in range(2):
                q = wire(self.normal(b, self.HQ, 1, self.D))
                k1, v1 = (wire(self.normal(b, self.HKV, 1, self.D)) for _ in range(2))
                tensors = dict(q=q, k=k1, v=v1)

                def head(sessions):
                    return pb.StepRequest(session_ids=[s.id for s in sessions], causal=True,
                                          return_lse=True, layer=1)
                request = head(built)
                message = WireMessage(head(built))
                for name, x in tensors.items():
                    getattr(request, name).CopyFrom(
                        pb.Tensor(dtype=wire_dtype, shape=x.shape, data=x.tobytes()))
                    message.set_tensor(name, wire_dtype, x.shape, x)
                self.assertEqual(pb.StepRequest.FromString(message.SerializeToString()), request)
                want = self.client._call(self.client._sessions_stub.Step, request, None, None)
                got = self.client.step_batch(hand, q, k1, v1, causal=True, return_lse=True,
                                             layer=1, return_info=True)
                what = f"{dtype} step {step} (seed {SEED})"
                self.assertEqual(got.o.tobytes(), want.o.data, what)
                self.assertEqual(got.lse.tobytes(), want.lse.data, what)
                self.assertEqual(got.lengths, list(want.lengths), what)
            late = WireMessage(head(hand))
            late.head.done_counter.CopyFrom(pb.StreamCounter(
                ref=pb.TensorRef(region="none", byte_size=8), value=1))
            late.set_tensor("q", wire_dtype, q.shape, q)
            self.assertRefused(lambda: self.client._call(self.client._step, late, None, None),
                               "ready_counter, done_counter")

    def test_hand_encoded_bad_buffers_are_refused_by_name(self):
        # q's bytes one element short of its shape, and a message cut inside q's bytes.
        (sessions, _), _ = self.two_batches()
        q = self.normal(len(sessions), self.HQ, 1, self.D)
        short = WireMessage(pb.StepRequest(session_ids=[s.id for s in sessions]))
        short.set_tensor("q", pb.DTYPE_FLOAT32, q.shape, q.reshape(-1)[:-1])
        self.assertRefused(lambda: self.client._call(self.client._step, short, None, None),
                           "q.data", f"expected {q.nbytes} bytes", f"got {q.nbytes - 4}")
        whole = WireMessage(pb.StepRequest(session_ids=[s.id for s in sessions]))
        whole.set_tensor("q", pb.DTYPE_FLOAT32, q.shape, q)
        cut = self.client._channel.unary_unary("/attention.v1.Sessions/Step")
        self.assertRefused(lambda: self.client._call(cut, whole.SerializeToString()[:-10], None,
                                                     None), "q: undecodable bytes", "truncated")
        self.assertEqual([s.info().length for s in sessions], list(self.LENGTHS))

    def test_a_hand_encoded_request_sent_again_sends_its_first_bytes(self):
        # A call sent again after it returned (a sealed session's retry of wait=False) sends what
        # it first sent, though the caller has since reused its buffers.
        q = self.normal(2, self.HQ, 1, self.D)
        message = WireMessage(pb.StepRequest(session_ids=["a", "b"]))
        message.set_tensor("q", pb.DTYPE_FLOAT32, q.shape, q)
        first = message.SerializeToString()
        self.assertEqual(message.ByteSize(), len(first))
        sent = q.tobytes()
        q[...] = 0
        self.assertEqual(message.SerializeToString(), first)
        self.assertEqual(pb.StepRequest.FromString(first).q.data, sent)

    def assertRefused(self, call, *words):
        with self.assertRaises(AttentionError) as e:
            call()
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT, e.exception.details)
        for word in words:
            self.assertIn(word, e.exception.details)

    def test_bad_buffers_are_refused_by_name_and_append_nothing(self):
        (sessions, _), _ = self.two_batches()
        b, hq, hkv, d = len(sessions), self.HQ, self.HKV, self.D
        lengths = [s.length for s in sessions]
        q, k1, v1 = (self.normal(b, hq, 1, d), self.normal(b, hkv, 1, d),
                     self.normal(b, hkv, 1, d))
        step = self.client.step_batch
        self.assertRefused(lambda: step(sessions, q[1:], k1, v1), "q.shape[0] (batch)",
                           f"expected {b}", f"got {b - 1}")
        self.assertRefused(lambda: step(sessions, q, k1[:, :1], v1[:, :1]), "k.shape[1] (kv heads)")
        self.assertRefused(lambda: step(sessions, q, k1, self.normal(b, hkv, 2, d)),
                           "v.shape[2] (rows)", "(as k)")
        self.assertRefused(lambda: step(sessions, q[:, :3], k1, v1), "q.shape[1] (query heads)")
        self.assertRefused(lambda: step(sessions + sessions[:1], np.concatenate([q, q[:1]]),
                                        np.concatenate([k1, k1[:1]]),
                                        np.concatenate([v1, v1[:1]])),
                           f"session_ids[{b}]", "at most once")
        with self.client.session(k=self.normal(hkv, 4, 2 * d), v=self.normal(hkv, 4, 2 * d)) as other:
            self.assertRefused(lambda: step(sessions[:1] + [other], q[:2]), "session_ids[1]",
                               "head dim 64")
        self.assertRefused(lambda: step(sessions, self.normal(b, hq, 3, d)), "q.shape[2] (queries)")
        # Outputs that overlap inputs or each other, in a region.
        region = self.region("packed-bad")
        q_in = region.array(q.shape, np.float32, offset=0)
        q_in[...] = q
        lse_at = q.nbytes + 4096
        self.assertRefused(lambda: step(sessions, q_in, out=q_in), "o_ref", "overlap q")
        out = region.array(q.shape, np.float32, offset=lse_at)
        lse_over_o = region.array(q.shape[:3], np.float32, offset=lse_at)
        self.assertRefused(lambda: step(sessions, q_in, return_lse=True, out=out,
                                        lse_out=lse_over_o), "lse_ref", "o_ref")
        # Stream order is for Steps in CUDA regions: events on a Step in host memory are refused
        # by name (and on a Step of entries, which CUDA memory never serves).
        handle = bytes(64)
        self.assertRefused(lambda: step(sessions, q, k1, v1, ready_event=handle),
                           "ready_event, done_event", "in host memory")
        self.assertRefused(lambda: step(sessions, q_in, done_event=handle),
                           "ready_event, done_event", "in host memory")
        with self.assertRaises(AttentionError) as refused:
            self.client._call(self.client._sessions_stub.Step, pb.StepRequest(
                entries=[pb.StepEntry(session_id=sessions[0].id, q=pb.Tensor(
                    dtype=pb.DTYPE_FLOAT32, shape=[hq, 1, d], data=q[0].tobytes()))],
                ready_event=handle), None, None)
        self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("on a Step of entries", refused.exception.details)
        # So are counters (here in a system region, which the GPU's stream cannot wait on).
        counter = pb.StreamCounter(ref=pb.TensorRef(region=region.name, offset=lse_at,
                                                    byte_size=8), value=1)
        packed_q = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, hq, 1, d], data=q[0].tobytes())
        for field in ("ready_counter", "done_counter"):
            with self.assertRaises(AttentionError) as refused:
                self.client._call(self.client._sessions_stub.Step, pb.StepRequest(
                    session_ids=[sessions[0].id], q=packed_q, **{field: counter}), None, None)
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("ready_counter, done_counter", refused.exception.details)
            self.assertIn("in host memory", refused.exception.details)
        self.assertEqual([s.length for s in sessions], lengths)
        del q_in, out, lse_over_o

    def test_a_dropped_session_in_a_batch_stepped_before_is_refused_by_the_client(self):
        # The client keeps the ids of the batches it stepped (a model names the same batch in
        # every layer call); a drop forgets them, so the same list is checked again.
        sessions = [self.client.session(k=self.normal(self.HKV, 3, self.D),
                                        v=self.normal(self.HKV, 3, self.D)) for _ in range(3)]
        q = self.normal(3, self.HQ, 1, self.D)
        self.client.step_batch(sessions, q)
        sessions[1].drop()
        for s in (sessions[0], sessions[2]):
            self.addCleanup(s.drop)
        with self.assertRaises(AttentionError) as refused:
            self.client.step_batch(sessions, q)
        self.assertEqual(refused.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("dropped", refused.exception.details)
        other = Client(f"127.0.0.1:{self.port}")
        self.addCleanup(other.close)
        with self.assertRaises(ValueError):  # another Client's sessions, even a batch seen before
            other.step_batch(sessions[:1], q[:1])

    def test_regions_of_another_client_are_not_found(self):
        """A packed Step's reference into a region another client (another connection, no token)
        registered is NOT_FOUND naming the field, and appends nothing, unary or on a socket.
        (Channels of one process with equal options share a connection, so the other client asks
        for its own.)"""
        region = self.region("packed-theirs")
        b, hq, hkv, d = 2, self.HQ, self.HKV, self.D
        q = region.array((b, hq, 1, d), np.float32)
        q[...] = self.normal(b, hq, 1, d)
        with Client(f"127.0.0.1:{self.port}", timeout=60,
                    options=[("grpc.use_local_subchannel_pool", 1)]) as other:
            mine = [other.session(k=self.normal(hkv, 5, d), v=self.normal(hkv, 5, d))
                    for _ in range(b)]
            request = pb.StepRequest(session_ids=[s.id for s in mine], q=pb.Tensor(
                dtype=pb.DTYPE_FLOAT32, shape=list(q.shape), ref=region.ref(0, q.nbytes)))
            from attention_client.session import _send_step
            for stream in (False, "socket"):  # a socket's requests are its Open call's caller's
                with self.assertRaises(AttentionError) as refused:
                    _send_step(other, request, stream, None, None)
                self.assertEqual(refused.exception.code, grpc.StatusCode.NOT_FOUND, stream)
                self.assertIn("q.ref", refused.exception.details)
            self.assertEqual([s.info().length for s in mine], [5, 5])
            for s in mine:
                s.drop()
        del q


class PackedStepCallerDiesTest(ServerTest):
    """A caller killed in the middle of its packed Steps (through its request ring, by reference
    in its region) leaks nothing: its sessions expire and give back every page, and the server
    serves the next caller."""
    SERVER_FLAGS = ["--allow_shared_memory", "--session_ttl_s=1"]

    def test_a_caller_killed_mid_step_leaks_no_page(self):
        listed = self.client.list_sessions()
        self.assertEqual(listed.pages_free, listed.pages_total)
        caller = textwrap.dedent(f"""
            import numpy as np
            from multiprocessing import shared_memory
            from attention_client import Client
            c = Client("127.0.0.1:{self.port}", timeout=60)
            rng = np.random.default_rng(0)
            b, hq, hkv, d = 8, 8, 2, 32
            sessions = [c.session(k=rng.standard_normal((hkv, 300, d), dtype=np.float32),
                                  v=rng.standard_normal((hkv, 300, d), dtype=np.float32))
                        for _ in range(b)]
            shm = shared_memory.SharedMemory(create=True, size=1 << 20)
            region = c.register_shared_memory("dying", shm)
            q = region.array((b, hq, 1, d), np.float32)
            k = region.array((b, hkv, 1, d), np.float32, offset=1 << 16)
            v = region.array((b, hkv, 1, d), np.float32, offset=2 << 16)
            o = region.array((b, hq, 1, d), np.float32, offset=3 << 16)
            for step in range(100000):
                for a in (q, k, v):
                    a[...] = rng.standard_normal(a.shape)
                c.step_batch(sessions, q, k, v, causal=True, out=o, stream="ring")
                if step == 3:
                    print("running", flush=True)
            """)
        with caller_killed_on_exit(caller):
            time.sleep(0.3)  # Steps in flight
        deadline = time.monotonic() + 30
        while True:
            listed = self.client.list_sessions()
            if listed.pages_free == listed.pages_total or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual(listed.pages_free, listed.pages_total,
                         "the killed caller's pages were not all given back")
        with self.client.session(k=self.normal(2, 4, 32), v=self.normal(2, 4, 32)) as s:
            o = self.client.step_batch([s], self.normal(1, 8, 1, 32), self.normal(1, 2, 1, 32),
                                       self.normal(1, 2, 1, 32), causal=True)
            self.assertEqual(o.shape, (1, 8, 1, 32))
            self.assertEqual(s.length, 5)


if __name__ == "__main__":
    print(f"python_packed_steps: seed {SEED}", flush=True)
    unittest.main()
