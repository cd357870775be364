// CPU advance_decode_rows: the rule of csrc/kernels/decode_rows.h, a loop over rows.
#include <torch/library.h>

#include "kernel_checks.h"

namespace pagedkv {

void advance_decode_rows_cpu(const at::Tensor& next_tokens, const at::Tensor& tokens,
                             const at::Tensor& positions, const at::Tensor& context_lens,
                             const at::Tensor& generated, const at::Tensor& offsets,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             int64_t block_size) {
  check_advance_decode_rows_args(next_tokens, tokens, positions, context_lens, generated, offsets,
                                 slot_mapping, block_tables, block_size);
  const int64_t batch = block_tables.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* next = next_tokens.const_data_ptr<int64_t>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  int32_t* pos = positions.data_ptr<int32_t>();
  int32_t* lens = context_lens.data_ptr<int32_t>();
  int32_t* gen = generated.data_ptr<int32_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  int32_t* slots = slot_mapping.data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    tok[b] = next[b];
    off[b] += 1;
    int32_t slot = -1;
    if (lens[b] > 0) {
      pos[b] += 1;
      lens[b] += 1;
      gen[b] += 1;
      const int64_t block = pos[b] / block_size;
      if (block < max_blocks) {
        slot = static_cast<int32_t>(tables[b * max_blocks + block] * block_size + pos[b] % block_size);
      }
    }
    slots[b] = slot;
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("advance_decode_rows", &advance_decode_rows_cpu); }

}  // namespace pagedkv
