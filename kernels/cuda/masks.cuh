// Device helpers over KernelParams: where a batch item lives, which keys a row may see, and a
// fast exp2.
#pragma once

#include "kernels/cuda/kernel_params.h"

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

// Keys [lo, hi) that rows [row_first, row_last] of an item may see (bottom-right aligned mask:
// row i sees key j iff i + nk - nq - window_left <= j <= i + nk - nq + window_right).
struct KeyRange {
  int lo, hi;
};

__device__ __forceinline__ KeyRange VisibleKeys(const KernelParams& p, const ItemExtent& e,
                                                int row_first, int row_last) {
  const int diag = e.nk - e.nq;
  int lo = 0, hi = e.nk;
  if (p.window_left >= 0) lo = max(lo, row_first + diag - p.window_left);
  if (p.window_right >= 0) hi = min(hi, row_last + diag + p.window_right + 1);
  return {lo, hi};
}

// Whether key tile [n0, n0 + tile) needs per-element masks for rows [row_first, row_last]: it
// runs past the keys, or crosses the window edge of the first or the last row.
__device__ __forceinline__ bool TileNeedsMask(const KernelParams& p, const ItemExtent& e,
                                              int row_first, int row_last, int n0, int tile) {
  const int diag = e.nk - e.nq;
  return n0 + tile > e.nk ||
         (p.window_right >= 0 && n0 + tile - 1 > row_first + diag + p.window_right) ||
         (p.window_left >= 0 && n0 < row_last + diag - p.window_left);
}

// 2^x on the special-function unit; 2^-inf = +0, which masked logits rely on.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace attention::cuda
