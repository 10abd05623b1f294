#include "client/request_ring.h"

#include <unistd.h>

#include <bit>
#include <cstring>
#include <new>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace attention::client {
namespace {

using Clock = std::chrono::steady_clock;

// A slot's length word is little-endian; this side writes and reads it as a native uint64.
static_assert(std::endian::native == std::endian::little);

// How long a wait spins without progress before it sleeps on the client bell: long enough to
// cover a decode Step's compute, so a response in a steady loop is seen without a wake-up.
constexpr Clock::duration kSpin = std::chrono::milliseconds(20);
// The longest sleep on the bell before the ring is checked again, should a wake-up be missed.
constexpr int kSleepMs = 10;
// How long the destructor lets the server answer what was posted before it cancels the call.
constexpr Clock::duration kCloseTimeout = std::chrono::seconds(5);

absl::Status CheckOptions(v1::RingMethod method, const RingOptions& options) {
  if (method != v1::RING_METHOD_ATTEND && method != v1::RING_METHOD_STEP) {
    return absl::InvalidArgumentError(
        absl::StrCat("method: expected RING_METHOD_ATTEND or RING_METHOD_STEP, got ",
                     v1::RingMethod_Name(method), " (", static_cast<int>(method), ")"));
  }
  if (options.slots < 1 || options.slots > ring::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("RingOptions::slots: expected 1 to ",
                                                   ring::kMaxSlots, ", got ", options.slots));
  }
  if (options.slot_bytes < ring::kMinSlotBytes || options.slot_bytes > ring::kMaxSlotBytes ||
      options.slot_bytes % ring::kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RingOptions::slot_bytes: expected a multiple of ", ring::kAlignment, " from ",
        ring::kMinSlotBytes, " to ", ring::kMaxSlotBytes, ", got ", options.slot_bytes));
  }
  if (options.region.empty()) {
    return absl::InvalidArgumentError(
        "RingOptions::region: expected a region name, got an empty string");
  }
  return absl::OkStatus();
}

// "/attn-ring-<pid>-<n>-<random>": distinct for each ring of this process, and the random part
// keeps it off a stale object an earlier process of the same pid left (Create refuses a name that
// exists).
std::string UniqueKey() {
  static std::atomic<uint64_t> next{0};
  return absl::StrCat("/attn-ring-", getpid(), "-", next.fetch_add(1), "-",
                      absl::Hex(std::random_device{}()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RequestRing>> RequestRing::Open(const Client& client,
                                                               v1::RingMethod method,
                                                               const RingOptions& options) {
  if (absl::Status s = CheckOptions(method, options); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(UniqueKey(), ring::RingBytes(options.slots, options.slot_bytes));
  if (!object.ok()) return object.status();
  auto regions = std::make_unique<SharedMemoryClient>(client);
  if (absl::StatusOr<v1::RegionInfo> info = regions->Register(options.region, **object);
      !info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("registering the request ring's region \"", options.region,
                                     "\": ", info.status().message()));
  }
  auto ring = std::unique_ptr<RequestRing>(
      new RequestRing(client, *std::move(object), std::move(regions), method, options));
  // Served (the server sets server_open and rings) or refused (the call ends): a refusal, such as
  // too many rings, is this call's error rather than the first Write's.
  if (!ring->AwaitOpen()) {
    grpc::Status refused = ring->Finish();
    return absl::Status(static_cast<absl::StatusCode>(refused.error_code()),
                        absl::StrCat("OpenRing: ", refused.error_message()));
  }
  return ring;
}

RequestRing::RequestRing(const Client& client, std::unique_ptr<SharedMemoryObject> object,
                         std::unique_ptr<SharedMemoryClient> regions, v1::RingMethod method,
                         const RingOptions& options)
    : object_(std::move(object)),
      // A fresh object reads zero; constructing the header there makes its words atomics of this
      // process.
      header_(new (object_->data()) ring::RingHeader()),
      regions_(std::move(regions)),
      options_(options),
      stub_(v1::SharedMemory::NewStub(client.channel())),
      // No deadline: the call lasts as long as the ring.
      context_(client.NewContext({.deadline = absl::InfiniteDuration()})) {
  request_.set_region(options_.region);
  request_.set_offset(0);
  request_.set_method(method);
  request_.set_slots(options_.slots);
  request_.set_slot_bytes(options_.slot_bytes);
  stub_->async()->OpenRing(context_.get(), &request_, &response_, [this](grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    call_status_ = std::move(status);
    call_done_.store(true);
    ring::RingBell(&header_->client_bell);  // a Read asleep on the bell sees the end
  });
}

RequestRing::~RequestRing() {
  WritesDone();
  if (!AwaitEnd(Clock::now() + kCloseTimeout)) {
    context_->TryCancel();
    AwaitEnd(Clock::time_point::max());
  }
  regions_->Unregister(options_.region).IgnoreError();
}

bool RequestRing::Write(const google::protobuf::MessageLite& request) {
  if (!error_.ok() || writes_done_ || Over()) return false;
  const size_t size = request.ByteSizeLong();
  const int64_t capacity = options_.slot_bytes - ring::kLengthBytes;
  if (size > static_cast<size_t>(capacity)) {
    Break(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("request ", posted_, " (", request.GetTypeName(), "): expected at most ",
                     capacity, " serialized bytes (RingOptions::slot_bytes ", options_.slot_bytes,
                     " less the slot's length word), got ", size)));
    return false;
  }
  const uint64_t slots = static_cast<uint64_t>(options_.slots);
  if (!Wait([&] { return posted_ - header_->requests_taken.load() < slots; })) return false;
  char* slot = ring::RequestSlot(object_->data(), options_.slots, options_.slot_bytes, posted_);
  const uint64_t length = size;
  std::memcpy(slot, &length, sizeof(length));
  request.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(slot + ring::kLengthBytes));
  header_->requests_posted.store(++posted_);
  ring::Notify(&header_->server_waiting, &header_->server_bell);
  return true;
}

bool RequestRing::Read(google::protobuf::MessageLite* response) {
  if (!error_.ok()) return false;
  if (!Wait([&] { return header_->responses_posted.load() > taken_; })) return false;
  const char* slot =
      ring::ResponseSlot(object_->data(), options_.slots, options_.slot_bytes, taken_);
  uint64_t length = 0;
  std::memcpy(&length, slot, sizeof(length));
  const uint64_t capacity = static_cast<uint64_t>(options_.slot_bytes - ring::kLengthBytes);
  if (length > capacity) {
    Break(grpc::Status(grpc::StatusCode::DATA_LOSS,
                       absl::StrCat("response ", taken_, " (slot ", taken_ % options_.slots,
                                    "): length: expected at most ", capacity, ", got ", length)));
    return false;
  }
  const bool parsed = response->ParseFromArray(slot + ring::kLengthBytes, static_cast<int>(length));
  header_->responses_taken.store(++taken_);
  ring::Notify(&header_->server_waiting, &header_->server_bell);
  if (!parsed) {
    Break(grpc::Status(
        grpc::StatusCode::DATA_LOSS,
        absl::StrCat("response ", taken_ - 1, ": expected a serialized ", response->GetTypeName(),
                     ", got ", length, " bytes that do not parse as one")));
    return false;
  }
  return true;
}

void RequestRing::WritesDone() {
  if (writes_done_) return;
  writes_done_ = true;
  header_->client_closed.store(1);
  // Unconditionally: a server asleep between its checks of server_waiting still wakes.
  ring::RingBell(&header_->server_bell);
}

grpc::Status RequestRing::Finish() {
  WritesDone();
  AwaitEnd(Clock::time_point::max());
  if (!error_.ok()) return error_;
  std::lock_guard<std::mutex> lock(mu_);
  return call_status_;
}

template <class Ready>
bool RequestRing::Wait(Ready ready) {
  const Clock::time_point spin_until = Clock::now() + kSpin;
  while (true) {
    if (ready()) return true;
    // The server may post its last responses and then end: look again once it has.
    if (Over()) return ready();
    if (Clock::now() < spin_until) {
      ring::CpuRelax();
      continue;
    }
    // Asleep only while the server, seeing client_waiting, would ring the bell for any change.
    header_->client_waiting.store(1);
    const uint32_t seen = header_->client_bell.load();
    if (!ready() && !Over()) ring::WaitBell(&header_->client_bell, seen, kSleepMs);
    header_->client_waiting.store(0);
  }
}

bool RequestRing::AwaitOpen() {
  while (header_->server_open.load() == 0) {
    if (call_done_.load()) return false;
    header_->client_waiting.store(1);
    const uint32_t seen = header_->client_bell.load();
    if (header_->server_open.load() == 0 && !call_done_.load()) {
      ring::WaitBell(&header_->client_bell, seen, kSleepMs);
    }
    header_->client_waiting.store(0);
  }
  return true;
}

bool RequestRing::Over() const { return header_->server_closed.load() != 0 || call_done_.load(); }

void RequestRing::Break(grpc::Status error) {
  error_ = std::move(error);
  WritesDone();
}

void RequestRing::DiscardResponses() {
  const uint64_t posted = header_->responses_posted.load();
  if (posted <= taken_) return;
  taken_ = posted;
  header_->responses_taken.store(taken_);
  ring::Notify(&header_->server_waiting, &header_->server_bell);
}

bool RequestRing::AwaitEnd(Clock::time_point until) {
  while (!call_done_.load()) {
    if (Clock::now() >= until) return false;
    header_->client_waiting.store(1);
    const uint32_t seen = header_->client_bell.load();
    DiscardResponses();
    if (!call_done_.load()) ring::WaitBell(&header_->client_bell, seen, kSleepMs);
    header_->client_waiting.store(0);
  }
  // The callback set call_done_ holding mu_: once this side holds it, the callback has left.
  std::lock_guard<std::mutex> lock(mu_);
  return true;
}

}  // namespace attention::client
