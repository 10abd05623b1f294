#include "server/regions/region_registry.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/quote.h"
#include "server/regions/shrink_guard.h"

namespace attention::server {

// One registered region. `uses`, `last_used` and `waiters` are guarded by the registry's mu_; the
// rest is fixed once inserted, but `shrunk`.
struct RegionRegistry::Use::Region {
  RegionDescription description;
  void* map_base = nullptr;  // system: the mapping (page-aligned); cuda: the IPC base pointer
  size_t map_bytes = 0;      // system: the mapping's length
  char* data = nullptr;      // the region's first byte
  int fd = -1;               // system: the object, open while mapped (its size is checked)
  int guard = -1;            // system: the mapping's slot in shrink_guard
  // System: the object was seen smaller than the region, or an access to the mapping faulted
  // (shrink_guard put zero pages there). The mapping no longer holds the object's bytes (and a
  // pinned one's pages may be the object's old ones): no request may use it from then on.
  std::atomic<bool> shrunk{false};
  RegionOwnership ownership;
  // A connection whose id is known: released once it is no longer open.
  bool by_known_connection() const { return ownership.by_connection && ownership.connection >= 0; }
  int uses = 0;
  absl::Time last_used;  // registered, or the last Use taken or dropped
  // Unregister calls waiting for the last Use: no new Use while any is.
  struct Waiter {
    absl::Time deadline;
    absl::AnyInvocable<void(absl::Status) &&> done;
  };
  std::vector<Waiter> waiters;

  absl::Status Intact(absl::string_view field);
};

// OK while a system region's mapping still holds its object's bytes; else FAILED_PRECONDITION
// for `field` (a reference, or the request that used the region), naming the region, the
// object's size now and the bytes of it the region was registered as. Sets `shrunk` once seen.
absl::Status RegionRegistry::Use::Region::Intact(absl::string_view field) {
  const RegionDescription& d = description;
  if (d.kind != RegionKind::kSystem) return absl::OkStatus();
  struct stat st;
  const int64_t size = fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
  const bool faulted = MappingShrunk(guard);
  if (!faulted && size >= d.offset + d.byte_size && !shrunk.load()) {
    return absl::OkStatus();
  }
  shrunk.store(true);
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": region ", Quote(d.name), " was registered as bytes [", d.offset, ", ",
      d.offset + d.byte_size, ") (", d.byte_size, " bytes) of ", Quote(d.key), ", which holds ",
      size, " bytes now",
      faulted ? " (an access past the object's end faulted: it shrank, or /dev/shm had no room "
                "for a page)"
              : "",
      "; its client shrank it after registering, so the region serves no more requests: "
      "unregister it and register it again"));
}

absl::StatusOr<RegionSpan> RegionRegistry::Use::SpanOf(const Region& region,
                                                       absl::string_view field, int64_t offset,
                                                       int64_t byte_size, int64_t alignment) {
  const RegionDescription& d = region.description;
  if (offset < 0 || byte_size < 0 || offset > d.byte_size || byte_size > d.byte_size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected bytes inside region ", Quote(d.name), " of ", d.byte_size,
                     " bytes, got offset ", offset, " and byte_size ", byte_size));
  }
  if (alignment > 1 &&
      reinterpret_cast<uintptr_t>(region.data + offset) % static_cast<uintptr_t>(alignment) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".offset: expected the tensor to start on a multiple of ", alignment,
                     " bytes (its element size), got offset ", offset, " into region ",
                     Quote(d.name), " (which starts at byte ", d.offset, " of its object)"));
  }
  return RegionSpan{
      .data = region.data + offset, .size = byte_size, .kind = d.kind, .device = d.device};
}

namespace {

// How often the open connections are asked for while regions of known connections exist.
constexpr absl::Duration kConnectionCheck = absl::Seconds(1);
constexpr size_t kMaxRegionName = 256;
// cudaIpcMemHandle_t is 64 bytes (CUDA_IPC_HANDLE_SIZE); this room holds no CUDA header.
constexpr size_t kCudaIpcHandleBytes = 64;

absl::Status CheckName(const std::string& name) {
  if (name.empty() || name.size() > kMaxRegionName) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: expected 1..", kMaxRegionName, " characters, got ", name.size()));
  }
  return absl::OkStatus();
}

// A POSIX shared-memory name: "/" then 1..NAME_MAX - 1 characters, none a "/" or a control
// character, and not "." or "..". Never a path: shm_open resolves it inside the shm filesystem.
absl::Status CheckSystemKey(const std::string& key) {
  const auto refuse = [&key](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "system_key: expected a POSIX shared-memory name (\"/name\", no other \"/\"), ", why,
        ", got ", Quote(key)));
  };
  if (key.size() < 2 || key[0] != '/') return refuse("starting with one \"/\"");
  if (key.size() > NAME_MAX) return refuse(absl::StrCat("at most ", NAME_MAX, " characters"));
  const std::string rest = key.substr(1);
  if (rest == "." || rest == "..") return refuse("not \".\" or \"..\"");
  for (char c : rest) {
    if (c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return refuse("no \"/\" or control characters after the first");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRange(int64_t offset, int64_t byte_size) {
  if (offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset: expected >= 0, got ", offset));
  }
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size: expected > 0, got ", byte_size));
  }
  int64_t end = 0;
  if (__builtin_add_overflow(offset, byte_size, &end)) {
    return absl::InvalidArgumentError("offset + byte_size: expected to fit int64, overflows");
  }
  return absl::OkStatus();
}

}  // namespace

RegionRegistry::Use::~Use() {
  if (registry_ != nullptr && region_ != nullptr) registry_->Release(region_.get());
}

RegionRegistry::RegionRegistry(const RegionLimits& limits, RegionHooks hooks,
                               OpenConnectionsHook open_connections)
    : limits_(limits),
      hooks_(std::move(hooks)),
      open_connections_(std::move(open_connections)),
      housekeeper_([this] { Housekeep(); }) {}

RegionRegistry::~RegionRegistry() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  housekeeping_.notify_all();
  housekeeper_.join();
  for (auto& [key, region] : regions_) Unmap(*region);
}

absl::Status RegionRegistry::CheckRoomLocked(const std::string& owner, const std::string& name,
                                             int64_t bytes) const {
  if (regions_.count({owner, name}) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: a region ", Quote(name),
                                                 " is registered already; unregister it first"));
  }
  int owned = 0;
  for (auto it = regions_.lower_bound({owner, ""});
       it != regions_.end() && it->first.first == owner; ++it) {
    ++owned;
  }
  if (owned >= limits_.max_regions_per_owner) {
    return absl::ResourceExhaustedError(
        absl::StrCat("regions: this caller holds ", owned, ", the limit is ",
                     limits_.max_regions_per_owner, " (--max_shared_memory_regions)"));
  }
  // No sum in the text: mapped + bytes may pass int64 (--max_shared_memory_bytes up to its max).
  if (bytes > limits_.max_mapped_bytes - mapped_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "byte_size: ", bytes, " bytes more would pass the limit of ", limits_.max_mapped_bytes,
        " bytes mapped (--max_shared_memory_bytes), of which ", mapped_bytes_,
        " are mapped already"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionDescription> RegionRegistry::Insert(const std::string& owner,
                                                         std::shared_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  const RegionDescription& d = region->description;
  if (absl::Status room = CheckRoomLocked(owner, d.name, d.byte_size); !room.ok()) {
    Unmap(*region);
    return room;
  }
  mapped_bytes_ += d.byte_size;
  region->last_used = absl::Now();
  regions_[{owner, d.name}] = region;
  if (region->by_known_connection()) ++connection_regions_;
  if (region->ownership.by_connection) housekeeping_.notify_all();  // its idle end, its checks
  return d;
}

std::vector<std::shared_ptr<RegionRegistry::Region>> RegionRegistry::TakeStaleLocked(
    const std::string& owner, const RegionOwnership& ownership) {
  std::vector<std::shared_ptr<Region>> stale;
  if (!ownership.by_connection || ownership.connection < 0) return stale;
  for (auto it = regions_.lower_bound({owner, ""});
       it != regions_.end() && it->first.first == owner;) {
    const Region& region = *it->second;
    if (region.by_known_connection() && region.ownership.connection != ownership.connection &&
        region.uses == 0 && region.waiters.empty()) {
      stale.push_back(RemoveLocked(it++));
    } else {
      ++it;
    }
  }
  return stale;
}

absl::Status RegionRegistry::Prepare(const std::string& owner, const RegionOwnership& ownership,
                                     const std::string& name) {
  std::vector<std::shared_ptr<Region>> stale;
  absl::Status room;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale = TakeStaleLocked(owner, ownership);
    room = CheckRoomLocked(owner, name, 0);
  }
  for (const std::shared_ptr<Region>& region : stale) Unmap(*region);
  return room;
}

absl::StatusOr<RegionDescription> RegionRegistry::RegisterSystem(
    const std::string& owner, const RegionOwnership& ownership, const std::string& name,
    const std::string& key, int64_t offset, int64_t byte_size) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (absl::Status s = CheckSystemKey(key); !s.ok()) return s;
  if (absl::Status s = CheckRange(offset, byte_size); !s.ok()) return s;
  // The bytes are checked after the object's size, so a size beyond the object is
  // INVALID_ARGUMENT whatever the limit.
  if (absl::Status room = Prepare(owner, ownership, name); !room.ok()) return room;
  // Never O_CREAT: the client made the object; the server only maps what exists.
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("system_key: shm_open(", Quote(key), "): ", strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    if (err == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("system_key: ", Quote(key), " is not a shared-memory object"));
  }
  // The server may open objects its clients may not (another user's, readable by the server's
  // user or by root): a client learning such a name must not reach its bytes through us. The
  // caller's own uid is not known over TCP, so the object must be the server's user's.
  if (!limits_.allow_foreign && st.st_uid != geteuid()) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "system_key: ", Quote(key), " belongs to uid ", st.st_uid, ", expected the server's uid ",
        geteuid(), " (another user's objects are refused; --allow_foreign_regions allows them)"));
  }
  if (offset + byte_size > static_cast<int64_t>(st.st_size)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: expected offset + byte_size <= the object's ", st.st_size,
                     " bytes, got ", offset, " + ", byte_size));
  }
  {
    // The bytes, before anything is mapped or pinned.
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status room = CheckRoomLocked(owner, name, byte_size); !room.ok()) {
      close(fd);
      return room;
    }
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = offset / page * page;
  const size_t map_bytes = static_cast<size_t>(offset + byte_size - map_offset);
  void* base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    static_cast<off_t>(map_offset));
  const int map_errno = errno;
  if (base == MAP_FAILED) {
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", map_bytes, " bytes of ", Quote(key), ": ", strerror(map_errno)));
  }
  // Guarded before anything touches it (pinning does): a shrink from here on cannot kill us.
  const int guard = GuardMapping(base, map_bytes);
  if (guard < 0) {
    munmap(base, map_bytes);
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("system_key: the server guards at most ", kMaxGuardedMappings,
                     " system regions at once (over every caller); unregister some first"));
  }
  auto region = std::make_shared<Region>();
  region->description = RegionDescription{.name = name,
                                          .kind = RegionKind::kSystem,
                                          .key = key,
                                          .offset = offset,
                                          .byte_size = byte_size};
  region->map_base = base;
  region->map_bytes = map_bytes;
  region->data = static_cast<char*>(base) + (offset - map_offset);
  region->fd = fd;  // kept: each reference checks the object's size
  region->guard = guard;
  region->ownership = ownership;
  if (hooks_.pin_host) region->description.pinned = hooks_.pin_host(base, map_bytes);
  return Insert(owner, std::move(region));
}

absl::StatusOr<RegionDescription> RegionRegistry::RegisterCuda(
    const std::string& owner, const RegionOwnership& ownership, const std::string& name,
    const std::string& handle, int device, int64_t offset, int64_t byte_size) {
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (!hooks_.open_cuda) {
    return absl::UnimplementedError(
        "cuda_ipc_handle: CUDA regions need the cuda backend; this server runs without one");
  }
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc_handle: expected ", kCudaIpcHandleBytes,
                     " bytes (a cudaIpcMemHandle_t), got ", handle.size()));
  }
  if (absl::Status s = CheckRange(offset, byte_size); !s.ok()) return s;
  // As RegisterSystem: the bytes are checked (in Insert) after the allocation's size.
  if (absl::Status room = Prepare(owner, ownership, name); !room.ok()) return room;
  absl::StatusOr<std::pair<void*, int64_t>> opened = hooks_.open_cuda(handle, device);
  if (!opened.ok()) return opened.status();
  auto region = std::make_shared<Region>();
  region->description = RegionDescription{.name = name,
                                          .kind = RegionKind::kCuda,
                                          .device = device,
                                          .offset = offset,
                                          .byte_size = byte_size};
  region->map_base = opened->first;
  region->data = static_cast<char*>(opened->first) + offset;
  region->ownership = ownership;
  if (offset + byte_size > opened->second) {
    Unmap(*region);
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: expected offset + byte_size <= the allocation's ", opened->second,
                     " bytes, got ", offset, " + ", byte_size));
  }
  return Insert(owner, std::move(region));
}

std::shared_ptr<RegionRegistry::Region> RegionRegistry::RemoveLocked(
    std::map<Key, std::shared_ptr<Region>>::iterator it) {
  std::shared_ptr<Region> region = std::move(it->second);
  regions_.erase(it);
  mapped_bytes_ -= region->description.byte_size;
  if (region->by_known_connection()) --connection_regions_;
  return region;
}

void RegionRegistry::Unregister(const std::string& owner, const std::string& name,
                                absl::Time deadline,
                                absl::AnyInvocable<void(absl::Status) &&> done) {
  std::shared_ptr<Region> removed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({owner, name});
    if (it != regions_.end() && it->second->uses > 0) {
      // The housekeeper answers it: at the last Use (Release wakes it) or at `deadline`.
      it->second->waiters.push_back({.deadline = deadline, .done = std::move(done)});
      housekeeping_.notify_all();
      return;
    }
    if (it != regions_.end()) removed = RemoveLocked(it);
  }
  if (removed == nullptr) {
    return std::move(done)(
        absl::NotFoundError(absl::StrCat("name: no region ", Quote(name), " of this caller")));
  }
  Unmap(*removed);
  std::move(done)(absl::OkStatus());
}

void RegionRegistry::Housekeep() {
  std::unique_lock<std::mutex> lock(mu_);
  absl::Time next_check = absl::InfinitePast();  // of the open connections
  while (!stopping_) {
    // The open connections, asked off the lock; a region used or registered since may belong to
    // a connection newer than the answer, so only regions idle since are judged by it.
    std::optional<absl::flat_hash_set<int64_t>> open;
    absl::Time asked = absl::InfinitePast();
    if (open_connections_ && connection_regions_ > 0 && absl::Now() >= next_check) {
      lock.unlock();
      asked = absl::Now();
      open = open_connections_();
      lock.lock();
      next_check = asked + kConnectionCheck;
      if (stopping_) break;
    }
    const absl::Time now = absl::Now();
    // The next deadline, idle end or check of the open connections.
    absl::Time next =
        connection_regions_ > 0 && open_connections_ ? next_check : absl::InfiniteFuture();
    std::vector<std::shared_ptr<Region>> removed;
    std::vector<std::pair<Region::Waiter, absl::Status>> answers;
    for (auto it = regions_.begin(); it != regions_.end();) {
      Region& region = *it->second;
      const bool closed = open.has_value() && region.by_known_connection() &&
                          region.last_used < asked && !open->contains(region.ownership.connection);
      if (region.uses == 0 &&
          (!region.waiters.empty() || closed ||
           (region.ownership.by_connection && now - region.last_used >= limits_.idle_timeout))) {
        for (Region::Waiter& waiter : region.waiters) {
          answers.emplace_back(std::move(waiter), absl::OkStatus());
        }
        region.waiters.clear();
        removed.push_back(RemoveLocked(it++));
        continue;
      }
      // Still used: the waiters whose deadline passed give up; the region stays.
      for (auto w = region.waiters.begin(); w != region.waiters.end();) {
        if (w->deadline > now) {
          next = std::min(next, w->deadline);
          ++w;
          continue;
        }
        answers.emplace_back(std::move(*w),
                             absl::DeadlineExceededError(absl::StrCat(
                                 "region ", Quote(region.description.name), " is still used by ",
                                 region.uses, " running requests; it stays registered")));
        w = region.waiters.erase(w);
      }
      if (region.ownership.by_connection && region.uses == 0) {
        next = std::min(next, region.last_used + limits_.idle_timeout);
      }
      ++it;
    }
    if (!removed.empty() || !answers.empty()) {
      // Unmapped and answered off the lock: unpinning may take a while, and an answer ends a call.
      lock.unlock();
      for (const std::shared_ptr<Region>& region : removed) Unmap(*region);
      removed.clear();
      for (auto& [waiter, status] : answers) std::move(waiter.done)(std::move(status));
      answers.clear();
      lock.lock();
      continue;
    }
    housekeeper_wakes_ = next;
    housekeeping_.wait_until(lock, absl::ToChronoTime(next));
  }
}

std::vector<RegionDescription> RegionRegistry::List(const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RegionDescription> out;
  for (auto it = regions_.lower_bound({owner, ""});
       it != regions_.end() && it->first.first == owner; ++it) {
    out.push_back(it->second->description);
  }
  return out;
}

absl::StatusOr<RegionSpan> RegionRegistry::Resolve(const std::string& owner,
                                                   absl::string_view field,
                                                   const std::string& region_name, int64_t offset,
                                                   int64_t byte_size, int64_t alignment,
                                                   std::vector<Use>* uses) {
  std::shared_ptr<Region> region;
  absl::StatusOr<RegionSpan> span;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({owner, region_name});
    // Another caller's region answers as an unknown one: names are not disclosed.
    if (it == regions_.end() || !it->second->waiters.empty()) {
      return absl::NotFoundError(absl::StrCat(field, ".region: no region ", Quote(region_name),
                                              " registered by this caller"));
    }
    region = it->second;
    span = Use::SpanOf(*region, field, offset, byte_size, alignment);
    if (!span.ok()) return span.status();
    ++region->uses;
    region->last_used = absl::Now();
  }
  // Held from here (so mapped, its fd open) while its object's size is checked, off the lock.
  Use use(this, region);
  if (absl::Status intact = region->Intact(field); !intact.ok()) return intact;
  uses->push_back(std::move(use));
  return span;
}

absl::StatusOr<RegionSpan> RegionRegistry::Use::Span(absl::string_view field, int64_t offset,
                                                     int64_t byte_size, int64_t alignment) const {
  return SpanOf(*region_, field, offset, byte_size, alignment);
}

const std::string& RegionRegistry::Use::name() const { return region_->description.name; }

int64_t RegionRegistry::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_bytes_;
}

void RegionRegistry::Release(Region* region) {
  std::lock_guard<std::mutex> lock(mu_);
  region->last_used = absl::Now();
  if (--region->uses > 0) return;
  // The last Use of a region Unregister waits for: the housekeeper removes it and answers. Of
  // a connection's: its idle end, if the housekeeper would sleep past it (it sleeps until the
  // earliest end it knows, so a region in steady use wakes nobody).
  if (!region->waiters.empty() || (region->ownership.by_connection &&
                                   region->last_used + limits_.idle_timeout < housekeeper_wakes_)) {
    housekeeping_.notify_all();
  }
}

absl::Status RegionRegistry::Use::Intact() const {
  return region_->Intact("the request's tensors by reference");
}

void RegionRegistry::Unmap(Region& region) {
  if (region.description.kind == RegionKind::kSystem) {
    if (region.description.pinned && hooks_.unpin_host) hooks_.unpin_host(region.map_base);
    UnguardMapping(region.guard);  // before munmap: the address range may be reused
    munmap(region.map_base, region.map_bytes);
    close(region.fd);
  } else if (hooks_.close_cuda) {
    hooks_.close_cuda(region.map_base, region.description.device);
  }
  region.map_base = nullptr;
}

}  // namespace attention::server
