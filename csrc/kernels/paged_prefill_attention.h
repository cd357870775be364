// Torch-free launcher of paged prefill attention: a flat batch of new tokens of several sequences
// (prompts, chunks of a chunked prefill, prefix-cache hits, decode-like single tokens) attends
// causally to each sequence's context, read from K/V cache blocks through a block table.
// Pointers are device pointers, strides count elements; the work is enqueued on `stream` and the
// launch status returned.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

struct PagedPrefillArgs {
  void* out;                   // [num_tokens, num_q_heads, head_dim], head_dim contiguous
  const void* q;               // [num_tokens, num_q_heads, head_dim], head_dim contiguous
  const void* k_cache;         // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* v_cache;         // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const int* block_tables;     // [batch, max_blocks], contiguous
  const int* context_lens;     // [batch]: tokens of sequence b, its new ones included
  const int* query_start_loc;  // [batch + 1]: sequence b's new tokens are rows [qsl[b], qsl[b+1])
  int64_t out_stride_t, out_stride_h;
  int64_t q_stride_t, q_stride_h;
  int num_tokens;              // rows of q; query_start_loc[batch] <= num_tokens
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int max_query_len;           // host upper bound of qsl[b+1] - qsl[b] (with num_tokens, sizes the grid)
  float scale;
};

// head_dim in {64, 128, 256}; block_size a power of two in [8, 128]; num_q_heads a multiple
// of num_kv_heads. Row i of sequence b sits at position context_lens[b] - q_len_b + i and sees
// cache positions 0 .. that position; a row before position 0 gets zeros.
cudaError_t paged_prefill_attention(const PagedPrefillArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
