// What both paged prefill kernels share: the host plan, the work of one CTA (which sequence, kv
// head, head chunk and query tile), and the cp.async loaders of the Q tile and of K/V tiles read
// through the block table. A CTA's rows (64 on CUDA cores, 64 or 128 on tensor cores) are (token,
// query head) pairs of one kv head's group: row r is token r / heads, head r % heads, so each K/V
// tile in shared memory serves the group.
#pragma once
#include <cstdint>

#include "kernels/attention_sink.cuh"
#include "kernels/common.cuh"
#include "kernels/mma.cuh"
#include "kernels/paged_decode_attention_common.cuh"
#include "kernels/paged_prefill_attention.h"
#include "kernels/paged_prefill_attention_plan.h"

namespace pagedkv::kernels::prefill {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;   // "no key yet": finite, so exp2f(kNegBig - x) is 0, not NaN

using decode::softcap_log2;  // the logit softcap in log2 units (paged_decode_attention_common.cuh)

// Shared-memory row stride of Q/K/V tiles in elements: 16 bytes of padding shift consecutive
// rows by 4 banks (8 rows read side by side hit distinct banks; ldmatrix is conflict-free) and
// keep rows 16-byte aligned.
template <typename T, int D>
constexpr int row_stride() { return D + 16 / static_cast<int>(sizeof(T)); }

// Computed on the host from shapes and max_query_len only.
struct Plan {
  int group_size;       // num_q_heads / num_kv_heads
  int head_chunks;      // CTAs that split one kv head's group of query heads
  int chunk_heads;      // query heads per chunk (the last chunk may have fewer)
  int tokens_per_tile;  // the kernel's rows / chunk_heads
  int tiles;            // query tiles of the whole batch (see cta_work)
  int block_shift;      // log2(block_size)
  int max_tokens;       // max_blocks * block_size: context_lens are clamped to it
  int splits;           // CTAs that split one query tile's keys (paged_prefill_num_splits)
  int keys_per_split;   // a multiple of the K/V tile (paged_prefill_keys_per_split)
};

struct Work {
  int b, kv_head, first, q_len, tok0, head0, heads, rows;
  int pos0;       // position of the tile's first token (< 0: rows before the context, zeros)
  // The CTA's K/V tiles start at key_begin, and keys key_lo .. kv_end - 1 are read (the CTA's
  // split of the tile's keys; from a sliding window's first key on). The tiles are zeros
  // elsewhere, their keys masked. key_begin is key_lo, but for a split starting at a window's
  // first key: there it is the start of that key's K/V tile of the split, so that the split's
  // last tile still ends at the split's end (a tile past it would hold the next split's keys).
  int key_begin, key_lo;
  int kv_end;
};

// The batch's query tiles are numbered flat: sequence b's tiles start at
// start(b) = qsl[b] / tokens_per_tile - qsl[0] / tokens_per_tile + b (monotonic in b; at least
// ceil(q_len_b / tokens_per_tile) of them before start(b + 1)), so the grid follows the batch's
// tokens, not batch x max_query_len, and a CTA finds its sequence by binary search.
// blockIdx.x = (split * num_kv_heads * head_chunks + kv_head * head_chunks + chunk) * tiles +
// (tiles - 1 - flat tile): the latest (longest) tiles go first, and CTAs running side by side
// read the same keys (one split). False (the whole CTA returns) for a tile past its sequence's
// tokens, or a split past the tile's keys. (The split merge runs one split's grid with a plan of
// splits = 1: w.kv_end is then the tile's whole key range.)
__device__ __forceinline__ int cta_split(const PagedPrefillArgs& a, const Plan& plan) {
  return blockIdx.x / (plan.tiles * a.num_kv_heads * plan.head_chunks);
}
__device__ __forceinline__ bool cta_work(const PagedPrefillArgs& a, const Plan& plan, Work& w) {
  const int split = cta_split(a, plan);
  int idx = blockIdx.x % (plan.tiles * a.num_kv_heads * plan.head_chunks);
  const int flat = plan.tiles - 1 - idx % plan.tiles;
  idx /= plan.tiles;
  const int chunk = idx % plan.head_chunks;
  w.kv_head = idx / plan.head_chunks;
  const int* qsl = a.query_start_loc;
  const int tile_len = plan.tokens_per_tile;
  const int base = qsl[0] / tile_len;
  int lo = 0, hi = a.batch - 1;  // the last b with start(b) <= flat
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qsl[mid] / tile_len - base + mid <= flat) lo = mid; else hi = mid - 1;
  }
  w.b = lo;
  w.first = qsl[w.b];
  w.q_len = qsl[w.b + 1] - w.first;
  w.tok0 = (flat - (w.first / tile_len - base + w.b)) * tile_len;
  if (w.tok0 >= w.q_len) return false;
  const int tokens = min(tile_len, w.q_len - w.tok0);
  const int ctx = min(max(a.context_lens[w.b], 0), plan.max_tokens);
  w.head0 = w.kv_head * plan.group_size + chunk * plan.chunk_heads;
  w.heads = min(plan.chunk_heads, plan.group_size - chunk * plan.chunk_heads);
  w.rows = tokens * w.heads;
  w.pos0 = ctx - w.q_len + w.tok0;
  w.kv_end = max(0, min(ctx, w.pos0 + tokens));
  // A sliding window: row r (position pos0 + r / heads) sees keys j > its position - window. The
  // tile's first row sees the earliest, so keys before its window are never read (their blocks
  // may have been freed and reused).
  const int window = a.sliding_window;
  const int window_lo = window > 0 && w.pos0 >= window ? w.pos0 - window + 1 : 0;
  if (plan.splits > 1) {
    const int split_begin = split * plan.keys_per_split;
    w.key_lo = max(split_begin, window_lo);
    w.key_begin = split_begin + (w.key_lo - split_begin) / kPrefillSplitKeyTile * kPrefillSplitKeyTile;
    w.kv_end = min(w.kv_end, split_begin + plan.keys_per_split);
    if (split > 0 && w.key_lo >= w.kv_end) return false;
  } else {
    w.key_begin = w.key_lo = window_lo;
  }
  return true;
}

// The CTA's kRows query rows into s_q [kRows][row_stride], zeros past w.rows.
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_q_tile(T* s_q, const PagedPrefillArgs& a, const Work& w) {
  constexpr int kVec = 16 / sizeof(T), kChunksPerRow = D / kVec, kLd = row_stride<T, D>();
  const T* q = static_cast<const T*>(a.q);
  for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kVec;
    const bool valid = r < w.rows;
    const T* src = valid ? q + (w.first + w.tok0 + r / w.heads) * a.q_stride_row +
                               (w.head0 + r % w.heads) * a.q_stride_h + col
                         : q;
    cp_async16(s_q + r * kLd + col, src, valid);
  }
}

// Calls piece(n, col, offset, valid) for each 16-byte piece of keys [key0, key0 + kKeys) of this
// kv head that this thread copies: tile row n, column col, and the piece's element offset in
// either cache (K and V share strides; 0 outside [w.key_lo, w.kv_end), whose table entries are
// never read).
template <typename T, int D, int kKeys, int kThreads, typename Piece>
__device__ __forceinline__ void for_each_kv_piece(int key0, const PagedPrefillArgs& a,
                                                  const Plan& plan, const Work& w, Piece piece) {
  constexpr int kVec = 16 / sizeof(T), kChunksPerRow = D / kVec;
  const int* table = a.block_tables + static_cast<int64_t>(w.b) * a.max_blocks;
  const int slot_mask = (1 << plan.block_shift) - 1;
  for (int c = threadIdx.x; c < kKeys * kChunksPerRow; c += kThreads) {
    const int n = c / kChunksPerRow, col = (c % kChunksPerRow) * kVec;
    const int key = key0 + n;
    const bool valid = key < w.kv_end && key >= w.key_lo;
    int64_t offset = 0;
    if (valid) {
      const int64_t block = __ldg(table + (key >> plan.block_shift));
      offset = block * a.cache_stride_block + (key & slot_mask) * a.cache_stride_token +
               w.kv_head * a.cache_stride_head + col;
    }
    piece(n, col, offset, valid);
  }
}

// Keys [key0, key0 + kKeys) of one cache into dst [kKeys][row_stride], zeros past w.kv_end.
template <typename T, int D, int kKeys, int kThreads>
__device__ __forceinline__ void load_kv_tile(T* dst, const T* cache, int key0,
                                             const PagedPrefillArgs& a, const Plan& plan,
                                             const Work& w) {
  constexpr int kLd = row_stride<T, D>();
  for_each_kv_piece<T, D, kKeys, kThreads>(key0, a, plan, w, [=](int n, int col, int64_t offset, bool valid) {
    cp_async16(dst + n * kLd + col, cache + offset, valid);
  });
}

// The same keys of both caches at once: each piece's table read and address serve K and V. The
// issue of these copies limits the tensor-core kernel: computing them once for both ran it
// 13-20% faster on an H100 (session 14) than two load_kv_tile calls.
template <typename T, int D, int kKeys, int kThreads>
__device__ __forceinline__ void load_kv_tiles(T* dst_k, T* dst_v, const T* k_cache, const T* v_cache,
                                              int key0, const PagedPrefillArgs& a, const Plan& plan,
                                              const Work& w) {
  constexpr int kLd = row_stride<T, D>();
  for_each_kv_piece<T, D, kKeys, kThreads>(key0, a, plan, w, [=](int n, int col, int64_t offset, bool valid) {
    cp_async16(dst_k + n * kLd + col, k_cache + offset, valid);
    cp_async16(dst_v + n * kLd + col, v_cache + offset, valid);
  });
}

// Where row r of the CTA (token r / heads, query head r % heads) writes its output.
template <typename T>
__device__ __forceinline__ T* output_row(const PagedPrefillArgs& a, const Work& w, int r) {
  return static_cast<T*>(a.out) + (w.first + w.tok0 + r / w.heads) * a.out_stride_row +
         (w.head0 + r % w.heads) * a.out_stride_h;
}

// Where row r of a split CTA leaves its partial in the workspace: [splits][num_tokens][num_q_heads]
// unnormalized outputs [head_dim], then as many (max, sum) pairs (log2 units; sum 0: no key seen).
struct SplitRow {
  float* out;     // [head_dim]
  float2* stats;  // (max, sum)
};
__device__ __forceinline__ SplitRow split_row(const PagedPrefillArgs& a, const Plan& plan,
                                              const Work& w, int r, int split) {
  const int64_t rows_per_split = static_cast<int64_t>(a.num_tokens) * a.num_q_heads;
  const int64_t row = split * rows_per_split +
                      static_cast<int64_t>(w.first + w.tok0 + r / w.heads) * a.num_q_heads +
                      w.head0 + r % w.heads;
  float2* stats = reinterpret_cast<float2*>(a.workspace + plan.splits * rows_per_split * a.head_dim);
  return {a.workspace + row * a.head_dim, stats + row};
}

// Max / sum over `width` consecutive lanes (a power of two <= 32).
template <int kWidth>
__device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
template <int kWidth>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace pagedkv::kernels::prefill
