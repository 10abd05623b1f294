// KV-resident sessions (attention.v1.Sessions) from C++: the K/V of one sequence stay on the
// server between calls, so a decode step sends only the new queries and the new token's K/V.
//
//   attention::client::Client client({.target = "localhost:50051"});
//   attention::client::SessionClient sessions(client);
//   absl::StatusOr<Session> s = sessions.Create({.dtype = v1::DTYPE_FLOAT16, .kv_heads = 8,
//                                                .head_dim = 128}, &k, &v);   // k, v: [8, N, 128]
//   absl::StatusOr<StepOutput> out = s->Step(q, {.causal = true}, &k1, &v1);  // q: [Hq, 1, 128]
//   // A layer's whole batch in one message: q [B, Hq, 1, D], k1, v1 [B, Hkv, 1, D].
//   absl::StatusOr<StepBatchOutput> batch = sessions.StepBatch(layer_sessions, q, {.causal = true},
//                                                              {.k = &k1, .v = &v1});
//   absl::StatusOr<Session> moved = s->MoveTo(peer_sessions);   // to another server, same id
//
// Every call carries the Client's deadline (or CallOptions') and bearer token over its channel
// and credentials; every call about an existing session also carries its owner (the session id's
// part before its first '.', a server's --replica_name) as the attention-session-owner header,
// so a router in front of several replicas sends it to the replica holding the session
// (deploy/README.md, "Routing sessions across replicas"). Session calls are never retried (an
// append that reached the server before the connection dropped would be applied twice). Sessions
// are a server-side cache: after a server restart or --session_ttl_s idle seconds a session is gone
// and its calls get NOT_FOUND; the caller re-creates it from its own copy of the sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"

namespace attention::client {

// The gRPC metadata key of a session's owner on every call about an existing session.
inline constexpr char kSessionOwnerHeader[] = "attention-session-owner";

// The replica that made session id `id`: its part before the first '.'; empty for an id of a
// server without --replica_name.
absl::string_view SessionOwner(absl::string_view id);

// The start of the message of a call refused UNAVAILABLE because its session is sealed (an
// Export moving it to another replica sealed it: v1::ExportRequest::seal, docs/API.md). Such a
// call changed nothing; the session calls (AppendKv, Truncate, Fork, StepMany, StepBatch) send it
// again, 10 ms doubling to 200 ms apart, until their deadline (30 s without one), as the router
// sends it to the session's new owner once the drain switched it. No other UNAVAILABLE is retried
// (a Step may have been applied); StepBatchAsync returns the refusal.
inline constexpr absl::string_view kSealedMarker = "session sealed: ";
bool IsSealed(const grpc::Status& status);

// The shape of a session's K/V rows, fixed at creation.
struct SessionSpec {
  v1::DType dtype = v1::DTYPE_FLOAT16;
  int64_t kv_heads = 1;   // Hkv
  int64_t head_dim = 64;  // D
  // Of the K/V given to Create and Append: BHSD [Hkv, n, D] or BSHD [n, Hkv, D]. (A Step's new
  // rows are always [Hkv, n, D].)
  v1::Layout layout = v1::LAYOUT_BHSD;
  // A sequence of a model's `layers` layers, one cache each (CreateSessionRequest.layers):
  // created empty; Append and the Steps then name the layer; Truncate, Fork and Drop take every
  // layer.
  int32_t layers = 1;
  // Dv, the head dim of v and of the Steps' o where it is not D (CreateSessionRequest.v_head_dim:
  // MLA models); 0: D.
  int64_t v_head_dim = 0;
  // v is k's first Dv features, kept once (CreateSessionRequest.v_from_k: MLA's latent cache):
  // Create, AppendK and the Steps then take k without v.
  bool v_from_k = false;
};

// The attention settings of a step; masks as in AttendRequest, bottom-right aligned: the
// queries are the session's last Nq positions after the step's append.
struct StepOptions {
  bool causal = false;
  std::optional<float> softmax_scale;  // absent: 1/sqrt(D)
  std::optional<int32_t> window_left;
  std::optional<int32_t> window_right;
  bool return_lse = false;
  // The layer of every session of the Step, for sessions of several layers.
  std::optional<int32_t> layer;
};

struct StepOutput {
  v1::Tensor o;        // [Hq, Nq, D], q's dtype
  v1::Tensor lse;      // with return_lse: float32 [Hq, Nq], natural log; else empty
  int64_t length = 0;  // the session's rows after the step
};

// A packed Step's tensors beside q (StepRequest.session_ids): new rows k, v [B, Hkv, n, D] (both
// or neither), and where o and lse go instead of the response (o [B, Hq, Nq, D], lse
// [B, Hq, Nq]; regions of this client, apart from each other and from every input). Tensors and
// refs must stay valid during the call.
// With every tensor in CUDA regions (a co-located caller on the server's GPU), the Step runs in
// stream order given the bytes of two cudaIpcEventHandle_t (events made with
// cudaEventInterprocess | cudaEventDisableTiming): the server's kernels wait on the GPU for
// ready_event's last record and record done_event after writing o and lse, and the call answers
// once the work is queued; the caller's stream waits for done_event before it reads o
// (cudaStreamWaitEvent). docs/API.md: StepRequest.ready_event. Or by counters (uint64s in the
// caller's CUDA regions): the server's stream waits until ready_counter reaches its value and
// writes done_counter's; the caller may queue its wait (cuStreamWaitValue64) before sending, so
// it can send the Step asynchronously (StepBatchAsync) and go on. docs/API.md:
// StepRequest.ready_counter.
struct StepBatchTensors {
  const v1::Tensor* k = nullptr;
  const v1::Tensor* v = nullptr;
  const v1::TensorRef* o_ref = nullptr;
  const v1::TensorRef* lse_ref = nullptr;
  std::string ready_event;  // empty: none
  std::string done_event;
  const v1::StreamCounter* ready_counter = nullptr;  // null: none
  const v1::StreamCounter* done_counter = nullptr;
};

struct StepBatchOutput {
  v1::Tensor o;                  // [B, Hq, Nq, D], q's dtype; no data when it went to o_ref
  v1::Tensor lse;                // with return_lse: float32 [B, Hq, Nq], unless in lse_ref
  std::vector<int64_t> lengths;  // each session's rows after the step
  v1::ServerTiming timing;
};

class SessionClient;
class SessionImport;

// One server-side session. Move-only; dropped on the server when destroyed, unless Release()d or
// Drop()ped. Its SessionClient must outlive it. Not thread-safe: one call at a time per session
// (the server also takes each session at most once per step).
class Session {
 public:
  Session(Session&& other) noexcept;
  Session& operator=(Session&& other) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  // Drops the session on the server (errors ignored: it may have expired) unless released.
  ~Session();

  // Appends rows: k and v [Hkv, n, D] (BHSD) or [n, Hkv, D] (BSHD, per the SessionSpec).
  absl::Status Append(const v1::Tensor& k, const v1::Tensor& v, const CallOptions& call = {});
  // The same into layer `layer` of a session of several layers.
  absl::Status Append(const v1::Tensor& k, const v1::Tensor& v, int32_t layer,
                      const CallOptions& call = {});
  // The same with the token id of each row (one per row), so later sessions of this caller can
  // share their full pages (SessionClient::CreateFromPrefix).
  absl::Status Append(const v1::Tensor& k, const v1::Tensor& v, absl::Span<const int64_t> tokens,
                      std::optional<int32_t> layer = std::nullopt, const CallOptions& call = {});
  // Appends rows of k alone, to a session whose v is k's first Dv features (SessionSpec::v_from_k;
  // any other refuses it, INVALID_ARGUMENT naming k and v).
  absl::Status AppendK(const v1::Tensor& k, std::optional<int32_t> layer = std::nullopt,
                       const CallOptions& call = {});
  // Keeps the first `length` rows (0 <= length <= the session's; speculative decoding drops
  // rejected tokens) and frees the server's pages beyond them.
  absl::Status Truncate(int64_t length, const CallOptions& call = {});
  // A new session holding this one's first `length` rows (absent: all), of its spec, on its
  // server (beam search, parallel sampling, a shared prompt). The server shares the full pages
  // between the two and copies only the partial last one; each then grows on its own.
  absl::StatusOr<Session> Fork(std::optional<int64_t> length = std::nullopt,
                               const CallOptions& call = {});

  // Attends q [Hq, Nq, D] (Hq a multiple of Hkv) to the session's rows, after first appending k
  // and v [Hkv, n, D] when given (both or neither).
  absl::StatusOr<StepOutput> Step(const v1::Tensor& q, const StepOptions& options = {},
                                  const v1::Tensor* k = nullptr, const v1::Tensor* v = nullptr,
                                  const CallOptions& call = {});

  // The session as Sessions.Export streams it: `each` gets every SessionChunk in order, the
  // header first, then each layer's rows (k and v [Hkv, n, D], at most `chunk_rows` rows; 0: what
  // fits 4 MiB), one at a time as they arrive. A snapshot of the session when the export starts.
  // An error from `each` ends the export (the server lets its snapshot go) and is returned.
  // `seal`: the server seals the session first (v1::ExportRequest::seal): its later changes there
  // are refused (kSealedMarker), so no row lands there that the export lacks; it stays sealed.
  absl::Status Export(absl::FunctionRef<absl::Status(const v1::SessionChunk&)> each,
                      int64_t chunk_rows = 0, const CallOptions& call = {},
                      bool seal = false) const;
  // Moves the session to `other`'s server under the same id: exported from here (sealed unless
  // `seal` is false), imported there chunk by chunk, then dropped here (this object then holds no
  // session). Returns the session there.
  absl::StatusOr<Session> MoveTo(SessionClient& other, int64_t chunk_rows = 0,
                                 const CallOptions& call = {}, bool seal = true);

  // Frees the session's K/V on the server now; afterwards this object holds no session.
  absl::Status Drop(const CallOptions& call = {});

  // The server's current view of the session (rows, pages, bytes, idle and expiry times), from
  // ListSessions; NOT_FOUND when it is gone.
  absl::StatusOr<v1::SessionInfo> Info(const CallOptions& call = {}) const;

  // Gives up ownership: the destructor will not drop it. Returns the session id.
  std::string Release();

  const std::string& id() const { return id_; }
  const SessionSpec& spec() const { return spec_; }
  // K/V rows as of this object's last call (Create, Append, Truncate or Step); of a session of
  // several layers, the rows every layer holds, and each layer's.
  int64_t length() const { return length_; }
  const std::vector<int64_t>& layer_lengths() const { return layer_lengths_; }
  // The rows its creation found cached (SessionClient::CreateFromPrefix; SessionInfo.prefix_rows).
  int64_t prefix_rows() const { return prefix_rows_; }

 private:
  friend class SessionClient;
  friend class SessionImport;
  Session(SessionClient* client, std::string id, const SessionSpec& spec,
          const v1::SessionInfo& info)
      : client_(client), id_(std::move(id)), spec_(spec), prefix_rows_(info.prefix_rows()) {
    SetInfo(info);
  }
  // The lengths a SessionInfo gives.
  void SetInfo(const v1::SessionInfo& info);
  // A Step's answer: `layer`'s rows (absent: the only layer's) are now `length`.
  void SetLength(int64_t length, std::optional<int32_t> layer);
  absl::Status AppendRows(const v1::Tensor& k, const v1::Tensor* v,
                          absl::Span<const int64_t> tokens, std::optional<int32_t> layer,
                          const CallOptions& call);
  // A call answered by the session's SessionInfo (AppendKv, Truncate); sets length().
  template <typename Request>
  absl::Status Update(grpc::Status (v1::Sessions::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                              v1::SessionInfo*),
                      const Request& request, const CallOptions& call);

  SessionClient* client_ = nullptr;
  std::string id_;  // empty: holds no session (moved from, dropped or released)
  SessionSpec spec_;
  int64_t length_ = 0;
  std::vector<int64_t> layer_lengths_;  // one per layer
  int64_t prefix_rows_ = 0;
};

// One entry of a batched step: `session` attends `q` [Hq, Nq, D] after appending k and v
// [Hkv, n, D] when given. The pointers must stay valid during the call.
struct StepItem {
  Session* session = nullptr;
  const v1::Tensor* q = nullptr;
  const v1::Tensor* k = nullptr;
  const v1::Tensor* v = nullptr;
};

// How an import makes its session.
struct ImportOptions {
  // The new session's id (an id a server made: 32 lower-case hex digits, after a replica name and
  // a '.' where that server had --replica_name; "" : one the server makes, of its replica name);
  // absent: the header's (an export's: the exported session's).
  std::optional<std::string> session_id;
  v1::Layout layout = v1::LAYOUT_BHSD;  // the Session's SessionSpec.layout
};

// One Sessions.Import in progress: Write each SessionChunk (the header first, then each layer's
// rows in order, as an Export gives them), then Finish for the new session. Move-only; one
// destroyed before Finish cancels the import, and the server keeps nothing of it.
class SessionImport {
 public:
  SessionImport(SessionImport&&) noexcept = default;
  SessionImport& operator=(SessionImport&&) noexcept = default;
  ~SessionImport();

  // Sends one chunk; an error (the server's status) once the stream has failed.
  absl::Status Write(const v1::SessionChunk& chunk);
  // Ends the stream: the new session, or the server's refusal.
  absl::StatusOr<Session> Finish();

 private:
  friend class SessionClient;
  SessionImport() = default;
  // The call's status, once (writer_ is done after it).
  absl::Status Close();

  SessionClient* client_ = nullptr;
  ImportOptions options_;
  bool first_ = true;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<v1::SessionInfo> info_;  // where the answer goes (stays put when moved)
  std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>> writer_;  // null once closed
};

// Sessions calls over a Client's channel, credentials, deadline and token. When the client's
// target lists several addresses balanced round-robin, sessions get their own pick_first channel
// over the same addresses, so every call of a session reaches the server that holds it. The
// Client must outlive it. Thread-safe, as Client is (each Session: one call at a time).
class SessionClient {
 public:
  explicit SessionClient(const Client& client);

  // A new session, with its first rows when k and v are given (both or neither).
  absl::StatusOr<Session> Create(const SessionSpec& spec, const v1::Tensor* k = nullptr,
                                 const v1::Tensor* v = nullptr, const CallOptions& call = {});
  // The same with the token id of each row of k and v (one per row; see Session::Append).
  absl::StatusOr<Session> Create(const SessionSpec& spec, const v1::Tensor& k, const v1::Tensor& v,
                                 absl::Span<const int64_t> tokens, const CallOptions& call = {});
  // A new session holding the rows of the longest run of full pages of `prefix_tokens` (the
  // sequence's first token ids) that this caller's sessions of this spec's shape and layers
  // appended with their tokens and the server still caches, shared with them (copy on write);
  // Session::prefix_rows() says how many: append the rest, with their tokens.
  absl::StatusOr<Session> CreateFromPrefix(const SessionSpec& spec,
                                           absl::Span<const int64_t> prefix_tokens,
                                           const CallOptions& call = {});

  // One Step RPC for several sessions of this client (each at most once, all of one owner:
  // INVALID_ARGUMENT naming both owners otherwise), which the server runs as one launch where
  // it can. Results come in the order of `items`; each session's length() is
  // updated.
  absl::StatusOr<std::vector<StepOutput>> StepMany(absl::Span<const StepItem> items,
                                                   const StepOptions& options = {},
                                                   const CallOptions& call = {});

  // One packed Step over a layer's batch: sessions[b] (each at most once, all of one dtype, Hkv
  // and D, and of one owner) attends q[b] of q [B, Hq, Nq, D], after appending row b of tensors.k
  // and tensors.v. One message and one tensor each for the whole batch; tensors given by reference
  // (Tensor.ref) are not copied. Each session's length() is updated.
  absl::StatusOr<StepBatchOutput> StepBatch(absl::Span<Session* const> sessions,
                                            const v1::Tensor& q, const StepOptions& options = {},
                                            const StepBatchTensors& tensors = {},
                                            const CallOptions& call = {});
  // The same without waiting: returns once the call is sent; `done` runs once, on a gRPC thread,
  // with the outcome (after each session's length() is updated). Until then the caller leaves the
  // sessions alone, and keeps `sessions`' objects alive; q and `tensors` are copied before this
  // returns. A model overlaps other work (e.g. another micro-batch's MLP) with the step.
  void StepBatchAsync(absl::Span<Session* const> sessions, const v1::Tensor& q,
                      const StepOptions& options, const StepBatchTensors& tensors,
                      const CallOptions& call,
                      absl::AnyInvocable<void(absl::StatusOr<StepBatchOutput>) &&> done);

  // The caller's sessions (every session when the server checks no tokens) and the cache's room.
  absl::StatusOr<v1::ListSessionsResponse> List(const CallOptions& call = {});

  // A new session from the chunks of an export (another server's, or built by hand), sent as
  // they are written (Sessions.Import).
  SessionImport StartImport(const ImportOptions& options = {}, const CallOptions& call = {});

  // Session `session_id` of this client's server as Sessions.Export streams it, sent to its owner
  // (Session::Export, which calls this, says how); for sessions known by id (List's, as Drain
  // moves them: client/replicas.h).
  absl::Status Export(const std::string& session_id,
                      absl::FunctionRef<absl::Status(const v1::SessionChunk&)> each,
                      int64_t chunk_rows = 0, const CallOptions& call = {},
                      bool seal = false) const;
  // Session `session_id` exported from here (sealed when `seal`), imported into `to`'s server
  // chunk by chunk as they arrive (under the same id unless `options` names another). Returns the
  // session there; the one here stays (Session::MoveTo drops it; Drain drops them all after its
  // switch).
  absl::StatusOr<Session> CopyTo(const std::string& session_id, SessionClient& to,
                                 const ImportOptions& options = {}, int64_t chunk_rows = 0,
                                 const CallOptions& call = {}, bool seal = false) const;

  // Drops a session by id (one released from a Session, or left by another process), sent to
  // its owner.
  absl::Status Drop(const std::string& session_id, const CallOptions& call = {});

  // The Client whose channel, deadline and token these calls use (client/replicas.h asks its
  // server's room).
  const Client& client() const { return client_; }
  // The channel sessions calls use, and a stub on it (for callers driving the RPCs themselves,
  // as attn_bench does).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::Sessions::Stub& stub() { return *stub_; }
  std::unique_ptr<grpc::ClientContext> NewContext(const CallOptions& call) const {
    return client_.NewContext(call);
  }

 private:
  friend class Session;
  friend class SessionImport;
  // A context for a call about sessions of owner `owner` (SessionOwner of their ids): with the
  // attention-session-owner header unless `owner` is empty.
  std::unique_ptr<grpc::ClientContext> OwnerContext(absl::string_view owner,
                                                    const CallOptions& call) const;
  // rpc(context) with an OwnerContext, again while a session is sealed (kSealedMarker).
  grpc::Status OwnerCall(absl::string_view owner, const CallOptions& call,
                         absl::FunctionRef<grpc::Status(grpc::ClientContext*)> rpc) const;
  // The one owner of a Step's sessions (its entries' or packed session_ids); INVALID_ARGUMENT
  // naming two sessions of different owners.
  static absl::StatusOr<std::string> StepOwner(const v1::StepRequest& request);
  // ListSessions, sent to `owner` (Session::Info; empty: anywhere).
  absl::StatusOr<v1::ListSessionsResponse> ListOn(absl::string_view owner, const CallOptions& call);
  // CreateSession with every optional field: first rows and their tokens, or a prefix.
  absl::StatusOr<Session> CreateSession(const SessionSpec& spec, const v1::Tensor* k,
                                        const v1::Tensor* v, absl::Span<const int64_t> tokens,
                                        absl::Span<const int64_t> prefix_tokens,
                                        const CallOptions& call);
  // The StepRequest for `items` and `options`; an error when an item lacks a session or q.
  static absl::StatusOr<v1::StepRequest> MakeStepRequest(absl::Span<const StepItem> items,
                                                         const StepOptions& options);
  // The packed StepRequest of StepBatch; an error when a session is not this client's or held.
  absl::StatusOr<v1::StepRequest> MakeBatchRequest(absl::Span<Session* const> sessions,
                                                   const v1::Tensor& q, const StepOptions& options,
                                                   const StepBatchTensors& tensors) const;
  // The answer of a packed Step: lengths checked against `sessions` and set on them.
  static absl::StatusOr<StepBatchOutput> TakeBatchResponse(absl::Span<Session* const> sessions,
                                                           std::optional<int32_t> layer,
                                                           v1::StepResponse& response);

  const Client& client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Sessions::Stub> stub_;
};

}  // namespace attention::client
