// The launch side of the paged decode kernels (paged_decode_kernel.cuh): tiles per head dim and
// the launch of one step (decode kernel, then the combine kernel when there are several splits).
// Included by paged_decode_{f16,bf16,f32}.cu, one dtype each.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/paged_decode_kernel.cuh"
#include "kernels/cuda/paged_decode_launchers.h"

namespace attention::cuda {

// (D, key tile, stages): a stage (K + V tile) is 32 KiB at both head dims, three stages and Q make
// ~100 KiB of shared memory, two CTAs per SM: four stages' worth of K/V in flight per SM.
template <typename T, int kD>
struct PagedTileFor;
template <typename T>
struct PagedTileFor<T, 64> {
  using Tile = PagedTile<T, 64, 128, 3>;
};
template <typename T>
struct PagedTileFor<T, 128> {
  using Tile = PagedTile<T, 128, 64, 3>;
};

template <typename Tile>
cudaError_t LaunchPagedTile(const PagedKernelParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = PagedDecodeKernel<Tile>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The combine kernel, when there are several splits.
template <typename T>
cudaError_t LaunchPagedCombine(const PagedKernelParams& p, const PagedLaunch& launch,
                               cudaStream_t stream) {
  if (p.splits == 1) return cudaSuccess;
  const int64_t rows = p.total_rows - launch.first_row;
  const int64_t rows_per_cta = kPagedThreads / 32;
  PagedCombineKernel<T><<<static_cast<unsigned>((rows + rows_per_cta - 1) / rows_per_cta),
                          kPagedThreads, 0, stream>>>(p, launch.first_row);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchPagedDecodeFor(const PagedKernelParams& p, const PagedLaunch& launch,
                                 cudaStream_t stream) {
  const dim3 grid(p.splits, p.heads_kv * p.m_blocks, launch.num_seqs);
  cudaError_t err = cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    PagedSimtKernel<T><<<grid, kPagedThreads, 0, stream>>>(p);
    err = cudaGetLastError();
  } else {
    switch (launch.kernel_head_dim) {
      case 64:
        err = LaunchPagedTile<typename PagedTileFor<T, 64>::Tile>(p, grid, stream);
        break;
      case 128:
        err = LaunchPagedTile<typename PagedTileFor<T, 128>::Tile>(p, grid, stream);
        break;
      default:
        PagedSimtKernel<T><<<grid, kPagedThreads, 0, stream>>>(p);
        err = cudaGetLastError();
    }
  }
  if (err != cudaSuccess) return err;
  return LaunchPagedCombine<T>(p, launch, stream);
}

}  // namespace attention::cuda
