// The attention.v1.Attention gRPC service, on gRPC's callback API: no thread is held per call.
// Its methods are raw (grpc::ByteBuffer in and out): each request is parsed from the slices gRPC
// received (server/requests/wire_message.h; undecodable bytes get INVALID_ARGUMENT naming the
// field), decoded (request_decoder), its tensors copied once into host memory of the kind the
// backend reads (executors/host_memory.h), queued on the scheduler, and answered from the worker
// that ran it with slices over that same memory. Each call passes the one CallGate
// (server/calls/call_gate.h): token, drain, metrics, request log, status conversion.
//
// Host copies of tensor data per request: 1, the wire's slices -> the host block (q, k, v; by 4
// threads above 8 MiB); none for a tensor by reference (Tensor.ref, o_ref, lse_ref): its params
// point into its shared-memory region, which holds it for the request until it is answered
// (RequestRegions), and CUDA regions are read and written in place on their GPU. The CUDA runner
// DMAs from and into that pinned block directly, and the response's o and lse are sent from it in
// place (gRPC writes the slices to the socket). Before this path there were 4 on a GPU: protobuf's
// parse into the request's bytes fields, those into pinned staging, staging into the response's
// bytes fields, and protobuf's serialization.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_context.h"
#include "server/calls/call_gate.h"
#include "server/executors/host_memory.h"
#include "server/metrics/metrics.h"
#include "server/regions/region_registry.h"
#include "server/requests/request_decoder.h"
#include "server/requests/wire_message.h"
#include "server/scheduling/scheduler.h"
#include "server/service/shared_memory_service.h"
#include "server/sessions/session_store.h"
#include "server/streams/stream_methods.h"

namespace attention::server {

struct ServiceOptions {
  std::string version;
  std::string backend = "cpu";  // "cpu" or "cuda"
  std::string replica_name;     // --replica_name (ServerInfo.replica_name)
  int64_t max_message_bytes = int64_t{1024} << 20;
  // Largest q + k + v (and o + lse) of one AttendChunked request; its chunks are messages, each
  // under max_message_bytes.
  int64_t max_chunked_request_bytes = int64_t{8} << 30;
  // Host bytes all unfinished AttendChunked calls may hold together (their blocks, taken when
  // the header comes); a header past it is RESOURCE_EXHAUSTED.
  int64_t chunked_memory_bytes = int64_t{16} << 30;
  // How long an AttendChunked call may wait for its next message before it ends
  // DEADLINE_EXCEEDED.
  absl::Duration chunked_idle_timeout = absl::Seconds(60);
  int max_queue = 256;
  int max_batch = 1;
  int max_head_dim = 256;
  // Work one request may ask for, FLOPs; 0 = no limit (main.cc sets the backend's default).
  double max_request_flops = 0;
  // Requests one AttendStream may have queued, running or waiting to be written; further reads
  // wait, so a fast sender is slowed by gRPC flow control instead of filling the queue.
  int stream_window = 16;
  // The socket streams' port (streams/socket_streams.h), reported in ServerInfo; 0: none.
  int socket_port = 0;
};

// Every method raw: the bytes of a request are ours to parse. AttendStream is generic: the
// stream transports of server/streams/ serve it (gRPC's callback API, or with --poll_streams its
// async API with a polling thread, or a request ring) from the table of stream methods.
using AttentionRawService =
    v1::Attention::WithRawCallbackMethod_Attend<v1::Attention::WithGenericMethod_AttendStream<
        v1::Attention::WithRawCallbackMethod_GetServerInfo<
            v1::Attention::WithRawCallbackMethod_AttendChunked<v1::Attention::Service>>>>;

class AttentionService final : public AttentionRawService {
 public:
  // `scheduler`, `gate`, `memory` and `regions` must outlive the service; `memory` null: plain
  // host memory. `regions`: the shared-memory regions requests may reference; null: shared memory
  // is off. Every call and every message of a stream passes `gate` (its token, drain, metrics and
  // log): once the drain closes, every new request, and every new message on an open stream, is
  // answered UNAVAILABLE; requests already accepted run to the end (their responses handed to
  // gRPC) before it reads drained. `sessions`: the session store whose room ServerInfo reports
  // (kv_pages_*); null: none (no sessions served).
  AttentionService(const ServiceOptions& options, Scheduler* scheduler, const CallGate* gate,
                   HostMemory* memory = nullptr, RegionRegistry* regions = nullptr,
                   SessionStore* sessions = nullptr);

  // One request on its way: what was parsed and decoded, the host block holding its tensors
  // (q | k | v | o | lse, each 256-byte aligned) and the response's other fields. An
  // AttendStream's message state.
  struct Call {
    WireAttendRequest request;
    DecodedRequest decoded;
    std::shared_ptr<char> memory;
    int64_t o_offset = 0, lse_offset = 0;
    v1::AttendResponse response;  // request_id, timing, device; o and lse are sent from memory
    // The regions the request references (tensors by reference), held until it is answered.
    std::unique_ptr<RequestRegions> refs;
    // For StreamFlow's error messages.
    const std::string& request_id() const { return request.header.request_id(); }
  };

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  // AttendStream, as the stream transports serve it (server/streams/): each message a request
  // of its own, answered as it finishes, possibly out of order (rpc "AttendStream"). A request
  // that fails ends the stream with its status (the message names its request_id) once the
  // responses already computed are written.
  StreamMethod AttendStreamMethod();
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  // One request in chunks (attend_chunked.cc): the header is checked and the host block sized
  // before any chunk is taken; each chunk is copied once into its place; the request runs when
  // every byte of q, k and v has come exactly once; o and lse go back in chunks as large as the
  // largest the client sent.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendChunked(
      grpc::CallbackServerContext* context) override;

 private:
  class ChunkedReactor;

  // Runs one request: refuse while draining, parse and decode it, copy its tensors into
  // `call->memory` and give `request`'s slices back, queue, execute, fill the timing and device,
  // write the response into `response`, record metrics. Calls `done` exactly once, inline on
  // early errors or from a worker; `request`, `response` and `call` must stay valid until then.
  void Process(absl::string_view rpc, const CallContext& context, grpc::ByteBuffer* request,
               grpc::ByteBuffer* response, Call* call,
               absl::AnyInvocable<void(absl::Status) &&> done);
  // Process's steps for any request: refuse while draining, `prepare` (the call's tensors into
  // call->memory), queue, execute, `respond` (writes the response, returns its bytes), record
  // metrics from `arrival` with `request_bytes` received. Calls `done` exactly once.
  void Run(absl::string_view rpc, const CallContext& context, absl::Time arrival,
           int64_t request_bytes, absl::AnyInvocable<absl::Status() &&> prepare,
           absl::AnyInvocable<int64_t() &&> respond, Call* call,
           absl::AnyInvocable<void(absl::Status) &&> done);
  // Allocates call->memory for the decoded call and points its params into it (those not in a
  // region).
  absl::Status Place(Call* call);
  // Parses, decodes and copies `request` into `call` (the steps before the queue), resolving its
  // tensors by reference through `context`'s regions.
  absl::Status Prepare(const grpc::ServerContextBase* context, const grpc::ByteBuffer& request,
                       Call* call);
  // The scheduler's index of the GPU holding the request's CUDA regions, or why it cannot run.
  absl::StatusOr<int> CudaRegionDevice(const RequestRegions& refs) const;
  // The response of a finished `call`: its fields, then o and lse as slices over call->memory.
  static void WriteResponse(const Call& call, grpc::ByteBuffer* response);

  const ServiceOptions options_;
  const DecodeOptions decode_options_;
  const DecodeOptions chunked_decode_options_;
  Scheduler* const scheduler_;
  const CallGate* const gate_;
  Metrics* const metrics_;                  // the gate's
  std::unique_ptr<HostMemory> own_memory_;  // when none was given
  HostMemory* const memory_;
  RegionRegistry* const regions_;
  SessionStore* const sessions_;  // ServerInfo's kv_pages_*; null: none
  // Bytes the blocks of unfinished AttendChunked calls hold (ServiceOptions::chunked_memory_bytes).
  std::atomic<int64_t> chunked_bytes_{0};
};

}  // namespace attention::server
