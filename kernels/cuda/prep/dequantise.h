// float8 e4m3 inputs made ready for the forward kernels on the device. The wgmma kernel reads Q and
// K as they come and V transposed (LaunchTransposeE4m3V: wgmma takes 8-bit operands K-major only,
// and in P V the keys are K). Elsewhere, e4m3 -> bfloat16 (LaunchDequantiseE4m3ToBf16): how the
// CUDA backend serves float8 inputs on kernels that take bfloat16 (the mma.sync forward). Every
// e4m3 value is exact in bfloat16 (kernels/float8.h), so the conversion loses nothing; the descale
// factors are not applied here but folded into the forward kernel's logit scale and output
// normalisation (KernelParams::scale_log2, o_scale), where they cost float32 rounding only. Scaling
// V here instead would round each v * v_descale to bfloat16's 8 significant bits unless v_descale
// is a power of two: a third bfloat16 rounding beside P's and o's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attention::cuda {

// dst[0, n) = bfloat16(e4m3 src[0, n)), exactly (NaN stays NaN), on `stream`. src and dst are
// device memory of the current device, any alignment; returns cudaGetLastError() of the launch.
cudaError_t LaunchDequantiseE4m3ToBf16(const void* src, void* dst, int64_t n, cudaStream_t stream);

// Keys per row of V^T: the key count rounded up to 16, so that V^T's rows are 16-byte multiples
// (TMA's rule for strides).
inline int64_t TransposedVKeys(int64_t keys) { return (keys + 15) / 16 * 16; }
// Bytes of V^T for `items` x `heads` of `keys` rows at head_dim: the wgmma kernel's float8
// workspace (ForwardPlan::workspace_bytes).
inline int64_t TransposedVBytes(int64_t items, int64_t heads, int64_t head_dim, int64_t keys) {
  return items * heads * head_dim * TransposedVKeys(keys);
}

// dst [items, heads, head_dim, TransposedVKeys(keys)] (contiguous, 16-byte aligned) = V [items,
// heads, keys, head_dim] at element strides item_stride, head_stride, row_stride, transposed
// (v, its strides and head_dim multiples of 16, as the wgmma kernel's plan requires),
// with each group of 16 keys in the order the wgmma kernel's P fragments take them: position q of
// a group holds key 2 (q / 4) + q % 2 + 8 ((q / 2) % 2) (flash_forward_sm90_kernel.cuh, to_p).
// Keys past `keys` are zero. One byte read and one written per element.
cudaError_t LaunchTransposeE4m3V(const void* v, int64_t item_stride, int64_t head_stride,
                                 int64_t row_stride, int items, int heads, int keys, int head_dim,
                                 void* dst, cudaStream_t stream);

}  // namespace attention::cuda
