#include "server/regions/ipc_events.h"

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

// sizeof(cudaIpcEventHandle_t), which this room cannot include.
constexpr size_t kHandleBytes = 64;

}  // namespace

IpcEvents::IpcEvents(EventHooks hooks, int capacity)
    : hooks_(std::move(hooks)), capacity_(capacity) {}

IpcEvents::~IpcEvents() = default;  // each event closes when its last holder lets it go

absl::StatusOr<std::shared_ptr<void>> IpcEvents::Open(absl::string_view field,
                                                      absl::string_view handle, int device) {
  if (!hooks_.open) {
    return absl::UnimplementedError(absl::StrCat(
        field, ": CUDA events are served by the cuda backend only (with --allow_shared_memory)"));
  }
  if (handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected a ", kHandleBytes,
                                                   "-byte cudaIpcEventHandle_t, got ",
                                                   handle.size(), " bytes"));
  }
  Key key{device, std::string(handle)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->event;
    }
  }
  // Opened without the lock (a driver call); two callers racing on one new handle both open it,
  // and the second's copy is dropped below.
  absl::StatusOr<void*> opened = hooks_.open(handle, device);
  if (!opened.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", opened.status().message()));
  }
  std::shared_ptr<void> event(*opened, [close = hooks_.close, device](void* e) {
    if (close) close(e, device);
  });
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = index_.find(key); it != index_.end()) return it->second->event;
  if (static_cast<int>(lru_.size()) >= capacity_) {
    index_.erase(lru_.back().key);
    lru_.pop_back();  // closed once the steps that hold it are answered
  }
  lru_.push_front(Entry{key, event});
  index_.emplace(std::move(key), lru_.begin());
  return event;
}

}  // namespace attention::server
