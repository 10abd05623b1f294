// Checking a response against the float64 reference (kernels/reference) computed locally from
// its request: the CLI's --check and the end-to-end tests.
//
// The request is mapped to kernel parameters here rather than through the server's decoder, so
// the oracle shares no code with what it checks. It assumes a well-formed request.
#pragma once

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"

namespace attention::client {

struct CheckResult {
  // ||o - ref|| / ||ref|| over every output element: the API's accuracy measure.
  double relative_error = 0;
  // max |o - ref| / max |ref|: the worst single element, scaled like the norm measure.
  double max_relative_error = 0;
  // For return_lse: ||lse - ref|| / (||ref|| + sqrt(n)) over the n rows that see a key (an LSE's
  // error is absolute near 0); rows that see none must be -inf in both (a mismatch there counts
  // as an infinite error).
  bool lse_checked = false;
  double lse_relative_error = 0;
  // Threads the reference ran on (one (batch item, query head) pair at a time each).
  int reference_threads = 1;
};

// The API's bound on relative_error for inputs of `dtype` (docs/API.md): 1e-5 for float32, 1e-2
// for float16/bfloat16, 4e-2 for float8_e4m3 (whose o is bfloat16; the Hopper kernel rounds P to
// e4m3), against the reference on the dequantised inputs.
double ErrorBound(v1::DType dtype);

// Computes the reference for `request` and compares `response` with it. An error when the
// response's o (or lse) has the wrong dtype or shape, or the request is not well formed.
absl::StatusOr<CheckResult> CheckResponse(const v1::AttendRequest& request,
                                          const v1::AttendResponse& response);

// True when every measured error of `result` is within ErrorBound(dtype).
bool WithinBound(const CheckResult& result, v1::DType dtype);

}  // namespace attention::client
