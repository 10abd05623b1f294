#include "server/sessions/session_store.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/quote.h"
#include "kernels/status_macros.h"
#include "server/metrics/metrics.h"

namespace attention::server {
namespace {

constexpr int kIdBytes = 16;  // 128 bits

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Pages a session of `rows` rows holds: at least one.
int64_t PagesFor(int64_t rows, int64_t page_rows) {
  return std::max<int64_t>(1, CeilDiv(rows, page_rows));
}

// What a chain's first block is keyed by besides its tokens: sessions of one owner (tenants never
// share), shape (both head dims, and whether V lies in K's rows: a page's rows hold K of D and V
// of Dv) and layer count (a block holds one page a layer). The owner's length first, so no owner's
// bytes read as another's followed by a shape.
std::string PrefixScope(absl::string_view owner, const KvShape& shape, int layers) {
  return absl::StrCat(owner.size(), ":", owner, "/", DTypeName(shape.dtype), "/", shape.heads_kv,
                      "/", shape.head_dim, "/", shape.value_head_dim(), shape.v_from_k ? "k" : "",
                      "/", layers);
}

// A session's key in SessionStore::moved_: its owner, a '\n' and its id.
std::string MovedKey(absl::string_view owner, absl::string_view id) {
  return absl::StrCat(owner, "\n", id);
}

}  // namespace

absl::StatusOr<std::string> NewSessionId(absl::string_view replica_name) {
  char bytes[kIdBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  std::string hex = absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
  return replica_name.empty() ? hex : absl::StrCat(replica_name, ".", hex);
}

std::string LayerSessionId(absl::string_view id, int layer) {
  std::string out;
  AppendLayerSessionId(&out, id, layer);
  return out;
}

void AppendLayerSessionId(std::string* out, absl::string_view id, int layer) {
  if (layer == 0) {
    out->append(id.data(), id.size());
  } else {
    absl::StrAppend(out, id, "/", layer);
  }
}

SessionStore::Lease& SessionStore::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = other.store_;
    session_ = std::move(other.session_);
  }
  return *this;
}

SessionStore::Lease::~Lease() { Release(); }

void SessionStore::Lease::Release() {
  if (session_ != nullptr) store_->Release(absl::MakeSpan(this, 1));
}

void SessionStore::Release(absl::Span<Lease> leases) {
  for (Lease& lease : leases) {
    if (lease.session_ != nullptr) lease.session_->call_mu.unlock();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = options_.clock();
    bool freed = false;
    for (Lease& lease : leases) {
      if (lease.session_ == nullptr) continue;
      Session& session = *lease.session_;
      --session.users;
      session.last_used = now;
      if (session.dropped && session.users == 0) {
        FreePagesLocked(session);
        freed = true;
      }
    }
    if (freed) PublishLocked();
  }
  // Outside the lock, as a lease's own release: the last reference frees the session.
  for (Lease& lease : leases) lease.session_.reset();
}

const std::string& SessionStore::Lease::id() const { return session_->id; }
const KvShape& SessionStore::Lease::shape() const { return session_->shape; }
int SessionStore::Lease::device() const { return session_->device; }
int64_t SessionStore::Lease::length() const { return session_->length; }
const std::vector<int32_t>& SessionStore::Lease::page_table() const { return session_->page_table; }

SessionStore::SessionStore(std::vector<KvDevice> devices, const SessionStoreOptions& options)
    : options_(options), devices_(std::move(devices)) {
  page_bytes_ = devices_.front().pool->page_bytes();
  device_states_.reserve(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    const int64_t pages = devices_[d].pool->num_pages();
    std::vector<int32_t>& free_pages = device_states_.emplace_back(pages).free_pages;
    free_pages.reserve(pages);
    // A stack: page 0 is handed out first.
    for (int64_t p = pages - 1; p >= 0; --p) free_pages.push_back(static_cast<int32_t>(p));
    DeviceState& state = device_states_.back();
    if (devices_[d].host_tier != nullptr)
      state.host_slots = devices_[d].host_tier_bytes / page_bytes_;
    // A stack as well: slot 0 first, so pages moved together take consecutive slots.
    for (int64_t slot = state.host_slots - 1; slot >= 0; --slot) {
      state.free_slots.push_back(static_cast<int32_t>(slot));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  PublishLocked();
}

int64_t SessionStore::PageRowsFor(const KvShape& shape) const {
  return PageRows(page_bytes_, shape);
}

absl::Status SessionStore::NotFound(absl::string_view id) const {
  return absl::NotFoundError(
      absl::StrCat("session ", Quote(id), " not found: unknown, dropped, or expired after ",
                   absl::FormatDuration(options_.ttl),
                   " idle (sessions are also lost when the server restarts); create it again"));
}

absl::Status SessionStore::MissingLocked(absl::string_view owner, absl::string_view id) const {
  return moved_.contains(MovedKey(owner, id)) ? SealedError(id) : NotFound(id);
}

absl::Status SealedError(absl::string_view id) {
  return absl::UnavailableError(absl::StrCat(
      kSealedMarker, "session ", Quote(id),
      " was sealed by an Export for a move to another replica; retry: the router sends the call "
      "to its new owner"));
}

absl::StatusOr<int> SessionStore::EmptiestDevice() {
  // Before the store's lock: a health check may probe the device.
  std::vector<bool> usable(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) {
    usable[d] = !devices_[d].health || devices_[d].health().ok();
  }
  std::lock_guard<std::mutex> lock(mu_);
  SweepLocked(options_.clock());
  int device = -1;
  for (size_t d = 0; d < device_states_.size(); ++d) {
    if (usable[d] &&
        (device < 0 || RoomLocked(device_states_[d]) > RoomLocked(device_states_[device]))) {
      device = static_cast<int>(d);
    }
  }
  if (device < 0) {
    return absl::UnavailableError("every device is out of service; the server needs a restart");
  }
  return device;
}

absl::StatusOr<int> SessionStore::PrefixDevice(absl::string_view owner, const KvShape& shape,
                                               int layers,
                                               absl::Span<const int64_t> prefix_tokens) {
  const int64_t page_rows = PageRowsFor(shape);
  if (page_rows > 0 && static_cast<int64_t>(prefix_tokens.size()) >= page_rows) {
    const std::string scope = PrefixScope(owner, shape, layers);
    int device = -1;
    size_t longest = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t d = 0; d < device_states_.size(); ++d) {
        const size_t found = MatchLocked(device_states_[d], scope, page_rows, prefix_tokens).size();
        if (found > longest) {
          longest = found;
          device = static_cast<int>(d);
        }
      }
    }
    // Outside the store's lock, as EmptiestDevice: the check may probe the device.
    if (device >= 0 && (!devices_[device].health || devices_[device].health().ok())) {
      return device;
    }
  }
  return EmptiestDevice();
}

std::vector<uint64_t> SessionStore::MatchLocked(const DeviceState& state, absl::string_view scope,
                                                int64_t page_rows,
                                                absl::Span<const int64_t> tokens) {
  std::vector<uint64_t> chain;
  uint64_t parent = 0;
  for (size_t first = 0; first + page_rows <= tokens.size(); first += page_rows) {
    parent = state.prefixes.Find(parent, scope, tokens.subspan(first, page_rows));
    if (parent == 0) break;
    chain.push_back(parent);
  }
  return chain;
}

absl::StatusOr<SessionStore::Place> SessionStore::LocateLocked(absl::string_view owner,
                                                               absl::string_view id,
                                                               absl::Time now) {
  // A layer's own id is the store's, not a caller's (LayerSessionId).
  if (absl::StrContains(id, '/')) return NotFound(id);
  std::shared_ptr<Session> session = FindLocked(owner, id, now);
  if (session == nullptr) return MissingLocked(owner, id);
  return Place{.device = session->device, .shape = session->shape, .layers = session->layers};
}

absl::StatusOr<SessionStore::Place> SessionStore::Locate(absl::string_view owner,
                                                         absl::string_view id) {
  std::lock_guard<std::mutex> lock(mu_);
  return LocateLocked(owner, id, options_.clock());
}

SessionStore::Places SessionStore::Locate(absl::string_view owner,
                                          absl::Span<const absl::string_view> ids) {
  Places out;
  out.places.reserve(ids.size());
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = options_.clock();
  for (absl::string_view id : ids) {
    absl::StatusOr<Place> place = LocateLocked(owner, id, now);
    if (!place.ok()) {
      out.refused = std::move(place).status();
      break;
    }
    out.places.push_back(*std::move(place));
  }
  return out;
}

absl::StatusOr<SessionStore::Lease> SessionStore::Create(absl::string_view owner,
                                                         const KvShape& shape, int64_t initial_rows,
                                                         int device, int layers,
                                                         absl::string_view id,
                                                         absl::Span<const int64_t> prefix_tokens) {
  const int64_t page_rows = PageRowsFor(shape);
  if (page_rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_heads * (head_dim + v_head_dim): expected a shape of which a ", page_bytes_,
        "-byte page (--kv_page_bytes) holds at least 16 rows of K and V, got kv_heads ",
        shape.heads_kv, " * (head_dim ", shape.head_dim, " + v_head_dim ",
        shape.v_from_k ? 0 : shape.value_head_dim(), shape.v_from_k ? ", v in k" : "", ") of ",
        DTypeName(shape.dtype)));
  }
  if (initial_rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("k.shape: expected at most 2147483647 rows per session, got ", initial_rows));
  }
  if (device < 0 || device >= static_cast<int>(devices_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected 0..", devices_.size() - 1, ", got ", device));
  }
  if (shape.value_head_dim() != shape.head_dim && !devices_[device].v_head_dim) {
    return absl::UnimplementedError(absl::StrCat(
        "v_head_dim: expected ", shape.head_dim, " (head_dim) for a session on ",
        devices_[device].name, ", whose kernels read V rows of the QK head dim, got ",
        shape.value_head_dim(), " (the CPU and CUDA backends serve a V head dim of its own)"));
  }
  if (shape.v_from_k && !devices_[device].v_head_dim) {
    return absl::UnimplementedError(absl::StrCat(
        "v_from_k: not served on ", devices_[device].name,
        ", whose kernels read V rows apart from K's (the CPU and CUDA backends serve it)"));
  }
  if (layers < 1 || (layers > 1 && initial_rows > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: expected 1 or more, and a session of several layers created empty, got ", layers,
        " layers and ", initial_rows, " rows"));
  }
  if (!prefix_tokens.empty() && initial_rows > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k, v: expected none with prefix_tokens (the rows after the cached prefix are appended), "
        "got ",
        initial_rows, " rows"));
  }
  std::string new_id(id);
  if (id.empty()) {
    ASSIGN_OR_RETURN(new_id, NewSessionId(options_.replica_name));
  }
  std::string scope = PrefixScope(owner, shape, layers);

  auto session = std::make_shared<Session>();
  // Its call lock before the store's, the order every call takes them in; the lease releases it.
  std::unique_lock<std::mutex> call_lock(session->call_mu);
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = options_.clock();
  SweepLocked(now);
  DeviceState& state = device_states_[device];
  const std::vector<uint64_t> found = MatchLocked(state, scope, page_rows, prefix_tokens);
  // Rows of a found chain need no page; none found, the session's first page is new.
  const int64_t per_layer = found.empty() ? PagesFor(initial_rows, page_rows) : 0;
  const int64_t pages = per_layer * layers;
  // The found blocks no session holds are room no more once this session holds them.
  int64_t taken = 0;
  for (uint64_t block : found) {
    if (state.prefixes.Unheld(block)) taken += layers;
  }
  RETURN_IF_ERROR(MakeRoomLocked(device, pages + taken));
  const int64_t free_pages = RoomLocked(state) - taken;
  if (pages > free_pages) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: a new session of ", initial_rows, " rows",
                     layers > 1 ? absl::StrCat(" and ", layers, " layers") : "", " needs ",
                     pages * page_bytes_, " bytes (", pages, " pages of ", page_bytes_, " bytes), ",
                     free_pages * page_bytes_, " bytes free on ", devices_[device].name,
                     BudgetsLocked(device), "; drop idle sessions or wait for them to expire"));
  }
  if (!id.empty() && sessions_.contains(id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("session_id: expected an id no session has, got ", Quote(id)));
  }
  // 128 random bits do not collide in practice; the check costs nothing.
  while (sessions_.contains(new_id)) {
    ASSIGN_OR_RETURN(new_id, NewSessionId(options_.replica_name));
  }
  if (std::string key = MovedKey(owner, id); !id.empty() && moved_.erase(key) > 0) {
    std::erase(moved_order_, key);  // moved back: its own again
  }
  session->id = std::move(new_id);
  session->owner = std::string(owner);
  session->shape = shape;
  session->device = device;
  session->page_rows = page_rows;
  session->last_used = now;
  session->users = 1;
  session->group = session->id;
  session->layers = layers;
  const int64_t prefix_rows = static_cast<int64_t>(found.size()) * page_rows;
  // Each layer holds its page of every block found first (so no page of theirs is taken back for
  // the new ones), then its new pages. Layers 1.. are new too: nobody knows their ids, nobody
  // holds them.
  std::vector<std::shared_ptr<Session>> group = {session};
  for (int layer = 0; layer < layers; ++layer) {
    if (layer > 0) {
      auto& other = group.emplace_back(std::make_shared<Session>());
      other->id = LayerSessionId(session->id, layer);
      other->owner = session->owner;
      other->shape = shape;
      other->device = device;
      other->page_rows = page_rows;
      other->last_used = now;
      other->group = session->id;
      other->layers = layers;
      other->layer = layer;
    }
    Session& s = *group.back();
    s.scope = scope;
    s.chain = found;
    s.tokens.assign(prefix_tokens.begin(), prefix_tokens.begin() + prefix_rows);
    s.length = prefix_rows;
    s.prefix_rows = prefix_rows;
    for (uint64_t block : found) {
      s.page_table.push_back(state.prefixes.Pages(block)[layer]);
      HoldPageLocked(state, s.page_table.back());
    }
  }
  for (const auto& s : group) {
    for (int64_t p = 0; p < per_layer; ++p) s->page_table.push_back(TakePageLocked(device));
  }
  for (size_t layer = 1; layer < group.size(); ++layer) {
    sessions_.emplace(group[layer]->id, std::move(group[layer]));
  }
  ++state.sessions;
  call_lock.release();  // held by the lease from now on
  sessions_.emplace(session->id, session);
  if (!prefix_tokens.empty() && options_.on_prefix) {
    const auto found_blocks = static_cast<int64_t>(found.size());
    options_.on_prefix(
        devices_[device].name,
        {.hit_blocks = found_blocks,
         .missed_blocks = static_cast<int64_t>(prefix_tokens.size()) / page_rows - found_blocks,
         .shared_bytes = found_blocks * layers * page_bytes_});
  }
  PublishLocked();
  return Lease(this, std::move(session));
}

bool SessionStore::ExpiredLocked(const Session& session, absl::Time now) const {
  if (session.users > 0 || now - session.last_used < options_.ttl) return false;
  // A layer of a session of several expires with its group, once every layer is idle past the
  // TTL (a layer found idle is the rare case: only then are the others looked at).
  bool expired = true;
  ForEachLayerLocked(session, [&](const std::shared_ptr<Session>& s) {
    if (s->users > 0 || now - s->last_used < options_.ttl) expired = false;
  });
  return expired;
}

std::shared_ptr<SessionStore::Session> SessionStore::FindLocked(absl::string_view owner,
                                                                absl::string_view id,
                                                                absl::Time now) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->owner != owner) return nullptr;
  std::shared_ptr<Session> session = it->second;
  if (ExpiredLocked(*session, now)) {
    RemoveLocked(session);
    if (options_.on_expired) options_.on_expired(1);
    PublishLocked();
    return nullptr;
  }
  return session;
}

absl::StatusOr<std::vector<SessionStore::Lease>> SessionStore::Acquire(
    absl::string_view owner, absl::Span<const absl::string_view> ids, Access access) {
  std::vector<std::shared_ptr<Session>> found;
  found.reserve(ids.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = options_.clock();
    for (absl::string_view id : ids) {
      std::shared_ptr<Session> session = FindLocked(owner, id, now);
      if (session == nullptr) {
        for (const auto& s : found) --s->users;  // none was locked yet
        return MissingLocked(owner, id);
      }
      ++session->users;  // cannot expire while held or waited for
      session->last_used = now;
      found.push_back(std::move(session));
    }
  }
  // Lock in address order (every call's), so calls on overlapping sets cannot deadlock.
  std::vector<Session*> order;
  order.reserve(found.size());
  for (const auto& s : found) order.push_back(s.get());
  std::sort(order.begin(), order.end(), std::less<Session*>());
  for (Session* s : order) s->call_mu.lock();
  std::vector<Lease> leases;
  leases.reserve(found.size());
  for (auto& s : found) leases.emplace_back(this, std::move(s));
  if (access == Access::kChange) {
    for (const Lease& lease : leases) {
      const Session& s = *lease.session_;
      if (s.sealed) return SealedError(s.layers == 1 ? s.id : s.group);  // releases them all
    }
  }
  // Held (users > 0), none of them moves to the host tier any more; those there come back.
  for (Lease& lease : leases) {
    if (lease.session_->host_slots.empty()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(RestoreLocked(*lease.session_));
  }
  return leases;
}

void SessionStore::Seal(Lease& lease) { lease.session_->sealed = true; }

absl::Status SessionStore::Reserve(absl::Span<Lease* const> leases,
                                   absl::Span<const int64_t> new_rows) {
  // Copy on write: a page the first new row lands in that other sessions hold too is replaced,
  // in the session's page table, by a page of its own, a copy when it holds rows of the session.
  // The shared page stays held until the copies are done, so nothing reuses it meanwhile.
  struct Replaced {
    Session* session;
    size_t index;    // in its page table
    int32_t shared;  // the page it held there
  };
  std::vector<Replaced> replaced;
  std::vector<std::vector<std::pair<int32_t, int32_t>>> copies(devices_.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> needed(devices_.size(), 0);
    std::vector<int64_t> more(leases.size(), 0);
    std::vector<bool> shared(leases.size(), false);
    for (size_t i = 0; i < leases.size(); ++i) {
      const Session& s = *leases[i]->session_;
      const int64_t rows = s.length + new_rows[i];
      if (rows > std::numeric_limits<int32_t>::max()) {
        return absl::InvalidArgumentError(absl::StrCat("session '", s.id, "': expected at most ",
                                                       std::numeric_limits<int32_t>::max(),
                                                       " rows, would hold ", rows));
      }
      more[i] = std::max<int64_t>(
          0, PagesFor(rows, s.page_rows) - static_cast<int64_t>(s.page_table.size()));
      const auto first = static_cast<size_t>(s.length / s.page_rows);
      // A cached page no other session holds is copied too: its index entry stays true.
      const DeviceState& state = device_states_[s.device];
      shared[i] =
          new_rows[i] > 0 && first < s.page_table.size() &&
          (state.refs[s.page_table[first]] > 1 || state.prefixes.Cached(s.page_table[first]));
      needed[s.device] += more[i] + (shared[i] ? 1 : 0);
    }
    for (size_t d = 0; d < devices_.size(); ++d) {
      RETURN_IF_ERROR(MakeRoomLocked(static_cast<int>(d), needed[d]));
      const int64_t free_pages = RoomLocked(device_states_[d]);
      if (needed[d] > free_pages) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KV cache full on ", devices_[d].name, ": the rows to append need ",
            needed[d] * page_bytes_, " bytes (", needed[d], " pages of ", page_bytes_, " bytes), ",
            free_pages * page_bytes_, " bytes free", BudgetsLocked(static_cast<int>(d)),
            "; nothing was appended. Drop idle sessions or wait for them to expire"));
      }
    }
    for (size_t i = 0; i < leases.size(); ++i) {
      Session& s = *leases[i]->session_;
      for (int64_t p = 0; p < more[i]; ++p) s.page_table.push_back(TakePageLocked(s.device));
      if (!shared[i]) continue;
      const auto first = static_cast<size_t>(s.length / s.page_rows);
      const int32_t own = TakePageLocked(s.device);
      replaced.push_back({&s, first, s.page_table[first]});
      if (s.length % s.page_rows != 0) copies[s.device].emplace_back(s.page_table[first], own);
      s.page_table[first] = own;
    }
    // Most decode steps take no page (their rows fit the sessions' last pages): nothing to tell.
    if (std::any_of(needed.begin(), needed.end(), [](int64_t n) { return n > 0; })) {
      PublishLocked();
    }
  }
  if (replaced.empty()) return absl::OkStatus();
  absl::Status status = absl::OkStatus();
  for (size_t d = 0; d < devices_.size() && status.ok(); ++d) {
    if (!copies[d].empty()) status = devices_[d].pool->CopyPages(copies[d]);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Replaced& r : replaced) {
    // Failed: the session holds the shared page again, and its own goes (the other pages
    // reserved stay, unwritten, as after a failed append).
    if (!status.ok()) std::swap(r.session->page_table[r.index], r.shared);
    DropPageLocked(device_states_[r.session->device], r.shared);
  }
  PublishLocked();
  return status;
}

absl::Status SessionStore::Append(absl::Span<Lease* const> leases, absl::Span<const KvRows> rows) {
  std::vector<std::vector<KvWrite>> writes(devices_.size());
  for (size_t i = 0; i < leases.size(); ++i) {
    const Session& s = *leases[i]->session_;
    if (rows[i].rows == 0) continue;
    if (static_cast<int64_t>(s.page_table.size()) * s.page_rows < s.length + rows[i].rows) {
      return absl::InternalError(absl::StrCat("session '", s.id, "': append of ", rows[i].rows,
                                              " rows without its pages"));
    }
    KvWrite& write = writes[s.device].emplace_back();
    write.shape = s.shape;
    write.page_table = s.page_table.data();
    write.first_row = s.length;
    write.rows = rows[i].rows;
    write.k = rows[i].k;
    write.v = rows[i].v;
    write.head_stride = rows[i].head_stride;
    write.row_stride = rows[i].row_stride;
    write.memory = rows[i].memory;
  }
  for (size_t d = 0; d < devices_.size(); ++d) {
    if (writes[d].empty()) continue;
    RETURN_IF_ERROR(devices_[d].pool->Write(writes[d]));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < leases.size(); ++i) leases[i]->session_->length += rows[i].rows;
  return absl::OkStatus();
}

absl::Status SessionStore::Append(Lease& lease, const KvRows& rows) {
  Lease* held[] = {&lease};
  return Append(held, absl::MakeConstSpan(&rows, 1));
}

absl::Status SessionStore::NameTokens(Lease& lease, absl::Span<const int64_t> tokens) {
  Session& s = *lease.session_;
  const auto named = static_cast<int64_t>(tokens.size());
  if (named > s.length) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: expected at most ", s.length,
                                                   " (the rows of session ", Quote(s.id), "), got ",
                                                   named));
  }
  if (named == 0) return absl::OkStatus();  // (most Steps: no store lock)
  std::lock_guard<std::mutex> lock(mu_);
  // Rows of unknown tokens before them end what the index can know of the session (until a
  // truncate cuts those rows).
  if (static_cast<int64_t>(s.tokens.size()) != s.length - named) {
    return absl::OkStatus();
  }
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  CachePrefixLocked(s);
  PublishLocked();
  return absl::OkStatus();
}

void SessionStore::CachePrefixLocked(Session& session) {
  if (session.dropped) return;
  PrefixIndex& index = device_states_[session.device].prefixes;
  const auto page_rows = static_cast<size_t>(session.page_rows);
  const auto layers = static_cast<size_t>(session.layers);
  for (size_t b = session.chain.size(); (b + 1) * page_rows <= session.tokens.size(); ++b) {
    const uint64_t parent = b == 0 ? 0 : session.chain[b - 1];
    // A block evicted under it: the chain is found from the root no more, nor what follows.
    if (parent != 0 && !index.Contains(parent)) return;
    const auto tokens = absl::MakeConstSpan(session.tokens).subspan(b * page_rows, page_rows);
    uint64_t block = index.Find(parent, session.scope, tokens);
    if (block == 0) {
      // Cached once every layer holds the block's rows: each layer's chain then takes it.
      std::vector<int32_t> pages;
      std::vector<Session*> waiting;
      ForEachLayerLocked(session, [&](const std::shared_ptr<Session>& layer) {
        Session& l = *layer;
        if (l.chain.size() == b && l.tokens.size() >= (b + 1) * page_rows &&
            std::equal(tokens.begin(), tokens.end(), l.tokens.begin() + b * page_rows) &&
            l.page_table[b] != kOnHost && !index.Cached(l.page_table[b])) {
          pages.push_back(l.page_table[b]);
          if (&l != &session) waiting.push_back(&l);
        }
      });
      if (pages.size() != layers) return;
      block = index.Insert(parent, session.scope, tokens, std::move(pages));
      for (Session* l : waiting) l->chain.push_back(block);
    }
    session.chain.push_back(block);
  }
}

absl::Status SessionStore::Read(const Lease& lease, int64_t first_row, int64_t rows, void* k,
                                void* v) {
  const Session& s = *lease.session_;
  if (first_row < 0 || first_row > s.length) {
    return absl::InvalidArgumentError(absl::StrCat("first_row: expected 0..", s.length, ", got ",
                                                   first_row, " (session ", Quote(s.id), ")"));
  }
  if (rows < 0 || rows > s.length - first_row) {
    return absl::InvalidArgumentError(absl::StrCat("rows: expected 0..", s.length - first_row,
                                                   ", got ", rows, " (session ", Quote(s.id),
                                                   " holds ", s.length, " rows)"));
  }
  if (rows == 0) return absl::OkStatus();
  return devices_[s.device].pool->Read(KvRead{.shape = s.shape,
                                              .page_table = s.page_table.data(),
                                              .first_row = first_row,
                                              .rows = rows,
                                              .k = k,
                                              .v = v,
                                              .head_stride = rows * s.shape.head_dim,
                                              .row_stride = s.shape.head_dim});
}

absl::Status SessionStore::Truncate(Lease& lease, int64_t length) {
  Session& s = *lease.session_;
  if (length < 0 || length > s.length) {
    return absl::InvalidArgumentError(absl::StrCat("length: expected 0..", s.length, ", got ",
                                                   length, " (session ", Quote(s.id), " holds ",
                                                   s.length, " rows)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // The lease holds the call lock, so no call of this session reads the pages let go here; the
  // ones other sessions hold stay theirs.
  const auto keep = static_cast<size_t>(PagesFor(length, s.page_rows));
  DeviceState& state = device_states_[s.device];
  for (size_t i = s.page_table.size(); i > keep; --i) DropPageLocked(state, s.page_table[i - 1]);
  s.page_table.resize(keep);
  s.length = length;
  // A kept page of a cached block stays cached: the next append into it copies it first.
  if (static_cast<int64_t>(s.tokens.size()) > length) s.tokens.resize(length);
  s.chain.resize(std::min(s.chain.size(), static_cast<size_t>(length / s.page_rows)));
  PublishLocked();
  return absl::OkStatus();
}

absl::StatusOr<SessionStore::Lease> SessionStore::Fork(Lease& parent, int64_t length,
                                                       absl::string_view group) {
  const Session& p = *parent.session_;
  if (length < 0 || length > p.length) {
    return absl::InvalidArgumentError(absl::StrCat("length: expected 0..", p.length, ", got ",
                                                   length, " (session ", Quote(p.id), " holds ",
                                                   p.length, " rows)"));
  }
  if (group.empty() != (p.layer == 0)) {
    return absl::InternalError(absl::StrCat("fork of layer ", p.layer, " of session ",
                                            Quote(p.group), " with group ", Quote(group)));
  }
  std::string id = LayerSessionId(group, p.layer);
  if (group.empty()) {
    ASSIGN_OR_RETURN(id, NewSessionId(options_.replica_name));
  }
  // Pages the child's rows fill are shared; a partial last one is copied; 0 rows get a fresh page.
  const int64_t full = length / p.page_rows;
  const bool partial = length % p.page_rows != 0;
  const bool own_page = partial || length == 0;
  std::pair<int32_t, int32_t> copy;
  auto child = std::make_shared<Session>();
  // Its call lock before the store's, as Create; the lease releases it.
  std::unique_lock<std::mutex> call_lock(child->call_mu);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = options_.clock();
    SweepLocked(now);
    DeviceState& state = device_states_[p.device];
    if (own_page) RETURN_IF_ERROR(MakeRoomLocked(p.device, 1));
    if (own_page && RoomLocked(state) == 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full: a fork of ", length, " rows of session ", Quote(p.id),
                       " needs ", page_bytes_, " bytes (1 page) for ",
                       partial ? "a copy of its partial last page" : "its rows",
                       ", 0 bytes free on ", devices_[p.device].name, BudgetsLocked(p.device),
                       "; drop idle sessions or wait for them to expire"));
    }
    while (group.empty() && sessions_.contains(id)) {
      ASSIGN_OR_RETURN(id, NewSessionId(options_.replica_name));
    }
    child->id = std::move(id);
    child->group = group.empty() ? child->id : std::string(group);
    child->layers = p.layers;
    child->layer = p.layer;
    child->owner = p.owner;
    child->shape = p.shape;
    child->device = p.device;
    child->page_rows = p.page_rows;
    child->last_used = now;
    child->users = 1;
    for (int64_t i = 0; i < full; ++i) {
      HoldPageLocked(state, p.page_table[i]);
      child->page_table.push_back(p.page_table[i]);
    }
    if (own_page) child->page_table.push_back(TakePageLocked(p.device));
    // The parent's prefix up to the child's rows is the child's.
    child->scope = p.scope;
    child->tokens.assign(p.tokens.begin(),
                         p.tokens.begin() + std::min<int64_t>(length, p.tokens.size()));
    child->chain.assign(p.chain.begin(), p.chain.begin() + std::min<int64_t>(full, p.chain.size()));
    if (partial) copy = {p.page_table[full], child->page_table.back()};
    child->length = length;
    if (child->layer == 0) ++state.sessions;
    sessions_.emplace(child->id, child);
    PublishLocked();
  }
  call_lock.release();  // held by the lease from now on
  Lease lease(this, std::move(child));
  // The parent's lease keeps its pages (the copy's source included) from being let go meanwhile.
  if (partial) {
    if (absl::Status copied = devices_[p.device].pool->CopyPages({copy}); !copied.ok()) {
      // The caller never learns the id: remove the child (its pages go when the lease does).
      Drop(p.owner, lease.id()).IgnoreError();
      return copied;
    }
  }
  return lease;
}

absl::StatusOr<SessionStore::Lease> SessionStore::ForkLayers(std::vector<Lease>& parents,
                                                             std::optional<int64_t> length) {
  ASSIGN_OR_RETURN(Lease child, Fork(parents.front(), length.value_or(parents.front().length())));
  for (size_t layer = 1; layer < parents.size(); ++layer) {
    absl::StatusOr<Lease> forked =
        Fork(parents[layer], length.value_or(parents[layer].length()), child.id());
    if (!forked.ok()) {
      // The caller never learns the id.
      Drop(parents.front().session_->owner, child.id()).IgnoreError();
      return forked.status();
    }
  }
  return child;
}

int64_t SessionStore::RoomLocked(const DeviceState& state) {
  return static_cast<int64_t>(state.free_pages.size()) + state.prefixes.unheld_pages();
}

unsigned char* SessionStore::SlotLocked(int device, int32_t slot) const {
  return devices_[device].host_tier.get() + static_cast<size_t>(slot) * page_bytes_;
}

std::string SessionStore::BudgetsLocked(int device) const {
  const DeviceState& state = device_states_[device];
  const std::string pool =
      absl::StrCat(" (its KV pool: ", devices_[device].pool->num_pages() * page_bytes_,
                   " bytes, --kv_cache_bytes or --kv_cache_fraction; ");
  if (state.host_slots == 0) return absl::StrCat(pool, "no host tier, --kv_host_bytes 0)");
  return absl::StrCat(
      pool, "its host tier: ", static_cast<int64_t>(state.free_slots.size()) * page_bytes_, " of ",
      state.host_slots * page_bytes_,
      " bytes free, --kv_host_bytes, which takes only pages of sessions no call "
      "holds, shared with no other session or prefix)");
}

absl::Status SessionStore::MakeRoomLocked(int device, int64_t needed) {
  DeviceState& state = device_states_[device];
  const int64_t short_by = needed - RoomLocked(state);
  if (short_by <= 0 || short_by > static_cast<int64_t>(state.free_slots.size())) {
    return absl::OkStatus();
  }
  // The sessions no call holds or waits for, least recently used first (by id on a tie, so the
  // choice is the same every time).
  std::vector<Session*> cold;
  for (const auto& [id, session] : sessions_) {
    if (session->device == device && session->users == 0) cold.push_back(session.get());
  }
  std::sort(cold.begin(), cold.end(), [](const Session* a, const Session* b) {
    return a->last_used != b->last_used ? a->last_used < b->last_used : a->id < b->id;
  });
  struct Move {
    Session* session;
    size_t index;  // in its page table
    int32_t slot;
  };
  std::vector<Move> moves;
  std::vector<HostPage> copies;
  for (Session* s : cold) {
    for (size_t i = 0; i < s->page_table.size() && static_cast<int64_t>(moves.size()) < short_by;
         ++i) {
      const int32_t page = s->page_table[i];
      // A page other sessions hold, or a prefix block caches, is not only this cold session's.
      if (page == kOnHost || state.refs[page] != 1 || state.prefixes.Cached(page)) continue;
      const int32_t slot = state.free_slots[state.free_slots.size() - 1 - moves.size()];
      moves.push_back({s, i, slot});
      copies.push_back({page, SlotLocked(device, slot)});
    }
  }
  if (static_cast<int64_t>(moves.size()) < short_by) return absl::OkStatus();  // moves nothing
  RETURN_IF_ERROR(devices_[device].pool->SavePages(copies));
  state.free_slots.resize(state.free_slots.size() - moves.size());
  // Nobody holds these sessions, and a call takes the store's lock to hold one (users), so their
  // page tables change here under the store's lock alone.
  for (const Move& m : moves) {
    Session& s = *m.session;
    if (s.host_slots.empty()) s.host_slots.assign(s.page_table.size(), -1);
    s.host_slots[m.index] = m.slot;
    DropPageLocked(state, s.page_table[m.index]);  // its only hold, not cached: free
    s.page_table[m.index] = kOnHost;
  }
  if (options_.on_host_tier) {
    options_.on_host_tier(devices_[device].name,
                          {.spilled_pages = static_cast<int64_t>(moves.size())});
  }
  PublishLocked();
  return absl::OkStatus();
}

absl::Status SessionStore::RestoreLocked(Session& session) {
  const absl::Time start = absl::Now();
  DeviceState& state = device_states_[session.device];
  const auto count = static_cast<int64_t>(
      std::count(session.page_table.begin(), session.page_table.end(), kOnHost));
  RETURN_IF_ERROR(MakeRoomLocked(session.device, count));
  // The host tier too full for what must move out: the session's own slots take it, its pages
  // waiting meanwhile in plain host memory (`bounce`, page i of it the i-th page on the host).
  std::vector<unsigned char> bounce;
  std::vector<int32_t> slots;  // the session's, in its page table's order
  for (size_t i = 0; i < session.page_table.size(); ++i) {
    if (session.page_table[i] == kOnHost) slots.push_back(session.host_slots[i]);
  }
  if (count > RoomLocked(state)) {
    bounce.resize(static_cast<size_t>(count * page_bytes_));
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(bounce.data() + i * page_bytes_, SlotLocked(session.device, slots[i]),
                  page_bytes_);
    }
    state.free_slots.insert(state.free_slots.end(), slots.rbegin(), slots.rend());
    absl::Status made = MakeRoomLocked(session.device, count);
    if (!made.ok() || count > RoomLocked(state)) {
      // Nothing moved (or a failed copy wrote into the slots): the session keeps its slots, its
      // bytes put back.
      state.free_slots.resize(state.free_slots.size() - slots.size());
      for (size_t i = 0; i < slots.size(); ++i) {
        std::memcpy(SlotLocked(session.device, slots[i]), bounce.data() + i * page_bytes_,
                    page_bytes_);
      }
      RETURN_IF_ERROR(made);
    }
  }
  if (count > RoomLocked(state)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full: session ", Quote(session.layers == 1 ? session.id : session.group), " has ",
        count * page_bytes_, " bytes (", count, " pages) on the host tier to bring back, ",
        RoomLocked(state) * page_bytes_, " bytes free on ", devices_[session.device].name,
        BudgetsLocked(session.device), "; drop idle sessions or wait for them to expire"));
  }
  std::vector<HostPage> copies;
  for (size_t i = 0; i < slots.size(); ++i) {
    copies.push_back({TakePageLocked(session.device), bounce.empty()
                                                          ? SlotLocked(session.device, slots[i])
                                                          : bounce.data() + i * page_bytes_});
  }
  const absl::Status loaded = devices_[session.device].pool->LoadPages(copies);
  if (!loaded.ok() && bounce.empty()) {
    for (const HostPage& copy : copies) DropPageLocked(state, copy.page);
    PublishLocked();
    return loaded;
  }
  auto copy = copies.begin();
  for (int32_t& page : session.page_table) {
    if (page == kOnHost) page = (copy++)->page;
  }
  if (bounce.empty()) state.free_slots.insert(state.free_slots.end(), slots.rbegin(), slots.rend());
  session.host_slots.clear();
  if (!loaded.ok()) {
    // Through the bounce, its slots hold other sessions' pages now: its rows are lost with the
    // device's fault, and so is the session (NOT_FOUND from now on, not wrong rows).
    if (auto it = sessions_.find(session.id); it != sessions_.end()) RemoveLocked(it->second);
    PublishLocked();
    return loaded;
  }
  if (options_.on_host_tier) {
    options_.on_host_tier(
        devices_[session.device].name,
        {.restored_pages = count, .restore_seconds = absl::ToDoubleSeconds(absl::Now() - start)});
  }
  PublishLocked();
  return absl::OkStatus();
}

int32_t SessionStore::TakePageLocked(int device) {
  DeviceState& state = device_states_[device];
  if (state.free_pages.empty()) {
    state.prefixes.Evict(&state.free_pages);
    if (options_.on_evicted) {
      options_.on_evicted(devices_[device].name, static_cast<int64_t>(state.free_pages.size()));
    }
  }
  const int32_t page = state.free_pages.back();
  state.free_pages.pop_back();
  state.refs[page] = 1;
  return page;
}

void SessionStore::HoldPageLocked(DeviceState& state, int32_t page) {
  const int32_t held = ++state.refs[page];
  if (held == 1) state.prefixes.Held(page);
  if (held == 2) ++state.shared_pages;
}

void SessionStore::DropPageLocked(DeviceState& state, int32_t page) {
  const int32_t left = --state.refs[page];
  if (left == 1) --state.shared_pages;
  if (left > 0) return;
  // A cached page waits, unheld, to be found again or taken back (TakePageLocked).
  if (state.prefixes.Cached(page)) {
    state.prefixes.Released(page);
  } else {
    state.free_pages.push_back(page);
  }
}

void SessionStore::FreePagesLocked(Session& session) {
  DeviceState& state = device_states_[session.device];
  // In reverse, so the stack hands a session's pages out again in their order.
  for (size_t i = session.page_table.size(); i-- > 0;) {
    if (session.page_table[i] == kOnHost) {
      state.free_slots.push_back(session.host_slots[i]);
    } else {
      DropPageLocked(state, session.page_table[i]);
    }
  }
  session.page_table.clear();
  session.host_slots.clear();
}

void SessionStore::RemoveLocked(const std::shared_ptr<Session>& session) {
  // Every layer of its group goes with it (one layer alone: the group is itself).
  ForEachLayerLocked(*session, [this](std::shared_ptr<Session> s) {
    sessions_.erase(s->id);
    if (s->layer == 0) --device_states_[s->device].sessions;
    s->dropped = true;
    // A call holding it frees the pages when it ends: they may be in use until then.
    if (s->users == 0) FreePagesLocked(*s);
  });
}

absl::Status SessionStore::Drop(absl::string_view owner, absl::string_view id) {
  if (absl::StrContains(id, '/')) return NotFound(id);  // as Locate
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Session> session = FindLocked(owner, id, options_.clock());
  if (session == nullptr) return NotFound(id);
  if (session->sealed) {  // moved away (layer 0 stands for the group: every layer is sealed)
    std::string key = MovedKey(owner, id);
    if (moved_.insert(key).second) moved_order_.push_back(std::move(key));
    if (moved_order_.size() > kMovedKept) {
      moved_.erase(moved_order_.front());
      moved_order_.pop_front();
    }
  }
  RemoveLocked(session);
  PublishLocked();
  return absl::OkStatus();
}

int SessionStore::SweepLocked(absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  for (const auto& [id, session] : sessions_) {
    // A group is looked at once, through its layer 0; RemoveLocked takes every layer.
    if (session->layer == 0 && ExpiredLocked(*session, now)) expired.push_back(session);
  }
  for (const auto& session : expired) RemoveLocked(session);
  if (!expired.empty()) {
    if (options_.on_expired) options_.on_expired(static_cast<int>(expired.size()));
    PublishLocked();
  }
  return static_cast<int>(expired.size());
}

int SessionStore::Sweep() {
  std::lock_guard<std::mutex> lock(mu_);
  return SweepLocked(options_.clock());
}

SessionSnapshot SessionStore::SnapshotLocked(const Session& session, absl::Time now) const {
  SessionSnapshot out;
  out.id = session.group;
  out.shape = session.shape;
  out.layers = session.layers;
  out.length = std::numeric_limits<int64_t>::max();
  out.idle = absl::InfiniteDuration();
  const std::vector<int32_t>& refs = device_states_[session.device].refs;
  ForEachLayerLocked(session, [&](const std::shared_ptr<Session>& layer) {
    const Session& s = *layer;
    out.length = std::min(out.length, s.length);
    if (session.layers > 1) out.layer_lengths.push_back(s.length);
    out.pages += static_cast<int64_t>(s.page_table.size());
    out.host_pages += std::count(s.page_table.begin(), s.page_table.end(), kOnHost);
    out.shared_pages +=
        std::count_if(s.page_table.begin(), s.page_table.end(),
                      [&refs](int32_t page) { return page != kOnHost && refs[page] > 1; });
    // A session in use is not idle; a group is as idle as its last used layer (it expires once
    // every layer is idle past the TTL).
    out.idle = std::min(out.idle, s.users > 0 ? absl::ZeroDuration() : now - s.last_used);
  });
  if (out.length == std::numeric_limits<int64_t>::max()) out.length = session.length;
  if (out.idle == absl::InfiniteDuration()) out.idle = absl::ZeroDuration();
  out.resident_bytes = (out.pages - out.host_pages) * page_bytes_;
  out.prefix_rows = session.prefix_rows;
  out.expires_in = std::max(absl::ZeroDuration(), options_.ttl - out.idle);
  out.device = devices_[session.device].name;
  return out;
}

std::vector<SessionSnapshot> SessionStore::List(absl::string_view owner) {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = options_.clock();
  SweepLocked(now);
  std::vector<SessionSnapshot> out;
  for (const auto& [id, session] : sessions_) {
    if (session->owner == owner && session->layer == 0) {
      out.push_back(SnapshotLocked(*session, now));
    }
  }
  // In id order (the table is hashed).
  std::sort(out.begin(), out.end(),
            [](const SessionSnapshot& a, const SessionSnapshot& b) { return a.id < b.id; });
  return out;
}

CacheRoom SessionStore::Room() {
  std::lock_guard<std::mutex> lock(mu_);
  CacheRoom room;
  room.page_bytes = page_bytes_;
  for (size_t d = 0; d < devices_.size(); ++d) {
    room.pages_total += devices_[d].pool->num_pages();
    room.pages_free += static_cast<int64_t>(device_states_[d].free_pages.size());
    room.pages_cached += device_states_[d].prefixes.unheld_pages();
  }
  return room;
}

SessionSnapshot SessionStore::Snapshot(const Lease& lease) {
  std::lock_guard<std::mutex> lock(mu_);
  return SnapshotLocked(*lease.session_, options_.clock());
}

void SessionStore::PublishLocked() {
  if (!options_.on_usage) return;
  for (size_t d = 0; d < devices_.size(); ++d) {
    const int64_t total = devices_[d].pool->num_pages();
    const DeviceState& state = device_states_[d];
    const int64_t free_pages = static_cast<int64_t>(state.free_pages.size());
    const int64_t free_slots = static_cast<int64_t>(state.free_slots.size());
    options_.on_usage(devices_[d].name,
                      {.sessions = state.sessions,
                       .resident_bytes = (total - free_pages) * page_bytes_,
                       .pages_free = free_pages,
                       .pages_total = total,
                       .pages_shared = state.shared_pages,
                       .pages_cached = state.prefixes.unheld_pages(),
                       .host_bytes_used = (state.host_slots - free_slots) * page_bytes_,
                       .host_bytes_total = state.host_slots * page_bytes_});
  }
}

}  // namespace attention::server
