// One bidirectional stream of requests (AttendStream, StepStream): reads continuously, hands each
// request to its method's processing (stream_methods.h) as soon as it is read, and writes each
// response when its request finishes, possibly out of order. Messages are raw (grpc::ByteBuffer
// both ways): the service parses each request itself (service/wire_buffers.h says why) and keeps
// what it needs for it in the method's StreamExchange, one per message. A request that fails ends
// the stream with its status (the message names its request_id) once the responses already
// computed are written.
//
// Every gRPC operation (read, write, finish) is started with StreamFlow's mu_ held, so its state
// and the operations in flight always agree; the completions come back on other threads, never
// inside those calls. The stream's transport owns itself through self_ until it is done, and
// each request in flight holds a reference too, so a worker finishing the last request can never
// touch a deleted stream. Two transports: StreamReactor below (gRPC's callback API), and
// PolledStreams' calls (the async API, one thread polling; generic_streams.h); the request rings
// are a third (request_rings.h).
//
// Thread hops: a request is decoded and queued on the gRPC thread that completed its read (no
// hop); the scheduler's worker that runs it starts the write of its response (one hop, the
// queue's); the next read is started as soon as the request is queued, so reading the next,
// computing this one and writing the last overlap on one stream, and the requests of a stream are
// queued in the order they were sent.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "kernels/quote.h"
#include "server/calls/call_context.h"
#include "server/calls/call_gate.h"
#include "server/streams/stream_methods.h"

namespace attention::server {

// The bookkeeping of one such stream, apart from the gRPC API that moves its messages.
// `Transport` (CRTP) starts the operations, each at most once at a time: StartRead(ByteBuffer*),
// StartWrite(const ByteBuffer*) and Finish(grpc::Status); and reports their completions to
// ReadDone, WriteDone and Cancelled. RunProcess(bytes, work) runs the processing of a message of
// `bytes` (`work`, an absl::AnyInvocable<void() &&>) on the thread that read it, or hands it to
// a thread of its own (the polled transport's large messages). It holds itself in `self_` while it
// may be needed (from Begin until its transport is done), and each request in flight holds a
// reference too.
template <typename Transport>
class StreamFlow : public OpenStreams::Stream {
 public:
  using Done = absl::AnyInvocable<void(absl::Status) &&>;

  // Serves `method` (its window and exchanges) with `process`, the method's processing of this
  // stream; it is among the method's open streams from Begin to Release.
  StreamFlow(const StreamMethod& method, StreamProcess process)
      : window_(method.window),
        new_exchange_(method.new_exchange),
        open_streams_(method.open_streams),
        process_(std::move(process)) {}

  // The drain is over (OpenStreams): as a failed request would, `status` ends the stream once
  // the answers it holds are written.
  void End(const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = status;
    Advance();
  }

  void ReadDone(bool ok) {
    std::unique_ptr<StreamExchange> exchange;
    std::shared_ptr<Transport> self;
    {
      std::lock_guard<std::mutex> lock(mu_);
      exchange = std::move(reading_);
      if (!ok) reads_done_ = true;
      if (!ok || Ending()) {  // a request read while the stream ends is dropped unanswered
        Advance();
        return;
      }
      ++in_flight_;
      self = self_;
      // No next read until this request is handed on: on the callback API the next read's
      // completion may run on another thread, and the requests of a stream must be queued in the
      // order they were sent (a client may send Steps that append to one session without waiting).
      dispatching_ = true;
    }
    StreamExchange* e = exchange.get();
    const size_t bytes = e->request.Length();
    // The transport runs it here or hands it to a thread of its own (RunProcess).
    transport().RunProcess(bytes, [this, e, self, exchange = std::move(exchange)]() mutable {
      process_(
          e, [self = std::move(self), exchange = std::move(exchange)](absl::Status status) mutable {
            self->Processed(std::move(exchange), std::move(status));
          });
    });
    std::lock_guard<std::mutex> lock(mu_);
    dispatching_ = false;
    Advance();  // the next read, if the window has room
  }

  void WriteDone(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    writing_.reset();
    if (!ok) cancelled_ = true;  // the stream broke: nothing more can be written
    Advance();
  }

  void Cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    Advance();
  }

 protected:
  // Starts the stream (its first read); `self` is the transport, held until Release.
  void Begin(std::shared_ptr<Transport> self) {
    if (open_streams_ != nullptr) open_streams_->Add(self);
    std::lock_guard<std::mutex> lock(mu_);
    self_ = std::move(self);
    Advance();
  }
  // The transport is done: the reference Begin took, to be dropped after the lock.
  std::shared_ptr<Transport> Release() {
    if (open_streams_ != nullptr) open_streams_->Remove(this);
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(self_);
  }

 private:
  Transport& transport() { return static_cast<Transport&>(*this); }

  void Processed(std::unique_ptr<StreamExchange> exchange, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    if (status.ok()) {
      ready_.push_back(std::move(exchange));
    } else if (status_.ok()) {
      status_ = absl::Status(status.code(), absl::StrCat("request ", Quote(exchange->request_id()),
                                                         ": ", status.message()));
    }
    Advance();
  }

  // Needs mu_.
  bool Ending() const { return finished_ || reads_done_ || cancelled_ || !status_.ok(); }

  // Starts whatever the state allows: the next write, the next read, or Finish. Needs mu_.
  void Advance() {
    if (finished_) return;
    if (cancelled_) ready_.clear();  // nobody is listening
    if (writing_ == nullptr && !ready_.empty()) {
      writing_ = std::move(ready_.front());
      ready_.pop_front();
      transport().StartWrite(&writing_->response);
    }
    const int held = in_flight_ + static_cast<int>(ready_.size()) + (writing_ != nullptr);
    if (!Ending() && reading_ == nullptr && !dispatching_ && held < window_) {
      reading_ = new_exchange_();
      transport().StartRead(&reading_->request);
    }
    if (Ending() && in_flight_ == 0 && writing_ == nullptr && ready_.empty()) {
      finished_ = true;
      // A read may still be outstanding; it completes (not ok) before the transport is done.
      transport().Finish(cancelled_ ? grpc::Status::CANCELLED : ToGrpcStatus(status_));
    }
  }

  const int window_;
  std::unique_ptr<StreamExchange> (*const new_exchange_)();
  OpenStreams* const open_streams_;
  StreamProcess process_;
  std::mutex mu_;  // guards all below; a pthread lock, which ThreadSanitizer sees
  std::shared_ptr<Transport> self_;
  std::unique_ptr<StreamExchange> reading_;            // the read outstanding, if any
  std::unique_ptr<StreamExchange> writing_;            // the write outstanding, if any
  std::deque<std::unique_ptr<StreamExchange>> ready_;  // answered, to be written
  int in_flight_ = 0;                                  // in process_, not yet answered
  bool dispatching_ = false;                           // ReadDone is handing a request on
  bool reads_done_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
  absl::Status status_;  // the first failure; ends the stream
};

// A stream on gRPC's callback API: gRPC runs the reactions (OnReadDone, ...) on its own threads,
// never inside the operations' calls. The reactor owns itself until OnDone.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public StreamFlow<StreamReactor> {
  using Flow = StreamFlow<StreamReactor>;

 public:
  StreamReactor(const StreamMethod& method, StreamProcess process)
      : Flow(method, std::move(process)) {}

  // Starts a stream of `method` on `context`: the reactor owns itself until gRPC is done with it.
  static grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Begin(
      const StreamMethod& method, const grpc::CallbackServerContext* context) {
    auto reactor = std::make_shared<StreamReactor>(method, method.open(CallbackCall(context)));
    reactor->Flow::Begin(reactor);
    return reactor.get();
  }

  void OnReadDone(bool ok) override { this->ReadDone(ok); }
  // On the gRPC thread that read the message: gRPC's pool has threads for the other streams.
  template <typename Work>
  void RunProcess(size_t /*bytes*/, Work work) {
    std::move(work)();
  }
  void OnWriteDone(bool ok) override { this->WriteDone(ok); }
  void OnCancel() override { this->Cancelled(); }
  void OnDone() override {
    // Released after Release's lock: the last reference deletes this.
    std::shared_ptr<StreamReactor> self = this->Release();
  }
  // StreamFlow starts the reactor's own StartRead, StartWrite and Finish.
};

}  // namespace attention::server
