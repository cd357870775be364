// Host-side planning of paged decode attention, from shapes only (never from context_lens, so
// one plan holds for a whole CUDA graph bucket). Plain C++ (no CUDA, no torch): the CPU build
// compiles it too, so the split heuristic is tested without a GPU.
#pragma once
#include <algorithm>
#include <cstdint>

namespace pagedkv::kernels {

inline constexpr int kPagedMaxGroup = 8;     // query heads one CTA serves; larger groups chunked

// Whether the kernel runs its tensor-core main loop (kernels/paged_decode_attention_mma.cuh):
// bf16/fp16 at head_dim 64, 128 or 256. Other shapes and fp32 take the CUDA-core loop. At head_dim
// 256 the loop's Q fragments and O accumulators take 96 registers, which spill at 3-4 CTAs per SM,
// so those CTAs run 2 per SM (paged_ctas_per_sm); the CUDA-core loop there peaks at ~1.7 TB/s
// (its per-token shuffles, not its loads, bound it: H100, session 25).
constexpr bool paged_decode_tensor_cores(int head_dim, int elem_bytes) {
  return elem_bytes == 2 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// CTAs of 128 threads resident per SM: the kernel's launch bounds hold its registers to this
// (65536 / (128 * n) per thread: 128, 170, 255), and the split heuristic plans with it. On the
// CUDA-core loop each query head of the group costs a lane 2 x 8 fp32 registers (query and output
// slices); the tensor-core loop needs at most 116 at any group and 32 KB of shared memory: 4 CTAs
// (of 4 warps; 2 of the 8-warp CTAs paged_decode_warps picks) up to head_dim 128, 2 at 256.
constexpr int paged_ctas_per_sm(int padded_group, bool tensor_cores, int head_dim = 128) {
  return tensor_cores ? (head_dim > 128 ? 2 : 4) : padded_group >= 8 ? 2 : padded_group >= 4 ? 3 : 4;
}

// How a kv head's group of query heads is cut into CTAs: `chunks` CTAs of at most
// `chunk_heads` heads, each compiled for `padded` (chunk_heads rounded up to 1, 2, 4 or 8).
struct HeadGroups {
  int group_size, chunks, chunk_heads, padded;
};

inline HeadGroups paged_head_groups(int num_q_heads, int num_kv_heads) {
  HeadGroups g{};
  g.group_size = num_q_heads / num_kv_heads;
  g.chunks = (g.group_size + kPagedMaxGroup - 1) / kPagedMaxGroup;
  g.chunk_heads = (g.group_size + g.chunks - 1) / g.chunks;
  g.padded = 1;
  while (g.padded < g.chunk_heads) g.padded *= 2;
  return g;
}

// Blocks of each split when a table of max_blocks is cut into `splits` (the last may hold
// fewer): a split starts at a block boundary, so no 8-token stage of the tensor-core loop
// straddles two blocks.
inline int64_t paged_blocks_per_split(int64_t max_blocks, int64_t splits) {
  return (max_blocks + splits - 1) / splits;
}

// The fewest splits (each a whole number of blocks, at most max_blocks) whose CTAs fill their
// waves of `slots` to >= 95%, else the fullest: a partial last wave leaves SMs idle.
inline int64_t paged_splits_filling(int64_t ctas, int64_t slots, int64_t max_blocks) {
  // Past slots / ctas + 20 splits every wave count is >= 20, so >= 95% full: no need to look.
  const int64_t max_splits = std::min(max_blocks, slots / ctas + 20);
  int64_t best = 1, best_num = 0, best_den = 1;  // fullness of the best so far: num / den
  for (int64_t splits = 1; splits <= max_splits; ++splits) {
    const int64_t blocks_per_split = paged_blocks_per_split(max_blocks, splits);
    const int64_t used = (max_blocks + blocks_per_split - 1) / blocks_per_split;
    if (used != splits) continue;  // rounding to whole blocks gives the same as fewer splits
    const int64_t work = ctas * splits;
    const int64_t capacity = (work + slots - 1) / slots * slots;
    if (20 * work >= 19 * capacity) return splits;
    if (work * best_den > best_num * capacity) best = splits, best_num = work, best_den = capacity;
  }
  return best;
}

// Split length from which a split grid of at most one CTA per SM runs 8-warp CTAs: a shorter
// split's 8 warps finish in a round or two of 8 tokens each, where the prologue and the merge
// dominate (1x1024 at 16 splits of 64 tokens ran 2.5% slower on 8 warps, session 10).
inline constexpr int64_t kWideSplitTokens = 512;

// Warps per CTA on the tensor-core loop (the CUDA-core loop always runs 4): 8 when the grid has at
// most one CTA per SM, so no SM has a second CTA's warps to keep its loads in flight, and is
// unsplit or split into pieces of >= kWideSplitTokens (counted in head_dim-128 tokens: a token of
// head_dim 256 is two); else 4. `ctas` counts the CTAs of the launch (with its splits and head
// chunks), `split_tokens` the tokens of a split.
inline int paged_decode_warps(int64_t num_splits, int64_t ctas, int64_t num_sms,
                              int64_t split_tokens, int64_t head_dim = 128) {
  const int64_t wide = split_tokens * std::max<int64_t>(head_dim, 128) / 128;
  return ctas <= num_sms && (num_splits == 1 || wide >= kWideSplitTokens) ? 8 : 4;
}

// Splits of each sequence's context (>= 1), from shapes only. Every SM should stream K/V, but a
// CTA beyond the first on an SM pays its own prologue (context length -> block table -> K/V,
// three dependent reads) and one more partial to merge, which only long splits repay. So: the
// fewest splits that fill one CTA per SM (kept as they are where those CTAs run 8 warps), or k
// CTAs per SM (up to what the kernel allows) where each split then keeps >= 256 * (k - 1) tokens
// (768 * (k - 1) on the tensor-core loop, whose CTAs stream faster, so their fixed costs weigh
// more); none when the unsplit CTAs already run >= 4 waves (the tail wave costs less than the
// splits' merges). On the H100 (132 SMs) this gives what a sweep of num_splits measured best or
// within 1% of it (lab/measurements.md, sessions 9-11): W3 (bf16, head_dim 128, tensor cores)
// 1x1024 16, 1x8192 16 (8-warp CTAs), 1x32768 16 (8-warp), 16x4096 1 (8-warp), 64x2048 1,
// 256x1024 1; W1 (28 q / 4 kv heads, 16-block tables) batch 1 16, batch 8 4, batch 32 1
// (8-warp; 9.2 us against 11.2 at 2 splits of 4 warps). Off W3, 4x8192 gets 4 splits of 8 warps
// (51.6 us in a probe against 51.2 at 8 of 4 warps, session 11). (The CUDA-core loop's sweep,
// 2026-11-24: W3 16, 32, 48, 12, 3, 3, 1.)
inline int paged_decode_num_splits(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                   int64_t block_size, int64_t max_blocks, int64_t num_sms,
                                   bool tensor_cores, int64_t head_dim = 128) {
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads < num_kv_heads || block_size <= 0 ||
      max_blocks <= 1 || num_sms <= 0) {
    return 1;
  }
  const HeadGroups g =
      paged_head_groups(static_cast<int>(num_q_heads), static_cast<int>(num_kv_heads));
  const int64_t ctas = batch * num_kv_heads * g.chunks;  // unsplit
  const int max_per_sm = paged_ctas_per_sm(g.padded, tensor_cores, static_cast<int>(head_dim));
  // per split, per CTA an SM adds; tensor cores: 768 tokens of head_dim 128, as many bytes above
  const int64_t min_tokens = tensor_cores ? 768 * 128 / std::max<int64_t>(head_dim, 128) : 256;
  if (ctas >= 4 * num_sms * max_per_sm) return 1;
  int64_t splits = paged_splits_filling(ctas, num_sms, max_blocks);
  // A grid that fills one CTA per SM runs so, as 8-warp CTAs on tensor cores, when they are wide
  // (paged_decode_warps): at one wave a second CTA per SM gained less than its merge and its
  // prologue cost (16x4096: 93.4 us unsplit against 95.1 at 2 splits of 4-warp CTAs, session
  // 10; 1x32768: 51.9 us at 16 splits of 8-warp CTAs against 52.5-52.7 at 32 of 4, session 11).
  const int64_t split_tokens = paged_blocks_per_split(max_blocks, splits) * block_size;
  if (tensor_cores && paged_decode_warps(splits, ctas * splits, num_sms, split_tokens, head_dim) == 8) {
    return static_cast<int>(splits);
  }
  for (int per_sm = 2; per_sm <= max_per_sm; ++per_sm) {
    const int64_t more = paged_splits_filling(ctas, per_sm * num_sms, max_blocks);
    const int64_t tokens = paged_blocks_per_split(max_blocks, more) * block_size;
    if (tokens >= min_tokens * (per_sm - 1)) splits = more;
  }
  return static_cast<int>(splits);
}

// The split path's workspace, in fp32 units: int32 merge counters per (sequence, query head),
// padded to 16 bytes, which must be zero before the first launch (the kernel leaves them zero);
// then per (sequence, query head, split) a normalized partial output [head_dim] and its softmax
// (max, sum). Zero without splits.
inline int64_t paged_decode_counter_floats(int64_t batch, int64_t num_q_heads) {
  return (batch * num_q_heads + 3) / 4 * 4;
}
inline int64_t paged_decode_workspace_floats(int64_t batch, int64_t num_q_heads,
                                             int64_t head_dim, int64_t num_splits) {
  return num_splits <= 1 ? 0
                         : paged_decode_counter_floats(batch, num_q_heads) +
                               batch * num_q_heads * num_splits * (head_dim + 2);
}

}  // namespace pagedkv::kernels
