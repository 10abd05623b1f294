"""A request whose tensors' bytes go onto the wire straight from the caller's buffers.

Built through protobuf, a packed Step's q [B, Hq, Nq, D], k and v [B, Hkv, n, D] (at batch 64 of
an 8B Llama in bfloat16: 512 KiB, 128 KiB and 128 KiB) were copied four times before gRPC's own
copy: into a bytes object (tobytes), into a pb.Tensor, into the request (CopyFrom), and into its
serialisation. A WireMessage holds the request without those tensors (`head`) and each tensor as
its small fields and its bytes; SerializeToString writes the head as protobuf does, then each
tensor as protobuf would (its field's tag and length, the Tensor's dtype and shape, then the data
field's tag, length and bytes), so the bytes are copied once, by the join. The result parses as
the protobuf-built request: protobuf reads fields in any order, and the head holds none of the
tensor fields.
"""
import functools

from attention_client._stubs import attention_pb2 as pb

_LENGTH_DELIMITED = 2  # the wire type of bytes and message fields
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_REF = pb.Tensor.DESCRIPTOR.fields_by_name["ref"].number


def _varint(n):
    """n (>= 0) as a protobuf varint: 7 bits a byte, lowest first, the high bit on all but the
    last."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number, length):
    """The tag and length that start length-delimited field `number` of `length` bytes."""
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(length)


@functools.lru_cache(maxsize=256)
def _tensor_prefix(number, dtype, shape, size):
    """What precedes a tensor's `size` bytes of data in Tensor field `number`: the field's tag
    and length, the Tensor's dtype and shape, the data field's tag and length. Kept for the
    shapes seen last: a model sends the same ones in every layer call."""
    small = pb.Tensor(dtype=dtype, shape=shape).SerializeToString() + _key(_DATA, size)
    return _key(number, len(small) + size) + small


class WireMessage:
    """A request message (`head`, without the tensor fields set here) and tensor fields whose
    bytes stay in the caller's buffers until the first SerializeToString joins them. Sent by any
    of the client's Step callables (they serialise with the request's own SerializeToString), the
    ring included; request_id reads and sets the head's.

    The first serialisation's bytes are kept, and the buffers let go: a call sent again (a sealed
    session's retry, after the call returned) sends what the first sent, even where the caller
    has since reused its buffers, as a protobuf-built request (holding copies) did. So the head
    must not change after it."""

    def __init__(self, head):
        self.head = head
        self._pieces = []  # per tensor field: its key and small fields, then its bytes
        self._serialized = None

    def set_tensor(self, field, dtype, shape, data):
        """Sets Tensor field `field` (a name of the head's type) to dtype, shape and the bytes of
        `data` (a C-contiguous buffer: a numpy array; kept, not copied, until serialised)."""
        data = memoryview(data).cast("B")
        number = self.head.DESCRIPTOR.fields_by_name[field].number
        self._pieces += [_tensor_prefix(number, dtype, tuple(shape), len(data)), data]

    @property
    def request_id(self):
        return self.head.request_id

    @request_id.setter
    def request_id(self, value):
        self.head.request_id = value

    def ByteSize(self):  # noqa: N802 (protobuf's name, which the ring's sizing calls)
        if self._serialized is not None:
            return len(self._serialized)
        return self.head.ByteSize() + sum(len(p) for p in self._pieces)

    def buffers(self):
        """The serialisation as buffers to send one after another, the tensors' bytes where they
        lie (no join: a socket stream's sendmsg gathers them); the kept bytes once serialised. For
        a send within the call that holds the caller's buffers (nothing is kept for a resend)."""
        if self._serialized is not None:
            return [self._serialized]
        return [self.head.SerializeToString(), *self._pieces]

    def SerializeToString(self):  # noqa: N802 (protobuf's name, which gRPC and the ring call)
        if self._serialized is None:
            self._serialized = b"".join([self.head.SerializeToString(), *self._pieces])
            self._pieces = None
        return self._serialized


def serialize(message):
    """A request's bytes by its own SerializeToString: a protobuf message's, or a WireMessage's."""
    return message.SerializeToString()


class Encoded:
    """A request already serialised, sent as a message is (the ring and the Step callables call
    SerializeToString; the ring's sizing ByteSize)."""

    __slots__ = ("_data",)

    def __init__(self, data):
        self._data = data

    def ByteSize(self):  # noqa: N802 (protobuf's name)
        return len(self._data)

    def SerializeToString(self):  # noqa: N802 (protobuf's name)
        return self._data


def varint_field(number, value):
    """Varint field `number` (an int32 or int64 >= 0) with its tag."""
    return _varint(number << 3) + _varint(value)


def message_field(number, encoded):
    """Message field `number` holding the `encoded` bytes of its message."""
    return _key(number, len(encoded)) + encoded


@functools.lru_cache(maxsize=256)
def _region_field(region):
    """TensorRef.region = `region`, encoded (the regions of a decode loop are few)."""
    name = region.encode()
    return _key(pb.TensorRef.DESCRIPTOR.fields_by_name["region"].number, len(name)) + name


_OFFSET = pb.TensorRef.DESCRIPTOR.fields_by_name["offset"].number
_BYTE_SIZE = pb.TensorRef.DESCRIPTOR.fields_by_name["byte_size"].number


# A decode loop's tensors come back to the same few addresses (the caching allocator's blocks):
# their fields are kept.
@functools.lru_cache(maxsize=4096)
def ref_field(number, region, offset, byte_size):
    """TensorRef field `number`: bytes [offset, offset + byte_size) of `region`."""
    return message_field(number, _region_field(region) + varint_field(_OFFSET, offset) +
                         varint_field(_BYTE_SIZE, byte_size))


@functools.lru_cache(maxsize=4096)
def tensor_ref_field(number, region, offset, byte_size):
    """Tensor field `number` holding only its ref: its dtype and shape come in another
    occurrence of the field in the same message, which protobuf merges with this one (a message
    field that appears twice parses as the merge of both)."""
    return message_field(number, ref_field(_REF, region, offset, byte_size))
