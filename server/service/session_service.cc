#include "server/service/session_service.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/requests/request_decoder.h"
#include "server/service/attention_service.h"
#include "server/service/security.h"
#include "server/service/shared_memory_service.h"
#include "server/service/wire_buffers.h"
#include "server/sessions/step_plan.h"

namespace attention::server {
namespace {

// Bytes a StepResponse carries besides its tensors and ids: tags, shapes, timing, device.
constexpr int64_t kResponseOverhead = 1024;
constexpr int64_t kEntryOverhead = 64;

void FillInfo(const SessionSnapshot& s, v1::SessionInfo* info) {
  info->set_session_id(s.id);
  info->set_dtype(ToProtoDType(s.shape.dtype));
  info->set_kv_heads(static_cast<int32_t>(s.shape.heads_kv));
  info->set_head_dim(static_cast<int32_t>(s.shape.head_dim));
  info->set_length(s.length);
  info->set_pages(s.pages);
  info->set_resident_bytes(s.resident_bytes);
  info->set_idle_s(absl::ToDoubleSeconds(s.idle));
  info->set_expires_in_s(absl::ToDoubleSeconds(s.expires_in));
  info->set_device(s.device);
}

absl::Status MissingSessionId() {
  return absl::InvalidArgumentError("session_id: expected a session id, got none");
}

double StageSumUs(const StageTimes& t) { return t.h2d_us + t.compute_us + t.d2h_us; }

// `finish`, releasing `refs` (the regions a call references) before it answers. The call's `run`
// checks them (RequestRegions::Intact) once it has read them.
absl::AnyInvocable<void(absl::Status) &&> HoldingRegions(
    std::unique_ptr<RequestRegions> refs, absl::AnyInvocable<void(absl::Status) &&> finish) {
  return [refs = std::move(refs), finish = std::move(finish)](absl::Status status) mutable {
    refs.reset();
    std::move(finish)(std::move(status));
  };
}

// Arena options whose first block is `block` (the arena never frees it).
google::protobuf::ArenaOptions StartingIn(char* block, size_t size) {
  google::protobuf::ArenaOptions options;
  options.initial_block = block;
  options.initial_block_size = size;
  return options;
}

}  // namespace

// One Step call: its entries checked against their sessions' shapes, grouped into decode jobs.
// Shared by the call's jobs; the last one to answer finishes the call.
struct SessionService::StepCall {
  // The entries of one device and decode key: one decode job.
  struct Group {
    int device = 0;
    DecodeKey key;
    std::vector<int> entries;
    // From the job's prepare to its answer: the sessions held and the sequences launched.
    std::vector<SessionStore::Lease> leases;
    std::vector<DecodeSequence> seqs;
  };

  const v1::StepRequest* request = nullptr;
  v1::StepResponse* response = nullptr;
  std::string owner;
  absl::Time arrival;
  std::vector<DecodedEntry> entries;  // per request entry
  // The regions the entries reference, held until the call is answered.
  std::unique_ptr<RequestRegions> refs;
  std::vector<Group> groups;
  Finish finish;

  std::mutex mu;  // guards the rest
  int pending = 0;
  absl::Status status;  // the first job's failure
  StageTimes stages;    // summed over the jobs
  absl::Duration queued;
  std::vector<std::string> devices;
};

SessionService::SessionService(const SessionServiceOptions& options, SessionStore* store,
                               Scheduler* scheduler, Metrics* metrics, DrainGate* drain,
                               RegionRegistry* regions)
    : options_(options),
      limits_{.max_head_dim = options.max_head_dim},
      store_(store),
      scheduler_(scheduler),
      metrics_(metrics),
      drain_(drain),
      regions_(regions) {
  if (store_ != nullptr) sweeper_ = std::thread([this] { SweeperLoop(); });
}

SessionService::~SessionService() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_sweep_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
}

void SessionService::SweeperLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_sweep_.wait_for(lock, absl::ToChronoNanoseconds(options_.sweep_interval),
                               [this] { return stopping_; })) {
    lock.unlock();
    store_->Sweep();
    lock.lock();
  }
}

template <typename Request, typename Response>
grpc::ServerUnaryReactor* SessionService::Serve(
    absl::string_view rpc, grpc::CallbackServerContext* context,
    const grpc::ByteBuffer* raw_request, grpc::ByteBuffer* raw_response,
    absl::AnyInvocable<void(const Request& request, Response* response, const std::string& owner,
                            const Arrival& arrival, Finish finish) &&>
        body) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The call's messages, kept by its answer until it is given.
  auto messages = std::make_shared<std::pair<Request, Response>>();
  Admit(
      rpc, context, *raw_request, &messages->first, &messages->second, raw_response,
      [messages, body = std::move(body)](const std::string& owner, const Arrival& arrival,
                                         Finish finish) mutable {
        std::move(body)(messages->first, &messages->second, owner, arrival, std::move(finish));
      },
      [reactor, messages](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

void SessionService::Admit(absl::string_view rpc, const grpc::ServerContextBase* context,
                           const grpc::ByteBuffer& raw_request, google::protobuf::Message* request,
                           const google::protobuf::Message* response,
                           grpc::ByteBuffer* raw_response, Body body, Finish answer) {
  const absl::Time arrival = absl::Now();
  const int64_t request_bytes = static_cast<int64_t>(raw_request.Length());
  metrics_->RequestStarted();
  absl::Status status = CheckBearerToken(context->client_metadata(), options_.auth_token);
  const bool entered = status.ok() && drain_->Enter();
  const bool refused = status.ok() && !entered;
  if (refused) status = absl::UnavailableError("server is shutting down");
  const absl::Time parse_start = absl::Now();
  if (status.ok()) status = ParseByteBuffer(raw_request, request);
  const Arrival arrived{.at = arrival, .parse = absl::Now() - parse_start};
  if (status.ok() && store_ == nullptr) {
    status = absl::UnimplementedError(
        "this server keeps no KV cache: its backend has no paged KV pool, or "
        "--kv_cache_fraction is 0");
  }
  Finish finish = [this, rpc, arrival, request_bytes, response, raw_response, entered,
                   answer = std::move(answer)](absl::Status status) mutable {
    int64_t response_bytes = 0;
    if (status.ok()) {
      SerializeToByteBuffer(*response, raw_response);
      response_bytes = static_cast<int64_t>(raw_response->Length());
    }
    metrics_->RequestFinished(rpc, status.code(), absl::Now() - arrival, request_bytes,
                              response_bytes);
    std::move(answer)(std::move(status));
    if (entered) drain_->Leave();
  };
  if (refused) {
    drain_->Refuse([finish = std::move(finish), status = std::move(status)]() mutable {
      std::move(finish)(std::move(status));
    });
    return;
  }
  if (!status.ok()) return std::move(finish)(std::move(status));
  // Sessions belong to the caller's token (the one the check above accepted); "" without tokens.
  std::move(body)(options_.auth_token, arrived, std::move(finish));
}

void SessionService::SubmitDeviceWork(grpc::CallbackServerContext* context, int device,
                                      std::vector<std::string> sessions,
                                      absl::AnyInvocable<absl::Status() &&> run, Finish finish) {
  Job job;
  job.work = DeviceWork{.run = [run = std::move(run)]() mutable -> absl::StatusOr<StageTimes> {
    // Writing K/V into the device's pool is its host-to-device stage.
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(std::move(run)());
    return StageTimes{.h2d_us = absl::ToDoubleMicroseconds(absl::Now() - start)};
  }};
  job.device = device;
  job.sessions = std::move(sessions);
  job.deadline = absl::FromChrono(context->deadline());
  job.cancelled = [context] { return context->IsCancelled(); };
  job.done = [this, finish = std::move(finish)](JobResult result) mutable {
    if (result.status.ok()) metrics_->StagesObserved(result.queued, result.stages);
    std::move(finish)(std::move(result.status));
  };
  scheduler_->Submit(std::move(job));
}

grpc::ServerUnaryReactor* SessionService::CreateSession(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return Serve<v1::CreateSessionRequest, v1::SessionInfo>(
      "CreateSession", context, request, response,
      [this, context](const v1::CreateSessionRequest& request, v1::SessionInfo* response,
                      const std::string& owner, const Arrival&, Finish finish) {
        RunCreate(context, owner, request, response, std::move(finish));
      });
}

grpc::ServerUnaryReactor* SessionService::AppendKv(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return Serve<v1::AppendKvRequest, v1::SessionInfo>(
      "AppendKv", context, request, response,
      [this, context](const v1::AppendKvRequest& request, v1::SessionInfo* response,
                      const std::string& owner, const Arrival&, Finish finish) {
        RunAppend(context, owner, request, response, std::move(finish));
      });
}

grpc::ServerUnaryReactor* SessionService::Step(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  return Serve<v1::StepRequest, v1::StepResponse>(
      "Step", context, request, response,
      [this, context](const v1::StepRequest& request, v1::StepResponse* response,
                      const std::string& owner, const Arrival& arrival, Finish finish) {
        RunStep(CallbackCall(context), owner, arrival, request, response, std::move(finish));
      });
}

SessionService::StepMessages::StepMessages()
    : arena(StartingIn(first_block, sizeof(first_block))),
      request(*google::protobuf::Arena::CreateMessage<v1::StepRequest>(&arena)),
      response(*google::protobuf::Arena::CreateMessage<v1::StepResponse>(&arena)) {}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* SessionService::StepStream(
    grpc::CallbackServerContext* context) {
  return StreamReactor<StepMessages>::Begin(options_.stream_window,
                                            StepStreamProcess(CallbackCall(context)));
}

StreamProcess<SessionService::StepMessages> SessionService::StepStreamProcess(CallContext call) {
  return [this, call = std::move(call)](grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                        StepMessages* step, Finish done) {
    Admit(
        "StepStream", call.grpc, *request, &step->request, &step->response, response,
        [this, &call, request, step](const std::string& owner, const Arrival& arrival,
                                     Finish finish) {
          // Parsed (protobuf copied the bytes): give the received slices back.
          request->Clear();
          RunStep(call, owner, arrival, step->request, &step->response, std::move(finish));
        },
        std::move(done));
  };
}

grpc::ServerUnaryReactor* SessionService::DropSession(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return Serve<v1::DropSessionRequest, v1::DropSessionResponse>(
      "DropSession", context, request, response,
      [this](const v1::DropSessionRequest& request, v1::DropSessionResponse*,
             const std::string& owner, const Arrival&, Finish finish) {
        std::move(finish)(request.session_id().empty() ? MissingSessionId()
                                                       : store_->Drop(owner, request.session_id()));
      });
}

grpc::ServerUnaryReactor* SessionService::ListSessions(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Serve<v1::ListSessionsRequest, v1::ListSessionsResponse>(
      "ListSessions", context, request, response,
      [this](const v1::ListSessionsRequest&, v1::ListSessionsResponse* response,
             const std::string& owner, const Arrival&, Finish finish) {
        for (const SessionSnapshot& s : store_->List(owner)) {
          FillInfo(s, response->add_sessions());
        }
        const CacheRoom room = store_->Room();
        response->set_page_bytes(room.page_bytes);
        response->set_pages_total(room.pages_total);
        response->set_pages_free(room.pages_free);
        std::move(finish)(absl::OkStatus());
      });
}

void SessionService::RunCreate(grpc::CallbackServerContext* context, const std::string& owner,
                               const v1::CreateSessionRequest& request, v1::SessionInfo* response,
                               Finish finish) {
  auto refs = std::make_unique<RequestRegions>(regions_, context, &options_.auth_token);
  absl::StatusOr<DecodedCreate> decoded = DecodeCreate(request, limits_, refs.get());
  if (!decoded.ok()) return std::move(finish)(decoded.status());
  const RequestRegions* regions = refs.get();  // held by `finish`, which runs after `run`
  finish = HoldingRegions(std::move(refs), std::move(finish));
  absl::StatusOr<int> device = store_->EmptiestDevice();
  if (!device.ok()) return std::move(finish)(device.status());
  auto run = [this, owner, decoded = *decoded, device = *device, response,
              regions]() -> absl::Status {
    absl::StatusOr<SessionStore::Lease> lease =
        store_->Create(owner, decoded.shape, decoded.rows.rows, device);
    if (!lease.ok()) return lease.status();
    absl::Status status = store_->Append(*lease, decoded.rows);
    // Rows read from a region that shrank meanwhile are not the client's (Intact).
    if (status.ok()) status = regions->Intact();
    if (!status.ok()) {
      // The caller never learns the id: remove the session (its pages go when the lease does).
      store_->Drop(owner, lease->id()).IgnoreError();
      return status;
    }
    FillInfo(store_->Snapshot(*lease), response);
    return absl::OkStatus();
  };
  // A new session: no other call can hold it yet.
  SubmitDeviceWork(context, *device, {}, std::move(run), std::move(finish));
}

void SessionService::RunAppend(grpc::CallbackServerContext* context, const std::string& owner,
                               const v1::AppendKvRequest& request, v1::SessionInfo* response,
                               Finish finish) {
  if (request.session_id().empty()) return std::move(finish)(MissingSessionId());
  if (!request.has_k() && !request.has_v()) {
    return std::move(finish)(
        absl::InvalidArgumentError("k: expected a tensor of rows to append, got none"));
  }
  absl::StatusOr<SessionStore::Place> place = store_->Locate(owner, request.session_id());
  if (!place.ok()) return std::move(finish)(place.status());
  auto refs = std::make_unique<RequestRegions>(regions_, context, &options_.auth_token);
  absl::StatusOr<KvRows> rows = DecodeKvRows("", request.has_k() ? &request.k() : nullptr,
                                             request.has_v() ? &request.v() : nullptr,
                                             request.layout(), place->shape, refs.get());
  if (!rows.ok()) return std::move(finish)(rows.status());
  const RequestRegions* regions = refs.get();  // held by `finish`, which runs after `run`
  finish = HoldingRegions(std::move(refs), std::move(finish));
  auto run = [this, owner, id = request.session_id(), rows = *rows, response,
              regions]() -> absl::Status {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    if (!leases.ok()) return leases.status();
    SessionStore::Lease& lease = leases->front();
    SessionStore::Lease* held[] = {&lease};
    const int64_t new_rows[] = {rows.rows};
    RETURN_IF_ERROR(store_->Reserve(held, new_rows));
    RETURN_IF_ERROR(store_->Append(lease, rows));
    // Rows read from a region that shrank meanwhile are not the client's.
    RETURN_IF_ERROR(regions->Intact());
    FillInfo(store_->Snapshot(lease), response);
    return absl::OkStatus();
  };
  SubmitDeviceWork(context, place->device, {request.session_id()}, std::move(run),
                   std::move(finish));
}

void SessionService::RunStep(const CallContext& call_context, const std::string& owner,
                             const Arrival& arrival, const v1::StepRequest& request,
                             v1::StepResponse* response, Finish finish) {
  if (absl::Status status = CheckStep(request); !status.ok()) {
    return std::move(finish)(std::move(status));
  }
  auto call = std::make_shared<StepCall>();
  call->arrival = arrival.at;
  call->request = &request;
  call->response = response;
  call->owner = owner;
  call->refs = std::make_unique<RequestRegions>(regions_, call_context.grpc, &options_.auth_token);
  // Every check that needs no session's length before anything is queued: the sessions' places
  // and shapes never change.
  const int n = request.entries_size();
  int64_t response_bytes = kResponseOverhead + static_cast<int64_t>(request.request_id().size());
  for (int i = 0; i < n; ++i) {
    const v1::StepEntry& entry = request.entries(i);
    absl::StatusOr<SessionStore::Place> place = store_->Locate(owner, entry.session_id());
    if (!place.ok()) return std::move(finish)(place.status());
    absl::StatusOr<DecodedEntry> decoded =
        DecodeStepEntry(i, entry, place->shape, call->refs.get());
    if (!decoded.ok()) return std::move(finish)(decoded.status());
    absl::StatusOr<MaskParams> mask = DecodeMask(request, place->shape.head_dim);
    if (!mask.ok()) return std::move(finish)(mask.status());
    absl::StatusOr<OpenModelOptions> open = DecodeOpenModelOptions(request, decoded->heads_q);
    if (!open.ok()) return std::move(finish)(open.status());
    const int64_t o_bytes = decoded->heads_q * decoded->rows_q * place->shape.head_dim *
                            static_cast<int64_t>(DTypeSize(place->shape.dtype));
    response_bytes += (decoded->o != nullptr ? 0 : o_bytes) +
                      static_cast<int64_t>(entry.session_id().size()) + kEntryOverhead;
    if (request.return_lse()) {
      response_bytes += decoded->heads_q * decoded->rows_q * int64_t{sizeof(float)};
    }
    const DecodeKey key{.shape = place->shape,
                        .heads_q = decoded->heads_q,
                        .softmax_scale = mask->softmax_scale,
                        .window_left = mask->window_left,
                        .window_right = mask->window_right,
                        .lse = request.return_lse(),
                        .sinks = open->sinks,
                        .softcap = open->softcap,
                        .chunk_size = open->chunk_size};
    auto group = std::find_if(call->groups.begin(), call->groups.end(), [&](const auto& g) {
      return g.device == place->device && g.key == key;
    });
    if (group == call->groups.end()) {
      call->groups.push_back(StepCall::Group{.device = place->device, .key = key});
      group = call->groups.end() - 1;
    }
    group->entries.push_back(i);
    call->entries.push_back(*decoded);
  }
  if (response_bytes > options_.max_message_bytes) {
    return std::move(finish)(absl::ResourceExhaustedError(
        absl::StrCat("response would be ", response_bytes, " bytes, over the message limit of ",
                     options_.max_message_bytes, " bytes")));
  }
  // The results in entry order, o shaped as q (and lse [Hq, Nq]); the launches write into them.
  for (int i = 0; i < n; ++i) {
    const v1::Tensor& q = request.entries(i).q();
    v1::StepResult* result = response->add_results();
    result->set_session_id(request.entries(i).session_id());
    v1::Tensor* o = result->mutable_o();
    o->set_dtype(q.dtype());
    o->mutable_shape()->CopyFrom(q.shape());
    if (call->entries[i].o == nullptr) {  // else it goes into a region (o_ref)
      o->mutable_data()->resize(call->entries[i].heads_q * call->entries[i].rows_q * q.shape(2) *
                                DTypeSize(*ToDType(q.dtype(), "q.dtype")));
    }
    if (request.return_lse()) {
      v1::Tensor* lse = result->mutable_lse();
      lse->set_dtype(v1::DTYPE_FLOAT32);
      lse->add_shape(call->entries[i].heads_q);
      lse->add_shape(call->entries[i].rows_q);
      lse->mutable_data()->resize(call->entries[i].heads_q * call->entries[i].rows_q *
                                  sizeof(float));
    }
  }
  call->finish = std::move(finish);
  call->pending = static_cast<int>(call->groups.size());

  std::vector<Job> jobs;
  for (size_t g = 0; g < call->groups.size(); ++g) {
    StepCall::Group& group = call->groups[g];
    Job job;
    job.device = group.device;
    for (int i : group.entries) job.sessions.push_back(request.entries(i).session_id());
    // On the worker: take the sessions, check the queries against their lengths, append the new
    // rows (all or nothing for the group), and give the launch its sequences.
    auto prepare = [this, call, &group]() -> absl::StatusOr<std::vector<DecodeSequence>> {
      const v1::StepRequest& request = *call->request;
      std::vector<std::string> ids;
      for (int i : group.entries) ids.push_back(request.entries(i).session_id());
      absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(call->owner, ids);
      if (!leases.ok()) return leases.status();
      std::vector<SessionStore::Lease*> held;
      std::vector<int64_t> new_rows;
      std::vector<KvRows> rows;
      double flops = 0;
      for (size_t s = 0; s < group.entries.size(); ++s) {
        const DecodedEntry& entry = call->entries[group.entries[s]];
        const int64_t length = (*leases)[s].length();
        RETURN_IF_ERROR(CheckQueriesFit(group.entries[s], entry, length));
        flops +=
            DecodeFlops(group.key, {.length = length + entry.rows.rows, .rows_q = entry.rows_q});
        held.push_back(&(*leases)[s]);
        new_rows.push_back(entry.rows.rows);
        rows.push_back(entry.rows);
      }
      if (options_.max_request_flops > 0 && flops > options_.max_request_flops) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "step needs ", absl::SixDigits(flops), " FLOPs on ", store_->device_name(group.device),
            ", over the limit of ", absl::SixDigits(options_.max_request_flops),
            " per request (--max_request_flops); nothing was appended"));
      }
      RETURN_IF_ERROR(store_->Reserve(held, new_rows));
      RETURN_IF_ERROR(store_->Append(held, rows));
      for (size_t s = 0; s < group.entries.size(); ++s) {
        const int i = group.entries[s];
        const SessionStore::Lease& lease = (*leases)[s];
        v1::StepResult* result = call->response->mutable_results(i);
        result->set_length(lease.length());
        group.seqs.push_back(DecodeSequence{
            .pages = lease.page_table(),
            .length = lease.length(),
            .q = call->entries[i].q,
            .rows_q = call->entries[i].rows_q,
            .o = call->entries[i].o != nullptr ? call->entries[i].o
                                               : result->mutable_o()->mutable_data()->data(),
            // std::string storage comes from operator new (or the inline buffer), aligned for
            // float.
            .lse = request.return_lse()
                       ? reinterpret_cast<float*>(result->mutable_lse()->mutable_data()->data())
                       : nullptr});
      }
      group.leases = *std::move(leases);
      return group.seqs;
    };
    job.work = DecodeWork{.key = group.key, .prepare = std::move(prepare)};
    job.deadline = absl::FromChrono(call_context.grpc->deadline());
    job.cancelled = [cancelled = call_context.cancelled] { return cancelled(); };
    job.done = [this, call, &group](JobResult result) {
      group.leases.clear();  // first: the sessions' next calls may run
      if (result.status.ok()) {
        double flops = 0;
        int64_t tokens = 0;
        for (const DecodeSequence& seq : group.seqs) {
          flops += DecodeFlops(group.key, seq);
          tokens += seq.rows_q;
        }
        metrics_->StagesObserved(result.queued, result.stages);
        metrics_->Computed(result.device->name, flops, tokens,
                           result.leads_batch ? result.batch_size : 0);
        metrics_->DecodeStepObserved(result.device->name,
                                     absl::Microseconds(StageSumUs(result.stages)));
      }
      bool last = false;
      {
        std::lock_guard<std::mutex> lock(call->mu);
        if (!result.status.ok() && call->status.ok()) call->status = result.status;
        call->stages.h2d_us += result.stages.h2d_us;
        call->stages.compute_us += result.stages.compute_us;
        call->stages.d2h_us += result.stages.d2h_us;
        call->stages.prepare_us += result.stages.prepare_us;
        call->stages.run_us += result.stages.run_us;
        call->queued = std::max(call->queued, result.queued);
        if (result.device != nullptr && std::find(call->devices.begin(), call->devices.end(),
                                                  result.device->name) == call->devices.end()) {
          call->devices.push_back(result.device->name);
        }
        last = --call->pending == 0;
      }
      if (!last) return;
      if (call->status.ok()) call->status = call->refs->Intact();
      v1::StepResponse* response = call->response;
      if (call->status.ok()) {
        response->set_request_id(call->request->request_id());
        response->set_device(absl::StrJoin(call->devices, ","));
        v1::ServerTiming* timing = response->mutable_timing();
        timing->set_queue_us(absl::ToDoubleMicroseconds(call->queued));
        timing->set_h2d_us(call->stages.h2d_us);
        timing->set_compute_us(call->stages.compute_us);
        timing->set_d2h_us(call->stages.d2h_us);
        timing->set_prepare_us(call->stages.prepare_us);
        timing->set_run_us(call->stages.run_us);
        timing->set_total_us(absl::ToDoubleMicroseconds(absl::Now() - call->arrival));
      }
      call->refs.reset();  // first: the regions may be unregistered once the caller has its answer
      std::move(call->finish)(call->status);
    };
    jobs.push_back(std::move(job));
  }
  response->mutable_timing()->set_decode_us(
      absl::ToDoubleMicroseconds(absl::Now() - call->arrival));
  response->mutable_timing()->set_parse_us(absl::ToDoubleMicroseconds(arrival.parse));
  scheduler_->SubmitAll(std::move(jobs));
}

}  // namespace attention::server
