#include "server/service/attention_service.h"

#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/quote.h"
#include "kernels/status_macros.h"
#include "server/service/security.h"
#include "server/service/wire_buffers.h"

namespace attention::server {

using v1::AttendRequest;
using v1::AttendResponse;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl's canonical codes share gRPC's numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

AttentionService::AttentionService(const ServiceOptions& options, Scheduler* scheduler,
                                   Metrics* metrics, DrainGate* drain, HostMemory* memory)
    : options_(options),
      decode_options_{.max_message_bytes = options.max_message_bytes,
                      .max_head_dim = options.max_head_dim,
                      .max_request_flops = options.max_request_flops},
      chunked_decode_options_{.max_message_bytes = options.max_chunked_request_bytes,
                              .max_head_dim = options.max_head_dim,
                              .max_request_flops = options.max_request_flops},
      scheduler_(scheduler),
      metrics_(metrics),
      drain_(drain),
      own_memory_(memory == nullptr ? MakePageableHostMemory() : nullptr),
      memory_(memory == nullptr ? own_memory_.get() : memory) {}

absl::Status AttentionService::Prepare(const grpc::ByteBuffer& request, Call* call) {
  const ReceivedBytes received(request);
  RETURN_IF_ERROR(ParseAttendRequest(received.wire, &call->request));
  const WireAttendRequest& r = call->request;
  // Sizes first: nothing is allocated for a request the checks refuse.
  ASSIGN_OR_RETURN(
      call->decoded,
      DecodeRequest(r.header,
                    InputTensors{.q_bytes = r.q.size, .k_bytes = r.k.size, .v_bytes = r.v.size},
                    decode_options_));
  RETURN_IF_ERROR(Place(call));
  // The one host copy of the tensors.
  const AttentionParams& p = call->decoded.params;
  received.wire.CopyTo(r.q.begin, r.q.size, static_cast<char*>(const_cast<void*>(p.q)));
  received.wire.CopyTo(r.k.begin, r.k.size, static_cast<char*>(const_cast<void*>(p.k)));
  received.wire.CopyTo(r.v.begin, r.v.size, static_cast<char*>(const_cast<void*>(p.v)));
  return absl::OkStatus();
}

absl::Status AttentionService::Place(Call* call) {
  constexpr int64_t kAlignment = 256;
  auto aligned = [](int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; };
  DecodedRequest& d = call->decoded;
  // One block: q | k | v | o | lse.
  const int64_t k_offset = aligned(d.q_bytes);
  const int64_t v_offset = k_offset + aligned(d.k_bytes);
  call->o_offset = v_offset + aligned(d.v_bytes);
  call->lse_offset = call->o_offset + aligned(d.o_bytes);
  ASSIGN_OR_RETURN(call->memory, memory_->Allocate(call->lse_offset + aligned(d.lse_bytes)));
  char* base = call->memory.get();
  d.params.q = base;
  d.params.k = base + k_offset;
  d.params.v = base + v_offset;
  d.params.o = base + call->o_offset;
  if (d.lse_bytes > 0) d.params.lse = reinterpret_cast<float*>(base + call->lse_offset);
  return absl::OkStatus();
}

void AttentionService::WriteResponse(const Call& call, grpc::ByteBuffer* response) {
  const DecodedRequest& d = call.decoded;
  std::string head = call.response.SerializeAsString();
  AppendSubmessagePrefix(AttendResponse::kOFieldNumber, d.o, v1::Tensor::kDataFieldNumber,
                         d.o_bytes, &head);
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  slices.push_back(SliceOver(call.memory.get() + call.o_offset, d.o_bytes, call.memory));
  if (d.lse_bytes > 0) {
    std::string lse_head;
    AppendSubmessagePrefix(AttendResponse::kLseFieldNumber, d.lse, v1::Tensor::kDataFieldNumber,
                           d.lse_bytes, &lse_head);
    slices.emplace_back(lse_head);
    slices.push_back(SliceOver(call.memory.get() + call.lse_offset, d.lse_bytes, call.memory));
  }
  *response = grpc::ByteBuffer(slices.data(), slices.size());
}

void AttentionService::Process(absl::string_view rpc, grpc::CallbackServerContext* context,
                               grpc::ByteBuffer* request, grpc::ByteBuffer* response, Call* call,
                               absl::AnyInvocable<void(absl::Status) &&> done) {
  Run(
      rpc, context, absl::Now(), static_cast<int64_t>(request->Length()),
      [this, request, call] {
        absl::Status prepared = Prepare(*request, call);
        // The tensors are in call->memory now (or refused): give the received slices back, so
        // a request does not hold twice its size while it waits and computes.
        request->Clear();
        return prepared;
      },
      [call, response] {
        WriteResponse(*call, response);
        return static_cast<int64_t>(response->Length());
      },
      call, std::move(done));
}

void AttentionService::Run(absl::string_view rpc, grpc::CallbackServerContext* context,
                           absl::Time arrival, int64_t request_bytes,
                           absl::AnyInvocable<absl::Status() &&> prepare,
                           absl::AnyInvocable<int64_t() &&> respond, Call* call,
                           absl::AnyInvocable<void(absl::Status) &&> done) {
  metrics_->RequestStarted();
  auto finish = [this, rpc, arrival, request_bytes, call, respond = std::move(respond),
                 done = std::move(done)](absl::Status status) mutable {
    const absl::Duration elapsed = absl::Now() - arrival;
    int64_t response_bytes = 0;
    if (status.ok()) {
      call->response.mutable_timing()->set_total_us(absl::ToDoubleMicroseconds(elapsed));
      response_bytes = std::move(respond)();
    }
    metrics_->RequestFinished(rpc, status.code(), elapsed, request_bytes, response_bytes);
    std::move(done)(std::move(status));
  };

  if (absl::Status auth = CheckBearerToken(context->client_metadata(), options_.auth_token);
      !auth.ok()) {
    return finish(std::move(auth));
  }
  if (!drain_->Enter()) {
    return drain_->Refuse([finish = std::move(finish)]() mutable {
      std::move(finish)(absl::UnavailableError("server is shutting down"));
    });
  }
  // From here on the answer also leaves the drain gate.
  auto answer = [this, finish = std::move(finish)](absl::Status status) mutable {
    std::move(finish)(std::move(status));
    drain_->Leave();
  };
  if (absl::Status prepared = std::move(prepare)(); !prepared.ok()) {
    return answer(std::move(prepared));
  }
  call->response.set_request_id(call->request.header.request_id());

  Job job;
  job.work = call->decoded.params;
  job.deadline = absl::FromChrono(context->deadline());
  job.cancelled = [context] { return context->IsCancelled(); };
  job.done = [this, call, flops = call->decoded.flops, tokens = call->decoded.query_tokens,
              answer = std::move(answer)](JobResult result) mutable {
    if (result.status.ok()) {
      v1::ServerTiming* timing = call->response.mutable_timing();
      timing->set_queue_us(absl::ToDoubleMicroseconds(result.queued));
      timing->set_h2d_us(result.stages.h2d_us);
      timing->set_compute_us(result.stages.compute_us);
      timing->set_d2h_us(result.stages.d2h_us);
      call->response.set_device(result.device->name);
      metrics_->StagesObserved(result.queued, result.stages);
      metrics_->Computed(result.device->name, flops, tokens,
                         result.leads_batch ? result.batch_size : 0);
    }
    std::move(answer)(std::move(result.status));
  };
  scheduler_->Submit(std::move(job));
}

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto call = std::make_shared<Call>();
  Call* c = call.get();
  // The handler's own buffer of the received message, read by nothing after Process copies it:
  // Process clears it to give its slices back early.
  Process("Attend", context, const_cast<grpc::ByteBuffer*>(request), response, c,
          [reactor, call = std::move(call)](absl::Status status) {
            reactor->Finish(ToGrpcStatus(status));
          });
  return reactor;
}

// One AttendStream call. Every gRPC operation (StartRead, StartWrite, Finish) is started with mu_
// held, so the state below and the operations in flight always agree; gRPC runs the reactions
// (OnReadDone, ...) on its own threads, never inside those calls. The reactor owns itself through
// self_ until OnDone, and each request in flight holds a reference too, so a worker finishing the
// last request can never touch a deleted reactor.
class AttentionService::StreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(AttentionService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {}

  // Takes ownership of itself and starts the first read.
  void Start(std::shared_ptr<StreamReactor> self) {
    std::lock_guard<std::mutex> lock(mu_);
    self_ = std::move(self);
    Advance();
  }

  void OnReadDone(bool ok) override {
    std::unique_ptr<Exchange> exchange;
    std::shared_ptr<StreamReactor> self;
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
    }
    Exchange* e = exchange.get();
    service_->Process(
        "AttendStream", context_, &e->request, &e->response, &e->call,
        [self = std::move(self), exchange = std::move(exchange)](absl::Status status) mutable {
          self->Processed(std::move(exchange), std::move(status));
        });
    std::lock_guard<std::mutex> lock(mu_);
    Advance();  // the next read, if the window has room
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_.reset();
    if (!ok) cancelled_ = true;  // the stream broke: nothing more can be written
    Advance();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    Advance();
  }

  void OnDone() override {
    std::shared_ptr<StreamReactor> self;
    std::lock_guard<std::mutex> lock(mu_);
    self = std::move(self_);  // released after the lock: the last reference deletes this
  }

 private:
  struct Exchange {
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    Call call;
  };

  void Processed(std::unique_ptr<Exchange> exchange, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    if (status.ok()) {
      ready_.push_back(std::move(exchange));
    } else if (status_.ok()) {
      status_ = absl::Status(
          status.code(), absl::StrCat("request ", Quote(exchange->call.request.header.request_id()),
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
      StartWrite(&writing_->response);
    }
    const int held = in_flight_ + static_cast<int>(ready_.size()) + (writing_ != nullptr);
    if (!Ending() && reading_ == nullptr && held < service_->options_.stream_window) {
      reading_ = std::make_unique<Exchange>();
      StartRead(&reading_->request);
    }
    if (Ending() && in_flight_ == 0 && writing_ == nullptr && ready_.empty()) {
      finished_ = true;
      // A read may still be outstanding; it completes (not ok) before OnDone.
      Finish(cancelled_ ? grpc::Status::CANCELLED : ToGrpcStatus(status_));
    }
  }

  AttentionService* const service_;
  grpc::CallbackServerContext* const context_;
  std::mutex mu_;  // guards all below; a pthread lock, which ThreadSanitizer sees
  std::shared_ptr<StreamReactor> self_;
  std::unique_ptr<Exchange> reading_;            // the read outstanding, if any
  std::unique_ptr<Exchange> writing_;            // the write outstanding, if any
  std::deque<std::unique_ptr<Exchange>> ready_;  // answered, to be written
  int in_flight_ = 0;                            // in Process, not yet answered
  bool reads_done_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
  absl::Status status_;  // the first failure; ends the stream
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::AttendStream(
    grpc::CallbackServerContext* context) {
  auto reactor = std::make_shared<StreamReactor>(this, context);
  reactor->Start(reactor);
  return reactor.get();
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* raw_request,
                                                          grpc::ByteBuffer* raw_response) {
  const absl::Time arrival = absl::Now();
  metrics_->RequestStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const int64_t request_bytes = static_cast<int64_t>(raw_request->Length());
  absl::Status status = CheckBearerToken(context->client_metadata(), options_.auth_token);
  v1::GetServerInfoRequest request;
  if (status.ok()) status = ParseByteBuffer(*raw_request, &request);
  if (!status.ok()) {
    metrics_->RequestFinished("GetServerInfo", status.code(), absl::Now() - arrival, request_bytes,
                              0);
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }
  v1::ServerInfo info;
  v1::ServerInfo* response = &info;
  response->set_version(options_.version);
  response->set_backend(options_.backend);
  for (const DeviceDescription* device : scheduler_->devices()) {
    v1::DeviceInfo* info = response->add_devices();
    info->set_name(device->name);
    info->set_description(device->description);
    info->set_memory_bytes(device->memory_bytes);
    info->set_multiprocessors(device->multiprocessors);
    info->set_compute_capability(device->compute_capability);
  }
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    response->add_dtypes(dtype);
  }
  // The fast ones, as the devices' kernels specialise them; all of 1..max_head_dim work.
  std::set<int> fast_head_dims;
  for (const DeviceDescription* device : scheduler_->devices()) {
    fast_head_dims.insert(device->fast_head_dims.begin(), device->fast_head_dims.end());
  }
  for (int d : fast_head_dims) response->add_head_dims(d);
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_message_bytes(options_.max_message_bytes);
  limits->set_max_queue(options_.max_queue);
  limits->set_max_batch(options_.max_batch);
  limits->set_max_head_dim(options_.max_head_dim);
  limits->set_max_request_flops(options_.max_request_flops);
  limits->set_max_chunked_request_bytes(options_.max_chunked_request_bytes);
  SerializeToByteBuffer(info, raw_response);
  metrics_->RequestFinished("GetServerInfo", absl::StatusCode::kOk, absl::Now() - arrival,
                            request_bytes, static_cast<int64_t>(raw_response->Length()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attention::server
