// Argument checks of pagedkv::linear_fp8_weight, shared by the CPU and CUDA implementations so
// both reject a bad call with the same message.
#pragma once
#include <vector>

#include "quant_linear_checks.h"

namespace pagedkv {

// out [..., n] = x [..., k] @ W^T with W[j, c] = weight[j, c] * scales[j / block_n, c / block_k]:
// weight [n, k] float8_e4m3fn, scales [ceil(n / block_n), ceil(k / block_k)] float32. One grid
// holds every FP8 checkpoint's scales: 128x128 blocks (FineGrainedFP8), per channel (block_n 1,
// block_k k), per tensor (block_n n, block_k k).
inline void check_linear_fp8_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& scales, int64_t block_n, int64_t block_k) {
  const int64_t k = check_quant_linear_x(x);
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "pagedkv: weight has dtype ", weight.scalar_type(),
              "; it must be torch.float8_e4m3fn");
  check_same_device(weight, x, "weight", "x");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) == k, "pagedkv: weight must be "
              "[n, k] with k = x.size(-1) = ", k, ", got ", weight.sizes());
  check_contiguous(weight, "weight");
  const int64_t n = weight.size(0);
  TORCH_CHECK(block_n > 0 && block_k > 0, "pagedkv: block (", block_n, ", ", block_k,
              ") must be two positive sizes (output rows, input columns) of a scale block");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "pagedkv: scales has dtype ", scales.scalar_type(),
              "; it must be torch.float32");
  const std::vector<int64_t> grid = {(n + block_n - 1) / block_n, (k + block_k - 1) / block_k};
  check_quant_linear_param(scales, "scales", x, "[ceil(n / block_n), ceil(k / block_k)]", grid);
  check_linear_out(out, x, n);
}

}  // namespace pagedkv
