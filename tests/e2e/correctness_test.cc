// End to end correctness: requests over loopback gRPC to the real server binary, every response
// compared with the float64 reference computed in the test.
#include <algorithm>
#include <future>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::e2e {
namespace {

using client::ProblemSpec;

// One CPU server for the suite (tests in one process share it).
class CpuServerTest : public SharedServerTest<CpuServerTest> {
 public:
  static std::vector<std::string> ServerFlags() { return {"--backend=cpu"}; }
};

class GridTest : public CpuServerTest, public ::testing::WithParamInterface<ProblemSpec> {};

TEST_P(GridTest, MatchesReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat(client::DescribeProblem(GetParam()), ", seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(GetParam(), rng);
  ASSERT_TRUE(request.ok()) << request.status();
  request->set_request_id(absl::StrCat("grid-", seed));
  ExpectCorrect(*request, client().Attend(*request));
}

INSTANTIATE_TEST_SUITE_P(Cpu, GridTest, ::testing::ValuesIn(CorrectnessGrid()),
                         [](const ::testing::TestParamInfo<ProblemSpec>& info) {
                           return absl::StrCat("p", info.index);
                         });

// Many requests of mixed shapes and dtypes over one stream; responses may come in any order and
// each must answer its own request.
TEST_F(CpuServerTest, StreamMatchesEachResponseToItsRequest) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const std::vector<ProblemSpec> grid = CorrectnessGrid();
  std::vector<v1::AttendRequest> requests;
  for (int i = 0; i < 48; ++i) {
    // Several requests share a shape, so only the data tells their answers apart.
    absl::StatusOr<v1::AttendRequest> request =
        client::MakeRandomRequest(grid[(i * 7) % grid.size()], rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("stream-", i));
    requests.push_back(*std::move(request));
  }
  absl::StatusOr<std::vector<v1::AttendResponse>> responses = client().AttendStream(requests);
  ASSERT_TRUE(responses.ok()) << responses.status();

  std::map<std::string, const v1::AttendResponse*> by_id;
  for (const v1::AttendResponse& response : *responses) {
    EXPECT_TRUE(by_id.emplace(response.request_id(), &response).second)
        << "two responses for " << response.request_id();
  }
  for (const v1::AttendRequest& request : requests) {
    SCOPED_TRACE(request.request_id());
    auto it = by_id.find(request.request_id());
    ASSERT_NE(it, by_id.end()) << "no response";
    ExpectCorrect(request, *it->second);
  }
}

// Concurrent unary calls (which the server may batch together) each get their own answer.
TEST_F(CpuServerTest, ConcurrentCallsGetTheirOwnAnswers) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const ProblemSpec spec{.batch = 1,
                         .heads_q = 4,
                         .heads_kv = 2,
                         .seqlen_q = 33,
                         .seqlen_k = 90,
                         .head_dim = 64,
                         .causal = true,
                         .return_lse = true};
  std::vector<v1::AttendRequest> requests;
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> futures;
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("async-", i));
    requests.push_back(*std::move(request));
  }
  for (const v1::AttendRequest& request : requests) {
    futures.push_back(client().AttendAsync(request));
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(requests[i].request_id());
    ExpectCorrect(requests[i], futures[i].get());
  }
}

// The same grid on the CUDA backend; skipped where the server finds no GPU.
TEST(GpuE2E, GridMatchesReferenceOnCuda) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cuda"});
  if (!server.ok()) GTEST_SKIP() << "no CUDA server: " << server.status().message();
  absl::StatusOr<v1::ServerInfo> info = server->client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  if (info->backend() != "cuda") {
    EXPECT_EQ(server->Stop(), absl::OkStatus());
    GTEST_SKIP() << "server backend is '" << info->backend() << "', not cuda";
  }
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (const ProblemSpec& spec : CorrectnessGrid()) {
    SCOPED_TRACE(client::DescribeProblem(spec));
    // A dtype the device cannot do is UNIMPLEMENTED by contract; ServerInfo says which it does.
    if (std::find(info->dtypes().begin(), info->dtypes().end(), spec.dtype) ==
        info->dtypes().end()) {
      continue;
    }
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    absl::StatusOr<v1::AttendResponse> response = server->client->Attend(*request);
    ExpectCorrect(*request, response);
    if (response.ok()) EXPECT_EQ(response->device().rfind("cuda:", 0), 0u) << response->device();
  }
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace attention::e2e
