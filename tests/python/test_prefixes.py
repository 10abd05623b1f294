"""Shared prefixes over real gRPC (CPU backend): a session created from prefix_tokens holds the
full pages another session appended with the same token ids, costs only its own new pages, and
steps bit for bit as a session of the same rows made from scratch (of one layer and of several,
whose blocks are cached once every layer holds them; rows appended by Steps naming their tokens
too); cached pages no session holds
are taken back least recently released first when the pool is full, never a page a session holds;
tokens of the wrong count and prefix_tokens with k and v are refused by name. Inputs are fresh
random each run; the seed is printed, and a failure message repeats it.

Run by ctest (label "python") like test_attention_client.py. Exits 77 (skipped) when grpcio or
numpy is missing.
"""
import unittest

from test_attention_client import SEED, ServerTest

import grpc
import numpy as np
from attention_client import AttentionError
from attention_client._stubs import attention_pb2 as pb

HQ, HKV, D = 4, 2, 64
# float32 K and V of a row: 2 * HKV * D * 4 = 1 KiB, so a 16 KiB page holds 16 rows; 16 pages.
PAGE_ROWS, PAGES = 16, 16


class PrefixTest(ServerTest):
    SERVER_FLAGS = [f"--kv_page_bytes={PAGE_ROWS * 1024}",
                    f"--kv_cache_bytes={PAGES * PAGE_ROWS * 1024}"]

    def tearDown(self):
        for info in self.client.list_sessions().sessions:
            request = pb.DropSessionRequest(session_id=info.session_id)
            self.client._sessions_stub.DropSession(request)

    def rows(self, n):
        return self.normal(HKV, n, D), self.normal(HKV, n, D)

    def tokens(self, n):
        return self.rng.integers(0, 2**40, n)

    def room(self):
        listed = self.client.list_sessions()
        return listed.pages_free, listed.pages_cached

    def assertSame(self, a, b, what):
        self.assertTrue(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)),
                        f"{what}: not equal bit for bit (seed {SEED})")

    def of_rows(self, n):
        """A session of n fresh rows of unknown tokens."""
        k, v = self.rows(n)
        return self.client.session(k=k, v=v)

    def create(self, **kw):
        return self.client.session(dtype="float32", kv_heads=HKV, head_dim=D, **kw)

    def test_a_session_from_a_prefix_costs_only_its_own_pages(self):
        n = 3 * PAGE_ROWS + 5
        k, v = self.rows(n)
        prompt = self.tokens(n)
        with self.client.session(k=k, v=v, tokens=prompt) as first:
            self.assertEqual(first.prefix_rows, 0)
            free, _ = self.room()
            with self.create(prefix_tokens=prompt) as second:
                # The three full pages are shared, the partial fourth is not: no page taken yet.
                self.assertEqual((second.prefix_rows, second.length),
                                 (3 * PAGE_ROWS, 3 * PAGE_ROWS))
                self.assertEqual(self.room()[0], free)
                second.append(k[:, 3 * PAGE_ROWS:], v[:, 3 * PAGE_ROWS:],
                              tokens=prompt[3 * PAGE_ROWS:])
                self.assertEqual(self.room()[0], free - 1)
                info = second.info()
                self.assertEqual((info.pages, info.shared_pages), (4, 3))
                with self.client.session(k=k, v=v) as scratch:
                    self.assertEqual(self.room()[0], free - 5)
                    # An extend step, then a decode step: the same bytes from both.
                    for nq in (5, 1):
                        q, (kn, vn) = self.normal(HQ, nq, D), self.rows(nq)
                        o_a, lse_a = second.step(q, kn, vn, causal=True, return_lse=True)
                        o_b, lse_b = scratch.step(q, kn, vn, causal=True, return_lse=True)
                        self.assertSame(o_a, o_b, f"o after {nq} queries")
                        self.assertSame(lse_a, lse_b, f"lse after {nq} queries")
            # A prefix that differs in its second page finds the first page only.
            other = prompt.copy()
            other[PAGE_ROWS + 1] += 1
            with self.create(prefix_tokens=other) as third:
                self.assertEqual(third.prefix_rows, PAGE_ROWS)

    def test_rows_a_step_appends_with_tokens_are_cached_too(self):
        # A session built by Steps alone (a prefill Step, then decode Steps of one row each)
        # naming their tokens: its full pages are found by a new session's prefix_tokens, as
        # AppendKv's are, and that session's Steps equal, bit for bit, one's made from scratch.
        n = 2 * PAGE_ROWS + 3
        k, v = self.rows(n)
        prompt = self.tokens(n)
        prefill = PAGE_ROWS + 4
        with self.create() as first:
            first.step(self.normal(HQ, 2, D), k[:, :prefill], v[:, :prefill], causal=True,
                       tokens=prompt[:prefill])
            for row in range(prefill, n):
                first.step(self.normal(HQ, 1, D), k[:, row:row + 1], v[:, row:row + 1],
                           causal=True, tokens=prompt[row:row + 1])
            free, _ = self.room()
            with self.create(prefix_tokens=prompt) as second:
                self.assertEqual((second.prefix_rows, second.length),
                                 (2 * PAGE_ROWS, 2 * PAGE_ROWS))
                self.assertEqual(self.room()[0], free)  # both pages shared: none taken
                second.append(k[:, 2 * PAGE_ROWS:], v[:, 2 * PAGE_ROWS:],
                              tokens=prompt[2 * PAGE_ROWS:])
                with self.client.session(k=k, v=v) as scratch:
                    q, (kn, vn) = self.normal(HQ, 3, D), self.rows(3)
                    self.assertSame(second.step(q, kn, vn, causal=True),
                                    scratch.step(q, kn, vn, causal=True), "o")
        # A Step's rows without tokens end what is cached: only the prefill's full page is found.
        other = self.tokens(n)
        with self.create() as first:
            first.step(self.normal(HQ, 1, D), k[:, :prefill], v[:, :prefill],
                       tokens=other[:prefill])
            first.step(self.normal(HQ, 1, D), k[:, prefill:], v[:, prefill:])
            with self.create(prefix_tokens=other) as second:
                self.assertEqual(second.prefix_rows, PAGE_ROWS)
        with self.create() as s:
            with self.assertRaises(AttentionError) as raised:
                s.step(self.normal(HQ, 1, D), *self.rows(2), tokens=prompt[:3])
            self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("entries[0].tokens: expected none or 2 (one token id per row of k and "
                          "v), got 3", raised.exception.details)
            self.assertEqual(s.info().length, 0)

    def test_a_sequence_of_layers_shares_each_layers_pages(self):
        n, layers = 2 * PAGE_ROWS + 3, 2
        prompt = self.tokens(n)
        rows = [self.rows(n) for _ in range(layers)]
        with self.create(layers=layers) as first:
            # Cached once every layer holds the rows: after layer 0 alone nothing is found yet.
            first.append(*rows[0], layer=0, tokens=prompt)
            with self.create(layers=layers, prefix_tokens=prompt) as early:
                self.assertEqual(early.prefix_rows, 0)
            first.append(*rows[1], layer=1, tokens=prompt)
            free, _ = self.room()
            with self.create(layers=layers, prefix_tokens=prompt) as second, \
                    self.create(layers=layers) as scratch:
                self.assertEqual((second.prefix_rows, second.layer_lengths),
                                 (2 * PAGE_ROWS, [2 * PAGE_ROWS] * layers))
                self.assertEqual(self.room()[0], free - layers)  # scratch's first pages only
                for layer, (k, v) in enumerate(rows):
                    second.append(k[:, 2 * PAGE_ROWS:], v[:, 2 * PAGE_ROWS:], layer=layer,
                                  tokens=prompt[2 * PAGE_ROWS:])
                    scratch.append(k, v, layer=layer)
                for layer in range(layers):
                    q, (kn, vn) = self.normal(HQ, 1, D), self.rows(1)
                    o_a, lse_a = second.step(q, kn, vn, layer=layer, return_lse=True)
                    o_b, lse_b = scratch.step(q, kn, vn, layer=layer, return_lse=True)
                    self.assertSame(o_a, o_b, f"o of layer {layer}")
                    self.assertSame(lse_a, lse_b, f"lse of layer {layer}")

    def test_cached_pages_go_least_recently_released_first_and_held_ones_never(self):
        prompt, other = self.tokens(3 * PAGE_ROWS), self.tokens(2 * PAGE_ROWS)
        # Pages the other tests left cached were released before these: they go first.
        free, earlier = self.room()
        for tokens in (prompt, other):
            k, v = self.rows(len(tokens))
            self.client.session(k=k, v=v, tokens=tokens).drop()
        self.assertEqual(self.room(), (free - 5, earlier + 5))
        with self.create(prefix_tokens=prompt) as held:
            self.assertEqual(held.prefix_rows, 3 * PAGE_ROWS)
            q = self.normal(HQ, 3, D)
            before = held.step(q, return_lse=True)
            # The free pages, then the earlier cached ones and `other`'s two; `held`'s three are
            # never taken.
            self.of_rows((free - 5) * PAGE_ROWS)
            self.assertEqual(self.room(), (0, earlier + 2))
            self.of_rows((earlier + 2) * PAGE_ROWS)
            self.assertEqual(self.room(), (0, 0))
            # `other` went with its pages: a session from it needs a page, and none is left.
            for create in (lambda: self.of_rows(1),
                           lambda: self.create(prefix_tokens=other)):
                with self.assertRaises(AttentionError) as refused:
                    create()
                self.assertEqual(refused.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            after = held.step(q, return_lse=True)
            self.assertSame(after[0], before[0], "o of the held prefix after the pool filled")
            self.assertSame(after[1], before[1], "lse of the held prefix after the pool filled")

    def test_refusals_name_the_field(self):
        k, v = self.rows(5)
        for call, message in (
            (lambda: self.client.session(k=k, v=v, tokens=[1, 2, 3]),
             "tokens: expected none or 5 (one token id per row of k and v), got 3"),
            (lambda: self.client.session(k=k, v=v, prefix_tokens=[1, 2, 3]),
             "k, v: expected none with prefix_tokens"),
        ):
            with self.assertRaises(AttentionError) as refused:
                call()
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(message, refused.exception.details)
        with self.create() as s:
            with self.assertRaises(AttentionError) as refused:
                s.append(k, v, tokens=[7])
            self.assertEqual(refused.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("tokens: expected none or 5", refused.exception.details)
            self.assertEqual(s.length, 0)


if __name__ == "__main__":
    unittest.main()
