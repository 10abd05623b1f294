// Validation and decoding of an AttendRequest into the kernel interface (AttentionParams).
//
// Decoding copies no tensor data: q, k, v point straight into the request's bytes fields, and o
// (and lse) point into the response's Tensor data, sized once here and written in place by the
// executor. Host copies per request on the CPU path are therefore two, both made by gRPC and
// protobuf themselves: wire -> request bytes (parsing) and response bytes -> wire (serializing).
// Sizing the response zero-fills it once (std::string::resize), which writes but copies nothing.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "kernels/attention_params.h"

namespace attention::server {

struct DecodeOptions {
  // Largest request or response payload accepted (the gRPC message limit).
  int64_t max_message_bytes = int64_t{1} << 30;
  // Head dims 1..max_head_dim are served.
  int max_head_dim = 256;
};

// A validated request, ready for an executor.
struct DecodedRequest {
  // Host pointers into the request (q, k, v, cu_seqlens) and the response (o, lse).
  AttentionParams params;
  // Attention FLOPs, 4 * Hq * D per (query row, visible key) pair, counted under the mask.
  double flops = 0;
  // Query rows computed: B * Nq, or total_q for varlen.
  int64_t query_tokens = 0;
};

// Validates `request` (INVALID_ARGUMENT naming the field, the expected and the actual value;
// RESOURCE_EXHAUSTED when the tensors exceed options.max_message_bytes) and decodes it. Sets the
// response's o (dtype and shape of q) and, when asked, lse (float32 [B, Hq, Nq], varlen
// [Hq, total_q]) to their final sizes; `request` and `response` must outlive the result and not
// be modified while it is in use.
absl::StatusOr<DecodedRequest> DecodeRequest(const v1::AttendRequest& request,
                                             const DecodeOptions& options,
                                             v1::AttendResponse* response);

}  // namespace attention::server
