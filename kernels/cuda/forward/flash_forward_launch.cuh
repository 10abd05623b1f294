// The launch side of the tensor-core kernel: tile shapes per dtype and head dim, and the launch.
// Included by flash_forward_{f16,bf16,f32}.cu (one dtype each, so they compile in parallel).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <iterator>

#include "kernels/cuda/forward/flash_forward_kernel.cuh"
#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/ops/smem_opt_in.h"

namespace attention::cuda {

// Tiles per specialised head dim: (D, Br, Bc, warps). Each warp owns Br / (16 warps) blocks of
// 16 rows; two 16-row blocks per warp let each K/V fragment read from shared memory feed two
// mma's. All fit two CTAs per SM (shared memory 48/96/96 KiB for 16-bit types; 80/96/128 for
// float32, whose 3xTF32 fragments need the registers of a second row block). Masked (causal,
// windowed) calls use the same tiles: a 64x64 tile for D=64 with a mask lost to 128x64 on v5
// (bfloat16 causal N=4096: 262 against 300 TFLOP/s, bench/README.md).
template <typename T, int kD>
struct FlashTileFor;
template <typename T>
struct FlashTileFor<T, 64> {
  using Tile = FlashTile<T, 64, 128, 64, 4>;
};
template <typename T>
struct FlashTileFor<T, 128> {
  using Tile = FlashTile<T, 128, 128, 64, 4>;
};
template <typename T>
struct FlashTileFor<T, 256> {
  using Tile = FlashTile<T, 256, 64, 32, 4>;
};
template <>
struct FlashTileFor<float, 64> {
  using Tile = FlashTile<float, 64, 64, 64, 4>;
};
template <>
struct FlashTileFor<float, 128> {
  using Tile = FlashTile<float, 128, 64, 32, 4>;
};
template <>
struct FlashTileFor<float, 256> {
  using Tile = FlashTile<float, 256, 64, 16, 4>;
};

template <typename Tile>
cudaError_t LaunchFlashTile(const KernelParams& p, cudaStream_t stream) {
  auto* kernel = FlashForwardKernel<Tile>;
  static std::atomic<uint64_t> smem_set_on{0};
  if (cudaError_t err = OptInSharedMemory(kernel, Tile::kSmemBytes, smem_set_on);
      err != cudaSuccess) {
    return err;
  }
  const dim3 grid((p.seqlen_q + Tile::kBr - 1) / Tile::kBr, p.heads_q, p.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// f(Tile()) for the tile of the specialised head dim that serves head_dim (WithSpecialisedHeadDim):
// the launch and the planner's shared memory query.
template <typename T, typename F>
auto WithFlashTile(int head_dim, F&& f) {
  return WithSpecialisedHeadDim(
      head_dim, [&](auto d) { return f(typename FlashTileFor<T, decltype(d)::value>::Tile()); });
}

// The tile's options instance where p sets an open-model option (HasOptions), else the plain one.
template <typename T>
cudaError_t LaunchFlashForward(const KernelParams& p, cudaStream_t stream) {
  return WithFlashTile<T>(p.head_dim, [&](auto tile) {
    using Tile = decltype(tile);
    return HasOptions(p) ? LaunchFlashTile<typename Tile::Options>(p, stream)
                         : LaunchFlashTile<Tile>(p, stream);
  });
}

template <typename T>
int FlashForwardSmemBytes(int head_dim) {
  return WithFlashTile<T>(head_dim, [](auto tile) { return decltype(tile)::kSmemBytes; });
}

}  // namespace attention::cuda
