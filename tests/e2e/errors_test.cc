// End to end errors: every status code of the API that the CPU backend can produce, with a
// message naming the field, and a server that keeps serving correctly afterwards.
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using client::ProblemSpec;

// Whether `word` occurs in `text` as a whole identifier ("q" in "q.shape[1]", not in "expected").
bool HasWord(const std::string& text, const std::string& word) {
  auto is_ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const bool starts = at == 0 || !is_ident(text[at - 1]);
    const size_t end = at + word.size();
    if (starts && (end == text.size() || !is_ident(text[end]))) return true;
  }
  return false;
}

absl::StatusOr<v1::AttendRequest> Request(const ProblemSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return client::MakeRandomRequest(spec, rng);
}

// A valid dense request to break: q [2, 4, 16, 32], k and v [2, 2, 24, 32], float32.
const ProblemSpec kDense{
    .batch = 2, .heads_q = 4, .heads_kv = 2, .seqlen_q = 16, .seqlen_k = 24, .head_dim = 32};
// A valid varlen request to break: q [10, 2, 16] with cu_seqlens_q {0, 3, 10}, k and v [12, 2, 16]
// with cu_seqlens_k {0, 5, 12}.
const ProblemSpec kVarlen{
    .heads_q = 2, .heads_kv = 2, .head_dim = 16, .varlen_q = {3, 7}, .varlen_k = {5, 7}};

struct MalformedCase {
  std::string name;
  const ProblemSpec* base;
  std::function<void(v1::AttendRequest*)> corrupt;
  // Words the message must contain: the field, and for shapes what is wrong with it.
  std::vector<std::string> words;
};

std::vector<MalformedCase> MalformedCases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  return {
      {"MissingQ", &kDense, [](v1::AttendRequest* r) { r->clear_q(); }, {"q"}},
      {"MissingV", &kDense, [](v1::AttendRequest* r) { r->clear_v(); }, {"v"}},
      {"WrongRank",
       &kDense,
       [](v1::AttendRequest* r) { r->mutable_q()->mutable_shape()->RemoveLast(); },
       {"q", "shape"}},
      {"ByteSizeMismatch",
       &kDense,
       [](v1::AttendRequest* r) {
         r->mutable_k()->mutable_data()->resize(r->k().data().size() - 4);
       },
       {"k", "data"}},
      {"DTypeMismatch",
       &kDense,
       [](v1::AttendRequest* r) {
         r->mutable_v()->set_dtype(v1::DTYPE_FLOAT16);
         r->mutable_v()->mutable_data()->resize(r->v().data().size() / 2);
       },
       {"v", "dtype"}},
      {"DTypeUnspecified",
       &kDense,
       [](v1::AttendRequest* r) {
         for (v1::Tensor* t : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) {
           t->set_dtype(v1::DTYPE_UNSPECIFIED);
         }
       },
       {"dtype"}},
      {"HeadsNotDivisible",
       &kDense,
       [](v1::AttendRequest* r) {
         // Hkv = 3 does not divide Hq = 4: k, v [2, 3, 24, 32].
         for (v1::Tensor* t : {r->mutable_k(), r->mutable_v()}) {
           t->set_shape(1, 3);
           t->mutable_data()->resize(2 * 3 * 24 * 32 * 4);
         }
       },
       {"heads"}},
      {"HeadDimZero",
       &kDense,
       [](v1::AttendRequest* r) {
         for (v1::Tensor* t : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) {
           t->set_shape(3, 0);
           t->clear_data();
         }
       },
       {"shape"}},
      {"HeadDimTooLarge",
       &kDense,
       [](v1::AttendRequest* r) {
         // D = 257: q [2, 4, 16, 257], k and v [2, 2, 24, 257].
         r->mutable_q()->set_shape(3, 257);
         r->mutable_q()->mutable_data()->resize(2 * 4 * 16 * 257 * 4);
         for (v1::Tensor* t : {r->mutable_k(), r->mutable_v()}) {
           t->set_shape(3, 257);
           t->mutable_data()->resize(2 * 2 * 24 * 257 * 4);
         }
       },
       {"head", "dim"}},
      {"HeadDimMismatch",
       &kDense,
       [](v1::AttendRequest* r) {
         for (v1::Tensor* t : {r->mutable_k(), r->mutable_v()}) {
           t->set_shape(3, 16);
           t->mutable_data()->resize(2 * 2 * 24 * 16 * 4);
         }
       },
       {"k", "shape"}},
      {"BatchMismatch",
       &kDense,
       [](v1::AttendRequest* r) {
         for (v1::Tensor* t : {r->mutable_k(), r->mutable_v()}) {
           t->set_shape(0, 1);
           t->mutable_data()->resize(t->data().size() / 2);
         }
       },
       {"k", "shape"}},
      {"ScaleNaN",
       &kDense,
       [nan](v1::AttendRequest* r) { r->set_softmax_scale(nan); },
       {"softmax_scale"}},
      {"ScaleInf",
       &kDense,
       [inf](v1::AttendRequest* r) { r->set_softmax_scale(inf); },
       {"softmax_scale"}},
      {"NegativeWindowLeft",
       &kDense,
       [](v1::AttendRequest* r) { r->set_window_left(-1); },
       {"window_left"}},
      {"NegativeWindowRight",
       &kDense,
       [](v1::AttendRequest* r) { r->set_window_right(-5); },
       {"window_right"}},
      {"CuSeqlensFirstNotZero",
       &kVarlen,
       [](v1::AttendRequest* r) { r->set_cu_seqlens_q(0, 1); },
       {"cu_seqlens_q"}},
      {"CuSeqlensDecreasing",
       &kVarlen,
       [](v1::AttendRequest* r) { r->set_cu_seqlens_k(1, 13); },
       {"cu_seqlens_k"}},
      {"CuSeqlensWrongTotal",
       &kVarlen,
       [](v1::AttendRequest* r) { r->set_cu_seqlens_q(2, 9); },
       {"cu_seqlens_q"}},
      {"CuSeqlensCountsDiffer",
       &kVarlen,
       [](v1::AttendRequest* r) { r->add_cu_seqlens_k(12); },
       {"cu_seqlens_k"}},
      {"CuSeqlensOnlyQ",
       &kVarlen,
       [](v1::AttendRequest* r) { r->clear_cu_seqlens_k(); },
       {"cu_seqlens_k"}},
  };
}

class ErrorsTest : public SharedServerTest<ErrorsTest> {
 public:
  static std::vector<std::string> ServerFlags() { return {"--backend=cpu"}; }

 protected:
  // A correct answer to a fresh request: the server is still serving.
  void ExpectStillServes() {
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    absl::StatusOr<v1::AttendRequest> request = Request(kDense, seed);
    ASSERT_TRUE(request.ok()) << request.status();
    ExpectCorrect(*request, client().Attend(*request));
  }
};

class MalformedTest : public ErrorsTest, public ::testing::WithParamInterface<MalformedCase> {};

TEST_P(MalformedTest, IsInvalidArgumentNamingTheField) {
  const MalformedCase& c = GetParam();
  absl::StatusOr<v1::AttendRequest> request = Request(*c.base, FreshSeed());
  ASSERT_TRUE(request.ok()) << request.status();
  c.corrupt(&*request);
  absl::StatusOr<v1::AttendResponse> response = client().Attend(*request);
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << response.status();
  const std::string message(response.status().message());
  for (const std::string& word : c.words) {
    EXPECT_TRUE(HasWord(message, word)) << "'" << message << "' does not name '" << word << "'";
  }
  ExpectStillServes();
}

INSTANTIATE_TEST_SUITE_P(Cpu, MalformedTest, ::testing::ValuesIn(MalformedCases()),
                         [](const ::testing::TestParamInfo<MalformedCase>& info) {
                           return info.param.name;
                         });

// A malformed request inside a stream ends that stream with INVALID_ARGUMENT; the server keeps
// serving other calls.
TEST_F(ErrorsTest, MalformedRequestEndsStream) {
  absl::StatusOr<v1::AttendRequest> good = Request(kDense, FreshSeed());
  ASSERT_TRUE(good.ok()) << good.status();
  v1::AttendRequest bad = *good;
  bad.clear_k();
  absl::StatusOr<std::vector<v1::AttendResponse>> responses =
      client().AttendStream(std::vector<v1::AttendRequest>{*good, bad, *good});
  ASSERT_FALSE(responses.ok());
  EXPECT_EQ(responses.status().code(), absl::StatusCode::kInvalidArgument) << responses.status();
  ExpectStillServes();
}

TEST_F(ErrorsTest, TinyDeadlineOnBigRequestIsDeadlineExceeded) {
  // q, k, v [1, 8, 1024, 128] float32: 12 MiB to send and 4 GFLOP to compute.
  const ProblemSpec big{
      .batch = 1, .heads_q = 8, .heads_kv = 8, .seqlen_q = 1024, .seqlen_k = 1024, .head_dim = 128};
  absl::StatusOr<v1::AttendRequest> request = Request(big, FreshSeed());
  ASSERT_TRUE(request.ok()) << request.status();
  absl::StatusOr<v1::AttendResponse> response =
      client().Attend(*request, {.deadline = absl::Milliseconds(1)});
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kDeadlineExceeded) << response.status();
  ExpectStillServes();
}

TEST(ResourceLimitsTest, RequestOverMessageLimitIsResourceExhausted) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu", "--max_message_mb=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  // q, k, v [1, 4, 1024, 64] float32: 3 MiB, over the 1 MiB limit.
  const ProblemSpec big{
      .batch = 1, .heads_q = 4, .heads_kv = 4, .seqlen_q = 1024, .seqlen_k = 1024, .head_dim = 64};
  absl::StatusOr<v1::AttendRequest> request = Request(big, FreshSeed());
  ASSERT_TRUE(request.ok()) << request.status();
  absl::StatusOr<v1::AttendResponse> response = server->client->Attend(*request);
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kResourceExhausted) << response.status();

  absl::StatusOr<v1::AttendRequest> small = Request(kDense, FreshSeed());
  ASSERT_TRUE(small.ok()) << small.status();
  ExpectCorrect(*small, server->client->Attend(*small));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// A request that computes for tens of milliseconds yet is cheap to send: q, k, v [1, 1, 4096, 32]
// float32 (1.5 MiB, 2.1 GFLOP). The float64 reference would take seconds, so the tests below
// check its answers for completeness and agreement with each other; correctness is the grid's.
const ProblemSpec kSlow{
    .batch = 1, .heads_q = 1, .heads_kv = 1, .seqlen_q = 4096, .seqlen_k = 4096, .head_dim = 32};

// Every OK response is complete (finite, q's shape) and, the requests being identical, equal to
// the first. Returns how many were OK; the others must have `allowed` codes.
int CheckSameAnswers(std::vector<std::future<absl::StatusOr<v1::AttendResponse>>>& futures,
                     const std::vector<absl::StatusCode>& allowed,
                     std::vector<absl::Status>* errors) {
  int ok = 0;
  std::string first;
  for (auto& future : futures) {
    absl::StatusOr<v1::AttendResponse> response = future.get();
    if (!response.ok()) {
      EXPECT_NE(std::find(allowed.begin(), allowed.end(), response.status().code()), allowed.end())
          << response.status();
      errors->push_back(response.status());
      continue;
    }
    absl::StatusOr<std::vector<float>> o = client::TensorToFloat(response->o());
    EXPECT_TRUE(o.ok()) << o.status();
    if (o.ok()) {
      EXPECT_EQ(o->size(), client::NumElements(client::QueryShape(kSlow)));
      EXPECT_TRUE(std::all_of(o->begin(), o->end(), [](float x) { return std::isfinite(x); }));
    }
    if (ok++ == 0) {
      first = response->o().data();
    } else {
      EXPECT_TRUE(response->o().data() == first) << "identical requests, different answers";
    }
  }
  return ok;
}

// One worker, one queue slot and a burst of slow requests: the overflow is RESOURCE_EXHAUSTED
// with a message about the queue, the accepted requests are answered, and the server goes on.
TEST(ResourceLimitsTest, FullQueueIsResourceExhausted) {
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--workers=1", "--max_queue=1", "--max_batch=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<v1::AttendRequest> request = Request(kSlow, FreshSeed());
  ASSERT_TRUE(request.ok()) << request.status();
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> futures;
  for (int i = 0; i < 8; ++i) futures.push_back(server->client->AttendAsync(*request));
  std::vector<absl::Status> errors;
  const int ok = CheckSameAnswers(futures, {absl::StatusCode::kResourceExhausted}, &errors);
  EXPECT_GE(ok, 1);
  EXPECT_GE(errors.size(), 1u);
  for (const absl::Status& error : errors) {
    EXPECT_TRUE(HasWord(absl::AsciiStrToLower(error.message()), "queue")) << error;
  }
  absl::StatusOr<v1::AttendRequest> small = Request(kDense, FreshSeed());
  ASSERT_TRUE(small.ok()) << small.status();
  ExpectCorrect(*small, server->client->Attend(*small));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// SIGTERM while requests run: the accepted ones finish (OK, or UNAVAILABLE if the server drops
// queued work while draining), new calls are refused with UNAVAILABLE, and the server exits 0.
TEST(ShutdownTest, SigtermDrainsInFlightRequests) {
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--threads=1", "--workers=1", "--shutdown_grace_s=20"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<v1::AttendRequest> request = Request(kSlow, FreshSeed());
  ASSERT_TRUE(request.ok()) << request.status();
  constexpr int kRequests = 6;
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> futures;
  for (int i = 0; i < kRequests; ++i) futures.push_back(server->client->AttendAsync(*request));

  // Wait until the server has accepted every request (in flight plus finished) while several
  // are still in flight, then stop it. Calls the server has not yet accepted when it stops are
  // outside this test: gRPC may cancel those.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  double inflight = 0, accepted = 0;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::string> metrics = HttpGet(server->process->metrics_port(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    const std::vector<MetricSample> samples = ParseMetrics(*metrics);
    inflight = SumSamples(samples, "attention_inflight_requests");
    accepted = inflight + SumSamples(samples, "attention_requests_total", {{"rpc", "Attend"}});
    if (accepted >= kRequests) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_GE(accepted, kRequests) << "the server never accepted every request";
  ASSERT_GE(inflight, 2) << "requests finished before the test could stop the server";
  ASSERT_TRUE(server->process->Signal(SIGTERM).ok());

  std::vector<absl::Status> errors;
  const int ok = CheckSameAnswers(futures, {absl::StatusCode::kUnavailable}, &errors);
  EXPECT_GE(ok, 1) << "the running request must complete";

  absl::StatusOr<v1::AttendResponse> late = server->client->Attend(*request);
  EXPECT_FALSE(late.ok());
  if (!late.ok()) {
    EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  }
  absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << server->process->Log();
}

}  // namespace
}  // namespace attention::e2e
