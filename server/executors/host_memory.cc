#include "server/executors/host_memory.h"

#include <cstdlib>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

constexpr size_t kAlignment = 256;

class PageableHostMemory final : public HostMemory {
 public:
  absl::StatusOr<std::shared_ptr<char>> Allocate(int64_t bytes) override {
    const size_t size = (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
    // Not touched here: pages are committed as the copy writes them.
    void* block = std::aligned_alloc(kAlignment, size);
    if (block == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    return std::shared_ptr<char>(static_cast<char*>(block), [](char* p) { std::free(p); });
  }
};

}  // namespace

std::unique_ptr<HostMemory> MakePageableHostMemory() {
  return std::make_unique<PageableHostMemory>();
}

}  // namespace attention::server
