// FlashAttention forward for Hopper (ForwardVariant::kWgmmaSm90, sm_90a only): TMA tile loads
// into 128-byte-swizzled shared memory on an mbarrier pipeline, wgmma for Q K^T and P V, and warp
// specialisation (one producer warpgroup, two or three consumer warpgroups, registers moved from
// the first to the others with setmaxnreg), persistent CTAs fed by a dynamic tile scheduler.
// float16 and bfloat16, and float8 e4m3 (o in bfloat16), float32 accumulation.
//
// A CTA (at most one per SM, 128 x (1 + kConsumers) threads) loops over work tiles = (query tile
// of kBr = 64 x kConsumers rows, query head, batch item), taken in the order and the way
// sm90_schedule.h describes:
//   warpgroup 0 (producer): one thread publishes each work tile and issues its TMA loads: the Q
//     tile (kD/64 boxes of kBr rows x 64 columns) into one of kQBuffers buffers once the
//     consumers have issued their last Q K^T of the work tile that used it before (with two
//     buffers the next tile's Q loads while the current one's last key tiles still run), then K
//     and V tiles of kBc keys into kStages stages (counted across work tiles), each stage guarded
//     by a "full" barrier (TMA transaction bytes) and an "empty" one (one arrival per consumer
//     warp). The rest of the warpgroup idles on 24 registers.
//   warpgroups 1 .. kConsumers (consumers, the rest of the registers): rows 64 wg .. 64 wg + 63
//     of the tile each. Per key tile: S = Q K^T as kD/16 wgmma m64n{kBc}k16 with both operands
//     in shared memory (K-major; the 16-element k-step advances the descriptor by 32 bytes inside
//     the swizzled 128-byte row, the next 64 columns are the next TMA box); the element mask
//     (masks.cuh) only on tiles that need it; the online softmax of the mma.sync kernel
//     (online_softmax.cuh: the wgmma accumulator of a warp is the accumulator of kBc/8 m16n8
//     tiles, so the same helpers run on it); P rounded to T and kept in registers as the A
//     operand of kBc/16 wgmma m64n{kD}k16 for O += P V, V read MN-major (rows of keys, as TMA
//     stores them). Inside a consumer the key tiles are software-pipelined: S_i = Q K_i^T is
//     issued before O += P_{i-1} V_{i-1}, so the softmax of tile i overlaps the P V of tile i-1
//     on the tensor cores. The epilogue (O = acc * o_scale / l, LSE) runs while the producer
//     already loads the next work tile: O by stmatrix into shared memory and one TMA store per
//     64-column box, which the consumers do not wait for (the 16-bit D = 256 tile has no room
//     beside its tiles and puts O in the V stages, whose next loads wait for the stores to have
//     read it; warpgroups whose rows start before the item's store from registers).
//   float8 e4m3 (head dims 128 and 256): the same with 128-byte rows of 128 elements, k32 wgmma
//     (QGMMA) for both products, P rounded to e4m3 as 2^(s - max + 8) (in [0, 256], so that
//     probabilities down to 2^-14 stay e4m3 normals; l carries the factor, the LSE drops it).
//     wgmma takes 8-bit operands K-major only, so P V reads V^T (KernelParams::v_transposed,
//     [B, Hkv, D, keys rounded up to 16], written by LaunchTransposeE4m3V before the kernel, each
//     16-key group in the order the P registers hold the keys: see to_p), by TMA boxes of 128
//     keys x kD rows.
//   Key tiles are visited last to first (the masked diagonal and ragged tiles first), tiles
//   outside every row's window never loaded: the range of VisibleKeys for the CTA's rows.
// Any Nq, Nk (an item's query tiles end at its last row, so the first may start before row 0:
// TMA reads zeros outside a tensor, the mask drops keys past Nk, rows before row 0 are not
// stored, and a warpgroup that has some stores O from registers), GQA/MQA through the K/V head
// coordinate, BHSD and BSHD and any 16-byte-aligned strides through the tensor maps, varlen (one
// packed map; query rows of the previous item that a tile overlaps are not stored, keys of the
// next one are masked and their V is finite: HostRunner sends requests with a non-finite V to the
// exact CPU path), windows and both mask alignments, LSE, head dims that are multiples of 8 up to
// 256 (columns past head_dim read as zeros and are not stored).
// Open-model options (Sm90Tile::kOptions: the 16-bit tiles once more, the plain ones having none
// of this code; float8 calls with options are dequantised to bfloat16 first): chunks cut the keys
// of the work tile, of each warpgroup and of each row as windows do (ChunkedVisibleKeys), the
// softcap rewrites S before the mask (Softcap by tanh.approx, one MUFU op: the softmax then at
// scale 1), and the head's sink joins l in the epilogue (AddSink).
// Falls back to mma_sm80 (the plan's rule, forward_plan.cc): float32, and devices other than
// compute capability 9.0. float8 e4m3 at head dim 64, at head dims whose padding to 8 is not a
// multiple of 16, and varlen float8 calls run here (or on mma_sm80) after HostRunner's
// dequantisation to bfloat16.
// Tiles per head dim: Sm90TileFor (flash_forward_sm90_launch.cuh).
//
// Current speed (v12, 2026-12-02, H200; bench/README.md has the grid and the command): on the
// FlashAttention grid's rows with N >= 1024, 1.01-1.28x cuDNN on all 60, 0.91-1.33x
// FlashAttention-3 (bfloat16), and float8 0.87-1.42x FlashAttention-3's float8 forward. The
// versions before this one, and the designs measured and dropped: docs/kernels.md.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/forward/sm90_schedule.h"
#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/masks.cuh"
#include "kernels/cuda/ops/mma_ops.cuh"
#include "kernels/cuda/ops/online_softmax.cuh"
#include "kernels/cuda/ops/wgmma_ops.cuh"

namespace attention::cuda {

// The kernel's parameters: the common ones and the tensor maps of Q, K and V (4-D: head_dim,
// rows, heads, batch items; varlen: one item of total rows), made per launch on the host.
struct Sm90Params {
  KernelParams p;
  CUtensorMap q, k, v;  // 64-byte aligned types; float8: v maps KernelParams::v_transposed
  CUtensorMap o;        // boxes of 64 rows for the TMA stores of O, where o_by_tma
  bool o_by_tma;        // the tile stores O by TMA and o's address and strides allow it
};

template <typename T, int kD_, int kBc_, int kStages_, int kConsumers_, int kQBuffers_ = 1,
          bool kOptions_ = false>
struct Sm90Tile {
  using Element = T;
  // float8 e4m3: Q and K as they come, V transposed (KernelParams::v_transposed), P rounded to
  // e4m3 for P V, o in bfloat16.
  static constexpr bool kFloat8 = sizeof(T) == 1;
  using Output = std::conditional_t<kFloat8, __nv_bfloat16, T>;
  static constexpr int kD = kD_;
  static constexpr int kBc = kBc_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumers = kConsumers_;  // consumer warpgroups of 64 rows each
  static constexpr int kBr = 64 * kConsumers;     // query rows per CTA
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kBoxCols = 128 / sizeof(T);  // elements in one 128-byte swizzled row
  static constexpr int kDBlocks = kD / kBoxCols;
  static constexpr int kQBytes = kBr * kD * sizeof(T);
  static constexpr int kKvBytes = kBc * kD * sizeof(T);  // one K (or V) stage
  // wgmma k-steps (32 bytes: k16 of 16-bit types, k32 of e4m3) of Q K^T over D, of P V over keys.
  static constexpr int kQkSteps = kD * sizeof(T) / 32;
  static constexpr int kPvSteps = kBc * sizeof(T) / 32;
  // float8 P is exp2(s - max + 8), in [0, 256], so that small probabilities stay e4m3 normals
  // (down to 2^-6 * 2^-8 of the row's largest instead of 2^-6); l carries the same factor, so o
  // is unchanged and the LSE subtracts it.
  static constexpr int kPLog2Gain = kFloat8 ? 8 : 0;
  // Q buffers: with two, the producer loads the next work tile's Q while the consumers still
  // run the current one's last key tiles (with one, only after their last Q K^T).
  static constexpr int kQBuffers = kQBuffers_;
  // true: the open-model options instance (KernelParams' sinks, softcap and chunk_size, read at
  // run time; 16-bit only); false: the plain one, which has none of their code. Options is the
  // same tile's.
  static constexpr bool kOptions = kOptions_;
  using Options = Sm90Tile<T, kD_, kBc_, kStages_, kConsumers_, kQBuffers_, true>;
  // The barriers: q_full and q_empty per Q buffer, k_full, v_full, k_empty and v_empty per
  // stage, and o_empty (used where kOInV).
  static constexpr int kBarriers = 2 * kQBuffers + 4 * kStages + 1;
  static constexpr int kBarrierBytes = (8 * kBarriers + 15) / 16 * 16;  // the slots' alignment
  // Each Q buffer's work tile as the producer publishes it (Sm90WorkTile, 16-byte aligned).
  static constexpr int kTileSlotBytes = 48;
  // 1024 bytes of slack to align the tiles to the swizzle's 1024-byte groups, the barriers,
  // and the work tile slots after them.
  static constexpr int kLoadSmemBytes = 1024 + kQBuffers * kQBytes + 2 * kStages * kKvBytes +
                                        kBarrierBytes + kTileSlotBytes * kQBuffers;
  // O of the consumers (64 rows x kD each) is stored through shared memory by TMA, in boxes of
  // 64 rows x 128 bytes (kOBoxCols elements) swizzled as the loads'. They lie beside the other
  // tiles where there is room (kOBeside); otherwise (16-bit D = 256) in the V stages, as
  // FlashAttention-3 places them (kOInV): the consumers write them there once every one of them
  // has finished its P V, and the producer loads the next work tile's V only once the stores
  // have read them (o_empty).
  static constexpr int kOBoxCols = 128 / sizeof(Output);
  static constexpr int kOTileBytes = kConsumers * 64 * kD * sizeof(Output);
  static constexpr bool kOBeside = kLoadSmemBytes + kOTileBytes <= 227 * 1024;
  static constexpr bool kOInV = !kOBeside && kOTileBytes <= kStages * kKvBytes;
  static constexpr bool kTmaStoreO = kOBeside || kOInV;
  static constexpr int kOBytes = kOBeside ? kOTileBytes : 0;
  static constexpr int kSmemBytes = kLoadSmemBytes + kOBytes;
  // setmaxnreg: the producer keeps 24 registers (32 beside three consumers, which need fewer
  // each); the consumers share the rest of the 64K-register file (multiples of 8).
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;

  static_assert(sizeof(T) == 2 || sizeof(T) == 1, "16-bit or e4m3 elements");
  static_assert(kD % kBoxCols == 0 && kD <= 256);
  static_assert(kD % kOBoxCols == 0);
  static_assert(kBc % 16 == 0 && kBc <= 256 && (kBc * 128) % 1024 == 0);
  // float8 V^T stages are boxes of 128 keys (one swizzled row) by kD rows.
  static_assert(!kFloat8 || kBc % 128 == 0);
  static_assert(kConsumers == 2 || kConsumers == 3);
  static_assert(!kOptions || !kFloat8, "float8 calls with options are dequantised first");
  static_assert(kQBuffers == 1 || kQBuffers == 2);
  static_assert(kSmemBytes <= 227 * 1024, "the most shared memory a CTA may take");
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536);
  // Shared addresses below 2^18: DescPlus moves descriptors on without a carry (smem_desc.h).
  static_assert(kSmemBytes < (1 << 18));
};

// One work tile: a query tile of one head of one batch item, and the key tiles it visits
// (n_block_max - 1 down to n_block_min; none when no row sees a key or the item is shorter).
// An item's query tiles end at its last row: m0 = nq - (m_blocks - m_block) kBr, so where nq is
// not a multiple of kBr the first tile starts before row 0 (those rows are computed on, from
// zeros or the previous item's rows, and never stored). Under a causal mask that ragged tile is
// then the one that sees the fewest keys, where aligned to row 0 it was the last, which sees the
// most: at D = 64, N = 1024 (192-row tiles) the key tiles of a head's six work tiles go from
// 2 + 3 + 5 + 6 + 8 + 8 to 1 + 2 + 4 + 5 + 7 + 8.
struct Sm90WorkTile {
  int m0, h, b;
  ItemExtent e;
  int n_block_min, n_block_max;
  __device__ int n_tiles() const { return n_block_max - n_block_min; }
};

template <int kBr, int kBc, bool kOptions>
__device__ __forceinline__ Sm90WorkTile GetWorkTile(const KernelParams& p, const Sm90Schedule& sc,
                                                    int pos) {
  Sm90WorkTile wt;
  const Sm90TileCoords at = Sm90TileAt(sc, pos);
  wt.h = at.pair % p.heads_q;
  wt.b = at.pair / p.heads_q;
  wt.e = GetItemExtent(p, wt.b);
  wt.m0 = wt.e.nq - (sc.m_blocks - at.m_block) * kBr;
  wt.n_block_min = wt.n_block_max = 0;
  if (wt.m0 + kBr <= 0) return wt;  // varlen: this item is shorter than the grid
  const KeyRange keys =
      ForwardVisibleKeys<kOptions>(p, wt.e.nq, wt.e.nk, max(wt.m0, 0), wt.m0 + kBr - 1);
  wt.n_block_min = max(keys.lo, 0) / kBc;
  wt.n_block_max = keys.hi > keys.lo ? (keys.hi + kBc - 1) / kBc : wt.n_block_min;
  return wt;
}

// The producer decodes each work tile once and publishes it with its position (>= work_tiles: no
// more work) in the Q buffer's slot (12 ints), before it arrives on the buffer's q_full: the
// consumers' round then starts with three shared loads and shuffles instead of the schedule's
// integer divisions, while both their tensor-core queues are empty.
__device__ __forceinline__ void PublishWorkTile(uint32_t slot, int pos, const Sm90WorkTile& wt) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(pos), "r"(wt.m0),
               "r"(wt.h), "r"(wt.b)
               : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + 16), "r"(wt.e.q_start),
               "r"(wt.e.k_start), "r"(wt.e.nq), "r"(wt.e.nk)
               : "memory");
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(slot + 32), "r"(wt.n_block_min),
               "r"(wt.n_block_max)
               : "memory");
}
// The work tile of `slot` as a consumer warp reads it: by lane 0 alone, the lane that later
// arrives on q_empty (that arrival is what lets the producer overwrite the slot, so no other
// lane's read can be left unordered with the next write: compute-sanitizer racecheck reported
// exactly that once CTAs ran several rounds), then shuffled to the warp, so the compiler knows the
// values are warp-uniform. Returns the position.
__device__ __forceinline__ int ReadWorkTile(uint32_t slot, Sm90WorkTile* wt) {
  int v[10] = {};
  if (threadIdx.x % 32 == 0) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(slot)
                 : "memory");
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[4]), "=r"(v[5]), "=r"(v[6]), "=r"(v[7])
                 : "r"(slot + 16)
                 : "memory");
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                 : "=r"(v[8]), "=r"(v[9])
                 : "r"(slot + 32)
                 : "memory");
  }
#pragma unroll
  for (int j = 0; j < 10; ++j) v[j] = __shfl_sync(0xffffffffu, v[j], 0);
  *wt = {.m0 = v[1],
         .h = v[2],
         .b = v[3],
         .e = {.q_start = v[4], .k_start = v[5], .nq = v[6], .nk = v[7]},
         .n_block_min = v[8],
         .n_block_max = v[9]};
  return v[0];
}

// A persistent kernel: gridDim.x CTAs (at most one per SM) loop over the work tiles. The producer
// runs ahead across tiles (the next tile's Q as soon as the consumers have issued their last
// Q K^T, its K and V as stages free up), so a tile's epilogue overlaps the next tile's loads.
template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    FlashForwardSm90Kernel(const __grid_constant__ Sm90Params sp) {
#if ATTENTION_SM90A
  using T = typename Tile::Element;
  using OutT = typename Tile::Output;
  constexpr bool kFloat8 = Tile::kFloat8;
  constexpr int kBoxCols = Tile::kBoxCols, kPvSteps = Tile::kPvSteps;
  constexpr int kD = Tile::kD, kBr = Tile::kBr, kBc = Tile::kBc, kStages = Tile::kStages;
  constexpr int kDBlocks = Tile::kDBlocks, kKvBytes = Tile::kKvBytes;
  constexpr int kNTiles = kBc / 8;  // 8-key column tiles of S
  constexpr int kDTiles = kD / 8;   // 8-wide column tiles of O
  constexpr uint32_t kRowBytes = 128;
  constexpr int kConsumerWarps = 4 * Tile::kConsumers;
  const KernelParams& p = sp.p;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Tiles of 128-byte rows (kBoxCols elements): Q [kQBuffers][kDBlocks][kBr], K
  // [kStages][kDBlocks][kBc], V [kStages][kDBlocks][kBc] (rows of keys), float8 V^T
  // [kStages][kBc / 128][kD] (rows of D); then O [kConsumers][kD / kOBoxCols][64] (Output).
  constexpr int kQBuffers = Tile::kQBuffers, kQb = 2 * kQBuffers;  // barriers before the stages'
  const uint32_t s_q0 = (SmemAddress(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_k = s_q0 + kQBuffers * Tile::kQBytes;
  const uint32_t s_v = s_k + kStages * kKvBytes;
  // O of each consumer (Tile::kTmaStoreO): after the V stages, or in them (Tile::kOInV).
  const uint32_t s_o = Tile::kOInV ? s_v : s_v + kStages * kKvBytes;
  const uint32_t bars = s_v + kStages * kKvBytes + Tile::kOBytes;
  // Work tile `round` of the CTA uses Q buffer round % kQBuffers: its tiles, its barriers (and
  // their parity) and the slot where the producer publishes the work tile.
  auto q_buffer = [&](int round) { return round % kQBuffers; };
  auto q_parity = [&](int round) { return static_cast<uint32_t>((round / kQBuffers) & 1); };
  auto s_q = [&](int b) { return s_q0 + b * Tile::kQBytes; };
  auto q_full = [&](int b) { return bars + 8u * b; };
  auto q_empty = [&](int b) { return bars + 8u * (kQBuffers + b); };
  auto tile_slot = [&](int b) { return bars + Tile::kBarrierBytes + Tile::kTileSlotBytes * b; };
  auto k_full = [&](int s) { return bars + 8u * (kQb + s); };
  auto v_full = [&](int s) { return bars + 8u * (kQb + kStages + s); };
  auto k_empty = [&](int s) { return bars + 8u * (kQb + 2 * kStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * (kQb + 3 * kStages + s); };
  const uint32_t o_empty = bars + 8u * (kQb + 4 * kStages);
  // Key tile `it` of the CTA's whole run (counted across work tiles): its stage and the parity of
  // the stage's barriers.
  auto stage = [&](int it) { return it % kStages; };
  auto parity = [&](int it) { return static_cast<uint32_t>((it / kStages) & 1); };

  const Sm90Schedule schedule = MakeSm90Schedule(p.seqlen_q, kBr, p.heads_q, p.batch,
                                                 p.window_left >= 0 || p.window_right >= 0);
  // Tensor-map item coordinate: varlen maps hold one item of packed rows.
  const bool varlen = p.cu_seqlens_q != nullptr;

  // Read through a shuffle, so the compiler knows it is the same across a warp: the wgmma
  // descriptors built from it (Q's rows of each consumer) then stay in uniform registers, where
  // from threadIdx.x alone they were rebuilt per thread before every wgmma (measured with v6).
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  if (threadIdx.x == 0) {
    for (int b = 0; b < kQBuffers; ++b) {
      MbarInit(q_full(b), 1);
      MbarInit(q_empty(b), kConsumerWarps);  // one arrival per consumer warp
    }
    for (int s = 0; s < kStages; ++s) {
      MbarInit(k_full(s), 1);
      MbarInit(v_full(s), 1);
      MbarInit(k_empty(s), kConsumerWarps);
      MbarInit(v_empty(s), kConsumerWarps);
    }
    MbarInit(o_empty, Tile::kConsumers);  // one arrival per consumer warpgroup
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    WarpgroupRegistersDown<Tile::kProducerRegs>();
    if (threadIdx.x != 0) return;  // the consumers wait for every load, so the CTA outlives them
    // Per work tile (a "round"): decode it, wait until the consumers are done with the round's Q
    // buffer, publish the tile in its slot (position >= work_tiles: no more work), arrive on its
    // q_full (with Q's bytes when the tile has keys), then stream its K and V tiles, and only then
    // draw the next position (drawn before the loads, a CTA commits to its next tile a whole tile
    // earlier, which balances the heaviest-first order's tail worse: 2-3% slower at D = 256
    // causal).
    int it = 0;       // key tiles so far
    int o_tiles = 0;  // work tiles with keys so far (Tile::kOInV)
    int pos = blockIdx.x;
    for (int round = 0;; ++round) {
      const int qb = q_buffer(round);
      const bool last = pos >= schedule.work_tiles;
      Sm90WorkTile wt{};
      if (!last) wt = GetWorkTile<kBr, kBc, Tile::kOptions>(p, schedule, pos);
      MbarWait(q_empty(qb), q_parity(round) ^ 1);
      PublishWorkTile(tile_slot(qb), pos, wt);
      if (last) {
        MbarArrive(q_full(qb));
        break;
      }
      if (wt.n_tiles() == 0) {
        MbarArrive(q_full(qb));
      } else {
        const int map_b = varlen ? 0 : wt.b, hk = wt.h / p.kv_group;
        MbarArriveExpectTx(q_full(qb), Tile::kQBytes);
#pragma unroll
        for (int c = 0; c < kDBlocks; ++c) {
          TmaLoad4d(s_q(qb) + c * kBr * kRowBytes, &sp.q, q_full(qb), c * kBoxCols,
                    wt.e.q_start + wt.m0, wt.h, map_b);
        }
        // The K and V tiles of keys `row` .. into stage s once the consumers have freed it.
        auto load_k = [&](int s, uint32_t phase, int row) {
          MbarWait(k_empty(s), phase ^ 1);
          MbarArriveExpectTx(k_full(s), kKvBytes);
#pragma unroll
          for (int c = 0; c < kDBlocks; ++c) {
            TmaLoad4d(s_k + s * kKvBytes + c * kBc * kRowBytes, &sp.k, k_full(s), c * kBoxCols, row,
                      hk, map_b);
          }
        };
        auto load_v = [&](int s, uint32_t phase, int row) {
          MbarWait(v_empty(s), phase ^ 1);
          MbarArriveExpectTx(v_full(s), kKvBytes);
          if constexpr (kFloat8) {
            // V^T: boxes of 128 keys by kD rows (rows past head_dim read as zeros).
#pragma unroll
            for (int c = 0; c < kBc / 128; ++c) {
              TmaLoad4d(s_v + s * kKvBytes + c * kD * kRowBytes, &sp.v, v_full(s), row + c * 128, 0,
                        hk, map_b);
            }
          } else {
#pragma unroll
            for (int c = 0; c < kDBlocks; ++c) {
              TmaLoad4d(s_v + s * kKvBytes + c * kBc * kRowBytes, &sp.v, v_full(s), c * kBoxCols,
                        row, hk, map_b);
            }
          }
        };
        for (int i = 0; i < wt.n_tiles(); ++i, ++it) {
          const int row = wt.e.k_start + (wt.n_block_max - 1 - i) * kBc;
          load_k(stage(it), parity(it), row);
          if (Tile::kOInV && i == 0) {
            // O of the last work tile with keys lies in the V stages until its stores have read
            // it (each such tile's consumers arrive once, and none can finish this one before
            // its first V, so o_empty is never more than one phase ahead of this wait).
            if (o_tiles > 0) MbarWait(o_empty, (o_tiles - 1) & 1);
            ++o_tiles;
          }
          load_v(stage(it), parity(it), row);
        }
      }
      pos = gridDim.x + atomicAdd(&p.tile_counters[0], 1);
    }
    // Every CTA has drawn its last position once all have counted themselves out here: the last
    // one leaves the counters zero for the next launch on the stream (the fences order each
    // CTA's last draw before its count, and the counts before the reset).
    __threadfence();
    if (atomicAdd(&p.tile_counters[1], 1) == static_cast<int>(gridDim.x) - 1) {
      __threadfence();
      atomicExch(&p.tile_counters[0], 0);
      atomicExch(&p.tile_counters[1], 0);
    }
    return;
  }

  WarpgroupRegistersUp<Tile::kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  int it = 0;  // key tiles so far
  for (int round = 0;; ++round) {
    const int qb = q_buffer(round);
    const uint32_t s_qw = s_q(qb) + wg * 64 * kRowBytes;  // this warpgroup's rows of each Q box
    MbarWait(q_full(qb), q_parity(round));
    Sm90WorkTile wt;
    if (ReadWorkTile(tile_slot(qb), &wt) >= schedule.work_tiles) break;
    const ItemExtent& e = wt.e;
    const int n_tiles = wt.n_tiles();
    // This warpgroup's rows in the item: wg_row0 .. wg_row0 + 63 (< nq, as tiles end at the
    // item's last row), of which those from wg_row_first on are the item's.
    const int wg_row0 = wt.m0 + wg * 64;
    const int wg_row_first = max(wg_row0, 0), wg_row_last = wg_row0 + 63;
    auto first_key = [&](int i) { return (wt.n_block_max - 1 - i) * kBc; };
    // The work tile's key tiles i0 .. i1 - 1 are the ones this warpgroup's own rows see: fewer
    // than the CTA's on a causal diagonal when kBc < kBr (D = 256: the lower 64 rows often skip
    // the first tile), none when all its rows lie before the item's start (the first tile of an
    // item whose length is not a multiple of kBr: at D = 64, N = 1024, two warpgroups of three).
    // The others it only frees once they are loaded, computing nothing, which leaves the tensor
    // cores to the other consumers.
    int i0 = n_tiles, i1 = n_tiles;
    if (wg_row_last >= 0) {
      const KeyRange keys =
          ForwardVisibleKeys<Tile::kOptions>(p, e.nq, e.nk, wg_row_first, wg_row_last);
      if (keys.hi > keys.lo) {
        i0 = min(max(wt.n_block_max - (keys.hi + kBc - 1) / kBc, 0), n_tiles);
        i1 = min(max(wt.n_block_max - max(keys.lo, 0) / kBc, i0), n_tiles);
      }
    }
    auto pass_over = [&](int from, int to) {
      for (int i = from; i < to; ++i) {
        MbarWait(k_full(stage(it + i)), parity(it + i));
        if (lane == 0) MbarArrive(k_empty(stage(it + i)));
        MbarWait(v_full(stage(it + i)), parity(it + i));
        if (lane == 0) MbarArrive(v_empty(stage(it + i)));
      }
    };
    pass_over(0, i0);
    // Once per work tile, not per key tile: the keys every row of the warpgroup sees (the tiles
    // that need no element mask) and, in the options instance, the keys of this thread's two rows
    // (its element masks); the chunk bounds hold integer divisions. The plain instance computes
    // its rows' keys (VisibleKeys, no division) on the tiles that need them.
    const KeyRange every_row =
        ForwardKeysOfEveryRow<Tile::kOptions>(p, e, wg_row_first, wg_row_last);
    auto row_of = [&](int half) { return wg_row0 + warp * 16 + g + half * 8; };
    KeyRange chunked_row_keys[2] = {};
    if constexpr (Tile::kOptions) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        chunked_row_keys[half] = ChunkedVisibleKeys(p, e.nq, e.nk, row_of(half), row_of(half));
      }
    }

    float acc_o[kDTiles][4];
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc_o[dt][j] = 0.f;
    float(&o_flat)[kD / 2] = reinterpret_cast<float(&)[kD / 2]>(acc_o);

    if (i0 == i1 && lane == 0) MbarArrive(q_empty(qb));  // nothing to read from Q
    if (i0 < i1) {
      if (p.negate_q) {
        // A negative scale runs as |scale| on -Q (KernelParams): flip the sign bits of this
        // warpgroup's 64 rows, then make the generic-proxy stores visible to wgmma.
        const int tid = threadIdx.x % 128;
#pragma unroll
        for (int c = 0; c < kDBlocks; ++c) {
          const uint32_t base = s_qw + c * kBr * kRowBytes;
#pragma unroll
          for (int j = 0; j < 64 * kRowBytes / 16 / 128; ++j) {
            const uint32_t addr = base + (tid + j * 128) * 16;
            uint4 x;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                         : "r"(addr));
            constexpr uint32_t kSigns = kFloat8 ? 0x80808080u : 0x80008000u;
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                         "r"(x.x ^ kSigns), "r"(x.y ^ kSigns), "r"(x.z ^ kSigns),
                         "r"(x.w ^ kSigns));
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        WarpgroupSync(1 + wg);
      }

      // S = Q K^T of key tile i of this work tile (the CTA's key tile it0 + i) issued and
      // committed: acc_s[nt] is the 16x8 block of this warp's rows, keys first_key(i) + 8 nt. The
      // 32-byte k-step advances the descriptors by 32 bytes inside the swizzled 128-byte row, the
      // next 64 columns by one TMA box: each k-step's descriptor is the tile's first moved on by
      // a constant (DescPlus), one addition per wgmma instead of a whole descriptor.
      const int it0 = it;
      auto issue_qk = [&](int i, float(&acc_s)[kNTiles][4]) {
        const uint32_t s_ks = s_k + stage(it0 + i) * kKvBytes;
        const uint64_t da0 = SmemDesc128B(s_qw, 16, 1024), db0 = SmemDesc128B(s_ks, 16, 1024);
        MbarWait(k_full(stage(it0 + i)), parity(it0 + i));
        WgmmaFence();
#pragma unroll
        for (int ks = 0; ks < Tile::kQkSteps; ++ks) {
          const uint32_t col = (ks / 4), sub = (ks % 4) * 32;
          WgmmaSS(WgmmaTag<T, kBc>(), reinterpret_cast<float(&)[kBc / 2]>(acc_s),
                  DescPlus(da0, (col * kBr * kRowBytes + sub) >> 4),
                  DescPlus(db0, (col * kBc * kRowBytes + sub) >> 4), ks > 0);
        }
        WgmmaCommit();
      };
      // O += P V of key tile i issued and committed. 16-bit: keys 16 kk.. of V are rows 16 kk..
      // of each 64-column box (MN-major: the next 8 keys 1024 bytes on, the next 64 columns one
      // box, kBc rows, on). float8: V^T is K-major like K in Q K^T, keys 32 kk.. 32 bytes on in
      // the 128-byte rows of box kk / 4. Descriptors moved on from the stage's first, as above.
      auto issue_pv = [&](int i, const uint32_t(&p_frag)[kPvSteps][4]) {
        const uint32_t s_vs = s_v + stage(it0 + i) * kKvBytes;
        const uint64_t db0 =
            kFloat8 ? SmemDesc128B(s_vs, 16, 1024) : SmemDesc128B(s_vs, kBc * kRowBytes, 1024);
        MbarWait(v_full(stage(it0 + i)), parity(it0 + i));
        FenceRegisters(o_flat);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) {
          const uint32_t offset =
              kFloat8 ? (kk / 4) * kD * kRowBytes + (kk % 4) * 32 : kk * 16 * kRowBytes;
          WgmmaRS(WgmmaTag<T, kD>(), o_flat, p_frag[kk], DescPlus(db0, offset >> 4), 1);
        }
        WgmmaCommit();
      };
      // Once S of key tile i has landed: the stage's K is free and, after the last key tile,
      // so is Q (the producer may load the next work tile's).
      auto release_k = [&](int i) {
        if (lane != 0) return;
        MbarArrive(k_empty(stage(it0 + i)));
        if (i == i1 - 1) MbarArrive(q_empty(qb));
      };
      // Softcap (options instance), mask (on tiles that need it) and online softmax of key tile
      // i's logits, in place; per row the rescale of the earlier terms.
      auto softmax = [&](int i, float(&acc_s)[kNTiles][4], float(&rescale)[2]) {
        const int n0 = first_key(i);
        if constexpr (Tile::kOptions) {
          if (p.softcap_log2 > 0.f) SoftcapTile</*kApprox=*/true>(p, acc_s);
        }
        if (ForwardTileNeedsMask<Tile::kOptions>(p, e, every_row, wg_row_first, wg_row_last, n0,
                                                 kBc)) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            MaskRow(acc_s, half,
                    Tile::kOptions ? chunked_row_keys[half]
                                   : VisibleKeys(p, e.nq, e.nk, row_of(half), row_of(half)),
                    n0, t);
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          rescale[half] = OnlineSoftmaxRow<kNTiles, Tile::kPLog2Gain>(acc_s, half, row_max[half],
                                                                      row_sum[half], p.scale_log2);
        }
      };
      // P as A fragments. 16-bit: keys 16 kk .. 16 kk + 15 are S column tiles 2 kk and 2 kk + 1.
      // float8: the k-step of keys 32 kk .. 32 kk + 31 takes S column tiles 4 kk .. 4 kk + 3 as
      // they lie, each register 4 of a row's probabilities (wgmma_ops.cuh: k = 4 t + {0..3} from
      // keys 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t of a 16-key group). So k-position q of a group holds
      // key 2 (q / 4) + q % 2 + 8 ((q / 2) % 2), and V^T stores each 16-key group in that order
      // (LaunchTransposeE4m3V), which costs no shuffle here.
      auto to_p = [&](const float(&acc_s)[kNTiles][4], uint32_t(&p_frag)[kPvSteps][4]) {
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) {
          if constexpr (kFloat8) {
            const int nt = 4 * kk;
            p_frag[kk][0] =
                PackE4m3x4(acc_s[nt][0], acc_s[nt][1], acc_s[nt + 1][0], acc_s[nt + 1][1]);
            p_frag[kk][1] =
                PackE4m3x4(acc_s[nt][2], acc_s[nt][3], acc_s[nt + 1][2], acc_s[nt + 1][3]);
            p_frag[kk][2] =
                PackE4m3x4(acc_s[nt + 2][0], acc_s[nt + 2][1], acc_s[nt + 3][0], acc_s[nt + 3][1]);
            p_frag[kk][3] =
                PackE4m3x4(acc_s[nt + 2][2], acc_s[nt + 2][3], acc_s[nt + 3][2], acc_s[nt + 3][3]);
          } else {
            p_frag[kk][0] = PackPair<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
            p_frag[kk][1] = PackPair<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
            p_frag[kk][2] = PackPair<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
            p_frag[kk][3] = PackPair<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
          }
        }
      };
      // Keeps P alive in its registers (an asynchronous wgmma reads them) until the wait.
      auto fence_p = [&](uint32_t(&p_frag)[kPvSteps][4]) {
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk)
#pragma unroll
          for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p_frag[kk][j])::"memory");
      };

      // Software pipeline inside the warpgroup: S_i = Q K_i^T is issued before O += P_{i-1}
      // V_{i-1}, and the softmax of S_i runs while that P V is on the tensor cores; O takes the
      // rescale of step i only after the P V that used step i-1's max has landed.
      uint32_t p_frag[kPvSteps][4];
      {
        float acc_s[kNTiles][4];
        issue_qk(i0, acc_s);
        WgmmaWait<0>();
        FenceRegisters(reinterpret_cast<float(&)[kBc / 2]>(acc_s));
        release_k(i0);
        float rescale[2];
        softmax(i0, acc_s, rescale);  // O is still zero: nothing to rescale
        to_p(acc_s, p_frag);
      }
      for (int i = i0 + 1; i < i1; ++i) {
        float acc_s[kNTiles][4];
        issue_qk(i, acc_s);
        issue_pv(i - 1, p_frag);
        WgmmaWait<1>();  // S_i has landed; P_{i-1} V_{i-1} may still run
        FenceRegisters(reinterpret_cast<float(&)[kBc / 2]>(acc_s));
        release_k(i);
        float rescale[2];
        softmax(i, acc_s, rescale);
        WgmmaWait<0>();
        fence_p(p_frag);
        FenceRegisters(o_flat);
        if (lane == 0) MbarArrive(v_empty(stage(it0 + i - 1)));
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[dt][0] *= rescale[0];
          acc_o[dt][1] *= rescale[0];
          acc_o[dt][2] *= rescale[1];
          acc_o[dt][3] *= rescale[1];
        }
        to_p(acc_s, p_frag);
      }
      issue_pv(i1 - 1, p_frag);
      WgmmaWait<0>();
      fence_p(p_frag);
      FenceRegisters(o_flat);
      if (lane == 0) MbarArrive(v_empty(stage(it0 + i1 - 1)));
    }
    pass_over(i1, n_tiles);
    it += n_tiles;

    // Epilogue: O = acc * o_scale / l (0 for rows that saw no key). Where the tile has room for
    // it (Tile::kTmaStoreO) and O's map could be made (Sm90Params::o_by_tma), through shared
    // memory: stmatrix of the rounded rows into this warpgroup's 128-byte-swizzled boxes, then one
    // thread's TMA stores, which clip columns past head_dim, so the consumers go on while the
    // stores run. Warpgroups whose rows start before the item's (a build that stored their boxes
    // at negative rows by TMA failed with an illegal instruction on the H200), and the other tiles,
    // store straight from the accumulators: each quad writes 16 contiguous bytes of a row per
    // 8-column tile.
    // The options instance adds the head's sink to l (AddSink) and takes the LSE from it.
    float l[2], inv[2], lse2[2] = {};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l[half] = QuadSum(row_sum[half]);
      inv[half] = l[half] > 0.f ? p.o_scale / l[half] : 0.f;
      if constexpr (Tile::kOptions) {
        lse2[half] = RowLse2(row_max[half], l[half], p.scale_log2);
        if (p.sinks != nullptr) inv[half] *= AddSink(p.sinks[wt.h], lse2[half]);
      }
    }
    // O in the V stages (Tile::kOInV; only in work tiles with keys, the ones whose V loads wait
    // for o_empty): once every consumer's last P V has read them.
    if (Tile::kOInV && n_tiles > 0) WarpgroupsSync<Tile::kConsumers>(1 + Tile::kConsumers);
    if (Tile::kTmaStoreO && sp.o_by_tma && wg_row0 >= 0 && (!Tile::kOInV || n_tiles > 0)) {
      constexpr int kOBoxCols = Tile::kOBoxCols;
      const uint32_t s_ow = s_o + wg * 64 * kD * sizeof(OutT);  // [kD / kOBoxCols][64 rows]
      const bool leader = threadIdx.x % 128 == 0;               // the thread that stores
      if (leader) TmaStoreWait<true>();  // the last work tile's stores have read the boxes
      WarpgroupSync(1 + wg);
      // Matrices (half 0, dt), (half 1, dt), (half 0, dt + 1), (half 1, dt + 1): lane l gives row
      // l % 8 of matrix l / 8, 16 bytes at its 8 columns' place in the swizzled box.
      const int m = lane / 8, m_row = warp * 16 + (m % 2) * 8 + lane % 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; dt += 2) {
        const int chunk = dt + m / 2;  // 8-column chunk of the row, 16 bytes
        const uint32_t addr = s_ow + (chunk / 8) * 64 * kRowBytes + m_row * kRowBytes +
                              (((chunk % 8) ^ (m_row % 8)) << 4);
        StoreMatrixX4(addr, PackPair<OutT>(acc_o[dt][0] * inv[0], acc_o[dt][1] * inv[0]),
                      PackPair<OutT>(acc_o[dt][2] * inv[1], acc_o[dt][3] * inv[1]),
                      PackPair<OutT>(acc_o[dt + 1][0] * inv[0], acc_o[dt + 1][1] * inv[0]),
                      PackPair<OutT>(acc_o[dt + 1][2] * inv[1], acc_o[dt + 1][3] * inv[1]));
      }
      FenceProxyAsyncShared();
      WarpgroupSync(1 + wg);
      if (leader) {
#pragma unroll
        for (int c = 0; c < kD / kOBoxCols; ++c) {
          TmaStore4d(&sp.o, s_ow + c * 64 * kRowBytes, c * kOBoxCols, e.q_start + wg_row0, wt.h,
                     varlen ? 0 : wt.b);
        }
        TmaStoreCommit();
      }
    } else {
      OutT* o = static_cast<OutT*>(p.o) + wt.b * p.o_batch_stride + wt.h * p.o_head_stride;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = wg_row0 + warp * 16 + g + half * 8;  // within the item
        if (row < 0) continue;
        OutT* o_row = o + static_cast<int64_t>(e.q_start + row) * p.o_row_stride;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < p.head_dim) {
            *reinterpret_cast<uint32_t*>(o_row + col) = PackPair<OutT>(
                acc_o[dt][half * 2] * inv[half], acc_o[dt][half * 2 + 1] * inv[half]);
          }
        }
      }
    }
    if (Tile::kOInV && n_tiles > 0 && threadIdx.x % 128 == 0) {
      TmaStoreWait<true>();  // the boxes are read: the producer may load V into them again
      MbarArrive(o_empty);
    }
    if (p.lse != nullptr && t == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = wg_row0 + warp * 16 + g + half * 8;
        if (row < 0) continue;
        // Natural-log LSE: scale_log2 * row_max is max(scale * s) * log2(e).
        const float lse =
            Tile::kOptions ? lse2[half] * kLn2
            : l[half] > 0.f
                ? (row_max[half] * p.scale_log2 + log2f(l[half]) - Tile::kPLog2Gain) * kLn2
                : -INFINITY;
        p.lse[wt.b * p.lse_batch_stride + wt.h * p.lse_head_stride + e.q_start + row] = lse;
      }
    }
  }
  // The CTA's shared memory must outlive the last stores' reads of it.
  if (Tile::kTmaStoreO && threadIdx.x % 128 == 0) TmaStoreWait<false>();
#endif  // ATTENTION_SM90A
}

}  // namespace attention::cuda
