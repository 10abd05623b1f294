// Bad input, end to end: one running attention_server (CPU backend) receives malformed requests,
// one per row below, and must answer each with the API's code and a message naming the field, what
// was expected and what came; afterwards it must still answer a good request correctly.
//
// Rows: every request-level row of docs/API.md's error table (malformed -> INVALID_ARGUMENT; over
// the message limit -> RESOURCE_EXHAUSTED; missing or wrong credentials -> UNAUTHENTICATED). The
// table's other rows are about server state and have their own tests: queue full
// (overload_test), draining (shutdown_test), deadline and cancellation (deadline_test).
// UNIMPLEMENTED and INTERNAL need a CUDA device lacking a feature or faulting; the CPU backend
// can produce neither.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"
#include "tests/reliability/reliability_util.h"

namespace attention::reliability {
namespace {

using client::ProblemSpec;
using e2e::FreshSeed;
using e2e::RunningServer;
using e2e::StartServer;
using ::testing::HasSubstr;

// Dense: q [2, 4, 16, 32], k and v [2, 2, 24, 32], float32, BHSD.
const ProblemSpec kDense{
    .batch = 2, .heads_q = 4, .heads_kv = 2, .seqlen_q = 16, .seqlen_k = 24, .head_dim = 32};
// BSHD: q [1, 8, 2, 16], k and v [1, 12, 2, 16], bfloat16.
const ProblemSpec kBshd{.batch = 1,
                        .heads_q = 2,
                        .heads_kv = 2,
                        .seqlen_q = 8,
                        .seqlen_k = 12,
                        .head_dim = 16,
                        .dtype = v1::DTYPE_BFLOAT16,
                        .layout = v1::LAYOUT_BSHD};
// Varlen: q [10, 2, 16] with cu_seqlens_q {0, 3, 10}; k and v [12, 2, 16] with {0, 5, 12}.
const ProblemSpec kVarlen{.heads_q = 2,
                          .heads_kv = 2,
                          .head_dim = 16,
                          .dtype = v1::DTYPE_FLOAT16,
                          .varlen_q = {3, 7},
                          .varlen_k = {5, 7}};

constexpr int kLimitMiB = 1;  // the server's --max_message_mb

// Gives `t` a new shape and the matching number of zero bytes.
void Reshape(v1::Tensor* t, const std::vector<int64_t>& shape) {
  int64_t bytes = t->dtype() == v1::DTYPE_FLOAT32 ? 4 : 2;
  t->clear_shape();
  for (int64_t d : shape) {
    t->add_shape(d);
    bytes *= d;
  }
  t->mutable_data()->assign(static_cast<size_t>(bytes), '\0');
}

struct BadInput {
  std::string name;
  const ProblemSpec* base;
  std::function<void(v1::AttendRequest*)> corrupt;
  absl::StatusCode code;
  std::string message;  // a substring the status message must contain
};

void PrintTo(const BadInput& c, std::ostream* os) { *os << c.name; }

std::vector<BadInput> BadInputs() {
  using R = v1::AttendRequest*;
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const absl::StatusCode kExhausted = absl::StatusCode::kResourceExhausted;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  return {
      // Missing and empty tensors.
      {"MissingQ", &kDense, [](R r) { r->clear_q(); }, kInvalid, "q: expected a tensor, got none"},
      {"MissingK", &kDense, [](R r) { r->clear_k(); }, kInvalid, "k: expected a tensor, got none"},
      {"MissingV", &kDense, [](R r) { r->clear_v(); }, kInvalid, "v: expected a tensor, got none"},
      {"EmptyRequest", &kDense, [](R r) { r->Clear(); }, kInvalid,
       "q: expected a tensor, got none"},
      {"EmptyTensorQ", &kDense,
       [](R r) {
         r->mutable_q()->clear_shape();
         r->mutable_q()->clear_data();
       },
       kInvalid, "q.shape: expected rank 4 ([B, H, N, D] for LAYOUT_BHSD), got rank 0 []"},
      {"EmptyTensorsAll", &kDense,
       [](R r) {
         r->mutable_q()->Clear();
         r->mutable_k()->Clear();
         r->mutable_v()->Clear();
       },
       kInvalid,
       "q.dtype: expected DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT8_E4M3, "
       "got DTYPE_UNSPECIFIED"},
      // Dims.
      {"ZeroSeqlenK", &kDense, [](R r) { r->mutable_k()->set_shape(2, 0); }, kInvalid,
       "k.shape[2]: expected > 0, got 0"},
      {"ZeroBatch", &kDense,
       [](R r) {
         Reshape(r->mutable_q(), {0, 4, 16, 32});
       },
       kInvalid, "q.shape[0]: expected > 0, got 0"},
      {"NegativeDim", &kDense, [](R r) { r->mutable_v()->set_shape(1, -2); }, kInvalid,
       "v.shape[1]: expected > 0, got -2"},
      {"NegativeHugeDim", &kDense,
       [](R r) { r->mutable_q()->set_shape(2, std::numeric_limits<int64_t>::min()); }, kInvalid,
       "q.shape[2]: expected > 0, got -9223372036854775808"},
      {"DimsOverflowInt64", &kDense,
       [](R r) {
         for (int i = 0; i < 4; ++i) r->mutable_q()->set_shape(i, int64_t{1} << 20);
       },
       kInvalid,
       "q.shape: expected a size that fits int64, got [1048576, 1048576, 1048576, "
       "1048576] (overflows)"},
      {"DimsOverflowWithElementSize", &kDense,
       [](R r) {
         // 2^61 elements fit int64, 2^61 * 4 bytes do not.
         r->mutable_k()->set_shape(0, int64_t{1} << 61);
         for (int i = 1; i < 4; ++i) r->mutable_k()->set_shape(i, 1);
       },
       kInvalid, "k.shape: expected a size that fits int64, got [2305843009213693952, 1, 1, 1]"},
      // Byte length.
      {"ByteLengthOneShort", &kDense, [](R r) { r->mutable_v()->mutable_data()->pop_back(); },
       kInvalid, "v.data: expected 12288 bytes (shape [2, 2, 24, 32] x 4 bytes), got 12287"},
      {"ByteLengthOneLong", &kDense, [](R r) { r->mutable_q()->mutable_data()->push_back('x'); },
       kInvalid, "q.data: expected 16384 bytes (shape [2, 4, 16, 32] x 4 bytes), got 16385"},
      {"ByteLengthOfOtherDType", &kBshd,
       [](R r) { r->mutable_k()->mutable_data()->append(r->k().data()); }, kInvalid,
       "k.data: expected 768 bytes (shape [1, 12, 2, 16] x 2 bytes), got 1536"},
      // Rank.
      {"Rank3WhereDense4", &kDense,
       [](R r) {
         Reshape(r->mutable_q(), {2, 4, 512});
       },
       kInvalid, "q.shape: expected rank 4 ([B, H, N, D] for LAYOUT_BHSD), got rank 3 [2, 4, 512]"},
      {"Rank5WhereDense4", &kDense,
       [](R r) {
         Reshape(r->mutable_k(), {2, 2, 24, 32, 1});
       },
       kInvalid, "k.shape: expected rank 4 ([B, H, N, D] for LAYOUT_BHSD), got rank 5"},
      {"Rank3WhereBshd4", &kBshd,
       [](R r) {
         Reshape(r->mutable_v(), {12, 2, 16});
       },
       kInvalid, "v.shape: expected rank 4 ([B, N, H, D] for LAYOUT_BSHD), got rank 3"},
      {"Rank4WhereVarlen3", &kVarlen,
       [](R r) {
         Reshape(r->mutable_q(), {1, 10, 2, 16});
       },
       kInvalid, "q.shape: expected rank 3 ([total, H, D] with cu_seqlens), got rank 4"},
      // DTypes.
      {"DTypeUnspecified", &kDense, [](R r) { r->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       kInvalid,
       "q.dtype: expected DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT8_E4M3, "
       "got DTYPE_UNSPECIFIED"},
      {"DTypeUnknown", &kDense, [](R r) { r->mutable_q()->set_dtype(static_cast<v1::DType>(42)); },
       kInvalid, "got unknown dtype 42"},
      {"DTypeMismatchK", &kDense, [](R r) { r->mutable_k()->set_dtype(v1::DTYPE_BFLOAT16); },
       kInvalid, "k.dtype: expected DTYPE_FLOAT32 (as q), got DTYPE_BFLOAT16"},
      {"DTypeMismatchV", &kBshd, [](R r) { r->mutable_v()->set_dtype(v1::DTYPE_FLOAT16); },
       kInvalid, "v.dtype: expected DTYPE_BFLOAT16 (as q), got DTYPE_FLOAT16"},
      {"DTypeUnspecifiedV", &kDense, [](R r) { r->mutable_v()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       kInvalid, "v.dtype: expected DTYPE_FLOAT32 (as q), got DTYPE_UNSPECIFIED"},
      {"LayoutUnknown", &kDense, [](R r) { r->set_layout(static_cast<v1::Layout>(7)); }, kInvalid,
       "layout: expected LAYOUT_BHSD or LAYOUT_BSHD, got 7"},
      // Shapes that disagree.
      {"HeadsNotDivisible", &kDense,
       [](R r) {
         Reshape(r->mutable_k(), {2, 3, 24, 32});
         Reshape(r->mutable_v(), {2, 3, 24, 32});
       },
       kInvalid, "k.shape[1] (heads): expected a divisor of q's 4 heads, got 3"},
      {"MoreKvHeadsThanQ", &kBshd,
       [](R r) {
         Reshape(r->mutable_k(), {1, 12, 4, 16});
         Reshape(r->mutable_v(), {1, 12, 4, 16});
       },
       kInvalid, "k.shape[2] (heads): expected a divisor of q's 2 heads, got 4"},
      {"HeadDimZero", &kDense,
       [](R r) {
         for (v1::Tensor* t : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) t->set_shape(3, 0);
       },
       kInvalid, "q.shape[3]: expected > 0, got 0"},
      {"HeadDim257", &kDense,
       [](R r) {
         Reshape(r->mutable_q(), {2, 4, 16, 257});
         Reshape(r->mutable_k(), {2, 2, 24, 257});
         Reshape(r->mutable_v(), {2, 2, 24, 257});
       },
       kInvalid, "q.shape[3] (head dim): expected 1..256, got 257"},
      {"HeadDimMismatch", &kDense,
       [](R r) {
         Reshape(r->mutable_k(), {2, 2, 24, 16});
         Reshape(r->mutable_v(), {2, 2, 24, 16});
       },
       kInvalid, "k.shape[3] (head dim): expected 32 (as q), got 16"},
      {"BatchMismatch", &kDense,
       [](R r) {
         Reshape(r->mutable_k(), {1, 2, 24, 32});
         Reshape(r->mutable_v(), {1, 2, 24, 32});
       },
       kInvalid, "k.shape[0] (batch): expected 2 (as q), got 1"},
      {"KAndVDiffer", &kDense,
       [](R r) {
         Reshape(r->mutable_v(), {2, 2, 23, 32});
       },
       kInvalid,
       "v.shape: expected [2, 2, 24, 32] (as k, but for the head dim), got [2, 2, 23, 32]"},
      // cu_seqlens.
      {"CuSeqlensNotMonotonic", &kVarlen,
       [](R r) {
         r->clear_cu_seqlens_q();
         for (int x : {0, 6, 4, 10}) r->add_cu_seqlens_q(x);
         r->add_cu_seqlens_k(12);  // keep the counts equal: the order is what is wrong
       },
       kInvalid, "cu_seqlens_q[2]: expected > cu_seqlens_q[1] = 6"},
      {"CuSeqlensEmptyItem", &kVarlen, [](R r) { r->set_cu_seqlens_k(1, 0); }, kInvalid,
       "cu_seqlens_k[1]: expected > cu_seqlens_k[0] = 0"},
      {"CuSeqlensFirstNotZero", &kVarlen, [](R r) { r->set_cu_seqlens_q(0, 1); }, kInvalid,
       "cu_seqlens_q[0]: expected 0, got 1"},
      {"CuSeqlensNegative", &kVarlen, [](R r) { r->set_cu_seqlens_k(1, -5); }, kInvalid,
       "cu_seqlens_k[1]: expected > cu_seqlens_k[0] = 0"},
      {"CuSeqlensPastTotal", &kVarlen, [](R r) { r->set_cu_seqlens_k(2, 4000); }, kInvalid,
       "cu_seqlens_k[2]: expected 12 (k.shape[0], the packed rows), got 4000"},
      {"CuSeqlensShortOfTotal", &kVarlen, [](R r) { r->set_cu_seqlens_q(2, 9); }, kInvalid,
       "cu_seqlens_q[2]: expected 10 (q.shape[0], the packed rows), got 9"},
      {"CuSeqlensWrongLength", &kVarlen, [](R r) { r->add_cu_seqlens_k(13); }, kInvalid,
       "cu_seqlens_k: expected 3 offsets (B+1, as cu_seqlens_q), got 4"},
      {"CuSeqlensSingleOffset", &kVarlen,
       [](R r) {
         r->clear_cu_seqlens_q();
         r->add_cu_seqlens_q(0);
       },
       kInvalid, "cu_seqlens_q: expected at least 2 offsets (B+1), got 1"},
      {"CuSeqlensOnlyQ", &kVarlen, [](R r) { r->clear_cu_seqlens_k(); }, kInvalid,
       "cu_seqlens_k: expected B+1 offsets (cu_seqlens_q and cu_seqlens_k come together), got "
       "none"},
      // Scalars.
      {"ScaleNaN", &kDense, [nan](R r) { r->set_softmax_scale(nan); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got nan"},
      {"ScaleInf", &kDense, [inf](R r) { r->set_softmax_scale(inf); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got inf"},
      {"ScaleNegInf", &kDense, [inf](R r) { r->set_softmax_scale(-inf); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got -inf"},
      {"ScaleZero", &kDense, [](R r) { r->set_softmax_scale(0.0f); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got 0"},
      {"ScaleNegative", &kBshd, [](R r) { r->set_softmax_scale(-0.5f); }, kInvalid,
       "softmax_scale: expected a finite value > 0, got -0.5"},
      {"WindowLeftNegative", &kDense, [](R r) { r->set_window_left(-1); }, kInvalid,
       "window_left: expected >= 0 (absent = unbounded), got -1"},
      {"WindowRightNegative", &kVarlen, [](R r) { r->set_window_right(-7); }, kInvalid,
       "window_right: expected >= 0 (absent = unbounded), got -7"},
      // Sizes: the gRPC message limit itself, and the response the request would need.
      {"MessageOverLimit", &kDense,
       [](R r) {
         Reshape(r->mutable_q(), {2, 4, 16 * 1024, 32});
       },
       kExhausted, "larger than max"},
      {"ResponseOverLimit", &kDense,
       [](R r) {
         // q [1, 1, 200000, 1] float16 is 0.4 MB, its LSE 0.8 MB: under 1 MiB in, over it out.
         for (v1::Tensor* t : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) {
           t->set_dtype(v1::DTYPE_FLOAT16);
         }
         Reshape(r->mutable_q(), {1, 1, 200000, 1});
         Reshape(r->mutable_k(), {1, 1, 1, 1});
         Reshape(r->mutable_v(), {1, 1, 1, 1});
         r->set_return_lse(true);
       },
       kExhausted, "response would be 1201041 bytes, over the message limit of 1048576 bytes"},
  };
}

class BadInputTest : public ::testing::TestWithParam<BadInput> {
 protected:
  static void SetUpTestSuite() {
    server_ = new absl::StatusOr<RunningServer>(
        StartServer({"--backend=cpu", absl::StrCat("--max_message_mb=", kLimitMiB)},
                    {.max_message_bytes = 64 << 20}));
  }
  static void TearDownTestSuite() {
    if (server_->ok()) EXPECT_TRUE((*server_)->process->Stop().ok());
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(server_->ok()) << server_->status(); }

  static absl::StatusOr<RunningServer>* server_;
};
absl::StatusOr<RunningServer>* BadInputTest::server_ = nullptr;

absl::StatusOr<v1::AttendRequest> RandomRequest(const ProblemSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return client::MakeRandomRequest(spec, rng);
}

TEST_P(BadInputTest, AnswersTheRightCodeAndMessageThenServesAGoodRequest) {
  const BadInput& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  absl::StatusOr<v1::AttendRequest> request = RandomRequest(*c.base, seed);
  ASSERT_TRUE(request.ok()) << request.status();
  c.corrupt(&*request);
  request->set_request_id(c.name);
  client::Client& client = *(*server_)->client;

  absl::StatusOr<v1::AttendResponse> unary = client.Attend(*request);
  ASSERT_FALSE(unary.ok()) << "accepted a malformed request";
  EXPECT_EQ(unary.status().code(), c.code) << unary.status();
  EXPECT_THAT(std::string(unary.status().message()), HasSubstr(c.message));

  // The same request on a stream ends the stream with the same code; the message names it.
  absl::StatusOr<std::vector<v1::AttendResponse>> streamed =
      client.AttendStream(std::vector<v1::AttendRequest>{*request});
  ASSERT_FALSE(streamed.ok());
  EXPECT_EQ(streamed.status().code(), c.code) << streamed.status();
  EXPECT_THAT(std::string(streamed.status().message()), HasSubstr(c.message));
  if (c.message != "larger than max") {  // gRPC's own limit check knows no request_id
    EXPECT_THAT(std::string(streamed.status().message()),
                HasSubstr(absl::StrCat("request '", c.name, "': ")));
  }

  absl::StatusOr<v1::AttendRequest> good = RandomRequest(*c.base, seed + 1);
  ASSERT_TRUE(good.ok()) << good.status();
  e2e::ExpectCorrect(*good, client.Attend(*good));
}

INSTANTIATE_TEST_SUITE_P(Cpu, BadInputTest, ::testing::ValuesIn(BadInputs()),
                         [](const ::testing::TestParamInfo<BadInput>& info) {
                           return info.param.name;
                         });

TEST(BadInputTableTest, HasAtLeastThirtyDistinctRows) {
  std::vector<BadInput> rows = BadInputs();
  EXPECT_GE(rows.size(), 30u);
  std::set<std::string> names;
  for (const BadInput& row : rows) EXPECT_TRUE(names.insert(row.name).second) << row.name;
}

// The status a stream (`method`: AttendStream, StepStream) ends with after one message carrying
// `bytes`.
grpc::Status RawStreamCall(grpc::GenericStub& stub, const std::string& method,
                           const std::string& bytes) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::CompletionQueue cq;
  auto next = [&cq] {
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);
    return ok;
  };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, "/attention.v1." + method, &cq);
  call->StartCall(nullptr);
  next();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer message(&slice, 1);
  call->Write(message, nullptr);
  next();
  call->WritesDone(nullptr);
  next();
  grpc::ByteBuffer response;
  call->Read(&response, nullptr);
  next();
  grpc::Status status;
  call->Finish(&status, nullptr);
  next();
  return status;
}

// Bytes that do not decode, of each kind, on every Attention and Sessions method: each is
// INVALID_ARGUMENT naming the field and the problem (gRPC's own parser would answer UNIMPLEMENTED
// with no message, before the service could count it), counted in attention_requests_total, and
// the server keeps serving.
TEST(GarbageBytesTest, UndecodableBytesAreInvalidArgumentOnEveryMethod) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::GenericStub stub(server->client->channel());
  struct Garbage {
    const char* kind;
    std::string bytes;
    const char* says;
  };
  std::mt19937 rng(FreshSeed());
  std::string random_bytes(64, '\0');
  // A random tag whose field number is 0 or whose wire type is 6 or 7 never decodes.
  for (char& c : random_bytes) c = static_cast<char>(rng());
  random_bytes[0] = static_cast<char>(0x06 | (rng() & 0x01));  // field 0, wire type 6 or 7
  // Field 1000 (unknown to every message: its bytes must still be whole) announced as 100
  // bytes long, then 3 bytes; and with its length as an 11-byte varint.
  const std::string unknown_field("\xc2\x3e", 2);
  const std::vector<Garbage> kinds = {
      {"truncated", unknown_field + std::string("\x64\x01\x02\x03", 4), "truncated"},
      {"overlong varint",
       unknown_field + std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11),
       "overlong varint"},
      {"random bytes", random_bytes, "undecodable bytes"},
      // Field 1 as a 32-bit value (a string or an enum in the messages that have it).
      {"wrong wire type", std::string("\x0d\x01\x02\x03\x04", 5), "expected wire type"},
      // Field 1 (request_id or session_id) holding bytes that are not UTF-8.
      {"invalid utf-8", std::string("\x0a\x02\xc3\x28", 4), "not valid UTF-8"},
  };
  const std::vector<std::string> methods = {
      "Attention/Attend", "Attention/GetServerInfo", "Sessions/CreateSession", "Sessions/AppendKv",
      "Sessions/Step",    "Sessions/DropSession",    "Sessions/ListSessions"};
  // Messages without a field 1 (nothing to mistype), or whose field 1 is no string.
  const std::set<std::string> no_field_1 = {"Attention/GetServerInfo", "Sessions/ListSessions"};
  const std::set<std::string> no_string_1 = {"Attention/GetServerInfo", "Sessions/ListSessions",
                                             "Sessions/CreateSession"};
  std::map<std::string, int> expected;  // rpc -> INVALID_ARGUMENT answers
  for (const Garbage& g : kinds) {
    for (const std::string& method : methods) {
      if ((g.kind == std::string("wrong wire type") && no_field_1.count(method) > 0) ||
          (g.kind == std::string("invalid utf-8") && no_string_1.count(method) > 0)) {
        continue;
      }
      SCOPED_TRACE(absl::StrCat(g.kind, " on ", method));
      const grpc::Status status =
          RawUnaryCall(server->client->channel(), "/attention.v1." + method, g.bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr(g.says));
      ++expected[method.substr(method.find('/') + 1)];
    }
    for (const char* method : {"Attention/AttendStream", "Sessions/StepStream"}) {
      SCOPED_TRACE(absl::StrCat(g.kind, " on ", method));
      const grpc::Status status = RawStreamCall(stub, method, g.bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr(g.says));
      ++expected[std::string(method).substr(std::string(method).find('/') + 1)];
    }
  }
  for (const auto& [rpc, count] : expected) {
    EXPECT_EQ(e2e::ScrapeMetric(server->process->metrics_port(), "attention_requests_total",
                                {{"rpc", rpc}, {"code", "INVALID_ARGUMENT"}})
                  .value_or(-1),
              count)
        << rpc;
  }
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  absl::StatusOr<v1::AttendRequest> good = RandomRequest(kDense, seed);
  ASSERT_TRUE(good.ok()) << good.status();
  e2e::ExpectCorrect(*good, server->client->Attend(*good));
  EXPECT_TRUE(server->process->Stop().ok());
}

// One unary call on the Sessions stub; its status as an absl::Status.
template <typename Request, typename Response>
absl::Status CallSessions(grpc::Status (v1::Sessions::Stub::*method)(grpc::ClientContext*,
                                                                     const Request&, Response*),
                          v1::Sessions::Stub& stub, const Request& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// Strings a client sends (session ids, request ids) may be megabytes of any bytes. Errors quote a
// short escaped prefix with the length: echoed whole, the status message would exceed the
// client's metadata limit, and the client would read RESOURCE_EXHAUSTED instead of the error.
// AttendStream and StepStream are the methods on the server's generic service
// (generic_streams.h), on either transport (--poll_streams or not): a method no service registers
// is still UNIMPLEMENTED, not a hang or a crash, and a message of either stream that does not
// decode still ends its stream INVALID_ARGUMENT.
TEST(GenericStreamsTest, UnknownMethodsAreUnimplementedOnEitherTransport) {
  for (const char* transport : {"--poll_streams=false", "--poll_streams"}) {
    SCOPED_TRACE(transport);
    absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu", transport});
    ASSERT_TRUE(server.ok()) << server.status();
    grpc::GenericStub stub(server->client->channel());
    for (const char* method : {"Sessions/NoSuchMethod", "None/Call"}) {
      EXPECT_EQ(RawStreamCall(stub, method, "").error_code(), grpc::StatusCode::UNIMPLEMENTED)
          << method;
    }
    for (const char* method : {"Attention/AttendStream", "Sessions/StepStream"}) {
      // Field 1 as a 32-bit value: request_id is a string in both requests.
      const grpc::Status garbage =
          RawStreamCall(stub, method, std::string("\x0d\x01\x02\x03\x04", 5));
      EXPECT_EQ(garbage.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << method << ": " << garbage.error_message();
      EXPECT_THAT(garbage.error_message(), HasSubstr("expected wire type")) << method;
    }
    EXPECT_EQ(server->Stop(), absl::OkStatus());
  }
}

TEST(LongClientStringTest, ErrorsQuoteAShortEscapedPrefix) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  // 1 MiB, starting with characters that are not printable ASCII. (Bytes that are not UTF-8 are
  // refused before: proto3 string fields must be UTF-8, see GarbageBytesTest.)
  std::string id = "\t\x01\xc3\xa9";  // tab, SOH, e acute
  id.resize(1 << 20, 'x');
  const auto expect_short = [](const absl::Status& status, absl::StatusCode code) {
    EXPECT_EQ(status.code(), code) << status.ToString().substr(0, 300);
    const std::string message(status.message());
    EXPECT_LT(message.size(), 1000u) << message.substr(0, 300);
    EXPECT_THAT(message, HasSubstr("'\\t\\x01\\xc3\\xa9xxx"));
    EXPECT_THAT(message, HasSubstr("...' (1048576 bytes)"));
    for (char c : message) EXPECT_TRUE(absl::ascii_isprint(c)) << int{c};
  };
  std::unique_ptr<v1::Sessions::Stub> sessions = v1::Sessions::NewStub(server->client->channel());

  v1::DropSessionRequest drop;
  drop.set_session_id(id);
  expect_short(CallSessions(&v1::Sessions::Stub::DropSession, *sessions, drop),
               absl::StatusCode::kNotFound);

  v1::StepRequest step;
  v1::StepEntry* entry = step.add_entries();
  entry->set_session_id(id);
  v1::Tensor* q = entry->mutable_q();
  q->set_dtype(v1::DTYPE_FLOAT32);
  Reshape(q, {2, 1, 16});
  expect_short(CallSessions(&v1::Sessions::Stub::Step, *sessions, step),
               absl::StatusCode::kNotFound);
  *step.add_entries() = *entry;  // the same session twice
  expect_short(CallSessions(&v1::Sessions::Stub::Step, *sessions, step),
               absl::StatusCode::kInvalidArgument);

  // A failing request on a stream: the stream's error names the request by its id.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  absl::StatusOr<v1::AttendRequest> bad = RandomRequest(kDense, seed);
  ASSERT_TRUE(bad.ok()) << bad.status();
  bad->clear_q();
  bad->set_request_id(id);
  expect_short(server->client->AttendStream(std::vector<v1::AttendRequest>{*bad}).status(),
               absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(server->process->Stop().ok());
}

}  // namespace
}  // namespace attention::reliability
