// Soak: 32 concurrent clients for ATTENTION_SOAK_S seconds (15 by default; 120 or more for the
// long run), each sending requests of random shape, dtype, layout, mask and varlen-ness, with
// fresh random data and a unique request_id. Every response is checked against the float64
// reference of its own request, so a response delivered to the wrong caller, or computed from
// another request's tensors, fails. A quarter of the clients use AttendStream (responses may come
// out of order: they are matched by request_id), the rest unary Attend.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::reliability {
namespace {

using client::ProblemSpec;

int SoakSeconds() {
  const char* env = std::getenv("ATTENTION_SOAK_S");
  return env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : 15;
}

// Small random problems: every feature, reference checks cheap enough for 2 cores.
ProblemSpec RandomSpec(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  ProblemSpec s;
  s.heads_kv = pick(1, 2);
  s.heads_q = s.heads_kv * pick(1, 3);
  const int dims[] = {8, 16, 24, 32, 64, 80, 128};
  s.head_dim = dims[pick(0, 6)];
  const v1::DType dtypes[] = {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16};
  s.dtype = dtypes[pick(0, 2)];
  s.layout = pick(0, 1) ? v1::LAYOUT_BSHD : v1::LAYOUT_BHSD;
  s.causal = pick(0, 2) == 0;
  if (pick(0, 3) == 0) s.window_left = pick(0, 16);
  if (!s.causal && pick(0, 3) == 0) s.window_right = pick(0, 16);
  if (pick(0, 3) == 0) s.softmax_scale = 0.05f + 0.5f * pick(0, 10) / 10.0f;
  s.return_lse = pick(0, 1) == 1;
  if (pick(0, 4) == 0) {
    const int items = pick(1, 3);
    for (int i = 0; i < items; ++i) {
      s.varlen_q.push_back(pick(1, 40));
      s.varlen_k.push_back(pick(1, 40));
    }
  } else {
    s.batch = pick(1, 2);
    s.seqlen_q = pick(1, 48);
    s.seqlen_k = pick(1, 48);
  }
  return s;
}

TEST(SoakTest, EveryResponseMatchesItsOwnRequest) {
  constexpr int kClients = 32;
  const absl::Duration duration = absl::Seconds(SoakSeconds());
  absl::StatusOr<e2e::RunningServer> server =
      e2e::StartServer({"--backend=cpu", "--workers=4", "--max_queue=1024"});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));

  std::atomic<int64_t> checked{0};
  const absl::Time end = absl::Now() + duration;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 rng(seed + c);
      client::Client client({.target = server->process->target()});
      const bool streams = c % 4 == 0;
      // The first failure stops every client: one wrong answer is enough to report.
      for (int64_t n = 0; absl::Now() < end && !::testing::Test::HasFailure(); ++n) {
        // A stream carries 4 requests at once; a unary client sends 1.
        std::vector<v1::AttendRequest> batch;
        std::vector<ProblemSpec> specs;
        for (int i = 0; i < (streams ? 4 : 1); ++i) {
          specs.push_back(RandomSpec(rng));
          absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(specs.back(), rng);
          ASSERT_TRUE(request.ok()) << request.status();
          request->set_request_id(absl::StrCat("c", c, "-", n, "-", i));
          batch.push_back(*std::move(request));
        }
        std::map<std::string, absl::StatusOr<v1::AttendResponse>> responses;
        if (streams) {
          absl::StatusOr<std::vector<v1::AttendResponse>> streamed = client.AttendStream(batch);
          if (!streamed.ok()) {
            ADD_FAILURE() << "stream " << c << ": " << streamed.status();
            continue;
          }
          for (v1::AttendResponse& r : *streamed) responses.emplace(r.request_id(), std::move(r));
        } else {
          responses.emplace(batch[0].request_id(), client.Attend(batch[0]));
        }
        for (size_t i = 0; i < batch.size(); ++i) {
          SCOPED_TRACE(
              absl::StrCat(batch[i].request_id(), ": ", client::DescribeProblem(specs[i])));
          auto it = responses.find(batch[i].request_id());
          if (it == responses.end()) {
            ADD_FAILURE() << "no response carries this request_id";
            continue;
          }
          e2e::ExpectCorrect(batch[i], it->second);
          checked.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_GT(checked.load(), 0);
  std::printf(
      "soak: %d clients, %s, %lld responses checked against their own reference "
      "(%.0f/s), %s\n",
      kClients, absl::FormatDuration(duration).c_str(), static_cast<long long>(checked.load()),
      checked.load() / absl::ToDoubleSeconds(duration),
      ::testing::Test::HasFailure() ? "FAILED" : "all correct");
  EXPECT_TRUE(server->process->Stop().ok());
}

}  // namespace
}  // namespace attention::reliability
