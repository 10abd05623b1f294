// The launch side of the paged decode kernels (paged_decode_kernel.cuh): tiles per head dim and
// the launch of one step (one kernel: with several splits, the row block's splits merge in their
// cluster, or the last of them merges them).
// Included by paged_decode_{f16,bf16,f32}.cu, one dtype each.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/decode/paged_decode_kernel.cuh"
#include "kernels/cuda/decode/paged_decode_launchers.h"
#include "kernels/cuda/decode/paged_decode_wide_kernel.cuh"
#include "kernels/cuda/ops/smem_opt_in.h"

namespace attention::cuda {

// (D, key tile, stages): a stage (K + V tile) is 32 KiB at both head dims. D = 64: three stages
// and Q make ~100 KiB of shared memory, two CTAs per SM. D = 128: four stages, ~132 KiB, one CTA
// per SM with three tiles in flight (measured on the H200, bench/README.md: 1-2% faster than three
// stages at two CTAs per SM, whose four tiles in flight per SM come with twice the prologues).
template <typename T, int kD>
struct PagedTileFor;
template <typename T>
struct PagedTileFor<T, 64> {
  using Tile = PagedTile<T, 64, 128, 3>;
};
template <typename T>
struct PagedTileFor<T, 128> {
  using Tile = PagedTile<T, 128, 64, 4>;
};

// The planner's CTAs per SM (PagedCtasPerSm) are what the tiles' shared memory allows
// (PagedTile::kResidentCtas).
static_assert(PagedTileFor<__half, 64>::Tile::kResidentCtas == PagedCtasPerSm(64));
static_assert(PagedTileFor<__half, 128>::Tile::kResidentCtas == PagedCtasPerSm(128));

template <typename Tile, bool kSoftcap = false>
cudaError_t LaunchPagedTile(const PagedKernelParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = PagedDecodeKernel<Tile, kSoftcap>;
  static std::atomic<uint64_t> smem_set_on{0};
  if (cudaError_t err = OptInSharedMemory(kernel, Tile::kSmemBytes, smem_set_on);
      err != cudaSuccess) {
    return err;
  }
  // p.cluster: the splits of a row block (grid x) form one cluster (MergeSplitsInCluster).
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = p.splits;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(Tile::kThreads);
  config.dynamicSmemBytes = Tile::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = p.cluster ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// The host's view of the wide tile (PagedWideSmemBytes, kPagedWideRows) is the tile's.
static_assert(PagedWideTile<__half, 576, 512>::kSmemBytes == PagedWideSmemBytes(576, 512));
static_assert(PagedWideTile<__half, 512, 512>::kSmemBytes == PagedWideSmemBytes(512, 512));
static_assert(PagedWideTile<__half, 576, 512, true>::kSmemBytes ==
              PagedWideSmemBytes(576, 512, true));
static_assert(PagedWideTile<__half, 576, 512>::kRows == kPagedWideRows);

template <typename Tile>
cudaError_t LaunchPagedWide(const PagedKernelParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = PagedWideKernel<Tile>;
  static std::atomic<uint64_t> smem_set_on{0};
  if (cudaError_t err = OptInSharedMemory(kernel, Tile::kSmemBytes, smem_set_on);
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The SIMT kernel (PagedSimtKernel): columns per lane for head dims up to kPagedSimtNarrowHeadDim,
// or up to kPagedMaxHeadDim (launch.simt_wide).
template <typename T>
cudaError_t LaunchPagedSimt(const PagedKernelParams& p, const PagedLaunch& launch, dim3 grid,
                            cudaStream_t stream) {
  constexpr int kNarrow = kPagedSimtNarrowHeadDim / 32, kWide = (kPagedMaxHeadDim + 31) / 32;
  if (launch.simt_wide) {
    PagedSimtKernel<T, kWide><<<grid, kPagedThreads, 0, stream>>>(p);
  } else {
    PagedSimtKernel<T, kNarrow><<<grid, kPagedThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchPagedDecodeFor(const PagedKernelParams& p, const PagedLaunch& launch,
                                 cudaStream_t stream) {
  const dim3 grid(p.splits, p.heads_kv * p.m_blocks, launch.num_seqs);
  cudaError_t err = cudaSuccess;
  if constexpr (std::is_same_v<T, float>) {
    err = LaunchPagedSimt<T>(p, launch, grid, stream);
  } else if (launch.wide_head_dim != 0) {
    static_assert(kPagedWideVHeadDim == 512 && kPagedWideHeadDims[0] == 512 &&
                  kPagedWideHeadDims[1] == 576);
    err = launch.wide_v_from_k ? LaunchPagedWide<PagedWideTile<T, 576, 512, true>>(p, grid, stream)
          : launch.wide_head_dim == 576
              ? LaunchPagedWide<PagedWideTile<T, 576, 512>>(p, grid, stream)
              : LaunchPagedWide<PagedWideTile<T, 512, 512>>(p, grid, stream);
  } else {
    switch (launch.kernel_head_dim) {
      case 64:
        err = LaunchPagedTile<typename PagedTileFor<T, 64>::Tile>(p, grid, stream);
        break;
      case 128:
        static_assert(kPagedSoftcapHeadDim == 128);
        err = launch.softcap
                  ? LaunchPagedTile<typename PagedTileFor<T, 128>::Tile, true>(p, grid, stream)
                  : LaunchPagedTile<typename PagedTileFor<T, 128>::Tile>(p, grid, stream);
        break;
      default:
        err = LaunchPagedSimt<T>(p, launch, grid, stream);
    }
  }
  return err;
}

}  // namespace attention::cuda
