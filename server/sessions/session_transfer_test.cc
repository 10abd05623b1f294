#include "server/sessions/session_transfer.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

using ::testing::HasSubstr;

TEST(ExportChunks, EachLayerInOrderSkippingEmptyOnes) {
  ExportChunks chunks({5, 0, 2}, 2);
  std::vector<std::tuple<int, int64_t, int64_t>> got;
  while (std::optional<RowChunk> c = chunks.Next())
    got.emplace_back(c->layer, c->first_row, c->rows);
  EXPECT_EQ(got, (std::vector<std::tuple<int, int64_t, int64_t>>{
                     {0, 0, 2}, {0, 2, 2}, {0, 4, 1}, {2, 0, 2}}));
  EXPECT_FALSE(chunks.Next().has_value());
}

TEST(ImportProgress, TakesAnExportsChunksAndIsWhole) {
  ImportProgress progress({5, 0, 2});
  EXPECT_THAT(progress.Whole().message(), HasSubstr("0 of layer 0's 5 rows"));
  ExportChunks chunks({5, 0, 2}, 3);
  while (std::optional<RowChunk> c = chunks.Next()) ASSERT_TRUE(progress.Take(*c).ok());
  EXPECT_TRUE(progress.Whole().ok());
  EXPECT_THAT(progress.Take({.layer = 2, .first_row = 2, .rows = 1}).message(),
              HasSubstr("layer: expected none (every declared row came)"));
}

TEST(ImportProgress, RefusesChunksOutOfOrderOrBeyondTheDeclaredRows) {
  ImportProgress progress({4, 3});
  EXPECT_THAT(progress.Take({.layer = 2, .first_row = 0, .rows = 1}).message(),
              HasSubstr("layer: expected 0..1 (the header's layers), got 2"));
  EXPECT_THAT(progress.Take({.layer = 1, .first_row = 0, .rows = 1}).message(),
              HasSubstr("layer: expected 0 (layers in order"));
  EXPECT_THAT(progress.Take({.layer = 0, .first_row = 1, .rows = 1}).message(),
              HasSubstr("first_row: expected 0"));
  EXPECT_THAT(progress.Take({.layer = 0, .first_row = 0, .rows = 5}).message(),
              HasSubstr("k.shape: expected 1..4 rows"));
  ASSERT_TRUE(progress.Take({.layer = 0, .first_row = 0, .rows = 4}).ok());
  EXPECT_THAT(progress.Whole().message(), HasSubstr("got 0 of layer 1's 3 rows"));
}

}  // namespace
}  // namespace attention::server
