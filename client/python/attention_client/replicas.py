"""Several replicas of attention_server: placing a new session on the one with the most free KV
pages, and draining a replica (every session moved to a peer under its id, as an operator's script
does before the replica stops; deploy/README.md, "Draining a replica").

    from attention_client import Client, replicas
    pool = [Client("r1-host:50051"), Client("r2-host:50051"), Client("r3-host:50051")]
    s = replicas.place_session(pool, k=k0, v=v0)        # on the replica with the most room
    moved = replicas.drain(pool[2], pool[1],
                           switch=lambda: point_owner_at("r3", "r2"))   # the router's update

Both clients call their replica directly, not through the router. A moved session keeps its id,
so its id still names the drained replica (its attention-session-owner header): `switch` is where
the router learns that the drained replica's sessions now live on the peer (with HAProxy:
deploy/haproxy/haproxy_routing.py drain, which sets the owner map over HAProxy's runtime API).
"""
import grpc

from attention_client._stubs import attention_pb2 as pb
from attention_client.client import AttentionError
from attention_client.session import (_owner_metadata, export_session, import_session,
                                      list_sessions)


def emptiest(clients, *, timeout=None):
    """The Client of `clients` whose server has the most room for a new session: its free KV
    pages and those of cached prefixes no session holds, taken back when needed (ServerInfo's
    kv_pages_free + kv_pages_cached; pages of its own size), the first of equals, asking every
    server at once. A server that does not answer, or serves no sessions (no pages at all), is
    passed over; AttentionError (UNAVAILABLE, naming each server's failure) when none is left."""
    calls = [c._stub.GetServerInfo.future(pb.GetServerInfoRequest(),
                                          timeout=c.timeout if timeout is None else timeout,
                                          metadata=c.metadata) for c in clients]
    best, most, failures = None, -1, []
    for client, call in zip(clients, calls):
        try:
            info = call.result()
        except grpc.RpcError as e:
            failures.append(f"{client._target}: {e.code().name}: {e.details()}")
            continue
        if info.kv_pages_total == 0:
            failures.append(f"{client._target}: serves no sessions (no KV pages)")
            continue
        free = info.kv_pages_free + info.kv_pages_cached
        if free > most:
            best, most = client, free
    if best is None:
        raise AttentionError(grpc.StatusCode.UNAVAILABLE,
                             "no replica to place a session on: " + "; ".join(failures))
    return best


def place_session(clients, *, timeout=None, **session_args):
    """A new session (Client.session(**session_args), timeout too) on the server of `clients`
    with the most room (emptiest). Behind a router every call about it then carries its owner's
    name, so the Client of the replica it landed on need not be the one used later."""
    return emptiest(clients, timeout=timeout).session(timeout=timeout, **session_args)


def drain(source, target, *, switch=None, chunk_rows=0, timeout=None, metadata=None):
    """Moves every session `source` lists to `target` under the same ids and returns the ids.

    First each session is exported from `source` sealed (ExportRequest.seal: from its export on,
    `source` refuses the session's AppendKv, Step, Truncate and Fork UNAVAILABLE, which the
    clients retry) and imported into `target` (Sessions.Import: the rows bit for bit); then
    `switch()` (when given) sends the sessions' calls to `target`, where the retries land; then
    each is dropped on `source`. So no row is appended on `source` that `target` lacks; a
    session's calls wait (retrying) from its export until the switch. metadata: the caller's on
    both servers
    (None: each client's own); the server checking tokens lists and moves only that caller's
    sessions. Raises AttentionError of the first call that fails: nothing was switched, and the
    sessions exported so far stay sealed on `source` (their changes refused there: run the drain
    again, to this or another peer) and imported on `target`."""
    listed = list_sessions(source, timeout=timeout, metadata=metadata).sessions
    ids = [info.session_id for info in listed]
    for session_id in ids:
        import_session(target, export_session(source, session_id, chunk_rows=chunk_rows,
                                              timeout=timeout, metadata=metadata, seal=True),
                       timeout=timeout, metadata=metadata)
    if switch is not None:
        switch()
    for session_id in ids:
        source._call(source._sessions_stub.DropSession, pb.DropSessionRequest(
            session_id=session_id), timeout, _owner_metadata(source, metadata, [session_id]))
    return ids
