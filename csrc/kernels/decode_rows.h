// Torch-free launcher of advance_decode_rows: one decode step on for a batch whose rows have all
// their cache blocks reserved up front (generate()), in one launch. In PyTorch ops the same
// update is ~15 elementwise kernels of ~1 us each, a few % of a small model's step.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace pagedkv::kernels {

struct DecodeRows {
  const int64_t* next_tokens;   // [batch]: the tokens just sampled
  int64_t* tokens;              // [batch]: the token each row feeds next (= next_tokens)
  int32_t* positions;           // [batch]: +1 for live rows (context_lens > 0)
  int32_t* context_lens;        // [batch]: +1 for live rows; 0 marks a padding row
  int32_t* generated;           // [batch]: +1 for live rows
  int64_t* offsets;             // [batch]: +1 for every row (the sampler's counter)
  int32_t* slot_mapping;        // [batch]: the new position's cache slot; -1 if not live or
                                //   past the row's table
  const int32_t* block_tables;  // [batch, max_blocks]
  int batch, max_blocks, block_size;
};

cudaError_t advance_decode_rows(const DecodeRows& rows, cudaStream_t stream);

}  // namespace pagedkv::kernels
