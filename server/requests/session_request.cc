#include "server/requests/session_request.h"

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
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
  if (shape.v_from_k) {
    // The session keeps v as k's first Dv features: rows come as k alone.
    if (v != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "v: expected none (the session's v is k's first ",
                       shape.value_head_dim(), " features: v_from_k), got a tensor"));
    }
  } else if ((k == nullptr) != (v == nullptr)) {
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
    if (t == nullptr) continue;  // v of a v_from_k session
    const std::string field = absl::StrCat(prefix, name);
    if (t->dtype() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected ", DTypeString(dtype),
                                                     " (the session's), got ",
                                                     DTypeString(t->dtype())));
    }
    const bool is_k = t == k;
    const char* expected_shape =
        bshd ? (is_k ? "[n, Hkv, D] for LAYOUT_BSHD" : "[n, Hkv, Dv] for LAYOUT_BSHD")
             : (is_k ? "[Hkv, n, D]" : "[Hkv, n, Dv]");
    RETURN_IF_ERROR(CheckTensor(field, *t, 3, expected_shape, DTypeSize(shape.dtype)).status());
    if (t->shape(head_axis) != shape.heads_kv) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", head_axis, "] (kv heads): expected ", shape.heads_kv,
                       " (the session's), got ", t->shape(head_axis)));
    }
    // k's last dim is the session's head_dim, v's its v_head_dim.
    const int64_t dim = is_k ? shape.head_dim : shape.value_head_dim();
    if (t->shape(2) != dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape[2] (", is_k ? "head dim" : "v head dim", "): expected ", dim,
          " (the session's ", is_k ? "head_dim" : "v_head_dim", "), got ", t->shape(2)));
    }
  }
  if (v != nullptr && k->shape(row_axis) != v->shape(row_axis)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "v.shape[", row_axis,
                                                   "] (rows): expected ", k->shape(row_axis),
                                                   " (as k), got ", v->shape(row_axis)));
  }
  KvRows rows;
  const int64_t alignment = static_cast<int64_t>(DTypeSize(shape.dtype));
  ASSIGN_OR_RETURN(rows.k, TensorData(absl::StrCat(prefix, "k"), *k, alignment, refs));
  if (v != nullptr) {
    ASSIGN_OR_RETURN(rows.v, TensorData(absl::StrCat(prefix, "v"), *v, alignment, refs));
  }
  rows.rows = k->shape(row_axis);
  rows.head_stride = bshd ? shape.head_dim : rows.rows * shape.head_dim;
  rows.row_stride = bshd ? shape.heads_kv * shape.head_dim : shape.head_dim;
  return rows;
}

namespace {

// A session's dtype, kv heads, head dims and layers (0 read as 1), as CreateSession and an
// Import's header give them (v_head_dim 0: head_dim); `prefix` begins the field names ("",
// "header.").
template <typename Message>
absl::StatusOr<std::pair<KvShape, int>> DecodeSessionShape(absl::string_view prefix,
                                                           const Message& m,
                                                           const SessionLimits& limits) {
  const int32_t kv_heads = m.kv_heads(), head_dim = m.head_dim(), layers = m.layers();
  const int32_t v_head_dim = m.v_head_dim();
  const v1::DType proto_dtype = m.dtype();
  ASSIGN_OR_RETURN(DType dtype, ToDType(proto_dtype, absl::StrCat(prefix, "dtype")));
  if (dtype == DType::kFloat8E4M3) {
    // No paged KV pool or decode kernel holds float8 rows; every Step of a session then keeps
    // the session's dtype, so float8 never reaches the Sessions path past this check.
    return absl::UnimplementedError(absl::StrCat(
        prefix,
        "dtype: DTYPE_FLOAT8_E4M3 sessions are not implemented (sessions hold DTYPE_FLOAT32, "
        "DTYPE_FLOAT16 or DTYPE_BFLOAT16 rows; float8 inputs are served by Attend)"));
  }
  if (kv_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "kv_heads: expected >= 1, got ", kv_heads));
  }
  if (head_dim < 1 || head_dim > limits.max_head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "head_dim: expected 1..", limits.max_head_dim, ", got ", head_dim));
  }
  if (v_head_dim < 0 || v_head_dim > limits.max_head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "v_head_dim: expected 0..",
                                                   limits.max_head_dim, " (0: head_dim), got ",
                                                   v_head_dim));
  }
  if (m.v_from_k() && v_head_dim > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "v_head_dim: expected 0..", head_dim,
        " (head_dim) with v_from_k (v is k's first v_head_dim features), got ", v_head_dim));
  }
  if (layers < 0 || layers > kMaxSessionLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "layers: expected 0..", kMaxSessionLayers, " (0: one), got ", layers));
  }
  return std::pair{KvShape{.dtype = dtype,
                           .heads_kv = kv_heads,
                           .head_dim = head_dim,
                           .v_head_dim = v_head_dim > 0 ? v_head_dim : head_dim,
                           .v_from_k = m.v_from_k()},
                   std::max(1, layers)};
}

}  // namespace

absl::StatusOr<DecodedCreate> DecodeCreate(const v1::CreateSessionRequest& request,
                                           const SessionLimits& limits, TensorRefResolver* refs) {
  DecodedCreate decoded;
  ASSIGN_OR_RETURN(std::tie(decoded.shape, decoded.layers),
                   DecodeSessionShape("", request, limits));
  ASSIGN_OR_RETURN(decoded.rows, DecodeKvRows("", request.has_k() ? &request.k() : nullptr,
                                              request.has_v() ? &request.v() : nullptr,
                                              request.layout(), decoded.shape, refs));
  if (decoded.layers > 1 && decoded.rows.rows > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k, v: expected none for a session of ", decoded.layers,
        " layers (created empty: append each layer's rows with AppendKv and its layer), got ",
        decoded.rows.rows, " rows"));
  }
  RETURN_IF_ERROR(CheckTokens("tokens", request.tokens_size(), decoded.rows.rows));
  if (request.prefix_tokens_size() > 0 && decoded.rows.rows > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k, v: expected none with prefix_tokens (append the rows after SessionInfo.prefix_rows), "
        "got ",
        decoded.rows.rows, " rows"));
  }
  decoded.tokens.assign(request.tokens().begin(), request.tokens().end());
  decoded.prefix_tokens.assign(request.prefix_tokens().begin(), request.prefix_tokens().end());
  return decoded;
}

absl::Status CheckTokens(absl::string_view field, int tokens, int64_t rows) {
  if (tokens == 0 || tokens == rows) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected none or ", rows, " (one token id per row of k and v), got ", tokens));
}

absl::Status CheckStepTokens(int index, const v1::StepEntry& entry, int64_t rows) {
  const std::string field = absl::StrCat("entries[", index, "].tokens");
  RETURN_IF_ERROR(CheckTokens(field, entry.tokens_size(), rows));
  if (entry.tokens_size() > 0 && (entry.k().has_ref() || entry.v().has_ref())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ": expected only with k and v in the message (rows read from a region are not "
                     "cached), got ",
                     entry.k().has_ref() ? "k" : "v", " by reference"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> DecodeChunkRows(int64_t chunk_rows, const KvShape& shape,
                                        int64_t max_message_bytes) {
  // k and v of one row, and what a chunk carries besides: tags, shapes, header-free fields.
  constexpr int64_t kChunkOverhead = 256;
  constexpr int64_t kDefaultChunkBytes = int64_t{4} << 20;
  const int64_t row_bytes =
      shape.heads_kv * shape.stored_dims() * static_cast<int64_t>(DTypeSize(shape.dtype));
  const int64_t most = std::max<int64_t>(1, (max_message_bytes - kChunkOverhead) / row_bytes);
  if (chunk_rows == 0) {
    return std::max<int64_t>(
        1, (std::min(max_message_bytes, kDefaultChunkBytes) - kChunkOverhead) / row_bytes);
  }
  if (chunk_rows < 0 || chunk_rows > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk_rows: expected 0..", most, " (0: as many as fit 4 MiB; at most what fits the ",
        max_message_bytes, "-byte message limit at ", row_bytes, " bytes a row of k and v), got ",
        chunk_rows));
  }
  return chunk_rows;
}

bool IsReplicaName(absl::string_view name) {
  return !name.empty() && name.size() <= 32 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
  });
}

absl::StatusOr<DecodedImportHeader> DecodeImportHeader(const v1::SessionChunk& chunk,
                                                       const SessionLimits& limits) {
  if (!chunk.has_header()) {
    return absl::InvalidArgumentError(
        "header: expected the session's header in the first message, got none");
  }
  if (chunk.has_k() || chunk.has_v()) {
    return absl::InvalidArgumentError(
        absl::StrCat(chunk.has_k() ? "k" : "v",
                     ": expected none in the header's message (rows come after it), "
                     "got a tensor"));
  }
  const v1::SessionHeader& header = chunk.header();
  DecodedImportHeader decoded;
  ASSIGN_OR_RETURN(std::tie(decoded.shape, decoded.layers),
                   DecodeSessionShape("header.", header, limits));
  if (header.layer_lengths_size() != decoded.layers) {
    return absl::InvalidArgumentError(absl::StrCat("header.layer_lengths: expected ",
                                                   decoded.layers, " lengths (one per layer), got ",
                                                   header.layer_lengths_size()));
  }
  for (int layer = 0; layer < decoded.layers; ++layer) {
    const int64_t length = header.layer_lengths(layer);
    if (length < 0 || length > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.layer_lengths[", layer, "]: expected 0..2147483647, got ", length));
    }
    decoded.lengths.push_back(length);
  }
  const std::string& id = header.session_id();
  // An id a server made: 32 hex digits, after its replica's name and a '.' when it had one.
  const size_t dot = id.find('.');
  const absl::string_view random =
      dot == std::string::npos ? absl::string_view(id) : absl::string_view(id).substr(dot + 1);
  const bool named =
      dot == std::string::npos || IsReplicaName(absl::string_view(id).substr(0, dot));
  if (!id.empty() &&
      (!named || random.size() != 32 || !std::all_of(random.begin(), random.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      }))) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.session_id: expected 32 lower-case hex digits, alone or after a "
                     "replica name and a '.', or none, got ",
                     Quote(id)));
  }
  decoded.id = id;
  return decoded;
}

absl::StatusOr<DecodedImportChunk> DecodeImportChunk(const v1::SessionChunk& chunk,
                                                     const KvShape& shape) {
  if (chunk.has_header()) {
    return absl::InvalidArgumentError(
        "header: expected it in the first message only, got one in a later message");
  }
  if (!chunk.has_k() && !chunk.has_v()) {
    return absl::InvalidArgumentError("k: expected a tensor of rows, got none");
  }
  DecodedImportChunk decoded{.layer = chunk.layer(), .first_row = chunk.first_row()};
  ASSIGN_OR_RETURN(decoded.rows,
                   DecodeKvRows("", chunk.has_k() ? &chunk.k() : nullptr,
                                chunk.has_v() ? &chunk.v() : nullptr, chunk.layout(), shape));
  return decoded;
}

namespace {

// A packed Step's own checks (CheckStep): session ids present and distinct, q present, no entries.
absl::Status CheckPackedStep(const v1::StepRequest& request) {
  if (request.entries_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("entries: expected none in a packed Step (session_ids holds ",
                     request.session_ids_size(), " sequences), got ", request.entries_size()));
  }
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(request.session_ids_size());
  for (int b = 0; b < request.session_ids_size(); ++b) {
    const std::string& id = request.session_ids(b);
    if (id.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_ids[", b, "]: expected a session id, got none"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_ids[", b, "]: expected each session at most once per step, got ",
                       Quote(id), " again"));
    }
  }
  if (!request.has_q()) {
    return absl::InvalidArgumentError("q: expected a tensor [B, Hq, Nq, D], got none");
  }
  return absl::OkStatus();
}

// The packed fields in a Step of entries (which would be ignored otherwise).
absl::Status CheckNoPackedFields(const v1::StepRequest& request) {
  for (const auto& [name, present] : {std::pair{"q", request.has_q()},
                                      {"k", request.has_k()},
                                      {"v", request.has_v()},
                                      {"o_ref", request.has_o_ref()},
                                      {"lse_ref", request.has_lse_ref()}}) {
    if (present) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected only in a packed Step (with session_ids), got one beside entries"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStep(const v1::StepRequest& request) {
  if (request.session_ids_size() > 0) {
    RETURN_IF_ERROR(CheckPackedStep(request));
    return DecodeMask(request, 1).status();
  }
  RETURN_IF_ERROR(CheckNoPackedFields(request));
  if (request.entries_size() == 0) {
    return absl::InvalidArgumentError(
        "entries: expected at least one entry (or the packed form's session_ids), got none");
  }
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(request.entries_size());
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
  decoded.q_bytes = decoded.heads_q * decoded.rows_q * shape.head_dim * element_bytes;
  decoded.o_bytes = decoded.heads_q * decoded.rows_q * shape.value_head_dim() * element_bytes;
  decoded.k_bytes = shape.heads_kv * rows.rows * shape.head_dim * element_bytes;
  decoded.v_bytes =
      rows.v != nullptr ? shape.heads_kv * rows.rows * shape.value_head_dim() * element_bytes : 0;
  if (entry.has_o_ref()) {
    ASSIGN_OR_RETURN(decoded.o, OutputRef(absl::StrCat(prefix, "o_ref"), entry.o_ref(),
                                          decoded.o_bytes, element_bytes, refs));
  }
  return decoded;
}

absl::Status CheckEntriesApart(const std::vector<DecodedEntry>& entries) {
  std::vector<ByteSpan> outputs, inputs;
  outputs.reserve(entries.size());
  inputs.reserve(3 * entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const DecodedEntry& e = entries[i];
    const std::string prefix = absl::StrCat("entries[", i, "].");
    outputs.push_back({absl::StrCat(prefix, "o_ref"), e.o, e.o_bytes});
    inputs.push_back({absl::StrCat(prefix, "q"), static_cast<const char*>(e.q), e.q_bytes});
    inputs.push_back({absl::StrCat(prefix, "k"), static_cast<const char*>(e.rows.k), e.k_bytes});
    inputs.push_back({absl::StrCat(prefix, "v"), static_cast<const char*>(e.rows.v), e.v_bytes});
  }
  return CheckOutputsApart(outputs, inputs);
}

absl::StatusOr<DecodedPacked> DecodePackedStep(const v1::StepRequest& request, const KvShape& shape,
                                               TensorRefResolver* refs) {
  const v1::DType dtype = ToProtoDType(shape.dtype);
  const int64_t element_bytes = static_cast<int64_t>(DTypeSize(shape.dtype));
  const int64_t batch = request.session_ids_size();
  const v1::Tensor& q = request.q();
  if (q.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("q.dtype: expected ", DTypeString(dtype),
                                                   " (the sessions'), got ",
                                                   DTypeString(q.dtype())));
  }
  RETURN_IF_ERROR(CheckTensor("q", q, 4, "[B, Hq, Nq, D]", element_bytes).status());
  if (q.shape(0) != batch) {
    return absl::InvalidArgumentError(absl::StrCat("q.shape[0] (batch): expected ", batch,
                                                   " (one per session_ids), got ", q.shape(0)));
  }
  if (q.shape(3) != shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q.shape[3] (head dim): expected ", shape.head_dim, " (the sessions'), got ", q.shape(3)));
  }
  if (q.shape(1) % shape.heads_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q.shape[1] (query heads): expected a multiple of the sessions' ",
                     shape.heads_kv, " kv heads, got ", q.shape(1)));
  }
  DecodedPacked packed{.batch = batch, .heads_q = q.shape(1), .rows_q = q.shape(2)};
  const int64_t q_bytes = packed.heads_q * packed.rows_q * shape.head_dim * element_bytes;
  const int64_t o_bytes = packed.heads_q * packed.rows_q * shape.value_head_dim() * element_bytes;
  ASSIGN_OR_RETURN(const char* q_data, TensorData("q", q, element_bytes, refs));

  // k [B, Hkv, n, D], v [B, Hkv, n, Dv]: sequence b's rows are [Hkv, n, D] at b * Hkv * n * D
  // and [Hkv, n, Dv] at b * Hkv * n * Dv.
  const char* k_data = nullptr;
  const char* v_data = nullptr;
  int64_t rows = 0;
  if (shape.v_from_k) {
    // v is k's first Dv features: the new rows come as k alone.
    if (request.has_v()) {
      return absl::InvalidArgumentError(
          absl::StrCat("v: expected none (the sessions' v is k's first ", shape.value_head_dim(),
                       " features: v_from_k), got a tensor"));
    }
  } else if (request.has_k() != request.has_v()) {
    return absl::InvalidArgumentError(absl::StrCat(request.has_k() ? "v" : "k",
                                                   ": expected a tensor (k and v come together), "
                                                   "got none"));
  }
  if (request.has_k()) {
    for (const auto& [name, t] : {std::pair{"k", &request.k()}, {"v", &request.v()}}) {
      if (t == &request.v() && !request.has_v()) continue;  // v_from_k
      if (t->dtype() != dtype) {
        return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: expected ",
                                                       DTypeString(dtype), " (the sessions'), got ",
                                                       DTypeString(t->dtype())));
      }
      const bool is_k = t == &request.k();
      RETURN_IF_ERROR(
          CheckTensor(name, *t, 4, is_k ? "[B, Hkv, n, D]" : "[B, Hkv, n, Dv]", element_bytes)
              .status());
      const int64_t expected[] = {batch, shape.heads_kv, request.k().shape(2),
                                  is_k ? shape.head_dim : shape.value_head_dim()};
      const char* meaning[] = {"batch", "kv heads", "rows", is_k ? "head dim" : "v head dim"};
      for (int axis = 0; axis < 4; ++axis) {
        if (t->shape(axis) != expected[axis]) {
          return absl::InvalidArgumentError(absl::StrCat(
              name, ".shape[", axis, "] (", meaning[axis], "): expected ", expected[axis],
              axis == 2   ? " (as k)"
              : axis == 0 ? " (one per session_ids)"
              : axis == 3 ? (is_k ? " (the sessions' head_dim)" : " (the sessions' v_head_dim)")
                          : " (the sessions')",
              ", got ", t->shape(axis)));
        }
      }
    }
    rows = request.k().shape(2);
    ASSIGN_OR_RETURN(k_data, TensorData("k", request.k(), element_bytes, refs));
    if (request.has_v()) {
      ASSIGN_OR_RETURN(v_data, TensorData("v", request.v(), element_bytes, refs));
    }
  }
  const int64_t k_bytes = shape.heads_kv * rows * shape.head_dim * element_bytes;
  const int64_t v_bytes =
      v_data != nullptr ? shape.heads_kv * rows * shape.value_head_dim() * element_bytes : 0;

  const int64_t lse_bytes = packed.heads_q * packed.rows_q * int64_t{sizeof(float)};
  if (request.has_o_ref()) {
    ASSIGN_OR_RETURN(packed.o,
                     OutputRef("o_ref", request.o_ref(), batch * o_bytes, element_bytes, refs));
  }
  if (request.has_lse_ref()) {
    if (!request.return_lse()) {
      return absl::InvalidArgumentError(
          "lse_ref: expected only with return_lse = true, got one with return_lse = false");
    }
    ASSIGN_OR_RETURN(char* lse, OutputRef("lse_ref", request.lse_ref(), batch * lse_bytes,
                                          int64_t{sizeof(float)}, refs));
    packed.lse = reinterpret_cast<float*>(lse);
  }
  RETURN_IF_ERROR(
      CheckOutputsApart({{"o_ref", packed.o, batch * o_bytes},
                         {"lse_ref", reinterpret_cast<const char*>(packed.lse), batch * lse_bytes}},
                        {{"q", q_data, batch * q_bytes},
                         {"k", k_data, batch * k_bytes},
                         {"v", v_data, batch * v_bytes}}));

  packed.entries.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    DecodedEntry& entry = packed.entries[b];
    entry.q = q_data + b * q_bytes;
    entry.heads_q = packed.heads_q;
    entry.rows_q = packed.rows_q;
    entry.q_bytes = q_bytes;
    entry.o_bytes = o_bytes;
    entry.k_bytes = k_bytes;
    entry.v_bytes = v_bytes;
    if (rows > 0) {
      entry.rows = KvRows{.k = k_data + b * k_bytes,
                          .v = v_data != nullptr ? v_data + b * v_bytes : nullptr,
                          .rows = rows,
                          .head_stride = rows * shape.head_dim,
                          .row_stride = shape.head_dim};
    }
    if (packed.o != nullptr) entry.o = packed.o + b * o_bytes;
  }
  return packed;
}

}  // namespace attention::server
