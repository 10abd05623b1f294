// The head dims the CUDA kernels specialise and the limits they take, in one place: the launchers
// dispatch on these arrays, the planners check against them, and SpecialisedHeadDims() reports
// them. Plain C++ (no CUDA types), so host code and the server may include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>
#include <vector>

namespace attention::cuda {

// Forward (flash_forward_launch.cuh): the head dims with their own tile shapes, ascending; any
// smaller multiple of 8 runs in the next one up (columns past head_dim zero-filled).
inline constexpr int kSpecialisedHeadDims[] = {64, 128, 256};
inline constexpr int kMaxHeadDim = kSpecialisedHeadDims[std::size(kSpecialisedHeadDims) - 1];

// Paged decode (paged_decode_launch.cuh): head dims with a tensor-core tile (float16 and
// bfloat16), ascending; any multiple of 8 below one of them runs in it.
inline constexpr int kPagedTensorHeadDims[] = {64, 128};
// Largest QK and V head dim of the paged SIMT path (every dtype, any head dim up to this; MLA's
// absorbed decode: QK 576, V 512). Head dims up to kPagedSimtNarrowHeadDim run in its narrow
// instance (8 columns per lane), larger ones in its wide one (paged_decode_launch.cuh).
inline constexpr int kPagedMaxHeadDim = 576;
inline constexpr int kPagedSimtNarrowHeadDim = 256;
// The wide tensor-core tile's (QK, V) head dims (float16, bfloat16; paged_decode_wide_kernel.cuh):
// MLA's absorbed decode and D = 512, on devices whose blocks may opt in to its shared memory.
inline constexpr int kPagedWideHeadDims[] = {512, 576};
inline constexpr int kPagedWideVHeadDim = 512;

// The specialisation that serves head_dim: the smallest of `dims` (ascending) >= head_dim, or 0
// when none is.
template <size_t kN>
constexpr int SpecialisationFor(const int (&dims)[kN], int64_t head_dim) {
  for (int d : dims) {
    if (head_dim <= d) return d;
  }
  return 0;
}

// The forward kernels' specialised head dims (kSpecialisedHeadDims), for a server's list of the
// head dims that run fastest.
// f(std::integral_constant<int, kD>()) for the smallest specialised head dim kD >= head_dim
// (kSpecialisedHeadDims, ascending; the largest past them): the one head-dim dispatch of the
// forward kernels' launchers and of the planner's shared-memory queries.
template <size_t kI = 0, typename F>
auto WithSpecialisedHeadDim(int64_t head_dim, F&& f) {
  constexpr int kD = kSpecialisedHeadDims[kI];
  if constexpr (kI + 1 < std::size(kSpecialisedHeadDims)) {
    if (head_dim > kD) return WithSpecialisedHeadDim<kI + 1>(head_dim, f);
  }
  return f(std::integral_constant<int, kD>());
}

inline std::vector<int> SpecialisedHeadDims() {
  return {std::begin(kSpecialisedHeadDims), std::end(kSpecialisedHeadDims)};
}
// The paged decode kernels' tensor-core head dims (kPagedTensorHeadDims).
inline std::vector<int> PagedSpecialisedHeadDims() {
  return {std::begin(kPagedTensorHeadDims), std::end(kPagedTensorHeadDims)};
}

}  // namespace attention::cuda
