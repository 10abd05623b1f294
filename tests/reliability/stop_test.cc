// Work that nobody waits for stops while it runs, not only while it is queued: a request whose
// deadline passes during its kernel frees its worker within a bound (the scheduler's watchdog
// poll plus one query tile of the CPU kernel), a drain whose grace ends stops what still runs and
// answers it UNAVAILABLE, and one request cannot ask for more work than --max_request_flops.
#include <signal.h>

#include <cstdint>
#include <future>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::reliability {
namespace {

using ::testing::HasSubstr;

// q, k, v [1, 1, 60000, 64] float16: 23 MB on the wire, 9.2e11 FLOPs, tens of seconds of one
// CPU thread (minutes under a sanitizer); far longer than any deadline below.
constexpr client::ProblemSpec kLong{.batch = 1,
                                    .heads_q = 1,
                                    .heads_kv = 1,
                                    .seqlen_q = 60000,
                                    .seqlen_k = 60000,
                                    .head_dim = 64,
                                    .dtype = v1::DTYPE_FLOAT16};
constexpr client::ProblemSpec kSmall{
    .batch = 1, .heads_q = 2, .heads_kv = 1, .seqlen_q = 16, .seqlen_k = 16, .head_dim = 32};

// How long a stopped run may take to free its worker: the watchdog's 10 ms poll, one tile of 64
// query rows over 60,000 keys (tens of milliseconds, a second or two under a sanitizer) and the
// answer's way back, with room for a loaded machine.
constexpr absl::Duration kStopBound = absl::Seconds(3);

// A one-worker CPU server that admits kLong, with `flags` beside, and a long and a small request.
class StopTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    flags.insert(flags.end(),
                 {"--backend=cpu", "--threads=1", "--workers=1", "--max_request_flops=1e13"});
    server_ = e2e::StartServer(flags);
    ASSERT_TRUE(server_.ok()) << server_.status();
    std::mt19937_64 rng(seed_);
    absl::StatusOr<v1::AttendRequest> long_request = client::MakeRandomRequest(kLong, rng);
    absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(kSmall, rng);
    ASSERT_TRUE(long_request.ok()) << long_request.status();
    ASSERT_TRUE(small.ok()) << small.status();
    long_request_ = *std::move(long_request);
    small_ = *std::move(small);
  }

  const uint64_t seed_ = e2e::FreshSeed();
  absl::StatusOr<e2e::RunningServer> server_ = absl::UnknownError("not started");
  v1::AttendRequest long_request_, small_;
};

TEST_F(StopTest, ARequestWhoseDeadlinePassesWhileRunningStopsAndFreesItsWorker) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  ASSERT_NO_FATAL_FAILURE(Start({}));

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::AttendResponse> expired =
      server_->client->Attend(long_request_, {.deadline = absl::Seconds(2)});
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kDeadlineExceeded) << expired.status();
  // The worker is free again soon after the deadline: the small request, which needs the one
  // worker, is answered well before the long one could have finished.
  const int port = server_->process->metrics_port();
  EXPECT_EQ(e2e::WaitForMetric(port, "attention_device_running_batches", {},
                               [](double v) { return v == 0; }),
            0);
  e2e::ExpectCorrect(small_, server_->client->Attend(small_));
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(2) + kStopBound) << "the stopped run held its worker";
  // The server counts the call by why it stopped: its deadline, or the client's cancellation,
  // which gRPC reports when the client gives up a moment before the server's copy of the deadline
  // (the two clocks start apart by the request's transfer).
  double stopped = 0;
  for (const char* code : {"DEADLINE_EXCEEDED", "CANCELLED"}) {
    stopped +=
        e2e::ScrapeMetric(port, "attention_requests_total", {{"rpc", "Attend"}, {"code", code}})
            .value_or(-1);
  }
  EXPECT_EQ(stopped, 1);
  EXPECT_EQ(server_->Stop(), absl::OkStatus());
}

TEST_F(StopTest, ADrainWhoseGraceEndsStopsWhatRunsAndAnswersItUnavailable) {
  constexpr int kGraceSeconds = 2;
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  ASSERT_NO_FATAL_FAILURE(Start({absl::StrCat("--shutdown_grace_s=", kGraceSeconds)}));
  std::future<absl::StatusOr<v1::AttendResponse>> running =
      server_->client->AttendAsync(long_request_, {.deadline = absl::Seconds(120)});
  ASSERT_TRUE(e2e::WaitUntilRunning(server_->process->metrics_port())) << "it never ran";
  // One more, queued behind it: it too is answered when the grace ends.
  std::future<absl::StatusOr<v1::AttendResponse>> queued =
      server_->client->AttendAsync(small_, {.deadline = absl::Seconds(120)});
  ASSERT_EQ(e2e::WaitForMetric(server_->process->metrics_port(), "attention_queue_depth", {},
                               [](double v) { return v >= 1; }),
            1);
  const absl::Time signal_time = absl::Now();
  ASSERT_TRUE(server_->process->Signal(SIGTERM).ok());
  for (auto* answer : {&running, &queued}) {
    absl::StatusOr<v1::AttendResponse> response = answer->get();
    EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr("grace period"));
  }
  absl::StatusOr<int> code = server_->process->WaitForExit(absl::Seconds(kGraceSeconds + 30));
  const absl::Duration exit_after = absl::Now() - signal_time;
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << server_->process->Log();
  // The grace, the stop, the linger and gRPC's close; a sanitized server also checks for leaks on
  // its way out.
  absl::Duration bound = absl::Seconds(kGraceSeconds) + kStopBound + absl::Seconds(3);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  bound += absl::Seconds(10);
#endif
  EXPECT_LT(exit_after, bound) << "the drain outlasted its grace";
}

TEST(StopLimitTest, ARequestOverTheWorkLimitIsRefusedBeforeItIsQueued) {
  absl::StatusOr<e2e::RunningServer> server =
      e2e::StartServer({"--backend=cpu", "--max_request_flops=1e9"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<v1::ServerInfo> info = server->client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->limits().max_request_flops(), 1e9);
  std::mt19937_64 rng(e2e::FreshSeed());
  // 4 * 4 heads * 64 * 2048^2 = 4.3e9 FLOPs.
  absl::StatusOr<v1::AttendRequest> big = client::MakeRandomRequest(
      {.heads_q = 4, .heads_kv = 4, .seqlen_q = 2048, .seqlen_k = 2048, .head_dim = 64}, rng);
  ASSERT_TRUE(big.ok()) << big.status();
  absl::StatusOr<v1::AttendResponse> refused = server->client->Attend(*big);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("4.29497e+09 FLOPs (4 * Hq * D * visible pairs), over the limit of 1e+09"));
  // An eighth of the keys fits.
  absl::StatusOr<v1::AttendRequest> fits = client::MakeRandomRequest(
      {.heads_q = 4, .heads_kv = 4, .seqlen_q = 2048, .seqlen_k = 256, .head_dim = 64}, rng);
  ASSERT_TRUE(fits.ok()) << fits.status();
  e2e::ExpectCorrect(*fits, server->client->Attend(*fits));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace attention::reliability
