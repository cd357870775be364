// Torch-free launcher of paged attention over an fp8 (e4m3) KV cache, for both ops: decode (one
// query row per sequence, at its last position) and prefill (sequence b's rows
// [query_start_loc[b], query_start_loc[b + 1]), the last of its context). Correctness first:
// CUDA cores, one warp per (query row, head), no key splits; the tensor-core paths of the 16-bit
// caches (which read K/V with ldmatrix) do not take fp8, and a fast fp8 path is later work.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/paged_attention_args.h"

namespace pagedkv::kernels {

struct PagedFp8Args : PagedAttentionArgs {
  const int* query_start_loc;  // [batch + 1] for prefill; nullptr: decode (row b = sequence b)
  int num_rows;                // rows of q and out
};

// q/out dtype `dtype`; caches e4m3 bytes. head_dim a multiple of 16 up to 256; block_size a power
// of two. A row before position 0, or with no key in its window, gets zeros; rows outside every
// sequence (prefill) are not written.
cudaError_t paged_attention_fp8(const PagedFp8Args& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
