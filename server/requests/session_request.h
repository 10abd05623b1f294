// Validation of Sessions requests (CreateSession, AppendKv, Step) into what the session store
// takes: shapes, host pointers into the request's bytes, strides. Every check of a call runs
// before anything is appended, so a refused call changes no session. Messages name the field,
// the expected and the actual value (request_decoder's helpers and wording).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "kernels/paged_kv.h"
#include "server/requests/tensor_refs.h"

namespace attention::server {

struct SessionLimits {
  int max_head_dim = 256;
};

v1::DType ToProtoDType(DType dtype);

// A CreateSession: the session's shape and its first rows (rows == 0 when none are given).
struct DecodedCreate {
  KvShape shape;
  KvRows rows;
  int layers = 1;                      // CreateSessionRequest.layers (0 read as 1)
  std::vector<int64_t> tokens;         // of `rows`: none, or one a row
  std::vector<int64_t> prefix_tokens;  // with no rows
};
// CreateSessionRequest.layers at most (a model's layers: a few hundred today).
inline constexpr int kMaxSessionLayers = 4096;
// Tensors given by reference are resolved through `refs` in every decoder below (null: shared
// memory is off, FAILED_PRECONDITION).
absl::StatusOr<DecodedCreate> DecodeCreate(const v1::CreateSessionRequest& request,
                                           const SessionLimits& limits,
                                           TensorRefResolver* refs = nullptr);

// An Export's rows per chunk (ExportRequest.chunk_rows) of a session of `shape`: as asked, at
// most what fits `max_message_bytes` with k and v; 0: what fits 4 MiB (or that limit if less).
absl::StatusOr<int64_t> DecodeChunkRows(int64_t chunk_rows, const KvShape& shape,
                                        int64_t max_message_bytes);

// A replica's name (--replica_name, the prefix of the session ids it makes): 1..32 characters of
// a-z, 0-9 and '-' (a DNS label's, so it can be a host or backend name, and no '.': the id's owner
// is what comes before its first '.').
bool IsReplicaName(absl::string_view name);

// An Import's first message (its header alone): the new session's shape, layers, each layer's
// declared rows, and its id (empty: the server makes one).
struct DecodedImportHeader {
  KvShape shape;
  int layers = 1;
  std::vector<int64_t> lengths;  // [layers]
  std::string id;
};
absl::StatusOr<DecodedImportHeader> DecodeImportHeader(const v1::SessionChunk& chunk,
                                                       const SessionLimits& limits);
// An Import's later message: rows of one layer of a session of `shape` (their order is the
// stream's: sessions/session_transfer.h). Tensors by value only.
struct DecodedImportChunk {
  int layer = 0;
  int64_t first_row = 0;
  KvRows rows;
};
absl::StatusOr<DecodedImportChunk> DecodeImportChunk(const v1::SessionChunk& chunk,
                                                     const KvShape& shape);

// AppendKvRequest.tokens (CreateSessionRequest.tokens: `field` names it): none, or one per row of
// the `rows` appended.
absl::Status CheckTokens(absl::string_view field, int tokens, int64_t rows);

// StepEntry `index`'s tokens: none, or one per appended row (CheckTokens), and then k and v in
// the message: rows read from a region are checked (RequestRegions::Intact) only once the Step
// ran, after their pages would be cached.
absl::Status CheckStepTokens(int index, const v1::StepEntry& entry, int64_t rows);

// The k and v rows to append to a session of `shape`: BHSD [Hkv, n, D] or BSHD [n, Hkv, D] (v with
// the session's Dv for D); both absent (null) is zero rows. `prefix` begins the field names ("",
// "entries[2].").
absl::StatusOr<KvRows> DecodeKvRows(absl::string_view prefix, const v1::Tensor* k,
                                    const v1::Tensor* v, v1::Layout layout, const KvShape& shape,
                                    TensorRefResolver* refs = nullptr);

// The checks of a Step that need no session: entries present, each with a session id (distinct)
// and a q, or the packed form's session ids (distinct) and q; the scale and windows.
absl::Status CheckStep(const v1::StepRequest& request);

// One Step entry checked against its session's shape (which never changes, so this runs before
// the step is queued).
struct DecodedEntry {
  const void* q = nullptr;  // [Hq, Nq, D]
  int64_t heads_q = 0;
  int64_t rows_q = 0;  // Nq
  KvRows rows;         // appended first
  // Where the step's results go: o [Hq, Nq, Dv] (with o_ref the region's bytes, else null until
  // the service points it into the response), lse [Hq, Nq] (null: not asked for).
  char* o = nullptr;
  float* lse = nullptr;
  // Bytes of q, o (q's dtype), k and v, for the overlap check.
  int64_t q_bytes = 0;
  int64_t o_bytes = 0;
  int64_t k_bytes = 0;
  int64_t v_bytes = 0;
};
absl::StatusOr<DecodedEntry> DecodeStepEntry(int index, const v1::StepEntry& entry,
                                             const KvShape& shape,
                                             TensorRefResolver* refs = nullptr);
// A Step of entries, each decoded by DecodeStepEntry: every entry's o_ref apart from every entry's
// q, k, v and every other entry's o_ref (CheckOutputsApart; "entries[2].o_ref: expected bytes
// apart from every input's, got bytes that overlap entries[0].q's").
absl::Status CheckEntriesApart(const std::vector<DecodedEntry>& entries);
// A packed Step (StepRequest.session_ids): the batch's tensors checked against its sessions' one
// `shape` and cut into one entry per sequence pointing into them (q [Hq, Nq, D], k [Hkv, n, D]
// and v [Hkv, n, Dv] of sequence b; with o_ref, its o), so the rest of the Step runs as for
// `entries`.
struct DecodedPacked {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t rows_q = 0;
  std::vector<DecodedEntry> entries;  // [B]
  char* o = nullptr;                  // o_ref's bytes [B, Hq, Nq, Dv], or null: o in the response
  float* lse = nullptr;               // lse_ref's bytes float32 [B, Hq, Nq], or null
};
absl::StatusOr<DecodedPacked> DecodePackedStep(const v1::StepRequest& request, const KvShape& shape,
                                               TensorRefResolver* refs = nullptr);

}  // namespace attention::server
