"""transformers models on the attention service (pip install "attention-client[transformers]").

    client = attention_client.Client("localhost:50051")
    name = attention_client.transformers.register(client)
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation=name)  # or from a config
    cache = attention_client.transformers.RemoteCache(client, model.config)
    out = model.generate(ids, max_new_tokens=64, past_key_values=cache)

register() adds an attention function (and transformers' SDPA mask builder) under `name` to
transformers' AttentionInterface, so every model on transformers' standard attention path (Llama,
Qwen2, Mistral, ...) computes attention on the service. With a RemoteCache the K/V stay on the
server: one session per sequence holding every layer (Sessions with `layers`: one create and one
drop per sequence), the prompt's K/V sent once at prefill, and each decode step sends only the new
token's q, k and v, one Step per layer carrying every sequence of the batch.
Without one (a DynamicCache, a StaticCache, or none) each call sends the keys it is given (an
Attend).
The cache's sessions are dropped when it is closed or released (and expire on the server anyway).
Its crop() (assisted and speculative decoding drop rejected tokens so) truncates the sessions
(Sessions.Truncate, every layer); its reorder_cache() (beam search), batch_select_indices() and
batch_repeat_interleave() (transformers' Cache dispatches them to each layer; the first layer acts
for all) fork the sessions of the sequences taken more than once (Sessions.Fork: the full pages
shared on the server, only the partial last one copied) and drop those of the sequences no longer
taken. A layer whose K/V shape differs from the first layer's keeps sessions of its own.

Every keyword argument transformers passes to the attention function is either served exactly or
refused by name (NotImplementedError): attention sinks (`s_aux`, gpt-oss) and `softcap` (Gemma 2)
go to the service as its sinks and softcap; a `sliding_window` (Mistral, Gemma, gpt-oss) becomes
the window and a chunked layer (Llama 4's `attention_chunk_size`) the chunk size, both checked
against the mask; a V head dim other than the QK head dim (MLA, DeepSeek-V3) is sent as it is
where the server's devices list "v_head_dim" (DeviceInfo.attend_options for Attend, step_options
for a RemoteCache's sessions: the CPU backend), else zero-padded to one head dim; a RemoteCache
holds an MLA model's latents (absorbed: one KV head of the latent and its rotary key, QK 576 and
V its first 512 features for DeepSeek-V3, the queries taken through kv_b_proj;
attend_absorbed), in sessions that keep V inside K's rows (v_from_k: the latent stored once)
where the server's step_options list "v_from_k". Attention weights, packed sequences and keywords
this module does not know are refused, as is a mask that is not causal with padding (and the
window or chunks).
"""
from dataclasses import dataclass
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from attention_client.client import AttentionError
from attention_client.torch import _attend_packed

# The attribute RemoteLayer.update sets on the key tensor it returns, so that the attention
# function, which transformers calls with (query, key, value) only, finds the layer.
_LAYER = "_attention_service_layer"
# An MLA layer's update gets latents that transformers expands into new tensors before attention:
# the layer waits here, by layer index, for this thread's next attention call of that index.
_latent_layers = threading.local()

# Keywords transformers passes that do not bear on attention once q, k, v and the mask are built:
# positions are in the rotary embedding already, the others steer what the model returns.
_WITHOUT_BEARING = frozenset({"position_ids", "use_cache", "output_hidden_states",
                              "output_router_logits", "num_items_in_batch"})
# Keywords served only when absent or at their default (None, False, 0), with what they ask for.
_REFUSED_UNLESS_DEFAULT = {
    "output_attentions": "attention weights (the service returns o only)",
    "position_bias": "an additive position bias",
    "cache": "a paged cache (continuous batching)",
    "cu_seq_lens_q": "packed sequences",
    "cu_seq_lens_k": "packed sequences",
    "max_length_q": "packed sequences",
    "max_length_k": "packed sequences",
    "seq_idx": "packed sequences",
}


def _check_keywords(fn, kwargs):
    """Raises NotImplementedError naming the first keyword that is neither served nor without
    bearing on attention (an unknown one included): none is ever ignored."""
    for key, value in kwargs.items():
        if key in _WITHOUT_BEARING:
            continue
        if key in _REFUSED_UNLESS_DEFAULT:
            if value is None or value is False or (not torch.is_tensor(value) and value == 0):
                continue
            raise NotImplementedError(f"{fn}: {key}: {_REFUSED_UNLESS_DEFAULT[key]} is not served "
                                      "by the attention service")
        raise NotImplementedError(f"{fn}: the attention keyword {key}={value!r} is not known to "
                                  "attention_client.transformers; it is refused rather than "
                                  "ignored")


@dataclass
class _Options:
    """What a layer's attention asks beyond causal: the mask's window (window_left) and chunks
    (chunk_size), which the mask must show, and the sinks and softcap, sent as they are."""
    window_left: int = None
    chunk_size: int = None
    sinks: torch.Tensor = None
    softcap: float = None

    def masked(self):
        """Client.attend's options with the mask's window and chunks."""
        return dict(window_left=self.window_left, chunk_size=self.chunk_size, **self.unmasked())

    def unmasked(self):
        """Client.attend's options for a call without a mask (SDPA's semantics: no window or
        chunks; transformers leaves the mask out only where they change nothing)."""
        return dict(sinks=self.sinks, softcap=self.softcap)


def _options(fn, module, sliding_window, s_aux, softcap):
    """The _Options of a layer: transformers' sliding_window W (query i sees key j iff
    i - W < j <= i) is window_left W - 1; a layer whose type is "chunked_attention" (Llama 4)
    has its config's attention_chunk_size; s_aux (the sinks, [Hq]) and softcap as given."""
    options = _Options(sinks=None if s_aux is None else s_aux.detach().float(),
                       softcap=None if not softcap else float(softcap))
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or \
                sliding_window < 1:
            raise ValueError(f"{fn}: sliding_window must be a positive int, got "
                             f"{sliding_window!r}")
        options.window_left = sliding_window - 1
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if layer_types is not None and layer is not None and \
            layer_types[layer] == "chunked_attention":
        options.chunk_size = int(config.attention_chunk_size)
    return options


def _mask_rows(attention_mask, batch, nq, nk):
    """The visible (query, key) pairs of transformers' 4-D mask, bool [B, Nq, Nk] (None: no mask).
    Boolean (True = visible) or additive (0 = visible); one mask for every head."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise NotImplementedError(f"attention_service: a [B, 1, Nq, Nk] mask is served, got shape "
                                  f"{tuple(attention_mask.shape)}")
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return keep[:, 0, :, -nk:].expand(batch, nq, nk)


def _check_causal(keep, rows, keys, options, fn):
    """For one item's mask keep [Nq, Nk] (True = visible) and the queries and keys that take part
    (LongTensors): raises NotImplementedError unless, over them alone, the mask is causal aligned
    bottom-right with the options' window and chunks, and nothing outside them is visible, as with
    padding (left or right) on a causal model."""
    sub = keep[rows][:, keys]
    nq, nk = sub.shape
    j = torch.arange(nk)[None, :]
    diagonal = torch.arange(nq)[:, None] + (nk - nq)
    want = j <= diagonal
    served = "causal masks"
    if options.window_left is not None:
        want &= j >= diagonal - options.window_left
        served += f" with the sliding window ({options.window_left + 1} keys)"
    if options.chunk_size is not None:
        want &= j // options.chunk_size == diagonal // options.chunk_size
        served += f" in chunks of {options.chunk_size}"
    if not torch.equal(sub, want.to(sub.device)) or int(keep.sum()) != int(sub.sum()):
        raise NotImplementedError(
            f"{fn}: the attention mask is not one the service computes; served: {served}, with "
            "or without padded positions")


def _padded_causal(keep, options, fn):
    """The queries and keys (LongTensors) of one item's mask keep [Nq, Nk] that take part (see
    something, are seen), checked by _check_causal."""
    rows = torch.nonzero(keep.any(1)).flatten()
    keys = torch.nonzero(keep.any(0)).flatten()
    _check_causal(keep, rows, keys, options, fn)
    return rows, keys


def _one_head_dim(query, key, value):
    """q [.., Dqk], k [.., Dqk], v [.., Dv] padded with zero features to one head dim max(Dqk, Dv)
    (MLA models have Dv != Dqk) for a server that takes one: zeros change neither q.k nor o's
    first Dv features."""
    d = max(query.shape[-1], value.shape[-1])
    return tuple(torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in (query, key, value))


def _in_stream_order(client, query):
    """Whether a Step of `query` may go in stream order through CUDA regions (torch CUDA tensors,
    the client's regions not found unusable): step_batch then writes o in place."""
    return bool(getattr(query, "is_cuda", False)) and client._cuda_segments.usable


def _serves_v_head_dim(client, options):
    """Whether every device of the client's server lists "v_head_dim" in its DeviceInfo
    `options` ("attend_options" or "step_options"): v and o may then have a head dim of their
    own; else _one_head_dim pads them."""
    return all("v_head_dim" in getattr(d, options) for d in client.server_info().devices)


def _serves_v_from_k(client):
    """Whether every device of the client's server lists "v_from_k" in its step_options: a
    session may then keep v as k's first features (an MLA layer's latent stored once)."""
    return all("v_from_k" in d.step_options for d in client.server_info().devices)


def _attend(client, query, key, value, attention_mask, scaling, is_causal, options):
    """query [B, Hq, Nq, D], key [B, Hkv, Nk, D] and value [B, Hkv, Nk, Dv] (all the keys): one
    Attend, with SDPA's semantics: without a mask, is_causal aligns top-left (a StaticCache's
    prefill hands over keys past the queries' that are not written yet); with one, the keys and
    queries it shows take part. o [B, Hq, Nq, Dv]; padded query rows get 0."""
    batch, _, nq, _ = query.shape
    nk = key.shape[2]
    keep = _mask_rows(attention_mask, batch, nq, nk)
    if keep is None:
        causal = bool(is_causal) and nq > 1
        return client.attend(query.contiguous(), key.contiguous(), value.contiguous(),
                             causal=causal, softmax_scale=scaling, mask_alignment="top_left",
                             **options.unmasked())
    out = query.new_zeros(*query.shape[:3], value.shape[-1])
    for b in range(batch):  # padded rows differ per item: one varlen item each
        rows, keys = _padded_causal(keep[b], options, "attention_service")
        if len(rows) > 0:
            o = _attend_packed(client, query[b:b + 1, :, rows], key[b:b + 1], value[b:b + 1],
                               [keys], True, scaling, "bottom_right", **options.masked())
            out[b, :, rows] = o[0]
    return out


def register(client, name="attention_service"):
    """Registers the service's attention under `name` with transformers' AttentionInterface (and
    transformers' SDPA mask builder under the same name, so padded batches bring their mask).
    Returns name, for attn_implementation=name. client: an attention_client.Client."""
    own_v_head_dim = []  # [whether Attend takes v of its own head dim], asked at the first call

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, sliding_window=None, s_aux=None, softcap=None,
                          **kwargs):
        if dropout:
            raise NotImplementedError(f"{name}: dropout={dropout}: the service computes attention "
                                      "without dropout (model.eval())")
        _check_keywords(name, kwargs)
        options = _options(name, module, sliding_window, s_aux, softcap)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        dv = value.shape[-1]
        if scaling is None:  # SDPA's default, from the QK head dim before any padding
            scaling = query.shape[-1]**-0.5
        with torch.no_grad():
            layer = getattr(key, _LAYER, None)
            latent = getattr(_latent_layers, "pending", {}).pop(
                getattr(module, "layer_idx", None), None)
            if latent is not None:
                o = latent.attend_absorbed(module, query, attention_mask, scaling, causal, options)
            elif layer is not None:
                o = layer.attend(query, key, value, attention_mask, scaling, causal, options)
            else:
                if query.shape[-1] != dv and not own_v_head_dim:
                    own_v_head_dim.append(_serves_v_head_dim(client, "attend_options"))
                if query.shape[-1] != dv and not own_v_head_dim[0]:
                    query, key, value = _one_head_dim(query, key, value)
                o = _attend(client, query, key, value, attention_mask, scaling, causal, options)
        return o[..., :dv].transpose(1, 2).contiguous(), None  # [B, Nq, Hq, Dv], as sdpa's

    AttentionInterface.register(name, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


class _Sequences:
    """The sessions a RemoteCache's layers share: one per sequence, holding every layer
    (Client.session(layers=)), made by the first layer's prefill, of its K/V's dtype, Hkv and D.
    A selection (RemoteLayer.select), which transformers hands to each layer in turn, is made on
    the sessions by the first layer and taken by the others (`selecting`, until each took it)."""

    def __init__(self, layers, own_v_head_dim, v_from_k=False):
        self.layers = layers
        # Whether the server's sessions take v of its own head dim (else it is padded to D).
        self.own_v_head_dim = own_v_head_dim
        # Whether the latent layers' sessions keep v as k's first features (MLA: the latent is
        # sent and stored once; attend_absorbed's value is then k's first features).
        self.v_from_k = v_from_k
        self.sessions = []
        self.shape = None  # (dtype, Hkv, D, Dv) of the sessions
        self.members = set()  # the layers that keep their K/V in them
        self.selecting = None  # (indices, the layers yet to take them)
        # The packed Step of CUDA tensors posted last without waiting for its answer (a
        # PostedStep; RemoteLayer._step_packed), or None.
        self.posted = None

    def settle(self):
        """Reads the answer of the Step posted last, raising its failure (AttentionError)."""
        posted, self.posted = self.posted, None
        if posted is not None:
            posted.result()


def _drop_sessions(client, sessions):
    """Drops every session in `sessions` (a list shared with the layers), ignoring those already
    gone; runs on close() and when the cache is garbage-collected."""
    while sessions:
        s = sessions.pop()
        try:
            if s.id:
                s.drop()
        except AttentionError:
            pass  # expired, or the server is gone: nothing is held any more


class RemoteLayer(CacheLayerMixin):
    """One layer's K/V in server sessions, one per sequence of the batch.

    update() only hands the new K/V to the attention function (tagged on the key tensor); the
    attention function sends them: at prefill a CreateSession per sequence with its K/V rows, then
    one Step per layer with every sequence's queries; at decode one packed Step per layer
    (step_batch: the batch's new q, k and v as one tensor each) when every sequence keeps all its
    new positions, else one Step with an entry per sequence that keeps any."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, client, all_sessions, index=None, layer=None, shared=None):
        super().__init__()
        self.client = client
        self.index = index  # for MLA layers (latent caches): the layer's index, else None
        self.layer = layer  # its index in the cache: its layer in the shared sessions
        self.shared = shared  # the cache's _Sequences (None: this layer's own sessions only)
        self.own = []                   # sessions of its own, one per sequence, when it has them
        self._all = all_sessions        # the cache's list, for dropping on release
        self.length = 0                 # positions the model has seen, padding included
        self.positions = []             # per sequence, the positions its session holds (LongTensor)
        self._pending = None

    @property
    def sessions(self):
        """One per sequence once the prefill ran: the shared ones, or this layer's own."""
        return self.shared.sessions if self.layer in self._members() else self.own

    def _members(self):
        return self.shared.members if self.shared is not None else ()

    def _v_from_k(self):
        """Whether this layer's sessions keep v as k's first features (an MLA layer's latent:
        its Steps and creations send k alone)."""
        return self.index is not None and self.shared is not None and self.shared.v_from_k

    def _join(self, key, value):
        """At prefill: keeps this layer in the shared sessions when its k [B, Hkv, n, D] and v
        [B, Hkv, n, Dv] have their shape (the first layer's makes them); True when it joined."""
        shape = (key.dtype, key.shape[1], key.shape[3], value.shape[3])
        if self.shared is None or (self.shared.shape not in (None, shape)):
            return False
        if self.shared.shape is None:
            self.shared.shape = shape
            self.shared.sessions = [
                self.client.session(dtype=key.dtype, kv_heads=shape[1], head_dim=shape[2],
                                    v_head_dim=shape[3], layers=self.shared.layers,
                                    v_from_k=self._v_from_k())
                for _ in range(key.shape[0])]
            self._all.extend(self.shared.sessions)
        self.shared.members.add(self.layer)
        return True

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self._pending is not None:
            raise RuntimeError("RemoteCache: the previous step's K/V never reached the service; "
                               "load the model with attn_implementation=attention_client."
                               "transformers.register(client)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = (key_states, value_states)
        if self.index is None:
            setattr(key_states, _LAYER, self)
        else:
            if not hasattr(_latent_layers, "pending"):
                _latent_layers.pending = {}
            _latent_layers.pending[self.index] = self
        return key_states, value_states

    def attend_absorbed(self, module, query, attention_mask, scaling, causal, options):
        """MLA (DeepSeek-V3) in its absorbed form: update() got the latents kv [B, 1, n, R] (after
        its norm) and k_rot [B, 1, n, P]; the session holds one KV head of K = [kv, k_rot] (R + P
        features) and V = kv (R; attend pads it to R + P where sessions take one head dim).
        query [B, H, Nq, Dn + P] is [q_nope, q_rot]; with kv_b_proj's weight W [H, Dn + Dv, R],
        q_nope . (W_k kv) = (q_nope W_k) . kv, so q = [q_nope W_k, q_rot] attends to K with the
        model's scale, and o = o_latent[:R] W_v^T, [B, H, Nq, Dv]."""
        kv, k_rot = self._pending
        proj = module.kv_b_proj
        if proj.bias is not None:
            raise NotImplementedError("RemoteCache: kv_b_proj.bias: an MLA layer whose kv_b_proj "
                                      "has a bias is not served")
        heads, nope, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
        rank = kv.shape[-1]
        w = proj.weight.view(heads, nope + dv, rank)
        q = torch.cat([torch.einsum("bhnd,hdr->bhnr", query[..., :nope], w[:, :nope]),
                       query[..., nope:]], dim=-1)
        key = torch.cat([kv, k_rot], dim=-1)
        self._pending = (key, kv)
        o = self.attend(q, key, kv, attention_mask, scaling, causal, options)
        return torch.einsum("bhnr,hvr->bhnv", o[..., :rank], w[:, nope:])

    def attend(self, query, key, value, attention_mask, scaling, causal, options):
        """Sends the pending K/V and the queries; o [B, Hq, Nq, Dv]. The queries are the new
        positions; a position takes part when its query sees its own key (padding hides both),
        and every item's mask must be causal (with the window) over the positions it kept."""
        if self._pending is None or self._pending[0] is not key:
            raise RuntimeError("RemoteCache: attention was called with keys this cache did not "
                               "hand out")
        self._pending = None
        if self.shared is not None:
            # Before anything here can synchronise with the GPU: a failed Step posted without
            # waiting leaves the stream waiting until its answer is read (its rescue writes the
            # done value), and its failure is raised now, in the forward that made it.
            self.shared.settle()
        if self.shared is None or not self.shared.own_v_head_dim:
            query, key, value = _one_head_dim(query, key, value)
        batch, _, nq, _ = query.shape
        new = key.shape[2]
        if nq != new:
            raise ValueError(f"RemoteCache: the step has {nq} queries and {new} new keys; the "
                             "queries must be the new positions")
        keep = _mask_rows(attention_mask, batch, nq, self.length + new)
        if not causal and nq > 1:
            raise NotImplementedError("RemoteCache serves causal (decoder) attention only")
        prefill = not self.sessions
        joined = prefill and self._join(key, value)
        v_from_k = self._v_from_k()  # value is key's first features: k alone is sent
        layer = self.layer if self.layer in self._members() else None
        if not prefill and len(self.sessions) != batch:
            raise ValueError(f"RemoteCache holds {len(self.sessions)} sequences, the step has "
                             f"{batch}")
        if not prefill and (keep is None or bool(keep[:, :, self.length:].diagonal(
                dim1=1, dim2=2).all())):
            return self._step_packed(query, key, value, keep, scaling, options)
        items, rows_of = [], []
        for b in range(batch):
            if keep is None:
                added = torch.arange(new)
            else:
                added = torch.nonzero(keep[b][:, self.length:].diagonal()).flatten().cpu()
                keys = torch.cat([self.positions[b], added + self.length]) if not prefill \
                    else added
                _check_causal(keep[b], added, keys, options, "RemoteCache")
            k = key[b][:, added].contiguous()
            v = None if v_from_k else value[b][:, added].contiguous()
            if prefill and joined:  # the shared session's layer gets its rows with the Step
                self.positions.append(added + self.length)
                item = (self.sessions[b], query[b][:, added].contiguous(), k, v)
            elif prefill:  # a session of its own per sequence, created with its rows
                s = self.client.session(k=k, v=v, v_head_dim=value.shape[-1], v_from_k=v_from_k)
                self.own.append(s)
                self._all.append(s)
                self.positions.append(added + self.length)
                item = (s, query[b][:, added].contiguous())
            else:
                self.positions[b] = torch.cat([self.positions[b], added + self.length])
                item = (self.sessions[b], query[b][:, added].contiguous(), k, v)
            if len(added) == 0:
                rows_of.append(None)
                continue
            items.append(item)
            rows_of.append(added)
        self.length += new
        step_options = options.unmasked() if keep is None else options.masked()
        results = iter(self.client.step_many(items, causal=True, softmax_scale=scaling,
                                             layer=layer, **step_options))
        out = query.new_zeros(*query.shape[:3], value.shape[-1])  # [B, Hq, Nq, Dv]
        for b, rows in enumerate(rows_of):
            if rows is not None:
                out[b][:, rows] = next(results)
        return out

    def _step_packed(self, query, key, value, keep, scaling, options):
        """A decode step in which every sequence keeps all its new positions: one packed Step
        (Client.step_batch: q [B, Hq, Nq, D], k [B, Hkv, n, D], v [B, Hkv, n, Dv]) instead of one
        entry per sequence; the same Step, bit for bit, in one message and one tensor each."""
        new = key.shape[2]
        added = torch.arange(new)
        for b in range(len(self.sessions)):
            if keep is not None:
                keys = torch.cat([self.positions[b], added + self.length])
                _check_causal(keep[b], added, keys, options, "RemoteCache")
            self.positions[b] = torch.cat([self.positions[b], added + self.length])
        self.length += new
        step_options = options.unmasked() if keep is None else options.masked()
        layer = self.layer if self.layer in self._members() else None
        if self._v_from_k():
            value = None  # the sessions' v is key's first features
        if layer is None or not _in_stream_order(self.client, query):
            return self.client.step_batch(self.sessions, query, key, value, causal=True,
                                          softmax_scale=scaling, layer=layer, **step_options)
        # CUDA tensors of a co-located server: the Step in stream order by counters, posted on
        # the request ring without waiting for its answer (o is written in place before the
        # stream's next kernels run), read at the next layer's attend; the model's last layer
        # reads its own, so a failure is raised in the forward that made it, before the logits.
        step = self.client.step_batch(self.sessions, query, key, value, causal=True,
                                      softmax_scale=scaling, layer=layer, stream="ring",
                                      wait=False, **step_options)
        if step.o is None or layer == max(self._members()):
            return step.result()  # the host path answered (o in the answer), or the last layer
        self.shared.posted = step
        return step.o

    def crop(self, max_length):
        """Drops the last -max_length positions (as DynamicLayer.crop: 0 drops nothing, a
        positive length is refused): each sequence keeps the rows of the positions before the new
        length. Returns the rows each sequence keeps; sessions of this layer's own are truncated
        here (Session.truncate), the shared ones by RemoteCache.crop, once for every layer."""
        if max_length > 0:
            raise ValueError(f"RemoteCache.crop: max_length: expected a negative count of "
                             f"positions to drop (or 0), got {max_length}, as transformers' "
                             "DynamicCache")
        if max_length == 0 or not self.sessions:
            return None
        if self.shared is not None:
            self.shared.settle()  # no Step of the sessions left in flight
        if -max_length > self.length:
            raise ValueError(f"RemoteCache.crop: max_length: expected -{self.length}..0 (the "
                             f"positions held), got {max_length}")
        self.length += max_length
        rows = []
        for b in range(len(self.sessions)):
            kept = self.positions[b][self.positions[b] < self.length]
            self.positions[b] = kept
            rows.append(len(kept))
        if self.layer not in self._members():
            for s, n in zip(self.own, rows):
                s.truncate(n)
        return rows

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def reset(self):
        raise NotImplementedError("RemoteCache cannot be reset; make a new one")

    def select(self, indices):
        """Sequence b of the batch becomes sequence indices[b] as it was (indices: a LongTensor
        or a bool mask over the batch, as DynamicLayer takes them). The first sequence to take an
        old one's place takes its session, each other one a fork of it (Session.fork: on the
        server it shares the session's full pages); the sessions no sequence takes are dropped.
        Nothing to do before the prefill."""
        if not self.sessions:
            return
        if self.shared is not None:
            self.shared.settle()  # no Step of the sessions left in flight
        chosen = torch.arange(len(self.positions))[torch.as_tensor(indices).cpu()].tolist()
        self.positions = [self.positions[i] for i in chosen]
        if self.layer not in self._members():
            self.own = self._selected(self.own, chosen)
            return
        shared = self.shared
        if shared.selecting is None:  # the first layer: the sessions themselves
            shared.sessions = self._selected(shared.sessions, chosen)
            shared.selecting = (chosen, set(shared.members) - {self.layer})
        else:
            if shared.selecting[0] != chosen or self.layer not in shared.selecting[1]:
                raise RuntimeError("RemoteCache: its layers were given different selections "
                                   "(reorder_cache / batch_select_indices) in one step")
            shared.selecting[1].discard(self.layer)
        if not shared.selecting[1]:
            shared.selecting = None

    def _selected(self, sessions, chosen):
        """sessions[i] for i in chosen: the first to take one takes it, each other one a fork
        of it; the sessions none takes are dropped."""
        taken = set()
        out = []
        for i in chosen:
            if i in taken:
                s = sessions[i].fork()
                self._all.append(s)
            else:
                taken.add(i)
                s = sessions[i]
            out.append(s)
        for i, s in enumerate(sessions):
            if i not in taken:
                s.drop()
        self._all[:] = [s for s in self._all if s.id]
        return out

    def reorder_cache(self, beam_idx):
        """Beam search: sequence b continues beam beam_idx[b] (select)."""
        self.select(beam_idx)

    def batch_select_indices(self, indices):
        self.select(indices)

    def batch_repeat_interleave(self, repeats):
        """Each sequence `repeats` times in a row (select: forks of its session)."""
        self.select(torch.arange(len(self.positions)).repeat_interleave(repeats))


class RemoteCache(Cache):
    """A transformers Cache whose layers keep their K/V in server sessions (RemoteLayer): one
    session per sequence holding every layer (a layer of another K/V shape: one of its own per
    sequence). Needs the model's attn_implementation to be register()'s name.

    client: an attention_client.Client; config: the model's config (num_hidden_layers). The
    sessions are dropped by close(), on leaving a `with` block, or when the cache is released."""

    def __init__(self, client, config):
        self.client = client
        self._sessions = []  # every layer's, shared with the finalizer
        # MLA models (a kv_lora_rank: DeepSeek-V3) cache latents, held in their absorbed form.
        mla = getattr(config, "kv_lora_rank", None) is not None
        own_v_head_dim = _serves_v_head_dim(client, "step_options")
        self._shared = _Sequences(config.num_hidden_layers, own_v_head_dim,
                                  mla and own_v_head_dim and _serves_v_from_k(client))
        layers = [RemoteLayer(client, self._sessions, i if mla else None, i, self._shared)
                  for i in range(config.num_hidden_layers)]
        super().__init__(layers=layers)
        self._finalizer = weakref.finalize(self, _drop_sessions, client, self._sessions)

    @property
    def session_ids(self):
        return [s.id for s in self._sessions if s.id]

    def close(self):
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def crop(self, max_length):
        """Drops the last -max_length positions of every layer's sessions (assisted and speculative
        decoding drop rejected tokens so); 0 drops nothing, as transformers' DynamicCache."""
        shared_rows = None
        for layer in self.layers:
            rows = layer.crop(max_length)
            if rows is not None and layer.layer in self._shared.members:
                if shared_rows not in (None, rows):
                    raise RuntimeError(f"RemoteCache.crop: layers keep different rows per "
                                       f"sequence ({shared_rows} and {rows})")
                shared_rows = rows
        if shared_rows is not None:
            for s, n in zip(self._shared.sessions, shared_rows):
                s.truncate(n)

