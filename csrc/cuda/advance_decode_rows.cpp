// CUDA launcher of advance_decode_rows: check, guard the device, launch on the current stream.
// The kernel lives in csrc/kernels/advance_decode_rows.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/advance_decode_rows.h"

namespace pagedkv {

void advance_decode_rows_cuda(const at::Tensor& next_tokens, const at::Tensor& tokens,
                              const at::Tensor& positions, const at::Tensor& context_lens,
                              const at::Tensor& generated, const at::Tensor& offsets,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              int64_t block_size) {
  const kernels::DecodeRows rows =
      checked_decode_rows(next_tokens, tokens, positions, context_lens, generated, offsets,
                          slot_mapping, block_tables, block_size);
  check_cuda(block_tables, "block_tables");
  const c10::cuda::CUDAGuard guard(block_tables.device());
  C10_CUDA_CHECK(kernels::advance_decode_rows(rows, c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("advance_decode_rows", &advance_decode_rows_cuda); }

}  // namespace pagedkv
