// CUDA events of co-located callers, by their IPC handles (StepRequest.ready_event and
// done_event): opened once per (device, handle) through the hooks and kept in a bounded cache, so
// a decode loop that sends the same two events every layer call opens them once. This room holds
// no CUDA code: the hooks do (server/executors/region_hooks.h).
//
// An event handle is a capability, not an allocation: it names no memory, and a caller who sends
// another process's handle can only order work against that process's stream. So events have no
// owner; the cache is shared by every caller, bounded at `capacity` handles (the least recently
// used one closed for a new one, once no step still holds it).
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attention::server {

struct EventHooks {
  // Opens an event's IPC handle (its bytes as the caller sent them) on `device`.
  std::function<absl::StatusOr<void*>(absl::string_view handle, int device)> open;
  std::function<void(void* event, int device)> close;
};

class IpcEvents {
 public:
  // Empty hooks: every Open is UNIMPLEMENTED.
  explicit IpcEvents(EventHooks hooks, int capacity = 256);
  ~IpcEvents();
  IpcEvents(const IpcEvents&) = delete;
  IpcEvents& operator=(const IpcEvents&) = delete;

  // The event of `handle` on `device`, held open while the answer lives. INVALID_ARGUMENT naming
  // `field` for a handle of the wrong size or one the driver cannot open, UNIMPLEMENTED without
  // hooks.
  absl::StatusOr<std::shared_ptr<void>> Open(absl::string_view field, absl::string_view handle,
                                             int device);

 private:
  using Key = std::pair<int, std::string>;  // (device, handle bytes)
  struct Entry {
    Key key;
    std::shared_ptr<void> event;
  };

  const EventHooks hooks_;
  const int capacity_;
  std::mutex mu_;
  std::list<Entry> lru_;  // most recently used first
  absl::flat_hash_map<Key, std::list<Entry>::iterator> index_;
};

}  // namespace attention::server
