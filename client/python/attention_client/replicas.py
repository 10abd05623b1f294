"""Draining a replica: every session of one attention_server moved to a peer under its id, as an
operator's script does before the replica stops (deploy/README.md, "Draining a replica").

    from attention_client import Client, replicas
    moved = replicas.drain(Client("r3-host:50051"), Client("r2-host:50051"),
                           switch=lambda: point_owner_at("r3", "r2"))   # the router's update

Both clients call their replica directly, not through the router. A moved session keeps its id,
so its id still names the drained replica (its attention-session-owner header): `switch` is where
the router learns that the drained replica's sessions now live on the peer (with HAProxy:
deploy/haproxy/haproxy_routing.py drain, which sets the owner map over HAProxy's runtime API).
"""
from attention_client._stubs import attention_pb2 as pb
from attention_client.session import (_owner_metadata, export_session, import_session,
                                      list_sessions)


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
