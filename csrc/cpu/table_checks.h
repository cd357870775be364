// Validation of block tables against context lengths, for the CPU attention ops (they read the
// tables on the host anyway; the CUDA launchers never read device memory).
#pragma once
#include <torch/types.h>

namespace pagedkv {

// block_tables [B, max_blocks] int32, context_lens [B] int32 on the CPU: every length fits the
// row, and every block a length covers is a block of the cache.
inline void check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t block_size, int64_t num_blocks) {
  const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
  const int* table = block_tables.const_data_ptr<int>();
  const int* lens = context_lens.const_data_ptr<int>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "pagedkv: context_lens[", b,
                "] is ", lens[b], "; allowed: 0 to max_blocks * block_size = ",
                max_blocks * block_size);
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int block = table[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "pagedkv: block_tables[", b, ", ", i,
                  "] is ", block, "; allowed: 0 to num_blocks - 1 = ", num_blocks - 1);
    }
  }
}

}  // namespace pagedkv
