#include "tests/e2e/e2e_test_util.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "client/reference_check.h"
#include "client/tensors.h"
#include "gtest/gtest.h"

namespace attention::e2e {

using client::ProblemSpec;

uint64_t FreshSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

absl::StatusOr<std::vector<std::string>> CreateTwinSessions(v1::Sessions::Stub& stub, int count,
                                                            int64_t heads_kv, int64_t rows,
                                                            int64_t head_dim,
                                                            std::mt19937_64& rng) {
  const int64_t n = heads_kv * rows * head_dim;
  v1::CreateSessionRequest create;
  create.set_dtype(v1::DTYPE_FLOAT16);
  create.set_kv_heads(heads_kv);
  create.set_head_dim(head_dim);
  *create.mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT16, {heads_kv, rows, head_dim},
                                           client::RandomNormal(n, rng));
  *create.mutable_v() = client::MakeTensor(v1::DTYPE_FLOAT16, {heads_kv, rows, head_dim},
                                           client::RandomNormal(n, rng));
  std::vector<std::string> ids;
  for (int i = 0; i < count; ++i) {
    v1::SessionInfo info;
    grpc::ClientContext context;
    const grpc::Status status = stub.CreateSession(&context, create, &info);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("CreateSession ", i, ": ", status.error_message()));
    }
    ids.push_back(info.session_id());
  }
  return ids;
}

std::vector<v1::StepRequest> RandomDecodeSteps(int count, int64_t heads_q, int64_t heads_kv,
                                               int64_t head_dim, std::mt19937_64& rng) {
  std::vector<v1::StepRequest> steps;
  for (int i = 0; i < count; ++i) {
    v1::StepRequest r;
    r.set_request_id(absl::StrCat("s", i));
    r.set_causal(true);
    v1::StepEntry* e = r.add_entries();
    *e->mutable_q() = client::MakeTensor(v1::DTYPE_FLOAT16, {heads_q, 1, head_dim},
                                         client::RandomNormal(heads_q * head_dim, rng));
    *e->mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT16, {heads_kv, 1, head_dim},
                                         client::RandomNormal(heads_kv * head_dim, rng));
    *e->mutable_v() = client::MakeTensor(v1::DTYPE_FLOAT16, {heads_kv, 1, head_dim},
                                         client::RandomNormal(heads_kv * head_dim, rng));
    steps.push_back(r);
  }
  return steps;
}

absl::StatusOr<RunningServer> StartServer(const std::vector<std::string>& flags,
                                          client::ClientOptions options, bool environment_flags) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> process =
      ServerProcess::Start({.flags = flags, .environment_flags = environment_flags});
  if (!process.ok()) return process.status();
  RunningServer server;
  server.process = *std::move(process);
  options.target = server.process->target();
  server.client = std::make_unique<client::Client>(options);
  return server;
}

std::unique_ptr<client::Client> ClientOnItsOwnConnection(const std::string& target,
                                                         client::ClientOptions options) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  options.target = target;
  return std::make_unique<client::Client>(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args), options);
}

absl::Status RunningServer::Stop() {
  client.reset();
  return process->Stop();
}

std::vector<ProblemSpec> CorrectnessGrid() {
  std::vector<ProblemSpec> base;
  // Single element: the smallest problem there is.
  base.push_back(
      {.batch = 1, .heads_q = 1, .heads_kv = 1, .seqlen_q = 1, .seqlen_k = 1, .head_dim = 64});
  // Ragged equal lengths, batch > 1.
  base.push_back(
      {.batch = 2, .heads_q = 4, .heads_kv = 4, .seqlen_q = 77, .seqlen_k = 77, .head_dim = 64});
  // GQA, Nq < Nk, head dim 128, BSHD.
  base.push_back({.batch = 1,
                  .heads_q = 8,
                  .heads_kv = 2,
                  .seqlen_q = 130,
                  .seqlen_k = 257,
                  .head_dim = 128,
                  .layout = v1::LAYOUT_BSHD});
  // MQA, causal with Nq > Nk: bottom-right alignment leaves the first 32 rows without keys.
  base.push_back({.batch = 2,
                  .heads_q = 4,
                  .heads_kv = 1,
                  .seqlen_q = 65,
                  .seqlen_k = 33,
                  .head_dim = 32,
                  .causal = true,
                  .return_lse = true});
  // Decode: one query row against a long key sequence, with LSE.
  base.push_back({.batch = 3,
                  .heads_q = 8,
                  .heads_kv = 2,
                  .seqlen_q = 1,
                  .seqlen_k = 300,
                  .head_dim = 128,
                  .return_lse = true});
  // Causal square, BSHD, LSE.
  base.push_back({.batch = 1,
                  .heads_q = 2,
                  .heads_kv = 2,
                  .seqlen_q = 200,
                  .seqlen_k = 200,
                  .head_dim = 64,
                  .layout = v1::LAYOUT_BSHD,
                  .causal = true,
                  .return_lse = true});
  // Sliding window on both sides, Nq < Nk, odd head dim.
  base.push_back({.batch = 1,
                  .heads_q = 3,
                  .heads_kv = 3,
                  .seqlen_q = 100,
                  .seqlen_k = 150,
                  .head_dim = 24,
                  .window_left = 16,
                  .window_right = 8,
                  .return_lse = true});
  // Causal with a left window (local attention), explicit scale.
  base.push_back({.batch = 1,
                  .heads_q = 4,
                  .heads_kv = 2,
                  .seqlen_q = 96,
                  .seqlen_k = 96,
                  .head_dim = 80,
                  .causal = true,
                  .softmax_scale = 0.3f,
                  .window_left = 20});
  // Diagonal only (window 0, 0) and a tiny head dim.
  base.push_back({.batch = 1,
                  .heads_q = 2,
                  .heads_kv = 1,
                  .seqlen_q = 50,
                  .seqlen_k = 50,
                  .head_dim = 8,
                  .window_left = 0,
                  .window_right = 0});
  // The largest head dim.
  base.push_back(
      {.batch = 1, .heads_q = 2, .heads_kv = 2, .seqlen_q = 40, .seqlen_k = 70, .head_dim = 256});
  // Varlen, causal, LSE, GQA: items with Nq < Nk, a one-row item, and a longer one.
  base.push_back({.heads_q = 4,
                  .heads_kv = 2,
                  .head_dim = 64,
                  .causal = true,
                  .return_lse = true,
                  .varlen_q = {37, 1, 128},
                  .varlen_k = {50, 20, 128}});
  // Varlen with equal lengths and no mask.
  base.push_back({.heads_q = 2, .heads_kv = 2, .head_dim = 96, .varlen_q = {100, 3, 60}});

  std::vector<ProblemSpec> grid;
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    for (ProblemSpec spec : base) {
      spec.dtype = dtype;
      grid.push_back(spec);
    }
  }
  // float8 e4m3 (o in bfloat16): every shape, descales absent on the first (all 1) and set, none
  // a power of two, on the others.
  for (size_t i = 0; i < base.size(); ++i) {
    ProblemSpec spec = base[i];
    spec.dtype = v1::DTYPE_FLOAT8_E4M3;
    if (i > 0) {
      spec.q_descale = 0.3f + 0.1f * static_cast<float>(i);
      spec.k_descale = 1.7f;
      spec.v_descale = 0.013f * static_cast<float>(i);
    }
    grid.push_back(spec);
  }
  return grid;
}

void ExpectCorrect(const v1::AttendRequest& request,
                   const absl::StatusOr<v1::AttendResponse>& response) {
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), request.request_id());
  EXPECT_FALSE(response->device().empty());
  absl::StatusOr<client::CheckResult> check = client::CheckResponse(request, *response);
  ASSERT_TRUE(check.ok()) << check.status();
  const double bound = client::ErrorBound(request.q().dtype());
  EXPECT_LE(check->relative_error, bound)
      << "||o-ref||/||ref||; max|o-ref|/max|ref| = " << check->max_relative_error;
  if (request.return_lse()) {
    EXPECT_TRUE(check->lse_checked);
    EXPECT_LE(check->lse_relative_error, bound) << "lse ||lse-ref||/(||ref||+sqrt(n))";
  }
}

}  // namespace attention::e2e
