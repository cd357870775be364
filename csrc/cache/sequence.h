// What the cache manager knows of one sequence: its blocks in order and enough of its tokens to
// key each block for the prefix cache when the block becomes full.
#pragma once
#include <cstdint>
#include <vector>

#include "cache/prefix_hash.h"

namespace pagedkv {

struct Sequence {
  std::vector<int32_t> blocks;       // block ids; token t lives in blocks[t / block_size]
  // Tokens of the partly filled last block (num_tokens % block_size of them); kept only with
  // prefix caching on, to key the block when it becomes full.
  std::vector<int32_t> tail_tokens;
  uint64_t last_full_key = kRootHash;  // prefix-cache key of the last full block
  bool keyable = true;               // false once slots were reserved without token ids
  int64_t num_tokens = 0;            // tokens holding a slot, including ones not yet computed
  uint64_t batch_mark = 0;           // the last batch call that named it (catches duplicates)
};

// A whole-block copy that copy-on-write asks the device to do before the next write.
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

}  // namespace pagedkv
