"""A model's greedy decode with attention and KV on the service, beside the same model with local
FlashAttention-3: tokens/s and their ratio, per batch, context and transport.

The model is an 8B-shaped Llama in plain torch (RMSNorm, rotary embeddings, GQA attention, SwiGLU
MLP; random weights; 16 layers by default to fit beside the server). Each layer's KV cache starts
with `context` rows of random K/V, the same for every attention; then `warmup + tokens` greedy
steps of one token per sequence, the last `tokens` timed, in `rounds` decodes of each attention
that alternate with as many of the anchor's (the first attention, alive throughout), so a drift
of the machine's speed reaches both: a row's time is the median of its rounds (spread: max - min
over the median), its ratio against the anchor's rounds that alternated with it. Attentions
(--attn):

  fa3      local FlashAttention-3 flash_attn_with_kvcache over a preallocated cache (the anchor;
           the fa3-fwd wheel, `fa3_fwd_interface`)
  fa3-graph  the same, each step after the first replayed from one CUDA graph (no launch
           costs of eager torch: the model's GPU time alone; the strongest local anchor)
  sdpa     local torch SDPA over a preallocated cache (a second column)
  unary    the service: one session per layer and sequence, one Step RPC per layer per token
           with an entry per sequence
  stream   the same Steps over one Sessions.StepStream
  ring     the same Steps through a request ring (server on this host, --allow_shared_memory)
  packed   one packed Step per layer call (q [B, Hq, 1, D], k, v [B, Hkv, 1, D] as one tensor
           each: Client.step_batch, what attention_client.transformers' RemoteCache sends), unary
  packed-socket  the packed Step over the client's socket stream (the server's --socket_port:
           length-framed messages on a plain TCP connection, no HTTP/2), the transport of a
           remote client
  packed-socket-overlap  packed-overlap's ping-pong with each half's Step posted on the socket
           stream (step_batch(wait=False, stream="socket"): both halves in flight on one socket)
  packed-ring  the packed Step through a request ring, q, k, v and o by reference in a
           shared-memory region that the model's process pins (cudaHostRegister), so each layer
           call is one device-to-host copy of q, k, v and one host-to-device copy of o
  packed-overlap  two micro-batches in ping-pong, each half's packed Step an asynchronous unary
           call (step_batch(wait=False)) while the other half computes (Model.forward_overlapped)
  packed-cuda  the packed Step of the model's CUDA tensors through CUDA regions in stream order
           (Client.step_batch's default for CUDA tensors): the server's kernels read q, k, v and
           write o in the model's GPU memory, ordered by interprocess events, nothing
           synchronised; unary
  packed-cuda-ring  the same through the client's request ring
  packed-cuda-pipe  the same, ordered by counters and posted without waiting for the answer
           (step_batch(wait=False, stream="ring")): the model queues its next kernels while the
           server works; each answer is read by the next layer's post (its failure raised there)
The host-path attentions (packed, packed-ring, packed-overlap and the per-entry ones) use a
Client with cuda_regions="off", so they measure what they name.

Prints one JSON line per (batch, context, attention), then the ratio table against fa3 (or the
first attention given), with the client's time in a layer call (ms/call; wait: of it, the
Step posted without waiting still waiting for the server's previous answer or slot), the
server's part of a layer call (ServerTiming: total, prepare,
run, kernel). Against the anchor: the first layer's attention output at step 0 (the same inputs
for every attention) and the first step's logits after all layers (max |diff| / max |value|),
and the share of equal greedy tokens.

    python3 bench/torch/decode_bench.py --target=127.0.0.1:50051 --batch=8,32,64 --context=1024,4096
"""
import argparse
import concurrent.futures
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F


def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


def rotary_tables(pos, d, dtype, theta=500000.0):
    """cos, sin [1, N, 1, D] of positions pos [N] (once per step: every layer uses them)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos()] * 2, -1).to(dtype)[None, :, None, :]
    sin = torch.cat([ang.sin()] * 2, -1).to(dtype)[None, :, None, :]
    return cos, sin


def rotary(x, cos, sin):
    """x [B, N, H, D]: rotate-half rotary embedding."""
    d = x.shape[-1]
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
        self.layers = [dict(qkv=w((a.heads + 2 * a.kv_heads) * d, h, fan_in=h),
                            o=w(h, a.heads * d, fan_in=a.heads * d),
                            up=w(2 * a.inter, h, fan_in=h), down=w(h, a.inter, fan_in=a.inter),
                            n1=torch.ones(h, device=device, dtype=dtype),
                            n2=torch.ones(h, device=device, dtype=dtype))
                       for _ in range(a.layers)]
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.head = w(a.vocab, h, fan_in=h)

    def pre_attention(self, L, x, cos, sin):
        """x [B, 1, hidden] -> q [B, 1, Hq, D], k, v [B, 1, Hkv, D] (FlashAttention's layout)."""
        a = self.a
        b, n, _ = x.shape
        y = rms_norm(x, L["n1"]) @ L["qkv"].T
        q, k, v = y.split([a.heads * a.head_dim, a.kv_heads * a.head_dim,
                           a.kv_heads * a.head_dim], -1)
        q = rotary(q.view(b, n, a.heads, a.head_dim), cos, sin)
        k = rotary(k.view(b, n, a.kv_heads, a.head_dim), cos, sin)
        return q, k, v.view(b, n, a.kv_heads, a.head_dim)

    def post_attention(self, L, x, o):
        """The output projection and the MLP: x, o [B, 1, Hq, D] -> the next layer's x."""
        b, n, _ = x.shape
        x = x + o.reshape(b, n, -1) @ L["o"].T
        gate, up = (rms_norm(x, L["n2"]) @ L["up"].T).chunk(2, -1)
        return x + (F.silu(gate) * up) @ L["down"].T

    def forward(self, ids, pos, attention):
        """ids [B, 1] at position pos [1]; attention.attend(layer, q, k, v) -> o [B, 1, Hq, D].
        Returns logits [B, V]."""
        x = self.embed[ids]
        cos, sin = rotary_tables(pos, self.a.head_dim, x.dtype)
        for i, L in enumerate(self.layers):
            x = self.post_attention(L, x, attention.attend(i, *self.pre_attention(L, x, cos, sin)))
        return rms_norm(x[:, -1], self.norm) @ self.head.T

    def forward_overlapped(self, ids, pos, attention):
        """As forward, over two micro-batches in ping-pong: attention.start(layer, half, q, k, v)
        sends a half's attention and returns at once, attention.finish(handle) waits for its o.
        Each half goes on to its next layer as soon as its own attention is back, so one half's
        output projection, MLP and next q, k, v overlap the other half's attention (the ping-pong
        of attention-FFN disaggregation)."""
        xs = [self.embed[h] for h in ids.chunk(2)]
        cos, sin = rotary_tables(pos, self.a.head_dim, xs[0].dtype)
        first = self.layers[0]
        pending = [attention.start(0, h, *self.pre_attention(first, x, cos, sin))
                   for h, x in enumerate(xs)]
        for i, L in enumerate(self.layers):
            for h in range(2):
                xs[h] = self.post_attention(L, xs[h], attention.finish(pending[h]))
                if i + 1 < len(self.layers):
                    after = self.layers[i + 1]
                    pending[h] = attention.start(i + 1, h,
                                                 *self.pre_attention(after, xs[h], cos, sin))
        return rms_norm(torch.cat(xs)[:, -1], self.norm) @ self.head.T


def initial_kv(a, batch, context, layer, device, dtype):
    """The random K/V a layer's cache starts with: k, v [B, context, Hkv, D]."""
    g = torch.Generator(device=device).manual_seed(a.seed * 1000 + layer)
    k = torch.randn(batch, context, a.kv_heads, a.head_dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(batch, context, a.kv_heads, a.head_dim, generator=g, device=device, dtype=dtype)
    return k, v


class Attention:
    """What every attention below shares: the first layer-0 output it computed (step 0, whose
    inputs are the same for every attention), to compare with the anchor's."""

    first_o = None
    overlapped = False
    graphed = False  # each step after the first replayed from one CUDA graph (decode)

    def record(self, i, o):
        if i == 0 and self.first_o is None:
            self.first_o = o.float().clone()
        return o

    def close(self):
        pass


class LocalFA3(Attention):
    """flash_attn_with_kvcache over a preallocated [B, S, Hkv, D] cache per layer."""

    def __init__(self, a, batch, context, steps, device, dtype):
        from fa3_fwd_interface import flash_attn_with_kvcache
        self.fn = flash_attn_with_kvcache
        self.k, self.v = [], []
        for i in range(a.layers):
            k0, v0 = initial_kv(a, batch, context, i, device, dtype)
            pad = torch.zeros(batch, steps, a.kv_heads, a.head_dim, device=device, dtype=dtype)
            self.k.append(torch.cat([k0, pad], 1))
            self.v.append(torch.cat([v0, pad.clone()], 1))
        self.lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.layers = a.layers

    def attend(self, i, q, k, v):
        o = self.fn(q, self.k[i], self.v[i], k=k, v=v, cache_seqlens=self.lengths, causal=True)
        if i == self.layers - 1:
            self.lengths += 1
        return self.record(i, o[0] if isinstance(o, tuple) else o)


class LocalFA3Graph(LocalFA3):
    """As fa3, the whole step (every layer, the logits) replayed from one CUDA graph after the
    first step ran eagerly: the model's GPU time without the launches of eager torch, the
    strongest local anchor (how vLLM-class engines decode)."""

    graphed = True


class LocalSDPA(Attention):
    """torch SDPA over the same preallocated cache (as [B, Hkv, S, D])."""

    def __init__(self, a, batch, context, steps, device, dtype):
        self.k, self.v = [], []
        for i in range(a.layers):
            k0, v0 = initial_kv(a, batch, context, i, device, dtype)
            pad = torch.zeros(batch, steps, a.kv_heads, a.head_dim, device=device, dtype=dtype)
            self.k.append(torch.cat([k0, pad], 1).transpose(1, 2).contiguous())
            self.v.append(torch.cat([v0, pad.clone()], 1).transpose(1, 2).contiguous())
        self.length = context
        self.layers = a.layers

    def attend(self, i, q, k, v):
        n = self.length
        self.k[i][:, :, n] = k[:, 0]
        self.v[i][:, :, n] = v[:, 0]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[i][:, :, :n + 1],
                                           self.v[i][:, :, :n + 1], enable_gqa=True)
        if i == self.layers - 1:
            self.length += 1
        return self.record(i, o.transpose(1, 2))


class ServiceSteps(Attention):
    """One session per layer and sequence, created with the cache's initial K/V; each layer call
    is one Step over every sequence of the batch, one entry per sequence (`transport`: "unary",
    "stream" for a StepStream, "ring" for a request ring). With `layered`, one session per
    sequence holding every layer (Client.session(layers=)), its layers' initial K/V appended, and
    each Step names its layer. Counts the calls' time and the server's part (ServerTiming, per
    field)."""

    layered = False

    def __init__(self, client, transport, a, batch, context, device, dtype):
        import attention_client
        import attention_client.session as sessions
        self.step_many = sessions.step_many
        self.client = client
        self.stream = {"unary": False, "stream": True, "ring": "ring"}.get(transport, False)
        self.sessions = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            if self.layered:
                groups = list(pool.map(lambda j: client.session(
                    dtype=dtype, kv_heads=a.kv_heads, head_dim=a.head_dim, layout="bshd",
                    layers=a.layers), range(batch)))
            for i in range(a.layers):
                k0, v0 = initial_kv(a, batch, context, i, device, dtype)
                k0, v0 = k0.cpu(), v0.cpu()
                if self.layered:
                    list(pool.map(lambda j: groups[j].append(k0[j], v0[j], layer=i),
                                  range(batch)))
                    self.sessions.append(groups)
                else:
                    self.sessions.append(list(pool.map(
                        lambda j: client.session(k=k0[j], v=v0[j], layout="bshd"),
                        range(batch))))
        self.calls = 0
        self.call_s = 0.0
        self.server_us = dict.fromkeys(attention_client.ServerTiming._fields, 0.0)

    def count(self, start, timing):
        """One call's time since `start` (None: counted by the caller) and its ServerTiming."""
        if start is not None:
            self.call_s += time.perf_counter() - start
        for name in self.server_us:
            self.server_us[name] += getattr(timing, name)
        self.calls += 1

    def attend(self, i, q, k, v):
        # q [B, 1, Hq, D] -> per sequence [Hq, 1, D]; k, v -> [Hkv, 1, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        items = [(s, q[j], k[j], v[j]) for j, s in enumerate(self.sessions[i])]
        start = time.perf_counter()
        results = self.step_many(self.client, items, causal=True, return_info=True,
                                 stream=self.stream)
        self.count(start, results[0].timing)
        return self.record(i, torch.stack([r.o for r in results]).transpose(1, 2))

    def close(self):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            every = {id(s): s for layer in self.sessions for s in layer}.values()
            list(pool.map(lambda s: s.drop(), every))


class ServicePacked(ServiceSteps):
    """As ServiceSteps, but each layer call is one packed Step (Client.step_batch) over sessions
    that hold every layer: "packed" unary; "packed-socket" over a socket stream; "packed-ring"
    through the client's request ring, q, k, v and o in a pinned shared-memory region;
    "packed-overlap" two micro-batches in ping-pong (Model.forward_overlapped), each half's Step
    a unary call in flight while the other half computes ("packed-socket-overlap": posted on the
    socket stream)."""

    layered = True

    def __init__(self, client, transport, a, batch, context, device, dtype):
        super().__init__(client, transport, a, batch, context, device, dtype)
        self.stream = ("ring" if transport.endswith(("-ring", "-pipe")) else
                       "socket" if transport.startswith("packed-socket") else False)
        self.pipelined = transport == "packed-cuda-pipe"
        self.posted = None  # packed-cuda-pipe: the Step posted last, its answer not yet counted
        self.wait_s = 0.0  # packed-cuda-pipe: of call_s, the posts' waits for the server
        self.overlapped = transport in ("packed-overlap", "packed-socket-overlap")
        self.halves = [[s[:batch // 2], s[batch // 2:]] for s in self.sessions]
        self.region = None
        if transport == "packed-ring":
            from multiprocessing import shared_memory
            import numpy as np
            shapes = dict(q=(batch, a.heads, 1, a.head_dim), k=(batch, a.kv_heads, 1, a.head_dim),
                          v=(batch, a.kv_heads, 1, a.head_dim), o=(batch, a.heads, 1, a.head_dim))
            width = torch.empty((), dtype=dtype).element_size()
            sizes = {n: (math.prod(sh) * width + 4095) // 4096 * 4096 for n, sh in shapes.items()}
            self.shm = shared_memory.SharedMemory(create=True, size=sum(sizes.values()))
            self.region = client.register_shared_memory(f"decode-{id(self)}", self.shm)
            self.host, at = {}, 0
            for name, shape in shapes.items():
                raw = self.region.array((sizes[name],), np.uint8, offset=at)
                self.host[name] = torch.from_numpy(raw).view(dtype)[:math.prod(shape)].view(shape)
                at += sizes[name]
            # Pinned: the copies between the model's GPU and the region run at PCIe speed.
            self.pinned = None
            if device.type == "cuda":
                self.pinned = self.host["q"].data_ptr()
                err = torch.cuda.cudart().cudaHostRegister(self.pinned, self.shm.size, 0)
                assert int(err) == 0, f"cudaHostRegister: {err}"

    def attend(self, i, q, k, v):
        # q [B, 1, Hq, D] -> [B, Hq, 1, D]; k, v -> [B, Hkv, 1, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        start = time.perf_counter()
        if self.pipelined:
            rings = self.client._step_rings  # one: the server has one owner name
            ring = next(iter(rings.values()), None)
            waited = ring.waited_s if ring is not None else 0.0
            step = self.client.step_batch(self.sessions[i], q, k, v, causal=True, layer=i,
                                          return_info=True, stream="ring", wait=False)
            self.call_s += time.perf_counter() - start
            # Of which waiting for the server (the previous Step's answer, or its slot).
            now = next(iter(rings.values()))
            self.wait_s += now.waited_s - (waited if now is ring else 0.0)
            self.settle()  # its answer was read by this post
            self.posted = step
            return self.record(i, step.o.transpose(1, 2))
        if self.region is None:  # host tensors, or (packed-cuda) CUDA regions in stream order
            result = self.client.step_batch(self.sessions[i], q, k, v, causal=True, layer=i,
                                            return_info=True, stream=self.stream)
            o = result.o
        else:
            for name, t in (("q", q), ("k", k), ("v", v)):
                self.host[name].copy_(t)
            result = self.client.step_batch(self.sessions[i], self.host["q"], self.host["k"],
                                            self.host["v"], causal=True, out=self.host["o"],
                                            layer=i, return_info=True, stream=self.stream)
            o = self.host["o"].to(q.device, copy=True)
        self.count(start, result.timing)
        return self.record(i, o.transpose(1, 2))

    def settle(self):
        """packed-cuda-pipe: counts the server's part of the Step posted last (raises its
        failure)."""
        if self.posted is not None:
            timing, self.posted = self.posted.result().timing, None
            self.count(None, timing)

    def start(self, i, half, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        future = self.client.step_batch(self.halves[i][half], q, k, v, causal=True, layer=i,
                                        return_info=True, wait=False, stream=self.stream)
        return i, half, future, time.perf_counter()

    def finish(self, handle):
        i, half, future, start = handle
        result = future.result()
        self.count(start, result.timing)
        o = result.o.transpose(1, 2)
        if i == 0 and self.first_o is None:
            if half == 0:
                self.first_half = o.float().clone()
            else:
                self.record(i, torch.cat([self.first_half, o.float()]))
        return o

    def close(self):
        self.settle()
        super().close()
        if self.region is not None:
            if self.pinned is not None:
                torch.cuda.cudart().cudaHostUnregister(self.pinned)
            self.host = None
            self.region.unregister()
            self.shm.close()
            self.shm.unlink()


def decode(model, attention, batch, context, a, device):
    """Greedy steps from random first tokens; returns (first step's logits, tokens [B, steps],
    seconds of the last a.tokens steps)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(a.seed + batch)
    ids = torch.randint(0, a.vocab, (batch, 1), generator=g).to(device)
    tokens, first = [], None
    graph = None
    for t in range(a.warmup + a.tokens):
        if t == a.warmup:
            sync()
            start = time.perf_counter()
        if graph is not None:  # fa3-graph after its first step
            graph_ids.copy_(ids)
            graph_pos.fill_(context + t)
            graph.replay()
            logits = graph_logits
        else:
            forward = model.forward_overlapped if attention.overlapped else model.forward
            logits = forward(ids, torch.tensor([context + t], device=device), attention)
        if first is None:
            first = logits.float()
        ids = logits.argmax(-1, keepdim=True)
        tokens.append(ids)
        if t == 0 and attention.graphed:
            # The next steps' work captured once (nothing runs during the capture), on the
            # inputs' buffers that each replay refills.
            graph_ids, graph_pos = ids.clone(), torch.tensor([context + 1], device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_logits = model.forward(graph_ids, graph_pos, attention)
    sync()
    return first, torch.cat(tokens, 1), time.perf_counter() - start


def make_attention(name, a, batch, context, capacity, client_for, device, dtype):
    """Attention `name` over `context` rows per sequence; a local one holds `capacity` more."""
    if name == "fa3":
        return LocalFA3(a, batch, context, capacity, device, dtype)
    if name == "fa3-graph":
        return LocalFA3Graph(a, batch, context, capacity, device, dtype)
    if name == "sdpa":
        return LocalSDPA(a, batch, context, capacity, device, dtype)
    if name.startswith("packed"):
        return ServicePacked(client_for(name), name, a, batch, context, device, dtype)
    return ServiceSteps(client_for(name), name, a, batch, context, device, dtype)


def compare(a, model, attns, batch, context, client_for, device, dtype):
    """The rows of one (batch, context): the anchor (attns[0]) lives throughout, and each other
    attention's a.rounds decodes alternate with as many of the anchor's, so both see the same
    state of the machine; each row's time is the median of its rounds, its ratio against the
    median of the anchor's rounds that alternated with it. The first rounds (the same inputs for
    all) are compared with the anchor's first."""
    steps = a.warmup + a.tokens
    capacity = steps * (1 + a.rounds * len(attns))  # rows every local cache may gain
    anchor_attn = make_attention(attns[0], a, batch, context, capacity, client_for, device, dtype)
    rows = []
    try:
        first, tokens, seconds = decode(model, anchor_attn, batch, context, a, device)
        anchor = (first, tokens, anchor_attn.first_o)
        anchor_rounds = [seconds]
        for name in attns[1:]:
            attention = make_attention(name, a, batch, context, capacity, client_for, device,
                                       dtype)
            try:
                paired, rounds, mine = [], [], None
                for _ in range(a.rounds):
                    paired.append(decode(model, anchor_attn, batch, context, a, device)[2])
                    out = decode(model, attention, batch, context, a, device)
                    mine = mine or out
                    rounds.append(out[2])
            finally:
                attention.close()
            anchor_rounds += paired
            row = timing_row(a, name, batch, context, rounds)
            if isinstance(attention, ServicePacked) and attention.pipelined:
                row.update(wait_ms_per_call=1e3 * attention.wait_s / attention.calls)
            if isinstance(attention, ServiceSteps):
                row.update(ms_per_call=1e3 * attention.call_s / attention.calls,
                           **{f"server_{field[:-3]}_ms_per_call": 1e-3 * us / attention.calls
                              for field, us in attention.server_us.items()})
            # The first layer's attention (same inputs everywhere) and the logits after every
            # layer, against the anchor's, relative to their largest.
            row.update(ratio=statistics.median(paired) / statistics.median(rounds),
                       attn_rel=float((attention.first_o - anchor[2]).abs().max()
                                      / anchor[2].abs().max()),
                       logits_rel=float((mine[0] - anchor[0]).abs().max()
                                        / anchor[0].abs().max()),
                       same_tokens=float((mine[1] == anchor[1]).float().mean()))
            rows.append(row)
            del attention
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        anchor_attn.close()
    rows.insert(0, timing_row(a, attns[0], batch, context, anchor_rounds))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def timing_row(a, name, batch, context, rounds):
    """tokens/s and ms per step of the median of `rounds` (seconds of a.tokens steps each)."""
    seconds = statistics.median(rounds)
    return dict(context=context, batch=batch, attn=name, tok_s=batch * a.tokens / seconds,
                ms_per_step=1e3 * seconds / a.tokens, rounds=len(rounds),
                spread=(max(rounds) - min(rounds)) / seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--attn", default="fa3,sdpa,unary,stream,ring,packed,packed-ring")
    p.add_argument("--batch", default="8,32,64")
    p.add_argument("--context", default="1024,4096")
    p.add_argument("--tokens", type=int, default=16, help="timed steps")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3,
                   help="decodes of each attention, alternating with the anchor's (median)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--weight_scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a small trial against a CPU server")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    model = Model(a, device, dtype)
    attns = a.attn.split(",")
    clients = {}

    def client_for(name):
        """The Client of an attention: CUDA regions on for packed-cuda*, off for the others."""
        regions = "on" if name.startswith("packed-cuda") else "off"
        if regions not in clients:
            import attention_client
            clients[regions] = attention_client.Client(a.target, timeout=600,
                                                       max_message_bytes=2047 << 20,
                                                       cuda_regions=regions)
        return clients[regions]
    rows = []
    steps = a.warmup + a.tokens
    with torch.inference_mode():
        # One untimed pass of the anchor first: the GPU's clocks, torch's kernels and the caching
        # allocator warm before any row is timed (without it the first rows ran up to 2x slow).
        if attns[0] in ("fa3", "sdpa"):
            warm = (LocalFA3 if attns[0] == "fa3" else LocalSDPA)(a, 8, 1024, steps, device, dtype)
            decode(model, warm, 8, 1024, a, device)
            del warm
        for context in [int(c) for c in a.context.split(",")]:
            for batch in [int(b) for b in a.batch.split(",")]:
                rows += compare(a, model, attns, batch, context, client_for, device, dtype)
    for client in clients.values():
        client.close()
    print(f"\n{a.layers} layers, hidden {a.hidden}, Hq {a.heads}, Hkv {a.kv_heads}, D {a.head_dim}, "
          f"MLP {a.inter}, {a.dtype}; {a.tokens} timed steps a round, the median of {a.rounds} "
          f"rounds; ratio against {attns[0]}'s rounds alternating with each")
    print(f"{'context':>7} {'batch':>5} {'attn':>11} {'tok/s':>9} {'ratio':>6} {'ms/step':>8} "
          f"{'spread':>6} "
          f"{'ms/call':>8} {'wait':>6} {'server':>7} {'prep':>6} {'run':>6} {'kernel':>6} "
          f"{'attn':>8} "
          f"{'logits':>8} {'same':>5}")
    for r in rows:
        print(f"{r['context']:>7} {r['batch']:>5} {r['attn']:>11} {r['tok_s']:>9.1f} "
              f"{r.get('ratio', 1.0):>6.2f} {r['ms_per_step']:>8.2f} {r['spread']:>6.2f} "
              f"{r.get('ms_per_call', float('nan')):>8.3f} "
              f"{r.get('wait_ms_per_call', float('nan')):>6.3f} "
              f"{r.get('server_total_ms_per_call', float('nan')):>7.3f} "
              f"{r.get('server_prepare_ms_per_call', float('nan')):>6.3f} "
              f"{r.get('server_run_ms_per_call', float('nan')):>6.3f} "
              f"{r.get('server_compute_ms_per_call', float('nan')):>6.3f} "
              f"{r.get('attn_rel', 0.0):>8.1e} "
              f"{r.get('logits_rel', 0.0):>8.1e} {r.get('same_tokens', 1.0):>5.2f}")


if __name__ == "__main__":
    main()
