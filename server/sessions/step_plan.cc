#include "server/sessions/step_plan.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace attention::server {

DecodePlan::DecodePlan(const DecodeKey& key, std::vector<DecodeSequence> seqs)
    : key_(key), seqs_(std::move(seqs)) {
  const int64_t n = static_cast<int64_t>(seqs_.size());
  row_bytes_ =
      key_.heads_q * key_.shape.head_dim * static_cast<int64_t>(DTypeSize(key_.shape.dtype));
  cu_seqlens_q_.assign(n + 1, 0);
  seqlens_k_.assign(n, 0);
  int64_t stride = 0;
  PagedDecodeParams& p = params_;
  for (int64_t s = 0; s < n; ++s) {
    const DecodeSequence& seq = seqs_[s];
    cu_seqlens_q_[s + 1] = cu_seqlens_q_[s] + static_cast<int32_t>(seq.rows_q);
    seqlens_k_[s] = static_cast<int32_t>(seq.length);
    stride = std::max<int64_t>(stride, static_cast<int64_t>(seq.pages.size()));
    p.max_seqlen_q = std::max(p.max_seqlen_q, seq.rows_q);
    p.max_seqlen_k = std::max(p.max_seqlen_k, seq.length);
  }
  page_table_.assign(n * stride, 0);
  for (int64_t s = 0; s < n; ++s) {
    std::copy(seqs_[s].pages.begin(), seqs_[s].pages.end(), page_table_.begin() + s * stride);
  }
  const int64_t total_q = cu_seqlens_q_[n];
  p.shape = key_.shape;
  p.heads_q = key_.heads_q;
  p.num_seqs = n;
  p.cu_seqlens_q = cu_seqlens_q_.data();
  p.total_q = total_q;
  p.seqlens_k = seqlens_k_.data();
  p.page_table = page_table_.data();
  p.page_table_stride = stride;
  p.softmax_scale = key_.softmax_scale;
  p.window_left = key_.window_left;
  p.window_right = key_.window_right;
  if (n == 1) {
    // The kernel reads q and writes o and lse where the sequence keeps them.
    p.q = seqs_[0].q;
    p.o = seqs_[0].o;
    p.lse = key_.lse ? seqs_[0].lse : nullptr;
    return;
  }
  // Packed: sequence s's [Hq, Nq_s, D] rows start at row cu_seqlens_q[s] of [total_q].
  q_packed_ = std::make_unique_for_overwrite<char[]>(total_q * row_bytes_);
  for (int64_t s = 0; s < n; ++s) {
    std::memcpy(q_packed_.get() + cu_seqlens_q_[s] * row_bytes_, seqs_[s].q,
                seqs_[s].rows_q * row_bytes_);
  }
  o_packed_ = std::make_unique_for_overwrite<char[]>(total_q * row_bytes_);
  if (key_.lse) lse_packed_ = std::make_unique_for_overwrite<float[]>(total_q * key_.heads_q);
  p.q = q_packed_.get();
  p.o = o_packed_.get();
  p.lse = lse_packed_.get();
}

double DecodeFlops(const DecodeKey& key, const DecodeSequence& seq) {
  return 4.0 * static_cast<double>(key.heads_q) * static_cast<double>(key.shape.head_dim) *
         static_cast<double>(
             VisibleKeyPairs(seq.rows_q, seq.length, key.window_left, key.window_right));
}

void DecodePlan::Unpack() const {
  if (seqs_.size() == 1) return;  // written in place
  for (size_t s = 0; s < seqs_.size(); ++s) {
    const DecodeSequence& seq = seqs_[s];
    std::memcpy(seq.o, o_packed_.get() + cu_seqlens_q_[s] * row_bytes_, seq.rows_q * row_bytes_);
    if (key_.lse) {
      std::memcpy(seq.lse, lse_packed_.get() + cu_seqlens_q_[s] * key_.heads_q,
                  seq.rows_q * key_.heads_q * sizeof(float));
    }
  }
}

}  // namespace attention::server
