"""Tensors in shared memory and Steps over one StepStream through the Python client
(client/python) against the real attention_server (CPU backend, --allow_shared_memory).

Inputs in a multiprocessing.shared_memory region, outputs written by the server into the region
(out=, lse_out=), compared with the numpy float64 reference; a bad output array is refused before
anything is sent; Steps over StepStream match the reference, and a Step on a dropped session
raises NOT_FOUND and the next Step opens a new stream; a Step naming the tokens of rows by
reference is refused by name. Fresh random inputs; the seed is printed.

Run by ctest (label "python"). Exits 77 (skipped) when grpcio or numpy is missing.
"""
import unittest
from multiprocessing import shared_memory

from test_attention_client import F32_BOUND, SEED, ServerTest, lse_error, reference, rel_error

import grpc
import numpy as np
from attention_client import AttentionError
from attention_client._stubs import attention_pb2 as pb


class SharedMemoryTest(ServerTest):
    SERVER_FLAGS = ["--allow_shared_memory"]

    def setUp(self):
        self.shm = shared_memory.SharedMemory(create=True, size=4 << 20)
        self.addCleanup(self.shm.unlink)
        self.addCleanup(self.shm.close)

    def test_attend_reads_and_writes_the_region(self):
        q0, k0, v0 = self.qkv(b=2, hq=4, hkv=2, nq=37, nk=53, d=32)
        region = self.client.register_shared_memory("py-attend", self.shm)
        try:
            self.assertEqual(region.kind, "system")
            self.assertEqual([r.name for r in self.client.list_shared_memory()], ["py-attend"])
            at = 0
            arrays = []
            for x in (q0, k0, v0, q0):  # q, k, v, then o's room
                a = region.array(x.shape, np.float32, offset=at)
                a[...] = x
                arrays.append(a)
                at += x.nbytes
            q, k, v, out = arrays
            out[...] = np.nan  # poisoned: every element must be written
            lse_out = region.array(q.shape[:3], np.float32, offset=at)
            lse_out[...] = np.nan
            o, lse = self.client.attend(q, k, v, causal=True, return_lse=True, out=out,
                                        lse_out=lse_out)
            self.assertIs(o, out)
            self.assertIs(lse, lse_out)
            ref_o, ref_lse = reference(q0, k0, v0, causal=True)
            self.assertWithin(rel_error(out, ref_o), F32_BOUND, "o in shared memory")
            self.assertWithin(lse_error(lse_out, ref_lse), F32_BOUND, "lse in shared memory")
            # Inputs by reference, output inline.
            o2 = self.client.attend(q, k, v)
            self.assertWithin(rel_error(o2, reference(q0, k0, v0)[0]), F32_BOUND, "inline o")
        finally:
            region.unregister()
        self.assertEqual(len(self.client.list_shared_memory()), 0)

    def test_out_must_lie_in_a_region(self):
        q, k, v = self.qkv(b=1, hq=1, hkv=1, nq=4, nk=4, d=8)
        with self.assertRaises(ValueError):
            self.client.attend(q, k, v, out=np.empty_like(q))

    def test_unknown_region_and_duplicate_names(self):
        region = self.client.register_shared_memory("py-dup", self.shm)
        try:
            with self.assertRaises(AttentionError) as e:
                self.client.register_shared_memory("py-dup", self.shm)
            self.assertEqual(e.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        finally:
            region.unregister()
        with self.assertRaises(AttentionError) as e:
            region.unregister()
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

    def steps_match_the_reference(self, s, k, v, steps, stream):
        """`steps` Steps of session `s` (whose rows are k, v) appending a row each, sent with
        `stream`, against the reference; the rows afterwards."""
        hq, (hkv, _, d) = 4, k.shape
        for step in range(steps):
            q = self.normal(hq, 1, d)
            k1, v1 = self.normal(hkv, 1, d), self.normal(hkv, 1, d)
            k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
            r = s.step(q, k1, v1, causal=True, return_lse=True, stream=stream, return_info=True)
            self.assertEqual(r.length, k.shape[1])
            ref_o, ref_lse = reference(q[None], k[None], v[None], causal=True)
            self.assertWithin(rel_error(r.o, ref_o[0]), F32_BOUND, f"{stream} step {step} o")
            self.assertWithin(lse_error(r.lse, ref_lse[0]), F32_BOUND, f"{stream} step {step} lse")
        return k, v

    def test_steps_over_one_stream_match_the_reference(self):
        hq, hkv, d = 4, 2, 32
        k, v = self.normal(hkv, 21, d), self.normal(hkv, 21, d)
        with self.client.session(k=k, v=v) as s:
            k, v = self.steps_match_the_reference(s, k, v, 20, True)
            # The test's server has no --replica_name: the stream of owner "".
            first_stream = self.client._step_streams.get("")
            self.assertIsNotNone(first_stream)
            # Dropped behind the object's back: its Step on the stream is NOT_FOUND, which ends
            # that stream; the next Step opens another.
            self.client._call(self.client._sessions_stub.DropSession,
                              pb.DropSessionRequest(session_id=s.id), None, None)
            with self.assertRaises(AttentionError) as e:
                s.step(self.normal(hq, 1, d), stream=True)
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.client.session(k=k, v=v) as s2:
            q = self.normal(hq, 1, d)
            o = s2.step(q, causal=True, stream=True)
            ref_o = reference(q[None], k[None], v[None], causal=True)[0][0]
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o after a new stream")
            self.assertIsNot(self.client._step_streams.get(""), first_stream)

    def test_steps_over_a_request_ring_match_the_reference(self):
        hq, hkv, d = 4, 2, 32
        k, v = self.normal(hkv, 13, d), self.normal(hkv, 13, d)
        with self.client.session(k=k, v=v) as s:
            k, v = self.steps_match_the_reference(s, k, v, 12, "ring")
            first_ring = self.client._step_rings.get("")
            self.assertIsNotNone(first_ring)
            # Its region is listed while it is served.
            self.assertEqual(len(self.client.list_shared_memory()), 1)
            # Dropped behind the object's back: its Step is NOT_FOUND, which ends that ring
            # (unregistered and unlinked); the next Step opens another.
            self.client._call(self.client._sessions_stub.DropSession,
                              pb.DropSessionRequest(session_id=s.id), None, None)
            with self.assertRaises(AttentionError) as e:
                s.step(self.normal(hq, 1, d), stream="ring")
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            self.assertIsNone(self.client._step_rings.get(""))
            self.assertEqual(len(self.client.list_shared_memory()), 0)
        with self.client.session(k=k, v=v) as s2:
            q = self.normal(hq, 1, d)
            o = s2.step(q, causal=True, stream="ring")
            ref_o = reference(q[None], k[None], v[None], causal=True)[0][0]
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o on a new ring")
            self.assertIsNot(self.client._step_rings.get(""), first_ring)

    def test_attend_requests_over_a_request_ring(self):
        from attention_client.client import _attend_request
        with self.client.request_ring("attend", slot_bytes=256 << 10) as ring:
            for i in range(4):
                q, k, v = self.qkv(b=1, hq=4, hkv=2, nq=9, nk=40, d=32)
                request, _ = _attend_request(
                    q, k, v, causal=i % 2 == 1, softmax_scale=None, window_left=None,
                    window_right=None, layout="bhsd", return_lse=False, cu_seqlens_q=None,
                    cu_seqlens_k=None, bfloat16_bits=False, request_id=f"r{i}",
                    mask_alignment="bottom_right")
                response = ring.request(request)
                self.assertEqual(response.request_id, f"r{i}")
                o = np.frombuffer(response.o.data, np.float32).reshape(q.shape)
                self.assertWithin(rel_error(o, reference(q, k, v, causal=i % 2 == 1)[0]),
                                  F32_BOUND, f"ring attend {i}")
            # Larger than a slot: refused before anything is sent.
            big = pb.AttendRequest(request_id="x" * (256 << 10))
            with self.assertRaises(ValueError):
                ring.request(big)
        self.assertEqual(len(self.client.list_shared_memory()), 0)
        with self.assertRaises(ValueError):
            self.client.request_ring("attend", slot_bytes=100)
        with self.assertRaises(ValueError):
            self.client.request_ring("decode")

    def test_a_step_naming_tokens_of_rows_by_reference_is_refused(self):
        # Rows read from a region are checked only after the Step ran, too late to cache them.
        k0 = self.normal(2, 3, 16)
        region = self.client.register_shared_memory("py-step-tokens", self.shm)
        try:
            region.array(k0.shape, np.float32)[...] = k0
            with self.client.session(dtype="float32", kv_heads=2, head_dim=16) as s:
                by_ref = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=k0.shape,
                                   ref=region.ref(0, k0.nbytes))
                inline = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=k0.shape, data=k0.tobytes())
                q = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=(4, 1, 16),
                              data=self.normal(4, 1, 16).tobytes())
                with self.assertRaises(grpc.RpcError) as e:
                    self.client._sessions_stub.Step(pb.StepRequest(entries=[pb.StepEntry(
                        session_id=s.id, q=q, k=by_ref, v=inline, tokens=[1, 2, 3])]))
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("entries[0].tokens: expected only with k and v in the message "
                              "(rows read from a region are not cached), got k by reference",
                              e.exception.details())
                self.assertEqual(s.info().length, 0)
        finally:
            region.unregister()


class RequestRingOffTest(ServerTest):
    def test_a_server_without_shared_memory_refuses_the_ring(self):
        with self.assertRaises(AttentionError) as e:
            self.client.request_ring("step")
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    print(f"seed {SEED}")
    unittest.main()
