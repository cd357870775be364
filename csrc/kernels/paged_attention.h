// Torch-free launcher of paged decode attention: one query token per sequence attends to its
// whole context, read from K/V cache blocks through a block table. Pointers are device pointers,
// strides count elements; the work is enqueued on `stream` and the launch status returned.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/paged_attention_plan.h"

namespace pagedkv::kernels {

struct PagedDecodeArgs {
  void* out;                 // [batch, num_q_heads, head_dim], head_dim contiguous
  const void* q;             // [batch, num_q_heads, head_dim], head_dim contiguous
  const void* k_cache;       // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* v_cache;       // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const int* block_tables;   // [batch, max_blocks], contiguous
  const int* context_lens;   // [batch]; 0 marks a padding row (written as zeros)
  float* workspace;          // paged_decode_workspace_floats(...) floats; unused if num_splits == 1
  int64_t out_stride_b, out_stride_h;
  int64_t q_stride_b, q_stride_h;
  int batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int num_splits;            // >= 1: thread blocks that share one (sequence, kv head)
  float scale;
};

// head_dim in {64, 128, 256}; block_size a power of two in [8, 128]; num_q_heads a multiple
// of num_kv_heads. Also launches the split-combine kernel when num_splits > 1.
cudaError_t paged_decode_attention(const PagedDecodeArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
