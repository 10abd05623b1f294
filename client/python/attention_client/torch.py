"""PyTorch drop-ins computed by the attention service (pip install "attention-client[torch]").

    from attention_client import torch as remote
    o = remote.scaled_dot_product_attention(q, k, v, is_causal=True)    # as torch's SDPA
    o = remote.flash_attn_func(q, k, v, causal=True)                    # as flash_attn's
    with remote.SessionKVCache(client, batch=2, kv_heads=8, head_dim=128, dtype=torch.bfloat16) as c:
        o = remote.flash_attn_with_kvcache(q, c, None, k=k_new, v=v_new, causal=True)

scaled_dot_product_attention keeps torch SDPA's semantics (BHSD with any leading dims, a causal
mask aligned top-left, GQA by enable_gqa); the flash_attn_* functions keep FlashAttention's (BSHD,
masks aligned bottom-right, natural-log LSE). Outputs come back in the inputs' dtype on their
device. Only the forward pass: inputs that require grad are refused, as are dropout and the masks
the service does not compute, each with an error that says what is supported. client=None uses
one shared Client for $ATTENTION_SERVICE (default localhost:50051).

CUDA tensors make no host round trip when the server shares their host and GPU (--backend=cuda
--allow_shared_memory): the Client registers the CUDA memory they live in as CUDA regions (once
per allocator segment), sends q, k, v by reference and has the server write o and lse into tensors
allocated on their device (attention_client.cuda_tensors; Client(cuda_regions="auto") falls back
to the host path, and remembers, where the server cannot take them). Elsewhere, and for
flash_attn_with_kvcache over a SessionKVCache, CUDA tensors are copied to the host and back.
"""
import math
import os
import threading

import torch

from attention_client.client import Client

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_default = None
_default_lock = threading.Lock()


def default_client():
    """The shared Client for $ATTENTION_SERVICE (default localhost:50051), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client(os.environ.get("ATTENTION_SERVICE", "localhost:50051"))
        return _default


def _client(client):
    return default_client() if client is None else client


def _check_tensors(fn, named, dropout_p=0.0):
    """The inputs the service can serve: torch tensors of one float dtype, no autograd, no
    dropout. Raises naming the function and the argument."""
    if dropout_p:
        raise NotImplementedError(f"{fn}: dropout_p={dropout_p}: the service computes attention "
                                  "without dropout (inference); pass dropout_p=0.0")
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                f"{fn}: {name} requires grad: the service computes the forward pass only; call it "
                "under torch.no_grad() (or torch.inference_mode()) or pass detached tensors")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; served: float32, float16, bfloat16")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        raise TypeError(f"{fn}: " + ", ".join(n for n, _ in named) +
                        f" must share one dtype, got {sorted(str(d) for d in dtypes)}")


def _unsupported(fn, **options):
    """Raises for flash_attn options the service does not implement (given a non-default)."""
    for name, value in options.items():
        if value is not None and value is not False and (torch.is_tensor(value) or value != 0.0):
            raise NotImplementedError(f"{fn}: {name} is not supported by the attention service")


def _window(window_size):
    """flash_attn's window_size (left, right), -1 = unbounded -> (window_left, window_right)."""
    left, right = window_size
    return (None if left < 0 else int(left)), (None if right < 0 else int(right))


def key_padding(attn_mask, lead, heads, nq, nk, fn="scaled_dot_product_attention"):
    """The keys each batch item keeps, bool [prod(lead), nk], of an SDPA attn_mask broadcastable to
    [*lead, heads, nq, nk]: boolean (True = takes part) or additive (0 = takes part, -inf =
    hidden). Raises NotImplementedError for a mask that is not a key-padding mask (one that hides
    different keys from different query rows or heads) or that adds a bias."""
    if attn_mask.dtype == torch.bool:
        keep = attn_mask
    elif attn_mask.is_floating_point():
        keep = attn_mask == 0
        if not bool(((attn_mask == 0) | (attn_mask == float("-inf"))).all()):
            raise NotImplementedError(
                f"{fn}: an additive attn_mask must hold only 0 and -inf (a key-padding mask); "
                "biases are not served")
    else:
        raise TypeError(f"{fn}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    try:
        keep = keep.expand(*lead, heads, nq, nk)
    except RuntimeError:
        raise ValueError(f"{fn}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                         f"to {(*lead, heads, nq, nk)}") from None
    keep = keep.reshape(-1, heads, nq, nk)
    first = keep[:, :1, :1, :]
    if not bool((keep == first).all()):
        raise NotImplementedError(
            f"{fn}: attn_mask hides different keys from different query rows or heads; served are "
            "key-padding masks (the same keys hidden from every row, e.g. shape [B, 1, 1, S]) and "
            "the causal mask (is_causal=True)")
    return first[:, 0, 0, :]


def _attend_packed(client, q, k, v, keys, causal, scale, mask_alignment, **options):
    """q [B, Hq, L, D], k [B, Hkv, S, D] and v [B, Hkv, S, Dv], keys: per item the key indices it
    keeps (a LongTensor each). One varlen Attend over the kept keys (options: more of
    Client.attend's, the window and chunks over the kept keys); o [B, Hq, L, Dv]. Items that keep
    no key get NaN rows, as torch's SDPA gives them."""
    batch, heads, nq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_full((batch, heads, nq, dv), float("nan"))
    items = [b for b in range(batch) if len(keys[b]) > 0]
    if not items:
        return out
    qp = torch.cat([q[b].transpose(0, 1) for b in items])           # [len(items) * L, Hq, D]
    kp = torch.cat([k[b][:, keys[b]].transpose(0, 1) for b in items])  # [sum kept, Hkv, D]
    vp = torch.cat([v[b][:, keys[b]].transpose(0, 1) for b in items])
    cu_q = [i * nq for i in range(len(items) + 1)]
    cu_k = [0]
    for b in items:
        cu_k.append(cu_k[-1] + len(keys[b]))
    o = client.attend(qp, kp, vp, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k, mask_alignment=mask_alignment, **options)
    o = o.reshape(len(items), nq, heads, dv).transpose(1, 2)
    out[items] = o
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, client=None):
    """torch.nn.functional.scaled_dot_product_attention on the service, with its semantics.

    query [*, Hq, L, E], key and value [*, Hkv, S, E] with the same leading dims (no broadcasting
    between them); Hq == Hkv, or Hq a multiple of Hkv with enable_gqa=True. is_causal: query i sees
    keys 0..i (top-left). attn_mask: a key-padding mask, boolean (True = takes part) or additive
    (0 / -inf), broadcastable to [*, Hq, L, S]. Returns [*, Hq, L, E] in query's dtype and device.
    """
    fn = "scaled_dot_product_attention"
    _check_tensors(fn, [("query", query), ("key", key), ("value", value)], dropout_p)
    if not (query.dim() == key.dim() == value.dim() >= 2):
        raise ValueError(f"{fn}: query, key and value must have the same rank >= 2, got "
                         f"{query.dim()}, {key.dim()}, {value.dim()}")
    nq, e = query.shape[-2:]
    nk = key.shape[-2]
    if key.shape[-1] != e:
        raise ValueError(f"{fn}: key's last dim must be query's {e}, got {key.shape[-1]}")
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(f"{fn}: value's shape {tuple(value.shape)} must match key's "
                         f"{tuple(key.shape)} but for the last dim")
    if value.shape[-1] != e:
        raise NotImplementedError(f"{fn}: value's last dim ({value.shape[-1]}) must equal the "
                                  f"query/key dim ({e}) on the service")
    lead = tuple(query.shape[:-3])
    heads_q = query.shape[-3] if query.dim() >= 3 else 1
    heads_kv = key.shape[-3] if key.dim() >= 3 else 1
    if tuple(key.shape[:-3]) != lead:
        raise ValueError(f"{fn}: key's leading dims {tuple(key.shape[:-3])} must equal query's "
                         f"{lead} (broadcasting between them is not served)")
    if heads_q != heads_kv:
        if not enable_gqa:
            raise ValueError(f"{fn}: query has {heads_q} heads and key {heads_kv}: pass "
                             "enable_gqa=True for grouped-query attention")
        if heads_q % heads_kv != 0:
            raise ValueError(f"{fn}: query's {heads_q} heads must be a multiple of key's "
                             f"{heads_kv} heads")
    if attn_mask is not None and is_causal:
        raise ValueError(f"{fn}: attn_mask and is_causal=True cannot be given together (as in "
                         "torch)")
    batch = math.prod(lead)
    q = query.reshape(batch, heads_q, nq, e)
    k = key.reshape(batch, heads_kv, nk, e)
    v = value.reshape(batch, heads_kv, nk, e)
    c = _client(client)
    if attn_mask is None:
        o = c.attend(q, k, v, causal=bool(is_causal), softmax_scale=scale,
                     mask_alignment="top_left")
    else:
        keep = key_padding(attn_mask.to(query.device), lead, heads_q, nq, nk, fn)
        keys = [torch.nonzero(keep[b]).flatten() for b in range(batch)]
        o = _attend_packed(c, q, k, v, keys, False, scale, "top_left")
    return o.reshape(query.shape)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, sinks=None, client=None):
    """flash_attn.flash_attn_func on the service: q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (v
    may have a head dim of its own, as MLA's); causal and window_size (left, right; -1 =
    unbounded) aligned bottom-right; softcap (0 = none) and sinks (one logit per query head, as
    gpt-oss's) where the server serves them (else UNIMPLEMENTED naming them; alibi_slopes is
    refused). Returns out [B, Sq, Hq, Dv], or with return_attn_probs (out, softmax_lse float32
    [B, Hq, Sq], None): the service returns no probabilities."""
    fn = "flash_attn_func"
    _check_tensors(fn, [("q", q), ("k", k), ("v", v)], dropout_p)
    _unsupported(fn, alibi_slopes=alibi_slopes)
    left, right = _window(window_size)
    out = _client(client).attend(q, k, v, layout="bshd", causal=causal,
                                 softmax_scale=softmax_scale, window_left=left,
                                 window_right=right, return_lse=return_attn_probs,
                                 **_open_model(softcap, sinks))
    if return_attn_probs:
        return out[0], out[1], None
    return out


def _open_model(softcap, sinks):
    """flash_attn's softcap (0 = none) and sinks as Client.attend's open-model options."""
    return dict(softcap=float(softcap) if softcap else None, sinks=sinks)


def _offsets(cu_seqlens, name, fn):
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{fn}: {name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        return [int(x) for x in cu_seqlens.tolist()]
    return [int(x) for x in cu_seqlens]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           sinks=None, client=None):
    """flash_attn.flash_attn_varlen_func on the service: q [total_q, Hq, D], k and v
    [total_k, Hkv, D] packed by cu_seqlens_q / cu_seqlens_k (B+1 offsets); masks bottom-right per
    sequence; softcap and sinks as flash_attn_func's. Returns out [total_q, Hq, Dv], or with
    return_attn_probs (out, softmax_lse float32 [Hq, total_q], None). max_seqlen_* are accepted
    for compatibility (the service derives them)."""
    fn = "flash_attn_varlen_func"
    _check_tensors(fn, [("q", q), ("k", k), ("v", v)], dropout_p)
    _unsupported(fn, alibi_slopes=alibi_slopes, block_table=block_table)
    left, right = _window(window_size)
    out = _client(client).attend(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 window_left=left, window_right=right,
                                 return_lse=return_attn_probs, **_open_model(softcap, sinks),
                                 cu_seqlens_q=_offsets(cu_seqlens_q, "cu_seqlens_q", fn),
                                 cu_seqlens_k=_offsets(cu_seqlens_k, "cu_seqlens_k", fn))
    if return_attn_probs:
        return out[0], out[1], None
    return out


class SessionKVCache:
    """The KV cache of a batch of sequences held by the service: one session per sequence, for
    flash_attn_with_kvcache. Use it as a context manager (the sessions are dropped on exit) or
    call close(). lengths: the rows each sequence holds.

    qv_head_dim=R: MLA's absorbed cache as FlashAttention-3's qv reads it (one KV head of the
    rotary key, head_dim of it, beside the latent of R features that is also V): sessions of
    head_dim R + head_dim whose v is the latent, kept once (Client.session(v_from_k=True));
    flash_attn_with_kvcache then takes qv, and k (rotary) with v (latent) as FA3 does."""

    def __init__(self, client, batch, kv_heads, head_dim, dtype, *, qv_head_dim=None):
        self.client = client
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.qv_head_dim = qv_head_dim
        self.sessions = []
        latent = {} if qv_head_dim is None else dict(
            head_dim=qv_head_dim + head_dim, v_head_dim=qv_head_dim, v_from_k=True)
        try:
            for _ in range(batch):
                self.sessions.append(client.session(
                    dtype=dtype, kv_heads=kv_heads, **{"head_dim": head_dim, **latent}))
        except BaseException:
            self.close()
            raise

    @property
    def lengths(self):
        return [s.length for s in self.sessions]

    def close(self):
        sessions, self.sessions = self.sessions, []
        for s in sessions:
            s.__exit__(None, None, None)  # drops it; an expired session is gone already

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_cache_seqlens(fn, cache_seqlens, lengths):
    if cache_seqlens is None:
        return
    want = ([int(cache_seqlens)] * len(lengths) if isinstance(cache_seqlens, int)
            else [int(x) for x in torch.as_tensor(cache_seqlens).flatten().tolist()])
    if want != lengths:
        raise ValueError(f"{fn}: cache_seqlens {want} differ from the rows the sessions hold "
                         f"{lengths}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, qv=None, sinks=None, client=None):
    """flash_attn.flash_attn_with_kvcache on the service: appends k, v [B, Sk, Hkv, D] (when given)
    to each sequence's cache, then attends q [B, Sq, Hq, D] to it, q being the last Sq positions
    (causal and window_size aligned bottom-right). Returns out [B, Sq, Hq, D], or with
    return_softmax_lse (out, lse float32 [B, Hq, Sq]).

    qv [B, Sq, Hq, R] (FlashAttention-3's MLA decode, with a SessionKVCache of qv_head_dim R): the
    logits are q.k + qv.v over k [.., D] (the rotary key) and v [.., R] (the latent), out
    [B, Sq, Hq, R]; the sessions hold [v, k] once (v_from_k), the default scale
    1 / sqrt(D + R) as FA3's.

    k_cache: a SessionKVCache (v_cache None): the K/V stay in server sessions and one packed Step
    carries the batch. Or, as in flash_attn, tensors k_cache, v_cache [B, S_max, Hkv, D] with
    cache_seqlens (int or [B]; default: S_max - Sk): k, v are written into them in place at
    cache_seqlens and one Attend computes the result. softcap and sinks as flash_attn_func's.
    """
    fn = "flash_attn_with_kvcache"
    _unsupported(fn, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                 block_table=block_table, alibi_slopes=alibi_slopes)
    open_model = _open_model(softcap, sinks)
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v go together: give both or neither")
    named = [("q", q)] + ([("k", k), ("v", v)] if k is not None else [])
    left, right = _window(window_size)
    latent = isinstance(k_cache, SessionKVCache) and k_cache.qv_head_dim is not None
    if qv is not None and not latent:
        raise ValueError(f"{fn}: qv: expected only with a SessionKVCache of qv_head_dim (MLA's "
                         "latent cache), got qv with another cache")
    if latent and qv is None:
        raise ValueError(f"{fn}: qv: expected with a SessionKVCache of qv_head_dim (its sessions "
                         "hold the latent beside the rotary key), got none")
    if latent:
        # The sessions hold [latent, rotary] a row, the latent doubling as v (v_from_k): q and
        # the new rows the same way, and no v sent.
        _check_tensors(fn, named + [("qv", qv)])
        q = torch.cat([qv, q], dim=-1)
        if k is not None:
            k, v = torch.cat([v, k], dim=-1), None
        named = []
    if isinstance(k_cache, SessionKVCache):
        if v_cache is not None and v_cache is not k_cache:
            raise ValueError(f"{fn}: with a SessionKVCache, pass v_cache=None")
        _check_tensors(fn, named)
        cache = k_cache
        if q.dim() != 4 or q.shape[0] != len(cache.sessions):
            raise ValueError(f"{fn}: q must be [B, Sq, Hq, D] with B = {len(cache.sessions)} "
                             f"(the cache's sequences), got {tuple(q.shape)}")
        _check_cache_seqlens(fn, cache_seqlens, cache.lengths)
        # One packed Step for the batch (q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] as one tensor
        # each; the same Step as one entry per sequence, bit for bit).
        result = cache.client.step_batch(
            cache.sessions, q.transpose(1, 2), None if k is None else k.transpose(1, 2),
            None if v is None else v.transpose(1, 2), causal=causal,
            softmax_scale=softmax_scale, window_left=left, window_right=right,
            return_lse=return_softmax_lse, **open_model)
        if return_softmax_lse:
            out, lse = result
            return out.transpose(1, 2), lse
        return result.transpose(1, 2)

    _check_tensors(fn, named + [("k_cache", k_cache), ("v_cache", v_cache)])
    batch, s_max = k_cache.shape[:2]
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        lengths = [s_max - new] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(x) for x in torch.as_tensor(cache_seqlens).flatten().tolist()]
    if len(lengths) != batch or any(n < 0 or n + new > s_max for n in lengths):
        raise ValueError(f"{fn}: cache_seqlens {lengths} with {new} new rows must fit the cache's "
                         f"{batch} x {s_max} rows")
    with torch.no_grad():
        if k is not None:
            for b, n in enumerate(lengths):
                k_cache[b, n:n + new] = k[b]
                v_cache[b, n:n + new] = v[b]
    kp = torch.cat([k_cache[b, :n + new] for b, n in enumerate(lengths)])  # [total_k, Hkv, D]
    vp = torch.cat([v_cache[b, :n + new] for b, n in enumerate(lengths)])
    sq = q.shape[1]
    cu_k = [0]
    for n in lengths:
        cu_k.append(cu_k[-1] + n + new)
    out = _client(client).attend(q.reshape(batch * sq, *q.shape[2:]), kp, vp, causal=causal,
                                 softmax_scale=softmax_scale, window_left=left,
                                 window_right=right, return_lse=return_softmax_lse,
                                 cu_seqlens_q=[b * sq for b in range(batch + 1)],
                                 cu_seqlens_k=cu_k, **open_model)
    if return_softmax_lse:
        o, lse = out
        # lse: [Hq, total_q] -> [B, Hq, Sq]
        return o.reshape(q.shape), lse.reshape(lse.shape[0], batch, sq).transpose(0, 1)
    return out.reshape(q.shape)
