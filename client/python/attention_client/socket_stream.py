"""Socket streams (attention.v1.Sockets; the server's --socket_port, ServerInfo.socket_port):
StepRequests over a plain TCP connection, each framed by an 8-byte length word instead of HTTP/2.
A remote model calls attention once per layer per token with one large Step each way; a gRPC
exchange of those bytes costs several raw TCP round trips of them (bench/README.md, "A model's
decode"), so Steps with stream="socket" take this connection instead.

The connection belongs to a Sockets.Open call on the client's channel: the call carries the
token and the session owner's header (a router sends it to the replica holding the sessions) and
lasts as long as the socket; the connection proves it belongs to the call by the call's 32 random
bytes. Frames are little-endian: a request or a response is its length (u64) and the message; the
server's last frame is its length word with bit 63 set over the status code (u32) and message.
"""
import os
import socket
import struct
import threading

import grpc

from attention_client._stubs import attention_pb2 as pb
from attention_client._wire import WireMessage
from attention_client.client import AttentionError

MAGIC = b"ATTNSOCK"
NONCE_BYTES = 32
END_BIT = 1 << 63
_LENGTH = struct.Struct("<Q")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def socket_host(target):
    """The host of a client's gRPC target, where its server's socket port listens: "host:port",
    "[v6]:port", "dns:///host:port", "ipv4:host:port"; None for a Unix socket or several
    addresses (a socket stream needs one server)."""
    if target.startswith("unix:") or "," in target:
        return None
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    host = target.rsplit(":", 1)[0] if ":" in target else target
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "localhost"


class SocketStream:
    """Steps over one socket stream (thread-safe): post() sends one (a pb.StepRequest or a
    _wire.WireMessage) and returns its answer's getter, so several may be in flight (two
    micro-batches' layer calls, say). A Step that fails ends the stream (AttentionError with the
    server's code and message, raised to every Step in flight); a Step past its timeout ends it
    too (DEADLINE_EXCEEDED: a late answer would belong to no Step). Open another for the next."""

    def __init__(self, client, port, metadata=None):
        host = socket_host(client._target)
        if host is None:
            raise ValueError(f"stream=\"socket\": the client's target {client._target!r} is not "
                             "one TCP address (a Unix socket's clients take the request ring)")
        nonce = os.urandom(NONCE_BYTES)
        # Senders take turns, and so do readers; a reader keeps the answers that come for other
        # Steps for their own answer() calls.
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._ids_lock = threading.Lock()  # guards _waiting (posters add, readers take)
        self._count = 0
        self._waiting = set()  # request_ids posted and not yet answered to their caller
        self._answers = {}  # request_id -> StepResponse read, not yet taken (_read_lock)
        self._ended = None  # the AttentionError that ended the stream
        # No deadline: the call lasts as long as the socket.
        self._call = client._sockets_stub.Open.future(
            pb.OpenSocketRequest(method=pb.RING_METHOD_STEP, nonce=nonce),
            metadata=client.metadata if metadata is None else metadata)
        try:
            self._sock = socket.create_connection((host, port), timeout=client.timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(MAGIC + nonce)
        except OSError as e:
            self._call.cancel()
            client._socket_port_seen = None  # asked again next time: the server may have moved
            raise AttentionError(grpc.StatusCode.UNAVAILABLE,
                                 f"socket stream: cannot connect to {host}:{port}: {e}") from None
        self._length = bytearray(_LENGTH.size)

    def post(self, request):
        """Sends one StepRequest without waiting for its answer; returns answer(timeout), which
        waits for its StepResponse (answers that come first, for Steps posted earlier, are kept
        for theirs). Steps are queued in the order posted; their request_ids must differ."""
        with self._send_lock:
            if self._ended is not None:
                raise self._ended
            self._count += 1
            if not request.request_id:
                request.request_id = f"step-{self._count}"
            request_id = request.request_id
            with self._ids_lock:
                if request_id in self._waiting:
                    raise ValueError(f"request_id: {request_id!r} is already in flight on this "
                                     "socket stream")
                self._waiting.add(request_id)
            # A WireMessage's tensors go from the caller's buffers, gathered by sendmsg.
            parts = (request.buffers() if isinstance(request, WireMessage)
                     else [request.SerializeToString()])
            try:
                self._send_all([_LENGTH.pack(sum(len(p) for p in parts)), *parts])
            except OSError as e:
                raise self._end(AttentionError(grpc.StatusCode.UNAVAILABLE,
                                               f"socket stream: {e}"))
        return lambda timeout=None: self._answer(request_id, timeout)

    def _answer(self, request_id, timeout):
        """The StepResponse of `request_id`, reading frames (keeping other Steps' answers) until
        it comes."""
        with self._read_lock:
            while request_id not in self._answers:
                if self._ended is not None:
                    with self._ids_lock:
                        self._waiting.discard(request_id)
                    raise self._ended
                try:
                    self._sock.settimeout(timeout)
                    length = self._read_length()
                    if length & END_BIT:
                        raise self._end_frame(length & ~END_BIT)
                    body = bytearray(length)
                    self._read_into(memoryview(body))
                except socket.timeout:
                    raise self._end(AttentionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                   f"socket stream: no answer to "
                                                   f"{request_id!r} within {timeout} s"))
                except OSError as e:
                    raise self._end(AttentionError(grpc.StatusCode.UNAVAILABLE,
                                                   f"socket stream: {e}"))
                response = pb.StepResponse.FromString(body)
                with self._ids_lock:
                    known = response.request_id in self._waiting
                if not known:
                    raise self._end(AttentionError(
                        grpc.StatusCode.DATA_LOSS, f"socket stream answered "
                        f"{response.request_id!r}, which no Step in flight sent"))
                self._answers[response.request_id] = response
            with self._ids_lock:
                self._waiting.discard(request_id)
            return self._answers.pop(request_id)

    def ended(self):
        """Whether the stream has ended (a Step failed, or the server ended it)."""
        return self._ended is not None or self._call.done()

    def close(self):
        """Ends the stream: the server answers what it holds, sends its end frame and closes."""
        with self._send_lock, self._read_lock:
            if self._ended is None:
                try:
                    self._sock.settimeout(5.0)
                    self._sock.shutdown(socket.SHUT_WR)
                    while True:  # responses never read, then the end frame
                        length = self._read_length()
                        if length & END_BIT:
                            break
                        self._read_into(memoryview(bytearray(length)))
                except OSError:
                    pass
                self._ended = AttentionError(grpc.StatusCode.CANCELLED,
                                             "socket stream: closed by its client")
            self._sock.close()
            self._call.cancel()

    def _send_all(self, parts):
        """sendmsg until every byte of `parts` is sent: with a timeout set, one call may send
        part of them."""
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            sent = self._sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]

    def _read_length(self):
        self._read_into(memoryview(self._length))
        return _LENGTH.unpack(self._length)[0]

    def _read_into(self, view):
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            got += n

    def _end_frame(self, length):
        """The server's end frame: the status it ended the stream with."""
        body = bytearray(length)
        self._read_into(memoryview(body))
        code = _CODES.get(int.from_bytes(body[:4], "little"), grpc.StatusCode.UNKNOWN)
        message = bytes(body[4:]).decode(errors="replace")
        if code == grpc.StatusCode.OK:
            code, message = grpc.StatusCode.DATA_LOSS, "socket stream: ended without an answer"
        return self._end(AttentionError(code, message))

    def _end(self, error):
        """The stream is over with `error`: no further Step goes on it."""
        self._ended = error
        try:
            self._sock.close()
        finally:
            self._call.cancel()
        return error
