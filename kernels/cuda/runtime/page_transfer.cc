#include "kernels/cuda/runtime/page_transfer.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops/cuda_status.h"

namespace attention::cuda {

absl::StatusOr<HostBuffer> AllocatePinnedHost(int64_t bytes) {
  void* memory = nullptr;
  if (bytes <= 0 ||
      cudaHostAlloc(&memory, static_cast<size_t>(bytes), cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", bytes, " bytes of pinned host memory for the KV host tier"));
  }
  return HostBuffer(static_cast<unsigned char*>(memory), [](unsigned char* p) { cudaFreeHost(p); });
}

absl::Status CopyHostPages(cudaStream_t stream, unsigned char* pool, int64_t page_bytes,
                           absl::Span<const HostPage> pages, bool to_host) {
  const auto bytes = static_cast<size_t>(page_bytes);
  for (size_t first = 0; first < pages.size();) {
    // [first, last): pages consecutive in the pool and on the host.
    size_t last = first + 1;
    while (last < pages.size() && pages[last].page == pages[last - 1].page + 1 &&
           pages[last].host == pages[last - 1].host + bytes) {
      ++last;
    }
    unsigned char* device = pool + static_cast<size_t>(pages[first].page) * bytes;
    unsigned char* host = pages[first].host;
    const size_t run = (last - first) * bytes;
    RETURN_IF_CUDA_ERROR(
        to_host ? cudaMemcpyAsync(host, device, run, cudaMemcpyDeviceToHost, stream)
                : cudaMemcpyAsync(device, host, run, cudaMemcpyHostToDevice, stream),
        to_host ? "copy KV pages to the host tier" : "copy KV pages back from the host tier");
    first = last;
  }
  RETURN_IF_CUDA_ERROR(
      cudaStreamSynchronize(stream),
      to_host ? "copy KV pages to the host tier" : "copy KV pages back from the host tier");
  return absl::OkStatus();
}

}  // namespace attention::cuda
