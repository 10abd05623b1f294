// Tensors by reference (Tensor.ref, AttendRequest.o_ref / lse_ref, StepEntry.o_ref): the decoders
// ask a TensorRefResolver for the bytes a TensorRef names and take the span it answers, so they
// know nothing of regions, owners or mappings (server/regions/ does; the service adapts).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"

namespace attention::server {

class TensorRefResolver {
 public:
  virtual ~TensorRefResolver() = default;
  // Host bytes of `ref` for request field `field` (e.g. "q.ref"), their start aligned to
  // `alignment` bytes, readable and writable until the request is answered. Errors name `field`:
  // NOT_FOUND for an unknown region, INVALID_ARGUMENT outside it or misaligned,
  // FAILED_PRECONDITION when the server serves no shared memory.
  virtual absl::StatusOr<char*> Resolve(absl::string_view field, const v1::TensorRef& ref,
                                        int64_t alignment) = 0;
};

// The bytes of tensor `name` (already checked by CheckTensor): its data, or its ref resolved
// through `refs` (null: shared memory is off, FAILED_PRECONDITION).
absl::StatusOr<const char*> TensorData(absl::string_view name, const v1::Tensor& t,
                                       int64_t alignment, TensorRefResolver* refs);
// Where an output goes: the region bytes of `ref`, checked to be `bytes` long, for field `field`
// ("o_ref").
absl::StatusOr<char*> OutputRef(absl::string_view field, const v1::TensorRef& ref, int64_t bytes,
                                int64_t alignment, TensorRefResolver* refs);

}  // namespace attention::server
