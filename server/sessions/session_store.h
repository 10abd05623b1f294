// The server's KV-resident sessions: the K/V rows of each session live in pages of a device's
// KvPagePool (kernels/paged_kv.h); this store owns the page allocator, each session's page table,
// ownership by caller token, and expiry after a TTL of idleness.
//
// Memory: each device's pool is a fixed number of pages, allocated once at startup. A session holds
// ceil(max(length, 1) / page_rows) pages (at least one, so creating sessions uses room). Pages are
// reference counted: a fork (Fork) shares its parent's full pages, and a page returns to the free
// list when its last session lets it go (Truncate, Drop, expiry). A page several sessions hold is
// never written: an append whose first row lands in one first copies it (copy on write), so no
// session sees another's new rows. A call that needs more pages than are free is refused
// RESOURCE_EXHAUSTED with the bytes it needs and the bytes free, after the prefix cache's
// unheld pages (below) were counted as room and taken, least recently released first. Idle
// sessions expire after `ttl` (Sweep, called by a sweeper, and a lazy check on every lookup); an
// unknown, expired or dropped id, or the id of another owner, is NOT_FOUND.
//
// Host tier (KvDevice::host_tier, --kv_host_bytes): when a call needs more pages than are free
// (and cached unheld), the pages of cold sessions move to host memory first: sessions no call
// holds or waits for (Lease, Acquire), least recently used first, page by page, only pages no
// other session holds and no prefix block caches (a shared or cached page stays in the pool:
// moving it would take it from sessions that are not cold). Nothing is moved unless the room
// then suffices, so a refused call moves nothing. The pool copies (KvPagePool::SavePages,
// synchronous: the pages are reused only once their bytes are on the host); the session's page
// table holds kOnHost where a page was. Acquire brings a session's pages back before its call
// runs (Step, AppendKv, Truncate, Fork, each chunk of Export), which may in turn move other
// cold sessions out (into the slots it leaves when the host tier is full: its pages then wait in
// plain host memory meanwhile). The copies run under the store's lock, so other calls on the
// store wait for them. RESOURCE_EXHAUSTED names both budgets when neither has the room.
//
// Shapes: a session's V head dim may differ from its QK head dim (KvShape::v_head_dim, MLA models),
// and its V may be K's first Dv features, kept once (KvShape::v_from_k), on a device whose pool
// serves them (KvDevice::v_head_dim); Create refuses them elsewhere by name.
//
// Layers: a session of a model's L layers (Create's `layers`) is L sessions of one shape, device
// and owner: layer 0 under the id callers know, layer l under LayerSessionId(id, l). Each has its
// own pages and length and is held by its own leases, so a model's Step of layer l holds only that
// layer; Drop, expiry (once every layer is idle past the TTL) and the snapshots take the group as
// one (Fork and Truncate of every layer are the caller's, holding every layer's lease).
//
// Shared prefixes: rows whose token ids the caller names (NameTokens) make, page by full page,
// the blocks of each device's PrefixIndex (prefix_index.h; a session of several layers: once
// every layer holds the block, one page a layer). Create's `prefix_tokens` starts a session
// holding the longest chain of those blocks its tokens begin with (of its owner, shape and
// layers): the pages are shared as a fork's, so an append into one copies it first. A cached
// page no session holds any longer stays, unheld, until an allocation needs it (it is never
// written while cached: a session whose append would land in it copies it, as a shared page).
//
// Concurrency: a call holds its sessions through Leases. A lease holds the session's call lock,
// so calls on one session run one at a time (a second call waits; nothing is rejected). A call
// on several sessions (a Step) locks them in one order every call follows (their addresses), so
// two such calls cannot deadlock. Pages of a session dropped while a call holds it are freed when
// the call ends.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/paged_kv.h"
#include "server/sessions/prefix_index.h"

namespace attention::server {

// One device's page pool (its executor's, which outlives the store).
struct KvDevice {
  std::string name;  // "cpu", "cuda:0"
  KvPagePool* pool = nullptr;
  // OK while the device can run work (Executor::Health); a device that fails it gets no new
  // sessions. Empty: always OK.
  std::function<absl::Status()> health;
  // Whether its pool serves sessions whose V head dim is not the QK head dim (its backend lists
  // "v_head_dim" in its step options); Create refuses them elsewhere, UNIMPLEMENTED.
  bool v_head_dim = false;
  // The host tier (see the file comment): pages of cold sessions wait here while the pool is full;
  // host_tier_bytes / page_bytes pages of it (the pool's AllocateHost). Null: none.
  HostBuffer host_tier;
  int64_t host_tier_bytes = 0;
};

// One device's share of the cache, as the store reports it after each change.
struct KvCacheUsage {
  int64_t sessions = 0;
  int64_t resident_bytes = 0;
  int64_t pages_free = 0;
  int64_t pages_total = 0;
  int64_t pages_shared = 0;  // held by more than one session (forks, prefixes), each counted once
  int64_t pages_cached = 0;  // in the prefix index and no session's: free once taken
  int64_t host_bytes_used = 0;  // the host tier's pages holding sessions' rows
  int64_t host_bytes_total = 0;
};

// Pages moved between a device's pool and its host tier by one spill or one session's restore,
// as the store reports them.
struct HostTierMove {
  int64_t spilled_pages = 0;
  int64_t restored_pages = 0;
  double restore_seconds = 0;  // a restore's copy and bookkeeping
};

// One Create's prefix lookup (Create's `prefix_tokens`), as the store reports it: the full
// pages of the prefix found cached and not, and the bytes of the pages it shares instead.
struct PrefixLookup {
  int64_t hit_blocks = 0;
  int64_t missed_blocks = 0;
  int64_t shared_bytes = 0;
};

struct SessionStoreOptions {
  // Idle time after which a session expires.
  absl::Duration ttl = absl::Seconds(600);
  // The server's --replica_name (empty: none), the prefix of every id the store makes.
  std::string replica_name;
  // The time now; tests pass a fake clock.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  // How the store reports, called with its lock held (main.cc points them at the metrics, so
  // this room links no Prometheus); empty: not reported. `count` sessions expired:
  std::function<void(int count)> on_expired;
  // A device's (by name) usage after sessions or pages changed:
  std::function<void(const std::string& device, const KvCacheUsage& usage)> on_usage;
  // A Create with a prefix looked it up on `device`:
  std::function<void(const std::string& device, const PrefixLookup& lookup)> on_prefix;
  // Cached pages `count` taken back for room on `device`:
  std::function<void(const std::string& device, int64_t count)> on_evicted;
  // Pages moved to or from the host tier of `device`:
  std::function<void(const std::string& device, const HostTierMove& move)> on_host_tier;
};

// What ListSessions and SessionInfo report of a session; of a session of several layers, the
// group: its pages summed over the layers, `length` the rows every layer holds.
struct SessionSnapshot {
  std::string id;
  KvShape shape;
  int64_t length = 0;
  int layers = 1;
  std::vector<int64_t> layer_lengths;  // per layer, when there are several
  int64_t pages = 0;
  int64_t shared_pages = 0;    // of `pages`, those other sessions hold too
  int64_t prefix_rows = 0;     // rows its Create found cached (prefix_tokens)
  int64_t resident_bytes = 0;  // of its pages in the pool
  int64_t host_pages = 0;      // of `pages`, those on the host tier
  absl::Duration idle;
  absl::Duration expires_in;
  std::string device;
};

// The cache's room over every device.
struct CacheRoom {
  int64_t page_bytes = 0;
  int64_t pages_total = 0;
  int64_t pages_free = 0;
  int64_t pages_cached = 0;  // prefix pages no session holds: room once taken
};

class SessionStore {
 public:
  struct Session;

  // One call's hold on one session (see the file comment). Movable; releasing it (destruction)
  // marks the session used now.
  class Lease {
   public:
    Lease() = default;
    Lease(SessionStore* store, std::shared_ptr<Session> session)
        : store_(store), session_(std::move(session)) {}
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();

    const std::string& id() const;
    const KvShape& shape() const;
    int device() const;
    // Rows held, and the page table covering them (and any pages reserved beyond them).
    int64_t length() const;
    const std::vector<int32_t>& page_table() const;

   private:
    friend class SessionStore;
    void Release();
    SessionStore* store_ = nullptr;
    std::shared_ptr<Session> session_;
  };

  // `devices` must be non-empty with pools of one page size.
  SessionStore(std::vector<KvDevice> devices, const SessionStoreOptions& options);
  SessionStore(const SessionStore&) = delete;
  SessionStore& operator=(const SessionStore&) = delete;

  int64_t page_bytes() const { return page_bytes_; }
  // Rows per page of `shape`; 0 when a page cannot hold 16 rows of it.
  int64_t PageRowsFor(const KvShape& shape) const;
  const std::string& device_name(int device) const { return devices_[device].name; }
  KvPagePool& pool(int device) { return *devices_[device].pool; }

  // The device in service with the most free pages (expired sessions' pages count as free), where
  // a new session goes; UNAVAILABLE when every device is out of service.
  absl::StatusOr<int> EmptiestDevice();
  // Where a new session of `owner` created from `prefix_tokens` goes: the device in service with
  // the longest cached chain of them, or the emptiest when none holds a block of them.
  absl::StatusOr<int> PrefixDevice(absl::string_view owner, const KvShape& shape, int layers,
                                   absl::Span<const int64_t> prefix_tokens);

  // A new session of `owner` with room for `initial_rows` on `device`, held by the returned lease
  // (write its first rows with Append). With `layers` > 1, that many sessions, empty (layer 0's
  // leased; see the file comment). INVALID_ARGUMENT when a page cannot hold 16 rows of `shape`;
  // RESOURCE_EXHAUSTED when the device lacks the room. `id`: the new session's (an import's,
  // which the caller checked is a session id), ALREADY_EXISTS when a session has it; empty: a new
  // random one. `prefix_tokens` (with no initial rows): the session starts holding every layer's
  // rows of the longest chain of full pages cached on `device` that they begin with (see the
  // file comment; SessionSnapshot::prefix_rows), and needs no new page when it found one.
  absl::StatusOr<Lease> Create(absl::string_view owner, const KvShape& shape, int64_t initial_rows,
                               int device, int layers = 1, absl::string_view id = {},
                               absl::Span<const int64_t> prefix_tokens = {});

  // Where session `id` of `owner` lives and its shape, without holding it (both never change);
  // NOT_FOUND as Acquire. A call uses it to queue its work for the session's device.
  struct Place {
    int device = 0;
    KvShape shape;
    int layers = 1;
  };
  absl::StatusOr<Place> Locate(absl::string_view owner, absl::string_view id);
  // Locate of each of `ids` in turn under one lock of the store (a Step's many sessions): the
  // places of the first ids, up to the first one refused, and that refusal (OK when none was).
  struct Places {
    std::vector<Place> places;
    absl::Status refused;
  };
  Places Locate(absl::string_view owner, absl::Span<const absl::string_view> ids);

  // What a call does with the sessions it holds: changes them or reads rows a new owner may get
  // (kChange: AppendKv, Step, Truncate, Fork), refused on a sealed session; or exports them
  // (kExport), which a sealed session still takes.
  enum class Access { kChange, kExport };

  // Holds the sessions `ids` (distinct) of `owner`, in the order given; waits for calls that hold
  // any of them. NOT_FOUND names the first id that is unknown, expired, dropped or another
  // owner's. With kChange, UNAVAILABLE (SealedError) when one of them is sealed (Seal), nothing
  // held.
  absl::StatusOr<std::vector<Lease>> Acquire(absl::string_view owner,
                                             absl::Span<const absl::string_view> ids,
                                             Access access = Access::kChange);
  // Releases every lease of `leases` under one lock of the store (a Step's many sessions; a
  // lease's own release is this of one), leaving them empty.
  void Release(absl::Span<Lease> leases);

  // Seals the lease's session (one layer; an export seals each) for good: from now on Acquire
  // with kChange refuses it. Held under its lease, so no call that changes it runs after the
  // holder read its rows. A sealed session is about to move and be dropped: nothing unseals it.
  void Seal(Lease& lease);

  // Reserves the pages for appending new_rows[i] rows to leases[i], all or nothing:
  // RESOURCE_EXHAUSTED (bytes needed, bytes free) when a device lacks the room. A page the first
  // new row lands in that other sessions hold too is replaced by a copy of its own first (one
  // pool CopyPages per device; copy on write).
  absl::Status Reserve(absl::Span<Lease* const> leases, absl::Span<const int64_t> new_rows);

  // Writes rows[i] after the last row of leases[i]'s session into pages reserved by Create or
  // Reserve: one pool Write per device for all its sessions (a step's new tokens move together).
  // The sessions' lengths grow only when every write was taken.
  absl::Status Append(absl::Span<Lease* const> leases, absl::Span<const KvRows> rows);
  absl::Status Append(Lease& lease, const KvRows& rows);  // one session

  // The token ids of the last tokens.size() rows of the lease's session, called once the caller
  // knows those rows are the client's (a region read may have shrunk meanwhile): the full pages of
  // rows whose tokens are all known, from its first row on, join the prefix index (see the file
  // comment). INVALID_ARGUMENT naming tokens when the session holds fewer rows.
  absl::Status NameTokens(Lease& lease, absl::Span<const int64_t> tokens);

  // Copies rows [first_row, first_row + rows) of the lease's session out of its pages (shared
  // ones too) into host k and v, BHSD [Hkv, rows, D] and [Hkv, rows, Dv] of its dtype (v null
  // where v_from_k; a session's export, a chunk at a time). INVALID_ARGUMENT naming first_row or
  // rows unless the range is within its length.
  absl::Status Read(const Lease& lease, int64_t first_row, int64_t rows, void* k, void* v);

  // Keeps the first `length` rows of the lease's session and lets the pages beyond them go (freed
  // unless other sessions hold them; at least one page stays). INVALID_ARGUMENT naming `length`
  // unless 0 <= length <= its length.
  absl::Status Truncate(Lease& lease, int64_t length);

  // A new session of the parent's owner, shape and device holding the parent's first `length`
  // rows, held by the returned lease: it shares the parent's pages those rows fill and gets a
  // copy of the page of its last rows when that page is partial (one pool CopyPages; a fork of 0
  // rows gets an empty page). INVALID_ARGUMENT naming `length` unless 0 <= length <= the
  // parent's length; RESOURCE_EXHAUSTED when the device has no page free for the copy.
  // A layer of a session of several: `group` empty forks layer 0 (a new id), else the parent's
  // layer joins the child `group` (the id of layer 0's fork).
  absl::StatusOr<Lease> Fork(Lease& parent, int64_t length, absl::string_view group = {});
  // Fork of every layer of a session (`parents`: a lease on each, in layer order), each holding
  // `length` rows (absent: all of its own): layer 0's fork names the child, the other layers join
  // it. All or nothing: a failure drops what was made.
  absl::StatusOr<Lease> ForkLayers(std::vector<Lease>& parents, std::optional<int64_t> length);

  // Removes a session of `owner` (every layer of one of several); NOT_FOUND as Acquire.
  absl::Status Drop(absl::string_view owner, absl::string_view id);

  // The sessions of `owner` (the server passes "" for every caller when it checks no tokens).
  std::vector<SessionSnapshot> List(absl::string_view owner);
  CacheRoom Room();
  SessionSnapshot Snapshot(const Lease& lease);

  // Expires every idle session past the TTL; returns how many.
  int Sweep();

  // A page table's entry for a page on the host tier (Session::host_slots says where).
  static constexpr int32_t kOnHost = -1;

 private:
  struct DeviceState {
    explicit DeviceState(int64_t pages) : refs(pages, 0), prefixes(pages) {}
    std::vector<int32_t> free_pages;  // a stack
    std::vector<int32_t> refs;        // per page: the sessions holding it (0: free or cached)
    int64_t sessions = 0;
    int64_t shared_pages = 0;  // pages more than one session holds (refs > 1)
    PrefixIndex prefixes;
    std::vector<int32_t> free_slots;  // of the host tier, a stack (page_bytes each)
    int64_t host_slots = 0;
  };

  // Calls fn(layer) for each layer of `session`'s group still in the store, in layer order (for a
  // session of one layer, itself, looked up by its id with no new string).
  template <typename Fn>
  void ForEachLayerLocked(const Session& session, Fn fn) const;
  // The session `id` of `owner` that has not expired by `now`, or null (expiring it if it just
  // did).
  std::shared_ptr<Session> FindLocked(absl::string_view owner, absl::string_view id,
                                      absl::Time now);
  bool ExpiredLocked(const Session& session, absl::Time now) const;
  absl::StatusOr<Place> LocateLocked(absl::string_view owner, absl::string_view id, absl::Time now);
  void RemoveLocked(const std::shared_ptr<Session>& session);
  void FreePagesLocked(Session& session);
  // Pages free or cached unheld (taken back when no page is free).
  static int64_t RoomLocked(const DeviceState& state);
  // Moves pages of cold sessions of `device` to its host tier (the file comment) until
  // RoomLocked is at least `needed`; moves none when it cannot reach that.
  absl::Status MakeRoomLocked(int device, int64_t needed);
  // Brings the lease's session's pages on the host tier back into the pool.
  absl::Status RestoreLocked(Session& session);
  // The budgets a RESOURCE_EXHAUSTED names: the pool's bytes and the host tier's.
  std::string BudgetsLocked(int device) const;
  unsigned char* SlotLocked(int device, int32_t slot) const;
  // A free page of `device`, now held once, after taking back the least recently released cached
  // pages when none is free; the caller checked RoomLocked.
  int32_t TakePageLocked(int device);
  // One more hold on `page`; one less, the last one freeing it unless it is cached.
  static void HoldPageLocked(DeviceState& state, int32_t page);
  static void DropPageLocked(DeviceState& state, int32_t page);
  // The full pages of `session`'s rows of known tokens not yet in its device's prefix index join
  // it (of a session of several layers, each block once every layer holds it).
  void CachePrefixLocked(Session& session);
  // The chain of cached blocks of `scope` that `tokens` begin with on `state`.
  static std::vector<uint64_t> MatchLocked(const DeviceState& state, absl::string_view scope,
                                           int64_t page_rows, absl::Span<const int64_t> tokens);
  int SweepLocked(absl::Time now);
  SessionSnapshot SnapshotLocked(const Session& session, absl::Time now) const;
  void PublishLocked();
  absl::Status NotFound(absl::string_view id) const;
  // NOT_FOUND for a session `owner` does not hold here, or the sealed refusal when it was moved
  // away (moved_).
  absl::Status MissingLocked(absl::string_view owner, absl::string_view id) const;

  const SessionStoreOptions options_;
  std::vector<KvDevice> devices_;
  int64_t page_bytes_ = 0;

  std::mutex mu_;
  std::vector<DeviceState> device_states_;  // guarded by mu_
  // By id; guarded by mu_. Hashed: a Step looks up each of its sessions twice (Locate, Acquire).
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_;
  // Sessions dropped while sealed, i.e. moved to another replica by a drain (owner '\n' id): a
  // call naming one that still reaches this replica (over a stream or ring opened here before
  // the router's switch) is refused as sealed, which clients retry where the router sends it
  // now, rather than NOT_FOUND. The last kMovedKept; an id created here again is forgotten.
  static constexpr size_t kMovedKept = 1 << 16;
  std::set<std::string, std::less<>> moved_;  // guarded by mu_
  std::deque<std::string> moved_order_;       // oldest first; guarded by mu_
};

// A session's state. Writes to page_table and length hold both mu_ and call_mu; reads hold
// either. (A move to the host tier writes page_table and host_slots under mu_ alone: only of a
// session no lease holds or waits for, which no call can lock without taking mu_ first.) The rest
// (last_used, users, dropped) is guarded by the store's mu_.
struct SessionStore::Session {
  std::string id;
  std::string owner;
  KvShape shape;
  int device = 0;
  int64_t page_rows = 0;
  // Of a session of several layers (the file comment): layer 0's id, their count, this one's.
  std::string group;
  int layers = 1;
  int layer = 0;

  std::mutex call_mu;               // held by the call that holds a lease on it
  std::vector<int32_t> page_table;  // kOnHost where a page is on the host tier
  // Beside page_table while some of its pages are on the host tier: each one's slot there (-1
  // for a page in the pool); empty when every page is in the pool.
  std::vector<int32_t> host_slots;
  int64_t length = 0;
  bool sealed = false;  // (Seal) written and read holding call_mu

  absl::Time last_used;
  int users = 0;  // leases on it, held or waiting
  bool dropped = false;

  // Its prefix (guarded by mu_): the chain's scope (owner, shape, layers: PrefixScope), the token
  // of each of its first rows (the rows appended with tokens, from row 0 on, none after a row of
  // unknown token), the index's block of each full page of them, and the rows Create found.
  std::string scope;
  std::vector<int64_t> tokens;
  std::vector<uint64_t> chain;
  int64_t prefix_rows = 0;
};

// 32 lower-case hex digits from 128 bits of the kernel's CSPRNG (getrandom), after
// `replica_name` and a '.' when the server has one (--replica_name): the id names its owner, so a
// router in front of several replicas sends the session's calls to it (the clients send the part
// before the first '.' as the attention-session-owner header).
absl::StatusOr<std::string> NewSessionId(absl::string_view replica_name);

// The message of a call refused because session `id` is sealed (SessionStore::Seal): UNAVAILABLE,
// beginning with kSealedMarker, which clients look for to retry (the router sends the retry to
// the session's new owner; docs/API.md).
inline constexpr absl::string_view kSealedMarker = "session sealed: ";
absl::Status SealedError(absl::string_view id);

// The store's id of layer `layer` of session `id` (layer 0: `id` itself). Callers never send
// these: a session id with a '/' names no session of theirs.
std::string LayerSessionId(absl::string_view id, int layer);
// Appends LayerSessionId(id, layer) (layer >= 0) to `out`, at most id.size() + kLayerSuffixBytes
// bytes: a Step's many ids in one buffer.
void AppendLayerSessionId(std::string* out, absl::string_view id, int layer);
inline constexpr size_t kLayerSuffixBytes = 11;  // '/' and up to 10 digits

template <typename Fn>
void SessionStore::ForEachLayerLocked(const Session& session, Fn fn) const {
  for (int layer = 0; layer < session.layers; ++layer) {
    auto it = session.layers == 1 ? sessions_.find(session.id)
                                  : sessions_.find(LayerSessionId(session.group, layer));
    if (it != sessions_.end()) fn(it->second);
  }
}

}  // namespace attention::server
