#include "kernels/paged_kv.h"

#include "absl/strings/str_cat.h"

namespace attention {

int64_t PageRows(int64_t page_bytes, DType dtype, int64_t heads_kv, int64_t head_dim) {
  if (page_bytes <= 0 || heads_kv <= 0 || head_dim <= 0) return 0;
  // One row of a page: K and V of every kv head.
  const int64_t row_bytes = 2 * heads_kv * head_dim * static_cast<int64_t>(DTypeSize(dtype));
  return page_bytes / row_bytes / 16 * 16;
}

absl::Status RefuseDeviceMemory(const StepMemory& memory, const char* backend) {
  if (!memory.on_device && memory.ready == nullptr && memory.ready_counter == nullptr &&
      !memory.stream_ordered()) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat(
      "tensors in device memory and stream order (CUDA regions, ready_event, done_event, "
      "ready_counter, done_counter) are not served by the ",
      backend, " backend"));
}

}  // namespace attention
