"""Greedy decode of a Llama-shaped model (random weights) with its KV cache on the attention
service against the same model with a local KV cache and torch SDPA: tokens/s, and where the time
of a remote token goes (the Step RPCs, the server's own time in them, the rest of the model).

The model is plain torch (RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP): the GPU host
has torch but not transformers. The remote path is what attention_client.transformers.RemoteCache
does: one session per layer and sequence created with the prompt's K/V, then one Step per layer
per decode step carrying every sequence's new q, k and v.

    python3 bench/torch/decode_bench.py --target=localhost:50051 --batch=1,8 --context=4096
Prints one JSON line per batch size, then a table.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import attention_client


def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


def rotary(x, pos, theta=500000.0):
    """x [B, H, N, D] at positions pos [N]: rotate-half rotary embedding."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Model:
    def __init__(self, a, device, dtype):
        g = torch.Generator(device="cpu").manual_seed(a.seed)

        def w(*shape, fan_in):
            return (torch.randn(*shape, generator=g) * (a.weight_scale / math.sqrt(fan_in))).to(
                device=device, dtype=dtype)

        h, d = a.hidden, a.head_dim
        self.a = a
        self.embed = w(a.vocab, h, fan_in=1)
        self.layers = []
        for _ in range(a.layers):
            self.layers.append(dict(
                qkv=w((a.heads + 2 * a.kv_heads) * d, h, fan_in=h), o=w(h, a.heads * d, fan_in=a.heads * d),
                up=w(2 * a.inter, h, fan_in=h), down=w(h, a.inter, fan_in=a.inter),
                n1=torch.ones(h, device=device, dtype=dtype), n2=torch.ones(h, device=device, dtype=dtype)))
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.head = w(a.vocab, h, fan_in=h)

    def forward(self, ids, pos, attend):
        """ids [B, N] at positions pos [N]; attend(layer, q, k, v) -> o, all [B, H, N, D]."""
        a = self.a
        x = self.embed[ids]
        b, n, _ = x.shape
        for i, L in enumerate(self.layers):
            y = rms_norm(x, L["n1"]) @ L["qkv"].T
            q, k, v = y.split([a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], -1)
            q = rotary(q.view(b, n, a.heads, a.head_dim).transpose(1, 2), pos)
            k = rotary(k.view(b, n, a.kv_heads, a.head_dim).transpose(1, 2), pos)
            v = v.view(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
            o = attend(i, q, k, v).transpose(1, 2).reshape(b, n, -1)
            x = x + o @ L["o"].T
            gate, up = (rms_norm(x, L["n2"]) @ L["up"].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ L["down"].T
        return rms_norm(x[:, -1], self.norm) @ self.head.T  # logits of the last position


class LocalCache:
    def __init__(self, a, batch, device, dtype):
        n = a.context + a.new_tokens
        self.k = [torch.zeros(batch, a.kv_heads, n, a.head_dim, device=device, dtype=dtype) for _ in range(a.layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = [0] * a.layers

    def attend(self, i, q, k, v):
        n, start = k.shape[2], self.lengths[i]
        end = self.lengths[i] = start + n
        self.k[i][:, :, start:end] = k
        self.v[i][:, :, start:end] = v
        return F.scaled_dot_product_attention(q, self.k[i][:, :, :end], self.v[i][:, :, :end],
                                              is_causal=n > 1, enable_gqa=True)


class RemoteCache:
    """One session per layer and sequence; the prefill's K/V create them, each decode step is one
    Step per layer over every sequence. Counts the Step RPCs' time and the server's part of it."""

    def __init__(self, client):
        self.client = client
        self.sessions = {}
        self.rpc_s = 0.0
        self.server_us = 0.0
        self.steps = 0

    def attend(self, i, q, k, v):
        b, _, n, _ = q.shape
        if i not in self.sessions:  # prefill: attention computed locally, K/V sent once
            self.sessions[i] = [self.client.session(k=k[j].contiguous(), v=v[j].contiguous()) for j in range(b)]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        items = [(s, q[j], k[j], v[j]) for j, s in enumerate(self.sessions[i])]
        start = time.perf_counter()
        results = self.client.step_many(items, causal=True, return_info=True)
        self.rpc_s += time.perf_counter() - start
        self.server_us += results[0].timing.total_us
        self.steps += 1
        return torch.stack([r.o for r in results])

    def close(self):
        for sessions in self.sessions.values():
            for s in sessions:
                s.drop()


def generate(model, cache_attend, prompt, new_tokens, sync):
    """Greedy: the prompt's forward, then new_tokens - 1 single-token steps. Returns the tokens
    [B, new_tokens] and the decode time (every step after the prefill), seconds."""
    n = prompt.shape[1]
    device = prompt.device
    logits = model.forward(prompt, torch.arange(n, device=device), cache_attend)
    tokens = [logits.argmax(-1)]
    sync()
    start = time.perf_counter()
    for t in range(new_tokens - 1):
        logits = model.forward(tokens[-1][:, None], torch.tensor([n + t], device=device), cache_attend)
        tokens.append(logits.argmax(-1))
    sync()
    return torch.stack(tokens, 1), time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:50051")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--inter", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weight_scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = a.layers * (a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * a.hidden
                         + 3 * a.hidden * a.inter) + 2 * a.vocab * a.hidden
    model = Model(a, device, dtype)
    client = attention_client.Client(a.target, timeout=600)
    rows = []
    with torch.inference_mode():
        for batch in [int(x) for x in a.batch.split(",")]:
            g = torch.Generator(device="cpu").manual_seed(a.seed + batch)
            prompt = torch.randint(0, a.vocab, (batch, a.context), generator=g).to(device)
            local = LocalCache(a, batch, device, dtype)
            want, local_s = generate(model, local.attend, prompt, a.new_tokens, sync)
            del local
            remote = RemoteCache(client)
            try:
                got, remote_s = generate(model, remote.attend, prompt, a.new_tokens, sync)
            finally:
                remote.close()
            decoded = batch * (a.new_tokens - 1)
            steps = max(a.new_tokens - 1, 1)
            row = dict(batch=batch, context=a.context, params_b=params / 1e9, dtype=a.dtype,
                       local_tok_s=decoded / local_s, remote_tok_s=decoded / remote_s,
                       ratio=local_s / remote_s,
                       remote_ms_per_step=1e3 * remote_s / steps,
                       step_rpcs_ms_per_step=1e3 * remote.rpc_s / steps,
                       server_ms_per_step=1e-3 * remote.server_us / steps,
                       rest_ms_per_step=1e3 * (remote_s - remote.rpc_s) / steps,
                       local_ms_per_step=1e3 * local_s / steps,
                       same_tokens=float((got == want).float().mean()),
                       distinct_tokens=len(set(want.flatten().tolist())))
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\nLlama-shaped {params / 1e9:.2f}B params, {a.layers} layers, Hq={a.heads} Hkv={a.kv_heads} "
          f"D={a.head_dim}, {a.dtype}, context {a.context}, {a.new_tokens} new tokens, {device}")
    print(f"{'batch':>5} {'local tok/s':>11} {'remote tok/s':>12} {'ratio':>6} {'ms/step':>8} "
          f"{'Steps ms':>8} {'server ms':>9} {'rest ms':>7} {'local ms':>8} {'same tok':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['local_tok_s']:>11.1f} {r['remote_tok_s']:>12.1f} {r['ratio']:>6.2f} "
              f"{r['remote_ms_per_step']:>8.2f} {r['step_rpcs_ms_per_step']:>8.2f} "
              f"{r['server_ms_per_step']:>9.2f} {r['rest_ms_per_step']:>7.2f} "
              f"{r['local_ms_per_step']:>8.2f} {r['same_tokens']:>8.2f}")


if __name__ == "__main__":
    main()
