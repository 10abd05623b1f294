#include "server/requests/request_decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "kernels/status_macros.h"

namespace attention::server {
namespace {

using v1::AttendRequest;
using v1::Tensor;

// Bytes a response carries besides its tensor data and request_id: tags, shapes, timing, device.
constexpr int64_t kResponseOverhead = 1024;

}  // namespace

std::string ShapeString(const Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

std::string DTypeString(int dtype) {
  const std::string& name = v1::DType_Name(static_cast<v1::DType>(dtype));
  return name.empty() ? absl::StrCat("unknown dtype ", dtype) : name;
}

absl::StatusOr<DType> ToDType(int dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_FLOAT8_E4M3:
      return DType::kFloat8E4M3;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field,
          ": expected DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT8_E4M3, got ",
          DTypeString(dtype)));
  }
}

absl::StatusOr<int64_t> CheckTensor(absl::string_view name, const Tensor& t, int rank,
                                    absl::string_view rank_meaning, size_t element_bytes) {
  return CheckTensor(name, t, static_cast<int64_t>(t.data().size()), rank, rank_meaning,
                     element_bytes);
}

absl::StatusOr<int64_t> CheckTensor(absl::string_view name, const Tensor& t, int64_t data_bytes,
                                    int rank, absl::string_view rank_meaning,
                                    size_t element_bytes) {
  if (t.shape_size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".shape: expected rank ", rank, " (",
                                                   rank_meaning, "), got rank ", t.shape_size(),
                                                   " ", ShapeString(t)));
  }
  int64_t bytes = static_cast<int64_t>(element_bytes);
  for (int i = 0; i < rank; ++i) {
    if (t.shape(i) <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape[", i, "]: expected > 0, got ", t.shape(i)));
    }
    if (__builtin_mul_overflow(bytes, t.shape(i), &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ".shape: expected a size that fits int64, got ", ShapeString(t), " (overflows)"));
    }
  }
  if (t.has_ref()) {
    // The bytes are in a region (tensor_refs.h resolves and bounds-checks them).
    if (data_bytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".data: expected no bytes beside ", name, ".ref, got ", data_bytes));
    }
    if (t.ref().byte_size() != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".ref.byte_size: expected ", bytes, " bytes (shape ", ShapeString(t),
                       " x ", element_bytes, " bytes), got ", t.ref().byte_size()));
    }
    return bytes;
  }
  if (data_bytes >= 0 && data_bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".data: expected ", bytes,
                                                   " bytes (shape ", ShapeString(t), " x ",
                                                   element_bytes, " bytes), got ", data_bytes));
  }
  return bytes;
}

namespace {

// Validates cu_seqlens_* against the packed rows of its tensor: B+1 offsets, starting at 0,
// strictly increasing (every item has at least one row), ending at `total_rows`.
absl::Status CheckCuSeqlens(absl::string_view name,
                            const google::protobuf::RepeatedField<int32_t>& cu, int expected_size,
                            absl::string_view size_source, int64_t total_rows,
                            absl::string_view rows_source) {
  if (cu.size() != expected_size) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", expected_size, " offsets (",
                                                   size_source, "), got ", cu.size()));
  }
  if (cu[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, "[0]: expected 0, got ", cu[0]));
  }
  for (int b = 1; b < cu.size(); ++b) {
    if (cu[b] <= cu[b - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", b, "]: expected > ", name, "[", b - 1, "] = ", cu[b - 1],
                       " (offsets increase; every item needs at least one row), got ", cu[b]));
    }
  }
  if (cu[cu.size() - 1] != total_rows) {
    return absl::InvalidArgumentError(absl::StrCat(name, "[", cu.size() - 1, "]: expected ",
                                                   total_rows, " (", rows_source,
                                                   ", the packed rows), got ", cu[cu.size() - 1]));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Descales> DecodeDescales(const AttendRequest& request, DType dtype,
                                        float softmax_scale) {
  Descales descales;
  for (const auto& [name, present, value, out] :
       {std::tuple{"q_descale", request.has_q_descale(), request.q_descale(), &descales.q},
        {"k_descale", request.has_k_descale(), request.k_descale(), &descales.k},
        {"v_descale", request.has_v_descale(), request.v_descale(), &descales.v}}) {
    if (!present) continue;
    if (dtype != DType::kFloat8E4M3) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected only with DTYPE_FLOAT8_E4M3 inputs, got ", value, " with ",
                       DTypeString(request.q().dtype())));
    }
    if (!(std::isfinite(value) && value > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected a finite value > 0, got ", value));
    }
    *out = value;
  }
  // The kernels scale the raw q.k products by this one factor (EffectiveSoftmaxScale), so it is
  // held to softmax_scale's limit.
  const double logit_scale = static_cast<double>(softmax_scale) * descales.q * descales.k;
  if (logit_scale > kMaxSoftmaxScale) {
    return absl::InvalidArgumentError(
        absl::StrCat("q_descale * k_descale * softmax_scale: expected at most ", kMaxSoftmaxScale,
                     " (the scale of the raw logits; larger cannot be computed accurately), got ",
                     logit_scale, " (q_descale ", descales.q, ", k_descale ", descales.k,
                     ", softmax_scale ", softmax_scale, ")"));
  }
  return descales;
}

absl::StatusOr<DecodedRequest> DecodeRequest(const AttendRequest& request,
                                             const DecodeOptions& options,
                                             v1::AttendResponse* response,
                                             TensorRefResolver* refs) {
  ASSIGN_OR_RETURN(
      DecodedRequest decoded,
      DecodeRequest(request,
                    InputTensors{.q_bytes = static_cast<int64_t>(request.q().data().size()),
                                 .k_bytes = static_cast<int64_t>(request.k().data().size()),
                                 .v_bytes = static_cast<int64_t>(request.v().data().size()),
                                 .q = request.q().data().data(),
                                 .k = request.k().data().data(),
                                 .v = request.v().data().data()},
                    options, refs));
  Tensor* o = response->mutable_o();
  *o = decoded.o;
  if (decoded.params.o == nullptr) {  // else it goes into a region (o_ref)
    o->mutable_data()->resize(decoded.o_bytes);
    decoded.params.o = o->mutable_data()->data();
  }
  if (request.return_lse()) {
    Tensor* lse = response->mutable_lse();
    *lse = decoded.lse;
    if (decoded.params.lse == nullptr) {  // else lse_ref
      lse->mutable_data()->resize(decoded.lse_bytes);
      // std::string storage comes from operator new (or the inline buffer), aligned for float.
      decoded.params.lse = reinterpret_cast<float*>(lse->mutable_data()->data());
    }
  }
  return decoded;
}

absl::StatusOr<DecodedRequest> DecodeRequest(const AttendRequest& request,
                                             const InputTensors& inputs,
                                             const DecodeOptions& options,
                                             TensorRefResolver* refs) {
  // Presence and dtypes first: every later message depends on them.
  for (const auto& [name, present] :
       {std::pair{"q", request.has_q()}, {"k", request.has_k()}, {"v", request.has_v()}}) {
    if (!present) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected a tensor, got none"));
    }
  }
  ASSIGN_OR_RETURN(DType dtype, ToDType(request.q().dtype(), "q.dtype"));
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"k", &request.k()}, {"v", &request.v()}}) {
    if (t->dtype() != request.q().dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: expected ",
                                                     DTypeString(request.q().dtype()),
                                                     " (as q), got ", DTypeString(t->dtype())));
    }
  }
  if (!v1::Layout_IsValid(request.layout())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: expected LAYOUT_BHSD or LAYOUT_BSHD, got ", static_cast<int>(request.layout())));
  }
  if (!v1::MaskAlignment_IsValid(request.mask_alignment())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mask_alignment: expected MASK_ALIGN_BOTTOM_RIGHT or MASK_ALIGN_TOP_LEFT, got ",
        static_cast<int>(request.mask_alignment())));
  }
  const bool varlen = request.cu_seqlens_q_size() > 0 || request.cu_seqlens_k_size() > 0;
  if (varlen && (request.cu_seqlens_q_size() == 0 || request.cu_seqlens_k_size() == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.cu_seqlens_q_size() == 0 ? "cu_seqlens_q" : "cu_seqlens_k",
        ": expected B+1 offsets (cu_seqlens_q and cu_seqlens_k come together), got none"));
  }

  // Ranks, dims and byte sizes.
  const bool bshd = request.layout() == v1::LAYOUT_BSHD;
  const int rank = varlen ? 3 : 4;
  const absl::string_view rank_meaning =
      varlen ? "[total, H, D] with cu_seqlens"
             : (bshd ? "[B, N, H, D] for LAYOUT_BSHD" : "[B, H, N, D] for LAYOUT_BHSD");
  const size_t element_bytes = DTypeSize(dtype);
  int64_t request_bytes = 0;
  bool overflow = false;
  int64_t tensor_bytes[3] = {0, 0, 0};
  int tensor_index = 0;
  for (const auto& [name, t, data_bytes] :
       {std::tuple<const char*, const Tensor*, int64_t>{"q", &request.q(), inputs.q_bytes},
        {"k", &request.k(), inputs.k_bytes},
        {"v", &request.v(), inputs.v_bytes}}) {
    ASSIGN_OR_RETURN(int64_t bytes,
                     CheckTensor(name, *t, data_bytes, rank, rank_meaning, element_bytes));
    tensor_bytes[tensor_index++] = bytes;
    // Bytes in a region do not cross gRPC. Each fits int64, their sum may not: AttendChunked's
    // bytes are still to come, so its shapes alone give them.
    if (!t->has_ref()) overflow |= __builtin_add_overflow(request_bytes, bytes, &request_bytes);
  }
  if (overflow || request_bytes > options.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request tensors are ",
                     overflow ? absl::StrCat("more than ", std::numeric_limits<int64_t>::max())
                              : absl::StrCat(request_bytes),
                     " bytes, over the message limit of ", options.max_message_bytes, " bytes"));
  }

  // Dims by layout. Dense q: [B, Hq, Nq, D] (BHSD) or [B, Nq, Hq, D] (BSHD); varlen [total, H, D].
  const Tensor& q = request.q();
  const Tensor& k = request.k();
  const Tensor& v = request.v();
  const int head_axis = varlen ? 1 : (bshd ? 2 : 1);
  const int row_axis = varlen ? 0 : (bshd ? 1 : 2);
  const int dim_axis = rank - 1;
  if (!varlen && k.shape(0) != q.shape(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k.shape[0] (batch): expected ", q.shape(0), " (as q), got ", k.shape(0)));
  }
  if (k.shape(dim_axis) != q.shape(dim_axis)) {
    return absl::InvalidArgumentError(absl::StrCat("k.shape[", dim_axis, "] (head dim): expected ",
                                                   q.shape(dim_axis), " (as q), got ",
                                                   k.shape(dim_axis)));
  }
  // v is shaped as k but for its head dim, which may differ (MLA).
  if (!std::equal(k.shape().begin(), k.shape().end() - 1, v.shape().begin())) {
    return absl::InvalidArgumentError(absl::StrCat("v.shape: expected ", ShapeString(k),
                                                   " (as k, but for the head dim), got ",
                                                   ShapeString(v)));
  }
  const int64_t heads_q = q.shape(head_axis);
  const int64_t heads_kv = k.shape(head_axis);
  if (heads_q % heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("k.shape[", head_axis,
                                                   "] (heads): expected a divisor of q's ", heads_q,
                                                   " heads, got ", heads_kv));
  }
  const int64_t head_dim = q.shape(dim_axis);
  const int64_t v_head_dim = v.shape(dim_axis);
  for (const auto& [name, dim] : {std::pair{"q", head_dim}, {"v", v_head_dim}}) {
    if (dim > options.max_head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape[", dim_axis,
                                                     "] (head dim): expected 1..",
                                                     options.max_head_dim, ", got ", dim));
    }
  }

  ASSIGN_OR_RETURN(MaskParams mask, DecodeMask(request, head_dim));
  ASSIGN_OR_RETURN(const Descales descales, DecodeDescales(request, dtype, mask.softmax_scale));
  ASSIGN_OR_RETURN(const OpenModelOptions open, DecodeOpenModelOptions(request, heads_q));

  AttentionParams p;
  p.dtype = dtype;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.v_head_dim = v_head_dim;
  p.sinks = open.sinks;
  p.softcap = open.softcap;
  p.chunk_size = open.chunk_size;
  p.softmax_scale = mask.softmax_scale;
  p.q_descale = descales.q;
  p.k_descale = descales.k;
  p.v_descale = descales.v;
  p.window_left = mask.window_left;
  p.window_right = mask.window_right;
  p.mask_alignment = request.mask_alignment() == v1::MASK_ALIGN_TOP_LEFT
                         ? MaskAlignment::kTopLeft
                         : MaskAlignment::kBottomRight;

  DecodedRequest decoded;
  int64_t visible_pairs = 0;
  if (varlen) {
    const int batch = request.cu_seqlens_q_size() - 1;
    if (batch < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cu_seqlens_q: expected at least 2 offsets (B+1), got ", request.cu_seqlens_q_size()));
    }
    absl::Status status = CheckCuSeqlens("cu_seqlens_q", request.cu_seqlens_q(), batch + 1, "B+1",
                                         q.shape(0), "q.shape[0]");
    if (status.ok()) {
      status = CheckCuSeqlens("cu_seqlens_k", request.cu_seqlens_k(), batch + 1,
                              "B+1, as cu_seqlens_q", k.shape(0), "k.shape[0]");
    }
    if (!status.ok()) return status;
    p.batch = batch;
    p.total_q = q.shape(0);
    p.total_k = k.shape(0);
    p.cu_seqlens_q = request.cu_seqlens_q().data();
    p.cu_seqlens_k = request.cu_seqlens_k().data();
    for (int b = 0; b < batch; ++b) {
      const int64_t nq = request.cu_seqlens_q(b + 1) - request.cu_seqlens_q(b);
      const int64_t nk = request.cu_seqlens_k(b + 1) - request.cu_seqlens_k(b);
      p.seqlen_q = std::max(p.seqlen_q, nq);
      p.seqlen_k = std::max(p.seqlen_k, nk);
      visible_pairs += VisibleKeyPairs(nq, nk, p.window_left, p.window_right, p.mask_alignment);
    }
    decoded.query_tokens = p.total_q;
  } else {
    p.batch = q.shape(0);
    p.seqlen_q = q.shape(row_axis);
    p.seqlen_k = k.shape(row_axis);
    visible_pairs = p.batch * VisibleKeyPairs(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right,
                                              p.mask_alignment);
    decoded.query_tokens = p.batch * p.seqlen_q;
  }
  decoded.flops = 4.0 * static_cast<double>(heads_q) * static_cast<double>(head_dim) *
                  static_cast<double>(visible_pairs);
  if (options.max_request_flops > 0 && decoded.flops > options.max_request_flops) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request needs ", absl::SixDigits(decoded.flops),
                     " FLOPs (4 * Hq * D * visible pairs), over the limit of ",
                     absl::SixDigits(options.max_request_flops),
                     " per request (--max_request_flops); split it over several calls"));
  }

  // The response: o shaped like q but for V's head dim, in OutputDType (bfloat16 for float8), lse
  // float32 [B, Hq, Nq] (varlen [Hq, total_q]).
  const DType o_dtype = OutputDType(dtype);
  const int64_t o_element_bytes = static_cast<int64_t>(DTypeSize(o_dtype));
  const int64_t o_bytes = tensor_bytes[0] / static_cast<int64_t>(element_bytes) / head_dim *
                          v_head_dim * o_element_bytes;
  const int64_t lse_rows = varlen ? p.total_q : p.batch * p.seqlen_q;
  const int64_t lse_bytes = request.return_lse() ? heads_q * lse_rows * int64_t{sizeof(float)} : 0;
  if (request.has_lse_ref() && !request.return_lse()) {
    return absl::InvalidArgumentError(
        "lse_ref: expected only with return_lse = true, got one without");
  }
  const int64_t response_bytes =
      (request.has_o_ref() ? 0 : o_bytes) + (request.has_lse_ref() ? 0 : lse_bytes) +
      static_cast<int64_t>(request.request_id().size()) + kResponseOverhead;
  if (response_bytes > options.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("response would be ", response_bytes,
                                                     " bytes, over the message limit of ",
                                                     options.max_message_bytes, " bytes"));
  }
  decoded.o.set_dtype(o_dtype == dtype ? q.dtype() : v1::DTYPE_BFLOAT16);
  decoded.o.mutable_shape()->CopyFrom(q.shape());
  decoded.o.set_shape(dim_axis, v_head_dim);
  // Tensors in a region have their params pointing there and no bytes to carry.
  if (request.has_o_ref()) {
    ASSIGN_OR_RETURN(p.o, OutputRef("o_ref", request.o_ref(), o_bytes, o_element_bytes, refs));
  } else {
    decoded.o_bytes = o_bytes;
  }
  decoded.q_bytes = q.has_ref() ? 0 : tensor_bytes[0];
  decoded.k_bytes = k.has_ref() ? 0 : tensor_bytes[1];
  decoded.v_bytes = v.has_ref() ? 0 : tensor_bytes[2];
  if (request.return_lse()) {
    decoded.lse.set_dtype(v1::DTYPE_FLOAT32);
    if (varlen) {
      decoded.lse.add_shape(heads_q);
      decoded.lse.add_shape(p.total_q);
    } else {
      decoded.lse.add_shape(p.batch);
      decoded.lse.add_shape(heads_q);
      decoded.lse.add_shape(p.seqlen_q);
    }
    if (request.has_lse_ref()) {
      ASSIGN_OR_RETURN(char* lse_data, OutputRef("lse_ref", request.lse_ref(), lse_bytes,
                                                 int64_t{sizeof(float)}, refs));
      p.lse = reinterpret_cast<float*>(lse_data);
    } else {
      decoded.lse_bytes = lse_bytes;
    }
  }
  const int64_t alignment = static_cast<int64_t>(element_bytes);
  auto input = [&](const char* name, const Tensor& t,
                   const void* bytes) -> absl::StatusOr<const void*> {
    if (!t.has_ref()) return bytes;
    return TensorData(name, t, alignment, refs);
  };
  ASSIGN_OR_RETURN(p.q, input("q", q, inputs.q));
  ASSIGN_OR_RETURN(p.k, input("k", k, inputs.k));
  ASSIGN_OR_RETURN(p.v, input("v", v, inputs.v));
  // Pointers of one address space (CUDA regions' too: unified addressing), so one check covers
  // host and device refs.
  RETURN_IF_ERROR(CheckOutputsApart({{"o_ref", static_cast<const char*>(p.o), o_bytes},
                                     {"lse_ref", reinterpret_cast<const char*>(p.lse), lse_bytes}},
                                    {{"q", static_cast<const char*>(p.q), tensor_bytes[0]},
                                     {"k", static_cast<const char*>(p.k), tensor_bytes[1]},
                                     {"v", static_cast<const char*>(p.v), tensor_bytes[2]}}));
  p.SetContiguousStrides(bshd ? Layout::kBSHD : Layout::kBHSD);
  decoded.params = p;
  return decoded;
}

}  // namespace attention::server
