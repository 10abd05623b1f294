// The plain-old-data view of AttentionParams that the CUDA kernels take by value. Lengths fit
// int32 (the launcher checks); offsets are int64 so that tensors past 2^31 elements index
// correctly. Also the host-side conversions that the forward and the paged decode params share
// (the softmax scale into the log2 domain, window bounds into int32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attention::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

struct KernelParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // nullptr: not computed
  // Element strides (see AttentionParams).
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int batch, heads_q;      // the grid's y and z extents
  int seqlen_q, seqlen_k;  // varlen: the largest item's
  int total_q, total_k;    // rows of the q and k tensors: varlen, the packed rows; else seqlen
  int kv_group;            // heads_q / heads_kv
  int head_dim;            // the real D; kernels specialised for a larger D zero-fill the rest
  // The kernel computes exp2(scale_log2 * (q.k - rowmax(q.k))) with scale_log2 > 0, so that the
  // max of the raw logits is the max of the scaled ones: scale_log2 = |scale| * log2(e), raised
  // to FLT_MIN for a zero scale (every exp2 is then 1, as with scale 0, and -inf stays -inf
  // instead of becoming NaN); negate_q flips Q's sign for a negative scale.
  float scale_log2;
  bool negate_q;
  // o = acc * o_scale / l: AttentionParams::v_descale folded into the normalisation (1 for
  // unscaled inputs), so that float8 V reaches the kernel as its exact bfloat16 values.
  float o_scale;
  // Window bounds, -1 = unbounded; the launcher turns bounds that exclude nothing into -1.
  int window_left, window_right;
  // The mask's diagonal: false = bottom-right (query i on key i + nk - nq), true = top-left (on
  // key i); see MaskDiagonal in masks.cuh.
  bool mask_top_left;
  const int32_t* cu_seqlens_q;  // device, batch + 1 entries; nullptr when not varlen
  const int32_t* cu_seqlens_k;
  // The open-model options (AttentionParams), read only by the kernels' options instances
  // (HasOptions picks them; the plain ones have none of this code). sinks: float32 [Hq] natural-log
  // sink logits in device memory (ForwardScratch::sinks), nullptr: none. softcap_log2 > 0: the
  // logits are capped, s2 = softcap_log2 * tanh(q.k * softcap_scale) in the log2 domain
  // (softcap_log2 = softcap log2(e), softcap_scale = |scale| / softcap, q negated for a negative
  // scale), and scale_log2 is 1. chunk_size > 0: a row also sees only the keys in its diagonal
  // key's chunk (ChunkedVisibleKeys, masks.cuh).
  const float* sinks;
  float softcap_log2, softcap_scale;
  int chunk_size;
  // Device, 2 entries, zero at launch and left zero: the wgmma kernel's dynamic tile scheduler
  // (ForwardScratch, cuda_attention.h); the mma.sync kernels ignore it.
  int32_t* tile_counters;
  // float8 on the wgmma kernel: device memory for V transposed (LaunchTransposeE4m3V, the
  // launch's workspace: ForwardPlan::workspace_bytes), written by the launcher before the kernel.
  void* v_transposed;
};

// Whether p sets an open-model option: the launchers then run the kernels' options instances.
inline bool HasOptions(const KernelParams& p) {
  return p.sinks != nullptr || p.softcap_log2 > 0.f || p.chunk_size > 0;
}

// The kernels' form of a softmax scale (KernelParams::scale_log2 and negate_q).
struct Log2Scale {
  float scale_log2;
  bool negate_q;
  // o = acc * o_scale / l: AttentionParams::v_descale folded into the normalisation (1 for
  // unscaled inputs), so that float8 V reaches the kernel as its exact bfloat16 values.
  float o_scale;
};
inline Log2Scale ToLog2Scale(float softmax_scale) {
  return {std::max(std::fabs(softmax_scale) * kLog2e, std::numeric_limits<float>::min()),
          softmax_scale < 0};
}

// A window bound that excludes no key of any row becomes unbounded (-1), so it fits in int32.
// Bottom-right, row i sees keys from i + nk - nq - window_left, so window_left >= nk reaches below
// key 0 for every row (covering = nk); likewise window_right >= nq past the last key (covering =
// nq). Top-left (diagonal key i) swaps them: window_left >= nq, window_right >= nk.
inline int ClampWindow(int64_t bound, int64_t covering) {
  return bound < 0 || bound >= covering ? -1 : static_cast<int>(bound);
}

}  // namespace attention::cuda
