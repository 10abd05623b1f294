// The prefix index (prefix_index.h) alone: chains found by parent and tokens, scopes apart, the
// unheld blocks evicted least recently released first with every block under them (the pages a
// session holds never handed back), and a chain thousands of blocks deep removed at once.
#include "server/sessions/prefix_index.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace attention::server {
namespace {

// A chain of `blocks` one-page blocks of `scope` over pages 0.. (block i's tokens {i, i}).
std::vector<uint64_t> Chain(PrefixIndex& index, absl::string_view scope, int blocks,
                            int32_t first_page = 0) {
  std::vector<uint64_t> chain;
  for (int i = 0; i < blocks; ++i) {
    const int64_t tokens[] = {i, i};
    chain.push_back(index.Insert(chain.empty() ? 0 : chain.back(), scope, tokens,
                                 {first_page + static_cast<int32_t>(i)}));
  }
  return chain;
}

TEST(PrefixIndexTest, FindsABlockByItsParentTokensAndScope) {
  PrefixIndex index(8);
  const std::vector<uint64_t> chain = Chain(index, "a", 2);
  const int64_t first[] = {0, 0}, second[] = {1, 1};
  EXPECT_EQ(index.Find(0, "a", first), chain[0]);
  EXPECT_EQ(index.Find(chain[0], "a", second), chain[1]);
  EXPECT_EQ(index.Find(chain[0], "ignored under a parent", second), chain[1]);
  EXPECT_EQ(index.Find(0, "b", first), 0u);   // another scope
  EXPECT_EQ(index.Find(0, "a", second), 0u);  // not a first block
  EXPECT_EQ(index.Find(chain[1], "a", second), 0u);
  EXPECT_EQ(index.Pages(chain[1]), std::vector<int32_t>{1});
  EXPECT_TRUE(index.Cached(1));
  EXPECT_FALSE(index.Cached(2));
}

TEST(PrefixIndexTest, EvictsTheLeastRecentlyReleasedWithTheBlocksUnderIt) {
  PrefixIndex index(8);
  const std::vector<uint64_t> a = Chain(index, "a", 3, 0);  // pages 0, 1, 2
  const std::vector<uint64_t> b = Chain(index, "b", 2, 3);  // pages 3, 4
  std::vector<int32_t> freed;
  EXPECT_FALSE(index.Evict(&freed));  // every block held
  // b's first block released first, then a's last two; a's first stays held.
  for (int32_t page : {3, 2, 1}) index.Released(page);
  EXPECT_EQ(index.unheld_pages(), 3);
  // b's first goes, and b's second (held: not handed back) with it.
  ASSERT_TRUE(index.Evict(&freed));
  EXPECT_EQ(freed, std::vector<int32_t>{3});
  EXPECT_FALSE(index.Contains(b[1]));
  EXPECT_FALSE(index.Cached(4));
  // Held again, a's last block leaves the LRU; a's second goes next, taking the last (held) along.
  index.Held(2);
  EXPECT_EQ(index.unheld_pages(), 1);
  freed.clear();
  ASSERT_TRUE(index.Evict(&freed));
  EXPECT_EQ(freed, std::vector<int32_t>{1});
  EXPECT_TRUE(index.Contains(a[0]));
  EXPECT_FALSE(index.Contains(a[2]));
  EXPECT_EQ(index.unheld_pages(), 0);
  EXPECT_FALSE(index.Evict(&freed));
}

TEST(PrefixIndexTest, AChainThousandsDeepGoesAtOnce) {
  constexpr int kBlocks = 200000;
  PrefixIndex index(kBlocks);
  Chain(index, "a", kBlocks);
  // Its first block alone unheld: taking it back takes the whole chain (no recursion to overflow
  // the stack), handing back only that block's page.
  index.Released(0);
  std::vector<int32_t> freed;
  ASSERT_TRUE(index.Evict(&freed));
  EXPECT_EQ(freed, std::vector<int32_t>{0});
  EXPECT_EQ(index.blocks(), 0);
  EXPECT_FALSE(index.Cached(kBlocks - 1));
}

}  // namespace
}  // namespace attention::server
