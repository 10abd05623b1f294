// The float8 e4m3 -> bfloat16 conversion of dequantise.h: one thread per 8 elements (an 8-byte
// load, a 16-byte store) where both pointers allow it, one per element otherwise. Memory-bound:
// 3 bytes moved per element.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/dequantise.h"
#include "kernels/float8.h"

namespace attention::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;  // elements per thread on the vector path
constexpr int64_t kMaxBlocks = 65535 * 16;

__device__ __nv_bfloat16 ToBf16(uint8_t x) {
  return __float2bfloat16_rn(Float8E4m3ToFloat(x));  // exact: e4m3 is a subset of bfloat16
}

__global__ void DequantiseVector(const uint2* __restrict__ src, uint4* __restrict__ dst,
                                 int64_t vectors) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vectors;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint2 in = src[i];
    const uint32_t words[2] = {in.x, in.y};
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const uint32_t lo = __bfloat16_as_ushort(ToBf16((words[w] >> (16 * pair)) & 0xffu));
        const uint32_t hi = __bfloat16_as_ushort(ToBf16((words[w] >> (16 * pair + 8)) & 0xffu));
        out[w * 2 + pair] = lo | (hi << 16);  // little-endian: the lower address in the low half
      }
    }
    dst[i] = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

__global__ void DequantiseScalar(const uint8_t* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                 int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = ToBf16(src[i]);
  }
}

int Blocks(int64_t work) {
  return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

cudaError_t LaunchDequantiseE4m3ToBf16(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<__nv_bfloat16*>(dst);
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(s) % 8 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0) {
    const int64_t vectors = n / kVector;
    if (vectors > 0) {
      DequantiseVector<<<Blocks(vectors), kThreads, 0, stream>>>(
          reinterpret_cast<const uint2*>(s), reinterpret_cast<uint4*>(d), vectors);
      done = vectors * kVector;
    }
  }
  if (done < n)
    DequantiseScalar<<<Blocks(n - done), kThreads, 0, stream>>>(s + done, d + done, n - done);
  return cudaGetLastError();
}

}  // namespace attention::cuda
