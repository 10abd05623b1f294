// The region registry over real POSIX shared-memory objects: mapping, bounds, owners, limits, the
// hooks, Unregister waiting for the requests that hold a region (no thread per waiting call),
// regions of an owner without a token going with its connection or when idle, another user's
// objects refused, and objects their client shrinks after registering them (refused references;
// faulting accesses repaired, not fatal).
#include "server/regions/region_registry.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// RegionRegistry::Unregister's answer, waited for.
absl::Status Unregister(RegionRegistry& registry, const std::string& owner, const std::string& name,
                        absl::Time deadline) {
  std::promise<absl::Status> answer;
  registry.Unregister(owner, name, deadline,
                      [&answer](absl::Status status) { answer.set_value(std::move(status)); });
  return answer.get_future().get();
}

// A shared-memory object of `bytes`, filled with byte i = i % 251, unlinked at the end.
class ShmObject {
 public:
  explicit ShmObject(int64_t bytes) : key_(absl::StrCat("/attn-regions-", getpid(), "-", ++n_)) {
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    data_ = static_cast<unsigned char*>(p);
    bytes_ = bytes;
    for (int64_t i = 0; i < bytes; ++i) data_[i] = static_cast<unsigned char>(i % 251);
  }
  ~ShmObject() {
    munmap(data_, bytes_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  unsigned char* data() const { return data_; }
  // As its client may: ftruncate to `bytes`. This process's own mapping must not be touched past
  // them from then on.
  void Truncate(int64_t bytes) const {
    const int fd = shm_open(key_.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    close(fd);
  }

 private:
  static inline int n_ = 0;
  std::string key_;
  unsigned char* data_ = nullptr;
  int64_t bytes_ = 0;
};

TEST(RegionRegistryTest, ResolvesBytesOfTheObjectAtItsOffset) {
  ShmObject object(3 * 4096);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 5000, 4000).ok());
  std::vector<RegionRegistry::Use> uses;
  absl::StatusOr<RegionSpan> span = registry.Resolve("me", "q.ref", "r", 100, 64, 4, &uses);
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(std::memcmp(span->data, object.data() + 5100, 64), 0);
  span->data[0] = 7;  // writes reach the client's mapping
  EXPECT_EQ(object.data()[5100], 7);
  EXPECT_EQ(registry.mapped_bytes(), 4000);
}

TEST(RegionRegistryTest, RefusesBadReferencesAndOtherOwners) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4096).ok());
  std::vector<RegionRegistry::Use> uses;
  for (auto [offset, size] :
       {std::pair<int64_t, int64_t>{4090, 8}, {-1, 8}, {0, -8}, {INT64_MAX - 2, 8}, {4097, 0}}) {
    EXPECT_EQ(registry.Resolve("me", "k.ref", "r", offset, size, 1, &uses).status().code(),
              absl::StatusCode::kInvalidArgument)
        << offset << " " << size;
  }
  EXPECT_EQ(registry.Resolve("me", "k.ref", "r", 2, 8, 4, &uses).status().code(),
            absl::StatusCode::kInvalidArgument);  // misaligned
  EXPECT_EQ(registry.Resolve("you", "k.ref", "r", 0, 8, 1, &uses).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Resolve("me", "k.ref", "s", 0, 8, 1, &uses).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(uses.empty());
  EXPECT_TRUE(registry.List("you").empty());
  EXPECT_EQ(Unregister(registry, "you", "r", absl::Now()).code(), absl::StatusCode::kNotFound);
}

// A request's further references to a region it holds (RequestRegions: a Step's entries name one
// region many times) go through the Use, with Resolve's checks and messages, and no second Use.
TEST(RegionRegistryTest, AHeldRegionServesFurtherReferencesWithTheSameChecks) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 1000, 4096).ok());
  std::vector<RegionRegistry::Use> uses;
  ASSERT_TRUE(registry.Resolve("me", "entries[0].q.ref", "r", 0, 64, 4, &uses).ok());
  ASSERT_EQ(uses.size(), 1u);
  EXPECT_EQ(uses[0].name(), "r");
  absl::StatusOr<RegionSpan> span = uses[0].Span("entries[5].k.ref", 512, 256, 4);
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->size, 256);
  span->data[0] = 9;  // byte 512 of the region: byte 1512 of the object
  EXPECT_EQ(object.data()[1512], 9);
  for (auto [offset, size, alignment] :
       {std::tuple<int64_t, int64_t, int64_t>{4090, 8, 1}, {-1, 8, 1}, {0, -8, 1}, {2, 8, 4}}) {
    const absl::StatusOr<RegionSpan> bad =
        uses[0].Span("entries[5].k.ref", offset, size, alignment);
    const absl::StatusOr<RegionSpan> looked_up =
        registry.Resolve("me", "entries[5].k.ref", "r", offset, size, alignment, &uses);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << offset << " " << size;
    EXPECT_EQ(bad.status(), looked_up.status()) << offset << " " << size;
    EXPECT_NE(bad.status().message().find("entries[5].k.ref"), absl::string_view::npos);
  }
  EXPECT_EQ(uses.size(), 1u);
}

TEST(RegionRegistryTest, KeepsTheLimitsOfRegionsAndBytes) {
  ShmObject object(8192);
  RegionRegistry registry({.max_regions_per_owner = 2, .max_mapped_bytes = 6000}, {});
  ASSERT_TRUE(registry.RegisterSystem("a", {}, "r1", object.key(), 0, 2000).ok());
  ASSERT_TRUE(registry.RegisterSystem("a", {}, "r2", object.key(), 0, 2000).ok());
  EXPECT_EQ(registry.RegisterSystem("a", {}, "r3", object.key(), 0, 100).status().code(),
            absl::StatusCode::kResourceExhausted);  // regions per owner
  EXPECT_EQ(registry.RegisterSystem("b", {}, "r1", object.key(), 0, 2001).status().code(),
            absl::StatusCode::kResourceExhausted);  // bytes over every owner
  EXPECT_TRUE(registry.RegisterSystem("b", {}, "r1", object.key(), 0, 2000).ok());
  EXPECT_EQ(registry.mapped_bytes(), 6000);
}

TEST(RegionRegistryTest, ASizeBeyondTheObjectIsInvalidWhateverTheLimit) {
  ShmObject object(8192);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (int64_t limit : {int64_t{6000}, kMax}) {
    SCOPED_TRACE(limit);
    RegionRegistry registry({.max_mapped_bytes = limit}, {});
    ASSERT_TRUE(registry.RegisterSystem("a", {}, "r1", object.key(), 0, 2000).ok());
    for (int64_t size : {int64_t{1} << 40, kMax - 10}) {
      const absl::Status status =
          registry.RegisterSystem("a", {}, "r2", object.key(), 8, size).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(status.message(),
                  HasSubstr(absl::StrCat("byte_size: expected offset + byte_size <= the object's "
                                         "8192 bytes, got 8 + ",
                                         size)));
    }
    EXPECT_EQ(registry.mapped_bytes(), 2000);
  }
}

TEST(RegionRegistryTest, TheByteLimitSaysWhatIsMapped) {
  ShmObject object(8192);
  RegionRegistry small({.max_mapped_bytes = 6000}, {});
  ASSERT_TRUE(small.RegisterSystem("a", {}, "r1", object.key(), 0, 4000).ok());
  const absl::Status status = small.RegisterSystem("b", {}, "r1", object.key(), 0, 2001).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(),
              HasSubstr("byte_size: 2001 bytes more would pass the limit of 6000 bytes mapped "
                        "(--max_shared_memory_bytes), of which 4000 are mapped already"));
}

TEST(RegionRegistryTest, PinsTheMappingAndUnpinsItBeforeUnmapping) {
  ShmObject object(8192);
  std::vector<void*> pinned, unpinned;
  RegionHooks hooks;
  hooks.pin_host = [&](void* p, int64_t) {
    pinned.push_back(p);
    return true;
  };
  hooks.unpin_host = [&](void* p) { unpinned.push_back(p); };
  RegionRegistry registry({}, hooks);
  absl::StatusOr<RegionDescription> d =
      registry.RegisterSystem("me", {}, "r", object.key(), 0, 100);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->pinned);
  ASSERT_EQ(pinned.size(), 1u);
  EXPECT_TRUE(unpinned.empty());
  ASSERT_TRUE(Unregister(registry, "me", "r", absl::Now()).ok());
  EXPECT_EQ(unpinned, pinned);
  EXPECT_EQ(registry.RegisterCuda("me", {}, "c", std::string(64, 'x'), 0, 0, 8).status().code(),
            absl::StatusCode::kUnimplemented);  // no open_cuda hook
}

TEST(RegionRegistryTest, UnregisterWaitsForUsesAndConcurrentCallsAllSucceed) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4096).ok());
  auto uses = std::make_unique<std::vector<RegionRegistry::Use>>();
  ASSERT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 8, 1, uses.get()).ok());
  EXPECT_EQ(Unregister(registry, "me", "r", absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(registry.List("me").size(), 1u);  // it stays
  std::vector<std::future<absl::Status>> waiting;
  for (int i = 0; i < 3; ++i) {
    waiting.push_back(std::async(std::launch::async, [&] {
      return Unregister(registry, "me", "r", absl::Now() + absl::Seconds(30));
    }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // While they wait, the region takes no new use.
  std::vector<RegionRegistry::Use> more;
  EXPECT_EQ(registry.Resolve("me", "q.ref", "r", 0, 8, 1, &more).status().code(),
            absl::StatusCode::kNotFound);
  uses.reset();  // the request is answered
  for (auto& w : waiting) EXPECT_TRUE(w.get().ok());
  EXPECT_TRUE(registry.List("me").empty());
  EXPECT_EQ(registry.mapped_bytes(), 0);
}

// Threads of this process, from /proc/self/status.
int ThreadCount() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST(RegionRegistryTest, WaitingUnregisterCallsHoldNoThreadAndEachGetsItsOwnDeadline) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4096).ok());
  auto uses = std::make_unique<std::vector<RegionRegistry::Use>>();
  ASSERT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 8, 1, uses.get()).ok());
  const int threads = ThreadCount();
  constexpr int kWaiting = 32;
  std::vector<std::promise<absl::Status>> answers(kWaiting + 1);
  for (int i = 0; i < kWaiting; ++i) {
    registry.Unregister("me", "r", absl::Now() + absl::Seconds(30),
                        [&answers, i](absl::Status s) { answers[i].set_value(std::move(s)); });
  }
  // One more with a short deadline: answered at it, while the others go on waiting.
  const absl::Time asked = absl::Now();
  registry.Unregister("me", "r", asked + absl::Milliseconds(50),
                      [&answers](absl::Status s) { answers[kWaiting].set_value(std::move(s)); });
  const absl::Status early = answers[kWaiting].get_future().get();
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_THAT(std::string(early.message()), HasSubstr("still used by 1 running requests"));
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(50));
  EXPECT_EQ(ThreadCount(), threads) << "a waiting Unregister started a thread";
  uses.reset();  // the request is answered: every waiting call succeeds
  for (int i = 0; i < kWaiting; ++i) EXPECT_TRUE(answers[i].get_future().get().ok()) << i;
  EXPECT_TRUE(registry.List("me").empty());
  EXPECT_EQ(registry.mapped_bytes(), 0);
}

TEST(RegionRegistryTest, ARegionThatExpiresGoesOnceUnusedForTheIdleTimeout) {
  ShmObject object(8192);
  constexpr absl::Duration kIdle = absl::Milliseconds(200);
  RegionRegistry registry({.idle_timeout = kIdle}, {});
  ASSERT_TRUE(
      registry.RegisterSystem("conn", {.by_connection = true}, "idle", object.key(), 0, 4096).ok());
  ASSERT_TRUE(
      registry.RegisterSystem("conn", {.by_connection = true}, "held", object.key(), 0, 4096).ok());
  ASSERT_TRUE(registry.RegisterSystem("token", {}, "kept", object.key(), 0, 4096).ok());
  auto uses = std::make_unique<std::vector<RegionRegistry::Use>>();
  ASSERT_TRUE(registry.Resolve("conn", "q.ref", "held", 0, 8, 1, uses.get()).ok());
  auto names = [&registry](const std::string& owner) {
    std::vector<std::string> out;
    for (const RegionDescription& d : registry.List(owner)) out.push_back(d.name);
    return out;
  };
  std::this_thread::sleep_for(absl::ToChronoMilliseconds(3 * kIdle));
  // The unused one is gone; the held one stays while held; a token's region never expires.
  EXPECT_THAT(names("conn"), ::testing::ElementsAre("held"));
  EXPECT_THAT(names("token"), ::testing::ElementsAre("kept"));
  EXPECT_EQ(registry.mapped_bytes(), 2 * 4096);
  const absl::Time dropped = absl::Now();
  uses.reset();
  while (!names("conn").empty() && absl::Now() - dropped < absl::Seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(names("conn").empty());
  EXPECT_GE(absl::Now() - dropped, kIdle);  // idle counted from its last use
  EXPECT_EQ(registry.mapped_bytes(), 4096);
}

// A connection's regions go once the open_connections hook no longer lists it (asked every
// second), whatever the idle timeout; a hook that cannot say releases nothing.
TEST(RegionRegistryTest, AConnectionsRegionsGoOnceItIsNoLongerOpen) {
  ShmObject object(8192);
  std::mutex mu;
  std::optional<absl::flat_hash_set<int64_t>> open = absl::flat_hash_set<int64_t>{7, 8};
  RegionRegistry registry({}, {}, [&]() {
    std::lock_guard<std::mutex> lock(mu);
    return open;
  });
  ASSERT_TRUE(registry
                  .RegisterSystem("peer a", {.by_connection = true, .connection = 7}, "r",
                                  object.key(), 0, 4096)
                  .ok());
  ASSERT_TRUE(registry
                  .RegisterSystem("peer b", {.by_connection = true, .connection = 8}, "r",
                                  object.key(), 0, 4096)
                  .ok());
  auto listed = [&registry](const std::string& owner) { return registry.List(owner).size(); };
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(listed("peer a"), 1u);
  {
    std::lock_guard<std::mutex> lock(mu);
    open = std::nullopt;  // channelz cannot say: nothing is taken for closed
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(listed("peer a"), 1u);
  {
    std::lock_guard<std::mutex> lock(mu);
    open = absl::flat_hash_set<int64_t>{8};  // connection 7 closed
  }
  const absl::Time closed = absl::Now();
  while (listed("peer a") > 0 && absl::Now() - closed < absl::Seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(listed("peer a"), 0u);
  EXPECT_LT(absl::Now() - closed, absl::Seconds(3));
  EXPECT_EQ(listed("peer b"), 1u);
  EXPECT_EQ(registry.mapped_bytes(), 4096);
}

// A later connection with the same owner key (the same address and port) never sees what an
// earlier one left: its registration drops the earlier connection's unused regions.
TEST(RegionRegistryTest, ALaterConnectionOfTheSameAddressDropsWhatAnEarlierOneLeft) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry
                  .RegisterSystem("peer a", {.by_connection = true, .connection = 7}, "old",
                                  object.key(), 0, 4096)
                  .ok());
  ASSERT_TRUE(registry
                  .RegisterSystem("peer a", {.by_connection = true, .connection = 9}, "new",
                                  object.key(), 0, 4096)
                  .ok());
  std::vector<std::string> names;
  for (const RegionDescription& d : registry.List("peer a")) names.push_back(d.name);
  EXPECT_THAT(names, ::testing::ElementsAre("new"));
  EXPECT_EQ(registry.mapped_bytes(), 4096);
  // The same connection registers again: its own regions stay.
  ASSERT_TRUE(registry
                  .RegisterSystem("peer a", {.by_connection = true, .connection = 9}, "more",
                                  object.key(), 4096, 4096)
                  .ok());
  EXPECT_EQ(registry.List("peer a").size(), 2u);
}

TEST(RegionRegistryTest, AnotherUsersObjectIsRefusedUnlessAllowed) {
  if (geteuid() != 0) GTEST_SKIP() << "giving an object to another user needs root";
  ShmObject object(4096);
  const int fd = shm_open(object.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchown(fd, 65534, 65534), 0);
  close(fd);
  RegionRegistry strict({}, {});
  const absl::Status refused = strict.RegisterSystem("me", {}, "r", object.key(), 0, 64).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("belongs to uid 65534"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--allow_foreign_regions"));
  EXPECT_EQ(strict.mapped_bytes(), 0);
  RegionRegistry lenient({.allow_foreign = true}, {});
  EXPECT_TRUE(lenient.RegisterSystem("me", {}, "r", object.key(), 0, 64).ok());
}

TEST(RegionRegistryTest, RefusesEveryReferenceOnceItsObjectShrankBelowTheRegion) {
  ShmObject object(3 * 4096);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 4096, 8192).ok());
  std::vector<RegionRegistry::Use> uses;
  ASSERT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 64, 1, &uses).ok());
  object.Truncate(2 * 4096);
  // Even bytes still inside the object: the region is not what was registered any more.
  absl::StatusOr<RegionSpan> span = registry.Resolve("me", "k.ref", "r", 0, 64, 1, &uses);
  ASSERT_EQ(span.status().code(), absl::StatusCode::kFailedPrecondition) << span.status();
  const std::string message(span.status().message());
  EXPECT_NE(message.find("k.ref: region 'r'"), std::string::npos) << message;
  EXPECT_NE(message.find("[4096, 12288) (8192 bytes)"), std::string::npos) << message;
  EXPECT_NE(message.find("holds 8192 bytes now"), std::string::npos) << message;
  EXPECT_EQ(uses.size(), 1u);  // the refused reference holds nothing
  EXPECT_EQ(uses[0].Intact().code(), absl::StatusCode::kFailedPrecondition);
  // Grown back, it stays refused (a pinned mapping may hold the old pages): register it again.
  object.Truncate(3 * 4096);
  EXPECT_EQ(registry.Resolve("me", "q.ref", "r", 0, 64, 1, &uses).status().code(),
            absl::StatusCode::kFailedPrecondition);
  uses.clear();
  ASSERT_TRUE(Unregister(registry, "me", "r", absl::Now()).ok());
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 4096, 8192).ok());
  EXPECT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 64, 1, &uses).ok());
}

TEST(RegionRegistryTest, AnAccessPastAShrunkObjectsEndReadsZerosAndFailsItsRequest) {
  ShmObject object(4 * 4096);
  ShmObject other(4096);
  int unpinned = 0;
  RegionRegistry registry({}, {.pin_host = [](void*, int64_t) { return true; },
                               .unpin_host = [&unpinned](void*) { ++unpinned; }});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4 * 4096).ok());
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "other", other.key(), 0, 4096).ok());
  std::vector<RegionRegistry::Use> uses;
  absl::StatusOr<RegionSpan> span = registry.Resolve("me", "v.ref", "r", 0, 4 * 4096, 1, &uses);
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(static_cast<unsigned char>(span->data[3 * 4096 + 5]), (3 * 4096 + 5) % 251);
  // The client shrinks it while the request runs: without the guard, the next line is SIGBUS.
  object.Truncate(4096);
  EXPECT_EQ(span->data[3 * 4096 + 5], 0);
  span->data[2 * 4096] = 9;  // a write completes too (into zero pages of the server's own)
  EXPECT_EQ(span->data[2 * 4096], 9);
  EXPECT_EQ(static_cast<unsigned char>(span->data[100]), 100);  // bytes before the end stay
  const absl::Status intact = uses[0].Intact();
  EXPECT_EQ(intact.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(intact.message()).find("faulted"), std::string::npos) << intact;
  EXPECT_EQ(registry.Resolve("me", "q.ref", "r", 0, 8, 1, &uses).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Other regions are untouched.
  EXPECT_TRUE(registry.Resolve("me", "k.ref", "other", 0, 8, 1, &uses).ok());
  EXPECT_TRUE(uses[1].Intact().ok());
  uses.clear();
  EXPECT_TRUE(Unregister(registry, "me", "r", absl::Now()).ok());
  EXPECT_EQ(unpinned, 1);
  EXPECT_TRUE(Unregister(registry, "me", "other", absl::Now()).ok());
}

// A fault outside every region still kills the process (the guard hides no real crash). The
// death tests fork without re-running the test (gtest's "fast" style; this binary starts no
// threads), so the child uses the parent's objects, which the parent unlinks.
TEST(RegionRegistryDeathTest, AFaultOutsideEveryRegionStillKills) {
  ShmObject object(4096);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4096).ok());  // guard on
  ShmObject unguarded(2 * 4096);
  EXPECT_DEATH(
      {
        unguarded.Truncate(0);
        volatile unsigned char* p = unguarded.data();
        p[4096] = 1;
      },
      "");
  std::vector<RegionRegistry::Use> uses;
  EXPECT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 8, 1, &uses).ok());
}

// (Under ASan, its own handler, chained, reports it and aborts.)
TEST(RegionRegistryDeathTest, ASentSigbusStillKills) {
  ShmObject object(4096);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", {}, "r", object.key(), 0, 4096).ok());
  EXPECT_DEATH(raise(SIGBUS), "");
}

}  // namespace
}  // namespace attention::server
