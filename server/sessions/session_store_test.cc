// The session store (session_store.h) over small CPU page pools: allocation, exhaustion, TTL
// expiry on a fake clock, owners, drop, truncate, fork (shared pages counted once, copy on write,
// release in either order, truncate of shared pages), device choice, concurrent appends to one
// session, and shared prefixes (chains of full pages found, owners apart, cached pages taken back
// least recently released first and never while held, copy before an append into one, layers),
// and the host tier (cold sessions' pages moved out and back bit for bit, held ones never, shared
// ones never, both budgets named when both are full, concurrent calls while pages move).
#include "server/sessions/session_store.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/paged_kv_pool.h"

namespace attention::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kPageBytes = 4096;
// float32, 2 kv heads, head dim 8: 128 bytes of K and V per row, so 32 rows per page.
constexpr KvShape kShape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 8};
constexpr int64_t kPageRows = 32;

class FakeClock {
 public:
  absl::Time Now() {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ += d;
  }

 private:
  std::mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

// Page pools of `pages[d]` pages, kept for the test's life as executors keep theirs for the
// server's: the store only points at them; each with a host tier of `host_pages` pages.
class Pools {
 public:
  std::vector<KvDevice> Devices(std::vector<int64_t> pages, int64_t host_pages = 0) {
    std::vector<KvDevice> devices;
    for (size_t d = 0; d < pages.size(); ++d) {
      absl::StatusOr<std::unique_ptr<KvPagePool>> pool =
          cpu::MakeKvPagePool(pages[d], kPageBytes, /*threads=*/1);
      EXPECT_TRUE(pool.ok()) << pool.status();
      if (!pool.ok()) continue;
      owned_.push_back(*std::move(pool));
      devices.push_back(KvDevice{.name = "dev" + std::to_string(d), .pool = owned_.back().get()});
      if (host_pages == 0) continue;
      absl::StatusOr<HostBuffer> host = owned_.back()->AllocateHost(host_pages * kPageBytes);
      EXPECT_TRUE(host.ok()) << host.status();
      if (!host.ok()) continue;
      devices.back().host_tier = *std::move(host);
      devices.back().host_tier_bytes = host_pages * kPageBytes;
    }
    return devices;
  }

 private:
  std::vector<std::unique_ptr<KvPagePool>> owned_;
};

// A new session on the device the server would pick (SessionStore::EmptiestDevice).
absl::StatusOr<SessionStore::Lease> CreateOnEmptiest(SessionStore& store, absl::string_view owner,
                                                     int64_t rows) {
  absl::StatusOr<int> device = store.EmptiestDevice();
  if (!device.ok()) return device.status();
  return store.Create(owner, kShape, rows, *device);
}

// `rows` random rows in BHSD [Hkv, rows, D] for k and v.
struct Rows {
  explicit Rows(int64_t rows, std::mt19937_64& rng)
      : k(kShape.heads_kv * rows * kShape.head_dim), v(k.size()) {
    std::normal_distribution<float> normal;
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    view = KvRows{.k = k.data(),
                  .v = v.data(),
                  .rows = rows,
                  .head_stride = rows * kShape.head_dim,
                  .row_stride = kShape.head_dim};
  }
  std::vector<float> k, v;
  KvRows view;
};

class SessionStoreTest : public ::testing::Test {
 protected:
  void Make(std::vector<int64_t> pages, absl::Duration ttl = absl::Seconds(60),
            std::string replica_name = "", int64_t host_pages = 0) {
    store_ = std::make_unique<SessionStore>(
        pools_.Devices(std::move(pages), host_pages),
        SessionStoreOptions{.ttl = ttl,
                            .replica_name = replica_name,
                            .clock = [this] { return clock_.Now(); },
                            .on_usage =
                                [this](const std::string&, const KvCacheUsage& usage) {
                                  host_bytes_used_ = usage.host_bytes_used;
                                },
                            .on_host_tier =
                                [this](const std::string&, const HostTierMove& move) {
                                  spilled_ += move.spilled_pages;
                                  restored_ += move.restored_pages;
                                }});
  }
  // Creates a session of `owner` holding `rows` rows; returns its id.
  std::string CreateWith(const std::string& owner, int64_t rows) {
    Rows data(rows, rng_);
    absl::StatusOr<SessionStore::Lease> lease = CreateOnEmptiest(*store_, owner, rows);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return "";
    EXPECT_EQ(store_->Append(*lease, data.view), absl::OkStatus());
    return lease->id();
  }
  // Forks session `id` of `owner` at `rows` rows; returns the child's id.
  std::string ForkOf(const std::string& owner, const std::string& id, int64_t rows) {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    EXPECT_TRUE(leases.ok()) << leases.status();
    if (!leases.ok()) return "";
    absl::StatusOr<SessionStore::Lease> child = store_->Fork(leases->front(), rows);
    EXPECT_TRUE(child.ok()) << child.status();
    return child.ok() ? child->id() : "";
  }
  // Session `id`'s page table, length and shared pages.
  struct Held {
    std::vector<int32_t> pages;
    int64_t length = 0, shared = 0;
  };
  Held HeldBy(const std::string& id, const std::string& owner = "") {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    EXPECT_TRUE(leases.ok()) << leases.status();
    if (!leases.ok()) return {};
    return {leases->front().page_table(), leases->front().length(),
            store_->Snapshot(leases->front()).shared_pages};
  }
  absl::Status TruncateTo(const std::string& id, int64_t rows) {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
    if (!leases.ok()) return leases.status();
    return store_->Truncate(leases->front(), rows);
  }
  absl::Status AppendRows(const std::string& owner, const std::string& id, int64_t rows) {
    Rows data(rows, rng_);
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    if (!leases.ok()) return leases.status();
    SessionStore::Lease* held[] = {&leases->front()};
    const int64_t new_rows[] = {rows};
    if (absl::Status s = store_->Reserve(held, new_rows); !s.ok()) return s;
    return store_->Append(leases->front(), data.view);
  }

  const uint64_t seed_ = std::random_device()();
  std::mt19937_64 rng_{seed_};
  FakeClock clock_;
  Pools pools_;  // before the store, which points at its pools
  std::unique_ptr<SessionStore> store_;
  // What the store reported (its callbacks run under its lock).
  int64_t host_bytes_used_ = 0, spilled_ = 0, restored_ = 0;
};

TEST(SessionIdTest, Is32HexDigitsAndFresh) {
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> id = NewSessionId("");
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 32u);
    for (char c : *id) EXPECT_TRUE(absl::ascii_isxdigit(c)) << *id;
    ids.insert(*id);
  }
  EXPECT_EQ(ids.size(), 100u);
}

TEST(SessionIdTest, StartsWithTheReplicaName) {
  absl::StatusOr<std::string> id = NewSessionId("r-7");
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(id->size(), 4u + 32u) << *id;
  EXPECT_EQ(id->substr(0, 4), "r-7.");
  for (char c : id->substr(4)) EXPECT_TRUE(absl::ascii_isxdigit(c)) << *id;
}

// Every id the store makes names the replica: a created session's, its fork's, an import's
// (Create with no id); an id given (an Import keeping an exported id) is kept as it came.
TEST_F(SessionStoreTest, IdsItMakesNameTheReplica) {
  SCOPED_TRACE(seed_);
  Make({10}, absl::Seconds(60), "r2");
  const std::string id = CreateWith("", 3);
  EXPECT_TRUE(absl::StartsWith(id, "r2.")) << id;
  const std::string child = ForkOf("", id, 2);
  EXPECT_TRUE(absl::StartsWith(child, "r2.")) << child;
  const std::string kept = "r1.0123456789abcdef0123456789abcdef";
  absl::StatusOr<SessionStore::Lease> imported = store_->Create("", kShape, 0, 0, 1, kept);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->id(), kept);
}

TEST_F(SessionStoreTest, AllocatesPagesForRowsAndAtLeastOne) {
  SCOPED_TRACE(seed_);
  Make({10});
  EXPECT_EQ(store_->PageRowsFor(kShape), kPageRows);
  const std::string empty = CreateWith("", 0);
  const std::string three = CreateWith("", 2 * kPageRows + 1);
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 2u);
  for (const SessionSnapshot& s : list) {
    EXPECT_EQ(s.pages, s.id == empty ? 1 : 3) << s.id;
    EXPECT_EQ(s.length, s.id == empty ? 0 : 2 * kPageRows + 1);
    EXPECT_EQ(s.resident_bytes, s.pages * kPageBytes);
    EXPECT_EQ(s.device, "dev0");
  }
  EXPECT_EQ(store_->Room().pages_free, 6);
  EXPECT_EQ(store_->Room().pages_total, 10);
  // Appending within the last page takes no page; past it, one more.
  ASSERT_EQ(AppendRows("", three, kPageRows - 1), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 6);
  ASSERT_EQ(AppendRows("", three, 1), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 5);
}

TEST_F(SessionStoreTest, TruncateKeepsTheFirstRowsAndFreesThePagesBeyond) {
  SCOPED_TRACE(seed_);
  Make({10});
  const std::string id = CreateWith("", 3 * kPageRows + 1);  // 4 pages
  EXPECT_EQ(store_->Room().pages_free, 6);
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
  ASSERT_TRUE(leases.ok()) << leases.status();
  SessionStore::Lease& lease = leases->front();
  for (const int64_t bad : {int64_t{-1}, 3 * kPageRows + 2}) {
    absl::Status refused = store_->Truncate(lease, bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.message(),
                HasSubstr(absl::StrCat("length: expected 0..", 3 * kPageRows + 1, ", got ", bad)));
  }
  EXPECT_EQ(lease.length(), 3 * kPageRows + 1);
  const std::vector<int32_t> pages = lease.page_table();
  ASSERT_EQ(store_->Truncate(lease, kPageRows + 1), absl::OkStatus());  // 2 pages kept
  EXPECT_EQ(lease.length(), kPageRows + 1);
  EXPECT_EQ(lease.page_table(), std::vector<int32_t>(pages.begin(), pages.begin() + 2));
  EXPECT_EQ(store_->Room().pages_free, 8);
  ASSERT_EQ(store_->Truncate(lease, 0), absl::OkStatus());  // a session keeps one page
  EXPECT_EQ(lease.length(), 0);
  EXPECT_EQ(lease.page_table().size(), 1u);
  EXPECT_EQ(store_->Room().pages_free, 9);
  leases->clear();
  // Appending after a truncate takes pages again.
  ASSERT_EQ(AppendRows("", id, kPageRows + 1), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 8);
}

TEST_F(SessionStoreTest, ForkSharesTheFullPagesAndCopiesThePartialOne) {
  SCOPED_TRACE(seed_);
  Make({10});
  const std::string parent = CreateWith("owner", 3 * kPageRows + 5);  // 4 pages, the last partial
  EXPECT_EQ(store_->Room().pages_free, 6);
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("owner", {parent});
  ASSERT_TRUE(leases.ok()) << leases.status();
  for (const int64_t bad : {int64_t{-1}, 3 * kPageRows + 6}) {
    absl::StatusOr<SessionStore::Lease> refused = store_->Fork(leases->front(), bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(),
                HasSubstr(absl::StrCat("length: expected 0..", 3 * kPageRows + 5, ", got ", bad)));
  }
  absl::StatusOr<SessionStore::Lease> child = store_->Fork(leases->front(), 3 * kPageRows + 5);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string id = child->id();
  EXPECT_NE(id, parent);
  EXPECT_EQ(child->shape(), kShape);
  EXPECT_EQ(child->device(), leases->front().device());
  const std::vector<int32_t> pages = leases->front().page_table();
  ASSERT_EQ(child->page_table().size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(child->page_table().begin(), child->page_table().begin() + 3),
            std::vector<int32_t>(pages.begin(), pages.begin() + 3));
  EXPECT_NE(child->page_table()[3], pages[3]);
  child = SessionStore::Lease();
  leases->clear();
  // One page more, not four: the shared pages count once in the room and the usage.
  EXPECT_EQ(store_->Room().pages_free, 5);
  EXPECT_EQ(HeldBy(parent, "owner").shared, 3);
  EXPECT_EQ(HeldBy(id, "owner").shared, 3);
  EXPECT_EQ(store_->List("owner").size(), 2u);  // the parent's owner's
  EXPECT_TRUE(store_->List("").empty());
  // Forks at a page's end share every page the rows fill; a fork of no rows gets an empty page.
  const std::string at_edge = ForkOf("owner", parent, 2 * kPageRows);
  EXPECT_EQ(store_->Room().pages_free, 5);
  const std::string none = ForkOf("owner", parent, 0);
  EXPECT_EQ(store_->Room().pages_free, 4);
  absl::StatusOr<std::vector<SessionStore::Lease>> both =
      store_->Acquire("owner", {parent, at_edge});
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ((*both)[1].length(), 2 * kPageRows);
  EXPECT_EQ((*both)[1].page_table(), std::vector<int32_t>(pages.begin(), pages.begin() + 2));
  both->clear();
  // Another owner's session is NOT_FOUND to a fork as to every call.
  EXPECT_EQ(store_->Acquire("other", {parent}).status().code(), absl::StatusCode::kNotFound);
  for (const std::string& s : {parent, id, at_edge, none}) {
    ASSERT_EQ(store_->Drop("owner", s), absl::OkStatus());
  }
  EXPECT_EQ(store_->Room().pages_free, 10);
}

// Read gives back a session's rows bit for bit, in chunks across page edges, from its own pages
// and from pages it shares with a fork, after a truncate; a range past its length is refused.
TEST_F(SessionStoreTest, ReadGivesBackTheRowsInChunks) {
  SCOPED_TRACE(seed_);
  Make({10});
  const int64_t n = 2 * kPageRows + 7;
  Rows data(n, rng_);
  absl::StatusOr<SessionStore::Lease> lease = CreateOnEmptiest(*store_, "", n);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(store_->Append(*lease, data.view), absl::OkStatus());
  const std::string id = lease->id();
  *lease = SessionStore::Lease();
  const std::string child = ForkOf("", id, kPageRows + 3);
  ASSERT_EQ(TruncateTo(id, n - 2), absl::OkStatus());
  const int64_t d = kShape.head_dim, hkv = kShape.heads_kv;
  // Rows [0, length) of the session in chunks of `chunk` rows, back into BHSD [Hkv, length, D].
  const auto read_all = [&](const std::string& session, int64_t chunk) {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {session});
    EXPECT_TRUE(leases.ok()) << leases.status();
    if (!leases.ok()) return std::pair<std::vector<float>, std::vector<float>>();
    const int64_t length = leases->front().length();
    std::vector<float> k(hkv * length * d), v(k.size()), k_part, v_part;
    for (int64_t first = 0; first < length; first += chunk) {
      const int64_t rows = std::min(chunk, length - first);
      k_part.assign(hkv * rows * d, 0.0f);
      v_part.assign(k_part.size(), 0.0f);
      EXPECT_EQ(store_->Read(leases->front(), first, rows, k_part.data(), v_part.data()),
                absl::OkStatus());
      for (int64_t h = 0; h < hkv; ++h) {
        std::copy_n(k_part.begin() + h * rows * d, rows * d, k.begin() + (h * length + first) * d);
        std::copy_n(v_part.begin() + h * rows * d, rows * d, v.begin() + (h * length + first) * d);
      }
    }
    return std::pair{k, v};
  };
  // The first `length` rows of data, BHSD [Hkv, length, D].
  const auto expected = [&](int64_t length) {
    std::vector<float> k, v;
    for (int64_t h = 0; h < hkv; ++h) {
      k.insert(k.end(), data.k.begin() + h * n * d, data.k.begin() + (h * n + length) * d);
      v.insert(v.end(), data.v.begin() + h * n * d, data.v.begin() + (h * n + length) * d);
    }
    return std::pair{k, v};
  };
  for (const int64_t chunk : {int64_t{1}, int64_t{5}, kPageRows + 1, n}) {
    EXPECT_EQ(read_all(id, chunk), expected(n - 2)) << "chunk " << chunk;
    EXPECT_EQ(read_all(child, chunk), expected(kPageRows + 3)) << "chunk " << chunk;
  }
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {child});
  ASSERT_TRUE(leases.ok()) << leases.status();
  std::vector<float> out(hkv * 2 * d);
  EXPECT_THAT(store_->Read(leases->front(), kPageRows + 2, 2, out.data(), out.data()).message(),
              HasSubstr("rows: expected 0..1, got 2"));
  EXPECT_THAT(store_->Read(leases->front(), -1, 1, out.data(), out.data()).message(),
              HasSubstr(absl::StrCat("first_row: expected 0..", kPageRows + 3, ", got -1")));
}

// A V head dim of its own (MLA): refused by name on a device whose pool does not serve it; on one
// that does, pages hold rows of D and Dv (fewer per page than two rows of D) and read back as
// written, k [Hkv, n, D] and v [Hkv, n, Dv].
TEST_F(SessionStoreTest, VHeadDimOnlyWhereTheDeviceServesIt) {
  std::vector<KvDevice> devices = pools_.Devices({4, 4});
  devices[1].v_head_dim = true;
  SessionStore store(std::move(devices), SessionStoreOptions{});
  KvShape shape = kShape;
  shape.v_head_dim = 24;  // 2 heads * (8 + 24) float32: 256 bytes a row, 16 rows a page
  const absl::Status refused = store.Create("", shape, 1, /*device=*/0).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnimplemented) << refused;
  EXPECT_THAT(refused.message(),
              HasSubstr("v_head_dim: expected 8 (head_dim) for a session on dev0"));
  EXPECT_THAT(refused.message(), HasSubstr("got 24"));

  const int64_t n = 37, hkv = shape.heads_kv, d = shape.head_dim, dv = 24;
  std::vector<float> k(hkv * n * d), v(hkv * n * dv);
  std::normal_distribution<float> normal;
  for (float& x : k) x = normal(rng_);
  for (float& x : v) x = normal(rng_);
  absl::StatusOr<SessionStore::Lease> lease = store.Create("", shape, n, /*device=*/1);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(store.Snapshot(*lease).pages, 3);  // 37 rows of 16 a page
  ASSERT_EQ(
      store.Append(
          *lease,
          KvRows{.k = k.data(), .v = v.data(), .rows = n, .head_stride = n * d, .row_stride = d}),
      absl::OkStatus());
  std::vector<float> k_out(k.size()), v_out(v.size());
  ASSERT_EQ(store.Read(*lease, 0, n, k_out.data(), v_out.data()), absl::OkStatus());
  EXPECT_EQ(k_out, k);
  EXPECT_EQ(v_out, v);
}

TEST_F(SessionStoreTest, AppendsIntoASharedPageCopyItFirst) {
  SCOPED_TRACE(seed_);
  Make({10});
  const std::string parent = CreateWith("", 2 * kPageRows + 5);  // 3 pages
  const std::string child = ForkOf("", parent, 2 * kPageRows + 5);
  EXPECT_EQ(store_->Room().pages_free, 6);
  const Held before = HeldBy(child);
  // Into each one's own partial page: no copy, no page.
  ASSERT_EQ(AppendRows("", parent, 3), absl::OkStatus());
  ASSERT_EQ(AppendRows("", child, 4), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 6);
  EXPECT_EQ(HeldBy(child).pages, before.pages);
  // Cut into the shared second page, each then appends there: the page is copied, the other's
  // page table stays as it was.
  ASSERT_EQ(TruncateTo(parent, kPageRows + 7), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 7);  // the parent's own third page
  ASSERT_EQ(AppendRows("", parent, 2), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 6);
  Held p = HeldBy(parent), c = HeldBy(child);
  EXPECT_EQ(p.length, kPageRows + 9);
  ASSERT_EQ(p.pages.size(), 2u);
  EXPECT_EQ(p.pages[0], before.pages[0]);
  EXPECT_NE(p.pages[1], before.pages[1]);
  EXPECT_EQ(c.pages, before.pages);
  EXPECT_EQ(p.shared, 1);
  EXPECT_EQ(c.shared, 1);
  // The child cut into its first page, shared still, and appending past it: a copy of the first,
  // and pages of its own after it.
  ASSERT_EQ(TruncateTo(child, 10), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 8);  // its second and third, now its alone
  ASSERT_EQ(AppendRows("", child, kPageRows), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 6);
  c = HeldBy(child);
  ASSERT_EQ(c.pages.size(), 2u);
  EXPECT_NE(c.pages[0], before.pages[0]);
  EXPECT_EQ(c.shared, 0);
  EXPECT_EQ(HeldBy(parent).shared, 0);
  EXPECT_EQ(HeldBy(parent).pages[0], before.pages[0]);
  // A cache without the page to copy into refuses the append, and both stay as they were.
  const std::string grandchild = ForkOf("", parent, kPageRows + 9);
  ASSERT_EQ(TruncateTo(grandchild, 3), absl::OkStatus());
  CreateWith("", store_->Room().pages_free * kPageRows);  // fills the cache
  ASSERT_EQ(store_->Room().pages_free, 0);
  const absl::Status full = AppendRows("", grandchild, 1);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HeldBy(grandchild).pages, std::vector<int32_t>{before.pages[0]});
  EXPECT_EQ(HeldBy(grandchild).shared, 1);
}

TEST_F(SessionStoreTest, PagesGoWithTheirLastSessionInEitherOrder) {
  SCOPED_TRACE(seed_);
  for (const bool parent_first : {true, false}) {
    SCOPED_TRACE(parent_first ? "parent first" : "child first");
    Make({12});
    const std::string parent = CreateWith("", 4 * kPageRows + 1);  // 5 pages
    const std::string child = ForkOf("", parent, 3 * kPageRows + 3);
    const std::string grandchild = ForkOf("", child, 2 * kPageRows);
    EXPECT_EQ(store_->Room().pages_free, 12 - 5 - 1);
    ASSERT_EQ(AppendRows("", grandchild, kPageRows + 1), absl::OkStatus());  // 2 of its own
    EXPECT_EQ(store_->Room().pages_free, 4);
    const std::string first = parent_first ? parent : grandchild;
    const std::string last = parent_first ? grandchild : parent;
    ASSERT_EQ(store_->Drop("", first), absl::OkStatus());
    // Parent first: its last two pages go (the child holds the first three); grandchild first:
    // its own two go.
    EXPECT_EQ(store_->Room().pages_free, 6);
    ASSERT_EQ(store_->Drop("", child), absl::OkStatus());
    // Then the child's copied page and, parent first, its third; grandchild first, the pages
    // only the child and the parent held stay with the parent.
    EXPECT_EQ(store_->Room().pages_free, parent_first ? 8 : 7);
    // A session held by a call frees its pages when the call ends.
    absl::StatusOr<std::vector<SessionStore::Lease>> held = store_->Acquire("", {last});
    ASSERT_TRUE(held.ok()) << held.status();
    ASSERT_EQ(store_->Drop("", last), absl::OkStatus());
    EXPECT_LT(store_->Room().pages_free, 12);
    held->clear();
    EXPECT_EQ(store_->Room().pages_free, 12);
  }
}

TEST_F(SessionStoreTest, ForkNeedsAFreePageForItsPartialPage) {
  SCOPED_TRACE(seed_);
  Make({3});
  const std::string parent = CreateWith("", 2 * kPageRows);
  CreateWith("", 1);  // fills the cache
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {parent});
  ASSERT_TRUE(leases.ok()) << leases.status();
  absl::StatusOr<SessionStore::Lease> refused = store_->Fork(leases->front(), kPageRows + 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("needs 4096 bytes"), HasSubstr("0 bytes free on dev0")));
  // At a page's end it needs none.
  absl::StatusOr<SessionStore::Lease> shared = store_->Fork(leases->front(), 2 * kPageRows);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(store_->List("").size(), 3u);
}

TEST_F(SessionStoreTest, FullCacheRefusesWithBytesNeededAndFree) {
  SCOPED_TRACE(seed_);
  Make({4});
  const std::string id = CreateWith("", 3 * kPageRows);  // 3 of 4 pages
  absl::StatusOr<SessionStore::Lease> big = CreateOnEmptiest(*store_, "", 2 * kPageRows);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), AllOf(HasSubstr("8192 bytes"), HasSubstr("4096 bytes free")));
  absl::Status append = AppendRows("", id, kPageRows + 1);  // needs 2 pages, 1 free
  EXPECT_EQ(append.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(append.message(), AllOf(HasSubstr("need 8192 bytes"), HasSubstr("4096 bytes free"),
                                      HasSubstr("nothing was appended")));
  // Nothing changed: the session keeps its rows and pages, the last page is still free.
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].length, 3 * kPageRows);
  EXPECT_EQ(list[0].pages, 3);
  EXPECT_EQ(store_->Room().pages_free, 1);
  EXPECT_EQ(AppendRows("", id, kPageRows), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 0);
}

TEST_F(SessionStoreTest, ReserveIsAllOrNothingOverSessions) {
  SCOPED_TRACE(seed_);
  Make({4});
  const std::string a = CreateWith("", kPageRows);
  const std::string b = CreateWith("", kPageRows);
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {a, b});
  ASSERT_TRUE(leases.ok()) << leases.status();
  SessionStore::Lease* held[] = {&(*leases)[0], &(*leases)[1]};
  const int64_t too_many[] = {kPageRows, 2 * kPageRows};  // 3 pages, 2 free
  EXPECT_EQ(store_->Reserve(held, too_many).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*leases)[0].page_table().size(), 1u);
  EXPECT_EQ((*leases)[1].page_table().size(), 1u);
  const int64_t fits[] = {kPageRows, kPageRows};
  EXPECT_EQ(store_->Reserve(held, fits), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 0);
}

TEST_F(SessionStoreTest, IdleSessionsExpireAfterTtl) {
  SCOPED_TRACE(seed_);
  Make({4}, absl::Seconds(10));
  const std::string swept = CreateWith("", 1);
  const std::string lazy = CreateWith("", 1);
  clock_.Advance(absl::Seconds(9));
  EXPECT_EQ(store_->Sweep(), 0);
  EXPECT_EQ(AppendRows("", lazy, 1), absl::OkStatus());  // used: its 10 s start again
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 2u);
  for (const SessionSnapshot& s : list) {
    EXPECT_EQ(s.idle, s.id == swept ? absl::Seconds(9) : absl::ZeroDuration());
    EXPECT_EQ(s.expires_in, s.id == swept ? absl::Seconds(1) : absl::Seconds(10));
  }
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->Sweep(), 1);
  EXPECT_EQ(store_->Room().pages_free, 3);
  absl::Status gone = AppendRows("", swept, 1);
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.message(), AllOf(HasSubstr(swept), HasSubstr("expired")));
  // No sweep: the lookup itself finds it expired.
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(AppendRows("", lazy, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Room().pages_free, 4);
}

// A session of several layers: a page per layer, each layer its own length under its own id,
// one entry in the list (pages summed, the length every layer holds), and the group goes as one:
// dropped, or expired once every layer is idle past the TTL.
TEST_F(SessionStoreTest, ASessionOfLayersIsKeptAndLetGoAsOne) {
  SCOPED_TRACE(seed_);
  Make({8}, absl::Seconds(10));
  absl::StatusOr<SessionStore::Lease> created = store_->Create("", kShape, 0, 0, 3);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  created = absl::UnknownError("released");  // the lease goes
  EXPECT_EQ(store_->Room().pages_free, 5);
  EXPECT_EQ(store_->Create("", kShape, 1, 0, 2).status().code(),
            absl::StatusCode::kInvalidArgument);  // created empty
  ASSERT_EQ(AppendRows("", LayerSessionId(id, 2), 3), absl::OkStatus());
  ASSERT_EQ(AppendRows("", id, 1), absl::OkStatus());
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].id, id);
  EXPECT_EQ(list[0].layers, 3);
  EXPECT_EQ(list[0].layer_lengths, (std::vector<int64_t>{1, 0, 3}));
  EXPECT_EQ(list[0].length, 0);
  EXPECT_EQ(list[0].pages, 3);
  // A layer's id is the store's own: callers' Locate and Drop do not find it.
  EXPECT_EQ(store_->Locate("", LayerSessionId(id, 1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Drop("", LayerSessionId(id, 1)).code(), absl::StatusCode::kNotFound);
  absl::StatusOr<SessionStore::Place> place = store_->Locate("", id);
  ASSERT_TRUE(place.ok()) << place.status();
  EXPECT_EQ(place->layers, 3);
  // Layer 1 is used now, the others 9 s ago: at 10 s the group stays (one layer is not idle past
  // the TTL, even looked up by an idle layer), at 19 s it goes, every layer at once.
  clock_.Advance(absl::Seconds(9));
  ASSERT_EQ(AppendRows("", LayerSessionId(id, 1), 1), absl::OkStatus());
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(store_->Sweep(), 0);
  EXPECT_EQ(AppendRows("", LayerSessionId(id, 2), 1), absl::OkStatus());
  ASSERT_EQ(store_->List("").size(), 1u);
  EXPECT_EQ(store_->List("")[0].expires_in, absl::Seconds(10));
  clock_.Advance(absl::Seconds(10));
  EXPECT_EQ(store_->Sweep(), 1);
  EXPECT_EQ(store_->Room().pages_free, 8);
  EXPECT_EQ(AppendRows("", LayerSessionId(id, 1), 1).code(), absl::StatusCode::kNotFound);
  // Dropped as one.
  absl::StatusOr<SessionStore::Lease> again = store_->Create("", kShape, 0, 0, 4);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::string second = again->id();
  again = absl::UnknownError("released");
  EXPECT_EQ(store_->Room().pages_free, 4);
  ASSERT_EQ(store_->Drop("", second), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 8);
  EXPECT_TRUE(store_->List("").empty());
}

// An import's session: created under the id it names, refused ALREADY_EXISTS when one has it
// (another owner's too); and a fork of every layer, all or nothing.
TEST_F(SessionStoreTest, CreateUnderAGivenIdAndForkEveryLayer) {
  SCOPED_TRACE(seed_);
  Make({7});
  const std::string id(32, 'a');
  absl::StatusOr<SessionStore::Lease> created = store_->Create("", kShape, 0, 0, 2, id);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->id(), id);
  created = absl::UnknownError("released");
  absl::StatusOr<SessionStore::Lease> again = store_->Create("other", kShape, 0, 0, 1, id);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("session_id: expected an id no session has"));
  ASSERT_EQ(AppendRows("", id, 3), absl::OkStatus());
  ASSERT_EQ(AppendRows("", LayerSessionId(id, 1), 5), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 5);

  absl::StatusOr<std::vector<SessionStore::Lease>> parents =
      store_->Acquire("", {id, LayerSessionId(id, 1)});
  ASSERT_TRUE(parents.ok()) << parents.status();
  absl::StatusOr<SessionStore::Lease> child = store_->ForkLayers(*parents, std::nullopt);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string child_id = child->id();
  child = absl::UnknownError("released");
  parents = absl::UnknownError("released");
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 2u);
  const SessionSnapshot& forked = list[0].id == child_id ? list[0] : list[1];
  EXPECT_EQ(forked.layer_lengths, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(store_->Room().pages_free, 3);  // a copy of each layer's partial page

  // Room for one layer's copy only: nothing is kept.
  ASSERT_EQ(AppendRows("", child_id, 1), absl::OkStatus());  // its own page already
  const std::string filler = CreateWith("", 1);
  EXPECT_EQ(store_->Room().pages_free, 2);
  const std::string more = CreateWith("", 1);
  EXPECT_EQ(store_->Room().pages_free, 1);
  parents = store_->Acquire("", {id, LayerSessionId(id, 1)});
  ASSERT_TRUE(parents.ok()) << parents.status();
  EXPECT_EQ(store_->ForkLayers(*parents, 2).status().code(), absl::StatusCode::kResourceExhausted);
  parents = absl::UnknownError("released");
  EXPECT_EQ(store_->List("").size(), 4u);
  EXPECT_EQ(store_->Room().pages_free, 1);
}

// A sealed session (an export's, for a move): every layer refuses a change, UNAVAILABLE naming
// the session (not the layer), with nothing held; an export still holds it, and Drop drops it.
TEST_F(SessionStoreTest, ASealedSessionRefusesChangesButNotExports) {
  SCOPED_TRACE(seed_);
  Make({7});
  const std::string id(32, 'b');
  ASSERT_TRUE(store_->Create("", kShape, 0, 0, 2, id).ok());
  ASSERT_EQ(AppendRows("", id, 3), absl::OkStatus());
  const std::string other = CreateWith("", 2);
  const std::string layer1 = LayerSessionId(id, 1);
  const std::vector<absl::string_view> layers = {id, layer1};
  {
    absl::StatusOr<std::vector<SessionStore::Lease>> held =
        store_->Acquire("", layers, SessionStore::Access::kExport);
    ASSERT_TRUE(held.ok()) << held.status();
    for (SessionStore::Lease& layer : *held) store_->Seal(layer);
  }
  for (const std::vector<absl::string_view>& ids :
       {layers, std::vector<absl::string_view>{layer1}, {other, id}}) {
    absl::StatusOr<std::vector<SessionStore::Lease>> refused = store_->Acquire("", ids);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << ids.size();
    EXPECT_TRUE(absl::StartsWith(refused.status().message(),
                                 absl::StrCat(kSealedMarker, "session '", id,
                                              "' was sealed by an Export for a move to another "
                                              "replica")))
        << refused.status();
  }
  EXPECT_EQ(AppendRows("", id, 1).code(), absl::StatusCode::kUnavailable);
  // Nothing was left held: the other session takes a change, the sealed one an export.
  EXPECT_EQ(AppendRows("", other, 1), absl::OkStatus());
  absl::StatusOr<std::vector<SessionStore::Lease>> exported =
      store_->Acquire("", layers, SessionStore::Access::kExport);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->front().length(), 3);
  exported = absl::UnknownError("released");
  EXPECT_EQ(store_->Drop("", id), absl::OkStatus());
  EXPECT_EQ(store_->List("").size(), 1u);
}

TEST_F(SessionStoreTest, ASessionDroppedSealedIsRefusedAsSealedUntilCreatedAgain) {
  // Moved away by a drain (sealed, then dropped): calls that still reach this store get the
  // sealed refusal, which clients retry where the router sends them now; another owner, and a
  // session dropped unsealed, get NOT_FOUND; an id created here again is an ordinary one.
  SCOPED_TRACE(seed_);
  Make({8});
  const std::string moved(32, 'c');
  ASSERT_TRUE(store_->Create("", kShape, 0, 0, 1, moved).ok());
  const std::string dropped = CreateWith("", 1);
  {
    absl::StatusOr<std::vector<SessionStore::Lease>> held =
        store_->Acquire("", {moved}, SessionStore::Access::kExport);
    ASSERT_TRUE(held.ok()) << held.status();
    store_->Seal(held->front());
  }
  ASSERT_EQ(store_->Drop("", moved), absl::OkStatus());
  ASSERT_EQ(store_->Drop("", dropped), absl::OkStatus());
  const std::string sealed = absl::StrCat(kSealedMarker, "session '", moved, "' was sealed");
  absl::StatusOr<SessionStore::Place> located = store_->Locate("", moved);
  EXPECT_EQ(located.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(located.status().message(), sealed)) << located.status();
  EXPECT_EQ(AppendRows("", moved, 1).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store_->Acquire("", {moved}, SessionStore::Access::kExport).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(store_->Locate("other", moved).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Locate("", dropped).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Drop("", moved).code(), absl::StatusCode::kNotFound);
  // Moved back here (an Import under its id): an ordinary session, NOT_FOUND once dropped.
  ASSERT_TRUE(store_->Create("", kShape, 0, 0, 1, moved).ok());
  EXPECT_EQ(AppendRows("", moved, 2), absl::OkStatus());
  ASSERT_EQ(store_->Drop("", moved), absl::OkStatus());
  EXPECT_EQ(store_->Locate("", moved).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionStoreTest, HeldSessionsDoNotExpire) {
  SCOPED_TRACE(seed_);
  Make({2}, absl::Seconds(10));
  const std::string id = CreateWith("", 1);
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
  ASSERT_TRUE(leases.ok());
  clock_.Advance(absl::Seconds(60));
  EXPECT_EQ(store_->Sweep(), 0);
  leases->clear();  // released now: idle from now on
  EXPECT_EQ(store_->Sweep(), 0);
  EXPECT_EQ(AppendRows("", id, 1), absl::OkStatus());
}

TEST_F(SessionStoreTest, OwnersSeeOnlyTheirSessions) {
  SCOPED_TRACE(seed_);
  Make({4});
  const std::string mine = CreateWith("token-a", 1);
  EXPECT_EQ(AppendRows("token-b", mine, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Drop("token-b", mine).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->List("token-b").empty());
  EXPECT_EQ(store_->List("token-a").size(), 1u);
  EXPECT_EQ(AppendRows("token-a", mine, 1), absl::OkStatus());
}

TEST_F(SessionStoreTest, DropFreesPagesWhenNoCallHoldsThem) {
  SCOPED_TRACE(seed_);
  Make({4});
  const std::string a = CreateWith("", 2 * kPageRows);
  const std::string b = CreateWith("", 1);
  EXPECT_EQ(store_->Room().pages_free, 1);
  EXPECT_EQ(store_->Drop("", a), absl::OkStatus());
  EXPECT_EQ(store_->Room().pages_free, 3);
  EXPECT_EQ(store_->Drop("", a).code(), absl::StatusCode::kNotFound);
  // Dropped while a call holds it: gone at once, its page freed when the call ends.
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {b});
  ASSERT_TRUE(leases.ok());
  EXPECT_EQ(store_->Drop("", b), absl::OkStatus());
  EXPECT_TRUE(store_->List("").empty());
  EXPECT_EQ(store_->Room().pages_free, 3);
  leases->clear();
  EXPECT_EQ(store_->Room().pages_free, 4);
}

TEST_F(SessionStoreTest, NewSessionsGoToTheDeviceWithTheMostFreePages) {
  SCOPED_TRACE(seed_);
  Make({3, 5});
  CreateWith("", 3 * kPageRows);  // dev1: 5 -> 2 free
  CreateWith("", 1);              // dev0 has 3 free now
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 2u);
  for (const SessionSnapshot& s : list) EXPECT_EQ(s.device, s.pages == 3 ? "dev1" : "dev0");
  EXPECT_EQ(store_->Room().pages_total, 8);
  EXPECT_EQ(store_->Room().pages_free, 4);
}

TEST(SessionStoreHealthTest, LostDevicesGetNoNewSessions) {
  Pools pools;
  std::vector<KvDevice> devices = pools.Devices({3, 5});
  std::atomic<bool> dev1_lost{false};
  devices[1].health = [&dev1_lost] {
    return dev1_lost ? absl::InternalError("context lost") : absl::OkStatus();
  };
  devices[0].health = [] { return absl::InternalError("context lost"); };
  SessionStore store(std::move(devices), SessionStoreOptions{});
  // dev0 is lost: the session goes to dev1 even though both have room.
  absl::StatusOr<SessionStore::Lease> first = CreateOnEmptiest(store, "", 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(store.device_name(first->device()), "dev1");
  dev1_lost = true;
  absl::StatusOr<SessionStore::Lease> second = CreateOnEmptiest(store, "", 1);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("every device is out of service"));
}

TEST_F(SessionStoreTest, ConcurrentCallsOnOneSessionRunOneAtATime) {
  SCOPED_TRACE(seed_);
  Make({8});
  const std::string id = CreateWith("", 0);
  constexpr int kThreads = 4, kAppends = 25;
  std::vector<std::thread> threads;
  std::vector<absl::Status> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed_ + t);
      for (int i = 0; i < kAppends; ++i) {
        Rows data(1, rng);
        absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
        if (!leases.ok()) {
          failures[t] = leases.status();
          return;
        }
        SessionStore::Lease* held[] = {&leases->front()};
        const int64_t one[] = {1};
        absl::Status s = store_->Reserve(held, one);
        if (s.ok()) s = store_->Append(leases->front(), data.view);
        if (!s.ok()) {
          failures[t] = s;
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : failures) EXPECT_EQ(s, absl::OkStatus());
  std::vector<SessionSnapshot> list = store_->List("");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].length, kThreads * kAppends);
  EXPECT_EQ(list[0].pages, (kThreads * kAppends + kPageRows - 1) / kPageRows);
}

// Shared prefixes (Create's prefix_tokens over rows named by NameTokens).
class PrefixTest : public SessionStoreTest {
 protected:
  // `n` distinct fresh token ids.
  std::vector<int64_t> Tokens(int64_t n) {
    std::vector<int64_t> tokens(n);
    for (int64_t& t : tokens) t = static_cast<int64_t>(rng_() >> 1);
    return tokens;
  }
  // A session of `owner` holding rows of `tokens` (each named); returns its id.
  std::string CreateNamed(const std::string& owner, const std::vector<int64_t>& tokens) {
    const std::string id = CreateWith(owner, static_cast<int64_t>(tokens.size()));
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    EXPECT_TRUE(leases.ok()) << leases.status();
    if (leases.ok()) EXPECT_EQ(store_->NameTokens(leases->front(), tokens), absl::OkStatus());
    return id;
  }
  absl::StatusOr<SessionStore::Lease> FromPrefix(const std::string& owner,
                                                 absl::Span<const int64_t> prefix, int layers = 1,
                                                 const KvShape& shape = kShape) {
    return store_->Create(owner, shape, 0, 0, layers, {}, prefix);
  }
  // Rows [0, rows) of session `id`'s k, BHSD [Hkv, rows, D].
  std::vector<float> KOf(const std::string& id, int64_t rows, const std::string& owner = "") {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    EXPECT_TRUE(leases.ok()) << leases.status();
    if (!leases.ok()) return {};
    std::vector<float> k(kShape.heads_kv * rows * kShape.head_dim), v(k.size());
    EXPECT_EQ(store_->Read(leases->front(), 0, rows, k.data(), v.data()), absl::OkStatus());
    return k;
  }
  CacheRoom Room() { return store_->Room(); }
  // Pages free, and cached that no session holds.
  std::pair<int64_t, int64_t> FreeAndCached() {
    const CacheRoom room = store_->Room();
    return {room.pages_free, room.pages_cached};
  }
  // The rows a new session of `owner` from `prefix` found (the session stays, unleased).
  int64_t FoundRows(absl::Span<const int64_t> prefix, const std::string& owner = "") {
    absl::StatusOr<SessionStore::Lease> lease = FromPrefix(owner, prefix);
    EXPECT_TRUE(lease.ok()) << lease.status();
    return lease.ok() ? lease->length() : -1;
  }
  // A store of `pages` pages holding one session of two full pages of named rows.
  struct TwoPages {
    std::vector<int64_t> tokens;
    std::string id;
    std::vector<float> k;  // its rows' k, BHSD [Hkv, 2 * kPageRows, D]
  };
  TwoPages MakeWithTwoPages(int64_t pages) {
    Make({pages});
    TwoPages out;
    out.tokens = Tokens(2 * kPageRows);
    out.id = CreateNamed("", out.tokens);
    out.k = KOf(out.id, 2 * kPageRows);
    return out;
  }
  // The id of a new session from `prefix` (unleased).
  std::string FromPrefixId(absl::Span<const int64_t> prefix) {
    absl::StatusOr<SessionStore::Lease> lease = FromPrefix("", prefix);
    EXPECT_TRUE(lease.ok()) << lease.status();
    return lease.ok() ? lease->id() : "";
  }
};

TEST_F(PrefixTest, ASessionFromAPrefixSharesTheFullPagesFound) {
  SCOPED_TRACE(seed_);
  Make({10});
  const std::vector<int64_t> tokens = Tokens(3 * kPageRows + 5);
  const std::string first = CreateNamed("", tokens);  // 4 pages, 3 of them full: 3 blocks
  EXPECT_EQ(Room().pages_free, 6);
  absl::StatusOr<SessionStore::Lease> second = FromPrefix("", tokens);
  ASSERT_TRUE(second.ok()) << second.status();
  // The partial last page is never shared; the three full ones are, and cost no page.
  EXPECT_EQ(second->length(), 3 * kPageRows);
  EXPECT_EQ(store_->Snapshot(*second).prefix_rows, 3 * kPageRows);
  const std::vector<int32_t> pages = HeldBy(first).pages;
  EXPECT_EQ(second->page_table(), std::vector<int32_t>(pages.begin(), pages.begin() + 3));
  EXPECT_EQ(Room().pages_free, 6);
  const std::string id = second->id();
  *second = SessionStore::Lease();
  EXPECT_EQ(KOf(id, 3 * kPageRows), KOf(first, 3 * kPageRows));
  // A prefix that differs in its second page finds only the first; one shorter than a page finds
  // none and the session gets its own empty page.
  std::vector<int64_t> other = tokens;
  other[kPageRows + 7] ^= 1;
  EXPECT_EQ(FoundRows(other), kPageRows);
  absl::StatusOr<SessionStore::Lease> none =
      FromPrefix("", absl::MakeConstSpan(tokens).first(kPageRows - 1));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->length(), 0);
  EXPECT_EQ(store_->Snapshot(*none).prefix_rows, 0);
  EXPECT_EQ(Room().pages_free, 5);
  *none = SessionStore::Lease();
  // k, v and a prefix together are refused.
  absl::StatusOr<SessionStore::Lease> both = store_->Create("", kShape, 1, 0, 1, {}, tokens);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("k, v: expected none with prefix_tokens"));
  // More tokens than rows are refused by name.
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
  ASSERT_TRUE(leases.ok()) << leases.status();
  EXPECT_THAT(store_->NameTokens(leases->front(), Tokens(3 * kPageRows + 1)).message(),
              HasSubstr(absl::StrCat("tokens: expected at most ", 3 * kPageRows, " (the rows")));
}

TEST_F(PrefixTest, OwnersShapesAndLayerCountsNeverShare) {
  SCOPED_TRACE(seed_);
  std::vector<KvDevice> devices = pools_.Devices({10});
  devices[0].v_head_dim = true;
  store_ = std::make_unique<SessionStore>(std::move(devices), SessionStoreOptions{});
  const std::vector<int64_t> tokens = Tokens(2 * kPageRows);
  CreateNamed("tenant-a", tokens);
  // The last shape differs only in its V head dim, with as many rows a page (2 * (8 + 7) float32s
  // a row: 34 rows, 32 when rounded down to 16s).
  for (const auto& [owner, layers, shape] :
       {std::tuple<std::string, int, KvShape>{"tenant-b", 1, kShape},
        {"", 1, kShape},
        {"tenant-a", 2, kShape},
        {"tenant-a", 1, KvShape{.dtype = DType::kFloat32, .heads_kv = 1, .head_dim = 16}},
        {"tenant-a", 1,
         KvShape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 8, .v_head_dim = 7}}}) {
    ASSERT_EQ(store_->PageRowsFor(shape), kPageRows);
    absl::StatusOr<SessionStore::Lease> lease = FromPrefix(owner, tokens, layers, shape);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->length(), 0) << owner << " " << layers;
  }
  EXPECT_EQ(FoundRows(tokens, "tenant-a"), 2 * kPageRows);
}

TEST_F(PrefixTest, UnheldCachedPagesAreTakenBackLeastRecentlyReleasedFirst) {
  SCOPED_TRACE(seed_);
  Make({6});
  const std::vector<int64_t> kept = Tokens(3 * kPageRows), lost = Tokens(2 * kPageRows);
  ASSERT_EQ(store_->Drop("", CreateNamed("", kept)), absl::OkStatus());
  EXPECT_EQ(FreeAndCached(), (std::pair<int64_t, int64_t>(3, 3)));
  ASSERT_EQ(store_->Drop("", CreateNamed("", lost)), absl::OkStatus());
  EXPECT_EQ(FreeAndCached(), (std::pair<int64_t, int64_t>(1, 5)));
  // Found again, `kept` is used later than `lost`: `lost`'s pages go first.
  absl::StatusOr<SessionStore::Lease> again = FromPrefix("", kept);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->length(), 3 * kPageRows);
  EXPECT_EQ(Room().pages_cached, 2);
  ASSERT_EQ(store_->Drop("", again->id()), absl::OkStatus());
  *again = SessionStore::Lease();
  EXPECT_EQ(Room().pages_cached, 5);
  // 3 pages: the free one and `lost`'s two.
  const std::string big = CreateWith("", 3 * kPageRows);
  EXPECT_EQ(FreeAndCached(), (std::pair<int64_t, int64_t>(0, 3)));
  EXPECT_EQ(FoundRows(lost), 0);
  EXPECT_EQ(Room().pages_cached, 2);
  // Its new page was `kept`'s last block's (the first of them released): the rest stays found.
  EXPECT_EQ(FoundRows(kept), 2 * kPageRows);
}

TEST_F(PrefixTest, PagesASessionHoldsAreNeverTakenBack) {
  SCOPED_TRACE(seed_);
  const auto [tokens, first, k] = MakeWithTwoPages(4);
  const std::string id = FromPrefixId(tokens);
  ASSERT_EQ(store_->Drop("", first), absl::OkStatus());  // `id` still holds both pages
  EXPECT_EQ(Room().pages_cached, 0);
  CreateWith("", 2 * kPageRows);
  absl::StatusOr<SessionStore::Lease> refused = CreateOnEmptiest(*store_, "", 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(KOf(id, 2 * kPageRows), k);
}

TEST_F(PrefixTest, AnAppendIntoACachedPageCopiesItFirst) {
  SCOPED_TRACE(seed_);
  const auto [tokens, first, k] = MakeWithTwoPages(10);
  // Cut into the second cached page and appended to: by its only holder, then by one of two.
  for (const bool alone : {false, true}) {
    SCOPED_TRACE(alone);
    const std::string id = FromPrefixId(tokens);
    if (alone) ASSERT_EQ(store_->Drop("", first), absl::OkStatus());
    ASSERT_EQ(TruncateTo(id, kPageRows + 3), absl::OkStatus());
    ASSERT_EQ(AppendRows("", id, 10), absl::OkStatus());
    // Its rows kept: the first kPageRows + 3 of each head's.
    std::vector<float> kept;
    const int64_t head = 2 * kPageRows * kShape.head_dim;
    for (int64_t h = 0; h < kShape.heads_kv; ++h) {
      kept.insert(kept.end(), k.begin() + h * head,
                  k.begin() + h * head + (kPageRows + 3) * kShape.head_dim);
    }
    EXPECT_EQ(KOf(id, kPageRows + 3), kept);
    const std::string found = FromPrefixId(tokens);
    EXPECT_EQ(HeldBy(found).length, 2 * kPageRows);
    EXPECT_EQ(KOf(found, 2 * kPageRows), k);
    ASSERT_EQ(store_->Drop("", found), absl::OkStatus());
    ASSERT_EQ(store_->Drop("", id), absl::OkStatus());
  }
}

TEST_F(PrefixTest, ABlockOfSeveralLayersIsCachedOnceEveryLayerHoldsIt) {
  SCOPED_TRACE(seed_);
  Make({10});
  const std::vector<int64_t> tokens = Tokens(kPageRows);
  absl::StatusOr<SessionStore::Lease> created = store_->Create("", kShape, 0, 0, 2);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  *created = SessionStore::Lease();
  std::vector<int32_t> pages;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string layer_id = LayerSessionId(id, layer);
    ASSERT_EQ(AppendRows("", layer_id, kPageRows), absl::OkStatus());
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {layer_id});
    ASSERT_TRUE(leases.ok()) << leases.status();
    ASSERT_EQ(store_->NameTokens(leases->front(), tokens), absl::OkStatus());
    pages.push_back(leases->front().page_table()[0]);
    leases->clear();
    absl::StatusOr<SessionStore::Lease> lease = FromPrefix("", tokens, 2);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->length(), layer == 0 ? 0 : kPageRows);
    ASSERT_EQ(store_->Drop("", lease->id()), absl::OkStatus());
  }
  absl::StatusOr<SessionStore::Lease> found = FromPrefix("", tokens, 2);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->page_table(), std::vector<int32_t>{pages[0]});
  EXPECT_EQ(HeldBy(LayerSessionId(found->id(), 1)).pages, std::vector<int32_t>{pages[1]});
}

// The host tier (session_store.h): sessions of known rows over a pool of 4 pages and a host tier
// of 4, each created a second after the last, so the least recently used is the first.
class HostTierTest : public SessionStoreTest {
 protected:
  void SetUp() override { Make({4}, absl::Seconds(600), "", 4); }

  struct Written {
    std::string id;
    std::vector<float> k, v;
  };
  // A session of `rows` random rows, created and released a second after the last.
  Written CreateKnown(int64_t rows) {
    clock_.Advance(absl::Seconds(1));
    Rows data(rows, rng_);
    absl::StatusOr<SessionStore::Lease> lease = store_->Create("", kShape, rows, 0);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return {};
    EXPECT_EQ(store_->Append(*lease, data.view), absl::OkStatus());
    return {lease->id(), data.k, data.v};
  }
  // Its rows as Read gives them (Acquire brings them back first), equal bit for bit.
  void ExpectRows(const Written& s, int64_t rows) {
    clock_.Advance(absl::Seconds(1));
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {s.id});
    ASSERT_TRUE(leases.ok()) << leases.status();
    ASSERT_EQ(leases->front().length(), rows);
    std::vector<float> k(s.k.size()), v(s.v.size());
    ASSERT_EQ(store_->Read(leases->front(), 0, rows, k.data(), v.data()), absl::OkStatus());
    EXPECT_EQ(std::memcmp(k.data(), s.k.data(), k.size() * sizeof(float)), 0) << s.id;
    EXPECT_EQ(std::memcmp(v.data(), s.v.data(), v.size() * sizeof(float)), 0) << s.id;
  }
  SessionSnapshot SnapshotOf(const std::string& id) {
    for (const SessionSnapshot& s : store_->List("")) {
      if (s.id == id) return s;
    }
    ADD_FAILURE() << id << " not listed";
    return {};
  }
};

TEST_F(HostTierTest, ColdSessionsMoveOutAndComeBackBitForBit) {
  SCOPED_TRACE(seed_);
  const Written a = CreateKnown(2 * kPageRows);  // 2 pages each
  const Written b = CreateKnown(2 * kPageRows - 3);
  EXPECT_EQ(store_->Room().pages_free, 0);
  // The pool is full: the least recently used session's pages go to the host tier.
  const Written c = CreateKnown(kPageRows + 1);
  EXPECT_EQ(SnapshotOf(a.id).host_pages, 2);
  EXPECT_EQ(SnapshotOf(a.id).resident_bytes, 0);
  EXPECT_EQ(SnapshotOf(b.id).host_pages, 0);
  EXPECT_EQ(spilled_, 2);
  EXPECT_EQ(host_bytes_used_, 2 * kPageBytes);
  // Each session's next call brings it back, moving the coldest other one out.
  ExpectRows(a, 2 * kPageRows);
  EXPECT_EQ(SnapshotOf(a.id).host_pages, 0);
  EXPECT_EQ(SnapshotOf(b.id).host_pages, 2);
  EXPECT_EQ(restored_, 2);
  EXPECT_EQ(spilled_, 4);
  ExpectRows(b, 2 * kPageRows - 3);
  ExpectRows(c, kPageRows + 1);
  ExpectRows(a, 2 * kPageRows);
  // A session appended to after its return holds its old rows and the new ones.
  ASSERT_EQ(AppendRows("", b.id, 2), absl::OkStatus());
  EXPECT_EQ(SnapshotOf(b.id).length, 2 * kPageRows - 1);
  // Dropping a session on the host tier frees its slots there.
  const int64_t used = host_bytes_used_;
  const std::string on_host = SnapshotOf(a.id).host_pages > 0 ? a.id : c.id;
  ASSERT_GT(SnapshotOf(on_host).host_pages, 0);
  const int64_t its = SnapshotOf(on_host).host_pages * kPageBytes;
  EXPECT_EQ(store_->Drop("", on_host), absl::OkStatus());
  EXPECT_EQ(host_bytes_used_, used - its);
}

TEST_F(HostTierTest, AHeldSessionNeverMoves) {
  SCOPED_TRACE(seed_);
  const Written a = CreateKnown(2 * kPageRows);
  const Written b = CreateKnown(2 * kPageRows);
  // The coldest session is in use: the next coldest moves instead.
  absl::StatusOr<std::vector<SessionStore::Lease>> held = store_->Acquire("", {a.id});
  ASSERT_TRUE(held.ok()) << held.status();
  const std::vector<int32_t> pages = held->front().page_table();
  const Written c = CreateKnown(2 * kPageRows);
  EXPECT_EQ(held->front().page_table(), pages);
  EXPECT_EQ(SnapshotOf(b.id).host_pages, 2);
  // With every other session held too, nothing can move: refused, nothing moved.
  absl::StatusOr<std::vector<SessionStore::Lease>> more = store_->Acquire("", {c.id});
  ASSERT_TRUE(more.ok()) << more.status();
  absl::StatusOr<SessionStore::Lease> refused = store_->Create("", kShape, 1, 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(SnapshotOf(b.id).host_pages, 2);
  // A held session's append takes room from the cold ones only.
  SessionStore::Lease* leases[] = {&held->front()};
  const int64_t new_rows[] = {1};
  EXPECT_EQ(store_->Reserve(leases, new_rows).code(), absl::StatusCode::kResourceExhausted);
  held->clear();
  more->clear();
  ExpectRows(a, 2 * kPageRows);
  ExpectRows(b, 2 * kPageRows);
  ExpectRows(c, 2 * kPageRows);
}

TEST_F(HostTierTest, BothFullIsRefusedNamingBothBudgets) {
  SCOPED_TRACE(seed_);
  const Written a = CreateKnown(2 * kPageRows);
  const Written b = CreateKnown(2 * kPageRows);
  const Written c = CreateKnown(2 * kPageRows);
  const Written d = CreateKnown(2 * kPageRows);
  EXPECT_EQ(host_bytes_used_, 4 * kPageBytes);
  for (const int64_t rows : {int64_t{1}, 2 * kPageRows}) {
    absl::StatusOr<SessionStore::Lease> refused = store_->Create("", kShape, rows, 0);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.status().message(),
                AllOf(HasSubstr("KV cache full"),
                      HasSubstr(absl::StrCat("its KV pool: ", 4 * kPageBytes, " bytes")),
                      HasSubstr(absl::StrCat("its host tier: 0 of ", 4 * kPageBytes,
                                             " bytes free, --kv_host_bytes"))))
        << refused.status();
  }
  // Nothing moved for the refused calls; a session on the host tier still comes back (the
  // coldest in the pool takes its place), and every one holds its rows.
  EXPECT_EQ(SnapshotOf(a.id).host_pages + SnapshotOf(b.id).host_pages, 4);
  ExpectRows(a, 2 * kPageRows);
  ExpectRows(b, 2 * kPageRows);
  ExpectRows(c, 2 * kPageRows);
  ExpectRows(d, 2 * kPageRows);
  // Without a host tier the message says so.
  Make({1});
  absl::StatusOr<SessionStore::Lease> refused = store_->Create("", kShape, 2 * kPageRows, 0);
  EXPECT_THAT(refused.status().message(), HasSubstr("no host tier, --kv_host_bytes 0"));
}

// Pages a fork shares stay in the pool (they are not only the cold session's); a session on the
// host tier is forked, truncated and exported after coming back.
TEST_F(HostTierTest, SharedPagesStayAndSpilledSessionsForkAndTruncate) {
  SCOPED_TRACE(seed_);
  const Written a = CreateKnown(kPageRows + 3);           // 2 pages, the last partial
  const std::string child = ForkOf("", a.id, kPageRows);  // shares a's first page
  clock_.Advance(absl::Seconds(1));
  const Written b = CreateKnown(1);
  // Pool: a's 2 pages (one shared with the child), b's and one free. The next session needs 2:
  // a's unshared page moves (the child's only page is the shared one; b is the warmest).
  const Written c = CreateKnown(2 * kPageRows);
  const SessionSnapshot parent = SnapshotOf(a.id);
  EXPECT_EQ(parent.host_pages, 1);
  EXPECT_EQ(parent.shared_pages, 1);
  EXPECT_EQ(SnapshotOf(child).host_pages, 0);  // its only page is the shared one
  // Fork and truncate of the session on the host tier, then its rows read back.
  const std::string grandchild = ForkOf("", a.id, kPageRows + 1);
  ASSERT_FALSE(grandchild.empty());
  ASSERT_EQ(TruncateTo(a.id, kPageRows + 2), absl::OkStatus());
  Written cut = a;
  for (std::vector<float>* t : {&cut.k, &cut.v}) {
    // BHSD [Hkv, rows, D]: the first kPageRows + 2 rows of each head.
    std::vector<float> kept;
    for (int64_t h = 0; h < kShape.heads_kv; ++h) {
      const auto head = t->begin() + h * (kPageRows + 3) * kShape.head_dim;
      kept.insert(kept.end(), head, head + (kPageRows + 2) * kShape.head_dim);
    }
    *t = kept;
  }
  ExpectRows(cut, kPageRows + 2);
  ExpectRows(b, 1);
  ExpectRows(c, 2 * kPageRows);
}

// Threads appending to and reading back sessions of their own while the pool is too small for
// all of them (8 pages, 6 sessions growing to 2 pages each, a host tier of 16): every read under a
// lease gives the session's own rows bit for bit, however its pages and the others' moved between
// calls.
TEST_F(HostTierTest, ConcurrentCallsReadTheirOwnRowsWhilePagesMove) {
  SCOPED_TRACE(seed_);
  Make({8}, absl::Seconds(600), "", 16);
  // Each session grows from 20 rows (1 page) to 50 (2 pages) by 30 appends.
  constexpr int kThreads = 3, kAppends = 60;
  constexpr int64_t kInitial = 20;
  // Per session: its id and each kv head's rows (k, v), [Hkv][rows * D].
  struct Known {
    std::string id;
    std::vector<std::vector<float>> k, v;
  };
  std::vector<Known> sessions;
  for (int i = 0; i < 2 * kThreads; ++i) {
    const Written w = CreateKnown(kInitial);
    Known& known = sessions.emplace_back(Known{w.id, {}, {}});
    for (int64_t h = 0; h < kShape.heads_kv; ++h) {
      const auto at = h * kInitial * kShape.head_dim;
      known.k.emplace_back(w.k.begin() + at, w.k.begin() + at + kInitial * kShape.head_dim);
      known.v.emplace_back(w.v.begin() + at, w.v.begin() + at + kInitial * kShape.head_dim);
    }
  }
  // Empty when the lease's session reads as `s` holds it, else what differs.
  auto differs = [this](const Known& s, const SessionStore::Lease& lease) -> std::string {
    const int64_t rows = lease.length(), d = kShape.head_dim;
    std::vector<float> k(kShape.heads_kv * rows * d), v(k.size());
    if (absl::Status read = store_->Read(lease, 0, rows, k.data(), v.data()); !read.ok()) {
      return read.ToString();
    }
    for (int64_t h = 0; h < kShape.heads_kv; ++h) {
      const size_t bytes = rows * d * sizeof(float);
      if (s.k[h].size() != static_cast<size_t>(rows * d) ||
          std::memcmp(k.data() + h * rows * d, s.k[h].data(), bytes) != 0 ||
          std::memcmp(v.data() + h * rows * d, s.v[h].data(), bytes) != 0) {
        return absl::StrCat("session ", s.id, " head ", h, " at ", rows, " rows");
      }
    }
    return "";
  };
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed_ + t);
      for (int i = 0; i < kAppends && failures[t].empty(); ++i) {
        Known& s = sessions[2 * t + i % 2];
        Rows row(1, rng);
        absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {s.id});
        if (!leases.ok()) {
          failures[t] = leases.status().ToString();
          break;
        }
        SessionStore::Lease* held[] = {&leases->front()};
        const int64_t one[] = {1};
        absl::Status status = store_->Reserve(held, one);
        if (status.ok()) status = store_->Append(leases->front(), row.view);
        if (!status.ok()) {
          failures[t] = status.ToString();
          break;
        }
        for (int64_t h = 0; h < kShape.heads_kv; ++h) {
          const auto d = kShape.head_dim;
          s.k[h].insert(s.k[h].end(), row.k.begin() + h * d, row.k.begin() + (h + 1) * d);
          s.v[h].insert(s.v[h].end(), row.v.begin() + h * d, row.v.begin() + (h + 1) * d);
        }
        failures[t] = differs(s, leases->front());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& failure : failures) EXPECT_EQ(failure, "");
  EXPECT_GT(spilled_, 0);
  // 12 pages over a pool of 8: reading each session once more brings some back.
  for (const Known& s : sessions) {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {s.id});
    ASSERT_TRUE(leases.ok()) << leases.status();
    EXPECT_EQ(differs(s, leases->front()), "");
  }
  EXPECT_GT(restored_, 0);
}

}  // namespace
}  // namespace attention::server
