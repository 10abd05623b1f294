#include "kernels/paged_kv.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attention {

int64_t PageRows(int64_t page_bytes, const KvShape& shape) {
  if (page_bytes <= 0 || shape.heads_kv <= 0 || shape.head_dim <= 0 || shape.v_head_dim < 0) {
    return 0;
  }
  // One row of a page: K and V of every kv head (K alone where V lies in it).
  const int64_t row_bytes =
      shape.heads_kv * shape.stored_dims() * static_cast<int64_t>(DTypeSize(shape.dtype));
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

absl::Status CheckHostPages(absl::Span<const HostPage> pages, int64_t num_pages) {
  std::vector<int32_t> seen;
  seen.reserve(pages.size());
  for (const HostPage& p : pages) {
    if (p.page < 0 || p.page >= num_pages) {
      return absl::InvalidArgumentError(absl::StrCat(
          "host tier copy: page ", p.page, " is outside the pool's ", num_pages, " pages"));
    }
    if (p.host == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("host tier copy: page ", p.page, " has no host memory"));
    }
    seen.push_back(p.page);
  }
  std::sort(seen.begin(), seen.end());
  if (auto twice = std::adjacent_find(seen.begin(), seen.end()); twice != seen.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("host tier copy: page ", *twice, " is listed twice"));
  }
  return absl::OkStatus();
}

namespace {
absl::Status NoHostTier() {
  return absl::UnimplementedError("this KV page pool keeps no host tier (--kv_host_bytes)");
}
}  // namespace

absl::StatusOr<HostBuffer> KvPagePool::AllocateHost(int64_t) { return NoHostTier(); }
absl::Status KvPagePool::SavePages(absl::Span<const HostPage>) { return NoHostTier(); }
absl::Status KvPagePool::LoadPages(absl::Span<const HostPage>) { return NoHostTier(); }

}  // namespace attention
