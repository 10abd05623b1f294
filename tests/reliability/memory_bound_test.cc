// Memory bounded for what is refused: a request over the message limit costs the server's resident
// memory at most about the receive quota (--receive_memory_mb: the limit plus 8 MiB here) plus a
// few MiB however large it is, four at once at most four times that, and a small gzip request
// that would inflate far over the limit is refused before it is inflated. The previous server
// grew by 94 MiB for one 96 MiB request, 209-286 MiB for four, 135 MiB for the gzip one. Measured
// on the real server (CPU backend) by polling its VmRSS while the requests are in flight.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/request_builder.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/reliability/reliability_util.h"

namespace attention::reliability {
namespace {

using e2e::RunningServer;
using e2e::StartServer;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr char kAttend[] = "/attention.v1.Attention/Attend";
constexpr int64_t kLimitMiB = 8;
// What gRPC may hold for requests in reception (--receive_memory_mb): the limit and 8 MiB.
constexpr int64_t kReceiveMiB = kLimitMiB + 8;
// Headroom a refusal may cost beyond the limit: read buffers, HTTP/2 frames, allocator slack.
constexpr int64_t kSlackMiB = 8;

// The server's resident set, polled every 2 ms while `run` runs; returns the peak over what it
// held before.
int64_t PeakGrowth(pid_t pid, const std::function<void()>& run) {
  const int64_t before = ResidentBytes(pid).value_or(0);
  std::atomic<bool> done{false};
  std::atomic<int64_t> peak{before};
  std::thread poller([&] {
    while (!done.load()) {
      const int64_t now = ResidentBytes(pid).value_or(0);
      peak.store(std::max(peak.load(), now));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  run();
  // Memory freed lazily still shows for a moment after the answers.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  done.store(true);
  poller.join();
  return peak.load() - before;
}

// `mib` MiB that claim to be an AttendRequest: q's tag and length, then its bytes.
std::string LargeRequest(int64_t mib) {
  std::string bytes(mib * kMiB, '\x01');
  const uint64_t length = bytes.size() - 6;
  bytes[0] = '\x12';  // q, length-delimited; a 5-byte varint length follows
  for (int i = 0; i < 5; ++i)
    bytes[1 + i] = static_cast<char>(((length >> (7 * i)) & 0x7f) | (i < 4 ? 0x80 : 0));
  return bytes;
}

std::shared_ptr<grpc::Channel> UnlimitedChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  // Not shared with other channels: each test call gets its own connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

class MemoryBoundTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if defined(__SANITIZE_ADDRESS__)
    // The server here is the sanitized build: AddressSanitizer keeps freed memory in its
    // quarantine (256 MiB by default), so the resident set no longer says what is held.
    GTEST_SKIP() << "resident memory is not measurable under AddressSanitizer";
#endif
    absl::StatusOr<RunningServer> server =
        StartServer({"--backend=cpu", "--threads=1", absl::StrCat("--max_message_mb=", kLimitMiB),
                     absl::StrCat("--receive_memory_mb=", kReceiveMiB), "--kv_cache_fraction=0"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::make_unique<RunningServer>(std::move(*server));
  }
  void TearDown() override {
    if (server_ != nullptr) EXPECT_TRUE(server_->Stop().ok());
  }
  std::unique_ptr<RunningServer> server_;
};

TEST_F(MemoryBoundTest, OverLimitRequestsCostAtMostTheLimit) {
  const std::string big = LargeRequest(96);
  const pid_t pid = server_->process->pid();
  // One connection first, so the server's own start-up allocations are done.
  std::shared_ptr<grpc::Channel> warm = UnlimitedChannel(server_->process->target());
  EXPECT_EQ(RawUnaryCall(warm, kAttend, LargeRequest(1), false).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  const int64_t one = PeakGrowth(pid, [&] {
    const grpc::Status status = RawUnaryCall(warm, kAttend, big, false);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  });
  EXPECT_LE(one, (kReceiveMiB + kSlackMiB) * kMiB)
      << "one 96 MiB request grew the server by " << one / kMiB << " MiB";

  constexpr int kAtOnce = 4;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < kAtOnce; ++i)
    channels.push_back(UnlimitedChannel(server_->process->target()));
  const int64_t four = PeakGrowth(pid, [&] {
    std::vector<std::thread> senders;
    for (int i = 0; i < kAtOnce; ++i) {
      senders.emplace_back([&, i] {
        // Over the shared quota gRPC may close a connection rather than cancel one stream.
        const grpc::Status status = RawUnaryCall(channels[i], kAttend, big, false);
        EXPECT_TRUE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                    status.error_code() == grpc::StatusCode::UNAVAILABLE)
            << status.error_code() << " " << status.error_message();
      });
    }
    for (std::thread& t : senders) t.join();
  });
  // The quota is shared, but gRPC reclaims memory after the fact: several connections reading at
  // once overshoot it by what each reads before the reclaimer runs. Each still costs at most about
  // the quota (today's server: the whole 96 MiB each).
  EXPECT_LE(four, kAtOnce * (kReceiveMiB + kSlackMiB) * kMiB)
      << kAtOnce << " 96 MiB requests at once grew the server by " << four / kMiB << " MiB";
}

// A request just under the limit still goes through with the quota in force.
TEST_F(MemoryBoundTest, RequestsUnderTheLimitStillWork) {
  // q [1, 1, 16, 64], k and v [1, 1, 7000, 64], float32: 3.4 MiB, under half the receive quota:
  // while gRPC receives a message it holds its frames' slices and the assembled copy, and it
  // returns them to the quota lazily, after the call. A 6.4 MiB request, one after another, was
  // refused (RST_STREAM, RESOURCE_EXHAUSTED) once on a loaded machine.
  const client::ProblemSpec spec{
      .batch = 1, .heads_q = 1, .heads_kv = 1, .seqlen_q = 16, .seqlen_k = 7000, .head_dim = 64};
  std::mt19937_64 rng(e2e::FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_GT(request->ByteSizeLong(), size_t{3} << 20);
  for (int i = 0; i < 3; ++i) e2e::ExpectCorrect(*request, server_->client->Attend(*request));
}

TEST_F(MemoryBoundTest, CompressedRequestsAreRefusedBeforeInflating) {
  // 128 MiB of zeros: ~130 KB in gzip.
  const std::string zeros(128 * kMiB, '\0');
  std::shared_ptr<grpc::Channel> channel = UnlimitedChannel(server_->process->target());
  EXPECT_EQ(RawUnaryCall(channel, kAttend, LargeRequest(1), false).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  grpc::Status status;
  const int64_t growth = PeakGrowth(server_->process->pid(),
                                    [&] { status = RawUnaryCall(channel, kAttend, zeros, true); });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
  EXPECT_LE(growth, (kReceiveMiB + kSlackMiB) * kMiB)
      << "a gzip request inflating to 128 MiB grew the server by " << growth / kMiB << " MiB ("
      << status.error_code() << " " << status.error_message() << ")";
}

}  // namespace
}  // namespace attention::reliability
