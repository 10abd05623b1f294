#include "client/session.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attention::client {

absl::string_view SessionOwner(absl::string_view id) {
  const size_t dot = id.find('.');
  return dot == absl::string_view::npos ? absl::string_view() : id.substr(0, dot);
}

bool IsSealed(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         absl::StrContains(status.error_message(), kSealedMarker);
}

namespace {

// The client's channel, unless it balances calls over several servers: a session lives on one.
std::shared_ptr<grpc::Channel> SessionChannel(const Client& client) {
  const ClientOptions& options = client.options();
  const bool several = ChannelTarget(options.target).find(',') != std::string::npos;
  if (!several || options.load_balancing == "pick_first") return client.channel();
  ClientOptions sticky = options;
  sticky.load_balancing = "pick_first";
  return grpc::CreateCustomChannel(ChannelTarget(sticky.target), ChannelCredentials(sticky),
                                   MakeChannelArguments(sticky));
}

// k and v together, or k alone (a session whose v is k's first features: the server refuses it
// for any other, naming the field).
absl::Status CheckPair(const v1::Tensor* k, const v1::Tensor* v) {
  if (k == nullptr && v != nullptr) {
    return absl::InvalidArgumentError("k and v go together: give both, k alone or neither");
  }
  return absl::OkStatus();
}

StepOutput ToOutput(v1::StepResult& result) {
  return StepOutput{std::move(*result.mutable_o()), std::move(*result.mutable_lse()),
                    result.length()};
}

// The options every Step request carries, entries or packed.
void SetStepOptions(const StepOptions& options, v1::StepRequest* request) {
  request->set_causal(options.causal);
  if (options.softmax_scale) request->set_softmax_scale(*options.softmax_scale);
  if (options.window_left) request->set_window_left(*options.window_left);
  if (options.window_right) request->set_window_right(*options.window_right);
  request->set_return_lse(options.return_lse);
  if (options.layer) request->set_layer(*options.layer);
}

}  // namespace

Session::Session(Session&& other) noexcept
    : client_(other.client_),
      id_(std::exchange(other.id_, "")),
      spec_(other.spec_),
      length_(other.length_),
      layer_lengths_(std::move(other.layer_lengths_)),
      prefix_rows_(other.prefix_rows_) {}

Session& Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    if (!id_.empty()) Drop().IgnoreError();
    client_ = other.client_;
    id_ = std::exchange(other.id_, "");
    spec_ = other.spec_;
    length_ = other.length_;
    layer_lengths_ = std::move(other.layer_lengths_);
    prefix_rows_ = other.prefix_rows_;
  }
  return *this;
}

void Session::SetInfo(const v1::SessionInfo& info) {
  length_ = info.length();
  if (info.layers() > 1) {
    layer_lengths_.assign(info.layer_lengths().begin(), info.layer_lengths().end());
  } else {
    layer_lengths_.assign(1, info.length());
  }
}

void Session::SetLength(int64_t length, std::optional<int32_t> layer) {
  const auto at = static_cast<size_t>(layer.value_or(0));
  if (at >= layer_lengths_.size()) layer_lengths_.resize(at + 1, length);
  layer_lengths_[at] = length;
  length_ = *std::min_element(layer_lengths_.begin(), layer_lengths_.end());
}

Session::~Session() {
  // Best effort: an expired session or a gone server leaves nothing to free.
  if (!id_.empty()) Drop().IgnoreError();
}

absl::Status Session::Append(const v1::Tensor& k, const v1::Tensor& v, const CallOptions& call) {
  return AppendRows(k, &v, {}, std::nullopt, call);
}

absl::Status Session::Append(const v1::Tensor& k, const v1::Tensor& v, int32_t layer,
                             const CallOptions& call) {
  return AppendRows(k, &v, {}, layer, call);
}

absl::Status Session::Append(const v1::Tensor& k, const v1::Tensor& v,
                             absl::Span<const int64_t> tokens, std::optional<int32_t> layer,
                             const CallOptions& call) {
  return AppendRows(k, &v, tokens, layer, call);
}

absl::Status Session::AppendK(const v1::Tensor& k, std::optional<int32_t> layer,
                              const CallOptions& call) {
  return AppendRows(k, nullptr, {}, layer, call);
}

absl::Status Session::AppendRows(const v1::Tensor& k, const v1::Tensor* v,
                                 absl::Span<const int64_t> tokens, std::optional<int32_t> layer,
                                 const CallOptions& call) {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  v1::AppendKvRequest request;
  request.set_session_id(id_);
  request.set_layout(spec_.layout);
  if (layer) request.set_layer(*layer);
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  *request.mutable_k() = k;
  if (v != nullptr) *request.mutable_v() = *v;
  return Update(&v1::Sessions::Stub::AppendKv, request, call);
}

absl::Status Session::Truncate(int64_t length, const CallOptions& call) {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  v1::TruncateRequest request;
  request.set_session_id(id_);
  request.set_length(length);
  return Update(&v1::Sessions::Stub::Truncate, request, call);
}

absl::StatusOr<Session> Session::Fork(std::optional<int64_t> length, const CallOptions& call) {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  v1::ForkRequest request;
  request.set_session_id(id_);
  if (length) request.set_length(*length);
  v1::SessionInfo info;
  if (absl::Status status = ToAbslStatus(client_->OwnerCall(SessionOwner(id_), call,
                                                            [&](grpc::ClientContext* context) {
                                                              return client_->stub().Fork(
                                                                  context, request, &info);
                                                            }));
      !status.ok()) {
    return status;
  }
  return Session(client_, info.session_id(), spec_, info);
}

absl::Status Session::Export(absl::FunctionRef<absl::Status(const v1::SessionChunk&)> each,
                             int64_t chunk_rows, const CallOptions& call, bool seal) const {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  return client_->Export(id_, each, chunk_rows, call, seal);
}

absl::StatusOr<Session> Session::MoveTo(SessionClient& other, int64_t chunk_rows,
                                        const CallOptions& call, bool seal) {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  absl::StatusOr<Session> moved =
      client_->CopyTo(id_, other, {.layout = spec_.layout}, chunk_rows, call, seal);
  if (!moved.ok()) return moved.status();
  if (absl::Status status = Drop(call); !status.ok()) return status;
  return moved;
}

SessionImport::~SessionImport() {
  if (writer_ != nullptr) {
    context_->TryCancel();
    Close().IgnoreError();
  }
}

absl::Status SessionImport::Close() {
  absl::Status status = ToAbslStatus(writer_->Finish());
  writer_.reset();
  return status;
}

absl::Status SessionImport::Write(const v1::SessionChunk& chunk) {
  if (writer_ == nullptr) return absl::FailedPreconditionError("the import has ended");
  bool written;
  if (std::exchange(first_, false) && options_.session_id.has_value()) {
    v1::SessionChunk header = chunk;
    header.mutable_header()->set_session_id(*options_.session_id);
    written = writer_->Write(header);
  } else {
    written = writer_->Write(chunk);
  }
  if (written) return absl::OkStatus();
  // The server ended the call: its status says why.
  absl::Status status = Close();
  return status.ok() ? absl::UnavailableError("the import stream closed") : status;
}

absl::StatusOr<Session> SessionImport::Finish() {
  if (writer_ == nullptr) return absl::FailedPreconditionError("the import has ended");
  writer_->WritesDone();
  if (absl::Status status = Close(); !status.ok()) return status;
  const SessionSpec spec{.dtype = info_->dtype(),
                         .kv_heads = info_->kv_heads(),
                         .head_dim = info_->head_dim(),
                         .layout = options_.layout,
                         .layers = std::max(1, info_->layers()),
                         .v_head_dim = info_->v_head_dim(),
                         .v_from_k = info_->v_from_k()};
  return Session(client_, info_->session_id(), spec, *info_);
}

template <typename Request>
absl::Status Session::Update(grpc::Status (v1::Sessions::Stub::*rpc)(grpc::ClientContext*,
                                                                     const Request&,
                                                                     v1::SessionInfo*),
                             const Request& request, const CallOptions& call) {
  v1::SessionInfo info;
  absl::Status status =
      ToAbslStatus(client_->OwnerCall(SessionOwner(id_), call, [&](grpc::ClientContext* context) {
        return (client_->stub().*rpc)(context, request, &info);
      }));
  if (status.ok()) SetInfo(info);
  return status;
}

absl::StatusOr<StepOutput> Session::Step(const v1::Tensor& q, const StepOptions& options,
                                         const v1::Tensor* k, const v1::Tensor* v,
                                         const CallOptions& call) {
  const StepItem item{this, &q, k, v};
  absl::StatusOr<std::vector<StepOutput>> outputs =
      client_->StepMany(absl::MakeConstSpan(&item, 1), options, call);
  if (!outputs.ok()) return outputs.status();
  return std::move(outputs->front());
}

absl::Status Session::Drop(const CallOptions& call) {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  absl::Status status = client_->Drop(id_, call);
  // Whatever the answer, this object stops claiming the session: NOT_FOUND means it is gone
  // already, and other errors leave it to expire on the server.
  id_.clear();
  return status;
}

absl::StatusOr<v1::SessionInfo> Session::Info(const CallOptions& call) const {
  if (id_.empty()) return absl::FailedPreconditionError("the session was dropped or released");
  absl::StatusOr<v1::ListSessionsResponse> list = client_->ListOn(SessionOwner(id_), call);
  if (!list.ok()) return list.status();
  for (const v1::SessionInfo& info : list->sessions()) {
    if (info.session_id() == id_) return info;
  }
  return absl::NotFoundError(absl::StrCat("session ", id_, " is not on the server"));
}

std::string Session::Release() { return std::exchange(id_, ""); }

SessionClient::SessionClient(const Client& client)
    : client_(client), channel_(SessionChannel(client)), stub_(v1::Sessions::NewStub(channel_)) {}

absl::StatusOr<Session> SessionClient::Create(const SessionSpec& spec, const v1::Tensor* k,
                                              const v1::Tensor* v, const CallOptions& call) {
  return CreateSession(spec, k, v, {}, {}, call);
}

absl::StatusOr<Session> SessionClient::Create(const SessionSpec& spec, const v1::Tensor& k,
                                              const v1::Tensor& v, absl::Span<const int64_t> tokens,
                                              const CallOptions& call) {
  return CreateSession(spec, &k, &v, tokens, {}, call);
}

absl::StatusOr<Session> SessionClient::CreateFromPrefix(const SessionSpec& spec,
                                                        absl::Span<const int64_t> prefix_tokens,
                                                        const CallOptions& call) {
  return CreateSession(spec, nullptr, nullptr, {}, prefix_tokens, call);
}

absl::StatusOr<Session> SessionClient::CreateSession(const SessionSpec& spec, const v1::Tensor* k,
                                                     const v1::Tensor* v,
                                                     absl::Span<const int64_t> tokens,
                                                     absl::Span<const int64_t> prefix_tokens,
                                                     const CallOptions& call) {
  if (absl::Status pair = CheckPair(k, v); !pair.ok()) return pair;
  v1::CreateSessionRequest request;
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.mutable_prefix_tokens()->Add(prefix_tokens.begin(), prefix_tokens.end());
  request.set_dtype(spec.dtype);
  request.set_kv_heads(static_cast<int32_t>(spec.kv_heads));
  request.set_head_dim(static_cast<int32_t>(spec.head_dim));
  request.set_layout(spec.layout);
  if (spec.layers > 1) request.set_layers(spec.layers);
  request.set_v_head_dim(static_cast<int32_t>(spec.v_head_dim));
  request.set_v_from_k(spec.v_from_k);
  if (k != nullptr) *request.mutable_k() = *k;
  if (v != nullptr) *request.mutable_v() = *v;
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  v1::SessionInfo info;
  grpc::Status status = stub_->CreateSession(context.get(), request, &info);
  if (!status.ok()) return ToAbslStatus(status);
  return Session(this, info.session_id(), spec, info);
}

absl::StatusOr<v1::StepRequest> SessionClient::MakeStepRequest(absl::Span<const StepItem> items,
                                                               const StepOptions& options) {
  v1::StepRequest request;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& item = items[i];
    if (item.session == nullptr || item.q == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("step item ", i, " lacks a session or q"));
    }
    if (item.session->id().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("step item ", i, ": the session was dropped or released"));
    }
    if (absl::Status pair = CheckPair(item.k, item.v); !pair.ok()) return pair;
    v1::StepEntry* entry = request.add_entries();
    entry->set_session_id(item.session->id());
    *entry->mutable_q() = *item.q;
    if (item.k != nullptr) *entry->mutable_k() = *item.k;
    if (item.v != nullptr) *entry->mutable_v() = *item.v;
  }
  SetStepOptions(options, &request);
  return request;
}

absl::StatusOr<v1::StepRequest> SessionClient::MakeBatchRequest(
    absl::Span<Session* const> sessions, const v1::Tensor& q, const StepOptions& options,
    const StepBatchTensors& tensors) const {
  if (sessions.empty()) {
    return absl::InvalidArgumentError("StepBatch: expected at least one session, got none");
  }
  if (absl::Status pair = CheckPair(tensors.k, tensors.v); !pair.ok()) return pair;
  v1::StepRequest request;
  for (size_t b = 0; b < sessions.size(); ++b) {
    const Session* session = sessions[b];
    if (session == nullptr || session->id().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("StepBatch: session ", b, " is null, dropped or released"));
    }
    if (session->client_ != this) {
      return absl::InvalidArgumentError(
          absl::StrCat("session ", session->id(), " belongs to another SessionClient"));
    }
    request.add_session_ids(session->id());
  }
  *request.mutable_q() = q;
  if (tensors.k != nullptr) *request.mutable_k() = *tensors.k;
  if (tensors.v != nullptr) *request.mutable_v() = *tensors.v;
  if (tensors.o_ref != nullptr) *request.mutable_o_ref() = *tensors.o_ref;
  if (tensors.lse_ref != nullptr) *request.mutable_lse_ref() = *tensors.lse_ref;
  request.set_ready_event(tensors.ready_event);
  request.set_done_event(tensors.done_event);
  if (tensors.ready_counter != nullptr) *request.mutable_ready_counter() = *tensors.ready_counter;
  if (tensors.done_counter != nullptr) *request.mutable_done_counter() = *tensors.done_counter;
  SetStepOptions(options, &request);
  return request;
}

absl::StatusOr<StepBatchOutput> SessionClient::TakeBatchResponse(
    absl::Span<Session* const> sessions, std::optional<int32_t> layer, v1::StepResponse& response) {
  if (response.lengths_size() != static_cast<int>(sessions.size())) {
    return absl::DataLossError(absl::StrCat("Step sent ", sessions.size(), " sequences and got ",
                                            response.lengths_size(), " lengths"));
  }
  StepBatchOutput output;
  output.lengths.assign(response.lengths().begin(), response.lengths().end());
  for (size_t b = 0; b < sessions.size(); ++b) sessions[b]->SetLength(output.lengths[b], layer);
  output.o = std::move(*response.mutable_o());
  output.lse = std::move(*response.mutable_lse());
  output.timing = response.timing();
  return output;
}

absl::StatusOr<StepBatchOutput> SessionClient::StepBatch(absl::Span<Session* const> sessions,
                                                         const v1::Tensor& q,
                                                         const StepOptions& options,
                                                         const StepBatchTensors& tensors,
                                                         const CallOptions& call) {
  absl::StatusOr<v1::StepRequest> request = MakeBatchRequest(sessions, q, options, tensors);
  if (!request.ok()) return request.status();
  absl::StatusOr<std::string> owner = StepOwner(*request);
  if (!owner.ok()) return owner.status();
  v1::StepResponse response;
  grpc::Status status = OwnerCall(*owner, call, [&](grpc::ClientContext* context) {
    return stub_->Step(context, *request, &response);
  });
  if (!status.ok()) return ToAbslStatus(status);
  return TakeBatchResponse(sessions, options.layer, response);
}

void SessionClient::StepBatchAsync(
    absl::Span<Session* const> sessions, const v1::Tensor& q, const StepOptions& options,
    const StepBatchTensors& tensors, const CallOptions& call,
    absl::AnyInvocable<void(absl::StatusOr<StepBatchOutput>) &&> done) {
  absl::StatusOr<v1::StepRequest> request = MakeBatchRequest(sessions, q, options, tensors);
  if (!request.ok()) return std::move(done)(request.status());
  absl::StatusOr<std::string> owner = StepOwner(*request);
  if (!owner.ok()) return std::move(done)(owner.status());
  // What the call needs until gRPC answers it, freed by the callback.
  struct Pending {
    std::unique_ptr<grpc::ClientContext> context;
    v1::StepRequest request;
    v1::StepResponse response;
    std::vector<Session*> sessions;
    std::optional<int32_t> layer;
    absl::AnyInvocable<void(absl::StatusOr<StepBatchOutput>) &&> done;
  };
  auto* pending = new Pending{.context = OwnerContext(*owner, call),
                              .request = *std::move(request),
                              .sessions = {sessions.begin(), sessions.end()},
                              .layer = options.layer,
                              .done = std::move(done)};
  stub_->async()->Step(
      pending->context.get(), &pending->request, &pending->response,
      [pending](grpc::Status status) {
        std::unique_ptr<Pending> owned(pending);
        if (!status.ok()) return std::move(owned->done)(ToAbslStatus(status));
        std::move(owned->done)(TakeBatchResponse(owned->sessions, owned->layer, owned->response));
      });
}

absl::StatusOr<std::vector<StepOutput>> SessionClient::StepMany(absl::Span<const StepItem> items,
                                                                const StepOptions& options,
                                                                const CallOptions& call) {
  absl::StatusOr<v1::StepRequest> request = MakeStepRequest(items, options);
  if (!request.ok()) return request.status();
  for (const StepItem& item : items) {
    if (item.session->client_ != this) {
      return absl::InvalidArgumentError(
          absl::StrCat("session ", item.session->id(), " belongs to another SessionClient"));
    }
  }
  absl::StatusOr<std::string> owner = StepOwner(*request);
  if (!owner.ok()) return owner.status();
  v1::StepResponse response;
  grpc::Status status = OwnerCall(*owner, call, [&](grpc::ClientContext* context) {
    return stub_->Step(context, *request, &response);
  });
  if (!status.ok()) return ToAbslStatus(status);
  if (response.results_size() != static_cast<int>(items.size())) {
    return absl::DataLossError(absl::StrCat("Step sent ", items.size(), " entries and got ",
                                            response.results_size(), " results"));
  }
  std::vector<StepOutput> outputs;
  outputs.reserve(items.size());
  for (int i = 0; i < response.results_size(); ++i) {
    v1::StepResult& result = *response.mutable_results(i);
    if (result.session_id() != items[i].session->id()) {
      return absl::DataLossError(absl::StrCat("Step result ", i, " is for session ",
                                              result.session_id(), ", expected ",
                                              items[i].session->id()));
    }
    items[i].session->SetLength(result.length(), options.layer);
    outputs.push_back(ToOutput(result));
  }
  return outputs;
}

absl::StatusOr<v1::ListSessionsResponse> SessionClient::List(const CallOptions& call) {
  return ListOn("", call);
}

absl::StatusOr<v1::ListSessionsResponse> SessionClient::ListOn(absl::string_view owner,
                                                               const CallOptions& call) {
  std::unique_ptr<grpc::ClientContext> context = OwnerContext(owner, call);
  v1::ListSessionsResponse response;
  grpc::Status status = stub_->ListSessions(context.get(), v1::ListSessionsRequest(), &response);
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

std::unique_ptr<grpc::ClientContext> SessionClient::OwnerContext(absl::string_view owner,
                                                                 const CallOptions& call) const {
  std::unique_ptr<grpc::ClientContext> context = NewContext(call);
  if (!owner.empty()) context->AddMetadata(kSessionOwnerHeader, std::string(owner));
  return context;
}

grpc::Status SessionClient::OwnerCall(
    absl::string_view owner, const CallOptions& call,
    absl::FunctionRef<grpc::Status(grpc::ClientContext*)> rpc) const {
  const absl::Duration timeout =
      call.deadline > absl::ZeroDuration() ? call.deadline : client_.options().deadline;
  const bool none = timeout == absl::InfiniteDuration();  // each try has none either
  const absl::Time deadline = absl::Now() + (none ? absl::Seconds(30) : timeout);
  absl::Duration wait = absl::Milliseconds(10);
  while (true) {
    const CallOptions left{
        .deadline = none ? timeout : std::max(deadline - absl::Now(), absl::Milliseconds(1))};
    grpc::Status status = rpc(OwnerContext(owner, left).get());
    if (!IsSealed(status) || absl::Now() + wait > deadline) return status;
    absl::SleepFor(wait);
    wait = std::min(2 * wait, absl::Milliseconds(200));
  }
}

absl::StatusOr<std::string> SessionClient::StepOwner(const v1::StepRequest& request) {
  std::vector<absl::string_view> ids(request.session_ids().begin(), request.session_ids().end());
  for (const v1::StepEntry& entry : request.entries()) ids.push_back(entry.session_id());
  for (absl::string_view id : ids) {
    if (SessionOwner(id) != SessionOwner(ids.front())) {
      return absl::InvalidArgumentError(
          absl::StrCat("a Step's sessions must all have one owner (", kSessionOwnerHeader,
                       "): session ", ids.front(), " is of '", SessionOwner(ids.front()),
                       "', session ", id, " of '", SessionOwner(id), "'"));
    }
  }
  return ids.empty() ? std::string() : std::string(SessionOwner(ids.front()));
}

absl::Status SessionClient::Export(const std::string& session_id,
                                   absl::FunctionRef<absl::Status(const v1::SessionChunk&)> each,
                                   int64_t chunk_rows, const CallOptions& call, bool seal) const {
  v1::ExportRequest request;
  request.set_session_id(session_id);
  request.set_chunk_rows(chunk_rows);
  request.set_seal(seal);
  std::unique_ptr<grpc::ClientContext> context = OwnerContext(SessionOwner(session_id), call);
  std::unique_ptr<grpc::ClientReader<v1::SessionChunk>> reader =
      stub_->Export(context.get(), request);
  v1::SessionChunk chunk;
  while (reader->Read(&chunk)) {
    if (absl::Status status = each(chunk); !status.ok()) {
      context->TryCancel();
      reader->Finish().ok();  // cancelled: the caller's error is the one to report
      return status;
    }
  }
  return ToAbslStatus(reader->Finish());
}

absl::StatusOr<Session> SessionClient::CopyTo(const std::string& session_id, SessionClient& to,
                                              const ImportOptions& options, int64_t chunk_rows,
                                              const CallOptions& call, bool seal) const {
  SessionImport import = to.StartImport(options, call);
  if (absl::Status status = Export(
          session_id, [&import](const v1::SessionChunk& chunk) { return import.Write(chunk); },
          chunk_rows, call, seal);
      !status.ok()) {
    return status;
  }
  return import.Finish();
}

SessionImport SessionClient::StartImport(const ImportOptions& options, const CallOptions& call) {
  SessionImport import;
  import.client_ = this;
  import.options_ = options;
  import.context_ = NewContext(call);
  import.info_ = std::make_unique<v1::SessionInfo>();
  import.writer_ = stub_->Import(import.context_.get(), import.info_.get());
  return import;
}

absl::Status SessionClient::Drop(const std::string& session_id, const CallOptions& call) {
  v1::DropSessionRequest request;
  request.set_session_id(session_id);
  std::unique_ptr<grpc::ClientContext> context = OwnerContext(SessionOwner(session_id), call);
  v1::DropSessionResponse response;
  return ToAbslStatus(stub_->DropSession(context.get(), request, &response));
}

}  // namespace attention::client
