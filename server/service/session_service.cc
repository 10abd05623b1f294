#include "server/service/session_service.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "server/requests/request_decoder.h"
#include "server/service/attention_service.h"
#include "server/service/security.h"

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

// Entries of one Step that run as one Decode: same device and shape.
struct StepGroup {
  int device = 0;
  KvShape shape;
  int64_t heads_q = 0;
  std::vector<int> entries;
};

}  // namespace

SessionService::SessionService(const SessionServiceOptions& options, SessionStore* store,
                               Metrics* metrics)
    : options_(options),
      limits_{.max_head_dim = options.max_head_dim},
      store_(store),
      metrics_(metrics) {
  if (store_ == nullptr) return;
  for (int i = 0; i < std::max(1, options_.workers); ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
  sweeper_ = std::thread([this] { SweeperLoop(); });
}

SessionService::~SessionService() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  stop_sweep_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  if (sweeper_.joinable()) sweeper_.join();
}

void SessionService::StartDraining() { draining_.store(true); }

bool SessionService::AwaitDrained(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return answered_.wait_until(lock, absl::ToChronoTime(deadline),
                              [this] { return in_flight_ == 0; });
}

void SessionService::WorkerLoop() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued call has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
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

grpc::ServerUnaryReactor* SessionService::Serve(
    absl::string_view rpc, grpc::CallbackServerContext* context,
    const google::protobuf::Message& request, const google::protobuf::Message* response,
    bool on_worker, absl::AnyInvocable<absl::Status(const std::string&, absl::Time) &&> body) {
  const absl::Time arrival = absl::Now();
  const int64_t request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  metrics_->RequestStarted();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [this, rpc, arrival, request_bytes, response, reactor](absl::Status status) {
    const int64_t response_bytes = status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0;
    metrics_->RequestFinished(rpc, status.code(), absl::Now() - arrival, request_bytes,
                              response_bytes);
    reactor->Finish(ToGrpcStatus(status));
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
    }
    answered_.notify_all();
  };
  absl::Status status = CheckBearerToken(context->client_metadata(), options_.auth_token);
  if (status.ok() && draining_.load()) status = absl::UnavailableError("server is shutting down");
  if (status.ok() && store_ == nullptr) {
    status = absl::UnimplementedError(
        "this server keeps no KV cache: its backend has no paged KV pool, or "
        "--kv_cache_fraction is 0");
  }
  if (!status.ok()) {
    finish(std::move(status));
    return reactor;
  }
  // Sessions belong to the caller's token (the one the check above accepted); "" without tokens.
  std::string owner = options_.auth_token;
  if (!on_worker) {
    finish(std::move(body)(owner, arrival));
    return reactor;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back([context, arrival, owner = std::move(owner), body = std::move(body),
                      finish = std::move(finish)]() mutable {
      if (context->IsCancelled()) return finish(absl::CancelledError("call cancelled"));
      finish(std::move(body)(owner, arrival));
    });
  }
  wake_.notify_one();
  return reactor;
}

grpc::ServerUnaryReactor* SessionService::CreateSession(grpc::CallbackServerContext* context,
                                                        const v1::CreateSessionRequest* request,
                                                        v1::SessionInfo* response) {
  return Serve("CreateSession", context, *request, response, /*on_worker=*/true,
               [this, request, response](const std::string& owner, absl::Time) {
                 return RunCreate(owner, *request, response);
               });
}

grpc::ServerUnaryReactor* SessionService::AppendKv(grpc::CallbackServerContext* context,
                                                   const v1::AppendKvRequest* request,
                                                   v1::SessionInfo* response) {
  return Serve("AppendKv", context, *request, response, /*on_worker=*/true,
               [this, request, response](const std::string& owner, absl::Time) {
                 return RunAppend(owner, *request, response);
               });
}

grpc::ServerUnaryReactor* SessionService::Step(grpc::CallbackServerContext* context,
                                               const v1::StepRequest* request,
                                               v1::StepResponse* response) {
  return Serve("Step", context, *request, response, /*on_worker=*/true,
               [this, request, response](const std::string& owner, absl::Time arrival) {
                 return RunStep(owner, arrival, *request, response);
               });
}

grpc::ServerUnaryReactor* SessionService::DropSession(grpc::CallbackServerContext* context,
                                                      const v1::DropSessionRequest* request,
                                                      v1::DropSessionResponse* response) {
  return Serve("DropSession", context, *request, response, /*on_worker=*/false,
               [this, request](const std::string& owner, absl::Time) {
                 if (request->session_id().empty()) return MissingSessionId();
                 return store_->Drop(owner, request->session_id());
               });
}

grpc::ServerUnaryReactor* SessionService::ListSessions(grpc::CallbackServerContext* context,
                                                       const v1::ListSessionsRequest* request,
                                                       v1::ListSessionsResponse* response) {
  return Serve("ListSessions", context, *request, response, /*on_worker=*/false,
               [this, response](const std::string& owner, absl::Time) {
                 for (const SessionSnapshot& s : store_->List(owner)) {
                   FillInfo(s, response->add_sessions());
                 }
                 const CacheRoom room = store_->Room();
                 response->set_page_bytes(room.page_bytes);
                 response->set_pages_total(room.pages_total);
                 response->set_pages_free(room.pages_free);
                 return absl::OkStatus();
               });
}

absl::Status SessionService::RunCreate(const std::string& owner,
                                       const v1::CreateSessionRequest& request,
                                       v1::SessionInfo* response) {
  absl::StatusOr<DecodedCreate> decoded = DecodeCreate(request, limits_);
  if (!decoded.ok()) return decoded.status();
  absl::StatusOr<SessionStore::Lease> lease =
      store_->Create(owner, decoded->shape, decoded->rows.rows);
  if (!lease.ok()) return lease.status();
  if (absl::Status status = store_->Append(*lease, decoded->rows); !status.ok()) {
    // The caller never learns the id: remove the session (its pages go when the lease does).
    store_->Drop(owner, lease->id()).IgnoreError();
    return status;
  }
  FillInfo(store_->Snapshot(*lease), response);
  return absl::OkStatus();
}

absl::Status SessionService::RunAppend(const std::string& owner, const v1::AppendKvRequest& request,
                                       v1::SessionInfo* response) {
  if (request.session_id().empty()) return MissingSessionId();
  if (!request.has_k() && !request.has_v()) {
    return absl::InvalidArgumentError("k: expected a tensor of rows to append, got none");
  }
  absl::StatusOr<std::vector<SessionStore::Lease>> leases =
      store_->Acquire(owner, {request.session_id()});
  if (!leases.ok()) return leases.status();
  SessionStore::Lease& lease = leases->front();
  absl::StatusOr<KvRows> rows =
      DecodeKvRows("", request.has_k() ? &request.k() : nullptr,
                   request.has_v() ? &request.v() : nullptr, request.layout(), lease.shape());
  if (!rows.ok()) return rows.status();
  SessionStore::Lease* held[] = {&lease};
  const int64_t new_rows[] = {rows->rows};
  if (absl::Status status = store_->Reserve(held, new_rows); !status.ok()) return status;
  if (absl::Status status = store_->Append(lease, *rows); !status.ok()) return status;
  FillInfo(store_->Snapshot(lease), response);
  return absl::OkStatus();
}

absl::Status SessionService::RunStep(const std::string& owner, absl::Time arrival,
                                     const v1::StepRequest& request, v1::StepResponse* response) {
  if (absl::Status status = CheckStep(request); !status.ok()) return status;
  const int n = request.entries_size();
  std::vector<std::string> ids;
  ids.reserve(n);
  for (const v1::StepEntry& entry : request.entries()) ids.push_back(entry.session_id());
  absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire(owner, ids);
  if (!leases.ok()) return leases.status();
  const absl::Time started = absl::Now();

  // Every check before anything is appended.
  std::vector<DecodedEntry> entries;
  entries.reserve(n);
  int64_t response_bytes = kResponseOverhead + static_cast<int64_t>(request.request_id().size());
  for (int i = 0; i < n; ++i) {
    const SessionStore::Lease& lease = (*leases)[i];
    absl::StatusOr<DecodedEntry> entry =
        DecodeStepEntry(i, request.entries(i), lease.shape(), lease.length());
    if (!entry.ok()) return entry.status();
    response_bytes += static_cast<int64_t>(request.entries(i).q().data().size()) +
                      static_cast<int64_t>(ids[i].size()) + kEntryOverhead;
    if (request.return_lse()) {
      response_bytes += entry->heads_q * entry->rows_q * int64_t{sizeof(float)};
    }
    entries.push_back(*entry);
  }
  if (response_bytes > options_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("response would be ", response_bytes,
                                                     " bytes, over the message limit of ",
                                                     options_.max_message_bytes, " bytes"));
  }
  std::vector<SessionStore::Lease*> held;
  std::vector<int64_t> new_rows;
  for (int i = 0; i < n; ++i) {
    held.push_back(&(*leases)[i]);
    new_rows.push_back(entries[i].rows.rows);
  }
  if (absl::Status status = store_->Reserve(held, new_rows); !status.ok()) return status;
  std::vector<KvRows> rows;
  for (const DecodedEntry& entry : entries) rows.push_back(entry.rows);
  if (absl::Status status = store_->Append(held, rows); !status.ok()) return status;

  // Results in entry order; groups of one device and shape, in order of first appearance.
  std::vector<StepGroup> groups;
  for (int i = 0; i < n; ++i) {
    const SessionStore::Lease& lease = (*leases)[i];
    v1::StepResult* result = response->add_results();
    result->set_session_id(ids[i]);
    result->set_length(lease.length());
    const KvShape& shape = lease.shape();
    auto same = [&](const StepGroup& g) {
      return g.device == lease.device() && g.shape.dtype == shape.dtype &&
             g.shape.heads_kv == shape.heads_kv && g.shape.head_dim == shape.head_dim &&
             g.heads_q == entries[i].heads_q;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back(
          StepGroup{.device = lease.device(), .shape = shape, .heads_q = entries[i].heads_q});
      it = groups.end() - 1;
    }
    it->entries.push_back(i);
  }

  KvStepTimes times;
  std::vector<std::string> devices;
  for (const StepGroup& group : groups) {
    absl::StatusOr<MaskParams> mask = DecodeMask(request, group.shape.head_dim);
    if (!mask.ok()) return mask.status();
    const int64_t row_bytes =
        group.heads_q * group.shape.head_dim * static_cast<int64_t>(DTypeSize(group.shape.dtype));
    const int seqs = static_cast<int>(group.entries.size());
    std::vector<int32_t> cu_seqlens_q(seqs + 1, 0);
    std::vector<int32_t> seqlens_k(seqs, 0);
    int64_t stride = 0;
    PagedDecodeParams p;
    for (int s = 0; s < seqs; ++s) {
      const int i = group.entries[s];
      cu_seqlens_q[s + 1] = cu_seqlens_q[s] + static_cast<int32_t>(entries[i].rows_q);
      seqlens_k[s] = static_cast<int32_t>((*leases)[i].length());
      stride = std::max<int64_t>(stride, (*leases)[i].page_table().size());
      p.max_seqlen_q = std::max(p.max_seqlen_q, entries[i].rows_q);
      p.max_seqlen_k = std::max<int64_t>(p.max_seqlen_k, seqlens_k[s]);
    }
    std::vector<int32_t> page_table(seqs * stride, 0);
    for (int s = 0; s < seqs; ++s) {
      const std::vector<int32_t>& pages = (*leases)[group.entries[s]].page_table();
      std::copy(pages.begin(), pages.end(), page_table.begin() + s * stride);
    }
    const int64_t total_q = cu_seqlens_q[seqs];
    // One entry reads its q and writes its o and lse in place; several are packed: q of sequence
    // s is [Hq, Nq_s, D] at row cu_seqlens_q[s] of the packed [total_q] rows.
    std::string q_packed, o_packed, lse_packed;
    const v1::Tensor& first_q = request.entries(group.entries[0]).q();
    if (seqs > 1) {
      q_packed.reserve(total_q * row_bytes);
      for (int i : group.entries) q_packed.append(request.entries(i).q().data());
      o_packed.resize(total_q * row_bytes);
      if (request.return_lse()) lse_packed.resize(total_q * group.heads_q * sizeof(float));
    }
    for (int i : group.entries) {
      v1::StepResult* result = response->mutable_results(i);
      v1::Tensor* o = result->mutable_o();
      o->set_dtype(request.entries(i).q().dtype());
      o->mutable_shape()->CopyFrom(request.entries(i).q().shape());
      o->mutable_data()->resize(request.entries(i).q().data().size());
      if (request.return_lse()) {
        v1::Tensor* lse = result->mutable_lse();
        lse->set_dtype(v1::DTYPE_FLOAT32);
        lse->add_shape(group.heads_q);
        lse->add_shape(entries[i].rows_q);
        lse->mutable_data()->resize(group.heads_q * entries[i].rows_q * sizeof(float));
      }
    }
    v1::StepResult* first = response->mutable_results(group.entries[0]);
    p.shape = group.shape;
    p.heads_q = group.heads_q;
    p.num_seqs = seqs;
    p.q = seqs > 1 ? q_packed.data() : first_q.data().data();
    p.o = seqs > 1 ? o_packed.data() : first->mutable_o()->mutable_data()->data();
    if (request.return_lse()) {
      // std::string storage comes from operator new (or the inline buffer), aligned for float.
      p.lse = reinterpret_cast<float*>(seqs > 1 ? lse_packed.data()
                                                : first->mutable_lse()->mutable_data()->data());
    }
    p.cu_seqlens_q = cu_seqlens_q.data();
    p.total_q = total_q;
    p.seqlens_k = seqlens_k.data();
    p.page_table = page_table.data();
    p.page_table_stride = stride;
    p.softmax_scale = mask->softmax_scale;
    p.window_left = mask->window_left;
    p.window_right = mask->window_right;

    const absl::Time launched = absl::Now();
    absl::StatusOr<KvStepTimes> step = store_->pool(group.device).Decode(p);
    if (!step.ok()) return step.status();
    const std::string& device = store_->device_name(group.device);
    metrics_->DecodeStepObserved(device, absl::Now() - launched);
    times.h2d_us += step->h2d_us;
    times.compute_us += step->compute_us;
    times.d2h_us += step->d2h_us;
    if (std::find(devices.begin(), devices.end(), device) == devices.end()) {
      devices.push_back(device);
    }
    if (seqs > 1) {
      for (int s = 0; s < seqs; ++s) {
        const int i = group.entries[s];
        v1::StepResult* result = response->mutable_results(i);
        std::string* o = result->mutable_o()->mutable_data();
        std::memcpy(o->data(), o_packed.data() + cu_seqlens_q[s] * row_bytes, o->size());
        if (request.return_lse()) {
          std::string* lse = result->mutable_lse()->mutable_data();
          std::memcpy(lse->data(),
                      lse_packed.data() + cu_seqlens_q[s] * group.heads_q * sizeof(float),
                      lse->size());
        }
      }
    }
  }
  response->set_request_id(request.request_id());
  response->set_device(absl::StrJoin(devices, ","));
  v1::ServerTiming* timing = response->mutable_timing();
  timing->set_queue_us(absl::ToDoubleMicroseconds(started - arrival));
  timing->set_h2d_us(times.h2d_us);
  timing->set_compute_us(times.compute_us);
  timing->set_d2h_us(times.d2h_us);
  timing->set_total_us(absl::ToDoubleMicroseconds(absl::Now() - arrival));
  return absl::OkStatus();
}

}  // namespace attention::server
