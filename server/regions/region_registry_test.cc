// The region registry over real POSIX shared-memory objects: mapping, bounds, owners, limits, the
// hooks, and Unregister waiting for the requests that hold a region.
#include "server/regions/region_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

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

 private:
  static inline int n_ = 0;
  std::string key_;
  unsigned char* data_ = nullptr;
  int64_t bytes_ = 0;
};

TEST(RegionRegistryTest, ResolvesBytesOfTheObjectAtItsOffset) {
  ShmObject object(3 * 4096);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", "r", object.key(), 5000, 4000).ok());
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
  ASSERT_TRUE(registry.RegisterSystem("me", "r", object.key(), 0, 4096).ok());
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
  EXPECT_EQ(registry.Unregister("you", "r", absl::Now()).code(), absl::StatusCode::kNotFound);
}

TEST(RegionRegistryTest, KeepsTheLimitsOfRegionsAndBytes) {
  ShmObject object(8192);
  RegionRegistry registry({.max_regions_per_owner = 2, .max_mapped_bytes = 6000}, {});
  ASSERT_TRUE(registry.RegisterSystem("a", "r1", object.key(), 0, 2000).ok());
  ASSERT_TRUE(registry.RegisterSystem("a", "r2", object.key(), 0, 2000).ok());
  EXPECT_EQ(registry.RegisterSystem("a", "r3", object.key(), 0, 100).status().code(),
            absl::StatusCode::kResourceExhausted);  // regions per owner
  EXPECT_EQ(registry.RegisterSystem("b", "r1", object.key(), 0, 2001).status().code(),
            absl::StatusCode::kResourceExhausted);  // bytes over every owner
  EXPECT_TRUE(registry.RegisterSystem("b", "r1", object.key(), 0, 2000).ok());
  EXPECT_EQ(registry.mapped_bytes(), 6000);
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
  absl::StatusOr<RegionDescription> d = registry.RegisterSystem("me", "r", object.key(), 0, 100);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->pinned);
  ASSERT_EQ(pinned.size(), 1u);
  EXPECT_TRUE(unpinned.empty());
  ASSERT_TRUE(registry.Unregister("me", "r", absl::Now()).ok());
  EXPECT_EQ(unpinned, pinned);
  EXPECT_EQ(registry.RegisterCuda("me", "c", std::string(64, 'x'), 0, 0, 8).status().code(),
            absl::StatusCode::kUnimplemented);  // no open_cuda hook
}

TEST(RegionRegistryTest, UnregisterWaitsForUsesAndConcurrentCallsAllSucceed) {
  ShmObject object(8192);
  RegionRegistry registry({}, {});
  ASSERT_TRUE(registry.RegisterSystem("me", "r", object.key(), 0, 4096).ok());
  auto uses = std::make_unique<std::vector<RegionRegistry::Use>>();
  ASSERT_TRUE(registry.Resolve("me", "q.ref", "r", 0, 8, 1, uses.get()).ok());
  EXPECT_EQ(registry.Unregister("me", "r", absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(registry.List("me").size(), 1u);  // it stays
  std::vector<std::future<absl::Status>> waiting;
  for (int i = 0; i < 3; ++i) {
    waiting.push_back(std::async(std::launch::async, [&] {
      return registry.Unregister("me", "r", absl::Now() + absl::Seconds(30));
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

}  // namespace
}  // namespace attention::server
