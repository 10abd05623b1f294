// Sessions moved between two real servers (CPU backend) through the C++ client: Session::Export,
// SessionClient::StartImport and Session::MoveTo. The exported rows are the rows appended (bytes
// compared), an imported session answers the same Steps as its original bit for bit (float32,
// float16, bfloat16; a session of several layers), a refused or abandoned import leaves
// neither a session nor a page behind, and a sealed session's changes are retried by the client
// and refused by name.
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::e2e {
namespace {

using client::Session;
using client::SessionClient;
using client::SessionImport;
using client::SessionSpec;
using client::StepOutput;

class SessionTransferTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (absl::StatusOr<RunningServer>** server : {&source_, &peer_}) {
      *server = new absl::StatusOr<RunningServer>(StartServer({"--backend=cpu"}));
    }
  }
  static void TearDownTestSuite() {
    for (absl::StatusOr<RunningServer>** server : {&source_, &peer_}) {
      if ((*server)->ok()) EXPECT_EQ((**server)->Stop(), absl::OkStatus());
      delete *server;
      *server = nullptr;
    }
  }
  void SetUp() override {
    ASSERT_TRUE(source_->ok()) << source_->status();
    ASSERT_TRUE(peer_->ok()) << peer_->status();
    sessions_ = std::make_unique<SessionClient>(*(*source_)->client);
    peer_sessions_ = std::make_unique<SessionClient>(*(*peer_)->client);
    seed_ = FreshSeed();
    rng_.seed(seed_);
  }
  // Nothing left on the peer: no session, every page free.
  void TearDown() override { ExpectEmpty(*peer_sessions_); }

  static void ExpectEmpty(SessionClient& sessions) {
    absl::StatusOr<v1::ListSessionsResponse> listed = sessions.List();
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_EQ(listed->sessions_size(), 0);
    EXPECT_EQ(listed->pages_free(), listed->pages_total());
  }

  // Values of [Hkv, n, D], and the tensor of them.
  std::vector<float> Values(const SessionSpec& spec, int64_t n) {
    return client::RandomNormal(spec.kv_heads * n * spec.head_dim, rng_);
  }

  static inline absl::StatusOr<RunningServer>* source_ = nullptr;
  static inline absl::StatusOr<RunningServer>* peer_ = nullptr;
  std::unique_ptr<SessionClient> sessions_, peer_sessions_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// [Hkv, a, D] followed by [Hkv, b, D] along the rows: [Hkv, a + b, D].
std::vector<float> ConcatRows(const SessionSpec& spec, const std::vector<float>& first, int64_t a,
                              const std::vector<float>& second, int64_t b) {
  std::vector<float> out;
  const int64_t d = spec.head_dim;
  for (int64_t h = 0; h < spec.kv_heads; ++h) {
    out.insert(out.end(), first.begin() + h * a * d, first.begin() + (h + 1) * a * d);
    out.insert(out.end(), second.begin() + h * b * d, second.begin() + (h + 1) * b * d);
  }
  return out;
}

// An export's chunks, and each layer's k and v bytes (BHSD) put together from them.
struct Exported {
  std::vector<v1::SessionChunk> chunks;
  std::vector<std::vector<std::string>> k_heads, v_heads;  // [layer][head]: that head's bytes

  std::string Bytes(const std::vector<std::vector<std::string>>& heads, int layer) const {
    std::string out;
    for (const std::string& head : heads[layer]) out += head;
    return out;
  }
};

absl::StatusOr<Exported> ExportAll(const Session& session, int64_t chunk_rows) {
  Exported out;
  absl::Status status = session.Export(
      [&out](const v1::SessionChunk& chunk) {
        if (out.chunks.empty()) {
          if (!chunk.has_header()) return absl::DataLossError("no header first");
          const int layers = std::max(1, chunk.header().layers());
          out.k_heads.assign(layers, std::vector<std::string>(chunk.header().kv_heads()));
          out.v_heads = out.k_heads;
        } else {
          const v1::Tensor& k = chunk.k();
          const int64_t per_head = static_cast<int64_t>(k.data().size()) / k.shape(0);
          for (int64_t h = 0; h < k.shape(0); ++h) {
            out.k_heads[chunk.layer()][h] += k.data().substr(h * per_head, per_head);
            out.v_heads[chunk.layer()][h] += chunk.v().data().substr(h * per_head, per_head);
          }
        }
        out.chunks.push_back(chunk);
        return absl::OkStatus();
      },
      chunk_rows);
  if (!status.ok()) return status;
  return out;
}

absl::StatusOr<Session> ImportAll(SessionClient& sessions, const Exported& exported,
                                  const client::ImportOptions& options = {}) {
  SessionImport import = sessions.StartImport(options);
  for (const v1::SessionChunk& chunk : exported.chunks) {
    if (absl::Status status = import.Write(chunk); !status.ok()) return status;
  }
  return import.Finish();
}

void ExpectSameBits(const StepOutput& a, const StepOutput& b, const std::string& what) {
  EXPECT_EQ(a.o.data(), b.o.data()) << what << ": o not equal bit for bit";
  EXPECT_EQ(a.lse.data(), b.lse.data()) << what << ": lse not equal bit for bit";
  EXPECT_EQ(a.length, b.length) << what;
}

TEST_F(SessionTransferTest, AnImportEqualsTheExportedSessionBitForBit) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const SessionSpec spec{.dtype = dtype, .kv_heads = 2, .head_dim = 64};
    const std::vector<float> k0 = Values(spec, 90), v0 = Values(spec, 90);
    const std::vector<float> k1 = Values(spec, 13), v1 = Values(spec, 13);
    const auto tensor = [&spec](int64_t n, const std::vector<float>& values) {
      return client::MakeTensor(spec.dtype, {spec.kv_heads, n, spec.head_dim}, values);
    };
    const v1::Tensor first_k = tensor(90, k0), first_v = tensor(90, v0);
    absl::StatusOr<Session> s = sessions_->Create(spec, &first_k, &first_v);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(s->Append(tensor(13, k1), tensor(13, v1)).ok());
    absl::StatusOr<Exported> exported = ExportAll(*s, 20);
    ASSERT_TRUE(exported.ok()) << exported.status();
    ASSERT_EQ(exported->chunks.size(), 1u + 6u);  // the header, then 103 rows by 20
    const v1::SessionHeader& header = exported->chunks.front().header();
    EXPECT_EQ(header.session_id(), s->id());
    EXPECT_EQ(header.dtype(), dtype);
    ASSERT_EQ(header.layer_lengths_size(), 1);
    EXPECT_EQ(header.layer_lengths(0), 103);
    EXPECT_EQ(exported->Bytes(exported->k_heads, 0),
              tensor(103, ConcatRows(spec, k0, 90, k1, 13)).data());
    EXPECT_EQ(exported->Bytes(exported->v_heads, 0),
              tensor(103, ConcatRows(spec, v0, 90, v1, 13)).data());

    absl::StatusOr<Session> t = ImportAll(*peer_sessions_, *exported);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->id(), s->id());
    EXPECT_EQ(t->length(), 103);
    for (int64_t nq : {4, 1}) {
      const v1::Tensor q =
          client::MakeTensor(dtype, {8, nq, 64}, Values({.kv_heads = 8, .head_dim = 64}, nq));
      const v1::Tensor k2 = tensor(nq, Values(spec, nq)), v2 = tensor(nq, Values(spec, nq));
      absl::StatusOr<StepOutput> a = s->Step(q, {.causal = true, .return_lse = true}, &k2, &v2);
      absl::StatusOr<StepOutput> b = t->Step(q, {.causal = true, .return_lse = true}, &k2, &v2);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
      ExpectSameBits(*a, *b, absl::StrCat(nq, " queries"));
    }
  }
}

// An Export with seal: the client retries each change the server refuses (Append, Truncate,
// Fork, Step) until the call's deadline, then returns the refusal, UNAVAILABLE naming the
// session; the session still exports its rows, unchanged, and drops.
TEST_F(SessionTransferTest, ASealedSessionRefusesChangesTheClientRetriesThem) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 16};
  const v1::Tensor k = client::MakeTensor(spec.dtype, {2, 10, 16}, Values(spec, 10));
  const v1::Tensor v = client::MakeTensor(spec.dtype, {2, 10, 16}, Values(spec, 10));
  absl::StatusOr<Session> s = sessions_->Create(spec, &k, &v);
  ASSERT_TRUE(s.ok()) << s.status();
  int chunks = 0;
  auto count = [&chunks](const v1::SessionChunk&) {
    ++chunks;
    return absl::OkStatus();
  };
  ASSERT_EQ(s->Export(count, 4, {}, /*seal=*/true), absl::OkStatus());
  EXPECT_EQ(chunks, 1 + 3);
  const client::CallOptions short_call{.deadline = absl::Milliseconds(300)};
  const v1::Tensor q =
      client::MakeTensor(spec.dtype, {4, 1, 16}, Values({.kv_heads = 4, .head_dim = 16}, 1));
  const std::vector<std::pair<std::string, std::function<absl::Status()>>> calls = {
      {"Append", [&] { return s->Append(k, v, short_call); }},
      {"Truncate", [&] { return s->Truncate(1, short_call); }},
      {"Fork", [&] { return s->Fork(std::nullopt, short_call).status(); }},
      {"Step", [&] { return s->Step(q, {}, nullptr, nullptr, short_call).status(); }},
  };
  for (const auto& [name, call] : calls) {
    const absl::Time started = absl::Now();
    const absl::Status status = call();
    // Retried 10, 20, 40 and 80 ms apart (the next wait would pass the deadline).
    EXPECT_GE(absl::Now() - started, absl::Milliseconds(150)) << name;
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << name << ": " << status;
    EXPECT_TRUE(absl::StartsWith(status.message(), absl::StrCat(client::kSealedMarker, "session '",
                                                                s->id(), "' was sealed")))
        << name << ": " << status;
  }
  absl::StatusOr<Exported> again = ExportAll(*s, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->Bytes(again->k_heads, 0), k.data());
  EXPECT_EQ(s->Drop(), absl::OkStatus());
  ExpectEmpty(*sessions_);
}

TEST_F(SessionTransferTest, MoveToTakesEveryLayerAndDropsTheOriginal) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT16, .kv_heads = 2, .head_dim = 32, .layers = 3};
  absl::StatusOr<Session> s = sessions_->Create(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  const int64_t lengths[] = {35, 0, 70};  // layer 1 stays empty
  for (int32_t layer = 0; layer < 3; ++layer) {
    if (lengths[layer] == 0) continue;
    const std::vector<int64_t> shape = {2, lengths[layer], 32};
    ASSERT_TRUE(s->Append(client::MakeTensor(spec.dtype, shape, Values(spec, lengths[layer])),
                          client::MakeTensor(spec.dtype, shape, Values(spec, lengths[layer])),
                          layer)
                    .ok());
  }
  const v1::Tensor q =
      client::MakeTensor(spec.dtype, {4, 1, 32}, Values({.kv_heads = 4, .head_dim = 32}, 1));
  std::vector<StepOutput> before;
  for (int32_t layer : {0, 2}) {
    absl::StatusOr<StepOutput> out = s->Step(q, {.layer = layer});
    ASSERT_TRUE(out.ok()) << out.status();
    before.push_back(*out);
  }
  const std::string id = s->id();
  absl::StatusOr<Session> moved = s->MoveTo(*peer_sessions_, 16);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(s->id(), "");
  EXPECT_EQ(moved->id(), id);
  EXPECT_EQ(moved->layer_lengths(), (std::vector<int64_t>{35, 0, 70}));
  EXPECT_EQ(moved->spec().layers, 3);
  ExpectEmpty(*sessions_);  // dropped at the source, its export's snapshot too
  for (int i = 0; i < 2; ++i) {
    const int32_t layer = i == 0 ? 0 : 2;
    absl::StatusOr<StepOutput> out = moved->Step(q, {.layer = layer});
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectSameBits(*out, before[i], absl::StrCat("layer ", layer));
  }
}

TEST_F(SessionTransferTest, RefusedAndAbandonedImportsLeaveNothing) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const SessionSpec spec{.dtype = v1::DTYPE_FLOAT32, .kv_heads = 1, .head_dim = 16};
  const v1::Tensor k = client::MakeTensor(spec.dtype, {1, 40, 16}, Values(spec, 40));
  absl::StatusOr<Session> s = sessions_->Create(spec, &k, &k);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<Exported> exported = ExportAll(*s, 8);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->chunks.size(), 6u);

  // A stream that ends before every declared row came.
  Exported short_stream = *exported;
  short_stream.chunks.pop_back();
  absl::StatusOr<Session> refused = ImportAll(*peer_sessions_, short_stream);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "stream: expected every declared row"))
      << refused.status();
  ExpectEmpty(*peer_sessions_);

  // Chunks out of order.
  Exported swapped = *exported;
  std::swap(swapped.chunks[1], swapped.chunks[2]);
  refused = ImportAll(*peer_sessions_, swapped);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "first_row: expected 0"))
      << refused.status();
  ExpectEmpty(*peer_sessions_);

  // An id that exists: the source's own session.
  refused = ImportAll(*sessions_, *exported);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  // Under a new id, on the same server: a copy.
  absl::StatusOr<Session> copy = ImportAll(*sessions_, *exported, {.session_id = ""});
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_NE(copy->id(), s->id());
  EXPECT_EQ(copy->length(), 40);

  // An import given up halfway (destroyed before Finish): cancelled, nothing kept.
  {
    SessionImport import = peer_sessions_->StartImport();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(import.Write(exported->chunks[i]).ok());
  }
  for (int attempt = 0; attempt < 100; ++attempt) {
    absl::StatusOr<v1::ListSessionsResponse> listed = peer_sessions_->List();
    ASSERT_TRUE(listed.ok()) << listed.status();
    if (listed->sessions_size() == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace
}  // namespace attention::e2e
