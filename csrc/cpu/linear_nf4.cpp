// CPU pagedkv::linear_nf4 through ATen: the NF4 weight dequantized to fp32 (codebook value times
// its block's absmax, one rounding: bitsandbytes' own dequantization), one fp32 matrix product,
// rounded once to x's dtype, as the CUDA kernel accumulates. dequantize_nf4 also serves the CUDA
// launcher's cuBLAS path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/linear_dequant.h"
#include "linear_nf4_checks.h"

namespace pagedkv {

// [n, k] float32 = code[q] * absmax per block, on the tensors' device.
at::Tensor dequantize_nf4(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& code,
                          int64_t block_size) {
  const int64_t n = packed.size(0);
  const int64_t k = packed.size(1) * 2;
  const at::Tensor bytes = packed.to(at::kInt);  // int32 indices: half the temporary of int64
  const at::Tensor q = at::stack({bytes.bitwise_right_shift(4), bytes.bitwise_and(0xF)}, -1).view({n, k});
  const at::Tensor values = code.index({q}).view({n, k / block_size, block_size});
  return (values * absmax.unsqueeze(-1)).view({n, k});
}

void linear_nf4_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                    const at::Tensor& code, int64_t block_size) {
  check_linear_nf4_args(out, x, packed, absmax, code, block_size);
  linear_dequantized_cpu(out, x, dequantize_nf4(packed, absmax, code, block_size));
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("linear_nf4", &linear_nf4_cpu); }

}  // namespace pagedkv
