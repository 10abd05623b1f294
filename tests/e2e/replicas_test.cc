// Several replicas from C++ (client/replicas.h) over three real attention_servers (CPU backend,
// --replica_name r1, r2, r3, small KV caches of 16 pages of 16 float32 rows): Emptiest picks the
// replica with the most free plus cached pages, asking all at once, the first of equals;
// PlaceSession creates the session there; a server that does not answer, or serves no sessions,
// is passed over, and none left is UNAVAILABLE naming each. Drain moves every session of r1 to r2
// under its id (float32, bfloat16, a float16 session of three layers), calls the switch once every
// session is on r2 and before any is dropped on r1, leaves r1 holding none and refusing the moved
// sessions as sealed; the moved sessions' Steps on r2 equal, bit for bit, the same Steps on twins
// on r3 that never moved. A failed switch drops nothing, and a second drain to another peer
// finishes the move. Inputs are fresh random each run (the seed is in every failure).
#include "client/replicas.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/session.h"
#include "client/tensors.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_test_util.h"

namespace attention::e2e {
namespace {

using client::Session;
using client::SessionClient;
using client::SessionSpec;
using client::StepOptions;
using client::StepOutput;

// float32 rows of Hkv 2, D 64: 1 KiB each (k and v), so a 16 KiB page holds 16 rows.
constexpr int64_t kPageRows = 16, kPages = 16;
const SessionSpec kSpec{.dtype = v1::DTYPE_FLOAT32, .kv_heads = 2, .head_dim = 64};

class ReplicasTest : public ::testing::Test {
 protected:
  static constexpr int kReplicas = 3;

  static void SetUpTestSuite() {
    for (int r = 0; r < kReplicas; ++r) {
      servers_[r] = new absl::StatusOr<RunningServer>(
          StartServer({"--backend=cpu", absl::StrCat("--replica_name=r", r + 1),
                       absl::StrCat("--kv_page_bytes=", kPageRows * 1024),
                       absl::StrCat("--kv_cache_bytes=", kPages * kPageRows * 1024)}));
    }
  }
  static void TearDownTestSuite() {
    for (absl::StatusOr<RunningServer>*& server : servers_) {
      if (server->ok()) EXPECT_EQ((*server)->Stop(), absl::OkStatus());
      delete server;
      server = nullptr;
    }
  }
  void SetUp() override {
    for (int r = 0; r < kReplicas; ++r) {
      ASSERT_TRUE(servers_[r]->ok()) << servers_[r]->status();
      sessions_[r] = std::make_unique<SessionClient>(client(r));
    }
    seed_ = FreshSeed();
    rng_.seed(seed_);
  }
  // Each test leaves every replica without a session and its pages free or cached.
  void TearDown() override {
    for (int r = 0; r < kReplicas; ++r) {
      absl::StatusOr<v1::ListSessionsResponse> listed = sessions_[r]->List();
      ASSERT_TRUE(listed.ok()) << listed.status();
      EXPECT_EQ(listed->sessions_size(), 0) << "r" << r + 1;
      EXPECT_EQ(listed->pages_free() + listed->pages_cached(), listed->pages_total())
          << "r" << r + 1;
    }
  }

  static client::Client& client(int r) { return *(*servers_[r])->client; }

  // Fresh values of `shape`, and the tensor of them in `dtype`.
  v1::Tensor Random(v1::DType dtype, const std::vector<int64_t>& shape) {
    return client::MakeTensor(dtype, shape, client::RandomNormal(client::NumElements(shape), rng_));
  }
  // A kSpec session of `rows` fresh rows on replica r, with their token ids when `tokens`.
  Session Fill(int r, int64_t rows, bool tokens = false) {
    const v1::Tensor k = Random(kSpec.dtype, {2, rows, 64}), v = Random(kSpec.dtype, {2, rows, 64});
    std::vector<int64_t> ids(rows);
    for (int64_t& id : ids) id = static_cast<int64_t>(rng_() >> 24);
    absl::StatusOr<Session> s =
        tokens ? sessions_[r]->Create(kSpec, k, v, ids) : sessions_[r]->Create(kSpec, &k, &v);
    EXPECT_TRUE(s.ok()) << s.status();
    return *std::move(s);
  }
  // Replica r's free plus cached pages, as its ServerInfo reports them.
  int64_t Room(int r) {
    absl::StatusOr<v1::ServerInfo> info = client(r).GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->kv_pages_free() + info->kv_pages_cached() : -1;
  }
  // The replica (1-based name) a session placed over replicas `pool` (0-based) lands on.
  std::string Place(const std::vector<int>& pool, std::vector<Session>& held) {
    std::vector<SessionClient*> over;
    for (int r : pool) over.push_back(sessions_[r].get());
    const v1::Tensor k = Random(kSpec.dtype, {2, 20, 64}), v = Random(kSpec.dtype, {2, 20, 64});
    absl::StatusOr<Session> s = client::PlaceSession(over, kSpec, &k, &v);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return "";
    EXPECT_EQ(s->length(), 20);
    held.push_back(*std::move(s));
    return std::string(client::SessionOwner(held.back().id()));
  }

  static inline absl::StatusOr<RunningServer>* servers_[kReplicas] = {};
  std::unique_ptr<SessionClient> sessions_[kReplicas];
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

// A client of a port nothing listens on: bound, so no one else takes it, but not listening, so a
// connection is refused at once (UNAVAILABLE).
class DeadReplica {
 public:
  DeadReplica() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), size), 0);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size), 0);
    client_ = std::make_unique<client::Client>(
        client::ClientOptions{.target = absl::StrCat("127.0.0.1:", ntohs(address.sin_port)),
                              .deadline = absl::Seconds(5)});
  }
  ~DeadReplica() { close(fd_); }
  const client::Client* client() const { return client_.get(); }
  const std::string& target() const { return client_->options().target; }

 private:
  int fd_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(ReplicasTest, NewSessionsGoToTheReplicaWithTheMostRoom) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  // r1 holds 9 pages, r2 3, r3 6: the next session (2 pages: 20 rows) goes to r2.
  std::vector<Session> held;
  const int64_t pages[] = {9, 3, 6};
  for (int r = 0; r < kReplicas; ++r) held.push_back(Fill(r, pages[r] * kPageRows));
  for (int r = 0; r < kReplicas; ++r) EXPECT_EQ(Room(r), kPages - pages[r]);
  const std::vector<const client::Client*> all = {&client(0), &client(1), &client(2)};
  absl::StatusOr<size_t> emptiest = client::Emptiest(all);
  ASSERT_TRUE(emptiest.ok()) << emptiest.status();
  EXPECT_EQ(*emptiest, 1u);
  EXPECT_EQ(Place({0, 1, 2}, held), "r2");
  // r2 now 11: 3 more pages there, and r3 (10) is the emptiest.
  held.push_back(Fill(1, 3 * kPageRows));
  EXPECT_EQ(Place({0, 1, 2}, held), "r3");
  EXPECT_EQ(Room(1), 8);
  EXPECT_EQ(Room(2), 8);
  // Equal room: the first of them in the order given.
  EXPECT_EQ(Place({0, 2, 1}, held), "r3");
  EXPECT_EQ(Place({0, 1, 2}, held), "r2");
}

// Pages of a cached prefix no session holds are room: r1, its 4 pages cached after its session
// dropped, has the room of r2, empty, and comes first.
TEST_F(ReplicasTest, CachedPagesCountAsRoom) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  Fill(0, 4 * kPageRows, /*tokens=*/true);  // dropped at once: its full pages stay cached
  absl::StatusOr<v1::ServerInfo> info = client(0).GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GE(info->kv_pages_cached(), 4);
  EXPECT_LE(info->kv_pages_free(), kPages - 4);
  const std::vector<const client::Client*> pool = {&client(0), &client(1)};
  absl::StatusOr<size_t> emptiest = client::Emptiest(pool);
  ASSERT_TRUE(emptiest.ok()) << emptiest.status();
  EXPECT_EQ(*emptiest, 0u);
}

TEST_F(ReplicasTest, AReplicaThatDoesNotAnswerIsPassedOverAndNamed) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  const DeadReplica dead, also_dead;
  Session s = Fill(0, 4 * kPageRows);
  const std::vector<const client::Client*> pool = {dead.client(), &client(0)};
  absl::StatusOr<size_t> emptiest = client::Emptiest(pool);
  ASSERT_TRUE(emptiest.ok()) << emptiest.status();
  EXPECT_EQ(*emptiest, 1u);

  // A server that serves no sessions (no KV pages) is passed over too.
  absl::StatusOr<RunningServer> no_sessions =
      StartServer({"--backend=cpu", "--kv_cache_fraction=0"});
  ASSERT_TRUE(no_sessions.ok()) << no_sessions.status();
  const std::vector<const client::Client*> none = {dead.client(), no_sessions->client.get(),
                                                   also_dead.client()};
  emptiest = client::Emptiest(none);
  EXPECT_EQ(emptiest.status().code(), absl::StatusCode::kUnavailable) << emptiest.status();
  const std::string message(emptiest.status().message());
  EXPECT_TRUE(absl::StartsWith(message, absl::StrCat("no replica to place a session on: ",
                                                     dead.target(), ": UNAVAILABLE: ")))
      << message;
  EXPECT_TRUE(absl::StrContains(message, absl::StrCat("; ", no_sessions->client->options().target,
                                                      ": serves no sessions (no KV pages); ",
                                                      also_dead.target(), ": UNAVAILABLE: ")))
      << message;
  SessionClient unplaceable(*no_sessions->client);
  std::vector<SessionClient*> over = {&unplaceable};
  EXPECT_EQ(client::PlaceSession(over, kSpec).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client::Emptiest({}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(no_sessions->Stop(), absl::OkStatus());
}

// One Step of session `id` on `sessions`' server, by id, after appending k, v [Hkv, n, D] when
// given: the Session objects of drained sessions belong to the source's SessionClient, and the
// test asks the target directly, as a router does after the switch.
absl::StatusOr<StepOutput> StepById(SessionClient& sessions, const std::string& id,
                                    const v1::Tensor& q, const StepOptions& options,
                                    const v1::Tensor* k = nullptr, const v1::Tensor* v = nullptr) {
  v1::StepRequest request;
  v1::StepEntry* entry = request.add_entries();
  entry->set_session_id(id);
  *entry->mutable_q() = q;
  if (k != nullptr) {
    *entry->mutable_k() = *k;
    *entry->mutable_v() = *v;
  }
  request.set_causal(options.causal);
  request.set_return_lse(options.return_lse);
  if (options.layer) request.set_layer(*options.layer);
  v1::StepResponse response;
  grpc::Status status = sessions.stub().Step(sessions.NewContext({}).get(), request, &response);
  if (!status.ok()) return client::ToAbslStatus(status);
  if (response.results_size() != 1) return absl::DataLossError("expected one result");
  v1::StepResult& result = *response.mutable_results(0);
  return StepOutput{std::move(*result.mutable_o()), std::move(*result.mutable_lse()),
                    result.length()};
}

// A change refused because session `id` is sealed (kSealedMarker), as the client returns it once
// its retries passed the call's deadline.
void ExpectSealed(const absl::Status& status, const std::string& id) {
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_TRUE(absl::StartsWith(
      status.message(), absl::StrCat(client::kSealedMarker, "session '", id, "' was sealed")))
      << status;
}

// A session on the drained replica and its twin on another that never moves: the same rows.
struct Twins {
  Session moving, twin;
  std::vector<int32_t> layers;  // those holding rows
};

TEST_F(ReplicasTest, DrainMovesEverySessionBitForBit) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  // On r1 (moved to r2) and r3 (twins): float32 and bfloat16 sessions, and a float16 one of
  // three layers whose layer 1 stays empty.
  const std::vector<std::pair<SessionSpec, std::vector<int64_t>>> kinds = {
      {kSpec, {50}},
      {{.dtype = v1::DTYPE_BFLOAT16, .kv_heads = 2, .head_dim = 64}, {41}},
      {{.dtype = v1::DTYPE_FLOAT16, .kv_heads = 1, .head_dim = 32, .layers = 3}, {20, 0, 33}},
  };
  std::vector<Twins> twins;
  for (const auto& [spec, lengths] : kinds) {
    absl::StatusOr<Session> moving = sessions_[0]->Create(spec);
    absl::StatusOr<Session> twin = sessions_[2]->Create(spec);
    ASSERT_TRUE(moving.ok() && twin.ok()) << moving.status() << " " << twin.status();
    Twins pair{*std::move(moving), *std::move(twin), {}};
    for (int32_t layer = 0; layer < spec.layers; ++layer) {
      const int64_t n = lengths[layer];
      if (n == 0) continue;
      pair.layers.push_back(layer);
      const v1::Tensor k = Random(spec.dtype, {spec.kv_heads, n, spec.head_dim});
      const v1::Tensor v = Random(spec.dtype, {spec.kv_heads, n, spec.head_dim});
      for (Session* s : {&pair.moving, &pair.twin}) ASSERT_TRUE(s->Append(k, v, layer).ok());
    }
    twins.push_back(std::move(pair));
  }
  std::set<std::string> ids;
  for (const Twins& pair : twins) ids.insert(pair.moving.id());

  const auto listed = [](SessionClient& sessions) {
    std::set<std::string> out;
    absl::StatusOr<v1::ListSessionsResponse> list = sessions.List();
    EXPECT_TRUE(list.ok()) << list.status();
    if (list.ok()) {
      for (const v1::SessionInfo& info : list->sessions()) out.insert(info.session_id());
    }
    return out;
  };
  int switched = 0;
  absl::StatusOr<std::vector<std::string>> moved = client::Drain(
      *sessions_[0], *sessions_[1],
      [&] {
        // Every session imported on r2, none dropped on r1 yet.
        ++switched;
        EXPECT_EQ(listed(*sessions_[1]), ids);
        EXPECT_EQ(listed(*sessions_[0]), ids);
        return absl::OkStatus();
      },
      /*chunk_rows=*/16);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(switched, 1);
  EXPECT_EQ(std::set<std::string>(moved->begin(), moved->end()), ids);
  EXPECT_EQ(listed(*sessions_[0]), std::set<std::string>());

  for (Twins& pair : twins) {
    const SessionSpec& spec = pair.twin.spec();
    SCOPED_TRACE(absl::StrCat(pair.moving.id(), " ", v1::DType_Name(spec.dtype)));
    // r1 refuses the moved session as sealed (moved away), not NOT_FOUND: the client retries
    // until the call's deadline, then returns the refusal.
    const v1::Tensor q1 = Random(spec.dtype, {2 * spec.kv_heads, 1, spec.head_dim});
    ExpectSealed(pair.moving
                     .Step(q1, {.layer = pair.layers.front()}, nullptr, nullptr,
                           {.deadline = absl::Milliseconds(200)})
                     .status(),
                 pair.moving.id());
    const std::string id = pair.moving.Release();  // its Session object is r1's
    for (int32_t layer : pair.layers) {
      for (int64_t nq : {1, 3}) {
        const v1::Tensor q = Random(spec.dtype, {2 * spec.kv_heads, nq, spec.head_dim});
        const v1::Tensor k = Random(spec.dtype, {spec.kv_heads, nq, spec.head_dim});
        const v1::Tensor v = Random(spec.dtype, {spec.kv_heads, nq, spec.head_dim});
        const StepOptions options{.causal = true, .return_lse = true, .layer = layer};
        absl::StatusOr<StepOutput> after = StepById(*sessions_[1], id, q, options, &k, &v);
        absl::StatusOr<StepOutput> never_moved = pair.twin.Step(q, options, &k, &v);
        ASSERT_TRUE(after.ok() && never_moved.ok()) << after.status() << never_moved.status();
        EXPECT_EQ(after->o.data(), never_moved->o.data()) << "layer " << layer << ", " << nq;
        EXPECT_EQ(after->lse.data(), never_moved->lse.data()) << "layer " << layer << ", " << nq;
        EXPECT_EQ(after->length, never_moved->length);
      }
    }
    EXPECT_EQ(sessions_[1]->Drop(id), absl::OkStatus());
  }
}

TEST_F(ReplicasTest, AFailedSwitchDropsNothingAndASecondDrainFinishesTheMove) {
  SCOPED_TRACE(absl::StrCat("seed ", seed_));
  Session s = Fill(0, 30);
  const v1::Tensor q = Random(kSpec.dtype, {4, 1, 64});
  absl::StatusOr<StepOutput> before = s.Step(q);
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<std::vector<std::string>> moved = client::Drain(
      *sessions_[0], *sessions_[1], [] { return absl::UnavailableError("the router is down"); });
  EXPECT_EQ(moved.status(), absl::UnavailableError("the router is down"));
  // Sealed on r1, its changes refused there (retried until the call's deadline); imported on r2.
  ExpectSealed(s.Step(q, {}, nullptr, nullptr, {.deadline = absl::Milliseconds(200)}).status(),
               s.id());
  absl::StatusOr<v1::ListSessionsResponse> on_r2 = sessions_[1]->List();
  ASSERT_TRUE(on_r2.ok()) << on_r2.status();
  ASSERT_EQ(on_r2->sessions_size(), 1);
  EXPECT_EQ(on_r2->sessions(0).session_id(), s.id());

  // Drained again, to r3 this time: the sealed session exports as it was.
  moved = client::Drain(*sessions_[0], *sessions_[2]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, std::vector<std::string>{s.id()});
  const std::string id = s.Release();
  absl::StatusOr<StepOutput> after = StepById(*sessions_[2], id, q, {});
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->o.data(), before->o.data());
  EXPECT_EQ(sessions_[1]->Drop(id), absl::OkStatus());
  EXPECT_EQ(sessions_[2]->Drop(id), absl::OkStatus());
}

}  // namespace
}  // namespace attention::e2e
