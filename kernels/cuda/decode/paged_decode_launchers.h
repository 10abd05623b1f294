// Paged decode launchers, one per dtype, callable from plain C++ (paged_decode.cc plans the step
// and turns their cudaError_t into a Status).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/decode/paged_decode_params.h"
#include "kernels/cuda/ops/limits.h"

namespace attention::cuda {

// CTAs resident per SM of the kernel for a head dim (PagedLaunch::kernel_head_dim; 0: the SIMT
// kernel), which the planner fills its wave with: the D = 128 tile's four stages (~132 KiB of
// shared memory) leave room for one, the D = 64 tile's three (~100 KiB) for two
// (paged_decode_launch.cuh checks both).
constexpr int PagedCtasPerSm(int kernel_head_dim) { return kernel_head_dim == 128 ? 1 : 2; }

// The one tensor-core tile instantiated with the logit softcap (Gemma 2 and Grok-1 cap at D = 128;
// Gemma 2's D = 256 runs on the SIMT kernel): a softcapped step of any head dim a tile serves runs
// in it, so the softcap costs the build two kernels (float16, bfloat16), not one per tile.
inline constexpr int kPagedSoftcapHeadDim = 128;

// The wide tile's rows per CTA (PagedWideTile::kRows) and its shared memory at QK head dim d and V
// head dim dv (PagedWideTile::kSmemBytes; paged_decode_launch.cuh checks both): Q [64][d], two
// stages of 32 K rows of d and V rows of dv (V in K's rows: three stages of K rows alone),
// P [64][32] in rows of 80 bytes, and its statistics.
inline constexpr int kPagedWideRows = 64;
constexpr int PagedWideSmemBytes(int d, int dv, bool v_from_k = false) {
  return kPagedWideRows * d * 2 + (v_from_k ? 3 * 32 * d : 2 * 32 * (d + dv)) * 2 +
         kPagedWideRows * 80 + (4 * kPagedWideRows + kPagedWideRows + 8) * 4;
}

// What the grid needs beyond the kernel params.
struct PagedLaunch {
  int num_seqs = 0;
  int kernel_head_dim = 0;  // 64 or 128: the tensor-core tile of that D; 0: the SIMT kernel
  // The tensor-core tile's softcap instance (kernel_head_dim kPagedSoftcapHeadDim); the SIMT
  // kernel caps by a branch on the params.
  bool softcap = false;
  // The SIMT kernel's wide instance (kernel_head_dim 0, D or Dv over kPagedSimtNarrowHeadDim: 18
  // columns per lane instead of 8).
  bool simt_wide = false;
  // > 0: the wide tensor-core tile of this QK head dim (kPagedWideHeadDims, V kPagedWideVHeadDim;
  // kernel_head_dim 0); its CTAs hold kPagedWideRows rows.
  int wide_head_dim = 0;
  // The wide tile's instance that reads V from K's rows (QK 576 only: MLA's latent cache).
  bool wide_v_from_k = false;
};

cudaError_t LaunchPagedDecodeF16(const PagedKernelParams& p, const PagedLaunch& launch,
                                 cudaStream_t stream);
cudaError_t LaunchPagedDecodeBF16(const PagedKernelParams& p, const PagedLaunch& launch,
                                  cudaStream_t stream);
cudaError_t LaunchPagedDecodeF32(const PagedKernelParams& p, const PagedLaunch& launch,
                                 cudaStream_t stream);

}  // namespace attention::cuda
