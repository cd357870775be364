// CPU advance_decode_rows: the rule of csrc/kernels/advance_decode_rows_rule.h, a loop over rows.
#include <torch/library.h>

#include "kernel_checks.h"
#include "kernels/advance_decode_rows_rule.h"

namespace pagedkv {

void advance_decode_rows_cpu(const at::Tensor& next_tokens, const at::Tensor& tokens,
                             const at::Tensor& positions, const at::Tensor& context_lens,
                             const at::Tensor& generated, const at::Tensor& offsets,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             int64_t block_size) {
  const kernels::DecodeRows rows =
      checked_decode_rows(next_tokens, tokens, positions, context_lens, generated, offsets,
                          slot_mapping, block_tables, block_size);
  for (int b = 0; b < rows.batch; ++b) kernels::advance_row(rows, b);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("advance_decode_rows", &advance_decode_rows_cpu); }

}  // namespace pagedkv
