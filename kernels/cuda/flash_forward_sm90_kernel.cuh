// FlashAttention forward for Hopper (ForwardVariant::kWgmmaSm90, sm_90a only): TMA tile loads
// into 128-byte-swizzled shared memory on an mbarrier pipeline, wgmma for Q K^T and P V, and warp
// specialisation (one producer warpgroup, two consumer warpgroups, registers moved from the first
// to the others with setmaxnreg). float16 and bfloat16, float32 accumulation.
//
// Per CTA = (query tile of kBr = 128 rows, query head, batch item); 384 threads:
//   warpgroup 0 (producer): one thread issues the TMA loads: the Q tile once (kD/64 boxes of
//     128 rows x 64 columns), then K and V tiles of kBc keys into kStages stages, each stage
//     guarded by a "full" barrier (TMA transaction bytes) and an "empty" one (one arrival per
//     consumer warp). The rest of the warpgroup idles on 24 registers.
//   warpgroups 1 and 2 (consumers, 240 registers): rows 64 wg .. 64 wg + 63 of the tile each.
//     Per key tile: S = Q K^T as kD/16 wgmma m64n{kBc}k16 with both operands in shared memory
//     (K-major; the 16-element k-step advances the descriptor by 32 bytes inside the swizzled
//     128-byte row, the next 64 columns are the next TMA box); the element mask (masks.cuh) only
//     on tiles that need it; the online softmax of the mma.sync kernel (online_softmax.cuh: the
//     wgmma accumulator of a warp is the accumulator of kBc/8 m16n8 tiles, so the same helpers
//     run on it); P rounded to T and kept in registers as the A operand of kBc/16 wgmma
//     m64n{kD}k16 for O += P V, V read MN-major (rows of keys, as TMA stores them).
//   Key tiles are visited last to first (the masked diagonal and ragged tiles first), tiles
//   outside every row's window never loaded: the range of VisibleKeys for the CTA's rows.
// Any Nq, Nk (TMA reads zeros past a tensor's end, the mask drops keys past Nk, rows past Nq are
// not stored), GQA/MQA through the K/V head coordinate, BHSD and BSHD and any 16-byte-aligned
// strides through the tensor maps, varlen (one packed map; rows of the next item that a tile
// overlaps are masked or not stored, and their V is finite: HostRunner sends requests with a
// non-finite V to the exact CPU path), windows and both mask alignments, LSE, head dims that are
// multiples of 8 up to 256 (columns past head_dim read as zeros and are not stored).
// Falls back to mma_sm80 (the plan's rule, forward_plan.cc): float32, and devices other than
// compute capability 9.0. float8 e4m3 runs here after HostRunner's dequantisation to bfloat16.
//
// Versions (H200, TFLOP/s; bench/README.md has the grid and the command):
//   v1 2026-12-01  TMA + wgmma + producer/consumer warpgroups, no overlap inside a consumer (each
//                  wgmma waited for before the softmax), O stored from registers.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/kernel_params.h"
#include "kernels/cuda/masks.cuh"
#include "kernels/cuda/mma_ops.cuh"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/wgmma_ops.cuh"

namespace attention::cuda {

// The kernel's parameters: the common ones and the tensor maps of Q, K and V (4-D: head_dim,
// rows, heads, batch items; varlen: one item of total rows), made per launch on the host.
struct Sm90Params {
  KernelParams p;
  CUtensorMap q, k, v;  // 64-byte aligned types
};

template <typename T, int kD_, int kBc_, int kStages_>
struct Sm90Tile {
  using Element = T;
  static constexpr int kD = kD_;
  static constexpr int kBc = kBc_;
  static constexpr int kStages = kStages_;
  static constexpr int kBr = 128;       // two consumer warpgroups of 64 rows
  static constexpr int kThreads = 384;  // producer + 2 consumers
  static constexpr int kBoxCols = 64;   // one 128-byte swizzled row of 16-bit elements
  static constexpr int kDBlocks = kD / kBoxCols;
  static constexpr int kQBytes = kBr * kD * 2;
  static constexpr int kKvBytes = kBc * kD * 2;  // one K (or V) stage
  static constexpr int kBarriers = 1 + 4 * kStages;
  // 1024 bytes of slack to align the tiles to the swizzle's 1024-byte groups.
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKvBytes + 8 * kBarriers;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;

  static_assert(sizeof(T) == 2, "16-bit elements");
  static_assert(kD % kBoxCols == 0 && kD <= 256);
  static_assert(kBc % 16 == 0 && kBc <= 256 && (kBc * 128) % 1024 == 0);
};

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    FlashForwardSm90Kernel(const __grid_constant__ Sm90Params sp) {
#if ATTENTION_SM90A
  using T = typename Tile::Element;
  constexpr int kD = Tile::kD, kBr = Tile::kBr, kBc = Tile::kBc, kStages = Tile::kStages;
  constexpr int kDBlocks = Tile::kDBlocks, kKvBytes = Tile::kKvBytes;
  constexpr int kNTiles = kBc / 8;  // 8-key column tiles of S
  constexpr int kDTiles = kD / 8;   // 8-wide column tiles of O
  constexpr uint32_t kRowBytes = 128;
  const KernelParams& p = sp.p;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t s_q = (SmemAddress(smem_raw) + 1023u) & ~1023u;  // [kDBlocks][kBr][64]
  const uint32_t s_k = s_q + Tile::kQBytes;                       // [kStages][kDBlocks][kBc][64]
  const uint32_t s_v = s_k + kStages * kKvBytes;                  // [kStages][kDBlocks][kBc][64]
  const uint32_t bars = s_v + kStages * kKvBytes;
  const uint32_t q_full = bars;
  auto k_full = [&](int s) { return bars + 8u * (1 + s); };
  auto v_full = [&](int s) { return bars + 8u * (1 + kStages + s); };
  auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };

  // Heaviest query tiles (most keys under a causal mask) start first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const ItemExtent e = GetItemExtent(p, b);
  const int m0 = m_block * kBr;
  if (m0 >= e.nq) return;  // varlen: this item is shorter than the grid
  const int row_last = min(m0 + kBr, e.nq) - 1;
  const KeyRange keys = VisibleKeys(p, e.nq, e.nk, m0, row_last);
  const int n_block_min = max(keys.lo, 0) / kBc;
  const int n_block_max = keys.hi > keys.lo ? (keys.hi + kBc - 1) / kBc : n_block_min;
  const int n_tiles = n_block_max - n_block_min;
  // Tensor-map coordinates of this item: varlen maps hold one item of packed rows.
  const int map_b = p.cu_seqlens_q == nullptr ? b : 0;
  const int hk = h / p.kv_group;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    MbarInit(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(k_full(s), 1);
      MbarInit(v_full(s), 1);
      MbarInit(k_empty(s), 8);  // one arrival per consumer warp
      MbarInit(v_empty(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    WarpgroupRegistersDown<Tile::kProducerRegs>();
    if (threadIdx.x == 0 && n_tiles > 0) {
      MbarArriveExpectTx(q_full, Tile::kQBytes);
#pragma unroll
      for (int c = 0; c < kDBlocks; ++c) {
        TmaLoad4d(s_q + c * kBr * kRowBytes, &sp.q, q_full, c * 64, e.q_start + m0, h, map_b);
      }
      for (int i = 0; i < n_tiles; ++i) {
        const int s = i % kStages;
        const uint32_t phase = (i / kStages) & 1;
        const int row = e.k_start + (n_block_max - 1 - i) * kBc;
        MbarWait(k_empty(s), phase ^ 1);
        MbarArriveExpectTx(k_full(s), kKvBytes);
#pragma unroll
        for (int c = 0; c < kDBlocks; ++c) {
          TmaLoad4d(s_k + s * kKvBytes + c * kBc * kRowBytes, &sp.k, k_full(s), c * 64, row, hk,
                    map_b);
        }
        MbarWait(v_empty(s), phase ^ 1);
        MbarArriveExpectTx(v_full(s), kKvBytes);
#pragma unroll
        for (int c = 0; c < kDBlocks; ++c) {
          TmaLoad4d(s_v + s * kKvBytes + c * kBc * kRowBytes, &sp.v, v_full(s), c * 64, row, hk,
                    map_b);
        }
      }
    }
    return;  // the consumers wait for every load, so the CTA outlives them
  }

  WarpgroupRegistersUp<Tile::kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wg_row0 = m0 + wg * 64;  // this warpgroup's first row in the item
  const int wg_row_last = min(wg_row0 + 63, e.nq - 1);

  float acc_o[kDTiles][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[dt][i] = 0.f;
  float(&o_flat)[kD / 2] = reinterpret_cast<float(&)[kD / 2]>(acc_o);

  if (n_tiles > 0) {
    MbarWait(q_full, 0);
    if (p.negate_q) {
      // A negative scale runs as |scale| on -Q (KernelParams): flip the sign bits of this
      // warpgroup's 64 rows, then make the generic-proxy stores visible to wgmma.
      const int tid = threadIdx.x % 128;
#pragma unroll
      for (int c = 0; c < kDBlocks; ++c) {
        const uint32_t base = s_q + c * kBr * kRowBytes + wg * 64 * kRowBytes;
#pragma unroll
        for (int j = 0; j < 64 * kRowBytes / 16 / 128; ++j) {
          const uint32_t addr = base + (tid + j * 128) * 16;
          uint4 x;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                       : "r"(addr));
          constexpr uint32_t kSigns = 0x80008000u;
          asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x.x ^ kSigns),
                       "r"(x.y ^ kSigns), "r"(x.z ^ kSigns), "r"(x.w ^ kSigns));
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      WarpgroupSync(1 + wg);
    }
    const uint32_t s_qw = s_q + wg * 64 * kRowBytes;  // this warpgroup's rows of each Q box

    for (int i = 0; i < n_tiles; ++i) {
      const int s = i % kStages;
      const uint32_t phase = (i / kStages) & 1;
      const int n0 = (n_block_max - 1 - i) * kBc;
      const uint32_t s_ks = s_k + s * kKvBytes, s_vs = s_v + s * kKvBytes;

      // S = Q K^T (raw logits): acc_s[nt] is the 16x8 block of this warp's rows, keys n0 + 8 nt.
      float acc_s[kNTiles][4];
      float(&s_flat)[kBc / 2] = reinterpret_cast<float(&)[kBc / 2]>(acc_s);
      MbarWait(k_full(s), phase);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        const uint32_t col = (ks / 4), sub = (ks % 4) * 32;
        const uint64_t da = SmemDesc128B(s_qw + col * kBr * kRowBytes + sub, 16, 1024);
        const uint64_t db = SmemDesc128B(s_ks + col * kBc * kRowBytes + sub, 16, 1024);
        WgmmaSS(WgmmaTag<T, kBc>(), s_flat, da, db, ks > 0);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(s_flat);
      if (lane == 0) MbarArrive(k_empty(s));  // this warp is done with K_s

      if (TileNeedsMask(p, e, wg_row0, wg_row_last, n0, kBc)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = wg_row0 + warp * 16 + g + half * 8;
          MaskRow(acc_s, half, VisibleKeys(p, e.nq, e.nk, row, row), n0, t);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float rescale =
            OnlineSoftmaxRow(acc_s, half, row_max[half], row_sum[half], p.scale_log2);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[dt][half * 2] *= rescale;
          acc_o[dt][half * 2 + 1] *= rescale;
        }
      }
      // P as A fragments: keys 16 kk .. 16 kk + 15 are S column tiles 2 kk and 2 kk + 1.
      uint32_t p_frag[kBc / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        p_frag[kk][0] = PackPair<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
        p_frag[kk][1] = PackPair<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
        p_frag[kk][2] = PackPair<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
        p_frag[kk][3] = PackPair<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
      }

      // O += P V: keys 16 kk.. of V_s are rows 16 kk.. of each 64-column box (MN-major: the
      // next 8 keys 1024 bytes on, the next 64 columns one box, kBc rows, on).
      MbarWait(v_full(s), phase);
      FenceRegisters(o_flat);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        const uint64_t db = SmemDesc128B(s_vs + kk * 16 * kRowBytes, kBc * kRowBytes, 1024);
        WgmmaRS(WgmmaTag<T, kD>(), o_flat, p_frag[kk], db, 1);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegisters(o_flat);
      if (lane == 0) MbarArrive(v_empty(s));
    }
  }

  // Epilogue: O = acc * o_scale / l (0 for rows that saw no key), straight from the accumulators:
  // each quad writes 16 contiguous bytes of a row per 8-column tile.
  T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = QuadSum(row_sum[half]);
    const float inv = l > 0.f ? p.o_scale / l : 0.f;
    const int row = wg_row0 + warp * 16 + g + half * 8;  // within the item
    if (row < e.nq) {
      T* o_row = o + static_cast<int64_t>(e.q_start + row) * p.o_row_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(o_row + col) =
              PackPair<T>(acc_o[dt][half * 2] * inv, acc_o[dt][half * 2 + 1] * inv);
        }
      }
      if (p.lse != nullptr && t == 0) {
        // Natural-log LSE: scale_log2 * row_max is max(scale * s) * log2(e).
        const float lse = l > 0.f ? (row_max[half] * p.scale_log2 + log2f(l)) * kLn2 : -INFINITY;
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + e.q_start + row] = lse;
      }
    }
  }
#endif  // ATTENTION_SM90A
}

}  // namespace attention::cuda
