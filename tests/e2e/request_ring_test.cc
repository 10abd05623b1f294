// End to end request rings (attention.v1.SharedMemory.OpenRing) against the real server on the
// CPU backend. The ring here is driven by hand through its layout (proto/attention/v1/
// request_ring.h), as a client that may misbehave: Attend requests sent at once are answered and
// match the float64 reference; Steps that append to one session, posted at once, equal the same
// Steps sent one by one as unary calls; a ring whose counters run ahead, whose slot lengths lie,
// or whose response does not fit ends with its documented code and the server serves on; a failed
// request ends the ring naming it; OpenRing's fields, the caller's regions and the ring limit are
// checked; Unregister waits for a ring; a cancelled call, a shrunk object and a server without
// --allow_shared_memory end or refuse the ring. A client that stops taking answers neither makes
// the server spin nor holds its exit on SIGTERM, and loses its ring after --ring_stall_timeout_s.
#include "client/request_ring.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/request_builder.h"
#include "client/shared_memory.h"
#include "client/tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/attention/v1/request_ring.h"
#include "tests/e2e/e2e_test_util.h"
#include "tests/e2e/metrics_scrape.h"

namespace attention::e2e {
namespace {

using client::SharedMemoryClient;
using client::SharedMemoryObject;
using ::testing::HasSubstr;

constexpr int kSlots = 4;
constexpr int64_t kSlotBytes = 64 << 10;

std::string FreshKey(absl::string_view what) {
  static int counter = 0;
  return absl::StrCat("/attn-e2e-ring-", getpid(), "-", what, "-", ++counter);
}

// A ring in a shared-memory object of its own, registered as `name`, and its OpenRing call.
struct RawRing {
  std::unique_ptr<SharedMemoryObject> object;
  ring::RingHeader* header = nullptr;
  int slots = kSlots;
  int64_t slot_bytes = kSlotBytes;
  grpc::ClientContext context;
  v1::OpenRingRequest request;
  v1::RingClosed closed;
  std::promise<grpc::Status> done;
  std::future<grpc::Status> ended = done.get_future();
  uint64_t posted = 0;
  uint64_t taken = 0;

  // A test that stopped early leaves no call running into a freed context.
  ~RawRing() {
    if (ended.valid() && ended.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      context.TryCancel();
      ended.wait();
    }
  }

  // Writes `bytes` into the next request slot as a message of `length` bytes (the two differ only
  // where a test lies) and publishes it.
  void PostBytes(const std::string& bytes, uint64_t length) {
    char* slot = ring::RequestSlot(object->data(), slots, slot_bytes, posted);
    std::memcpy(slot, &length, sizeof(length));
    std::memcpy(slot + ring::kLengthBytes, bytes.data(), bytes.size());
    header->requests_posted.store(++posted);
    ring::Notify(&header->server_waiting, &header->server_bell);
  }
  void Post(const google::protobuf::MessageLite& message) {
    const std::string bytes = message.SerializeAsString();
    PostBytes(bytes, bytes.size());
  }
  // Parses the next response into `response`; false once the server closed the ring with none
  // left (or after `timeout`), or when the response does not parse.
  bool Take(google::protobuf::MessageLite* response, absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time give_up = absl::Now() + timeout;
    while (header->responses_posted.load() == taken) {
      if (header->server_closed.load() != 0 || absl::Now() > give_up) return false;
      absl::SleepFor(absl::Microseconds(50));
    }
    const char* slot = ring::ResponseSlot(object->data(), slots, slot_bytes, taken);
    uint64_t length = 0;
    std::memcpy(&length, slot, sizeof(length));
    EXPECT_LE(length, static_cast<uint64_t>(slot_bytes - ring::kLengthBytes));
    const bool parsed =
        response->ParseFromArray(slot + ring::kLengthBytes, static_cast<int>(length));
    header->responses_taken.store(++taken);
    ring::Notify(&header->server_waiting, &header->server_bell);
    return parsed;
  }
  void Close() {
    header->client_closed.store(1);
    ring::RingBell(&header->server_bell);
  }
  // The call's status, once the ring ended.
  grpc::Status Ended(std::chrono::seconds within = std::chrono::seconds(30)) {
    if (ended.wait_for(within) != std::future_status::ready) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the ring did not end");
    }
    return ended.get();
  }
};

// A zeroed ring object of `bytes` (default: what the geometry needs), registered as `name` on
// `client`'s connection, then OpenRing with `request` (its region, slots and slot_bytes filled in
// from the ring unless set).
std::unique_ptr<RawRing> OpenRing(client::Client& client, const std::string& name,
                                  v1::RingMethod method, v1::OpenRingRequest request = {},
                                  int64_t bytes = 0) {
  auto r = std::make_unique<RawRing>();
  if (request.slots() == 0) request.set_slots(kSlots);
  if (request.slot_bytes() == 0) request.set_slot_bytes(kSlotBytes);
  if (request.region().empty()) request.set_region(name);
  request.set_method(method);
  r->slots = request.slots();
  r->slot_bytes = request.slot_bytes();
  if (bytes == 0)
    bytes = ring::RingBytes(std::max(r->slots, 1), std::max<int64_t>(r->slot_bytes, 64));
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object =
      SharedMemoryObject::Create(FreshKey(name), bytes);
  EXPECT_TRUE(object.ok()) << object.status();
  if (!object.ok()) return nullptr;
  r->object = *std::move(object);
  std::memset(r->object->data(), 0, bytes);
  r->header = reinterpret_cast<ring::RingHeader*>(r->object->data());
  absl::StatusOr<v1::RegionInfo> info = SharedMemoryClient(client).Register(name, *r->object);
  EXPECT_TRUE(info.ok()) << info.status();
  r->request = request;
  v1::SharedMemory::NewStub(client.channel())
      ->async()
      ->OpenRing(&r->context, &r->request, &r->closed,
                 [ring = r.get()](grpc::Status status) { ring->done.set_value(status); });
  // Served, or refused: a test that unregisters the region must not overtake the call.
  while (r->header->server_open.load() == 0 &&
         r->ended.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) {
  }
  return r;
}

// CPU seconds (user + system) the process `pid` has used, from /proc/PID/stat; -1 when unreadable.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command (in parentheses, which may hold spaces): state is field 3, utime 14,
  // stime 15.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  if (fields.size() < 13) return -1;
  return (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
}

// Fills a ring with requests and never takes an answer: `slots` answers fill the response slots
// and the next one waits for a free slot that never comes. The server neither spins on it nor
// lets it hold SIGTERM's exit.
void FillAndNeverRead(RawRing& ring, std::mt19937_64& rng) {
  for (int i = 0; i < 2 * kSlots; ++i) {
    while (ring.posted - ring.header->requests_taken.load() == static_cast<uint64_t>(kSlots) &&
           ring.header->server_closed.load() == 0) {
      absl::SleepFor(absl::Microseconds(100));
    }
    absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
        {.batch = 1, .heads_q = 2, .seqlen_q = 5, .seqlen_k = 9, .head_dim = 16}, rng);
    ASSERT_TRUE(request.ok());
    request->set_request_id(absl::StrCat("unread", i));
    ring.Post(*request);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (ring.header->responses_posted.load() < static_cast<uint64_t>(kSlots) &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(ring.header->responses_posted.load(), static_cast<uint64_t>(kSlots));
}

class RequestRingE2E : public SharedServerTest<RequestRingE2E> {
 public:
  static std::vector<std::string> ServerFlags() {
    return {"--backend=cpu", "--threads=2", "--allow_shared_memory", "--kv_page_bytes=16384",
            "--max_rings=2"};
  }

 protected:
  void TearDown() override {
    // Unregisters what the test registered (its rings' regions among them, once their rings
    // ended), so the next test starts with none.
    absl::StatusOr<v1::ListRegionsResponse> list = SharedMemoryClient(client()).List();
    ASSERT_TRUE(list.ok());
    for (const v1::RegionInfo& region : list->regions()) {
      EXPECT_TRUE(SharedMemoryClient(client()).Unregister(region.name()).ok()) << region.name();
    }
  }
};

TEST_F(RequestRingE2E, AttendRequestsPostedAtOnceAreAnsweredAndMatchTheReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<RawRing> ring = OpenRing(client(), "attend", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  const int metrics_port = process().metrics_port();
  EXPECT_EQ(WaitForMetric(metrics_port, "attention_request_rings", {},
                          [](double rings) { return rings == 1; }),
            1);
  // More requests than slots: the ring is reused, and its last requests wait for free slots.
  std::map<std::string, v1::AttendRequest> sent;
  const std::vector<client::ProblemSpec> specs = {
      {.batch = 1, .heads_q = 4, .heads_kv = 2, .seqlen_q = 7, .seqlen_k = 33, .head_dim = 16},
      {.batch = 2, .heads_q = 2, .seqlen_q = 1, .seqlen_k = 65, .head_dim = 32, .causal = true},
      {.batch = 1,
       .heads_q = 1,
       .seqlen_q = 17,
       .seqlen_k = 17,
       .head_dim = 64,
       .return_lse = true}};
  int answered = 0;
  for (int i = 0; i < 3 * kSlots; ++i) {
    absl::StatusOr<v1::AttendRequest> request =
        client::MakeRandomRequest(specs[i % specs.size()], rng);
    ASSERT_TRUE(request.ok()) << request.status();
    request->set_request_id(absl::StrCat("r", i));
    sent[request->request_id()] = *request;
    if (ring->posted - ring->taken == static_cast<uint64_t>(kSlots)) {
      v1::AttendResponse response;
      ASSERT_TRUE(ring->Take(&response));
      ExpectCorrect(sent.at(response.request_id()), response);
      ++answered;
    }
    while (ring->posted - ring->header->requests_taken.load() == static_cast<uint64_t>(kSlots)) {
      absl::SleepFor(absl::Microseconds(50));
    }
    ring->Post(*request);
  }
  while (answered < 3 * kSlots) {
    v1::AttendResponse response;
    ASSERT_TRUE(ring->Take(&response)) << "answered " << answered;
    ExpectCorrect(sent.at(response.request_id()), response);
    ++answered;
  }
  ring->Close();
  const grpc::Status status = ring->Ended();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(ring->closed.requests(), 3 * kSlots);
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
  EXPECT_EQ(WaitForMetric(metrics_port, "attention_request_rings", {},
                          [](double rings) { return rings == 0; }),
            0);
  // The ring's requests count as AttendStream's.
  absl::StatusOr<double> counted =
      ScrapeMetric(metrics_port, "attention_requests_total", {{"rpc", "AttendStream"}});
  ASSERT_TRUE(counted.ok()) << counted.status();
  EXPECT_GE(*counted, 3 * kSlots);
}

TEST_F(RequestRingE2E, StepsPostedAtOnceEqualTheSameStepsSentOneByOne) {
  std::mt19937_64 rng(FreshSeed());
  auto stub = v1::Sessions::NewStub(client().channel());
  const int64_t hkv = 2, hq = 4, d = 32, n = 40;
  absl::StatusOr<std::vector<std::string>> twins = CreateTwinSessions(*stub, 2, hkv, n, d, rng);
  ASSERT_TRUE(twins.ok()) << twins.status();
  const std::vector<std::string>& ids = *twins;
  // Each Step appends a row to the session and attends over it: posted at once, the ring must
  // queue them in the order sent for their answers to equal the one-by-one Steps'.
  const std::vector<v1::StepRequest> steps = RandomDecodeSteps(kSlots, hq, hkv, d, rng);
  std::unique_ptr<RawRing> ring = OpenRing(client(), "steps", v1::RING_METHOD_STEP);
  ASSERT_NE(ring, nullptr);
  for (v1::StepRequest r : steps) {
    r.mutable_entries(0)->set_session_id(ids[0]);
    ring->Post(r);
  }
  std::map<std::string, v1::StepResponse> on_ring;
  for (int i = 0; i < kSlots; ++i) {
    v1::StepResponse response;
    ASSERT_TRUE(ring->Take(&response)) << i;
    on_ring[response.request_id()] = response;
  }
  for (int i = 0; i < kSlots; ++i) {
    v1::StepRequest r = steps[i];
    r.mutable_entries(0)->set_session_id(ids[1]);
    v1::StepResponse one_by_one;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Step(&context, r, &one_by_one).ok());
    const v1::StepResponse& answer = on_ring.at(r.request_id());
    ASSERT_EQ(answer.results_size(), 1);
    EXPECT_EQ(answer.results(0).length(), n + i + 1);
    EXPECT_EQ(answer.results(0).o().data(), one_by_one.results(0).o().data()) << r.request_id();
  }
  ring->Close();
  EXPECT_TRUE(ring->Ended().ok());
}

TEST_F(RequestRingE2E, TheClientLibrarysRingCarriesRequestsByReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  absl::StatusOr<std::unique_ptr<client::RequestRing>> ring = client::RequestRing::Open(
      client(), v1::RING_METHOD_ATTEND, {.slots = 2, .slot_bytes = 64 << 10, .region = "lib"});
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> tensors =
      SharedMemoryObject::Create(FreshKey("tensors"), 1 << 20);
  ASSERT_TRUE(tensors.ok());
  ASSERT_TRUE(SharedMemoryClient(client()).Register("tensors", **tensors).ok());
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<v1::AttendRequest> request =
        client::MakeRandomRequest({.batch = 1,
                                   .heads_q = 4,
                                   .heads_kv = 2,
                                   .seqlen_q = 9,
                                   .seqlen_k = 70,
                                   .head_dim = 32,
                                   .dtype = v1::DTYPE_BFLOAT16,
                                   .causal = i % 2 == 1},
                                  rng);
    ASSERT_TRUE(request.ok());
    request->set_request_id(absl::StrCat("lib", i));
    v1::AttendRequest by_ref = *request;
    int64_t at = 0;
    for (auto [from, to] : {std::pair{&request->q(), by_ref.mutable_q()},
                            {&request->k(), by_ref.mutable_k()},
                            {&request->v(), by_ref.mutable_v()}}) {
      client::PlaceTensor(*from, "tensors", at, (*tensors)->data(), to);
      at += (static_cast<int64_t>(from->data().size()) + 63) / 64 * 64;
    }
    v1::AttendResponse response;
    ASSERT_TRUE((*ring)->Write(by_ref) && (*ring)->Read(&response))
        << (*ring)->Finish().error_message();
    ExpectCorrect(*request, response);
  }
  const grpc::Status status = (*ring)->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  // --max_rings=2: this ring's call is over, so two more may open; the next is refused by Open.
  absl::StatusOr<std::unique_ptr<client::RequestRing>> second =
      client::RequestRing::Open(client(), v1::RING_METHOD_STEP, {.region = "second"});
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<std::unique_ptr<client::RequestRing>> third =
      client::RequestRing::Open(client(), v1::RING_METHOD_STEP, {.region = "third"});
  ASSERT_TRUE(third.ok()) << third.status();
  absl::StatusOr<std::unique_ptr<client::RequestRing>> fourth =
      client::RequestRing::Open(client(), v1::RING_METHOD_STEP, {.region = "fourth"});
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
  EXPECT_THAT(std::string(fourth.status().message()), HasSubstr("OpenRing: "));
}

TEST_F(RequestRingE2E, AFailedRequestEndsTheRingNamingIt) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "lost", v1::RING_METHOD_STEP);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  v1::StepRequest r;
  r.set_request_id("to-nowhere");
  v1::StepEntry* e = r.add_entries();
  e->set_session_id("no-such-session");
  *e->mutable_q() =
      client::MakeTensor(v1::DTYPE_FLOAT16, {2, 1, 16}, client::RandomNormal(2 * 16, rng));
  ring->Post(r);
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("to-nowhere"));
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
}

TEST_F(RequestRingE2E, ACounterRunningAheadEndsTheRing) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "ahead", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  ring->header->requests_posted.store(kSlots + 3);
  ring::RingBell(&ring->header->server_bell);
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("ring requests_posted: expected 0 to 4"));
}

TEST_F(RequestRingE2E, ALengthBeyondItsSlotEndsTheRing) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "long", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  ring->PostBytes("", uint64_t{1} << 40);
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("length expected at most 65528"));
}

TEST_F(RequestRingE2E, AResponseLargerThanASlotEndsTheRing) {
  std::mt19937_64 rng(FreshSeed());
  v1::OpenRingRequest small;
  small.set_slot_bytes(ring::kMinSlotBytes);
  // q, k and v by reference behind the ring, in the same region; o (16 KiB) comes inline.
  const int64_t tensors_at = ring::RingBytes(kSlots, ring::kMinSlotBytes);
  std::unique_ptr<RawRing> ring =
      OpenRing(client(), "small", v1::RING_METHOD_ATTEND, small, tensors_at + (64 << 10));
  ASSERT_NE(ring, nullptr);
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 1, .seqlen_q = 64, .seqlen_k = 2, .head_dim = 64}, rng);
  ASSERT_TRUE(request.ok());
  v1::AttendRequest by_ref = *request;
  int64_t at = tensors_at;
  for (auto [from, to] : {std::pair{&request->q(), by_ref.mutable_q()},
                          {&request->k(), by_ref.mutable_k()},
                          {&request->v(), by_ref.mutable_v()}}) {
    client::PlaceTensor(*from, "small", at, ring->object->data(), to);
    at += static_cast<int64_t>(from->data().size());
  }
  ring->Post(by_ref);
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("larger slots"));
}

TEST_F(RequestRingE2E, OpenRingChecksItsFieldsTheRegionAndTheLimit) {
  auto refused = [&](v1::OpenRingRequest request, int64_t bytes = 0,
                     v1::RingMethod method = v1::RING_METHOD_ATTEND) {
    std::unique_ptr<RawRing> ring = OpenRing(client(), "checked", method, request, bytes);
    grpc::Status status = ring->Ended();
    EXPECT_TRUE(SharedMemoryClient(client()).Unregister("checked").ok());
    return status;
  };
  v1::OpenRingRequest r;
  r.set_slots(65);
  grpc::Status status = refused(r);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("slots: expected 1 to 64, got 65"));
  r = {};
  r.set_slot_bytes(4100);
  status = refused(r);
  EXPECT_THAT(status.error_message(), HasSubstr("slot_bytes: expected a multiple of 64"));
  r = {};
  r.set_offset(8);
  status = refused(r, ring::RingBytes(kSlots, kSlotBytes) + 64);
  EXPECT_THAT(status.error_message(), HasSubstr("offset: expected a non-negative multiple of 64"));
  status = refused({}, 0, v1::RING_METHOD_UNSPECIFIED);
  EXPECT_THAT(status.error_message(), HasSubstr("method: expected RING_METHOD_ATTEND"));
  // A region smaller than the ring.
  status = refused({}, ring::RingBytes(kSlots, kSlotBytes) - 64);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("ring: expected bytes inside region"));
  // An unknown region.
  r = {};
  r.set_region("nowhere");
  status = refused(r);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  // Another caller's region: another connection is another caller on this server (no tokens).
  std::unique_ptr<RawRing> mine = OpenRing(client(), "mine", v1::RING_METHOD_ATTEND);
  ASSERT_NE(mine, nullptr);
  std::unique_ptr<client::Client> other_client = ClientOnItsOwnConnection(process().target());
  client::Client& other = *other_client;
  r = {};
  r.set_region("mine");
  std::unique_ptr<RawRing> theirs = OpenRing(other, "theirs", v1::RING_METHOD_ATTEND, r);
  ASSERT_NE(theirs, nullptr);
  status = theirs->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  EXPECT_TRUE(SharedMemoryClient(other).Unregister("theirs").ok());
  // --max_rings=2: "mine" and one more.
  std::unique_ptr<RawRing> second = OpenRing(client(), "second", v1::RING_METHOD_STEP);
  std::unique_ptr<RawRing> third = OpenRing(client(), "third", v1::RING_METHOD_STEP);
  status = third->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--max_rings"));
  for (RawRing* ring : {mine.get(), second.get()}) {
    ring->Close();
    EXPECT_TRUE(ring->Ended().ok());
  }
  // Room again.
  std::unique_ptr<RawRing> fourth = OpenRing(client(), "fourth", v1::RING_METHOD_STEP);
  fourth->Close();
  EXPECT_TRUE(fourth->Ended().ok());
}

TEST_F(RequestRingE2E, UnregisterWaitsForTheRing) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "held", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  SharedMemoryClient regions(client());
  const absl::Status early = regions.Unregister("held", {.deadline = absl::Milliseconds(200)});
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  // The server's side of that call gives up at the same deadline; closing the ring before it has
  // would let it remove the region after all.
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<v1::ListRegionsResponse> list = regions.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->regions_size(), 1);
  ring->Close();
  EXPECT_TRUE(ring->Ended().ok());
  const absl::Status unregistered = regions.Unregister("held");
  EXPECT_TRUE(unregistered.ok()) << unregistered;
}

// Threads of the process `pid`, from /proc/PID/status.
int ThreadsOf(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
  }
  return -1;
}

// Unregister calls waiting for a ring's region hold no server thread each: they are answered when
// the ring ends.
TEST_F(RequestRingE2E, UnregisterCallsWaitingForTheRingHoldNoThreadEach) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "waited", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  const pid_t pid = process().pid();
  constexpr int kWaiting = 24;
  const int before = ThreadsOf(pid);
  std::vector<std::future<absl::Status>> waiting;
  for (int i = 0; i < kWaiting; ++i) {
    waiting.push_back(std::async(std::launch::async, [this] {
      return SharedMemoryClient(client()).Unregister("waited", {.deadline = absl::Seconds(30)});
    }));
  }
  absl::SleepFor(absl::Milliseconds(500));  // every call arrived and waits
  for (auto& w : waiting) {
    ASSERT_EQ(w.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  }
  const int during = ThreadsOf(pid);
  // gRPC may add a thread or two under a burst of calls; a thread per call would be 24.
  EXPECT_LT(during - before, kWaiting / 3) << before << " threads before, " << during << " after";
  ring->Close();
  EXPECT_TRUE(ring->Ended().ok());
  for (auto& w : waiting) EXPECT_TRUE(w.get().ok());
}

TEST_F(RequestRingE2E, ACancelledCallEndsItsRing) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "cancelled", v1::RING_METHOD_STEP);
  ASSERT_NE(ring, nullptr);
  // Past the thread's spin, so it sleeps on the bell when the cancel comes.
  absl::SleepFor(absl::Milliseconds(50));
  ring->context.TryCancel();
  EXPECT_EQ(ring->Ended().error_code(), grpc::StatusCode::CANCELLED);
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (ring->header->server_closed.load() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
}

// A client that stops reading, then cancels: the answer waiting for a slot is dropped, the ring
// ends at once and its region is free to unregister (TearDown).
TEST_F(RequestRingE2E, ACancelledCallWhoseAnswersWereNeverReadEndsItsRing) {
  std::unique_ptr<RawRing> ring = OpenRing(client(), "unread", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  FillAndNeverRead(*ring, rng);
  absl::SleepFor(absl::Milliseconds(50));
  ring->context.TryCancel();
  EXPECT_EQ(ring->Ended(std::chrono::seconds(5)).error_code(), grpc::StatusCode::CANCELLED);
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (ring->header->server_closed.load() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
}

TEST(RequestRingShrinkE2E, AnObjectShrunkUnderTheRingEndsItAndTheServerServesOn) {
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--threads=1", "--allow_shared_memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<RawRing> ring = OpenRing(*server->client, "shrunk", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 1, .seqlen_q = 4, .seqlen_k = 4, .head_dim = 8}, rng);
  ASSERT_TRUE(request.ok());
  // One request served first: the zeros the server then reads in place of the header put its
  // counters behind what it took, and the ring still ends naming the shrink.
  ring->Post(*request);
  v1::AttendResponse response;
  ASSERT_TRUE(ring->Take(&response));
  // As a misbehaving client may; this process does not touch its mapping from here on.
  const int fd = shm_open(ring->object->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_TRUE(server->client->Attend(*request).ok());
  EXPECT_TRUE(SharedMemoryClient(*server->client).Unregister("shrunk").ok());
  ring.reset();
  EXPECT_TRUE(server->Stop().ok());
}

TEST(RequestRingShutdownE2E, TheServerStopsWhileARingIsServed) {
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--allow_shared_memory", "--shutdown_grace_s=2"});
  ASSERT_TRUE(server.ok()) << server.status();
  // The ring's connection stays open while the server stops (Stop closes only its own client).
  std::unique_ptr<client::Client> ring_client = ClientOnItsOwnConnection(server->process->target());
  std::unique_ptr<RawRing> ring = OpenRing(*ring_client, "open", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  absl::StatusOr<v1::AttendRequest> request = client::MakeRandomRequest(
      {.batch = 1, .heads_q = 2, .seqlen_q = 5, .seqlen_k = 9, .head_dim = 16}, rng);
  ASSERT_TRUE(request.ok());
  ring->Post(*request);
  v1::AttendResponse response;
  ASSERT_TRUE(ring->Take(&response));
  ExpectCorrect(*request, response);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(server->Stop().ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  // Ended by the drain, not cancelled by gRPC's shutdown.
  const grpc::Status status = ring->Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("server is shutting down"));
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
}

TEST(RequestRingShutdownE2E, AClientThatStopsReadingNeitherSpinsNorHoldsTheExit) {
  absl::StatusOr<RunningServer> server = StartServer(
      {"--backend=cpu", "--threads=1", "--allow_shared_memory", "--shutdown_grace_s=2"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<client::Client> ring_client = ClientOnItsOwnConnection(server->process->target());
  std::unique_ptr<RawRing> ring = OpenRing(*ring_client, "unread", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  FillAndNeverRead(*ring, rng);
  // Past the thread's spin (20 ms after its last event): what it costs while the answer waits.
  absl::SleepFor(absl::Milliseconds(100));
  const double before = CpuSeconds(server->process->pid());
  absl::SleepFor(absl::Seconds(1));
  const double used = CpuSeconds(server->process->pid()) - before;
  ASSERT_GE(before, 0);
  EXPECT_LT(used, 0.5) << "the server spun while a ring's answer waited for a free slot";
  EXPECT_EQ(ring->header->server_closed.load(), 0u) << "the ring ended before the signal";

  const absl::Time signal_time = absl::Now();
  ASSERT_TRUE(server->process->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = server->process->WaitForExit(absl::Seconds(20));
  const absl::Duration exit_after = absl::Now() - signal_time;
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << server->process->Log();
  EXPECT_EQ(*code, 0) << server->process->Log();
  // 2 s of grace, 1 s of linger, at most 1 s of held refusals and 0.5 s for gRPC to close; the
  // rest is slack.
  EXPECT_LT(exit_after, absl::Seconds(10));
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
  EXPECT_FALSE(ring->Ended().ok());
  std::printf("unread ring: %.3f s of CPU in 1 s stalled; exit %d after %s\n", used, *code,
              absl::FormatDuration(exit_after).c_str());
}

// A client that stops reading without cancelling: after --ring_stall_timeout_s with an answer
// waiting for a free slot, the ring ends DEADLINE_EXCEEDED naming the flag, its slot is free
// for another ring and its region can be unregistered.
TEST(RequestRingShutdownE2E, AClientThatStopsReadingLosesItsRingAfterTheStallTimeout) {
  absl::StatusOr<RunningServer> server =
      StartServer({"--backend=cpu", "--threads=1", "--allow_shared_memory", "--max_rings=1",
                   "--ring_stall_timeout_s=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<RawRing> ring = OpenRing(*server->client, "stalled", v1::RING_METHOD_ATTEND);
  ASSERT_NE(ring, nullptr);
  std::mt19937_64 rng(FreshSeed());
  const absl::Time filled_at = absl::Now();
  FillAndNeverRead(*ring, rng);
  const grpc::Status status = ring->Ended(std::chrono::seconds(10));
  const absl::Duration ended_after = absl::Now() - filled_at;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--ring_stall_timeout_s"));
  EXPECT_GE(ended_after, absl::Seconds(1));
  EXPECT_EQ(ring->header->server_closed.load(), 1u);
  // --max_rings=1: the ring's slot is free again, and its region is no longer held.
  std::unique_ptr<RawRing> next = OpenRing(*server->client, "next", v1::RING_METHOD_ATTEND);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->header->server_open.load(), 1u) << next->Ended().error_message();
  next->Close();
  EXPECT_TRUE(next->Ended().ok());
  SharedMemoryClient regions(*server->client);
  EXPECT_TRUE(regions.Unregister("stalled", {.deadline = absl::Seconds(5)}).ok());
  EXPECT_TRUE(regions.Unregister("next").ok());
  ring.reset();
  next.reset();
  EXPECT_TRUE(server->Stop().ok());
}

TEST(RequestRingOffE2E, WithoutSharedMemoryOpenRingIsFailedPrecondition) {
  absl::StatusOr<RunningServer> server = StartServer({"--backend=cpu", "--threads=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  v1::OpenRingRequest request;
  request.set_region("x");
  request.set_method(v1::RING_METHOD_STEP);
  request.set_slots(1);
  request.set_slot_bytes(ring::kMinSlotBytes);
  v1::RingClosed closed;
  grpc::ClientContext context;
  const grpc::Status status =
      v1::SharedMemory::NewStub(server->client->channel())->OpenRing(&context, request, &closed);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--allow_shared_memory"));
  EXPECT_TRUE(server->Stop().ok());
}

}  // namespace
}  // namespace attention::e2e
