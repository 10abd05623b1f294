// libFuzzer target over everything the server does with untrusted bytes before a device sees
// them: protobuf parsing, validation and decoding of the requests that carry tensors.
//
// The first input byte picks the message (its value modulo 4):
//   0  AttendRequest as the server reads it: the wire parser (server/requests/wire_message) over
//      the bytes split into pieces as gRPC's slices split them, checked against protobuf's own
//      parse (whatever it accepts protobuf accepts, with the same fields and tensor bytes), then
//      the decoder over the tensors copied into their own buffer (as the service copies them)
//      and, for what it accepts, the CPU kernel itself; the same bytes also as an AttendChunk
//      (ParseAttendChunk);
//   1  CreateSessionRequest (DecodeCreate);
//   2  AppendKvRequest (DecodeKvRows) against a session whose shape (V head dim included) and
//      length come from the next 4 bytes (SessionFromBytes);
//   3  StepRequest (CheckStep, then DecodeStepEntry for every entry) against such a session.
// The rest of the input is the serialized message.
//
// The property checked is the server's safety contract: any request either fails with
// INVALID_ARGUMENT (or, for Attend, RESOURCE_EXHAUSTED) and a message, or it decodes into what
// the next stage takes: kernel parameters the kernel accepts and computes inside the buffers the
// decoder sized, or KV rows and queries whose pointers, strides and counts stay inside the
// request's bytes. Every element the strides reach is read (AddressSanitizer reports any read
// outside them).
//
// Run it with fuzz/run.sh. The seed corpus in fuzz/corpus/ holds the named inputs that
// write_seed_corpus makes and the inputs (named by hash) that fuzzing runs found to add coverage,
// merged in with `request_decoder_fuzzer -merge=1 fuzz/corpus NEW_INPUTS_DIR`.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_attention.h"
#include "kernels/paged_kv.h"
#include "server/requests/request_decoder.h"
#include "server/requests/session_request.h"
#include "server/requests/wire_message.h"
#include "server/sessions/step_plan.h"

namespace {

// The kernel runs only on requests this cheap, so each input stays well under a millisecond.
constexpr double kMaxKernelFlops = 4e6;

// Stops the run with a message; libFuzzer saves the input that got here.
void Fail(const char* what) {
  std::fprintf(stderr, "request_decoder_fuzzer: %s\n", what);
  std::abort();
}

void CheckDecoded(const attention::server::DecodedRequest& decoded, int max_head_dim) {
  const attention::AttentionParams& p = decoded.params;
  if (p.batch < 1 || p.heads_q < 1 || p.heads_kv < 1 || p.seqlen_q < 1 || p.seqlen_k < 1) {
    Fail("a decoded dimension is not positive");
  }
  if (p.head_dim < 1 || p.head_dim > max_head_dim) Fail("head dim out of range");
  if (p.heads_q % p.heads_kv != 0) Fail("Hq is not a multiple of Hkv");
  if (p.window_left < attention::kUnboundedWindow || p.window_right < attention::kUnboundedWindow) {
    Fail("negative window");
  }
  if (!attention::CheckParams(p).ok()) Fail("decoded parameters fail the kernel's own check");
  if (decoded.flops < 0 || decoded.query_tokens < 1) Fail("negative work counts");
}

// The bytes in pieces of 1..16 bytes whose sizes come from the bytes themselves, so that every
// kind of boundary (inside a tag, a length, a tensor's data) is met.
attention::server::WireBytes Pieces(const uint8_t* data, size_t size) {
  std::vector<absl::string_view> pieces;
  for (size_t pos = 0; pos < size;) {
    const size_t n = std::min<size_t>(1 + (data[pos] + pos) % 16, size - pos);
    pieces.emplace_back(reinterpret_cast<const char*>(data) + pos, n);
    pos += n;
  }
  return attention::server::WireBytes(std::move(pieces));
}

void CheckRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument &&
      status.code() != absl::StatusCode::kResourceExhausted) {
    Fail("a refusal that is neither INVALID_ARGUMENT nor RESOURCE_EXHAUSTED");
  }
  if (status.message().empty()) Fail("a refusal without a message");
}

void FuzzAttend(const uint8_t* data, size_t size) {
  const attention::server::WireBytes wire = Pieces(data, size);
  attention::server::WireAttendChunk chunk;
  if (absl::Status s = attention::server::ParseAttendChunk(wire, &chunk); !s.ok()) {
    CheckRefusal(s);
  } else if (chunk.data.begin < 0 || chunk.data.size < 0 ||
             chunk.data.begin + chunk.data.size > wire.size()) {
    Fail("a chunk's data range outside the message");
  }

  attention::server::WireAttendRequest parsed;
  attention::v1::AttendRequest request;
  const bool protobuf_parses = request.ParseFromArray(data, static_cast<int>(size));
  if (absl::Status s = attention::server::ParseAttendRequest(wire, &parsed); !s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument) Fail("a parse error not INVALID_ARGUMENT");
    if (s.message().empty()) Fail("a parse error without a message");
    return;
  }
  if (!protobuf_parses) Fail("the wire parser accepted bytes protobuf refuses");
  // The same fields and tensor bytes as protobuf's parse.
  std::string tensor_data[3];
  int i = 0;
  for (const auto& [range, t] :
       {std::pair{parsed.q, request.q()}, {parsed.k, request.k()}, {parsed.v, request.v()}}) {
    if (range.begin < 0 || range.size < 0 || range.begin + range.size > wire.size()) {
      Fail("a tensor's data range outside the message");
    }
    tensor_data[i].resize(range.size);
    wire.CopyTo(range.begin, range.size, tensor_data[i].data());
    if (tensor_data[i] != t.data()) Fail("tensor bytes differ from protobuf's parse");
    ++i;
  }
  attention::v1::AttendRequest expected = request;
  // (Only tensors that are present: mutable_q() would add an absent one.)
  if (expected.has_q()) expected.mutable_q()->clear_data();
  if (expected.has_k()) expected.mutable_k()->clear_data();
  if (expected.has_v()) expected.mutable_v()->clear_data();
  expected.DiscardUnknownFields();
  attention::v1::AttendRequest header = parsed.header;
  header.DiscardUnknownFields();
  // Compared as their serialized bytes (canonical field order; a NaN scale equals itself there).
  if (header.SerializeAsString() != expected.SerializeAsString()) {
    Fail("the parsed fields differ from protobuf's parse");
  }

  // Odd-sized inputs get a tiny message limit, so the RESOURCE_EXHAUSTED paths are reached too.
  const attention::server::DecodeOptions options{
      .max_message_bytes = size % 2 == 1 ? 512 : int64_t{64} << 20, .max_head_dim = 256};
  absl::StatusOr<attention::server::DecodedRequest> decoded =
      attention::server::DecodeRequest(parsed.header,
                                       attention::server::InputTensors{.q_bytes = parsed.q.size,
                                                                       .k_bytes = parsed.k.size,
                                                                       .v_bytes = parsed.v.size,
                                                                       .q = tensor_data[0].data(),
                                                                       .k = tensor_data[1].data(),
                                                                       .v = tensor_data[2].data()},
                                       options);
  if (!decoded.ok()) return CheckRefusal(decoded.status());
  // o and lse placed as the service places them: buffers of the sizes the decoder gives.
  std::vector<char> o(decoded->o_bytes);
  std::vector<float> lse(decoded->lse_bytes / sizeof(float));
  decoded->params.o = o.data();
  if (decoded->lse_bytes > 0) decoded->params.lse = lse.data();
  // o mirrors q, in bfloat16 (two bytes an element) for float8 q.
  const bool float8 = request.q().dtype() == attention::v1::DTYPE_FLOAT8_E4M3;
  if (decoded->o_bytes != static_cast<int64_t>(request.q().data().size()) * (float8 ? 2 : 1) ||
      decoded->o.dtype() != (float8 ? attention::v1::DTYPE_BFLOAT16 : request.q().dtype())) {
    Fail("o does not mirror q");
  }
  if (request.return_lse() != (decoded->params.lse != nullptr)) {
    Fail("lse presence differs from return_lse");
  }
  CheckDecoded(*decoded, options.max_head_dim);

  if (decoded->flops <= kMaxKernelFlops) {
    static attention::cpu::CpuBackend* backend = new attention::cpu::CpuBackend({.threads = 1});
    if (!backend->Forward(decoded->params).ok()) Fail("the CPU kernel refused a decoded request");
  }
}

// Sessions requests are refused with INVALID_ARGUMENT and a message, nothing else; a float8
// session (which no backend holds) with UNIMPLEMENTED.
void CheckSessionRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument &&
      status.code() != absl::StatusCode::kUnimplemented) {
    Fail("a Sessions refusal that is neither INVALID_ARGUMENT nor UNIMPLEMENTED");
  }
  if (status.message().empty()) Fail("a Sessions refusal without a message");
}

// The session a fuzzed AppendKv or Step runs against, from 4 input bytes: dtype, kv heads
// (1..8), head dim (1..256) and rows held (0..255), as a CreateSession could have made it.
struct FuzzedSession {
  attention::KvShape shape;
  int64_t length = 0;
};
// Byte 0: the dtype (% 3) and, by (bytes[0] / 3) % 3, V of the head dim (0), a V head dim of its
// own (1: half the head dim, rounded up), or that V as k's first features (2: v_from_k); byte 1:
// kv heads; byte 2: the head dim; byte 3: the length.
FuzzedSession SessionFromBytes(const uint8_t* bytes) {
  constexpr attention::DType kDTypes[] = {attention::DType::kFloat32, attention::DType::kFloat16,
                                          attention::DType::kBFloat16};
  const int64_t head_dim = 1 + bytes[2];
  const int v_mode = bytes[0] / 3 % 3;
  return {.shape = {.dtype = kDTypes[bytes[0] % 3],
                    .heads_kv = 1 + bytes[1] % 8,
                    .head_dim = head_dim,
                    .v_head_dim = v_mode != 0 ? (head_dim + 1) / 2 : head_dim,
                    .v_from_k = v_mode == 2},
          .length = bytes[3]};
}

// Reads every element [head, row, 0..D) (of v: 0..Dv, at VStride's strides) that `rows`' strides
// reach in k and v, as the KV write does, and checks that the byte counts match the tensors the
// rows came from. A shape whose v is k's first features (v_from_k) takes k alone: a v is refused.
void CheckKvRows(const attention::KvRows& rows, const attention::v1::Tensor* k,
                 const attention::v1::Tensor* v, const attention::KvShape& shape) {
  if (rows.rows < 0) Fail("negative KV rows");
  if (shape.v_from_k && (v != nullptr || rows.v != nullptr)) {
    Fail("a v taken for a session whose v is k's first features");
  }
  if (rows.rows == 0) {
    if (rows.k != nullptr || rows.v != nullptr) Fail("KV pointers without rows");
    return;
  }
  if (k == nullptr || (v == nullptr && !shape.v_from_k)) Fail("KV rows from no tensors");
  if (rows.k != k->data().data() || (v != nullptr && rows.v != v->data().data())) {
    Fail("KV pointers outside the request's tensors");
  }
  const int64_t element = static_cast<int64_t>(attention::DTypeSize(shape.dtype));
  // k's (D) and v's (Dv): each tensor's bytes, its strides and its row's elements.
  struct Side {
    const void* base;
    const attention::v1::Tensor* tensor;
    int64_t head_stride, row_stride, dim;
  };
  const Side sides[] = {{rows.k, k, rows.head_stride, rows.row_stride, shape.head_dim},
                        {rows.v, v, attention::VStride(shape, rows.head_stride),
                         attention::VStride(shape, rows.row_stride), shape.value_head_dim()}};
  // Touch what the strides reach, so AddressSanitizer sees any read outside the buffers.
  volatile uint8_t sink = 0;
  for (const Side& side : sides) {
    if (side.tensor == nullptr) continue;  // v of a v_from_k shape
    const int64_t bytes = rows.rows * shape.heads_kv * side.dim * element;
    if (static_cast<int64_t>(side.tensor->data().size()) != bytes) {
      Fail("KV rows do not cover their tensors' bytes exactly");
    }
    const int64_t last =
        (shape.heads_kv - 1) * side.head_stride + (rows.rows - 1) * side.row_stride + side.dim - 1;
    if (side.head_stride < 1 || side.row_stride < 1 || (last + 1) * element > bytes) {
      Fail("KV strides reach outside the tensors");
    }
    const auto* p = static_cast<const uint8_t*>(side.base);
    for (int64_t h = 0; h < shape.heads_kv; ++h) {
      for (int64_t r = 0; r < rows.rows; ++r) {
        const int64_t first = (h * side.head_stride + r * side.row_stride) * element;
        sink = sink + p[first] + p[first + side.dim * element - 1];
      }
    }
  }
}

void FuzzCreate(const uint8_t* data, size_t size) {
  attention::v1::CreateSessionRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return;
  const attention::server::SessionLimits limits{.max_head_dim = 256};
  absl::StatusOr<attention::server::DecodedCreate> decoded =
      attention::server::DecodeCreate(request, limits);
  if (!decoded.ok()) return CheckSessionRefusal(decoded.status());
  const attention::KvShape& shape = decoded->shape;
  if (shape.heads_kv != request.kv_heads() || shape.head_dim != request.head_dim() ||
      shape.heads_kv < 1 || shape.head_dim < 1 || shape.head_dim > limits.max_head_dim ||
      shape.value_head_dim() !=
          (request.v_head_dim() > 0 ? request.v_head_dim() : shape.head_dim) ||
      shape.value_head_dim() > limits.max_head_dim) {
    Fail("a created session's shape is not the request's, or out of range");
  }
  if (attention::server::ToProtoDType(shape.dtype) != request.dtype()) Fail("dtype changed");
  CheckKvRows(decoded->rows, request.has_k() ? &request.k() : nullptr,
              request.has_v() ? &request.v() : nullptr, shape);
}

void FuzzAppend(const uint8_t* data, size_t size) {
  if (size < 4) return;
  const FuzzedSession session = SessionFromBytes(data);
  attention::v1::AppendKvRequest request;
  if (!request.ParseFromArray(data + 4, static_cast<int>(size - 4))) return;
  const attention::v1::Tensor* k = request.has_k() ? &request.k() : nullptr;
  const attention::v1::Tensor* v = request.has_v() ? &request.v() : nullptr;
  absl::StatusOr<attention::KvRows> rows =
      attention::server::DecodeKvRows("", k, v, request.layout(), session.shape);
  if (!rows.ok()) return CheckSessionRefusal(rows.status());
  CheckKvRows(*rows, k, v, session.shape);
}

// A packed Step (session_ids) checked by CheckStep: every sequence's entry must point inside the
// batch's tensors, cover them exactly, and fit the sessions' rows.
void FuzzPackedStep(const attention::v1::StepRequest& request, const FuzzedSession& session,
                    int64_t element) {
  const attention::KvShape& shape = session.shape;
  absl::StatusOr<attention::server::DecodedPacked> packed =
      attention::server::DecodePackedStep(request, shape);
  if (!packed.ok()) return CheckSessionRefusal(packed.status());
  const int64_t batch = request.session_ids_size();
  if (packed->batch != batch || static_cast<int64_t>(packed->entries.size()) != batch) {
    Fail("a packed Step decoded into another number of sequences than session_ids");
  }
  const int64_t q_bytes = packed->heads_q * packed->rows_q * shape.head_dim * element;
  if (packed->heads_q < 1 || packed->rows_q < 1 || packed->heads_q % shape.heads_kv != 0 ||
      batch * q_bytes != static_cast<int64_t>(request.q().data().size())) {
    Fail("a packed Step's q shape does not cover its bytes exactly");
  }
  const char* q = request.q().data().data();
  for (int64_t b = 0; b < batch; ++b) {
    const attention::server::DecodedEntry& entry = packed->entries[b];
    if (entry.q != q + b * q_bytes) Fail("a packed Step's sequence q is not its slice of q");
    const int64_t k_bytes = entry.rows.rows * shape.heads_kv * shape.head_dim * element;
    const int64_t v_bytes = entry.rows.rows * shape.heads_kv * shape.value_head_dim() * element;
    if (shape.v_from_k && (request.has_v() || entry.rows.v != nullptr)) {
      Fail("a packed Step's v taken for sessions whose v is k's first features");
    }
    if (entry.rows.rows > 0 &&
        (entry.rows.k != request.k().data().data() + b * k_bytes ||
         batch * k_bytes != static_cast<int64_t>(request.k().data().size()) ||
         (!shape.v_from_k &&
          (entry.rows.v != request.v().data().data() + b * v_bytes ||
           batch * v_bytes != static_cast<int64_t>(request.v().data().size()))))) {
      Fail("a packed Step's sequence rows are not their slice of k and v");
    }
    const absl::Status fits =
        attention::server::CheckQueriesFit([] { return std::string("q.shape[2] (queries)"); },
                                           entry.rows_q, entry.rows.rows, session.length);
    if (!fits.ok()) {
      CheckSessionRefusal(fits);
    } else if (entry.rows_q > session.length + entry.rows.rows) {
      Fail("queries beyond the session's rows after the append");
    }
  }
}

void FuzzStep(const uint8_t* data, size_t size) {
  if (size < 4) return;
  const FuzzedSession session = SessionFromBytes(data);
  attention::v1::StepRequest request;
  if (!request.ParseFromArray(data + 4, static_cast<int>(size - 4))) return;
  const absl::Status checked = attention::server::CheckStep(request);
  if (!checked.ok()) return CheckSessionRefusal(checked);
  const attention::KvShape& shape = session.shape;
  const int64_t element = static_cast<int64_t>(attention::DTypeSize(shape.dtype));
  if (request.session_ids_size() > 0) return FuzzPackedStep(request, session, element);
  if (request.entries_size() < 1) Fail("a Step without entries passed CheckStep");
  // Every entry against the one fuzzed session shape (in the server each has its own session).
  for (int i = 0; i < request.entries_size(); ++i) {
    const attention::v1::StepEntry& entry = request.entries(i);
    absl::StatusOr<attention::server::DecodedEntry> decoded =
        attention::server::DecodeStepEntry(i, entry, shape);
    if (!decoded.ok()) {
      CheckSessionRefusal(decoded.status());
      continue;
    }
    if (decoded->q != entry.q().data().data()) Fail("q points outside the request's tensor");
    if (decoded->heads_q < 1 || decoded->rows_q < 1 || decoded->heads_q % shape.heads_kv != 0) {
      Fail("decoded query heads or rows out of range");
    }
    if (decoded->heads_q * decoded->rows_q * shape.head_dim * element !=
        static_cast<int64_t>(entry.q().data().size())) {
      Fail("q's decoded shape does not cover its bytes exactly");
    }
    CheckKvRows(decoded->rows, entry.has_k() ? &entry.k() : nullptr,
                entry.has_v() ? &entry.v() : nullptr, shape);
    // The check that needs the session's length: queries are its last positions.
    const absl::Status fits = attention::server::CheckQueriesFit(
        [i] { return absl::StrCat("entries[", i, "].q.shape[1] (queries)"); }, decoded->rows_q,
        decoded->rows.rows, session.length);
    if (!fits.ok()) {
      CheckSessionRefusal(fits);
    } else if (decoded->rows_q > session.length + decoded->rows.rows) {
      Fail("queries beyond the session's rows after the append");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Protobuf logs every request_id that is not UTF-8; at fuzzing rates that log is the bottleneck.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  switch (data[0] % 4) {
    case 0:
      FuzzAttend(data + 1, size - 1);
      break;
    case 1:
      FuzzCreate(data + 1, size - 1);
      break;
    case 2:
      FuzzAppend(data + 1, size - 1);
      break;
    default:
      FuzzStep(data + 1, size - 1);
      break;
  }
  return 0;
}
