"""Client and attend(): numpy arrays or torch tensors in, the same kind out.

torch is imported only when a torch tensor or dtype is handed in: importing it takes seconds,
and a broken install raises on import (not only ImportError), which must not break numpy use.
"""
import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import grpc
import numpy as np

from attention_client._stubs import attention_pb2 as pb
from attention_client._stubs import attention_pb2_grpc as pb_grpc

try:  # optional: numpy's bfloat16 and float8 e4m3
    import ml_dtypes
    _ML_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    _ML_FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:
    _ML_BFLOAT16 = _ML_FLOAT8_E4M3 = None

_NUMPY_DTYPES = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.float16): pb.DTYPE_FLOAT16}
_LAYOUTS = {"bhsd": pb.LAYOUT_BHSD, "bshd": pb.LAYOUT_BSHD}
_MASK_ALIGNMENTS = {"bottom_right": pb.MASK_ALIGN_BOTTOM_RIGHT, "top_left": pb.MASK_ALIGN_TOP_LEFT}


def _is_torch(x):
    """Whether x is a torch object (a tensor, a dtype), judged without importing torch."""
    return type(x).__module__.split(".")[0] == "torch"


class ServerTiming(NamedTuple):
    """Server-side microseconds of one call: waiting in the queue, host-to-device copies, the
    kernel, device-to-host copies, and the whole call in the server; then decode_us (arrival to
    queued: the parse, parse_us, and the checks), prepare_us (a Step's leases, K/V append and
    launch plan on the device's worker) and run_us (the device run as the worker's clock sees
    it; run_us - h2d_us - compute_us - d2h_us is its host side)."""
    queue_us: float
    h2d_us: float
    compute_us: float
    d2h_us: float
    total_us: float
    decode_us: float = 0.0
    prepare_us: float = 0.0
    run_us: float = 0.0
    parse_us: float = 0.0

    @classmethod
    def _from_pb(cls, t):
        return cls(t.queue_us, t.h2d_us, t.compute_us, t.d2h_us, t.total_us, t.decode_us,
                   t.prepare_us, t.run_us, t.parse_us)


@dataclass(frozen=True)
class AttendResult:
    """attend(..., return_info=True): o, lse (None without return_lse), where it ran (device,
    e.g. "cuda:0" or "cpu"), the server's timing and the echoed request_id."""
    o: Any
    lse: Optional[Any]
    timing: ServerTiming
    device: str
    request_id: str


@dataclass(frozen=True)
class StepBatchResult:
    """step_batch(..., return_info=True): o [B, Hq, Nq, D], lse [B, Hq, Nq] (None without
    return_lse), each sequence's length after the step, the server's timing and the device."""
    o: Any
    lse: Optional[Any]
    lengths: list
    timing: ServerTiming
    device: str


@dataclass(frozen=True)
class StepResult:
    """step(..., return_info=True): o, lse (None without return_lse), the session's length after
    the step, and the device and timing of the Step RPC (shared by the items of a step_many)."""
    o: Any
    lse: Optional[Any]
    length: int
    timing: ServerTiming
    device: str


def _set_options(request, causal, softmax_scale, window_left, window_right, return_lse):
    """The mask and output options an AttendRequest and a StepRequest share."""
    request.causal = causal
    request.return_lse = return_lse
    if softmax_scale is not None:
        request.softmax_scale = softmax_scale
    if window_left is not None:
        request.window_left = window_left
    if window_right is not None:
        request.window_right = window_right


def _set_open_model_options(request, sinks, softcap, chunk_size):
    """The open-model options an AttendRequest and a StepRequest share (None: absent): sinks, one
    logit per query head; softcap; chunk_size."""
    if sinks is not None:
        request.sinks.extend(float(x) for x in np.asarray(
            sinks.detach().cpu() if _is_torch(sinks) else sinks, dtype=np.float32).reshape(-1))
    if softcap is not None:
        request.softcap = softcap
    if chunk_size is not None:
        request.chunk_size = chunk_size


class AttentionError(Exception):
    """A failed call: code is the grpc.StatusCode, details the server's message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


# The start of the message of a call refused UNAVAILABLE because its session is sealed: an Export
# moving it to another replica sealed it (ExportRequest.seal; docs/API.md), and the router sends
# the call to the session's new owner once the drain switched it. Such a call changed nothing, so
# it is sent again (retry_sealed); no other UNAVAILABLE is (a Step may have been applied).
SEALED_MARKER = "session sealed: "
_SEALED_WAITS = (0.01, 0.2)  # seconds: the first wait between tries, doubling up to the second
_SEALED_DEADLINE = 30.0  # seconds of retries for a call without a deadline


def is_sealed(error):
    """Whether AttentionError `error` is a refusal of a sealed session (SEALED_MARKER)."""
    return error.code == grpc.StatusCode.UNAVAILABLE and SEALED_MARKER in (error.details or "")


class _SealedRetries:
    """The waits between the tries of one call refused for a sealed session: 10 ms doubling to
    200 ms, while the next wait fits before the deadline, `timeout` seconds (None: 30) on."""

    def __init__(self, timeout):
        self._deadline = time.monotonic() + (_SEALED_DEADLINE if timeout is None else timeout)
        self._wait = _SEALED_WAITS[0]

    def left(self):
        """Seconds left for the next try."""
        return max(self._deadline - time.monotonic(), 0.001)

    def wait_after(self, error):
        """Seconds to wait before trying again after AttentionError `error`; None when it is
        to be raised (not a sealed session's refusal, or no time left)."""
        if not is_sealed(error) or time.monotonic() + self._wait > self._deadline:
            return None
        wait, self._wait = self._wait, min(2 * self._wait, _SEALED_WAITS[1])
        return wait


def retry_sealed(send, timeout):
    """send(seconds left) again, after 10 ms doubling to 200 ms, while it raises a sealed
    session's refusal (is_sealed), until `timeout` seconds (None: 30) have passed; then that
    refusal is raised."""
    retries = _SealedRetries(timeout)
    while True:
        try:
            return send(retries.left())
        except AttentionError as e:
            wait = retries.wait_after(e)
            if wait is None:
                raise
        time.sleep(wait)


def retry_sealed_later(start, finish, timeout):
    """retry_sealed for a call answered later: start(seconds left) starts it and returns its gRPC
    future; the answer goes through finish(response). Returns a concurrent.futures.Future of
    finish's result, or of the failure (AttentionError); a sealed session's refusal starts the
    call again after the same waits (on a timer thread, nothing blocks meanwhile)."""
    future = concurrent.futures.Future()
    retries = _SealedRetries(timeout)

    def attempt():
        try:
            call = start(retries.left())
        except Exception as e:  # a closed channel, say: the future must still resolve
            future.set_exception(e)
            return
        call.add_done_callback(done)

    def done(call):
        try:
            try:
                response = call.result()
            except grpc.RpcError as e:
                raise AttentionError(e.code(), e.details()) from None
        except AttentionError as e:
            wait = retries.wait_after(e)
            if wait is None:
                future.set_exception(e)
            else:
                timer = threading.Timer(wait, attempt)
                timer.daemon = True
                timer.start()
            return
        try:
            future.set_result(finish(response))
        except Exception as e:  # the answer did not fit the request
            future.set_exception(e)

    attempt()
    return future


def float32_to_bfloat16_bits(x):
    """float32 values -> uint16 bfloat16 bits, rounded to nearest even (as the server rounds)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def bfloat16_bits_to_float32(bits):
    """uint16 bfloat16 bits -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# The 127 non-negative finite float8 e4m3 values, ascending (bytes 0x00..0x7e), and the midpoints
# between neighbours: OCP FP8 E4M3FN, 3 mantissa bits, exponent bias 7, subnormals m * 2^-9.
_E4M3_VALUES = np.array([(m / 8.0) * 2.0**-6 if e == 0 else (1 + m / 8.0) * 2.0**(e - 7)
                         for e in range(16) for m in range(8)][:127], dtype=np.float64)
_E4M3_MIDPOINTS = (_E4M3_VALUES[:-1] + _E4M3_VALUES[1:]) / 2


def float32_to_float8_e4m3_bits(x):
    """Values -> uint8 float8 e4m3 bits, rounded to nearest even; NaN, inf and magnitudes past
    464 (which round beyond the largest value, 448) become NaN (0x7f | sign), as the server's."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    i = np.searchsorted(_E4M3_MIDPOINTS, a, side="left")  # the nearer of bytes i and i + 1
    tie = (i < len(_E4M3_MIDPOINTS)) & (a == _E4M3_MIDPOINTS[np.minimum(i, 125)])
    i = i + (tie & (i % 2 == 1))  # a tie goes to the even byte
    bits = np.where(np.isnan(a) | (a > 464), 0x7F, i).astype(np.uint8)
    return bits | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def float8_e4m3_bits_to_float32(bits):
    """uint8 float8 e4m3 bits -> float32 values (exact; 0x7f and 0xff are NaN)."""
    b = np.asarray(bits, dtype=np.uint8)
    magnitude = np.append(_E4M3_VALUES, np.nan).astype(np.float32)[b & 0x7F]
    return np.where(b & 0x80, -magnitude, magnitude).astype(np.float32)


def _host_array(x, name, bfloat16_bits, float8_bits=False, host=None):
    """One input as (pb dtype, shape, array, kind): array holds the bytes the wire carries (host
    memory, row-major, little-endian; x itself, or a view of it, where x is so already), kind says
    how to return the output. host: x's contiguous copy in host memory where the caller made one
    (a torch CUDA tensor's, _to_host); else one is made here where needed."""
    if _is_torch(x):
        import torch
        t = x.detach().contiguous().cpu() if host is None else host
        if t.dtype == torch.bfloat16:
            return pb.DTYPE_BFLOAT16, t.shape, t.view(torch.int16).numpy(), ("torch", x)
        if t.dtype == getattr(torch, "float8_e4m3fn", None):  # o comes back as torch.bfloat16
            return pb.DTYPE_FLOAT8_E4M3, t.shape, t.view(torch.uint8).numpy(), ("torch", x)
        if t.dtype not in (torch.float32, torch.float16):
            raise TypeError(f"{name}: torch dtype {t.dtype} is not float32, float16, bfloat16 "
                            "or float8_e4m3fn")
        a = t.numpy()
        return _NUMPY_DTYPES[a.dtype], t.shape, _little_endian(a), ("torch", x)
    a = np.asarray(x)
    ml = ("ml_bfloat16", None)  # o comes back as ml_dtypes.bfloat16
    if _ML_BFLOAT16 is not None and a.dtype == _ML_BFLOAT16:
        return pb.DTYPE_BFLOAT16, a.shape, _little_endian(a.view(np.uint16)), ml
    if _ML_FLOAT8_E4M3 is not None and a.dtype == _ML_FLOAT8_E4M3:
        return pb.DTYPE_FLOAT8_E4M3, a.shape, _little_endian(a.view(np.uint8)), ml
    if a.dtype == np.uint16 and bfloat16_bits:
        return pb.DTYPE_BFLOAT16, a.shape, _little_endian(a), ("bits", None)
    if a.dtype == np.uint8 and float8_bits:  # o comes back as uint16 bfloat16 bits
        return pb.DTYPE_FLOAT8_E4M3, a.shape, _little_endian(a), ("bits", None)
    if a.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"{name}: dtype {a.dtype} is not float32, float16, bfloat16 or "
                        "float8_e4m3 (ml_dtypes, torch, uint16 bits with bfloat16_bits=True, or "
                        "uint8 bits with float8_bits=True)")
    return _NUMPY_DTYPES[a.dtype], a.shape, _little_endian(a), ("numpy", None)


def _little_endian(a):
    """a as the wire holds it: row-major, little-endian (a itself where it is so)."""
    a = np.ascontiguousarray(a)
    return a.astype(a.dtype.newbyteorder("<"), copy=False)


def _to_host(xs):
    """Host copies of inputs xs, None for those that are not torch CUDA tensors (they need none).

    The CUDA tensors are copied into parts of one pinned buffer, queued on their streams without
    waiting, then one wait per device: a .cpu() each would wait for the stream once per tensor
    and copy through pageable memory (staged by the driver). The buffer goes back to torch's
    pinned-memory cache when the copies are dropped."""
    cuda = [x for x in xs if _is_torch(x) and x.is_cuda]
    if not cuda:
        return [None] * len(xs)
    import torch
    sizes = [x.numel() * x.element_size() for x in cuda]
    starts = [0]
    for size in sizes:  # each part 64-byte aligned, so it views as any dtype
        starts.append(starts[-1] + (size + 63) // 64 * 64)
    buffer = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=True)
    hosts = {}
    for x, at, size in zip(cuda, starts, sizes):
        host = buffer[at:at + size].view(x.dtype).view(x.shape)
        host.copy_(x.detach(), non_blocking=True)
        hosts[id(x)] = host
    for device in {x.device for x in cuda}:
        torch.cuda.current_stream(device).synchronize()
    return [hosts.get(id(x)) for x in xs]


def _to_tensor(x, name, bfloat16_bits, float8_bits=False):
    """One input as (pb.Tensor, kind) where kind says how to return the output."""
    dtype, shape, a, kind = _host_array(x, name, bfloat16_bits, float8_bits)
    return pb.Tensor(dtype=dtype, shape=list(shape), data=a.tobytes()), kind


def _ref_of(client, x):
    """(pb.Tensor by reference, kind) of x where its bytes lie in one of the client's regions,
    else None."""
    if not client._regions:
        return None
    from attention_client.shared_memory import as_ref
    t = as_ref(client, x)
    if t is None:
        return None
    if _is_torch(x):
        return t, ("torch", x)
    return t, ("ml_bfloat16" if t.dtype == pb.DTYPE_BFLOAT16 else "numpy", None)


def _to_tensor_or_ref(client, x, name, bfloat16_bits, float8_bits=False):
    """As _to_tensor, but a numpy array inside one of the client's regions goes by reference."""
    return _ref_of(client, x) or _to_tensor(x, name, bfloat16_bits, float8_bits)


def _from_tensor(t, kind):
    """A response tensor as the output's kind: numpy, or torch on the input's device (_torch_of),
    each a copy of the message's bytes (which are read-only)."""
    shape = tuple(t.shape)
    if t.dtype == pb.DTYPE_FLOAT32:
        a = np.frombuffer(t.data, dtype="<f4").reshape(shape)
    elif t.dtype == pb.DTYPE_FLOAT16:
        a = np.frombuffer(t.data, dtype="<f2").reshape(shape)
    elif t.dtype == pb.DTYPE_BFLOAT16:
        a = np.frombuffer(t.data, dtype="<u2").reshape(shape)
        if kind[0] == "ml_bfloat16":
            a = a.view(_ML_BFLOAT16)
    else:
        raise AttentionError(grpc.StatusCode.INTERNAL, f"response tensor has dtype {t.dtype}")
    if kind[0] == "torch":
        import torch
        if t.dtype == pb.DTYPE_BFLOAT16:  # torch has no uint16: reinterpret through int16
            return _torch_of(a.view(np.int16), kind[1].device).view(torch.bfloat16)
        return _torch_of(a.astype(a.dtype.newbyteorder("="), copy=False), kind[1].device)
    return a.copy()


def _lse_from_tensor(t, kind):
    """A float32 LSE tensor as numpy, or torch on the device of the input when kind is torch."""
    lse = np.frombuffer(t.data, dtype="<f4").reshape(tuple(t.shape))
    if kind[0] == "torch":
        return _torch_of(lse.astype(np.float32, copy=False), kind[1].device)
    return lse.copy()


def _torch_of(a, device):
    """numpy array a (read-only: a message's bytes) as a new torch tensor on `device`, copied
    once: to a GPU straight from a's bytes (torch.tensor's host-to-device copy, no host copy
    first); to the host by numpy (torch.tensor's host copy took ~2x as long at 512 KiB)."""
    import torch
    if device.type == "cpu":
        return torch.from_numpy(a.copy())
    return torch.tensor(a, device=device)


def _attend_request(q, k, v, *, causal, softmax_scale, window_left, window_right, layout,
                    return_lse, cu_seqlens_q, cu_seqlens_k, bfloat16_bits, request_id,
                    mask_alignment, to_tensor=_to_tensor, float8_bits=False, q_descale=None,
                    k_descale=None, v_descale=None, sinks=None, softcap=None, chunk_size=None):
    """The AttendRequest of Client.attend's arguments, and the kind of output to return.

    to_tensor(x, name, bfloat16_bits, float8_bits) -> (pb.Tensor, kind): Client.attend's also
    places arrays inside registered shared memory by reference."""
    tq, kind = to_tensor(q, "q", bfloat16_bits, float8_bits)
    tk, _ = to_tensor(k, "k", bfloat16_bits, float8_bits)
    tv, _ = to_tensor(v, "v", bfloat16_bits, float8_bits)
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    request = pb.AttendRequest(request_id=request_id, q=tq, k=tk, v=tv, layout=_LAYOUTS[layout])
    _set_options(request, causal, softmax_scale, window_left, window_right, return_lse)
    _set_open_model_options(request, sinks, softcap, chunk_size)
    if mask_alignment not in _MASK_ALIGNMENTS:
        raise ValueError(f"mask_alignment must be one of {sorted(_MASK_ALIGNMENTS)}, got "
                         f"{mask_alignment!r}")
    request.mask_alignment = _MASK_ALIGNMENTS[mask_alignment]
    for field, value in (("q_descale", q_descale), ("k_descale", k_descale),
                         ("v_descale", v_descale)):
        if value is not None:  # float8 inputs only; the server checks
            setattr(request, field, value)
    if cu_seqlens_q is not None:
        request.cu_seqlens_q.extend(int(x) for x in cu_seqlens_q)
        request.cu_seqlens_k.extend(
            int(x) for x in (cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k))
    return request, kind


def _attend_output(response, kind, return_lse, return_info, out=None, lse_out=None):
    """What Client.attend returns for an AttendResponse: o, (o, lse) or an AttendResult; out and
    lse_out: the shared-memory arrays the server wrote O and LSE into, when the request named them."""
    o = out if out is not None else _from_tensor(response.o, kind)
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else _lse_from_tensor(response.lse, kind)
    if return_info:
        return AttendResult(o, lse, ServerTiming._from_pb(response.timing), response.device,
                            response.request_id)
    return (o, lse) if return_lse else o


class Client:
    """One channel to a server; thread-safe, reuse it for many calls.

    target: "host:port", or several "h1:p1,h2:p2" (calls spread round-robin over them).
    timeout: default deadline per call, seconds. max_attempts > 1 retries UNAVAILABLE Attend
    calls (session calls are never retried). metadata: sent on every call that names none, e.g.
    [("authorization", "Bearer TOKEN")]. connections > 1: attend() calls spread round-robin over
    that many TCP connections (tensors by reference stay on the first, which holds the regions).
    cuda_regions: torch CUDA tensors handed to attend() go by reference through CUDA regions, no
    host round trip, where the server shares the host and GPU: "auto" (try, and remember when the
    server cannot), "on" (never fall back to the host path) or "off" (see
    attention_client.cuda_tensors).
    """

    def __init__(self, target="localhost:50051", *, timeout=60.0, max_message_bytes=1 << 30,
                 max_attempts=1, credentials=None, options=(), metadata=None,
                 chunked_above_bytes=512 << 20, chunk_bytes=16 << 20, connections=1,
                 cuda_regions="auto"):
        self.timeout = timeout
        # attend() sends requests whose q, k and v exceed chunked_above_bytes through
        # AttendChunked, in chunks of chunk_bytes (over 2 GiB, or over the server's message
        # limit); 0: always Attend.
        self.chunked_above_bytes = chunked_above_bytes
        self.chunk_bytes = chunk_bytes
        self.metadata = metadata
        self._credentials = credentials
        self._several = ("," in target and "://" not in target
                         and not target.startswith(("ipv4:", "ipv6:")))
        if self._several:
            hosts = [h.strip().replace("localhost:", "127.0.0.1:") for h in target.split(",")]
            target = ("ipv6:" if any(h.startswith("[") for h in hosts) else "ipv4:") + ",".join(hosts)
        self._target = target
        self._base_options = [("grpc.max_send_message_length", max_message_bytes),
                              ("grpc.max_receive_message_length", max_message_bytes)]
        self._extra_options = list(options)
        config = {}
        if self._several:
            config["loadBalancingConfig"] = [{"round_robin": {}}]
        if max_attempts > 1:
            config["methodConfig"] = [{
                "name": [{"service": "attention.v1.Attention"}],
                "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.1s",
                                "maxBackoff": "2s", "backoffMultiplier": 2,
                                "retryableStatusCodes": ["UNAVAILABLE"]}}]
        opts = list(self._base_options)
        if config:
            import json
            opts.append(("grpc.service_config", json.dumps(config)))
            opts.append(("grpc.per_rpc_retry_buffer_size", max_message_bytes))
        self._channel = self._open_channel(opts)
        self._stub = pb_grpc.AttentionStub(self._channel)
        # connections > 1: attend() calls without shared-memory references are spread
        # round-robin over that many channels, each its own TCP connection (a local subchannel
        # pool; channels of equal options would share one), so large calls in flight at once do
        # not share one connection's flow control. Everything else uses the first.
        self._more_channels = [
            self._open_channel(opts + [("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, connections) - 1)]
        self._attend_stubs = [self._stub] + [pb_grpc.AttentionStub(c) for c in self._more_channels]
        self._next_attend = itertools.count()
        # A session lives on one server: over several addresses, sessions take a pick_first
        # channel of their own, so every call of a session reaches the server holding it.
        self._sessions_channel = self._open_channel(self._base_options) if self._several else None
        self._sessions_stub = pb_grpc.SessionsStub(self._sessions_channel or self._channel)
        # Sessions.Step and StepStream for every Step this client sends: a request goes out by its
        # own SerializeToString, so a packed Step's _wire.WireMessage (its tensors' bytes joined
        # once from the caller's buffers) travels as a pb.StepRequest does.
        from attention_client._wire import serialize
        sessions = f"/{pb.DESCRIPTOR.services_by_name['Sessions'].full_name}/"
        self._step = (self._sessions_channel or self._channel).unary_unary(
            sessions + "Step", request_serializer=serialize,
            response_deserializer=pb.StepResponse.FromString)
        self._step_stream = (self._sessions_channel or self._channel).stream_stream(
            sessions + "StepStream", request_serializer=serialize,
            response_deserializer=pb.StepResponse.FromString)
        # Shared memory: regions are the connection's (or the token's), so they use the sessions'
        # channel (one server).
        self._shm_stub = pb_grpc.SharedMemoryStub(self._sessions_channel or self._channel)
        self._sockets_stub = pb_grpc.SocketsStub(self._sessions_channel or self._channel)
        self._socket_port_seen = None  # ServerInfo.socket_port, asked once
        self._regions = []
        # Opened by the first session.step(..., stream=True) of each session owner (its
        # attention-session-owner header; "" for a server without --replica_name).
        self._step_streams = {}
        # Socket streams for Steps, one per session owner as the StepStreams: opened by the
        # owner's first Step with stream="socket".
        self._step_sockets = {}
        # Request rings for Steps, one per session owner as the StepStreams (a ring stays on the
        # server that opened it): opened by the owner's first session.step(..., stream="ring").
        self._step_rings = {}
        from attention_client.cuda_tensors import SegmentRegions
        # Registers nothing until used. Over several addresses "auto" is "off": the regions would
        # be on one server, the calls spread over all.
        self._step_events = {}  # (thread, device) -> step_batch's events in stream order
        self._step_counters = {}  # (thread, device) -> step_batch's counters in stream order
        self._batch_ids = {}  # sessions of a packed Step -> (ids, owner) (session._batch)
        self._cuda_segments = SegmentRegions(
            self, "off" if self._several and cuda_regions == "auto" else cuda_regions)

    def _open_channel(self, opts):
        opts = list(opts) + self._extra_options
        if self._credentials is None:
            return grpc.insecure_channel(self._target, options=opts)
        return grpc.secure_channel(self._target, self._credentials, options=opts)

    def _call(self, method, request, timeout, metadata):
        """A unary call; a sealed session's refusal is retried (retry_sealed)."""
        metadata = self.metadata if metadata is None else metadata
        timeout = self.timeout if timeout is None else timeout

        def send(seconds_left):
            try:
                return method(request, timeout=seconds_left, metadata=metadata)
            except grpc.RpcError as e:
                raise AttentionError(e.code(), e.details()) from None

        return retry_sealed(send, timeout)

    def close(self):
        self._cuda_segments.close()
        for step_stream in self._step_streams.values():
            step_stream.close()
        for step_socket in self._step_sockets.values():
            step_socket.close()
        for step_ring in self._step_rings.values():
            step_ring.close()
        self._channel.close()
        for channel in self._more_channels:
            channel.close()
        if self._sessions_channel is not None:
            self._sessions_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def attend(self, q, k, v, *, causal=False, softmax_scale=None, window_left=None,
               window_right=None, layout="bhsd", return_lse=False, cu_seqlens_q=None,
               cu_seqlens_k=None, bfloat16_bits=False, timeout=None, request_id="",
               metadata=None, return_info=False, mask_alignment="bottom_right", out=None,
               lse_out=None, float8_bits=False, q_descale=None, k_descale=None, v_descale=None,
               sinks=None, softcap=None, chunk_size=None):
        """O = softmax(scale * Q Kᵀ + mask) V on the server.

        q: [B, Hq, Nq, D] (layout "bhsd") or [B, Nq, Hq, D] ("bshd"); k, v: [B, Hkv, Nk, D]
        likewise. Varlen: q [total_q, Hq, D], k and v [total_k, Hkv, D] with cu_seqlens_q and
        cu_seqlens_k (B+1 offsets each; cu_seqlens_k defaults to cu_seqlens_q).
        mask_alignment: where a causal or window mask sits when Nq != Nk: "bottom_right" (query i
        on key i + Nk - Nq, FlashAttention's) or "top_left" (query i on key i, torch SDPA's).
        Returns o (same kind, dtype and shape as q), or (o, lse) with return_lse: lse float32
        [B, Hq, Nq] (varlen [Hq, total_q]); with return_info an AttendResult (o, lse, timing,
        device, request_id). Raises AttentionError with the gRPC status code.
        Open-model options (ServerInfo's DeviceInfo.attend_options says which a device serves;
        the others are refused UNIMPLEMENTED): sinks, one logit per query head (gpt-oss: the
        softmax denominator gains exp(sink)); softcap (Gemma 2: logits s -> softcap *
        tanh(s / softcap) before the mask); chunk_size (Llama 4: a key is seen only by the
        queries of its chunk); and v may have a head dim of its own (MLA), which o then has.
        float8 e4m3 inputs (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, or uint8 bits with
        float8_bits=True) give o in bfloat16 (torch.bfloat16, ml_dtypes.bfloat16, uint16 bits);
        q_descale, k_descale, v_descale (float8 only): the server computes with q * q_descale...

        Shared memory (register_shared_memory): numpy arrays inside a registered region travel
        by reference; out (and lse_out, with return_lse) must be arrays inside a region, and
        the server writes O (LSE) there: they are what is returned. torch CUDA tensors (without
        out and lse_out) go through CUDA regions where the server can take them (cuda_regions,
        attention_client.cuda_tensors): o and lse come back as new tensors on q's device.
        """
        open_model = dict(sinks=sinks, softcap=softcap, chunk_size=chunk_size)
        # CUDA regions place o shaped as q, and no GPU kernel serves the open-model options.
        if (out is None and lse_out is None and _is_torch(q) and getattr(q, "is_cuda", False)
                and self._cuda_segments.usable and v.shape[-1] == q.shape[-1]
                and all(x is None for x in open_model.values())):
            from attention_client.cuda_tensors import attend_on_device
            done, result = attend_on_device(self, q, k, v, dict(
                causal=causal, softmax_scale=softmax_scale, window_left=window_left,
                window_right=window_right, layout=layout, return_lse=return_lse,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, timeout=timeout,
                request_id=request_id, metadata=metadata, return_info=return_info,
                mask_alignment=mask_alignment))
            if done:
                return result
        from attention_client.shared_memory import out_ref
        request, kind = _attend_request(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_left=window_left,
            window_right=window_right, layout=layout, return_lse=return_lse,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, bfloat16_bits=bfloat16_bits,
            request_id=request_id, mask_alignment=mask_alignment,
            to_tensor=lambda x, name, *bits: _to_tensor_or_ref(self, x, name, *bits),
            float8_bits=float8_bits, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, **open_model)
        if out is not None:
            request.o_ref.CopyFrom(out_ref(self, out, "out"))
        if lse_out is not None:
            request.lse_ref.CopyFrom(out_ref(self, lse_out, "lse_out"))
        # Chunked above the threshold, for requests whose bytes all travel (tensors by reference
        # and outputs into a region go through Attend).
        by_reference = (out is not None or lse_out is not None
                        or any(t.HasField("ref") for t in (request.q, request.k, request.v)))
        size = len(request.q.data) + len(request.k.data) + len(request.v.data)
        # Regions belong to the connection that registered them: references take the first.
        stub = self._stub if by_reference else self._attend_stubs[
            next(self._next_attend) % len(self._attend_stubs)]
        if self.chunked_above_bytes and size > self.chunked_above_bytes and not by_reference:
            response = self._attend_chunked(stub, request, timeout, metadata)
        else:
            response = self._call(stub.Attend, request, timeout, metadata)
        return _attend_output(response, kind, return_lse, return_info, out=out, lse_out=lse_out)

    def _attend_chunked(self, stub, request, timeout, metadata):
        """Attention.AttendChunked: the request without its tensors' data, then chunks of q, k and
        v; the answer likewise. Returns the AttendResponse with o and lse filled in."""
        head = pb.AttendRequest()
        head.CopyFrom(request)
        for t in (head.q, head.k, head.v):
            t.ClearField("data")
        chunk = self.chunk_bytes

        def messages():
            yield pb.AttendChunk(request=head)
            for which, t in ((pb.CHUNK_TENSOR_Q, request.q), (pb.CHUNK_TENSOR_K, request.k),
                             (pb.CHUNK_TENSOR_V, request.v)):
                data = memoryview(t.data)
                for at in range(0, len(data), chunk):
                    yield pb.AttendChunk(chunk=pb.TensorChunk(
                        tensor=which, offset=at, data=bytes(data[at:at + chunk])))

        try:
            answer = stub.AttendChunked(
                messages(), timeout=self.timeout if timeout is None else timeout,
                metadata=self.metadata if metadata is None else metadata)
            response, buffers = None, {}
            for part in answer:
                if part.HasField("response"):
                    response = part.response
                    buffers[pb.CHUNK_TENSOR_O] = bytearray(len(request.q.data))
                    if response.HasField("lse"):
                        buffers[pb.CHUNK_TENSOR_LSE] = bytearray(4 * int(np.prod(response.lse.shape)))
                    continue
                c = part.chunk
                buffers[c.tensor][c.offset:c.offset + len(c.data)] = c.data
        except grpc.RpcError as e:
            raise AttentionError(e.code(), e.details()) from None
        response.o.data = bytes(buffers[pb.CHUNK_TENSOR_O])
        if pb.CHUNK_TENSOR_LSE in buffers:
            response.lse.data = bytes(buffers[pb.CHUNK_TENSOR_LSE])
        return response

    def health(self, service="", *, timeout=None):
        """The grpc.health.v1 status of service ("" = the server as a whole;
        "attention.v1.Attention", "attention.v1.Sessions"): "SERVING" or "NOT_SERVING" (or
        "UNKNOWN"). An unknown service raises AttentionError NOT_FOUND."""
        from attention_client.health import check
        return check(self, service, timeout)

    def _socket_port(self):
        """The server's socket port (ServerInfo.socket_port), asked once; AttentionError
        UNIMPLEMENTED when it serves none."""
        if self._socket_port_seen is None:
            self._socket_port_seen = self.server_info().socket_port
        if self._socket_port_seen == 0:
            raise AttentionError(grpc.StatusCode.UNIMPLEMENTED,
                                 "stream=\"socket\": the server serves no socket streams "
                                 "(ServerInfo.socket_port is 0; it needs --socket_port)")
        return self._socket_port_seen

    def server_info(self, timeout=None):
        """The server's attention.v1.ServerInfo message."""
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout, None)

    def session(self, *, dtype=None, kv_heads=None, head_dim=None, k=None, v=None, layout="bhsd",
                bfloat16_bits=False, timeout=None, metadata=None, layers=None, tokens=None,
                prefix_tokens=None, v_head_dim=None, v_from_k=False):
        """A new KV-resident session on the server (attention_client.session.Session).

        k, v (optional first rows): [Hkv, N, D] (layout "bhsd") or [N, Hkv, D] ("bshd"), v with
        Dv for D; dtype, kv_heads, head_dim and v_head_dim default to theirs. v_head_dim: Dv,
        the head dim of v and of the Steps' o where it is not D (MLA models; None: D), served
        where the device's DeviceInfo.step_options list "v_head_dim" (else AttentionError
        UNIMPLEMENTED). v_from_k: v is k's first v_head_dim features, kept once (MLA's latent
        cache: one KV head of 576 whose first 512 are v, as FlashMLA reads it): the session
        stores k alone, and its creation, append() and Steps take k without v (served where
        step_options list "v_from_k"). dtype: "float32" | "float16" | "bfloat16", or a
        numpy/torch dtype.
        layout also applies to append(). metadata: for every call of the session (default: the
        client's). layers: a sequence of a model's `layers` layers, one cache each (created
        empty; append(), step(), step_many() and step_batch() then name the layer; truncate, fork
        and drop take every layer): one create and one drop per sequence.
        tokens: the token id of each row of k and v (so later sessions can share their pages).
        prefix_tokens (without k and v): the sequence's first token ids; the session starts
        holding the rows of the longest run of full pages of them that this caller's sessions of
        this shape and layer count appended with their tokens and the server still caches
        (shared with those sessions; Session.prefix_rows says how many): append the rest, with
        their tokens.
        """
        from attention_client.session import create_session
        return create_session(self, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim, k=k, v=v,
                              layout=layout, bfloat16_bits=bfloat16_bits, timeout=timeout,
                              metadata=metadata, layers=layers, tokens=tokens,
                              prefix_tokens=prefix_tokens, v_head_dim=v_head_dim,
                              v_from_k=v_from_k)

    def step_many(self, items, *, causal=False, softmax_scale=None, window_left=None,
                  window_right=None, return_lse=False, timeout=None, metadata=None,
                  request_id="", return_info=False, sinks=None, softcap=None, chunk_size=None,
                  layer=None):
        """One Step RPC over several sessions of this client, run by the server as one launch.

        items: (session, q), (session, q, k, v) or (session, q, k, v, tokens) tuples, each
        session at most once; q [Hq, Nq, D], k [Hkv, n, D] and v [Hkv, n, Dv] appended before
        attending, tokens their token ids (as Session.append's). Returns one o
        [Hq, Nq, Dv] (or (o, lse), or with return_info a StepResult) per item, in order; every
        session's length is updated.
        sinks, softcap, chunk_size: as attend()'s, for every item (DeviceInfo.step_options).
        layer: the layer of every session, for sessions of several layers.
        """
        from attention_client.session import step_many
        return step_many(self, items, causal=causal, softmax_scale=softmax_scale,
                         window_left=window_left, window_right=window_right,
                         return_lse=return_lse, timeout=timeout, metadata=metadata,
                         request_id=request_id, return_info=return_info, sinks=sinks,
                         softcap=softcap, chunk_size=chunk_size, layer=layer)

    def step_batch(self, sessions, q, k=None, v=None, *, causal=False, softmax_scale=None,
                   window_left=None, window_right=None, return_lse=False, out=None,
                   lse_out=None, timeout=None, metadata=None, request_id="", return_info=False,
                   stream=False, wait=True, sinks=None, softcap=None, chunk_size=None,
                   ready_event=None, done_event=None, ready_counter=None, done_counter=None,
                   layer=None):
        """One packed Step over a layer's batch: one message and one tensor each, none per
        sequence. Sequence b is sessions[b] (each at most once, all of one dtype, Hkv, D and Dv).

        q [B, Hq, Nq, D]; k [B, Hkv, n, D] and v [B, Hkv, n, Dv] appended to each sequence before
        it attends. Returns o [B, Hq, Nq, Dv] (q's kind and dtype; Dv the sessions' v_head_dim),
        or (o, lse) with return_lse (lse float32 [B, Hq, Nq]), or with return_info a
        StepBatchResult; every session's length is updated.
        Tensors inside regions this client registered go by reference (no copy through the
        socket); out and lse_out, arrays in such regions, receive o and lse there (they must not
        overlap each other or an input). stream: as Session.step (False: unary; True: the
        client's StepStream; "ring": its request ring; "socket": its socket stream). wait=False
        returns at once, so the caller can work meanwhile (another micro-batch's MLP, say):
        unary, a concurrent.futures.Future of the result; on the ring or the socket, a
        PostedStep once the Step is posted, whose result() reads the answer (on the ring the next
        Step reads it too, and raises its failure; on the socket several may be in flight).
        Leave the sessions and buffers alone until it is done.
        sinks, softcap, chunk_size: as attend()'s. layer: the layer of every session, for sessions
        of several layers (Client.session(layers=)).

        torch CUDA tensors (without out and lse_out) go through CUDA regions in stream order
        (attention_client.cuda_tensors): the server's kernels read q, k, v and write o where they
        are, ordered after the kernels queued on the current stream by an interprocess event,
        and the current stream waits for the server's before later work; the call returns once
        the server has queued the step, with nothing synchronised. With wait=False and
        stream="ring" they are ordered by counters instead (StepRequest.ready_counter,
        done_counter): the current stream waits for the server's write of the done counter,
        queued before the server has even taken the Step, so the call returns once the Step is
        posted and the model queues its next kernels while the server works; a Step that fails
        has the counter written by this client (the stream goes on, o undefined) and its failure
        raised by result() or the next Step. ready_event, done_event (bytes of
        cudaIpcEventHandle_t) and ready_counter, done_counter ((a uint64 torch CUDA tensor of one
        element in a registered CUDA region, value)) do the same for a caller whose q, k, v, out
        and lse_out are already in CUDA regions it registered.
        """
        from attention_client.session import step_batch
        return step_batch(self, sessions, q, k, v, causal=causal, softmax_scale=softmax_scale,
                          window_left=window_left, window_right=window_right,
                          return_lse=return_lse, out=out, lse_out=lse_out, timeout=timeout,
                          metadata=metadata, request_id=request_id, return_info=return_info,
                          stream=stream, wait=wait, sinks=sinks, softcap=softcap,
                          chunk_size=chunk_size, ready_event=ready_event, done_event=done_event,
                          ready_counter=ready_counter, done_counter=done_counter, layer=layer)

    def register_shared_memory(self, name, shm, *, offset=0, size=None, timeout=None,
                               metadata=None):
        """Registers a multiprocessing.shared_memory.SharedMemory (bytes [offset, offset + size))
        with the server as region `name`; returns a Region (see attention_client.shared_memory)."""
        from attention_client.shared_memory import register_system
        return register_system(self, name, shm, offset=offset, size=size, timeout=timeout,
                               metadata=self.metadata if metadata is None else metadata)

    def register_cuda_tensor(self, name, tensor, *, timeout=None, metadata=None):
        """Registers a torch CUDA tensor's memory by its CUDA IPC handle; returns a Region."""
        from attention_client.shared_memory import register_cuda_tensor
        return register_cuda_tensor(self, name, tensor, timeout=timeout,
                                    metadata=self.metadata if metadata is None else metadata)

    def request_ring(self, method, *, slot_bytes=1 << 20, metadata=None):
        """A request ring ("attend": AttendRequest in, AttendResponse out; "step": StepRequest in,
        StepResponse out) over this client's connection; see attention_client.request_ring."""
        from attention_client.request_ring import RequestRing
        return RequestRing(self, method, slot_bytes=slot_bytes, metadata=metadata)

    def list_shared_memory(self, *, timeout=None, metadata=None):
        """The caller's regions on the server (RegionInfo messages)."""
        from attention_client.shared_memory import list_regions
        return list_regions(self, timeout=timeout, metadata=metadata)

    def import_session(self, chunks, *, session_id=None, layout="bhsd", bfloat16_bits=False,
                       timeout=None, metadata=None):
        """A new session of the caller's on this server holding exactly the rows of `chunks`
        (pb.SessionChunk messages: another server's Session.export(), or ones built by hand:
        the header first, then each layer's rows in order), sent as they come
        (Sessions.Import). session_id: the new session's id (an id a server made: 32 lower-case
        hex digits, after a replica name and a '.' where that server had --replica_name); None:
        the header's (an export's: the exported session's), "": a new one the server makes (of
        this server's replica name). An
        id that exists raises AttentionError ALREADY_EXISTS; a stream that fails leaves nothing
        on the server. layout, bfloat16_bits: the Session's (as session())."""
        from attention_client.session import import_session
        return import_session(self, chunks, session_id=session_id, layout=layout,
                              bfloat16_bits=bfloat16_bits, timeout=timeout, metadata=metadata)

    def list_sessions(self, *, timeout=None, metadata=None):
        """ListSessionsResponse: the caller's sessions (all, when the server checks no tokens),
        page_bytes, pages_total, pages_free."""
        from attention_client.session import list_sessions
        return list_sessions(self, timeout=timeout, metadata=metadata)


def attend(q, k, v, *, target="localhost:50051", **kwargs):
    """One call on a fresh channel; for many calls, keep a Client."""
    timeout = kwargs.pop("timeout", 60.0)
    with Client(target, timeout=timeout) as client:
        return client.attend(q, k, v, **kwargs)
