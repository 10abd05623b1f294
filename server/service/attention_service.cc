#include "server/service/attention_service.h"

#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/service/security.h"
#include "server/service/shared_memory_service.h"

namespace attention::server {

using v1::AttendRequest;
using v1::AttendResponse;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  // absl's canonical codes share gRPC's numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

AttentionService::AttentionService(const ServiceOptions& options, Scheduler* scheduler,
                                   Metrics* metrics, DrainGate* drain, RegionRegistry* regions)
    : options_(options),
      decode_options_{.max_message_bytes = options.max_message_bytes,
                      .max_head_dim = options.max_head_dim,
                      .max_request_flops = options.max_request_flops},
      scheduler_(scheduler),
      metrics_(metrics),
      drain_(drain),
      regions_(regions) {}

void AttentionService::Process(absl::string_view rpc, grpc::CallbackServerContext* context,
                               const AttendRequest& request, AttendResponse* response,
                               absl::AnyInvocable<void(absl::Status) &&> done) {
  const absl::Time arrival = absl::Now();
  const int64_t request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  metrics_->RequestStarted();
  auto finish = [this, rpc, arrival, request_bytes, response,
                 done = std::move(done)](absl::Status status) mutable {
    const absl::Duration elapsed = absl::Now() - arrival;
    int64_t response_bytes = 0;
    if (status.ok()) {
      response->mutable_timing()->set_total_us(absl::ToDoubleMicroseconds(elapsed));
      response_bytes = static_cast<int64_t>(response->ByteSizeLong());
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
  // The regions the request references stay held until it is answered.
  auto refs = std::make_unique<RequestRegions>(regions_, context, &options_.auth_token,
                                               /*cuda_inputs=*/true);
  absl::StatusOr<DecodedRequest> decoded =
      DecodeRequest(request, decode_options_, response, refs.get());
  if (!decoded.ok()) return answer(decoded.status());
  response->set_request_id(request.request_id());

  Job job;
  if (refs->cuda_device() >= 0) {
    // CUDA regions are read and written in place on their GPU: the request runs there.
    absl::StatusOr<int> device = CudaRegionDevice(*refs, decoded->params);
    if (!device.ok()) return answer(device.status());
    job.device = *device;
  }
  job.work = decoded->params;
  job.deadline = absl::FromChrono(context->deadline());
  job.cancelled = [context] { return context->IsCancelled(); };
  response->mutable_timing()->set_decode_us(absl::ToDoubleMicroseconds(absl::Now() - arrival));
  job.done = [this, response, flops = decoded->flops, tokens = decoded->query_tokens,
              refs = std::move(refs), answer = std::move(answer)](JobResult result) mutable {
    if (result.status.ok()) result.status = refs->Intact();
    refs.reset();  // first: the regions may be unregistered once the caller has its answer
    if (result.status.ok()) {
      v1::ServerTiming* timing = response->mutable_timing();
      timing->set_queue_us(absl::ToDoubleMicroseconds(result.queued));
      timing->set_h2d_us(result.stages.h2d_us);
      timing->set_compute_us(result.stages.compute_us);
      timing->set_d2h_us(result.stages.d2h_us);
      response->set_device(result.device->name);
      metrics_->StagesObserved(result.queued, result.stages);
      metrics_->Computed(result.device->name, flops, tokens,
                         result.leads_batch ? result.batch_size : 0);
    }
    std::move(answer)(std::move(result.status));
  };
  scheduler_->Submit(std::move(job));
}

absl::StatusOr<int> AttentionService::CudaRegionDevice(const RequestRegions& refs,
                                                       const AttentionParams& params) const {
  if (params.window_left != kUnboundedWindow || params.window_right != kUnboundedWindow) {
    // Masked requests check V for Inf/NaN on the host before they run, and those holding any
    // run on the CPU kernel (the exact path), which reads q, k, v and o on the host.
    return absl::UnimplementedError(
        "masked requests (causal, windows) need q, k, v and o in host or system shared memory; "
        "this one has tensors in a CUDA region");
  }
  const std::string name = absl::StrCat("cuda:", refs.cuda_device());
  const std::vector<const DeviceDescription*> devices = scheduler_->devices();
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i]->name == name) return static_cast<int>(i);
  }
  return absl::FailedPreconditionError(absl::StrCat("the request's CUDA regions are on ", name,
                                                    ", which this server does not serve"));
}

grpc::ServerUnaryReactor* AttentionService::Attend(grpc::CallbackServerContext* context,
                                                   const AttendRequest* request,
                                                   AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Process("Attend", context, *request, response,
          [reactor](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

grpc::ServerBidiReactor<AttendRequest, AttendResponse>* AttentionService::AttendStream(
    grpc::CallbackServerContext* context) {
  return StreamReactor<AttendRequest, AttendResponse>::Begin(
      options_.stream_window,
      [this, context](const AttendRequest& request, AttendResponse* response,
                      absl::AnyInvocable<void(absl::Status) &&> done) {
        Process("AttendStream", context, request, response, std::move(done));
      });
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest* request,
                                                          v1::ServerInfo* response) {
  const absl::Time arrival = absl::Now();
  metrics_->RequestStarted();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status auth = CheckBearerToken(context->client_metadata(), options_.auth_token);
      !auth.ok()) {
    metrics_->RequestFinished("GetServerInfo", auth.code(), absl::Now() - arrival,
                              static_cast<int64_t>(request->ByteSizeLong()), 0);
    reactor->Finish(ToGrpcStatus(auth));
    return reactor;
  }
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
  metrics_->RequestFinished("GetServerInfo", absl::StatusCode::kOk, absl::Now() - arrival,
                            static_cast<int64_t>(request->ByteSizeLong()),
                            static_cast<int64_t>(response->ByteSizeLong()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attention::server
