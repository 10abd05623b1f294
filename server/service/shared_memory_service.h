// The attention.v1.SharedMemory gRPC service (co-located clients), and the adapter through which
// the Attention and Sessions services resolve a request's TensorRefs in the region registry
// (server/regions/). Off unless the server runs with --allow_shared_memory: then every call here
// and every request naming a region is FAILED_PRECONDITION.
//
// Owners: a region belongs to the caller's bearer token when the server checks tokens, else to
// the caller's connection (its peer address and port; RegionOwner, server/calls/call_gate.h), so
// another client of the same host cannot use or see it. A connection's regions go with it (its
// channelz id, connections.h), or once idle for --region_idle_timeout_s.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_gate.h"
#include "server/regions/region_registry.h"
#include "server/requests/tensor_refs.h"

namespace attention::server {

// The TensorRefs of one request of `context`'s caller, resolved in `registry`; the regions stay
// held until this is destroyed. `registry` null: shared memory is off (FAILED_PRECONDITION).
// Costs nothing for a request without references. CUDA regions are served for q, k, v, o and lse
// of Attend and of a packed Step (`cuda_inputs`), all on one GPU, which the request then runs on;
// elsewhere (the other Sessions calls, a Step's entries) they are UNIMPLEMENTED: those bytes are
// read or written on the host.
class RequestRegions final : public TensorRefResolver {
 public:
  RequestRegions(RegionRegistry* registry, const grpc::ServerContextBase* context,
                 const std::string* auth_token, bool cuda_inputs = false)
      : registry_(registry),
        context_(context),
        auth_token_(auth_token),
        cuda_inputs_(cuda_inputs) {}
  absl::StatusOr<char*> Resolve(absl::string_view field, const v1::TensorRef& ref,
                                int64_t alignment) override;

  // Checked before the request answers OK: FAILED_PRECONDITION when a region it used shrank
  // while it ran (RegionRegistry::Use::Intact), so it fails instead of answering with zeros.
  absl::Status Intact() const;

  // The GPU ordinal of the CUDA regions referenced, or -1 when none.
  int cuda_device() const { return cuda_device_; }
  // References resolved into CUDA regions so far (one per field, however many share a region).
  int cuda_refs() const { return cuda_refs_; }

 private:
  RegionRegistry* const registry_;
  const grpc::ServerContextBase* const context_;
  const std::string* const auth_token_;
  const bool cuda_inputs_;
  std::string owner_;                      // from the first reference on
  std::vector<RegionRegistry::Use> uses_;  // one per region referenced
  int cuda_device_ = -1;
  int cuda_refs_ = 0;
};

class RequestRings;  // request_rings.h (which needs this header's RequestRegions)

class SharedMemoryService final : public v1::SharedMemory::CallbackService {
 public:
  // `registry` null: shared memory is off. `rings` (null: OpenRing is UNIMPLEMENTED) serves the
  // request rings. `registry`, `rings` and `gate` must outlive the service. Every call passes
  // `gate` (token, metrics, log; not the drain: no call here computes).
  SharedMemoryService(RegionRegistry* registry, RequestRings* rings, const CallGate* gate);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterRegionRequest* request,
                                     v1::RegionInfo* response) override;
  grpc::ServerUnaryReactor* Unregister(grpc::CallbackServerContext* context,
                                       const v1::UnregisterRegionRequest* request,
                                       v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* context,
                                 const v1::ListRegionsRequest* request,
                                 v1::ListRegionsResponse* response) override;
  grpc::ServerUnaryReactor* OpenRing(grpc::CallbackServerContext* context,
                                     const v1::OpenRingRequest* request,
                                     v1::RingClosed* response) override;

 private:
  // The gate's admission, then the flag; OK when the call may go on.
  absl::Status Admission(const CallTicket& ticket) const;
  // Ends the call (its metrics and log) and finishes it.
  static void Answer(CallTicket ticket, grpc::ServerUnaryReactor* reactor, absl::Status status);

  RegionRegistry* const registry_;
  RequestRings* const rings_;
  const CallGate* const gate_;
};

}  // namespace attention::server
