// Tensors by reference (Tensor.ref, AttendRequest.o_ref / lse_ref, StepEntry.o_ref): the decoders
// ask a TensorRefResolver for the bytes a TensorRef names and take the span it answers, so they
// know nothing of regions, owners or mappings (server/regions/ does; the service adapts).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
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

// [begin, begin + bytes) of one tensor of a request, named by its field ("q", "entries[2].o_ref");
// a null begin or 0 bytes (a tensor absent, or whose bytes are still to come) overlaps nothing.
struct ByteSpan {
  std::string field;
  const char* begin = nullptr;
  int64_t bytes = 0;
};
// An output that overlaps an input or another output would be read after it was written, or
// written twice. INVALID_ARGUMENT naming both: "o_ref: expected bytes apart from every input's,
// got bytes that overlap q's", or for two outputs "lse_ref: expected bytes apart from every other
// output's, got bytes that overlap o_ref's" (named the later of `outputs` first). Inputs may
// overlap each other. Sorts the spans by address: O(n log n) in their number.
absl::Status CheckOutputsApart(const std::vector<ByteSpan>& outputs,
                               const std::vector<ByteSpan>& inputs);

}  // namespace attention::server
