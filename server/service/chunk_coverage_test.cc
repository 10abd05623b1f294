#include "server/service/chunk_coverage.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

// 10000 chunks of 4 bytes in order: one stretch kept, not one per chunk.
TEST(ChunkCoverageTest, AdjacentChunksMerge) {
  ChunkCoverage coverage;
  for (int64_t at = 0; at < 40000; at += 4) {
    ASSERT_TRUE(coverage.Add("k", at, 4).ok());
    EXPECT_EQ(coverage.ranges(), 1u);
  }
  EXPECT_EQ(coverage.received(), 40000);
}

// Chunks in a random order: the stretches kept never outnumber the gaps between them plus one,
// and end as one.
TEST(ChunkCoverageTest, ChunksInAnyOrderMergeAsTheGapsClose) {
  std::vector<int64_t> order(1000);
  std::iota(order.begin(), order.end(), 0);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  ChunkCoverage coverage;
  std::vector<bool> have(order.size(), false);
  for (int64_t i : order) {
    ASSERT_TRUE(coverage.Add("q", i * 8, 8).ok());
    have[i] = true;
    size_t stretches = 0;
    for (size_t j = 0; j < have.size(); ++j) stretches += have[j] && (j == 0 || !have[j - 1]);
    ASSERT_EQ(coverage.ranges(), stretches);
  }
  EXPECT_EQ(coverage.ranges(), 1u);
  EXPECT_EQ(coverage.received(), 8000);
}

// Merged stretches still refuse a byte that came before, named with the stretch it lies in.
TEST(ChunkCoverageTest, OverlapsWithMergedStretchesAreRefused) {
  ChunkCoverage coverage;
  ASSERT_TRUE(coverage.Add("v", 0, 10).ok());
  ASSERT_TRUE(coverage.Add("v", 10, 10).ok());
  ASSERT_TRUE(coverage.Add("v", 30, 10).ok());
  const absl::Status status = coverage.Add("v", 19, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("chunk of v: bytes [19, 21) overlap bytes [0, 20)"));
  EXPECT_EQ(coverage.Add("v", 29, 2).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(coverage.Add("v", 20, 10).ok());
  EXPECT_EQ(coverage.ranges(), 1u);
  EXPECT_EQ(coverage.received(), 40);
}

}  // namespace
}  // namespace attention::server
