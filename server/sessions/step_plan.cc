#include "server/sessions/step_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attention::server {

DecodePlan::DecodePlan(const DecodeKey& key, std::vector<DecodeSequence> seqs) {
  const int64_t n = static_cast<int64_t>(seqs.size());
  cu_seqlens_q_.assign(n + 1, 0);
  seqlens_k_.assign(n, 0);
  int64_t stride = 0;
  PagedDecodeParams& p = params_;
  for (int64_t s = 0; s < n; ++s) {
    const DecodeSequence& seq = seqs[s];
    cu_seqlens_q_[s + 1] = cu_seqlens_q_[s] + static_cast<int32_t>(seq.rows_q);
    seqlens_k_[s] = static_cast<int32_t>(seq.length);
    stride = std::max<int64_t>(stride, static_cast<int64_t>(seq.pages.size()));
    p.max_seqlen_q = std::max(p.max_seqlen_q, seq.rows_q);
    p.max_seqlen_k = std::max(p.max_seqlen_k, seq.length);
    q_seqs_.push_back(seq.q);
    o_seqs_.push_back(seq.o);
    if (key.lse) lse_seqs_.push_back(seq.lse);
  }
  page_table_.assign(n * stride, 0);
  for (int64_t s = 0; s < n; ++s) {
    std::copy(seqs[s].pages.begin(), seqs[s].pages.end(), page_table_.begin() + s * stride);
  }
  p.shape = key.shape;
  p.heads_q = key.heads_q;
  p.num_seqs = n;
  p.q_seqs = q_seqs_.data();
  p.o_seqs = o_seqs_.data();
  p.lse_seqs = key.lse ? lse_seqs_.data() : nullptr;
  p.cu_seqlens_q = cu_seqlens_q_.data();
  p.total_q = cu_seqlens_q_[n];
  p.seqlens_k = seqlens_k_.data();
  p.page_table = page_table_.data();
  p.page_table_stride = stride;
  p.softmax_scale = key.softmax_scale;
  p.window_left = key.window_left;
  p.window_right = key.window_right;
  p.sinks = key.sinks;
  p.softcap = key.softcap;
  p.chunk_size = key.chunk_size;
  p.memory = key.memory;
}

absl::Status CheckQueriesFit(absl::FunctionRef<std::string()> field, int64_t rows_q,
                             int64_t new_rows, int64_t length) {
  const int64_t length_after = length + new_rows;
  if (rows_q > length_after) {
    return absl::InvalidArgumentError(absl::StrCat(
        field(), ": expected at most the session's ", length_after,
        " rows after this step's append (queries are its last positions), got ", rows_q));
  }
  return absl::OkStatus();
}

double DecodeFlops(const DecodeKey& key, const DecodeSequence& seq) {
  return 4.0 * static_cast<double>(key.heads_q) * static_cast<double>(key.shape.head_dim) *
         static_cast<double>(
             VisibleKeyPairs(seq.rows_q, seq.length, key.window_left, key.window_right));
}

}  // namespace attention::server
