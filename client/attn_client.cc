// attn_client: sends one attention request (or --repeat of them) to an attention server and
// prints what came back; with --check, compares it with the float64 reference computed here.
//
//   attn_client --target=localhost:50051 --shape=2,16,1024,128 --kv_heads=4 --dtype=bfloat16
//       --causal --check
//   attn_client --health          # exit 0 when the server reports SERVING (container probes)
//   attn_client --info            # the server's devices, dtypes and limits
//
// Exit status: 0 success; 1 the check failed, the server is not SERVING, or a call failed;
// 2 bad flags or inputs.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "client/npy.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "client/tool_flags.h"
#include "kernels/attention_params.h"

ABSL_FLAG(std::string, target, "localhost:50051", "server address, host:port");
ABSL_FLAG(int64_t, deadline_ms, 60000, "deadline per call, milliseconds");
ABSL_FLAG(bool, health, false,
          "health-check mode: call grpc.health.v1 Check and exit 0 when SERVING, else 1");
ABSL_FLAG(std::string, health_service, "",
          "service to health-check; empty for the server as a whole");
ABSL_FLAG(bool, info, false, "print GetServerInfo and exit");

ABSL_FLAG(std::optional<attention::client::Shape>, shape, std::nullopt,
          "B,H,N,D: batch, query heads, query length, head dim (positive integers; default: "
          "--q's shape, else 1,8,512,64)");
ABSL_FLAG(std::optional<int64_t>, kv_heads, std::nullopt, "key/value heads (default: H)");
ABSL_FLAG(std::optional<int64_t>, nk, std::nullopt, "key length (default: N)");
ABSL_FLAG(std::optional<std::string>, dtype, std::nullopt,
          "float32 | float16 | bfloat16 | float8_e4m3 (default: float16 for a '<f2' --q file, "
          "else float32); float8_e4m3 inputs get o in bfloat16");
ABSL_FLAG(std::optional<float>, q_descale, std::nullopt,
          "float8_e4m3: q's descale factor (the server computes with q * q_descale; default 1)");
ABSL_FLAG(std::optional<float>, k_descale, std::nullopt, "float8_e4m3: k's descale factor");
ABSL_FLAG(std::optional<float>, v_descale, std::nullopt, "float8_e4m3: v's descale factor");
ABSL_FLAG(int, max_message_mb, 1024,
          "largest gRPC message sent or received, MiB (1..2047); a larger request is refused "
          "before it is built (the server has its own limit: --info)");
ABSL_FLAG(double, chunk_mb, 16, "AttendChunked: MiB per chunk");
ABSL_FLAG(double, max_chunked_mb, 8192,
          "largest request sent through AttendChunked, MiB (the server's own limit is "
          "--max_chunked_request_mb, in --info); larger ones are refused before they are built");
ABSL_FLAG(double, chunked_above_mb, 512,
          "send requests whose q + k + v exceed this many MiB through AttendChunked (needed over "
          "2 GiB or the server's message limit); 0: always Attend");
ABSL_FLAG(std::string, layout, "bhsd", "bhsd ([B, H, N, D]) | bshd ([B, N, H, D])");
ABSL_FLAG(bool, causal, false, "causal mask (aligned as --mask_alignment says)");
ABSL_FLAG(std::string, mask_alignment, "bottom_right",
          "where the causal/window mask's diagonal sits when Nq != Nk: bottom_right (query i on "
          "key i + Nk - Nq, FlashAttention's) | top_left (query i on key i, torch SDPA's)");
ABSL_FLAG(std::optional<float>, scale, std::nullopt, "softmax scale (default: 1/sqrt(D))");
ABSL_FLAG(std::optional<int32_t>, window_left, std::nullopt, "sliding window, keys to the left");
ABSL_FLAG(std::optional<int32_t>, window_right, std::nullopt, "sliding window, keys to the right");
ABSL_FLAG(bool, lse, false, "ask for the log-sum-exp too");
ABSL_FLAG(std::vector<std::string>, varlen, {},
          "varlen: per-item query lengths, e.g. 100,37,512 (packs q/k/v [total, H, D]; "
          "--shape's B and N are then ignored)");
ABSL_FLAG(std::vector<std::string>, varlen_k, {},
          "varlen: per-item key lengths (default: --varlen)");
ABSL_FLAG(std::string, q, "",
          ".npy file for q ('<f4' or '<f2'), with --k and --v; gives --shape and --dtype unless "
          "they are set");
ABSL_FLAG(std::string, k, "", ".npy file for k; gives --kv_heads and --nk unless they are set");
ABSL_FLAG(std::string, v, "", ".npy file for v");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt, "seed for random inputs (default: random)");
ABSL_FLAG(std::string, out, "",
          "write o to this .npy ('<f2' for float16, else '<f4'; bfloat16 is exact in float32)");
ABSL_FLAG(int, repeat, 1, "send the request this many times (latency statistics)");
ABSL_FLAG(bool, tls, false, "connect over TLS (implied by --tls_ca, --tls_cert)");
ABSL_FLAG(std::string, tls_ca, "", "PEM roots to verify the server with (default: the system's)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mutual TLS (needs --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token, sent as 'authorization: Bearer <token>'");
ABSL_FLAG(bool, check, false,
          "compare with the float64 reference; exit 1 when ||o-ref||/||ref|| exceeds the API "
          "bound (float32 1e-5, float16/bfloat16/float8_e4m3 1e-2)");

namespace attention::client {
namespace {

constexpr int kExitFailed = 1;

absl::StatusOr<std::vector<int64_t>> ParseInts(absl::Span<const std::string> parts,
                                               const char* flag) {
  std::vector<int64_t> values;
  for (const std::string& part : parts) {
    int64_t value;
    if (!absl::SimpleAtoi(part, &value)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not a number"));
    }
    values.push_back(value);
  }
  return values;
}

// The --q, --k, --v files, read before the problem is described since they may describe it.
using InputFiles = std::array<std::optional<NpyArray>, 3>;

absl::StatusOr<InputFiles> ReadInputFiles() {
  InputFiles files;
  const std::string paths[] = {absl::GetFlag(FLAGS_q), absl::GetFlag(FLAGS_k),
                               absl::GetFlag(FLAGS_v)};
  // A missing one would be random, and the answer, computed on noise, would look like any other.
  const int given = static_cast<int>(std::count_if(
      std::begin(paths), std::end(paths), [](const std::string& path) { return !path.empty(); }));
  if (given != 0 && given != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--q, --k and --v go together (each tensor from its file), got ",
                     paths[0].empty() ? "" : "--q ", paths[1].empty() ? "" : "--k ",
                     paths[2].empty() ? "" : "--v ", "only"));
  }
  for (int i = 0; i < 3; ++i) {
    if (paths[i].empty()) continue;
    absl::StatusOr<NpyArray> array = ReadNpy(paths[i]);
    if (!array.ok()) return array.status();
    files[i] = *std::move(array);
  }
  return files;
}

// The flags' problem; unset flags come from the files: B, Hq, Nq, D and the dtype from q's
// shape and element type, Hkv and Nk from k's shape (rank 4, in --layout's order).
absl::StatusOr<ProblemSpec> SpecFromFlags(const InputFiles& files) {
  ProblemSpec spec;
  const std::string layout = absl::GetFlag(FLAGS_layout);
  if (layout != "bhsd" && layout != "bshd") {
    return absl::InvalidArgumentError(absl::StrCat("--layout must be bhsd or bshd, got ", layout));
  }
  spec.layout = layout == "bshd" ? v1::LAYOUT_BSHD : v1::LAYOUT_BHSD;
  const int head_axis = spec.layout == v1::LAYOUT_BSHD ? 2 : 1;
  const std::optional<NpyArray>& q_file = files[0];
  const std::optional<NpyArray>& k_file = files[1];
  Shape shape{1, 8, 512, 64};
  if (absl::GetFlag(FLAGS_shape)) {
    shape = *absl::GetFlag(FLAGS_shape);
  } else if (q_file && q_file->shape.size() == 4) {
    shape = {q_file->shape[0], q_file->shape[head_axis], q_file->shape[3 - head_axis],
             q_file->shape[3]};
  }
  spec.batch = shape.batch;
  spec.heads_q = shape.heads;
  spec.seqlen_q = shape.seqlen;
  spec.head_dim = shape.head_dim;
  const bool k_gives = k_file && k_file->shape.size() == 4;
  spec.heads_kv =
      absl::GetFlag(FLAGS_kv_heads).value_or(k_gives ? k_file->shape[head_axis] : spec.heads_q);
  spec.seqlen_k =
      absl::GetFlag(FLAGS_nk).value_or(k_gives ? k_file->shape[3 - head_axis] : spec.seqlen_q);
  if (absl::Status s = CheckKvFlags(spec); !s.ok()) return s;
  const bool half_file = q_file && q_file->type == NpyType::kFloat16;
  absl::StatusOr<v1::DType> dtype =
      ParseDType(absl::GetFlag(FLAGS_dtype).value_or(half_file ? "float16" : "float32"));
  if (!dtype.ok()) return dtype.status();
  spec.dtype = *dtype;
  spec.causal = absl::GetFlag(FLAGS_causal);
  const std::string alignment = absl::GetFlag(FLAGS_mask_alignment);
  if (alignment != "bottom_right" && alignment != "top_left") {
    return absl::InvalidArgumentError(
        absl::StrCat("--mask_alignment must be bottom_right or top_left, got ", alignment));
  }
  spec.mask_alignment =
      alignment == "top_left" ? v1::MASK_ALIGN_TOP_LEFT : v1::MASK_ALIGN_BOTTOM_RIGHT;
  spec.softmax_scale = absl::GetFlag(FLAGS_scale);
  spec.window_left = absl::GetFlag(FLAGS_window_left);
  spec.window_right = absl::GetFlag(FLAGS_window_right);
  spec.return_lse = absl::GetFlag(FLAGS_lse);
  spec.q_descale = absl::GetFlag(FLAGS_q_descale);
  spec.k_descale = absl::GetFlag(FLAGS_k_descale);
  spec.v_descale = absl::GetFlag(FLAGS_v_descale);
  for (auto [flag, name, lengths] : {std::tuple{&FLAGS_varlen, "varlen", &spec.varlen_q},
                                     std::tuple{&FLAGS_varlen_k, "varlen_k", &spec.varlen_k}}) {
    absl::StatusOr<std::vector<int64_t>> values = ParseInts(absl::GetFlag(*flag), name);
    if (!values.ok()) return values.status();
    if (std::any_of(values->begin(), values->end(), [](int64_t n) { return n < 0; })) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": lengths must be >= 0"));
    }
    lengths->assign(values->begin(), values->end());
  }
  if (!spec.varlen_k.empty() && spec.varlen_k.size() != spec.varlen_q.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--varlen_k: expected ", spec.varlen_q.size(),
                                                   " lengths (one per --varlen "
                                                   "item), got ",
                                                   spec.varlen_k.size()));
  }
  if (spec.is_varlen()) spec.batch = static_cast<int64_t>(spec.varlen_q.size());
  return spec;
}

// q, k, v from the --q/--k/--v files, or random normal from the seed.
absl::StatusOr<v1::AttendRequest> BuildRequest(const ProblemSpec& spec, InputFiles& files) {
  uint64_t seed = absl::GetFlag(FLAGS_seed).value_or(std::random_device()());
  std::printf("problem: %s (seed %llu)\n", DescribeProblem(spec).c_str(),
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> shapes[] = {QueryShape(spec), KeyValueShape(spec),
                                         KeyValueShape(spec)};
  const char* names[] = {"--q", "--k", "--v"};
  std::vector<float> data[3];
  for (int i = 0; i < 3; ++i) {
    if (!files[i]) {
      data[i] = RandomNormal(NumElements(shapes[i]), rng);
      continue;
    }
    if (files[i]->shape != shapes[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(names[i], " has shape [", absl::StrJoin(files[i]->shape, ", "),
                       "], the request needs [", absl::StrJoin(shapes[i], ", "), "]"));
    }
    data[i] = std::move(files[i]->values);
  }
  return MakeRequest(spec, data[0], data[1], data[2]);
}

// A failed call's status, and what to do about it where the status alone does not say: a call
// past --deadline_ms, and a connection refused or failed where TLS is on one side only (gRPC's
// texts: "Connection refused"; a plaintext client of a TLS server reads "Socket closed", a TLS
// client of a plaintext server "Ssl handshake failed: ... wrong version number").
std::string Advised(const absl::Status& status) {
  std::string text = status.ToString();
  const std::string target = absl::GetFlag(FLAGS_target);
  const bool tls = absl::GetFlag(FLAGS_tls) || !absl::GetFlag(FLAGS_tls_ca).empty() ||
                   !absl::GetFlag(FLAGS_tls_cert).empty();
  const auto says = [&status](absl::string_view what) {
    return absl::StrContains(status.message(), what);
  };
  if (absl::IsDeadlineExceeded(status)) {
    absl::StrAppend(
        &text, "\n  the call took longer than --deadline_ms=", absl::GetFlag(FLAGS_deadline_ms),
        ": raise it for a request this large (or a busy server), or send less");
  } else if (!absl::IsUnavailable(status)) {
    return text;
  } else if (says("Connection refused")) {
    absl::StrAppend(&text, "\n  nothing listens at --target=", target,
                    ": is the server running, on this host and port?");
  } else if (tls && says("andshake")) {
    absl::StrAppend(&text,
                    "\n  the TLS handshake failed: if the server serves plaintext (started "
                    "without --tls_cert), leave out --tls, --tls_ca and --tls_cert; if it serves "
                    "TLS, --tls_ca must hold the CA that signed its certificate, --target must "
                    "name a host the certificate is for, and a server with --tls_client_ca needs "
                    "--tls_cert and --tls_key");
  } else if (!tls && says("Socket closed")) {
    absl::StrAppend(&text,
                    "\n  the server closed the connection: if it serves TLS (started with "
                    "--tls_cert), pass --tls_ca=CA.pem (and --tls_cert and --tls_key for mutual "
                    "TLS)");
  }
  return text;
}

int RunHealth(Client& client) {
  const std::string service = absl::GetFlag(FLAGS_health_service);
  absl::StatusOr<HealthStatus> status = client.CheckHealth(service);
  if (!status.ok()) {
    std::fprintf(stderr, "health check failed: %s\n", Advised(status.status()).c_str());
    return kExitFailed;
  }
  std::printf("%s: %s\n", service.empty() ? "(server)" : service.c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : kExitFailed;
}

int RunInfo(Client& client) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "GetServerInfo failed: %s\n", Advised(info.status()).c_str());
    return kExitFailed;
  }
  std::printf("%s", info->DebugString().c_str());
  return 0;
}

void PrintLatencies(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  double sum = 0;
  for (double x : ms) sum += x;
  std::printf("round trip: %.3f ms", ms[ms.size() / 2]);
  if (ms.size() > 1) {
    std::printf(" median, %.3f min, %.3f mean, %.3f max over %zu calls", ms.front(),
                sum / ms.size(), ms.back(), ms.size());
  }
  std::printf("\n");
}

// The request's size from its shapes, before any of it is built: q, k and v at the dtype's width.
int64_t EstimateRequestBytes(const ProblemSpec& spec) {
  const int64_t width = DTypeBytes(spec.dtype);
  return width * (NumElements(QueryShape(spec)) + 2 * NumElements(KeyValueShape(spec)));
}

// The request's work as the server counts it (server/requests/request_decoder.cc): 4 * Hq * D per
// (query row, visible key) pair.
double RequestFlops(const ProblemSpec& spec) {
  const int64_t left = spec.window_left.value_or(kUnboundedWindow);
  const int64_t right = spec.causal ? 0 : spec.window_right.value_or(kUnboundedWindow);
  const MaskAlignment alignment = spec.mask_alignment == v1::MASK_ALIGN_TOP_LEFT
                                      ? MaskAlignment::kTopLeft
                                      : MaskAlignment::kBottomRight;
  double pairs = 0;
  if (spec.is_varlen()) {
    for (size_t b = 0; b < spec.varlen_q.size(); ++b) {
      const int64_t nk = spec.varlen_k.empty() ? spec.varlen_q[b] : spec.varlen_k[b];
      pairs += static_cast<double>(VisibleKeyPairs(spec.varlen_q[b], nk, left, right, alignment));
    }
  } else {
    pairs =
        static_cast<double>(spec.batch) *
        static_cast<double>(VisibleKeyPairs(spec.seqlen_q, spec.seqlen_k, left, right, alignment));
  }
  return 4.0 * static_cast<double>(spec.heads_q) * static_cast<double>(spec.head_dim) * pairs;
}

int RunAttend(Client& client, int64_t max_message_bytes) {
  absl::StatusOr<InputFiles> files = ReadInputFiles();
  absl::StatusOr<ProblemSpec> spec =
      files.ok() ? SpecFromFlags(*files) : absl::StatusOr<ProblemSpec>(files.status());
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
    return kExitUsage;
  }
  // Unary up to the message limit; chunked above --chunked_above_mb, up to --max_chunked_mb.
  const int64_t chunked_above = client.options().chunked_above_bytes;
  const int64_t max_chunked = static_cast<int64_t>(absl::GetFlag(FLAGS_max_chunked_mb) * (1 << 20));
  const int64_t bytes = EstimateRequestBytes(*spec);
  const bool chunked = chunked_above > 0 && bytes > chunked_above;
  if ((!chunked && bytes > max_message_bytes) || (chunked && bytes > max_chunked)) {
    std::fprintf(
        stderr,
        "the request would be %.1f MiB, over --max_message_mb=%lld%s; raise it (the "
        "server's limits are in --info) or send less\n",
        static_cast<double>(bytes) / (1 << 20), static_cast<long long>(max_message_bytes >> 20),
        chunked
            ? absl::StrCat(" and, sent chunked, over --max_chunked_mb=", max_chunked >> 20).c_str()
            : "");
    return kExitUsage;
  }
  // The server's work limit, before anything is built: a request over it would be refused after
  // its tensors were drawn and sent.
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "GetServerInfo failed: %s\n", Advised(info.status()).c_str());
    return kExitFailed;
  }
  if (const double flops = RequestFlops(*spec);
      info->limits().max_request_flops() > 0 && flops > info->limits().max_request_flops()) {
    std::fprintf(stderr,
                 "the request would need %s FLOPs (4 * Hq * D * visible pairs), over the "
                 "server's limit of %s per request (its --max_request_flops, in --info); "
                 "split it over several calls\n",
                 absl::StrCat(absl::SixDigits(flops)).c_str(),
                 absl::StrCat(absl::SixDigits(info->limits().max_request_flops())).c_str());
    return kExitUsage;
  }
  absl::StatusOr<v1::AttendRequest> request = BuildRequest(*spec, *files);
  if (!request.ok()) {
    std::fprintf(stderr, "%s\n", request.status().ToString().c_str());
    return kExitUsage;
  }
  std::printf("request: %.3f MiB\n", request->ByteSizeLong() / (1024.0 * 1024.0));

  const int repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  std::vector<double> latencies_ms;
  v1::AttendResponse response;
  for (int i = 0; i < repeat; ++i) {
    request->set_request_id(absl::StrCat("attn_client-", i));
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<v1::AttendResponse> result = client.Attend(*request);
    const auto end = std::chrono::steady_clock::now();
    if (!result.ok()) {
      std::fprintf(stderr, "Attend failed: %s\n", Advised(result.status()).c_str());
      return kExitFailed;
    }
    latencies_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    response = *std::move(result);
  }

  absl::StatusOr<std::vector<float>> o = TensorToFloat(response.o());
  if (!o.ok()) {
    std::fprintf(stderr, "bad response: %s\n", o.status().ToString().c_str());
    return kExitFailed;
  }
  double sum = 0, sum_abs = 0;
  for (float x : *o) {
    sum += x;
    sum_abs += std::abs(x);
  }
  const v1::ServerTiming& t = response.timing();
  std::printf("device: %s\n", response.device().c_str());
  std::printf("o: %s [%s], sum %.6g, sum|.| %.6g\n", DTypeName(response.o().dtype()),
              absl::StrJoin(response.o().shape(), ", ").c_str(), sum, sum_abs);
  std::printf("server: queue %.1f us, h2d %.1f us, compute %.1f us, d2h %.1f us, total %.1f us\n",
              t.queue_us(), t.h2d_us(), t.compute_us(), t.d2h_us(), t.total_us());
  PrintLatencies(latencies_ms);

  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    const std::vector<int64_t> shape(response.o().shape().begin(), response.o().shape().end());
    const NpyType type =
        response.o().dtype() == v1::DTYPE_FLOAT16 ? NpyType::kFloat16 : NpyType::kFloat32;
    if (absl::Status s = WriteNpy(out, shape, *o, type); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return kExitFailed;
    }
    std::printf("wrote %s\n", out.c_str());
  }

  if (!absl::GetFlag(FLAGS_check)) return 0;
  std::fprintf(stderr, "check: computing the float64 reference...\n");
  absl::StatusOr<CheckResult> check = CheckResponse(*request, response);
  if (!check.ok()) {
    std::fprintf(stderr, "check failed: %s\n", check.status().ToString().c_str());
    return kExitFailed;
  }
  const double bound = ErrorBound(spec->dtype);
  std::printf("check: ||o-ref||/||ref|| = %.3g, max|o-ref|/max|ref| = %.3g", check->relative_error,
              check->max_relative_error);
  if (check->lse_checked) std::printf(", lse error = %.3g", check->lse_relative_error);
  const bool pass = WithinBound(*check, spec->dtype);
  std::printf(" (bound %.0e; every row, reference on %d threads): %s\n", bound,
              check->reference_threads, pass ? "PASS" : "FAIL");
  return pass ? 0 : kExitFailed;
}

// The whole of a small file (certificates, keys, tokens).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ClientOptions::tls and ::bearer_token from the security flags.
absl::Status ApplySecurityFlags(ClientOptions& options) {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca), cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (absl::GetFlag(FLAGS_tls) || !ca.empty() || !cert.empty()) {
    ClientOptions::Tls tls;
    for (auto [path, pem] :
         {std::pair{&ca, &tls.root_certs_pem}, std::pair{&cert, &tls.client_cert_pem},
          std::pair{&key, &tls.client_key_pem}}) {
      if (path->empty()) continue;
      absl::StatusOr<std::string> text = ReadSmallFile(*path);
      if (!text.ok()) return text.status();
      *pem = *std::move(text);
    }
    options.tls = std::move(tls);
  }
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadSmallFile(path);
    if (!token.ok()) return token.status();
    options.bearer_token = std::string(absl::StripAsciiWhitespace(*token));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace attention::client

int main(int argc, char** argv) {
  attention::client::ParseToolFlags(
      argc, argv,
      "attn_client --target=HOST:PORT [--shape=B,H,N,D ...] [--check] | --health | --info",
      __FILE__);
  attention::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (max_message_mb < 1 || max_message_mb > 2047) {
    std::cerr << "attn_client: --max_message_mb: expected 1..2047, got " << max_message_mb << "\n";
    return attention::client::kExitUsage;
  }
  options.max_message_bytes = max_message_mb << 20;
  options.chunk_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_chunk_mb) * (1 << 20));
  options.chunked_above_bytes =
      static_cast<int64_t>(absl::GetFlag(FLAGS_chunked_above_mb) * (1 << 20));
  if (options.chunk_bytes < 1 || options.chunked_above_bytes < 0) {
    std::cerr << "attn_client: --chunk_mb must be > 0 and --chunked_above_mb >= 0\n";
    return attention::client::kExitUsage;
  }
  if (absl::Status status = attention::client::ApplySecurityFlags(options); !status.ok()) {
    std::cerr << "attn_client: " << status << "\n";
    return attention::client::kExitUsage;
  }
  attention::client::Client client(options);
  if (absl::GetFlag(FLAGS_health)) return attention::client::RunHealth(client);
  if (absl::GetFlag(FLAGS_info)) return attention::client::RunInfo(client);
  return attention::client::RunAttend(client, options.max_message_bytes);
}
