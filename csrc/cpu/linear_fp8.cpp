// CPU pagedkv::linear_fp8_weight through ATen: the FP8 weight dequantized to fp32 (each value
// times its block's fp32 scale, one rounding: the checkpoint formats' own dequantization), one
// fp32 matrix product, rounded once to x's dtype, as the CUDA kernel accumulates.
// dequantize_fp8 also serves the CUDA launcher's cuBLAS path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/linear_dequant.h"
#include "linear_fp8_checks.h"

namespace pagedkv {

// [..., n, k] float32 = weight * scales broadcast over their blocks (scales [..., ceil(n / block_n),
// ceil(k / block_k)]), on the tensors' device: a linear's weight, or a stack of experts'.
at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scales, int64_t block_n, int64_t block_k) {
  const int64_t n = weight.size(-2);
  const int64_t k = weight.size(-1);
  const at::Tensor s =
      scales.repeat_interleave(block_n, -2).slice(-2, 0, n).repeat_interleave(block_k, -1).slice(-1, 0, k);
  return weight.to(at::kFloat) * s;
}

void linear_fp8_weight_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                           int64_t block_n, int64_t block_k) {
  check_linear_fp8_args(out, x, weight, scales, block_n, block_k);
  linear_dequantized_cpu(out, x, dequantize_fp8(weight, scales, block_n, block_k));
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("linear_fp8_weight", &linear_fp8_weight_cpu); }

}  // namespace pagedkv
