#include "server/service/attention_service.h"

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
#include "server/service/shared_memory_service.h"
#include "server/service/wire_buffers.h"

namespace attention::server {

using v1::AttendRequest;
using v1::AttendResponse;

AttentionService::AttentionService(const ServiceOptions& options, Scheduler* scheduler,
                                   const CallGate* gate, HostMemory* memory,
                                   RegionRegistry* regions, SessionStore* sessions)
    : options_(options),
      decode_options_{.max_message_bytes = options.max_message_bytes,
                      .max_head_dim = options.max_head_dim,
                      .max_request_flops = options.max_request_flops},
      chunked_decode_options_{.max_message_bytes = options.max_chunked_request_bytes,
                              .max_head_dim = options.max_head_dim,
                              .max_request_flops = options.max_request_flops},
      scheduler_(scheduler),
      gate_(gate),
      metrics_(gate->metrics()),
      own_memory_(memory == nullptr ? MakePageableHostMemory() : nullptr),
      memory_(memory == nullptr ? own_memory_.get() : memory),
      regions_(regions),
      sessions_(sessions) {}

absl::Status AttentionService::Prepare(const grpc::ServerContextBase* context,
                                       const grpc::ByteBuffer& request, Call* call) {
  const absl::Time start = absl::Now();
  const ReceivedBytes received(request);
  RETURN_IF_ERROR(ParseAttendRequest(received.wire, &call->request));
  call->response.mutable_timing()->set_parse_us(absl::ToDoubleMicroseconds(absl::Now() - start));
  const WireAttendRequest& r = call->request;
  // The regions the request references stay held until it is answered.
  call->refs = std::make_unique<RequestRegions>(regions_, context, &gate_->auth_token(),
                                                /*cuda_inputs=*/true);
  // Sizes first: nothing is allocated for a request the checks refuse.
  ASSIGN_OR_RETURN(
      call->decoded,
      DecodeRequest(r.header,
                    InputTensors{.q_bytes = r.q.size, .k_bytes = r.k.size, .v_bytes = r.v.size},
                    decode_options_, call->refs.get()));
  RETURN_IF_ERROR(Place(call));
  // The one host copy of the tensors that came on the wire (those by reference stay in their
  // region: the decoder checked they carry no bytes).
  const AttentionParams& p = call->decoded.params;
  const v1::AttendRequest& h = r.header;
  if (!h.q().has_ref()) {
    received.wire.CopyTo(r.q.begin, r.q.size, static_cast<char*>(const_cast<void*>(p.q)));
  }
  if (!h.k().has_ref()) {
    received.wire.CopyTo(r.k.begin, r.k.size, static_cast<char*>(const_cast<void*>(p.k)));
  }
  if (!h.v().has_ref()) {
    received.wire.CopyTo(r.v.begin, r.v.size, static_cast<char*>(const_cast<void*>(p.v)));
  }
  return absl::OkStatus();
}

absl::Status AttentionService::Place(Call* call) {
  constexpr int64_t kAlignment = 256;
  auto aligned = [](int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; };
  DecodedRequest& d = call->decoded;
  // One block: q | k | v | o | lse, each of size 0 when in a region (its params point there).
  const int64_t k_offset = aligned(d.q_bytes);
  const int64_t v_offset = k_offset + aligned(d.k_bytes);
  call->o_offset = v_offset + aligned(d.v_bytes);
  call->lse_offset = call->o_offset + aligned(d.o_bytes);
  const int64_t block_bytes = call->lse_offset + aligned(d.lse_bytes);
  if (block_bytes == 0) return absl::OkStatus();  // everything in regions
  ASSIGN_OR_RETURN(call->memory, memory_->Allocate(block_bytes));
  char* base = call->memory.get();
  if (d.params.q == nullptr) d.params.q = base;
  if (d.params.k == nullptr) d.params.k = base + k_offset;
  if (d.params.v == nullptr) d.params.v = base + v_offset;
  if (d.params.o == nullptr) d.params.o = base + call->o_offset;
  if (d.lse_bytes > 0) d.params.lse = reinterpret_cast<float*>(base + call->lse_offset);
  return absl::OkStatus();
}

void AttentionService::WriteResponse(const Call& call, grpc::ByteBuffer* response) {
  const DecodedRequest& d = call.decoded;
  const v1::AttendRequest& h = call.request.header;
  std::string head;
  if (h.has_o_ref() || h.has_lse_ref()) {
    // o and lse written into a region (o_ref, lse_ref) go with their dtype and shape, no data.
    v1::AttendResponse fields = call.response;
    if (h.has_o_ref()) *fields.mutable_o() = d.o;
    if (h.has_lse_ref()) *fields.mutable_lse() = d.lse;
    head = fields.SerializeAsString();
  } else {
    head = call.response.SerializeAsString();
  }
  if (!h.has_o_ref()) {
    AppendSubmessagePrefix(AttendResponse::kOFieldNumber, d.o, v1::Tensor::kDataFieldNumber,
                           d.o_bytes, &head);
  }
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head);
  if (!h.has_o_ref()) {
    slices.push_back(SliceOver(call.memory.get() + call.o_offset, d.o_bytes, call.memory));
  }
  if (d.lse_bytes > 0) {
    std::string lse_head;
    AppendSubmessagePrefix(AttendResponse::kLseFieldNumber, d.lse, v1::Tensor::kDataFieldNumber,
                           d.lse_bytes, &lse_head);
    slices.emplace_back(lse_head);
    slices.push_back(SliceOver(call.memory.get() + call.lse_offset, d.lse_bytes, call.memory));
  }
  *response = grpc::ByteBuffer(slices.data(), slices.size());
}

void AttentionService::Process(absl::string_view rpc, const CallContext& context,
                               grpc::ByteBuffer* request, grpc::ByteBuffer* response, Call* call,
                               absl::AnyInvocable<void(absl::Status) &&> done) {
  Run(
      rpc, context, absl::Now(), static_cast<int64_t>(request->Length()),
      [this, grpc = context.grpc, request, call] {
        absl::Status prepared = Prepare(grpc, *request, call);
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

void AttentionService::Run(absl::string_view rpc, const CallContext& context, absl::Time arrival,
                           int64_t request_bytes, absl::AnyInvocable<absl::Status() &&> prepare,
                           absl::AnyInvocable<int64_t() &&> respond, Call* call,
                           absl::AnyInvocable<void(absl::Status) &&> done) {
  CallTicket ticket = gate_->Admit(rpc, *context.grpc, arrival, request_bytes);
  const absl::Status admission = ticket.admission();
  auto answer = [call, ticket = std::move(ticket), respond = std::move(respond),
                 done = std::move(done)](absl::Status status) mutable {
    // First, on every path: the regions may be unregistered once the caller has its answer.
    call->refs.reset();
    int64_t response_bytes = 0;
    if (status.ok()) {
      call->response.mutable_timing()->set_total_us(
          absl::ToDoubleMicroseconds(absl::Now() - ticket.arrival()));
      response_bytes = std::move(respond)();
    }
    std::move(ticket).End(std::move(status), response_bytes, std::move(done));
  };
  if (!admission.ok()) return answer(admission);
  if (absl::Status prepared = std::move(prepare)(); !prepared.ok()) {
    return answer(std::move(prepared));
  }
  call->response.set_request_id(call->request.header.request_id());

  Job job;
  if (call->refs != nullptr && call->refs->cuda_device() >= 0) {
    // CUDA regions are read and written in place on their GPU: the request runs there. Masked
    // ones too: the CUDA runner scans a V in device memory for Inf/NaN on the device and runs one
    // holding any on the exact CPU kernel over host copies, as from the host (host_runner.h).
    absl::StatusOr<int> device = CudaRegionDevice(*call->refs);
    if (!device.ok()) return answer(device.status());
    job.device = *device;
  }
  job.work = call->decoded.params;
  job.deadline = absl::FromChrono(context.grpc->deadline());
  job.cancelled = [cancelled = context.cancelled] { return cancelled(); };
  call->response.mutable_timing()->set_decode_us(absl::ToDoubleMicroseconds(absl::Now() - arrival));
  job.done = [this, call, flops = call->decoded.flops, tokens = call->decoded.query_tokens,
              answer = std::move(answer)](JobResult result) mutable {
    // A region that shrank while the request ran fails it (its bytes were zeros past the end).
    if (result.status.ok() && call->refs != nullptr) result.status = call->refs->Intact();
    if (result.status.ok()) {
      v1::ServerTiming* timing = call->response.mutable_timing();
      timing->set_queue_us(absl::ToDoubleMicroseconds(result.queued));
      timing->set_h2d_us(result.stages.h2d_us);
      timing->set_compute_us(result.stages.compute_us);
      timing->set_d2h_us(result.stages.d2h_us);
      timing->set_run_us(result.stages.run_us);
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
  Process("Attend", CallbackCall(context), const_cast<grpc::ByteBuffer*>(request), response, c,
          [reactor, call = std::move(call)](absl::Status status) {
            reactor->Finish(ToGrpcStatus(status));
          });
  return reactor;
}

StreamMethod AttentionService::AttendStreamMethod() {
  return MakeStreamMethod<Call>(options_.stream_window,
                                [this](const CallContext& context, StreamExchange* exchange,
                                       Call* call, absl::AnyInvocable<void(absl::Status) &&> done) {
                                  Process("AttendStream", context, &exchange->request,
                                          &exchange->response, call, std::move(done));
                                });
}

absl::StatusOr<int> AttentionService::CudaRegionDevice(const RequestRegions& refs) const {
  const std::string name = absl::StrCat("cuda:", refs.cuda_device());
  const std::vector<const DeviceDescription*> devices = scheduler_->devices();
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i]->name == name) return static_cast<int>(i);
  }
  return absl::FailedPreconditionError(absl::StrCat("the request's CUDA regions are on ", name,
                                                    ", which this server does not serve"));
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* raw_request,
                                                          grpc::ByteBuffer* raw_response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CallTicket ticket =
      gate_->Admit("GetServerInfo", *context, absl::Now(),
                   static_cast<int64_t>(raw_request->Length()), CallGate::Drain::kSkip);
  auto answer = [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); };
  absl::Status status = ticket.admission();
  v1::GetServerInfoRequest request;
  if (status.ok()) status = ParseByteBuffer(*raw_request, &request);
  if (!status.ok()) {
    std::move(ticket).End(std::move(status), 0, answer);
    return reactor;
  }
  v1::ServerInfo info;
  v1::ServerInfo* response = &info;
  response->set_version(options_.version);
  response->set_backend(options_.backend);
  response->set_replica_name(options_.replica_name);
  response->set_socket_port(options_.socket_port);
  if (sessions_ != nullptr) {
    const CacheRoom room = sessions_->Room();
    response->set_kv_page_bytes(room.page_bytes);
    response->set_kv_pages_total(room.pages_total);
    response->set_kv_pages_free(room.pages_free);
    response->set_kv_pages_cached(room.pages_cached);
  }
  for (const DeviceDescription* device : scheduler_->devices()) {
    v1::DeviceInfo* info = response->add_devices();
    info->set_name(device->name);
    info->set_description(device->description);
    info->set_memory_bytes(device->memory_bytes);
    info->set_multiprocessors(device->multiprocessors);
    info->set_compute_capability(device->compute_capability);
    for (const std::string& option : device->attend_options) info->add_attend_options(option);
    for (const std::string& option : device->step_options) info->add_step_options(option);
  }
  for (v1::DType dtype :
       {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT8_E4M3}) {
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
  std::move(ticket).End(absl::OkStatus(), static_cast<int64_t>(raw_response->Length()), answer);
  return reactor;
}

}  // namespace attention::server
