#include "server/streams/request_rings.h"

#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/attention/v1/request_ring.h"
#include "server/streams/stream_reactor.h"

namespace attention::server {
namespace {

// How long a ring's thread spins after its last event before it sleeps on the bell (as the
// polled streams' thread, generic_streams.cc): a decode loop posts a Step every few hundred
// microseconds, and a sleeping thread costs the next request a wake-up.
constexpr absl::Duration kIdleSpin = absl::Milliseconds(20);

absl::Status CheckGeometry(const v1::OpenRingRequest& request) {
  if (request.method() != v1::RING_METHOD_ATTEND && request.method() != v1::RING_METHOD_STEP) {
    return absl::InvalidArgumentError(
        absl::StrCat("method: expected RING_METHOD_ATTEND or RING_METHOD_STEP, got ",
                     v1::RingMethod_Name(request.method())));
  }
  if (request.slots() < 1 || request.slots() > ring::kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots: expected 1 to ", ring::kMaxSlots, ", got ", request.slots()));
  }
  if (request.slot_bytes() < ring::kMinSlotBytes || request.slot_bytes() > ring::kMaxSlotBytes ||
      request.slot_bytes() % ring::kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slot_bytes: expected a multiple of ", ring::kAlignment, " from ", ring::kMinSlotBytes,
        " to ", ring::kMaxSlotBytes, ", got ", request.slot_bytes()));
  }
  if (request.offset() < 0 || request.offset() % ring::kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset: expected a non-negative multiple of ",
                                                   ring::kAlignment, ", got ", request.offset()));
  }
  return absl::OkStatus();
}

}  // namespace

// The ring's memory as its thread sees it: the slots, and the server's own counters, which are
// stored into the ring but never read back from it (the client could have changed them).
struct RequestRings::Memory {
  char* base;
  int slots;
  int64_t slot_bytes;
  ring::RingHeader* header;
  uint64_t requests_taken = 0;
  uint64_t responses_posted = 0;

  int64_t payload_bytes() const { return slot_bytes - ring::kLengthBytes; }

  // The next request, copied out of its slot into `request`: true; false when none is posted.
  // INVALID_ARGUMENT when the ring's words are out of range.
  absl::StatusOr<bool> Take(grpc::ByteBuffer* request) {
    const uint64_t posted = header->requests_posted.load();
    if (posted == requests_taken) return false;
    const uint64_t count = static_cast<uint64_t>(slots);
    if (posted - requests_taken > count) {  // also a count that went back
      return absl::InvalidArgumentError(absl::StrCat(
          "ring requests_posted: expected ", requests_taken, " to ", requests_taken + count,
          " (requests_taken to requests_taken + slots), got ", posted));
    }
    const char* slot = ring::RequestSlot(base, slots, slot_bytes, requests_taken);
    uint64_t length = 0;
    std::memcpy(&length, slot, sizeof(length));
    if (length > static_cast<uint64_t>(payload_bytes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ring request ", requests_taken, " (slot ", requests_taken % count,
          "): length expected at most ", payload_bytes(), " (slot_bytes - 8), got ", length));
    }
    grpc::Slice bytes(slot + ring::kLengthBytes, length);  // a copy: the slot is the client's
    *request = grpc::ByteBuffer(&bytes, 1);
    header->requests_taken.store(++requests_taken);
    ring::Notify(&header->client_waiting, &header->client_bell);  // its slot is free
    return true;
  }

  // `response` into the next response slot: true; false when none is free. INVALID_ARGUMENT when
  // the client's count is out of range, RESOURCE_EXHAUSTED when the response exceeds a slot.
  absl::StatusOr<bool> Post(const grpc::ByteBuffer& response) {
    const uint64_t taken = header->responses_taken.load();
    const uint64_t count = static_cast<uint64_t>(slots);
    if (responses_posted - taken > count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ring responses_taken: expected ",
          responses_posted < count ? 0 : responses_posted - count, " to ", responses_posted,
          " (responses_posted - slots to responses_posted), got ", taken));
    }
    if (responses_posted - taken == count) return false;
    const size_t length = response.Length();
    if (length > static_cast<size_t>(payload_bytes())) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "response ", responses_posted, ": expected at most ", payload_bytes(),
          " bytes (the ring's slot_bytes - 8), got ", length, "; open the ring with larger slots"));
    }
    char* slot = ring::ResponseSlot(base, slots, slot_bytes, responses_posted);
    std::vector<grpc::Slice> pieces;
    if (!response.Dump(&pieces).ok()) return absl::InternalError("response: unreadable buffer");
    char* to = slot + ring::kLengthBytes;
    for (const grpc::Slice& piece : pieces) {
      std::memcpy(to, piece.begin(), piece.size());
      to += piece.size();
    }
    const uint64_t length_word = length;
    std::memcpy(slot, &length_word, sizeof(length_word));
    header->responses_posted.store(++responses_posted);
    ring::Notify(&header->client_waiting, &header->client_bell);
    return true;
  }
};

// What the call and the thread see of a ring.
class RequestRings::Ring {
 public:
  virtual ~Ring() = default;
  // The ring's thread, until the ring ends and its call is answered.
  virtual void Serve() = 0;
  // The call was cancelled (the client went away, or the server shuts down).
  virtual void CallCancelled() = 0;
};

namespace {

// The OpenRing call: answered by the ring when it ends; tells the ring when it is cancelled.
class RingCall final : public grpc::ServerUnaryReactor {
 public:
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (on_cancel_) on_cancel_();
  }
  void OnDone() override { delete this; }
  void SetOnCancel(std::function<void()> on_cancel) {
    std::lock_guard<std::mutex> lock(mu_);
    on_cancel_ = std::move(on_cancel);
  }

 private:
  std::mutex mu_;
  std::function<void()> on_cancel_;  // holds the ring
};

}  // namespace

// One ring's StreamFlow of its method's messages; its operations are requests to the ring's
// thread (StartRead, Finish) or done at once where they can be (StartWrite).
class RequestRings::Flow final : public StreamFlow<Flow>, public Ring {
  using Base = StreamFlow<Flow>;

 public:
  // `closing` runs as the ring closes, before its call is answered.
  Flow(Memory memory, std::vector<RegionRegistry::Use> use, const StreamMethod& method,
       StreamProcess process, RingCall* call, v1::RingClosed* response,
       absl::Duration stall_timeout, absl::AnyInvocable<void() &&> closing)
      : Base(method, std::move(process)),
        stall_timeout_(stall_timeout),
        closing_(std::move(closing)),
        memory_(memory),
        use_(std::move(use)),
        call_(call),
        response_(response) {}

  // Starts the flow; it holds itself until its call is answered.
  void Begin(const std::shared_ptr<Flow>& self) { Base::Begin(self); }

  // StreamFlow's operations, with its lock held, on the ring's thread or a worker's.
  void StartRead(grpc::ByteBuffer* request) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      read_into_ = request;
    }
    Wake();
  }
  void StartWrite(const grpc::ByteBuffer* response) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      write_from_ = response;
      write_since_ = absl::Now();
      PostLocked();  // the answering worker writes it, if a slot is free
    }
    Wake();
  }
  void Finish(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      finish_ = status;
    }
    Wake();
  }
  template <typename Work>
  void RunProcess(size_t /*bytes*/, Work work) {
    std::move(work)();
  }

  void CallCancelled() override {
    cancelled_.store(true);
    Wake();
  }

  void Serve() override;

 private:
  // Posts the pending response if a slot is free; records the write's outcome for the thread to
  // report (StreamFlow's completions never run inside its own calls). Needs ops_mu_.
  void PostLocked() {
    if (write_from_ == nullptr || written_.has_value()) return;
    absl::StatusOr<bool> posted = memory_.Post(*write_from_);
    if (posted.ok() && !*posted) return;  // no free slot yet
    write_from_ = nullptr;
    written_ = posted.ok();
    if (!posted.ok()) broken_ = posted.status();
  }
  // Tells the ring's thread something changed, in case it sleeps.
  void Wake() {
    pending_events_.store(true);
    ring::Notify(&memory_.header->server_waiting, &memory_.header->server_bell);
  }
  // Whether the pending response may be posted now: a slot is free (a client that stops reading
  // frees none; the thread then sleeps, woken by the client's bell when it takes one). Needs
  // ops_mu_.
  bool SlotFreeLocked() const {
    return memory_.responses_posted - memory_.header->responses_taken.load() <
           static_cast<uint64_t>(memory_.slots);
  }
  // The pending response will never be read (the call is cancelled or the ring broken): it is
  // dropped, reported to StreamFlow as a failed write, so the flow can end. Needs ops_mu_.
  void DropUnreadWriteLocked() {
    if (write_from_ == nullptr || (!cancelled_.load() && broken_.ok())) return;
    write_from_ = nullptr;
    written_ = false;
  }
  // Anything for the thread to do now? A pending response only once it can be posted or dropped.
  // Needs ops_mu_.
  bool ReadyLocked() const {
    return finish_.has_value() || written_.has_value() ||
           (write_from_ != nullptr && (SlotFreeLocked() || cancelled_.load() || !broken_.ok())) ||
           (read_into_ != nullptr &&
            (memory_.header->requests_posted.load() != memory_.requests_taken ||
             memory_.header->client_closed.load() != 0));
  }
  // The ring is found broken (`status`): it ends with it once its requests in flight are done.
  void Break(absl::Status status) {
    // A shrunk object reads as zeros (shrink_guard.h), which look like broken words: say why.
    for (const RegionRegistry::Use& use : use_) {
      if (absl::Status intact = use.Intact(); !intact.ok()) status = std::move(intact);
    }
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      if (broken_.ok()) broken_ = std::move(status);
    }
    Base::Cancelled();
  }
  // The last step: the client is told the ring is over and the call is answered.
  void Close(const grpc::Status& flow_status);

  // How long a response may wait for a free slot (--ring_stall_timeout_s) before the ring ends.
  const absl::Duration stall_timeout_;
  absl::AnyInvocable<void() &&> closing_;
  Memory memory_;  // its counters: ops_mu_ for responses_posted; requests_taken the thread's
  const std::vector<RegionRegistry::Use> use_;  // the ring's region, held while it is served
  RingCall* const call_;
  v1::RingClosed* const response_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> pending_events_{false};
  std::mutex ops_mu_;  // guards the six below
  grpc::ByteBuffer* read_into_ = nullptr;
  const grpc::ByteBuffer* write_from_ = nullptr;
  absl::Time write_since_;       // when write_from_ was handed over
  std::optional<bool> written_;  // a write done, not yet reported: whether it succeeded
  std::optional<grpc::Status> finish_;
  absl::Status broken_;  // why the ring ends, when it is the ring's fault
};

void RequestRings::Flow::Serve() {
  absl::Time last_event = absl::Now();
  absl::Time last_check = last_event;
  bool cancel_told = false;
  while (true) {
    bool progressed = false;
    grpc::ByteBuffer* read_into = nullptr;
    std::optional<bool> written;
    std::optional<grpc::Status> finish;
    bool stalled = false;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      PostLocked();
      DropUnreadWriteLocked();
      stalled = write_from_ != nullptr && absl::Now() - write_since_ >= stall_timeout_;
      written = std::exchange(written_, std::nullopt);
      finish = finish_;
      read_into = read_into_;
    }
    if (finish.has_value()) {
      if (read_into != nullptr) {  // the read left outstanding completes, not ok
        {
          std::lock_guard<std::mutex> lock(ops_mu_);
          read_into_ = nullptr;
        }
        Base::ReadDone(false);
      }
      return Close(*finish);
    }
    if (written.has_value()) {
      Base::WriteDone(*written);
      progressed = true;
    }
    if (stalled) {
      // The client took no answer for that long while one waited: it is not reading. The ring
      // ends (its region and its place among --max_rings freed) instead of waiting on it forever.
      Break(absl::DeadlineExceededError(absl::StrCat(
          "ring responses: the client took none of the ", memory_.slots,
          " answers in its response slots for ", absl::FormatDuration(stall_timeout_),
          " while another waited for a free slot (--ring_stall_timeout_s); the ring is closed")));
      progressed = true;
    }
    if (read_into != nullptr) {
      absl::StatusOr<bool> taken = memory_.Take(read_into);
      if (!taken.ok()) {
        Break(taken.status());
      } else if (*taken || memory_.header->client_closed.load() != 0) {
        {
          std::lock_guard<std::mutex> lock(ops_mu_);
          read_into_ = nullptr;
        }
        Base::ReadDone(*taken);  // false: the client closed the ring and every request is taken
        progressed = true;
      }
    }
    if (cancelled_.load() && !cancel_told) {
      cancel_told = true;
      Base::Cancelled();
    }
    const absl::Time now = absl::Now();
    if (now - last_check >= absl::Milliseconds(ring::kServerTickMs)) {
      last_check = now;
      for (const RegionRegistry::Use& use : use_) {
        if (absl::Status intact = use.Intact(); !intact.ok()) Break(std::move(intact));
      }
    }
    if (progressed || pending_events_.exchange(false)) {
      last_event = now;
      continue;
    }
    if (now - last_event < kIdleSpin) {
      ring::CpuRelax();
      continue;
    }
    // Asleep until the client or a worker rings, or the tick (see request_ring.h for the order).
    ring::RingHeader* header = memory_.header;
    header->server_waiting.store(1);
    const uint32_t seen = header->server_bell.load();
    bool ready;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      ready = ReadyLocked() || pending_events_.load();
    }
    if (!ready && !cancelled_.load())
      ring::WaitBell(&header->server_bell, seen, ring::kServerTickMs);
    header->server_waiting.store(0);
  }
}

void RequestRings::Flow::Close(const grpc::Status& flow_status) {
  absl::Status broken;
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    broken = broken_;
    response_->set_requests(static_cast<int64_t>(memory_.responses_posted));
  }
  memory_.header->server_closed.store(1);
  ring::RingBell(&memory_.header->client_bell);
  // A broken ring says why; otherwise StreamFlow's status (OK once the client closed the ring, a
  // failed request's status naming it, or CANCELLED).
  const grpc::Status status = broken.ok() ? flow_status : ToGrpcStatus(broken);
  call_->SetOnCancel(nullptr);  // drops the call's hold on this flow
  std::move(closing_)();
  call_->Finish(status);
  std::shared_ptr<Flow> self = std::static_pointer_cast<Flow>(Base::Release());
}

RequestRings::RequestRings(const StreamMethods* methods, RegionRegistry* registry,
                           const CallGate* gate, int max_rings, absl::Duration stall_timeout)
    : methods_(methods),
      registry_(registry),
      gate_(gate),
      max_rings_(max_rings),
      stall_timeout_(stall_timeout),
      metrics_(gate->metrics()) {}

RequestRings::~RequestRings() { Stop(); }

grpc::ServerUnaryReactor* RequestRings::Open(grpc::CallbackServerContext* context,
                                             const v1::OpenRingRequest& request,
                                             v1::RingClosed* response) {
  const absl::Time arrival = absl::Now();
  auto* call = new RingCall;
  // A refused ring is counted as a call (rpc="OpenRing"); a served one is not: its requests are
  // counted as the stream method's, as the streams' calls are not counted themselves.
  auto refuse = [&](const absl::Status& status) {
    gate_->Refuse("OpenRing", *context, arrival, status,
                  [call](absl::Status status) { call->Finish(ToGrpcStatus(status)); });
    return call;
  };
  if (absl::Status geometry = CheckGeometry(request); !geometry.ok()) return refuse(geometry);
  const bool attend = request.method() == v1::RING_METHOD_ATTEND;
  const StreamMethod* method = methods_->Find(attend ? kAttendStreamPath : kStepStreamPath);
  if (method == nullptr) {
    return refuse(absl::UnimplementedError(
        absl::StrCat("method: ", v1::RingMethod_Name(request.method()), " is not served here (no ",
                     attend ? "Attention" : "Sessions", " service)")));
  }
  std::vector<RegionRegistry::Use> use;
  absl::StatusOr<RegionSpan> span = registry_->Resolve(
      RegionOwner(*context, gate_->auth_token()), "ring", request.region(), request.offset(),
      ring::RingBytes(request.slots(), request.slot_bytes()), ring::kAlignment, &use);
  if (!span.ok()) return refuse(span.status());
  if (span->kind != RegionKind::kSystem) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("region: ", request.region(),
                     " is CUDA memory; a ring needs a system region (a POSIX shm object)")));
  }
  Memory memory{.base = span->data,
                .slots = request.slots(),
                .slot_bytes = request.slot_bytes(),
                .header = reinterpret_cast<ring::RingHeader*>(span->data)};

  std::lock_guard<std::mutex> lock(mu_);
  servers_.Reap();
  // Rings not yet closed: a ring whose call was answered no longer counts, though its thread may
  // still be on its way out.
  const int served = serving_.load();
  if (stopped_) return refuse(absl::UnavailableError("server is shutting down"));
  if (served >= max_rings_) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        "rings: ", served, " served already, at most ", max_rings_, " at once (--max_rings)")));
  }
  // The method's flow, started; the call holds it until it is answered, its thread until it ends.
  auto flow = std::make_shared<Flow>(
      memory, std::move(use), *method, method->open(CallbackCall(context)), call, response,
      stall_timeout_, [this] { metrics_->SetRequestRings(serving_.fetch_sub(1) - 1); });
  flow->Begin(flow);
  std::shared_ptr<Ring> ring = flow;
  call->SetOnCancel([ring] { ring->CallCancelled(); });
  memory.header->server_open.store(1);
  ring::RingBell(&memory.header->client_bell);
  metrics_->SetRequestRings(serving_.fetch_add(1) + 1);
  servers_.Start([ring]() mutable { ring->Serve(); });
  return call;
}

void RequestRings::Stop() {
  ServiceThreads servers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    servers = std::move(servers_);
  }
  servers.JoinAll();
}

}  // namespace attention::server
