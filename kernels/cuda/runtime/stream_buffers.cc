#include "kernels/cuda/runtime/stream_buffers.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"

namespace attention::cuda {

absl::Status GrowableBuffer::Grow(size_t bytes, absl::string_view what) {
  if (bytes <= bytes_) return absl::OkStatus();
  Free();
  void* p = nullptr;
  const cudaError_t err = kind_ == Kind::kDevice ? cudaMalloc(&p, bytes)
                                                 : cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    return CudaError(
        err, absl::StrCat("cannot allocate ", bytes, " bytes of ",
                          kind_ == Kind::kDevice ? "device" : "pinned host", " memory for ", what));
  }
  data_ = static_cast<unsigned char*>(p);
  bytes_ = bytes;
  return absl::OkStatus();
}

void GrowableBuffer::Free() {
  if (kind_ == Kind::kDevice) {
    cudaFree(data_);
  } else {
    cudaFreeHost(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<cudaStream_t> CreateStream() {
  cudaStream_t stream = nullptr;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "cudaStreamCreate");
  return stream;
}

absl::Status CreateEvents(absl::Span<cudaEvent_t> events) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (const cudaError_t err = cudaEventCreate(&events[i]); err != cudaSuccess) {
      events[i] = nullptr;
      DestroyEvents(events.subspan(0, i));
      for (size_t j = 0; j < i; ++j) events[j] = nullptr;
      return CudaError(err, "cudaEventCreate");
    }
  }
  return absl::OkStatus();
}

void DestroyEvents(absl::Span<const cudaEvent_t> events) {
  for (cudaEvent_t e : events) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

}  // namespace attention::cuda
