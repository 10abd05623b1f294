"""An asyncio client (grpc.aio) beside the blocking attention_client.Client.

    async with attention_client.aio.AsyncClient("localhost:50051") as client:
        o = await client.attend(q, k, v, causal=True)          # the arguments of Client.attend
        outs = await asyncio.gather(*(client.attend(*x) for x in batches))   # calls in flight at once

Inputs and outputs as Client.attend's (numpy arrays or torch tensors). Failed calls raise
attention_client.AttentionError with the gRPC status code.
"""
import grpc

from attention_client._stubs import attention_pb2 as pb
from attention_client._stubs import attention_pb2_grpc as pb_grpc
from attention_client.client import AttentionError, _attend_output, _attend_request


class AsyncClient:
    """One grpc.aio channel to a server; make it inside the event loop that uses it.

    target: "host:port". timeout: default deadline per call, seconds. metadata: sent on every
    call that names none. credentials: grpc channel credentials for TLS (None: plaintext).
    """

    def __init__(self, target="localhost:50051", *, timeout=60.0, max_message_bytes=1 << 30,
                 credentials=None, options=(), metadata=None):
        self.timeout = timeout
        self.metadata = metadata
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes)] + list(options)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=opts)
        self._stub = pb_grpc.AttentionStub(self._channel)

    async def _call(self, method, request, timeout, metadata):
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout,
                                metadata=self.metadata if metadata is None else metadata)
        except grpc.aio.AioRpcError as e:
            raise AttentionError(e.code(), e.details()) from None

    async def close(self):
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def attend(self, q, k, v, *, causal=False, softmax_scale=None, window_left=None,
                     window_right=None, layout="bhsd", return_lse=False, cu_seqlens_q=None,
                     cu_seqlens_k=None, bfloat16_bits=False, timeout=None, request_id="",
                     metadata=None, return_info=False, mask_alignment="bottom_right",
                     float8_bits=False, q_descale=None, k_descale=None, v_descale=None):
        """Client.attend, awaited: o, (o, lse) with return_lse, or an AttendResult."""
        request, kind = _attend_request(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_left=window_left,
            window_right=window_right, layout=layout, return_lse=return_lse,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, bfloat16_bits=bfloat16_bits,
            request_id=request_id, mask_alignment=mask_alignment, float8_bits=float8_bits,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        response = await self._call(self._stub.Attend, request, timeout, metadata)
        return _attend_output(response, kind, return_lse, return_info)

    async def server_info(self, timeout=None):
        """The server's attention.v1.ServerInfo message."""
        return await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout,
                                None)
