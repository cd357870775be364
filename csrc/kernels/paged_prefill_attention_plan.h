// Host-side planning of paged prefill attention, from shapes only (never from the device's
// metadata, so a plan holds without a sync). Plain C++ (no CUDA, no torch): the CPU build sizes
// the split workspace with it too, and CI tests the split rule without a GPU.
#pragma once
#include <algorithm>
#include <cstdint>

namespace pagedkv::kernels {

inline constexpr int kPrefillMaxChunkHeads = 16;  // larger groups are cut: >= 4 tokens a 64-row tile
inline constexpr int kPrefillSplitRows = 128;     // rows of the CTAs a split launch runs
inline constexpr int kPrefillSplitKeyTile = 64;   // keys of their K/V tiles: a split is whole tiles
// A split's fewest keys: its CTA's prologue (Q tile, first K/V tile) and its partials' round
// trip through the workspace weigh little against 8 or more K/V tiles.
inline constexpr int64_t kPrefillSplitMinKeys = 512;

// How a kv head's group of query heads is cut into CTAs: `chunks` CTAs of <= `chunk_heads` heads.
struct PrefillHeadGroups {
  int group_size, chunks, chunk_heads;
};
inline PrefillHeadGroups prefill_head_groups(int num_q_heads, int num_kv_heads) {
  PrefillHeadGroups g{};
  g.group_size = num_q_heads / num_kv_heads;
  g.chunks = (g.group_size + kPrefillMaxChunkHeads - 1) / kPrefillMaxChunkHeads;
  g.chunk_heads = (g.group_size + g.chunks - 1) / g.chunks;
  return g;
}

// Query tiles of `tokens_per_tile` tokens over the whole batch (the kernels' flat tiles,
// paged_prefill_attention_common.cuh's cta_work): at most num_tokens / tokens_per_tile + batch in
// all, and at most ceil(max_query_len / tokens_per_tile) + 1 per sequence; whichever bound is
// smaller.
inline int64_t prefill_tiles(int64_t num_tokens, int64_t batch, int64_t max_query_len,
                             int64_t tokens_per_tile) {
  const int64_t by_tokens = num_tokens / tokens_per_tile + batch;
  const int64_t by_length = batch * ((max_query_len + tokens_per_tile - 1) / tokens_per_tile + 1);
  return std::min(by_tokens, by_length);
}

// Whether a launch of these shapes may split: the tensor-core kernel's 128-row CTAs (bf16/fp16,
// head_dim <= 128).
constexpr bool prefill_can_split(int head_dim, int elem_bytes) {
  return elem_bytes == 2 && head_dim <= 128;
}

// Splits of each 128-row CTA's keys (1: unsplit). A batch of few new tokens over a long context
// (a short turn after a long cached conversation, a chunk of a long prompt) gives few CTAs, each
// walking the whole context: split their keys so that the SMs hold two CTAs each, as many splits
// as fit in that one wave with >= kPrefillSplitMinKeys keys each. None when the unsplit grid
// already fills two CTAs an SM. The CTA count is prefill_tiles' bound, one tile a sequence above
// the tiles that hold tokens at most (those CTAs return at once), hence the wave's 1/8 slack
// (1x512/8192: 136 CTAs counted, 128 that work, 2 splits). max_tokens: max_blocks * block_size.
inline int64_t paged_prefill_num_splits(int64_t num_tokens, int64_t batch, int64_t max_query_len,
                                        int64_t num_q_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t elem_bytes, int64_t max_tokens,
                                        int64_t num_sms) {
  if (!prefill_can_split(static_cast<int>(head_dim), static_cast<int>(elem_bytes)) ||
      num_tokens <= 0 || batch <= 0 || max_query_len <= 0 || num_kv_heads <= 0 ||
      num_q_heads < num_kv_heads || num_sms <= 0) {
    return 1;
  }
  const PrefillHeadGroups g =
      prefill_head_groups(static_cast<int>(num_q_heads), static_cast<int>(num_kv_heads));
  const int64_t ctas = prefill_tiles(num_tokens, batch, max_query_len, kPrefillSplitRows / g.chunk_heads) *
                       num_kv_heads * g.chunks;
  const int64_t slots = 2 * num_sms;  // the tensor-core kernel runs two CTAs an SM
  const int64_t by_grid = slots * 9 / 8 / std::max<int64_t>(ctas, 1);
  const int64_t by_keys = max_tokens / kPrefillSplitMinKeys;
  return std::max<int64_t>(1, std::min(by_grid, by_keys));
}

// Keys of each split (the last may hold fewer): whole K/V tiles.
inline int64_t paged_prefill_keys_per_split(int64_t max_tokens, int64_t splits) {
  const int64_t keys = (max_tokens + splits - 1) / splits;
  return (keys + kPrefillSplitKeyTile - 1) / kPrefillSplitKeyTile * kPrefillSplitKeyTile;
}

// The split launch's fp32 workspace: per (split, q row, query head) an unnormalized partial
// output [head_dim], then its (max, sum). 0 unsplit.
inline int64_t paged_prefill_workspace_floats(int64_t num_tokens, int64_t num_q_heads,
                                              int64_t head_dim, int64_t splits) {
  return splits <= 1 ? 0 : splits * num_tokens * num_q_heads * (head_dim + 2);
}

}  // namespace pagedkv::kernels
