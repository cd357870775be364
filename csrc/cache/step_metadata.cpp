#include "cache/step_metadata.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

namespace pagedkv {
namespace {

constexpr int64_t kAlign = 16;  // int32s: 64 bytes

int64_t aligned(int64_t offset) { return (offset + kAlign - 1) / kAlign * kAlign; }

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

StepLayout::StepLayout(int32_t max_batch, int32_t max_tokens, int32_t max_blocks_per_seq)
    : max_batch(max_batch), max_tokens(max_tokens), max_blocks_per_seq(max_blocks_per_seq) {
  if (max_batch < 1 || max_tokens < max_batch || max_blocks_per_seq < 1) {
    throw std::invalid_argument("pagedkv: a step layout needs max_batch >= 1, max_tokens >= max_batch "
                                "and max_blocks_per_seq >= 1; got " + str(max_batch) + ", " +
                                str(max_tokens) + ", " + str(max_blocks_per_seq));
  }
  context_lens = 0;
  query_start_loc = aligned(context_lens + max_batch);
  slot_mapping = aligned(query_start_loc + max_batch + 1);
  positions = aligned(slot_mapping + max_tokens);
  block_tables = aligned(positions + max_tokens);
  size = block_tables + static_cast<int64_t>(max_batch) * max_blocks_per_seq;
}

int64_t StepLayout::used_size(int32_t padded_batch) const {
  if (padded_batch < 0 || padded_batch > max_batch) {
    throw std::invalid_argument("pagedkv: used_size: padded_batch = " + str(padded_batch) +
                                " is outside [0, " + str(max_batch) + "] (max_batch)");
  }
  return block_tables + static_cast<int64_t>(padded_batch) * max_blocks_per_seq;
}

StepSizes build_step_metadata(CacheManager& manager, const StepLayout& layout,
                              std::span<const int64_t> seq_ids, std::span<const int32_t> query_lens,
                              int32_t padded_batch, int32_t* buffer, int32_t pad_query_len) {
  if (seq_ids.size() > static_cast<size_t>(layout.max_batch)) {  // before it is cast to int32
    throw std::invalid_argument("pagedkv: a step of " + str(static_cast<int64_t>(seq_ids.size())) +
                                " sequences has more than " + str(layout.max_batch) + " rows (max_batch)");
  }
  const int32_t batch = static_cast<int32_t>(seq_ids.size());
  if (padded_batch < std::max(batch, 1) || padded_batch > layout.max_batch) {
    throw std::invalid_argument("pagedkv: padded_batch " + str(padded_batch) + " must be in [" +
                                str(std::max(batch, 1)) + " (the batch), max_batch " +
                                str(layout.max_batch) + "]");
  }
  if (!query_lens.empty() && query_lens.size() != seq_ids.size()) {
    throw std::invalid_argument("pagedkv: got " + str(query_lens.size()) + " query_lens for " +
                                str(batch) + " sequences; give one per sequence (or none for decode)");
  }
  if (layout.max_blocks_per_seq < manager.max_blocks_per_seq()) {
    throw std::invalid_argument("pagedkv: the step layout has rows of " + str(layout.max_blocks_per_seq) +
                                " blocks but sequences may hold " + str(manager.max_blocks_per_seq()));
  }
  int32_t* context_lens = buffer + layout.context_lens;
  int32_t* query_start_loc = buffer + layout.query_start_loc;
  int32_t* slot_mapping = buffer + layout.slot_mapping;
  int32_t* positions = buffer + layout.positions;
  int32_t* block_tables = buffer + layout.block_tables;
  const int32_t block_shift = std::countr_zero(static_cast<uint32_t>(manager.block_size()));
  const int32_t offset_mask = manager.block_size() - 1;
  if (pad_query_len < 1) {
    throw std::invalid_argument("pagedkv: pad_query_len = " + str(pad_query_len) +
                                " must be >= 1 (each padding row's tokens)");
  }
  // Every padding row takes pad_query_len tokens: check the room for them before the real rows
  // use it.
  const int64_t token_budget =
      layout.max_tokens - static_cast<int64_t>(padded_batch - batch) * pad_query_len;
  if (token_budget < 0) {
    throw std::invalid_argument("pagedkv: " + str(padded_batch - batch) + " padding rows of " +
                                str(pad_query_len) + " tokens exceed max_tokens " +
                                str(layout.max_tokens));
  }

  const uint64_t mark = manager.new_batch_mark();
  int32_t t = 0;
  StepSizes sizes{0, 0, 0};
  for (int32_t i = 0; i < batch; ++i) {
    const Sequence& seq = manager.batch_member(seq_ids[i], mark);
    const int32_t len = static_cast<int32_t>(seq.num_tokens);
    const int32_t q = query_lens.empty() ? 1 : query_lens[i];
    if (q < 1 || q > len) {
      throw std::invalid_argument("pagedkv: query_lens[" + str(i) + "] = " + str(q) + " for sequence " +
                                  str(seq_ids[i]) + " must be in [1, " + str(len) +
                                  "] (its tokens holding slots)");
    }
    if (static_cast<int64_t>(t) + q > token_budget) {  // in int64: q may be up to 2^31 - 1
      throw std::invalid_argument("pagedkv: the step has more than " + str(token_budget) +
                                  " new tokens (max_tokens " + str(layout.max_tokens) +
                                  " less padding rows); chunk the prefill or raise max_tokens");
    }
    // A sequence that released its leading blocks: the step's first query must not see them.
    const int64_t first_key = static_cast<int64_t>(len) - q - seq.window + 1;
    if (seq.released > 0 && first_key < static_cast<int64_t>(seq.released) * manager.block_size()) {
      throw std::invalid_argument("pagedkv: sequence " + str(seq_ids[i]) + " released its first " +
                                  str(seq.released) + " blocks (window " + str(seq.window) +
                                  "); a step of " + str(q) + " new tokens would attend to them");
    }
    context_lens[i] = len;
    query_start_loc[i] = t;
    const int32_t* blocks = seq.blocks.data();
    for (int32_t p = len - q; p < len; ++p, ++t) {
      positions[t] = p;
      slot_mapping[t] = (blocks[p >> block_shift] << block_shift) | (p & offset_mask);
    }
    std::memcpy(block_tables + static_cast<int64_t>(i) * layout.max_blocks_per_seq, blocks,
                seq.blocks.size() * sizeof(int32_t));
    sizes.max_query_len = std::max(sizes.max_query_len, q);
    sizes.max_context_len = std::max(sizes.max_context_len, len);
  }
  for (int32_t i = batch; i < padded_batch; ++i) {  // rows that attend to nothing, write nothing
    context_lens[i] = 0;
    query_start_loc[i] = t;
    for (int32_t j = 0; j < pad_query_len; ++j, ++t) {
      positions[t] = 0;
      slot_mapping[t] = -1;
    }
  }
  query_start_loc[padded_batch] = t;
  sizes.num_tokens = t;
  return sizes;
}

}  // namespace pagedkv
