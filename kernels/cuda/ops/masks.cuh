// Device helpers over the kernels' params (KernelParams, PagedKernelParams): where a batch item
// lives, which keys a row may see (the one window clamp of both kernels), which key tiles need
// element masks, and the element mask on mma accumulators (layout: online_softmax.cuh).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda/ops/kernel_params.h"

namespace attention::cuda {

// Where one CTA's batch item lives: its first row and its lengths.
struct ItemExtent {
  int q_start, k_start, nq, nk;
};

__device__ __forceinline__ ItemExtent GetItemExtent(const KernelParams& p, int b) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.seqlen_q, p.seqlen_k};
  const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
  return {q0, k0, p.cu_seqlens_q[b + 1] - q0, p.cu_seqlens_k[b + 1] - k0};
}

// Keys [lo, hi) of an item.
struct KeyRange {
  int lo, hi;
};

// The key on row 0's diagonal for an item of nq queries and nk keys (row i's is i + this): the
// forward kernel's mask is aligned as its params say (AttentionParams::mask_alignment), the paged
// decode kernel's always bottom-right (a session's queries are its last positions).
__device__ __forceinline__ int MaskDiagonal(const KernelParams& p, int nq, int nk) {
  return p.mask_top_left ? 0 : nk - nq;
}
template <typename Params>
__device__ __forceinline__ int MaskDiagonal(const Params&, int nq, int nk) {
  return nk - nq;
}

// Keys [lo, hi) that rows [row_first, row_last] of an item of nq queries and nk keys may see
// (row i sees key j iff i + diag - window_left <= j <= i + diag + window_right, diag =
// MaskDiagonal; bounds -1 = unbounded). Params: any kernel params with window_left, window_right.
template <typename Params>
__device__ __forceinline__ KeyRange VisibleKeys(const Params& p, int nq, int nk, int row_first,
                                                int row_last) {
  const int diag = MaskDiagonal(p, nq, nk);
  int lo = 0, hi = nk;
  if (p.window_left >= 0) lo = max(lo, row_first + diag - p.window_left);
  if (p.window_right >= 0) hi = min(hi, row_last + diag + p.window_right + 1);
  return {lo, hi};
}

// Chunked attention's pieces, in int32 (the Hopper kernel's producer computes its work tiles'
// keys on 24 registers, which int64 bounds and a second signed division spilled past): the first
// key of `key`'s chunk (floor division: diagonal keys are negative when Nq > Nk), and min(hi, end +
// chunk) for a chunk starting at `end` (end + chunk overflows only where it exceeds hi).
__device__ __forceinline__ int ChunkStart(int key, int chunk) {
  // Keys in (-2^30, 2^30) and chunks of at most 2^30 (the launchers' bound): in (-2^31, 2^30).
  return (key / chunk - (key % chunk < 0 ? 1 : 0)) * chunk;
}
__device__ __forceinline__ int MinChunkEnd(int hi, int end, int chunk) {
  return hi >= end && static_cast<unsigned>(hi) - static_cast<unsigned>(end) >
                          static_cast<unsigned>(chunk)
             ? end + chunk
             : hi;
}

// The keys [lo, hi) that rows row_first <= row_last of an item may see (VisibleKeys), cut to the
// chunks with a chunk size (p.chunk_size > 0): a row also sees only the keys in the chunk of its
// diagonal key, lo from the first row's chunk and hi from the last's, both nondecreasing in the
// row (kernels/attention_params.h's VisibleKeys on the host). The last row's chunk is the first's
// moved on by whole chunks (an unsigned division). Params: kernel params with window_left,
// window_right and chunk_size.
template <typename Params>
__device__ __forceinline__ KeyRange ChunkedVisibleKeys(const Params& p, int nq, int nk,
                                                       int row_first, int row_last) {
  KeyRange keys = VisibleKeys(p, nq, nk, row_first, row_last);
  if (p.chunk_size > 0) {
    const int diag = MaskDiagonal(p, nq, nk), chunk = p.chunk_size;
    const int start = ChunkStart(row_first + diag, chunk);
    keys.lo = max(keys.lo, start);
    const unsigned span = static_cast<unsigned>(row_last - row_first) +
                          static_cast<unsigned>(row_first + diag - start);
    const int end = static_cast<int>(static_cast<unsigned>(start) +
                                     span / static_cast<unsigned>(chunk) * chunk);
    keys.hi = MinChunkEnd(keys.hi, end, chunk);
  }
  return keys;
}

// The keys [lo, hi) that every row of row_first <= row_last sees (lo >= hi: none): the window's
// (VisibleKeys with the rows swapped) cut to the rows' chunk when they share one, else none.
template <typename Params>
__device__ __forceinline__ KeyRange ChunkedKeysOfEveryRow(const Params& p, int nq, int nk,
                                                          int row_first, int row_last) {
  KeyRange keys = VisibleKeys(p, nq, nk, row_last, row_first);
  if (p.chunk_size > 0) {
    const int diag = MaskDiagonal(p, nq, nk), chunk = p.chunk_size;
    const int start = ChunkStart(row_first + diag, chunk);
    keys.lo = max(keys.lo, start);
    const bool one_chunk = static_cast<unsigned>(row_last + diag) - static_cast<unsigned>(start) <
                           static_cast<unsigned>(chunk);
    keys.hi = one_chunk ? MinChunkEnd(keys.hi, start, chunk) : min(keys.hi, keys.lo);
  }
  return keys;
}

// The forward kernels' keys of rows [row_first, row_last]: with kOptions (the options instances)
// cut to the chunks, else VisibleKeys (the plain instances read no chunk size).
template <bool kOptions>
__device__ __forceinline__ KeyRange ForwardVisibleKeys(const KernelParams& p, int nq, int nk,
                                                       int row_first, int row_last) {
  if constexpr (kOptions) {
    return ChunkedVisibleKeys(p, nq, nk, row_first, row_last);
  } else {
    return VisibleKeys(p, nq, nk, row_first, row_last);
  }
}

// Whether key tile [n0, n0 + tile) needs per-element masks for rows [row_first, row_last]: it
// runs past the keys, or crosses the window edge of the first or the last row.
__device__ __forceinline__ bool TileNeedsMask(const KernelParams& p, const ItemExtent& e,
                                              int row_first, int row_last, int n0, int tile) {
  const int diag = MaskDiagonal(p, e.nq, e.nk);
  return n0 + tile > e.nk ||
         (p.window_right >= 0 && n0 + tile - 1 > row_first + diag + p.window_right) ||
         (p.window_left >= 0 && n0 < row_last + diag - p.window_left);
}

// The keys every row of [row_first, row_last] sees, which ForwardTileNeedsMask tests tiles
// against: with kOptions ChunkedKeysOfEveryRow, whose chunk bounds cost integer divisions, so the
// kernels compute it once per block of rows, out of the key loop; the plain instances read none.
template <bool kOptions>
__device__ __forceinline__ KeyRange ForwardKeysOfEveryRow(const KernelParams& p,
                                                          const ItemExtent& e, int row_first,
                                                          int row_last) {
  if constexpr (kOptions) {
    return ChunkedKeysOfEveryRow(p, e.nq, e.nk, row_first, row_last);
  } else {
    return {0, 0};
  }
}

// TileNeedsMask of the forward kernels: with kOptions, whether the tile holds a key outside
// `every_row` (ForwardKeysOfEveryRow of the same rows, which also cuts at the item's last key):
// two compares per tile; else TileNeedsMask.
template <bool kOptions>
__device__ __forceinline__ bool ForwardTileNeedsMask(const KernelParams& p, const ItemExtent& e,
                                                     const KeyRange& every_row, int row_first,
                                                     int row_last, int n0, int tile) {
  if constexpr (kOptions) {
    return n0 < every_row.lo || n0 + tile > every_row.hi;
  } else {
    return TileNeedsMask(p, e, row_first, row_last, n0, tile);
  }
}

// Sets the logits of one row (s[.][2 half + i]) outside its visible keys `vis` to -inf; s starts
// at key n0 and this lane (t = lane % 4) holds keys n0 + 8 nt + 2t + i.
template <int kNTiles>
__device__ __forceinline__ void MaskRow(float (&s)[kNTiles][4], int half, KeyRange vis, int n0,
                                        int t) {
  const int lo = vis.lo - n0 - 2 * t, hi = vis.hi - n0 - 2 * t;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = nt * 8 + i;  // key n0 + col + 2t
      if (col < lo || col >= hi) s[nt][half * 2 + i] = -INFINITY;
    }
}

// Sets the logits of one row (layout as MaskRow) to NaN at the keys n0 + j that it sees (`vis`)
// and whose V held an Inf or NaN (bit j of `flags`; the caller has zeroed those V elements so that
// the rows masking the key multiply a finite V by their P = 0): the row's result is NaN, as the
// non-finite V would have made it.
template <int kNTiles>
__device__ __forceinline__ void PoisonRow(float (&s)[kNTiles][4], int half, KeyRange vis, int n0,
                                          int t, uint32_t flags) {
  const int lo = vis.lo - n0 - 2 * t, hi = vis.hi - n0 - 2 * t;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = nt * 8 + i;  // key n0 + col + 2t
      if (col >= lo && col < hi && ((flags >> (col + 2 * t)) & 1u) != 0) s[nt][half * 2 + i] = NAN;
    }
}

}  // namespace attention::cuda
