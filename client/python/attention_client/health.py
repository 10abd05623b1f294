"""grpc.health.v1.Health/Check by its method name, without the grpcio-health-checking package:
its two messages are one field each, so they are written and read here in protobuf's wire
format (https://protobuf.dev/programming-guides/encoding/)."""

_METHOD = "/grpc.health.v1.Health/Check"
# HealthCheckResponse.ServingStatus
_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def encode_request(service):
    """HealthCheckRequest{service = 1 (string)}; proto3 leaves an empty string out."""
    data = service.encode("utf-8")
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_response(data):
    """HealthCheckResponse{status = 1 (enum)} -> the status name; other fields are skipped."""
    status, pos = 0, 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"HealthCheckResponse: wire type {wire_type}")
    return _STATUS_NAMES.get(status, "UNKNOWN")


def check(client, service, timeout):
    """Client.health: one Check call on the client's channel."""
    method = client._channel.unary_unary(_METHOD, request_serializer=encode_request,
                                         response_deserializer=decode_response)
    return client._call(method, service, timeout, None)
