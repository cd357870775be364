// What the cache manager knows of one sequence: its blocks in order and enough of its tokens to
// key each block for the prefix cache when the block becomes full.
#pragma once
#include <cstdint>
#include <vector>

#include "cache/prefix_hash.h"

namespace pagedkv {

// A token id in append_batch that reserves the slot of a token sampled but not read back yet.
inline constexpr int32_t kPendingToken = -1;
// The block-table entry of a released leading block: a valid block id (the CPU ops check every
// entry a context covers) that attention never reads, since it starts at the window's first key.
inline constexpr int32_t kReleasedBlock = 0;

struct Sequence {
  std::vector<int32_t> blocks;       // block ids; token t lives in blocks[t / block_size]
  // The ids of the named tokens (`named` of them); kept only with prefix caching on, to key a
  // block when it becomes full and, after truncate(), to key a reopened block again.
  std::vector<int32_t> tokens;
  // Prefix-cache key of each full block of named tokens (chained: each covers its whole prefix).
  std::vector<uint64_t> full_keys;
  bool keyable = true;               // false while slots reserved without token ids are unnamed
  // Leading tokens whose ids are known: all of them, less the slots reserve() left without ids
  // until name_reserved names them.
  int64_t named = 0;
  // 1 while the last slot's token is not known yet (append_batch with kPendingToken): the engine
  // schedules step N+1 before reading step N's samples back. The token is the last of `tokens`
  // (a block it fills stays unkeyed until set_pending_tokens names it); no more slots are
  // appended until then.
  int32_t pending = 0;
  int64_t num_tokens = 0;            // tokens holding a slot, including ones not yet computed
  uint64_t batch_mark = 0;           // the last batch call that named it (catches duplicates)
  // Leading blocks given back by release_out_of_window: every token in them lies before the
  // sliding window of any token the sequence computes from then on. Their entries of `blocks`
  // hold kReleasedBlock; `window` is the window they were released for (later steps' queries and
  // truncate() must stay where that window does not reach them).
  int32_t released = 0;
  int64_t window = 0;

  uint64_t last_full_key() const { return full_keys.empty() ? kRootHash : full_keys.back(); }
};

// A whole-block copy that copy-on-write asks the device to do before the next write.
struct BlockCopy {
  int32_t src;
  int32_t dst;
};

}  // namespace pagedkv
