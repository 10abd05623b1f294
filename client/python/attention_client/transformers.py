"""transformers models on the attention service (pip install "attention-client[transformers]").

    client = attention_client.Client("localhost:50051")
    name = attention_client.transformers.register(client)
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation=name)  # or from a config
    cache = attention_client.transformers.RemoteCache(client, model.config)
    out = model.generate(ids, max_new_tokens=64, past_key_values=cache)

register() adds an attention function (and transformers' SDPA mask builder) under `name` to
transformers' AttentionInterface, so every model on transformers' standard attention path (Llama,
Qwen2, Mistral, ...) computes attention on the service. With a RemoteCache the K/V stay on the
server: one session per layer and sequence, the prompt's K/V sent once at prefill, and each decode
step sends only the new token's q, k and v, one Step per layer carrying every sequence of the batch.
Without one (a DynamicCache, or none) each call sends the keys it is given (an Attend).
The cache's sessions are dropped when it is closed or released (and expire on the server anyway).
"""
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


def _padded_causal(keep, fn):
    """For one item's mask keep [Nq, Nk] (True = visible): the queries and keys that take part
    (LongTensors) such that, over them alone, the mask is causal aligned bottom-right, as with
    padding (left or right) on a causal model. Raises NotImplementedError for any other mask."""
    rows = torch.nonzero(keep.any(1)).flatten()
    keys = torch.nonzero(keep.any(0)).flatten()
    sub = keep[rows][:, keys]
    nq, nk = sub.shape
    want = (torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)).to(sub.device)
    if not torch.equal(sub, want) or int(keep.sum()) != int(sub.sum()):
        raise NotImplementedError(
            f"{fn}: the attention mask is not a causal mask with padding; served: causal masks, "
            "with or without padded positions")
    return rows, keys


def _attend(client, query, key, value, attention_mask, scaling, is_causal):
    """query [B, Hq, Nq, D], key and value [B, Hkv, Nk, D] (all the keys): one Attend, queries
    the last Nq positions. o [B, Hq, Nq, D]; padded query rows get 0."""
    batch, _, nq, _ = query.shape
    nk = key.shape[2]
    keep = _mask_rows(attention_mask, batch, nq, nk)
    if keep is None:
        return client.attend(query.contiguous(), key.contiguous(), value.contiguous(),
                             causal=bool(is_causal) and nq > 1, softmax_scale=scaling)
    out = torch.zeros_like(query)
    for b in range(batch):  # padded rows differ per item: one varlen item each
        rows, keys = _padded_causal(keep[b], "attention_service")
        if len(rows) > 0:
            o = _attend_packed(client, query[b:b + 1, :, rows], key[b:b + 1], value[b:b + 1],
                               [keys], True, scaling, "bottom_right")
            out[b, :, rows] = o[0]
    return out


def register(client, name="attention_service"):
    """Registers the service's attention under `name` with transformers' AttentionInterface (and
    transformers' SDPA mask builder under the same name, so padded batches bring their mask).
    Returns name, for attn_implementation=name. client: an attention_client.Client."""

    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, **kwargs):
        if dropout:
            raise NotImplementedError(f"{name}: dropout={dropout}: the service computes attention "
                                      "without dropout (model.eval())")
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise NotImplementedError(f"{name}: sliding windows and softcapping are not served")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        with torch.no_grad():
            layer = getattr(key, _LAYER, None)
            if layer is not None:
                o = layer.attend(query, key, value, attention_mask, scaling, causal)
            else:
                o = _attend(client, query, key, value, attention_mask, scaling, causal)
        return o.transpose(1, 2).contiguous(), None  # [B, Nq, Hq, D], as transformers' sdpa

    AttentionInterface.register(name, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


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
    one Step per layer with every sequence's queries; at decode one Step per layer carrying each
    sequence's new q, k and v."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, client, all_sessions):
        super().__init__()
        self.client = client
        self.sessions = []              # one per sequence, once the prefill ran
        self._all = all_sessions        # the cache's list, for dropping on release
        self.length = 0                 # positions the model has seen, padding included
        self._pending = None

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
        setattr(key_states, _LAYER, self)
        return key_states, value_states

    def attend(self, query, key, value, attention_mask, scaling, causal):
        """Sends the pending K/V and the queries; o [B, Hq, Nq, D]."""
        if self._pending is None or self._pending[0] is not key:
            raise RuntimeError("RemoteCache: attention was called with keys this cache did not "
                               "hand out")
        self._pending = None
        batch, _, nq, _ = query.shape
        new = key.shape[2]
        keep = _mask_rows(attention_mask, batch, nq, self.length + new)
        if not causal and nq > 1:
            raise NotImplementedError("RemoteCache serves causal (decoder) attention only")
        if not self.sessions:  # prefill: a session per sequence, created with its rows
            for b in range(batch):
                rows = slice(None) if keep is None else _padded_causal(keep[b], "RemoteCache")[1]
                s = self.client.session(k=key[b][:, rows].contiguous(),
                                        v=value[b][:, rows].contiguous())
                self.sessions.append(s)
                self._all.append(s)
            appended = False
        elif len(self.sessions) != batch:
            raise ValueError(f"RemoteCache holds {len(self.sessions)} sequences, the step has "
                             f"{batch}")
        else:
            appended = True
        items, rows_of = [], []
        for b, s in enumerate(self.sessions):
            if keep is None:
                rows, new_keys = slice(None), slice(None)
            else:
                rows, keys = _padded_causal(keep[b], "RemoteCache")
                # The keys this step adds are the last `new` positions; those kept are appended.
                new_keys = keys[keys >= self.length] - self.length
                held = s.length if appended else s.length - len(new_keys)
                if len(keys) != held + len(new_keys):
                    raise ValueError(f"RemoteCache: the mask shows {len(keys)} keys for sequence "
                                     f"{b}, the session holds {held}")
            q = query[b][:, rows].contiguous()
            if q.shape[1] == 0:
                rows_of.append(None)
                continue
            item = (s, q)
            if appended:
                item += (key[b][:, new_keys].contiguous(), value[b][:, new_keys].contiguous())
            items.append(item)
            rows_of.append(rows)
        self.length += new
        results = iter(self.client.step_many(items, causal=True, softmax_scale=scaling))
        out = torch.zeros_like(query)
        for b, rows in enumerate(rows_of):
            if rows is not None:
                out[b][:, rows] = next(results)
        return out

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def reset(self):
        raise NotImplementedError("RemoteCache cannot be reset; make a new one")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("RemoteCache does not reorder sequences (beam search)")


class RemoteCache(Cache):
    """A transformers Cache whose layers keep their K/V in server sessions (RemoteLayer): one
    session per layer and sequence. Needs the model's attn_implementation to be register()'s name.

    client: an attention_client.Client; config: the model's config (num_hidden_layers). The
    sessions are dropped by close(), on leaving a `with` block, or when the cache is released."""

    def __init__(self, client, config):
        self.client = client
        self._sessions = []  # every layer's, shared with the finalizer
        layers = [RemoteLayer(client, self._sessions) for _ in range(config.num_hidden_layers)]
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
        raise NotImplementedError("RemoteCache cannot drop rows from its sessions")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("RemoteCache does not repeat sequences")

    def batch_select_indices(self, indices):
        raise NotImplementedError("RemoteCache does not select sequences")
