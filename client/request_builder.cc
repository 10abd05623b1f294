#include "client/request_builder.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/tensors.h"

namespace attention::client {
namespace {

std::vector<int32_t> CuSeqlens(absl::Span<const int32_t> lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  std::partial_sum(lengths.begin(), lengths.end(), cu.begin() + 1);
  return cu;
}

const std::vector<int32_t>& KeyLengths(const ProblemSpec& spec) {
  return spec.varlen_k.empty() ? spec.varlen_q : spec.varlen_k;
}

std::vector<int64_t> Shape(const ProblemSpec& spec, int64_t heads, int64_t seqlen,
                           absl::Span<const int32_t> varlen) {
  if (spec.is_varlen()) {
    const int64_t total = std::accumulate(varlen.begin(), varlen.end(), int64_t{0});
    return {total, heads, spec.head_dim};
  }
  if (spec.layout == v1::LAYOUT_BSHD) return {spec.batch, seqlen, heads, spec.head_dim};
  return {spec.batch, heads, seqlen, spec.head_dim};
}

}  // namespace

std::vector<int64_t> QueryShape(const ProblemSpec& spec) {
  return Shape(spec, spec.heads_q, spec.seqlen_q, spec.varlen_q);
}

std::vector<int64_t> KeyValueShape(const ProblemSpec& spec) {
  return Shape(spec, spec.heads_kv, spec.seqlen_k, KeyLengths(spec));
}

absl::StatusOr<v1::AttendRequest> MakeRequest(const ProblemSpec& spec, absl::Span<const float> q,
                                              absl::Span<const float> k,
                                              absl::Span<const float> v) {
  const std::vector<int64_t> q_shape = QueryShape(spec);
  const std::vector<int64_t> kv_shape = KeyValueShape(spec);
  const struct {
    const char* name;
    absl::Span<const float> data;
    const std::vector<int64_t>& shape;
  } tensors[] = {{"q", q, q_shape}, {"k", k, kv_shape}, {"v", v, kv_shape}};
  for (const auto& t : tensors) {
    if (static_cast<int64_t>(t.data.size()) != NumElements(t.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat(t.name, " has ", t.data.size(), " values, shape [",
                       absl::StrJoin(t.shape, ", "), "] needs ", NumElements(t.shape)));
    }
  }
  if (!spec.varlen_k.empty() && spec.varlen_k.size() != spec.varlen_q.size()) {
    return absl::InvalidArgumentError(absl::StrCat("varlen_k has ", spec.varlen_k.size(),
                                                   " items, varlen_q ", spec.varlen_q.size()));
  }

  v1::AttendRequest request;
  *request.mutable_q() = MakeTensor(spec.dtype, q_shape, q);
  *request.mutable_k() = MakeTensor(spec.dtype, kv_shape, k);
  *request.mutable_v() = MakeTensor(spec.dtype, kv_shape, v);
  request.set_layout(spec.layout);
  request.set_causal(spec.causal);
  request.set_mask_alignment(spec.mask_alignment);
  if (spec.softmax_scale) request.set_softmax_scale(*spec.softmax_scale);
  if (spec.window_left) request.set_window_left(*spec.window_left);
  if (spec.window_right) request.set_window_right(*spec.window_right);
  request.set_return_lse(spec.return_lse);
  if (spec.q_descale) request.set_q_descale(*spec.q_descale);
  if (spec.k_descale) request.set_k_descale(*spec.k_descale);
  if (spec.v_descale) request.set_v_descale(*spec.v_descale);
  if (spec.is_varlen()) {
    for (int32_t c : CuSeqlens(spec.varlen_q)) request.add_cu_seqlens_q(c);
    for (int32_t c : CuSeqlens(KeyLengths(spec))) request.add_cu_seqlens_k(c);
  }
  return request;
}

std::vector<float> RandomNormal(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = normal(rng);
  return values;
}

absl::StatusOr<v1::AttendRequest> MakeRandomRequest(const ProblemSpec& spec, std::mt19937_64& rng) {
  const int64_t q_elements = NumElements(QueryShape(spec));
  const int64_t kv_elements = NumElements(KeyValueShape(spec));
  std::vector<float> q = RandomNormal(q_elements, rng);
  std::vector<float> k = RandomNormal(kv_elements, rng);
  std::vector<float> v = RandomNormal(kv_elements, rng);
  return MakeRequest(spec, q, k, v);
}

std::string DescribeProblem(const ProblemSpec& spec) {
  std::string out;
  if (spec.is_varlen()) {
    absl::StrAppend(&out, "varlen q=[", absl::StrJoin(spec.varlen_q, ","), "] k=[",
                    absl::StrJoin(KeyLengths(spec), ","), "]");
  } else {
    absl::StrAppend(&out, "B=", spec.batch, " Nq=", spec.seqlen_q, " Nk=", spec.seqlen_k);
  }
  absl::StrAppend(&out, " Hq=", spec.heads_q, " Hkv=", spec.heads_kv, " D=", spec.head_dim, " ",
                  DTypeName(spec.dtype), spec.layout == v1::LAYOUT_BSHD ? " bshd" : " bhsd");
  if (spec.causal) absl::StrAppend(&out, " causal");
  if (spec.window_left) absl::StrAppend(&out, " window_left=", *spec.window_left);
  if (spec.window_right) absl::StrAppend(&out, " window_right=", *spec.window_right);
  if (spec.mask_alignment == v1::MASK_ALIGN_TOP_LEFT) absl::StrAppend(&out, " top_left");
  if (spec.softmax_scale) absl::StrAppend(&out, " scale=", *spec.softmax_scale);
  if (spec.return_lse) absl::StrAppend(&out, " lse");
  if (spec.q_descale) absl::StrAppend(&out, " q_descale=", *spec.q_descale);
  if (spec.k_descale) absl::StrAppend(&out, " k_descale=", *spec.k_descale);
  if (spec.v_descale) absl::StrAppend(&out, " v_descale=", *spec.v_descale);
  return out;
}

}  // namespace attention::client
