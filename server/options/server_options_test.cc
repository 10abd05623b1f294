// The flag checks and the KV cache sizing of server/options: each refusal names the flag, what
// was expected and what came; the page count follows --kv_cache_fraction or --kv_cache_bytes and
// stays inside the room --device_memory_fraction leaves.
#include "server/options/server_options.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

constexpr int kMessageMb = 1024;
constexpr int64_t kGiB = int64_t{1} << 30;

// Expects INVALID_ARGUMENT whose message has every one of `parts`.
template <typename... Parts>
void ExpectInvalid(const absl::Status& status, const Parts&... parts) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (const std::string& part : {std::string(parts)...}) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
}

TEST(CheckOptionsTest, DefaultsPass) {
  EXPECT_TRUE(CheckOptions(ServerOptions{}, kMessageMb).ok());
  EXPECT_TRUE(CheckKvCacheOptions(KvCacheOptions{}).ok());
}

TEST(CheckOptionsTest, Backend) {
  ServerOptions o;
  o.backend = "tpu";
  ExpectInvalid(CheckOptions(o, kMessageMb), "--backend", "expected auto, cpu or cuda", "got tpu");
}

TEST(CheckOptionsTest, MaxMessageMb) {
  ExpectInvalid(CheckOptions(ServerOptions{}, 0), "--max_message_mb", "expected 1..2047", "got 0");
  ExpectInvalid(CheckOptions(ServerOptions{}, 2048), "--max_message_mb", "got 2048");
  EXPECT_TRUE(CheckOptions(ServerOptions{}, 2047).ok());
}

TEST(CheckOptionsTest, CountsAtLeastOne) {
  {
    ServerOptions o;
    o.scheduler.max_queue = 0;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--max_queue", "expected >= 1", "got 0");
  }
  {
    ServerOptions o;
    o.scheduler.max_batch = -3;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--max_batch", "expected >= 1", "got -3");
  }
  {
    ServerOptions o;
    o.cuda.streams = 0;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--streams", "expected >= 1", "got 0");
  }
  {
    ServerOptions o;
    o.stream_window = 0;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--stream_window", "expected >= 1", "got 0");
  }
  {
    ServerOptions o;
    o.shared_memory.limits.idle_timeout = absl::ZeroDuration();
    ExpectInvalid(CheckOptions(o, kMessageMb), "--region_idle_timeout_s", "expected >= 1", "got 0");
  }
  {
    ServerOptions o;
    o.shared_memory.ring_stall_timeout_s = 0;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--ring_stall_timeout_s", "expected >= 1", "got 0");
  }
}

TEST(CheckOptionsTest, MaxHeadDim) {
  ServerOptions o;
  o.max_head_dim = 576;
  EXPECT_TRUE(CheckOptions(o, kMessageMb).ok());
  for (const int bad : {0, 1025}) {
    o.max_head_dim = bad;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--max_head_dim", "expected 1..1024",
                  absl::StrCat("got ", bad));
  }
}

TEST(CheckOptionsTest, NonNegatives) {
  const auto negative = [](ServerOptions& o, int which) {
    switch (which) {
      case 0:
        o.threads = -1;
        break;
      case 1:
        o.scheduler.workers = -1;
        break;
      case 2:
        o.scheduler.max_queue_delay = absl::Microseconds(-1);
        break;
      case 3:
        o.shutdown_grace_s = -1;
        break;
      case 4:
        o.scheduler.worker_spin = absl::Microseconds(-1);
        break;
    }
  };
  for (int which = 0; which < 5; ++which) {
    SCOPED_TRACE(which);
    ServerOptions o;
    negative(o, which);
    ExpectInvalid(CheckOptions(o, kMessageMb), "--threads, --workers, --max_queue_delay_us",
                  "must be >= 0");
  }
}

TEST(CheckOptionsTest, PortsAreTcpPortsAndDistinct) {
  for (int port : {-1, 65536, 1 << 20}) {
    SCOPED_TRACE(port);
    ServerOptions o;
    o.port = port;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--port: expected a TCP port 0..65535",
                  absl::StrCat("got ", port));
    o.port = 0;
    o.metrics_port = port;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--metrics_port: expected a TCP port 0..65535",
                  absl::StrCat("got ", port));
  }
  ServerOptions o;
  o.port = o.metrics_port = 9464;
  ExpectInvalid(CheckOptions(o, kMessageMb), "--port and --metrics_port", "got 9464 for both");
  o.port = o.metrics_port = 0;  // each picks a free one
  EXPECT_TRUE(CheckOptions(o, kMessageMb).ok());
  o.port = 65535;
  EXPECT_TRUE(CheckOptions(o, kMessageMb).ok());
}

TEST(CheckOptionsTest, ConnectionAge) {
  {
    ServerOptions o;
    o.max_connection_age_s = -1;
    ExpectInvalid(CheckOptions(o, kMessageMb), "--max_connection_age_s", "expected 0..2147483",
                  "got -1");
  }
  {
    ServerOptions o;
    o.max_connection_age_grace_s = 2147484;  // over INT_MAX milliseconds
    ExpectInvalid(CheckOptions(o, kMessageMb), "--max_connection_age_grace_s",
                  "expected 0..2147483", "got 2147484");
  }
}

TEST(CheckOptionsTest, DeviceMemoryFraction) {
  ServerOptions o;
  o.cuda.memory_fraction = 0;
  ExpectInvalid(CheckOptions(o, kMessageMb), "--device_memory_fraction",
                "expected a value in (0, 1]", "got 0");
  o.cuda.memory_fraction = 1.5;
  ExpectInvalid(CheckOptions(o, kMessageMb), "--device_memory_fraction", "got 1.5");
}

TEST(CheckOptionsTest, FractionsShareTheGpu) {
  ServerOptions o;
  o.cuda.memory_fraction = 0.8;
  o.kv_cache.fraction = 0.3;
  ExpectInvalid(CheckOptions(o, kMessageMb), "--device_memory_fraction 0.8",
                "--kv_cache_fraction 0.3", "expected a sum of at most 1");
  // The CPU backend has no request buffers in device memory; bytes replace the fraction.
  o.backend = "cpu";
  EXPECT_TRUE(CheckOptions(o, kMessageMb).ok());
  o.backend = "cuda";
  o.kv_cache.bytes = kGiB;
  EXPECT_TRUE(CheckOptions(o, kMessageMb).ok());
}

TEST(CheckKvCacheOptionsTest, EachField) {
  {
    KvCacheOptions o;
    o.fraction = 1;
    ExpectInvalid(CheckKvCacheOptions(o), "--kv_cache_fraction", "expected a value in [0, 1)",
                  "got 1");
    o.fraction = -0.5;
    ExpectInvalid(CheckKvCacheOptions(o), "--kv_cache_fraction", "got -0.5");
  }
  {
    KvCacheOptions o;
    o.bytes = -1;
    ExpectInvalid(CheckKvCacheOptions(o), "--kv_cache_bytes", "expected >= 0", "got -1");
  }
  for (int64_t bad : {int64_t{0}, int64_t{300}, (int64_t{1} << 30) + 256}) {
    KvCacheOptions o;
    o.page_bytes = bad;
    ExpectInvalid(CheckKvCacheOptions(o), "--kv_page_bytes",
                  "expected a multiple of 256 from 256 to 2^30", absl::StrCat("got ", bad));
  }
  {
    KvCacheOptions o;
    o.ttl_s = 0;
    ExpectInvalid(CheckKvCacheOptions(o), "--session_ttl_s", "expected >= 1", "got 0");
  }
  for (int64_t bad : {int64_t{-1}, int64_t{1}, int64_t{524287}}) {
    KvCacheOptions o;
    o.host_bytes = bad;
    ExpectInvalid(CheckKvCacheOptions(o), "--kv_host_bytes",
                  "expected 0 (no host tier) or at least one page of --kv_page_bytes 524288",
                  absl::StrCat("got ", bad));
  }
  for (int64_t good : {int64_t{0}, int64_t{524288}, int64_t{1} << 40}) {
    KvCacheOptions o;
    o.host_bytes = good;
    EXPECT_EQ(CheckKvCacheOptions(o), absl::OkStatus()) << good;
  }
}

TEST(KvCachePagesTest, NoSessionsIsZeroPages) {
  absl::StatusOr<int64_t> pages =
      KvCachePages({.fraction = 0, .bytes = 0}, 0.65, "cuda:0", 80 * kGiB);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, 0);
}

TEST(KvCachePagesTest, FractionOfTheDevice) {
  // A quarter of 80 GiB in 512 KiB pages.
  absl::StatusOr<int64_t> pages =
      KvCachePages({.fraction = 0.25, .page_bytes = 512 << 10}, 0.65, "cuda:0", 80 * kGiB);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, 20 * kGiB / (512 << 10));
  // Rounded down to whole pages.
  pages = KvCachePages({.fraction = 0.5, .page_bytes = 1024}, 0, "cpu", 4097);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, 2);
}

TEST(KvCachePagesTest, BytesReplaceTheFraction) {
  absl::StatusOr<int64_t> pages =
      KvCachePages({.fraction = 0.25, .bytes = 3 * kGiB + 5, .page_bytes = 256 << 10}, 0.65,
                   "cuda:1", 80 * kGiB);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, 3 * kGiB / (256 << 10));
}

TEST(KvCachePagesTest, LessThanOnePage) {
  absl::StatusOr<int64_t> pages =
      KvCachePages({.fraction = 0.25, .page_bytes = 1 << 20}, 0, "cpu", 1 << 20);
  ExpectInvalid(pages.status(), "--kv_cache_fraction 0.25 of cpu's 1048576 bytes", "gives 0 pages",
                "--kv_page_bytes 1048576", "expected 1 to 2^31-1 (or 0 for no sessions)");
}

TEST(KvCachePagesTest, TooManyPages) {
  // 2^31 pages of 256 bytes: one more than int32 page ids can name.
  const int64_t bytes = (int64_t{1} << 31) * 256;
  absl::StatusOr<int64_t> pages =
      KvCachePages({.bytes = bytes, .page_bytes = 256}, 0, "cpu", 4 * bytes);
  ExpectInvalid(pages.status(), absl::StrCat("--kv_cache_bytes ", bytes), "gives 2147483648 pages",
                "--kv_page_bytes 256", "expected 1 to 2^31-1");
  pages = KvCachePages({.bytes = bytes - 256, .page_bytes = 256}, 0, "cpu", 4 * bytes);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, (int64_t{1} << 31) - 1);
}

TEST(KvCachePagesTest, BytesOverTheRoomTheRequestBuffersLeave) {
  // 100 GiB with 0.65 for requests leaves 35 GiB.
  absl::StatusOr<int64_t> pages = KvCachePages({.bytes = 36 * kGiB}, 0.65, "cuda:0", 100 * kGiB);
  ExpectInvalid(pages.status(), absl::StrCat("--kv_cache_bytes ", 36 * kGiB), "more than the ",
                absl::StrCat(35 * kGiB), "bytes of cuda:0",
                "left beside the request buffers (--device_memory_fraction 0.65)");
  pages = KvCachePages({.bytes = 34 * kGiB}, 0.65, "cuda:0", 100 * kGiB);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, 34 * kGiB / 524288);
}

}  // namespace
}  // namespace attention::server
