// Shared-memory regions of co-located clients (the SharedMemory service's state): a client puts
// tensors in memory it shares with the server and sends references (region, offset, size)
// instead of bytes, so the bytes never cross the socket.
//
// A system region is a POSIX shared-memory object, named as shm_open names it ("/name": one
// leading slash, no other, never a file path), opened read-write without O_CREAT and mapped once
// at registration. A CUDA region is a cudaIpcMemHandle_t of another process's device memory,
// opened once on its device through the hooks (this room holds no CUDA code).
//
// Security: a region belongs to the owner key that registered it (the bearer token, or the
// client's connection); other owners see NOT_FOUND, as for an unknown name. A system object must
// belong to the server's own user (st_uid), unless RegionLimits::allow_foreign. Every reference is
// bounds-checked (offset, size, alignment) before a pointer is handed out. A request holds a Use
// of each region it references; Unregister waits until no Use is left (bounded by its deadline),
// so a mapping is never removed under a running request. Limits: regions per owner and the total
// bytes mapped.
//
// Lifetime: an owner known only by its connection (no bearer token) may go without unregistering,
// and gRPC 1.51 tells the server nothing when a connection closes. Such a region is released once
// its connection (its id, RegionOwnership::connection) is no longer among the open ones (the
// `open_connections` hook, asked every second while such regions exist), or once no request has
// used it for RegionLimits::idle_timeout when its connection's id is unknown or the hook cannot
// say; a registration from a later connection with the same owner key (the same address and port)
// drops what an earlier connection left. So clients that come and go cannot pile up mappings and
// fds, and a later connection could reach an earlier one's regions only in the second before the
// check. One housekeeping thread does it, and answers
// the Unregister calls that wait (their region's last Use, their deadline): no thread per waiting
// call.
//
// A client may shrink its object (ftruncate) after registering it: each reference checks the
// object's size (fstat of the fd kept open) and is refused once the object is smaller than the
// region; an access that faults because it shrank while a request ran is repaired by
// shrink_guard.h (zero pages over the rest of the mapping), and the request fails when it
// answers (Use::Intact). Either way the region then serves no more requests: FAILED_PRECONDITION
// until it is unregistered and registered again.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::server {

struct RegionLimits {
  int max_regions_per_owner = 64;
  int64_t max_mapped_bytes = int64_t{64} << 30;  // over every owner
  // A region owned by a connection goes once no request has used it for this long.
  absl::Duration idle_timeout = absl::Seconds(300);
  // System objects of another user (st_uid not the server's) may be registered.
  bool allow_foreign = false;
};

// What the device backend does for regions; each may be empty (then: not pinned, and CUDA
// regions are UNIMPLEMENTED).
struct RegionHooks {
  // Registers host memory with the GPU so copies from and to it run at the pinned rate; answers
  // whether it did. `unpin_host` undoes it before the mapping goes.
  std::function<bool(void* data, int64_t bytes)> pin_host;
  std::function<void(void* data)> unpin_host;
  // Opens the IPC handle's memory on `device`: its base pointer and the allocation's bytes.
  std::function<absl::StatusOr<std::pair<void*, int64_t>>(absl::string_view handle, int device)>
      open_cuda;
  std::function<void(void* base, int device)> close_cuda;
};

enum class RegionKind { kSystem, kCuda };

struct RegionDescription {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  std::string key;  // the system key; empty for CUDA regions
  int device = 0;   // CUDA regions
  int64_t offset = 0;
  int64_t byte_size = 0;
  bool pinned = false;
};

// Who owns a region, beyond its owner key: a bearer token (the default) keeps its regions until it
// unregisters them; a connection (no token) may close without a word.
struct RegionOwnership {
  bool by_connection = false;
  int64_t connection = -1;  // by_connection: its id (OpenConnections); -1: unknown
};

// The ids of the open connections; nullopt when they cannot be known.
using OpenConnectionsHook = std::function<std::optional<absl::flat_hash_set<int64_t>>()>;

// Bytes of a region a reference resolved to: host memory (system) or device memory of `device`.
struct RegionSpan {
  char* data = nullptr;
  int64_t size = 0;
  RegionKind kind = RegionKind::kSystem;
  int device = 0;
};

class RegionRegistry {
 public:
  // A region held by one request: while any Use of it lives, it stays mapped (Unregister waits).
  class Use {
   public:
    Use(Use&&) = default;
    Use& operator=(Use&&) = delete;
    ~Use();

    // Checked when the request that holds it answers: OK while the region (a system one) still
    // holds its object's bytes; FAILED_PRECONDITION once its object was seen shrunk below it or
    // an access to it faulted (see shrink_guard.h): what the request read or wrote there is not
    // the client's data, so it must fail.
    absl::Status Intact() const;

    // Bytes [offset, offset + byte_size) of this held region for the request field `field`,
    // checked as Resolve checks them (bounds, alignment; no lookup, no lock, no size check of
    // the object: the request's answer checks Intact once). For a request's further references
    // to a region it already holds.
    absl::StatusOr<RegionSpan> Span(absl::string_view field, int64_t offset, int64_t byte_size,
                                    int64_t alignment) const;
    const std::string& name() const;

   private:
    friend class RegionRegistry;
    struct Region;
    // Bytes [offset, offset + byte_size) of `region` for `field`: INVALID_ARGUMENT outside it, or
    // when the pointer is not a multiple of `alignment`.
    static absl::StatusOr<RegionSpan> SpanOf(const Region& region, absl::string_view field,
                                             int64_t offset, int64_t byte_size, int64_t alignment);
    Use(RegionRegistry* registry, std::shared_ptr<Region> region)
        : registry_(registry), region_(std::move(region)) {}
    RegionRegistry* registry_ = nullptr;
    std::shared_ptr<Region> region_;
  };

  // Starts the housekeeping thread. `open_connections` (may be empty) says which connections of
  // connection-owned regions are still open.
  RegionRegistry(const RegionLimits& limits, RegionHooks hooks,
                 OpenConnectionsHook open_connections = {});
  // Stops the housekeeping thread and unmaps every region; no Use and no waiting Unregister may be
  // left.
  ~RegionRegistry();
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  // Maps bytes [offset, offset + byte_size) of the shared-memory object `key`. INVALID_ARGUMENT
  // for a bad name, key, offset or size (naming the field), NOT_FOUND when no such object exists,
  // PERMISSION_DENIED for another user's object (unless allow_foreign), ALREADY_EXISTS when the
  // owner has a region of that name, RESOURCE_EXHAUSTED over a limit. A connection's regions go
  // with it (above).
  absl::StatusOr<RegionDescription> RegisterSystem(const std::string& owner,
                                                   const RegionOwnership& ownership,
                                                   const std::string& name, const std::string& key,
                                                   int64_t offset, int64_t byte_size);
  // Opens a CUDA IPC handle (sizeof(cudaIpcMemHandle_t) bytes) on `device`; bytes [offset,
  // offset + byte_size) of its allocation. UNIMPLEMENTED without the open_cuda hook.
  absl::StatusOr<RegionDescription> RegisterCuda(const std::string& owner,
                                                 const RegionOwnership& ownership,
                                                 const std::string& name, const std::string& handle,
                                                 int device, int64_t offset, int64_t byte_size);
  // Removes the region once no request holds it, then `done(OK)`; `done(DEADLINE_EXCEEDED)` (the
  // region stays) when requests still hold it at `deadline`; `done(NOT_FOUND)` for unknown names.
  // `done` runs here when the answer is known at once (an idle region, an unknown name), else on
  // the housekeeping thread; no lock is held while it runs.
  void Unregister(const std::string& owner, const std::string& name, absl::Time deadline,
                  absl::AnyInvocable<void(absl::Status) &&> done);
  std::vector<RegionDescription> List(const std::string& owner) const;

  // Resolves bytes [offset, offset + byte_size) of the owner's region `region` for the request
  // field `field` (e.g. "q.ref"), the pointer aligned to `alignment`; adds a Use of the region to
  // `uses`. NOT_FOUND for an unknown region (or another owner's), INVALID_ARGUMENT out of bounds,
  // FAILED_PRECONDITION when its object shrank (see Use::Intact).
  absl::StatusOr<RegionSpan> Resolve(const std::string& owner, absl::string_view field,
                                     const std::string& region, int64_t offset, int64_t byte_size,
                                     int64_t alignment, std::vector<Use>* uses);

  int64_t mapped_bytes() const;

 private:
  using Region = Use::Region;
  using Key = std::pair<std::string, std::string>;  // owner, name

  absl::Status CheckRoomLocked(const std::string& owner, const std::string& name,
                               int64_t bytes) const;
  absl::StatusOr<RegionDescription> Insert(const std::string& owner,
                                           std::shared_ptr<Region> region);
  // Takes the region out of the registry (it is unmapped once the caller drops the lock). Needs
  // mu_.
  std::shared_ptr<Region> RemoveLocked(std::map<Key, std::shared_ptr<Region>>::iterator it);
  // The unused regions of `owner` that an earlier connection left (another connection id than
  // `ownership`'s), taken out. Needs mu_.
  std::vector<std::shared_ptr<Region>> TakeStaleLocked(const std::string& owner,
                                                       const RegionOwnership& ownership);
  // A registration's early checks: the caller's stale regions dropped, then a taken name or a
  // full caller refused (before anything is opened; Insert checks again).
  absl::Status Prepare(const std::string& owner, const RegionOwnership& ownership,
                       const std::string& name);
  void Release(Region* region);
  void Unmap(Region& region);
  // The housekeeping thread: answers waiting Unregister calls and releases idle regions.
  void Housekeep();

  const RegionLimits limits_;
  const RegionHooks hooks_;
  const OpenConnectionsHook open_connections_;
  mutable std::mutex mu_;
  std::condition_variable housekeeping_;                   // a waiter to answer, or a new deadline
  std::map<Key, std::shared_ptr<Region>> regions_;         // guarded by mu_
  int64_t mapped_bytes_ = 0;                               // guarded by mu_
  bool stopping_ = false;                                  // guarded by mu_
  absl::Time housekeeper_wakes_ = absl::InfiniteFuture();  // guarded by mu_: its next wake
  int connection_regions_ = 0;  // guarded by mu_: regions of a connection whose id is known
  std::thread housekeeper_;
};

}  // namespace attention::server
