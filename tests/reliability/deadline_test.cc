// Deadlines and cancellation: requests whose deadline passes, or whose client cancels, while they
// wait in the queue never reach the kernel. One worker is kept busy by a long request; short
// requests queue behind it, some with a 200 ms deadline, some cancelled by their client. The
// metrics then show them answered DEADLINE_EXCEEDED and CANCELLED, while the kernel's counters
// (attention_tokens_total, attention_flops_total) count the long request and nothing else.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::reliability {
namespace {

// One unary call on the callback API, cancellable from the test.
class PendingCall {
 public:
  PendingCall(v1::Attention::Stub* stub, const v1::AttendRequest& request, absl::Duration deadline)
      : request_(request) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    stub->async()->Attend(&context_, &request_, &response_, [this](grpc::Status status) {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(status);
      done_ = true;
      cv_.notify_all();
    });
  }
  void Cancel() { context_.TryCancel(); }
  grpc::Status Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

 private:
  grpc::ClientContext context_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  grpc::Status status_;
};

TEST(DeadlineTest, ExpiredAndCancelledQueuedRequestsNeverReachTheKernel) {
  constexpr int kExpiring = 5;
  constexpr int kCancelled = 5;
  absl::StatusOr<e2e::RunningServer> server =
      e2e::StartServer({"--backend=cpu", "--threads=1", "--workers=1", "--max_queue=64"});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->process->metrics_port();
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);

  // The queued ones: q [1, 2, 3, 16]: 3 query tokens each, easy to tell apart in the counters.
  const client::ProblemSpec short_spec{
      .batch = 1, .heads_q = 2, .heads_kv = 2, .seqlen_q = 3, .seqlen_k = 5, .head_dim = 16};
  absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(short_spec, rng);
  ASSERT_TRUE(small.ok()) << small.status();

  // The blocker keeps the one worker busy for a second or two whatever the build.
  absl::StatusOr<e2e::Blocker> blocker =
      e2e::CalibratedBlocker(*server->client, absl::Seconds(1.5), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  // The counters from here on: what the calibration added is not the blocker's.
  absl::StatusOr<double> tokens_before = e2e::ScrapeMetric(port, "attention_tokens_total");
  absl::StatusOr<double> flops_before = e2e::ScrapeMetric(port, "attention_flops_total");
  ASSERT_TRUE(tokens_before.ok() && flops_before.ok());

  auto stub = v1::Attention::NewStub(server->client->channel());
  std::future<absl::StatusOr<v1::AttendResponse>> blocked =
      server->client->AttendAsync(blocker->request, {.deadline = absl::Minutes(10)});
  ASSERT_TRUE(e2e::WaitUntilRunning(port)) << "the blocker never ran";

  std::vector<std::unique_ptr<PendingCall>> expiring, cancelled;
  for (int i = 0; i < kExpiring; ++i) {
    expiring.push_back(std::make_unique<PendingCall>(stub.get(), *small, absl::Milliseconds(200)));
  }
  for (int i = 0; i < kCancelled; ++i) {
    cancelled.push_back(std::make_unique<PendingCall>(stub.get(), *small, absl::Seconds(60)));
  }
  // All ten wait in the queue before any is cancelled.
  ASSERT_EQ(e2e::WaitForMetric(port, "attention_queue_depth", {},
                               [](double v) { return v == kExpiring + kCancelled; }),
            kExpiring + kCancelled)
      << "the blocker finished before the short requests queued; it must run longer";
  for (auto& call : cancelled) call->Cancel();
  for (auto& call : expiring) {
    EXPECT_EQ(call->Wait().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  for (auto& call : cancelled) EXPECT_EQ(call->Wait().error_code(), grpc::StatusCode::CANCELLED);

  // The blocker itself completes (only its answer's size is checked, see CalibratedBlocker).
  absl::StatusOr<v1::AttendResponse> blocker_response = blocked.get();
  ASSERT_TRUE(blocker_response.ok()) << blocker_response.status();
  EXPECT_EQ(blocker_response->o().data().size(), blocker->request.q().data().size());
  std::printf(
      "deadline: blocker [1, 16, %ld, 64] computed for %.0f ms; queued requests were "
      "answered while it ran\n",
      static_cast<long>(blocker->seqlen), blocker_response->timing().compute_us() / 1e3);

  // The server answered the queued ones when the worker reached them, without running them.
  const std::map<std::string, std::string> attend = {{"rpc", "Attend"}};
  auto with_code = [&](const char* code) {
    std::map<std::string, std::string> labels = attend;
    labels["code"] = code;
    return labels;
  };
  EXPECT_EQ(e2e::WaitForMetric(port, "attention_requests_total", with_code("DEADLINE_EXCEEDED"),
                               [](double v) { return v >= kExpiring; }),
            kExpiring);
  EXPECT_EQ(e2e::WaitForMetric(port, "attention_requests_total", with_code("CANCELLED"),
                               [](double v) { return v >= kCancelled; }),
            kCancelled);
  // OK: the calibration and the blocker.
  EXPECT_EQ(e2e::WaitForMetric(port, "attention_requests_total", with_code("OK"),
                               [](double v) { return v >= 2; }),
            2);
  // The kernel saw the blocker alone: N query tokens, 4 * 16 * 64 * N * N FLOPs.
  const double blocker_tokens = *tokens_before + blocker->seqlen;
  const double blocker_flops = *flops_before + blocker->flops;
  absl::StatusOr<double> tokens = e2e::ScrapeMetric(port, "attention_tokens_total");
  absl::StatusOr<double> flops = e2e::ScrapeMetric(port, "attention_flops_total");
  ASSERT_TRUE(tokens.ok() && flops.ok());
  EXPECT_EQ(*tokens, blocker_tokens);
  EXPECT_EQ(*flops, blocker_flops);

  // A short request that is not cancelled does reach the kernel: the counters do move.
  e2e::ExpectCorrect(*small, server->client->Attend(*small));
  tokens = e2e::ScrapeMetric(port, "attention_tokens_total");
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(*tokens, blocker_tokens + 3);
  EXPECT_TRUE(server->process->Stop().ok());
}

}  // namespace
}  // namespace attention::reliability
