// Validation and decoding of an AttendRequest into the kernel interface (AttentionParams).
//
// Decoding copies no tensor data: q, k, v point wherever their bytes lie (the request's bytes
// fields, the host block the service copied them into from the wire: InputTensors, or a
// shared-memory region for a tensor by reference), and o (and lse) into the response's Tensor
// data, a region (o_ref, lse_ref), or wherever the caller places them. The server's own
// path (server/service) makes one host copy per request: the wire's slices into its host block.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "kernels/attention_params.h"
#include "server/requests/tensor_refs.h"

namespace attention::server {

struct DecodeOptions {
  // Largest request or response payload accepted (the gRPC message limit).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Head dims 1..max_head_dim are served.
  int max_head_dim = 256;
  // Work one request may ask for, in FLOPs (DecodedRequest::flops); 0 = no limit.
  double max_request_flops = 0;
};

// The bytes of q, k and v, wherever they lie: the request's own data fields, ranges of the bytes
// gRPC received (wire_message.h), or elsewhere. The sizes are checked against the shapes; the
// pointers (host memory holding the bytes, or null while only the checks run) go into the params.
// A size of -1: the bytes are still to come (AttendChunked), the shape alone decides.
struct InputTensors {
  int64_t q_bytes = 0, k_bytes = 0, v_bytes = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
};

// A validated request, ready for an executor.
struct DecodedRequest {
  // Host pointers into the request (q, k, v, cu_seqlens) and the response (o, lse), or into the
  // regions of tensors by reference. The InputTensors overload of DecodeRequest leaves o and lse
  // null for the caller to place, unless they go into a region (o_ref, lse_ref).
  AttentionParams params;
  // The response's tensors without their data: o (shape of q, dtype OutputDType of q's:
  // bfloat16 for float8), and when asked lse
  // (float32 [B, Hq, Nq], varlen [Hq, total_q]); the bytes the response carries for them (0 when
  // not asked, or written into a region).
  v1::Tensor o;
  v1::Tensor lse;
  int64_t o_bytes = 0;
  int64_t lse_bytes = 0;
  // The bytes of q, k and v the request carries, as their shapes and dtype give them (0 for a
  // tensor by reference, whose params already point into its region).
  int64_t q_bytes = 0, k_bytes = 0, v_bytes = 0;
  // Attention FLOPs, 4 * Hq * D per (query row, visible key) pair, counted under the mask.
  double flops = 0;
  // Query rows computed: B * Nq, or total_q for varlen.
  int64_t query_tokens = 0;
};

// Validates `request` (INVALID_ARGUMENT naming the field, the expected and the actual value;
// RESOURCE_EXHAUSTED when the tensors exceed options.max_message_bytes) and decodes it. Sets the
// response's o (shape of q, bfloat16 for float8 inputs, else q's dtype) and, when asked, lse
// (float32 [B, Hq, Nq], varlen [Hq, total_q]) to their final sizes; `request` and `response` must
// outlive the result and not be modified while it is in use. Checks shared with the Sessions
// service (server/session_request.h). Messages name the field, the expected and the actual value.

// "[2, 4, 16, 32]".
std::string ShapeString(const v1::Tensor& t);
// "DTYPE_FLOAT16", or "unknown dtype 9".
std::string DTypeString(int dtype);
// The kernel dtype of a v1::DType; INVALID_ARGUMENT naming `field` (e.g. "q.dtype") otherwise.
absl::StatusOr<DType> ToDType(int dtype, absl::string_view field);
// Checks rank, dims (> 0, product fits int64) and byte size of tensor `name`; returns its bytes.
absl::StatusOr<int64_t> CheckTensor(absl::string_view name, const v1::Tensor& t, int rank,
                                    absl::string_view rank_meaning, size_t element_bytes);
// The same with the tensor's bytes counted elsewhere: `data_bytes` stands for t.data().size()
// (-1: not checked, the bytes are still to come).
absl::StatusOr<int64_t> CheckTensor(absl::string_view name, const v1::Tensor& t, int64_t data_bytes,
                                    int rank, absl::string_view rank_meaning, size_t element_bytes);

// The scale and window of a request with softmax_scale, window_left, window_right and causal
// (AttendRequest, StepRequest), for head dim `head_dim`; AttendRequest's mask_alignment is decoded
// beside it (a StepRequest is always bottom-right).
struct MaskParams {
  float softmax_scale = 1.0f;
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
};
// The largest softmax_scale served. Far above any model's: 1/sqrt(D) is ~0.06-1, and temperature
// or logit-scaling variants reach ~1e2. Beyond it the kernels' folded scale * log2(e) factor and
// the scaled logits risk overflowing float32, and the softmax becomes a discontinuous function of
// the logits' last-bit rounding (the top logit takes all the weight, so a tensor-core q.k that
// differs from an exact one in the last bit flips the answer): no backend could promise an
// accurate result, so such scales are refused rather than answered inexactly.
inline constexpr float kMaxSoftmaxScale = 1e6f;

template <typename Request>
absl::StatusOr<MaskParams> DecodeMask(const Request& request, int64_t head_dim) {
  if (request.has_softmax_scale() &&
      !(std::isfinite(request.softmax_scale()) && request.softmax_scale() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale: expected a finite value > 0, got ", request.softmax_scale()));
  }
  if (request.has_softmax_scale() && request.softmax_scale() > kMaxSoftmaxScale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale: expected at most ", kMaxSoftmaxScale,
        " (larger scales cannot be computed accurately), got ", request.softmax_scale()));
  }
  for (const auto& [name, present, value] :
       {std::tuple{"window_left", request.has_window_left(), request.window_left()},
        {"window_right", request.has_window_right(), request.window_right()}}) {
    if (present && value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected >= 0 (absent = unbounded), got ", value));
    }
  }
  MaskParams mask;
  mask.softmax_scale = request.has_softmax_scale()
                           ? request.softmax_scale()
                           : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  if (request.has_window_left()) mask.window_left = request.window_left();
  if (request.has_window_right()) mask.window_right = request.window_right();
  if (request.causal()) mask.window_right = 0;  // any given right bound is >= 0, so causal wins
  return mask;
}

// The open-model options of an AttendRequest or StepRequest (sinks, softcap, chunk_size) for
// `heads_q` query heads: absent ones are nullptr / 0. sinks points into the request's field.
// INVALID_ARGUMENT naming the field for a sink count other than heads_q, a non-finite sink, a
// softcap not finite and > 0, a chunk_size not > 0. Which backend serves them is the executor's
// business (a kernel refuses what it does not serve by name).
struct OpenModelOptions {
  const float* sinks = nullptr;
  float softcap = 0.0f;
  int64_t chunk_size = 0;
};
template <typename Request>
absl::StatusOr<OpenModelOptions> DecodeOpenModelOptions(const Request& request, int64_t heads_q) {
  OpenModelOptions open;
  if (request.sinks_size() > 0) {
    if (request.sinks_size() != heads_q) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sinks: expected ", heads_q, " values (one per query head), got ", request.sinks_size()));
    }
    for (int h = 0; h < request.sinks_size(); ++h) {
      if (!std::isfinite(request.sinks(h))) {
        return absl::InvalidArgumentError(
            absl::StrCat("sinks[", h, "]: expected a finite logit, got ", request.sinks(h)));
      }
    }
    open.sinks = request.sinks().data();
  }
  if (request.has_softcap()) {
    if (!(std::isfinite(request.softcap()) && request.softcap() > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("softcap: expected a finite value > 0, got ", request.softcap()));
    }
    open.softcap = request.softcap();
  }
  if (request.has_chunk_size()) {
    if (request.chunk_size() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk_size: expected > 0 (absent = no chunks), got ", request.chunk_size()));
    }
    open.chunk_size = request.chunk_size();
  }
  return open;
}

// The descale factors of an AttendRequest whose q, k, v are of `dtype` (1 where absent): only
// float8 inputs take them, each finite and > 0, and softmax_scale * q_descale * k_descale (the
// scale of the raw logits) at most kMaxSoftmaxScale; INVALID_ARGUMENT naming the field otherwise.
struct Descales {
  float q = 1.0f, k = 1.0f, v = 1.0f;
};
absl::StatusOr<Descales> DecodeDescales(const v1::AttendRequest& request, DType dtype,
                                        float softmax_scale);

// Tensors given by reference (Tensor.ref, o_ref, lse_ref) are resolved through `refs` (null:
// shared memory is off, and such requests get FAILED_PRECONDITION); o and lse written into a
// region leave the response's tensor with its dtype and shape and no data.
absl::StatusOr<DecodedRequest> DecodeRequest(const v1::AttendRequest& request,
                                             const DecodeOptions& options,
                                             v1::AttendResponse* response,
                                             TensorRefResolver* refs = nullptr);

// The same checks over `request`'s fields but the tensors' data, whose bytes `inputs` gives (its
// pointers unused for tensors by reference); o and lse are described in the result (o, lse,
// o_bytes, lse_bytes) and, unless in a region, left for the caller to place.
// `request` and the inputs' memory must outlive the result.
absl::StatusOr<DecodedRequest> DecodeRequest(const v1::AttendRequest& request,
                                             const InputTensors& inputs,
                                             const DecodeOptions& options,
                                             TensorRefResolver* refs = nullptr);

}  // namespace attention::server
