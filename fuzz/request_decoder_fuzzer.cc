// libFuzzer target over everything the server does with untrusted bytes before a device sees
// them: protobuf parsing of an AttendRequest, validation and decoding (server/request_decoder),
// and, for what the decoder accepts, the CPU kernel itself. The property checked is the server's
// safety contract: any request either fails with INVALID_ARGUMENT or RESOURCE_EXHAUSTED, or it
// decodes into parameters the kernel accepts and computes inside the buffers the decoder sized
// (AddressSanitizer reports any read or write outside them).
//
// Run it with fuzz/run.sh. The seed corpus in fuzz/corpus/ holds the named requests that
// write_seed_corpus makes and the inputs (named by hash) that fuzzing runs found to add coverage,
// merged in with `request_decoder_fuzzer -merge=1 fuzz/corpus NEW_INPUTS_DIR`.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/cpu_attention.h"
#include "server/requests/request_decoder.h"

namespace {

// The kernel runs only on requests this cheap, so each input stays well under a millisecond.
constexpr double kMaxKernelFlops = 4e6;

// Stops the run with a message; libFuzzer saves the input that got here.
void Fail(const char* what) {
  std::fprintf(stderr, "request_decoder_fuzzer: %s\n", what);
  std::abort();
}

void CheckDecoded(const attention::v1::AttendRequest& request,
                  const attention::v1::AttendResponse& response,
                  const attention::server::DecodedRequest& decoded, int max_head_dim) {
  const attention::AttentionParams& p = decoded.params;
  if (p.batch < 1 || p.heads_q < 1 || p.heads_kv < 1 || p.seqlen_q < 1 || p.seqlen_k < 1) {
    Fail("a decoded dimension is not positive");
  }
  if (p.head_dim < 1 || p.head_dim > max_head_dim) Fail("head dim out of range");
  if (p.heads_q % p.heads_kv != 0) Fail("Hq is not a multiple of Hkv");
  if (p.window_left < attention::kUnboundedWindow || p.window_right < attention::kUnboundedWindow) {
    Fail("negative window");
  }
  // o: same dtype, shape and byte size as q, and p.o points at it.
  if (response.o().dtype() != request.q().dtype() ||
      response.o().data().size() != request.q().data().size() ||
      p.o != response.o().data().data() || p.q != request.q().data().data()) {
    Fail("o does not mirror q");
  }
  if (request.return_lse() != (p.lse != nullptr)) Fail("lse presence differs from return_lse");
  if (!attention::CheckParams(p).ok()) Fail("decoded parameters fail the kernel's own check");
  if (decoded.flops < 0 || decoded.query_tokens < 1) Fail("negative work counts");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Protobuf logs every request_id that is not UTF-8; at fuzzing rates that log is the bottleneck.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;

  // Odd-sized inputs get a tiny message limit, so the RESOURCE_EXHAUSTED paths are reached too.
  const attention::server::DecodeOptions options{
      .max_message_bytes = size % 2 == 1 ? 512 : int64_t{64} << 20, .max_head_dim = 256};
  attention::v1::AttendResponse response;
  absl::StatusOr<attention::server::DecodedRequest> decoded =
      attention::server::DecodeRequest(request, options, &response);
  if (!decoded.ok()) {
    const absl::StatusCode code = decoded.status().code();
    if (code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kResourceExhausted) {
      Fail("a refusal that is neither INVALID_ARGUMENT nor RESOURCE_EXHAUSTED");
    }
    if (decoded.status().message().empty()) Fail("a refusal without a message");
    return 0;
  }
  CheckDecoded(request, response, *decoded, options.max_head_dim);

  if (decoded->flops <= kMaxKernelFlops) {
    static attention::cpu::CpuBackend* backend = new attention::cpu::CpuBackend({.threads = 1});
    if (!backend->Forward(decoded->params).ok()) Fail("the CPU kernel refused a decoded request");
  }
  return 0;
}
