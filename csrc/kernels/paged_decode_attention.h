// Torch-free launcher of paged decode attention: one query token per sequence attends to its
// whole context, read from K/V cache blocks through a block table. Pointers are device pointers,
// strides count elements; the work is enqueued on `stream` and the launch status returned.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/paged_attention_args.h"
#include "kernels/paged_decode_attention_plan.h"

namespace pagedkv::kernels {

// Rows are sequences; a context_lens of 0 marks a padding row, written as zeros.
struct PagedDecodeArgs : PagedAttentionArgs {
  float* workspace;  // paged_decode_workspace_floats(...) floats; unused if num_splits == 1
  int num_splits;    // >= 1: thread blocks that share one (sequence, kv head)
  int num_sms;       // the device's SM count: how wide a CTA to launch (paged_decode_warps)
  // [batch] int32, a permutation of the rows, or null: the CTAs of row_order[0] are launched
  // first (longest contexts first: a ragged batch of several waves then ends without a tail of
  // long rows started last).
  const int* row_order;
  // (k_scale set, an e4m3 cache: only where paged_decode_tensor_cores(head_dim, q's bytes) holds.)
};

// head_dim in {64, 80, 96, 128, 256}; block_size a power of two in [8, 128]; num_q_heads a
// multiple of num_kv_heads; sliding_window and logit_softcap as PagedAttentionArgs says (0: off).
// The last CTA of a split sequence to finish merges the splits (one launch).
cudaError_t paged_decode_attention(const PagedDecodeArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
