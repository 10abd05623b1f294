// Host side of the Hopper forward kernel (flash_forward_sm90_kernel.cuh): its tile per head dim,
// the TMA tensor maps of Q, K and V made per launch, and the launch.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/forward/flash_forward_sm90_kernel.cuh"
#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/ops/smem_opt_in.h"
#include "kernels/cuda/prep/dequantise.h"

namespace attention::cuda {

// Tiles per head dim (the kernel's opening comment has their speed): Sm90Tile<T, kD, keys per
// stage, stages, consumer warpgroups, Q buffers>. D = 64: three consumers (192 query rows; S, P and
// O of a warpgroup fit 160 registers) on three stages, two Q buffers (1.02-1.05x at N = 1024-2048;
// at D = 128 0.98-1.02x, on v7 and on v8, so one there, and D = 256 has no room for a second).
// Masked D = 64 calls of up to 2048 rows took two consumers (128 rows) until v9, which lets a
// consumer skip the key tiles its own rows do not see: three are now 1.05-1.10x faster there
// (causal N = 512-2048), and 64-key tiles on two consumers 0.86-0.94x (2026-12-02). D = 128:
// 128-key tiles (176, as FlashAttention-3 takes unmasked, ran 0.52 instead of 0.54-0.56 PFLOP/s at
// N = 1024 and no faster at 4096 or 16384). D = 256: 80 keys, so that Q (64 KiB) and two K/V stages
// fit in 227 KiB (at 16 bits O's boxes then go into the V stages: Sm90Tile::kOInV).
template <typename T, int kD>
struct Sm90TileFor;
template <typename T>
struct Sm90TileFor<T, 64> {
  using Tile = Sm90Tile<T, 64, 128, 3, 3, 2>;
};
template <typename T>
struct Sm90TileFor<T, 128> {
  using Tile = Sm90Tile<T, 128, 128, 2, 2>;
};
template <typename T>
struct Sm90TileFor<T, 256> {
  using Tile = Sm90Tile<T, 256, 80, 2, 2>;
};
// float8 e4m3 at D = 128 and 256 (the plan's rule: other head dims are dequantised to bfloat16):
// 128-key tiles (one 128-byte row of V^T per head dim), three stages at D = 128 (112 KiB of shared
// memory), two at 256 (160 KiB). The only float8 tiles measured so far (bench/README.md).
template <>
struct Sm90TileFor<__nv_fp8_e4m3, 128> {
  using Tile = Sm90Tile<__nv_fp8_e4m3, 128, 128, 3, 2>;
};
template <>
struct Sm90TileFor<__nv_fp8_e4m3, 256> {
  using Tile = Sm90Tile<__nv_fp8_e4m3, 256, 128, 2, 2>;
};

// The driver's tensor-map encoder, looked up once through the runtime (so nothing links
// libcuda, and machines without a driver still load the library); nullptr where the driver
// lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 4-D map (cols, rows, heads, items) of elements T with element strides, read in boxes of one
// 128-byte row of columns x box_rows rows into the 128-byte swizzle (or stored from it). Q, K, V
// and O: cols = head_dim, rows = tokens; float8 V^T: cols = keys, rows = head_dim. A dimension of
// extent 1 gets a stride TMA accepts whatever the caller's is (it is never stepped over).
template <typename T>
bool EncodeTileMap(CUtensorMap* map, const void* base, int cols, int rows, int heads, int items,
                   int64_t row_stride, int64_t head_stride, int64_t item_stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  constexpr int64_t kBytes = sizeof(T);
  const int64_t rows_bytes = row_stride * kBytes * rows;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(items)};
  const cuuint64_t strides[3] = {
      static_cast<cuuint64_t>(row_stride * kBytes),
      static_cast<cuuint64_t>(heads > 1 ? head_stride * kBytes : rows_bytes),
      static_cast<cuuint64_t>(items > 1 ? item_stride * kBytes : rows_bytes)};
  const cuuint32_t box[4] = {128 / kBytes, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                   : std::is_same_v<T, __nv_bfloat16>
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename Tile>
cudaError_t LaunchSm90Tile(const KernelParams& p, cudaStream_t stream) {
  using T = typename Tile::Element;
  if (p.tile_counters == nullptr) return cudaErrorInvalidValue;  // ForwardScratch missing
  Sm90Params sp{};
  sp.p = p;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int items = varlen ? 1 : p.batch;
  const int heads_kv = p.heads_q / p.kv_group;
  if (!EncodeTileMap<T>(&sp.q, p.q, p.head_dim, p.total_q, p.heads_q, items, p.q_row_stride,
                        p.q_head_stride, p.q_batch_stride, Tile::kBr) ||
      !EncodeTileMap<T>(&sp.k, p.k, p.head_dim, p.total_k, heads_kv, items, p.k_row_stride,
                        p.k_head_stride, p.k_batch_stride, Tile::kBc)) {
    return cudaErrorInvalidValue;
  }
  if constexpr (Tile::kFloat8) {
    // V^T [items, Hkv, head_dim, keys16], written here first (the plan takes float8 only dense).
    if (p.v_transposed == nullptr || varlen) return cudaErrorInvalidValue;
    const int64_t keys16 = TransposedVKeys(p.total_k);
    if (cudaError_t err =
            LaunchTransposeE4m3V(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.batch,
                                 heads_kv, p.total_k, p.head_dim, p.v_transposed, stream);
        err != cudaSuccess) {
      return err;
    }
    if (!EncodeTileMap<T>(&sp.v, p.v_transposed, static_cast<int>(keys16), p.head_dim, heads_kv,
                          items, keys16, p.head_dim * keys16, heads_kv * p.head_dim * keys16,
                          Tile::kD)) {
      return cudaErrorInvalidValue;
    }
  } else if (!EncodeTileMap<T>(&sp.v, p.v, p.head_dim, p.total_k, heads_kv, items, p.v_row_stride,
                               p.v_head_stride, p.v_batch_stride, Tile::kBc)) {
    return cudaErrorInvalidValue;
  }
  if constexpr (Tile::kTmaStoreO) {
    // O by TMA where the driver takes its map (16-byte aligned address and strides); otherwise
    // the kernel stores from registers, which needs 4-byte alignment only.
    using OutT = typename Tile::Output;
    sp.o_by_tma = EncodeTileMap<OutT>(&sp.o, p.o, p.head_dim, p.total_q, p.heads_q, items,
                                      p.o_row_stride, p.o_head_stride, p.o_batch_stride, 64);
  }
  auto* kernel = FlashForwardSm90Kernel<Tile>;
  static std::atomic<uint64_t> smem_set_on{0};
  if (cudaError_t err = OptInSharedMemory(kernel, Tile::kSmemBytes, smem_set_on);
      err != cudaSuccess) {
    return err;
  }
  // Persistent: one CTA per SM at most, each looping over the work tiles.
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess) {
    return err;
  }
  const int64_t work_tiles =
      int64_t{(p.seqlen_q + Tile::kBr - 1) / Tile::kBr} * p.heads_q * p.batch;
  const int ctas = static_cast<int>(std::min<int64_t>(work_tiles, sms));
  kernel<<<ctas, Tile::kThreads, Tile::kSmemBytes, stream>>>(sp);
  return cudaGetLastError();
}

// f(Sm90TileFor<T, kD>()) for the specialised head dim kD that serves head_dim.
template <typename T, typename F>
auto WithSm90Tiles(int head_dim, F&& f) {
  return WithSpecialisedHeadDim(head_dim,
                                [&](auto d) { return f(Sm90TileFor<T, decltype(d)::value>()); });
}

// The tile's options instance where p sets an open-model option (HasOptions; 16-bit types only,
// the plan dequantises float8 calls with options), else the plain one.
template <typename T>
cudaError_t LaunchFlashForwardSm90(const KernelParams& p, cudaStream_t stream) {
  return WithSm90Tiles<T>(p.head_dim, [&](auto tiles) {
    using Tile = typename decltype(tiles)::Tile;
    if constexpr (Tile::kFloat8) {
      if (HasOptions(p)) return cudaErrorInvalidValue;
      return LaunchSm90Tile<Tile>(p, stream);
    } else {
      return HasOptions(p) ? LaunchSm90Tile<typename Tile::Options>(p, stream)
                           : LaunchSm90Tile<Tile>(p, stream);
    }
  });
}

// The most dynamic shared memory a call at head_dim may take (the plan checks it).
template <typename T>
int FlashForwardSm90MaxSmemBytes(int head_dim) {
  return WithSm90Tiles<T>(head_dim, [](auto tiles) { return decltype(tiles)::Tile::kSmemBytes; });
}

}  // namespace attention::cuda
