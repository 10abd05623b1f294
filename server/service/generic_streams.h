// Sessions.StepStream on the server's generic service (SessionService marks the method generic):
//   CallbackStepStreams (the default): gRPC's callback API, the stream a StreamReactor, as every
//     other stream of the server.
//   PolledStepStreams (--poll_step_streams): gRPC's async API, every StepStream call's reads,
//     writes and finish completed on one completion queue that one thread polls without sleeping.
//     Each completion is seen the moment it happens, where on the callback API one of gRPC's
//     threads is woken for it (the echo server's delayed replies: 36-58 us less a round trip with
//     a Step's bytes on the H200 host, bench/README.md run D). Its price: one core always busy.
// Either answers any other method that reaches the generic service UNIMPLEMENTED (every other
// method of the server is registered by its own service).
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "server/service/session_service.h"

namespace attention::server {

class CallbackStepStreams final : public grpc::CallbackGenericService {
 public:
  // `sessions` must outlive the server.
  explicit CallbackStepStreams(SessionService* sessions) : sessions_(sessions) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  SessionService* const sessions_;
};

class PolledStepStreams {
 public:
  // `service` is registered with the server (ServerBuilder::RegisterAsyncGenericService) and `cq`
  // is the server's queue for it (ServerBuilder::AddCompletionQueue); `sessions` outlives this.
  PolledStepStreams(SessionService* sessions, grpc::AsyncGenericService* service,
                    std::unique_ptr<grpc::ServerCompletionQueue> cq);
  // Stops, if Stop has not.
  ~PolledStepStreams();
  PolledStepStreams(const PolledStepStreams&) = delete;
  PolledStepStreams& operator=(const PolledStepStreams&) = delete;

  // Starts the polling thread, once the server has started.
  void Start();
  // Once the server has shut down (its calls are over or cancelled) and the scheduler with it:
  // waits until every call has seen its last completion, then shuts the queue down and joins the
  // thread. No operation may start on a queue that is shut down, hence the order.
  void Stop();

 private:
  class Call;
  void Run();

  SessionService* const sessions_;
  grpc::AsyncGenericService* const service_;
  const std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::atomic<int> live_{0};  // calls asked for or accepted, and not yet over
  std::thread poller_;
  bool stopped_ = false;
};

}  // namespace attention::server
