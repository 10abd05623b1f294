// One device's index of cached prefixes (sessions created from a prefix another session holds):
// blocks of page_rows rows whose tokens are known, one page per layer of a session group, found
// by their content and their place in a chain, as vLLM's automatic prefix caching keys a block
// by (parent block, its tokens, extra keys) and SGLang's radix cache walks a tree of them.
//
// A block's key is its parent block (0: the chain's first block), its tokens, and for a first
// block the chain's scope (the owner, shape and layer count: tenants never share, and a block of
// another shape is never found). Keys are compared whole (a hash map over the full key), so a
// hash collision costs a probe, never a wrong hit. A parent is named by its serial, never reused,
// so a chain whose block was evicted cannot be found again through a newer block at its place.
//
// The index does not hold pages: the store's sessions do (their reference counts). It is told
// when a cached page gains its first holder (Held) and loses its last (Released); a block no
// session holds any page of is kept, least recently released first, until the store needs its
// pages (Evict): then it and every block under it leave the index, and the pages of theirs no
// session holds are handed back to be free. A held page is never handed back.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attention::server {

class PrefixIndex {
 public:
  explicit PrefixIndex(int64_t num_pages) : block_of_(num_pages, nullptr), held_(num_pages, 0) {}

  // The block after `parent` (0: a chain's first, of `scope`) whose tokens are `tokens`, or 0.
  uint64_t Find(uint64_t parent, absl::string_view scope, absl::Span<const int64_t> tokens) const;
  // Adds that block, its rows in `pages` (one per layer, each held by a session and in no
  // block); `parent` is 0 or a block of the index. Returns its serial.
  uint64_t Insert(uint64_t parent, absl::string_view scope, absl::Span<const int64_t> tokens,
                  std::vector<int32_t> pages);
  bool Contains(uint64_t block) const { return blocks_.contains(block); }
  // The pages of a block of the index (one per layer).
  const std::vector<int32_t>& Pages(uint64_t block) const;
  // Whether a block is no session's (what Evict may take): its pages count as room.
  bool Unheld(uint64_t block) const;
  bool Cached(int32_t page) const { return block_of_[page] != nullptr; }

  // A cached page's first holder came (its reference count went 0 → 1), or its last went.
  void Held(int32_t page);
  void Released(int32_t page);

  // Pages of blocks no session holds: evictable.
  int64_t unheld_pages() const { return unheld_pages_; }
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Removes the least recently released block no session holds, and every block under it;
  // appends the pages no session holds to `freed` (at least the block's own). Returns false when
  // no block is unheld.
  bool Evict(std::vector<int32_t>* freed);

 private:
  struct Key {
    uint64_t parent = 0;
    std::string scope;  // a first block's; empty under a parent (which fixes the scope)
    std::vector<int64_t> tokens;

    bool operator==(const Key& other) const {
      return parent == other.parent && scope == other.scope && tokens == other.tokens;
    }
    template <typename H>
    friend H AbslHashValue(H h, const Key& key) {
      return H::combine(std::move(h), key.parent, key.scope, key.tokens);
    }
  };
  struct Block {
    uint64_t serial = 0;
    const Key* key = nullptr;  // the map's
    Block* parent = nullptr;
    std::vector<Block*> children;
    std::vector<int32_t> pages;
    int held = 0;  // of `pages`, those a session holds
    bool in_lru = false;
    std::list<Block*>::iterator lru;
  };

  static Key MakeKey(uint64_t parent, absl::string_view scope, absl::Span<const int64_t> tokens);
  // Removes `root` and every block under it; Erase: one block, its children gone already.
  void Remove(Block* root, std::vector<int32_t>* freed);
  void Erase(Block* block, std::vector<int32_t>* freed);

  absl::node_hash_map<Key, Block, absl::Hash<Key>> index_;
  absl::flat_hash_map<uint64_t, Block*> blocks_;  // by serial
  std::vector<Block*> block_of_;                  // per page: the block it caches, or null
  std::vector<uint8_t> held_;                     // per cached page: a session holds it
  std::list<Block*> lru_;                         // unheld blocks, least recently released first
  int64_t unheld_pages_ = 0;
  uint64_t next_serial_ = 1;
};

}  // namespace attention::server
