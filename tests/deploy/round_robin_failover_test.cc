// Horizontal scale through gRPC itself: three attention_server replicas (CPU backend) on loopback
// behind one client channel whose target lists all three, with the round_robin policy and
// retries of UNAVAILABLE. This is the channel a client builds against a Kubernetes headless
// Service (deploy/k8s), whose DNS name resolves to every replica; here the resolver is "ipv4:"
// with the three addresses instead of "dns:".
//
// Several threads send small random requests and check each response against the float64
// reference. One replica is SIGKILLed mid-run (no drain: its in-flight calls fail UNAVAILABLE and
// are retried on the others). The test asserts that every request completed and matched, that
// each replica's attention_requests_total counted a share of the load before the kill, and that
// requests started after the kill completed, served by both survivors.
//
// Sessions over the same kind of channel: two replicas, one round-robin client. A session lives
// on the server that created it, so every call of a session must reach that server
// (client/session.h: SessionClient takes a pick_first channel of its own); a Step sent to the
// other one is NOT_FOUND. The test finds each session on exactly one replica through each
// replica's own ListSessions, and checks every Step through the round-robin client against the
// float64 reference.
//
// Sessions through a router: two replicas (--replica_name r1 and r2) behind a real HAProxy
// (Debian's haproxy on PATH; the test skips without it), configured by
// deploy/haproxy/haproxy_routing.py config. Session ids name their replica; the C++ client's calls
// about a session (Append, Step, Truncate, Fork, Export, Info, Drop, StepMany, StepBatch) carry its
// owner in the attention-session-owner header, so through the proxy, which spreads everything else
// (CreateSession) leastconn over both, each reaches the replica holding the session: all succeed
// and every Step matches the float64 reference. A Step over sessions of both owners is refused
// INVALID_ARGUMENT naming both.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"
#include "tests/e2e/server_process.h"

namespace attention::deploy {
namespace {

using e2e::ServerProcess;

constexpr int kReplicas = 3;
constexpr int kClientThreads = 4;
// Requests that must complete before the kill and, of those started after it, after the kill.
constexpr int64_t kMinRequestsPerPhase = 60;
constexpr absl::Duration kMinPhase = absl::Seconds(1);
constexpr absl::Duration kPhaseTimeout = absl::Seconds(20);

// "ipv4:127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3": one channel over every replica.
std::string MultiAddressTarget(const std::vector<std::unique_ptr<ServerProcess>>& replicas) {
  std::vector<std::string> addresses;
  for (const auto& replica : replicas) addresses.push_back(replica->target());
  return absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
}

// round_robin over every address the resolver returns; UNAVAILABLE (a replica that died or is
// draining) is retried, on whichever replica the policy picks next. deploy/README.md gives the
// same service config for clients of the Kubernetes deployment.
std::unique_ptr<client::Client> MakeRoundRobinClient(const std::string& target) {
  return std::make_unique<client::Client>(
      client::ClientOptions{.target = target,
                            .deadline = absl::Seconds(20),
                            .load_balancing = "round_robin",
                            .max_attempts = 5,
                            .initial_backoff = absl::Milliseconds(50),
                            .max_backoff = absl::Seconds(1)});
}

// Attend requests this replica answered OK, from its /metrics.
absl::StatusOr<double> AttendServedOk(const ServerProcess& replica) {
  absl::StatusOr<std::string> body = e2e::HttpGet(replica.metrics_port(), "/metrics");
  if (!body.ok()) return body.status();
  return e2e::SumSamples(e2e::ParseMetrics(*body), "attention_requests_total",
                         {{"rpc", "Attend"}, {"code", "OK"}});
}

// Small random problems (q, k, v of at most 24 KiB each): ragged lengths, GQA or not, causal or
// not.
client::ProblemSpec RandomSmallProblem(std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> seqlen(1, 48);
  std::bernoulli_distribution coin(0.5);
  return {.batch = 1,
          .heads_q = 2,
          .heads_kv = coin(rng) ? 1 : 2,
          .seqlen_q = seqlen(rng),
          .seqlen_k = seqlen(rng),
          .head_dim = coin(rng) ? 32 : 64,
          .causal = coin(rng)};
}

// Client threads sending requests one after another until stopped. Counts what completed and
// matched, what started after MarkKilled() and completed, and keeps the first failures.
class Load {
 public:
  Load(client::Client* client, uint64_t seed) {
    for (int t = 0; t < kClientThreads; ++t) {
      threads_.emplace_back([this, client, seed, t] { Run(client, seed + t); });
    }
  }
  ~Load() { Stop(); }

  void MarkKilled() { killed_ = true; }
  void Stop() {
    stop_ = true;
    for (std::thread& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

  int64_t completed() const { return completed_; }
  int64_t completed_after_kill() const { return completed_after_kill_; }
  int64_t failed() const { return failed_; }
  std::vector<std::string> failures() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }

 private:
  void Run(client::Client* client, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t n = 0; !stop_; ++n) {
      const client::ProblemSpec spec = RandomSmallProblem(rng);
      absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
      if (!request.ok()) {
        Fail(absl::StrCat("building ", client::DescribeProblem(spec), ": ",
                          request.status().ToString()));
        continue;
      }
      request->set_request_id(absl::StrCat("seed-", seed, "-", n));
      const bool started_after_kill = killed_;
      absl::Status outcome = Check(*request, client->Attend(*request));
      if (!outcome.ok()) {
        Fail(absl::StrCat(client::DescribeProblem(spec), ": ", outcome.ToString()));
        continue;
      }
      ++completed_;
      if (started_after_kill) ++completed_after_kill_;
    }
  }

  static absl::Status Check(const v1::AttendRequest& request,
                            const absl::StatusOr<v1::AttendResponse>& response) {
    if (!response.ok()) return response.status();
    if (response->request_id() != request.request_id()) {
      return absl::InternalError(absl::StrCat("response for request '", response->request_id(),
                                              "' to request '", request.request_id(), "'"));
    }
    absl::StatusOr<client::CheckResult> check = client::CheckResponse(request, *response);
    if (!check.ok()) return check.status();
    if (!client::WithinBound(*check, request.q().dtype())) {
      return absl::InternalError(absl::StrCat("relative error ", check->relative_error,
                                              " (max element ", check->max_relative_error, ", lse ",
                                              check->lse_relative_error, ") over the bound ",
                                              client::ErrorBound(request.q().dtype())));
    }
    return absl::OkStatus();
  }

  void Fail(std::string message) {
    ++failed_;
    std::lock_guard<std::mutex> lock(mu_);
    if (failures_.size() < 10) failures_.push_back(std::move(message));
  }

  std::atomic<bool> stop_{false};
  std::atomic<bool> killed_{false};
  std::atomic<int64_t> completed_{0};
  std::atomic<int64_t> completed_after_kill_{0};
  std::atomic<int64_t> failed_{0};
  mutable std::mutex mu_;
  std::vector<std::string> failures_;
  std::vector<std::thread> threads_;
};

// Waits until `done` holds and at least kMinPhase has passed; false after kPhaseTimeout.
bool WaitForPhase(const std::function<bool()>& done) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < kPhaseTimeout) {
    if (done() && absl::Now() - start >= kMinPhase) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST(RoundRobinFailoverTest, EveryRequestCompletesWhenAReplicaDiesMidRun) {
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));

  std::vector<std::unique_ptr<ServerProcess>> replicas;
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> replica =
        ServerProcess::Start({.flags = {"--backend=cpu", "--threads=1"}});
    ASSERT_TRUE(replica.ok()) << replica.status();
    replicas.push_back(*std::move(replica));
  }
  std::unique_ptr<client::Client> client = MakeRoundRobinClient(MultiAddressTarget(replicas));

  auto load = std::make_unique<Load>(client.get(), seed);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(WaitForPhase([&] { return load->completed() >= kMinRequestsPerPhase; }))
      << "only " << load->completed() << " requests completed before the kill";

  // Every replica served a share of the load before the kill.
  std::vector<double> served_before(kReplicas);
  for (int i = 0; i < kReplicas; ++i) {
    absl::StatusOr<double> served = AttendServedOk(*replicas[i]);
    ASSERT_TRUE(served.ok()) << served.status();
    served_before[i] = *served;
  }
  const int64_t completed_before = load->completed();
  const absl::Duration before_kill = absl::Now() - start;
  const double total_before = served_before[0] + served_before[1] + served_before[2];
  for (int i = 0; i < kReplicas; ++i) {
    EXPECT_GT(served_before[i], 0) << "replica " << i << " served nothing before the kill";
    // round_robin spreads evenly once every connection is up; a tenth leaves room for the
    // requests sent while the first connection was the only one ready.
    EXPECT_GE(served_before[i], 0.1 * total_before)
        << "replica " << i << " served " << served_before[i] << " of " << total_before;
  }

  constexpr int kVictim = 1;
  ASSERT_TRUE(replicas[kVictim]->Signal(SIGKILL).ok());
  absl::StatusOr<int> exit_code = replicas[kVictim]->WaitForExit(absl::Seconds(10));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 128 + SIGKILL);
  load->MarkKilled();
  const absl::Time kill_time = absl::Now();
  ASSERT_TRUE(WaitForPhase([&] { return load->completed_after_kill() >= kMinRequestsPerPhase; }))
      << "only " << load->completed_after_kill() << " requests started after the kill completed";
  load->Stop();
  const absl::Duration after_kill = absl::Now() - kill_time;

  EXPECT_EQ(load->failed(), 0) << "failures (first 10):\n" << absl::StrJoin(load->failures(), "\n");
  EXPECT_GE(load->completed_after_kill(), kMinRequestsPerPhase);

  // Both survivors kept serving after the kill.
  for (int i = 0; i < kReplicas; ++i) {
    if (i == kVictim) continue;
    absl::StatusOr<double> served = AttendServedOk(*replicas[i]);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_GT(*served, served_before[i]) << "replica " << i << " served nothing after the kill";
  }

  const double rate_before = completed_before / absl::ToDoubleSeconds(before_kill);
  const double rate_after = load->completed_after_kill() / absl::ToDoubleSeconds(after_kill);
  std::printf(
      "served before the kill by replica: %.0f %.0f %.0f; %lld requests in %.1f s (%.0f/s) "
      "before, %lld started and completed in %.1f s (%.0f/s) after; %lld failed\n",
      served_before[0], served_before[1], served_before[2],
      static_cast<long long>(completed_before), absl::ToDoubleSeconds(before_kill), rate_before,
      static_cast<long long>(load->completed_after_kill()), absl::ToDoubleSeconds(after_kill),
      rate_after, static_cast<long long>(load->failed()));

  // Close the connections first: an open one makes the server's drain wait for it.
  load.reset();
  client.reset();
  for (int i = 0; i < kReplicas; ++i) {
    if (i == kVictim) continue;
    EXPECT_TRUE(replicas[i]->Stop().ok()) << replicas[i]->Log();
  }
}

// A session's rows as the client keeps them, [N, Hkv, D] floats (BSHD), and the replica that
// holds it.
struct SessionRows {
  std::vector<float> k, v;
  int holder = -1;

  int64_t length(const client::SessionSpec& spec) const {
    return static_cast<int64_t>(k.size()) / (spec.kv_heads * spec.head_dim);
  }
};

// n new random rows [n, Hkv, D] (the same values as a Step's [Hkv, 1, D] when n is 1), kept in
// `rows` and returned as tensors of `shape`.
std::pair<v1::Tensor, v1::Tensor> GrowRows(SessionRows& rows, const client::SessionSpec& spec,
                                           int64_t n, const std::vector<int64_t>& shape,
                                           std::mt19937_64& rng) {
  std::vector<float> k = client::RandomNormal(n * spec.kv_heads * spec.head_dim, rng);
  std::vector<float> v = client::RandomNormal(n * spec.kv_heads * spec.head_dim, rng);
  rows.k.insert(rows.k.end(), k.begin(), k.end());
  rows.v.insert(rows.v.end(), v.begin(), v.end());
  return {client::MakeTensor(spec.dtype, shape, k), client::MakeTensor(spec.dtype, shape, v)};
}

// Checks o [Hq, 1, D], the step of query q on the session's rows, against the float64 reference
// of the same attention as an Attend problem: q [1, 1, Hq, D] over k, v [1, N, Hkv, D].
absl::Status CheckStepOutput(const client::SessionSpec& spec, const SessionRows& rows,
                             const std::vector<float>& q, int64_t heads_q, const v1::Tensor& o) {
  const client::ProblemSpec problem{.batch = 1,
                                    .heads_q = heads_q,
                                    .heads_kv = spec.kv_heads,
                                    .seqlen_q = 1,
                                    .seqlen_k = rows.length(spec),
                                    .head_dim = spec.head_dim,
                                    .dtype = spec.dtype,
                                    .layout = v1::LAYOUT_BSHD,
                                    .causal = true};
  absl::StatusOr<v1::AttendRequest> request = client::MakeRequest(problem, q, rows.k, rows.v);
  if (!request.ok()) return request.status();
  v1::AttendResponse response;
  *response.mutable_o() = o;
  response.mutable_o()->clear_shape();
  for (int64_t s : {int64_t{1}, int64_t{1}, heads_q, spec.head_dim}) {
    response.mutable_o()->add_shape(s);
  }
  absl::StatusOr<client::CheckResult> check = client::CheckResponse(*request, response);
  if (!check.ok()) return check.status();
  if (!client::WithinBound(*check, spec.dtype)) {
    return absl::InternalError(absl::StrCat("relative error ", check->relative_error,
                                            " over the bound ", client::ErrorBound(spec.dtype)));
  }
  return absl::OkStatus();
}

// The sessions of the tests below (float32, 2 KV heads of 16, BSHD rows), queried by 4 heads.
constexpr int64_t kHeadsQ = 4;
const client::SessionSpec kSessionSpec{
    .dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 16, .layout = v1::LAYOUT_BSHD};

// One decode step of `session`: a new random row (kept in `rows`) appended and a random query of
// `heads_q` heads, its o checked against the reference over the session's rows.
absl::Status StepChecked(client::Session& session, SessionRows& rows,
                         const client::SessionSpec& spec, int64_t heads_q, std::mt19937_64& rng) {
  const std::vector<float> q = client::RandomNormal(heads_q * spec.head_dim, rng);
  auto [k, v] = GrowRows(rows, spec, 1, {spec.kv_heads, 1, spec.head_dim}, rng);
  absl::StatusOr<client::StepOutput> out = session.Step(
      client::MakeTensor(spec.dtype, {heads_q, 1, spec.head_dim}, q), {.causal = true}, &k, &v);
  if (!out.ok()) return out.status();
  if (out->length != rows.length(spec)) {
    return absl::InternalError(
        absl::StrCat("the step answered length ", out->length, ", expected ", rows.length(spec)));
  }
  return CheckStepOutput(spec, rows, q, heads_q, out->o);
}

TEST(RoundRobinSessionsTest, RoundRobinClientKeepsSessionsOnOneServer) {
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  constexpr int kServers = 2;
  // Odd, and the order of the Steps shuffled: a channel alternating between the two servers
  // cannot match where the sessions are by chance.
  constexpr int kSessions = 5;
  constexpr int kSteps = 4;
  const client::SessionSpec& spec = kSessionSpec;

  std::vector<std::unique_ptr<ServerProcess>> servers;
  for (int i = 0; i < kServers; ++i) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start({.flags = {"--backend=cpu", "--threads=1"}});
    ASSERT_TRUE(server.ok()) << server.status();
    servers.push_back(*std::move(server));
  }
  // One client over both addresses (round_robin, the default for several), and one straight to
  // each server for looking at it directly.
  auto balanced = std::make_unique<client::Client>(
      client::ClientOptions{.target = absl::StrCat(servers[0]->target(), ",", servers[1]->target()),
                            .deadline = absl::Seconds(20)});
  std::vector<std::unique_ptr<client::Client>> direct;
  for (const auto& server : servers) {
    direct.push_back(std::make_unique<client::Client>(
        client::ClientOptions{.target = server->target(), .deadline = absl::Seconds(20)}));
  }

  // The balanced channel does spread calls: Attend calls reach both servers.
  for (int i = 0; i < 40; ++i) {
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
        {.batch = 1, .heads_q = 2, .heads_kv = 1, .seqlen_q = 3, .seqlen_k = 5, .head_dim = 8},
        rng);
    ASSERT_TRUE(request.ok()) << request.status();
    ASSERT_TRUE(balanced->Attend(*request).ok());
  }
  for (int i = 0; i < kServers; ++i) {
    absl::StatusOr<double> served = AttendServedOk(*servers[i]);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_GT(*served, 0) << "server " << i << " got no Attend call of the round-robin client";
  }

  client::SessionClient sessions(*balanced);
  std::vector<client::Session> created;
  std::vector<SessionRows> rows(kSessions);
  for (int s = 0; s < kSessions; ++s) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 20);
    auto [k, v] = GrowRows(rows[s], spec, n, {n, spec.kv_heads, spec.head_dim}, rng);
    absl::StatusOr<client::Session> session = sessions.Create(spec, &k, &v);
    ASSERT_TRUE(session.ok()) << session.status();
    created.push_back(*std::move(session));
  }

  // Each session is on exactly one server, as that server's own ListSessions says.
  const auto holders = [&](const std::string& id) {
    std::vector<int> found;
    for (int i = 0; i < kServers; ++i) {
      client::SessionClient on_server(*direct[i]);
      absl::StatusOr<v1::ListSessionsResponse> list = on_server.List();
      EXPECT_TRUE(list.ok()) << list.status();
      if (!list.ok()) continue;
      for (const v1::SessionInfo& info : list->sessions()) {
        if (info.session_id() == id) found.push_back(i);
      }
    }
    return found;
  };
  for (int s = 0; s < kSessions; ++s) {
    const std::vector<int> found = holders(created[s].id());
    ASSERT_EQ(found.size(), 1u) << "session " << created[s].id() << " is on " << found.size()
                                << " servers";
    rows[s].holder = found[0];
  }

  // Every Step through the round-robin client reaches the holder: it succeeds (the other server
  // would answer NOT_FOUND) and matches the reference over the session's rows.
  std::vector<int> order(kSessions);
  for (int s = 0; s < kSessions; ++s) order[s] = s;
  for (int step = 0; step < kSteps; ++step) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int s : order) {
      SCOPED_TRACE(absl::StrCat("step ", step, " of session ", s));
      EXPECT_EQ(StepChecked(created[s], rows[s], spec, kHeadsQ, rng), absl::OkStatus());
    }
  }

  // Afterwards each session is still on its one server, with every appended row; sent straight
  // to the other server, its Step is NOT_FOUND.
  for (int s = 0; s < kSessions; ++s) {
    EXPECT_EQ(holders(created[s].id()), std::vector<int>{rows[s].holder});
    client::SessionClient on_holder(*direct[rows[s].holder]);
    absl::StatusOr<v1::ListSessionsResponse> list = on_holder.List();
    ASSERT_TRUE(list.ok()) << list.status();
    int64_t listed_length = -1;
    for (const v1::SessionInfo& info : list->sessions()) {
      if (info.session_id() == created[s].id()) listed_length = info.length();
    }
    EXPECT_EQ(listed_length, rows[s].length(spec));
    client::SessionClient on_other(*direct[1 - rows[s].holder]);
    v1::StepRequest request;
    v1::StepEntry* entry = request.add_entries();
    entry->set_session_id(created[s].id());
    *entry->mutable_q() = client::MakeTensor(spec.dtype, {kHeadsQ, 1, spec.head_dim},
                                             std::vector<float>(kHeadsQ * spec.head_dim, 1));
    v1::StepResponse response;
    std::unique_ptr<grpc::ClientContext> context = on_other.NewContext({});
    EXPECT_EQ(on_other.stub().Step(context.get(), request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  created.clear();  // drops the sessions
  balanced.reset();
  direct.clear();
  for (auto& server : servers) EXPECT_TRUE(server->Stop().ok()) << server->Log();
}

// A free TCP port on loopback (bound and released: the proxy binds it next).
absl::StatusOr<int> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  close(fd);
  if (!ok) return absl::InternalError("bind to 127.0.0.1:0 failed");
  return ntohs(address.sin_port);
}

// HAProxy in the foreground in front of `replicas` (name, "host:port"), its config rendered by
// deploy/haproxy/haproxy_routing.py into a temporary directory; stopped (SIGTERM) on destruction.
class Haproxy {
 public:
  static absl::StatusOr<std::unique_ptr<Haproxy>> Start(
      const std::vector<std::pair<std::string, std::string>>& replicas) {
    char dir_template[] = "/tmp/owner_routing_XXXXXX";
    if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
    const std::string dir = dir_template;
    absl::StatusOr<int> port = FreePort();
    if (!port.ok()) return port.status();
    std::string render = absl::StrCat(ATTENTION_PYTHON3, " ", HAPROXY_ROUTING_SCRIPT, " config",
                                      " --bind 127.0.0.1:", *port, " --admin_socket ", dir,
                                      "/admin.sock --dir ", dir);
    for (const auto& [name, target] : replicas)
      absl::StrAppend(&render, " --replica ", name, "=", target);
    if (std::system(render.c_str()) != 0) return absl::InternalError("failed: " + render);
    const std::string config = dir + "/haproxy.cfg";
    const std::string log = dir + "/haproxy.log";
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      execlp("haproxy", "haproxy", "-db", "-f", config.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    auto proxy = std::unique_ptr<Haproxy>(new Haproxy(pid, dir, *port));
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!proxy->Listening()) {
      if (waitpid(pid, nullptr, WNOHANG) == pid || absl::Now() > deadline) {
        proxy->pid_ = 0;
        return absl::InternalError("haproxy did not start; see " + log);
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return proxy;
  }

  ~Haproxy() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  Haproxy(pid_t pid, std::string dir, int port) : pid_(pid), dir_(std::move(dir)), port_(port) {}

  bool Listening() const {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port_);
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    close(fd);
    return ok;
  }

  pid_t pid_;
  std::string dir_;
  int port_;
};

TEST(OwnerRoutingTest, SessionCallsThroughHaproxyReachTheirOwner) {
  if (std::system("command -v haproxy > /dev/null") != 0) {
    GTEST_SKIP() << "haproxy is not on PATH (scripts/install_deps.sh test installs it)";
  }
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::string> names = {"r1", "r2"};
  constexpr int kSessions = 6;
  constexpr int kSteps = 3;
  const client::SessionSpec& spec = kSessionSpec;

  std::vector<std::unique_ptr<ServerProcess>> servers;
  std::vector<std::pair<std::string, std::string>> replicas;
  for (const std::string& name : names) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start({.flags = {"--backend=cpu", "--threads=1", "--replica_name=" + name}});
    ASSERT_TRUE(server.ok()) << server.status();
    replicas.emplace_back(name, (*server)->target());
    servers.push_back(*std::move(server));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    client::Client direct({.target = servers[i]->target(), .deadline = absl::Seconds(20)});
    absl::StatusOr<v1::ServerInfo> info = direct.GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->replica_name(), names[i]);
  }
  absl::StatusOr<std::unique_ptr<Haproxy>> proxy = Haproxy::Start(replicas);
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  auto through = std::make_unique<client::Client>(
      client::ClientOptions{.target = (*proxy)->target(), .deadline = absl::Seconds(20)});
  client::SessionClient sessions(*through);

  // Created through the proxy: on both replicas, each id its replica's name, a '.', 32 hex digits.
  std::vector<client::Session> created;
  std::vector<SessionRows> rows(kSessions);
  std::set<std::string> owners;
  for (int s = 0; s < kSessions; ++s) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 20);
    auto [k, v] = GrowRows(rows[s], spec, n, {n, spec.kv_heads, spec.head_dim}, rng);
    absl::StatusOr<client::Session> session = sessions.Create(spec, &k, &v);
    ASSERT_TRUE(session.ok()) << session.status();
    const std::string owner(client::SessionOwner(session->id()));
    EXPECT_NE(std::find(names.begin(), names.end(), owner), names.end()) << session->id();
    EXPECT_EQ(session->id().size(), owner.size() + 1 + 32) << session->id();
    owners.insert(owner);
    created.push_back(*std::move(session));
  }
  ASSERT_EQ(owners.size(), names.size()) << "leastconn put every session on one replica";

  // Every call about a session reaches its owner: Append, Steps, Truncate, Info, Fork, Export.
  for (int step = 0; step < kSteps; ++step) {
    for (int s = 0; s < kSessions; ++s) {
      SCOPED_TRACE(absl::StrCat("step ", step, " of session ", created[s].id()));
      auto [k1, v1] = GrowRows(rows[s], spec, 2, {2, spec.kv_heads, spec.head_dim}, rng);
      ASSERT_EQ(created[s].Append(k1, v1), absl::OkStatus());
      EXPECT_EQ(StepChecked(created[s], rows[s], spec, kHeadsQ, rng), absl::OkStatus());
    }
  }
  for (int s = 0; s < kSessions; ++s) {
    SCOPED_TRACE(created[s].id());
    const int64_t kept = rows[s].length(spec) - 1;
    ASSERT_EQ(created[s].Truncate(kept), absl::OkStatus());
    rows[s].k.resize(kept * spec.kv_heads * spec.head_dim);
    rows[s].v.resize(kept * spec.kv_heads * spec.head_dim);
    absl::StatusOr<v1::SessionInfo> info = created[s].Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->length(), kept);
    absl::StatusOr<client::Session> child = created[s].Fork();
    ASSERT_TRUE(child.ok()) << child.status();
    EXPECT_EQ(client::SessionOwner(child->id()), client::SessionOwner(created[s].id()));
    const std::vector<float> q = client::RandomNormal(kHeadsQ * spec.head_dim, rng);
    absl::StatusOr<client::StepOutput> out =
        child->Step(client::MakeTensor(spec.dtype, {kHeadsQ, 1, spec.head_dim}, q));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(child->Drop(), absl::OkStatus());
    int chunks = 0;
    EXPECT_EQ(created[s].Export([&chunks](const v1::SessionChunk&) {
      ++chunks;
      return absl::OkStatus();
    }),
              absl::OkStatus());
    EXPECT_GE(chunks, 2);
  }

  // A Step reaches one replica: sessions of two owners are refused before anything is sent.
  const auto other = std::find_if(created.begin(), created.end(), [&](const client::Session& s) {
    return client::SessionOwner(s.id()) != client::SessionOwner(created[0].id());
  });
  ASSERT_NE(other, created.end());
  const v1::Tensor q = client::MakeTensor(spec.dtype, {kHeadsQ, 1, spec.head_dim},
                                          std::vector<float>(kHeadsQ * spec.head_dim, 1));
  const client::StepItem items[] = {{&created[0], &q}, {&*other, &q}};
  absl::StatusOr<std::vector<client::StepOutput>> mixed = sessions.StepMany(items);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument) << mixed.status();
  for (const client::Session* session : {&created[0], &*other}) {
    const std::string owner(client::SessionOwner(session->id()));
    EXPECT_TRUE(absl::StrContains(mixed.status().message(), "'" + owner + "'")) << mixed.status();
  }
  client::Session* const batch[] = {&created[0], &*other};
  const v1::Tensor packed = client::MakeTensor(spec.dtype, {2, kHeadsQ, 1, spec.head_dim},
                                               std::vector<float>(2 * kHeadsQ * spec.head_dim, 1));
  EXPECT_EQ(sessions.StepBatch(batch, packed).status().code(), absl::StatusCode::kInvalidArgument);

  // Dropped through the proxy, each on its owner: nothing is left on either replica.
  for (client::Session& session : created) EXPECT_EQ(session.Drop(), absl::OkStatus());
  for (const auto& server : servers) {
    client::Client direct({.target = server->target(), .deadline = absl::Seconds(20)});
    absl::StatusOr<v1::ListSessionsResponse> list = client::SessionClient(direct).List();
    ASSERT_TRUE(list.ok()) << list.status();
    EXPECT_EQ(list->sessions_size(), 0);
  }
  through.reset();
  proxy->reset();
  for (auto& server : servers) EXPECT_TRUE(server->Stop().ok()) << server->Log();
}

}  // namespace
}  // namespace attention::deploy
