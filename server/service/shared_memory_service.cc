#include "server/service/shared_memory_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/service/connections.h"
#include "server/streams/request_rings.h"

namespace attention::server {
namespace {

absl::Status SharedMemoryOff() {
  return absl::FailedPreconditionError(
      "shared memory is off on this server (start it with --allow_shared_memory)");
}

void FillInfo(const RegionDescription& d, v1::RegionInfo* info) {
  info->set_name(d.name);
  info->set_kind(d.kind == RegionKind::kSystem ? "system" : "cuda");
  info->set_key(d.key);
  info->set_device(d.device);
  info->set_offset(d.offset);
  info->set_byte_size(d.byte_size);
  info->set_pinned(d.pinned);
}

}  // namespace

absl::StatusOr<char*> RequestRegions::Resolve(absl::string_view field, const v1::TensorRef& ref,
                                              int64_t alignment) {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", SharedMemoryOff().message()));
  }
  if (owner_.empty()) owner_ = RegionOwner(*context_, *auth_token_);
  // A region this request already holds (a Step's entries refer to one region many times) is
  // not looked up again: the registry's lookup checks its object's size with a system call.
  auto held = std::find_if(uses_.begin(), uses_.end(), [&](const RegionRegistry::Use& use) {
    return use.name() == ref.region();
  });
  absl::StatusOr<RegionSpan> span =
      held != uses_.end() ? held->Span(field, ref.offset(), ref.byte_size(), alignment)
                          : registry_->Resolve(owner_, field, ref.region(), ref.offset(),
                                               ref.byte_size(), alignment, &uses_);
  if (!span.ok()) return span.status();
  if (span->kind == RegionKind::kCuda) {
    const bool served =
        cuda_inputs_ &&
        (field == "q.ref" || field == "k.ref" || field == "v.ref" || field == "o_ref" ||
         field == "lse_ref" || field == "ready_counter.ref" || field == "done_counter.ref");
    if (!served) {
      return absl::UnimplementedError(absl::StrCat(
          field, ": region ", ref.region(),
          " is CUDA memory, served for the q, k, v, o and lse of Attend and of a packed Step (and "
          "its stream counters) only; use a system region here"));
    }
    if (cuda_device_ >= 0 && span->device != cuda_device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected CUDA memory of cuda:", cuda_device_,
                       " (as the request's other CUDA tensors), got cuda:", span->device));
    }
    cuda_device_ = span->device;
    ++cuda_refs_;
  }
  return span->data;
}

absl::Status RequestRegions::Intact() const {
  for (const RegionRegistry::Use& use : uses_) {
    if (absl::Status intact = use.Intact(); !intact.ok()) return intact;
  }
  return absl::OkStatus();
}

SharedMemoryService::SharedMemoryService(RegionRegistry* registry, RequestRings* rings,
                                         const CallGate* gate)
    : registry_(registry), rings_(rings), gate_(gate) {}

absl::Status SharedMemoryService::Admission(const CallTicket& ticket) const {
  if (!ticket.admission().ok()) return ticket.admission();
  return registry_ == nullptr ? SharedMemoryOff() : absl::OkStatus();
}

void SharedMemoryService::Answer(CallTicket ticket, grpc::ServerUnaryReactor* reactor,
                                 absl::Status status) {
  std::move(ticket).End(std::move(status), 0,
                        [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
}

grpc::ServerUnaryReactor* SharedMemoryService::Register(grpc::CallbackServerContext* context,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegionInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CallTicket ticket = gate_->Admit("Register", *context, absl::Now(), 0, CallGate::Drain::kSkip);
  absl::Status status = Admission(ticket);
  if (status.ok()) {
    const std::string owner = RegionOwner(*context, gate_->auth_token());
    // An owner known by its connection alone may go without a word: its regions go with its
    // connection, or once idle (region_registry.h). A token's regions stay until unregistered.
    RegionOwnership ownership;
    if (gate_->auth_token().empty()) {
      ownership = {.by_connection = true, .connection = ConnectionOf(context->peer())};
    }
    absl::StatusOr<RegionDescription> region;
    switch (request->source_case()) {
      case v1::RegisterRegionRequest::kSystemKey:
        region = registry_->RegisterSystem(owner, ownership, request->name(), request->system_key(),
                                           request->offset(), request->byte_size());
        break;
      case v1::RegisterRegionRequest::kCudaIpcHandle:
        region =
            registry_->RegisterCuda(owner, ownership, request->name(), request->cuda_ipc_handle(),
                                    request->device(), request->offset(), request->byte_size());
        break;
      default:
        region = absl::InvalidArgumentError(
            "source: expected system_key or cuda_ipc_handle, got neither");
    }
    status = region.status();
    if (region.ok()) FillInfo(*region, response);
  }
  Answer(std::move(ticket), reactor, std::move(status));
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryService::Unregister(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CallTicket ticket = gate_->Admit("Unregister", *context, absl::Now(), 0, CallGate::Drain::kSkip);
  if (absl::Status admission = Admission(ticket); !admission.ok()) {
    Answer(std::move(ticket), reactor, std::move(admission));
    return reactor;
  }
  // Most regions are idle: answered at once. One in use is answered by the registry's
  // housekeeping thread when its last request ends or at the call's deadline; no thread waits.
  registry_->Unregister(RegionOwner(*context, gate_->auth_token()), request->name(),
                        absl::FromChrono(context->deadline()),
                        [reactor, ticket = std::move(ticket)](absl::Status status) mutable {
                          Answer(std::move(ticket), reactor, std::move(status));
                        });
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryService::List(grpc::CallbackServerContext* context,
                                                    const v1::ListRegionsRequest* request,
                                                    v1::ListRegionsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CallTicket ticket = gate_->Admit("List", *context, absl::Now(), 0, CallGate::Drain::kSkip);
  const absl::Status status = Admission(ticket);
  if (status.ok()) {
    for (const RegionDescription& d : registry_->List(RegionOwner(*context, gate_->auth_token()))) {
      FillInfo(d, response->add_regions());
    }
  }
  Answer(std::move(ticket), reactor, status);
  return reactor;
}

grpc::ServerUnaryReactor* SharedMemoryService::OpenRing(grpc::CallbackServerContext* context,
                                                        const v1::OpenRingRequest* request,
                                                        v1::RingClosed* response) {
  // Counted as a call only when refused: a served ring's requests are counted as its method's.
  absl::Status status = gate_->Authenticate(*context);
  if (status.ok() && registry_ == nullptr) status = SharedMemoryOff();
  if (status.ok() && rings_ == nullptr) {
    status = absl::UnimplementedError("request rings are not served here");
  }
  if (status.ok()) return rings_->Open(context, *request, response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  gate_->Refuse("OpenRing", *context, absl::Now(), status,
                [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

}  // namespace attention::server
