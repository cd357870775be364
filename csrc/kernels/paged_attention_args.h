// The arguments both paged attention kernels (decode, prefill) share: query rows, the paged K/V
// cache and its block tables. A row is a sequence in decode, a new token in prefill. Pointers are
// device pointers, strides count elements.
#pragma once
#include <cstdint>
#include <type_traits>

namespace pagedkv::kernels {

struct PagedAttentionArgs {
  void* out;                 // [rows, num_q_heads, head_dim], head_dim contiguous
  const void* q;             // [rows, num_q_heads, head_dim], head_dim contiguous
  const void* k_cache;       // [num_blocks, block_size, num_kv_heads, head_dim], strided below
  const void* v_cache;       // [num_blocks, block_size, num_kv_heads, head_dim], k_cache's strides
  const int* block_tables;   // [batch, max_blocks], contiguous
  const int* context_lens;   // [batch]: tokens of sequence b in the cache
  int64_t out_stride_row, out_stride_h;
  int64_t q_stride_row, q_stride_h;
  // Both caches' strides (multiples of 16 bytes; head_dim's is 1): token-major storage
  // [num_blocks, block_size, Hkv, D], or head-major [num_blocks, Hkv, block_size, D] seen
  // through transpose(1, 2).
  int64_t cache_stride_block, cache_stride_token, cache_stride_head;
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  // A query at position p sees keys j with p - j < sliding_window (0: every key up to p); scaled
  // scores become logit_softcap * tanh(score / logit_softcap) before the softmax (0: as they are).
  int sliding_window;
  float logit_softcap;
  // [num_q_heads] fp32 attention sinks (GPT-OSS), or null: head h's softmax denominator gains
  // exp(sinks[h]) and its output nothing (kernels/attention_sink.cuh folds it in at the end).
  const float* sinks;
  // An e4m3 cache's scales (one element each: K = float(k_cache) * *k_scale, V likewise), or both
  // null for a cache of q's dtype.
  const float* k_scale;
  const float* v_scale;
};
// Filled by the host compiler, read by nvcc's code: a POD keeps the two layouts identical (and the
// structs deriving from it put their own fields after its tail padding, never inside it).
static_assert(std::is_standard_layout_v<PagedAttentionArgs> &&
              std::is_trivially_copyable_v<PagedAttentionArgs>);

}  // namespace pagedkv::kernels
