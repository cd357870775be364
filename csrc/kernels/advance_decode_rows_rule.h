// What advance_decode_rows does to one row, shared by the CPU loop
// (csrc/cpu/advance_decode_rows.cpp) and the CUDA kernel (csrc/kernels/advance_decode_rows.cu).
// Plain C++ that nvcc and the host compiler both take.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace pagedkv::kernels {

struct DecodeRows {
  const int64_t* next_tokens;   // [batch]: the tokens just sampled
  int64_t* tokens;              // [batch]: the token each row feeds next (= next_tokens, 0
                                //   for an invalid -1)
  int32_t* positions;           // [batch]: +1 for live rows (context_lens > 0)
  int32_t* context_lens;        // [batch]: +1 for live rows; 0 marks a padding row
  int32_t* generated;           // [batch]: +1 for live rows
  int64_t* offsets;             // [batch]: +1 for every row (the sampler's counter)
  int32_t* slot_mapping;        // [batch]: the new position's cache slot; -1 if not live or
                                //   past the row's table
  const int32_t* block_tables;  // [batch, max_blocks]
  int batch, max_blocks, block_size;
};

PAGEDKV_HD void advance_row(const DecodeRows& r, int b) {
  // -1: the sampler found no distribution (NaN/inf logits); the host raises when it reads it,
  // but the step already queued must still embed a valid id.
  r.tokens[b] = r.next_tokens[b] < 0 ? 0 : r.next_tokens[b];
  r.offsets[b] += 1;
  int32_t slot = -1;
  if (r.context_lens[b] > 0) {
    const int32_t pos = r.positions[b] + 1;
    r.positions[b] = pos;
    r.context_lens[b] += 1;
    r.generated[b] += 1;
    const int32_t block = pos / r.block_size;
    if (block < r.max_blocks) {
      slot = r.block_tables[static_cast<int64_t>(b) * r.max_blocks + block] * r.block_size +
             pos % r.block_size;
    }
  }
  r.slot_mapping[b] = slot;
}

}  // namespace pagedkv::kernels
