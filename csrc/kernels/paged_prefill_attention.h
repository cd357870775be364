// Torch-free launcher of paged prefill attention: a flat batch of new tokens of several sequences
// (prompts, chunks of a chunked prefill, prefix-cache hits, decode-like single tokens) attends
// causally to each sequence's context, read from K/V cache blocks through a block table.
// Pointers are device pointers, strides count elements; the work is enqueued on `stream` and the
// launch status returned.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/paged_attention_args.h"
#include "kernels/paged_prefill_attention_plan.h"

namespace pagedkv::kernels {

struct PagedPrefillArgs : PagedAttentionArgs {  // rows = new tokens; context_lens counts them
  const int* query_start_loc;  // [batch + 1]: sequence b's new tokens are rows [qsl[b], qsl[b+1])
  int num_tokens;              // rows of q; query_start_loc[batch] <= num_tokens
  int max_query_len;           // host upper bound of qsl[b+1] - qsl[b] (with num_tokens, sizes the grid)
  int num_sms;                 // the device's SM count: how many rows a CTA takes
  // Splits of each query tile's keys: paged_prefill_num_splits(...) of these shapes
  // (paged_prefill_attention_plan.h), or 1. With more than 1, `workspace` holds
  // paged_prefill_workspace_floats(num_tokens, num_q_heads, head_dim, num_splits) floats, 16-byte
  // aligned; else it is unused (may be null).
  int num_splits;
  float* workspace;
  // (k_scale set, an e4m3 cache: only where paged_decode_tensor_cores(head_dim, q's bytes) holds.)
};

// head_dim in {64, 80, 96, 128, 256}; block_size a power of two in [8, 128]; num_q_heads a
// multiple of num_kv_heads. Row i of sequence b sits at position context_lens[b] - q_len_b + i and
// sees cache positions 0 .. that position (those within sliding_window of it, if set); a row
// before position 0 gets zeros.
cudaError_t paged_prefill_attention(const PagedPrefillArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
