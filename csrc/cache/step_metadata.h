// The metadata of one model step, written by the host straight into one packed int32 buffer
// (pinned, so it reaches the device in one copy). For each scheduled sequence i, its last
// query_lens[i] tokens are the step's new tokens: their slots were reserved (add/append) before
// the step, and the step writes their K/V before attention reads the context.
//
//   context_lens    [padded_batch]      tokens attention sees, the new ones included; padding: 0
//   query_start_loc [padded_batch + 1]  new tokens of row i are [qsl[i], qsl[i+1]) of the step
//   slot_mapping    [num_tokens]        block * block_size + offset of each new token; padding: -1
//   positions       [num_tokens]        position of each new token in its sequence; padding: 0
//   block_tables    [padded_batch, max_blocks_per_seq]  row i's blocks in order; entries past
//                   ceil(context_lens[i] / block_size) are stale or 0 but always valid block ids
//
// Padding rows (CUDA-graph buckets) hold one padding token each, so a decode bucket of B rows
// has exactly B tokens.
#pragma once
#include <cstdint>
#include <span>

#include "cache/cache_manager.h"

namespace pagedkv {

// Where each field starts in the buffer, in int32 elements (64-byte aligned). block_tables is
// last, so the used part of a step is one prefix of the buffer: one copy, no matter the batch.
struct StepLayout {
  StepLayout(int32_t max_batch, int32_t max_tokens, int32_t max_blocks_per_seq);

  int32_t max_batch, max_tokens, max_blocks_per_seq;
  int64_t context_lens, query_start_loc, slot_mapping, positions, block_tables;
  int64_t size;  // the whole buffer

  // Elements from the start of the buffer to the end of a step's block-table rows;
  // padded_batch in [0, max_batch].
  int64_t used_size(int32_t padded_batch) const;
};

struct StepSizes {
  int32_t num_tokens;       // new tokens of the step, padding tokens included
  int32_t max_query_len;    // over the real rows
  int32_t max_context_len;  // over the real rows
};

// Writes a step's metadata for seq_ids into buffer (layout.size int32s). query_lens: one per
// sequence, or empty for a decode step (1 each). padded_batch >= seq_ids.size() rows are written,
// each padding row with pad_query_len tokens (context 0, slot -1: a CUDA graph of rows of
// pad_query_len tokens, such as a speculative verification step, keeps its shape).
StepSizes build_step_metadata(CacheManager& manager, const StepLayout& layout,
                              std::span<const int64_t> seq_ids, std::span<const int32_t> query_lens,
                              int32_t padded_batch, int32_t* buffer, int32_t pad_query_len = 1);

}  // namespace pagedkv
