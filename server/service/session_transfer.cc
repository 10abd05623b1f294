// Sessions.Export and Sessions.Import: a session moved between servers in chunks (the order is
// sessions/session_transfer.h's, the checks requests/session_request.h's).
//
// One step at a time on each call: Export reads a chunk (a device job on the session's device,
// like any session work) and writes it before it reads the next; Import appends a chunk (a
// device job) before it reads the next. So a call holds one chunk at a time, no lease is held
// while the network waits, and a slow peer holds nothing but its own call. Export reads a
// snapshot: a fork of every layer taken in order with the session's other calls, dropped when
// the export ends. Import's session exists from its header on and is dropped when the stream
// fails, is cancelled or ends short.
#include "server/sessions/session_transfer.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/service/session_service.h"
#include "server/service/wire_buffers.h"

namespace attention::server {

class SessionService::ExportReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ExportReactor(SessionService* service, grpc::CallbackServerContext* context,
                const grpc::ByteBuffer& raw_request)
      : service_(service), call_(CallbackCall(context)) {
    service_->Admit(
        "Export", context, raw_request, &request_, &no_response_, &no_raw_response_,
        [this](const std::string& owner, const Arrival&, SessionService::Finish finish) {
          owner_ = owner;
          finish_ = std::move(finish);
          service_->SubmitSessionWork(
              call_, owner_, request_.session_id(),
              [this](std::vector<SessionStore::Lease>& layers) { return Snapshot(layers); },
              [this](absl::Status status) {
                if (!status.ok()) return End(std::move(status));
                Write(header_);
              },
              SessionStore::Access::kExport);
        },
        [this](absl::Status status) { Finish(ToGrpcStatus(status)); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return End(absl::CancelledError("the call broke while a chunk was written"));
    std::optional<RowChunk> chunk = chunks_->Next();
    if (!chunk.has_value()) return End(absl::OkStatus());
    service_->SubmitDeviceWork(
        call_, device_, {LayerSessionId(snapshot_id_, chunk->layer)},
        [this, chunk = *chunk] { return Read(chunk); },
        [this](absl::Status status) {
          if (!status.ok()) return End(std::move(status));
          Write(chunk_);
        });
  }

  void OnDone() override { delete this; }

 private:
  // On the session's device, holding every layer: checks chunk_rows, seals the session when
  // asked (before its rows are read, under the leases an append needs: no append lands after
  // the snapshot), forks the snapshot and fills the header.
  absl::Status Snapshot(std::vector<SessionStore::Lease>& layers) {
    const SessionStore::Lease& first = layers.front();
    ASSIGN_OR_RETURN(const int64_t chunk_rows,
                     DecodeChunkRows(request_.chunk_rows(), first.shape(),
                                     service_->options_.max_message_bytes));
    if (request_.seal()) {
      for (SessionStore::Lease& layer : layers) service_->store_->Seal(layer);
    }
    ASSIGN_OR_RETURN(SessionStore::Lease snapshot, service_->store_->ForkLayers(layers, {}));
    snapshot_id_ = snapshot.id();
    device_ = snapshot.device();
    shape_ = first.shape();
    v1::SessionHeader* header = header_.mutable_header();
    header->set_session_id(request_.session_id());
    header->set_dtype(ToProtoDType(shape_.dtype));
    header->set_kv_heads(static_cast<int32_t>(shape_.heads_kv));
    header->set_head_dim(static_cast<int32_t>(shape_.head_dim));
    header->set_v_head_dim(static_cast<int32_t>(shape_.value_head_dim()));
    header->set_v_from_k(shape_.v_from_k);
    header->set_layers(static_cast<int32_t>(layers.size()));
    std::vector<int64_t> lengths;
    for (const SessionStore::Lease& layer : layers) {
      header->add_layer_lengths(layer.length());
      lengths.push_back(layer.length());
    }
    chunks_.emplace(std::move(lengths), chunk_rows);
    return absl::OkStatus();
  }

  // On the session's device: `chunk`'s rows of the snapshot into chunk_, k BHSD [Hkv, rows, D]
  // and v [Hkv, rows, Dv] (k alone where v is k's first Dv features).
  absl::Status Read(const RowChunk& chunk) {
    const std::string id = LayerSessionId(snapshot_id_, chunk.layer);
    ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases,
                     service_->store_->Acquire(owner_, {id}));
    chunk_.Clear();
    chunk_.set_layer(chunk.layer);
    chunk_.set_first_row(chunk.first_row);
    chunk_.set_layout(v1::LAYOUT_BHSD);
    void* data[2] = {nullptr, nullptr};
    for (auto [i, t] : {std::pair{0, chunk_.mutable_k()}, {1, chunk_.mutable_v()}}) {
      if (i == 1 && shape_.v_from_k) {
        chunk_.clear_v();
        break;
      }
      const int64_t dim = i == 0 ? shape_.head_dim : shape_.value_head_dim();
      t->set_dtype(ToProtoDType(shape_.dtype));
      for (int64_t d : {shape_.heads_kv, chunk.rows, dim}) t->add_shape(d);
      t->mutable_data()->resize(static_cast<size_t>(chunk.rows * shape_.heads_kv * dim) *
                                DTypeSize(shape_.dtype));
      data[i] = t->mutable_data()->data();
    }
    return service_->store_->Read(leases.front(), chunk.first_row, chunk.rows, data[0], data[1]);
  }

  void Write(const v1::SessionChunk& message) {
    out_.Clear();  // the last chunk's, written
    SerializeToByteBuffer(message, &out_);
    StartWrite(&out_);
  }

  // Once: lets the snapshot go and answers.
  void End(absl::Status status) {
    if (!snapshot_id_.empty()) service_->store_->Drop(owner_, snapshot_id_).IgnoreError();
    std::move(finish_)(std::move(status));
  }

  SessionService* const service_;
  const CallContext call_;
  v1::ExportRequest request_;
  v1::SessionInfo no_response_;  // Admit's: the answer is the stream
  grpc::ByteBuffer no_raw_response_;
  SessionService::Finish finish_;
  std::string owner_;
  std::string snapshot_id_;
  int device_ = 0;
  KvShape shape_;
  std::optional<ExportChunks> chunks_;
  v1::SessionChunk header_;
  v1::SessionChunk chunk_;
  grpc::ByteBuffer out_;
};

class SessionService::ImportReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  ImportReactor(SessionService* service, grpc::CallbackServerContext* context,
                grpc::ByteBuffer* raw_response)
      : service_(service),
        context_(context),
        call_(CallbackCall(context)),
        raw_response_(raw_response) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!admitted_) {
      // The header's message (an empty one when the stream ended first: no header).
      admitted_ = true;
      if (!ok) in_.Clear();
      return service_->Admit(
          "Import", context_, in_, &message_, &info_, raw_response_,
          [this](const std::string& owner, const Arrival&, SessionService::Finish finish) {
            owner_ = owner;
            finish_ = std::move(finish);
            in_.Clear();
            Create();
          },
          [this](absl::Status status) { Finish(ToGrpcStatus(status)); });
    }
    if (!ok) {
      if (context_->IsCancelled()) return End(absl::CancelledError("the call was cancelled"));
      return Complete();
    }
    absl::Status status = ParseByteBuffer(in_, &message_);
    in_.Clear();
    if (status.ok()) status = Append();
    if (!status.ok()) End(std::move(status));
  }

  void OnDone() override { delete this; }

 private:
  // The header: the session, empty, on the emptiest device.
  void Create() {
    absl::StatusOr<DecodedImportHeader> header = DecodeImportHeader(message_, service_->limits_);
    if (!header.ok()) return End(header.status());
    absl::StatusOr<int> device = service_->store_->EmptiestDevice();
    if (!device.ok()) return End(device.status());
    device_ = *device;
    shape_ = header->shape;
    progress_.emplace(header->lengths);
    service_->SubmitDeviceWork(
        call_, device_, {},
        [this, header = *std::move(header)]() -> absl::Status {
          ASSIGN_OR_RETURN(
              SessionStore::Lease lease,
              service_->store_->Create(owner_, header.shape, 0, device_, header.layers, header.id));
          id_ = lease.id();
          return absl::OkStatus();
        },
        [this](absl::Status status) { Next(std::move(status)); });
  }

  // A chunk of rows, checked against the stream's order, appended on the device.
  absl::Status Append() {
    ASSIGN_OR_RETURN(DecodedImportChunk chunk, DecodeImportChunk(message_, shape_));
    RETURN_IF_ERROR(progress_->Take(
        {.layer = chunk.layer, .first_row = chunk.first_row, .rows = chunk.rows.rows}));
    std::string layer_id = LayerSessionId(id_, chunk.layer);
    service_->SubmitDeviceWork(
        call_, device_, {layer_id},
        [this, layer_id, chunk]() -> absl::Status {
          SessionStore* store = service_->store_;
          ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases,
                           store->Acquire(owner_, {layer_id}));
          SessionStore::Lease& lease = leases.front();
          // The owner may call on the session meanwhile (its id is known from the header).
          if (lease.length() != chunk.first_row) {
            return absl::AbortedError(absl::StrCat(
                "session ", id_, " changed during its import: layer ", chunk.layer, " holds ",
                lease.length(), " rows, the stream's next row is ", chunk.first_row));
          }
          SessionStore::Lease* held[] = {&lease};
          const int64_t new_rows[] = {chunk.rows.rows};
          RETURN_IF_ERROR(store->Reserve(held, new_rows));
          return store->Append(lease, chunk.rows);
        },
        [this](absl::Status status) { Next(std::move(status)); });
    return absl::OkStatus();
  }

  // The stream ended: every declared row came, and the answer is the session's info.
  void Complete() {
    if (absl::Status whole = progress_->Whole(); !whole.ok()) return End(std::move(whole));
    service_->SubmitDeviceWork(
        call_, device_, {id_},
        [this]() -> absl::Status {
          ASSIGN_OR_RETURN(std::vector<SessionStore::Lease> leases,
                           service_->store_->Acquire(owner_, {id_}));
          FillSessionInfo(service_->store_->Snapshot(leases.front()), &info_);
          return absl::OkStatus();
        },
        [this](absl::Status status) { End(std::move(status)); });
  }

  // A device job done: the next message, or the end.
  void Next(absl::Status status) {
    if (!status.ok()) return End(std::move(status));
    StartRead(&in_);
  }

  // Once: a failed import leaves no session; answers.
  void End(absl::Status status) {
    if (!status.ok() && !id_.empty()) service_->store_->Drop(owner_, id_).IgnoreError();
    std::move(finish_)(std::move(status));
  }

  SessionService* const service_;
  grpc::CallbackServerContext* const context_;
  const CallContext call_;
  grpc::ByteBuffer* const raw_response_;
  bool admitted_ = false;
  grpc::ByteBuffer in_;
  v1::SessionChunk message_;
  v1::SessionInfo info_;
  SessionService::Finish finish_;
  std::string owner_;
  std::string id_;
  int device_ = 0;
  KvShape shape_;
  std::optional<ImportProgress> progress_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* SessionService::Export(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new ExportReactor(this, context, *request);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* SessionService::Import(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return new ImportReactor(this, context, response);
}

}  // namespace attention::server
