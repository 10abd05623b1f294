// Horizontal scale through gRPC itself: three attention_server replicas (CPU backend) on loopback
// behind one client channel whose target lists all three, with the round_robin policy and
// retries of UNAVAILABLE. This is the channel a client builds against a Kubernetes headless
// Service (deploy/k8s), whose DNS name resolves to every replica; here the resolver is "ipv4:"
// with the three addresses instead of "dns:".
//
// Several threads send small random requests and check each response against the float64
// reference. One replica is SIGKILLed mid-run (no drain: its in-flight calls fail UNAVAILABLE and
// are retried on the others). The test asserts that every request completed and matched, that
// each replica's attention_requests_total counted a share of the load before the kill, and that
// requests started after the kill completed, served by both survivors.
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"
#include "tests/e2e/server_process.h"

namespace attention::deploy {
namespace {

using e2e::ServerProcess;

constexpr int kReplicas = 3;
constexpr int kClientThreads = 4;
// Requests that must complete before the kill and, of those started after it, after the kill.
constexpr int64_t kMinRequestsPerPhase = 60;
constexpr absl::Duration kMinPhase = absl::Seconds(1);
constexpr absl::Duration kPhaseTimeout = absl::Seconds(20);

// "ipv4:127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3": one channel over every replica.
std::string MultiAddressTarget(const std::vector<std::unique_ptr<ServerProcess>>& replicas) {
  std::vector<std::string> addresses;
  for (const auto& replica : replicas) addresses.push_back(replica->target());
  return absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
}

// round_robin over every address the resolver returns; UNAVAILABLE (a replica that died or is
// draining) is retried, on whichever replica the policy picks next. deploy/README.md gives the
// same service config for clients of the Kubernetes deployment.
std::unique_ptr<client::Client> MakeRoundRobinClient(const std::string& target) {
  return std::make_unique<client::Client>(
      client::ClientOptions{.target = target,
                            .deadline = absl::Seconds(20),
                            .load_balancing = "round_robin",
                            .max_attempts = 5,
                            .initial_backoff = absl::Milliseconds(50),
                            .max_backoff = absl::Seconds(1)});
}

// Attend requests this replica answered OK, from its /metrics.
absl::StatusOr<double> AttendServedOk(const ServerProcess& replica) {
  absl::StatusOr<std::string> body = e2e::HttpGet(replica.metrics_port(), "/metrics");
  if (!body.ok()) return body.status();
  return e2e::SumSamples(e2e::ParseMetrics(*body), "attention_requests_total",
                         {{"rpc", "Attend"}, {"code", "OK"}});
}

// Small random problems (q, k, v of at most 24 KiB each): ragged lengths, GQA or not, causal or
// not.
client::ProblemSpec RandomSmallProblem(std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> seqlen(1, 48);
  std::bernoulli_distribution coin(0.5);
  return {.batch = 1,
          .heads_q = 2,
          .heads_kv = coin(rng) ? 1 : 2,
          .seqlen_q = seqlen(rng),
          .seqlen_k = seqlen(rng),
          .head_dim = coin(rng) ? 32 : 64,
          .causal = coin(rng)};
}

// Client threads sending requests one after another until stopped. Counts what completed and
// matched, what started after MarkKilled() and completed, and keeps the first failures.
class Load {
 public:
  Load(client::Client* client, uint64_t seed) {
    for (int t = 0; t < kClientThreads; ++t) {
      threads_.emplace_back([this, client, seed, t] { Run(client, seed + t); });
    }
  }
  ~Load() { Stop(); }

  void MarkKilled() { killed_ = true; }
  void Stop() {
    stop_ = true;
    for (std::thread& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

  int64_t completed() const { return completed_; }
  int64_t completed_after_kill() const { return completed_after_kill_; }
  int64_t failed() const { return failed_; }
  std::vector<std::string> failures() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }

 private:
  void Run(client::Client* client, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n = 0; !stop_; ++n) {
      const client::ProblemSpec spec = RandomSmallProblem(rng);
      absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
      if (!request.ok()) {
        Fail(absl::StrCat("building ", client::DescribeProblem(spec), ": ",
                          request.status().ToString()));
        continue;
      }
      request->set_request_id(absl::StrCat("seed-", seed, "-", n));
      const bool started_after_kill = killed_;
      absl::Status outcome = Check(*request, client->Attend(*request));
      if (!outcome.ok()) {
        Fail(absl::StrCat(client::DescribeProblem(spec), ": ", outcome.ToString()));
        continue;
      }
      ++completed_;
      if (started_after_kill) ++completed_after_kill_;
    }
  }

  static absl::Status Check(const v1::AttendRequest& request,
                            const absl::StatusOr<v1::AttendResponse>& response) {
    if (!response.ok()) return response.status();
    if (response->request_id() != request.request_id()) {
      return absl::InternalError(absl::StrCat("response for request '", response->request_id(),
                                              "' to request '", request.request_id(), "'"));
    }
    absl::StatusOr<client::CheckResult> check = client::CheckResponse(request, *response);
    if (!check.ok()) return check.status();
    if (!client::WithinBound(*check, request.q().dtype())) {
      return absl::InternalError(absl::StrCat("relative error ", check->relative_error,
                                              " (max element ", check->max_relative_error, ", lse ",
                                              check->lse_relative_error, ") over the bound ",
                                              client::ErrorBound(request.q().dtype())));
    }
    return absl::OkStatus();
  }

  void Fail(std::string message) {
    ++failed_;
    std::lock_guard<std::mutex> lock(mu_);
    if (failures_.size() < 10) failures_.push_back(std::move(message));
  }

  std::atomic<bool> stop_{false};
  std::atomic<bool> killed_{false};
  std::atomic<int64_t> completed_{0};
  std::atomic<int64_t> completed_after_kill_{0};
  std::atomic<int64_t> failed_{0};
  mutable std::mutex mu_;
  std::vector<std::string> failures_;
  std::vector<std::thread> threads_;
};

// Waits until `done` holds and at least kMinPhase has passed; false after kPhaseTimeout.
bool WaitForPhase(const std::function<bool()>& done) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < kPhaseTimeout) {
    if (done() && absl::Now() - start >= kMinPhase) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST(RoundRobinFailoverTest, EveryRequestCompletesWhenAReplicaDiesMidRun) {
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));

  std::vector<std::unique_ptr<ServerProcess>> replicas;
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> replica =
        ServerProcess::Start({.flags = {"--backend=cpu", "--threads=1"}});
    ASSERT_TRUE(replica.ok()) << replica.status();
    replicas.push_back(*std::move(replica));
  }
  std::unique_ptr<client::Client> client = MakeRoundRobinClient(MultiAddressTarget(replicas));

  auto load = std::make_unique<Load>(client.get(), seed);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(WaitForPhase([&] { return load->completed() >= kMinRequestsPerPhase; }))
      << "only " << load->completed() << " requests completed before the kill";

  // Every replica served a share of the load before the kill.
  std::vector<double> served_before(kReplicas);
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<double> served = AttendServedOk(*replicas[i]);
    ASSERT_TRUE(served.ok()) << served.status();
    served_before[i] = *served;
  }
  const int64_t completed_before = load->completed();
  const absl::Duration before_kill = absl::Now() - start;
  const double total_before = served_before[0] + served_before[1] + served_before[2];
  for (int i = 0; i < kReplicas; ++i) {
    EXPECT_GT(served_before[i], 0) << "replica " << i << " served nothing before the kill";
    // round_robin spreads evenly once every connection is up; a tenth leaves room for the
    // requests sent while the first connection was the only one ready.
    EXPECT_GE(served_before[i], 0.1 * total_before)
        << "replica " << i << " served " << served_before[i] << " of " << total_before;
  }

  constexpr int kVictim = 1;
  ASSERT_TRUE(replicas[kVictim]->Signal(SIGKILL).ok());
  absl::StatusOr<int> exit_code = replicas[kVictim]->WaitForExit(absl::Seconds(10));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 128 + SIGKILL);
  load->MarkKilled();
  const absl::Time kill_time = absl::Now();
  ASSERT_TRUE(WaitForPhase([&] { return load->completed_after_kill() >= kMinRequestsPerPhase; }))
      << "only " << load->completed_after_kill() << " requests started after the kill completed";
  load->Stop();
  const absl::Duration after_kill = absl::Now() - kill_time;

  EXPECT_EQ(load->failed(), 0) << "failures (first 10):\n" << absl::StrJoin(load->failures(), "\n");
  EXPECT_GE(load->completed_after_kill(), kMinRequestsPerPhase);

  // Both survivors kept serving after the kill.
  for (int i = 0; i < kReplicas; ++i) {
    if (i == kVictim) continue;
    absl::StatusOr<double> served = AttendServedOk(*replicas[i]);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_GT(*served, served_before[i]) << "replica " << i << " served nothing after the kill";
  }

  const double rate_before = completed_before / absl::ToDoubleSeconds(before_kill);
  const double rate_after = load->completed_after_kill() / absl::ToDoubleSeconds(after_kill);
  std::printf(
      "served before the kill by replica: %.0f %.0f %.0f; %lld requests in %.1f s (%.0f/s) "
      "before, %lld started and completed in %.1f s (%.0f/s) after; %lld failed\n",
      served_before[0], served_before[1], served_before[2],
      static_cast<long long>(completed_before), absl::ToDoubleSeconds(before_kill), rate_before,
      static_cast<long long>(load->completed_after_kill()), absl::ToDoubleSeconds(after_kill),
      rate_after, static_cast<long long>(load->failed()));

  // Close the connections first: an open one makes the server's drain wait for it.
  load.reset();
  client.reset();
  for (int i = 0; i < kReplicas; ++i) {
    if (i == kVictim) continue;
    EXPECT_TRUE(replicas[i]->Stop().ok()) << replicas[i]->Log();
  }
}

}  // namespace
}  // namespace attention::deploy
