// Step planning: one decode launch over the sequences of one or more Steps. Each sequence is a
// session's page table and length (after the step's append) and its new queries; the plan builds
// what PagedDecodeParams takes (page table rows, key lengths, cu_seqlens, and each sequence's own
// q, o and lse buffers, which the pool gathers and scatters itself). Plain data, no gRPC: the
// scheduler builds one plan per launch, so Steps of different calls can share it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/paged_kv.h"

namespace attention::server {

// What sequences must share to decode in one launch.
struct DecodeKey {
  KvShape shape;
  int64_t heads_q = 0;
  float softmax_scale = 1.0f;
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  bool lse = false;  // the launch writes lse for every sequence
  // The Step's open-model options (PagedDecodeParams'): sinks point into the request, so only
  // sequences of one Step share them.
  const float* sinks = nullptr;
  float softcap = 0.0f;
  int64_t chunk_size = 0;
  // Where q, o and lse are, and the Step's events or counters: a Step in stream order shares
  // its launch with no other Step.
  StepMemory memory;

  bool operator==(const DecodeKey& other) const {
    return shape == other.shape && heads_q == other.heads_q &&
           softmax_scale == other.softmax_scale && window_left == other.window_left &&
           window_right == other.window_right && lse == other.lse && sinks == other.sinks &&
           softcap == other.softcap && chunk_size == other.chunk_size && memory == other.memory;
  }
};

// One sequence of a launch. The pointers are host memory that outlives the launch, or device
// memory when the key's memory says so.
struct DecodeSequence {
  absl::Span<const int32_t> pages;  // the session's page table, covering `length` rows
  int64_t length = 0;               // keys, this step's new rows included
  const void* q = nullptr;          // [Hq, Nq, D] of the key's dtype
  int64_t rows_q = 0;               // Nq: the session's last Nq positions
  void* o = nullptr;                // [Hq, Nq, D], written by the launch
  float* lse = nullptr;             // [Hq, Nq] float32 when the key asks for lse
};

// The check of a sequence that needs its session's length (`length` rows before the step): its
// queries are the session's last positions, so at most as many as it holds after the append of
// `new_rows`. `field` names the queries' field in the refusal (called only then).
absl::Status CheckQueriesFit(absl::FunctionRef<std::string()> field, int64_t rows_q,
                             int64_t new_rows, int64_t length);

// FLOPs of one sequence's step, counted as a forward pass counts them: 4 * Hq * D * the visible
// (query, key) pairs.
double DecodeFlops(const DecodeKey& key, const DecodeSequence& seq);

class DecodePlan {
 public:
  // `seqs` must not be empty.
  DecodePlan(const DecodeKey& key, std::vector<DecodeSequence> seqs);
  DecodePlan(const DecodePlan&) = delete;
  DecodePlan& operator=(const DecodePlan&) = delete;

  // For Executor::RunDecode, per-sequence form (q_seqs, o_seqs, lse_seqs): the launch writes each
  // sequence's o and lse into its own buffers.
  const PagedDecodeParams& params() const { return params_; }

 private:
  std::vector<int32_t> cu_seqlens_q_;  // [seqs + 1]
  std::vector<int32_t> seqlens_k_;     // [seqs]
  std::vector<int32_t> page_table_;    // [seqs, stride], unused pages 0
  std::vector<const void*> q_seqs_;    // [seqs]
  std::vector<void*> o_seqs_;          // [seqs]
  std::vector<float*> lse_seqs_;       // [seqs] when the key asks for lse
  PagedDecodeParams params_;
};

}  // namespace attention::server
