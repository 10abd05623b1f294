// Overload: a server with one worker and --max_queue=2 under 48 clients sending as fast as they
// can. Requests beyond the queue must be refused at once with RESOURCE_EXHAUSTED naming the queue
// length and limit; every accepted request must come back correct; the server's memory must stay
// bounded by what it admits (queue + running + the messages being read), not by the offered load.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"
#include "tests/reliability/reliability_util.h"

namespace attention::reliability {
namespace {

using ::testing::HasSubstr;

TEST(OverloadTest, ExcessIsRefusedAtOnceAcceptedWorkIsCorrectMemoryStaysBounded) {
  constexpr int kClients = 48;
  constexpr int kRequestsPerClient = 4;
  constexpr int kMaxQueue = 2;
  absl::StatusOr<e2e::RunningServer> server = e2e::StartServer(
      {"--backend=cpu", "--threads=1", "--workers=1", absl::StrCat("--max_queue=", kMaxQueue)});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));

  // Four requests that are cheap to send and slow to compute: q [1, 1, 4096, 4] float32 (64 KiB)
  // against 4096 - 100 * i keys, a quarter GFLOP, tens of milliseconds on one thread. Client c
  // sends request c % 4; the keys differ, so each response fits one request only.
  constexpr int kDistinct = 4;
  std::vector<v1::AttendRequest> requests;
  for (int i = 0; i < kDistinct; ++i) {
    const client::ProblemSpec spec{.batch = 1,
                                   .heads_q = 1,
                                   .heads_kv = 1,
                                   .seqlen_q = 4096,
                                   .seqlen_k = 4096 - 100 * i,
                                   .head_dim = 4};
    std::mt19937_64 rng(seed + i);
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("request-", i));
    requests.push_back(*std::move(request));
  }
  const int64_t request_bytes = static_cast<int64_t>(requests[0].ByteSizeLong());
  // The first accepted response to each request is checked against the float64 reference; the
  // later ones must equal it bit for bit (one compute thread: the kernel is deterministic).
  std::vector<std::optional<v1::AttendResponse>> verified(kDistinct);

  absl::StatusOr<int64_t> rss_before = ResidentBytes(server->process->pid());
  ASSERT_TRUE(rss_before.ok()) << rss_before.status();
  std::atomic<bool> sampling{true};
  std::atomic<int64_t> rss_peak{*rss_before};
  std::thread sampler([&] {
    while (sampling.load()) {
      absl::StatusOr<int64_t> rss = ResidentBytes(server->process->pid());
      if (rss.ok()) rss_peak.store(std::max(rss_peak.load(), *rss));
      absl::SleepFor(absl::Milliseconds(5));
    }
  });

  std::mutex mu;
  int accepted = 0, refused = 0;
  std::vector<absl::Duration> refusal_latency, accepted_latency;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      // One channel per client, as separate processes would have.
      client::Client client({.target = server->process->target()});
      const int r = c % kDistinct;
      for (int i = 0; i < kRequestsPerClient; ++i) {
        const absl::Time start = absl::Now();
        absl::StatusOr<v1::AttendResponse> response = client.Attend(requests[r]);
        const absl::Duration latency = absl::Now() - start;
        if (response.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (!verified[r].has_value()) {
            e2e::ExpectCorrect(requests[r], response);
            verified[r] = *response;
          } else {
            EXPECT_EQ(response->request_id(), requests[r].request_id());
            EXPECT_EQ(response->o().shape_size(), 4);
            EXPECT_TRUE(response->o().data() == verified[r]->o().data())
                << "a response differs from the verified one for " << requests[r].request_id();
          }
          ++accepted;
          accepted_latency.push_back(latency);
          continue;
        }
        EXPECT_EQ(response.status().code(), absl::StatusCode::kResourceExhausted)
            << response.status();
        EXPECT_THAT(std::string(response.status().message()),
                    HasSubstr(absl::StrCat("queued, limit ", kMaxQueue)));
        std::lock_guard<std::mutex> lock(mu);
        ++refused;
        refusal_latency.push_back(latency);
      }
    });
  }
  for (std::thread& t : clients) t.join();
  sampling.store(false);
  sampler.join();

  EXPECT_EQ(accepted + refused, kClients * kRequestsPerClient);
  EXPECT_GE(accepted, 1);
  EXPECT_GE(refused, kClients) << "48 clients against a queue of 2 must overflow";
  ASSERT_FALSE(refusal_latency.empty());
  ASSERT_FALSE(accepted_latency.empty());
  std::sort(refusal_latency.begin(), refusal_latency.end());
  std::sort(accepted_latency.begin(), accepted_latency.end());
  const absl::Duration refusal_median = refusal_latency[refusal_latency.size() / 2];
  const absl::Duration accepted_median = accepted_latency[accepted_latency.size() / 2];
  // "At once": a refusal does not wait for compute, so it is faster than an accepted request.
  EXPECT_LT(refusal_median, accepted_median);
  const int64_t growth = rss_peak.load() - *rss_before;
  // Bound: every client's message in memory at once twice over (wire buffer and parsed copy),
  // plus the response of each admitted request, plus 64 MiB for threads and allocator slack.
  int64_t bound =
      2 * kClients * request_bytes + (kMaxQueue + 1) * request_bytes + (int64_t{64} << 20);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer holds freed memory in a quarantine (256 MiB by default) before reuse.
  bound += int64_t{256} << 20;
#endif
  EXPECT_LT(growth, bound);
  std::printf(
      "overload: %d accepted, %d refused; median latency refused %s, accepted %s; max refused "
      "%s; server RSS %.1f MiB -> peak %.1f MiB (bound +%.1f MiB)\n",
      accepted, refused, absl::FormatDuration(refusal_median).c_str(),
      absl::FormatDuration(accepted_median).c_str(),
      absl::FormatDuration(refusal_latency.back()).c_str(), *rss_before / 1048576.0,
      rss_peak.load() / 1048576.0, bound / 1048576.0);

  // Still serving, and nothing left queued.
  e2e::ExpectCorrect(requests[1], server->client->Attend(requests[1]));
  absl::StatusOr<double> depth =
      e2e::ScrapeMetric(server->process->metrics_port(), "attention_queue_depth");
  ASSERT_TRUE(depth.ok()) << depth.status();
  EXPECT_EQ(*depth, 0);
  EXPECT_TRUE(server->process->Stop().ok());
}

}  // namespace
}  // namespace attention::reliability
