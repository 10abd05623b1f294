"""Tensors in shared memory (attention.v1.SharedMemory), for clients on the server's host: their
bytes never cross the socket. The server must run with --allow_shared_memory.

    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=64 << 20)
    region = client.register_shared_memory("inputs", shm)     # the server maps it once
    q = region.array((1, 8, 128, 64), np.float16)             # numpy views into the region
    k = region.array((1, 8, 128, 64), np.float16, offset=q.nbytes)
    ...fill q, k, v in place...
    out = region.array(q.shape, q.dtype, offset=...)
    client.attend(q, k, v, out=out)                           # inputs by reference, O written into out
    region.unregister()

Any C-contiguous numpy array whose bytes lie inside a region this Client registered travels by
reference (offset and size), not by value. A CUDA region (register_cuda_tensor) is registered
from a torch CUDA tensor's IPC handle; contiguous torch CUDA tensors inside it (views of it, or
tensors sharing its storage) then go by reference as q, k, v and out of attend, and the server
(cuda backend, same GPU) computes on them in place:

    buf = torch.empty(4 * n, dtype=torch.bfloat16, device="cuda")
    region = client.register_cuda_tensor("gpu", buf)
    q, k, v, out = (buf[i * n:(i + 1) * n].view(shape) for i in range(4))
    client.attend(q, k, v, out=out)

A region belongs to this client's credentials (its bearer token, or without one its connection).
"""
import numpy as np

from attention_client._stubs import attention_pb2 as pb


class Region:
    """A region registered with the server: name, size (bytes), kind ("system" or "cuda"), and
    for system regions the mapping in this process (array() gives views into it)."""

    def __init__(self, client, info, buffer, metadata, cuda_base=None):
        self._client = client
        self.name = info.name
        self.size = info.byte_size
        self.kind = info.kind
        self.pinned = info.pinned
        self._metadata = metadata
        self._buffer = buffer  # uint8 numpy view of the region's bytes (system); None for cuda
        self._base = buffer.__array_interface__["data"][0] if buffer is not None else None
        self._cuda_base = cuda_base  # CUDA regions: the device address of the region's first byte

    def __repr__(self):
        return f"Region({self.name!r}, {self.kind}, {self.size} bytes)"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unregister()

    def array(self, shape, dtype, offset=0):
        """A numpy array of `shape` and `dtype` over bytes [offset, offset + nbytes) of the
        region; writes go straight to the shared memory."""
        if self._buffer is None:
            raise ValueError(f"region {self.name} is CUDA memory: it has no host view")
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside region "
                             f"{self.name} of {self.size} bytes")
        return self._buffer[offset:offset + nbytes].view(dtype).reshape(shape)

    def ref(self, offset, nbytes):
        return pb.TensorRef(region=self.name, offset=offset, byte_size=nbytes)

    def _locate(self, a):
        """The offset of `a`'s bytes in this region (a numpy array or a torch CPU tensor over a
        system region, a torch CUDA tensor in a CUDA one), or None when they are not inside it."""
        if isinstance(a, np.ndarray):
            if self._base is None or not a.flags.c_contiguous:
                return None
            start, nbytes = a.__array_interface__["data"][0] - self._base, a.nbytes
        elif _is_torch(a) and a.is_contiguous():
            base = self._cuda_base if a.is_cuda else self._base
            if base is None:
                return None
            start, nbytes = a.data_ptr() - base, a.numel() * a.element_size()
        else:
            return None
        if 0 <= start and start + nbytes <= self.size:
            return start
        return None

    def unregister(self, *, timeout=None):
        """Removes the region from the server (waiting, up to the timeout, while a request uses
        it). Arrays from array() stay valid in this process (the mapping is the caller's) and no
        longer travel by reference; the shared memory can be closed once they are gone."""
        if self in self._client._regions:
            self._client._regions.remove(self)
        self._buffer = self._base = self._cuda_base = None
        self._client._call(self._client._shm_stub.Unregister,
                           pb.UnregisterRegionRequest(name=self.name), timeout, self._metadata)


def register_system(client, name, shm, *, offset=0, size=None, timeout=None, metadata=None):
    """Registers bytes [offset, offset + size) of `shm` (a multiprocessing.shared_memory
    .SharedMemory, or a POSIX shm name such as "/my-object" with `buffer` given through shm=(name,
    buffer)) as `name`. Returns a Region."""
    if isinstance(shm, tuple):
        key, buf = shm
    else:
        key, buf = "/" + shm.name.lstrip("/"), shm.buf
    total = memoryview(buf).nbytes
    size = total - offset if size is None else size
    if offset < 0 or size <= 0 or offset + size > total:
        raise ValueError(f"bytes [{offset}, {offset + size}) are outside the object of "
                         f"{total} bytes")
    request = pb.RegisterRegionRequest(name=name, system_key=key, offset=offset, byte_size=size)
    info = client._call(client._shm_stub.Register, request, timeout, metadata)
    # The view only once registered: a refusal's traceback holding one would keep the caller
    # from closing the object.
    region = Region(client, info, np.frombuffer(buf, dtype=np.uint8)[offset:offset + size],
                    metadata)
    client._regions.append(region)
    return region


def register_cuda_tensor(client, name, tensor, *, timeout=None, metadata=None):
    """Registers the device memory of a torch CUDA tensor by its CUDA IPC handle (the storage's
    allocation, from the tensor's first byte to the storage's end). Returns a Region."""
    storage = tensor.untyped_storage()
    # (device, handle, size_bytes, offset_bytes, ...): the handle names the caching allocator's
    # whole block; the storage starts offset_bytes into it.
    shared = storage._share_cuda_()
    device, handle, size_bytes, offset_bytes = shared[0], shared[1], shared[2], shared[3]
    start = offset_bytes + tensor.storage_offset() * tensor.element_size()
    return register_cuda_memory(client, name, bytes(handle), device, start,
                                size_bytes - tensor.storage_offset() * tensor.element_size(),
                                tensor.data_ptr(), timeout=timeout, metadata=metadata)


def register_cuda_memory(client, name, ipc_handle, device, offset, size, cuda_base, *,
                         timeout=None, metadata=None):
    """Registers `size` bytes at `offset` into the allocation a CUDA IPC handle names, on GPU
    `device`, as a CUDA region; `cuda_base` is the device address of the region's first byte (what
    Region.ref locates tensors against). Returns a Region."""
    request = pb.RegisterRegionRequest(name=name, cuda_ipc_handle=ipc_handle, device=device,
                                       offset=offset, byte_size=size)
    info = client._call(client._shm_stub.Register, request, timeout, metadata)
    region = Region(client, info, None, metadata, cuda_base=cuda_base)
    client._regions.append(region)
    return region


def list_regions(client, *, timeout=None, metadata=None):
    return client._call(client._shm_stub.List, pb.ListRegionsRequest(), timeout, metadata).regions


def _is_torch(a):
    return type(a).__module__.startswith("torch")


def _is_torch_cuda(a):
    return _is_torch(a) and getattr(a, "is_cuda", False)


def _wire_dtype_of(a):
    name = str(a.dtype).replace("torch.", "") if _is_torch(a) else a.dtype.name
    dtype = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16,
             "bfloat16": pb.DTYPE_BFLOAT16}.get(name)
    if dtype is None:
        raise TypeError(f"dtype {a.dtype} is not float32, float16 or bfloat16")
    return dtype


def as_ref(client, a):
    """pb.Tensor referring to `a` (a numpy array or torch tensor over a system region, or a torch
    CUDA tensor in a CUDA region) when its bytes lie in one of the client's regions, else None.
    bfloat16 as ml_dtypes.bfloat16 or torch.bfloat16."""
    found = _region_of(client, a)
    if found is None:
        return None
    region, offset = found
    nbytes = a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()
    return pb.Tensor(dtype=_wire_dtype_of(a), shape=list(a.shape), ref=region.ref(offset, nbytes))


def _region_of(client, a):
    """(region, offset) of the client's region holding `a`'s bytes, or None."""
    for region in client._regions:
        offset = region._locate(a)
        if offset is not None:
            return region, offset
    return None


def out_ref(client, out, name):
    """The TensorRef of output array `out`, which must lie in one of the client's regions."""
    t = as_ref(client, out) if out is not None else None
    if t is None:
        raise ValueError(f"{name}: expected a C-contiguous array inside a region this Client "
                         "registered (Region.array, or a CUDA tensor in a CUDA region)")
    return t.ref


def counter_ref(client, counter, name):
    """The TensorRef of a stream counter (StepRequest.ready_counter, done_counter): `counter`, a
    torch CUDA tensor of one 8-byte element, must lie in one of the client's CUDA regions."""
    if not (_is_torch(counter) and counter.is_cuda and counter.numel() == 1
            and counter.element_size() == 8):
        raise ValueError(f"{name}: expected a torch CUDA tensor of one 8-byte element (int64), "
                         f"got {getattr(counter, 'dtype', type(counter))} of "
                         f"{getattr(counter, 'shape', '?')}")
    found = _region_of(client, counter)
    if found is None:
        raise ValueError(f"{name}: expected a tensor inside a CUDA region this Client registered")
    region, offset = found
    return region.ref(offset, 8)
