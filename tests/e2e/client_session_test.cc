// The C++ Session object (client/session.h) against the real server (CPU backend): decode steps
// after appends match the float64 reference over the whole sequence, StepMany over sessions of
// different lengths, a step after Truncate over the kept rows, forks that grow apart from their
// parent (each step against the reference over its own rows; one page used, not a session's
// worth; copy on write after a truncate into a shared page), the packed StepBatch and
// StepBatchAsync bit for bit equal to StepMany, LSE, ownership (drop on destruction, Release,
// moves), NOT_FOUND after a drop, the bearer token on session calls, a session from a cached
// prefix (its full pages shared, Steps as on one from scratch, bit for bit), and a session of a V
// head dim of its own stepping as an Attend of its rows. (Sessions over a round-robin client across
// two servers: tests/deploy/round_robin_failover_test.cc.)
//
// The reference of a step is an Attend problem over the session's rows: q [1, 1, Hq, D] (one
// decode query, so [Hq, 1, D] as the step sends it) against k, v [1, N, Hkv, D], built by
// MakeRequest from the same float values, so both sides round them to the dtype alike.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using client::Session;
using client::SessionClient;
using client::SessionSpec;
using client::StepBatchOutput;
using client::StepBatchTensors;
using client::StepItem;
using client::StepOptions;
using client::StepOutput;

class ClientSessionTest : public SharedServerTest<ClientSessionTest> {
 public:
  static std::vector<std::string> ServerFlags() { return {"--backend=cpu"}; }
};

// A session's rows as the client keeps them: [N, Hkv, D] floats (BSHD), so appending rows is
// appending values.
struct Sequence {
  SessionSpec spec;
  std::vector<float> k, v;

  int64_t rows() const { return static_cast<int64_t>(k.size()) / (spec.kv_heads * spec.head_dim); }
  // n new random rows: appended here, returned as tensors [n, Hkv, D] for Create and Append.
  std::pair<v1::Tensor, v1::Tensor> Grow(int64_t n, std::mt19937_64& rng) {
    return Grow(n, {n, spec.kv_heads, spec.head_dim}, rng);
  }
  // One new row as a Step takes it: [Hkv, 1, D] (the same values as [1, Hkv, D]).
  std::pair<v1::Tensor, v1::Tensor> GrowForStep(std::mt19937_64& rng) {
    return Grow(1, {spec.kv_heads, 1, spec.head_dim}, rng);
  }

 private:
  std::pair<v1::Tensor, v1::Tensor> Grow(int64_t n, const std::vector<int64_t>& shape,
                                         std::mt19937_64& rng) {
    std::vector<float> new_k = client::RandomNormal(client::NumElements(shape), rng);
    std::vector<float> new_v = client::RandomNormal(client::NumElements(shape), rng);
    k.insert(k.end(), new_k.begin(), new_k.end());
    v.insert(v.end(), new_v.begin(), new_v.end());
    return {client::MakeTensor(spec.dtype, shape, new_k),
            client::MakeTensor(spec.dtype, shape, new_v)};
  }
};

// Expects `out`, the step of query q (values of [Hq, 1, D]) on `sequence`, to match the reference.
void ExpectStepCorrect(const Sequence& sequence, const std::vector<float>& q, int64_t heads_q,
                       const StepOptions& options, const StepOutput& out) {
  const client::ProblemSpec problem{.batch = 1,
                                    .heads_q = heads_q,
                                    .heads_kv = sequence.spec.kv_heads,
                                    .seqlen_q = 1,
                                    .seqlen_k = sequence.rows(),
                                    .head_dim = sequence.spec.head_dim,
                                    .dtype = sequence.spec.dtype,
                                    .layout = v1::LAYOUT_BSHD,
                                    .causal = options.causal,
                                    .softmax_scale = options.softmax_scale,
                                    .window_left = options.window_left,
                                    .window_right = options.window_right,
                                    .return_lse = options.return_lse};
  SCOPED_TRACE(client::DescribeProblem(problem));
  EXPECT_EQ(out.length, sequence.rows());
  absl::StatusOr<v1::AttendRequest> request =
      client::MakeRequest(problem, q, sequence.k, sequence.v);
  ASSERT_TRUE(request.ok()) << request.status();
  // The step's o [Hq, 1, D] and lse [Hq, 1] as the Attend response of that problem.
  v1::AttendResponse response;
  *response.mutable_o() = out.o;
  response.mutable_o()->clear_shape();
  for (int64_t s : {int64_t{1}, int64_t{1}, heads_q, sequence.spec.head_dim}) {
    response.mutable_o()->add_shape(s);
  }
  if (options.return_lse) {
    ASSERT_EQ(out.lse.shape_size(), 2);
    *response.mutable_lse() = out.lse;
    response.mutable_lse()->clear_shape();
    for (int64_t s : {int64_t{1}, heads_q, int64_t{1}}) response.mutable_lse()->add_shape(s);
  }
  ASSERT_EQ(out.o.shape_size(), 3);
  EXPECT_EQ(out.o.shape(0), heads_q);
  EXPECT_EQ(out.o.shape(1), 1);
  absl::StatusOr<client::CheckResult> check = client::CheckResponse(*request, response);
  ASSERT_TRUE(check.ok()) << check.status();
  EXPECT_LE(check->relative_error, client::ErrorBound(problem.dtype));
  if (options.return_lse) {
    EXPECT_TRUE(check->lse_checked);
    EXPECT_LE(check->lse_relative_error, client::ErrorBound(problem.dtype));
  }
}

TEST_F(ClientSessionTest, DecodeAfterAppendsMatchesReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    SCOPED_TRACE(client::DTypeName(dtype));
    const int64_t heads_q = 8;
    Sequence seq{
        .spec = {.dtype = dtype, .kv_heads = 2, .head_dim = 128, .layout = v1::LAYOUT_BSHD}};
    SessionClient sessions(client());
    auto [k0, v0] = seq.Grow(61, rng);
    absl::StatusOr<Session> session = sessions.Create(seq.spec, &k0, &v0);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ(session->id().size(), 32u);
    EXPECT_EQ(session->length(), 61);
    for (int64_t n : {17, 1, 100}) {
      auto [k, v] = seq.Grow(n, rng);
      ASSERT_EQ(session->Append(k, v), absl::OkStatus());
      EXPECT_EQ(session->length(), seq.rows());
    }
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> q = client::RandomNormal(heads_q * seq.spec.head_dim, rng);
      auto [k, v] = seq.GrowForStep(rng);
      const StepOptions options{.causal = true, .return_lse = step == 2};
      absl::StatusOr<StepOutput> out = session->Step(
          client::MakeTensor(dtype, {heads_q, 1, seq.spec.head_dim}, q), options, &k, &v);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->o.dtype(), dtype);
      ExpectStepCorrect(seq, q, heads_q, options, *out);
    }
    absl::StatusOr<v1::SessionInfo> info = session->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->length(), seq.rows());
    EXPECT_EQ(info->kv_heads(), 2);
    EXPECT_EQ(info->head_dim(), 128);
    EXPECT_GT(info->resident_bytes(), 0);
  }
}

// SessionSpec::v_head_dim (MLA: v of a head dim of its own): the session echoes it, its Steps' o
// has it, and a Step equals the float64 reference of an Attend of the same q over the same rows
// (the CPU and CUDA backends serve it on Step; the reference, not the server's Attend, which the
// CUDA forward kernels do not serve with a V head dim of its own).
TEST_F(ClientSessionTest, ASessionOfItsOwnVHeadDimStepsAsTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t hq = 4, hkv = 2, d = 96, dv = 64, n = 40;
  const SessionSpec spec{
      .dtype = v1::DTYPE_FLOAT32, .kv_heads = hkv, .head_dim = d, .v_head_dim = dv};
  // BHSD rows: k [Hkv, n, D], v [Hkv, n, Dv], then one more row of each for the Step.
  std::vector<float> k = client::RandomNormal(hkv * n * d, rng);
  std::vector<float> v = client::RandomNormal(hkv * n * dv, rng);
  const std::vector<float> k1 = client::RandomNormal(hkv * d, rng);
  const std::vector<float> v1 = client::RandomNormal(hkv * dv, rng);
  const std::vector<float> q = client::RandomNormal(hq * d, rng);
  SessionClient sessions(client());
  const v1::Tensor k0 = client::MakeTensor(spec.dtype, {hkv, n, d}, k);
  const v1::Tensor v0 = client::MakeTensor(spec.dtype, {hkv, n, dv}, v);
  absl::StatusOr<Session> session = sessions.Create(spec, &k0, &v0);
  // A backend whose devices do not list v_head_dim in their step options (run on another backend
  // by ATTENTION_E2E_EXTRA_FLAGS) refuses the session by name.
  absl::StatusOr<v1::ServerInfo> server = client().GetServerInfo();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_FALSE(server->devices().empty());
  if (!absl::c_linear_search(server->devices(0).step_options(), "v_head_dim")) {
    EXPECT_EQ(session.status().code(), absl::StatusCode::kUnimplemented) << session.status();
    EXPECT_TRUE(absl::StrContains(session.status().message(), "v_head_dim")) << session.status();
    return;
  }
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor k_step = client::MakeTensor(spec.dtype, {hkv, 1, d}, k1);
  const v1::Tensor v_step = client::MakeTensor(spec.dtype, {hkv, 1, dv}, v1);
  absl::StatusOr<StepOutput> out = session->Step(client::MakeTensor(spec.dtype, {hq, 1, d}, q),
                                                 {.causal = true}, &k_step, &v_step);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(std::vector<int64_t>(out->o.shape().begin(), out->o.shape().end()),
            (std::vector<int64_t>{hq, 1, dv}));
  absl::StatusOr<v1::SessionInfo> info = session->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(std::pair(info->head_dim(), info->v_head_dim()), std::pair(int32_t{96}, int32_t{64}));

  // The Attend: q [1, Hq, 1, D] over the session's n + 1 rows, k [1, Hkv, n + 1, D] and v
  // [1, Hkv, n + 1, Dv] (each head's n rows, then its step row).
  std::vector<float> all_k, all_v;
  for (int64_t h = 0; h < hkv; ++h) {
    all_k.insert(all_k.end(), k.begin() + h * n * d, k.begin() + (h + 1) * n * d);
    all_k.insert(all_k.end(), k1.begin() + h * d, k1.begin() + (h + 1) * d);
    all_v.insert(all_v.end(), v.begin() + h * n * dv, v.begin() + (h + 1) * n * dv);
    all_v.insert(all_v.end(), v1.begin() + h * dv, v1.begin() + (h + 1) * dv);
  }
  v1::AttendRequest attend;
  *attend.mutable_q() = client::MakeTensor(spec.dtype, {1, hq, 1, d}, q);
  *attend.mutable_k() = client::MakeTensor(spec.dtype, {1, hkv, n + 1, d}, all_k);
  *attend.mutable_v() = client::MakeTensor(spec.dtype, {1, hkv, n + 1, dv}, all_v);
  attend.set_causal(true);
  // The Step's o [Hq, 1, Dv] as the Attend's [1, Hq, 1, Dv], against the reference.
  v1::AttendResponse as_attend;
  *as_attend.mutable_o() = out->o;
  as_attend.mutable_o()->clear_shape();
  for (int64_t dim : {int64_t{1}, hq, int64_t{1}, dv}) as_attend.mutable_o()->add_shape(dim);
  absl::StatusOr<client::CheckResult> checked = client::CheckResponse(attend, as_attend);
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_TRUE(client::WithinBound(*checked, spec.dtype)) << checked->relative_error;

  // v of the QK head dim is refused by name, and appends nothing.
  const v1::Tensor wrong_v = client::MakeTensor(spec.dtype, {hkv, 1, d}, k1);
  const absl::Status refused = session->Append(k_step, wrong_v);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_TRUE(absl::StrContains(
      refused.message(), "v.shape[2] (v head dim): expected 64 (the session's v_head_dim), got 96"))
      << refused;
  EXPECT_EQ(session->Info()->length(), n + 1);
}

// SessionSpec::v_from_k (MLA's latent cache: v is k's first Dv features, kept once): created,
// appended and stepped with k alone, its Steps answer bit for bit what a session of the same k
// and an explicit v = k[..., :Dv] answers; the session echoes it, a v sent to it is refused by
// name, and an export imports as the same session (the chunks carry k alone).
TEST_F(ClientSessionTest, ASessionWhoseVIsKsFirstFeaturesStepsAsOneGivenThatV) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t hq = 8, hkv = 1, d = 72, dv = 64, n = 37;
  const SessionSpec latent_spec{.dtype = v1::DTYPE_FLOAT32,
                                .kv_heads = hkv,
                                .head_dim = d,
                                .v_head_dim = dv,
                                .v_from_k = true};
  SessionSpec explicit_spec = latent_spec;
  explicit_spec.v_from_k = false;
  // k [Hkv, rows, D] and its v [Hkv, rows, Dv]: each row's first Dv features.
  auto first_features = [&](const std::vector<float>& k, int64_t rows) {
    std::vector<float> v;
    for (int64_t r = 0; r < hkv * rows; ++r) {
      v.insert(v.end(), k.begin() + r * d, k.begin() + r * d + dv);
    }
    return v;
  };
  const std::vector<float> k0 = client::RandomNormal(hkv * n * d, rng);
  const v1::Tensor k0_t = client::MakeTensor(latent_spec.dtype, {hkv, n, d}, k0);
  const v1::Tensor v0_t =
      client::MakeTensor(latent_spec.dtype, {hkv, n, dv}, first_features(k0, n));
  SessionClient sessions(client());
  absl::StatusOr<Session> latent = sessions.Create(latent_spec, &k0_t, nullptr);
  absl::StatusOr<v1::ServerInfo> server = client().GetServerInfo();
  ASSERT_TRUE(server.ok()) << server.status();
  if (!absl::c_linear_search(server->devices(0).step_options(), "v_from_k")) {
    EXPECT_EQ(latent.status().code(), absl::StatusCode::kUnimplemented) << latent.status();
    EXPECT_TRUE(absl::StrContains(latent.status().message(), "v_from_k")) << latent.status();
    return;
  }
  ASSERT_TRUE(latent.ok()) << latent.status();
  absl::StatusOr<Session> given = sessions.Create(explicit_spec, &k0_t, &v0_t);
  ASSERT_TRUE(given.ok()) << given.status();
  absl::StatusOr<v1::SessionInfo> info = latent->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->v_from_k());
  EXPECT_EQ(info->v_head_dim(), dv);

  // An append of 5 rows, then 3 Steps of one row each (the last with lse), on both.
  const std::vector<float> k1 = client::RandomNormal(hkv * 5 * d, rng);
  ASSERT_EQ(latent->AppendK(client::MakeTensor(latent_spec.dtype, {hkv, 5, d}, k1)),
            absl::OkStatus());
  ASSERT_EQ(
      given->Append(client::MakeTensor(latent_spec.dtype, {hkv, 5, d}, k1),
                    client::MakeTensor(latent_spec.dtype, {hkv, 5, dv}, first_features(k1, 5))),
      absl::OkStatus());
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> q = client::RandomNormal(hq * d, rng);
    const std::vector<float> k = client::RandomNormal(hkv * d, rng);
    const v1::Tensor q_t = client::MakeTensor(latent_spec.dtype, {hq, 1, d}, q);
    const v1::Tensor k_t = client::MakeTensor(latent_spec.dtype, {hkv, 1, d}, k);
    const v1::Tensor v_t =
        client::MakeTensor(latent_spec.dtype, {hkv, 1, dv}, first_features(k, 1));
    const StepOptions options{.causal = true, .return_lse = step == 2};
    absl::StatusOr<StepOutput> a = latent->Step(q_t, options, &k_t, nullptr);
    absl::StatusOr<StepOutput> b = given->Step(q_t, options, &k_t, &v_t);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->o.data(), b->o.data()) << "step " << step;
    EXPECT_EQ(a->lse.data(), b->lse.data()) << "step " << step;
    EXPECT_EQ(std::vector<int64_t>(a->o.shape().begin(), a->o.shape().end()),
              (std::vector<int64_t>{hq, 1, dv}));
  }

  // A v sent to it is refused by name and appends nothing.
  const absl::Status refused =
      latent->Append(client::MakeTensor(latent_spec.dtype, {hkv, 1, d}, k1),
                     client::MakeTensor(latent_spec.dtype, {hkv, 1, dv}, first_features(k1, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "v: expected none")) << refused;
  EXPECT_EQ(latent->Info()->length(), n + 5 + 3);

  // Export and import: the chunks carry k alone; the import steps as the source does.
  client::SessionImport import = sessions.StartImport({.session_id = ""});
  ASSERT_EQ(latent->Export([&](const v1::SessionChunk& chunk) -> absl::Status {
    if (!chunk.has_header()) EXPECT_FALSE(chunk.has_v());
    return import.Write(chunk);
  }),
            absl::OkStatus());
  absl::StatusOr<Session> copy = import.Finish();
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(copy->Info()->v_from_k());
  const v1::Tensor q_t =
      client::MakeTensor(latent_spec.dtype, {hq, 1, d}, client::RandomNormal(hq * d, rng));
  absl::StatusOr<StepOutput> from_copy = copy->Step(q_t, {.causal = true});
  absl::StatusOr<StepOutput> from_source = latent->Step(q_t, {.causal = true});
  ASSERT_TRUE(from_copy.ok()) << from_copy.status();
  ASSERT_TRUE(from_source.ok()) << from_source.status();
  EXPECT_EQ(from_copy->o.data(), from_source->o.data());

  // v_from_k with a V head dim over the QK one is refused by name.
  SessionSpec too_wide = latent_spec;
  too_wide.v_head_dim = d + 8;
  absl::StatusOr<Session> wide = sessions.Create(too_wide);
  EXPECT_TRUE(absl::IsInvalidArgument(wide.status())) << wide.status();
  EXPECT_TRUE(absl::StrContains(wide.status().message(), "v_head_dim: expected 0..72 (head_dim)"))
      << wide.status();
}

TEST_F(ClientSessionTest, StepAfterTruncateMatchesReferenceOverTheKeptRows) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t heads_q = 4;
  Sequence seq{
      .spec = {
          .dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 64, .layout = v1::LAYOUT_BSHD}};
  SessionClient sessions(client());
  auto [k0, v0] = seq.Grow(300, rng);
  absl::StatusOr<Session> session = sessions.Create(seq.spec, &k0, &v0);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::Status refused = session->Truncate(301);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "length: expected 0..300, got 301")) << refused;
  ASSERT_EQ(session->Truncate(123), absl::OkStatus());
  EXPECT_EQ(session->length(), 123);
  seq.k.resize(123 * seq.spec.kv_heads * seq.spec.head_dim);
  seq.v.resize(seq.k.size());
  const std::vector<float> q = client::RandomNormal(heads_q * seq.spec.head_dim, rng);
  auto [k, v] = seq.GrowForStep(rng);
  const StepOptions options{.causal = true, .return_lse = true};
  absl::StatusOr<StepOutput> out = session->Step(
      client::MakeTensor(seq.spec.dtype, {heads_q, 1, seq.spec.head_dim}, q), options, &k, &v);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectStepCorrect(seq, q, heads_q, options, *out);
}

// A session of a model's several layers: each layer its own cache, appended to and stepped by
// naming it, each step against the float64 reference of that layer's rows; a packed Step of one
// layer; truncate and fork of every layer; one drop frees every layer's pages.
TEST_F(ClientSessionTest, ASessionOfSeveralLayersKeepsACachePerLayer) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  constexpr int kLayers = 3;
  const int64_t heads_q = 4;
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT32,
                         .kv_heads = 2,
                         .head_dim = 32,
                         .layout = v1::LAYOUT_BSHD,
                         .layers = kLayers};
  SessionClient sessions(client());
  absl::StatusOr<v1::ListSessionsResponse> before = sessions.List();
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<Session> session = sessions.Create(spec);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<Sequence> layers(kLayers, Sequence{.spec = spec});
  for (int layer = 0; layer < kLayers; ++layer) {
    auto [k, v] = layers[layer].Grow(10 + 7 * layer, rng);
    ASSERT_EQ(session->Append(k, v, layer), absl::OkStatus());
  }
  EXPECT_EQ(session->layer_lengths(), (std::vector<int64_t>{10, 17, 24}));
  EXPECT_EQ(session->length(), 10);
  for (int layer = 0; layer < kLayers; ++layer) {
    const std::vector<float> q = client::RandomNormal(heads_q * spec.head_dim, rng);
    auto [k, v] = layers[layer].GrowForStep(rng);
    const StepOptions options{.causal = true, .return_lse = true, .layer = layer};
    absl::StatusOr<StepOutput> out = session->Step(
        client::MakeTensor(spec.dtype, {heads_q, 1, spec.head_dim}, q), options, &k, &v);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectStepCorrect(layers[layer], q, heads_q, options, *out);
  }
  EXPECT_EQ(session->layer_lengths(), (std::vector<int64_t>{11, 18, 25}));
  // A Step that names no layer, or one out of range, is refused by name.
  const v1::Tensor q = client::MakeTensor(spec.dtype, {heads_q, 1, spec.head_dim},
                                          client::RandomNormal(heads_q * spec.head_dim, rng));
  absl::StatusOr<StepOutput> no_layer = session->Step(q, {.causal = true});
  EXPECT_EQ(no_layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(no_layer.status().message(), "layer: expected 0..2"))
      << no_layer.status();
  absl::StatusOr<StepOutput> past = session->Step(q, {.causal = true, .layer = kLayers});
  EXPECT_TRUE(absl::StrContains(past.status().message(), "got 3")) << past.status();
  // A packed Step of layer 1 over the session and a fork of it: the same rows, the same bits.
  absl::StatusOr<Session> child = session->Fork();
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->layer_lengths(), session->layer_lengths());
  std::vector<float> q2 = client::RandomNormal(heads_q * spec.head_dim, rng);
  q2.insert(q2.end(), q2.begin(), q2.end());
  Session* pair[] = {&*session, &*child};
  absl::StatusOr<StepBatchOutput> both =
      sessions.StepBatch(pair, client::MakeTensor(spec.dtype, {2, heads_q, 1, spec.head_dim}, q2),
                         {.causal = true, .layer = 1});
  ASSERT_TRUE(both.ok()) << both.status();
  const std::string& o = both->o.data();
  EXPECT_EQ(o.substr(0, o.size() / 2), o.substr(o.size() / 2));
  // Truncate takes every layer, or none when one holds fewer rows.
  absl::Status refused = session->Truncate(12);
  EXPECT_TRUE(absl::StrContains(refused.message(), "layer 0")) << refused;
  ASSERT_EQ(session->Truncate(5), absl::OkStatus());
  EXPECT_EQ(session->layer_lengths(), (std::vector<int64_t>(kLayers, 5)));
  ASSERT_EQ(child->Drop(), absl::OkStatus());
  ASSERT_EQ(session->Drop(), absl::OkStatus());
  absl::StatusOr<v1::ListSessionsResponse> after = sessions.List();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->pages_free(), before->pages_free());
}

// The rows of `seq`'s first `rows` rows: what a fork at `rows` or a truncate to it holds.
Sequence FirstRows(const Sequence& seq, int64_t rows) {
  Sequence first = seq;
  first.k.resize(rows * seq.spec.kv_heads * seq.spec.head_dim);
  first.v.resize(first.k.size());
  return first;
}

// The sessions of the page tests: float32 rows of 2 KV heads of 64, BSHD.
constexpr SessionSpec kPagedSpec{
    .dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 64, .layout = v1::LAYOUT_BSHD};

// Rows of a float32 session of `spec` a page of the server holds (its page size, in rows of 16);
// 0 when ListSessions fails.
int64_t PageRows(SessionClient& sessions, const SessionSpec& spec) {
  absl::StatusOr<v1::ListSessionsResponse> room = sessions.List();
  EXPECT_TRUE(room.ok()) << room.status();
  if (!room.ok()) return 0;
  return room->page_bytes() / (2 * spec.kv_heads * spec.head_dim * 4) / 16 * 16;
}

TEST_F(ClientSessionTest, ForksGrowApartFromTheirParentAndShareItsFullPages) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t heads_q = 4;
  Sequence parent_seq{.spec = kPagedSpec};
  SessionClient sessions(client());
  // Three pages and some.
  const int64_t page_rows = PageRows(sessions, parent_seq.spec);
  ASSERT_GT(page_rows, 0);
  const int64_t n = 3 * page_rows + 5;
  auto [k0, v0] = parent_seq.Grow(n, rng);
  absl::StatusOr<Session> parent = sessions.Create(parent_seq.spec, &k0, &v0);
  ASSERT_TRUE(parent.ok()) << parent.status();

  absl::StatusOr<Session> refused = parent->Fork(n + 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                absl::StrCat("length: expected 0..", n, ", got ", n + 1)))
      << refused.status();
  for (const std::string& id : {std::string(32, '0'), std::string()}) {
    v1::ForkRequest request;
    request.set_session_id(id);
    v1::SessionInfo info;
    const grpc::Status status = sessions.stub().Fork(sessions.NewContext({}).get(), request, &info);
    EXPECT_EQ(status.error_code(),
              id.empty() ? grpc::StatusCode::INVALID_ARGUMENT : grpc::StatusCode::NOT_FOUND);
    EXPECT_TRUE(absl::StrContains(status.error_message(), id.empty() ? "session_id" : id))
        << status.error_message();
  }

  // The fork takes one page (the copy of the partial fourth), not the four a session of its rows
  // takes.
  absl::StatusOr<v1::ListSessionsResponse> room = sessions.List();
  ASSERT_TRUE(room.ok()) << room.status();
  const int64_t free_before = room->pages_free();
  absl::StatusOr<Session> child = parent->Fork();
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_NE(child->id(), parent->id());
  EXPECT_EQ(child->length(), n);
  room = sessions.List();
  ASSERT_TRUE(room.ok()) << room.status();
  const int64_t taken = free_before - room->pages_free();
  EXPECT_EQ(taken, 1);
  absl::StatusOr<v1::SessionInfo> info = child->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages(), 4);
  EXPECT_EQ(info->shared_pages(), 3);
  // The cache counts the three pages the two share once, in its gauge of shared pages.
  absl::StatusOr<std::string> text = HttpGet(process().metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(SumSamples(ParseMetrics(*text), "attention_kv_pages_shared"), 3);
  EXPECT_EQ(info->kv_heads(), 2);
  EXPECT_EQ(info->head_dim(), 64);
  EXPECT_EQ(info->dtype(), v1::DTYPE_FLOAT32);
  EXPECT_LT(taken, info->pages());

  // Different rows and queries to each, two steps each: each attends to its own rows alone.
  Sequence child_seq = parent_seq;
  const StepOptions options{.causal = true, .return_lse = true};
  auto step = [&](Session& session, Sequence& seq) {
    const std::vector<float> q = client::RandomNormal(heads_q * seq.spec.head_dim, rng);
    auto [k, v] = seq.GrowForStep(rng);
    absl::StatusOr<StepOutput> out = session.Step(
        client::MakeTensor(seq.spec.dtype, {heads_q, 1, seq.spec.head_dim}, q), options, &k, &v);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectStepCorrect(seq, q, heads_q, options, *out);
  };
  for (int i = 0; i < 2; ++i) {
    step(*parent, parent_seq);
    step(*child, child_seq);
  }
  // A fork of the parent's first rows, ending inside its second page; then the parent cut into
  // its first page, which the child and that fork hold too: its next row goes into a copy.
  const int64_t kept = page_rows + 7;
  absl::StatusOr<Session> partial = parent->Fork(kept);
  ASSERT_TRUE(partial.ok()) << partial.status();
  Sequence partial_seq = FirstRows(parent_seq, kept);
  ASSERT_EQ(parent->Truncate(9), absl::OkStatus());
  parent_seq = FirstRows(parent_seq, 9);
  for (int i = 0; i < 2; ++i) {
    step(*parent, parent_seq);
    step(*partial, partial_seq);
    step(*child, child_seq);
  }
  // Dropping every one gives back every page: the parent's four and what the forks and the
  // copies took.
  parent->Drop().IgnoreError();
  child->Drop().IgnoreError();
  partial->Drop().IgnoreError();
  room = sessions.List();
  ASSERT_TRUE(room.ok()) << room.status();
  EXPECT_EQ(room->pages_free(), free_before + 4);
}

TEST_F(ClientSessionTest, StepManyOverSessionsOfDifferentLengths) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t heads_q = 4;
  SessionClient sessions(client());
  std::vector<Sequence> seqs;
  std::vector<Session> live;
  for (int64_t length : {1, 90, 300}) {
    Sequence& seq = seqs.emplace_back(Sequence{
        .spec = {
            .dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 64, .layout = v1::LAYOUT_BSHD}});
    auto [k, v] = seq.Grow(length, rng);
    absl::StatusOr<Session> session = sessions.Create(seq.spec, &k, &v);
    ASSERT_TRUE(session.ok()) << session.status();
    live.push_back(*std::move(session));
  }
  // Sessions 0 and 2 append a row before attending; session 1 only attends.
  std::vector<std::vector<float>> q(seqs.size());
  std::vector<v1::Tensor> q_tensors(seqs.size()), k_tensors(seqs.size()), v_tensors(seqs.size());
  std::vector<StepItem> items;
  for (size_t i = 0; i < seqs.size(); ++i) {
    q[i] = client::RandomNormal(heads_q * 64, rng);
    q_tensors[i] = client::MakeTensor(v1::DTYPE_FLOAT32, {heads_q, 1, 64}, q[i]);
    StepItem item{.session = &live[i], .q = &q_tensors[i]};
    if (i != 1) {
      std::tie(k_tensors[i], v_tensors[i]) = seqs[i].GrowForStep(rng);
      item.k = &k_tensors[i];
      item.v = &v_tensors[i];
    }
    items.push_back(item);
  }
  const StepOptions options{.causal = true, .return_lse = true};
  absl::StatusOr<std::vector<StepOutput>> outs = sessions.StepMany(items, options);
  ASSERT_TRUE(outs.ok()) << outs.status();
  ASSERT_EQ(outs->size(), seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("session ", i));
    ExpectStepCorrect(seqs[i], q[i], heads_q, options, (*outs)[i]);
    EXPECT_EQ(live[i].length(), seqs[i].rows());
  }
}

TEST_F(ClientSessionTest, StepBatchAndStepBatchAsyncEqualStepManyBitForBit) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t heads_q = 4, heads_kv = 2, d = 64;
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT32, .kv_heads = heads_kv, .head_dim = d};
  SessionClient sessions(client());
  // The same K/V in two sets of sessions: one stepped per entry, one packed.
  std::vector<Session> per_entry, packed;
  for (int64_t length : {1, 90, 300}) {
    const std::vector<int64_t> shape = {heads_kv, length, d};
    const v1::Tensor k = client::MakeTensor(spec.dtype, shape,
                                            client::RandomNormal(client::NumElements(shape), rng));
    const v1::Tensor v = client::MakeTensor(spec.dtype, shape,
                                            client::RandomNormal(client::NumElements(shape), rng));
    for (std::vector<Session>* set : {&per_entry, &packed}) {
      absl::StatusOr<Session> session = sessions.Create(spec, &k, &v);
      ASSERT_TRUE(session.ok()) << session.status();
      set->push_back(*std::move(session));
    }
  }
  const int64_t batch = static_cast<int64_t>(packed.size());
  std::vector<Session*> batch_sessions;
  for (Session& session : packed) batch_sessions.push_back(&session);
  const StepOptions options{.causal = true, .return_lse = true};
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "StepBatchAsync" : "StepBatch");
    // q [B, Hq, 1, D], k, v [B, Hkv, 1, D]; entry b gets row b of each.
    const std::vector<float> q = client::RandomNormal(batch * heads_q * d, rng);
    const std::vector<float> k = client::RandomNormal(batch * heads_kv * d, rng);
    const std::vector<float> v = client::RandomNormal(batch * heads_kv * d, rng);
    std::vector<v1::Tensor> q_rows, k_rows, v_rows;
    std::vector<StepItem> items;
    for (int64_t b = 0; b < batch; ++b) {
      auto slice = [b](const std::vector<float>& x, int64_t n) {
        return std::vector<float>(x.begin() + b * n, x.begin() + (b + 1) * n);
      };
      q_rows.push_back(client::MakeTensor(spec.dtype, {heads_q, 1, d}, slice(q, heads_q * d)));
      k_rows.push_back(client::MakeTensor(spec.dtype, {heads_kv, 1, d}, slice(k, heads_kv * d)));
      v_rows.push_back(client::MakeTensor(spec.dtype, {heads_kv, 1, d}, slice(v, heads_kv * d)));
    }
    for (int64_t b = 0; b < batch; ++b) {
      items.push_back(
          {.session = &per_entry[b], .q = &q_rows[b], .k = &k_rows[b], .v = &v_rows[b]});
    }
    absl::StatusOr<std::vector<StepOutput>> want = sessions.StepMany(items, options);
    ASSERT_TRUE(want.ok()) << want.status();

    const v1::Tensor q_packed = client::MakeTensor(spec.dtype, {batch, heads_q, 1, d}, q);
    const v1::Tensor k_packed = client::MakeTensor(spec.dtype, {batch, heads_kv, 1, d}, k);
    const v1::Tensor v_packed = client::MakeTensor(spec.dtype, {batch, heads_kv, 1, d}, v);
    const StepBatchTensors tensors{.k = &k_packed, .v = &v_packed};
    absl::StatusOr<StepBatchOutput> got;
    if (async) {
      absl::Notification done;
      sessions.StepBatchAsync(batch_sessions, q_packed, options, tensors, {},
                              [&](absl::StatusOr<StepBatchOutput> out) {
                                got = std::move(out);
                                done.Notify();
                              });
      done.WaitForNotification();
    } else {
      got = sessions.StepBatch(batch_sessions, q_packed, options, tensors);
    }
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->lengths.size(), static_cast<size_t>(batch));
    const size_t o_bytes = heads_q * d * sizeof(float), lse_bytes = heads_q * sizeof(float);
    ASSERT_EQ(got->o.data().size(), batch * o_bytes);
    ASSERT_EQ(got->lse.data().size(), batch * lse_bytes);
    for (int64_t b = 0; b < batch; ++b) {
      SCOPED_TRACE(absl::StrCat("sequence ", b));
      EXPECT_EQ(got->o.data().substr(b * o_bytes, o_bytes), (*want)[b].o.data());
      EXPECT_EQ(got->lse.data().substr(b * lse_bytes, lse_bytes), (*want)[b].lse.data());
      EXPECT_EQ(got->lengths[b], (*want)[b].length);
      EXPECT_EQ(packed[b].length(), per_entry[b].length());
    }
  }
  // Stream order is for Steps whose tensors are all in CUDA regions: events beside host tensors
  // are refused by name, and nothing is appended.
  const std::vector<int64_t> lengths = {packed[0].length(), packed[1].length(), packed[2].length()};
  const v1::Tensor q = client::MakeTensor(spec.dtype, {batch, heads_q, 1, d},
                                          client::RandomNormal(batch * heads_q * d, rng));
  const v1::Tensor kv = client::MakeTensor(spec.dtype, {batch, heads_kv, 1, d},
                                           client::RandomNormal(batch * heads_kv * d, rng));
  const StepBatchTensors events{.k = &kv, .v = &kv, .ready_event = std::string(64, '\0')};
  const absl::StatusOr<StepBatchOutput> refused =
      sessions.StepBatch(batch_sessions, q, options, events);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find(
                "ready_event, done_event, ready_counter, done_counter: expected only with the "
                "Step's tensors in CUDA regions"),
            std::string::npos)
      << refused.status();
  // So are counters.
  v1::StreamCounter counter;
  counter.mutable_ref()->set_region("nowhere");
  counter.mutable_ref()->set_byte_size(8);
  counter.set_value(1);
  const StepBatchTensors counters{.k = &kv, .v = &kv, .done_counter = &counter};
  const absl::StatusOr<StepBatchOutput> refused_counter =
      sessions.StepBatch(batch_sessions, q, options, counters);
  EXPECT_EQ(refused_counter.status().code(), absl::StatusCode::kInvalidArgument)
      << refused_counter.status();
  EXPECT_NE(refused_counter.status().message().find("in host memory"), std::string::npos)
      << refused_counter.status();
  for (int64_t b = 0; b < batch; ++b) EXPECT_EQ(packed[b].length(), lengths[b]);
}

bool Listed(SessionClient& sessions, const std::string& id) {
  absl::StatusOr<v1::ListSessionsResponse> list = sessions.List();
  EXPECT_TRUE(list.ok()) << list.status();
  if (!list.ok()) return false;
  for (const v1::SessionInfo& info : list->sessions()) {
    if (info.session_id() == id) return true;
  }
  return false;
}

TEST_F(ClientSessionTest, OwnershipAndNotFoundAfterDrop) {
  SessionClient sessions(client());
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT16, .kv_heads = 1, .head_dim = 32};
  std::string id;
  {
    absl::StatusOr<Session> session = sessions.Create(spec);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ(session->length(), 0);
    Session moved = *std::move(session);  // the moved-from object holds nothing to drop
    EXPECT_TRUE(session->id().empty());
    id = moved.id();
    EXPECT_TRUE(Listed(sessions, id));
  }
  EXPECT_FALSE(Listed(sessions, id)) << "the destructor drops the session";

  absl::StatusOr<Session> session = sessions.Create(spec);
  ASSERT_TRUE(session.ok()) << session.status();
  id = session->Release();
  session = absl::UnknownError("destroyed");  // destroys the released object
  EXPECT_TRUE(Listed(sessions, id)) << "a released session stays";
  EXPECT_EQ(sessions.Drop(id), absl::OkStatus());
  EXPECT_EQ(sessions.Drop(id).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(Listed(sessions, id));

  absl::StatusOr<Session> dropped = sessions.Create(spec);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->Drop(), absl::OkStatus());
  const v1::Tensor q = client::MakeTensor(v1::DTYPE_FLOAT16, {1, 1, 32}, std::vector<float>(32, 1));
  EXPECT_EQ(dropped->Step(q).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dropped->Drop().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientSessionTest, BadStepsAreRefused) {
  SessionClient sessions(client());
  absl::StatusOr<Session> session =
      sessions.Create({.dtype = v1::DTYPE_FLOAT32, .kv_heads = 3, .head_dim = 16});
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor q = client::MakeTensor(v1::DTYPE_FLOAT32, {4, 1, 16}, std::vector<float>(64, 1));
  // 4 query heads over 3 kv heads: the server's INVALID_ARGUMENT.
  EXPECT_EQ(session->Step(q).status().code(), absl::StatusCode::kInvalidArgument);
  // k without v: refused before sending.
  EXPECT_EQ(session->Step(q, {}, &q, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  // A session of another SessionClient in a batch: refused before sending.
  SessionClient other(client());
  StepItem item{.session = &*session, .q = &q};
  EXPECT_EQ(other.StepMany({&item, 1}).status().code(), absl::StatusCode::kInvalidArgument);
}

// A server checking a bearer token: session calls carry the client's token like Attend calls.
class ClientSessionTokenTest : public SharedServerTest<ClientSessionTokenTest> {
 public:
  static constexpr char kToken[] = "session-test-token";
  static std::string TokenFile() {
    static const std::string* const path = [] {
      auto* file = new std::string((std::filesystem::temp_directory_path() /
                                    absl::StrCat("client_session_test_token.", getpid()))
                                       .string());
      std::ofstream(*file) << kToken << "\n";
      return file;
    }();
    return *path;
  }
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--auth_token_file=" + TokenFile()};
  }
  static void TearDownTestSuite() {
    SharedServerTest<ClientSessionTokenTest>::TearDownTestSuite();
    std::filesystem::remove(TokenFile());
  }
};

TEST_F(ClientSessionTokenTest, SessionCallsCarryTheToken) {
  client::Client with_token({.target = process().target(), .bearer_token = kToken});
  SessionClient sessions(with_token);
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT32, .kv_heads = 1, .head_dim = 8};
  absl::StatusOr<Session> session = sessions.Create(spec);
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::Tensor q = client::MakeTensor(v1::DTYPE_FLOAT32, {1, 1, 8}, std::vector<float>(8, 1));
  EXPECT_TRUE(session->Step(q, {}, &q, &q).ok());
  EXPECT_TRUE(session->Info().ok());
  absl::StatusOr<Session> child = session->Fork();
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->length(), 1);

  SessionClient anonymous(client());  // the fixture's client sends no token
  EXPECT_EQ(anonymous.Create(spec).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.Drop(session->id()).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.List().status().code(), absl::StatusCode::kUnauthenticated);
  v1::ForkRequest fork;
  fork.set_session_id(session->id());
  v1::SessionInfo info;
  EXPECT_EQ(anonymous.stub().Fork(anonymous.NewContext({}).get(), fork, &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(session->Drop(), absl::OkStatus());
}

// Shared prefixes on a server of their own (their cached pages stay after the test).
class ClientPrefixTest : public SharedServerTest<ClientPrefixTest> {
 public:
  static std::vector<std::string> ServerFlags() { return {"--backend=cpu"}; }
};

TEST_F(ClientPrefixTest, ASessionFromAPrefixSharesItsFullPagesAndStepsAsOneFromScratch) {
  SessionClient sessions(client());
  const int64_t page_rows = PageRows(sessions, kPagedSpec);
  ASSERT_GT(page_rows, 0);
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  Sequence seq{.spec = kPagedSpec};
  const int64_t heads_q = 4;
  const int64_t n = 2 * page_rows + 3;
  std::vector<int64_t> tokens(n);
  for (int64_t& t : tokens) t = static_cast<int64_t>(rng() >> 2);
  auto [k, v] = seq.Grow(n, rng);
  absl::StatusOr<Session> first = sessions.Create(seq.spec, k, v, tokens);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->prefix_rows(), 0);
  absl::StatusOr<v1::ListSessionsResponse> room = sessions.List();
  ASSERT_TRUE(room.ok()) << room.status();
  const int64_t free_before = room->pages_free();

  // The two full pages are found and shared: no page taken; the rest is appended with its tokens.
  absl::StatusOr<Session> second = sessions.CreateFromPrefix(seq.spec, tokens);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->prefix_rows(), 2 * page_rows);
  EXPECT_EQ(second->length(), 2 * page_rows);
  room = sessions.List();
  ASSERT_TRUE(room.ok()) << room.status();
  EXPECT_EQ(room->pages_free(), free_before);
  const Sequence rest = [&] {
    Sequence tail = seq;
    const int64_t skip = 2 * page_rows * seq.spec.kv_heads * seq.spec.head_dim;
    tail.k.erase(tail.k.begin(), tail.k.begin() + skip);
    tail.v.erase(tail.v.begin(), tail.v.begin() + skip);
    return tail;
  }();
  const std::vector<int64_t> shape = {rest.rows(), seq.spec.kv_heads, seq.spec.head_dim};
  ASSERT_EQ(second->Append(client::MakeTensor(seq.spec.dtype, shape, rest.k),
                           client::MakeTensor(seq.spec.dtype, shape, rest.v),
                           absl::MakeConstSpan(tokens).subspan(2 * page_rows)),
            absl::OkStatus());
  EXPECT_EQ(second->length(), n);
  // Tokens of another count are refused by name.
  EXPECT_TRUE(absl::StrContains(
      second
          ->Append(client::MakeTensor(seq.spec.dtype, shape, rest.k),
                   client::MakeTensor(seq.spec.dtype, shape, rest.v), {1, 2})
          .message(),
      absl::StrCat("tokens: expected none or ", rest.rows(), " (one token id per row")));
  absl::StatusOr<std::string> text = HttpGet(process().metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<MetricSample> samples = ParseMetrics(*text);
  EXPECT_EQ(SumSamples(samples, "attention_kv_prefix_blocks_total", {{"result", "hit"}}), 2);
  EXPECT_EQ(SumSamples(samples, "attention_kv_pages_shared"), 2);

  // Steps on it against the float64 reference, and bit for bit as on a session from scratch.
  const std::vector<int64_t> all = {n, seq.spec.kv_heads, seq.spec.head_dim};
  const v1::Tensor k0 = client::MakeTensor(seq.spec.dtype, all, seq.k);
  const v1::Tensor v0 = client::MakeTensor(seq.spec.dtype, all, seq.v);
  absl::StatusOr<Session> scratch = sessions.Create(seq.spec, &k0, &v0);
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  const StepOptions options{.causal = true, .return_lse = true};
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> q = client::RandomNormal(heads_q * seq.spec.head_dim, rng);
    const v1::Tensor q_tensor =
        client::MakeTensor(seq.spec.dtype, {heads_q, 1, seq.spec.head_dim}, q);
    auto [k1, v1_rows] = seq.GrowForStep(rng);
    absl::StatusOr<StepOutput> shared = second->Step(q_tensor, options, &k1, &v1_rows);
    absl::StatusOr<StepOutput> own = scratch->Step(q_tensor, options, &k1, &v1_rows);
    ASSERT_TRUE(shared.ok()) << shared.status();
    ASSERT_TRUE(own.ok()) << own.status();
    ExpectStepCorrect(seq, q, heads_q, options, *shared);
    EXPECT_EQ(shared->o.data(), own->o.data());
    EXPECT_EQ(shared->lse.data(), own->lse.data());
  }
}

}  // namespace
}  // namespace attention::e2e
