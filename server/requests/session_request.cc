#include "server/requests/session_request.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/quote.h"
#include "kernels/status_macros.h"
#include "server/requests/request_decoder.h"

namespace attention::server {

v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kFloat8E4M3:
      return v1::DTYPE_FLOAT8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<KvRows> DecodeKvRows(absl::string_view prefix, const v1::Tensor* k,
                                    const v1::Tensor* v, v1::Layout layout, const KvShape& shape,
                                    TensorRefResolver* refs) {
  if ((k == nullptr) != (v == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, k == nullptr ? "k" : "v",
                                                   ": expected a tensor (k and v come together), "
                                                   "got none"));
  }
  if (k == nullptr) return KvRows{};
  if (!v1::Layout_IsValid(layout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: expected LAYOUT_BHSD or LAYOUT_BSHD, got ", static_cast<int>(layout)));
  }
  const v1::DType dtype = ToProtoDType(shape.dtype);
  const bool bshd = layout == v1::LAYOUT_BSHD;
  const int head_axis = bshd ? 1 : 0;
  const int row_axis = bshd ? 0 : 1;
  for (const auto& [name, t] : {std::pair{"k", k}, {"v", v}}) {
    const std::string field = absl::StrCat(prefix, name);
    if (t->dtype() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected ", DTypeString(dtype),
                                                     " (the session's), got ",
                                                     DTypeString(t->dtype())));
    }
    RETURN_IF_ERROR(CheckTensor(field, *t, 3, bshd ? "[n, Hkv, D] for LAYOUT_BSHD" : "[Hkv, n, D]",
                                DTypeSize(shape.dtype))
                        .status());
    if (t->shape(head_axis) != shape.heads_kv) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", head_axis, "] (kv heads): expected ", shape.heads_kv,
                       " (the session's), got ", t->shape(head_axis)));
    }
    if (t->shape(2) != shape.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[2] (head dim): expected ",
                                                     shape.head_dim, " (the session's), got ",
                                                     t->shape(2)));
    }
  }
  if (k->shape(row_axis) != v->shape(row_axis)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "v.shape: expected ", ShapeString(*k),
                                                   " (as k), got ", ShapeString(*v)));
  }
  KvRows rows;
  const int64_t alignment = static_cast<int64_t>(DTypeSize(shape.dtype));
  ASSIGN_OR_RETURN(rows.k, TensorData(absl::StrCat(prefix, "k"), *k, alignment, refs));
  ASSIGN_OR_RETURN(rows.v, TensorData(absl::StrCat(prefix, "v"), *v, alignment, refs));
  rows.rows = k->shape(row_axis);
  rows.head_stride = bshd ? shape.head_dim : rows.rows * shape.head_dim;
  rows.row_stride = bshd ? shape.heads_kv * shape.head_dim : shape.head_dim;
  return rows;
}

absl::StatusOr<DecodedCreate> DecodeCreate(const v1::CreateSessionRequest& request,
                                           const SessionLimits& limits, TensorRefResolver* refs) {
  ASSIGN_OR_RETURN(DType dtype, ToDType(request.dtype(), "dtype"));
  if (dtype == DType::kFloat8E4M3) {
    // No paged KV pool or decode kernel holds float8 rows; every Step of a session then keeps
    // the session's dtype, so float8 never reaches the Sessions path past this check.
    return absl::UnimplementedError(
        "dtype: DTYPE_FLOAT8_E4M3 sessions are not implemented (sessions hold DTYPE_FLOAT32, "
        "DTYPE_FLOAT16 or DTYPE_BFLOAT16 rows; float8 inputs are served by Attend)");
  }
  if (request.kv_heads() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_heads: expected >= 1, got ", request.kv_heads()));
  }
  if (request.head_dim() < 1 || request.head_dim() > limits.max_head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim: expected 1..", limits.max_head_dim, ", got ", request.head_dim()));
  }
  DecodedCreate decoded;
  decoded.shape =
      KvShape{.dtype = dtype, .heads_kv = request.kv_heads(), .head_dim = request.head_dim()};
  ASSIGN_OR_RETURN(decoded.rows, DecodeKvRows("", request.has_k() ? &request.k() : nullptr,
                                              request.has_v() ? &request.v() : nullptr,
                                              request.layout(), decoded.shape, refs));
  return decoded;
}

absl::Status CheckStep(const v1::StepRequest& request) {
  if (request.entries_size() == 0) {
    return absl::InvalidArgumentError("entries: expected at least one entry, got none");
  }
  std::set<absl::string_view> seen;
  for (int i = 0; i < request.entries_size(); ++i) {
    const v1::StepEntry& entry = request.entries(i);
    if (entry.session_id().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].session_id: expected a session id, got none"));
    }
    if (!seen.insert(entry.session_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i,
                       "].session_id: expected each session at most once per step, "
                       "got ",
                       Quote(entry.session_id()), " again"));
    }
    if (!entry.has_q()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "].q: expected a tensor [Hq, Nq, D], got none"));
    }
  }
  // The head dim only sets the default scale, which is not checked.
  return DecodeMask(request, 1).status();
}

absl::StatusOr<DecodedEntry> DecodeStepEntry(int index, const v1::StepEntry& entry,
                                             const KvShape& shape, TensorRefResolver* refs) {
  const std::string prefix = absl::StrCat("entries[", index, "].");
  const std::string q_field = absl::StrCat(prefix, "q");
  const v1::Tensor& q = entry.q();
  const v1::DType dtype = ToProtoDType(shape.dtype);
  if (q.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(q_field, ".dtype: expected ", DTypeString(dtype),
                                                   " (the session's), got ",
                                                   DTypeString(q.dtype())));
  }
  RETURN_IF_ERROR(CheckTensor(q_field, q, 3, "[Hq, Nq, D]", DTypeSize(shape.dtype)).status());
  if (q.shape(2) != shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(q_field, ".shape[2] (head dim): expected ",
                                                   shape.head_dim, " (the session's), got ",
                                                   q.shape(2)));
  }
  if (q.shape(0) % shape.heads_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(q_field, ".shape[0] (query heads): expected a multiple of the session's ",
                     shape.heads_kv, " kv heads, got ", q.shape(0)));
  }
  ASSIGN_OR_RETURN(KvRows rows, DecodeKvRows(prefix, entry.has_k() ? &entry.k() : nullptr,
                                             entry.has_v() ? &entry.v() : nullptr, v1::LAYOUT_BHSD,
                                             shape, refs));
  DecodedEntry decoded;
  const int64_t element_bytes = static_cast<int64_t>(DTypeSize(shape.dtype));
  ASSIGN_OR_RETURN(decoded.q, TensorData(q_field, q, element_bytes, refs));
  decoded.heads_q = q.shape(0);
  decoded.rows_q = q.shape(1);
  decoded.rows = rows;
  if (entry.has_o_ref()) {
    ASSIGN_OR_RETURN(decoded.o,
                     OutputRef(absl::StrCat(prefix, "o_ref"), entry.o_ref(),
                               decoded.heads_q * decoded.rows_q * shape.head_dim * element_bytes,
                               element_bytes, refs));
  }
  return decoded;
}

}  // namespace attention::server
