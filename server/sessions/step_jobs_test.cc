// A Step's jobs over a real session store, scheduler and CPU executor (its own KV pool): the
// launch's o and lse against a float64 reference over the session's rows, the new row appended,
// sequences of two decode keys as two jobs of one step, and the refusals that leave the sessions
// as they were (queries beyond the session's rows, the FLOP limit), a Step after a truncate
// equal to one on a session of only the kept rows, and forks stepping as fresh sessions of their
// rows.
#include "server/sessions/step_jobs.h"

#include <cmath>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/executors/executor.h"
#include "server/scheduling/scheduler.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// float32, 2 kv heads, head dim 8; 4 query heads (GQA 2:1).
constexpr KvShape kShape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 8};
constexpr int64_t kHeadsQ = 4;

// A sequence's rows and queries, BHSD: k, v [Hkv, rows, D]; q, o [Hq, rows_q, D]; lse [Hq, rows_q].
struct Tensors {
  Tensors(int64_t rows, int64_t rows_q, std::mt19937& rng)
      : k(kShape.heads_kv * rows * kShape.head_dim),
        v(k.size()),
        q(kHeadsQ * rows_q * kShape.head_dim),
        o(q.size()),
        lse(kHeadsQ * rows_q) {
    std::normal_distribution<float> normal;
    for (std::vector<float>* t : {&k, &v, &q}) {
      for (float& x : *t) x = normal(rng);
    }
    kv_rows = KvRows{.k = k.data(),
                     .v = v.data(),
                     .rows = rows,
                     .head_stride = rows * kShape.head_dim,
                     .row_stride = kShape.head_dim};
  }
  std::vector<float> k, v, q, o, lse;
  KvRows kv_rows;
};

// A step of the test, answered into `outcome`.
struct TestStep final : StepWork {
  void Finished(StepOutcome result) override {
    std::lock_guard<std::mutex> lock(mu);
    outcome = std::move(result);
    done.notify_all();
  }
  StepOutcome Wait() {
    std::unique_lock<std::mutex> lock(mu);
    done.wait(lock, [this] { return outcome.has_value(); });
    return *outcome;
  }
  std::mutex mu;
  std::condition_variable done;
  std::optional<StepOutcome> outcome;
  std::deque<std::string> ids;  // what the sequences' session_id view (a deque: they stay put)
};

class StepJobsTest : public ::testing::Test {
 protected:
  StepJobsTest() {
    std::unique_ptr<Executor> executor = MakeCpuExecutor(1);
    absl::StatusOr<KvPagePool*> pool = executor->InitKvPool(/*num_pages=*/16, /*page_bytes=*/4096);
    EXPECT_TRUE(pool.ok()) << pool.status();
    std::vector<std::unique_ptr<Executor>> executors;
    executors.push_back(std::move(executor));
    scheduler_.emplace(std::move(executors), SchedulerOptions{.workers = 1, .max_queue = 8});
    std::vector<KvDevice> devices;
    devices.push_back(KvDevice{.name = "cpu", .pool = *pool});
    store_.emplace(std::move(devices), SessionStoreOptions{});
  }
  ~StepJobsTest() override { scheduler_->Shutdown(); }

  // A session of `t`'s first `rows` rows (all: -1); its id.
  std::string Create(const Tensors& t, int64_t rows = -1) {
    KvRows first = t.kv_rows;  // [Hkv, all of t's rows, D] strides
    if (rows >= 0) first.rows = rows;
    absl::StatusOr<SessionStore::Lease> lease = store_->Create("", kShape, first.rows, 0);
    EXPECT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(store_->Append(*lease, first), absl::OkStatus());
    return lease->id();
  }
  int64_t Length(const std::string& id) {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {id});
    EXPECT_TRUE(leases.ok()) << leases.status();
    return leases.ok() ? leases->front().length() : -1;
  }
  // Sequence of session `id` in `step` (which keeps the id its jobs view): `t`'s rows appended,
  // its last `rows_q` positions queried.
  static StepSequence Sequence(TestStep& step, const std::string& id, Tensors& t, int64_t rows_q,
                               const DecodeKey& key) {
    return {.session_id = step.ids.emplace_back(id),
            .key = key,
            .rows = t.kv_rows,
            .q = t.q.data(),
            .rows_q = rows_q,
            .o = t.o.data(),
            .lse = t.lse.data()};
  }
  StepOutcome Run(const std::shared_ptr<TestStep>& step, const StepJobs& jobs) {
    scheduler_->SubmitAll(jobs.Jobs(step, absl::InfiniteFuture(), [] { return false; }));
    return step->Wait();
  }

  std::mt19937 rng_{std::random_device{}()};
  std::optional<Scheduler> scheduler_;
  std::optional<SessionStore> store_;
  const DecodeKey key_{
      .shape = kShape, .heads_q = kHeadsQ, .softmax_scale = 0.5f, .window_right = 0, .lse = true};
};

// o and lse of query head h, row r over every key of `old` then `added`, in float64.
void ExpectMatchesReference(const Tensors& old, const Tensors& added, const Tensors& queries,
                            float scale) {
  const int64_t d = kShape.head_dim;
  const int64_t n_old = old.kv_rows.rows, n = n_old + added.kv_rows.rows;
  const int64_t rows_q = static_cast<int64_t>(queries.lse.size()) / kHeadsQ;
  double err = 0, norm = 0;
  for (int64_t h = 0; h < kHeadsQ; ++h) {
    const int64_t hk = h / (kHeadsQ / kShape.heads_kv);
    for (int64_t r = 0; r < rows_q; ++r) {
      const int64_t last_key = n - rows_q + r;  // bottom-right causal
      auto key = [&](const std::vector<float>& t_old, const std::vector<float>& t_new, int64_t j,
                     int64_t c) {
        return j < n_old ? t_old[(hk * n_old + j) * d + c]
                         : t_new[(hk * (n - n_old) + (j - n_old)) * d + c];
      };
      std::vector<double> logits(last_key + 1);
      double max_logit = -INFINITY;
      for (int64_t j = 0; j <= last_key; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) {
          dot += double{queries.q[(h * rows_q + r) * d + c]} * key(old.k, added.k, j, c);
        }
        logits[j] = dot * scale;
        max_logit = std::max(max_logit, logits[j]);
      }
      double sum = 0;
      for (double& l : logits) sum += (l = std::exp(l - max_logit));
      EXPECT_NEAR(queries.lse[h * rows_q + r], max_logit + std::log(sum), 1e-4);
      for (int64_t c = 0; c < d; ++c) {
        double o = 0;
        for (int64_t j = 0; j <= last_key; ++j) o += logits[j] / sum * key(old.v, added.v, j, c);
        const double got = queries.o[(h * rows_q + r) * d + c];
        err += (got - o) * (got - o);
        norm += o * o;
      }
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

TEST_F(StepJobsTest, AppendsTheNewRowsAndAttendsToEveryRow) {
  const Tensors first(37, 0, rng_);
  const std::string id = Create(first);
  Tensors step_rows(1, 2, rng_);  // one new row, two queries (the session's last two positions)
  auto step = std::make_shared<TestStep>();
  step->seqs.push_back(Sequence(*step, id, step_rows, 2, key_));
  StepJobs jobs(&*store_, {}, {});
  const StepOutcome outcome = Run(step, jobs);
  ASSERT_EQ(outcome.status, absl::OkStatus());
  EXPECT_EQ(step->seqs[0].length, 38);
  EXPECT_EQ(Length(id), 38);
  EXPECT_THAT(outcome.devices, ::testing::ElementsAre("cpu"));
  ExpectMatchesReference(first, step_rows, step_rows, key_.softmax_scale);
}

TEST_F(StepJobsTest, StepAfterTruncateEqualsStepOnTheKeptRows) {
  const Tensors first(37, 0, rng_);
  const std::string truncated = Create(first);
  {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {truncated});
    ASSERT_TRUE(leases.ok()) << leases.status();
    ASSERT_EQ(store_->Truncate(leases->front(), 20), absl::OkStatus());
  }
  const std::string fresh = Create(first, 20);  // only the first 20 of `first`'s rows
  // The same step (one new row, two queries) on each.
  Tensors on_truncated(1, 2, rng_);
  Tensors on_fresh = on_truncated;
  on_fresh.kv_rows.k = on_fresh.k.data();
  on_fresh.kv_rows.v = on_fresh.v.data();
  for (auto [id, t] : {std::pair{truncated, &on_truncated}, std::pair{fresh, &on_fresh}}) {
    auto step = std::make_shared<TestStep>();
    step->seqs.push_back(Sequence(*step, id, *t, 2, key_));
    StepJobs jobs(&*store_, {}, {});
    ASSERT_EQ(Run(step, jobs).status, absl::OkStatus());
    EXPECT_EQ(Length(id), 21);
  }
  EXPECT_EQ(on_truncated.o, on_fresh.o);  // bit for bit
  EXPECT_EQ(on_truncated.lse, on_fresh.lse);
}

// Forks of one session, and the parent cut into a page they share, in one Step with different new
// rows each: each answers bit for bit what a session created with its rows does (the shared pages
// read as the parent's, the copied partial pages as theirs, the parent's append copied on write).
TEST_F(StepJobsTest, ForksStepAsFreshSessionsOfTheirRows) {
  const Tensors first(70, 0, rng_);  // pages of 32 rows: 32, 32 and 6
  const std::string parent = Create(first);
  std::string child, partial;
  {
    absl::StatusOr<std::vector<SessionStore::Lease>> leases = store_->Acquire("", {parent});
    ASSERT_TRUE(leases.ok()) << leases.status();
    for (auto [id, rows] : {std::pair{&child, 70}, std::pair{&partial, 40}}) {
      absl::StatusOr<SessionStore::Lease> fork = store_->Fork(leases->front(), rows);
      ASSERT_TRUE(fork.ok()) << fork.status();
      *id = fork->id();
    }
    ASSERT_EQ(store_->Truncate(leases->front(), 10), absl::OkStatus());
  }
  const std::pair<std::string, int64_t> forked[] = {{parent, 10}, {child, 70}, {partial, 40}};
  std::vector<Tensors> on_forks, on_fresh;
  std::vector<std::string> fresh;  // the sequences keep views of the ids
  auto step = std::make_shared<TestStep>();
  on_forks.reserve(3);
  on_fresh.reserve(3);
  fresh.reserve(3);
  for (const auto& [id, rows] : forked) {
    on_forks.emplace_back(1, 2, rng_);
    on_fresh.push_back(on_forks.back());
    on_fresh.back().kv_rows.k = on_fresh.back().k.data();
    on_fresh.back().kv_rows.v = on_fresh.back().v.data();
    step->seqs.push_back(Sequence(*step, id, on_forks.back(), 2, key_));
    fresh.push_back(Create(first, rows));
    step->seqs.push_back(Sequence(*step, fresh.back(), on_fresh.back(), 2, key_));
  }
  StepJobs jobs(&*store_, {}, {});
  ASSERT_EQ(Run(step, jobs).status, absl::OkStatus());
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(forked[i].second);
    EXPECT_EQ(Length(forked[i].first), forked[i].second + 1);
    EXPECT_EQ(on_forks[i].o, on_fresh[i].o);  // bit for bit
    EXPECT_EQ(on_forks[i].lse, on_fresh[i].lse);
  }
  // The child of every row against the float64 reference too.
  ExpectMatchesReference(first, on_forks[1], on_forks[1], key_.softmax_scale);
}

TEST_F(StepJobsTest, SequencesOfTwoKeysAreTwoJobsAndEachIsObserved) {
  const Tensors a_rows(5, 0, rng_), b_rows(9, 0, rng_);
  const std::string a = Create(a_rows), b = Create(b_rows);
  Tensors a_step(1, 1, rng_), b_step(1, 1, rng_);
  DecodeKey other = key_;
  other.softmax_scale = 0.25f;
  auto step = std::make_shared<TestStep>();
  step->seqs.push_back(Sequence(*step, a, a_step, 1, key_));
  step->seqs.push_back(Sequence(*step, b, b_step, 1, other));
  std::mutex mu;
  int observed = 0;
  int64_t tokens = 0;
  StepJobs jobs(&*store_, {}, [&](const JobResult& result, double flops, int64_t t) {
    std::lock_guard<std::mutex> lock(mu);
    ++observed;
    tokens += t;
    EXPECT_GT(flops, 0);
  });
  const StepOutcome outcome = Run(step, jobs);
  ASSERT_EQ(outcome.status, absl::OkStatus());
  EXPECT_EQ(observed, 2);
  EXPECT_EQ(tokens, 2);
  ExpectMatchesReference(a_rows, a_step, a_step, key_.softmax_scale);
  ExpectMatchesReference(b_rows, b_step, b_step, other.softmax_scale);
}

TEST_F(StepJobsTest, RefusalsOnTheWorkerAppendNothing) {
  const Tensors first(3, 0, rng_);
  const std::string id = Create(first);
  Tensors step_rows(1, 5, rng_);  // five queries, but the session holds 4 rows after the append
  auto make_step = [&] {
    auto step = std::make_shared<TestStep>();
    step->seqs.push_back(Sequence(*step, id, step_rows, 5, key_));
    return step;
  };
  StepJobs jobs(&*store_, {}, {});
  StepOutcome outcome = Run(make_step(), jobs);
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(outcome.status.message(), HasSubstr("entries[0].q.shape[1] (queries)"));
  EXPECT_EQ(Length(id), 3);

  auto step = make_step();
  step->seqs[0].rows_q = 1;
  StepJobs limited(&*store_, {.max_request_flops = 1}, {});
  outcome = Run(step, limited);
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(outcome.status.message(),
              HasSubstr("over the limit of 1 per request (--max_request_flops); nothing was "
                        "appended"));
  EXPECT_EQ(Length(id), 3);
}

// A sealed session (an export of it is moving it to another replica) refuses a Step of one
// launch UNAVAILABLE with the marker clients retry on; in a Step of several launches the others
// may have appended their rows, so the refusal is ABORTED, without the marker.
TEST_F(StepJobsTest, ASealedSessionInAStepOfSeveralLaunchesIsNotRetryable) {
  const Tensors a_rows(5, 0, rng_), b_rows(9, 0, rng_);
  const std::string a = Create(a_rows), b = Create(b_rows);
  {
    absl::StatusOr<std::vector<SessionStore::Lease>> held = store_->Acquire("", {b});
    ASSERT_TRUE(held.ok()) << held.status();
    store_->Seal(held->front());
  }
  Tensors a_step(1, 1, rng_), b_step(1, 1, rng_);
  StepJobs jobs(&*store_, {}, {});
  auto alone = std::make_shared<TestStep>();
  alone->seqs.push_back(Sequence(*alone, b, b_step, 1, key_));
  StepOutcome outcome = Run(alone, jobs);
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kUnavailable) << outcome.status;
  EXPECT_TRUE(absl::StartsWith(outcome.status.message(), kSealedMarker)) << outcome.status;

  DecodeKey other = key_;
  other.softmax_scale = 0.25f;
  auto both = std::make_shared<TestStep>();
  both->seqs.push_back(Sequence(*both, a, a_step, 1, key_));
  both->seqs.push_back(Sequence(*both, b, b_step, 1, other));
  outcome = Run(both, jobs);
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kAborted) << outcome.status;
  EXPECT_FALSE(absl::StrContains(outcome.status.message(), kSealedMarker)) << outcome.status;
  EXPECT_THAT(outcome.status.message(), HasSubstr("2 launches"));
  EXPECT_THAT(outcome.status.message(), HasSubstr(b));
  absl::StatusOr<std::vector<SessionStore::Lease>> sealed =
      store_->Acquire("", {b}, SessionStore::Access::kExport);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_EQ(sealed->front().length(), 9);  // nothing appended to it
}

}  // namespace
}  // namespace attention::server
