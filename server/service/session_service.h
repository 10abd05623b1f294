// The attention.v1.Sessions gRPC service (KV-resident sessions), on gRPC's callback API. Calls
// that touch a device (CreateSession, AppendKv, Step) become scheduler jobs on the device their
// session's pages are on, through the one queue every computing RPC takes: the same admission
// (RESOURCE_EXHAUSTED when full), deadline and cancellation drop, drain, device health and
// metrics as Attend. DropSession and ListSessions touch no device and are answered inline.
//
// Every call passes the CallGate (server/calls/call_gate.h): the bearer token (when the server has
// one), UNAVAILABLE once the server drains, the request metrics under its rpc name, the log. A Step
// is checked against its sessions' shapes before it is queued; its entries of one device and one
// decode key (dtype, kv heads, head dim, query heads, mask, lse) are one decode job, which the
// scheduler may run in one launch with other Steps' jobs (--max_batch > 1). Entries of other
// devices or keys are further jobs of the same call, queued together or not at all.
//
// Every method is raw (grpc::ByteBuffer in and out), StepStream's messages too: each request is
// parsed by ParseByteBuffer (wire_buffers.h: INVALID_ARGUMENT naming the field when its bytes do
// not decode; protobuf copies the tensors once, tensors by reference stay in their regions) and
// each response serialized by protobuf.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "google/protobuf/arena.h"
#include "grpcpp/grpcpp.h"
#include "server/calls/call_context.h"
#include "server/calls/call_gate.h"
#include "server/metrics/metrics.h"
#include "server/regions/ipc_events.h"
#include "server/regions/region_registry.h"
#include "server/requests/session_request.h"
#include "server/scheduling/scheduler.h"
#include "server/sessions/session_store.h"
#include "server/sessions/step_jobs.h"
#include "server/streams/stream_methods.h"

namespace attention::server {

struct SessionServiceOptions {
  int64_t max_message_bytes = int64_t{1024} << 20;
  int max_head_dim = 256;
  // Work one Step may ask for on one device, FLOPs; 0 = no limit.
  double max_request_flops = 0;
  // Steps one StepStream may hold at once (running or waiting to be written); further reads wait.
  int stream_window = 16;
  // How often idle sessions past the TTL are removed (lookups also check).
  absl::Duration sweep_interval = absl::Seconds(1);
};

// Every method raw: the bytes of a request are ours to parse (wire_buffers.h says why).
// StepStream is generic: the stream transports of server/streams/ serve it from the table of
// stream methods.
using SessionsRawService =
    v1::Sessions::WithRawCallbackMethod_CreateSession<v1::Sessions::WithRawCallbackMethod_AppendKv<
        v1::Sessions::WithRawCallbackMethod_Truncate<v1::Sessions::WithRawCallbackMethod_Fork<
            v1::Sessions::WithRawCallbackMethod_Step<v1::Sessions::WithGenericMethod_StepStream<
                v1::Sessions::WithRawCallbackMethod_DropSession<
                    v1::Sessions::WithRawCallbackMethod_ListSessions<
                        v1::Sessions::WithRawCallbackMethod_Export<
                            v1::Sessions::WithRawCallbackMethod_Import<
                                v1::Sessions::Service>>>>>>>>>>;

// What SessionInfo says of a session (SessionStore::Snapshot, List).
void FillSessionInfo(const SessionSnapshot& s, v1::SessionInfo* info);

class RequestRegions;

class SessionService final : public SessionsRawService {
 public:
  // `store` may be null: the server keeps no KV cache (its backend has no page pool), and every
  // call is answered UNIMPLEMENTED. The store's device d is the scheduler's executor d. `store`,
  // `scheduler` and `gate` must outlive the service; every call passes `gate` (its token, which
  // sessions belong to, drain, metrics and log). `regions`: the shared-memory regions requests
  // may reference; null: shared memory is off. `events`: the CUDA events of packed Steps in stream
  // order (StepRequest.ready_event, done_event); null: refused.
  SessionService(const SessionServiceOptions& options, SessionStore* store, Scheduler* scheduler,
                 const CallGate* gate, RegionRegistry* regions = nullptr,
                 IpcEvents* events = nullptr);
  // Stops the sweeper.
  ~SessionService() override;
  SessionService(const SessionService&) = delete;
  SessionService& operator=(const SessionService&) = delete;

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AppendKv(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Truncate(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Fork(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  // One Step's (a unary call's or a StepStream message's) parsed request and its response, on an
  // arena of their own whose first block is inside the struct: a Step of 8 entries by reference
  // parses into ~70 messages and strings and answers with ~30 more (7.7 KB in all), and a packed
  // Step's session ids are a string each, which one by one were as many heap allocations to make
  // and to free.
  struct StepMessages {
    StepMessages();
    const std::string& request_id() const { return request.request_id(); }

    alignas(8) char first_block[8192];
    google::protobuf::Arena arena;
    v1::StepRequest& request;
    v1::StepResponse& response;
  };
  // StepStream, as the stream transports serve it (server/streams/): Steps on one stream, each
  // answered as it finishes (its response carries its request_id), with the unary Step's checks,
  // queue, metrics (rpc "StepStream") and drain per Step; at most `stream_window` Steps of one
  // stream are held at once. A failed Step ends the stream with its status, naming its
  // request_id.
  StreamMethod StepStreamMethod();
  grpc::ServerUnaryReactor* DropSession(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  // A session's header, then its rows chunk by chunk (session_transfer.cc): each chunk a device
  // job reading a snapshot of the session (a fork of every layer made at the start, dropped at
  // the end), written before the next is read.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Export(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request) override;
  // A new session from a header, then rows chunk by chunk (session_transfer.cc): each chunk read,
  // checked and appended as a device job before the next is read; the session dropped when the
  // stream fails.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Import(grpc::CallbackServerContext* context,
                                                    grpc::ByteBuffer* response) override;

 private:
  struct StepCall;
  class ExportReactor;
  class ImportReactor;
  // How a call's body answers: `finish` once, from this thread or from a scheduler worker.
  using Finish = absl::AnyInvocable<void(absl::Status) &&>;
  // A request as Admit hands it on: when it was taken from gRPC (before it was parsed), and how
  // long its parse took.
  struct Arrival {
    absl::Time at;
    absl::Duration parse;
  };
  using Body =
      absl::AnyInvocable<void(const std::string& owner, const Arrival& arrival, Finish finish) &&>;

  // A unary call's work once admitted: over its parsed request, filling its response, for the
  // caller `owner` of `call`; answers through `finish`.
  template <typename Request, typename Response>
  using Handler = void (SessionService::*)(const CallContext& call, const std::string& owner,
                                           const Arrival& arrival, const Request& request,
                                           Response* response, Finish finish);
  // A unary call's parsed request and its response (a Step's: StepMessages, on an arena).
  template <typename Request, typename Response>
  struct UnaryMessages {
    Request request;
    Response response;
  };
  // Answers one unary call through Admit and its default reactor: `handler` runs over the parsed
  // request and a response (held in a `Messages`), which Admit serializes into `raw_response`.
  template <typename Request, typename Response,
            typename Messages = UnaryMessages<Request, Response>>
  grpc::ServerUnaryReactor* Serve(absl::string_view rpc, grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* raw_request,
                                  grpc::ByteBuffer* raw_response,
                                  Handler<Request, Response> handler);
  // Admits one request (a unary call or one message of a stream): checks the token, the drain,
  // that `raw_request` parses as `request` (INVALID_ARGUMENT naming the field otherwise) and the
  // store, then runs `body`, which answers through the `finish` it is given (serializing
  // `response` into `raw_response` when ok, recording metrics under `rpc`, calling `answer`,
  // leaving the drain gate). `body` gets the caller's owner key. `request`, `response` and
  // `raw_response` must stay valid until `answer` runs.
  void Admit(absl::string_view rpc, const grpc::ServerContextBase* context,
             const grpc::ByteBuffer& raw_request, google::protobuf::Message* request,
             const google::protobuf::Message* response, grpc::ByteBuffer* raw_response, Body body,
             Finish answer);
  // Queues `run` as device work on `device` for `call`, holding `sessions`.
  void SubmitDeviceWork(const CallContext& call, int device, std::vector<std::string> sessions,
                        absl::AnyInvocable<absl::Status() &&> run, Finish finish);
  // Queues `work` as session `id`'s device work (so it runs after the session's calls queued
  // before it), run with a lease on each of its layers (one for a session of one layer):
  // Truncate, Fork and Export (`access`: the store's refusal of a sealed session). Refuses an
  // empty id, and NOT_FOUND as the store, before queueing.
  void SubmitSessionWork(
      const CallContext& call, const std::string& owner, const std::string& id,
      absl::AnyInvocable<absl::Status(std::vector<SessionStore::Lease>&) &&> work, Finish finish,
      SessionStore::Access access = SessionStore::Access::kChange);

  // The unary calls' work (Handlers).
  void RunCreate(const CallContext& call, const std::string& owner, const Arrival& arrival,
                 const v1::CreateSessionRequest& request, v1::SessionInfo* response, Finish finish);
  void RunAppend(const CallContext& call, const std::string& owner, const Arrival& arrival,
                 const v1::AppendKvRequest& request, v1::SessionInfo* response, Finish finish);
  void RunTruncate(const CallContext& call, const std::string& owner, const Arrival& arrival,
                   const v1::TruncateRequest& request, v1::SessionInfo* response, Finish finish);
  void RunFork(const CallContext& call, const std::string& owner, const Arrival& arrival,
               const v1::ForkRequest& request, v1::SessionInfo* response, Finish finish);
  void RunDrop(const CallContext& call, const std::string& owner, const Arrival& arrival,
               const v1::DropSessionRequest& request, v1::DropSessionResponse* response,
               Finish finish);
  void RunList(const CallContext& call, const std::string& owner, const Arrival& arrival,
               const v1::ListSessionsRequest& request, v1::ListSessionsResponse* response,
               Finish finish);
  // A Step's entries (or a packed Step's sequences) checked against their sessions' shapes into
  // call->seqs (o and lse not yet placed, unless in the caller's regions), and its response
  // against the message limit.
  absl::Status DecodeStep(const std::string& owner, const v1::StepRequest& request,
                          StepCall* call) const;
  // Where a packed Step's tensors are, once decoded: the host's, or (every one of them in CUDA
  // regions, on the GPU of every session at `places`) that device's, with its events opened into
  // `call`.
  absl::StatusOr<StepMemory> DecodeStepMemory(const v1::StepRequest& request,
                                              const std::vector<SessionStore::Place>& places,
                                              StepCall* call) const;
  // Where each sequence's o and lse go: a packed Step's o [B, Hq, Nq, D] and lse [B, Hq, Nq] in
  // the response (unless in the caller's regions), else the response's results in entry order,
  // o shaped as q and lse [Hq, Nq].
  static void AddResults(const v1::StepRequest& request, StepCall* call,
                         v1::StepResponse* response);
  // Decodes a Step and hands it to step_jobs_. `arrival` starts the call's ServerTiming (decode_us
  // and total_us count its parse too).
  void RunStep(const CallContext& call, const std::string& owner, const Arrival& arrival,
               const v1::StepRequest& request, v1::StepResponse* response, Finish finish);

  void SweeperLoop();

  const SessionServiceOptions options_;
  const SessionLimits limits_;
  SessionStore* const store_;
  Scheduler* const scheduler_;
  const CallGate* const gate_;
  Metrics* const metrics_;  // the gate's
  RegionRegistry* const regions_;
  IpcEvents* const events_;
  const StepJobs step_jobs_;  // the Step's work on its sessions

  std::mutex mu_;
  std::condition_variable stop_sweep_;  // for the sweeper: stopping
  bool stopping_ = false;               // guarded by mu_
  std::thread sweeper_;
};

}  // namespace attention::server
