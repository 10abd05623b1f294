#include "server/sessions/step_plan.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/paged_kv_pool.h"

namespace attention::server {
namespace {

using ::testing::ElementsAre;

constexpr KvShape kShape{.dtype = DType::kFloat32, .heads_kv = 2, .head_dim = 8};
constexpr int64_t kHq = 4;
constexpr int64_t kPageBytes = 16 * 2 * 2 * 8 * 4;  // 16 rows of K and V

DecodeKey Key(bool lse) {
  return DecodeKey{.shape = kShape, .heads_q = kHq, .softmax_scale = 0.5f, .lse = lse};
}

// One sequence's buffers: q [Hq, nq, D] random, o and lse poisoned.
struct SeqData {
  SeqData(std::vector<int32_t> pages_in, int64_t length_in, int64_t nq, std::mt19937& rng)
      : pages(std::move(pages_in)),
        length(length_in),
        q(kHq * nq * kShape.head_dim),
        o(q.size(), -777.0f),
        lse(kHq * nq, -777.0f) {
    std::normal_distribution<float> normal;
    for (float& x : q) x = normal(rng);
  }
  DecodeSequence View() {
    return DecodeSequence{.pages = pages,
                          .length = length,
                          .q = q.data(),
                          .rows_q = static_cast<int64_t>(lse.size()) / kHq,
                          .o = o.data(),
                          .lse = lse.data()};
  }
  std::vector<int32_t> pages;
  int64_t length;
  std::vector<float> q, o, lse;
};

TEST(DecodePlanTest, LaysOutSequencesOfSeveralLengthsAndPageCounts) {
  std::mt19937 rng(7);
  SeqData a({4, 9}, 20, 1, rng), b({3}, 5, 3, rng), c({1, 2, 6}, 40, 2, rng);
  const DecodePlan plan(Key(true), {a.View(), b.View(), c.View()});
  const PagedDecodeParams& p = plan.params();
  EXPECT_EQ(p.num_seqs, 3);
  EXPECT_EQ(p.total_q, 6);
  EXPECT_EQ(p.max_seqlen_q, 3);
  EXPECT_EQ(p.max_seqlen_k, 40);
  EXPECT_THAT(std::vector<int32_t>(p.cu_seqlens_q, p.cu_seqlens_q + 4), ElementsAre(0, 1, 4, 6));
  EXPECT_THAT(std::vector<int32_t>(p.seqlens_k, p.seqlens_k + 3), ElementsAre(20, 5, 40));
  // One row of the page table a sequence, as wide as the longest, the rest zeros.
  EXPECT_EQ(p.page_table_stride, 3);
  EXPECT_THAT(std::vector<int32_t>(p.page_table, p.page_table + 9),
              ElementsAre(4, 9, 0, 3, 0, 0, 1, 2, 6));
  EXPECT_EQ(p.softmax_scale, 0.5f);
  // Every sequence's q, o and lse where it keeps them: the pool gathers and scatters.
  EXPECT_EQ(p.q, nullptr);
  EXPECT_EQ(p.o, nullptr);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_THAT(std::vector<const void*>(p.q_seqs, p.q_seqs + 3),
              ElementsAre(a.q.data(), b.q.data(), c.q.data()));
  EXPECT_THAT(std::vector<void*>(p.o_seqs, p.o_seqs + 3),
              ElementsAre(a.o.data(), b.o.data(), c.o.data()));
  ASSERT_NE(p.lse_seqs, nullptr);
  EXPECT_THAT(std::vector<float*>(p.lse_seqs, p.lse_seqs + 3),
              ElementsAre(a.lse.data(), b.lse.data(), c.lse.data()));
  const DecodePlan without(Key(false), {a.View()});
  EXPECT_EQ(without.params().lse_seqs, nullptr);
}

// A launch of several sequences answers each exactly as its own launch does, in its own buffers.
TEST(DecodePlanTest, SharedLaunchWritesWhatEachSequenceAloneGets) {
  std::mt19937 rng(9);
  absl::StatusOr<std::unique_ptr<KvPagePool>> pool =
      cpu::MakeKvPagePool(/*num_pages=*/8, kPageBytes, /*threads=*/1);
  ASSERT_TRUE(pool.ok()) << pool.status();
  // Three sequences' K/V written into their pages: [Hkv, rows, D] random.
  std::vector<std::vector<int32_t>> tables = {{5, 0}, {2}, {7, 1, 3}};
  std::vector<int64_t> lengths = {19, 9, 33};
  std::vector<std::vector<float>> kv(3);
  std::vector<KvWrite> writes;
  std::normal_distribution<float> normal;
  for (int s = 0; s < 3; ++s) {
    kv[s].resize(kShape.heads_kv * lengths[s] * kShape.head_dim);
    for (float& x : kv[s]) x = normal(rng);
    writes.push_back(KvWrite{.shape = kShape,
                             .page_table = tables[s].data(),
                             .rows = lengths[s],
                             .k = kv[s].data(),
                             .v = kv[s].data(),
                             .head_stride = lengths[s] * kShape.head_dim,
                             .row_stride = kShape.head_dim});
  }
  ASSERT_EQ((*pool)->Write(writes), absl::OkStatus());

  std::vector<SeqData> shared, alone;
  for (int s = 0; s < 3; ++s) {
    shared.emplace_back(tables[s], lengths[s], 1 + s, rng);
    alone.push_back(shared.back());
  }
  std::vector<DecodeSequence> views;
  for (SeqData& d : shared) views.push_back(d.View());
  const DecodePlan plan(Key(true), views);
  ASSERT_TRUE((*pool)->Decode(plan.params()).ok());
  for (int s = 0; s < 3; ++s) {
    const DecodePlan own(Key(true), {alone[s].View()});
    ASSERT_TRUE((*pool)->Decode(own.params()).ok());
    EXPECT_EQ(shared[s].o, alone[s].o) << "sequence " << s;
    EXPECT_EQ(shared[s].lse, alone[s].lse) << "sequence " << s;
    EXPECT_NE(shared[s].o.front(), -777.0f) << "sequence " << s << " left unwritten";
  }
}

TEST(CheckQueriesFitTest, QueriesAreTheSessionsLastPositions) {
  auto field = [] { return std::string("entries[4].q.shape[1] (queries)"); };
  EXPECT_EQ(CheckQueriesFit(field, /*rows_q=*/1, /*new_rows=*/1, /*length=*/0), absl::OkStatus());
  const absl::Status status = CheckQueriesFit(field, 3, 1, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "entries[4].q.shape[1] (queries): expected at most the session's 2 rows after this "
            "step's append (queries are its last positions), got 3");
  EXPECT_EQ(CheckQueriesFit(field, 3, 1, 2), absl::OkStatus());
}

}  // namespace
}  // namespace attention::server
