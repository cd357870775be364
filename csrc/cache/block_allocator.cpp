#include "cache/block_allocator.h"

#include <algorithm>

namespace pagedkv {

BlockAllocator::BlockAllocator(int32_t num_blocks, int32_t block_size, bool prefix_caching)
    : block_size_(block_size),
      ref_(num_blocks, 0),
      lru_prev_(num_blocks, -1),
      lru_next_(num_blocks, -1) {
  free_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // hands out 0, 1, 2, ...
  if (prefix_caching) {
    keyed_.assign(num_blocks, 0);
    key_.assign(num_blocks, 0);
    parent_key_.assign(num_blocks, 0);
    tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
    block_of_key_.reserve(num_blocks);
  }
}

std::vector<int32_t> BlockAllocator::evictable_blocks() const {
  std::vector<int32_t> blocks;
  blocks.reserve(lru_size_);
  for (int32_t b = lru_head_; b != -1; b = lru_next_[b]) blocks.push_back(b);
  return blocks;
}

int32_t BlockAllocator::allocate() {
  int32_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else {
    block = lru_head_;
    lru_remove(block);
    unregister(block);
  }
  ref_[block] = 1;
  return block;
}

void BlockAllocator::add_ref(int32_t block) {
  if (ref_[block]++ == 0) lru_remove(block);  // only keyed blocks are kept with no owner
}

void BlockAllocator::release(int32_t block, bool keep_cached) {
  if (--ref_[block] > 0) return;
  if (!keep_cached) unregister(block);
  if (!keyed_.empty() && keyed_[block]) {
    lru_push_back(block);
  } else {
    free_.push_back(block);
  }
}

int32_t BlockAllocator::find_cached(uint64_t key, uint64_t parent_key,
                                    const int32_t* tokens) const {
  const auto it = block_of_key_.find(key);
  if (it == block_of_key_.end()) return -1;
  const int32_t block = it->second;
  const int32_t* stored = tokens_.data() + static_cast<size_t>(block) * block_size_;
  const bool same = parent_key_[block] == parent_key && std::equal(tokens, tokens + block_size_, stored);
  return same ? block : -1;
}

void BlockAllocator::register_full(int32_t block, uint64_t key, uint64_t parent_key,
                                   const int32_t* tokens) {
  if (!block_of_key_.emplace(key, block).second) return;
  keyed_[block] = 1;
  key_[block] = key;
  parent_key_[block] = parent_key;
  std::copy(tokens, tokens + block_size_, tokens_.begin() + static_cast<size_t>(block) * block_size_);
}

void BlockAllocator::drop_cached() {
  while (lru_head_ != -1) {
    const int32_t block = lru_head_;
    lru_remove(block);
    unregister(block);
    free_.push_back(block);
  }
}

void BlockAllocator::unregister(int32_t block) {
  if (keyed_.empty() || !keyed_[block]) return;
  block_of_key_.erase(key_[block]);
  keyed_[block] = 0;
}

void BlockAllocator::lru_push_back(int32_t block) {
  lru_prev_[block] = lru_tail_;
  lru_next_[block] = -1;
  if (lru_tail_ != -1) {
    lru_next_[lru_tail_] = block;
  } else {
    lru_head_ = block;
  }
  lru_tail_ = block;
  ++lru_size_;
}

void BlockAllocator::lru_remove(int32_t block) {
  const int32_t prev = lru_prev_[block], next = lru_next_[block];
  (prev != -1 ? lru_next_[prev] : lru_head_) = next;
  (next != -1 ? lru_prev_[next] : lru_tail_) = prev;
  lru_prev_[block] = lru_next_[block] = -1;
  --lru_size_;
}

}  // namespace pagedkv
