#include "server/service/generic_streams.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/service/stream_reactor.h"

namespace attention::server {
namespace {

constexpr char kStepStreamMethod[] = "/attention.v1.Sessions/StepStream";

grpc::Status UnknownMethod(const std::string& method) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat("method ", method, " is not served here"));
}

}  // namespace

grpc::ServerGenericBidiReactor* CallbackStepStreams::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (context->method() == kStepStreamMethod) return sessions_->StepStream(context);
  class Refusal final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Refusal(const std::string& method) { Finish(UnknownMethod(method)); }
    void OnDone() override { delete this; }
  };
  return new Refusal(context->method());
}

// One call taken from the queue. Before it is accepted it holds itself (`accepting_`); once
// accepted, a StepStream call is a StreamFlow whose operations complete on the queue, and holds
// itself through the flow until its Finish and its done notification have come back with no
// operation outstanding. All completions arrive on the polling thread; writes and the finish may
// also start on a scheduler worker (a Step answered), reads only on the polling thread.
class PolledStepStreams::Call final
    : public StreamFlow<PolledStepStreams::Call, SessionService::StepMessages> {
  using Flow = StreamFlow<Call, SessionService::StepMessages>;

 public:
  enum class Kind { kAccepted, kRead, kWritten, kFinished, kDone };
  struct Op {  // a completion queue tag: which call, which operation
    Call* call;
    Kind kind;
  };

  explicit Call(PolledStepStreams* owner)
      : Flow(owner->sessions_->stream_window(),
             owner->sessions_->StepStreamProcess(
                 {.grpc = &context_, .cancelled = [this] { return cancelled_.load(); }})),
        owner_(owner) {}

  // Asks the server for the next call.
  static void Accept(PolledStepStreams* owner) {
    auto call = std::make_shared<Call>(owner);
    call->accepting_ = call;
    owner->live_.fetch_add(1);
    // Before the call is asked for, as the async API requires; delivered once an accepted call is
    // over (finished or cancelled).
    call->context_.AsyncNotifyWhenDone(&call->done_);
    owner->service_->RequestCall(&call->context_, &call->stream_, owner->cq_.get(),
                                 owner->cq_.get(), &call->accepted_);
  }

  // One completion, on the polling thread.
  void Completed(Kind kind, bool ok) {
    std::shared_ptr<Call> keep;  // the last reference may go here: released on return
    switch (kind) {
      case Kind::kAccepted:
        keep = std::move(accepting_);
        if (!ok) {  // the server is shutting down: no call came, and no done notification comes
          owner_->live_.fetch_sub(1);
          return;
        }
        Accept(owner_);  // the next call
        if (context_.method() == kStepStreamMethod) {
          Flow::Begin(keep);
        } else {
          unknown_ = true;
          refusing_ = keep;
          Finish(UnknownMethod(context_.method()));
        }
        break;
      case Kind::kRead:
        ReadDone(ok);
        break;
      case Kind::kWritten:
        WriteDone(ok);
        break;
      case Kind::kFinished:
        finished_ = true;
        break;
      case Kind::kDone:
        done_seen_ = true;
        if (context_.IsCancelled()) {
          cancelled_.store(true);
          if (!unknown_) Cancelled();
        }
        break;
    }
    if (kind != Kind::kAccepted && kind != Kind::kDone) pending_.fetch_sub(1);
    if (finished_ && done_seen_ && pending_.load() == 0 && !over_) {
      over_ = true;
      keep = unknown_ ? std::move(refusing_) : Flow::Release();
      owner_->live_.fetch_sub(1);
    }
  }

  // The operations StreamFlow starts (with its lock held).
  void StartRead(grpc::ByteBuffer* request) {
    pending_.fetch_add(1);
    stream_.Read(request, &read_);
  }
  void StartWrite(const grpc::ByteBuffer* response) {
    pending_.fetch_add(1);
    stream_.Write(*response, &written_);
  }
  void Finish(const grpc::Status& status) {
    pending_.fetch_add(1);
    stream_.Finish(status, &finished_op_);
  }

 private:
  PolledStepStreams* const owner_;
  grpc::GenericServerContext context_;
  grpc::GenericServerAsyncReaderWriter stream_{&context_};
  Op accepted_{this, Kind::kAccepted}, read_{this, Kind::kRead}, written_{this, Kind::kWritten},
      finished_op_{this, Kind::kFinished}, done_{this, Kind::kDone};
  std::shared_ptr<Call> accepting_;  // the call's hold on itself until it is accepted
  std::shared_ptr<Call> refusing_;   // and while another method's call is refused
  std::atomic<int> pending_{0};      // reads, writes and the finish not yet completed
  std::atomic<bool> cancelled_{false};
  // The polling thread's alone:
  bool unknown_ = false;  // another method than StepStream: refused, no flow
  bool finished_ = false;
  bool done_seen_ = false;
  bool over_ = false;
};

PolledStepStreams::PolledStepStreams(SessionService* sessions, grpc::AsyncGenericService* service,
                                     std::unique_ptr<grpc::ServerCompletionQueue> cq)
    : sessions_(sessions), service_(service), cq_(std::move(cq)) {}

PolledStepStreams::~PolledStepStreams() { Stop(); }

void PolledStepStreams::Start() {
  Call::Accept(this);
  poller_ = std::thread([this] { Run(); });
}

void PolledStepStreams::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (poller_.joinable()) {
    // The server is down: its calls' last completions are on their way (a bounded wait: every
    // operation of a call that is over completes, not ok).
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (live_.load() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  }
  cq_->Shutdown();
  if (poller_.joinable()) {
    poller_.join();
  } else {  // never started: drain what the queue holds (nothing was asked of it)
    void* tag = nullptr;
    bool ok = false;
    while (cq_->Next(&tag, &ok)) {
    }
  }
}

void PolledStepStreams::Run() {
  void* tag = nullptr;
  bool ok = false;
  while (true) {
    switch (cq_->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC))) {
      case grpc::CompletionQueue::GOT_EVENT: {
        const auto* op = static_cast<const Call::Op*>(tag);
        op->call->Completed(op->kind, ok);
        break;
      }
      case grpc::CompletionQueue::TIMEOUT:
        break;
      case grpc::CompletionQueue::SHUTDOWN:
        return;
    }
  }
}

}  // namespace attention::server
