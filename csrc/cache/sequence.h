// What the cache manager knows of one sequence: its blocks in order and enough of its tokens to
// key each block for the prefix cache when the block becomes full.
#pragma once
#include <cstdint>
#include <vector>

#include "cache/prefix_hash.h"

namespace pagedkv {

// A token id in append_batch that reserves the slot of a token sampled but not read back yet.
inline constexpr int32_t kPendingToken = -1;

struct Sequence {
  std::vector<int32_t> blocks;       // block ids; token t lives in blocks[t / block_size]
  // Tokens of the partly filled last block (num_tokens % block_size of them); kept only with
  // prefix caching on, to key the block when it becomes full.
  std::vector<int32_t> tail_tokens;
  uint64_t last_full_key = kRootHash;  // prefix-cache key of the last full block
  bool keyable = true;               // false while slots reserved without token ids are unnamed
  // Leading tokens whose ids are known: all of them, less the slots reserve() left without ids
  // until name_reserved names them.
  int64_t named = 0;
  // 1 while the last slot's token is not known yet (append_batch with kPendingToken): the engine
  // schedules step N+1 before reading step N's samples back. The token is the last of
  // tail_tokens (a full tail stays unkeyed until set_pending_tokens names it); no more slots are
  // appended until then.
  int32_t pending = 0;
  int64_t num_tokens = 0;            // tokens holding a slot, including ones not yet computed
  uint64_t batch_mark = 0;           // the last batch call that named it (catches duplicates)
};

// A whole-block copy that copy-on-write asks the device to do before the next write.
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

}  // namespace pagedkv
