#include "server/streams/generic_streams.h"

#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/streams/stream_reactor.h"

namespace attention::server {
namespace {

// The largest message processed on the polling thread itself (its copy takes ~0.1 ms).
constexpr size_t kInlineProcessBytes = size_t{1} << 20;

grpc::Status UnknownMethod(const std::string& method) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat("method ", method, " is not served here"));
}

}  // namespace

grpc::ServerGenericBidiReactor* CallbackStreams::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (const StreamMethod* method = methods_->Find(context->method()); method != nullptr) {
    return StreamReactor::Begin(*method, context);
  }
  class Refusal final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Refusal(const std::string& method) { Finish(UnknownMethod(method)); }
    void OnDone() override { delete this; }
  };
  return new Refusal(context->method());
}

// One call taken from the queue: its context, its stream and the tags of its operations. Before
// it is accepted it holds itself (`accepting_`); once accepted, a stream's Flow (of its method)
// holds it, and the Flow holds itself until the call's Finish and its done notification
// have come back with no operation outstanding; a refused call holds itself that long. All
// completions arrive on the polling thread; writes and the finish may also start on a scheduler
// worker (a request answered), reads only on the polling thread.
class PolledStreams::Call final {
 public:
  enum class Kind { kAccepted, kRead, kWritten, kFinished, kDone };
  struct Op {  // a completion queue tag: which call, which operation
    Call* call;
    Kind kind;
  };
  // What the Flow of an accepted stream is told.
  class Events {
   public:
    virtual void ReadDone(bool ok) = 0;
    virtual void WriteDone(bool ok) = 0;
    virtual void Cancelled() = 0;
    // The Flow's hold on itself, to be dropped once the call is over.
    virtual std::shared_ptr<void> Release() = 0;

   protected:
    ~Events() = default;
  };

  explicit Call(PolledStreams* owner) : owner_(owner) {}

  // Asks the server for the next call.
  static void Accept(PolledStreams* owner) {
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
    std::shared_ptr<void> keep;  // the last reference may go here: released on return
    switch (kind) {
      case Kind::kAccepted:
        keep = std::move(accepting_);
        if (!ok) {  // the server is shutting down: no call came, and no done notification comes
          owner_->live_.fetch_sub(1);
          return;
        }
        Accept(owner_);  // the next call
        Begin(std::static_pointer_cast<Call>(keep));
        break;
      case Kind::kRead:
        events_->ReadDone(ok);
        break;
      case Kind::kWritten:
        events_->WriteDone(ok);
        break;
      case Kind::kFinished:
        finished_ = true;
        break;
      case Kind::kDone:
        done_seen_ = true;
        if (context_.IsCancelled()) {
          cancelled_.store(true);
          if (events_ != nullptr) events_->Cancelled();
        }
        break;
    }
    if (kind != Kind::kAccepted && kind != Kind::kDone) pending_.fetch_sub(1);
    if (finished_ && done_seen_ && pending_.load() == 0 && !over_) {
      over_ = true;
      if (events_ != nullptr) {
        keep = events_->Release();
      } else {
        keep = std::move(refusing_);
      }
      owner_->live_.fetch_sub(1);
    }
  }

  // The operations a Flow starts (with its lock held).
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

  // The call as its requests see it: on the async API the context says whether the call was
  // cancelled only once its done tag has come back, so the answer is the one that tag brought.
  CallContext context() {
    return {.grpc = &context_, .cancelled = [this] { return cancelled_.load(); }};
  }

 private:
  // The accepted call's stream, by its method; `self` holds the call.
  void Begin(std::shared_ptr<Call> self);

  PolledStreams* const owner_;
  grpc::GenericServerContext context_;
  grpc::GenericServerAsyncReaderWriter stream_{&context_};
  Op accepted_{this, Kind::kAccepted}, read_{this, Kind::kRead}, written_{this, Kind::kWritten},
      finished_op_{this, Kind::kFinished}, done_{this, Kind::kDone};
  std::shared_ptr<Call> accepting_;  // the call's hold on itself until it is accepted
  std::shared_ptr<Call> refusing_;   // and while a method not served here is refused
  std::atomic<int> pending_{0};      // reads, writes and the finish not yet completed
  std::atomic<bool> cancelled_{false};
  // The polling thread's alone:
  Events* events_ = nullptr;  // the stream's Flow, from its Begin to its Release; null if refused
  bool finished_ = false;
  bool done_seen_ = false;
  bool over_ = false;
};

// An accepted stream of one method: StreamFlow's bookkeeping, its operations started on the
// call. Holds the call (the call only points back at it).
class PolledStreams::Flow final : public StreamFlow<Flow>, public Call::Events {
  using Base = StreamFlow<Flow>;

 public:
  Flow(PolledStreams* owner, const StreamMethod& method, StreamProcess process,
       std::shared_ptr<Call> call)
      : Base(method, std::move(process)), owner_(owner), call_(std::move(call)) {}

  static Call::Events* Begin(PolledStreams* owner, const StreamMethod& method, CallContext context,
                             std::shared_ptr<Call> call) {
    auto flow =
        std::make_shared<Flow>(owner, method, method.open(std::move(context)), std::move(call));
    flow->Base::Begin(flow);
    return flow.get();
  }

  // A message over kInlineProcessBytes is processed on the offload thread, so that its copy
  // (milliseconds for tens of MiB) does not hold up every other stream's completions; once one
  // is, the stream's next messages follow it there until it is done, so they are still processed
  // (and queued) in the order they were read.
  template <typename Work>
  void RunProcess(size_t bytes, Work work) {
    if (bytes <= kInlineProcessBytes && offloaded_->load() == 0) return std::move(work)();
    offloaded_->fetch_add(1);
    owner_->Offload([offloaded = offloaded_, work = std::move(work)]() mutable {
      std::move(work)();  // may release the stream: only `offloaded` is used after it
      offloaded->fetch_sub(1);
    });
  }

  void ReadDone(bool ok) override { Base::ReadDone(ok); }
  void WriteDone(bool ok) override { Base::WriteDone(ok); }
  void Cancelled() override { Base::Cancelled(); }
  std::shared_ptr<void> Release() override { return Base::Release(); }

  // StreamFlow's operations.
  void StartRead(grpc::ByteBuffer* request) { call_->StartRead(request); }
  void StartWrite(const grpc::ByteBuffer* response) { call_->StartWrite(response); }
  void Finish(const grpc::Status& status) { call_->Finish(status); }

 private:
  PolledStreams* const owner_;
  const std::shared_ptr<Call> call_;
  // Messages of this stream handed to the offload thread and not yet processed (polling thread:
  // reads it; offload thread: counts it down).
  const std::shared_ptr<std::atomic<int>> offloaded_ = std::make_shared<std::atomic<int>>(0);
};

void PolledStreams::Call::Begin(std::shared_ptr<Call> self) {
  if (const StreamMethod* method = owner_->methods_->Find(context_.method()); method != nullptr) {
    events_ = Flow::Begin(owner_, *method, context(), std::move(self));
  } else {
    refusing_ = std::move(self);
    Finish(UnknownMethod(context_.method()));
  }
}

PolledStreams::PolledStreams(const StreamMethods* methods, grpc::AsyncGenericService* service,
                             std::unique_ptr<grpc::ServerCompletionQueue> cq)
    : methods_(methods), service_(service), cq_(std::move(cq)) {}

PolledStreams::~PolledStreams() { Stop(); }

void PolledStreams::Start() {
  Call::Accept(this);
  offloader_ = std::thread([this] { RunOffloaded(); });
  poller_ = std::thread([this] { Run(); });
}

void PolledStreams::Offload(absl::AnyInvocable<void() &&> work) {
  {
    std::lock_guard<std::mutex> lock(offload_mu_);
    offloaded_.push_back(std::move(work));
  }
  offload_cv_.notify_one();
}

void PolledStreams::RunOffloaded() {
  std::unique_lock<std::mutex> lock(offload_mu_);
  while (true) {
    offload_cv_.wait(lock, [this] { return offload_stop_ || !offloaded_.empty(); });
    if (offloaded_.empty()) return;  // stopping, and nothing left
    absl::AnyInvocable<void()&&> work = std::move(offloaded_.front());
    offloaded_.pop_front();
    lock.unlock();
    std::move(work)();
    work = nullptr;  // what it held goes before the lock is taken again
    lock.lock();
  }
}

void PolledStreams::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (poller_.joinable()) {
    // The server is down: its calls' last completions are on their way (a bounded wait: every
    // operation of a call that is over completes, not ok).
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (live_.load() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  }
  // Before the queue shuts down: what is left there may still start a write or the finish.
  if (offloader_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(offload_mu_);
      offload_stop_ = true;
    }
    offload_cv_.notify_one();
    offloader_.join();
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

void PolledStreams::Run() {
  // Polls without sleeping while completions keep coming (a decode loop sends a message every few
  // hundred microseconds); once none has come for this long, sleeps in the queue until the next,
  // so an idle server holds no core busy, and the first message after a pause pays one wake-up.
  constexpr absl::Duration kSpin = absl::Milliseconds(20);
  absl::Time last_event = absl::Now();
  void* tag = nullptr;
  bool ok = false;
  while (true) {
    const bool spin = absl::Now() - last_event < kSpin;
    switch (cq_->AsyncNext(
        &tag, &ok, spin ? gpr_time_0(GPR_CLOCK_MONOTONIC) : gpr_inf_future(GPR_CLOCK_MONOTONIC))) {
      case grpc::CompletionQueue::GOT_EVENT: {
        const auto* op = static_cast<const Call::Op*>(tag);
        op->call->Completed(op->kind, ok);
        last_event = absl::Now();
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
