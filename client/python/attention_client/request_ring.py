"""Requests through a request ring (attention.v1.SharedMemory.OpenRing), for clients on the
server's host: each request is serialized into a slot of a shared-memory object that the server
maps, and its response read from another, with no gRPC message per request. A decode loop with one
Step in flight saves loopback gRPC's exchange on every Step (on the H200 host the C++ client's
Step by reference took kernel + 107 us on a ring against kernel + 208 us on a StepStream:
bench/results/2026-12-02-request-rings.md). The server must run with --allow_shared_memory.

    ring = client.request_ring("step")            # or session.step(..., stream="ring")
    response = ring.request(step_request)         # a StepRequest in, its StepResponse out
    ring.close()

The layout is proto/attention/v1/request_ring.h. Python cannot order memory accesses itself, so
this side relies on x86-64's: stores become visible in program order, as do loads (it refuses to
open a ring elsewhere), and aligned 8-byte ctypes loads and stores are single instructions. The
one order x86-64 does not keep, a store before a later load, is the doorbell's: so this side rings
the server's bell after every request instead of checking whether the server sleeps, and sleeps
on its own bell at most 1 ms at a time.
"""
import ctypes
import platform
import secrets
import threading
import time
from multiprocessing import shared_memory

import grpc

from attention_client._stubs import attention_pb2 as pb
from attention_client.client import AttentionError

# proto/attention/v1/request_ring.h: the header's words (byte offsets) and the ring's limits.
_HEADER_BYTES = 448
_REQUESTS_POSTED, _REQUESTS_TAKEN, _RESPONSES_POSTED, _RESPONSES_TAKEN = 0, 64, 128, 192
_CLIENT_CLOSED, _SERVER_OPEN, _SERVER_CLOSED = 256, 260, 264
_SERVER_BELL, _CLIENT_BELL, _CLIENT_WAITING = 320, 384, 388
_LENGTH_BYTES = 8
MIN_SLOT_BYTES = 4096
MAX_SLOT_BYTES = 64 << 20

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SPIN_S = 0.02  # how long a wait spins before it sleeps on the bell (as the C++ client)
_SLEEP_NS = 1_000_000

_METHODS = {"attend": (pb.RING_METHOD_ATTEND, pb.AttendResponse),
            "step": (pb.RING_METHOD_STEP, pb.StepResponse)}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class RequestRing:
    """One ring of AttendRequests ("attend") or StepRequests ("step") over `client`'s connection,
    whose regions its requests may refer to. One request in flight at a time (thread-safe:
    callers take turns); submit() returns once it is posted, so the caller can work while the
    server answers. A request that fails ends the ring (AttentionError with its code); open
    another for the next."""

    def __init__(self, client, method, *, slot_bytes=1 << 20, metadata=None):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise NotImplementedError(
                f"request rings from Python need x86-64's memory order; this is "
                f"{platform.machine()} (use the C++ client, client/request_ring.h)")
        if method not in _METHODS:
            raise ValueError(f"method: expected 'attend' or 'step', got {method!r}")
        if not (MIN_SLOT_BYTES <= slot_bytes <= MAX_SLOT_BYTES and slot_bytes % 64 == 0):
            raise ValueError(f"slot_bytes: expected a multiple of 64 from {MIN_SLOT_BYTES} to "
                             f"{MAX_SLOT_BYTES}, got {slot_bytes}")
        self._method, self._response_type = _METHODS[method]
        # One request in flight: one slot each way, the request's after the header, the
        # response's after it.
        self._slot_bytes = slot_bytes
        self._request_at, self._response_at = _HEADER_BYTES, _HEADER_BYTES + slot_bytes
        self._lock = threading.Lock()
        self._mapping_lock = threading.Lock()  # the call's end against the mapping's release
        self._posted = self._taken = 0  # this side's counters (requests_posted, responses_taken)
        self._in_flight = None  # the RingTicket of the request posted and not yet answered
        self._closed = False  # no more requests
        self._released = False  # the region unregistered, the shared memory unlinked
        # Seconds spent waiting for the server (a slot it had not taken, an answer not yet
        # posted): what a caller that posts without waiting for answers still waits.
        self.waited_s = 0.0
        self._shm = shared_memory.SharedMemory(create=True, size=_HEADER_BYTES + 2 * slot_bytes)
        buf = self._shm.buf
        self._buf = buf
        word = lambda kind, at: kind.from_buffer(buf, at)  # noqa: E731
        self._requests_posted = word(ctypes.c_uint64, _REQUESTS_POSTED)
        self._requests_taken = word(ctypes.c_uint64, _REQUESTS_TAKEN)
        self._responses_posted = word(ctypes.c_uint64, _RESPONSES_POSTED)
        self._responses_taken = word(ctypes.c_uint64, _RESPONSES_TAKEN)
        self._client_closed = word(ctypes.c_uint32, _CLIENT_CLOSED)
        self._server_open = word(ctypes.c_uint32, _SERVER_OPEN)
        self._server_closed = word(ctypes.c_uint32, _SERVER_CLOSED)
        self._server_bell = word(ctypes.c_uint32, _SERVER_BELL)
        self._client_bell = word(ctypes.c_uint32, _CLIENT_BELL)
        self._client_waiting = word(ctypes.c_uint32, _CLIENT_WAITING)
        self._region = None
        self._call = None
        try:
            self._region = client.register_shared_memory(
                f"ring-{secrets.token_hex(6)}", self._shm, metadata=metadata)
            self._call = client._shm_stub.OpenRing.future(
                pb.OpenRingRequest(region=self._region.name, offset=0, method=self._method,
                                   slots=1, slot_bytes=slot_bytes),
                metadata=client.metadata if metadata is None else metadata)
            self._call.add_done_callback(self._on_end)
            # Served (server_open) or refused (the call ends): a refusal is this constructor's.
            while self._server_open.value == 0 and not self._call.done():
                self._sleep()
            if self._server_open.value == 0:
                self._raise_end()
        except BaseException:
            self._release()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, message):
        """Sends one request and returns its response (an AttendResponse or a StepResponse)."""
        return self.submit(message).response()

    def submit(self, message, on_error=None, recover=None):
        """Posts one request without waiting for its response: returns a RingTicket, whose
        response() reads it. One request is in flight at a time: a later submit (or request) first
        reads the earlier one's response into its ticket, and raises if that request failed (the
        failure ended the ring). recover(error), when given, runs once if this request fails,
        whoever finds it: what it returns stands for the response (the request answered another
        way), and what it raises for the failure. `on_error()` runs once if this request fails
        (and recover raised), whoever finds it."""
        data = message.SerializeToString()
        if len(data) > self._slot_bytes - _LENGTH_BYTES:
            raise ValueError(f"request of {len(data)} serialized bytes: expected at most "
                             f"{self._slot_bytes - _LENGTH_BYTES} (slot_bytes less the length "
                             f"word); open the ring with larger slots")
        with self._lock:
            self._settle()
            if self._closed:
                raise AttentionError(grpc.StatusCode.FAILED_PRECONDITION, "the ring is closed")
            self._await(lambda: self._requests_taken.value == self._posted)
            at = self._request_at
            self._buf[at:at + _LENGTH_BYTES] = len(data).to_bytes(_LENGTH_BYTES, "little")
            self._buf[at + _LENGTH_BYTES:at + _LENGTH_BYTES + len(data)] = data
            self._posted += 1
            self._requests_posted.value = self._posted  # after the slot's bytes (x86-64 order)
            self._wake(self._server_bell)
            self._in_flight = RingTicket(self, on_error, recover)
            return self._in_flight

    def settle(self):
        """Reads the response of the request in flight, if any, into its ticket; raises its
        failure unless its recover answered it. Returns whether the ring takes more requests (a
        failure ends it, answered by recover or not)."""
        with self._lock:
            self._settle()
            return not self._closed

    def _settle(self):
        """Reads the response of the request in flight into its ticket; raises its failure
        (unless recovered). Under _lock."""
        ticket, self._in_flight = self._in_flight, None
        if ticket is None:
            return
        try:
            ticket._response = self._take()
        except BaseException as e:
            ticket._fail(e)
            if ticket._error is not None:
                raise ticket._error from None

    def _take(self):
        """The next response, once posted. Under _lock."""
        self._await(lambda: self._responses_posted.value > self._taken)
        at = self._response_at
        length = int.from_bytes(self._buf[at:at + _LENGTH_BYTES], "little")
        if length > self._slot_bytes - _LENGTH_BYTES:
            raise AttentionError(grpc.StatusCode.DATA_LOSS,
                                 f"response {self._taken}: length {length} beyond its slot")
        response = self._response_type.FromString(
            bytes(self._buf[at + _LENGTH_BYTES:at + _LENGTH_BYTES + length]))
        self._taken += 1
        self._responses_taken.value = self._taken
        return response

    def close(self):
        """Closes the ring (the server ends its call once every request is answered), then
        unregisters and unlinks its shared memory."""
        with self._lock:
            if self._released:
                return
            try:
                self._settle()  # the last request's answer (or its failure, to its ticket)
            except AttentionError:
                pass
            self._closed = True
            self._client_closed.value = 1
            self._wake(self._server_bell)
            try:
                self._call.result()
            except grpc.RpcError:
                pass  # a ring that ended with a failed request already raised it
            finally:
                self._release()

    def _await(self, ready):
        """Spins, then sleeps on the client bell, until `ready()`; raises once the ring ended
        without it. Counts the time in waited_s."""
        if ready():
            return
        start = time.monotonic()
        spin_until = start + _SPIN_S
        try:
            while not ready():
                if self._server_closed.value or self._call.done():
                    if ready():
                        return
                    self._raise_end()
                if time.monotonic() > spin_until:
                    self._client_waiting.value = 1
                    if not ready():
                        self._sleep()
                    self._client_waiting.value = 0
        finally:
            self.waited_s += time.monotonic() - start

    def _raise_end(self):
        self._closed = True
        try:
            self._call.result()
            raise AttentionError(grpc.StatusCode.DATA_LOSS, "the ring ended without an answer")
        except grpc.RpcError as e:
            raise AttentionError(e.code(), e.details()) from None

    def _sleep(self):
        seen = self._client_bell.value
        timeout = _Timespec(0, _SLEEP_NS)
        _libc.syscall(_SYS_FUTEX, ctypes.byref(self._client_bell), _FUTEX_WAIT, seen,
                      ctypes.byref(timeout), None, 0)

    def _on_end(self, _):
        """The call ended (on one of gRPC's threads): wakes a request asleep on the bell."""
        with self._mapping_lock:
            if not self._released:
                self._wake(self._client_bell)

    @staticmethod
    def _wake(bell):
        bell.value = (bell.value + 1) & 0xFFFFFFFF
        _libc.syscall(_SYS_FUTEX, ctypes.byref(bell), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def _release(self):
        if self._call is not None and not self._call.done():
            self._call.cancel()
        if self._region is not None:
            try:
                self._region.unregister()
            except AttentionError:
                pass
            self._region = None
        with self._mapping_lock:
            self._released = True  # _on_end touches the bell no more
        # The ctypes words and the memoryview hold the mapping: they go before it closes.
        for name in ("_requests_posted", "_requests_taken", "_responses_posted",
                     "_responses_taken", "_client_closed", "_server_open", "_server_closed",
                     "_server_bell", "_client_bell", "_client_waiting", "_buf"):
            self.__dict__.pop(name, None)
        try:
            self._shm.close()
        except BufferError:
            pass  # a view of it is still held (an error's traceback): closed when that goes
        self._shm.unlink()


class RingTicket:
    """A request posted on a RequestRing (RequestRing.submit): response() returns its response,
    reading it first if no later request has."""

    def __init__(self, ring, on_error=None, recover=None):
        self._ring = ring
        self._on_error = on_error
        self._recover = recover
        self._response = None
        self._error = None

    def done(self):
        """True once the response (or the failure) has been read."""
        return self._response is not None or self._error is not None

    def response(self):
        """The response; raises the request's failure (AttentionError)."""
        if not self.done():
            with self._ring._lock:
                if self._ring._in_flight is self:
                    try:
                        self._ring._settle()
                    except AttentionError:
                        pass  # in self._error
        if self._error is not None:
            raise self._error
        return self._response

    def _fail(self, error):
        if self._recover is not None and isinstance(error, AttentionError):
            recover, self._recover = self._recover, None
            try:
                self._response = recover(error)
                return
            except AttentionError as e:
                error = e
        self._error = error
        if self._on_error is not None:
            on_error, self._on_error = self._on_error, None
            on_error()
