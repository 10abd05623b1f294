#include <algorithm>

#include "kernels/cuda/prep/non_finite_scan.h"

namespace attention::cuda {
namespace {

constexpr int kScanThreads = 256;
// Blocks of the grid-stride loop: enough to keep every SM's loads in flight on an H200 (132 SMs)
// without a block per 4 KiB of a large V.
constexpr int kMaxScanBlocks = 1024;

// The bit test of kernels/non_finite.cc on one 64-bit word: nonzero when an element's exponent
// field is all ones (adding its lowest bit carries into the masked-off sign bit).
__device__ __forceinline__ uint64_t NonFiniteWord(uint64_t x, uint64_t exponent, uint64_t low,
                                                  uint64_t sign) {
  return ((x & exponent) + low) & sign;
}

// Element e of the unaligned ends, zero-extended into a word (zero is finite).
__device__ __forceinline__ uint64_t Element(const unsigned char* p, int64_t e, int elem_bytes) {
  switch (elem_bytes) {
    case 4:
      return reinterpret_cast<const uint32_t*>(p)[e];
    case 2:
      return reinterpret_cast<const uint16_t*>(p)[e];
    default:
      return p[e];
  }
}

// [data, data + head) and the tail after the 16-byte words: element by element; the words in
// between as two 64-bit halves each. One atomicOr per thread that found a value.
__global__ void __launch_bounds__(kScanThreads)
    NonFiniteScanKernel(const unsigned char* data, int64_t head_elems, const uint4* words,
                        int64_t word_count, const unsigned char* tail, int64_t tail_elems,
                        int elem_bytes, uint64_t exponent, uint64_t low, uint64_t sign,
                        unsigned int* flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kScanThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  uint64_t any = 0;
  for (int64_t i = first; i < word_count; i += stride) {
    const uint4 w = words[i];
    any |= NonFiniteWord((static_cast<uint64_t>(w.y) << 32) | w.x, exponent, low, sign);
    any |= NonFiniteWord((static_cast<uint64_t>(w.w) << 32) | w.z, exponent, low, sign);
  }
  for (int64_t e = first; e < head_elems; e += stride) {
    any |= NonFiniteWord(Element(data, e, elem_bytes), exponent, low, sign);
  }
  for (int64_t e = first; e < tail_elems; e += stride) {
    any |= NonFiniteWord(Element(tail, e, elem_bytes), exponent, low, sign);
  }
  if (any != 0) atomicOr(flag, 1u);
}

}  // namespace

cudaError_t LaunchNonFiniteScan(const void* data, int64_t elements, int elem_bytes,
                                const NonFiniteBits& bits, unsigned int* flag,
                                cudaStream_t stream) {
  if (elements <= 0) return cudaSuccess;
  const auto* p = static_cast<const unsigned char*>(data);
  const int64_t bytes = elements * elem_bytes;
  // Bytes up to the first 16-byte boundary (whole elements: data is aligned to its element).
  const int64_t head = std::min<int64_t>(
      bytes, (16 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16)) % 16);
  const int64_t word_count = (bytes - head) / 16;
  const unsigned char* tail = p + head + word_count * 16;
  const int64_t tail_bytes = bytes - head - word_count * 16;
  const int64_t work = std::max<int64_t>(word_count, (head + tail_bytes) / elem_bytes);
  const int blocks = static_cast<int>(
      std::clamp<int64_t>((work + kScanThreads - 1) / kScanThreads, 1, kMaxScanBlocks));
  NonFiniteScanKernel<<<blocks, kScanThreads, 0, stream>>>(
      p, head / elem_bytes, reinterpret_cast<const uint4*>(p + head), word_count, tail,
      tail_bytes / elem_bytes, elem_bytes, bits.exponent, bits.low, bits.sign, flag);
  return cudaGetLastError();
}

}  // namespace attention::cuda
