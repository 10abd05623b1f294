// The request log: which calls it writes at each level, and its rate limit (a burst of refusals
// leaves a few lines and the count of the rest). The gate itself is tested through the services
// (service/attention_service_test.cc, tests/e2e, tests/reliability).
#include "server/calls/call_gate.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

struct Captured {
  CallLog log;
  std::vector<std::string> lines;
  explicit Captured(int level, int max_lines_per_s = 20)
      : log(CallLogOptions{.level = level,
                           .max_lines_per_s = max_lines_per_s,
                           .sink = [this](const std::string& line) { lines.push_back(line); }}) {}
  void End(const absl::Status& status) {
    if (log.Logs(status)) log.Ended("Step", status, absl::Milliseconds(3), "ipv4:127.0.0.1:5");
  }
};

// Level 0 writes nothing, 1 (the default) one line per failed call, 2 one line per call.
TEST(CallLogTest, EachLevelWritesItsCalls) {
  for (const auto& [level, lines] : {std::pair{0, 0u}, std::pair{1, 1u}, std::pair{2, 2u}}) {
    Captured c(level);
    c.End(absl::OkStatus());
    c.End(absl::UnavailableError("server is shutting down"));
    c.log.Flush();
    ASSERT_EQ(c.lines.size(), lines) << "level " << level;
    if (lines == 0) continue;
    EXPECT_THAT(c.lines.back(), HasSubstr("Step from ipv4:127.0.0.1:5 UNAVAILABLE after 3ms: "
                                          "server is shutting down"));
    if (lines == 2) EXPECT_THAT(c.lines.front(), HasSubstr("Step from ipv4:127.0.0.1:5 OK after"));
  }
}

TEST(CallLogTest, ABurstLeavesTheLimitsLinesAndTheCountOfTheRest) {
  Captured c(1, /*max_lines_per_s=*/5);
  // As a drain refuses 2,300 calls at once.
  for (int i = 0; i < 2300; ++i) c.End(absl::UnavailableError("server is shutting down"));
  EXPECT_EQ(c.lines.size(), 5u);
  c.log.Flush();
  ASSERT_EQ(c.lines.size(), 6u);
  EXPECT_THAT(c.lines.back(), HasSubstr("2295 calls not logged"));
  c.log.Flush();  // nothing more left out
  EXPECT_EQ(c.lines.size(), 6u);
}

TEST(CallGateTest, ToGrpcStatusKeepsCodeAndMessage) {
  const grpc::Status status = ToGrpcStatus(absl::ResourceExhaustedError("queue full"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(status.error_message(), "queue full");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace attention::server
