// Attention.AttendChunked against the real server: requests larger than the message limit (the
// limit lowered to 1 MiB, so the logic that carries tensors over 2 GiB runs here in milliseconds)
// sent in small ragged chunks come back equal to the float64 reference; chunks out of order work;
// overlaps, bytes outside a tensor, missing bytes and a missing header are INVALID_ARGUMENT; every
// call is counted in the metrics.
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/request_builder.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using ::testing::HasSubstr;

class ChunkedTest : public SharedServerTest<ChunkedTest> {
 public:
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--max_message_mb=1", "--max_chunked_request_mb=64",
            "--chunked_memory_mb=48", "--chunked_idle_timeout_s=1"};
  }
};

// Over the 1 MiB message limit: float32 q [1, 4, 300, 64], k and v [1, 2, 1500, 64] (~1.8 MiB),
// GQA, causal, with LSE; and bfloat16 BSHD with a window.
std::vector<client::ProblemSpec> LargeProblems() {
  return {{.batch = 1,
           .heads_q = 4,
           .heads_kv = 2,
           .seqlen_q = 300,
           .seqlen_k = 1500,
           .head_dim = 64,
           .causal = true,
           .return_lse = true},
          {.batch = 2,
           .heads_q = 4,
           .heads_kv = 4,
           .seqlen_q = 257,
           .seqlen_k = 1201,
           .head_dim = 128,
           .dtype = v1::DTYPE_BFLOAT16,
           .layout = v1::LAYOUT_BSHD,
           .window_left = 100,
           .return_lse = true}};
}

TEST_F(ChunkedTest, OverTheMessageLimitMatchesTheReference) {
  for (const client::ProblemSpec& spec : LargeProblems()) {
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937_64 rng(seed);
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("chunked-", seed));
    ASSERT_GT(request->ByteSizeLong(), size_t{1} << 20);
    // The unary call is refused by size; the chunked one carries it.
    EXPECT_EQ(client().Attend(*request).status().code(), absl::StatusCode::kResourceExhausted);
    // Ragged chunks: no tensor is a multiple of them.
    ExpectCorrect(*request, client().AttendChunked(*request, 96 * 1024 + 7));
  }
  EXPECT_GE(ScrapeMetric(process().metrics_port(), "attention_requests_total",
                         {{"rpc", "AttendChunked"}, {"code", "OK"}})
                .value_or(0),
            2);
}

// ClientOptions::connections = 3: calls spread round-robin over three channels (idle before, all
// READY once each carried a call), every answer equal to the reference, unary and chunked.
TEST_F(ChunkedTest, CallsSpreadOverSeveralConnectionsMatchTheReference) {
  client::Client spread({.target = process().target(), .connections = 3});
  ASSERT_EQ(spread.attend_channels().size(), 3u);
  for (const auto& channel : spread.attend_channels()) {
    EXPECT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_IDLE);
  }
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(
        {.batch = 1, .heads_q = 4, .heads_kv = 2, .seqlen_q = 33, .seqlen_k = 70, .head_dim = 64},
        rng);
    ASSERT_TRUE(small.ok()) << small.status();
    ExpectCorrect(*small, spread.Attend(*small));
  }
  for (const auto& channel : spread.attend_channels()) {
    EXPECT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
  }
  absl::StatusOr<v1::AttendRequest> large = client::MakeRandomRequest(LargeProblems()[0], rng);
  ASSERT_TRUE(large.ok()) << large.status();
  ExpectCorrect(*large, spread.AttendChunked(*large, 64 * 1024));
}

// A raw AttendChunked call sending `messages` as they are, then reading the answer.
struct RawAnswer {
  grpc::Status status;
  int messages = 0;
};
// One raw AttendChunked call, each step awaited on its own completion queue.
class RawCall {
 public:
  RawCall(const std::shared_ptr<grpc::Channel>& channel, std::chrono::seconds deadline)
      : stub_(channel) {
    context_.set_deadline(std::chrono::system_clock::now() + deadline);
    call_ = stub_.PrepareCall(&context_, "/attention.v1.Attention/AttendChunked", &cq_);
    call_->StartCall(nullptr);
    started_ = Await();
  }
  bool started() const { return started_; }
  bool Write(const v1::AttendChunk& m) {
    grpc::ByteBuffer buffer;
    bool own = false;
    grpc::SerializationTraits<v1::AttendChunk>::Serialize(m, &buffer, &own).IgnoreError();
    call_->Write(buffer, nullptr);
    return Await();
  }
  void WritesDone() {
    call_->WritesDone(nullptr);
    Await();
  }
  // Reads the answer's messages to the end, then the status.
  RawAnswer Finish() {
    RawAnswer answer;
    for (;;) {
      grpc::ByteBuffer buffer;
      call_->Read(&buffer, nullptr);
      if (!Await()) break;
      ++answer.messages;
    }
    call_->Finish(&answer.status, nullptr);
    Await();
    return answer;
  }

 private:
  bool Await() {
    void* tag = nullptr;
    bool ok = false;
    return cq_.Next(&tag, &ok) && ok;
  }

  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
};

RawAnswer RawChunked(const std::shared_ptr<grpc::Channel>& channel,
                     const std::vector<v1::AttendChunk>& messages) {
  RawCall call(channel, std::chrono::seconds(30));
  bool ok = call.started();
  for (const v1::AttendChunk& m : messages) {
    if (!ok) break;
    ok = call.Write(m);
  }
  if (ok) call.WritesDone();
  return call.Finish();
}

// The messages of `request` in chunks of `chunk` bytes, in order.
std::vector<v1::AttendChunk> Chunks(const v1::AttendRequest& request, size_t chunk) {
  std::vector<v1::AttendChunk> out(1);
  *out[0].mutable_request() = request;
  for (v1::Tensor* t :
       {out[0].mutable_request()->mutable_q(), out[0].mutable_request()->mutable_k(),
        out[0].mutable_request()->mutable_v()}) {
    t->clear_data();
  }
  for (const auto& [tensor, t] : {std::pair{v1::CHUNK_TENSOR_Q, &request.q()},
                                  {v1::CHUNK_TENSOR_K, &request.k()},
                                  {v1::CHUNK_TENSOR_V, &request.v()}}) {
    for (size_t at = 0; at < t->data().size(); at += chunk) {
      v1::AttendChunk m;
      m.mutable_chunk()->set_tensor(tensor);
      m.mutable_chunk()->set_offset(static_cast<int64_t>(at));
      m.mutable_chunk()->set_data(t->data().substr(at, chunk));
      out.push_back(std::move(m));
    }
  }
  return out;
}

TEST_F(ChunkedTest, ChunksInAnyOrderAndEveryMalformedSequenceIsRefused) {
  const client::ProblemSpec spec{
      .batch = 1, .heads_q = 2, .heads_kv = 2, .seqlen_q = 20, .seqlen_k = 33, .head_dim = 16};
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
  ASSERT_TRUE(request.ok()) << request.status();
  std::vector<v1::AttendChunk> messages = Chunks(*request, 1000);
  ASSERT_GT(messages.size(), 4u);

  // Out of order: the header first, then the chunks reversed and shuffled.
  std::vector<v1::AttendChunk> shuffled = messages;
  std::shuffle(shuffled.begin() + 1, shuffled.end(), rng);
  const RawAnswer ok = RawChunked(client().channel(), shuffled);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_GE(ok.messages, 2);  // the response and at least one chunk of o

  struct Case {
    const char* name;
    std::vector<v1::AttendChunk> messages;
    const char* says;
  };
  std::vector<Case> cases;
  {
    std::vector<v1::AttendChunk> m = messages;
    m.push_back(messages[1]);  // the first chunk again
    m.erase(m.end() - 2);      // so that the byte count still matches without the last
    cases.push_back({"overlap", m, "overlap"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m.pop_back();
    cases.push_back({"missing bytes", m, "before every byte came"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m[1].mutable_chunk()->set_offset(1 << 20);
    cases.push_back({"outside the tensor", m, "expected bytes within"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m[1].mutable_chunk()->set_tensor(v1::CHUNK_TENSOR_O);
    cases.push_back({"a chunk of o", m, "chunk.tensor"});
  }
  {
    std::vector<v1::AttendChunk> m(messages.begin() + 1, messages.end());
    cases.push_back({"no header", m, "first message"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m[0].mutable_request()->mutable_q()->set_data("x");
    cases.push_back({"data in the header", m, "request.q.data"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m[0].mutable_request()->mutable_k()->add_shape(3);
    cases.push_back({"a bad shape", m, "k.shape"});
  }
  {
    // Tensors by reference and outputs into a region go through Attend.
    std::vector<v1::AttendChunk> m = messages;
    v1::TensorRef* ref = m[0].mutable_request()->mutable_v()->mutable_ref();
    ref->set_region("r");
    ref->set_byte_size(static_cast<int64_t>(request->v().data().size()));
    cases.push_back({"v by reference", m, "request.v.ref"});
  }
  {
    std::vector<v1::AttendChunk> m = messages;
    m[0].mutable_request()->mutable_o_ref()->set_region("r");
    cases.push_back({"o into a region", m, "request.o_ref"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const RawAnswer answer = RawChunked(client().channel(), c.messages);
    EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << answer.status.error_message();
    EXPECT_THAT(answer.status.error_message(), HasSubstr(c.says));
    EXPECT_EQ(answer.messages, 0);
  }
  // Then a good one still works.
  ExpectCorrect(*request, client().AttendChunked(*request, 777));
}

TEST_F(ChunkedTest, DeadlinesApplyAndTheServerServesOn) {
  // 24 MiB in 256 KiB chunks and 3e10 FLOPs of CPU work (q, k, v [1, 8, 4000, 64] float32):
  // seconds on the CPU backend, far over the 100 ms deadline.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<v1::AttendRequest> slow = client::MakeRandomRequest(
      {.heads_q = 8, .heads_kv = 8, .seqlen_q = 4000, .seqlen_k = 4000, .head_dim = 64}, rng);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_EQ(client()
                .AttendChunked(*slow, 256 * 1024, {.deadline = absl::Milliseconds(100)})
                .status()
                .code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(LargeProblems()[0], rng);
  ASSERT_TRUE(request.ok()) << request.status();
  ExpectCorrect(*request, client().AttendChunked(*request, 64 * 1024));
}

TEST_F(ChunkedTest, OverTheChunkedLimitIsResourceExhaustedBeforeAnyChunk) {
  // q, k, v [1, 1, 4M, 8] float32: 3 x 128 MiB claimed, over the 64 MiB limit; no chunk sent.
  v1::AttendChunk head;
  for (v1::Tensor* t : {head.mutable_request()->mutable_q(), head.mutable_request()->mutable_k(),
                        head.mutable_request()->mutable_v()}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : {int64_t{1}, int64_t{1}, int64_t{4} << 20, int64_t{8}}) t->add_shape(d);
  }
  const RawAnswer answer = RawChunked(client().channel(), {head});
  EXPECT_EQ(answer.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << answer.status.error_message();
}

// The blocks of unfinished calls share --chunked_memory_mb (48 MiB here): while one call holds
// 32 MiB a second such header is RESOURCE_EXHAUSTED; the first, sent no chunk, ends
// DEADLINE_EXCEEDED after --chunked_idle_timeout_s (1 s here) and frees its share.
TEST_F(ChunkedTest, UnfinishedCallsShareABudgetAndIdleCallsTimeOut) {
  // q [1, 1, 16, 8], k and v [1, 1, 512K, 8] float32: 2 x 16 MiB and a little.
  v1::AttendChunk head;
  for (const auto& [t, seqlen] : {std::pair{head.mutable_request()->mutable_q(), int64_t{16}},
                                  {head.mutable_request()->mutable_k(), int64_t{512} << 10},
                                  {head.mutable_request()->mutable_v(), int64_t{512} << 10}}) {
    t->set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : {int64_t{1}, int64_t{1}, seqlen, int64_t{8}}) t->add_shape(d);
  }
  // The first call: its header, then nothing, its side left open.
  const absl::Time start = absl::Now();
  RawCall idle(client().channel(), std::chrono::seconds(10));
  ASSERT_TRUE(idle.started());
  ASSERT_TRUE(idle.Write(head));
  // The server takes the header before the next call's (it is read on arrival).
  absl::SleepFor(absl::Milliseconds(200));

  const RawAnswer refused = RawChunked(client().channel(), {head});
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_THAT(refused.status.error_message(), HasSubstr("--chunked_memory_mb"));

  const grpc::Status status = idle.Finish().status;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--chunked_idle_timeout_s"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  // Its share freed, the same header is taken again (and ends for want of chunks).
  absl::SleepFor(absl::Milliseconds(200));
  const RawAnswer taken = RawChunked(client().channel(), {head});
  EXPECT_EQ(taken.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << taken.status.error_message();
  EXPECT_THAT(taken.status.error_message(), HasSubstr("before every byte came"));
}

// Chunks of 4 bytes, in order: each merges into the range before it; the answer matches.
TEST_F(ChunkedTest, TinyChunksMatchTheReference) {
  const client::ProblemSpec spec{
      .batch = 1, .heads_q = 1, .heads_kv = 1, .seqlen_q = 8, .seqlen_k = 40, .head_dim = 16};
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
  ASSERT_TRUE(request.ok()) << request.status();
  ExpectCorrect(*request, client().AttendChunked(*request, 4));
}

}  // namespace
}  // namespace attention::e2e
