// Describing an attention problem once (shapes, dtype, layout, mask, varlen) and turning it into
// an AttendRequest, with given data or with random normal data. Used by the CLI, the load
// generator and the end-to-end tests.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attention/v1/attention.pb.h"

namespace attention::client {

struct ProblemSpec {
  int64_t batch = 1;
  int64_t heads_q = 1;
  int64_t heads_kv = 1;
  int64_t seqlen_q = 1;
  int64_t seqlen_k = 1;
  int64_t head_dim = 64;
  v1::DType dtype = v1::DTYPE_FLOAT32;
  v1::Layout layout = v1::LAYOUT_BHSD;
  bool causal = false;
  // Where the causal/window mask's diagonal sits when Nq != Nk (proto:
  // AttendRequest.mask_alignment).
  v1::MaskAlignment mask_alignment = v1::MASK_ALIGN_BOTTOM_RIGHT;
  std::optional<float> softmax_scale;  // absent: the server's default 1/sqrt(D)
  std::optional<int32_t> window_left;
  std::optional<int32_t> window_right;
  bool return_lse = false;
  // float8_e4m3 only (AttendRequest.q_descale, k_descale, v_descale): the server computes with
  // q * q_descale, ...; absent = 1. The values given to MakeRequest are the stored (raw) ones.
  std::optional<float> q_descale;
  std::optional<float> k_descale;
  std::optional<float> v_descale;
  // Varlen when non-empty: one length per batch item (batch and seqlen_* are then ignored);
  // q, k and v are packed [total, H, D]. varlen_k empty means the same lengths as varlen_q.
  std::vector<int32_t> varlen_q;
  std::vector<int32_t> varlen_k;

  bool is_varlen() const { return !varlen_q.empty(); }
};

// q's shape: [B, Hq, Nq, D] (BHSD), [B, Nq, Hq, D] (BSHD) or [total_q, Hq, D] (varlen).
std::vector<int64_t> QueryShape(const ProblemSpec& spec);
// k's and v's shape, likewise with Hkv and Nk.
std::vector<int64_t> KeyValueShape(const ProblemSpec& spec);

// A request for `spec` holding q, k and v (prod of their shapes each, row-major), rounded to
// spec.dtype. Checks only the sizes of the spans; the server validates the rest.
absl::StatusOr<v1::AttendRequest> MakeRequest(const ProblemSpec& spec, absl::Span<const float> q,
                                              absl::Span<const float> k, absl::Span<const float> v);

// `n` standard normal values.
std::vector<float> RandomNormal(int64_t n, std::mt19937_64& rng);

// A request for `spec` with standard normal q, k and v drawn from `rng`.
absl::StatusOr<v1::AttendRequest> MakeRandomRequest(const ProblemSpec& spec, std::mt19937_64& rng);

// "B=2 Hq=8 Hkv=2 Nq=100 Nk=77 D=64 bfloat16 bshd causal ..." for logs and test failures.
std::string DescribeProblem(const ProblemSpec& spec);

}  // namespace attention::client
