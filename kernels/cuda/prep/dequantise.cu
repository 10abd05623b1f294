// dequantise.h's float8 preparations. The e4m3 -> bfloat16 conversion: one thread per 8 elements
// (an 8-byte load, a 16-byte store) where both pointers allow it, one per element otherwise;
// 3 bytes moved per element. The transposition of V: 2 bytes per element. Both memory-bound.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/prep/dequantise.h"
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

// LaunchTransposeE4m3V: a block per (64 keys, head, item) and 128 head dims at a time, staged in
// shared memory [64 keys][128 bytes + 4] by 16-byte loads along D (a warp reads 4 rows of 128
// bytes). Then each lane writes one 16-key group of a row of V^T (16 bytes), its 4 lanes the
// row's 4 groups, so that a warp's store covers 8 rows x 64 contiguous bytes (whole 32-byte
// sectors); it reads its 16 bytes down a column of the tile (the row padding leaves a 2-way bank
// conflict between the groups 32 rows apart).
constexpr int kTransposeKeys = 64;
constexpr int kTransposeCols = 128;
constexpr int kTransposePitch = kTransposeCols + 4;
constexpr int kTransposeThreads = 256;

__device__ __forceinline__ int KeyOfPosition(int q) {
  return 2 * (q / 4) + q % 2 + 8 * ((q / 2) % 2);
}

__global__ void __launch_bounds__(kTransposeThreads)
    TransposeE4m3V(const uint8_t* __restrict__ v, int64_t item_stride, int64_t head_stride,
                   int64_t row_stride, int keys, int head_dim, int64_t keys16,
                   uint8_t* __restrict__ dst) {
  __shared__ __align__(16) uint8_t tile[kTransposeKeys][kTransposePitch];
  const int key0 = blockIdx.x * kTransposeKeys;
  const int head = blockIdx.y, item = blockIdx.z;
  const uint8_t* src = v + item * item_stride + head * head_stride;
  uint8_t* out = dst + (static_cast<int64_t>(item) * gridDim.y + head) * head_dim * keys16;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane % 4;  // this lane's key group
  for (int d0 = 0; d0 < head_dim; d0 += kTransposeCols) {
    if (d0 > 0) __syncthreads();  // the previous columns' reads are done
    for (int i = threadIdx.x; i < kTransposeKeys * kTransposeCols / 16; i += kTransposeThreads) {
      const int row = i / (kTransposeCols / 16), col = (i % (kTransposeCols / 16)) * 16;
      const int key = key0 + row;
      uint4 x = make_uint4(0, 0, 0, 0);
      // head_dim is a multiple of 16 here (the plan's rule), so a chunk is all in or all out.
      if (key < keys && d0 + col < head_dim) {
        x = *reinterpret_cast<const uint4*>(src + key * row_stride + d0 + col);
      }
      uint32_t* t = reinterpret_cast<uint32_t*>(&tile[row][col]);  // 4-byte aligned rows
      t[0] = x.x;
      t[1] = x.y;
      t[2] = x.z;
      t[3] = x.w;
    }
    __syncthreads();
    const int first = key0 + 16 * g;
    for (int col = warp * 8 + lane / 4; col < kTransposeCols; col += kTransposeThreads / 4) {
      const int d = d0 + col;
      if (d >= head_dim || first >= keys16) continue;
      uint32_t w[4];
#pragma unroll
      for (int word = 0; word < 4; ++word) {
        w[word] = 0;
#pragma unroll
        for (int byte = 0; byte < 4; ++byte) {
          w[word] |= uint32_t{tile[16 * g + KeyOfPosition(word * 4 + byte)][col]} << (8 * byte);
        }
      }
      *reinterpret_cast<uint4*>(out + d * keys16 + first) = make_uint4(w[0], w[1], w[2], w[3]);
    }
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

cudaError_t LaunchTransposeE4m3V(const void* v, int64_t item_stride, int64_t head_stride,
                                 int64_t row_stride, int items, int heads, int keys, int head_dim,
                                 void* dst, cudaStream_t stream) {
  if (items <= 0 || heads <= 0 || keys <= 0 || head_dim <= 0) return cudaSuccess;
  const int64_t keys16 = TransposedVKeys(keys);
  const dim3 grid(static_cast<unsigned>((keys16 + kTransposeKeys - 1) / kTransposeKeys), heads,
                  items);
  TransposeE4m3V<<<grid, kTransposeThreads, 0, stream>>>(
      static_cast<const uint8_t*>(v), item_stride, head_stride, row_stride, keys, head_dim, keys16,
      static_cast<uint8_t*>(dst));
  return cudaGetLastError();
}

}  // namespace attention::cuda
