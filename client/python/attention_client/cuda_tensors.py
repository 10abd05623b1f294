"""torch CUDA tensors without a host round trip, for a server on the same host and GPU.

Client.attend (and so every attention_client.torch function that calls it) given torch CUDA
tensors registers the CUDA memory they live in as CUDA regions (attention.v1.SharedMemory, by
CUDA IPC handle), sends q, k and v by reference, and has the server write o (and lse) into a
tensor it allocates on the same device: no byte crosses the socket or the PCIe bus, and the server
computes on the tensors where they are (the cuda backend, --allow_shared_memory).

    client = attention_client.Client("localhost:50051")          # cuda_regions="auto"
    o = client.attend(q, k, v, causal=True)                     # q, k, v on cuda: by reference

What is registered: the caching allocator's segment (one cudaMalloc) holding each tensor, found
with the CUDA driver (cuMemGetAddressRange, cuPointerGetAttribute, cuIpcGetMemHandle through ctypes
on libcuda.so.1; torch's own storage._share_cuda_() would tie every shared block to a reference
count that only a torch consumer returns, so torch would never free those blocks). Segments are
registered once and cached per Client, keyed by device and the driver's buffer id (unique to an
allocation for the process's life), so repeated calls with the allocator's reused blocks register
nothing, and an address seen before in a segment torch cannot free (below) needs no driver query:
- at most `capacity` segments (default 32, within the server's 64 regions per caller) stay
  registered; the least recently used one is unregistered for a new one;
- every segment is unregistered by Client.close().
CUDA leaves undefined what happens when the exporting process frees memory another process still
has open, and torch frees cached segments (torch.cuda.empty_cache, an allocation that failed and
releases the cache). So while a segment is registered the cache holds the storage of the tensor
that brought it (one block of it): torch never frees a segment with a block in use, and the
reference goes only after the server has closed the handle (Unregister answered). That block's
memory stays allocated meanwhile (bounded by `capacity` blocks). A segment that is freed anyway
(memory from outside torch's allocator) and whose addresses a new allocation reuses is recognised
by the overlap (live allocations never overlap) and unregistered before the new one is
registered.

Synchronisation: before each Attend the tensors' device's current stream is synchronised, so the
server reads what the queued kernels wrote; the server has written o and lse before it answers.
Tensors made on another stream must be synchronised by the caller, as for any CUDA consumer.
Client.step_batch of torch CUDA tensors runs in stream order instead (step_batch_on_device): an
interprocess event recorded on the current stream, which the server's stream waits for, and one
the server records after its kernels, which the current stream waits for; the call returns once
the server has queued the step, and nothing synchronises with the GPU, so a model's layers queue
as they would with a local attention kernel. With wait=False on the request ring the order is kept
by two counters in a CUDA region instead (StepRequest.ready_counter, done_counter; the driver's
cuStreamWriteValue64 and cuStreamWaitValue64): the current stream's wait for the done value is
queued before the server has taken the Step, so the call returns once the Step is posted, and the
model queues its next kernels while the server works.

Fallback (Client(cuda_regions=...)): "auto" (default) tries the first call on a device this way;
when registration is refused (a server without --allow_shared_memory: FAILED_PRECONDITION; the cpu
backend: UNIMPLEMENTED; a server on another host or one that cannot open the handle:
INVALID_ARGUMENT) or the driver cannot export the memory (no libcuda, memory from
expandable_segments), the Client remembers it and sends every later call through the host (the
tensors copied to the host, the result copied back), as it would without this module. A call the
server refuses with FAILED_PRECONDITION or UNIMPLEMENTED (e.g. a device it does not serve) goes
through the host too, that call only; one refused NOT_FOUND (the server restarted, the
client's connection changed, or a segment sat unused past the server's --region_idle_timeout_s:
regions belong to the connection without a bearer token) registers its segments again and is sent
once more. "on": never fall back (errors raise AttentionError or
CudaRegionsUnavailable); "off": always the host path. Device ordinals must name the same GPUs in
the client and the server (the same CUDA_VISIBLE_DEVICES). A Client over several addresses does
not try ("auto" is "off" there): its regions would be on one server, its calls spread over all.
"""
import ctypes
import itertools
import os
import threading
from collections import OrderedDict

import grpc

from attention_client import _wire
from attention_client._stubs import attention_pb2 as pb
from attention_client.client import AttentionError

MODES = ("auto", "on", "off")
# Registration refusals that say this server cannot take this client's CUDA memory at all.
_SERVER_CANNOT = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
                  grpc.StatusCode.INVALID_ARGUMENT)
# Call refusals that the host path answers instead (that call only).
_CALL_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class CudaRegionsUnavailable(Exception):
    """This client's CUDA memory cannot be shared with the server (the reason in the message)."""


class CudaDriver:
    """The few CUDA driver calls the registration needs, through ctypes on libcuda.so.1 (the
    driver, present wherever a GPU is), in the device's primary context (the one torch uses)."""

    _HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
    _BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID

    def __init__(self):
        try:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaRegionsUnavailable(
                f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
        self._contexts = {}
        self._lock = threading.Lock()
        self._check(self._cuda.cuInit(0), "cuInit")

    def _check(self, result, what):
        if result != 0:
            name = ctypes.c_char_p()
            self._cuda.cuGetErrorName(result, ctypes.byref(name))
            raise CudaRegionsUnavailable(
                f"{what} failed: {name.value.decode() if name.value else result}")

    def _context(self, device):
        with self._lock:
            if device not in self._contexts:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                self._check(self._cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
                # Retained for the process's life: torch keeps the same primary context.
                self._check(self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                            "cuDevicePrimaryCtxRetain")
                self._contexts[device] = ctx
            return self._contexts[device]

    def _in_context(self, device, fn):
        self._check(self._cuda.cuCtxPushCurrent_v2(self._context(device)), "cuCtxPushCurrent")
        try:
            return fn()
        finally:
            self._cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def segment(self, ptr, device):
        """(base, size, buffer id) of the allocation holding device address `ptr`; the buffer id
        is unique to the allocation for the process's life (CU_POINTER_ATTRIBUTE_BUFFER_ID)."""
        def query():
            base, size, buffer_id = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
            self._check(self._cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                           ctypes.c_uint64(ptr)),
                        "cuMemGetAddressRange")
            self._check(self._cuda.cuPointerGetAttribute(ctypes.byref(buffer_id),
                                                         self._BUFFER_ID, ctypes.c_uint64(ptr)),
                        "cuPointerGetAttribute(BUFFER_ID)")
            return base.value, size.value, buffer_id.value
        return self._in_context(device, query)

    def ipc_handle(self, base, device):
        """The 64 bytes of the CUDA IPC handle of the allocation starting at `base`."""
        def query():
            handle = ctypes.create_string_buffer(self._HANDLE_BYTES)
            self._check(self._cuda.cuIpcGetMemHandle(handle, ctypes.c_uint64(base)),
                        "cuIpcGetMemHandle")
            return handle.raw
        return self._in_context(device, query)


    def write_value(self, device, stream, address, value):
        """Queues on `stream` (a CUstream handle of `device`) the write of uint64 `value` at
        device `address` (cuStreamWriteValue64)."""
        self._in_context(device, lambda: self._check(
            self._cuda.cuStreamWriteValue64_v2(ctypes.c_void_p(stream), ctypes.c_uint64(address),
                                               ctypes.c_uint64(value), 0),
            "cuStreamWriteValue64"))

    def wait_value(self, device, stream, address, value):
        """Queues on `stream` a wait until the uint64 at `address` reaches `value` (as int64
        differences, cuStreamWaitValue64 GEQ)."""
        self._in_context(device, lambda: self._check(
            self._cuda.cuStreamWaitValue64_v2(ctypes.c_void_p(stream), ctypes.c_uint64(address),
                                              ctypes.c_uint64(value), 0),
            "cuStreamWaitValue64"))


class _Segment:
    __slots__ = ("device", "base", "size", "buffer_id", "region", "keep")

    def __init__(self, device, base, size, buffer_id, region, keep):
        self.device, self.base, self.size, self.buffer_id = device, base, size, buffer_id
        self.region = region
        self.keep = keep  # a storage in the segment: torch cannot free it while registered


class SegmentRegions:
    """The CUDA regions of one Client: the allocator segments its tensors were in, registered
    once each (see the module comment). Thread-safe. `driver` finds a tensor's segment (a
    CudaDriver by default, made on first use)."""

    def __init__(self, client, mode="auto", capacity=32, driver=None):
        if mode not in MODES:
            raise ValueError(f"cuda_regions must be one of {MODES}, got {mode!r}")
        self._client = client
        self.mode = mode
        self.capacity = capacity
        self._driver = driver
        self._segments = OrderedDict()  # (device, buffer id) -> _Segment, least recently used first
        # (device, address) -> the key of the registered segment holding it, for segments whose
        # keep storage stops torch from freeing them: such an address stays in that allocation
        # while it is registered, so a repeated address needs no driver query (a decode loop's
        # tensors come back to the same few addresses every layer).
        self._by_address = {}
        self._lock = threading.Lock()
        self.registrations = 0  # Register calls made, for tests and diagnostics
        self._names = itertools.count()
        self.unavailable = None  # the reason, once remembered (mode "auto")

    @property
    def usable(self):
        return self.mode == "on" or (self.mode == "auto" and self.unavailable is None)

    def _unregister(self, segment):
        key = (segment.device, segment.buffer_id)
        self._by_address = {a: k for a, k in self._by_address.items() if k != key}
        try:
            segment.region.unregister()
        except AttentionError:
            pass  # gone already (the connection closed, the server restarted)
        segment.keep = None  # the server has closed the handle: torch may free the segment now

    def ensure(self, tensors):
        """Registers the segments of `tensors` (torch CUDA tensors, contiguous) that are not yet;
        returns each one's _Segment (its region and base address). Raises CudaRegionsUnavailable
        (remembered in mode "auto") when the server or the driver cannot share them."""
        with self._lock:
            try:
                if self._driver is None:
                    self._driver = CudaDriver()
                keys = []
                for t in tensors:
                    keys.append(self._ensure_one(t, keys))
                return [self._segments[key] for key in keys]
            except CudaRegionsUnavailable as e:
                if self.mode == "auto":
                    self.unavailable = str(e)
                raise

    def _ensure_one(self, t, used):
        device = t.device.index if t.device.index is not None else 0
        address = (device, t.data_ptr())
        key = self._by_address.get(address)
        if key is not None and key in self._segments:
            self._segments.move_to_end(key)
            return key
        base, size, buffer_id = self._driver.segment(t.data_ptr(), device)
        key = (device, buffer_id)
        known = self._segments.get(key)
        if known is not None:
            self._segments.move_to_end(key)
            self._remember(address, known)
            return key
        # Segments torch freed: this new allocation (a buffer id not seen) overlaps their
        # addresses. Their registrations go first.
        for k, s in list(self._segments.items()):
            if s.device == device and s.base < base + size and base < s.base + s.size:
                del self._segments[k]
                self._unregister(s)
        while len(self._segments) >= self.capacity:
            victim = next((k for k in self._segments if k not in used), None)
            if victim is None:
                break  # every one is in use by this call: over capacity for one call
            self._unregister(self._segments.pop(victim))
        from attention_client.shared_memory import register_cuda_memory
        name = f"torch-{os.getpid()}-cuda{device}-{base:x}-{next(self._names)}"
        try:
            region = register_cuda_memory(self._client, name,
                                          self._driver.ipc_handle(base, device), device, 0, size,
                                          base)
        except AttentionError as e:
            if e.code in _SERVER_CANNOT:
                raise CudaRegionsUnavailable(f"the server refused the CUDA region: {e}") from None
            raise
        self.registrations += 1
        keep = t.untyped_storage() if hasattr(t, "untyped_storage") else None
        self._segments[key] = _Segment(device, base, size, buffer_id, region, keep)
        self._remember(address, self._segments[key])
        return key

    _MAX_ADDRESSES = 4096

    def _remember(self, address, segment):
        """Notes that `address` lies in `segment`, when torch cannot free that segment."""
        if segment.keep is None:
            return  # memory outside torch's allocator: its addresses may change hands
        if len(self._by_address) >= self._MAX_ADDRESSES:
            self._by_address.clear()
        self._by_address[address] = (segment.device, segment.buffer_id)

    def close(self):
        """Unregisters every segment (Client.close calls it)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), OrderedDict()
            self._by_address = {}
        for s in segments:
            self._unregister(s)


def _step_events(client, device):
    """This thread's two interprocess events on `device` for Steps in stream order, and their IPC
    handles: (ready, done, ready handle, done handle). Per thread: a Step's events must not be
    recorded by another Step meanwhile."""
    import torch
    key = (threading.get_ident(), device)
    events = client._step_events.get(key)
    if events is None:
        with torch.cuda.device(device):
            ready, done = (torch.cuda.Event(interprocess=True) for _ in range(2))
            # A handle needs a recorded event.
            for e in (ready, done):
                e.record()
            events = (ready, done, ready.ipc_handle(), done.ipc_handle())
        client._step_events[key] = events
    return events


class _StepCounters:
    """A device's two counters for Steps in stream order by counters (ready, done: one int64
    tensor of 2 on the device, in a CUDA region), the last value used, and a stream of its own
    from which a failed Step's done value is written."""

    def __init__(self, device):
        import torch
        self.tensor = torch.zeros(2, dtype=torch.int64, device=device)
        # Zero before any stream waits on them: the server's stream does not wait for this one.
        torch.cuda.current_stream(device).synchronize()
        self.ready, self.done = self.tensor[0:1], self.tensor[1:2]
        self.value = 0
        self.rescue = torch.cuda.Stream(device=device)  # non-blocking, as torch makes its streams


def _step_counters(client, device):
    """This thread's counters on `device` (per thread: another thread's Steps would write the
    done counter past this one's value before this one's Step ran)."""
    key = (threading.get_ident(), device)
    counters = client._step_counters.get(key)
    if counters is None:
        counters = client._step_counters[key] = _StepCounters(device)
    return counters


def _shaped_request(client, sessions, q, k, v, options):
    """The packed StepRequest naming `sessions` with `options` (step_batch's, those it carries)
    and q, k, v's dtype and shape (k and v may be None); their refs are the caller's to set."""
    from attention_client.session import _packed_request
    from attention_client.shared_memory import _wire_dtype_of
    request = _packed_request(client, sessions, **options)
    dtype = _wire_dtype_of(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None:
            tensor = getattr(request, name)
            tensor.dtype = dtype
            tensor.shape.extend(t.shape)
    return request


# A decode loop's plans kept per batch of sessions (shapes, options, threads' counters).
_PLANS_KEPT = 16


def _counter_plan(client, sessions, batch, q, k, v, lse, counter_segment, counters, options):
    """The _CounterPlan of a Step on `batch` (session._Batch) with these tensors' shapes, the
    calling thread's `counters` and `options`; kept on the batch (a model makes this call once
    per layer per token with the same ones). Options with sinks are planned each call (their
    values are not compared)."""
    names = [n for n in _REQUEST_OPTIONS if n != "layer" and options.get(n) is not None]
    key = None
    if options.get("sinks") is None:
        key = (tuple((n, options[n]) for n in names), q.shape, q.dtype,
               None if k is None else (k.shape, None if v is None else v.shape),
               lse is not None, id(counters), counter_segment.region.name)
        plan = batch.plans.get(key)
        if plan is not None:
            return plan
    plan = _CounterPlan(client, sessions, q, k, v, counter_segment,
                        counters.tensor.data_ptr() - counter_segment.base,
                        {n: options[n] for n in names})
    if key is not None:
        if len(batch.plans) >= _PLANS_KEPT:
            batch.plans.clear()
        batch.plans[key] = plan
    return plan


class _CounterPlan:
    """A packed Step in stream order by counters, as a decode loop repeats it on one batch of
    sessions: what every such call sends alike (the sessions' ids, the options, q, k, v's dtype
    and shape, the counters' refs) serialised once, in `head`; request() adds what changes: the
    layer, the tensors' refs and the counters' value. A model makes this call once per layer per
    token: no protobuf message is built for it, nothing per sequence."""

    _FIELDS = {n: pb.StepRequest.DESCRIPTOR.fields_by_name[n].number
               for n in ("layer", "q", "k", "v", "o_ref", "lse_ref", "ready_counter",
                         "done_counter")}
    _VALUE = pb.StreamCounter.DESCRIPTOR.fields_by_name["value"].number
    _TENSORS = ("q", "k", "v", "o_ref", "lse_ref")  # Tensors with their refs, then TensorRefs
    _ENCODERS = (_wire.tensor_ref_field,) * 3 + (_wire.ref_field,) * 2

    def __init__(self, client, sessions, q, k, v, counter_segment, at, options):
        request = _shaped_request(client, sessions, q, k, v, options)
        # ready at `at` in the counters' region, done 8 bytes on; their values come with each call.
        for counter, offset in ((request.ready_counter, at), (request.done_counter, at + 8)):
            counter.ref.region, counter.ref.offset, counter.ref.byte_size = (
                counter_segment.region.name, offset, 8)
        self.head = request.SerializeToString()

    def request(self, layer, tensors, segments, value):
        """The StepRequest (serialised) of a call: `layer` (None: none), q, k, v, o, lse (k, v,
        lse may be None) in their `segments`, the counters' `value`."""
        fields = self._FIELDS
        parts = [self.head]
        if layer is not None:
            parts.append(_wire.varint_field(fields["layer"], layer))
        for name, encode, t, segment in zip(self._TENSORS, self._ENCODERS, tensors, segments):
            if t is not None:
                parts.append(encode(fields[name], segment.region.name,
                                    t.data_ptr() - segment.base, t.numel() * t.element_size()))
        value = _wire.varint_field(self._VALUE, value)  # a StreamCounter's value
        parts += [_wire.message_field(fields["ready_counter"], value),
                  _wire.message_field(fields["done_counter"], value)]
        return _wire.Encoded(b"".join(parts))


def step_batch_on_device(client, sessions, q, k, v, options, batch, _retried=False):
    """Client.step_batch of torch CUDA tensors q, k, v through CUDA regions, in stream order: the
    server's stream waits on the GPU for an event this call records on the current stream, its
    kernels read q, k, v and write o (and lse) in place, and the current stream waits for its
    event before anything later runs, so neither side synchronises with the GPU. (True, result)
    or (False, None) when the host path must answer (as attend_on_device). options: step_batch's
    keyword arguments but out and lse_out; batch: the sessions' session._Batch."""
    import torch
    regions = client._cuda_segments
    if not regions.usable:
        return False, None
    inputs = [t for t in (q, k, v) if t is not None]  # v None: the sessions' v is k's
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.device == q.device
               for t in inputs):
        return False, None
    if min(t.numel() for t in inputs) == 0:
        return False, None
    q, k, v = (t.detach().contiguous() if t is not None else None for t in (q, k, v))
    # o [B, Hq, Nq, Dv]: the sessions' V head dim.
    o = torch.empty((*q.shape[:3], sessions[0].v_head_dim), dtype=q.dtype, device=q.device)
    lse = (torch.empty(tuple(q.shape[:3]), dtype=torch.float32, device=q.device)
           if options.get("return_lse") else None)
    wait = options.get("wait", True)
    device = q.device.index if q.device.index is not None else 0
    if not wait and options.get("stream") == "ring":
        return _step_by_counters(client, sessions, q, k, v, o, lse, device, options, batch)
    segments = _ensure(regions, (q, k, v, o, lse))
    if segments is None:
        return False, None
    from attention_client.session import _batch_output, _send_step
    request = _device_request(client, sessions, q, k, v, o, lse, segments, options)
    ready, done, ready_handle, done_handle = _step_events(client, device)
    request.ready_event, request.done_event = bytes(ready_handle), bytes(done_handle)
    stream = torch.cuda.current_stream(q.device)
    ready.record(stream)
    try:
        # A sealed session's refusal is retried as on the host path (_send_step; it came before
        # the server waited on `ready` or recorded `done`, and `ready`'s record stands for the
        # retry: no other Step of this thread records it meanwhile).
        answer = _send_step(client, request, options.get("stream"), options.get("timeout"),
                            options.get("metadata"))
    except AttentionError as e:
        if e.code == grpc.StatusCode.NOT_FOUND and not _retried:
            regions.close()  # the server lost the regions: register them again, once
            return step_batch_on_device(client, sessions, q, k, v, options, batch, _retried=True)
        if regions.mode == "auto" and e.code in _CALL_REFUSED:
            return False, None
        raise
    # What runs on this stream from here on sees o and lse written, and q, k, v read.
    stream.wait_event(done)
    result = _batch_output(answer, sessions, ("torch", q), options.get("return_lse"), o, lse,
                           options.get("return_info"), options.get("layer"))
    if not wait:
        import concurrent.futures
        future = concurrent.futures.Future()
        future.set_result(result)
        return True, future
    return True, result


def _device_request(client, sessions, q, k, v, o, lse, segments, options):
    """The packed StepRequest of CUDA tensors q, k, v, o, lse (k, v, lse may be None) in their
    `segments` (_ensure's, in that order), with step_batch's `options`. A model makes this call
    once per layer per token: no search of the client's regions, no per-sequence work."""
    request = _shaped_request(client, sessions, q, k, v, {
        name: options[name] for name in _REQUEST_OPTIONS if options.get(name) is not None})
    for name, t, segment in zip(("q", "k", "v"), (q, k, v), segments):
        if t is not None:
            _set_ref(getattr(request, name).ref, t, segment)
    _set_ref(request.o_ref, o, segments[3])
    if lse is not None:
        _set_ref(request.lse_ref, lse, segments[4])
    return request


def _step_by_counters(client, sessions, q, k, v, o, lse, device, options, batch):
    """step_batch_on_device with wait=False on the ring: ordered by counters, posted without
    waiting for the answer (Client.step_batch)."""
    regions = client._cuda_segments
    counters = _step_counters(client, device)
    segments = _ensure(regions, (q, k, v, o, lse, counters.tensor))
    if segments is None:
        return False, None
    from attention_client.session import PostedStep, _batch_output, _submit_step
    counters.value += 1
    value = counters.value
    request = _counter_plan(client, sessions, batch, q, k, v, lse, segments[5], counters,
                            options).request(options.get("layer"), (q, k, v, o, lse), segments,
                                             value)
    stream = _current_stream(q.device)
    driver = regions._driver
    driver.write_value(device, stream, counters.ready.data_ptr(), value)

    def release():
        # The Step failed: nothing will write o, lse or the done value, for which the stream
        # waits. o and lse become NaN first (on the same stream as the done value), so what the
        # stream computes from them before the caller reads the failure is no answer.
        import torch
        with torch.cuda.stream(counters.rescue):
            o.fill_(float("nan"))
            if lse is not None:
                lse.fill_(float("nan"))
        driver.write_value(device, counters.rescue.cuda_stream, counters.done.data_ptr(), value)

    # No host fallback here: a failure raised now may be the previous Step's, read by this post,
    # and this Step's own comes with its answer, after the caller went on. A sealed session's
    # refusal is sent again as a unary Step (_submit_step, as on the host path): it carries the
    # same counters, whose ready value is written, so the retry writes o and then done; release
    # runs only if the retry fails too.
    response = _submit_step(client, request, options.get("metadata"), release,
                            options.get("timeout"))
    layer, return_lse, return_info = (options.get(n) for n in ("layer", "return_lse",
                                                                "return_info"))
    step = PostedStep(response, lambda answer: _batch_output(
        answer, sessions, ("torch", q), return_lse, o, lse, return_info, layer), o, lse)
    # What runs on this stream from here on sees o and lse written, and q, k, v read.
    driver.wait_value(device, stream, counters.done.data_ptr(), value)
    return True, step


# step_batch's keyword arguments that a packed StepRequest carries (session._packed_request).
_REQUEST_OPTIONS = ("request_id", "layer", "causal", "softmax_scale", "window_left",
                    "window_right", "return_lse", "sinks", "softcap", "chunk_size")


def _set_ref(ref, t, segment):
    """TensorRef `ref` := contiguous CUDA tensor `t`'s bytes in `segment`'s region."""
    ref.region = segment.region.name
    ref.offset = t.data_ptr() - segment.base
    ref.byte_size = t.numel() * t.element_size()


def _current_stream(device):
    """The CUstream handle of torch's current stream on `device` (its raw getter where torch has
    one: this runs once per layer call)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream


def _lse_shape(q, layout, cu_seqlens_q):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])  # [Hq, total_q]
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return tuple(q.shape[:3])  # [B, Hq, Nq]


def _ensure(regions, tensors):
    """Registers the segments of `tensors`; returns each one's _Segment (None for None), or None
    when the call must take the host path. Refusals that say the server cannot take CUDA memory
    are remembered (ensure); others (e.g. RESOURCE_EXHAUSTED: its region limits) send this call
    through the host. Mode "on" raises instead."""
    try:
        found = iter(regions.ensure([t for t in tensors if t is not None]))
        return [None if t is None else next(found) for t in tensors]
    except (CudaRegionsUnavailable, AttentionError):
        if regions.mode == "on":
            raise
        return None


def attend_on_device(client, q, k, v, options, _retried=False):
    """Client.attend of torch CUDA tensors q, k, v through CUDA regions: (True, its result), or
    (False, None) when the host path must answer instead (see the module comment). options:
    Client.attend's keyword arguments but out and lse_out."""
    import torch
    regions = client._cuda_segments
    if not regions.usable:
        return False, None
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.device == q.device
               for t in (k, v)):
        return False, None  # mixed devices: the host path copies them as it always did
    if min(t.numel() for t in (q, k, v)) == 0:
        return False, None  # no memory to share; the server's answer for empty tensors
    if q.dtype == getattr(torch, "float8_e4m3fn", None):
        return False, None  # float8 (o in bfloat16, descales) takes the host path
    q, k, v = (t.detach().contiguous() for t in (q, k, v))
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = (torch.empty(_lse_shape(q, options.get("layout", "bhsd"), options.get("cu_seqlens_q")),
                       dtype=torch.float32, device=q.device)
           if options.get("return_lse") else None)
    if not _ensure(regions, (q, k, v, o, lse)):
        return False, None
    # The server reads q, k, v once the queued kernels that write them are done.
    torch.cuda.current_stream(q.device).synchronize()
    try:
        return True, client.attend(q, k, v, out=o, lse_out=lse, **options)
    except AttentionError as e:
        if e.code == grpc.StatusCode.NOT_FOUND and not _retried:
            # The server lost the regions (a restart) or no longer counts them as this caller's
            # (a new connection, without a bearer token): register them again, once.
            regions.close()
            return attend_on_device(client, q, k, v, options, _retried=True)
        if regions.mode == "auto" and e.code in _CALL_REFUSED:
            return False, None
        raise
