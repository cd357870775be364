// Physical cache blocks: reference counts, a free list, and the prefix cache (full blocks keyed by
// their chained hash). A block whose last owner lets go while it holds a registered full prefix is
// not freed but parked in an LRU list: it can be revived by a later prompt with the same prefix,
// and it is evicted (its key dropped) only when the free list is empty and a block is needed.
// "Free" below counts both kinds, since either can be handed out.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace pagedkv {

class BlockAllocator {
 public:
  BlockAllocator(int32_t num_blocks, int32_t block_size, bool prefix_caching);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_.size()); }
  // Blocks that allocate() can hand out: never-used/unkeyed ones plus evictable cached ones.
  int32_t num_free() const { return static_cast<int32_t>(free_.size()) + lru_size_; }
  int32_t num_evictable() const { return lru_size_; }
  int32_t ref_count(int32_t block) const { return ref_[block]; }
  // Cached blocks with no owner, least recently freed first (the eviction order).
  std::vector<int32_t> evictable_blocks() const;

  // A block with ref count 1. The caller has checked num_free() > 0. Takes the free list first,
  // then evicts the least recently freed cached block.
  int32_t allocate();
  // One more owner; revives a cached block that had none (takes it off the LRU list).
  void add_ref(int32_t block);
  // One owner fewer; at zero a keyed block goes to the back of the LRU list, others to the free list.
  // keep_cached=false: at zero the block leaves the prefix cache too (its K/V may be unwritten).
  void release(int32_t block, bool keep_cached = true);

  // The cached block holding exactly these tokens after exactly this parent, or -1.
  int32_t find_cached(uint64_t key, uint64_t parent_key, const int32_t* tokens) const;
  // Every evictable cached block leaves the prefix cache and goes to the free list.
  void drop_cached();
  // Makes a full block findable by find_cached. A key already held by another block stays with
  // that block (this one then simply is not cached).
  void register_full(int32_t block, uint64_t key, uint64_t parent_key, const int32_t* tokens);
  // The block leaves the prefix cache (its content is about to change); a no-op if not keyed.
  void unregister(int32_t block);

 private:
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);

  int32_t block_size_;
  std::vector<int32_t> ref_;
  std::vector<int32_t> free_;  // a stack: the last block released is the next handed out

  // Intrusive doubly linked LRU list over block ids (-1 ends it): no allocation per operation.
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = -1, lru_tail_ = -1, lru_size_ = 0;

  // Prefix cache, sized only when enabled: per block its key, parent key and token ids (to rule
  // out collisions), and key -> block for the blocks that are findable.
  std::vector<uint8_t> keyed_;
  std::vector<uint64_t> key_, parent_key_;
  std::vector<int32_t> tokens_;  // [num_blocks * block_size]
  std::unordered_map<uint64_t, int32_t> block_of_key_;
};

}  // namespace pagedkv
