// End to end KV-resident sessions (attention.v1.Sessions) over real gRPC, against the real server
// on the CPU backend, driven through the generated stub (the server's contract, not a client
// library): decode and extend steps against the float64 reference over ragged lengths, GQA,
// windows and LSE; many single-row appends equal one Attend; two half-sequence sessions merged by
// their LSEs equal one session holding all of it; errors (NOT_FOUND, INVALID_ARGUMENT changing
// nothing, RESOURCE_EXHAUSTED, UNAUTHENTICATED), expiry after the TTL, the metrics, no page
// leaked over 10,000 create, append, drop cycles, and StepStream (many Steps on one stream, a
// Step on a dropped session ending it, a cancelled stream leaving its sessions free); the
// open-model options the device lists (DeviceInfo.step_options) against the reference; the host
// tier (--kv_host_bytes): more sessions than the pool holds stepped round robin against the
// reference (by one client and by three at once), a spilled session exported bit for bit, a
// Step's own sessions never moved for each other, and both budgets named when both are full.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::Status ToAbsl(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// Calls on the Sessions service of one server, with a bearer token when given.
class SessionsStub {
 public:
  SessionsStub(std::shared_ptr<grpc::Channel> channel, std::string token = "")
      : attention_(v1::Attention::NewStub(channel)),
        stub_(v1::Sessions::NewStub(std::move(channel))),
        token_(std::move(token)) {}

  // The server's first device ("cpu", or "cuda:0" when the suite runs against --backend=cuda).
  v1::DeviceInfo FirstDevice() {
    absl::StatusOr<v1::ServerInfo> info =
        Call(&v1::Attention::Stub::GetServerInfo, v1::GetServerInfoRequest(), v1::ServerInfo(),
             attention_.get());
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() && info->devices_size() > 0 ? info->devices(0) : v1::DeviceInfo();
  }
  std::string ServerDevice() { return FirstDevice().name(); }

  absl::StatusOr<v1::SessionInfo> Create(const v1::CreateSessionRequest& r) {
    return Call(&v1::Sessions::Stub::CreateSession, r, v1::SessionInfo());
  }
  absl::StatusOr<v1::SessionInfo> Append(const v1::AppendKvRequest& r) {
    return Call(&v1::Sessions::Stub::AppendKv, r, v1::SessionInfo());
  }
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& r) {
    return Call(&v1::Sessions::Stub::Step, r, v1::StepResponse());
  }
  // A StepStream on `context` (which gets the token).
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> StepStream(
      grpc::ClientContext* context) {
    if (!token_.empty()) context->AddMetadata("authorization", "Bearer " + token_);
    return stub_->StepStream(context);
  }
  absl::Status Drop(const std::string& id) {
    v1::DropSessionRequest r;
    r.set_session_id(id);
    return Call(&v1::Sessions::Stub::DropSession, r, v1::DropSessionResponse()).status();
  }
  absl::StatusOr<v1::ListSessionsResponse> List() {
    return Call(&v1::Sessions::Stub::ListSessions, v1::ListSessionsRequest(),
                v1::ListSessionsResponse());
  }
  // The session's length per ListSessions; -1 when it is not listed.
  int64_t Length(const std::string& id) {
    absl::StatusOr<v1::ListSessionsResponse> list = List();
    EXPECT_TRUE(list.ok()) << list.status();
    if (!list.ok()) return -1;
    for (const v1::SessionInfo& s : list->sessions()) {
      if (s.session_id() == id) return s.length();
    }
    return -1;
  }

 private:
  template <typename Stub, typename Req, typename Resp>
  absl::StatusOr<Resp> Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
                            const Req& request, Resp response, Stub* stub) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (!token_.empty()) context.AddMetadata("authorization", "Bearer " + token_);
    grpc::Status status = (stub->*method)(&context, request, &response);
    if (!status.ok()) return ToAbsl(status);
    return response;
  }
  template <typename Req, typename Resp>
  absl::StatusOr<Resp> Call(grpc::Status (v1::Sessions::Stub::*method)(grpc::ClientContext*,
                                                                       const Req&, Resp*),
                            const Req& request, Resp response) {
    return Call(method, request, std::move(response), stub_.get());
  }

  std::unique_ptr<v1::Attention::Stub> attention_;
  std::unique_ptr<v1::Sessions::Stub> stub_;
  std::string token_;
};

// A sequence's K/V as the test keeps it: per kv head, rows of D floats (BHSD [Hkv, N, D]).
struct Sequence {
  int64_t heads_kv = 0, head_dim = 0;
  std::vector<std::vector<float>> k, v;  // [Hkv][N * D]

  Sequence(int64_t hkv, int64_t d) : heads_kv(hkv), head_dim(d), k(hkv), v(hkv) {}
  int64_t length() const { return static_cast<int64_t>(k[0].size()) / head_dim; }

  // n new random rows, appended here; returned as BHSD [Hkv, n, D] (k then v).
  std::pair<std::vector<float>, std::vector<float>> Grow(int64_t n, std::mt19937_64& rng) {
    std::vector<float> nk = client::RandomNormal(heads_kv * n * head_dim, rng);
    std::vector<float> nv = client::RandomNormal(heads_kv * n * head_dim, rng);
    for (int64_t h = 0; h < heads_kv; ++h) {
      k[h].insert(k[h].end(), nk.begin() + h * n * head_dim, nk.begin() + (h + 1) * n * head_dim);
      v[h].insert(v[h].end(), nv.begin() + h * n * head_dim, nv.begin() + (h + 1) * n * head_dim);
    }
    return {std::move(nk), std::move(nv)};
  }
  // Rows [from, to) as BHSD [Hkv, to - from, D] (k or v).
  std::vector<float> Rows(const std::vector<std::vector<float>>& kv, int64_t from,
                          int64_t to) const {
    std::vector<float> out;
    for (int64_t h = 0; h < heads_kv; ++h) {
      out.insert(out.end(), kv[h].begin() + from * head_dim, kv[h].begin() + to * head_dim);
    }
    return out;
  }
};

// BHSD [Hkv, n, D] values as BSHD [n, Hkv, D].
std::vector<float> ToBshd(const std::vector<float>& bhsd, int64_t hkv, int64_t n, int64_t d) {
  std::vector<float> out(bhsd.size());
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(bhsd.begin() + (h * n + i) * d, d, out.begin() + (i * hkv + h) * d);
    }
  }
  return out;
}

// The mask, scale, LSE and open-model options a Step and its reference Attend share.
struct MaskSpec {
  bool causal = false;
  std::optional<float> softmax_scale;
  std::optional<int32_t> window_left;
  bool return_lse = false;
  std::vector<float> sinks;  // one per query head; empty: none
  std::optional<float> softcap;
  std::optional<int32_t> chunk_size;
};

// Sets `m` on a StepRequest or an AttendRequest (the fields are named alike).
template <typename Request>
void SetMask(const MaskSpec& m, Request* r) {
  r->set_causal(m.causal);
  if (m.softmax_scale) r->set_softmax_scale(*m.softmax_scale);
  if (m.window_left) r->set_window_left(*m.window_left);
  r->set_return_lse(m.return_lse);
  for (float sink : m.sinks) r->add_sinks(sink);
  if (m.softcap) r->set_softcap(*m.softcap);
  if (m.chunk_size) r->set_chunk_size(*m.chunk_size);
}

// The AttendRequest whose answer a step's result must match: q [1, Hq, Nq, D] over the whole
// sequence [1, Hkv, N, D].
v1::AttendRequest ReferenceRequest(v1::DType dtype, const Sequence& seq,
                                   const std::vector<float>& q, int64_t hq, int64_t nq,
                                   const MaskSpec& m) {
  const int64_t n = seq.length(), d = seq.head_dim, hkv = seq.heads_kv;
  v1::AttendRequest r;
  *r.mutable_q() = client::MakeTensor(dtype, {1, hq, nq, d}, q);
  *r.mutable_k() = client::MakeTensor(dtype, {1, hkv, n, d}, seq.Rows(seq.k, 0, n));
  *r.mutable_v() = client::MakeTensor(dtype, {1, hkv, n, d}, seq.Rows(seq.v, 0, n));
  SetMask(m, &r);
  return r;
}

// Expects a step's result to match the float64 reference of `request` within the API's bound.
void ExpectMatchesReference(const v1::AttendRequest& request, const v1::StepResult& result) {
  v1::AttendResponse response;
  *response.mutable_o() = result.o();
  response.mutable_o()->mutable_shape()->Clear();
  for (int64_t s : request.q().shape()) response.mutable_o()->add_shape(s);
  if (request.return_lse()) {
    *response.mutable_lse() = result.lse();
    response.mutable_lse()->mutable_shape()->Clear();
    for (int i = 0; i < 3; ++i) response.mutable_lse()->add_shape(request.q().shape(i));
  }
  absl::StatusOr<client::CheckResult> check = client::CheckResponse(request, response);
  ASSERT_TRUE(check.ok()) << check.status();
  const double bound = client::ErrorBound(request.q().dtype());
  EXPECT_LE(check->relative_error, bound) << "o ||o-ref||/||ref||";
  if (request.return_lse()) {
    EXPECT_TRUE(check->lse_checked);
    EXPECT_LE(check->lse_relative_error, bound) << "lse";
  }
}

// What a Step sent on a stream must answer: its session's length after it, and the reference.
struct ExpectedStep {
  int64_t length;
  v1::AttendRequest reference;
};

// Ends the writes of `stream`, reads every answer and checks it against `expected` (by request_id,
// one entry each); the stream must end OK with every Step answered.
void ExpectStepsAnswered(grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>& stream,
                         std::map<std::string, ExpectedStep> expected) {
  stream.WritesDone();
  v1::StepResponse response;
  while (stream.Read(&response)) {
    auto it = expected.find(response.request_id());
    ASSERT_NE(it, expected.end()) << "unexpected or repeated request_id " << response.request_id();
    ASSERT_EQ(response.results_size(), 1);
    EXPECT_EQ(response.results(0).length(), it->second.length) << response.request_id();
    ExpectMatchesReference(it->second.reference, response.results(0));
    expected.erase(it);
  }
  EXPECT_TRUE(expected.empty()) << expected.size() << " steps unanswered";
  EXPECT_TRUE(stream.Finish().ok());
}

// One session the tests drive: its server id, dtype and the rows it should hold.
struct TestSession {
  std::string id;
  v1::DType dtype;
  Sequence seq;
  std::string device;  // where the server placed it
};

// Creates a session of `initial` random rows (none when 0), sent in `layout`; expects it on the
// server's first device unless `any_device`.
absl::StatusOr<TestSession> CreateSession(SessionsStub& stub, v1::DType dtype, int64_t hkv,
                                          int64_t d, int64_t initial, v1::Layout layout,
                                          std::mt19937_64& rng, bool any_device = false) {
  TestSession s{.dtype = dtype, .seq = Sequence(hkv, d)};
  v1::CreateSessionRequest r;
  r.set_dtype(dtype);
  r.set_kv_heads(static_cast<int32_t>(hkv));
  r.set_head_dim(static_cast<int32_t>(d));
  r.set_layout(layout);
  if (initial > 0) {
    auto [k, v] = s.seq.Grow(initial, rng);
    const bool bshd = layout == v1::LAYOUT_BSHD;
    const std::vector<int64_t> shape =
        bshd ? std::vector<int64_t>{initial, hkv, d} : std::vector<int64_t>{hkv, initial, d};
    *r.mutable_k() = client::MakeTensor(dtype, shape, bshd ? ToBshd(k, hkv, initial, d) : k);
    *r.mutable_v() = client::MakeTensor(dtype, shape, bshd ? ToBshd(v, hkv, initial, d) : v);
  }
  absl::StatusOr<v1::SessionInfo> info = stub.Create(r);
  if (!info.ok()) return info.status();
  EXPECT_EQ(info->session_id().size(), 32u);
  EXPECT_EQ(info->length(), initial);
  if (!any_device) EXPECT_EQ(info->device(), stub.ServerDevice());
  s.id = info->session_id();
  s.device = info->device();
  return s;
}

// A step entry for `s`: q [hq, nq, D] (returned) after appending `append` new rows (recorded).
std::vector<float> AddEntry(TestSession& s, int64_t hq, int64_t nq, int64_t append,
                            std::mt19937_64& rng, v1::StepRequest* r) {
  v1::StepEntry* e = r->add_entries();
  e->set_session_id(s.id);
  const int64_t hkv = s.seq.heads_kv, d = s.seq.head_dim;
  std::vector<float> q = client::RandomNormal(hq * nq * d, rng);
  *e->mutable_q() = client::MakeTensor(s.dtype, {hq, nq, d}, q);
  if (append > 0) {
    auto [k, v] = s.seq.Grow(append, rng);
    *e->mutable_k() = client::MakeTensor(s.dtype, {hkv, append, d}, k);
    *e->mutable_v() = client::MakeTensor(s.dtype, {hkv, append, d}, v);
  }
  return q;
}

class SessionsE2E : public SharedServerTest<SessionsE2E> {
 public:
  // 16 KiB pages: 16 rows of float32 with Hkv 2, D 64, so sequences span many pages. Idle
  // workers poll the queue for 200 us before they sleep (--worker_spin_us), as a co-located
  // decode server's would: every call of the suite goes through the spinning path.
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--threads=2", "--kv_page_bytes=16384", "--worker_spin_us=200"};
  }

 protected:
  SessionsStub Stub() { return SessionsStub(client().channel()); }
  // Paged decode launches so far (attention_decode_step_duration_seconds_count).
  double DecodeLaunches() {
    absl::StatusOr<std::string> text = HttpGet(process().metrics_port(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    if (!text.ok()) return -1;
    return SumSamples(ParseMetrics(*text), "attention_decode_step_duration_seconds_count");
  }
};

struct StepCase {
  v1::DType dtype;
  int64_t hq, hkv, d;
  int64_t initial;  // rows given to CreateSession
  int64_t append;   // rows the step appends
  int64_t nq;
  MaskSpec mask;
  v1::Layout layout = v1::LAYOUT_BHSD;
};

// Runs each case on a session of its own: the case's step, then one more decode step, each
// answered for its session (id, length, the server's device) and matching the reference.
void ExpectStepCasesMatchTheReference(SessionsStub& stub, const std::vector<StepCase>& cases,
                                      std::mt19937_64& rng) {
  for (size_t c = 0; c < cases.size(); ++c) {
    const StepCase& k = cases[c];
    SCOPED_TRACE(absl::StrCat("case ", c));
    absl::StatusOr<TestSession> s =
        CreateSession(stub, k.dtype, k.hkv, k.d, k.initial, k.layout, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    // The step of the case, then one more decode step on the same session.
    for (const auto& [append, nq] : {std::pair{k.append, k.nq}, {int64_t{1}, int64_t{1}}}) {
      v1::StepRequest r;
      r.set_request_id(absl::StrCat("case-", c));
      SetMask(k.mask, &r);
      const std::vector<float> q = AddEntry(*s, k.hq, nq, append, rng, &r);
      absl::StatusOr<v1::StepResponse> out = stub.Step(r);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->request_id(), r.request_id());
      EXPECT_EQ(out->device(), stub.ServerDevice());
      EXPECT_GT(out->timing().total_us(), 0);
      ASSERT_EQ(out->results_size(), 1);
      EXPECT_EQ(out->results(0).session_id(), s->id);
      EXPECT_EQ(out->results(0).length(), s->seq.length());
      ExpectMatchesReference(ReferenceRequest(k.dtype, s->seq, q, k.hq, nq, k.mask),
                             out->results(0));
    }
    EXPECT_EQ(stub.Drop(s->id), absl::OkStatus());
  }
}

TEST_F(SessionsE2E, StepsMatchTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  const std::vector<StepCase> cases = {
      // decode, GQA, causal, LSE
      {v1::DTYPE_FLOAT32, 4, 2, 64, 37, 1, 1, {.causal = true, .return_lse = true}},
      // MQA, extend by 3 rows with 3 queries, first rows sent BSHD
      {v1::DTYPE_FLOAT16,
       8,
       1,
       128,
       100,
       3,
       3,
       {.causal = true, .return_lse = true},
       v1::LAYOUT_BSHD},
      // one row, no mask, head dim 40
      {v1::DTYPE_BFLOAT16, 2, 2, 40, 1, 0, 1, {}},
      // sliding window over many pages (16 rows a page)
      {v1::DTYPE_FLOAT32,
       6,
       3,
       32,
       70,
       5,
       5,
       {.causal = true, .window_left = 16, .return_lse = true}},
      // prefill through a step: the session starts empty
      {v1::DTYPE_FLOAT16, 4, 2, 64, 0, 20, 20, {.causal = true, .return_lse = true}},
      // fewer queries than appended rows, explicit scale, no mask
      {v1::DTYPE_FLOAT32,
       4,
       4,
       32,
       33,
       2,
       1,
       {.softmax_scale = 0.3f, .return_lse = true},
       v1::LAYOUT_BSHD},
      // long decode with a window
      {v1::DTYPE_BFLOAT16,
       8,
       2,
       128,
       250,
       1,
       1,
       {.causal = true, .window_left = 31, .return_lse = true}},
  };
  ExpectStepCasesMatchTheReference(stub, cases, rng);
}

// The open-model options the server's device serves on Step (DeviceInfo.step_options: all three
// on the CPU and the CUDA backends) against the reference: gpt-oss's sinks (far above, far below
// and near the rows' LSE), Gemma 2's softcap of 50 and Grok-1's 30 on logits that reach the cap
// (head dims 128, 64 and 256), Llama 4's chunks with extend steps, all of them with a window; each
// case's step (extending by nq rows with nq queries), then a decode step.
TEST_F(SessionsE2E, StepsWithOpenModelOptionsMatchTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  const v1::DeviceInfo device = stub.FirstDevice();
  std::vector<std::string> served(device.step_options().begin(), device.step_options().end());
  std::sort(served.begin(), served.end());
  // And v_head_dim and v_from_k (sessions whose V head dim is their own, or whose V is K's first
  // features: client_session_test.cc).
  EXPECT_EQ(served,
            (std::vector<std::string>{"chunk_size", "sinks", "softcap", "v_from_k", "v_head_dim"}))
      << device.name();
  const std::vector<float> sinks8 = {25.0f, -25.0f, 9.0f, -9.0f, 6.0f, 0.0f, 2.5f, -80.0f};
  const std::vector<StepCase> cases = {
      {v1::DTYPE_BFLOAT16,
       8,
       2,
       64,
       300,
       1,
       1,
       {.causal = true, .return_lse = true, .sinks = sinks8}},
      {v1::DTYPE_FLOAT16,
       8,
       2,
       128,
       129,
       1,
       1,
       {.softmax_scale = 2.5f, .return_lse = true, .softcap = 50.0f}},
      {v1::DTYPE_FLOAT32,
       4,
       1,
       64,
       97,
       3,
       3,
       {.causal = true,
        .softmax_scale = 2.5f,
        .window_left = 40,
        .return_lse = true,
        .softcap = 30.0f}},
      {v1::DTYPE_BFLOAT16,
       2,
       1,
       256,
       40,
       1,
       1,
       {.causal = true,
        .softmax_scale = 2.0f,
        .return_lse = true,
        .sinks = {3.0f, -3.0f},
        .softcap = 50.0f}},
      {v1::DTYPE_BFLOAT16,
       4,
       2,
       64,
       70,
       4,
       4,
       {.causal = true, .return_lse = true, .chunk_size = 32}},
      {v1::DTYPE_FLOAT16,
       8,
       2,
       64,
       200,
       2,
       2,
       {.causal = true,
        .softmax_scale = 0.5f,
        .window_left = 50,
        .return_lse = true,
        .sinks = sinks8,
        .softcap = 20.0f,
        .chunk_size = 64}},
  };
  ExpectStepCasesMatchTheReference(stub, cases, rng);
}

TEST_F(SessionsE2E, OneStepOverRaggedSessionsOfSeveralShapes) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  // Five sessions of one shape (one launch) with lengths around the 16-row page, and two of
  // another shape (a second launch), interleaved.
  struct Member {
    v1::DType dtype;
    int64_t hq, hkv, d, initial;
  };
  const std::vector<Member> members = {
      {v1::DTYPE_FLOAT32, 4, 2, 64, 1},   {v1::DTYPE_FLOAT16, 4, 4, 32, 9},
      {v1::DTYPE_FLOAT32, 4, 2, 64, 15},  {v1::DTYPE_FLOAT32, 4, 2, 64, 16},
      {v1::DTYPE_FLOAT16, 4, 4, 32, 40},  {v1::DTYPE_FLOAT32, 4, 2, 64, 17},
      {v1::DTYPE_FLOAT32, 4, 2, 64, 130},
  };
  const MaskSpec mask{.causal = true, .return_lse = true};
  std::vector<TestSession> sessions;
  for (const Member& m : members) {
    absl::StatusOr<TestSession> s =
        CreateSession(stub, m.dtype, m.hkv, m.d, m.initial, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
  }
  for (int step = 0; step < 2; ++step) {
    v1::StepRequest r;
    SetMask(mask, &r);
    std::vector<std::vector<float>> qs;
    for (size_t i = 0; i < members.size(); ++i) {
      // Decode steps, and on the second step some entries extend by 2 rows with 2 queries.
      const int64_t n = step == 1 && i % 3 == 0 ? 2 : 1;
      qs.push_back(AddEntry(sessions[i], members[i].hq, n, n, rng, &r));
    }
    const double launches_before = DecodeLaunches();
    absl::StatusOr<v1::StepResponse> out = stub.Step(r);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(DecodeLaunches() - launches_before, 2) << "one launch per shape";
    ASSERT_EQ(out->results_size(), static_cast<int>(members.size()));
    for (size_t i = 0; i < members.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("step ", step, " entry ", i));
      EXPECT_EQ(out->results(i).session_id(), sessions[i].id);
      EXPECT_EQ(out->results(i).length(), sessions[i].seq.length());
      const int64_t nq = r.entries(i).q().shape(1);
      ExpectMatchesReference(
          ReferenceRequest(members[i].dtype, sessions[i].seq, qs[i], members[i].hq, nq, mask),
          out->results(i));
    }
  }
  for (const TestSession& s : sessions) EXPECT_EQ(stub.Drop(s.id), absl::OkStatus());
}

TEST_F(SessionsE2E, HundredSingleRowAppendsEqualOneAttend) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  constexpr int64_t kHq = 4, kHkv = 2, kD = 64, kRows = 100, kNq = 8;
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, kHkv, kD, 0, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  // One row at a time: AppendKv on even rows, a decode Step's append on odd ones.
  const MaskSpec causal{.causal = true};
  for (int64_t i = 0; i < kRows; ++i) {
    if (i % 2 == 0) {
      auto [k, v] = s->seq.Grow(1, rng);
      v1::AppendKvRequest a;
      a.set_session_id(s->id);
      *a.mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT32, {kHkv, 1, kD}, k);
      *a.mutable_v() = client::MakeTensor(v1::DTYPE_FLOAT32, {kHkv, 1, kD}, v);
      absl::StatusOr<v1::SessionInfo> info = stub.Append(a);
      ASSERT_TRUE(info.ok()) << info.status();
      ASSERT_EQ(info->length(), i + 1);
    } else {
      v1::StepRequest r;
      SetMask(causal, &r);
      AddEntry(*s, kHq, 1, 1, rng, &r);
      absl::StatusOr<v1::StepResponse> out = stub.Step(r);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->results(0).length(), i + 1);
    }
  }
  // The last 8 positions' queries, causal, against one Attend over the 100 rows.
  v1::StepRequest r;
  SetMask(MaskSpec{.causal = true, .return_lse = true}, &r);
  const std::vector<float> q = AddEntry(*s, kHq, kNq, 0, rng, &r);
  absl::StatusOr<v1::StepResponse> step = stub.Step(r);
  ASSERT_TRUE(step.ok()) << step.status();
  const v1::AttendRequest attend = ReferenceRequest(v1::DTYPE_FLOAT32, s->seq, q, kHq, kNq,
                                                    MaskSpec{.causal = true, .return_lse = true});
  absl::StatusOr<v1::AttendResponse> whole = client().Attend(attend);
  ASSERT_TRUE(whole.ok()) << whole.status();
  absl::StatusOr<std::vector<float>> o_step = client::TensorToFloat(step->results(0).o());
  absl::StatusOr<std::vector<float>> o_whole = client::TensorToFloat(whole->o());
  ASSERT_TRUE(o_step.ok() && o_whole.ok());
  ASSERT_EQ(o_step->size(), o_whole->size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < o_step->size(); ++i) {
    diff += std::pow((*o_step)[i] - (*o_whole)[i], 2);
    norm += std::pow((*o_whole)[i], 2);
  }
  EXPECT_LE(std::sqrt(diff / norm), 1e-5) << "||o_step - o_attend|| / ||o_attend||";
  ExpectMatchesReference(attend, step->results(0));
  EXPECT_EQ(stub.Drop(s->id), absl::OkStatus());
}

TEST_F(SessionsE2E, TwoHalvesMergedByLseEqualTheWhole) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  constexpr int64_t kHq = 8, kHkv = 2, kD = 64, kRows = 150, kNq = 2;
  absl::StatusOr<TestSession> whole =
      CreateSession(stub, v1::DTYPE_FLOAT32, kHkv, kD, kRows, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(whole.ok()) << whole.status();
  // The halves hold rows [0, 70) and [70, 150) of the same sequence.
  std::vector<TestSession> halves;
  for (const auto& [from, to] : {std::pair<int64_t, int64_t>{0, 70}, {70, kRows}}) {
    absl::StatusOr<TestSession> half =
        CreateSession(stub, v1::DTYPE_FLOAT32, kHkv, kD, 0, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(half.ok()) << half.status();
    v1::AppendKvRequest a;
    a.set_session_id(half->id);
    *a.mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT32, {kHkv, to - from, kD},
                                        whole->seq.Rows(whole->seq.k, from, to));
    *a.mutable_v() = client::MakeTensor(v1::DTYPE_FLOAT32, {kHkv, to - from, kD},
                                        whole->seq.Rows(whole->seq.v, from, to));
    ASSERT_TRUE(stub.Append(a).ok());
    halves.push_back(*std::move(half));
  }
  // One step over all three sessions with the same q (no mask: every query sees every row).
  const std::vector<float> q = client::RandomNormal(kHq * kNq * kD, rng);
  v1::StepRequest r;
  r.set_return_lse(true);
  for (const std::string& id : {whole->id, halves[0].id, halves[1].id}) {
    v1::StepEntry* e = r.add_entries();
    e->set_session_id(id);
    *e->mutable_q() = client::MakeTensor(v1::DTYPE_FLOAT32, {kHq, kNq, kD}, q);
  }
  absl::StatusOr<v1::StepResponse> out = stub.Step(r);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<std::vector<float>> o, lse;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::vector<float>> oi = client::TensorToFloat(out->results(i).o());
    absl::StatusOr<std::vector<float>> li = client::TensorToFloat(out->results(i).lse());
    ASSERT_TRUE(oi.ok() && li.ok());
    o.push_back(*oi);
    lse.push_back(*li);
  }
  // Row (h, i): o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b}), lse = log of the
  // sum.
  double o_diff = 0, o_norm = 0, lse_diff = 0, lse_norm = 0;
  for (int64_t row = 0; row < kHq * kNq; ++row) {
    const double la = lse[1][row], lb = lse[2][row], m = std::max(la, lb);
    const double wa = std::exp(la - m), wb = std::exp(lb - m);
    const double merged_lse = m + std::log(wa + wb);
    lse_diff += std::pow(merged_lse - lse[0][row], 2);
    lse_norm += std::pow(lse[0][row], 2);
    for (int64_t j = 0; j < kD; ++j) {
      const int64_t at = row * kD + j;
      const double merged = (wa * o[1][at] + wb * o[2][at]) / (wa + wb);
      o_diff += std::pow(merged - o[0][at], 2);
      o_norm += std::pow(o[0][at], 2);
    }
  }
  EXPECT_LE(std::sqrt(o_diff / o_norm), 1e-5) << "merged o vs the whole sequence's";
  EXPECT_LE(std::sqrt(lse_diff / lse_norm), 1e-5) << "merged lse vs the whole sequence's";
  ExpectMatchesReference(
      ReferenceRequest(v1::DTYPE_FLOAT32, whole->seq, q, kHq, kNq, MaskSpec{.return_lse = true}),
      out->results(0));
  for (const std::string& id : {whole->id, halves[0].id, halves[1].id}) {
    EXPECT_EQ(stub.Drop(id), absl::OkStatus());
  }
}

TEST_F(SessionsE2E, UnknownAndDroppedSessionsAreNotFound) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 3, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(stub.Drop(s->id), absl::OkStatus());
  for (const std::string& id : {s->id, std::string(32, 'a')}) {
    v1::StepRequest r;
    TestSession ghost{.id = id, .dtype = v1::DTYPE_FLOAT32, .seq = Sequence(1, 8)};
    AddEntry(ghost, 1, 1, 1, rng, &r);
    absl::StatusOr<v1::StepResponse> out = stub.Step(r);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(id));
    EXPECT_EQ(stub.Drop(id).code(), absl::StatusCode::kNotFound);
    v1::AppendKvRequest a;
    a.set_session_id(id);
    *a.mutable_k() = r.entries(0).k();
    *a.mutable_v() = r.entries(0).v();
    EXPECT_EQ(stub.Append(a).status().code(), absl::StatusCode::kNotFound);
  }
}

// float8 is an Attend dtype: no session holds float8 rows, so CreateSession refuses it (and with
// it every Step of float8 tensors, which must be of their session's dtype).
TEST_F(SessionsE2E, Float8SessionsAreUnimplemented) {
  SessionsStub stub = Stub();
  v1::CreateSessionRequest r;
  r.set_dtype(v1::DTYPE_FLOAT8_E4M3);
  r.set_kv_heads(2);
  r.set_head_dim(64);
  const absl::StatusOr<v1::SessionInfo> info = stub.Create(r);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnimplemented) << info.status();
  EXPECT_THAT(std::string(info.status().message()),
              HasSubstr("DTYPE_FLOAT8_E4M3 sessions are not implemented"));
}

TEST_F(SessionsE2E, InvalidEntriesAreRefusedBeforeAnythingIsAppended) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> a =
      CreateSession(stub, v1::DTYPE_FLOAT16, 2, 16, 5, v1::LAYOUT_BHSD, rng);
  absl::StatusOr<TestSession> b =
      CreateSession(stub, v1::DTYPE_FLOAT16, 2, 16, 5, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(a.ok() && b.ok());
  struct Case {
    std::string name;
    std::function<void(v1::StepRequest*)> corrupt;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"kv heads",
       [](v1::StepRequest* r) {
         *r->mutable_entries(1)->mutable_k() =
             client::MakeTensor(v1::DTYPE_FLOAT16, {3, 1, 16}, std::vector<float>(48, 1));
       },
       {"entries[1].k.shape[0]", "expected 2", "got 3"}},
      {"v bytes",
       [](v1::StepRequest* r) { r->mutable_entries(1)->mutable_v()->mutable_data()->pop_back(); },
       {"entries[1].v.data", "expected 64 bytes", "got 63"}},
      {"q heads",
       [](v1::StepRequest* r) {
         *r->mutable_entries(1)->mutable_q() =
             client::MakeTensor(v1::DTYPE_FLOAT16, {3, 1, 16}, std::vector<float>(48, 1));
       },
       {"entries[1].q.shape[0]", "multiple", "2 kv heads", "got 3"}},
      {"dtype",
       [](v1::StepRequest* r) {
         r->mutable_entries(1)->mutable_q()->set_dtype(v1::DTYPE_BFLOAT16);
       },
       {"entries[1].q.dtype", "DTYPE_FLOAT16", "DTYPE_BFLOAT16"}},
      {"duplicate",
       [&](v1::StepRequest* r) { r->mutable_entries(1)->set_session_id(a->id); },
       {"entries[1].session_id", "at most once", a->id}},
      {"window",
       [](v1::StepRequest* r) { r->set_window_left(-1); },
       {"window_left", "expected >= 0", "got -1"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::StepRequest r;
    AddEntry(*a, 4, 1, 1, rng, &r);  // valid, and appends a row
    AddEntry(*b, 4, 1, 1, rng, &r);
    c.corrupt(&r);
    absl::StatusOr<v1::StepResponse> out = stub.Step(r);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    for (const std::string& word : c.words) {
      EXPECT_THAT(std::string(out.status().message()), HasSubstr(word));
    }
    EXPECT_EQ(stub.Length(a->id), 5) << "entry 0's row was appended";
    EXPECT_EQ(stub.Length(b->id), 5);
  }
  // Create and Append name their fields too.
  v1::CreateSessionRequest create;
  create.set_dtype(v1::DTYPE_FLOAT16);
  create.set_kv_heads(2);
  create.set_head_dim(0);
  EXPECT_THAT(std::string(stub.Create(create).status().message()),
              HasSubstr("head_dim: expected 1..256, got 0"));
  v1::AppendKvRequest append;
  append.set_session_id(a->id);
  append.set_layout(v1::LAYOUT_BSHD);
  *append.mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT16, {4, 3, 16}, std::vector<float>(192));
  *append.mutable_v() = append.k();
  absl::StatusOr<v1::SessionInfo> appended = stub.Append(append);
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(appended.status().message()),
              HasSubstr("k.shape[1] (kv heads): expected 2 (the session's), got 3"));
  EXPECT_EQ(stub.Length(a->id), 5);
  EXPECT_EQ(stub.Drop(a->id), absl::OkStatus());
  EXPECT_EQ(stub.Drop(b->id), absl::OkStatus());
}

TEST_F(SessionsE2E, ListAndMetricsShowTheCache) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<client::HealthStatus> health = client().CheckHealth("attention.v1.Sessions");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  // float32, Hkv 2, D 64: 16 rows per 16 KiB page, so 40 rows hold 3 pages.
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 2, 64, 40, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  v1::StepRequest r;
  AddEntry(*s, 2, 1, 1, rng, &r);
  ASSERT_TRUE(stub.Step(r).ok());
  absl::StatusOr<v1::ListSessionsResponse> list = stub.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->page_bytes(), 16384);
  EXPECT_GT(list->pages_total(), list->pages_free());
  const v1::SessionInfo* info = nullptr;
  for (const v1::SessionInfo& i : list->sessions()) {
    if (i.session_id() == s->id) info = &i;
  }
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->length(), 41);
  EXPECT_EQ(info->pages(), 3);
  EXPECT_EQ(info->resident_bytes(), 3 * 16384);
  EXPECT_EQ(info->kv_heads(), 2);
  EXPECT_EQ(info->head_dim(), 64);
  EXPECT_EQ(info->dtype(), v1::DTYPE_FLOAT32);
  EXPECT_GE(info->idle_s(), 0);
  EXPECT_LE(info->expires_in_s(), 600);
  EXPECT_GT(info->expires_in_s(), 500);

  absl::StatusOr<std::string> text = HttpGet(process().metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<MetricSample> samples = ParseMetrics(*text);
  const std::string device = stub.ServerDevice();
  EXPECT_GE(SumSamples(samples, "attention_sessions_resident", {{"device", device}}), 1);
  EXPECT_GE(SumSamples(samples, "attention_session_resident_bytes", {{"device", device}}),
            3 * 16384);
  EXPECT_EQ(SumSamples(samples, "attention_kv_pages_free", {{"device", device}}),
            list->pages_free());
  EXPECT_EQ(SumSamples(samples, "attention_kv_pages_capacity", {{"device", device}}),
            list->pages_total());
  EXPECT_TRUE(HasSample(samples, "attention_session_expirations_total"));
  EXPECT_GE(
      SumSamples(samples, "attention_decode_step_duration_seconds_count", {{"device", device}}), 1);
  EXPECT_GE(SumSamples(samples, "attention_requests_total", {{"rpc", "Step"}, {"code", "OK"}}), 1);
  EXPECT_GE(
      SumSamples(samples, "attention_requests_total", {{"rpc", "CreateSession"}, {"code", "OK"}}),
      1);
  EXPECT_EQ(stub.Drop(s->id), absl::OkStatus());
}

TEST_F(SessionsE2E, ConcurrentStepsOnOneSessionRunOneAtATime) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 0, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  constexpr int kThreads = 3, kSteps = 20;
  std::vector<std::vector<int64_t>> lengths(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      SessionsStub own = Stub();
      const v1::Tensor row =
          client::MakeTensor(v1::DTYPE_FLOAT32, {1, 1, 8}, std::vector<float>(8, 1.0f + t));
      for (int i = 0; i < kSteps; ++i) {
        v1::StepRequest r;
        v1::StepEntry* e = r.add_entries();
        e->set_session_id(s->id);
        *e->mutable_q() = row;
        *e->mutable_k() = row;
        *e->mutable_v() = row;
        absl::StatusOr<v1::StepResponse> out = own.Step(r);
        if (out.ok()) lengths[t].push_back(out->results(0).length());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // Every step appended its row and saw a length no other step saw.
  std::vector<int64_t> all;
  for (const auto& l : lengths) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kThreads * kSteps));
  for (int i = 0; i < kThreads * kSteps; ++i) EXPECT_EQ(all[i], i + 1);
  EXPECT_EQ(stub.Length(s->id), kThreads * kSteps);
  EXPECT_EQ(stub.Drop(s->id), absl::OkStatus());
}

// The cache's state per the server's metrics endpoint, summed over its devices.
struct CacheGauges {
  double sessions = -1, resident_bytes = -1, pages_free = -1;
};

CacheGauges ScrapeCache(int metrics_port) {
  absl::StatusOr<std::string> text = HttpGet(metrics_port, "/metrics");
  EXPECT_TRUE(text.ok()) << text.status();
  if (!text.ok()) return {};
  const std::vector<MetricSample> samples = ParseMetrics(*text);
  return {SumSamples(samples, "attention_sessions_resident"),
          SumSamples(samples, "attention_session_resident_bytes"),
          SumSamples(samples, "attention_kv_pages_free")};
}

// The churn test's sessions: float16, Hkv 1, D 32, so 128 bytes a row (k and v) and 128 rows a
// 16 KiB page (SessionsE2E's --kv_page_bytes); 0..130 rows at creation and 1..130 appended span
// one to three pages.
constexpr int64_t kChurnHkv = 1, kChurnD = 32, kChurnMaxRows = 130, kChurnPageRows = 128;

// The pages a session of `length` rows holds: at least one.
int64_t ChurnPages(int64_t length) {
  return std::max<int64_t>(1, (length + kChurnPageRows - 1) / kChurnPageRows);
}

v1::Tensor ChurnRows(int64_t n, std::mt19937_64& rng) {
  return client::MakeTensor(v1::DTYPE_FLOAT16, {kChurnHkv, n, kChurnD},
                            client::RandomNormal(kChurnHkv * n * kChurnD, rng));
}

// Grows session `id` of `length` rows: AppendKv of 1..130 rows; on every eighth cycle an append
// of the wrong shape, which must be refused; on every fourth a decode Step appending one row.
absl::Status GrowChurnSession(SessionsStub& stub, const std::string& id, int64_t length, int cycle,
                              std::mt19937_64& rng) {
  v1::AppendKvRequest append;
  append.set_session_id(id);
  const int64_t added = std::uniform_int_distribution<int64_t>(1, kChurnMaxRows)(rng);
  *append.mutable_k() = ChurnRows(added, rng);
  *append.mutable_v() = ChurnRows(added, rng);
  absl::StatusOr<v1::SessionInfo> appended = stub.Append(append);
  if (!appended.ok()) return appended.status();
  if (appended->length() != length + added || appended->pages() != ChurnPages(length + added)) {
    return absl::InternalError(absl::StrCat("AppendKv of ", added, " rows to ", length,
                                            " answered length ", appended->length(), ", ",
                                            appended->pages(), " pages"));
  }
  if (cycle % 8 == 0) {  // two kv heads for a one-head session
    v1::AppendKvRequest wrong = append;
    *wrong.mutable_k() = client::MakeTensor(v1::DTYPE_FLOAT16, {2, 1, kChurnD},
                                            std::vector<float>(2 * kChurnD, 1.0f));
    *wrong.mutable_v() = wrong.k();
    const absl::Status refused = stub.Append(wrong).status();
    if (refused.code() != absl::StatusCode::kInvalidArgument) {
      return absl::InternalError(
          absl::StrCat("a wrong-shape AppendKv answered ", refused.ToString()));
    }
  }
  if (cycle % 4 == 0) {
    v1::StepRequest step;
    v1::StepEntry* entry = step.add_entries();
    entry->set_session_id(id);
    *entry->mutable_q() = ChurnRows(1, rng);
    *entry->mutable_k() = ChurnRows(1, rng);
    *entry->mutable_v() = ChurnRows(1, rng);
    absl::StatusOr<v1::StepResponse> stepped = stub.Step(step);
    if (!stepped.ok()) return stepped.status();
  }
  return absl::OkStatus();
}

// One create, grow, drop cycle; the session is dropped even when a check before failed.
absl::Status ChurnCycle(SessionsStub& stub, int cycle, std::mt19937_64& rng) {
  v1::CreateSessionRequest create;
  create.set_dtype(v1::DTYPE_FLOAT16);
  create.set_kv_heads(kChurnHkv);
  create.set_head_dim(kChurnD);
  const int64_t initial = std::uniform_int_distribution<int64_t>(0, kChurnMaxRows)(rng);
  if (initial > 0) {
    *create.mutable_k() = ChurnRows(initial, rng);
    *create.mutable_v() = ChurnRows(initial, rng);
  }
  absl::StatusOr<v1::SessionInfo> created = stub.Create(create);
  if (!created.ok()) return created.status();
  const absl::Status used =
      created->pages() == ChurnPages(initial)
          ? GrowChurnSession(stub, created->session_id(), initial, cycle, rng)
          : absl::InternalError(
                absl::StrCat("a session of ", initial, " rows holds ", created->pages(), " pages"));
  const absl::Status dropped = stub.Drop(created->session_id());
  return used.ok() ? dropped : used;
}

// No page leaks under churn: 10,000 create, append, drop cycles from several threads at once
// (see ChurnCycle), after which every page is free again and no session is held.
TEST_F(SessionsE2E, TenThousandCreateAppendDropCyclesLeaveNoPagesBehind) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const CacheGauges before = ScrapeCache(process().metrics_port());
  absl::StatusOr<v1::ListSessionsResponse> list_before = Stub().List();
  ASSERT_TRUE(list_before.ok()) << list_before.status();
  ASSERT_GT(before.pages_free, 0);
  constexpr int kCycles = 10000, kThreads = 4;
  std::atomic<int> next_cycle{0};
  std::vector<std::string> failures(kThreads);  // each thread's first failure
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      SessionsStub stub = Stub();
      std::mt19937_64 rng(seed + t);
      for (int cycle = next_cycle++; cycle < kCycles; cycle = next_cycle++) {
        if (const absl::Status s = ChurnCycle(stub, cycle, rng); !s.ok()) {
          failures[t] = absl::StrCat("cycle ", cycle, ": ", s.ToString());
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::cout << kCycles << " cycles on " << kThreads << " threads in "
            << absl::FormatDuration(absl::Now() - start) << "\n";
  for (const std::string& failure : failures) EXPECT_EQ(failure, "");

  const CacheGauges after = ScrapeCache(process().metrics_port());
  EXPECT_EQ(after.pages_free, before.pages_free) << "KV pages not returned";
  EXPECT_EQ(after.sessions, 0) << before.sessions << " at the start";
  EXPECT_EQ(after.resident_bytes, 0);
  absl::StatusOr<v1::ListSessionsResponse> list = Stub().List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->sessions_size(), 0);
  EXPECT_EQ(list->pages_free(), list_before->pages_free());
}

// Steps take the one queue every computing call takes. The one worker runs a blocker while a
// burst of Steps arrives: the queue's two places are taken, every other Step is refused
// RESOURCE_EXHAUSTED at once and changes nothing, and the queued ones answer correctly once the
// blocker ends; their FLOPs, query tokens and stage times show on /metrics.
// StepStream: many Steps on one stream, each answer carrying its request_id and matching the
// reference. The first half one at a time, each appending a row; then 32 written at once
// (queries only, so every answer is known whatever the order).
TEST_F(SessionsE2E, StepStreamAnswersManyStepsCorrectly) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  std::vector<TestSession> sessions;
  for (int64_t initial : {19, 45}) {
    absl::StatusOr<TestSession> s =
        CreateSession(stub, v1::DTYPE_FLOAT32, 2, 32, initial, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
  }
  const MaskSpec mask{.causal = true, .return_lse = true};
  grpc::ClientContext context;
  auto stream = stub.StepStream(&context);
  for (int i = 0; i < 24; ++i) {
    TestSession& s = sessions[i % 2];
    v1::StepRequest r;
    r.set_request_id(absl::StrCat("one-", i));
    SetMask(mask, &r);
    const std::vector<float> q = AddEntry(s, 4, 1, 1, rng, &r);
    ASSERT_TRUE(stream->Write(r));
    v1::StepResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.request_id(), r.request_id());
    ASSERT_EQ(response.results_size(), 1);
    EXPECT_EQ(response.results(0).length(), s.seq.length());
    EXPECT_GT(response.timing().total_us(), 0);
    ExpectMatchesReference(ReferenceRequest(s.dtype, s.seq, q, 4, 1, mask), response.results(0));
  }
  std::map<std::string, ExpectedStep> expected;
  for (int i = 0; i < 32; ++i) {
    TestSession& s = sessions[i % 2];
    v1::StepRequest r;
    r.set_request_id(absl::StrCat("many-", i));
    SetMask(mask, &r);
    const std::vector<float> q = AddEntry(s, 4, 2, 0, rng, &r);
    expected[r.request_id()] = {s.seq.length(), ReferenceRequest(s.dtype, s.seq, q, 4, 2, mask)};
    ASSERT_TRUE(stream->Write(r));
  }
  ExpectStepsAnswered(*stream, std::move(expected));
  for (const TestSession& s : sessions) EXPECT_EQ(stub.Length(s.id), s.seq.length());
}

// Steps written at once that each append a row to one session apply in the order they were sent
// (a stream queues its requests in that order): each answer's length and output are those of its
// place in the sequence.
TEST_F(SessionsE2E, StepStreamAppliesAppendsSentAtOnceInOrder) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 2, 32, 7, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  const MaskSpec mask{.causal = true};
  grpc::ClientContext context;
  auto stream = stub.StepStream(&context);
  std::map<std::string, ExpectedStep> expected;
  for (int i = 0; i < 24; ++i) {
    v1::StepRequest r;
    r.set_request_id(absl::StrCat("append-", i));
    SetMask(mask, &r);
    const std::vector<float> q = AddEntry(*s, 4, 1, 1, rng, &r);
    expected[r.request_id()] = {s->seq.length(), ReferenceRequest(s->dtype, s->seq, q, 4, 1, mask)};
    ASSERT_TRUE(stream->Write(r));
  }
  ExpectStepsAnswered(*stream, std::move(expected));
  EXPECT_EQ(stub.Length(s->id), s->seq.length());
}

// A Step on a dropped session ends the stream NOT_FOUND naming its request_id; the Steps before
// it were answered.
TEST_F(SessionsE2E, StepStreamEndsWithTheStatusOfAStepOnADroppedSession) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT16, 1, 16, 8, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  grpc::ClientContext context;
  auto stream = stub.StepStream(&context);
  v1::StepRequest r;
  r.set_request_id("before");
  AddEntry(*s, 2, 1, 0, rng, &r);
  ASSERT_TRUE(stream->Write(r));
  v1::StepResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.request_id(), "before");
  ASSERT_TRUE(stub.Drop(s->id).ok());
  r.set_request_id("after-drop");
  ASSERT_TRUE(stream->Write(r));
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("after-drop"));
}

// A cancelled stream ends CANCELLED; its Steps leave no session held, and the server answers
// the next Step on the same session.
TEST_F(SessionsE2E, ACancelledStepStreamLeavesItsSessionsFree) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 2, 64, 300, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  {
    grpc::ClientContext context;
    auto stream = stub.StepStream(&context);
    for (int i = 0; i < 8; ++i) {
      v1::StepRequest r;
      r.set_request_id(absl::StrCat("cancelled-", i));
      AddEntry(*s, 8, 64, 0, rng, &r);
      if (!stream->Write(r)) break;
    }
    context.TryCancel();
    v1::StepResponse response;
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  v1::StepRequest r;
  const MaskSpec mask{.causal = true};
  SetMask(mask, &r);
  const std::vector<float> q = AddEntry(*s, 2, 1, 1, rng, &r);
  absl::StatusOr<v1::StepResponse> out = stub.Step(r);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(ReferenceRequest(s->dtype, s->seq, q, 2, 1, mask), out->results(0));
  EXPECT_EQ(stub.Length(s->id), 301);
}

TEST(StepAdmissionE2E, AFullQueueRefusesStepsAtOnce) {
  constexpr int kSteps = 48, kQueue = 2;
  constexpr int64_t kHq = 4, kHkv = 2, kD = 64, kInitial = 40;
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--threads=1", "--workers=1",
                   absl::StrCat("--max_queue=", kQueue), "--kv_page_bytes=16384"});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub(server->client->channel());
  const std::string device = stub.ServerDevice();
  std::vector<TestSession> sessions;
  for (int i = 0; i < kSteps; ++i) {
    absl::StatusOr<TestSession> s =
        CreateSession(stub, v1::DTYPE_FLOAT32, kHkv, kD, kInitial, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
  }
  const MaskSpec mask{.causal = true, .return_lse = true};
  std::vector<v1::StepRequest> steps(kSteps);
  std::vector<std::vector<float>> queries(kSteps);
  for (int i = 0; i < kSteps; ++i) {
    SetMask(mask, &steps[i]);
    queries[i] = AddEntry(sessions[i], kHq, 1, 1, rng, &steps[i]);
  }
  absl::StatusOr<Blocker> blocker = CalibratedBlocker(*server->client, absl::Seconds(2), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  if (const std::string why = WhyTooFast(*blocker, absl::Milliseconds(500)); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const int port = server->process->metrics_port();
  auto metric = [port, &device](const std::string& name, bool per_device) {
    absl::StatusOr<double> value =
        ScrapeMetric(port, name,
                     per_device ? std::map<std::string, std::string>{{"device", device}}
                                : std::map<std::string, std::string>{});
    EXPECT_TRUE(value.ok()) << value.status();
    return value.value_or(-1);
  };
  const double flops_before = metric("attention_flops_total", true);
  const double tokens_before = metric("attention_tokens_total", true);
  const double queue_stage_before =
      SumSamples(ParseMetrics(HttpGet(port, "/metrics").value_or("")),
                 "attention_stage_duration_seconds_count", {{"stage", "queue"}});

  std::future<absl::StatusOr<v1::AttendResponse>> blocked =
      server->client->AttendAsync(blocker->request);
  ASSERT_TRUE(WaitUntilRunning(port)) << "the blocker never ran";
  std::vector<absl::StatusOr<v1::StepResponse>> answers(kSteps, absl::UnknownError("not answered"));
  std::vector<absl::Duration> took(kSteps);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSteps; ++i) {
    threads.emplace_back([&, i] {
      SessionsStub own(server->client->channel());
      const absl::Time start = absl::Now();
      answers[i] = own.Step(steps[i]);
      took[i] = absl::Now() - start;
    });
  }
  for (std::thread& t : threads) t.join();
  ExpectBlockerAnswered(*blocker, blocked.get());

  int served = 0;
  double step_flops = 0;
  for (int i = 0; i < kSteps; ++i) {
    if (answers[i].ok()) {
      ++served;
      const TestSession& s = sessions[i];
      step_flops += 4.0 * kHq * kD * static_cast<double>(s.seq.length());
      ExpectMatchesReference(ReferenceRequest(s.dtype, s.seq, queries[i], kHq, 1, mask),
                             answers[i]->results(0));
      continue;
    }
    EXPECT_EQ(answers[i].status().code(), absl::StatusCode::kResourceExhausted)
        << answers[i].status();
    EXPECT_THAT(answers[i].status().message(), HasSubstr("queue full"));
    // Refused at once, not after the blocker, and nothing was appended.
    EXPECT_LT(took[i], absl::Seconds(1)) << "step " << i << " was refused only after waiting";
    EXPECT_EQ(stub.Length(sessions[i].id), kInitial) << "a refused step changed its session";
  }
  EXPECT_GE(served, 1);
  EXPECT_LE(served, kQueue) << "more Steps were accepted than the queue holds";

  EXPECT_DOUBLE_EQ(metric("attention_tokens_total", true) - tokens_before,
                   static_cast<double>(blocker->seqlen + served));
  EXPECT_NEAR(metric("attention_flops_total", true) - flops_before, blocker->flops + step_flops,
              1e-6 * blocker->flops);
  EXPECT_EQ(SumSamples(ParseMetrics(HttpGet(port, "/metrics").value_or("")),
                       "attention_stage_duration_seconds_count", {{"stage", "queue"}}) -
                queue_stage_before,
            1 + served);
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// With --max_batch > 1, Steps of different calls queued together (same shape, heads and mask,
// other sessions) run as one decode launch: attention_batch_size sees one launch of all of them
// after the blocker's launch of one; each answer matches the reference.
TEST(StepAdmissionE2E, CompatibleStepsOfDifferentCallsShareOneLaunch) {
  constexpr int kSteps = 4;
  constexpr int64_t kHq = 8, kHkv = 2, kD = 32;
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--workers=1", "--max_batch=8", "--kv_page_bytes=16384"});
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub(server->client->channel());
  const std::string device = stub.ServerDevice();
  std::vector<TestSession> sessions;
  std::vector<v1::StepRequest> steps(kSteps);
  std::vector<std::vector<float>> queries(kSteps);
  const MaskSpec mask{.causal = true, .return_lse = true};
  for (int i = 0; i < kSteps; ++i) {
    // Ragged lengths: the launch packs sequences of different lengths and page counts.
    absl::StatusOr<TestSession> s =
        CreateSession(stub, v1::DTYPE_FLOAT16, kHkv, kD, 17 + 61 * i, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
    SetMask(mask, &steps[i]);
    queries[i] = AddEntry(sessions[i], kHq, 1 + i % 2, 1 + i % 2, rng, &steps[i]);
  }
  absl::StatusOr<Blocker> blocker = CalibratedBlocker(*server->client, absl::Seconds(1), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  if (const std::string why = WhyTooFast(*blocker, absl::Milliseconds(500)); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const int port = server->process->metrics_port();
  const std::map<std::string, std::string> on_device = {{"device", device}};
  const double launches_before =
      ScrapeMetric(port, "attention_batch_size_count", on_device).value_or(-1);
  const double batched_before =
      ScrapeMetric(port, "attention_batch_size_sum", on_device).value_or(-1);

  std::future<absl::StatusOr<v1::AttendResponse>> blocked =
      server->client->AttendAsync(blocker->request);
  ASSERT_TRUE(WaitUntilRunning(port)) << "the blocker never ran";
  std::vector<absl::StatusOr<v1::StepResponse>> answers(kSteps, absl::UnknownError("not answered"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kSteps; ++i) {
    threads.emplace_back(
        [&, i] { answers[i] = SessionsStub(server->client->channel()).Step(steps[i]); });
  }
  const double queued =
      WaitForMetric(port, "attention_queue_depth", {}, [](double v) { return v >= kSteps; });
  for (std::thread& t : threads) t.join();
  ExpectBlockerAnswered(*blocker, blocked.get());
  ASSERT_EQ(queued, kSteps) << "the Steps were not all queued behind the blocker";
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_TRUE(answers[i].ok()) << answers[i].status();
    const TestSession& s = sessions[i];
    ExpectMatchesReference(ReferenceRequest(s.dtype, s.seq, queries[i], kHq, 1 + i % 2, mask),
                           answers[i]->results(0));
  }
  EXPECT_EQ(
      ScrapeMetric(port, "attention_batch_size_count", on_device).value_or(-1) - launches_before,
      2);
  EXPECT_EQ(ScrapeMetric(port, "attention_batch_size_sum", on_device).value_or(-1) - batched_before,
            1 + kSteps);
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// A server with two CPU devices: new sessions alternate over them (each goes to the device with
// the most free pages), and one Step over sessions on both devices (one launch per device) answers
// every entry, in entry order, against the reference.
TEST(TwoDeviceSessionsE2E, AStepOverSessionsOnBothDevicesMatchesTheReference) {
  constexpr int kSessions = 6;
  constexpr int64_t kHq = 4, kHkv = 2, kD = 64;
  // Two CPU devices by design, also where the suite is pointed at a GPU backend
  // (ATTENTION_E2E_EXTRA_FLAGS, bench/cuda/device_run.sh): those flags would make them two GPUs.
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--devices=0,1", "--threads=1", "--max_batch=8", "--kv_page_bytes=16384"},
      {}, /*environment_flags=*/false);
  ASSERT_TRUE(server.ok()) << server.status();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub(server->client->channel());
  std::vector<TestSession> sessions;
  for (int i = 0; i < kSessions; ++i) {
    // Equal lengths keep the pools level, so the placement alternates.
    absl::StatusOr<TestSession> s =
        CreateSession(stub, v1::DTYPE_FLOAT32, kHkv, kD, 40, v1::LAYOUT_BHSD, rng, true);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->device, absl::StrCat("cpu:", i % 2));
    sessions.push_back(*std::move(s));
  }
  const MaskSpec mask{.causal = true, .return_lse = true};
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    v1::StepRequest r;
    SetMask(mask, &r);
    std::vector<std::vector<float>> queries;
    // Ragged: entry i appends 1 + i % 3 rows with as many queries.
    for (int i = 0; i < kSessions; ++i) {
      queries.push_back(AddEntry(sessions[i], kHq, 1 + i % 3, 1 + i % 3, rng, &r));
    }
    absl::StatusOr<v1::StepResponse> out = stub.Step(r);
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<std::string> devices = absl::StrSplit(out->device(), ',');
    std::sort(devices.begin(), devices.end());
    EXPECT_EQ(devices, (std::vector<std::string>{"cpu:0", "cpu:1"})) << out->device();
    ASSERT_EQ(out->results_size(), kSessions);
    for (int i = 0; i < kSessions; ++i) {
      const TestSession& s = sessions[i];
      EXPECT_EQ(out->results(i).session_id(), s.id);
      EXPECT_EQ(out->results(i).length(), s.seq.length());
      ExpectMatchesReference(ReferenceRequest(s.dtype, s.seq, queries[i], kHq, 1 + i % 3, mask),
                             out->results(i));
    }
  }
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

TEST(SessionsOffE2E, WithoutACacheSessionsAreUnimplemented) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu", "--kv_cache_fraction=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<client::HealthStatus> health =
      server->client->CheckHealth("attention.v1.Sessions");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  SessionsStub stub(server->client->channel());
  absl::StatusOr<v1::ListSessionsResponse> list = stub.List();
  EXPECT_EQ(list.status().code(), absl::StatusCode::kUnimplemented) << list.status();
  EXPECT_THAT(std::string(list.status().message()), HasSubstr("--kv_cache_fraction"));
  EXPECT_EQ(server->Stop(), absl::OkStatus());
}

// Co-located clients may connect over a Unix domain socket (--unix_socket) beside TCP: Steps on a
// StepStream over it are answered as over TCP, with the worker's timing (prepare_us, run_us)
// and the parse's share of the decode (parse_us).
TEST(UnixSocketE2E, StepStreamOverAUnixSocketMatchesTheReference) {
  const std::string path = absl::StrCat("/tmp/attention-sessions-test-", getpid(), ".sock");
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=2", "--kv_page_bytes=16384", "--unix_socket=" + path});
  ASSERT_TRUE(server.ok()) << server.status();
  {
    SessionsStub stub(
        grpc::CreateChannel(absl::StrCat("unix:", path), grpc::InsecureChannelCredentials()));
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937_64 rng(seed);
    absl::StatusOr<TestSession> s =
        CreateSession(stub, v1::DTYPE_FLOAT32, 2, 64, 37, v1::LAYOUT_BHSD, rng);
    ASSERT_TRUE(s.ok()) << s.status();
    const MaskSpec mask{.causal = true};
    grpc::ClientContext context;
    auto stream = stub.StepStream(&context);
    for (int i = 0; i < 8; ++i) {
      v1::StepRequest r;
      r.set_request_id(absl::StrCat("unix-", i));
      SetMask(mask, &r);
      const std::vector<float> q = AddEntry(*s, 4, 1, 1, rng, &r);
      ASSERT_TRUE(stream->Write(r));
      v1::StepResponse response;
      ASSERT_TRUE(stream->Read(&response));
      EXPECT_EQ(response.request_id(), r.request_id());
      ASSERT_EQ(response.results_size(), 1);
      EXPECT_EQ(response.results(0).length(), s->seq.length());
      EXPECT_GT(response.timing().prepare_us(), 0);
      EXPECT_GE(response.timing().run_us(), response.timing().compute_us());
      EXPECT_GT(response.timing().parse_us(), 0);
      EXPECT_LE(response.timing().parse_us(), response.timing().decode_us());
      ExpectMatchesReference(ReferenceRequest(s->dtype, s->seq, q, 4, 1, mask),
                             response.results(0));
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  EXPECT_EQ(server->Stop(), absl::OkStatus());
  std::filesystem::remove(path);
}

// Regions belong to the peer when there is no token, and every client of a Unix socket has the
// same peer name: the server refuses to serve shared memory there without a token.
TEST(UnixSocketE2E, SharedMemoryOnAUnixSocketNeedsAToken) {
  const std::string path = absl::StrCat("/tmp/attention-sessions-test-shm-", getpid(), ".sock");
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--allow_shared_memory", "--unix_socket=" + path});
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("needs --auth_token_file"));
}

// A server with a bearer token, a cache of 8 pages of 4 KiB and a 2-second TTL.
class SessionsLimitsE2E : public SharedServerTest<SessionsLimitsE2E> {
 public:
  static constexpr char kToken[] = "sessions-e2e-token";
  static constexpr int64_t kPages = 8;
  static constexpr int64_t kPageBytes = 4096;

  static std::string TokenFile() {
    static const std::string* const path = [] {
      auto* file = new std::string(
          (std::filesystem::temp_directory_path() / absl::StrCat("sessions_test_token.", getpid()))
              .string());
      std::ofstream(*file) << kToken << "\n";
      return file;
    }();
    return *path;
  }
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu",
            "--threads=1",
            "--auth_token_file=" + TokenFile(),
            absl::StrCat("--kv_cache_bytes=", kPages * kPageBytes + kPageBytes / 2),
            absl::StrCat("--kv_page_bytes=", kPageBytes),
            "--session_ttl_s=2"};
  }
  static void TearDownTestSuite() {
    SharedServerTest<SessionsLimitsE2E>::TearDownTestSuite();
    std::filesystem::remove(TokenFile());
  }

 protected:
  SessionsStub Stub(const std::string& token = kToken) {
    return SessionsStub(client().channel(), token);
  }
};

TEST_F(SessionsLimitsE2E, EveryCallNeedsTheToken) {
  for (const std::string& token : {std::string(), std::string("wrong-token")}) {
    SCOPED_TRACE(token);
    SessionsStub stub = Stub(token);
    v1::CreateSessionRequest create;
    create.set_dtype(v1::DTYPE_FLOAT32);
    create.set_kv_heads(1);
    create.set_head_dim(8);
    EXPECT_EQ(stub.Create(create).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(stub.Append(v1::AppendKvRequest()).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(stub.Step(v1::StepRequest()).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(stub.Drop("x").code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(stub.List().status().code(), absl::StatusCode::kUnauthenticated);
  }
  absl::StatusOr<v1::ListSessionsResponse> list = Stub().List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->pages_total(), kPages);
}

TEST_F(SessionsLimitsE2E, AFullCacheRefusesWithBytesNeededAndFree) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  // float32, Hkv 1, D 8: 64 bytes a row, 64 rows a page. One session takes 7 of the 8 pages.
  absl::StatusOr<TestSession> big =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 7 * 64, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(big.ok()) << big.status();
  absl::StatusOr<TestSession> small =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 1, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(small.ok()) << small.status();
  absl::StatusOr<TestSession> none =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 0, v1::LAYOUT_BHSD, rng);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  EXPECT_THAT(std::string(none.status().message()),
              AllOf(HasSubstr("needs 4096 bytes"), HasSubstr("0 bytes free")));
  // A step whose append needs a page: refused, and its other entry appended nothing either.
  v1::StepRequest r;
  AddEntry(*small, 1, 1, 1, rng, &r);
  AddEntry(*big, 1, 1, 1, rng, &r);
  absl::StatusOr<v1::StepResponse> out = stub.Step(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
  EXPECT_THAT(std::string(out.status().message()),
              AllOf(HasSubstr("need 4096 bytes"), HasSubstr("0 bytes free")));
  EXPECT_EQ(stub.Length(small->id), 1);
  EXPECT_EQ(stub.Length(big->id), 7 * 64);
  // Dropping frees the room.
  EXPECT_EQ(stub.Drop(small->id), absl::OkStatus());
  v1::StepRequest again;
  AddEntry(*big, 1, 1, 1, rng, &again);
  out = stub.Step(again);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->results(0).length(), 7 * 64 + 1);
  EXPECT_EQ(stub.Drop(big->id), absl::OkStatus());
}

TEST_F(SessionsLimitsE2E, IdleSessionsExpire) {
  std::mt19937_64 rng(FreshSeed());
  SessionsStub stub = Stub();
  absl::StatusOr<TestSession> s =
      CreateSession(stub, v1::DTYPE_FLOAT32, 1, 8, 5, v1::LAYOUT_BHSD, rng);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<v1::ListSessionsResponse> list = stub.List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->sessions_size(), 1);
  EXPECT_LE(list->sessions(0).expires_in_s(), 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  // The sweeper removed it: the metrics show it before any call touches the session.
  absl::StatusOr<std::string> text = HttpGet(process().metrics_port(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<MetricSample> samples = ParseMetrics(*text);
  EXPECT_GE(SumSamples(samples, "attention_session_expirations_total"), 1);
  const std::string device = stub.ServerDevice();
  EXPECT_EQ(SumSamples(samples, "attention_sessions_resident", {{"device", device}}), 0);
  EXPECT_EQ(SumSamples(samples, "attention_kv_pages_free", {{"device", device}}), kPages);
  v1::StepRequest r;
  AddEntry(*s, 1, 1, 0, rng, &r);
  absl::StatusOr<v1::StepResponse> out = stub.Step(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("expired"));
}

// The host tier (--kv_host_bytes): a pool of 8 pages of 4 KiB and a host tier of 16. float16,
// Hkv 1, D 64: 256 bytes a row (K and V), 16 rows a page, so a session of up to 32 rows holds 2
// pages and the pool 4 such sessions. With ATTENTION_E2E_EXTRA_FLAGS=--backend=cuda, the same on a
// GPU (the CUDA pool, a pinned host tier).
class HostTierE2E : public SharedServerTest<HostTierE2E> {
 public:
  static constexpr int64_t kPageBytes = 4096, kPoolPages = 8, kHostPages = 16;
  static constexpr int64_t kRows = 28, kHq = 4, kHkv = 1, kD = 64;
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--threads=2", absl::StrCat("--kv_page_bytes=", kPageBytes),
            absl::StrCat("--kv_cache_bytes=", kPoolPages * kPageBytes),
            absl::StrCat("--kv_host_bytes=", kHostPages * kPageBytes)};
  }

 protected:
  SessionsStub Stub() { return SessionsStub(client().channel()); }
  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    return ScrapeMetric(process().metrics_port(), name, labels).value_or(-1);
  }
  // `count` sessions of kRows random rows, created in order (the first is the least recently
  // used).
  std::vector<TestSession> CreateSessions(SessionsStub& stub, int count, std::mt19937_64& rng) {
    std::vector<TestSession> out;
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<TestSession> s =
          CreateSession(stub, v1::DTYPE_FLOAT16, kHkv, kD, kRows, v1::LAYOUT_BHSD, rng);
      EXPECT_TRUE(s.ok()) << "session " << i << ": " << s.status();
      if (s.ok()) out.push_back(*std::move(s));
    }
    return out;
  }
  // One Step over `sessions` (each appends a row and asks one query); each result checked against
  // the reference over every row of its session. The Step's status.
  absl::Status StepAll(SessionsStub& stub, std::vector<TestSession*> sessions,
                       std::mt19937_64& rng) {
    const MaskSpec mask{.causal = true, .return_lse = true};
    v1::StepRequest r;
    SetMask(mask, &r);
    std::vector<std::vector<float>> qs;
    for (TestSession* s : sessions) qs.push_back(AddEntry(*s, kHq, 1, 1, rng, &r));
    absl::StatusOr<v1::StepResponse> out = stub.Step(r);
    if (!out.ok()) {
      // Nothing appended: the sessions' rows are as before.
      for (TestSession* s : sessions) {
        for (auto* kv : {&s->seq.k, &s->seq.v}) {
          for (std::vector<float>& head : *kv) head.resize(head.size() - kD);
        }
      }
      return out.status();
    }
    EXPECT_EQ(out->results_size(), static_cast<int>(sessions.size()));
    for (size_t i = 0; i < sessions.size() && i < static_cast<size_t>(out->results_size()); ++i) {
      SCOPED_TRACE(sessions[i]->id);
      EXPECT_EQ(out->results(i).session_id(), sessions[i]->id);
      EXPECT_EQ(out->results(i).length(), sessions[i]->seq.length());
      ExpectMatchesReference(
          ReferenceRequest(sessions[i]->dtype, sessions[i]->seq, qs[i], kHq, 1, mask),
          out->results(i));
    }
    return absl::OkStatus();
  }
  void DropAll(SessionsStub& stub, const std::vector<TestSession>& sessions) {
    for (const TestSession& s : sessions) EXPECT_EQ(stub.Drop(s.id), absl::OkStatus()) << s.id;
  }
};

TEST_F(HostTierE2E, RoundRobinStepsOverMoreSessionsThanThePoolHolds) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  const std::string device = stub.ServerDevice();
  const double spilled = Metric("attention_kv_host_pages_total", {{"direction", "spilled"}});
  const double restored = Metric("attention_kv_host_pages_total", {{"direction", "restored"}});
  EXPECT_EQ(Metric("attention_kv_host_bytes_capacity", {{"device", device}}),
            kHostPages * kPageBytes);
  // 9 sessions of 2 pages: 18 pages, the pool holds 8.
  std::vector<TestSession> sessions = CreateSessions(stub, 9, rng);
  ASSERT_EQ(sessions.size(), 9u);
  EXPECT_GT(Metric("attention_kv_host_bytes_used", {{"device", device}}), 0);
  for (int round = 0; round < 3; ++round) {
    for (TestSession& s : sessions) {
      SCOPED_TRACE(absl::StrCat("round ", round));
      EXPECT_EQ(StepAll(stub, {&s}, rng), absl::OkStatus());
    }
  }
  EXPECT_GT(Metric("attention_kv_host_pages_total", {{"direction", "spilled"}}), spilled);
  const double restored_by_steps =
      Metric("attention_kv_host_pages_total", {{"direction", "restored"}});
  EXPECT_GT(restored_by_steps, restored);
  EXPECT_GT(Metric("attention_kv_host_restore_duration_seconds_count", {{"device", device}}), 0);
  // The first session is the least recently used: on the host tier. Its export brings it back
  // and holds its rows bit for bit.
  const TestSession& cold = sessions.front();
  grpc::ClientContext context;
  v1::ExportRequest request;
  request.set_session_id(cold.id);
  request.set_chunk_rows(10);
  std::unique_ptr<v1::Sessions::Stub> raw = v1::Sessions::NewStub(client().channel());
  std::unique_ptr<grpc::ClientReader<v1::SessionChunk>> reader = raw->Export(&context, request);
  v1::SessionChunk chunk;
  int64_t rows = 0;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) continue;
    const int64_t n = chunk.k().shape(1);
    EXPECT_EQ(chunk.first_row(), rows);
    for (const auto& [got, kv] : {std::pair{&chunk.k(), &cold.seq.k}, {&chunk.v(), &cold.seq.v}}) {
      const v1::Tensor want =
          client::MakeTensor(cold.dtype, {kHkv, n, kD}, cold.seq.Rows(*kv, rows, rows + n));
      EXPECT_TRUE(got->data() == want.data()) << "rows " << rows << ".." << rows + n;
    }
    rows += n;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(rows, cold.seq.length());
  EXPECT_GT(Metric("attention_kv_host_pages_total", {{"direction", "restored"}}),
            restored_by_steps);
  DropAll(stub, sessions);
  EXPECT_EQ(Metric("attention_kv_host_bytes_used", {{"device", device}}), 0);
}

// A Step holds its sessions: bringing one back moves other sessions out, never another of the
// Step's. Four sessions fill the pool exactly, so one Step over the four least recently used
// (all on the host tier) fits only if none of them moves for another; five never fit.
TEST_F(HostTierE2E, AStepsOwnSessionsNeverMoveForEachOther) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  std::vector<TestSession> sessions = CreateSessions(stub, 10, rng);  // 20 pages
  ASSERT_EQ(sessions.size(), 10u);
  EXPECT_EQ(StepAll(stub, {&sessions[0], &sessions[1], &sessions[2], &sessions[3]}, rng),
            absl::OkStatus());
  absl::Status refused =
      StepAll(stub, {&sessions[4], &sessions[5], &sessions[6], &sessions[7], &sessions[8]}, rng);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr("KV cache full"), HasSubstr("--kv_cache_bytes"),
                    HasSubstr("--kv_host_bytes")));
  // Nothing lost or mixed up: every session steps alone against its own rows.
  for (TestSession& s : sessions) {
    EXPECT_EQ(stub.Length(s.id), s.seq.length()) << s.id;
    EXPECT_EQ(StepAll(stub, {&s}, rng), absl::OkStatus());
  }
  DropAll(stub, sessions);
}

// Three clients stepping three sessions each at once (18 pages over a pool of 8): pages move
// between the pool and the host tier while other Steps run, and every answer matches the
// reference over its own session's rows.
TEST_F(HostTierE2E, ConcurrentClientsSteppingTheirOwnSessionsMatchTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  constexpr int kClients = 3;
  std::vector<TestSession> sessions = CreateSessions(stub, 3 * kClients, rng);
  ASSERT_EQ(sessions.size(), 3u * kClients);
  const double restored = Metric("attention_kv_host_pages_total", {{"direction", "restored"}});
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937_64 client_rng(seed + 1 + c);
      SessionsStub own = Stub();
      for (int i = 0; i < 9; ++i) {
        TestSession& s = sessions[3 * c + i % 3];
        EXPECT_EQ(StepAll(own, {&s}, client_rng), absl::OkStatus()) << "client " << c;
      }
    });
  }
  for (std::thread& client : clients) client.join();
  EXPECT_GT(Metric("attention_kv_host_pages_total", {{"direction", "restored"}}), restored);
  DropAll(stub, sessions);
}

// Pool and host tier full (24 pages: 12 sessions): a new session is refused naming both budgets;
// a session on the host tier still steps (the coldest in the pool takes its slots).
TEST_F(HostTierE2E, BothFullRefusesNamingBothBudgets) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SessionsStub stub = Stub();
  std::vector<TestSession> sessions = CreateSessions(stub, 12, rng);
  ASSERT_EQ(sessions.size(), 12u);
  absl::StatusOr<TestSession> refused =
      CreateSession(stub, v1::DTYPE_FLOAT16, kHkv, kD, kRows, v1::LAYOUT_BHSD, rng);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr(absl::StrCat("its KV pool: ", kPoolPages * kPageBytes, " bytes")),
                    HasSubstr(absl::StrCat("its host tier: 0 of ", kHostPages * kPageBytes,
                                           " bytes free, --kv_host_bytes"))));
  for (TestSession& s : sessions) EXPECT_EQ(StepAll(stub, {&s}, rng), absl::OkStatus());
  DropAll(stub, sessions);
}

}  // namespace
}  // namespace attention::e2e
