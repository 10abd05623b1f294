#include "kernels/paged_kv.h"

#include "absl/strings/str_cat.h"

namespace attention {

int64_t PageRows(int64_t page_bytes, const KvShape& shape) {
  if (page_bytes <= 0 || shape.heads_kv <= 0 || shape.head_dim <= 0 || shape.v_head_dim < 0) {
    return 0;
  }
  // One row of a page: K and V of every kv head.
  const int64_t row_bytes = shape.heads_kv * (shape.head_dim + shape.value_head_dim()) *
                            static_cast<int64_t>(DTypeSize(shape.dtype));
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
