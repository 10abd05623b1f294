// Pinned host memory for the CUDA executors (host_memory.h): blocks from cudaHostAlloc (portable,
// so every GPU's DMAs read them directly), kept for reuse after release while the cache holds less
// than its cap. A request takes the smallest cached block of at least its size, if that is at most
// twice its size; else a new one. Blocks are rounded up to 2 MiB so sizes repeat.
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/executors/host_memory.h"

namespace attention::server {
namespace {

constexpr int64_t kRounding = int64_t{2} << 20;

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  explicit PinnedPool(int64_t cache_bytes) : cache_bytes_(cache_bytes) {}
  ~PinnedPool() {
    for (auto& [size, block] : free_) cudaFreeHost(block);
  }

  absl::StatusOr<std::shared_ptr<char>> Allocate(int64_t bytes) {
    const int64_t size = (bytes + kRounding - 1) / kRounding * kRounding;
    char* block = nullptr;
    int64_t block_size = size;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= 2 * size) {
        block_size = it->first;
        block = it->second;
        cached_ -= it->first;
        free_.erase(it);
      }
    }
    if (block == nullptr) {
      void* fresh = nullptr;
      if (cudaHostAlloc(&fresh, size, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();  // not sticky; the host has no more to pin
        return pageable_->Allocate(bytes);
      }
      block = static_cast<char*>(fresh);
    }
    std::shared_ptr<PinnedPool> self = shared_from_this();
    return std::shared_ptr<char>(block,
                                 [self, block_size](char* p) { self->Release(p, block_size); });
  }

 private:
  void Release(char* block, int64_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_ + size <= cache_bytes_) {
        free_.emplace(size, block);
        cached_ += size;
        return;
      }
    }
    cudaFreeHost(block);
  }

  const int64_t cache_bytes_;
  const std::unique_ptr<HostMemory> pageable_ = MakePageableHostMemory();
  std::mutex mu_;
  std::multimap<int64_t, char*> free_;  // guarded by mu_: size -> cached block
  int64_t cached_ = 0;                  // guarded by mu_
};

class PinnedHostMemory final : public HostMemory {
 public:
  explicit PinnedHostMemory(int64_t cache_bytes)
      : pool_(std::make_shared<PinnedPool>(cache_bytes)) {}
  absl::StatusOr<std::shared_ptr<char>> Allocate(int64_t bytes) override {
    return pool_->Allocate(bytes);
  }

 private:
  std::shared_ptr<PinnedPool> pool_;
};

}  // namespace

std::unique_ptr<HostMemory> MakePinnedHostMemory(int64_t cache_bytes) {
  return std::make_unique<PinnedHostMemory>(cache_bytes);
}

}  // namespace attention::server
