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

    First each session is exported from `source` and imported into `target` (Sessions.Export,
    Sessions.Import: the rows bit for bit), while `source` still answers its calls; then
    `switch()` (when given) sends the sessions' calls to `target`; then each is dropped on
    `source`. A call that only reads a session (a Step without k and v) is answered the same by
    either copy throughout. Rows appended on `source` after a session's export and before the
    switch are not on `target`: pause a session's appends while it moves (the Step's answered
    length tells a client which rows a replica holds). metadata: the caller's on both servers
    (None: each client's own); the server checking tokens lists and moves only that caller's
    sessions. Raises AttentionError of the first call that fails: the sessions imported so far
    stay on both replicas, and nothing was switched."""
    listed = list_sessions(source, timeout=timeout, metadata=metadata).sessions
    ids = [info.session_id for info in listed]
    for session_id in ids:
        import_session(target, export_session(source, session_id, chunk_rows=chunk_rows,
                                              timeout=timeout, metadata=metadata),
                       timeout=timeout, metadata=metadata)
    if switch is not None:
        switch()
    for session_id in ids:
        source._call(source._sessions_stub.DropSession, pb.DropSessionRequest(
            session_id=session_id), timeout, _owner_metadata(source, metadata, [session_id]))
    return ids
