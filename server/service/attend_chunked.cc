// Attention.AttendChunked: one request whose tensors come in chunks on one bidi call, so that a
// request may exceed protobuf's 2 GiB message ceiling and a client may keep several calls in
// flight on several connections.
//
// The client's first message carries the AttendRequest (shapes and options, tensors without
// data). It is checked as Attend checks a request (its size against --max_chunked_request_mb
// instead of the message limit), the token first, and the host block for q | k | v | o | lse is
// allocated before any chunk is read. Each chunk (tensor, byte offset, bytes) is copied once from
// the received slices into its place; chunks may come in any order, each byte exactly once (an
// overlap, or a byte outside its tensor, is INVALID_ARGUMENT). When every byte of q, k and v has
// come, the request takes the one path every computing RPC takes (Run: drain, queue, device,
// metrics). The answer: one AttendChunk with the response (o and lse without data, timing,
// device), then o and lse in chunks as large as the largest the client sent, each a slice over the
// host block (no copy), then OK. A client that ends its side early gets INVALID_ARGUMENT naming
// what is missing.
//
// Bounded: the blocks of all unfinished calls together stay under --chunked_memory_mb (a header
// past it is RESOURCE_EXHAUSTED, before its block is allocated); a call whose next message does
// not come within --chunked_idle_timeout_s ends DEADLINE_EXCEEDED; the received byte ranges of a
// tensor are kept merged, so a call's bookkeeping grows with the gaps between them, not the chunks.
#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/alarm.h"
#include "kernels/status_macros.h"
#include "server/service/attention_service.h"
#include "server/service/chunk_coverage.h"
#include "server/service/wire_buffers.h"

namespace attention::server {
namespace {

constexpr int64_t kMinResponseChunk = int64_t{64} << 10;
// Room a chunk message needs besides its data: tags, tensor, offset, lengths.
constexpr int64_t kChunkOverhead = 64;

}  // namespace

class AttentionService::ChunkedReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ChunkedReactor(AttentionService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), arrival_(absl::Now()) {
    std::lock_guard<std::mutex> lock(read_mu_);
    last_read_ = arrival_;
    ArmIdleTimer();
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(read_mu_);
    if (submitted_) return;  // the call timed out while this read waited
    last_read_ = absl::Now();
    if (!ok) {
      // The client ended its side (or the call broke) before the request was whole.
      return Submit(context_->IsCancelled() ? absl::CancelledError("the call was cancelled")
                                            : Missing());
    }
    absl::Status status = Take();
    in_.Clear();
    if (!status.ok()) return Submit(std::move(status));
    if (have_header_ && Whole()) return Submit(absl::OkStatus());
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    outgoing_.pop_front();
    if (!ok) outgoing_.clear();  // the call broke: nothing more can be written
    WriteNext();
  }

  void OnDone() override {
    // The thread that called Finish may still be leaving mu_.
    { std::lock_guard<std::mutex> lock(mu_); }
    // Here rather than at the last Unref: a cancelled timer's callback may come after the
    // server (and the service) are gone.
    service_->chunked_bytes_.fetch_sub(held_bytes_);
    Unref();
  }

 private:
  // Takes the message in in_: the header first, then chunks.
  absl::Status Take() {
    const ReceivedBytes received(in_);
    request_bytes_ += static_cast<int64_t>(in_.Length());
    WireAttendChunk message;
    RETURN_IF_ERROR(ParseAttendChunk(received.wire, &message));
    const v1::AttendChunk& header = message.header;
    if (!have_header_) {
      if (!header.has_request()) {
        return absl::InvalidArgumentError(
            absl::StrCat("first message: expected an AttendChunk with the request, got ",
                         header.has_chunk() ? "a chunk" : "none"));
      }
      // The token before anything is allocated for the caller.
      RETURN_IF_ERROR(service_->gate_->Authenticate(*context_));
      call_.request.header = header.request();
      for (const auto& [name, t] :
           {std::pair<const char*, const v1::Tensor*>{"q", &call_.request.header.q()},
            {"k", &call_.request.header.k()},
            {"v", &call_.request.header.v()}}) {
        if (!t->data().empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "request.", name, ".data: expected empty (the bytes come in chunks), got ",
              t->data().size(), " bytes"));
        }
        if (t->has_ref()) {
          return absl::InvalidArgumentError(
              absl::StrCat("request.", name, ".ref: expected none (AttendChunked carries the ",
                           "bytes in chunks; tensors by reference go through Attend), got one"));
        }
      }
      for (const auto& [name, present] : {std::pair{"o_ref", call_.request.header.has_o_ref()},
                                          {"lse_ref", call_.request.header.has_lse_ref()}}) {
        if (present) {
          return absl::InvalidArgumentError(absl::StrCat(
              "request.", name, ": expected none (AttendChunked answers in chunks; outputs ",
              "into a region go through Attend), got one"));
        }
      }
      ASSIGN_OR_RETURN(call_.decoded,
                       DecodeRequest(call_.request.header,
                                     InputTensors{.q_bytes = -1, .k_bytes = -1, .v_bytes = -1},
                                     service_->chunked_decode_options_));
      RETURN_IF_ERROR(Reserve());
      RETURN_IF_ERROR(service_->Place(&call_));
      have_header_ = true;
      return absl::OkStatus();
    }
    if (!header.has_chunk()) {
      return absl::InvalidArgumentError("message after the request: expected a chunk, got none");
    }
    const v1::TensorChunk& chunk = header.chunk();
    const DecodedRequest& d = call_.decoded;
    struct Target {
      const char* name;
      int64_t size;
      const void* data;
      ChunkCoverage* coverage;
    };
    Target target;
    switch (chunk.tensor()) {
      case v1::CHUNK_TENSOR_Q:
        target = {"q", d.q_bytes, d.params.q, &coverage_[0]};
        break;
      case v1::CHUNK_TENSOR_K:
        target = {"k", d.k_bytes, d.params.k, &coverage_[1]};
        break;
      case v1::CHUNK_TENSOR_V:
        target = {"v", d.v_bytes, d.params.v, &coverage_[2]};
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "chunk.tensor: expected CHUNK_TENSOR_Q, CHUNK_TENSOR_K or CHUNK_TENSOR_V, got ",
            v1::ChunkTensor_Name(chunk.tensor()).empty()
                ? absl::StrCat(static_cast<int>(chunk.tensor()))
                : v1::ChunkTensor_Name(chunk.tensor())));
    }
    const int64_t size = message.data.size;
    if (size == 0 || chunk.offset() < 0 || chunk.offset() > target.size - size) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk of ", target.name, ": expected bytes within [0, ", target.size,
                       "), got [", chunk.offset(), ", ", chunk.offset() + size, ")"));
    }
    RETURN_IF_ERROR(target.coverage->Add(target.name, chunk.offset(), size));
    // The one host copy of these bytes.
    received.wire.CopyTo(message.data.begin, size,
                         static_cast<char*>(const_cast<void*>(target.data)) + chunk.offset());
    largest_chunk_ = std::max(largest_chunk_, size);
    return absl::OkStatus();
  }

  // Counts this call's block against --chunked_memory_mb, or refuses it.
  absl::Status Reserve() {
    const DecodedRequest& d = call_.decoded;
    const int64_t bytes = d.q_bytes + d.k_bytes + d.v_bytes + d.o_bytes + d.lse_bytes;
    const int64_t budget = service_->options_.chunked_memory_bytes;
    const int64_t before = service_->chunked_bytes_.fetch_add(bytes);
    if (before + bytes > budget) {
      service_->chunked_bytes_.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat(
          "--chunked_memory_mb: this request needs ", bytes, " bytes, unfinished AttendChunked ",
          "calls hold ", before, " of the ", budget, " bytes allowed; retry later"));
    }
    held_bytes_ = bytes;
    return absl::OkStatus();
  }

  // Sets the idle timer for last_read_ + the timeout; it holds a reference until it fires or is
  // cancelled. Needs read_mu_.
  void ArmIdleTimer() {
    refs_.fetch_add(1);
    spent_alarm_ = std::move(alarm_);  // fired already (or none): its callback is returning
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(absl::ToChronoTime(last_read_ + service_->options_.chunked_idle_timeout),
                [this](bool fired) {
                  {
                    std::lock_guard<std::mutex> lock(read_mu_);
                    if (fired && !submitted_) OnIdleCheck();
                  }
                  Unref();
                });
  }

  // The timer fired: ends the call when no message came for the timeout, else waits on. Needs
  // read_mu_.
  void OnIdleCheck() {
    const absl::Duration timeout = service_->options_.chunked_idle_timeout;
    if (absl::Now() - last_read_ < timeout) return ArmIdleTimer();
    Submit(absl::DeadlineExceededError(absl::StrCat(
        "--chunked_idle_timeout_s: no message came on this AttendChunked call for ",
        absl::FormatDuration(timeout), " (",
        have_header_ ? absl::StrCat(Received(), " so far") : "the request never came", ")")));
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  std::string Received() const {
    const DecodedRequest& d = call_.decoded;
    return absl::StrCat("q ", coverage_[0].received(), " of ", d.q_bytes, ", k ",
                        coverage_[1].received(), " of ", d.k_bytes, ", v ", coverage_[2].received(),
                        " of ", d.v_bytes, " bytes");
  }

  bool Whole() const {
    const DecodedRequest& d = call_.decoded;
    return coverage_[0].received() == d.q_bytes && coverage_[1].received() == d.k_bytes &&
           coverage_[2].received() == d.v_bytes;
  }

  absl::Status Missing() const {
    if (!have_header_) {
      return absl::InvalidArgumentError("the call ended before its first message (the request)");
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the call ended before every byte came: ", Received()));
  }

  // Hands the request, or the reason it cannot run, to the one request path; no more reads.
  // Needs read_mu_.
  void Submit(absl::Status received) {
    submitted_ = true;
    alarm_->Cancel();
    call_.response.set_request_id(call_.request.header.request_id());
    service_->Run(
        "AttendChunked", CallbackCall(context_), arrival_, request_bytes_,
        [received = std::move(received)]() mutable { return std::move(received); },
        [this] { return Respond(); }, &call_,
        [this](absl::Status status) {
          std::lock_guard<std::mutex> lock(mu_);
          status_ = ToGrpcStatus(status);
          if (!status.ok()) outgoing_.clear();
          done_ = true;
          WriteNext();
        });
  }

  // Queues the response: its header, then o and lse in chunks. Returns the bytes queued.
  int64_t Respond() {
    std::lock_guard<std::mutex> lock(mu_);
    const DecodedRequest& d = call_.decoded;
    v1::AttendChunk head;
    *head.mutable_response() = call_.response;
    *head.mutable_response()->mutable_o() = d.o;
    if (d.lse_bytes > 0) *head.mutable_response()->mutable_lse() = d.lse;
    int64_t bytes = 0;
    outgoing_.emplace_back();
    SerializeToByteBuffer(head, &outgoing_.back());
    bytes += static_cast<int64_t>(outgoing_.back().Length());
    const int64_t chunk_bytes =
        std::max(kMinResponseChunk,
                 std::min(largest_chunk_, service_->options_.max_message_bytes - kChunkOverhead));
    for (const auto& [tensor, offset, size] :
         {std::tuple{v1::CHUNK_TENSOR_O, call_.o_offset, d.o_bytes},
          {v1::CHUNK_TENSOR_LSE, call_.lse_offset, d.lse_bytes}}) {
      for (int64_t at = 0; at < size; at += chunk_bytes) {
        const int64_t n = std::min(chunk_bytes, size - at);
        v1::TensorChunk fields;
        fields.set_tensor(tensor);
        fields.set_offset(at);
        std::string prefix;
        AppendSubmessagePrefix(v1::AttendChunk::kChunkFieldNumber, fields,
                               v1::TensorChunk::kDataFieldNumber, n, &prefix);
        grpc::Slice slices[2] = {
            grpc::Slice(prefix),
            SliceOver(call_.memory.get() + offset + at, static_cast<size_t>(n), call_.memory)};
        outgoing_.emplace_back(slices, 2);
        bytes += static_cast<int64_t>(outgoing_.back().Length());
      }
    }
    return bytes;
  }

  // Writes the next queued message, or finishes once the answer is known and all are written.
  // Needs mu_.
  void WriteNext() {
    if (finished_ || writing_ || !done_) return;
    if (!outgoing_.empty()) {
      writing_ = true;
      StartWrite(&outgoing_.front());
      return;
    }
    finished_ = true;
    Finish(status_);
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;
  const absl::Time arrival_;
  // The reactor's own reference (until OnDone) and the pending idle timer's.
  std::atomic<int> refs_{1};
  int64_t held_bytes_ = 0;  // counted in service_->chunked_bytes_

  std::mutex read_mu_;  // guards the reads' side against the idle timer, until Submit
  bool submitted_ = false;
  absl::Time last_read_;
  std::unique_ptr<grpc::Alarm> alarm_, spent_alarm_;
  grpc::ByteBuffer in_;
  Call call_;
  bool have_header_ = false;
  ChunkCoverage coverage_[3];  // q, k, v
  int64_t request_bytes_ = 0;
  int64_t largest_chunk_ = 0;

  std::mutex mu_;                          // guards the rest
  std::deque<grpc::ByteBuffer> outgoing_;  // the answer's messages; the front is being written
  bool writing_ = false;
  bool done_ = false;  // the answer is known (status_, outgoing_)
  bool finished_ = false;
  grpc::Status status_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::AttendChunked(
    grpc::CallbackServerContext* context) {
  return new ChunkedReactor(this, context);
}

}  // namespace attention::server
