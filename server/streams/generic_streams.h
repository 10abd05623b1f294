// The server's stream methods (stream_methods.h: Attention.AttendStream and Sessions.StepStream,
// which both services mark generic) on its generic service:
//   CallbackStreams (the default): gRPC's callback API, each stream a StreamReactor, as every
//     other call of the server.
//   PolledStreams (--poll_streams): gRPC's async API, every stream's reads, writes and finish
//     completed on one completion queue that one thread polls without sleeping, and each read's
//     message decoded on that thread (one over 1 MiB, whose copy would hold up the other streams,
//     on an offload thread, the stream's later messages after it). Each completion is seen the
//     moment it happens, where on the callback API one of gRPC's threads is woken for it, and the
//     decode runs on a thread whose caches stay warm: a one-in-flight Step 8 x 32k by reference
//     took kernel + 212 us against kernel + 333 us on the callback API (H200 host, bench/README.md,
//     co-located clients). Its price: one core busy while messages come; after 20 ms without a
//     completion the thread sleeps in the queue until the next one.
// Either answers any method not in its table UNIMPLEMENTED (every other method of the server is
// registered by its own service).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "server/streams/stream_methods.h"

namespace attention::server {

class CallbackStreams final : public grpc::CallbackGenericService {
 public:
  // `methods` must outlive the server.
  explicit CallbackStreams(const StreamMethods* methods) : methods_(methods) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  const StreamMethods* const methods_;
};

class PolledStreams {
 public:
  // `service` is registered with the server (ServerBuilder::RegisterAsyncGenericService) and `cq`
  // is the server's queue for it (ServerBuilder::AddCompletionQueue); `methods` outlives this.
  PolledStreams(const StreamMethods* methods, grpc::AsyncGenericService* service,
                std::unique_ptr<grpc::ServerCompletionQueue> cq);
  // Stops, if Stop has not.
  ~PolledStreams();
  PolledStreams(const PolledStreams&) = delete;
  PolledStreams& operator=(const PolledStreams&) = delete;

  // Starts the polling thread, once the server has started.
  void Start();
  // Once the server has shut down (its calls are over or cancelled) and the scheduler with it:
  // waits until every call has seen its last completion, then shuts the queue down and joins the
  // thread. No operation may start on a queue that is shut down, hence the order.
  void Stop();

 private:
  class Call;
  class Flow;
  void Run();
  // Runs `work` on the offload thread, after what was handed to it before (Flow::RunProcess).
  void Offload(absl::AnyInvocable<void() &&> work);
  void RunOffloaded();

  const StreamMethods* const methods_;
  grpc::AsyncGenericService* const service_;
  const std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::atomic<int> live_{0};  // calls asked for or accepted, and not yet over
  std::thread poller_;
  bool stopped_ = false;
  std::thread offloader_;
  std::mutex offload_mu_;  // guards the three below
  std::condition_variable offload_cv_;
  std::deque<absl::AnyInvocable<void() &&>> offloaded_;
  bool offload_stop_ = false;
};

}  // namespace attention::server
