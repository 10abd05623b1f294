#!/usr/bin/env python3
"""FlashAttention-3 (the fa3-fwd wheel) on the open-model shapes, the anchor for the options'
benchmarks (bench/README.md, "Forward kernel options" and "MLA's absorbed decode"):

  softcap  FA3's forward (flash_attn_func, bfloat16: the wheel has float16 compiled out) plain and
           with softcap 50, alternately over --rounds rounds, on forward_ab.sh's default shapes
           (N 4096, D 64 / 128 / 256, B = 16384 / N, H = 2048 / D, causal and not): what the
           softcap costs the fastest kernel there is, beside what it costs ours.
  mla      FA3's decode with MLA's absorbed shapes (flash_attn_with_kvcache with qv: q of the 64
           rope dims, qv of the 512 latent ones, one KV head holding 64 + 512 dims a row, V the 512
           latent ones), the shapes of `decode_bench --shapes` (Hq 128 and 16, B 1 / 8 / 32 / 64,
           NK 4096 and 32768): ms, "latent_tbps" (B NK 576 2 bytes over the time) and TFLOP/s
           (2 B Hq NK (576 + 512)), to set beside decode_bench's mla rows.

Timed with triton.testing.do_bench (median; it clears the L2 between runs), one JSON line per row.

    python3 bench/cuda/fa3_options_anchor.py [--what softcap,mla] [--rounds 3]
"""
import argparse
import json
import statistics

import torch
from triton.testing import do_bench


def softcap_rows(rounds):
    from fa3_fwd_interface import flash_attn_func
    for d in (64, 128, 256):
        for causal in (False, True):
            n, b, h = 4096, 16384 // 4096, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            ms = {"plain": [], "softcap": []}
            for _ in range(rounds):
                for name, cap in (("plain", 0.0), ("softcap", 50.0)):
                    ms[name].append(do_bench(
                        lambda: flash_attn_func(q, k, v, causal=causal, softcap=cap)))
            plain, capped = (statistics.median(ms[x]) for x in ("plain", "softcap"))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            yield dict(what="softcap", dtype="bfloat16", d=d, N=n, causal=causal,
                       plain_ms=plain, softcap_ms=capped, plain_tflops=flops / plain / 1e9,
                       speed=plain / capped)


def mla_rows():
    from fa3_fwd_interface import flash_attn_with_kvcache
    rope, latent = 64, 512
    for hq in (128, 16):
        for nk in (4096, 32768):
            for b in (1, 8, 32, 64):
                q = torch.randn(b, 1, hq, rope, device="cuda", dtype=torch.bfloat16)
                qv = torch.randn(b, 1, hq, latent, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, nk, 1, rope, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, nk, 1, latent, device="cuda", dtype=torch.bfloat16)
                lengths = torch.full((b,), nk, dtype=torch.int32, device="cuda")
                scale = (rope + latent) ** -0.5
                ms = do_bench(lambda: flash_attn_with_kvcache(
                    q, k, v, qv=qv, cache_seqlens=lengths, softmax_scale=scale))
                yield dict(what="mla", shape=f"mla_hq{hq}", batch=b, nk=nk, ms=ms,
                           latent_tbps=b * nk * (rope + latent) * 2 / ms / 1e9,
                           tflops=2 * b * hq * nk * (rope + latent + latent) / ms / 1e9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", default="softcap,mla")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    for what in a.what.split(","):
        if what not in ("softcap", "mla"):
            p.error(f"--what: expected softcap and/or mla, got {what!r}")
        rows = softcap_rows(a.rounds) if what == "softcap" else mla_rows()
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
