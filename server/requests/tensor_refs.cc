#include "server/requests/tensor_refs.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

absl::Status SharedMemoryOff(absl::string_view field) {
  return absl::FailedPreconditionError(
      absl::StrCat(field,
                   ": tensors in shared memory are off on this server (start it with "
                   "--allow_shared_memory)"));
}

}  // namespace

absl::StatusOr<const char*> TensorData(absl::string_view name, const v1::Tensor& t,
                                       int64_t alignment, TensorRefResolver* refs) {
  if (!t.has_ref()) return t.data().data();
  const std::string field = absl::StrCat(name, ".ref");
  if (refs == nullptr) return SharedMemoryOff(field);
  absl::StatusOr<char*> data = refs->Resolve(field, t.ref(), alignment);
  if (!data.ok()) return data.status();
  return *data;
}

absl::StatusOr<char*> OutputRef(absl::string_view field, const v1::TensorRef& ref, int64_t bytes,
                                int64_t alignment, TensorRefResolver* refs) {
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size: expected ", bytes,
                                                   " bytes (the output's size), got ",
                                                   ref.byte_size()));
  }
  if (refs == nullptr) return SharedMemoryOff(field);
  return refs->Resolve(field, ref, alignment);
}

}  // namespace attention::server
