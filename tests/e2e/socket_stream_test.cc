// The C++ client's socket stream (client/socket_stream.h) against the real server (CPU backend,
// --socket_port=0): Steps written at once are answered in the order sent, equal bit for bit to the
// same Steps sent one by one over unary calls; AttendStream's requests match the float64
// reference; a failed request ends the stream with its status in the end frame; a server without
// socket streams is UNIMPLEMENTED naming the flag. The hostile cases (bad hellos, frames, opens,
// stalled and killed clients) are tests/python/test_socket_streams.py's.
#include "client/socket_stream.h"

#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::e2e {
namespace {

class SocketStreamE2E : public SharedServerTest<SocketStreamE2E> {
 public:
  static std::vector<std::string> ServerFlags() { return {"--backend=cpu", "--socket_port=0"}; }
};

TEST_F(SocketStreamE2E, StepsWrittenAtOnceEqualTheSameStepsSentOneByOne) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  auto stub = v1::Sessions::NewStub(client().channel());
  const int64_t hkv = 2, hq = 4, d = 32, n = 40;
  constexpr int kSteps = 6;
  absl::StatusOr<std::vector<std::string>> twins = CreateTwinSessions(*stub, 2, hkv, n, d, rng);
  ASSERT_TRUE(twins.ok()) << twins.status();
  const std::vector<std::string>& ids = *twins;
  // Each Step appends a row and attends over it: written at once, the socket's Steps must be
  // queued in the order sent for their answers to equal the one-by-one Steps'.
  const std::vector<v1::StepRequest> steps = RandomDecodeSteps(kSteps, hq, hkv, d, rng);
  absl::StatusOr<std::unique_ptr<client::SocketStream>> stream =
      client::SocketStream::Open(client(), v1::RING_METHOD_STEP);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (v1::StepRequest r : steps) {
    r.mutable_entries(0)->set_session_id(ids[0]);
    ASSERT_TRUE((*stream)->Write(r));
  }
  std::map<std::string, v1::StepResponse> on_socket;
  for (int i = 0; i < kSteps; ++i) {
    v1::StepResponse response;
    ASSERT_TRUE((*stream)->Read(&response)) << i << ": " << (*stream)->Finish().error_message();
    on_socket[response.request_id()] = response;
  }
  const grpc::Status finished = (*stream)->Finish();
  EXPECT_TRUE(finished.ok()) << finished.error_message();
  for (int i = 0; i < kSteps; ++i) {
    v1::StepRequest r = steps[i];
    r.mutable_entries(0)->set_session_id(ids[1]);
    v1::StepResponse one_by_one;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Step(&context, r, &one_by_one).ok());
    const v1::StepResponse& answer = on_socket.at(r.request_id());
    ASSERT_EQ(answer.results_size(), 1);
    EXPECT_EQ(answer.results(0).length(), n + i + 1);
    EXPECT_EQ(answer.results(0).o().data(), one_by_one.results(0).o().data()) << r.request_id();
  }
}

TEST_F(SocketStreamE2E, AttendRequestsMatchTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<std::unique_ptr<client::SocketStream>> stream =
      client::SocketStream::Open(client(), v1::RING_METHOD_ATTEND);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<v1::AttendRequest> requests;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::AttendRequest> request =
        client::MakeRandomRequest({.batch = 1,
                                   .heads_q = 4,
                                   .heads_kv = 2,
                                   .seqlen_q = 9 + i,
                                   .seqlen_k = 61,
                                   .head_dim = 32,
                                   .dtype = v1::DTYPE_BFLOAT16,
                                   .causal = i % 2 == 1},
                                  rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("a", i));
    requests.push_back(*request);
    ASSERT_TRUE((*stream)->Write(*request));
  }
  for (int i = 0; i < 3; ++i) {
    v1::AttendResponse response;
    ASSERT_TRUE((*stream)->Read(&response));
    const int index = response.request_id().back() - '0';
    ASSERT_GE(index, 0);
    ASSERT_LT(index, 3);
    ExpectCorrect(requests[index], response);
  }
  EXPECT_TRUE((*stream)->Finish().ok());
}

TEST_F(SocketStreamE2E, AFailedRequestEndsTheStreamNamingIt) {
  absl::StatusOr<std::unique_ptr<client::SocketStream>> stream =
      client::SocketStream::Open(client(), v1::RING_METHOD_STEP);
  ASSERT_TRUE(stream.ok()) << stream.status();
  v1::StepRequest bad;
  bad.set_request_id("no-such-session");
  bad.add_entries()->set_session_id("0123456789abcdef0123456789abcdef");
  ASSERT_TRUE((*stream)->Write(bad));
  v1::StepResponse response;
  EXPECT_FALSE((*stream)->Read(&response));
  const grpc::Status status = (*stream)->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("request 'no-such-session': entries[0].q"),
            std::string::npos)
      << status.error_message();
}

TEST(SocketStreamWithoutSockets, OpenIsUnimplementedNamingTheFlag) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<client::SocketStream>> stream =
      client::SocketStream::Open(*server->client, v1::RING_METHOD_STEP);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(stream.status().message().find("--socket_port"), std::string::npos);
  EXPECT_TRUE(server->Stop().ok());
}

}  // namespace
}  // namespace attention::e2e
