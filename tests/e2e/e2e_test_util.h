// Shared pieces of the end-to-end tests: starting a server with a client attached, fresh seeds,
// the correctness grid every backend must pass, and the check of one response.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gtest/gtest.h"
#include "tests/e2e/server_process.h"

namespace attention::e2e {

// A fresh seed per call (random_device); tests show it with SCOPED_TRACE so a failure can be
// replayed.
uint64_t FreshSeed();

struct RunningServer {
  std::unique_ptr<ServerProcess> process;
  std::unique_ptr<client::Client> client;

  // Closes the client's connection, then stops the server expecting exit code 0. (A connection
  // left open makes the server's drain wait for the client to go away.)
  absl::Status Stop();
};

// Starts attention_server with `flags` (and ATTENTION_E2E_EXTRA_FLAGS unless environment_flags is
// false: ServerProcessOptions) and connects a client to it.
absl::StatusOr<RunningServer> StartServer(const std::vector<std::string>& flags,
                                          client::ClientOptions options = {},
                                          bool environment_flags = true);

// A client of `target` (plaintext) on a connection of its own: channels of equal arguments would
// otherwise share one, and another connection is another caller to the server (regions, rings).
std::unique_ptr<client::Client> ClientOnItsOwnConnection(const std::string& target,
                                                         client::ClientOptions options = {});

// A test suite whose tests share one server (a server per test would multiply start and drain
// time). `Suite` names its flags: `static std::vector<std::string> ServerFlags();`.
template <typename Suite>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new absl::StatusOr<RunningServer>(StartServer(Suite::ServerFlags()));
  }
  static void TearDownTestSuite() {
    if (server_->ok()) {
      EXPECT_EQ((*server_)->Stop(), absl::OkStatus());
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(server_->ok()) << server_->status(); }

  client::Client& client() { return *(*server_)->client; }
  ServerProcess& process() { return *(*server_)->process; }

  static inline absl::StatusOr<RunningServer>* server_ = nullptr;
};

// `count` float16 sessions [Hkv, N, D] created through `stub` with the same random K and V drawn
// from `rng`: a Step sent to each in a different way must answer the same, bit for bit.
absl::StatusOr<std::vector<std::string>> CreateTwinSessions(v1::Sessions::Stub& stub, int count,
                                                            int64_t heads_kv, int64_t rows,
                                                            int64_t head_dim, std::mt19937_64& rng);

// `count` decode Steps of one float16 entry each (q [Hq, 1, D], k, v [Hkv, 1, D] random from
// `rng`), request_ids "s0", "s1", ..., causal, their session_id left for the caller to set: the
// same Steps sent to twin sessions (CreateTwinSessions) over two transports must answer alike.
std::vector<v1::StepRequest> RandomDecodeSteps(int count, int64_t heads_q, int64_t heads_kv,
                                               int64_t head_dim, std::mt19937_64& rng);

// Problems every backend must answer within the API's bound: lengths that are not tile
// multiples, Nq != Nk (both ways, so some rows see no key), decode (Nq = 1), GQA and MQA, causal,
// sliding windows, an explicit scale, LSE, varlen, both layouts, head dims from 8 to 256, and
// every dtype.
std::vector<client::ProblemSpec> CorrectnessGrid();

// Expects `response` to be OK, to echo the request_id, to name a device, and to match the
// float64 reference of `request` within the API's bound for its dtype.
void ExpectCorrect(const v1::AttendRequest& request,
                   const absl::StatusOr<v1::AttendResponse>& response);

}  // namespace attention::e2e
