// The plain C++ interface every attention backend implements: one forward pass described by
// pointers, shapes and strides. No gRPC, no protobuf: the server fills this from a request.
//
// Indexing (element strides, not bytes), for batch item b, head h, row i, feature d:
//   q[b * q_batch_stride + (q_row_offset(b) + i) * q_row_stride + h * q_head_stride + d]
// and likewise for k, v (kv head h / (heads_q / heads_kv)) and o. Contiguous BHSD and BSHD are two
// choices of strides (SetContiguousStrides); varlen packs [total, H, D] and uses cu_seqlens_*.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace attention {

// kFloat8E4M3: OCP FP8 E4M3FN inputs (kernels/float8.h), whose output is bfloat16 (OutputDType).
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };
enum class Layout { kBHSD, kBSHD };
// Which corner the mask's diagonal starts from: bottom-right (FlashAttention's convention, the
// default) puts query i on key i + Nk - Nq, top-left (torch SDPA's) on key i.
enum class MaskAlignment { kBottomRight, kTopLeft };

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
// The dtype o is written in for inputs of `dtype`: the same, but bfloat16 for float8 (a float8 o
// would lose most of the accuracy the float32 accumulation buys).
inline DType OutputDType(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : dtype;
}

// A window bound that is absent: the row sees every key on that side.
inline constexpr int64_t kUnboundedWindow = -1;

struct AttentionParams {
  DType dtype = DType::kFloat32;

  // q and k: [.., Hq or Hkv, N, D], v: [.., Hkv, Nk, Dv], all of `dtype` (Dv = value_head_dim());
  // o: [.., Hq, Nq, Dv] of OutputDType(dtype).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  // Optional, float32, natural log: [B, Hq, Nq] (varlen: [Hq, total_q]). nullptr: not computed.
  float* lse = nullptr;

  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  // Per-item lengths; with varlen, the largest item's lengths (used to size GPU grids).
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;
  // V's (and o's) head dim when it differs from Q's and K's (MLA: DeepSeek's prefill 192/128; the
  // absorbed decode reads V as the first 512 features of K's 576, v pointing into k with k's
  // strides); 0: head_dim.
  int64_t v_head_dim = 0;

  // Element strides. With varlen the batch strides are 0 and rows start at cu_seqlens[b].
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  // lse[b * lse_batch_stride + h * lse_head_stride + q_row_offset(b) + i]
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  float softmax_scale = 1.0f;
  // Per-tensor factors (finite, > 0): attention runs on q * q_descale, k * k_descale and
  // v * v_descale. The server sets them only for float8 inputs (1 otherwise); backends apply them
  // to any dtype, folded in: softmax_scale * q_descale * k_descale scales the logits of the raw
  // values (EffectiveSoftmaxScale) and v_descale multiplies o.
  float q_descale = 1.0f, k_descale = 1.0f, v_descale = 1.0f;

  // Mask: query i sees key j iff
  //   i + diag - window_left <= j <= i + diag + window_right,
  // with an unbounded side skipped, diag = Nk - Nq (bottom-right aligned, FlashAttention's
  // convention) or 0 (top-left, torch SDPA's); MaskDiagonal gives it. Causal is window_right = 0.
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  MaskAlignment mask_alignment = MaskAlignment::kBottomRight;
  // Chunked attention (Llama 4's attention_chunk_size), when > 0: query i also sees only keys in
  // the chunk of its diagonal key, floor(j / chunk_size) == floor((i + diag) / chunk_size).
  int64_t chunk_size = 0;

  // Open-model options; absent (nullptr, 0) changes nothing.
  // Logit softcapping (Gemma 2), when > 0: each logit s = scale * q.k becomes
  // softcap * tanh(s / softcap) before the mask.
  float softcap = 0.0f;
  // Per-query-head sink logits (gpt-oss), float32 [Hq], natural log, host memory: the softmax
  // denominator of every row of head h gains exp(sinks[h]) (a key that is seen by all rows and
  // contributes no value), so o = sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j)) and lse =
  // log(exp(sinks[h]) + sum_j exp(s_j)); a row that sees no key gets o = 0 and lse = sinks[h].
  const float* sinks = nullptr;

  // Set by the caller once nobody waits for the result (the call was cancelled, its deadline
  // passed, or the server gave up on it while shutting down). A backend checks it between tiles
  // and then returns CANCELLED with o and lse undefined. nullptr: never stopped.
  const std::atomic<bool>* stop = nullptr;

  // Varlen: batch + 1 monotonic offsets into packed rows; nullptr when not varlen. Host memory for
  // the CPU backend, device memory for the CUDA backend.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // Varlen: rows in the packed tensors (cu_seqlens_*[batch]).
  int64_t total_q = 0;
  int64_t total_k = 0;

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  bool is_causal() const { return window_right == 0; }
  int64_t value_head_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  // Whether any open-model option (sinks, softcap, chunk_size, a V head dim of its own) is set.
  bool has_open_model_options() const {
    return sinks != nullptr || softcap != 0.0f || chunk_size != 0 || value_head_dim() != head_dim;
  }

  // Fills every stride (q, k, v, o and lse) for contiguous tensors in `layout` (or packed varlen
  // [total, H, D] when cu_seqlens are set, whatever `layout` says).
  void SetContiguousStrides(Layout layout);
};

// The scale of the raw q.k products: softmax_scale * q_descale * k_descale, rounded to float once.
inline float EffectiveSoftmaxScale(const AttentionParams& p) {
  return static_cast<float>(static_cast<double>(p.softmax_scale) * p.q_descale * p.k_descale);
}

// Checks the fields a backend relies on (non-null pointers, positive shapes, Hq % Hkv == 0).
// Requests are validated with clearer messages in the server; this guards direct callers.
absl::Status CheckParams(const AttentionParams& p);

// The open-model options set in p, by their field names ("sinks, softcap"), for a backend's
// refusal; empty when none is.
std::string OpenModelOptionNames(const AttentionParams& p);
// OK when p sets no open-model option, else UNIMPLEMENTED naming them and `backend`.
absl::Status RefuseOpenModelOptions(const AttentionParams& p, const char* backend);

// What a backend answers when `stop` ended its run.
absl::Status StoppedError();
inline bool StopRequested(const std::atomic<bool>* stop) {
  return stop != nullptr && stop->load(std::memory_order_relaxed);
}

// The key on query 0's diagonal for an item of nq queries and nk keys: query i's is i + this.
inline int64_t MaskDiagonal(MaskAlignment alignment, int64_t nq, int64_t nk) {
  return alignment == MaskAlignment::kTopLeft ? 0 : nk - nq;
}

// The keys a query whose diagonal key is `diagonal` may see under a window (kUnboundedWindow: that
// side unbounded) and chunks (0: none): lo..hi, not clamped to the item's keys (an unbounded side
// is far outside them; lo > hi: none). Both bounds are nondecreasing in the diagonal, so a block
// of rows sees keys lo(first row)..hi(last row).
struct RowKeys {
  int64_t lo, hi;
};
inline RowKeys VisibleKeys(int64_t diagonal, int64_t window_left, int64_t window_right,
                           int64_t chunk_size) {
  int64_t lo = window_left == kUnboundedWindow ? INT64_MIN / 4 : diagonal - window_left;
  int64_t hi = window_right == kUnboundedWindow ? INT64_MAX / 4 : diagonal + window_right;
  if (chunk_size > 0) {
    // The diagonal key's chunk, by floor division (the diagonal is negative when Nq > Nk).
    const int64_t first =
        (diagonal / chunk_size - (diagonal % chunk_size < 0 ? 1 : 0)) * chunk_size;
    lo = lo > first ? lo : first;
    hi = hi < first + chunk_size - 1 ? hi : first + chunk_size - 1;
  }
  return {lo, hi};
}
// The same for query i (item-local) of an item of nq queries and nk keys under p's mask.
inline RowKeys VisibleKeys(const AttentionParams& p, int64_t i, int64_t nq, int64_t nk) {
  return VisibleKeys(i + MaskDiagonal(p.mask_alignment, nq, nk), p.window_left, p.window_right,
                     p.chunk_size);
}

// (query row, key) pairs of one sequence with nq queries and nk keys under the window aligned as
// `alignment` says: row i sees keys max(0, i+diag-left) .. min(nk-1, i+diag+right), diag =
// MaskDiagonal. FLOPs of the sequence are 4 * Hq * D * pairs.
int64_t VisibleKeyPairs(int64_t nq, int64_t nk, int64_t window_left, int64_t window_right,
                        MaskAlignment alignment = MaskAlignment::kBottomRight);

}  // namespace attention
