"""attention_client.torch against the real attention_server (CPU backend): the SDPA drop-in equals
torch.nn.functional.scaled_dot_product_attention (relative error < 1e-5 in float32) over a grid
of shapes (Nq != Nk, causal and not, GQA, leading dims, key-padding masks), the flash_attn-style
calls equal torch's SDPA under FlashAttention's bottom-right masks, and what is not served is
refused with a clear error. Fresh random inputs each run (the seed is printed on failure).

Run by ctest (label "python") with the Python of .python-env (scripts/install_deps.sh installs
torch there); exits 77 (skipped) with the reason when torch is missing.
"""
import sys
import unittest

try:
    import torch
except ImportError as e:
    print(f"SKIP: torch is not installed for {sys.executable} ({e}); scripts/install_deps.sh "
          "installs it into .python-env", file=sys.stderr)
    sys.exit(77)

from test_attention_client import F32_BOUND, SEED, ServerTest

from attention_client import torch as remote

F = torch.nn.functional


def rel(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def bottom_right_mask(nq, nk, causal, left=-1, right=-1):
    """bool [nq, nk], True = visible: FlashAttention's bottom-right aligned window."""
    i = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        right = 0
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


class TorchTest(ServerTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.gen = torch.Generator().manual_seed(SEED)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(dtype)

    def test_sdpa_equals_torch(self):
        # (leading dims, Hq, Hkv, L, S, E, is_causal, scale)
        grid = [((2,), 4, 4, 37, 53, 64, False, None),
                ((2,), 4, 4, 37, 53, 64, True, None),     # L < S: top-left keeps S - L keys out
                ((3,), 2, 2, 70, 20, 32, True, None),     # L > S: rows 20.. see every key
                ((2, 3), 4, 2, 17, 29, 16, True, None),   # two leading dims, GQA
                ((), 8, 2, 40, 40, 64, True, 0.3),        # 3-D input [H, L, E], GQA, a scale
                ((1,), 6, 3, 1, 45, 128, True, None),     # one query: sees key 0 only
                ((2,), 1, 1, 130, 65, 80, False, None)]
        for lead, hq, hkv, nq, nk, e, causal, scale in grid:
            with self.subTest(lead=lead, hq=hq, hkv=hkv, nq=nq, nk=nk, e=e, causal=causal):
                q = self.randn(*lead, hq, nq, e)
                k, v = self.randn(*lead, hkv, nk, e), self.randn(*lead, hkv, nk, e)
                gqa = hq != hkv
                o = remote.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                        enable_gqa=gqa, client=self.client)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                     enable_gqa=gqa)
                self.assertEqual(o.shape, ref.shape)
                self.assertEqual(o.dtype, torch.float32)
                self.assertWithin(rel(o, ref), F32_BOUND, "sdpa")

    def test_sdpa_key_padding_masks(self):
        b, h, nq, nk, e = 3, 4, 9, 31, 32
        q, k, v = self.randn(b, h, nq, e), self.randn(b, h, nk, e), self.randn(b, h, nk, e)
        keep = torch.rand(b, nk, generator=self.gen) > 0.4
        keep[:, 0] = True  # every item keeps a key (torch gives NaN rows otherwise)
        additive = torch.zeros(b, 1, 1, nk).masked_fill(~keep[:, None, None, :], float("-inf"))
        for mask in (keep[:, None, None, :], additive):
            with self.subTest(dtype=mask.dtype):
                o = remote.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                        client=self.client)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                self.assertWithin(rel(o, ref), F32_BOUND, "key-padding sdpa")

    def test_sdpa_half_types_come_back_as_given(self):
        for dtype in (torch.float16, torch.bfloat16):
            q = self.randn(2, 4, 20, 64, dtype=dtype)
            k, v = self.randn(2, 4, 33, 64, dtype=dtype), self.randn(2, 4, 33, 64, dtype=dtype)
            o = remote.scaled_dot_product_attention(q, k, v, is_causal=True, client=self.client)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            self.assertEqual(o.dtype, dtype)
            self.assertWithin(rel(o, ref), 1e-2, f"sdpa {dtype}")

    def test_sdpa_refuses_what_it_cannot_serve(self):
        q, k = self.randn(1, 2, 5, 16), self.randn(1, 2, 7, 16)
        c = self.client
        cases = [
            (dict(dropout_p=0.1), NotImplementedError, "dropout_p=0.1"),
            (dict(attn_mask=torch.ones(5, 7).tril().bool()), NotImplementedError,
             "key-padding masks"),
            (dict(attn_mask=torch.randn(1, 1, 1, 7)), NotImplementedError, "only 0 and -inf"),
            (dict(attn_mask=torch.ones(1, 1, 1, 7, dtype=torch.bool), is_causal=True), ValueError,
             "cannot be given together"),
        ]
        for kwargs, error, text in cases:
            with self.subTest(kwargs=list(kwargs)):
                with self.assertRaisesRegex(error, text):
                    remote.scaled_dot_product_attention(q, k, k, client=c, **kwargs)
        with self.assertRaisesRegex(ValueError, "enable_gqa=True"):
            remote.scaled_dot_product_attention(self.randn(1, 4, 5, 16), k, k, client=c)
        grad = q.clone().requires_grad_()
        with self.assertRaisesRegex(NotImplementedError, "query requires grad.*no_grad"):
            remote.scaled_dot_product_attention(grad, k, k, client=c)
        with torch.no_grad():
            remote.scaled_dot_product_attention(grad, k, k, client=c)
        with self.assertRaisesRegex(TypeError, "float64"):
            remote.scaled_dot_product_attention(q.double(), k.double(), k.double(), client=c)

    def test_default_client_from_environment(self):
        import os
        q = self.randn(1, 2, 6, 16)
        saved, remote._default = remote._default, None
        os.environ["ATTENTION_SERVICE"] = f"127.0.0.1:{self.port}"
        try:
            o = remote.scaled_dot_product_attention(q, q, q, is_causal=True)
            self.assertIs(remote.default_client(), remote._default)
            self.assertEqual(remote._default._target, f"127.0.0.1:{self.port}")
        finally:
            if remote._default is not None:
                remote._default.close()
            remote._default = saved
            del os.environ["ATTENTION_SERVICE"]
        ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        self.assertWithin(rel(o, ref), F32_BOUND, "default client")

    def test_flash_attn_func_bottom_right_with_lse(self):
        for nq, nk, causal, window in ((37, 53, True, (-1, -1)), (50, 20, True, (-1, -1)),
                                       (40, 40, False, (8, 3)), (33, 65, False, (-1, -1))):
            with self.subTest(nq=nq, nk=nk, causal=causal, window=window):
                q = self.randn(2, nq, 4, 64)  # BSHD
                k, v = self.randn(2, nk, 2, 64), self.randn(2, nk, 2, 64)
                o, lse, probs = remote.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                       return_attn_probs=True, client=self.client)
                self.assertIsNone(probs)
                mask = bottom_right_mask(nq, nk, causal, *window)
                seen = mask.any(1)  # rows that see no key: o = 0, lse = -inf
                ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                     v.transpose(1, 2), attn_mask=mask,
                                                     enable_gqa=True).transpose(1, 2)
                self.assertWithin(rel(o[:, seen], ref[:, seen]), F32_BOUND, "flash_attn_func")
                self.assertTrue(bool((o[:, ~seen] == 0).all()))
                s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) / 8.0
                ref_lse = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
                self.assertEqual(lse.shape, (2, 4, nq))
                self.assertWithin(rel(lse[..., seen], ref_lse[..., seen]), F32_BOUND, "lse")

    def test_flash_attn_func_softcap_sinks_and_v_head_dim(self):
        # Against a float64 eager computation: softcap before the mask, a sink logit per head in
        # the denominator, V's head dim 24 (QK 32); alibi_slopes is refused by name.
        nq, nk = 21, 40
        q, k = self.randn(2, nq, 4, 32), self.randn(2, nk, 2, 32)
        v, sinks = self.randn(2, nk, 2, 24), self.randn(4) * 2
        o = remote.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=2.0,
                                   sinks=sinks, client=self.client)
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(2, dim=2).double())
        s = 2.0 * torch.tanh(s / 32**0.5 / 2.0)
        s = s.masked_fill(~bottom_right_mask(nq, nk, True, 9, -1), float("-inf"))
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(2, 4, nq, 1)], dim=-1)
        p = s.softmax(-1)[..., :nk]
        ref = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(2, dim=2).double())
        self.assertEqual(o.shape, (2, nq, 4, 24))
        self.assertWithin(rel(o, ref), F32_BOUND, "flash_attn_func with softcap and sinks")
        with self.assertRaisesRegex(NotImplementedError, "alibi_slopes"):
            remote.flash_attn_func(q, k, k, alibi_slopes=torch.ones(4), client=self.client)

    def test_flash_attn_varlen_func(self):
        lens_q, lens_k = [5, 17, 1], [9, 17, 30]
        q = self.randn(sum(lens_q), 4, 32)
        k, v = self.randn(sum(lens_k), 1, 32), self.randn(sum(lens_k), 1, 32)
        cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
        cu_k = torch.tensor([0, 9, 26, 56], dtype=torch.int32)
        o = remote.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 30, causal=True,
                                          client=self.client)
        for b in range(3):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            mask = bottom_right_mask(lens_q[b], lens_k[b], True)
            ref = F.scaled_dot_product_attention(
                q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                attn_mask=mask, enable_gqa=True).transpose(0, 1)
            self.assertWithin(rel(o[qs], ref), F32_BOUND, f"varlen item {b}")

    def check_kvcache_step(self, o, q, k_all, v_all, lengths):
        for b, n in enumerate(lengths):
            mask = bottom_right_mask(q.shape[1], n, True)
            ref = F.scaled_dot_product_attention(
                q[b].transpose(0, 1), k_all[b][:n].transpose(0, 1), v_all[b][:n].transpose(0, 1),
                attn_mask=mask, enable_gqa=True).transpose(0, 1)
            self.assertWithin(rel(o[b], ref), F32_BOUND, f"kvcache item {b}")

    def test_flash_attn_with_kvcache_over_sessions_and_tensors(self):
        b, hq, hkv, d, s_max = 3, 4, 2, 64, 40
        k_all, v_all = self.randn(b, s_max, hkv, d), self.randn(b, s_max, hkv, d)
        with remote.SessionKVCache(self.client, b, hkv, d, torch.float32) as cache:
            ids = [s.id for s in cache.sessions]
            k_cache, v_cache = torch.zeros(b, s_max, hkv, d), torch.zeros(b, s_max, hkv, d)
            length = 0
            for new, nq in ((12, 12), (1, 1), (3, 2)):  # prefill, decode, an extend step
                q = self.randn(b, nq, hq, d)
                k, v = k_all[:, length:length + new], v_all[:, length:length + new]
                o, lse = remote.flash_attn_with_kvcache(q, cache, None, k=k, v=v, causal=True,
                                                        cache_seqlens=length,
                                                        return_softmax_lse=True)
                self.assertEqual(lse.shape, (b, hq, nq))
                o2 = remote.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, causal=True,
                                                    cache_seqlens=torch.full((b,), length),
                                                    client=self.client)
                length += new
                self.assertEqual(cache.lengths, [length] * b)
                self.assertTrue(torch.equal(k_cache[:, :length], k_all[:, :length]))
                self.check_kvcache_step(o, q, k_all, v_all, [length] * b)
                self.check_kvcache_step(o2, q, k_all, v_all, [length] * b)
            with self.assertRaisesRegex(ValueError, "cache_seqlens"):
                remote.flash_attn_with_kvcache(q, cache, None, cache_seqlens=3)
        listed = {s.session_id for s in self.client.list_sessions().sessions}
        self.assertFalse(listed & set(ids), "the cache's sessions outlived it")

    def test_flash_attn_with_kvcache_qv_over_a_latent_cache(self):
        # FlashAttention-3's MLA decode (qv): logits q.k + qv.v over the rotary key k [.., D] and
        # the latent v [.., R], out [.., R], the default scale 1 / sqrt(D + R); the sessions hold
        # [v, k] once (v_from_k). Against a float64 reference of that definition.
        b, hq, d, r = 2, 8, 8, 24
        k_all, v_all = self.randn(b, 30, 1, d), self.randn(b, 30, 1, r)
        with remote.SessionKVCache(self.client, b, 1, d, torch.float32, qv_head_dim=r) as cache:
            self.assertTrue(all(s.v_from_k and (s.head_dim, s.v_head_dim) == (d + r, r)
                                for s in cache.sessions))
            length = 0
            for new in (20, 1, 1):
                q, qv = self.randn(b, new, hq, d), self.randn(b, new, hq, r)
                k, v = k_all[:, length:length + new], v_all[:, length:length + new]
                o = remote.flash_attn_with_kvcache(q, cache, None, k=k, v=v, qv=qv, causal=True)
                length += new
                self.assertEqual(o.shape, (b, new, hq, r))
                for i in range(b):
                    kk, vv = k_all[i, :length, 0].double(), v_all[i, :length, 0].double()
                    s = (torch.einsum("qhd,kd->hqk", q[i].double(), kk) +
                         torch.einsum("qhr,kr->hqk", qv[i].double(), vv)) / (d + r) ** 0.5
                    s = s.masked_fill(~bottom_right_mask(new, length, True), float("-inf"))
                    ref = torch.einsum("hqk,kr->qhr", s.softmax(-1), vv)
                    self.assertWithin(rel(o[i], ref), F32_BOUND, f"qv step {length} item {i}")
            with self.assertRaisesRegex(ValueError, "qv: expected with a SessionKVCache"):
                remote.flash_attn_with_kvcache(q, cache, None, causal=True)
        with remote.SessionKVCache(self.client, 1, 1, d, torch.float32) as plain:
            with self.assertRaisesRegex(ValueError, "qv: expected only with"):
                remote.flash_attn_with_kvcache(q[:1], plain, None, qv=qv[:1])

    def test_packed_step_of_a_models_views_equals_the_protobuf_built_step(self):
        # A decode layer's q, k, v as a model hands them (decode_bench.py: split from one
        # projection, [B, 1, H, D] transposed to [B, H, 1, D]), here all strided views, go onto
        # the wire from their host copies (step_batch's WireMessage); the same Step built through
        # protobuf from contiguous copies is answered bit for bit alike, o back as q's dtype and
        # device.
        from attention_client._stubs import attention_pb2 as pb
        b, hq, hkv, d = 5, 8, 2, 32
        for dtype, wire in ((torch.bfloat16, pb.DTYPE_BFLOAT16),
                            (torch.float16, pb.DTYPE_FLOAT16)):
            hand, built = ([self.client.session(dtype=dtype, kv_heads=hkv, head_dim=d)
                            for _ in range(b)] for _ in range(2))
            for i, (s, t) in enumerate(zip(hand, built)):
                k0, v0 = (self.randn(hkv, 7 + i, d, dtype=dtype) for _ in range(2))
                s.append(k0, v0)
                t.append(k0, v0)
            y = self.randn(b, 1, (hq + 2 * hkv) * d, dtype=dtype)
            q, k, v = y.split([hq * d, hkv * d, hkv * d], -1)
            q, k, v = (x.view(b, 1, -1, d).transpose(1, 2) for x in (q, k, v))  # strided views
            self.assertFalse(any(x.is_contiguous() for x in (q, k, v)))
            request = pb.StepRequest(session_ids=[s.id for s in built], causal=True)
            for name, x in (("q", q), ("k", k), ("v", v)):
                getattr(request, name).CopyFrom(pb.Tensor(
                    dtype=wire, shape=x.shape,
                    data=x.contiguous().view(torch.int16).numpy().tobytes()))
            want = self.client._call(self.client._sessions_stub.Step, request, None, None)
            o = self.client.step_batch(hand, q, k, v, causal=True)
            self.assertEqual((o.dtype, o.device, o.shape), (dtype, q.device, q.shape))
            self.assertEqual(o.view(torch.int16).numpy().tobytes(), want.o.data,
                             f"{dtype} (seed {SEED})")
            o += 1  # the output is the caller's: writable
            for s in hand + built:
                s.drop()


if __name__ == "__main__":
    unittest.main()
