// What the forward runner's streams (host_runner.h) and the decode pool (paged_kv_pool.h) both
// hold: a non-blocking CUDA stream, sets of CUDA events created and destroyed together, and
// buffers of device memory or pinned host staging that grow to the largest call and are then
// reused (they never shrink, so after warm-up nothing is allocated on the call path).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attention::cuda {

// A buffer of device memory (of the current device) or of pinned host memory (portable: every
// device addresses it). Its contents are not kept when it grows.
class GrowableBuffer {
 public:
  enum class Kind { kDevice, kPinned };
  explicit GrowableBuffer(Kind kind) : kind_(kind) {}
  ~GrowableBuffer() { Free(); }
  GrowableBuffer(const GrowableBuffer&) = delete;
  GrowableBuffer& operator=(const GrowableBuffer&) = delete;

  unsigned char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // Makes the buffer `bytes` long when it is shorter, freeing the old one first (its bytes count
  // against the device's memory); a failed allocation leaves it empty and is RESOURCE_EXHAUSTED
  // "cannot allocate <bytes> bytes of device memory (or pinned host memory) for <what>".
  absl::Status Grow(size_t bytes, absl::string_view what);
  // Frees it; bytes() is then 0.
  void Free();

 private:
  const Kind kind_;
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
};

// A new non-blocking stream (it does not wait for the legacy default stream) on the current
// device.
absl::StatusOr<cudaStream_t> CreateStream();

// Creates every event of `events`; on an error none is left (those already created are
// destroyed) and `events` is all null.
absl::Status CreateEvents(absl::Span<cudaEvent_t> events);
// Destroys the events of `events` that are not null.
void DestroyEvents(absl::Span<const cudaEvent_t> events);

}  // namespace attention::cuda
