// Split-KV decode ("flash-decoding") over the paged KV cache (kernels/paged_kv.h).
//
// Grid (split, kv head x 16-row block, sequence). A CTA owns one kv head of one sequence, a slice
// of split_keys keys of it, and 16 "rows": the query heads of the kv head's group times the step's
// queries, packed as row r = query (r / group) of query head (hk * group + r % group). With GQA,
// one read of a K/V tile thus serves every query head of the group (decode is bound by reading
// K/V, not by the mma's, which run 16 rows even when fewer are real).
//
// Tensor-core path (float16, bfloat16; PagedTile): K/V tiles of kBc rows stream through kStages
// shared-memory stages with cp.async (16 bytes, zero-filled past the last key), kStages - 1 tiles
// in flight while one is consumed. A tile inside one page (pages of a multiple of kBc rows, as the
// server's are) costs one page-table read; others (smaller pages, the last tile) look up each row.
// The kWarps warps split each tile's keys (kBc / kWarps each) and keep their own online softmax
// (online_softmax.cuh, as in flash_forward_kernel.cuh) over the same 16 rows; Q's fragments stay in
// registers. S = Q K^T and O += P V are mma.sync m16n8k16 with float32 accumulation, P fed back
// from the accumulators as the A operand. At the end the warps' (max, sum, O) are merged through
// shared memory and the CTA writes either the result (one split) or a normalised float32 partial
// and its log2-sum-exp. With several splits the step is still one launch. Two splits on a Hopper
// GPU run as a cluster per (sequence, row block): the partials stay in each CTA's shared memory
// and the pair merges them by LSE through distributed shared memory (MergeSplitsInCluster).
// Otherwise the partials go to a global workspace, each split CTA takes a ticket of its (sequence,
// row block) after them (MergeSplitsIfLast), and the last to arrive merges the splits by LSE into
// o and lse and zeroes the ticket again.
//
// SIMT path (float32, head dims the tensor path lacks, and a V head dim of its own, Dv != D:
// PagedSimtKernel): a warp per row, keys one at a time (lanes split D and Dv, a shuffle reduction
// per key). Correct, not fast.
//
// Open-model options, as the CPU kernel and the float64 reference have them: a chunk size narrows
// each row's keys before any is read (ChunkedVisibleKeys: the CTA's key range, the element masks);
// a softcap rewrites every logit before the mask (Softcap: tanhf, in the log2 domain, the
// softmax then at scale 1), in the tensor-core kernel's kSoftcap instance (the plain one has none
// of it) and by a branch in the SIMT kernel; sinks join a row's denominator once its (max, sum) are
// final (AddSink: with one split in the epilogue, with several where the splits merge, so the
// partials stay sink-free), changing o by one factor and lse, never the key loop.
//
// Keys a row cannot see never reach it, even when their K or V is Inf or NaN (rows of a dropped
// sequence left in a reused page, the unused tail of the last page, keys outside the window). Keys
// past a sequence's length are never read (zero-filled by cp.async; the SIMT path stops at them).
// A masked logit is overwritten with -inf (a NaN one too), so its P is exactly 0; but the mma
// multiplies that 0 by V (0 * NaN = NaN), and a warp's V rows serve all 16 rows. So on a warp's
// tiles that take the element mask (only those), the warp zeroes the Inf and NaN elements of its
// V rows in shared memory (only it reads them) and flags their keys; the rows that see a flagged
// key get a NaN logit there (PoisonRow: their result is NaN, as the non-finite V makes it), the
// others multiply a finite V by their P = 0. The SIMT path visits only the keys a row sees.
//
// Measured (bench/README.md, H200, bfloat16 B=8 Hq=32 Hkv=8 D=128, one query, 512 KiB pages, 2
// splits of the 4-stage tile merged in clusters): 46.9 us at Nk=4096 (2.86 TB/s of K/V), 252.1 us
// at 32k (4.26), 959.5 us at 128k (4.48); 1.07x / 1.02x / 1.00x of torch SDPA's cuDNN backend in
// the same run (0.9998x at 128k; 1.005x in another). A plain read of the same K/V bytes
// (decode_bench's roofline anchor) takes 38.0 / 259.1 / 975.5 us: from 32k on the step reads at
// least at the anchor's rate; at 4k ~12 of its 47 us are outside the key loop (launch 2.8, ~6 until
// the first tiles land, ~1.3 epilogue, ~1.7 for the cluster merge, which the ticket merge took ~4.5
// for). The version before this one: docs/kernels.md.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/decode/paged_decode_params.h"
#include "kernels/cuda/ops/kernel_params.h"
#include "kernels/cuda/ops/masks.cuh"
#include "kernels/cuda/ops/mma_ops.cuh"
#include "kernels/cuda/ops/online_softmax.cuh"
#include "kernels/cuda/ops/tile_ops.cuh"

namespace attention::cuda {

inline constexpr int kPagedRows = 16;  // rows (query heads x queries) per CTA
inline constexpr int kPagedThreads = 128;

// Trace: the tile sweep's instrumentation hook (bench/cuda/decode_bench.cu); thread 0 of each CTA
// calls Trace::Mark(point) at the PagedTracePoint points. NoPagedTrace compiles to nothing.
enum PagedTracePoint { kTraceStart, kTraceFirstTile, kTraceLoopDone, kTraceStored, kTraceEnd };
struct NoPagedTrace {
  __device__ static void Mark(PagedTracePoint) {}
};

template <typename T, int kD_, int kBc_, int kStages_, int kWarps_ = 4,
          typename Trace_ = NoPagedTrace>
struct PagedTile {
  using Element = T;
  static constexpr int kD = kD_;
  static constexpr int kBc = kBc_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarps = kWarps_;
  using Trace = Trace_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpKeys = kBc / kWarps;  // keys of a tile per warp
  static constexpr int kChunkElems = 8;
  static constexpr int kChunks = kD / kChunkElems;
  static constexpr int kRowBytes = kD * 2;
  static constexpr int kTileBytes = kBc * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K then V
  static constexpr int kQBytes = kPagedRows * kRowBytes;
  // Warps' partial O (float) and (max, sum) per row, merged at the end in the stage buffers,
  // followed there by the CTA's normalised O [16][kD] and log2-sum-exps [16] (float) when a
  // cluster merges the splits.
  static constexpr int kMergeBytes = kWarps * kPagedRows * (kD + 2) * 4;
  static constexpr int kClusterPartBytes = kPagedRows * (kD + 1) * 4;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  // CTAs per SM that the shared memory allows on an H100 / H200 (228 KiB per SM, 1 KiB of it
  // reserved per CTA), and __launch_bounds__'s minimum of resident CTAs: that many where it is
  // more than one (without it ptxas held the D = 64 tile to 96 registers and spilled 8 bytes), else
  // none (0: ptxas picks the registers of a CTA alone on its SM).
  static constexpr int kResidentCtas = (228 << 10) / (kSmemBytes + (1 << 10));
  static constexpr int kMinCtasPerSm = kResidentCtas > 1 ? kResidentCtas : 0;
  static_assert(kMergeBytes + kClusterPartBytes <= kStages * kStageBytes,
                "the merge reuses the stage buffers");
  static_assert(kWarpKeys % 16 == 0, "P V consumes keys 16 at a time");
  static_assert(kWarpKeys <= 32, "a warp flags its keys' non-finite V in one 32-bit word");
  static_assert(kBc % (kThreads / kChunks) == 0, "whole rows per load pass");
  static_assert(kD % 64 == 0, "the swizzle needs rows of >= 8 chunks");
};

// Row r of a CTA's 16 rows: its element offset in q (times head_dim), in o (times v_head_dim) and
// in lse.
struct PagedRow {
  int64_t index;  // heads_q * q0 + head * nq + query
  int query;
  int head;
};
__device__ __forceinline__ PagedRow GetPagedRow(const PagedKernelParams& p, int q0, int nq, int hk,
                                                int m) {
  const int query = m / p.group, head = hk * p.group + m % p.group;
  return {static_cast<int64_t>(p.heads_q) * q0 + static_cast<int64_t>(head) * nq + query, query,
          head};
}

// Element i of o, rounded to T.
template <typename T>
__device__ __forceinline__ void StoreO(void* o, int64_t i, float x) {
  if constexpr (std::is_same_v<T, float>) {
    static_cast<float*>(o)[i] = x;
  } else if constexpr (std::is_same_v<T, __half>) {
    static_cast<__half*>(o)[i] = __float2half_rn(x);
  } else {
    static_cast<__nv_bfloat16*>(o)[i] = __float2bfloat16_rn(x);
  }
}

// Elements at .. at + 3 of o (at a multiple of 4, o aligned to 16 bytes) in one store: o may be
// pinned host memory, written over the bus (the KV pool's staging), where one 8- or 16-byte store
// is one write and four 2-byte ones are four.
template <typename T>
__device__ __forceinline__ void StoreO4(void* o, int64_t at, float4 x) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(static_cast<float*>(o) + at) = x;
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 lo = __floats2half2_rn(x.x, x.y), hi = __floats2half2_rn(x.z, x.w);
    *reinterpret_cast<uint2*>(static_cast<__half*>(o) + at) = make_uint2(
        *reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  } else {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(o) + at) = make_uint2(
        *reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
}

// Writes element `col` of a finished row: o (one split) or the split's float32 partial.
template <typename T>
__device__ __forceinline__ void StoreOut(const PagedKernelParams& p, int64_t index, int col,
                                         float x) {
  if (p.splits == 1) {
    StoreO<T>(p.o, index * p.v_head_dim + col, x);
  } else {
    p.part_o[(blockIdx.x * p.total_rows + index) * p.v_head_dim + col] = x;
  }
}
// StoreOut of columns col..col+3 (v_head_dim and col multiples of 4).
template <typename T>
__device__ __forceinline__ void StoreOut4(const PagedKernelParams& p, int64_t index, int col,
                                          float4 x) {
  if (p.splits == 1) {
    StoreO4<T>(p.o, index * p.v_head_dim + col, x);
  } else {
    *reinterpret_cast<float4*>(p.part_o + (blockIdx.x * p.total_rows + index) * p.v_head_dim +
                               col) = x;
  }
}
// Writes a finished row's log2-sum-exp (-inf: saw no key): natural-log lse, or the partial's.
__device__ __forceinline__ void StoreLse(const PagedKernelParams& p, int64_t index, float lse2) {
  if (p.splits == 1) {
    if (p.lse != nullptr) p.lse[index] = lse2 == -INFINITY ? -INFINITY : lse2 * kLn2;
  } else {
    p.part_lse[blockIdx.x * p.total_rows + index] = lse2;
  }
}

// A tensor-core CTA's rows and keys: rows [m0, row_last] of its sequence's group x Nq, and its
// split's keys cut to what those rows' queries may see, as n_tiles whole tiles of kBc keys from
// tile tile_begin. False when the sequence has no row from m0 on (fewer rows than the grid).
struct PagedCtaWork {
  int q0, nq, nk, row_last, first_query, last_query, tile_begin, n_tiles;
};
template <int kRows, int kBc>
__device__ __forceinline__ bool GetPagedCtaWork(const PagedKernelParams& p, int seq, int m0,
                                                int split_lo, PagedCtaWork& w) {
  w.q0 = p.cu_seqlens_q[seq];
  w.nq = p.cu_seqlens_q[seq + 1] - w.q0;
  w.nk = p.seqlens_k[seq];
  const int rows = p.group * w.nq;
  if (m0 >= rows) return false;
  w.row_last = min(m0 + kRows, rows) - 1;
  w.first_query = m0 / p.group;
  w.last_query = w.row_last / p.group;
  const KeyRange vis = ChunkedVisibleKeys(p, w.nq, w.nk, w.first_query, w.last_query);
  const int k_lo = max(vis.lo, split_lo), k_hi = min(vis.hi, split_lo + p.split_keys);
  w.tile_begin = k_lo / kBc;
  w.n_tiles = k_hi > k_lo ? (k_hi + kBc - 1) / kBc - w.tile_begin : 0;
  return true;
}

// The keys this lane's rows m + g and m + g + 8 (of a 16-row block from m; g = lane / 4) may see,
// and those every row of the CTA's [first_query, last_query] sees (`all`: a key tile inside it
// needs no element mask).
__device__ __forceinline__ void PagedLaneKeys(const PagedKernelParams& p, int nq, int nk, int m,
                                              int g, int first_query, int last_query,
                                              KeyRange (&rows)[2], KeyRange& all) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int query = (m + g + half * 8) / p.group;
    rows[half] = ChunkedVisibleKeys(p, nq, nk, query, query);
  }
  all = ChunkedKeysOfEveryRow(p, nq, nk, first_query, last_query);
}

// O += P V over 16 keys: acc_o's 8-column tiles take pa (P of 16 rows x the 16 keys, as an A
// fragment) times V's 16 key rows at s_v_rows (swizzled, ldmatrix.trans from the lane offset
// off_v: SwizzledOffset(lane & 15, lane >> 4)), pair dp of 16 columns at a time.
template <typename T, int kOTiles>
__device__ __forceinline__ void MmaPV(float (&acc_o)[kOTiles][4], const uint32_t (&pa)[4],
                                      uint32_t s_v_rows, uint32_t off_v) {
#pragma unroll
  for (int dp = 0; dp < kOTiles / 2; ++dp) {
    uint32_t vb[4];
    LdMatrixX4Trans(vb, s_v_rows + PairOffset(off_v, dp));
    Mma16816<T>(acc_o[2 * dp], pa, vb[0], vb[1]);
    Mma16816<T>(acc_o[2 * dp + 1], pa, vb[2], vb[3]);
  }
}

// Rows [m0, row_last] of q, kRows of them, into the swizzled shared tile at s_q (rows of kChunks
// 16-byte chunks, zeros for missing rows and for columns past head_dim), negated for a negative
// scale; by kThreads threads.
template <typename T, int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void LoadPagedQ(const PagedKernelParams& p, uint32_t s_q, int q0, int nq,
                                           int hk, int m0, int row_last) {
  const uint32_t sign = p.negate_q ? 0x80008000u : 0u;
  const int d_chunks = p.head_dim / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (m0 + r <= row_last && c < d_chunks) {
      const PagedRow row = GetPagedRow(p, q0, nq, hk, m0 + r);
      x = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + row.index * p.head_dim +
                                          c * 8);
      x.x ^= sign, x.y ^= sign, x.z ^= sign, x.w ^= sign;
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     s_q + SwizzledOffset<kChunks * 16>(r, c)),
                 "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
  }
}

// Zeroes the Inf and NaN elements of the 16-byte chunks first, first + step, ... below `chunks` of
// the shared rows at `base` (row_chunks chunks a row, rows row_bytes apart, or packed when 0; the
// swizzle permutes chunks within a row only, and within aligned groups of 8, so a row's first
// row_chunks chunks stay its first) and returns the rows where this thread found any (bit r for
// row r).
template <typename T>
__device__ __forceinline__ uint32_t ZeroNonFiniteRows(uint32_t base, int chunks, int row_chunks,
                                                      int first, int step, int row_bytes = 0) {
  uint32_t rows = 0;
  for (int i = first; i < chunks; i += step) {
    const uint32_t addr = row_bytes == 0
                              ? base + i * 16
                              : base + (i / row_chunks) * row_bytes + (i % row_chunks) * 16;
    uint4 x;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(addr));
    if (ZeroNonFinite<T>(x)) {
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x.x), "r"(x.y),
                   "r"(x.z), "r"(x.w));
      rows |= 1u << (i / row_chunks);
    }
  }
  return rows;
}

// Called by every thread of a split CTA (splits > 1) once its partials of its 16 rows are stored.
// The CTA takes a ticket of its (sequence, grid row); the last split to take one merges the splits'
// partials of those rows by LSE into o (and lse), a warp per row, and resets the ticket for the
// next step. One launch per step: the merges of early finished rows overlap the other CTAs' reads,
// and no combine launch waits for the whole grid. A warp merges up to kMergeBatch of its rows at
// once (as many as `weights` holds), so their loads from L2 are in flight together: one round trip
// for the log-sum-exps, one for the partials (the merge ends the step: its latency is the step's).
// weights: shared memory for blockDim.x / 32 x kPagedMaxSplits floats. The CTA's coordinates are
// read again here rather than kept live through the key loop. kRows: the CTA's rows (16; the wide
// tile's 64, paged_decode_wide_kernel.cuh).
template <typename T, int kRows = kPagedRows>
__device__ __forceinline__ void MergeSplitsIfLast(const PagedKernelParams& p, float* weights) {
  constexpr int kMergeBatch = 4;
  __shared__ bool last;
  __threadfence();  // this thread's partials are visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* ticket = p.tickets + static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y;
    last = atomicAdd(ticket, 1) == p.splits - 1;
    if (last) *ticket = 0;  // every split has its ticket: zero again for the next step
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int seq = blockIdx.z;
  const int hk = blockIdx.y / p.m_blocks, m0 = blockIdx.y % p.m_blocks * kRows;
  const int q0 = p.cu_seqlens_q[seq], nq = p.cu_seqlens_q[seq + 1] - q0;
  const int row_end = min(m0 + kRows, p.group * nq);
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int splits = p.splits;
  const int batch = max(1, min(kMergeBatch, kPagedMaxSplits / splits));
  float* w = weights + warp * kPagedMaxSplits;  // [batch][splits]
  const int64_t split_stride = p.total_rows * p.v_head_dim;
  // The warp's rows m0 + warp + k * warps, `batch` at a time.
  for (int m = m0 + warp; m < row_end; m += batch * warps) {
    int64_t r[kMergeBatch];
    int head[kMergeBatch];
    float mx[kMergeBatch], sum[kMergeBatch];
    const int n = min(batch, (row_end - 1 - m) / warps + 1);  // rows of this batch
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const PagedRow row = GetPagedRow(p, q0, nq, hk, b < n ? m + b * warps : m);
      r[b] = row.index;
      head[b] = row.head;
      mx[b] = -INFINITY;
      sum[b] = 0.f;
    }
    // Other CTAs wrote the partials: loads through L2 (__ldcg), never a stale L1 line.
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      if (b >= n) break;
      for (int s = lane; s < splits; s += 32) {
        const float l = __ldcg(p.part_lse + s * p.total_rows + r[b]);
        w[b * splits + s] = l;
        mx[b] = fmaxf(mx[b], l);
      }
    }
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) mx[b] = fmaxf(mx[b], __shfl_xor_sync(0xffffffffu, mx[b], x));
      if (b >= n) continue;
      for (int s = lane; s < splits; s += 32) {
        const float ws = mx[b] == -INFINITY ? 0.f : exp2f(w[b * splits + s] - mx[b]);
        w[b * splits + s] = ws;
        sum[b] += ws;
      }
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) sum[b] += __shfl_xor_sync(0xffffffffu, sum[b], x);
    }
    // Each row's 1 / sum and log2-sum-exp (the sink joins them here), in every lane.
    float inv[kMergeBatch], lse2[kMergeBatch];
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      inv[b] = sum[b] > 0.f ? 1.f / sum[b] : 0.f;
      lse2[b] = sum[b] > 0.f ? mx[b] + log2f(sum[b]) : -INFINITY;
      if (p.sinks != nullptr && b < n) inv[b] *= AddSink(p.sinks[head[b]], lse2[b]);
    }
    __syncwarp();
    // Lane l sums columns 4l..4l+3 (+128 c) over the splits, every row's loads in flight together.
    if (p.v_head_dim % 4 == 0) {
      for (int col = 4 * lane; col < p.v_head_dim; col += 128) {
        float4 o[kMergeBatch];
#pragma unroll
        for (int b = 0; b < kMergeBatch; ++b) o[b] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int s = 0; s < splits; ++s) {
#pragma unroll
          for (int b = 0; b < kMergeBatch; ++b) {
            if (b >= n) break;
            const float4 x = __ldcg(reinterpret_cast<const float4*>(p.part_o + s * split_stride +
                                                                    r[b] * p.v_head_dim + col));
            const float ws = w[b * splits + s];
            o[b].x += ws * x.x, o[b].y += ws * x.y, o[b].z += ws * x.z, o[b].w += ws * x.w;
          }
        }
#pragma unroll
        for (int b = 0; b < kMergeBatch; ++b) {
          if (b >= n) break;
          StoreO4<T>(
              p.o, r[b] * p.v_head_dim + col,
              make_float4(o[b].x * inv[b], o[b].y * inv[b], o[b].z * inv[b], o[b].w * inv[b]));
        }
      }
    } else {
      for (int col = lane; col < p.v_head_dim; col += 32) {
#pragma unroll
        for (int b = 0; b < kMergeBatch; ++b) {
          if (b >= n) break;
          float o = 0.f;
#pragma unroll 8
          for (int s = 0; s < splits; ++s)
            o +=
                w[b * splits + s] * __ldcg(p.part_o + s * split_stride + r[b] * p.v_head_dim + col);
          StoreO<T>(p.o, r[b] * p.v_head_dim + col, o * inv[b]);
        }
      }
    }
    if (lane == 0 && p.lse != nullptr) {
#pragma unroll
      for (int b = 0; b < kMergeBatch; ++b) {
        if (b < n) p.lse[r[b]] = lse2[b] == -INFINITY ? -INFINITY : lse2[b] * kLn2;
      }
    }
    __syncwarp();  // every lane is done with w before the next batch's weights
  }
}

// Called by every thread of a split CTA launched in a cluster of its row block's splits
// (p.cluster; Hopper on), once its normalised O rows o_part [16][kD] and their log2-sum-exps
// lse_part [16] (-inf: saw no key) are in its shared memory. The cluster's CTAs merge the splits by
// LSE reading each other's shared memory: CTA rank j finishes the float4s j * blockDim.x + tid +
// k * splits * blockDim.x of the rows row-major, each thread loading one float4 and one lse per
// split at once. No global workspace, no fence, no ticket: the merge costs two cluster barriers
// and a round trip through the distributed shared memory, where the ticket merge paid a fence, an
// atomic and two L2 round trips after the last split. The second barrier keeps every CTA's shared
// memory alive until the others have read it.
template <typename T, int kD>
__device__ __forceinline__ void MergeSplitsInCluster(const PagedKernelParams& p,
                                                     const float* o_part, const float* lse_part,
                                                     int q0, int nq, int hk, int m0, int n_rows) {
#if __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's o_part and lse_part are written
  const int splits = p.splits;
  const int items = n_rows * (kD / 4);
  for (int i = static_cast<int>(cluster.block_rank()) * blockDim.x + threadIdx.x; i < items;
       i += splits * blockDim.x) {
    const int r = i / (kD / 4), col = i % (kD / 4) * 4;
    if (col >= p.v_head_dim) continue;
    float lse[kPagedMaxClusterSplits];
    float4 x[kPagedMaxClusterSplits];
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < kPagedMaxClusterSplits; ++s) {
      if (s >= splits) break;
      lse[s] = *cluster.map_shared_rank(lse_part + r, s);
      x[s] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(o_part + r * kD + col, s));
      mx = fmaxf(mx, lse[s]);
    }
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kPagedMaxClusterSplits; ++s) {
      if (s >= splits) break;
      const float w = mx == -INFINITY ? 0.f : exp2f(lse[s] - mx);
      sum += w;
      o.x += w * x[s].x, o.y += w * x[s].y, o.z += w * x[s].z, o.w += w * x[s].w;
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    float lse2 = sum > 0.f ? mx + log2f(sum) : -INFINITY;
    const PagedRow row = GetPagedRow(p, q0, nq, hk, m0 + r);
    if (p.sinks != nullptr) inv *= AddSink(p.sinks[row.head], lse2);
    StoreO4<T>(p.o, row.index * p.v_head_dim + col,
               make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv));
    if (col == 0 && p.lse != nullptr) {
      p.lse[row.index] = lse2 == -INFINITY ? -INFINITY : lse2 * kLn2;
    }
  }
  cluster.sync();  // the others are done reading this CTA's shared memory
#endif
}

// kSoftcap: the logits are capped (Softcap) before the mask, and the softmax runs at scale 1 on
// them; the plain instance has no instruction of it.
template <typename Tile, bool kSoftcap = false>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinCtasPerSm)
    PagedDecodeKernel(const PagedKernelParams p) {
  using T = typename Tile::Element;
  constexpr int kD = Tile::kD, kBc = Tile::kBc, kStages = Tile::kStages;
  constexpr int kRowBytes = Tile::kRowBytes, kWarpKeys = Tile::kWarpKeys;
  constexpr int kNTiles = kWarpKeys / 8;      // 8-key column tiles of this warp's S
  constexpr int kDTiles = kD / 8;             // 8-wide column tiles of O
  constexpr int kKSteps = Tile::kChunks / 2;  // k-steps of Q K^T
  constexpr int kThreads = Tile::kThreads;
  constexpr int kRowStep = kThreads / Tile::kChunks;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = SmemAddress(smem);
  const uint32_t s_kv = s_q + Tile::kQBytes;  // [kStages][K tile, V tile]

  if (threadIdx.x == 0) Tile::Trace::Mark(kTraceStart);
  const int seq = blockIdx.z;
  const int hk = blockIdx.y / p.m_blocks, m0 = blockIdx.y % p.m_blocks * kPagedRows;
  const int split_lo = blockIdx.x * p.split_keys;
  const int32_t* page_table = p.page_table + seq * p.page_table_stride;
  // The page-table entries of the first kStages - 1 tiles from split_lo, read together with the
  // lengths below (they follow from the grid alone), so that the first K/V requests wait for one
  // round trip to memory instead of two; used when the CTA's keys start at split_lo (no left window
  // cuts them).
  int first_pages[kStages - 1];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int at = (split_lo + s * kBc) / p.page_rows;
    first_pages[s] = at < p.page_table_stride ? page_table[at] : 0;
  }
  PagedCtaWork work;
  if (!GetPagedCtaWork<kPagedRows, kBc>(p, seq, m0, split_lo, work)) return;
  const int q0 = work.q0, nq = work.nq, nk = work.nk, row_last = work.row_last;
  const int first_query = work.first_query, last_query = work.last_query;
  const int tile_begin = work.tile_begin, n_tiles = work.n_tiles;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int d_chunks = p.head_dim / Tile::kChunkElems;

  // Loads: thread i copies chunk i % kChunks of tile rows i / kChunks + j * kRowStep, K and V.
  const int ld_chunk = threadIdx.x % Tile::kChunks, ld_row = threadIdx.x / Tile::kChunks;
  const bool ld_chunk_valid = ld_chunk < d_chunks;
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * 2;
  const int64_t head_offset = static_cast<int64_t>(hk) * p.page_rows * row_bytes;
  const int64_t v_offset = static_cast<int64_t>(p.heads_kv) * p.page_rows * row_bytes;
  const int64_t thread_offset = ld_row * row_bytes + ld_chunk * 16;
  // page: the tile's page-table entry when already read, else -1.
  auto load_tile = [&](int stage, int tile, int page) {
    const uint32_t s_k = s_kv + stage * Tile::kStageBytes, s_v = s_k + Tile::kTileBytes;
    const int n0 = (tile_begin + tile) * kBc;
    const int page_row0 = n0 % p.page_rows;
    if (page_row0 + kBc <= p.page_rows && n0 + kBc <= nk) {
      // The whole tile lies in one page, below the last key (pages of a multiple of kBc rows):
      // one page-table read, then rows at a fixed stride.
      if (page < 0) page = page_table[n0 / p.page_rows];
      const unsigned char* src =
          p.pool + page * p.page_bytes + page_row0 * row_bytes + head_offset + thread_offset;
      if (!ld_chunk_valid) src = p.pool;
#pragma unroll
      for (int j = 0; j < kBc / kRowStep; ++j) {
        const uint32_t off = SwizzledOffset<kRowBytes>(ld_row + j * kRowStep, ld_chunk);
        const unsigned char* row = ld_chunk_valid ? src + j * kRowStep * row_bytes : src;
        CpAsync16(s_k + off, row, ld_chunk_valid);
        CpAsync16(s_v + off, ld_chunk_valid ? row + v_offset : row, ld_chunk_valid);
      }
      return;
    }
    // Otherwise each row through the page table; rows past the last key are zero-filled.
#pragma unroll
    for (int j = 0; j < kBc / kRowStep; ++j) {
      const int r = ld_row + j * kRowStep, key = n0 + r;
      const bool valid = ld_chunk_valid && key < nk;
      const unsigned char* src = p.pool;
      if (valid) {
        const int page = page_table[key / p.page_rows];
        src += page * p.page_bytes + head_offset + (key % p.page_rows) * row_bytes + ld_chunk * 16;
      }
      const uint32_t off = SwizzledOffset<kRowBytes>(r, ld_chunk);
      CpAsync16(s_k + off, src, valid);
      CpAsync16(s_v + off, valid ? src + v_offset : src, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_tile(s, s, tile_begin * kBc == split_lo ? first_pages[s] : -1);
    CpAsyncCommit();
  }

  LoadPagedQ<T, kPagedRows, Tile::kChunks, kThreads>(p, s_q, q0, nq, hk, m0, row_last);
  __syncthreads();
  const uint32_t off_a = SwizzledOffset<kRowBytes>(lane & 15, lane >> 4);
  const uint32_t off_b =
      SwizzledOffset<kRowBytes>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  uint32_t q_frag[kKSteps][4];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) LdMatrixX4(q_frag[kk], s_q + PairOffset(off_a, kk));

  // The mask of rows g and g + 8 of the 16, and the keys every row sees (tiles inside them need
  // no element mask: inside every row's window and chunk, and below nk).
  KeyRange row_keys[2], all_rows;
  PagedLaneKeys(p, nq, nk, m0, g, first_query, last_query, row_keys, all_rows);

  float acc_o[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[dt][i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  // Capped logits are in the log2 domain already.
  const float scale_log2 = kSoftcap ? 1.f : p.scale_log2;

  for (int tile = 0; tile < n_tiles; ++tile) {
    // Tile `tile` has landed; every warp is past tile - 1, whose stage the next load reuses.
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    if (tile == 0 && threadIdx.x == 0) Tile::Trace::Mark(kTraceFirstTile);
    if (tile + kStages - 1 < n_tiles) {
      load_tile((tile + kStages - 1) % kStages, tile + kStages - 1, -1);
    }
    CpAsyncCommit();

    const uint32_t s_k = s_kv + (tile % kStages) * Tile::kStageBytes + warp * kWarpKeys * kRowBytes;
    const uint32_t s_v = s_k + Tile::kTileBytes;
    const int n0 = (tile_begin + tile) * kBc + warp * kWarpKeys;  // this warp's first key

    // Masked warp tiles: zero the Inf and NaN of this warp's V rows (as stored: the swizzle
    // permutes chunks within a row only) and flag their keys, bit j for key n0 + j.
    const bool masked = n0 < all_rows.lo || n0 + kWarpKeys > all_rows.hi;
    uint32_t nonfinite = 0;
    if (masked) {
      nonfinite = ZeroNonFiniteRows<T>(s_v, kWarpKeys * Tile::kChunks, Tile::kChunks, lane, 32);
      nonfinite = __reduce_or_sync(0xffffffffu, nonfinite);
      __syncwarp();  // the zeroed V is visible to the whole warp before P V
    }

    float acc_s[kNTiles][4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_s[nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t kb[4];
        LdMatrixX4(kb, s_k + np * 16 * kRowBytes + PairOffset(off_b, kk));
        Mma16816<T>(acc_s[2 * np], q_frag[kk], kb[0], kb[1]);
        Mma16816<T>(acc_s[2 * np + 1], q_frag[kk], kb[2], kb[3]);
      }
    }
    if constexpr (kSoftcap) SoftcapTile</*kApprox=*/false>(p, acc_s);

    if (masked) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        MaskRow(acc_s, half, row_keys[half], n0, t);
        if (nonfinite != 0) PoisonRow(acc_s, half, row_keys[half], n0, t, nonfinite);
      }
    }

    // Online softmax in the log2 domain (online_softmax.cuh). O is rescaled only when some row
    // of the warp got a new max (after the first tiles, most tiles leave every max as it was: the
    // rescale is then exactly 1).
    float rescale[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rescale[half] = OnlineSoftmaxRow(acc_s, half, row_max[half], row_sum[half], scale_log2);
    }
    if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_o[dt][i] *= rescale[i / 2];
    }

    // O += P V over this warp's keys, 16 at a time.
#pragma unroll
    for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = PackPair<T>(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      pa[1] = PackPair<T>(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      pa[2] = PackPair<T>(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      pa[3] = PackPair<T>(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
      MmaPV<T>(acc_o, pa, s_v + kk * 16 * kRowBytes, off_a);
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  if (threadIdx.x == 0) Tile::Trace::Mark(kTraceLoopDone);

  // Merge the warps: each stores (max, sum, O) of its rows; then every thread finishes columns.
  float* merge = reinterpret_cast<float*>(smem + Tile::kQBytes);
  float* m_max = merge + Tile::kWarps * kPagedRows * kD;  // [kWarps][16]
  float* m_sum = m_max + Tile::kWarps * kPagedRows;       // [kWarps][16]
  float* o_part = m_sum + Tile::kWarps * kPagedRows;      // [16][kD], p.cluster only
  float* lse_part = o_part + kPagedRows * kD;             // [16], p.cluster only
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    const float l = QuadSum(row_sum[half]);
    if (t == 0) {
      m_max[warp * kPagedRows + r] = row_max[half];
      m_sum[warp * kPagedRows + r] = l;
    }
    float* o_row = merge + (warp * kPagedRows + r) * kD;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * t) =
          make_float2(acc_o[dt][half * 2], acc_o[dt][half * 2 + 1]);
  }
  __syncthreads();
  // Thread r < 16 turns row r's (max, sum) of each warp into the warp's weight (in m_max), the
  // row's 1 / sum (m_sum[r]) and log2-sum-exp (m_sum[16 + r]) once; then every thread finishes 4
  // columns of a row at a time (the epilogue runs at 4 warps per SM: few instructions per output).
  if (threadIdx.x < kPagedRows) {
    const int r = threadIdx.x;
    float mx = -INFINITY, sum = 0.f;
#pragma unroll
    for (int w = 0; w < Tile::kWarps; ++w) mx = fmaxf(mx, m_max[w * kPagedRows + r]);
#pragma unroll
    for (int w = 0; w < Tile::kWarps; ++w) {
      const float weight =
          mx == -INFINITY ? 0.f : FastExp2((m_max[w * kPagedRows + r] - mx) * scale_log2);
      sum += weight * m_sum[w * kPagedRows + r];
      m_max[w * kPagedRows + r] = weight;
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    float lse2 = sum > 0.f ? mx * scale_log2 + log2f(sum) : -INFINITY;
    // One split: the sink joins the row here (several: where the splits merge).
    if (p.sinks != nullptr && p.splits == 1 && m0 + r <= row_last) {
      inv *= AddSink(p.sinks[GetPagedRow(p, q0, nq, hk, m0 + r).head], lse2);
    }
    m_sum[r] = inv;
    m_sum[kPagedRows + r] = lse2;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kPagedRows * kD / 4; i += kThreads) {
    const int r = i / (kD / 4), col = i % (kD / 4) * 4;
    if (m0 + r > row_last || col >= p.v_head_dim) continue;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Tile::kWarps; ++w) {
      const float weight = m_max[w * kPagedRows + r];
      const float4 x = *reinterpret_cast<const float4*>(merge + (w * kPagedRows + r) * kD + col);
      o.x += weight * x.x, o.y += weight * x.y, o.z += weight * x.z, o.w += weight * x.w;
    }
    const float inv = m_sum[r];
    o.x *= inv, o.y *= inv, o.z *= inv, o.w *= inv;
    if (p.cluster) {
      *reinterpret_cast<float4*>(o_part + r * kD + col) = o;
      if (col == 0) lse_part[r] = m_sum[kPagedRows + r];
      continue;
    }
    const PagedRow row = GetPagedRow(p, q0, nq, hk, m0 + r);
    StoreOut4<T>(p, row.index, col, o);
    if (col == 0) StoreLse(p, row.index, m_sum[kPagedRows + r]);
  }
  if (threadIdx.x == 0) Tile::Trace::Mark(kTraceStored);
  if (p.cluster) {
    MergeSplitsInCluster<T, kD>(p, o_part, lse_part, q0, nq, hk, m0, row_last - m0 + 1);
  } else if (p.splits > 1) {
    // The merge area is free once every thread is past the loop above (the merge syncs first).
    MergeSplitsIfLast<T>(p, merge);
  }
  if (threadIdx.x == 0) Tile::Trace::Mark(kTraceEnd);
}

// The SIMT path: warp w computes rows w, w + 4, ... of the CTA's 16, lane l owning columns
// l + 32 c of q and k (D) and of v and o (Dv). Any head dims up to 32 * kMaxCols: kMaxCols 8 (up
// to 256, every plain head dim) or 18 (MLA's absorbed decode, QK 576 / V 512), compiled apart so
// that the narrow instance keeps its registers.
// __launch_bounds__(threads, 1): without a minimum of resident CTAs ptxas held this kernel to 64
// registers and spilled 8 bytes; it runs at most 16 warps per SM anyway.
template <typename T, int kMaxCols>
__global__ void __launch_bounds__(kPagedThreads, 1) PagedSimtKernel(const PagedKernelParams p) {
  const int seq = blockIdx.z;
  const int hk = blockIdx.y / p.m_blocks, m0 = blockIdx.y % p.m_blocks * kPagedRows;
  const int q0 = p.cu_seqlens_q[seq], nq = p.cu_seqlens_q[seq + 1] - q0;
  const int nk = p.seqlens_k[seq];
  const int rows = p.group * nq;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float merge_weights[kPagedThreads / 32][kPagedMaxSplits];
  const int32_t* page_table = p.page_table + seq * p.page_table_stride;
  // Elements from a page's start: this kv head's K rows, and its V rows after every head's K (or
  // K's own rows, v_pitch = D apart, where V is their first Dv columns).
  const int64_t k_offset = static_cast<int64_t>(hk) * p.page_rows * p.head_dim;
  const int64_t v_offset = p.v_from_k
                               ? k_offset
                               : static_cast<int64_t>(p.heads_kv) * p.page_rows * p.head_dim +
                                     static_cast<int64_t>(hk) * p.page_rows * p.v_head_dim;
  const int v_pitch = p.v_from_k ? p.head_dim : p.v_head_dim;
  const float sign = p.negate_q ? -1.f : 1.f;
  const bool softcap = p.softcap_log2 > 0.f;
  const float scale_log2 = softcap ? 1.f : p.scale_log2;  // capped logits are log2 already
  for (int m = m0 + warp; m < min(m0 + kPagedRows, rows); m += kPagedThreads / 32) {
    const PagedRow row = GetPagedRow(p, q0, nq, hk, m);
    const KeyRange vis = ChunkedVisibleKeys(p, nq, nk, row.query, row.query);
    const int split_lo = blockIdx.x * p.split_keys;
    const int k_lo = max(vis.lo, split_lo), k_hi = min(vis.hi, split_lo + p.split_keys);
    float q[kMaxCols], acc[kMaxCols];
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) {
      const int col = lane + 32 * c;
      q[c] =
          col < p.head_dim
              ? sign * static_cast<float>(static_cast<const T*>(p.q)[row.index * p.head_dim + col])
              : 0.f;
      acc[c] = 0.f;
    }
    float mx = -INFINITY, sum = 0.f;
    for (int key = k_lo; key < k_hi; ++key) {
      const T* page =
          reinterpret_cast<const T*>(p.pool + page_table[key / p.page_rows] * p.page_bytes);
      const int64_t page_row = key % p.page_rows;
      const T* k = page + k_offset + page_row * p.head_dim;
      const T* v = page + v_offset + page_row * v_pitch;
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c) {
        const int col = lane + 32 * c;
        if (col < p.head_dim) s += q[c] * static_cast<float>(k[col]);
      }
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) s += __shfl_xor_sync(0xffffffffu, s, x);
      if (softcap) s = Softcap</*kApprox=*/false>(p, s);
      float rescale;
      const float pk = OnlineSoftmaxKey(s, mx, sum, scale_log2, rescale);
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c) {
        const int col = lane + 32 * c;
        acc[c] = acc[c] * rescale + (col < p.v_head_dim ? pk * static_cast<float>(v[col]) : 0.f);
      }
    }
    float inv = sum > 0.f ? 1.f / sum : 0.f;
    float lse2 = sum > 0.f ? mx * scale_log2 + log2f(sum) : -INFINITY;
    // One split: the sink joins the row here (several: where the splits merge).
    if (p.sinks != nullptr && p.splits == 1) inv *= AddSink(p.sinks[row.head], lse2);
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) {
      const int col = lane + 32 * c;
      if (col < p.v_head_dim) StoreOut<T>(p, row.index, col, acc[c] * inv);
    }
    if (lane == 0) StoreLse(p, row.index, lse2);
  }
  if (p.splits > 1) MergeSplitsIfLast<T>(p, &merge_weights[0][0]);
}

}  // namespace attention::cuda
