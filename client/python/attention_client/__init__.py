"""Python client of the attention.v1 service.

    import numpy as np, attention_client
    client = attention_client.Client("localhost:50051")
    o = client.attend(q, k, v, causal=True)                 # q: [B, Hq, Nq, D] numpy or torch
    o, lse = client.attend(q, k, v, return_lse=True)        # lse: float32 [B, Hq, Nq]
    o = attention_client.attend(q, k, v, target="localhost:50051")   # one-off call
    r = client.attend(q, k, v, return_info=True)            # r.o, r.lse, r.timing, r.device
    client.health()                                         # "SERVING"
    with client.session(k=k0, v=v0) as s:                   # KV-resident: k0, v0 [Hkv, N, D]
        o = s.step(q1, k=k1, v=v1, causal=True)             # q1 [Hq, 1, D]; k1, v1 [Hkv, 1, D]
        o = s.step(q1, causal=True, stream=True)            # over one long-lived StepStream
    region = client.register_shared_memory("r", shm)        # multiprocessing.shared_memory
    client.attend(region.array(...), ..., out=region.array(...))   # tensors by reference

float32 and float16 arrays travel as they are; bfloat16 as ml_dtypes.bfloat16 arrays or torch
bfloat16 tensors, or, without either, as uint16 arrays of bfloat16 bits with bfloat16_bits=True
(see float32_to_bfloat16_bits / bfloat16_bits_to_float32). float8 e4m3 inputs (o in bfloat16,
with q_descale / k_descale / v_descale) as torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, or uint8
bits with float8_bits=True (float32_to_float8_e4m3_bits / float8_e4m3_bits_to_float32). torch is
imported only when a torch tensor is handed in.

attention_client.torch (torch SDPA and flash_attn drop-ins), attention_client.transformers
(transformers models with their KV cache on the server) and attention_client.aio (an asyncio
client) are imported on first use, so `import attention_client` stays free of torch.
"""
import importlib
from attention_client.client import (SEALED_MARKER, AttendResult, AttentionError, Client,
                                     ServerTiming, StepBatchResult, StepResult, attend,
                                     bfloat16_bits_to_float32, float8_e4m3_bits_to_float32,
                                     float32_to_bfloat16_bits, float32_to_float8_e4m3_bits,
                                     is_sealed)
from attention_client.session import Session, StepStream
from attention_client.shared_memory import Region

__all__ = ["AttendResult", "AttentionError", "Client", "ServerTiming", "StepBatchResult",
           "StepResult", "attend", "bfloat16_bits_to_float32", "float32_to_bfloat16_bits", "float8_e4m3_bits_to_float32",
           "float32_to_float8_e4m3_bits", "Region", "Session", "StepStream", "SEALED_MARKER",
           "is_sealed"]

_SUBMODULES = ("aio", "torch", "transformers")


def __getattr__(name):
    """attention_client.torch / .transformers / .aio, imported when first named (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"attention_client.{name}")
    raise AttributeError(f"module 'attention_client' has no attribute {name!r}")
