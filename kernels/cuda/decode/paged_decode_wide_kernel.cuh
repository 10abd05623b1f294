// The wide tensor-core tile of the paged decode (float16, bfloat16): head dims past the D = 128
// tile's registers, where each query head's O row is too wide for one warp to hold, and many query
// heads share one KV head. MLA's absorbed decode (one KV head, QK 576, V 512, 16 to 128 query heads
// per KV head) and D = Dv = 512 (PagedWideTile<T, 576, 512>, <T, 512, 512>); MLA's latent cache
// with V read from K's first 512 features (<T, 576, 512, true>: a stage holds the K tile alone,
// 576 halves a key read where V apart from K costs 1088, and three stages fit).
//
// Grid as the 16-row kernel's (paged_decode_kernel.cuh: split, kv head x row block, sequence), but
// a CTA owns kRows = 64 rows (4 blocks of 16: query heads of the group times queries), so one read
// of a K/V tile serves 64 query heads (Hq 128 per KV head: 2 CTAs read each tile, where 16-row CTAs
// were 8). 8 warps: warp w takes row block w / 2 and part w % 2 (a row block's two warps on two SM
// sub-partitions: where one row block holds every real row, Hq 16 or D = 512's GQA 8, the live
// warps do not share one sub-partition's tensor cores; 4-11% faster there at batch >= 8 on an
// H100, 2026-12-06). For S = Q K^T the parts split the tile's kBc = 32 keys (16 each, over all D
// columns; Q's fragments are read from shared memory per k-step, 36 of them at D = 576, rather
// than held); for O += P V they split V's columns (256 each: 128 accumulator registers, where one
// warp holding 512 would need 256). So the row max of a tile is exchanged through shared memory
// (both parts then hold the same max and rescale alike), P goes through shared memory as T, and
// each part keeps its own running sum of its keys' p (the total is their sum at the end). Row
// blocks without a real row (Hq 16: 3 of the 4) skip their mma's. K/V tiles stream through kStages
// shared-memory stages by cp.async (zero-filled past the last key), kStages - 1 tiles in flight
// while one is consumed. Rows of o leave through shared memory (Q's and the stages', free by then)
// in 8- or 16-byte stores (o may be pinned host memory). Splits merge through the global workspace
// and tickets (MergeSplitsIfLast; no cluster merge).
//
// Masks, windows, chunks, sinks and non-finite K/V as the 16-row kernel has them (MaskRow,
// PoisonRow, AddSink); the softcap is not compiled here (the planner sends softcapped steps to the
// SIMT kernel). On a tile that takes the element mask, the CTA zeroes the Inf and NaN elements of
// the tile's V and flags their keys before S, so that rows that see a flagged key get a NaN logit
// there and rows that do not multiply a finite V by their P = 0. With V in K's rows the zeroing
// touches K's first Dv columns before S: the rows that see a flagged key get NaN either way.
#pragma once

#include "kernels/cuda/decode/paged_decode_kernel.cuh"

namespace attention::cuda {

template <typename T, int kD_, int kDv_, bool kVFromK_ = false>
struct PagedWideTile {
  using Element = T;
  static constexpr int kD = kD_, kDv = kDv_;
  static constexpr bool kVFromK = kVFromK_;  // V is K's first kDv columns, in K's tile
  static constexpr int kMBlocks = 4;         // 16-row blocks per CTA
  static constexpr int kRows = kMBlocks * 16;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kParts = kWarps / kMBlocks;  // warps per row block
  static constexpr int kBc = 32;
  static constexpr int kStages = kVFromK ? 3 : 2;
  static constexpr int kWarpKeys = kBc / kParts;  // S keys per warp
  static constexpr int kWarpCols = kDv / kParts;  // O columns per warp
  static constexpr int kKRowBytes = kD * 2, kVRowBytes = kDv * 2;
  static constexpr int kKChunks = kD / 8, kVChunks = kDv / 8;
  static constexpr int kKTileBytes = kBc * kKRowBytes;
  static constexpr int kVTileBytes = kVFromK ? 0 : kBc * kVRowBytes;
  // V's rows in shared memory: their own tile's, or K's.
  static constexpr int kVPitchBytes = kVFromK ? kKRowBytes : kVRowBytes;
  static constexpr int kStageBytes = kKTileBytes + kVTileBytes;
  static constexpr int kQBytes = kRows * kKRowBytes;
  // P [kRows][kBc] of T, rows padded by 16 bytes (5 chunks apart: the 8 rows of an ldmatrix phase
  // hit 8 different bank groups).
  static constexpr int kPRowBytes = kBc * 2 + 16;
  static constexpr int kPBytes = kRows * kPRowBytes;
  // Per part and row: the tile's max, then the final sums; per row the lse; per warp its flags.
  static constexpr int kStatBytes = (2 * kParts * kRows + kRows + kWarps) * 4;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kPBytes + kStatBytes;
  static_assert(kSmemBytes <= 227 << 10, "an H100 / H200 CTA's shared memory");
  static_assert(kRows * kDv * 4 <= kQBytes + kStages * kStageBytes,
                "o leaves through Q's and the stages' buffers");
  static_assert(kWarps * kPagedMaxSplits * 4 <= kQBytes + kStages * kStageBytes,
                "the merge's weights");
  static_assert(!kVFromK || kDv <= kD, "V is K's first kDv columns");
  static_assert(kWarpKeys == 16, "S of a warp: two 8-key column tiles, P V one k-step of 16");
  static_assert(kBc <= 32, "the tile's non-finite V keys are flagged in one 32-bit word");
  static_assert(kD % 64 == 0 && kDv % 64 == 0, "the swizzle needs rows of >= 8 chunks");
  static_assert((kWarpCols * 2) % 128 == 0, "a part's columns start on a swizzle period");
};

template <typename Tile>
__global__ void __launch_bounds__(Tile::kThreads, 1) PagedWideKernel(const PagedKernelParams p) {
  using T = typename Tile::Element;
  constexpr int kD = Tile::kD, kDv = Tile::kDv, kBc = Tile::kBc, kStages = Tile::kStages;
  constexpr int kRows = Tile::kRows, kParts = Tile::kParts, kThreads = Tile::kThreads;
  constexpr int kKRowBytes = Tile::kKRowBytes, kVRowBytes = Tile::kVRowBytes;
  constexpr int kVPitchBytes = Tile::kVPitchBytes;
  constexpr int kKChunks = Tile::kKChunks, kVChunks = Tile::kVChunks;
  constexpr int kPRowBytes = Tile::kPRowBytes;
  constexpr int kKSteps = kD / 16;              // k-steps of Q K^T
  constexpr int kNTiles = Tile::kWarpKeys / 8;  // 8-key column tiles of a warp's S
  constexpr int kOTiles = Tile::kWarpCols / 8;  // 8-wide column tiles of a warp's O
  constexpr int kPvSteps = kBc / 16;            // k-steps of P V

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = SmemAddress(smem);
  const uint32_t s_kv = s_q + Tile::kQBytes;  // [kStages][K tile, V tile]
  const uint32_t s_p = s_kv + kStages * Tile::kStageBytes;
  float* const stats =
      reinterpret_cast<float*>(smem + Tile::kQBytes + kStages * Tile::kStageBytes + Tile::kPBytes);
  float* const s_max = stats;                   // [kParts][kRows]: the tile's max per part
  float* const s_sum = s_max + kParts * kRows;  // [kParts][kRows]: the final sums per part
  float* const s_lse = s_sum + kParts * kRows;  // [kRows]
  uint32_t* const s_flags = reinterpret_cast<uint32_t*>(s_lse + kRows);  // [kWarps]

  const int seq = blockIdx.z;
  const int hk = blockIdx.y / p.m_blocks, m0 = blockIdx.y % p.m_blocks * kRows;
  const int split_lo = blockIdx.x * p.split_keys;
  const int32_t* page_table = p.page_table + seq * p.page_table_stride;
  PagedCtaWork w;  // rows [m0, w.row_last], keys from tile w.tile_begin
  if (!GetPagedCtaWork<kRows, kBc>(p, seq, m0, split_lo, w)) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int mb = warp / kParts, part = warp % kParts;
  const bool live = m0 + mb * 16 <= w.row_last;  // this warp's row block holds a real row

  // K of this kv head, and V after every head's K (kernels/paged_kv.h), bytes from a page's start
  // (V in K's rows: no V of its own).
  const int64_t k_head = static_cast<int64_t>(hk) * p.page_rows * kKRowBytes;
  [[maybe_unused]] const int64_t v_head =
      static_cast<int64_t>(p.heads_kv) * p.page_rows * kKRowBytes +
      static_cast<int64_t>(hk) * p.page_rows * kVRowBytes;
  // Tile `tile` into stage `stage`: kThreads / kBc = 8 threads a key row, each every eighth of its
  // 16-byte chunks, so a thread looks its row up in the page table once a tile (the division by
  // page_rows was most of an address's instructions, and the kernel issue-bound); rows past the
  // last key zero-filled.
  constexpr int kRowThreads = kThreads / kBc;
  static_assert(kThreads % kBc == 0, "whole key rows per thread group");
  const int ld_row = threadIdx.x / kRowThreads, ld_chunk = threadIdx.x % kRowThreads;
  auto load_tile = [&](int stage, int tile) {
    const uint32_t s_k = s_kv + stage * Tile::kStageBytes;
    const int key = (w.tile_begin + tile) * kBc + ld_row;
    const bool valid = key < w.nk;
    const unsigned char* page = p.pool;
    int64_t page_row = 0;
    if (valid) {
      page += page_table[key / p.page_rows] * p.page_bytes;
      page_row = key % p.page_rows;
    }
    auto load = [&](uint32_t dst, int chunks, const unsigned char* row, auto row_bytes_c) {
      constexpr int kRowBytesC = decltype(row_bytes_c)::value;
#pragma unroll
      for (int c = ld_chunk; c < chunks; c += kRowThreads) {
        CpAsync16(dst + SwizzledOffset<kRowBytesC>(ld_row, c), valid ? row + c * 16 : p.pool,
                  valid);
      }
    };
    load(s_k, kKChunks, page + k_head + page_row * kKRowBytes,
         std::integral_constant<int, kKRowBytes>());
    if constexpr (!Tile::kVFromK) {
      load(s_k + Tile::kKTileBytes, kVChunks, page + v_head + page_row * kVRowBytes,
           std::integral_constant<int, kVRowBytes>());
    }
  };
  // Tiles 0 .. kStages - 2 in flight before the loop, a commit group each.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < w.n_tiles) load_tile(s, s);
    CpAsyncCommit();
  }

  LoadPagedQ<T, kRows, kKChunks, kThreads>(p, s_q, w.q0, w.nq, hk, m0, w.row_last);

  // ldmatrix lane offsets (paged_decode_kernel.cuh's): A (Q rows of this row block; V rows as the
  // transposed B) and B (K rows).
  const uint32_t off_q = SwizzledOffset<kKRowBytes>(mb * 16 + (lane & 15), lane >> 4);
  const uint32_t off_k =
      SwizzledOffset<kKRowBytes>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  const uint32_t off_v = SwizzledOffset<kVPitchBytes>(lane & 15, lane >> 4);
  const uint32_t off_p = s_p + (mb * 16 + (lane & 15)) * kPRowBytes + (lane >> 4) * 16;

  // The rows g and g + 8 of this warp's row block: their queries' visible keys; and the keys every
  // row sees (tiles inside them need no element mask).
  KeyRange row_keys[2], all_rows;
  PagedLaneKeys(p, w.nq, w.nk, m0 + mb * 16, g, w.first_query, w.last_query, row_keys, all_rows);

  float acc_o[kOTiles][4];
#pragma unroll
  for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[ot][i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const float scale_log2 = p.scale_log2;

  for (int tile = 0; tile < w.n_tiles; ++tile) {
    // Tile `tile` has landed (and Q, on the first): of the kStages - 1 + tile groups committed,
    // at most kStages - 2 are pending. Every warp is past tile - 1, whose stage the next load
    // reuses, and whose P, maxes and flags this tile overwrites.
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    if (tile + kStages - 1 < w.n_tiles) {
      load_tile((tile + kStages - 1) % kStages, tile + kStages - 1);
    }
    CpAsyncCommit();

    const uint32_t s_k = s_kv + (tile % kStages) * Tile::kStageBytes;
    const uint32_t s_v = Tile::kVFromK ? s_k : s_k + Tile::kKTileBytes;
    const int n0 = (w.tile_begin + tile) * kBc;
    const int w0 = n0 + part * Tile::kWarpKeys;  // this warp's first key of S

    // Masked tiles: zero the Inf and NaN of the tile's V (as stored: the swizzle permutes chunks
    // within a row only) and flag their keys, bit j for key n0 + j.
    const bool masked = n0 < all_rows.lo || n0 + kBc > all_rows.hi;
    uint32_t nonfinite = 0;
    if (masked) {
      uint32_t mine =
          ZeroNonFiniteRows<T>(s_v, kBc * kVChunks, kVChunks, threadIdx.x, kThreads, kVPitchBytes);
      mine = __reduce_or_sync(0xffffffffu, mine);
      if (lane == 0) s_flags[warp] = mine;
      __syncthreads();  // the zeroed V and every warp's flags
#pragma unroll
      for (int x = 0; x < Tile::kWarps; ++x) nonfinite |= s_flags[x];
    }

    // S of this warp's 16 keys for its 16 rows, and their max.
    float acc_s[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[nt][i] = 0.f;
    if (live) {
      const uint32_t s_kw = s_k + part * Tile::kWarpKeys * kKRowBytes;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t qa[4], kb[4];
        LdMatrixX4(qa, s_q + PairOffset(off_q, kk));
        LdMatrixX4(kb, s_kw + PairOffset(off_k, kk));
        Mma16816<T>(acc_s[0], qa, kb[0], kb[1]);
        Mma16816<T>(acc_s[1], qa, kb[2], kb[3]);
      }
      if (masked) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          MaskRow(acc_s, half, row_keys[half], w0, t);
          const uint32_t flags = nonfinite >> (part * Tile::kWarpKeys);
          if (flags != 0) PoisonRow(acc_s, half, row_keys[half], w0, t, flags);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(acc_s[nt][half * 2], acc_s[nt][half * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (t == 0) s_max[part * kRows + mb * 16 + g + half * 8] = mx;
      }
    }
    __syncthreads();  // both parts' maxes

    if (live) {
      // The row's new max over both parts (the same in both: they rescale alike), its p in place,
      // this warp's share of the sum, and P to shared memory.
      float rescale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mb * 16 + g + half * 8;
        float mx = row_max[half];
#pragma unroll
        for (int q = 0; q < kParts; ++q) mx = fmaxf(mx, s_max[q * kRows + r]);
        // A row that has seen no key yet keeps max -inf; subtract 0 then so exp2 gives 0, not NaN.
        const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        rescale[half] = FastExp2(row_max[half] * scale_log2 - m_scaled);
        row_max[half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float& s = acc_s[nt][half * 2 + i];
            s = FastExp2(fmaf(s, scale_log2, -m_scaled));
            sum += s;
          }
          const uint32_t pair = PackPair<T>(acc_s[nt][half * 2], acc_s[nt][half * 2 + 1]);
          const int key = part * Tile::kWarpKeys + nt * 8 + 2 * t;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_p + r * kPRowBytes + key * 2),
                       "r"(pair));
        }
        row_sum[half] = fmaf(row_sum[half], rescale[half], sum);
      }
      if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
        for (int ot = 0; ot < kOTiles; ++ot)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc_o[ot][i] *= rescale[i / 2];
      }
    }
    __syncthreads();  // P of both parts

    // O[:, this part's columns] += P V over the tile's keys, 16 at a time.
    if (live) {
      const uint32_t s_vw = s_v + part * Tile::kWarpCols * 2;
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        uint32_t pa[4];
        LdMatrixX4(pa, off_p + kk * 32);
        MmaPV<T>(acc_o, pa, s_vw + kk * 16 * kVPitchBytes, off_v);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the stage buffers are free for o

  // Each part's sum of its keys' p; then the rows' 1 / sum and log2-sum-exp, and o normalised into
  // Q's and the stage buffers ([kRows][kDv] float), stored from there 4 columns at a time.
  float* const o_s = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = QuadSum(row_sum[half]);
    if (live && t == 0) s_sum[part * kRows + mb * 16 + g + half * 8] = l;
  }
  __syncthreads();
  if (live) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mb * 16 + g + half * 8;
      float sum = 0.f;
#pragma unroll
      for (int q = 0; q < kParts; ++q) sum += s_sum[q * kRows + r];
      float inv = sum > 0.f ? 1.f / sum : 0.f;
      float lse2 = sum > 0.f ? row_max[half] * scale_log2 + log2f(sum) : -INFINITY;
      // One split: the sink joins the row here (several: where the splits merge).
      if (p.sinks != nullptr && p.splits == 1 && m0 + r <= w.row_last) {
        inv *= AddSink(p.sinks[GetPagedRow(p, w.q0, w.nq, hk, m0 + r).head], lse2);
      }
      if (part == 0 && t == 0) s_lse[r] = lse2;
#pragma unroll
      for (int ot = 0; ot < kOTiles; ++ot) {
        const int col = part * Tile::kWarpCols + ot * 8 + 2 * t;
        *reinterpret_cast<float2*>(o_s + r * kDv + col) =
            make_float2(acc_o[ot][half * 2] * inv, acc_o[ot][half * 2 + 1] * inv);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * kDv / 4; i += kThreads) {
    const int r = i / (kDv / 4), col = i % (kDv / 4) * 4;
    if (m0 + r > w.row_last) break;  // rows ascend with i
    const PagedRow row = GetPagedRow(p, w.q0, w.nq, hk, m0 + r);
    StoreOut4<T>(p, row.index, col, *reinterpret_cast<const float4*>(o_s + r * kDv + col));
    if (col == 0) StoreLse(p, row.index, s_lse[r]);
  }
  // The merge's weights reuse o's buffer (it syncs before writing them).
  if (p.splits > 1) MergeSplitsIfLast<T, kRows>(p, o_s);
}

}  // namespace attention::cuda
