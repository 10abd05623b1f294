"""KV-resident sessions through the Python client (client/python) against the real attention_server
(CPU backend).

Each step's output is compared with the numpy float64 reference of test_attention_client.py over
the session's whole sequence (every row created, appended and stepped so far), by relative error
within the API's bounds (1e-5 float32, 1e-2 float16 and bfloat16). Inputs are fresh random each
run; the seed is printed, and a failure message repeats it.

Run by ctest (label "python") like test_attention_client.py. Exits 77 (skipped) when grpcio or
numpy is missing.
"""
import copy
import unittest

from test_attention_client import (F16_BOUND, F32_BOUND, SEED, ServerTest, lse_error, reference,
                                   rel_error)

import grpc
import numpy as np
from attention_client._stubs import attention_pb2 as pb
from attention_client import (AttentionError, Client, bfloat16_bits_to_float32,
                              float32_to_bfloat16_bits)

try:
    import torch
except ImportError:
    torch = None


def session_reference(q, k, v, **kwargs):
    """o [Hq, Nq, D] and lse [Hq, Nq] of q [Hq, Nq, D] over k, v [Hkv, N, D] (queries last)."""
    o, lse = reference(q[None], k[None], v[None], **kwargs)
    return o[0], lse[0]


class SessionTest(ServerTest):
    def rows(self, hkv, n, d):
        return self.normal(hkv, n, d), self.normal(hkv, n, d)

    def test_decode_after_appends_matches_reference(self):
        hq, hkv, d = 8, 2, 64
        k, v = self.rows(hkv, 45, d)
        with self.client.session(k=k, v=v) as s:  # float32, Hkv and D from k
            self.assertEqual((s.length, s.kv_heads, s.head_dim), (45, hkv, d))
            for n in (7, 1, 30):
                k1, v1 = self.rows(hkv, n, d)
                self.assertEqual(s.append(k1, v1), k.shape[1] + n)
                k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
            for step in range(4):  # decode: one token's query and K/V per step
                q = self.normal(hq, 1, d)
                k1, v1 = self.rows(hkv, 1, d)
                k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
                o = s.step(q, k1, v1, causal=True)
                self.assertEqual(o.dtype, np.float32)
                self.assertEqual(o.shape, q.shape)
                self.assertEqual(s.length, k.shape[1])
                ref_o, _ = session_reference(q, k, v, causal=True)
                self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"step {step} o")

    def test_lse_scale_and_window(self):
        hq, hkv, d = 4, 4, 32
        k, v = self.rows(hkv, 70, d)
        with self.client.session(k=k, v=v) as s:
            q = self.normal(hq, 5, d)  # an extend step: 5 queries, the last 5 positions
            k1, v1 = self.rows(hkv, 5, d)
            k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
            o, lse = s.step(q, k1, v1, causal=True, return_lse=True)
            self.assertEqual(lse.dtype, np.float32)
            self.assertEqual(lse.shape, (hq, 5))
            ref_o, ref_lse = session_reference(q, k, v, causal=True)
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "causal o")
            self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "causal lse")
            # No append: the queries are the last 3 positions of the 75 rows.
            q = self.normal(hq, 3, d)
            o, lse = s.step(q, softmax_scale=0.3, window_left=16, window_right=0, return_lse=True)
            self.assertEqual(s.length, 75)
            ref_o, ref_lse = session_reference(q, k, v, scale=0.3, window_left=16, window_right=0)
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "window o")
            self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, "window lse")

    def test_open_model_options_on_steps(self):
        # Sinks, softcap and chunks on Steps (an extend step and decode steps, over sessions of
        # two lengths in one step_many); a sink count other than Hq names the field.
        hq, hkv, d = 8, 2, 32
        sinks = self.normal(hq) * 2
        seqs = [self.rows(hkv, n, d) for n in (600, 37)]
        sessions = [self.client.session(k=k, v=v) for k, v in seqs]
        try:
            for step, (nq, options) in enumerate([
                    (4, dict(sinks=sinks)), (1, dict(softcap=1.5, softmax_scale=0.9)),
                    (1, dict(chunk_size=16)), (3, dict(sinks=sinks, softcap=2.0, chunk_size=24,
                                                        window_left=40))]):
                items, queries = [], []
                for i, s in enumerate(sessions):
                    q = self.normal(hq, nq, d)
                    k1, v1 = self.rows(hkv, nq, d)
                    k, v = seqs[i]
                    seqs[i] = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
                    items.append((s, q, k1, v1))
                    queries.append(q)
                results = self.client.step_many(items, causal=True, return_lse=True, **options)
                ref_options = dict(options)
                ref_options["scale"] = ref_options.pop("softmax_scale", None)
                for i, (o, lse) in enumerate(results):
                    ref_o, ref_lse = session_reference(queries[i], *seqs[i], causal=True,
                                                       **ref_options)
                    what = f"step {step} sequence {i} with {sorted(options)}"
                    self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"{what}: o")
                    self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, f"{what}: lse")
            with self.assertRaises(AttentionError) as raised:
                sessions[0].step(self.normal(hq, 1, d), sinks=sinks[:3])
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertRegex(raised.exception.details, "^sinks:")
        finally:
            for s in sessions:
                s.drop()

    def test_bshd_float16_session(self):
        hq, hkv, d = 6, 3, 64
        k, v = (x.astype(np.float16) for x in self.rows(hkv, 33, d))
        # BSHD first rows and appends: [N, Hkv, D].
        with self.client.session(k=k.transpose(1, 0, 2).copy(), v=v.transpose(1, 0, 2).copy(),
                                 layout="bshd") as s:
            self.assertEqual((s.kv_heads, s.head_dim), (hkv, d))
            k1, v1 = (x.astype(np.float16) for x in self.rows(hkv, 20, d))
            s.append(k1.transpose(1, 0, 2).copy(), v1.transpose(1, 0, 2).copy())
            k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
            q = self.normal(hq, 2, d).astype(np.float16)
            o = s.step(q, causal=True)
            self.assertEqual(o.dtype, np.float16)
            ref_o, _ = session_reference(q, k, v, causal=True)
            self.assertWithin(rel_error(o, ref_o), F16_BOUND, "float16 o")

    def test_bfloat16_bits_session(self):
        hq, hkv, d = 4, 1, 128
        k, v = (float32_to_bfloat16_bits(x) for x in self.rows(hkv, 50, d))
        with self.client.session(dtype="bfloat16", k=k, v=v, bfloat16_bits=True) as s:
            q = float32_to_bfloat16_bits(self.normal(hq, 1, d))
            k1, v1 = (float32_to_bfloat16_bits(x) for x in self.rows(hkv, 1, d))
            o = s.step(q, k1, v1)
            self.assertEqual(o.dtype, np.uint16)
            kf, vf = (bfloat16_bits_to_float32(np.concatenate(x, axis=1)) for x in ((k, k1), (v, v1)))
            ref_o, _ = session_reference(bfloat16_bits_to_float32(q), kf, vf)
            self.assertWithin(rel_error(bfloat16_bits_to_float32(o), ref_o), F16_BOUND,
                              "bfloat16 o")

    def test_step_many_over_sessions_of_different_lengths(self):
        hq, hkv, d = 4, 2, 64
        lengths = (1, 64, 257)
        seqs = [self.rows(hkv, n, d) for n in lengths]
        sessions = [self.client.session(k=k, v=v) for k, v in seqs]
        try:
            items, refs = [], []
            for i, (s, (k, v)) in enumerate(zip(sessions, seqs)):
                q = self.normal(hq, 2, d)
                if i % 2 == 0:  # some entries append two rows, some only attend
                    k1, v1 = self.rows(hkv, 2, d)
                    k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
                    items.append((s, q, k1, v1))
                else:
                    items.append((s, q))
                refs.append(session_reference(q, k, v, causal=True))
            outs = self.client.step_many(items, causal=True, return_lse=True)
            self.assertEqual(len(outs), len(items))
            for i, ((o, lse), (ref_o, ref_lse)) in enumerate(zip(outs, refs)):
                self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"session {i} o")
                self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, f"session {i} lse")
            self.assertEqual([s.length for s in sessions], [lengths[0] + 2, lengths[1], lengths[2] + 2])
        finally:
            for s in sessions:
                s.drop()

    def test_step_results_carry_length_timing_and_device(self):
        hq, hkv, d = 4, 2, 32
        k, v = self.rows(hkv, 20, d)
        with self.client.session(k=k, v=v) as s, self.client.session(k=k, v=v) as t:
            q = self.normal(hq, 1, d)
            k1, v1 = self.rows(hkv, 1, d)
            r = s.step(q, k1, v1, causal=True, return_lse=True, return_info=True)
            ref_o, ref_lse = session_reference(q, np.concatenate([k, k1], axis=1),
                                               np.concatenate([v, v1], axis=1), causal=True)
            self.assertWithin(rel_error(r.o, ref_o), F32_BOUND, "o")
            self.assertWithin(lse_error(r.lse, ref_lse), F32_BOUND, "lse")
            self.assertEqual((r.length, r.device), (21, "cpu"))
            self.assertGreater(r.timing.compute_us, 0)
            self.assertGreaterEqual(r.timing.total_us, r.timing.compute_us)
            # One Step RPC: its timing and device are every item's.
            both = self.client.step_many([(s, q), (t, q)], return_info=True)
            self.assertEqual([b.length for b in both], [21, 20])
            self.assertEqual(both[0].timing, both[1].timing)
            self.assertIsNone(both[0].lse)

    def test_info_list_and_not_found_after_drop(self):
        k, v = self.rows(2, 40, 64)
        s = self.client.session(k=k, v=v)
        info = s.info()
        self.assertEqual((info.session_id, info.length, info.kv_heads, info.head_dim),
                         (s.id, 40, 2, 64))
        self.assertGreater(info.resident_bytes, 0)
        self.assertGreater(info.pages, 0)
        self.assertIn(s.id, [x.session_id for x in self.client.list_sessions().sessions])
        stale = copy.copy(s)  # still names the session after s drops it
        s.drop()
        self.assertNotIn(stale.id, [x.session_id for x in self.client.list_sessions().sessions])
        for call in (lambda: stale.step(self.normal(2, 1, 64)),
                     lambda: stale.append(*self.rows(2, 1, 64)),
                     stale.info, stale.drop):
            with self.assertRaises(AttentionError) as e:
                call()
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(AttentionError) as e:  # the dropped object refuses locally
            s.step(self.normal(2, 1, 64))
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_truncate_then_step_equals_a_fresh_session(self):
        hq, hkv, d = 4, 2, 64
        # Three pages of rows and some, cut to 37 rows (one page).
        n = 3 * self.client.list_sessions().page_bytes // (2 * hkv * d * 4) + 5
        k, v = self.rows(hkv, n, d)
        q = self.normal(hq, 2, d)
        k1, v1 = self.rows(hkv, 2, d)
        with self.client.session(k=k, v=v) as cut, \
                self.client.session(k=k[:, :37].copy(), v=v[:, :37].copy()) as fresh:
            for bad in (-1, n + 1):
                with self.assertRaises(AttentionError) as e:
                    cut.truncate(bad)
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(f"length: expected 0..{n}, got {bad}", e.exception.details)
            pages = cut.info().pages
            self.assertEqual(cut.truncate(37), 37)
            info = cut.info()
            self.assertEqual(info.length, 37)
            self.assertLess(info.pages, pages)
            self.assertEqual(info.pages, fresh.info().pages)
            o, lse = cut.step(q, k1, v1, causal=True, return_lse=True)
            fresh_o, fresh_lse = fresh.step(q, k1, v1, causal=True, return_lse=True)
            np.testing.assert_array_equal(o, fresh_o)  # bit for bit
            np.testing.assert_array_equal(lse, fresh_lse)
            ref_o, _ = session_reference(q, np.concatenate([k[:, :37], k1], axis=1),
                                         np.concatenate([v[:, :37], v1], axis=1), causal=True)
            self.assertWithin(rel_error(o, ref_o), F32_BOUND, "o after truncate")
            self.assertEqual(cut.truncate(0), 0)
            stale = copy.copy(cut)
        with self.assertRaises(AttentionError) as e:  # dropped on leaving the block
            stale.truncate(0)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_fork_grows_apart_from_its_parent(self):
        hq, hkv, d = 4, 2, 64
        page_rows = self.client.list_sessions().page_bytes // (2 * hkv * d * 4) // 16 * 16
        n = 2 * page_rows + 9  # two full pages and a partial third
        k, v = self.rows(hkv, n, d)
        with self.client.session(k=k, v=v) as parent:
            with self.assertRaises(AttentionError) as e:
                parent.fork(n + 1)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(f"length: expected 0..{n}, got {n + 1}", e.exception.details)
            free = self.client.list_sessions().pages_free
            with parent.fork() as child, parent.fork(page_rows + 3) as cut:
                # The children take a page each (their partial last page's copy), not the three
                # and two a session of their rows takes.
                self.assertEqual(self.client.list_sessions().pages_free, free - 2)
                info = child.info()
                self.assertEqual((info.length, info.pages, info.shared_pages), (n, 3, 2))
                self.assertEqual((child.kv_heads, child.head_dim, child.dtype),
                                 (parent.kv_heads, parent.head_dim, parent.dtype))
                self.assertEqual(cut.length, page_rows + 3)
                rows = {parent.id: (k, v), child.id: (k, v),
                        cut.id: (k[:, :page_rows + 3], v[:, :page_rows + 3])}
                for step in range(2):
                    for s in (parent, child, cut):
                        q = self.normal(hq, 1, d)
                        k1, v1 = self.rows(hkv, 1, d)
                        sk, sv = (np.concatenate([x, y], axis=1) for x, y in zip(rows[s.id],
                                                                                  (k1, v1)))
                        rows[s.id] = (sk, sv)
                        o, lse = s.step(q, k1, v1, causal=True, return_lse=True)
                        ref_o, ref_lse = session_reference(q, sk, sv, causal=True)
                        self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"step {step} o")
                        self.assertWithin(lse_error(lse, ref_lse), F32_BOUND, f"step {step} lse")
                stale = copy.copy(child)
            self.assertEqual(self.client.list_sessions().pages_free, free)
        with self.assertRaises(AttentionError) as e:  # dropped on leaving the block
            stale.fork()
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_a_session_of_several_layers(self):
        """One session holding a model's layers: each layer its own cache, named by append's and
        the Steps' layer; equal bit for bit to a session per layer; truncate, fork and drop take
        every layer; one entry in the list; the layer is refused by name where it is wrong."""
        hq, hkv, d, layers = 4, 2, 32, 3
        before = self.client.list_sessions().pages_free
        s = self.client.session(dtype="float32", kv_heads=hkv, head_dim=d, layers=layers)
        kv = [self.rows(hkv, n, d) for n in (5, 40, 17)]
        singles = [self.client.session(k=k, v=v) for k, v in kv]
        for layer, (k, v) in enumerate(kv):
            s.append(k, v, layer=layer)
        self.assertEqual((s.layers, s.layer_lengths, s.length), (layers, [5, 40, 17], 5))
        info = s.info()
        self.assertEqual((info.layers, list(info.layer_lengths), info.length), (3, [5, 40, 17], 5))
        self.assertEqual(sum(i.session_id == s.id for i in self.client.list_sessions().sessions), 1)
        for step in range(2):
            q = self.normal(hq, 1, d)
            k1, v1 = self.rows(hkv, 1, d)
            for layer in range(layers):
                o = s.step(q, k1, v1, causal=True, layer=layer)
                want = singles[layer].step(q, k1, v1, causal=True)
                self.assertTrue(np.array_equal(o, want), f"step {step} layer {layer}, seed {SEED}")
                k, v = kv[layer]
                kv[layer] = (np.concatenate([k, k1], 1), np.concatenate([v, v1], 1))
                ref_o, _ = session_reference(q, *kv[layer], causal=True)
                self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"layer {layer}")
        self.assertEqual(s.layer_lengths, [7, 42, 19])
        # A packed Step of one layer over several such sessions.
        t = self.client.session(dtype="float32", kv_heads=hkv, head_dim=d, layers=layers)
        t.append(*kv[1], layer=1)
        q2 = np.stack([self.normal(hq, 1, d)] * 2)
        o2 = self.client.step_batch([s, t], q2, causal=True, layer=1)
        self.assertTrue(np.array_equal(o2[0], o2[1]), f"seed {SEED}")  # the same layer-1 rows
        self.assertTrue(np.array_equal(o2[0], singles[1].step(q2[0], causal=True)))
        # The layer, refused by name where it is missing or out of range.
        for call, words in ((lambda: s.step(q, causal=True), "layer: expected 0..2"),
                            (lambda: s.step(q, causal=True, layer=3), "got 3"),
                            (lambda: s.append(k1, v1), "layer: expected 0..2"),
                            (lambda: singles[0].step(q, causal=True, layer=1),
                             "of 1 layer, got 1"),
                            (lambda: self.client.session(k=k1, v=v1, layers=2), "k, v")):
            with self.assertRaises(AttentionError) as e:
                call()
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(words, e.exception.details)
        self.assertEqual(singles[0].step(q, causal=True, layer=0).shape, q.shape)
        # A layer's own id is no session of the caller's.
        with self.assertRaises(AttentionError) as e:
            self.client._call(self.client._sessions_stub.Truncate,
                              pb.TruncateRequest(session_id=s.id + "/1", length=0), None, None)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        # Fork and truncate take every layer.
        with s.fork() as child:
            self.assertEqual((child.layers, child.layer_lengths), (3, [7, 42, 19]))
            q = self.normal(hq, 1, d)
            for layer in range(layers):
                self.assertTrue(np.array_equal(child.step(q, causal=True, layer=layer),
                                               s.step(q, causal=True, layer=layer)))
        with self.assertRaises(AttentionError) as e:
            s.truncate(10)  # more than layer 0 holds
        self.assertIn("layer 0", e.exception.details)
        self.assertEqual(s.truncate(6), 6)
        self.assertEqual(s.layer_lengths, [6, 6, 6])
        for layer in range(layers):
            singles[layer].truncate(6)
            self.assertTrue(np.array_equal(s.step(q, causal=True, layer=layer),
                                           singles[layer].step(q, causal=True)))
        for x in [s, t] + singles:
            x.drop()
        self.assertEqual(self.client.list_sessions().pages_free, before)

    def test_context_manager_drops(self):
        with self.client.session(dtype=np.float32, kv_heads=1, head_dim=16) as s:
            self.assertEqual(s.length, 0)
            session_id = s.id
        self.assertNotIn(session_id, [x.session_id for x in self.client.list_sessions().sessions])

    def test_bad_query_heads_is_invalid_argument(self):
        with self.client.session(k=self.normal(3, 8, 32), v=self.normal(3, 8, 32)) as s:
            with self.assertRaises(AttentionError) as e:
                s.step(self.normal(4, 1, 32))  # 4 query heads over 3 kv heads
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_round_robin_client_keeps_a_session_on_one_server(self):
        # Two names of one server: attend() goes round-robin, sessions over their own
        # pick_first channel.
        with Client(f"127.0.0.1:{self.port},localhost:{self.port}", timeout=60) as balanced:
            k, v = self.rows(1, 10, 16)
            with balanced.session(k=k, v=v) as s:
                for _ in range(3):
                    k1, v1 = self.rows(1, 1, 16)
                    s.step(self.normal(2, 1, 16), k1, v1)
                self.assertEqual(s.length, 13)
            self.assertIsNotNone(balanced._sessions_channel)

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_torch_tensors(self):
        k, v = (torch.from_numpy(x) for x in self.rows(2, 20, 64))
        with self.client.session(k=k, v=v) as s:
            q = torch.from_numpy(self.normal(4, 1, 64))
            o, lse = s.step(q, return_lse=True)
            self.assertIsInstance(o, torch.Tensor)
            self.assertIsInstance(lse, torch.Tensor)
            ref_o, _ = session_reference(q.numpy(), k.numpy(), v.numpy())
            self.assertWithin(rel_error(o.numpy(), ref_o), F32_BOUND, "torch o")


class VHeadDimSessionTest(ServerTest):
    """Sessions whose V head dim is their own (CreateSessionRequest.v_head_dim): MLA's expanded
    cache (QK 192, V 128, DeepSeek-V3's prefill) and its absorbed decode (one KV head of QK 576
    whose first 512 features are V, as FlashMLA holds it). A server of --max_head_dim 576."""

    SERVER_FLAGS = ["--max_head_dim=576"]

    def check(self, o, q, k, v, what, **kwargs):
        """o of q against the reference and against one Attend over the same k and v."""
        ref_o, _ = session_reference(q, k, v, **kwargs)
        self.assertEqual(o.shape, ref_o.shape, what)
        self.assertWithin(rel_error(o, ref_o), F32_BOUND, f"{what}: o")
        options = dict(kwargs)
        options["softmax_scale"] = options.pop("scale", None)
        attended = self.client.attend(q[None], k[None], v[None], **options)[0]
        self.assertWithin(rel_error(o, attended), F32_BOUND, f"{what}: o against Attend")

    def test_expanded_mla_steps(self):
        hq, hkv, d, dv = 8, 2, 192, 128
        k, v = self.normal(hkv, 45, d), self.normal(hkv, 45, dv)
        with self.client.session(k=k, v=v) as s:  # Dv from v
            self.assertEqual((s.head_dim, s.v_head_dim), (d, dv))
            self.assertEqual(s.info().v_head_dim, dv)
            self.assertIn("v_head_dim=128", repr(s))
            k1, v1 = self.normal(hkv, 6, d), self.normal(hkv, 6, dv)
            s.append(k1, v1)
            k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
            for nq in (5, 1, 1):  # an extend step, then decode steps
                q = self.normal(hq, nq, d)
                k1, v1 = self.normal(hkv, nq, d), self.normal(hkv, nq, dv)
                k, v = np.concatenate([k, k1], axis=1), np.concatenate([v, v1], axis=1)
                o, lse = s.step(q, k1, v1, causal=True, return_lse=True)
                self.check(o, q, k, v, f"{nq} queries", causal=True)
                self.assertWithin(lse_error(lse, session_reference(q, k, v, causal=True)[1]),
                                  F32_BOUND, f"{nq} queries: lse")

    def test_absorbed_mla_decode_packed(self):
        # One KV head: K [1, n, 576] = [latent 512, rotary 64], V its first 512 features.
        hq, d, dv, batch = 16, 576, 512, 2
        rows = [300, 41]
        keys = [self.normal(1, n, d) for n in rows]
        sessions = [self.client.session(k=k, v=k[..., :dv].copy(), v_head_dim=dv) for k in keys]
        try:
            for step in range(2):
                q = self.normal(batch, hq, 1, d)
                k1 = self.normal(batch, 1, 1, d)
                v1 = k1[..., :dv].copy()
                keys = [np.concatenate([keys[b], k1[b]], axis=1) for b in range(batch)]
                o = self.client.step_batch(sessions, q, k1, v1, causal=True,
                                           softmax_scale=0.07)
                self.assertEqual(o.shape, (batch, hq, 1, dv))
                for b in range(batch):
                    self.check(o[b], q[b], keys[b], keys[b][..., :dv], f"step {step} seq {b}",
                               causal=True, scale=0.07)
        finally:
            for s in sessions:
                s.drop()

    def test_refusals_name_v_head_dim(self):
        hq, hkv, d, dv = 4, 2, 192, 128
        with self.client.session(dtype="float32", kv_heads=hkv, head_dim=d, v_head_dim=dv) as s:
            self.assertEqual((s.length, s.v_head_dim), (0, dv))
            cases = [
                (lambda: s.append(self.normal(hkv, 2, d), self.normal(hkv, 2, d)),
                 r"^v\.shape\[2\] \(v head dim\): expected 128 \(the session's v_head_dim\), "
                 "got 192"),
                (lambda: s.step(self.normal(hq, 1, d), self.normal(hkv, 1, d),
                                self.normal(hkv, 1, d)),
                 r"^entries\[0\]\.v\.shape\[2\] \(v head dim\): expected 128"),
                (lambda: self.client.step_batch([s], self.normal(1, hq, 1, d),
                                                self.normal(1, hkv, 1, d),
                                                self.normal(1, hkv, 1, d)),
                 r"^v\.shape\[3\] \(v head dim\): expected 128 \(the sessions' v_head_dim\)"),
                (lambda: self.client.session(dtype="float32", kv_heads=1, head_dim=d,
                                             v_head_dim=600),
                 r"^v_head_dim: expected 0\.\.576 \(0: head_dim\), got 600"),
            ]
            for call, message in cases:
                with self.assertRaises(AttentionError) as raised:
                    call()
                self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertRegex(raised.exception.details, message)
            self.assertEqual(s.info().length, 0)  # nothing appended by a refused call


if __name__ == "__main__":
    print(f"python_sessions: seed {SEED}", flush=True)
    unittest.main()
