"""Python client of the attention.v1 service.

    import numpy as np, attention_client
    client = attention_client.Client("localhost:50051")
    o = client.attend(q, k, v, causal=True)                 # q: [B, Hq, Nq, D] numpy or torch
    o, lse = client.attend(q, k, v, return_lse=True)        # lse: float32 [B, Hq, Nq]
    o = attention_client.attend(q, k, v, target="localhost:50051")   # one-off call

float32 and float16 arrays travel as they are; bfloat16 as ml_dtypes.bfloat16 arrays or torch
bfloat16 tensors, or, without either, as uint16 arrays of bfloat16 bits with bfloat16_bits=True
(see float32_to_bfloat16_bits / bfloat16_bits_to_float32).
"""
from attention_client.client import (AttentionError, Client, attend, bfloat16_bits_to_float32,
                                     float32_to_bfloat16_bits)

__all__ = ["AttentionError", "Client", "attend", "bfloat16_bits_to_float32",
           "float32_to_bfloat16_bits"]
