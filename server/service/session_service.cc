#include "server/service/session_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kernels/quote.h"
#include "kernels/status_macros.h"
#include "server/requests/request_decoder.h"
#include "server/service/attention_service.h"
#include "server/service/shared_memory_service.h"
#include "server/service/wire_buffers.h"
#include "server/sessions/step_jobs.h"

namespace attention::server {

void FillSessionInfo(const SessionSnapshot& s, v1::SessionInfo* info) {
  info->set_session_id(s.id);
  info->set_dtype(ToProtoDType(s.shape.dtype));
  info->set_kv_heads(static_cast<int32_t>(s.shape.heads_kv));
  info->set_head_dim(static_cast<int32_t>(s.shape.head_dim));
  info->set_v_head_dim(static_cast<int32_t>(s.shape.value_head_dim()));
  info->set_v_from_k(s.shape.v_from_k);
  info->set_length(s.length);
  info->set_pages(s.pages);
  info->set_shared_pages(s.shared_pages);
  info->set_resident_bytes(s.resident_bytes);
  info->set_idle_s(absl::ToDoubleSeconds(s.idle));
  info->set_expires_in_s(absl::ToDoubleSeconds(s.expires_in));
  info->set_device(s.device);
  info->set_layers(s.layers);
  for (int64_t length : s.layer_lengths) info->add_layer_lengths(length);
  info->set_prefix_rows(s.prefix_rows);
}

namespace {

// Bytes a StepResponse carries besides its tensors and ids: tags, shapes, timing, device.
constexpr int64_t kResponseOverhead = 1024;
constexpr int64_t kEntryOverhead = 64;

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

// "DTYPE_BFLOAT16, 8 kv heads, head dim 128" (", v head dim 96" where Dv differs): a session's
// shape in an error message.
std::string KvShapeString(const KvShape& shape) {
  return absl::StrCat(DTypeString(ToProtoDType(shape.dtype)), ", ", shape.heads_kv,
                      " kv heads, head dim ", shape.head_dim,
                      shape.value_head_dim() != shape.head_dim
                          ? absl::StrCat(", v head dim ", shape.value_head_dim())
                          : "");
}

// Whether a call may name `layer` (the request's optional layer field) of session `id`, found at
// `place`: a session of several layers needs one, 0..layers-1; one of a single layer takes none
// or 0.
absl::Status CheckLayer(const std::string& id, const SessionStore::Place& place,
                        std::optional<int> layer) {
  if (!layer.has_value()) {
    if (place.layers == 1) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("layer: expected 0..", place.layers - 1,
                                                   " for session ", Quote(id), " of ", place.layers,
                                                   " layers, got none"));
  }
  if (*layer < 0 || *layer >= place.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: expected 0..", place.layers - 1, " for session ", Quote(id), " of ",
                     place.layers, " layer", place.layers == 1 ? "" : "s", ", got ", *layer));
  }
  return absl::OkStatus();
}

// The store's id of the layer a call names of session `id` (CheckLayer's refusals).
absl::StatusOr<std::string> LayerOf(const std::string& id, const SessionStore::Place& place,
                                    std::optional<int> layer) {
  RETURN_IF_ERROR(CheckLayer(id, place, layer));
  return LayerSessionId(id, layer.value_or(0));
}

// Every layer's id of session `id` (one for a session of one layer).
std::vector<std::string> LayerIds(const std::string& id, const SessionStore::Place& place) {
  std::vector<std::string> ids;
  for (int layer = 0; layer < place.layers; ++layer) ids.push_back(LayerSessionId(id, layer));
  return ids;
}

// A Step in stream order: events or counters sent.
bool StreamOrdered(const v1::StepRequest& request) {
  return !request.ready_event().empty() || !request.done_event().empty() ||
         request.has_ready_counter() || request.has_done_counter();
}

}  // namespace

// One Step call: the step's state (its sequences, one per entry) and what answering it needs.
struct SessionService::StepCall final : StepWork {
  const v1::StepRequest* request = nullptr;
  v1::StepResponse* response = nullptr;
  absl::Time arrival;
  // A packed Step's (StepRequest.session_ids) o and lse in the caller's regions (o_ref,
  // lse_ref), else null.
  char* packed_o = nullptr;
  float* packed_lse = nullptr;
  // A packed Step's events in stream order (StepRequest.ready_event, done_event), held open until
  // it is answered; null when not sent.
  std::shared_ptr<void> ready_event, done_event;
  // The store's id of each sequence's session (of the layer the Step names, StepRequest.layer),
  // one after another in one buffer rather than a string each: the sequences' ids, and their
  // jobs' (which outlive the request), are views of it.
  std::string ids;

  bool packed() const { return request->session_ids_size() > 0; }
  std::string QueriesField(int seq) const override {
    return packed() ? "q.shape[2] (queries)" : StepWork::QueriesField(seq);
  }
  // The regions the entries reference, held until the call is answered.
  std::unique_ptr<RequestRegions> refs;
  Finish finish;

  void Finished(StepOutcome outcome) override {
    if (outcome.status.ok()) outcome.status = refs->Intact();
    if (outcome.status.ok()) {
      // Each sequence's length after the step: a packed Step's lengths [B], else its results'.
      if (packed()) response->mutable_lengths()->Reserve(static_cast<int>(seqs.size()));
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (packed()) {
          response->add_lengths(seqs[i].length);
        } else {
          response->mutable_results(static_cast<int>(i))->set_length(seqs[i].length);
        }
      }
      response->set_request_id(request->request_id());
      response->set_device(absl::StrJoin(outcome.devices, ","));
      v1::ServerTiming* timing = response->mutable_timing();
      timing->set_queue_us(absl::ToDoubleMicroseconds(outcome.queued));
      timing->set_h2d_us(outcome.stages.h2d_us);
      timing->set_compute_us(outcome.stages.compute_us);
      timing->set_d2h_us(outcome.stages.d2h_us);
      timing->set_prepare_us(outcome.stages.prepare_us);
      timing->set_run_us(outcome.stages.run_us);
      timing->set_total_us(absl::ToDoubleMicroseconds(absl::Now() - arrival));
    }
    refs.reset();  // first: the regions may be unregistered once the caller has its answer
    std::move(finish)(std::move(outcome.status));
  }
};

SessionService::SessionService(const SessionServiceOptions& options, SessionStore* store,
                               Scheduler* scheduler, const CallGate* gate, RegionRegistry* regions,
                               IpcEvents* events)
    : options_(options),
      limits_{.max_head_dim = options.max_head_dim},
      store_(store),
      scheduler_(scheduler),
      gate_(gate),
      metrics_(gate->metrics()),
      regions_(regions),
      events_(events),
      step_jobs_(store, {.max_request_flops = options.max_request_flops},
                 [metrics = metrics_](const JobResult& result, double flops, int64_t tokens) {
                   metrics->Computed(result.device->name, flops, tokens,
                                     result.leads_batch ? result.batch_size : 0);
                   // A step in stream order answers before it ran: its stages are not measured
                   // (all 0), and not observed.
                   if (const double us = StageSumUs(result.stages); us > 0) {
                     metrics->StagesObserved(result.queued, result.stages);
                     metrics->DecodeStepObserved(result.device->name, absl::Microseconds(us));
                   }
                 }) {
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

template <typename Request, typename Response, typename Messages>
grpc::ServerUnaryReactor* SessionService::Serve(absl::string_view rpc,
                                                grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* raw_request,
                                                grpc::ByteBuffer* raw_response,
                                                Handler<Request, Response> handler) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // The call's messages, kept by its answer until it is given.
  auto messages = std::make_shared<Messages>();
  Admit(
      rpc, context, *raw_request, &messages->request, &messages->response, raw_response,
      [this, handler, context, messages](const std::string& owner, const Arrival& arrival,
                                         Finish finish) {
        (this->*handler)(CallbackCall(context), owner, arrival, messages->request,
                         &messages->response, std::move(finish));
      },
      [reactor, messages](absl::Status status) { reactor->Finish(ToGrpcStatus(status)); });
  return reactor;
}

void SessionService::Admit(absl::string_view rpc, const grpc::ServerContextBase* context,
                           const grpc::ByteBuffer& raw_request, google::protobuf::Message* request,
                           const google::protobuf::Message* response,
                           grpc::ByteBuffer* raw_response, Body body, Finish answer) {
  CallTicket ticket =
      gate_->Admit(rpc, *context, absl::Now(), static_cast<int64_t>(raw_request.Length()));
  absl::Status status = ticket.admission();
  const absl::Time parse_start = absl::Now();
  if (status.ok()) status = ParseByteBuffer(raw_request, request);
  const Arrival arrived{.at = ticket.arrival(), .parse = absl::Now() - parse_start};
  if (status.ok() && store_ == nullptr) {
    status = absl::UnimplementedError(
        "this server keeps no KV cache: its backend has no paged KV pool, or "
        "--kv_cache_fraction is 0");
  }
  Finish finish = [ticket = std::move(ticket), response, raw_response,
                   answer = std::move(answer)](absl::Status status) mutable {
    int64_t response_bytes = 0;
    if (status.ok()) {
      SerializeToByteBuffer(*response, raw_response);
      response_bytes = static_cast<int64_t>(raw_response->Length());
    }
    std::move(ticket).End(std::move(status), response_bytes, std::move(answer));
  };
  if (!status.ok()) return std::move(finish)(std::move(status));
  // Sessions belong to the caller's token (the one the gate accepted); "" without tokens.
  std::move(body)(gate_->auth_token(), arrived, std::move(finish));
}

void SessionService::SubmitDeviceWork(const CallContext& call, int device,
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
  auto kept = std::make_shared<const std::vector<std::string>>(std::move(sessions));
  job.sessions.assign(kept->begin(), kept->end());
  job.keeps = std::move(kept);
  job.deadline = absl::FromChrono(call.grpc->deadline());
  job.cancelled = [cancelled = call.cancelled] { return cancelled(); };
  job.done = [this, finish = std::move(finish)](JobResult result) mutable {
    if (result.status.ok()) metrics_->StagesObserved(result.queued, result.stages);
    std::move(finish)(std::move(result.status));
  };
  scheduler_->Submit(std::move(job));
}

grpc::ServerUnaryReactor* SessionService::CreateSession(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return Serve("CreateSession", context, request, response, &SessionService::RunCreate);
}

grpc::ServerUnaryReactor* SessionService::AppendKv(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return Serve("AppendKv", context, request, response, &SessionService::RunAppend);
}

grpc::ServerUnaryReactor* SessionService::Truncate(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return Serve("Truncate", context, request, response, &SessionService::RunTruncate);
}

grpc::ServerUnaryReactor* SessionService::Fork(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  return Serve("Fork", context, request, response, &SessionService::RunFork);
}

grpc::ServerUnaryReactor* SessionService::Step(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  return Serve<v1::StepRequest, v1::StepResponse, StepMessages>("Step", context, request, response,
                                                                &SessionService::RunStep);
}

grpc::ServerUnaryReactor* SessionService::DropSession(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return Serve("DropSession", context, request, response, &SessionService::RunDrop);
}

grpc::ServerUnaryReactor* SessionService::ListSessions(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Serve("ListSessions", context, request, response, &SessionService::RunList);
}

SessionService::StepMessages::StepMessages()
    : arena(StartingIn(first_block, sizeof(first_block))),
      request(*google::protobuf::Arena::CreateMessage<v1::StepRequest>(&arena)),
      response(*google::protobuf::Arena::CreateMessage<v1::StepResponse>(&arena)) {}

StreamMethod SessionService::StepStreamMethod() {
  return MakeStreamMethod<StepMessages>(
      options_.stream_window,
      [this](const CallContext& call, StreamExchange* exchange, StepMessages* step, Finish done) {
        grpc::ByteBuffer* request = &exchange->request;
        Admit(
            "StepStream", call.grpc, *request, &step->request, &step->response, &exchange->response,
            [this, &call, request, step](const std::string& owner, const Arrival& arrival,
                                         Finish finish) {
              // Parsed (protobuf copied the bytes): give the received slices back.
              request->Clear();
              RunStep(call, owner, arrival, step->request, &step->response, std::move(finish));
            },
            std::move(done));
      });
}

void SessionService::RunDrop(const CallContext&, const std::string& owner, const Arrival&,
                             const v1::DropSessionRequest& request, v1::DropSessionResponse*,
                             Finish finish) {
  std::move(finish)(request.session_id().empty() ? MissingSessionId()
                                                 : store_->Drop(owner, request.session_id()));
}

void SessionService::RunList(const CallContext&, const std::string& owner, const Arrival&,
                             const v1::ListSessionsRequest&, v1::ListSessionsResponse* response,
                             Finish finish) {
  for (const SessionSnapshot& s : store_->List(owner)) FillSessionInfo(s, response->add_sessions());
  const CacheRoom room = store_->Room();
  response->set_page_bytes(room.page_bytes);
  response->set_pages_total(room.pages_total);
  response->set_pages_free(room.pages_free);
  response->set_pages_cached(room.pages_cached);
  std::move(finish)(absl::OkStatus());
}

void SessionService::RunCreate(const CallContext& call, const std::string& owner, const Arrival&,
                               const v1::CreateSessionRequest& request, v1::SessionInfo* response,
                               Finish finish) {
  auto refs = std::make_unique<RequestRegions>(regions_, call.grpc, &gate_->auth_token());
  absl::StatusOr<DecodedCreate> decoded = DecodeCreate(request, limits_, refs.get());
  if (!decoded.ok()) return std::move(finish)(decoded.status());
  const RequestRegions* regions = refs.get();  // held by `finish`, which runs after `run`
  finish = HoldingRegions(std::move(refs), std::move(finish));
  // A prefix goes where it is cached.
  absl::StatusOr<int> device =
      decoded->prefix_tokens.empty()
          ? store_->EmptiestDevice()
          : store_->PrefixDevice(owner, decoded->shape, decoded->layers, decoded->prefix_tokens);
  if (!device.ok()) return std::move(finish)(device.status());
  auto run = [this, owner, decoded = *std::move(decoded), device = *device, response,
              regions]() -> absl::Status {
    absl::StatusOr<SessionStore::Lease> lease = store_->Create(
        owner, decoded.shape, decoded.rows.rows, device, decoded.layers, {}, decoded.prefix_tokens);
    if (!lease.ok()) return lease.status();
    absl::Status status = store_->Append(*lease, decoded.rows);
    // Rows read from a region that shrank meanwhile are not the client's (Intact), nor cached.
    if (status.ok()) status = regions->Intact();
    if (status.ok()) status = store_->NameTokens(*lease, decoded.tokens);
    if (!status.ok()) {
      // The caller never learns the id: remove the session (its pages go when the lease does).
      store_->Drop(owner, lease->id()).IgnoreError();
      return status;
    }
    FillSessionInfo(store_->Snapshot(*lease), response);
    return absl::OkStatus();
  };
  // A new session: no other call can hold it yet.
  SubmitDeviceWork(call, *device, {}, std::move(run), std::move(finish));
}

void SessionService::RunAppend(const CallContext& call, const std::string& owner, const Arrival&,
                               const v1::AppendKvRequest& request, v1::SessionInfo* response,
                               Finish finish) {
  if (request.session_id().empty()) return std::move(finish)(MissingSessionId());
  if (!request.has_k() && !request.has_v()) {
    return std::move(finish)(
        absl::InvalidArgumentError("k: expected a tensor of rows to append, got none"));
  }
  absl::StatusOr<SessionStore::Place> place = store_->Locate(owner, request.session_id());
  if (!place.ok()) return std::move(finish)(place.status());
  absl::StatusOr<std::string> layer_id =
      LayerOf(request.session_id(), *place,
              request.has_layer() ? std::optional<int>(request.layer()) : std::nullopt);
  if (!layer_id.ok()) return std::move(finish)(layer_id.status());
  auto refs = std::make_unique<RequestRegions>(regions_, call.grpc, &gate_->auth_token());
  absl::StatusOr<KvRows> rows = DecodeKvRows("", request.has_k() ? &request.k() : nullptr,
                                             request.has_v() ? &request.v() : nullptr,
                                             request.layout(), place->shape, refs.get());
  if (!rows.ok()) return std::move(finish)(rows.status());
  if (absl::Status tokens = CheckTokens("tokens", request.tokens_size(), rows->rows);
      !tokens.ok()) {
    return std::move(finish)(tokens);
  }
  const RequestRegions* regions = refs.get();  // held by `finish`, which runs after `run`
  finish = HoldingRegions(std::move(refs), std::move(finish));
  auto run = [this, owner, id = *layer_id, rows = *rows, response, regions,
              tokens = std::vector<int64_t>(request.tokens().begin(),
                                            request.tokens().end())]() -> absl::Status {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, {id});
    if (!leases.ok()) return leases.status();
    SessionStore::Lease& lease = leases->front();
    SessionStore::Lease* held[] = {&lease};
    const int64_t new_rows[] = {rows.rows};
    RETURN_IF_ERROR(store_->Reserve(held, new_rows));
    RETURN_IF_ERROR(store_->Append(lease, rows));
    // Rows read from a region that shrank meanwhile are not the client's, nor cached.
    RETURN_IF_ERROR(regions->Intact());
    RETURN_IF_ERROR(store_->NameTokens(lease, tokens));
    FillSessionInfo(store_->Snapshot(lease), response);
    return absl::OkStatus();
  };
  SubmitDeviceWork(call, place->device, {*layer_id}, std::move(run), std::move(finish));
}

void SessionService::SubmitSessionWork(
    const CallContext& call, const std::string& owner, const std::string& id,
    absl::AnyInvocable<absl::Status(std::vector<SessionStore::Lease>&) &&> work, Finish finish,
    SessionStore::Access access) {
  if (id.empty()) return std::move(finish)(MissingSessionId());
  absl::StatusOr<SessionStore::Place> place = store_->Locate(owner, id);
  if (!place.ok()) return std::move(finish)(place.status());
  std::vector<std::string> ids = LayerIds(id, *place);
  auto run = [this, owner, ids, access, work = std::move(work)]() mutable -> absl::Status {
    const std::vector<absl::string_view> layers(ids.begin(), ids.end());
    ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases,
                     store_->Acquire(owner, layers, access));
    return std::move(work)(leases);
  };
  SubmitDeviceWork(call, place->device, std::move(ids), std::move(run), std::move(finish));
}

void SessionService::RunTruncate(const CallContext& call, const std::string& owner, const Arrival&,
                                 const v1::TruncateRequest& request, v1::SessionInfo* response,
                                 Finish finish) {
  SubmitSessionWork(
      call, owner, request.session_id(),
      [this, id = request.session_id(), length = request.length(),
       response](std::vector<SessionStore::Lease>& layers) -> absl::Status {
        // Every layer or none: the length is checked against each before any is cut (one layer:
        // the store's own check says the same).
        for (size_t layer = 0; layer < layers.size() && layers.size() > 1; ++layer) {
          if (length < 0 || length > layers[layer].length()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "length: expected 0..", layers[layer].length(), ", got ", length, " (layer ", layer,
                " of session ", Quote(id), " holds ", layers[layer].length(), " rows)"));
          }
        }
        for (SessionStore::Lease& layer : layers) RETURN_IF_ERROR(store_->Truncate(layer, length));
        FillSessionInfo(store_->Snapshot(layers.front()), response);
        return absl::OkStatus();
      },
      std::move(finish));
}

void SessionService::RunFork(const CallContext& call, const std::string& owner, const Arrival&,
                             const v1::ForkRequest& request, v1::SessionInfo* response,
                             Finish finish) {
  // The child holds the rows of the parent's calls queued before it, and its page copy runs in
  // the device's order.
  const std::optional<int64_t> length =
      request.has_length() ? std::optional<int64_t>(request.length()) : std::nullopt;
  SubmitSessionWork(
      call, owner, request.session_id(),
      [this, length, response](std::vector<SessionStore::Lease>& parents) -> absl::Status {
        ASSIGN_OR_RETURN(SessionStore::Lease child, store_->ForkLayers(parents, length));
        FillSessionInfo(store_->Snapshot(child), response);
        return absl::OkStatus();
      },
      std::move(finish));
}

absl::Status SessionService::DecodeStep(const std::string& owner, const v1::StepRequest& request,
                                        StepCall* call) const {
  RETURN_IF_ERROR(CheckStep(request));
  // Every check that needs no session's length before anything is queued: the sessions' places
  // and shapes never change. A packed Step (session_ids) is cut into one entry per sequence,
  // pointing into its tensors; from there both forms run alike.
  const bool packed = call->packed();
  const int n = packed ? request.session_ids_size() : request.entries_size();
  auto session_id = [&request, packed](int i) -> const std::string& {
    return packed ? request.session_ids(i) : request.entries(i).session_id();
  };
  const std::optional<int> layer =
      request.has_layer() ? std::optional<int>(request.layer()) : std::nullopt;
  // Each sequence's session id, then the store's id of its layer.
  std::vector<absl::string_view> ids;
  ids.reserve(n);
  size_t id_bytes = 0;
  for (int i = 0; i < n; ++i) {
    ids.push_back(session_id(i));
    id_bytes += ids.back().size();
  }
  // Every session's place under one lock of the store; a refusal counts where its entry comes.
  SessionStore::Places located = store_->Locate(owner, ids);
  const std::vector<SessionStore::Place>& places = located.places;
  // The store's ids live in the call; room for all of them is reserved, so the buffer never
  // moves.
  call->ids.reserve(id_bytes + (layer.has_value() ? n * kLayerSuffixBytes : 0));
  for (int i = 0; i < n; ++i) {
    if (i == static_cast<int>(places.size())) return located.refused;
    const SessionStore::Place& place = places[i];
    RETURN_IF_ERROR(CheckLayer(session_id(i), place, layer));
    const size_t at = call->ids.size();
    AppendLayerSessionId(&call->ids, session_id(i), layer.value_or(0));
    ids[i] = absl::string_view(call->ids).substr(at);
    if (packed && i > 0 && !(place.shape == places.front().shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_ids[", i,
                       "]: expected a session of session_ids[0]'s dtype, kv heads and "
                       "head dims (",
                       KvShapeString(places.front().shape), "), got ", KvShapeString(place.shape)));
    }
  }
  std::vector<DecodedEntry> entries;
  StepMemory memory;
  if (packed) {
    ASSIGN_OR_RETURN(DecodedPacked decoded,
                     DecodePackedStep(request, places.front().shape, call->refs.get()));
    entries = std::move(decoded.entries);
    call->packed_o = decoded.o;
    call->packed_lse = decoded.lse;
    ASSIGN_OR_RETURN(memory, DecodeStepMemory(request, places, call));
  } else {
    if (StreamOrdered(request)) {
      return absl::InvalidArgumentError(
          "ready_event, done_event, ready_counter, done_counter: expected only on a packed Step "
          "(session_ids) in CUDA regions, got them on a Step of entries");
    }
    entries.reserve(n);
    for (int i = 0; i < n; ++i) {
      ASSIGN_OR_RETURN(DecodedEntry decoded,
                       DecodeStepEntry(i, request.entries(i), places[i].shape, call->refs.get()));
      RETURN_IF_ERROR(CheckStepTokens(i, request.entries(i), decoded.rows.rows));
      entries.push_back(decoded);
    }
    RETURN_IF_ERROR(CheckEntriesApart(entries));
  }
  call->seqs.reserve(n);
  int64_t response_bytes = kResponseOverhead + static_cast<int64_t>(request.request_id().size());
  // The mask and the open-model options are the request's; only the default scale (the head
  // dim) and the count of sinks (Hq) depend on the entry, so they are decoded again only when
  // those change: once for a packed Step, not once per sequence.
  MaskParams mask;
  OpenModelOptions open;
  std::pair<int64_t, int64_t> decoded_for = {-1, -1};  // (head dim, Hq) of `mask` and `open`
  for (int i = 0; i < n; ++i) {
    const SessionStore::Place& place = places[i];
    const DecodedEntry& decoded = entries[i];
    if (decoded_for != std::pair{place.shape.head_dim, decoded.heads_q}) {
      ASSIGN_OR_RETURN(mask, DecodeMask(request, place.shape.head_dim));
      ASSIGN_OR_RETURN(open, DecodeOpenModelOptions(request, decoded.heads_q));
      decoded_for = {place.shape.head_dim, decoded.heads_q};
    }
    response_bytes += (decoded.o != nullptr ? 0 : decoded.o_bytes) +
                      static_cast<int64_t>(session_id(i).size()) + kEntryOverhead;
    if (request.return_lse() && call->packed_lse == nullptr) {
      response_bytes += decoded.heads_q * decoded.rows_q * int64_t{sizeof(float)};
    }
    call->seqs.push_back(StepSequence{.session_id = ids[i],
                                      .device = place.device,
                                      .key = {.shape = place.shape,
                                              .heads_q = decoded.heads_q,
                                              .softmax_scale = mask.softmax_scale,
                                              .window_left = mask.window_left,
                                              .window_right = mask.window_right,
                                              .lse = request.return_lse(),
                                              .sinks = open.sinks,
                                              .softcap = open.softcap,
                                              .chunk_size = open.chunk_size,
                                              .memory = memory},
                                      .rows = decoded.rows,
                                      .q = decoded.q,
                                      .rows_q = decoded.rows_q,
                                      .o = decoded.o,
                                      .lse = decoded.lse});
    if (!packed) call->seqs.back().tokens = absl::MakeConstSpan(request.entries(i).tokens());
  }
  if (response_bytes > options_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("response would be ", response_bytes,
                                                     " bytes, over the message limit of ",
                                                     options_.max_message_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepMemory> SessionService::DecodeStepMemory(
    const v1::StepRequest& request, const std::vector<SessionStore::Place>& places,
    StepCall* call) const {
  RequestRegions& refs = *call->refs;
  if (refs.cuda_refs() == 0) {
    if (StreamOrdered(request)) {
      return absl::InvalidArgumentError(
          "ready_event, done_event, ready_counter, done_counter: expected only with the Step's "
          "tensors in CUDA regions, got a Step in host memory");
    }
    return StepMemory{};
  }
  // The kernels read and write device memory only: every tensor is there, outputs included (v
  // absent from a Step of sessions whose v is k's first features: v_from_k).
  const int expected =
      2 + (request.has_k() ? 1 : 0) + (request.has_v() ? 1 : 0) + (request.return_lse() ? 1 : 0);
  if (refs.cuda_refs() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("q, k, v, o_ref", request.return_lse() ? ", lse_ref" : "",
                     ": expected every tensor of a Step in CUDA regions or none (o_ref",
                     request.return_lse() ? " and lse_ref" : "", " included), got ",
                     refs.cuda_refs(), " of ", expected, " in CUDA memory"));
  }
  // The kernels of each session's device read and write the regions: every session on theirs.
  const std::string regions_device = absl::StrCat("cuda:", refs.cuda_device());
  const std::vector<const DeviceDescription*> devices = scheduler_->devices();
  for (size_t i = 0; i < places.size(); ++i) {
    const std::string& device = devices[places[i].device]->name;
    if (device != regions_device) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_ids[", i, "]: expected a session on ", regions_device,
                       " (where the Step's CUDA regions are), got one on ", device));
    }
  }
  StepMemory memory{.on_device = true};
  for (const auto& [field, handle, held, event] :
       {std::tuple{"ready_event", &request.ready_event(), &call->ready_event, &memory.ready},
        {"done_event", &request.done_event(), &call->done_event, &memory.done}}) {
    if (handle->empty()) continue;
    if (events_ == nullptr) {
      return absl::UnimplementedError(
          absl::StrCat(field, ": CUDA events are not served by this server"));
    }
    ASSIGN_OR_RETURN(*held, events_->Open(field, *handle, refs.cuda_device()));
    *event = held->get();
  }
  for (const auto& [field, event_field, has, counter, event, ptr, value] :
       {std::tuple{"ready_counter", "ready_event", request.has_ready_counter(),
                   &request.ready_counter(), memory.ready, &memory.ready_counter,
                   &memory.ready_value},
        {"done_counter", "done_event", request.has_done_counter(), &request.done_counter(),
         memory.done, &memory.done_counter, &memory.done_value}}) {
    if (!has) continue;
    if (event != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected a counter or an event on each side, got both (",
                       event_field, " too)"));
    }
    const std::string ref_field = absl::StrCat(field, ".ref");
    if (counter->ref().byte_size() != sizeof(uint64_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          ref_field, ".byte_size: expected 8 (a uint64), got ", counter->ref().byte_size()));
    }
    const int before = refs.cuda_refs();
    ASSIGN_OR_RETURN(char* const at, refs.Resolve(ref_field, counter->ref(), sizeof(uint64_t)));
    if (refs.cuda_refs() == before) {
      return absl::InvalidArgumentError(
          absl::StrCat(ref_field, ": expected a CUDA region on cuda:", refs.cuda_device(),
                       " (the GPU's stream reads and writes the counter), got a system region"));
    }
    *ptr = reinterpret_cast<uint64_t*>(at);
    *value = counter->value();
  }
  return memory;
}

void SessionService::AddResults(const v1::StepRequest& request, StepCall* call,
                                v1::StepResponse* response) {
  std::vector<StepSequence>& seqs = call->seqs;
  const int n = static_cast<int>(seqs.size());
  if (call->packed()) {
    // o [B, Hq, Nq, Dv] and lse [B, Hq, Nq], the response's or the caller's regions'.
    const v1::Tensor& q = request.q();
    const StepSequence& first = seqs.front();
    const int64_t o_bytes = first.key.heads_q * first.rows_q * first.key.shape.value_head_dim() *
                            DTypeSize(first.key.shape.dtype);
    const int64_t lse_floats = first.key.heads_q * first.rows_q;
    v1::Tensor* o = response->mutable_o();
    o->set_dtype(q.dtype());
    o->mutable_shape()->CopyFrom(q.shape());
    o->set_shape(3, first.key.shape.value_head_dim());
    if (call->packed_o == nullptr) o->mutable_data()->resize(n * o_bytes);
    float* lse = call->packed_lse;
    if (request.return_lse() && lse == nullptr) {
      v1::Tensor* lse_tensor = response->mutable_lse();
      lse_tensor->set_dtype(v1::DTYPE_FLOAT32);
      for (int axis = 0; axis < 3; ++axis) lse_tensor->add_shape(q.shape(axis));
      lse_tensor->mutable_data()->resize(n * lse_floats * sizeof(float));
      // std::string storage comes from operator new (or the inline buffer), aligned for float.
      lse = reinterpret_cast<float*>(lse_tensor->mutable_data()->data());
    }
    for (int i = 0; i < n; ++i) {
      if (seqs[i].o == nullptr) seqs[i].o = o->mutable_data()->data() + i * o_bytes;
      if (lse != nullptr) seqs[i].lse = lse + i * lse_floats;
    }
    return;
  }
  // The results in entry order, o shaped as q with Dv for D and lse [Hq, Nq].
  for (int i = 0; i < n; ++i) {
    const v1::Tensor& q = request.entries(i).q();
    StepSequence& seq = seqs[i];
    v1::StepResult* result = response->add_results();
    result->set_session_id(request.entries(i).session_id());
    v1::Tensor* o = result->mutable_o();
    o->set_dtype(q.dtype());
    o->mutable_shape()->CopyFrom(q.shape());
    o->set_shape(2, seq.key.shape.value_head_dim());
    if (seq.o == nullptr) {  // else it goes into a region (o_ref)
      o->mutable_data()->resize(seq.key.heads_q * seq.rows_q * seq.key.shape.value_head_dim() *
                                DTypeSize(seq.key.shape.dtype));
      seq.o = o->mutable_data()->data();
    }
    if (request.return_lse()) {
      v1::Tensor* lse = result->mutable_lse();
      lse->set_dtype(v1::DTYPE_FLOAT32);
      lse->add_shape(seq.key.heads_q);
      lse->add_shape(seq.rows_q);
      lse->mutable_data()->resize(seq.key.heads_q * seq.rows_q * sizeof(float));
      // std::string storage comes from operator new (or the inline buffer), aligned for float.
      seq.lse = reinterpret_cast<float*>(lse->mutable_data()->data());
    }
  }
}

void SessionService::RunStep(const CallContext& call_context, const std::string& owner,
                             const Arrival& arrival, const v1::StepRequest& request,
                             v1::StepResponse* response, Finish finish) {
  auto call = std::make_shared<StepCall>();
  call->arrival = arrival.at;
  call->request = &request;
  call->response = response;
  call->owner = owner;
  // A packed Step's tensors may be in CUDA regions (co-located callers), a Step of entries' not.
  call->refs = std::make_unique<RequestRegions>(regions_, call_context.grpc, &gate_->auth_token(),
                                                /*cuda_inputs=*/request.session_ids_size() > 0);
  if (absl::Status decoded = DecodeStep(owner, request, call.get()); !decoded.ok()) {
    return std::move(finish)(std::move(decoded));
  }
  // Where each sequence's o and lse go; the launches write into them.
  AddResults(request, call.get(), response);
  call->finish = std::move(finish);
  // The step's work on its sessions (sessions/step_jobs.h), queued whole or not at all.
  std::vector<Job> jobs = step_jobs_.Jobs(call, absl::FromChrono(call_context.grpc->deadline()),
                                          call_context.cancelled);
  response->mutable_timing()->set_decode_us(absl::ToDoubleMicroseconds(absl::Now() - arrival.at));
  response->mutable_timing()->set_parse_us(absl::ToDoubleMicroseconds(arrival.parse));
  scheduler_->SubmitAll(std::move(jobs));
}

}  // namespace attention::server
