// --max_connection_age_s: the server sends GOAWAY once a connection reaches that age, and the
// client reconnects (so clients behind DNS re-resolve and rebalance). Calls keep succeeding across
// the rotations; a long-lived call on an aged connection is ended after the age grace, which shows
// the age is applied.
#include <cstdio>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::reliability {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

TEST(ConnectionAgeTest, CallsSucceedAcrossConnectionRotations) {
  constexpr int kAgeSeconds = 1;
  constexpr int kAgeGraceSeconds = 1;
  absl::StatusOr<e2e::RunningServer> server = e2e::StartServer(
      {"--backend=cpu", "--threads=1", absl::StrCat("--max_connection_age_s=", kAgeSeconds),
       absl::StrCat("--max_connection_age_grace_s=", kAgeGraceSeconds)});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);

  // A health watch never ends on its own: only the aged connection's closing ends it.
  auto health = grpc::health::v1::Health::NewStub(server->client->channel());
  grpc::ClientContext watch_context;
  // Bounds the test should the age not be applied: the watch then ends DEADLINE_EXCEEDED.
  watch_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  HealthCheckRequest watch_request;
  auto watch = health->Watch(&watch_context, watch_request);
  HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));

  // Sequential calls over four ages (age +-10 % jitter, then its grace): every one succeeds.
  const absl::Time end = absl::Now() + absl::Seconds(4 * kAgeSeconds + kAgeGraceSeconds);
  int calls = 0;
  while (absl::Now() < end) {
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
        {.batch = 1, .heads_q = 2, .heads_kv = 1, .seqlen_q = 16, .seqlen_k = 40, .head_dim = 32},
        rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("r", calls));
    SCOPED_TRACE(request->request_id());
    e2e::ExpectCorrect(*request, server->client->Attend(*request));
    ++calls;
    absl::SleepFor(absl::Milliseconds(50));
  }

  // The watch started on the first connection, which has aged out and been closed by now.
  while (watch->Read(&update)) {
  }
  const grpc::Status watch_end = watch->Finish();
  EXPECT_EQ(watch_end.error_code(), grpc::StatusCode::UNAVAILABLE) << watch_end.error_message();
  std::printf("connection age %d s: %d calls ok; the watch on the first connection ended: %s\n",
              kAgeSeconds, calls, watch_end.error_message().c_str());
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace attention::reliability
