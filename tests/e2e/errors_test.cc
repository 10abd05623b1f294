// End to end errors: every status code of the API that the CPU backend can produce, with a
// message naming the field, and a server that keeps serving correctly afterwards.
#include <signal.h>

#include <cctype>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
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

// One worker, one queue slot: while a blocker runs, the first of a burst of small requests waits
// in the slot and the rest are refused at once with RESOURCE_EXHAUSTED and a message about the
// queue; the blocker and the queued request are answered, and the server goes on.
TEST(ResourceLimitsTest, FullQueueIsResourceExhausted) {
  constexpr int kBurst = 8;
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--workers=1", "--max_queue=1", "--max_batch=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<Blocker> blocker = CalibratedBlocker(*server->client, absl::Seconds(1), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  std::future<absl::StatusOr<v1::AttendResponse>> blocked =
      server->client->AttendAsync(blocker->request);
  ASSERT_TRUE(WaitUntilRunning(server->process->metrics_port())) << "the blocker never ran";

  // The burst goes out one call at a time, so the first one sent is the one that is queued.
  absl::StatusOr<v1::AttendRequest> small = Request(kDense, seed + 1);
  ASSERT_TRUE(small.ok()) << small.status();
  std::future<absl::StatusOr<v1::AttendResponse>> queued = server->client->AttendAsync(*small);
  ASSERT_EQ(WaitForMetric(server->process->metrics_port(), "attention_queue_depth", {},
                          [](double v) { return v >= 1; }),
            1);
  for (int i = 1; i < kBurst; ++i) {
    absl::StatusOr<v1::AttendResponse> refused = server->client->Attend(*small);
    ASSERT_FALSE(refused.ok()) << "call " << i
                               << " of the burst was served while the queue was full";
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_TRUE(HasWord(absl::AsciiStrToLower(refused.status().message()), "queue"))
        << refused.status();
  }
  ExpectBlockerAnswered(*blocker, blocked.get());
  ExpectCorrect(*small, queued.get());
  ExpectCorrect(*small, server->client->Attend(*small));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// SIGTERM while one request runs and five wait: every accepted request is answered, new calls are
// refused with UNAVAILABLE, and the server exits 0.
TEST(ShutdownTest, SigtermDrainsInFlightRequests) {
  constexpr int kQueued = 5;
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--threads=1", "--workers=1", "--shutdown_grace_s=20"});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<Blocker> blocker = CalibratedBlocker(*server->client, absl::Seconds(1), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  absl::StatusOr<v1::AttendRequest> small = Request(kDense, seed + 1);
  ASSERT_TRUE(small.ok()) << small.status();

  std::future<absl::StatusOr<v1::AttendResponse>> blocked =
      server->client->AttendAsync(blocker->request);
  ASSERT_TRUE(WaitUntilRunning(server->process->metrics_port())) << "the blocker never ran";
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> queued;
  for (int i = 0; i < kQueued; ++i) queued.push_back(server->client->AttendAsync(*small));
  // Every call accepted (counted in flight) before the signal; calls the server has not yet
  // accepted when it stops would be outside this test (gRPC may cancel those).
  ASSERT_EQ(WaitForMetric(server->process->metrics_port(), "attention_inflight_requests", {},
                          [](double v) { return v >= 1 + kQueued; }),
            1 + kQueued);
  ASSERT_TRUE(server->process->Signal(SIGTERM).ok());

  ExpectBlockerAnswered(*blocker, blocked.get());
  for (auto& future : queued) ExpectCorrect(*small, future.get());
  absl::StatusOr<v1::AttendResponse> late = server->client->Attend(*small);
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
