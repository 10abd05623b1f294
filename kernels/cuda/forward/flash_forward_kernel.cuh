// FlashAttention-2 forward on tensor cores, float32 accumulation: float16 and bfloat16 through
// mma.sync m16n8k16, float32 through 3xTF32 m16n8k8 (each product from three tf32 mma's on
// hi/lo splits, ~2^-22 relative error: float32 accuracy at tensor-core speed). See
// flash_forward_launch.cuh for the tile choices per head dim and their measured speed.
//
// Algorithm, per CTA = (query tile of kBr rows, query head, batch item):
//   Q tile -> shared memory once; key/value tiles of kBc rows stream through two shared-memory
//   buffers each with cp.async (16 bytes, zero-filled past the end): K tile j+1 is in flight
//   while tile j's S = Q K^T, softmax and O += P V run, V tile j+1 while P V_j and the next S run.
//   Each of the kWarps warps owns kMSteps blocks of 16 query rows, so softmax statistics stay in
//   the warp (a row's 64..128 logits live in the 4 lanes of a quad). S comes out of the mma in
//   float32; online softmax keeps the running max m of the raw logits and the sum l per row
//   (O rescaled by the change of m), p = exp2(s * scale*log2(e) - m * scale*log2(e)) is one FFMA
//   and one ex2 (KernelParams: the scale is made positive), then p is rounded to T and fed
//   straight back as the A operand of P V (the accumulator layout of m16n8k16 is the A layout of
//   the next mma), never through shared memory. V's B fragments come from ldmatrix.trans of
//   row-major V. For float32 the A layout of m16n8k8 wants keys (t, t+4) where the accumulator
//   holds (2t, 2t+1), so the 8 keys of a k-step are taken in that permuted order on both sides:
//   V's B fragment is read as keys (2t, 2t+1) with two 4-byte shared loads (ldmatrix cannot
//   transpose 32-bit data).
//   Key tiles are visited last to first, so the tiles that need element masks (the causal
//   diagonal, window edges, the ragged last tile) come first; tiles entirely outside the mask
//   are never loaded, and fully visible tiles skip the mask arithmetic.
// Shared memory rows are kD elements = kChunks chunks of 16 bytes; chunk c of row r is stored at
// c ^ (r % 8), so the 8 row addresses of every ldmatrix phase and every cp.async warp store hit 8
// different 16-byte bank groups (no bank conflicts, no padding).
// Head dims below kD are served by the same kernel: columns >= head_dim are zero-filled on load
// (adding nothing to Q K^T) and not stored.
// Open-model options (FlashTile::kOptions, one instance per tile beside the plain one, which has
// none of this code): chunks cut each row's keys as windows do (ChunkedVisibleKeys: the CTA's key
// range, the tiles that need element masks, the masks), the softcap rewrites S before the mask
// (Softcap, in the log2 domain: the softmax then runs at scale 1; tanh.approx in 16-bit tiles,
// tanhf in float32 ones), and the head's sink joins l in the epilogue (AddSink: one factor on o,
// and the LSE).
//
// Current speed (v5, 2026-11-30; H200, bfloat16/float16 TFLOP/s on the FlashAttention grid of
// bench/README.md, against torch SDPA's FlashAttention-2 in the same run): D=64 causal 174-321
// (1.01-1.17x FA2), unmasked 266-336 (1.03-1.09x); D=128 195-371 (0.99-1.11x); D=256 176-290
// (0.85-1.01x); float32 (3xTF32) 35.0-37.0 (1.02-1.04x torch's float32 memory-efficient kernel).
// On Hopper, float16 and bfloat16 run on the wgmma kernel instead (forward_plan.h). The versions
// before this one: docs/kernels.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/limits.h"
#include "kernels/cuda/ops/masks.cuh"
#include "kernels/cuda/ops/mma_ops.cuh"
#include "kernels/cuda/ops/online_softmax.cuh"
#include "kernels/cuda/ops/tile_ops.cuh"

namespace attention::cuda {

template <typename T, int kD_, int kBr_, int kBc_, int kWarps_, bool kMaskVariants_ = false,
          bool kOptions_ = false>
struct FlashTile {
  using Element = T;
  static constexpr bool kF32 = std::is_same_v<T, float>;
  static constexpr int kD = kD_;
  static constexpr int kBr = kBr_;
  static constexpr int kBc = kBc_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMSteps = kBr / (16 * kWarps);  // 16-row blocks per warp
  static constexpr int kChunkElems = 16 / sizeof(T);
  static constexpr int kChunks = kD / kChunkElems;  // 16-byte chunks per row
  static constexpr int kRowBytes = kD * sizeof(T);
  // true: the key-tile step compiled twice, with and without the element mask, each one straight
  // block (more code, more registers live at once: D=128 spills); false: one copy that branches
  // to the mask. Only the tile sweep (bench/cuda) instantiates true.
  static constexpr bool kMaskVariants = kMaskVariants_;
  // true: the open-model options instance (KernelParams' sinks, softcap and chunk_size, read at
  // run time); false: the plain one, which has none of their code. Options is the same tile's.
  static constexpr bool kOptions = kOptions_;
  using Options = FlashTile<T, kD_, kBr_, kBc_, kWarps_, kMaskVariants_, true>;
  // Q fragments stay in registers when they are few (D = 64); otherwise they are re-read from
  // shared memory per k-step, which keeps registers for the O accumulator.
  static constexpr bool kQInRegisters = kMSteps * kD <= 128;
  // Q tile + 2 K tiles + 2 V tiles.
  static constexpr int kSmemBytes = (kBr + 4 * kBc) * kRowBytes;

  static_assert(kD % 64 == 0, "the swizzle needs rows of >= 8 chunks");
  static_assert(kD <= kMaxHeadDim);
  static_assert(kBr % (16 * kWarps) == 0 && kMSteps >= 1, "warps own whole 16-row blocks");
  static_assert(kBc % 16 == 0, "P V consumes keys 16 at a time");
};

// Issues cp.async for a tile of kRows rows starting at global row `row0` of `src` (rows >= n_rows
// and chunks >= d_chunks are zero-filled). Thread i copies chunk i % kChunks of rows
// i / kChunks + j * (kThreads / kChunks), so one pointer advanced by a constant serves all j.
template <typename Tile, int kRows, typename T>
__device__ __forceinline__ void LoadTile(uint32_t smem, const T* src, int64_t row_stride, int row0,
                                         int n_rows, int d_chunks) {
  constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
  static_assert(Tile::kThreads % Tile::kChunks == 0 && kRows % kRowStep == 0,
                "whole rows per pass");
  const int c = threadIdx.x % Tile::kChunks;
  const int r0 = threadIdx.x / Tile::kChunks;
  const bool c_valid = c < d_chunks;
  const T* g = src + (row0 + r0) * row_stride + c * Tile::kChunkElems;
#pragma unroll
  for (int j = 0; j < kRows / kRowStep; ++j) {
    const int r = r0 + j * kRowStep;
    const bool valid = c_valid && row0 + r < n_rows;
    CpAsync16(smem + SwizzledOffset<Tile::kRowBytes>(r, c), valid ? g : src, valid);
    g += kRowStep * row_stride;
  }
}

// Flips the sign of every element of a tile of kRows rows (each thread the chunks LoadTile gave
// it): Q is negated for a negative softmax scale, so that the kernel always scales by |scale| and
// the row max of the raw logits is the row max of the scaled ones.
template <typename Tile, int kRows>
__device__ __forceinline__ void NegateTile(uint32_t smem) {
  constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
  constexpr uint32_t kSigns = Tile::kF32 ? 0x80000000u : 0x80008000u;
  const int c = threadIdx.x % Tile::kChunks;
#pragma unroll
  for (int j = 0; j < kRows / kRowStep; ++j) {
    const uint32_t addr =
        smem + SwizzledOffset<Tile::kRowBytes>(threadIdx.x / Tile::kChunks + j * kRowStep, c);
    uint4 x;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(addr));
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x.x ^ kSigns),
                 "r"(x.y ^ kSigns), "r"(x.z ^ kSigns), "r"(x.w ^ kSigns));
  }
}

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads) FlashForwardKernel(const KernelParams p) {
  using T = typename Tile::Element;
  constexpr bool kF32 = Tile::kF32;
  constexpr int kD = Tile::kD, kBr = Tile::kBr, kBc = Tile::kBc, kRowBytes = Tile::kRowBytes;
  constexpr int kMSteps = Tile::kMSteps;
  constexpr int kNTiles = kBc / 8;            // 8-key column tiles of S
  constexpr int kDTiles = kD / 8;             // 8-wide column tiles of O
  constexpr int kKSteps = Tile::kChunks / 2;  // k-steps of Q K^T (two chunks each)
  constexpr int kTileBytes = kBc * kRowBytes;
  constexpr int kBlockBytes = 16 * kRowBytes;  // one 16-row block of a tile

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = SmemAddress(smem);
  const uint32_t s_k = s_q + kBr * kRowBytes;  // [2][kBc][kD]
  const uint32_t s_v = s_k + 2 * kTileBytes;   // [2][kBc][kD]

  // Heaviest query tiles (most keys under a causal mask) start first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const ItemExtent e = GetItemExtent(p, b);
  const int m0 = m_block * kBr;
  if (m0 >= e.nq) return;  // varlen: this item is shorter than the grid
  const int row_last = min(m0 + kBr, e.nq) - 1;
  const int d_chunks = p.head_dim / Tile::kChunkElems;

  const int hk = h / p.kv_group;
  // q, o: this item and head at row m0; k, v: this item and kv head at row 0.
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
               static_cast<int64_t>(e.q_start + m0) * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride +
               static_cast<int64_t>(e.k_start) * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride +
               static_cast<int64_t>(e.k_start) * p.v_row_stride;
  T* o = static_cast<T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
         static_cast<int64_t>(e.q_start + m0) * p.o_row_stride;

  const KeyRange keys = ForwardVisibleKeys<Tile::kOptions>(p, e.nq, e.nk, m0, row_last);
  const int n_block_min = max(keys.lo, 0) / kBc;
  const int n_block_max = keys.hi > keys.lo ? (keys.hi + kBc - 1) / kBc : n_block_min;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  float acc_o[kMSteps][kDTiles][4];
  // Per row (g and g + 8 of each block): the running max of the raw logits q.k and this lane's
  // share of the running sum of exp2(scale_log2 * (q.k - max)).
  float row_max[kMSteps][2], row_sum[kMSteps][2];
#pragma unroll
  for (int ms = 0; ms < kMSteps; ++ms) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[ms][dt][i] = 0.f;
    row_max[ms][0] = row_max[ms][1] = -INFINITY;
    row_sum[ms][0] = row_sum[ms][1] = 0.f;
  }

  // Warp-local first row (within the tile) of 16-row block ms.
  auto block_row = [&](int ms) { return (warp * kMSteps + ms) * 16; };

  if (n_block_max > n_block_min) {
    // Prologue: [Q + K of the first tile], [V of the first tile].
    LoadTile<Tile, kBr>(s_q, q, p.q_row_stride, 0, e.nq - m0, d_chunks);
    LoadTile<Tile, kBc>(s_k, k, p.k_row_stride, (n_block_max - 1) * kBc, e.nk, d_chunks);
    CpAsyncCommit();
    LoadTile<Tile, kBc>(s_v, v, p.v_row_stride, (n_block_max - 1) * kBc, e.nk, d_chunks);
    CpAsyncCommit();

    // Lane row offsets of the ldmatrix.x4 patterns (see PairOffset). A pattern (Q, and V
    // transposed): lanes 0-15 give rows 0-15 of the pair's first chunk, lanes 16-31 of its second.
    // B pattern (K): matrices (rows 0-7, chunk 0), (rows 0-7, chunk 1), (rows 8-15, chunk 0),
    // (rows 8-15, chunk 1), i.e. the B fragments of two 8-key column tiles.
    const uint32_t off_a = SwizzledOffset<kRowBytes>(lane & 15, lane >> 4);
    const uint32_t off_b =
        SwizzledOffset<kRowBytes>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    const uint32_t s_qw = s_q + warp * kMSteps * kBlockBytes;  // this warp's rows of Q

    // Q (and K of the first tile) have landed.
    CpAsyncWait<1>();
    __syncthreads();
    if (p.negate_q) {
      NegateTile<Tile, kBr>(s_q);
      __syncthreads();
    }
    uint32_t q_frag[Tile::kQInRegisters ? kMSteps : 1][Tile::kQInRegisters ? kKSteps : 1][4];
    if constexpr (Tile::kQInRegisters) {
#pragma unroll
      for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk)
          LdMatrixX4(q_frag[ms][kk], s_qw + ms * kBlockBytes + PairOffset(off_a, kk));
    }

    const float scale_log2 = p.scale_log2;
    // One key tile; with_mask is a bool, or a std::bool_constant for Tile::kMaskVariants.
    auto tile_step = [&](const int n_block, const int it, auto with_mask) {
      const int buf = it & 1;
      const uint32_t s_kb = s_k + buf * kTileBytes, s_vb = s_v + buf * kTileBytes;
      const int n0 = n_block * kBc;
      // The next tile's loads are issued unconditionally: after the last tile they zero-fill the
      // free buffers (n_rows 0) instead of branching.
      const int next0 = max(n0 - kBc, 0), next_rows = n_block > n_block_min ? e.nk : 0;

      // K_j has landed; everyone is past tile j-1, so the other K buffer is free.
      CpAsyncWait<1>();
      __syncthreads();
      LoadTile<Tile, kBc>(s_k + (buf ^ 1) * kTileBytes, k, p.k_row_stride, next0, next_rows,
                          d_chunks);
      CpAsyncCommit();

      // S = Q K_j^T (raw logits): acc_s[ms][nt] is the 16x8 block of rows block_row(ms), keys
      // n0 + 8 nt.
      float acc_s[kMSteps][kNTiles][4];
#pragma unroll
      for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_s[ms][nt][i] = 0.f;
      // float32: the tensor cores' float32 accumulation is not round-to-nearest, so long mma
      // chains drift (seen: 2.6e-5 relative error at D=128, 4097 keys). Each chain covers at
      // most kChainSteps k-steps (32 features, 64 keys) and is added to the total in IEEE float.
      constexpr int kChainSteps = 4;
      float chain[kF32 ? kMSteps : 1][kF32 ? kNTiles : 1][4];
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        if constexpr (kF32) {
          if (kk % kChainSteps == 0) {
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
              for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) chain[ms][nt][i] = 0.f;
          }
        }
        uint32_t a[kMSteps][4];
#pragma unroll
        for (int ms = 0; ms < kMSteps; ++ms) {
          if constexpr (Tile::kQInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[ms][i] = q_frag[ms][kk][i];
          } else {
            LdMatrixX4(a[ms], s_qw + ms * kBlockBytes + PairOffset(off_a, kk));
          }
        }
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          // Keys np*16 + 0..15 as the B fragments of column tiles 2 np and 2 np + 1.
          uint32_t kb[4];
          LdMatrixX4(kb, s_kb + np * kBlockBytes + PairOffset(off_b, kk));
          if constexpr (kF32) {
            const SplitFrag<4> kbs = Split(kb);
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms) {
              const SplitFrag<4> as = Split(a[ms]);
              MmaTf32x3(chain[ms][2 * np], as, kbs.hi[0], kbs.hi[1], kbs.lo[0], kbs.lo[1]);
              MmaTf32x3(chain[ms][2 * np + 1], as, kbs.hi[2], kbs.hi[3], kbs.lo[2], kbs.lo[3]);
            }
          } else {
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms) {
              Mma16816<T>(acc_s[ms][2 * np], a[ms], kb[0], kb[1]);
              Mma16816<T>(acc_s[ms][2 * np + 1], a[ms], kb[2], kb[3]);
            }
          }
        }
        if constexpr (kF32) {
          if (kk % kChainSteps == kChainSteps - 1 || kk == kKSteps - 1) {
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
              for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc_s[ms][nt][i] += chain[ms][nt][i];
          }
        }
      }

      // The softcap (options instance) rewrites every logit before the mask.
      if constexpr (Tile::kOptions) {
        if (p.softcap_log2 > 0.f) {
#pragma unroll
          for (int ms = 0; ms < kMSteps; ++ms) SoftcapTile</*kApprox=*/!kF32>(p, acc_s[ms]);
        }
      }

      // Masked logits become -inf. Only tiles on a mask edge or past the last key take this
      // variant; the rest run the softmax below with no per-element mask work.
      if (with_mask) {
#pragma unroll
        for (int ms = 0; ms < kMSteps; ++ms) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = m0 + block_row(ms) + g + half * 8;
            MaskRow(acc_s[ms], half, ForwardVisibleKeys<Tile::kOptions>(p, e.nq, e.nk, row, row),
                    n0, t);
          }
        }
      }

      // Online softmax in the log2 domain (online_softmax.cuh: one FFMA and one ex2 per logit).
#pragma unroll
      for (int ms = 0; ms < kMSteps; ++ms) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float rescale =
              OnlineSoftmaxRow(acc_s[ms], half, row_max[ms][half], row_sum[ms][half], scale_log2);
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            acc_o[ms][dt][half * 2] *= rescale;
            acc_o[ms][dt][half * 2 + 1] *= rescale;
          }
        }
      }

      // P as A fragments (16-bit types): keys 16 kk .. 16 kk + 15 are S column tiles 2 kk and
      // 2 kk + 1. float32 keeps P in acc_s and splits it per k-step below.
      uint32_t p_frag[kF32 ? 1 : kMSteps][kF32 ? 1 : kBc / 16][4];
      if constexpr (!kF32) {
#pragma unroll
        for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
          for (int kk = 0; kk < kBc / 16; ++kk) {
            p_frag[ms][kk][0] = PackPair<T>(acc_s[ms][2 * kk][0], acc_s[ms][2 * kk][1]);
            p_frag[ms][kk][1] = PackPair<T>(acc_s[ms][2 * kk][2], acc_s[ms][2 * kk][3]);
            p_frag[ms][kk][2] = PackPair<T>(acc_s[ms][2 * kk + 1][0], acc_s[ms][2 * kk + 1][1]);
            p_frag[ms][kk][3] = PackPair<T>(acc_s[ms][2 * kk + 1][2], acc_s[ms][2 * kk + 1][3]);
          }
      }

      // V_j has landed; everyone is past P V_{j-1}, so the other V buffer is free.
      CpAsyncWait<1>();
      __syncthreads();
      LoadTile<Tile, kBc>(s_v + (buf ^ 1) * kTileBytes, v, p.v_row_stride, next0, next_rows,
                          d_chunks);
      CpAsyncCommit();

      if constexpr (kF32) {
        // O += P V_j, 8 keys per k-step in the order (2t, 2t+1) <-> A columns (t, t+4); each
        // 8-wide column tile sums this tile's keys in its own chain (see kChainSteps).
        SplitFrag<4> pa[kMSteps][kNTiles];
#pragma unroll
        for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            const uint32_t x[4] = {
                __float_as_uint(acc_s[ms][nt][0]), __float_as_uint(acc_s[ms][nt][2]),
                __float_as_uint(acc_s[ms][nt][1]), __float_as_uint(acc_s[ms][nt][3])};
            pa[ms][nt] = Split(x);
          }
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          float pv_chain[kMSteps][4] = {};
          // V[key][dt*8 + g] and V[key + 1][dt*8 + g]: chunk 2 dt + g/4, word g % 4.
          const int col = dt * 8 + g;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            const int key = nt * 8 + 2 * t;
            uint32_t vb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const uint32_t addr =
                  s_vb + SwizzledOffset<kRowBytes>(key + i, col / 4) + (col % 4) * 4;
              asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(vb[i]) : "r"(addr));
            }
            const SplitFrag<2> vs = Split(vb);
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms) {
              MmaTf32x3(pv_chain[ms], pa[ms][nt], vs.hi[0], vs.hi[1], vs.lo[0], vs.lo[1]);
            }
          }
#pragma unroll
          for (int ms = 0; ms < kMSteps; ++ms)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[ms][dt][i] += pv_chain[ms][i];
        }
      } else {
        // O += P V_j. ldmatrix.trans of (keys 0-7 | 8-15) x (chunk 2 dp | 2 dp + 1) gives the B
        // fragments of O's column tiles 2 dp and 2 dp + 1.
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk) {
#pragma unroll
          for (int dp = 0; dp < kDTiles / 2; ++dp) {
            uint32_t vb[4];
            LdMatrixX4Trans(vb, s_vb + kk * kBlockBytes + PairOffset(off_a, dp));
#pragma unroll
            for (int ms = 0; ms < kMSteps; ++ms) {
              Mma16816<T>(acc_o[ms][2 * dp], p_frag[ms][kk], vb[0], vb[1]);
              Mma16816<T>(acc_o[ms][2 * dp + 1], p_frag[ms][kk], vb[2], vb[3]);
            }
          }
        }
      }
    };
    for (int n_block = n_block_max - 1, it = 0; n_block >= n_block_min; --n_block, ++it) {
      // The rows' keys per tile, not once per CTA as the Hopper kernel has them: held across the
      // loop, their two registers made the D = 128 16-bit options tile spill 112 bytes on sm_80
      // (none when computed here; a chunk size's division is one per tile, not per logit).
      const bool with_mask = ForwardTileNeedsMask<Tile::kOptions>(
          p, e, ForwardKeysOfEveryRow<Tile::kOptions>(p, e, m0, row_last), m0, row_last,
          n_block * kBc, kBc);
      if constexpr (Tile::kMaskVariants) {
        if (with_mask) {
          tile_step(n_block, it, std::true_type());
        } else {
          tile_step(n_block, it, std::false_type());
        }
      } else {
        tile_step(n_block, it, with_mask);
      }
    }
    CpAsyncWait<0>();
  }

  // Epilogue: O = acc * o_scale / l (0 for rows that saw no key), staged through this warp's own
  // rows of the Q tile (no other warp reads them) so global stores are whole 16-byte chunks. The
  // options instance adds the head's sink to l (AddSink) and takes the LSE from it.
#pragma unroll
  for (int ms = 0; ms < kMSteps; ++ms) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = QuadSum(row_sum[ms][half]);
      float inv = l > 0.f ? p.o_scale / l : 0.f;
      float lse2 = 0.f;  // options: the row's log2-sum-exp, the sink in it
      if constexpr (Tile::kOptions) {
        lse2 = RowLse2(row_max[ms][half], l, p.scale_log2);
        if (p.sinks != nullptr) inv *= AddSink(p.sinks[h], lse2);
      }
      const int r = block_row(ms) + g + half * 8;  // row within the tile
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const float x0 = acc_o[ms][dt][half * 2] * inv, x1 = acc_o[ms][dt][half * 2 + 1] * inv;
        // Columns dt*8 + 2t, +1.
        if constexpr (kF32) {
          const uint32_t addr = s_q + SwizzledOffset<kRowBytes>(r, dt * 2 + t / 2) + (t % 2) * 8;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x0), "f"(x1));
        } else {
          const uint32_t addr = s_q + SwizzledOffset<kRowBytes>(r, dt) + t * 4;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(PackPair<T>(x0, x1)));
        }
      }
      if (p.lse != nullptr && t == 0 && m0 + r < e.nq) {
        // Natural-log LSE: scale_log2 * row_max is max(scale * s) * log2(e).
        const float lse = Tile::kOptions ? lse2 * kLn2
                          : l > 0.f      ? (row_max[ms][half] * p.scale_log2 + log2f(l)) * kLn2
                                         : -INFINITY;
        p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + e.q_start + m0 + r] = lse;
      }
    }
  }
  __syncwarp();
  constexpr int kWarpRows = kMSteps * 16;
#pragma unroll
  for (int i = 0; i < kWarpRows * Tile::kChunks / 32; ++i) {
    const int idx = lane + i * 32;
    const int r = warp * kWarpRows + idx / Tile::kChunks;
    const int c = idx % Tile::kChunks;
    if (m0 + r < e.nq && c < d_chunks) {
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(s_q + SwizzledOffset<kRowBytes>(r, c)));
      *reinterpret_cast<uint4*>(o + r * p.o_row_stride + c * Tile::kChunkElems) = val;
    }
  }
}

}  // namespace attention::cuda
