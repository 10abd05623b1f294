// The attention.v1.Attention gRPC service, on gRPC's callback API: no thread is held per call.
// Each request is decoded into its own response (request_decoder), queued on the scheduler, and
// answered from the worker that ran it. absl::Status becomes grpc::Status only here.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/metrics/metrics.h"
#include "server/regions/region_registry.h"
#include "server/requests/request_decoder.h"
#include "server/scheduling/scheduler.h"
#include "server/service/drain_gate.h"
#include "server/service/shared_memory_service.h"
#include "server/service/stream_reactor.h"

namespace attention::server {

struct ServiceOptions {
  std::string version;
  std::string backend = "cpu";  // "cpu" or "cuda"
  int64_t max_message_bytes = int64_t{1024} << 20;
  int max_queue = 256;
  int max_batch = 1;
  int max_head_dim = 256;
  // Work one request may ask for, FLOPs; 0 = no limit (main.cc sets the backend's default).
  double max_request_flops = 0;
  // Requests one AttendStream may have queued, running or waiting to be written; further reads
  // wait, so a fast sender is slowed by gRPC flow control instead of filling the queue.
  int stream_window = 16;
  // When set, every call must carry `authorization: Bearer <auth_token>` (see security.h).
  std::string auth_token;
};

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // `scheduler`, `metrics` and `drain` must outlive the service. Once `drain` closes, every new
  // request, and every new message on an open stream, is answered UNAVAILABLE; requests already
  // accepted run to the end (their responses handed to gRPC) before it reads drained.
  // `regions`: the shared-memory regions requests may reference; null: shared memory is off.
  AttentionService(const ServiceOptions& options, Scheduler* scheduler, Metrics* metrics,
                   DrainGate* drain, RegionRegistry* regions = nullptr);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  // Reads requests continuously and writes each response when its request finishes, possibly out
  // of order. A request that fails ends the stream with its status (the message names its
  // request_id) once the responses already computed are written.
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;

 private:
  // Runs one request: refuse while draining, decode into `response`, queue, execute, fill the
  // timing and device, record metrics. Calls `done` exactly once, inline on early errors or from
  // a worker; `request` and `response` must stay valid until then.
  void Process(absl::string_view rpc, grpc::CallbackServerContext* context,
               const v1::AttendRequest& request, v1::AttendResponse* response,
               absl::AnyInvocable<void(absl::Status) &&> done);

  // The scheduler's index of the GPU holding the request's CUDA regions, or why it cannot run.
  absl::StatusOr<int> CudaRegionDevice(const RequestRegions& refs,
                                       const AttentionParams& params) const;

  const ServiceOptions options_;
  const DecodeOptions decode_options_;
  Scheduler* const scheduler_;
  Metrics* const metrics_;
  DrainGate* const drain_;
  RegionRegistry* const regions_;
};

}  // namespace attention::server
