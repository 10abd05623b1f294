"""Round trips of a request's bytes from Python, one at a time, p50 in microseconds (one JSON line):

    python3 bench/echo/py_echo.py --target=127.0.0.1:50061 [--parts=4]   # grpcio, attn_echo_server
    python3 bench/echo/py_echo.py --tcp                                    # raw TCP, both ends here

The default sizes are a batch-64 decode Step of an 8B-shaped Llama (bf16 q [64, 32, 1, 128] and
new k, v [64, 8, 1, 128] up, o as q back). With --target the request is an EchoRequest
(bench/echo/echo.proto, encoded here by the Python client's wire encoder: no stubs of echo.proto)
to attn_echo_server, whose reply carries q's bytes back; --parts splits the bytes over that many
connections, all in flight at once. --tcp sends the same bytes over one loopback socket to a
thread that answers with o's size: the floor under any transport on this host.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from attention_client._wire import _key  # noqa: E402


def field(number, data):
    """A length-delimited protobuf field (the client's own encoder: attention_client._wire)."""
    return _key(number, len(data)) + data


def timed(call, rounds, warmup):
    times = []
    for i in range(warmup + rounds):
        start = time.perf_counter()
        call()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def grpc_echo(a):
    import grpc
    opts = [("grpc.max_receive_message_length", 1 << 30), ("grpc.use_local_subchannel_pool", 1)]
    calls = [grpc.insecure_channel(a.target, options=opts).unary_unary("/attention.bench.Echo/Echo")
             for _ in range(a.parts)]
    request = (field(1, os.urandom(a.q_bytes // a.parts)) +
               field(2, os.urandom(a.kv_bytes // a.parts)) +
               field(3, os.urandom(a.kv_bytes // a.parts)))
    return timed(lambda: [f.result() for f in [c.future(request) for c in calls]], a.rounds,
                 a.warmup)


def tcp_echo(a):
    up, down = a.q_bytes + 2 * a.kv_bytes, a.q_bytes
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf, reply = bytearray(up), bytes(down)
        while True:
            view, got = memoryview(buf), 0
            while got < up:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request, back = bytes(up), bytearray(down)

    def round_trip():
        sock.sendall(request)
        view, got = memoryview(back), 0
        while got < down:
            got += sock.recv_into(view[got:])

    return timed(round_trip, a.rounds, a.warmup)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50061", help="attn_echo_server's address")
    p.add_argument("--tcp", action="store_true", help="raw TCP instead of gRPC")
    p.add_argument("--parts", type=int, default=1, help="connections the bytes are split over")
    p.add_argument("--q_bytes", type=int, default=524288)
    p.add_argument("--kv_bytes", type=int, default=131072, help="bytes of each of k and v")
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    a = p.parse_args()
    p50 = tcp_echo(a) if a.tcp else grpc_echo(a)
    print(json.dumps({"transport": "tcp" if a.tcp else "grpcio", "parts": 1 if a.tcp else a.parts,
                      "q_bytes": a.q_bytes, "kv_bytes": a.kv_bytes, "p50_us": round(p50, 1)}))


if __name__ == "__main__":
    main()
