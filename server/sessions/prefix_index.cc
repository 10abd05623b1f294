#include "server/sessions/prefix_index.h"

#include <algorithm>
#include <utility>

namespace attention::server {

PrefixIndex::Key PrefixIndex::MakeKey(uint64_t parent, absl::string_view scope,
                                      absl::Span<const int64_t> tokens) {
  return Key{.parent = parent,
             .scope = parent == 0 ? std::string(scope) : std::string(),
             .tokens = std::vector<int64_t>(tokens.begin(), tokens.end())};
}

uint64_t PrefixIndex::Find(uint64_t parent, absl::string_view scope,
                           absl::Span<const int64_t> tokens) const {
  auto it = index_.find(MakeKey(parent, scope, tokens));
  return it == index_.end() ? 0 : it->second.serial;
}

uint64_t PrefixIndex::Insert(uint64_t parent, absl::string_view scope,
                             absl::Span<const int64_t> tokens, std::vector<int32_t> pages) {
  auto [it, inserted] = index_.try_emplace(MakeKey(parent, scope, tokens));
  Block& block = it->second;
  block.serial = next_serial_++;
  block.key = &it->first;
  if (parent != 0) {
    block.parent = blocks_.at(parent);
    block.parent->children.push_back(&block);
  }
  block.pages = std::move(pages);
  block.held = static_cast<int>(block.pages.size());
  for (int32_t page : block.pages) {
    block_of_[page] = &block;
    held_[page] = 1;
  }
  blocks_.emplace(block.serial, &block);
  return block.serial;
}

const std::vector<int32_t>& PrefixIndex::Pages(uint64_t block) const {
  return blocks_.at(block)->pages;
}

bool PrefixIndex::Unheld(uint64_t block) const { return blocks_.at(block)->held == 0; }

void PrefixIndex::Held(int32_t page) {
  Block* block = block_of_[page];
  if (block == nullptr || held_[page]) return;
  held_[page] = 1;
  if (block->held++ == 0) {
    lru_.erase(block->lru);
    block->in_lru = false;
    unheld_pages_ -= static_cast<int64_t>(block->pages.size());
  }
}

void PrefixIndex::Released(int32_t page) {
  Block* block = block_of_[page];
  if (block == nullptr || !held_[page]) return;
  held_[page] = 0;
  if (--block->held == 0) {
    block->lru = lru_.insert(lru_.end(), block);
    block->in_lru = true;
    unheld_pages_ += static_cast<int64_t>(block->pages.size());
  }
}

bool PrefixIndex::Evict(std::vector<int32_t>* freed) {
  if (lru_.empty()) return false;
  Remove(lru_.front(), freed);
  return true;
}

void PrefixIndex::Remove(Block* root, std::vector<int32_t>* freed) {
  if (root->parent != nullptr) {
    std::vector<Block*>& siblings = root->parent->children;
    siblings.erase(std::find(siblings.begin(), siblings.end(), root));
  }
  // The blocks under it go too: their chains pass through it, so nothing finds them once it is
  // gone. Children first, by a stack of our own (a chain of a long prompt is thousands deep).
  std::vector<Block*> stack = {root};
  while (!stack.empty()) {
    Block* block = stack.back();
    if (!block->children.empty()) {
      stack.push_back(block->children.back());
      block->children.pop_back();
      continue;
    }
    stack.pop_back();
    Erase(block, freed);
  }
}

void PrefixIndex::Erase(Block* block, std::vector<int32_t>* freed) {
  if (block->in_lru) {
    lru_.erase(block->lru);
    unheld_pages_ -= static_cast<int64_t>(block->pages.size());
  }
  for (int32_t page : block->pages) {
    if (!held_[page]) freed->push_back(page);
    block_of_[page] = nullptr;
    held_[page] = 0;
  }
  blocks_.erase(block->serial);
  index_.erase(index_.find(*block->key));
}

}  // namespace attention::server
