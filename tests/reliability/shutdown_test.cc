// Shutdown under load: SIGTERM while one worker has a queue of accepted requests and clients keep
// sending. The health service must report NOT_SERVING before any request is refused; requests
// arriving after that get UNAVAILABLE; every request accepted before the signal completes with a
// correct response; the process exits 0 within --shutdown_grace_s. Also: calls arriving during
// the drain are refused by the service, not cancelled, over five drains of 16 clients; idle
// connections do not delay the exit; open streams end UNAVAILABLE.
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::reliability {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

TEST(ShutdownTest, SigtermUnderLoadDrainsEveryAcceptedRequest) {
  constexpr int kAccepted = 12;
  constexpr int kLateClients = 4;
  constexpr int kGraceSeconds = 20;
  absl::StatusOr<e2e::RunningServer> server =
      e2e::StartServer({"--backend=cpu", "--threads=1", "--workers=1", "--max_queue=64",
                        absl::StrCat("--shutdown_grace_s=", kGraceSeconds)});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));

  // Request 0 blocks the one worker for about two seconds whatever the build. The others are
  // small ([1, 2, 64, 32]) and wait behind it, so all twelve are accepted and unfinished when the
  // signal comes.
  std::mt19937_64 blocker_rng(seed);
  absl::StatusOr<e2e::Blocker> blocker =
      e2e::CalibratedBlocker(*server->client, absl::Seconds(2), blocker_rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  blocker->request.set_request_id("r0");
  const client::ProblemSpec small{.batch = 1,
                                  .heads_q = 2,
                                  .heads_kv = 1,
                                  .seqlen_q = 64,
                                  .seqlen_k = 80,
                                  .head_dim = 32,
                                  .return_lse = true};
  std::vector<v1::AttendRequest> requests;  // [i - 1] is request i: 1..11 accepted, then late
  for (int i = 1; i < kAccepted + kLateClients; ++i) {
    std::mt19937_64 rng(seed + i);
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(small, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("r", i));
    requests.push_back(*std::move(request));
  }

  // A health watcher, as a load balancer would keep: the time NOT_SERVING first arrives.
  auto health = grpc::health::v1::Health::NewStub(server->client->channel());
  grpc::ClientContext watch_context;
  HealthCheckRequest watch_request;
  watch_request.set_service("attention.v1.Attention");
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> watch =
      health->Watch(&watch_context, watch_request);
  HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  ASSERT_EQ(update.status(), HealthCheckResponse::SERVING);
  std::atomic<int64_t> not_serving_at_ns{0};
  std::thread watcher([&] {
    while (watch->Read(&update)) {
      if (update.status() == HealthCheckResponse::NOT_SERVING) {
        not_serving_at_ns.store(absl::GetCurrentTimeNanos());
        break;
      }
    }
    watch_context.TryCancel();  // the watch must not hold the draining server open
    watch->Finish();
  });
  // Should a check below end the test early, the threads are stopped and joined first.
  absl::Cleanup stop_watcher = [&] {
    watch_context.TryCancel();
    watcher.join();
  };

  // Phase 1: twelve requests accepted (in flight on the server) before the signal.
  std::vector<std::future<absl::StatusOr<v1::AttendResponse>>> accepted;
  accepted.push_back(server->client->AttendAsync(blocker->request));
  ASSERT_TRUE(e2e::WaitUntilRunning(server->process->metrics_port())) << "the blocker never ran";
  for (int i = 1; i < kAccepted; ++i) {
    accepted.push_back(server->client->AttendAsync(requests[i - 1]));
  }
  ASSERT_GE(e2e::WaitForMetric(server->process->metrics_port(), "attention_inflight_requests", {},
                               [](double v) { return v >= kAccepted; }),
            kAccepted)
      << "requests never showed as in flight together; the blocker, [1, 16, " << blocker->seqlen
      << ", 64], must run longer";

  // Phase 2: clients that keep sending through the shutdown, each on its own channel.
  std::atomic<bool> signalled{false};
  std::atomic<bool> stop_late{false};
  std::mutex mu;
  int late_ok = 0, late_unavailable = 0;
  int64_t first_refusal_ns = 0;
  std::vector<std::thread> late;
  absl::Cleanup stop_late_clients = [&] {
    stop_late.store(true);
    for (std::thread& t : late) t.join();
  };
  for (int c = 0; c < kLateClients; ++c) {
    late.emplace_back([&, c] {
      client::Client client({.target = server->process->target(), .deadline = absl::Seconds(60)});
      const v1::AttendRequest& request = requests[kAccepted - 1 + c];
      while (!stop_late.load()) {
        const bool sent_after_signal = signalled.load();
        absl::StatusOr<v1::AttendResponse> response = client.Attend(request);
        const int64_t now_ns = absl::GetCurrentTimeNanos();
        std::lock_guard<std::mutex> lock(mu);
        if (response.ok()) {
          e2e::ExpectCorrect(request, response);
          ++late_ok;
          continue;
        }
        // Refused: UNAVAILABLE, and only once the signal was sent.
        EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
        EXPECT_TRUE(sent_after_signal || signalled.load()) << response.status();
        ++late_unavailable;
        if (first_refusal_ns == 0) first_refusal_ns = now_ns;
        return;
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time signal_time = absl::Now();
  signalled.store(true);
  ASSERT_TRUE(server->process->Signal(SIGTERM).ok());

  // Every request accepted before the signal completes, correctly.
  e2e::ExpectBlockerAnswered(*blocker, accepted[0].get());
  for (int i = 1; i < kAccepted; ++i) {
    SCOPED_TRACE(requests[i - 1].request_id());
    e2e::ExpectCorrect(requests[i - 1], accepted[i].get());
  }
  for (std::thread& t : late) t.join();  // each ends at its first refusal
  std::move(stop_late_clients).Cancel();
  absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(kGraceSeconds + 10));
  const absl::Duration exit_after = absl::Now() - signal_time;
  watcher.join();
  std::move(stop_watcher).Cancel();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << server->process->Log();
  absl::Duration exit_bound = absl::Seconds(kGraceSeconds);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitized server also scans for leaks or races on its way out, seconds on a busy machine.
  exit_bound += absl::Seconds(10);
#endif
  EXPECT_LT(exit_after, exit_bound);

  EXPECT_EQ(late_unavailable, kLateClients);
  ASSERT_NE(not_serving_at_ns.load(), 0) << "the health watch never saw NOT_SERVING";
  // The server flips health before it refuses anything; the two events reach different client
  // threads, whose wake-ups can swap them by microseconds, so the check allows 100 ms of that
  // noise (flipping health only after the drain would be seconds late).
  EXPECT_LE(not_serving_at_ns.load(), first_refusal_ns + int64_t{100'000'000})
      << "a request was refused before health reported NOT_SERVING";
  std::printf(
      "shutdown: %d accepted completed (blocker [1, 16, %ld, 64]), %d late requests "
      "served, %d refused; exit 0 after %s (grace %d s)\n",
      kAccepted, static_cast<long>(blocker->seqlen), late_ok, late_unavailable,
      absl::FormatDuration(exit_after).c_str(), kGraceSeconds);
}

// A small request ([1, 2, 16, 32] over 16 keys) for the calls that keep arriving.
constexpr client::ProblemSpec kSmallCall{
    .batch = 1, .heads_q = 2, .heads_kv = 1, .seqlen_q = 16, .seqlen_k = 16, .head_dim = 32};

// What a drain test starts with: a server of `workers` workers and `grace_s` s of grace, a
// blocker that keeps a worker busy for about `blocking`, a small request for the calls that keep
// arriving, and `n` clients, each on its own connection, connected (one call answered) before the
// signal, as long-lived clients would be.
struct DrainScene {
  e2e::RunningServer server;
  e2e::Blocker blocker;
  v1::AttendRequest small;
  std::vector<std::unique_ptr<client::Client>> clients;
};

absl::StatusOr<DrainScene> StartDrainScene(int workers, int grace_s, absl::Duration blocking, int n,
                                           std::mt19937_64& rng) {
  absl::StatusOr<e2e::RunningServer> server =
      e2e::StartServer({"--backend=cpu", "--threads=1", absl::StrCat("--workers=", workers),
                        absl::StrCat("--shutdown_grace_s=", grace_s)});
  if (!server.ok()) return server.status();
  absl::StatusOr<e2e::Blocker> blocker = e2e::CalibratedBlocker(*server->client, blocking, rng);
  if (!blocker.ok()) return blocker.status();
  absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(kSmallCall, rng);
  if (!small.ok()) return small.status();
  DrainScene scene{
      .server = *std::move(server), .blocker = *std::move(blocker), .small = *std::move(small)};
  for (int c = 0; c < n; ++c) {
    scene.clients.push_back(e2e::ClientOnItsOwnConnection(scene.server.process->target(),
                                                          {.deadline = absl::Seconds(grace_s)}));
    if (absl::Status connected = scene.clients.back()->GetServerInfo().status(); !connected.ok()) {
      return connected;
    }
  }
  return scene;
}

// Calls arriving while the server drains are refused by the service itself (UNAVAILABLE, "server
// is shutting down"), never cancelled by gRPC's shutdown: the server stays up until the drain is
// over. One accepted request holds the drain; the calls judged are those answered before it.
TEST(ShutdownTest, CallsArrivingDuringTheDrainGetUnavailable) {
  constexpr int kClients = 4;
  constexpr int kGraceSeconds = 60;
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  // The blocker keeps the one worker busy for about two seconds: the whole drain.
  absl::StatusOr<DrainScene> scene =
      StartDrainScene(1, kGraceSeconds, absl::Seconds(2), kClients, rng);
  ASSERT_TRUE(scene.ok()) << scene.status();
  e2e::RunningServer* server = &scene->server;
  const e2e::Blocker* blocker = &scene->blocker;
  const v1::AttendRequest* small = &scene->small;
  std::vector<std::unique_ptr<client::Client>>& clients = scene->clients;

  std::atomic<int64_t> blocker_done_ns{0};
  std::promise<absl::StatusOr<v1::AttendResponse>> blocker_result;
  server->client->AttendAsync(blocker->request, [&](absl::StatusOr<v1::AttendResponse> response) {
    blocker_done_ns.store(absl::GetCurrentTimeNanos());
    blocker_result.set_value(std::move(response));
  });
  // From here on the blocker's callback may run: the test waits for it before returning.
  std::future<absl::StatusOr<v1::AttendResponse>> blocked = blocker_result.get_future();
  absl::Cleanup wait_for_blocker = [&] {
    if (blocked.valid()) blocked.wait();
  };
  ASSERT_TRUE(e2e::WaitUntilRunning(server->process->metrics_port())) << "the blocker never ran";
  ASSERT_TRUE(server->process->Signal(SIGTERM).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (server->client->CheckHealth("attention.v1.Attention")
                 .value_or(HealthCheckResponse::SERVING) == HealthCheckResponse::SERVING &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }

  // Each client sends until the blocker's answer arrives; (answered at, status) per call.
  std::mutex mu;
  std::vector<std::pair<int64_t, absl::Status>> outcomes;
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      while (blocker_done_ns.load() == 0) {
        absl::StatusOr<v1::AttendResponse> response = clients[c]->Attend(*small);
        std::lock_guard<std::mutex> lock(mu);
        outcomes.emplace_back(absl::GetCurrentTimeNanos(), response.status());
        absl::SleepFor(absl::Milliseconds(1));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  e2e::ExpectBlockerAnswered(*blocker, blocked.get());

  // Answered before the drain ended: refused by the service (or accepted just before the signal
  // took effect). Answered after: the server may be inside gRPC's own shutdown, not judged.
  int refused = 0, after = 0;
  for (const auto& [answered_ns, status] : outcomes) {
    if (answered_ns >= blocker_done_ns.load()) {
      ++after;
      continue;
    }
    if (status.ok()) continue;
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("server is shutting down"));
    ++refused;
  }
  EXPECT_GT(refused, 0) << "no call reached the server while it drained";
  absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(kGraceSeconds + 10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << server->process->Log();
  std::printf("drain: %d calls refused UNAVAILABLE while one request drained, %d answered after\n",
              refused, after);
}

// Clients that keep sending through the whole shutdown, past the drain and the closing of the
// connections: every call is answered (OK, correct) or refused UNAVAILABLE, which clients retry
// elsewhere; none is CANCELLED (the client cancelled nothing). One accepted blocker keeps the
// drain open for about a second, so calls arrive during the drain, at its end and while gRPC
// closes the connections. Each client has a connection of its own; half send back to back, the
// other half pause up to 150 ms between calls, as clients with work of their own between calls
// do, so not every client waits on an answer when gRPC's shutdown begins. A call that reaches
// gRPC once its shutdown has begun is cancelled by it: the races are narrow, so the drain runs
// kRuns times, each on a fresh server.
TEST(ShutdownTest, ClientsSendingThroughTheShutdownGetAnswersOrUnavailable) {
  constexpr int kRuns = 5;
  constexpr int kClients = 16;
  constexpr int kGraceSeconds = 30;
  const uint64_t seed = e2e::FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  for (int run = 0; run < kRuns && !HasFailure(); ++run) {
    SCOPED_TRACE(absl::StrCat("run ", run));
    std::mt19937_64 rng(seed + run);
    absl::StatusOr<DrainScene> scene =
        StartDrainScene(2, kGraceSeconds, absl::Seconds(1), kClients, rng);
    ASSERT_TRUE(scene.ok()) << scene.status();
    e2e::RunningServer* server = &scene->server;
    const e2e::Blocker* blocker = &scene->blocker;
    const v1::AttendRequest* small = &scene->small;
    std::vector<std::unique_ptr<client::Client>>& clients = scene->clients;

    // The blocker runs first (it must be accepted before the signal), then the clients start.
    std::future<absl::StatusOr<v1::AttendResponse>> blocked =
        server->client->AttendAsync(blocker->request);
    ASSERT_TRUE(e2e::WaitUntilRunning(server->process->metrics_port())) << "the blocker never ran";
    std::atomic<bool> exited{false};
    std::mutex mu;
    std::map<absl::StatusCode, int> codes;
    std::vector<std::string> unexpected;
    std::vector<std::thread> threads;
    absl::Cleanup stop_clients = [&] {
      exited.store(true);
      for (std::thread& t : threads) t.join();
    };
    for (int c = 0; c < kClients; ++c) {
      threads.emplace_back([&, c, pauses = std::mt19937_64(seed + run * kClients + c)]() mutable {
        std::uniform_int_distribution<int> pause_ms(0, 150);
        // Until the process is gone: a refused call is retried, as a client would retry
        // elsewhere (here there is no elsewhere, so it comes back).
        while (!exited.load()) {
          absl::StatusOr<v1::AttendResponse> response = clients[c]->Attend(*small);
          {
            std::lock_guard<std::mutex> lock(mu);
            ++codes[response.status().code()];
            if (response.ok()) {
              e2e::ExpectCorrect(*small, response);
            } else if (response.status().code() != absl::StatusCode::kUnavailable &&
                       unexpected.size() < 10) {
              unexpected.push_back(response.status().ToString());
            }
          }
          if (c % 2 == 1) absl::SleepFor(absl::Milliseconds(pause_ms(pauses)));
        }
      });
    }
    absl::SleepFor(absl::Milliseconds(100));  // served before the signal
    ASSERT_TRUE(server->process->Signal(SIGTERM).ok());
    e2e::ExpectBlockerAnswered(*blocker, blocked.get());
    absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(kGraceSeconds + 10));
    // A little longer: calls sent as the process went must be answered (or fail) too.
    absl::SleepFor(absl::Milliseconds(200));
    std::move(stop_clients).Invoke();
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << server->process->Log();
    EXPECT_GT(codes[absl::StatusCode::kOk], 0);
    EXPECT_GT(codes[absl::StatusCode::kUnavailable], 0);
    EXPECT_THAT(unexpected, ::testing::IsEmpty()) << "calls answered neither OK nor UNAVAILABLE";
    std::string summary;
    for (const auto& [c, n] : codes)
      absl::StrAppend(&summary, " ", absl::StatusCodeToString(c), " ", n);
    std::printf("through the shutdown, run %d:%s\n", run, summary.c_str());
  }
}

// An idle connection and open streams do not hold the exit: once the accepted requests are
// answered, the server closes them instead of waiting out --shutdown_grace_s. The open streams,
// one never used and one whose message was answered, end UNAVAILABLE (a client retries it
// elsewhere), not CANCELLED by gRPC's shutdown; on both stream transports.
TEST(ShutdownTest, IdleConnectionsDoNotHoldTheExitAndOpenStreamsEndUnavailable) {
  constexpr int kGraceSeconds = 30;
  std::mt19937_64 rng(e2e::FreshSeed());
  absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(kSmallCall, rng);
  ASSERT_TRUE(small.ok()) << small.status();
  for (const char* transport : {"--poll_streams=false", "--poll_streams"}) {
    SCOPED_TRACE(transport);
    absl::StatusOr<e2e::RunningServer> server =
        e2e::StartServer({"--backend=cpu", "--threads=1", transport,
                          absl::StrCat("--shutdown_grace_s=", kGraceSeconds)});
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_TRUE(server->client->GetServerInfo().ok());  // connected, then idle
    auto stub = v1::Attention::NewStub(server->client->channel());
    grpc::ClientContext idle_context, used_context;
    auto idle = stub->AttendStream(&idle_context);  // open, nothing sent
    auto used = stub->AttendStream(&used_context);
    v1::AttendResponse answer;
    ASSERT_TRUE(used->Write(*small) && used->Read(&answer));
    e2e::ExpectCorrect(*small, answer);

    const absl::Time signal_time = absl::Now();
    ASSERT_TRUE(server->process->Signal(SIGTERM).ok());
    absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(kGraceSeconds + 10));
    const absl::Duration exit_after = absl::Now() - signal_time;
    for (auto* stream : {idle.get(), used.get()}) {
      const grpc::Status ended = stream->Finish();
      EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE) << ended.error_message();
      EXPECT_THAT(ended.error_message(), ::testing::HasSubstr("server is shutting down"));
    }
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << server->process->Log();
    // The server lingers 1 s after the drain and gives gRPC 0.5 s to close; the rest is slack.
    absl::Duration exit_bound = absl::Seconds(5);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    exit_bound += absl::Seconds(10);  // the sanitizer's exit scan
#endif
    EXPECT_LT(exit_after, exit_bound);
    std::printf("%s: idle connection and streams: exit 0 after %s (grace %d s)\n", transport,
                absl::FormatDuration(exit_after).c_str(), kGraceSeconds);
  }
}

}  // namespace
}  // namespace attention::reliability
