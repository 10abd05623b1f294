"""KV-resident sessions (attention.v1.Sessions): K/V stay on the server between calls, so a
decode step sends only the new queries and the new token's K/V.

    with client.session(k=k0, v=v0) as s:           # k0, v0: [Hkv, N, D]; dtype and shape from them
        o = s.step(q, k=k1, v=v1, causal=True)      # q: [Hq, Nq, D]; k1, v1: [Hkv, n, D] appended first
        with s.fork() as t:                         # a child sharing s's pages; grows on its own
            o = t.step(q, k=k2, v=v2, causal=True)
    outs = client.step_many([(s1, q1, k1, v1), (s2, q2)], causal=True)   # one Step RPC
    o = s.step(q, k=k1, v=v1, causal=True, stream=True)   # over the client's one StepStream
    o = client.step_batch([s1, s2], q, k, v, causal=True)   # a layer's batch as packed tensors:
                                                            # q [B, Hq, Nq, D], k, v [B, Hkv, n, D]
    t = s.move_to(other_client)                     # exported here, imported there (same id)
    u = other_client.import_session(s.export())     # or by hand: the chunks of an Export

Sessions are a server-side cache: a restart or --session_ttl_s idle seconds lose them, and their
calls then raise AttentionError with code NOT_FOUND; re-create from your own copy of the sequence.
"""
import queue
import threading

import grpc
import numpy as np

from attention_client._stubs import attention_pb2 as pb
from attention_client.client import (_LAYOUTS, AttentionError, ServerTiming, StepBatchResult,
                                     StepResult, _from_tensor, _host_array, _is_torch,
                                     _lse_from_tensor, _ref_of, _set_open_model_options,
                                     _set_options, _to_host, _to_tensor, is_sealed, retry_sealed,
                                     retry_sealed_later)
from attention_client._wire import WireMessage
from attention_client.socket_stream import SocketStream

_DTYPE_NAMES = {"float32": pb.DTYPE_FLOAT32, "fp32": pb.DTYPE_FLOAT32,
                "float16": pb.DTYPE_FLOAT16, "fp16": pb.DTYPE_FLOAT16, "half": pb.DTYPE_FLOAT16,
                "bfloat16": pb.DTYPE_BFLOAT16, "bf16": pb.DTYPE_BFLOAT16}


def _wire_dtype(dtype):
    """"float16", np.float16, torch.float16, ml_dtypes.bfloat16 or a pb.DType value -> pb.DType."""
    if isinstance(dtype, int) and dtype in (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16):
        return dtype
    if _is_torch(dtype):
        name = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        name = dtype
    else:
        name = np.dtype(dtype).name
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return _DTYPE_NAMES[name]


# The gRPC metadata key every call about an existing session carries (Step, AppendKv, Truncate,
# Fork, Export, DropSession, Session.info's ListSessions): its owner, the part of the session id
# before its first '.' (the server's --replica_name), so a router in front of several replicas
# (deploy/README.md) sends the call to the replica holding the session.
OWNER_HEADER = "attention-session-owner"


def session_owner(session_id):
    """The replica named by a session id: its part before the first '.' ("" for an id of a
    server without --replica_name)."""
    owner, dot, _ = session_id.partition(".")
    return owner if dot else ""


def _owner_of(session_ids):
    """The one owner of the sessions `session_ids` ("" when their ids name none). A call reaches
    one replica, so sessions of two owners are a ValueError naming both."""
    owner, first = "", None
    for session_id in session_ids:
        this = session_owner(session_id)
        if first is not None and this != owner:
            raise ValueError(f"a Step's sessions must all have one owner ({OWNER_HEADER}): "
                             f"session {first} is of {owner!r}, session {session_id} of "
                             f"{this!r}")
        owner, first = this, first or session_id
    return owner


def _with_owner(client, metadata, owner):
    """The metadata of a call about sessions of `owner` (metadata None: the client's), with the
    attention-session-owner header when there is an owner."""
    base = client.metadata if metadata is None else metadata
    if not owner:
        return base
    return [*(base or ()), (OWNER_HEADER, owner)]


def _owner_metadata(client, metadata, session_ids):
    """The metadata of a call about the sessions `session_ids` (_owner_of, _with_owner)."""
    return _with_owner(client, metadata, _owner_of(session_ids))


class Session:
    """One session on the server. Use it as a context manager (dropped on exit) or call drop().

    id: the server's session id; length: K/V rows as of this object's last call; head_dim and
    v_head_dim: D of q and k, Dv of v and o (D unless created with another). A session of a
    model's several layers (Client.session(layers=L)): layers L, layer_lengths each layer's rows,
    length the rows every layer holds; append and the Steps name the layer. prefix_rows: the rows
    its creation found cached (Client.session(prefix_tokens=)), shared with other sessions.
    """

    def __init__(self, client, info, layout, bfloat16_bits, metadata):
        self._client = client
        self.id = info.session_id
        self.layers = max(1, info.layers)
        self.prefix_rows = info.prefix_rows
        self._set_info(info)
        self.dtype = info.dtype
        self.kv_heads = info.kv_heads
        self.head_dim = info.head_dim
        self.v_head_dim = info.v_head_dim or info.head_dim  # 0 from a server that predates it
        self.v_from_k = info.v_from_k  # v is k's first v_head_dim features, kept once
        self.layout = layout
        self._bfloat16_bits = bfloat16_bits
        self._metadata = metadata

    def __repr__(self):
        dv = "" if self.v_head_dim == self.head_dim else f", v_head_dim={self.v_head_dim}"
        dv += ", v_from_k=True" if self.v_from_k else ""
        return (f"Session({self.id}, length={self.length}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}{dv})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.id:
            try:
                self.drop()
            except AttentionError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:  # an expired session is dropped already
                    raise

    @property
    def length(self):
        # Worked out when read: a packed Step sets one layer's length of every sequence of its
        # batch, once per layer call.
        return min(self.layer_lengths)

    def _set_info(self, info):
        self.layer_lengths = list(info.layer_lengths) if self.layers > 1 else [info.length]

    def _set_length(self, length, layer):
        """A call's answer: `layer`'s (None: the only one's) rows are now `length`."""
        self.layer_lengths[layer or 0] = length

    def _call_metadata(self):
        """The metadata of a call about this session: its own (or the client's) with its owner."""
        return _owner_metadata(self._client, self._metadata, [self._live_id()])

    def _live_id(self):
        if not self.id:
            raise AttentionError(grpc.StatusCode.FAILED_PRECONDITION, "the session was dropped")
        return self.id

    def append(self, k, v=None, *, layer=None, tokens=None, timeout=None):
        """Appends rows: k, v [Hkv, n, D] (layout "bhsd") or [n, Hkv, D] ("bshd"; v with Dv,
        v_head_dim, for D; none where the session's v is k's: v_from_k), to `layer`
        (0..layers-1; needed for a session of several layers); tokens: the token id of each row
        (so later sessions can share their full pages: Client.session(prefix_tokens=)). Returns
        the new length."""
        if (v is None) != self.v_from_k:
            raise ValueError("v: expected none (the session's v is k's first features)"
                             if self.v_from_k else "v: expected a tensor with k")
        tk, _ = _to_tensor(k, "k", self._bfloat16_bits)
        tv = None if v is None else _to_tensor(v, "v", self._bfloat16_bits)[0]
        request = pb.AppendKvRequest(session_id=self._live_id(), layout=_LAYOUTS[self.layout],
                                     k=tk, v=tv, layer=layer, tokens=_token_ids(tokens))
        info = self._client._call(self._client._sessions_stub.AppendKv, request, timeout,
                                  self._call_metadata())
        self._set_info(info)
        return self.length

    def truncate(self, length, *, timeout=None):
        """Keeps the first `length` rows (0 <= length <= the session's length; speculative
        decoding drops rejected tokens) and frees the server's pages beyond them. Runs after the
        session's calls sent before it. Returns the new length."""
        request = pb.TruncateRequest(session_id=self._live_id(), length=length)
        info = self._client._call(self._client._sessions_stub.Truncate, request, timeout,
                                  self._call_metadata())
        self._set_info(info)
        return self.length

    def fork(self, length=None, *, timeout=None):
        """A new Session holding this one's first `length` rows (None: all), of its dtype, shape
        and layout, on its server (beam search, parallel sampling, a shared prompt). The server
        shares the full pages between the two and copies only the partial last one; each then
        grows on its own (an append into a shared page copies it first). Runs after the
        session's calls sent before it. Use the child as a context manager too, or drop() it."""
        request = pb.ForkRequest(session_id=self._live_id(), length=length)
        info = self._client._call(self._client._sessions_stub.Fork, request, timeout,
                                  self._call_metadata())
        return Session(self._client, info, self.layout, self._bfloat16_bits, self._metadata)

    def step(self, q, k=None, v=None, *, causal=False, softmax_scale=None, window_left=None,
             window_right=None, return_lse=False, timeout=None, return_info=False, stream=False,
             sinks=None, softcap=None, chunk_size=None, layer=None, tokens=None):
        """Attends q [Hq, Nq, D] to the session, after appending k [Hkv, n, D] and v
        [Hkv, n, Dv] when given (k alone where the session's v is k's: v_from_k); tokens: the
        token id of each appended row, as append()'s (its full pages are then cached for later
        sessions' prefix_tokens).

        stream=True sends the Step over the Client's long-lived Sessions.StepStream of the
        session's owner (opened on first use; no per-call setup), one Step in flight at a time;
        timeout does not apply there. stream="ring" sends it through the Client's request ring
        of that owner instead (a server on
        this host with --allow_shared_memory; attention_client.request_ring): no gRPC message per
        Step, the lowest latency. stream="socket" sends it over the Client's socket stream of
        that owner (a server with --socket_port, on any host; attention_client.socket_stream): no
        HTTP/2, a remote caller's fastest path for large Steps.

        The queries are the session's last Nq positions (masks bottom-right aligned, as attend()).
        Returns o [Hq, Nq, Dv] (same kind and dtype as q; Dv = v_head_dim), or (o, lse) with
        return_lse: lse float32 [Hq, Nq]; with return_info a StepResult (o, lse, length, timing,
        device).
        sinks, softcap, chunk_size: as Client.attend()'s. layer: the layer attended to (and
        appended to), for a session of several layers.
        """
        return step_many(self._client, [(self, q, k, v, tokens)], causal=causal,
                         softmax_scale=softmax_scale, window_left=window_left,
                         window_right=window_right, return_lse=return_lse, timeout=timeout,
                         metadata=self._metadata, return_info=return_info, stream=stream,
                         sinks=sinks, softcap=softcap, chunk_size=chunk_size, layer=layer)[0]

    def export(self, *, chunk_rows=0, timeout=None, seal=False):
        """The session as Sessions.Export streams it: an iterator of pb.SessionChunk, first the
        header (dtype, kv_heads, head_dim, v_head_dim, layers, layer_lengths), then each layer's
        rows in order, k [Hkv, n, D] and v [Hkv, n, Dv] of at most `chunk_rows` rows (0: what
        fits 4 MiB). A snapshot of the session when the export starts; hand it to
        Client.import_session of another server (a replica handing its sessions to a peer), or
        keep the chunks. Raises AttentionError (NOT_FOUND for another caller's or an unknown
        session). seal=True seals the session here first (ExportRequest.seal): its later
        AppendKv, Step, Truncate and Fork are refused UNAVAILABLE (SEALED_MARKER; the clients
        retry them until the router sends them to the new owner), so no row lands here that the
        export lacks; it stays sealed until dropped."""
        return export_session(self._client, self._live_id(), chunk_rows=chunk_rows,
                              timeout=timeout, metadata=self._metadata, seal=seal)

    def move_to(self, other, *, chunk_rows=0, timeout=None, metadata=None, seal=True):
        """Moves the session to the server of Client `other` under the same id: exported from
        here (sealed first unless seal=False: no call of another thread changes it here after
        the export; see export), imported there, then dropped here. Returns the Session on
        `other` (this object then holds no session). metadata: the caller's on `other` (default:
        other's)."""
        moved = import_session(other, self.export(chunk_rows=chunk_rows, timeout=timeout,
                                                  seal=seal),
                               layout=self.layout, bfloat16_bits=self._bfloat16_bits,
                               timeout=timeout, metadata=metadata)
        self.drop(timeout=timeout)
        return moved

    def drop(self, *, timeout=None):
        """Frees the session's K/V on the server; the object holds no session afterwards."""
        request = pb.DropSessionRequest(session_id=self._live_id())
        metadata = self._call_metadata()
        self.id = ""
        self._client._batch_ids.clear()  # packed Steps' kept ids (_session_ids) may hold it
        self._client._call(self._client._sessions_stub.DropSession, request, timeout, metadata)

    def info(self, *, timeout=None):
        """The server's SessionInfo (length, pages, resident_bytes, idle_s, expires_in_s, device);
        raises AttentionError NOT_FOUND when the session is gone."""
        session_id = self._live_id()
        # ListSessions with the owner's header: a router sends it to the replica holding it.
        for info in list_sessions(self._client, timeout=timeout,
                                  metadata=self._call_metadata()).sessions:
            if info.session_id == session_id:
                self._set_info(info)
                return info
        raise AttentionError(grpc.StatusCode.NOT_FOUND, f"session {session_id} is not on the server")


def _check_kv(k, v):
    """k and v together, k alone (a session whose v is k's first features: v_from_k; the server
    refuses it for any other, naming v) or neither."""
    if k is None and v is not None:
        raise ValueError("k and v go together: give both, k alone (v_from_k sessions) or neither")


def _token_ids(tokens):
    """Token ids as the wire's int64s (a list, numpy or torch ints; None: none)."""
    if tokens is None:
        return []
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    return [int(t) for t in tokens]


def create_session(client, *, dtype=None, kv_heads=None, head_dim=None, k=None, v=None,
                   layout="bhsd", bfloat16_bits=False, timeout=None, metadata=None, layers=None,
                   tokens=None, prefix_tokens=None, v_head_dim=None, v_from_k=False):
    """A new session; see Client.session."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    if v_from_k and v is not None:
        raise ValueError("v: expected none with v_from_k=True (v is k's first v_head_dim "
                         "features)")
    if not v_from_k and (k is None) != (v is None):
        raise ValueError("k and v go together: give both or neither")
    request = pb.CreateSessionRequest(layout=_LAYOUTS[layout], v_from_k=v_from_k)
    if k is not None:
        tk, _ = _to_tensor(k, "k", bfloat16_bits)
        request.k.CopyFrom(tk)
        if len(tk.shape) == 3:  # else the server names the bad shape
            heads_axis = 0 if layout == "bhsd" else 1
            kv_heads = tk.shape[heads_axis] if kv_heads is None else kv_heads
            head_dim = tk.shape[2] if head_dim is None else head_dim
        if v is not None:
            tv, _ = _to_tensor(v, "v", bfloat16_bits)
            request.v.CopyFrom(tv)
            if len(tv.shape) == 3 and v_head_dim is None and tv.shape[2] != head_dim:
                v_head_dim = tv.shape[2]
        dtype = tk.dtype if dtype is None else dtype
    if dtype is None or kv_heads is None or head_dim is None:
        raise ValueError("dtype, kv_heads and head_dim are needed when k and v are not given")
    request.dtype = _wire_dtype(dtype)
    request.kv_heads = kv_heads
    request.head_dim = head_dim
    if layers is not None:
        request.layers = layers
    request.tokens.extend(_token_ids(tokens))
    request.prefix_tokens.extend(_token_ids(prefix_tokens))
    if v_head_dim is not None:
        request.v_head_dim = v_head_dim
    info = client._call(client._sessions_stub.CreateSession, request, timeout, metadata)
    return Session(client, info, layout, bfloat16_bits, metadata)


def export_session(client, session_id, *, chunk_rows=0, timeout=None, metadata=None, seal=False):
    """Sessions.Export of session `session_id` of the client's server (its owner's header added):
    an iterator of pb.SessionChunk; see Session.export."""
    request = pb.ExportRequest(session_id=session_id, chunk_rows=chunk_rows, seal=seal)
    stream = client._sessions_stub.Export(
        request, timeout=client.timeout if timeout is None else timeout,
        metadata=_owner_metadata(client, metadata, [session_id]))
    try:
        yield from stream
    except grpc.RpcError as e:
        raise AttentionError(e.code(), e.details()) from None
    finally:
        stream.cancel()  # an abandoned iterator ends the server's export (a no-op once done)


def import_session(client, chunks, *, session_id=None, layout="bhsd", bfloat16_bits=False,
                   timeout=None, metadata=None):
    """A new session from the chunks of an export; see Client.import_session."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")

    failed = []  # what iterating `chunks` raised (an export's error), raised here instead

    def messages():
        try:
            for i, chunk in enumerate(chunks):
                if i == 0 and session_id is not None:
                    chunk = pb.SessionChunk.FromString(chunk.SerializeToString())
                    chunk.header.session_id = session_id
                yield chunk
        except Exception as e:  # the stream ends short: the server keeps nothing
            failed.append(e)

    try:
        info = client._call(client._sessions_stub.Import, messages(), timeout, metadata)
    except AttentionError:
        if failed:
            raise failed[0] from None
        raise
    session = Session(client, info, layout, bfloat16_bits, metadata)
    if failed:  # every row came, but the source's stream failed after them
        session.drop(timeout=timeout)
        raise failed[0]
    return session


def step_many(client, items, *, causal=False, softmax_scale=None, window_left=None,
              window_right=None, return_lse=False, timeout=None, metadata=None, request_id="",
              return_info=False, stream=False, sinks=None, softcap=None, chunk_size=None,
              layer=None):
    """One Step RPC over several sessions; see Client.step_many."""
    request = pb.StepRequest(request_id=request_id, layer=layer)
    _set_options(request, causal, softmax_scale, window_left, window_right, return_lse)
    _set_open_model_options(request, sinks, softcap, chunk_size)
    kinds, sessions = [], []
    for item in items:
        session, q, k, v, tokens = (tuple(item) + (None, None, None))[:5]
        _check_kv(k, v)
        if session._client is not client:
            raise ValueError(f"session {session.id} belongs to another Client")
        tq, kind = _to_tensor(q, "q", session._bfloat16_bits)
        entry = request.entries.add(session_id=session._live_id(), q=tq,
                                    tokens=_token_ids(tokens))
        if k is not None:
            entry.k.CopyFrom(_to_tensor(k, "k", session._bfloat16_bits)[0])
        if v is not None:
            entry.v.CopyFrom(_to_tensor(v, "v", session._bfloat16_bits)[0])
        kinds.append(kind)
        sessions.append(session)
    metadata = _owner_metadata(client, metadata, [entry.session_id for entry in request.entries])
    response = _send_step(client, request, stream, timeout, metadata)
    if len(response.results) != len(sessions):
        raise AttentionError(grpc.StatusCode.DATA_LOSS, f"Step sent {len(sessions)} entries and "
                             f"got {len(response.results)} results")
    timing = ServerTiming._from_pb(response.timing)
    outputs = []
    for session, kind, result in zip(sessions, kinds, response.results):
        if result.session_id != session.id:
            raise AttentionError(grpc.StatusCode.DATA_LOSS, f"Step result for session "
                                 f"{result.session_id} where {session.id} was expected")
        session._set_length(result.length, layer)
        o = _from_tensor(result.o, kind)
        lse = _lse_from_tensor(result.lse, kind) if return_lse else None
        if return_info:
            outputs.append(StepResult(o, lse, result.length, timing, response.device))
        else:
            outputs.append((o, lse) if return_lse else o)
    return outputs


def _submit_step(client, request, metadata, on_error=None, timeout=None):
    """Posts one StepRequest through the client's request ring of the sessions' owner (opened by
    the owner's first; metadata's owner header names it) and returns a function that reads its
    StepResponse; see RequestRing.submit.

    A ring stays on the server that opened it, so a sealed session's refusal there (is_sealed:
    refused before anything was appended) is not retried on the ring: the Step goes again as a
    unary Step, retried as every unary call is (retry_sealed, `timeout` seconds; None: the
    client's), where the router now sends the session's calls, whoever reads its answer (this
    call's reader or the next Step's post). The refusal ended the ring: the next Step opens
    another, which its owner header routes to the owner of then."""
    from attention_client.request_ring import RequestRing, MAX_SLOT_BYTES

    def recover(error):
        if not is_sealed(error):
            raise error
        return client._call(client._step, request, timeout, metadata)

    # One ring per owner (the header the router routes on), as one StepStream per owner.
    owner = dict(metadata or ()).get(OWNER_HEADER, "")

    def failed(ring):
        if client._step_rings.get(owner) is ring:
            del client._step_rings[owner]  # a failed Step ends its ring; the next opens another
            ring.close()

    ring = client._step_rings.get(owner)
    try:
        if ring is not None and not ring.settle():
            failed(ring)  # ended by the failure of the Step before, which recover answered
            ring = None
        if ring is None:
            # Room for this Step and its answer (o is q's size), at least 1 MiB.
            need = max(1 << 20, 2 * request.ByteSize() + 4096)
            ring = client._step_rings[owner] = RequestRing(
                client, "step", metadata=metadata,
                slot_bytes=min(MAX_SLOT_BYTES, (need + 63) // 64 * 64))
        ticket = ring.submit(request, on_error, recover)
    except AttentionError:
        if ring is not None:
            failed(ring)  # an earlier Step's failure, or this one's post
        raise

    def response():
        try:
            return ticket.response()
        except AttentionError:
            failed(ring)
            raise
    return response


def _socket_of(client, metadata):
    """The client's socket stream of the sessions' owner (metadata's header), opened when there is
    none or it ended (its replica stopped: a Step on it was never sent)."""
    owner = dict(metadata or ()).get(OWNER_HEADER, "")
    socket_stream = client._step_sockets.get(owner)
    if socket_stream is None or socket_stream.ended():
        socket_stream = client._step_sockets[owner] = SocketStream(client, client._socket_port(),
                                                                   metadata)
    return socket_stream


def _post_on_socket(client, request, metadata, timeout):
    """Posts `request` on the owner's socket stream; returns a function that waits for its
    StepResponse (timeout: the client's when None). A failure ends the socket, and the next Step
    opens another (_socket_of)."""
    answer = _socket_of(client, metadata).post(request)
    return lambda: answer(client.timeout if timeout is None else timeout)


def _send_step(client, request, stream, timeout, metadata):
    """One StepRequest to the server, unary (stream False), over the client's StepStream of the
    sessions' owner (True), its socket stream of that owner ("socket") or through its request
    ring of that owner ("ring"); returns the StepResponse. A sealed session's refusal is retried
    (retry_sealed; on the ring: _submit_step)."""
    if stream == "ring":
        return _submit_step(client, request, metadata, timeout=timeout)()
    if stream:
        # One stream per owner: a router sends a whole stream to the replica its header names.
        owner = dict(metadata or ()).get(OWNER_HEADER, "")

        def send(seconds_left):
            if stream == "socket":
                return _post_on_socket(client, request, metadata, seconds_left)()
            step_stream = client._step_streams.get(owner)
            if step_stream is None or step_stream.ended():
                # None yet, or ended since its last Step (its replica stopped: a drained one),
                # so this Step was not sent on it: a new one goes where the router sends now.
                step_stream = client._step_streams[owner] = StepStream(client, metadata)
            try:
                return step_stream.step(request)
            except AttentionError:
                # A failed Step ends its stream; the next (a sealed session's retry) opens another.
                client._step_streams.pop(owner, None)
                raise

        timeout = client.timeout if timeout is None else timeout
        return retry_sealed(send, timeout)
    return client._call(client._step, request, timeout, metadata)


def step_batch(client, sessions, q, k=None, v=None, *, causal=False, softmax_scale=None,
               window_left=None, window_right=None, return_lse=False, out=None, lse_out=None,
               timeout=None, metadata=None, request_id="", return_info=False, stream=False,
               wait=True, sinks=None, softcap=None, chunk_size=None, ready_event=None,
               done_event=None, ready_counter=None, done_counter=None, layer=None,
               _on_error=None):
    """One packed Step over a layer's batch; see Client.step_batch."""
    _check_kv(k, v)
    if not sessions:
        raise ValueError("sessions: expected at least one session, got none")
    batch = _batch(client, sessions)
    metadata = _with_owner(client, metadata, batch.owner)
    ordered = (ready_event, done_event, ready_counter, done_counter)
    if (out is None and lse_out is None and all(x is None for x in ordered)
            and _is_torch(q) and getattr(q, "is_cuda", False) and client._cuda_segments.usable):
        from attention_client.cuda_tensors import step_batch_on_device
        done, result = step_batch_on_device(client, sessions, q, k, v, dict(
            causal=causal, softmax_scale=softmax_scale, window_left=window_left,
            window_right=window_right, return_lse=return_lse, timeout=timeout,
            metadata=metadata, request_id=request_id, return_info=return_info, stream=stream,
            wait=wait, sinks=sinks, softcap=softcap, chunk_size=chunk_size, layer=layer), batch)
        if done:
            return result
    bits = sessions[0]._bfloat16_bits
    request = _packed_request(client, sessions, request_id=request_id, layer=layer, causal=causal,
                              softmax_scale=softmax_scale, window_left=window_left,
                              window_right=window_right, return_lse=return_lse, sinks=sinks,
                              softcap=softcap, chunk_size=chunk_size)
    if ready_event is not None:
        request.ready_event = bytes(ready_event)
    if done_event is not None:
        request.done_event = bytes(done_event)
    for field, counter in (("ready_counter", ready_counter), ("done_counter", done_counter)):
        if counter is not None:
            from attention_client.shared_memory import counter_ref
            tensor, value = counter
            message = getattr(request, field)
            message.ref.CopyFrom(counter_ref(client, tensor, field))
            message.value = value
    # q, k and v by reference where they lie in the client's regions; else their bytes travel in
    # the message, joined onto the wire from their buffers (WireMessage), torch CUDA ones first
    # copied to host together (_to_host).
    inputs = [(name, x) for name, x in (("q", q), ("k", k), ("v", v)) if x is not None]
    refs = [_ref_of(client, x) for _, x in inputs]
    hosts = _to_host([x if ref is None else None for (_, x), ref in zip(inputs, refs)])
    message, kinds = WireMessage(request), []
    for (name, x), ref, host in zip(inputs, refs, hosts):
        if ref is not None:
            getattr(request, name).CopyFrom(ref[0])
            kinds.append(ref[1])
        else:
            dtype, shape, data, kind = _host_array(x, name, bits, host=host)
            message.set_tensor(name, dtype, shape, data)
            kinds.append(kind)
    kind = kinds[0]  # o is returned as q
    if out is not None:
        from attention_client.shared_memory import out_ref
        request.o_ref.CopyFrom(out_ref(client, out, "out"))
    if lse_out is not None:
        if not return_lse:
            raise ValueError("lse_out: expected only with return_lse=True")
        from attention_client.shared_memory import out_ref
        request.lse_ref.CopyFrom(out_ref(client, lse_out, "lse_out"))
    def output(response):
        return _batch_output(response, sessions, kind, return_lse, out, lse_out, return_info,
                             layer)

    if wait:
        return output(_send_step(client, message, stream, timeout, metadata))
    if stream == "ring":
        return PostedStep(_submit_step(client, message, metadata, _on_error, timeout), output,
                          out, lse_out)
    if stream == "socket":
        return PostedStep(_post_on_socket(client, message, metadata, timeout), output, out,
                          lse_out)
    if stream:
        raise ValueError("wait=False takes unary Steps, the request ring (stream=\"ring\") or the "
                         "socket stream (\"socket\"); a StepStream carries one Step at a time")
    return retry_sealed_later(
        lambda seconds_left: client._step.future(message, timeout=seconds_left,
                                                 metadata=metadata),
        output, client.timeout if timeout is None else timeout)


def _packed_request(client, sessions, *, request_id="", layer=None, causal=False,
                    softmax_scale=None, window_left=None, window_right=None, return_lse=False,
                    sinks=None, softcap=None, chunk_size=None):
    """A packed StepRequest naming `sessions` with the Step's options; its tensors are the
    caller's to set."""
    request = pb.StepRequest(request_id=request_id, layer=layer,
                             session_ids=_session_ids(client, sessions))
    _set_options(request, causal, softmax_scale, window_left, window_right, return_lse)
    _set_open_model_options(request, sinks, softcap, chunk_size)
    return request


_BATCHES_KEPT = 64


class _Batch:
    """A packed Step's sessions as its calls see them: their ids, their owner (_owner_of), and
    what calls on them keep (plans: cuda_tensors' serialised Steps in stream order)."""

    __slots__ = ("ids", "owner", "plans")

    def __init__(self, ids):
        self.ids = ids
        self.owner = _owner_of(ids)
        self.plans = {}


def _batch(client, sessions):
    """The _Batch of a packed Step's sessions, each checked to be live and this client's, of one
    owner. A model names the same batch in every layer call, so those of the last batches are
    kept, by the sessions' identity (Session.drop forgets them all)."""
    key = tuple(sessions)
    batch = client._batch_ids.get(key)
    if batch is None:
        for session in sessions:
            if session._client is not client:
                raise ValueError(f"session {session.id} belongs to another Client")
        batch = _Batch([session._live_id() for session in sessions])
        if len(client._batch_ids) >= _BATCHES_KEPT:
            client._batch_ids.clear()
        client._batch_ids[key] = batch
    return batch


def _session_ids(client, sessions):
    """The ids of a packed Step's sessions (_batch)."""
    return _batch(client, sessions).ids


class PostedStep:
    """A Step posted without waiting whose answer is read later (step_batch with wait=False,
    stream="ring" or "socket"): result() reads it. On the ring the client's next Step reads it
    too, and raises this one's failure if it failed; on the socket several may be in flight, each
    answer kept for its own result() (call it for every posted Step: an answer not taken stays
    in the client until the socket closes), and a failed one ends the socket (the others'
    result() raise it too). Until then the sessions' lengths are those before it. o and lse: where the
    answer's o and lse are written when they are the caller's (out, lse_out, or a Step of CUDA
    tensors in stream order, whose o later kernels on the stream may read at once); None when
    they come in the answer."""

    def __init__(self, response, output, o=None, lse=None):
        self._response = response
        self._output = output
        self._result = None
        self.o, self.lse = o, lse

    def result(self):
        """What step_batch returns with wait=True; raises the Step's failure (AttentionError)."""
        if self._result is None:
            self._result = (self._output(self._response()),)
        return self._result[0]


def _batch_output(response, sessions, kind, return_lse, out, lse_out, return_info, layer):
    """What step_batch returns for a packed Step's StepResponse; sets the sessions' lengths."""
    if len(response.lengths) != len(sessions):
        raise AttentionError(grpc.StatusCode.DATA_LOSS, f"Step sent {len(sessions)} sequences "
                             f"and got {len(response.lengths)} lengths")
    for session, length in zip(sessions, response.lengths):
        session._set_length(length, layer)
    o = out if out is not None else _from_tensor(response.o, kind)
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else _lse_from_tensor(response.lse, kind)
    if return_info:
        return StepBatchResult(o, lse, list(response.lengths),
                               ServerTiming._from_pb(response.timing), response.device)
    return (o, lse) if return_lse else o


def list_sessions(client, *, timeout=None, metadata=None):
    """The ListSessionsResponse: the caller's sessions, page_bytes, pages_total, pages_free."""
    return client._call(client._sessions_stub.ListSessions, pb.ListSessionsRequest(), timeout,
                        metadata)


class StepStream:
    """Steps over one Sessions.StepStream call: no per-call setup, one Step in flight at a time
    (thread-safe: callers take turns). A Step that fails ends the stream (AttentionError with its
    code); open another for the next."""

    def __init__(self, client, metadata=None):
        self._requests = queue.Queue()
        self._lock = threading.Lock()
        self._count = 0
        self._call = client._step_stream(
            iter(self._requests.get, None),
            metadata=client.metadata if metadata is None else metadata)

    def step(self, request):
        """Sends one StepRequest and returns its StepResponse."""
        with self._lock:
            self._count += 1
            if not request.request_id:
                request.request_id = f"step-{self._count}"
            self._requests.put(request)
            try:
                response = next(self._call)
            except StopIteration:
                raise AttentionError(grpc.StatusCode.DATA_LOSS,
                                     "the StepStream ended without an answer") from None
            except grpc.RpcError as e:
                raise AttentionError(e.code(), e.details()) from None
            if response.request_id != request.request_id:
                raise AttentionError(grpc.StatusCode.DATA_LOSS,
                                     f"StepStream answered {response.request_id!r} where "
                                     f"{request.request_id!r} was expected")
            return response

    def ended(self):
        """Whether the stream has ended (its server ended it, or a Step failed)."""
        return self._call.done()

    def close(self):
        """Ends the stream (the server finishes it once every Step is answered)."""
        self._requests.put(None)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass
