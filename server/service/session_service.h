// The attention.v1.Sessions gRPC service (KV-resident sessions), on gRPC's callback API. Calls
// that touch K/V (CreateSession, AppendKv, Step) run on the service's own worker threads, since a
// call may wait for another call on the same session and a decode step blocks until its kernel
// is done; DropSession and ListSessions are answered inline.
//
// Every call checks the bearer token (when the server has one), is refused UNAVAILABLE once the
// server drains, and is recorded in the request metrics under its rpc name. A Step runs its
// entries of one shape (dtype, kv heads, head dim, query heads) and device as ONE
// KvPagePool::Decode; entries of other shapes or devices are further calls, in order of first
// appearance.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/metrics/metrics.h"
#include "server/requests/session_request.h"
#include "server/sessions/session_store.h"

namespace attention::server {

struct SessionServiceOptions {
  int64_t max_message_bytes = int64_t{1024} << 20;
  int max_head_dim = 256;
  // When set, every call must carry `authorization: Bearer <auth_token>` (see security.h), and
  // sessions belong to the token that created them.
  std::string auth_token;
  // Threads running CreateSession, AppendKv and Step.
  int workers = 2;
  // How often idle sessions past the TTL are removed (lookups also check).
  absl::Duration sweep_interval = absl::Seconds(1);
};

class SessionService final : public v1::Sessions::CallbackService {
 public:
  // `store` may be null: the server keeps no KV cache (its backend has no page pool), and every
  // call is answered UNIMPLEMENTED. `store` and `metrics` must outlive the service.
  SessionService(const SessionServiceOptions& options, SessionStore* store, Metrics* metrics);
  // Runs the calls already queued, then stops the workers and the sweeper.
  ~SessionService() override;
  SessionService(const SessionService&) = delete;
  SessionService& operator=(const SessionService&) = delete;

  // From now on every new call is answered UNAVAILABLE; calls already accepted run to the end.
  void StartDraining();
  // After StartDraining: blocks until every accepted call has been answered or `deadline`
  // passes. True when drained.
  bool AwaitDrained(absl::Time deadline);

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* AppendKv(grpc::CallbackServerContext* context,
                                     const v1::AppendKvRequest* request,
                                     v1::SessionInfo* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerUnaryReactor* DropSession(grpc::CallbackServerContext* context,
                                        const v1::DropSessionRequest* request,
                                        v1::DropSessionResponse* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;

 private:
  // Answers one call: checks the token and draining, then runs `body` (on a worker when
  // `on_worker`, else inline) and finishes the reactor with its status, recording metrics.
  // `body` gets the caller's owner key and the call's arrival time.
  grpc::ServerUnaryReactor* Serve(
      absl::string_view rpc, grpc::CallbackServerContext* context,
      const google::protobuf::Message& request, const google::protobuf::Message* response,
      bool on_worker, absl::AnyInvocable<absl::Status(const std::string&, absl::Time) &&> body);

  absl::Status RunCreate(const std::string& owner, const v1::CreateSessionRequest& request,
                         v1::SessionInfo* response);
  absl::Status RunAppend(const std::string& owner, const v1::AppendKvRequest& request,
                         v1::SessionInfo* response);
  absl::Status RunStep(const std::string& owner, absl::Time arrival, const v1::StepRequest& request,
                       v1::StepResponse* response);

  void WorkerLoop();
  void SweeperLoop();

  const SessionServiceOptions options_;
  const SessionLimits limits_;
  SessionStore* const store_;
  Metrics* const metrics_;
  std::atomic<bool> draining_{false};

  std::mutex mu_;
  std::condition_variable wake_;                     // for the workers: a call queued, or stopping
  std::condition_variable stop_sweep_;               // for the sweeper: stopping
  std::deque<absl::AnyInvocable<void() &&>> queue_;  // guarded by mu_
  bool stopping_ = false;                            // guarded by mu_
  int in_flight_ = 0;                                // guarded by mu_: calls not yet answered
  std::condition_variable answered_;                 // in_flight_ went down
  std::vector<std::thread> workers_;
  std::thread sweeper_;
};

}  // namespace attention::server
