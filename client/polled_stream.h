// A bidirectional stream driven by the calling thread one operation at a time, on gRPC's async
// API with a completion queue of its own that the thread polls without ever sleeping: Write,
// Read, WritesDone and Finish each start their operation and poll the queue (a non-blocking
// epoll of the connection) until it completes. So a response is read by the waiting thread the
// moment its bytes arrive, with no wake-up: on a virtual machine a thread woken from sleep costs
// tens of microseconds (bench/results/2026-12-01-step-latency-spin-poll-clients.md), which a decode
// loop with one Step in flight pays on every Step. The price is one core busy while a call is
// outstanding; it suits a co-located model process that waits for attention anyway.
//
//   auto stream = PolledStream<Req, Resp>::Start(
//       [&](grpc::ClientContext* c, grpc::CompletionQueue* cq) {
//         return stub->PrepareAsyncStepStream(c, cq);
//       }, &context);
//   stream->Write(request) && stream->Read(&response);
#pragma once

#include <memory>
#include <utility>

#include "grpcpp/grpcpp.h"

namespace attention::client {

template <class Req, class Resp>
class PolledStream {
 public:
  // `prepare` makes the stream on the given context and queue (a stub's PrepareAsyncX). The
  // context must outlive the stream.
  template <class Prepare>
  static std::unique_ptr<PolledStream> Start(Prepare prepare, grpc::ClientContext* context) {
    auto stream = std::unique_ptr<PolledStream>(new PolledStream);
    stream->stream_ = prepare(context, &stream->cq_);
    stream->stream_->StartCall(kTag);
    stream->started_ = stream->Await();
    return stream;
  }
  ~PolledStream() {
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  PolledStream(const PolledStream&) = delete;
  PolledStream& operator=(const PolledStream&) = delete;

  // false when the stream is broken (then Finish says why).
  bool Write(const Req& request) {
    if (!started_) return false;
    stream_->Write(request, kTag);
    return Await();
  }
  // false when the stream is over or broken.
  bool Read(Resp* response) {
    if (!started_) return false;
    stream_->Read(response, kTag);
    return Await();
  }
  void WritesDone() {
    if (!started_) return;
    stream_->WritesDone(kTag);
    Await();
  }
  grpc::Status Finish() {
    grpc::Status status;
    stream_->Finish(&status, kTag);
    Await();
    return status;
  }

 private:
  PolledStream() = default;

  // Polls until the one operation in flight completes; its ok.
  bool Await() {
    void* tag = nullptr;
    bool ok = false;
    while (true) {
      switch (cq_.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC))) {
        case grpc::CompletionQueue::GOT_EVENT:
          return ok;
        case grpc::CompletionQueue::TIMEOUT:
          break;
        case grpc::CompletionQueue::SHUTDOWN:
          return false;
      }
    }
  }

  static inline void* const kTag = reinterpret_cast<void*>(1);
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<Req, Resp>> stream_;
  bool started_ = false;
};

}  // namespace attention::client
