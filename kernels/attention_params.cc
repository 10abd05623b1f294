#include "kernels/attention_params.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
  }
  return "unknown";
}

void AttentionParams::SetContiguousStrides(Layout layout) {
  const int64_t d = head_dim;
  const int64_t dv = value_head_dim();  // v's and o's
  if (is_varlen()) {
    // Packed [total, H, D]: rows advance by H*D; batch items are found through cu_seqlens.
    q_batch_stride = k_batch_stride = v_batch_stride = o_batch_stride = 0;
    q_row_stride = heads_q * d;
    o_row_stride = heads_q * dv;
    k_row_stride = heads_kv * d;
    v_row_stride = heads_kv * dv;
    q_head_stride = k_head_stride = d;
    v_head_stride = o_head_stride = dv;
    lse_batch_stride = 0;
    lse_head_stride = total_q;  // lse: [Hq, total_q]
    return;
  }
  if (layout == Layout::kBHSD) {  // [B, H, N, D]
    q_row_stride = k_row_stride = d;
    o_row_stride = v_row_stride = dv;
    q_head_stride = seqlen_q * d;
    o_head_stride = seqlen_q * dv;
    k_head_stride = seqlen_k * d;
    v_head_stride = seqlen_k * dv;
  } else {  // [B, N, H, D]
    q_row_stride = heads_q * d;
    o_row_stride = heads_q * dv;
    k_row_stride = heads_kv * d;
    v_row_stride = heads_kv * dv;
    q_head_stride = k_head_stride = d;
    o_head_stride = v_head_stride = dv;
  }
  q_batch_stride = heads_q * seqlen_q * d;
  o_batch_stride = heads_q * seqlen_q * dv;
  k_batch_stride = heads_kv * seqlen_k * d;
  v_batch_stride = heads_kv * seqlen_k * dv;
  lse_head_stride = seqlen_q;  // lse: [B, Hq, Nq]
  lse_batch_stride = heads_q * seqlen_q;
}

absl::Status CheckParams(const AttentionParams& p) {
  if (!p.q || !p.k || !p.v || !p.o) {
    return absl::InvalidArgumentError("q, k, v and o must all be set");
  }
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 ||
      p.head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shapes must be positive: batch=", p.batch, " heads_q=", p.heads_q, " heads_kv=",
        p.heads_kv, " seqlen_q=", p.seqlen_q, " seqlen_k=", p.seqlen_k, " head_dim=", p.head_dim));
  }
  if (p.heads_q % p.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads_q (", p.heads_q, ") must be a multiple of heads_kv (", p.heads_kv, ")"));
  }
  if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr)) {
    return absl::InvalidArgumentError("cu_seqlens_q and cu_seqlens_k must be set together");
  }
  if (p.window_left < kUnboundedWindow || p.window_right < kUnboundedWindow) {
    return absl::InvalidArgumentError(absl::StrCat("window bounds must be >= 0 or unbounded, got ",
                                                   p.window_left, ", ", p.window_right));
  }
  if (p.v_head_dim < 0 || p.chunk_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("v_head_dim and chunk_size must be >= 0, got ",
                                                   p.v_head_dim, ", ", p.chunk_size));
  }
  if (!(std::isfinite(p.softcap) && p.softcap >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap must be finite and >= 0 (0: none), got ", p.softcap));
  }
  for (const auto& [name, descale] : {std::pair{"q_descale", p.q_descale},
                                      {"k_descale", p.k_descale},
                                      {"v_descale", p.v_descale}}) {
    if (!(std::isfinite(descale) && descale > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be finite and > 0, got ", descale));
    }
  }
  return absl::OkStatus();
}

std::string OpenModelOptionNames(const AttentionParams& p) {
  std::string names;
  const auto add = [&names](bool set, const char* name) {
    if (set) absl::StrAppend(&names, names.empty() ? "" : ", ", name);
  };
  add(p.sinks != nullptr, "sinks");
  add(p.softcap != 0.0f, "softcap");
  add(p.chunk_size != 0, "chunk_size");
  add(p.value_head_dim() != p.head_dim, "v_head_dim");
  return names;
}

absl::Status RefuseOpenModelOptions(const AttentionParams& p, const char* backend) {
  if (!p.has_open_model_options()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(OpenModelOptionNames(p), ": not implemented by the ",
                                               backend, " backend (the cpu backend serves them)"));
}

absl::Status StoppedError() {
  return absl::CancelledError("stopped while running: nobody waits for the result any more");
}

int64_t VisibleKeyPairs(int64_t nq, int64_t nk, int64_t window_left, int64_t window_right,
                        MaskAlignment alignment) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t diagonal = i + MaskDiagonal(alignment, nq, nk);
    const int64_t lo =
        window_left == kUnboundedWindow ? 0 : std::max<int64_t>(0, diagonal - window_left);
    const int64_t hi =
        window_right == kUnboundedWindow ? nk - 1 : std::min(nk - 1, diagonal + window_right);
    pairs += std::max<int64_t>(0, hi - lo + 1);
  }
  return pairs;
}

}  // namespace attention
