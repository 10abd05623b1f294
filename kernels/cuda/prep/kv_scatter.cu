#include "kernels/cuda/prep/kv_scatter.h"

namespace attention::cuda {
namespace {

constexpr int kScatterThreads = 128;

// Segment blockIdx.x, in units of U.
template <typename U>
__global__ void __launch_bounds__(kScatterThreads)
    KvScatterKernel(const KvSegment* segments, const unsigned char* src, unsigned char* dst) {
  const KvSegment s = segments[blockIdx.x];
  const U* from = reinterpret_cast<const U*>(src + s.src);
  U* to = reinterpret_cast<U*>(dst + s.dst);
  const int64_t n = s.bytes / static_cast<int64_t>(sizeof(U));
  for (int64_t i = threadIdx.x; i < n; i += kScatterThreads) to[i] = from[i];
}

template <typename U>
cudaError_t Launch(const KvSegment* segments, int64_t count, const unsigned char* src,
                   unsigned char* dst, cudaStream_t stream) {
  KvScatterKernel<U>
      <<<static_cast<unsigned>(count), kScatterThreads, 0, stream>>>(segments, src, dst);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchKvScatter(const KvSegment* segments, int64_t count, const unsigned char* src,
                            unsigned char* dst, int unit, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (unit) {
    case 16:
      return Launch<uint4>(segments, count, src, dst, stream);
    case 8:
      return Launch<uint2>(segments, count, src, dst, stream);
    case 4:
      return Launch<uint32_t>(segments, count, src, dst, stream);
    default:
      return Launch<uint16_t>(segments, count, src, dst, stream);
  }
}

}  // namespace attention::cuda
