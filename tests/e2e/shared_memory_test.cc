// End to end tensors in shared memory (attention.v1.SharedMemory) against the real server on the
// CPU backend, through the client library (client/shared_memory.h): Attend and Step with inputs
// and outputs in POSIX shared memory match the float64 reference (or the same call sent inline,
// bit for bit); every bad reference or registration gets its documented code and writes nothing
// outside the region (guard bytes around it are checked); an output overlapping an input or another
// output (Attend, a Step's entries) is refused naming both; regions of one caller are invisible to
// another; another user's object is refused; a tokenless client's regions go with its connection
// or once idle; Unregister waits for a running request; without --allow_shared_memory everything is
// FAILED_PRECONDITION; a client that shrinks its object before or during a request gets
// FAILED_PRECONDITION, and the server serves on.
#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/reference_check.h"
#include "client/request_builder.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/blocker.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::e2e {
namespace {

using client::MakeRef;
using client::PlaceTensor;
using client::SharedMemoryClient;
using client::SharedMemoryObject;
using ::testing::HasSubstr;

constexpr unsigned char kGuard = 0xA5;   // bytes outside the registered range
constexpr unsigned char kPoison = 0xFF;  // output bytes before a run (a NaN in every dtype)
constexpr int64_t kGuardBytes = 4096;    // before and after the registered range

// A fresh key per object, so parallel test runs never meet.
std::string FreshKey(absl::string_view what) {
  static int counter = 0;
  return absl::StrCat("/attn-e2e-", getpid(), "-", what, "-", ++counter);
}

// A shared-memory object of guard + `bytes` + guard, its middle registered as `name`.
struct GuardedRegion {
  std::unique_ptr<SharedMemoryObject> object;
  std::string name;
  int64_t bytes = 0;
  char* data() const { return object->data() + kGuardBytes; }
  bool GuardsIntact() const {
    for (int64_t i = 0; i < kGuardBytes; ++i) {
      if (static_cast<unsigned char>(object->data()[i]) != kGuard ||
          static_cast<unsigned char>(data()[bytes + i]) != kGuard) {
        return false;
      }
    }
    return true;
  }
};

absl::StatusOr<GuardedRegion> MakeRegion(SharedMemoryClient& regions, const std::string& name,
                                         int64_t bytes) {
  GuardedRegion r;
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey(name), bytes + 2 * kGuardBytes);
  if (!object.ok()) return object.status();
  r.object = *std::move(object);
  r.name = name;
  r.bytes = bytes;
  std::memset(r.object->data(), kGuard, bytes + 2 * kGuardBytes);
  absl::StatusOr<v1::RegionInfo> info =
      regions.RegisterSystem(name, r.object->key(), kGuardBytes, bytes);
  if (!info.ok()) return info.status();
  EXPECT_EQ(info->kind(), "system");
  EXPECT_EQ(info->byte_size(), bytes);
  return r;
}

int64_t RoundUp(int64_t n) { return (n + 63) / 64 * 64; }

// `request` with q, k, v moved into `region` (laid out one after the other) and o (and lse)
// directed there; `o_offset` and `lse_offset` get where.
v1::AttendRequest ByReference(const v1::AttendRequest& request, const GuardedRegion& region,
                              int64_t* o_offset, int64_t* lse_offset, int64_t* used) {
  v1::AttendRequest r = request;
  int64_t at = 0;
  for (auto [from, to] : {std::pair{&request.q(), r.mutable_q()},
                          {&request.k(), r.mutable_k()},
                          {&request.v(), r.mutable_v()}}) {
    PlaceTensor(*from, region.name, at, region.data(), to);
    at += RoundUp(static_cast<int64_t>(from->data().size()));
  }
  *o_offset = at;
  // o is q's size, but bfloat16 (2 bytes an element) for float8 q.
  const int64_t o_bytes = static_cast<int64_t>(request.q().data().size()) *
                          (request.q().dtype() == v1::DTYPE_FLOAT8_E4M3 ? 2 : 1);
  *r.mutable_o_ref() = MakeRef(region.name, at, o_bytes);
  at += RoundUp(o_bytes);
  *lse_offset = at;
  if (request.return_lse()) {
    const int64_t rows = request.q().shape(0) * request.q().shape(1) * request.q().shape(2);
    *r.mutable_lse_ref() = MakeRef(region.name, at, rows * int64_t{sizeof(float)});
    at += RoundUp(rows * int64_t{sizeof(float)});
  }
  *used = at;
  return r;
}

class SharedMemoryE2E : public SharedServerTest<SharedMemoryE2E> {
 public:
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--threads=2", "--allow_shared_memory",
            "--max_shared_memory_regions=6", "--kv_page_bytes=16384"};
  }

 protected:
  SharedMemoryClient Regions() { return SharedMemoryClient(client()); }
};

TEST_F(SharedMemoryE2E, AttendWithTensorsInSharedMemoryMatchesTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  SharedMemoryClient regions = Regions();
  const std::vector<client::ProblemSpec> specs = {{.batch = 2,
                                                   .heads_q = 4,
                                                   .heads_kv = 2,
                                                   .seqlen_q = 37,
                                                   .seqlen_k = 53,
                                                   .head_dim = 32,
                                                   .dtype = v1::DTYPE_FLOAT32,
                                                   .causal = true,
                                                   .return_lse = true},
                                                  {.batch = 1,
                                                   .heads_q = 3,
                                                   .heads_kv = 1,
                                                   .seqlen_q = 70,
                                                   .seqlen_k = 19,
                                                   .head_dim = 64,
                                                   .dtype = v1::DTYPE_BFLOAT16,
                                                   .layout = v1::LAYOUT_BSHD,
                                                   .return_lse = true},
                                                  {.batch = 3,
                                                   .heads_q = 2,
                                                   .heads_kv = 2,
                                                   .seqlen_q = 1,
                                                   .seqlen_k = 129,
                                                   .head_dim = 40,
                                                   .dtype = v1::DTYPE_FLOAT16,
                                                   .window_left = 16},
                                                  {.batch = 1,
                                                   .heads_q = 4,
                                                   .heads_kv = 2,
                                                   .seqlen_q = 33,
                                                   .seqlen_k = 65,
                                                   .head_dim = 24,
                                                   .dtype = v1::DTYPE_FLOAT8_E4M3,
                                                   .causal = true,
                                                   .return_lse = true,
                                                   .q_descale = 0.6f,
                                                   .k_descale = 1.3f,
                                                   .v_descale = 0.07f}};
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "attend", 4 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  for (const client::ProblemSpec& spec : specs) {
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(spec, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    int64_t o_offset = 0, lse_offset = 0, used = 0;
    const v1::AttendRequest by_ref = ByReference(*request, *region, &o_offset, &lse_offset, &used);
    ASSERT_LE(used, region->bytes);
    std::memset(region->data() + o_offset, kPoison, used - o_offset);
    absl::StatusOr<v1::AttendResponse> response = client().Attend(by_ref);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_TRUE(response->o().data().empty()) << "o went into the region, not the response";
    EXPECT_EQ(response->o().shape_size(), request->q().shape_size());
    // The answer as if it had come inline, from the region's bytes.
    v1::AttendResponse inline_answer = *response;
    inline_answer.mutable_o()->set_data(region->data() + o_offset, by_ref.o_ref().byte_size());
    if (spec.return_lse) {
      const int64_t lse_bytes = by_ref.lse_ref().byte_size();
      EXPECT_TRUE(response->lse().data().empty());
      inline_answer.mutable_lse()->set_data(region->data() + lse_offset, lse_bytes);
    }
    ExpectCorrect(*request, inline_answer);
    EXPECT_TRUE(region->GuardsIntact());
  }
  // Inputs by reference, output inline; and inline inputs, output into the region.
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(specs[0], rng);
  ASSERT_TRUE(request.ok());
  int64_t o_offset = 0, lse_offset = 0, used = 0;
  v1::AttendRequest mixed = ByReference(*request, *region, &o_offset, &lse_offset, &used);
  mixed.clear_o_ref();
  mixed.clear_lse_ref();
  ExpectCorrect(*request, client().Attend(mixed));
  {
    // The same on one AttendStream, beside a request whose tensors all come inline.
    v1::AttendRequest by_ref_on_stream = mixed;
    by_ref_on_stream.set_request_id("by-ref");
    v1::AttendRequest inline_on_stream = *request;
    inline_on_stream.set_request_id("inline");
    absl::StatusOr<std::vector<v1::AttendResponse>> answers =
        client().AttendStream({by_ref_on_stream, inline_on_stream});
    ASSERT_TRUE(answers.ok()) << answers.status();
    ASSERT_EQ(answers->size(), 2u);
    EXPECT_NE((*answers)[0].request_id(), (*answers)[1].request_id());
    for (const v1::AttendResponse& answer : *answers) {
      EXPECT_THAT(answer.request_id(), testing::AnyOf("by-ref", "inline"));
      v1::AttendRequest expected = *request;
      expected.set_request_id(answer.request_id());
      ExpectCorrect(expected, answer);
    }
  }
  v1::AttendRequest out_only = *request;
  *out_only.mutable_o_ref() = mixed.q().ref();  // q's bytes are o's size: overwrite them
  out_only.set_return_lse(false);
  absl::StatusOr<v1::AttendResponse> response = client().Attend(out_only);
  ASSERT_TRUE(response.ok()) << response.status();
  v1::AttendResponse inline_answer = *response;
  inline_answer.mutable_o()->set_data(region->data(), request->q().data().size());
  ExpectCorrect(out_only, inline_answer);
  EXPECT_TRUE(regions.Unregister("attend").ok());
}

TEST_F(SharedMemoryE2E, StepWithTensorsInSharedMemoryEqualsTheSameStepInline) {
  std::mt19937_64 rng(FreshSeed());
  SharedMemoryClient regions = Regions();
  auto stub = v1::Sessions::NewStub(client().channel());
  const int64_t hkv = 2, hq = 4, d = 32, n = 40, nq = 2;
  absl::StatusOr<std::vector<std::string>> twins = CreateTwinSessions(*stub, 2, hkv, n, d, rng);
  ASSERT_TRUE(twins.ok()) << twins.status();
  const std::vector<std::string>& ids = *twins;
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "step", 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  const v1::Tensor q =
      client::MakeTensor(v1::DTYPE_FLOAT16, {hq, nq, d}, client::RandomNormal(hq * nq * d, rng));
  const v1::Tensor k1 =
      client::MakeTensor(v1::DTYPE_FLOAT16, {hkv, nq, d}, client::RandomNormal(hkv * nq * d, rng));
  const v1::Tensor v1t =
      client::MakeTensor(v1::DTYPE_FLOAT16, {hkv, nq, d}, client::RandomNormal(hkv * nq * d, rng));
  auto step = [&](const std::string& id, bool by_ref) {
    v1::StepRequest r;
    r.set_causal(true);
    v1::StepEntry* e = r.add_entries();
    e->set_session_id(id);
    *e->mutable_q() = q;
    *e->mutable_k() = k1;
    *e->mutable_v() = v1t;
    if (by_ref) {
      PlaceTensor(q, "step", 0, region->data(), e->mutable_q());
      PlaceTensor(k1, "step", 4096, region->data(), e->mutable_k());
      PlaceTensor(v1t, "step", 8192, region->data(), e->mutable_v());
      std::memset(region->data() + 16384, kPoison, q.data().size());
      *e->mutable_o_ref() = MakeRef("step", 16384, static_cast<int64_t>(q.data().size()));
    }
    v1::StepResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub->Step(&context, r, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  };
  const v1::StepResponse inline_answer = step(ids[0], false);
  const v1::StepResponse shm_answer = step(ids[1], true);
  ASSERT_EQ(shm_answer.results_size(), 1);
  EXPECT_TRUE(shm_answer.results(0).o().data().empty());
  EXPECT_EQ(shm_answer.results(0).length(), n + nq);
  ASSERT_EQ(inline_answer.results_size(), 1);
  EXPECT_EQ(std::string(region->data() + 16384, q.data().size()),
            inline_answer.results(0).o().data())
      << "the step by reference differs from the same step inline";
  EXPECT_TRUE(region->GuardsIntact());
  EXPECT_TRUE(regions.Unregister("step").ok());
}

TEST_F(SharedMemoryE2E, BadReferencesGetTheirCodesAndTouchNothingOutsideTheRegion) {
  std::mt19937_64 rng(FreshSeed());
  SharedMemoryClient regions = Regions();
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "bad", 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 2, .seqlen_q = 16, .seqlen_k = 16, .head_dim = 32}, rng);
  ASSERT_TRUE(request.ok());
  int64_t o_offset = 0, lse_offset = 0, used = 0;
  const v1::AttendRequest good = ByReference(*request, *region, &o_offset, &lse_offset, &used);
  std::memset(region->data() + o_offset, kPoison, region->bytes - o_offset);
  const std::string before(region->data(), region->bytes);
  const int64_t q_bytes = static_cast<int64_t>(request->q().data().size());
  struct Case {
    std::string what;
    std::function<void(v1::AttendRequest*)> change;
    absl::StatusCode code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"q past the end",
       [&](v1::AttendRequest* r) { r->mutable_q()->mutable_ref()->set_offset(region->bytes - 8); },
       absl::StatusCode::kInvalidArgument, "q.ref"},
      {"q at a negative offset",
       [&](v1::AttendRequest* r) { r->mutable_q()->mutable_ref()->set_offset(-4096); },
       absl::StatusCode::kInvalidArgument, "q.ref"},
      {"o past the end",
       [&](v1::AttendRequest* r) { r->mutable_o_ref()->set_offset(region->bytes - q_bytes + 4); },
       absl::StatusCode::kInvalidArgument, "o_ref"},
      {"o offset overflowing",
       [&](v1::AttendRequest* r) {
         r->mutable_o_ref()->set_offset(std::numeric_limits<int64_t>::max() - 2);
       },
       absl::StatusCode::kInvalidArgument, "o_ref"},
      {"k misaligned",
       [&](v1::AttendRequest* r) { r->mutable_k()->mutable_ref()->set_offset(q_bytes + 2); },
       absl::StatusCode::kInvalidArgument, "k.ref.offset"},
      {"v's size not its shape's",
       [&](v1::AttendRequest* r) { r->mutable_v()->mutable_ref()->set_byte_size(q_bytes - 4); },
       absl::StatusCode::kInvalidArgument, "v.ref.byte_size"},
      {"o's size not q's",
       [&](v1::AttendRequest* r) { r->mutable_o_ref()->set_byte_size(q_bytes * 2); },
       absl::StatusCode::kInvalidArgument, "o_ref.byte_size"},
      {"data beside a ref",
       [&](v1::AttendRequest* r) { r->mutable_q()->set_data(request->q().data()); },
       absl::StatusCode::kInvalidArgument, "q.data"},
      {"an unknown region",
       [&](v1::AttendRequest* r) { r->mutable_k()->mutable_ref()->set_region("nope"); },
       absl::StatusCode::kNotFound, "k.ref.region"},
      {"an unknown output region",
       [&](v1::AttendRequest* r) { r->mutable_o_ref()->set_region("nope"); },
       absl::StatusCode::kNotFound, "o_ref.region"},
      {"lse_ref without return_lse",
       [&](v1::AttendRequest* r) { *r->mutable_lse_ref() = MakeRef("bad", 0, 4); },
       absl::StatusCode::kInvalidArgument, "lse_ref"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::AttendRequest r = good;
    c.change(&r);
    absl::StatusOr<v1::AttendResponse> response = client().Attend(r);
    EXPECT_EQ(response.status().code(), c.code) << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.says));
    EXPECT_TRUE(region->GuardsIntact());
    EXPECT_TRUE(std::string(region->data(), region->bytes) == before) << "the region changed";
  }
  EXPECT_TRUE(regions.Unregister("bad").ok());
}

TEST_F(SharedMemoryE2E, OutputsThatOverlapAnInputOrEachOtherAreRefusedNamingBoth) {
  std::mt19937_64 rng(FreshSeed());
  SharedMemoryClient regions = Regions();
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "alias", 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest({.batch = 1,
                                                                         .heads_q = 2,
                                                                         .seqlen_q = 16,
                                                                         .seqlen_k = 16,
                                                                         .head_dim = 32,
                                                                         .return_lse = true},
                                                                        rng);
  ASSERT_TRUE(request.ok());
  int64_t o_offset = 0, lse_offset = 0, used = 0;
  const v1::AttendRequest good = ByReference(*request, *region, &o_offset, &lse_offset, &used);
  const int64_t q_bytes = static_cast<int64_t>(request->q().data().size());
  std::memset(region->data() + o_offset, kPoison, region->bytes - o_offset);
  const std::string before(region->data(), region->bytes);
  struct Case {
    std::function<void(v1::AttendRequest*)> change;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[&](v1::AttendRequest* r) { r->mutable_o_ref()->set_offset(0); },
       "o_ref: expected bytes apart from every input's, got bytes that overlap q's"},
      {[&](v1::AttendRequest* r) { r->mutable_lse_ref()->set_offset(RoundUp(q_bytes) + 64); },
       "lse_ref: expected bytes apart from every input's, got bytes that overlap k's"},
      {[&](v1::AttendRequest* r) { r->mutable_lse_ref()->set_offset(o_offset + q_bytes - 4); },
       "lse_ref: expected bytes apart from every other output's, got bytes that overlap o_ref's"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    v1::AttendRequest r = good;
    c.change(&r);
    absl::StatusOr<v1::AttendResponse> response = client().Attend(r);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.says));
    EXPECT_TRUE(std::string(region->data(), region->bytes) == before) << "the region changed";
  }
  // A Step of two entries, all by reference: entry i's q at 8192 i, k, v after it, o at 8192 i +
  // 6144; an entry's o on another entry's q, or on another entry's o, is refused before any row is
  // appended.
  auto stub = v1::Sessions::NewStub(client().channel());
  const int64_t hkv = 2, hq = 4, d = 32, n = 8, nq = 2;
  absl::StatusOr<std::vector<std::string>> ids = CreateTwinSessions(*stub, 2, hkv, n, d, rng);
  ASSERT_TRUE(ids.ok()) << ids.status();
  v1::StepRequest step;
  for (int i = 0; i < 2; ++i) {
    v1::StepEntry* e = step.add_entries();
    e->set_session_id((*ids)[i]);
    PlaceTensor(
        client::MakeTensor(v1::DTYPE_FLOAT16, {hq, nq, d}, client::RandomNormal(hq * nq * d, rng)),
        "alias", 8192 * i, region->data(), e->mutable_q());
    for (auto [at, t] : {std::pair{2048, e->mutable_k()}, {4096, e->mutable_v()}}) {
      PlaceTensor(client::MakeTensor(v1::DTYPE_FLOAT16, {hkv, nq, d},
                                     client::RandomNormal(hkv * nq * d, rng)),
                  "alias", 8192 * i + at, region->data(), t);
    }
    *e->mutable_o_ref() = MakeRef("alias", 8192 * i + 6144, hq * nq * d * 2);
  }
  const std::string step_before(region->data(), region->bytes);
  auto refused = [&](const v1::StepRequest& r) {
    v1::StepResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub->Step(&context, r, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(std::string(region->data(), region->bytes) == step_before) << "the region changed";
    return status.error_message();
  };
  v1::StepRequest on_q = step;
  on_q.mutable_entries(1)->mutable_o_ref()->set_offset(0);
  EXPECT_THAT(refused(on_q), HasSubstr("entries[1].o_ref: expected bytes apart from every input's, "
                                       "got bytes that overlap entries[0].q's"));
  v1::StepRequest on_o = step;
  on_o.mutable_entries(0)->mutable_o_ref()->set_offset(8192 + 6144 + 64);
  EXPECT_THAT(refused(on_o), HasSubstr("entries[1].o_ref: expected bytes apart from every other "
                                       "output's, got bytes that overlap entries[0].o_ref's"));
  // Refused steps appended nothing: the good one answers at n + nq rows.
  v1::StepResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub->Step(&context, step, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.results_size(), 2);
  EXPECT_EQ(response.results(0).length(), n + nq);
  EXPECT_TRUE(region->GuardsIntact());
  EXPECT_TRUE(regions.Unregister("alias").ok());
}

TEST_F(SharedMemoryE2E, RegistrationsAreCheckedAndLimited) {
  SharedMemoryClient regions = Regions();
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("reg"), 65536);
  ASSERT_TRUE(object.ok()) << object.status();
  const std::string key = (*object)->key();
  struct Case {
    std::string what, name, key;
    int64_t offset, size;
    absl::StatusCode code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"a file path", "a", "/dev/shm" + key, 0, 16, absl::StatusCode::kInvalidArgument,
       "system_key"},
      {"a relative path", "a", "../../etc/passwd", 0, 16, absl::StatusCode::kInvalidArgument,
       "system_key"},
      {"dot-dot", "a", "/..", 0, 16, absl::StatusCode::kInvalidArgument, "system_key"},
      {"no such object", "a", key + "-missing", 0, 16, absl::StatusCode::kNotFound, "system_key"},
      {"past the object's end", "a", key, 65536 - 8, 16, absl::StatusCode::kInvalidArgument,
       "byte_size"},
      // Far past it: the object's size is checked before --max_shared_memory_bytes.
      {"far past the object's end", "a", key, 8, std::numeric_limits<int64_t>::max() - 8,
       absl::StatusCode::kInvalidArgument,
       "byte_size: expected offset + byte_size <= the object's 65536 bytes, got 8 + "},
      {"a negative offset", "a", key, -1, 16, absl::StatusCode::kInvalidArgument, "offset"},
      {"no bytes", "a", key, 0, 0, absl::StatusCode::kInvalidArgument, "byte_size"},
      {"no name", "", key, 0, 16, absl::StatusCode::kInvalidArgument, "name"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<v1::RegionInfo> info = regions.RegisterSystem(c.name, c.key, c.offset, c.size);
    EXPECT_EQ(info.status().code(), c.code) << info.status();
    EXPECT_THAT(std::string(info.status().message()), HasSubstr(c.says));
  }
  // The same name twice; then the caller's limit (--max_shared_memory_regions=6).
  ASSERT_TRUE(regions.RegisterSystem("r0", key, 0, 4096).ok());
  EXPECT_EQ(regions.RegisterSystem("r0", key, 0, 4096).status().code(),
            absl::StatusCode::kAlreadyExists);
  int registered = 1;
  absl::Status last;
  for (int i = 1; i < 10 && last.ok(); ++i) {
    last = regions.RegisterSystem(absl::StrCat("r", i), key, 4096 * i, 4096).status();
    if (last.ok()) ++registered;
  }
  EXPECT_EQ(registered, 6);
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  absl::StatusOr<v1::ListRegionsResponse> list = regions.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->regions_size(), 6);
  for (int i = 0; i < registered; ++i) {
    EXPECT_TRUE(regions.Unregister(absl::StrCat("r", i)).ok());
  }
  EXPECT_EQ(regions.Unregister("r0").code(), absl::StatusCode::kNotFound);
}

TEST_F(SharedMemoryE2E, AnotherCallersRegionIsNotFound) {
  std::mt19937_64 rng(FreshSeed());
  SharedMemoryClient regions = Regions();
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "mine", 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  // Another connection: another caller (no tokens on this server).
  std::unique_ptr<client::Client> other_client = ClientOnItsOwnConnection(process().target());
  client::Client& other = *other_client;
  SharedMemoryClient other_regions(other);
  absl::StatusOr<v1::ListRegionsResponse> list = other_regions.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->regions_size(), 0);
  EXPECT_EQ(other_regions.Unregister("mine").code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 2, .seqlen_q = 8, .seqlen_k = 8, .head_dim = 16}, rng);
  ASSERT_TRUE(request.ok());
  int64_t o_offset = 0, lse_offset = 0, used = 0;
  const v1::AttendRequest by_ref = ByReference(*request, *region, &o_offset, &lse_offset, &used);
  std::memset(region->data() + o_offset, kPoison, 64);
  absl::StatusOr<v1::AttendResponse> response = other.Attend(by_ref);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kNotFound) << response.status();
  EXPECT_EQ(static_cast<unsigned char>(region->data()[o_offset]), kPoison);
  // The owner's call works.
  EXPECT_TRUE(client().Attend(by_ref).ok());
  EXPECT_TRUE(regions.Unregister("mine").ok());
}

TEST_F(SharedMemoryE2E, UnregisterWaitsForTheRequestUsingTheRegion) {
  std::mt19937_64 rng(FreshSeed());
  SharedMemoryClient regions = Regions();
  absl::StatusOr<Blocker> blocker = CalibratedBlocker(client(), absl::Milliseconds(1500), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  // A GPU computes the largest blocker in milliseconds: nothing runs long enough to wait for.
  if (const std::string why = WhyTooFast(*blocker, absl::Milliseconds(500)); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const int64_t q_bytes = static_cast<int64_t>(blocker->request.q().data().size());
  absl::StatusOr<GuardedRegion> region = MakeRegion(regions, "busy", 2 * q_bytes);
  ASSERT_TRUE(region.ok()) << region.status();
  v1::AttendRequest r = blocker->request;
  PlaceTensor(blocker->request.q(), "busy", 0, region->data(), r.mutable_q());
  *r.mutable_o_ref() = MakeRef("busy", q_bytes, q_bytes);
  std::future<absl::StatusOr<v1::AttendResponse>> running = client().AttendAsync(r);
  ASSERT_TRUE(WaitUntilRunning(process().metrics_port()));
  // Held by the running request: a short deadline passes, and the region stays.
  const absl::Status early = regions.Unregister("busy", {.deadline = absl::Milliseconds(200)});
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  absl::StatusOr<v1::ListRegionsResponse> list = regions.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->regions_size(), 1);
  // Waits until the request is done with it.
  EXPECT_TRUE(regions.Unregister("busy").ok());
  EXPECT_EQ(running.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  absl::StatusOr<v1::AttendResponse> response = running.get();
  EXPECT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(region->GuardsIntact());
}

TEST_F(SharedMemoryE2E, AnotherUsersObjectIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "giving an object to another user needs root";
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("foreign"), 4096);
  ASSERT_TRUE(object.ok()) << object.status();
  const int fd = shm_open((*object)->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchown(fd, 65534, 65534), 0);  // now nobody's, which the server (root) can still open
  close(fd);
  absl::StatusOr<v1::RegionInfo> info =
      Regions().RegisterSystem("foreign", (*object)->key(), 0, 64);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kPermissionDenied) << info.status();
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("belongs to uid 65534"));
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("--allow_foreign_regions"));
}

// Links in /proc/PID/fd of the process `pid` to the shared-memory object `key`.
int OpenFdsOf(pid_t pid, const std::string& key) {
  int n = 0;
  const std::string target = "/dev/shm" + key;
  for (const std::filesystem::directory_entry& entry :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
    std::error_code error;
    if (std::filesystem::read_symlink(entry.path(), error).string() == target) ++n;
  }
  return n;
}

// Waits up to 10 s for the server `pid` to hold no fd of the object `key`; how long it took.
absl::Duration AwaitFdsClosed(pid_t pid, const std::string& key) {
  const absl::Time start = absl::Now();
  while (OpenFdsOf(pid, key) > 0 && absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::Now() - start;
}

// A client without a token that registers regions and goes away without unregistering them: gRPC
// does not tell the server that its connection closed, but the server sees it among its open
// connections no more and releases the regions (fds closed, bytes unmapped), long before
// --region_idle_timeout_s, so such clients cannot hold --max_shared_memory_bytes, and a later
// connection on the same address and port finds nothing of theirs.
TEST(SharedMemoryLifetimeE2E, TheRegionsOfAClientWithoutATokenGoWithItsConnection) {
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--allow_shared_memory", "--max_shared_memory_bytes=8192"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("gone"), 8192);
  ASSERT_TRUE(object.ok()) << object.status();
  const std::string key = (*object)->key();
  const pid_t pid = server->process->pid();
  std::unique_ptr<client::Client> short_lived = ClientOnItsOwnConnection(server->process->target());
  ASSERT_TRUE(SharedMemoryClient(*short_lived).RegisterSystem("a", key, 0, 4096).ok());
  ASSERT_TRUE(SharedMemoryClient(*short_lived).RegisterSystem("b", key, 4096, 4096).ok());
  EXPECT_EQ(OpenFdsOf(pid, key), 2);
  // Every byte is held: another client is refused for now.
  SharedMemoryClient regions(*server->client);
  const absl::Status full = regions.RegisterSystem("c", key, 0, 4096).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  short_lived.reset();  // gone without unregistering: its connection closes
  const absl::Duration released_after = AwaitFdsClosed(pid, key);
  EXPECT_EQ(OpenFdsOf(pid, key), 0) << "the gone client's regions were not released";
  EXPECT_LT(released_after, absl::Seconds(5));  // about a second, the default idle time is 300 s
  EXPECT_TRUE(regions.RegisterSystem("c", key, 0, 8192).ok());
  EXPECT_TRUE(regions.Unregister("c").ok());
  EXPECT_TRUE(server->Stop().ok());
}

// A connected client's region that no request uses for --region_idle_timeout_s is released.
TEST(SharedMemoryLifetimeE2E, AnIdleRegionOfAClientWithoutATokenIsReleased) {
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--allow_shared_memory", "--region_idle_timeout_s=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("idle"), 4096);
  ASSERT_TRUE(object.ok()) << object.status();
  SharedMemoryClient regions(*server->client);
  ASSERT_TRUE(regions.RegisterSystem("idle", (*object)->key(), 0, 4096).ok());
  const absl::Duration released_after = AwaitFdsClosed(server->process->pid(), (*object)->key());
  EXPECT_GE(released_after, absl::Milliseconds(900));
  EXPECT_LT(released_after, absl::Seconds(5));
  absl::StatusOr<v1::ListRegionsResponse> list = regions.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->regions_size(), 0);
  EXPECT_EQ(regions.Unregister("idle").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(server->Stop().ok());
}

TEST(SharedMemoryOffE2E, WithoutTheFlagEverythingIsFailedPrecondition) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu", "--threads=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  SharedMemoryClient regions(*server->client);
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("off"), 65536);
  ASSERT_TRUE(object.ok());
  EXPECT_EQ(regions.Register("x", **object).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(regions.List().status().code(), absl::StatusCode::kFailedPrecondition);
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 1, .seqlen_q = 4, .seqlen_k = 4, .head_dim = 8}, rng);
  ASSERT_TRUE(request.ok());
  v1::AttendRequest r = *request;
  PlaceTensor(request->q(), "x", 0, (*object)->data(), r.mutable_q());
  absl::StatusOr<v1::AttendResponse> response = server->client->Attend(r);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(response.status().message()), HasSubstr("--allow_shared_memory"));
  EXPECT_TRUE(server->Stop().ok());
}

// As a misbehaving client may: shrinks `object` to `bytes` (this process must not touch its own
// mapping past them from then on).
void Truncate(const SharedMemoryObject& object, int64_t bytes) {
  const int fd = shm_open(object.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, bytes), 0);
  close(fd);
}

// Each on a server of its own: without the guard, the server dies of SIGBUS here.
std::vector<std::string> ShrinkServerFlags() {
  return {"--backend=cpu", "--threads=2", "--allow_shared_memory", "--kv_page_bytes=16384"};
}

TEST(SharedMemoryShrinkE2E, AnObjectShrunkBeforeARequestIsRefusedAndTheServerServesOn) {
  absl::StatusOr<RunningServer> server = StartServer(ShrinkServerFlags());
  ASSERT_TRUE(server.ok()) << server.status();
  SharedMemoryClient regions(*server->client);
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 2, .seqlen_q = 64, .seqlen_k = 64, .head_dim = 32}, rng);
  ASSERT_TRUE(request.ok());
  const int64_t bytes = static_cast<int64_t>(request->q().data().size());  // 16 KiB each
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("shrunk"), 4 * bytes);
  ASSERT_TRUE(object.ok()) << object.status();
  ASSERT_TRUE(regions.Register("shrunk", **object).ok());
  v1::AttendRequest r = *request;
  PlaceTensor(request->q(), "shrunk", 0, (*object)->data(), r.mutable_q());
  PlaceTensor(request->k(), "shrunk", bytes, (*object)->data(), r.mutable_k());
  PlaceTensor(request->v(), "shrunk", 2 * bytes, (*object)->data(), r.mutable_v());
  *r.mutable_o_ref() = MakeRef("shrunk", 3 * bytes, bytes);
  ASSERT_TRUE(server->client->Attend(r).ok());
  Truncate(**object, bytes);  // q's bytes stay; k, v and o are gone
  absl::StatusOr<v1::AttendResponse> response = server->client->Attend(r);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition) << response.status();
  const std::string message(response.status().message());
  EXPECT_THAT(message, HasSubstr("ref: region 'shrunk' was registered as bytes [0, "));
  EXPECT_THAT(message, HasSubstr(absl::StrCat("(", 4 * bytes, " bytes)")));
  EXPECT_THAT(message, HasSubstr(absl::StrCat("holds ", bytes, " bytes now")));
  // Alive and serving; the region is refused until registered again, by the Sessions calls too.
  EXPECT_TRUE(server->client->Attend(*request).ok());
  EXPECT_EQ(server->client->Attend(r).status().code(), absl::StatusCode::kFailedPrecondition);
  v1::CreateSessionRequest create;
  create.set_dtype(v1::DTYPE_FLOAT32);
  create.set_kv_heads(2);
  create.set_head_dim(32);
  const v1::Tensor rows =
      client::MakeTensor(v1::DTYPE_FLOAT32, {2, 8, 32}, client::RandomNormal(2 * 8 * 32, rng));
  PlaceTensor(rows, "shrunk", 0, (*object)->data(), create.mutable_k());  // inside `bytes`
  PlaceTensor(rows, "shrunk", 0, (*object)->data(), create.mutable_v());
  v1::SessionInfo info;
  grpc::ClientContext context;
  const grpc::Status created =
      v1::Sessions::NewStub(server->client->channel())->CreateSession(&context, create, &info);
  EXPECT_EQ(created.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(created.error_message(), HasSubstr("k.ref: region 'shrunk'"));
  EXPECT_TRUE(regions.Unregister("shrunk").ok());
  EXPECT_TRUE(regions.RegisterSystem("shrunk", (*object)->key(), 0, bytes).ok());
  EXPECT_TRUE(regions.Unregister("shrunk").ok());
  EXPECT_EQ(server->Stop(), absl::OkStatus());  // not killed (SIGBUS: code 135)
}

TEST(SharedMemoryShrinkE2E, AnObjectShrunkDuringARequestFailsItAndTheServerServesOn) {
  absl::StatusOr<RunningServer> server = StartServer(ShrinkServerFlags());
  ASSERT_TRUE(server.ok()) << server.status();
  SharedMemoryClient regions(*server->client);
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<Blocker> blocker =
      CalibratedBlocker(*server->client, absl::Milliseconds(1500), rng);
  ASSERT_TRUE(blocker.ok()) << blocker.status();
  if (const std::string why = WhyTooFast(*blocker, absl::Milliseconds(500)); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const v1::AttendRequest& inline_request = blocker->request;
  const int64_t bytes = static_cast<int64_t>(inline_request.q().data().size());
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey("shrinking"), 4 * bytes);
  ASSERT_TRUE(object.ok()) << object.status();
  ASSERT_TRUE(regions.Register("shrinking", **object).ok());
  v1::AttendRequest r = inline_request;
  PlaceTensor(inline_request.q(), "shrinking", 0, (*object)->data(), r.mutable_q());
  PlaceTensor(inline_request.k(), "shrinking", bytes, (*object)->data(), r.mutable_k());
  PlaceTensor(inline_request.v(), "shrinking", 2 * bytes, (*object)->data(), r.mutable_v());
  *r.mutable_o_ref() = MakeRef("shrinking", 3 * bytes, bytes);
  std::future<absl::StatusOr<v1::AttendResponse>> running = server->client->AttendAsync(r);
  ASSERT_TRUE(WaitUntilRunning(server->process->metrics_port()));
  absl::SleepFor(absl::Milliseconds(100));
  // The kernel reads k and v and writes o there as it runs: its next access past the end faults.
  Truncate(**object, 4096);
  ASSERT_EQ(running.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  absl::StatusOr<v1::AttendResponse> response = running.get();
  EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition) << response.status();
  EXPECT_THAT(std::string(response.status().message()), HasSubstr("region 'shrinking'"));
  // The CPU kernel's next access faulted (repaired by the guard). Against another backend
  // (ATTENTION_E2E_EXTRA_FLAGS=--backend=cuda) a pinned region is copied by DMA, which does not
  // fault: the object's size, checked at the answer, fails the request there.
  if (const char* extra = std::getenv("ATTENTION_E2E_EXTRA_FLAGS");
      extra == nullptr || !absl::StrContains(extra, "--backend=cuda")) {
    EXPECT_THAT(std::string(response.status().message()), HasSubstr("faulted"));
  }
  // Alive and serving; the region is refused, and unregisters.
  absl::StatusOr<v1::AttendRequest> small = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 1, .seqlen_q = 8, .seqlen_k = 8, .head_dim = 16}, rng);
  ASSERT_TRUE(small.ok());
  EXPECT_TRUE(server->client->Attend(*small).ok());
  absl::StatusOr<v1::AttendResponse> again = server->client->Attend(r);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_TRUE(regions.Unregister("shrinking").ok());
  EXPECT_EQ(server->Stop(), absl::OkStatus());  // not killed (SIGBUS: code 135)
}

}  // namespace
}  // namespace attention::e2e
