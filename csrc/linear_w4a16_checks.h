// Argument checks of pagedkv::linear_w4a16, shared by the CPU and CUDA implementations so both
// reject a bad call with the same message.
#pragma once
#include <vector>

#include "quant_linear_checks.h"

namespace pagedkv {

// out [..., n] = x [..., k] @ W^T with W [n, k] = (q - zeros) * scales, groups of group_size
// input columns: packed [n, k / 8] int32 (column 8w + e of a row in bits 4e..4e+3 of its word w),
// scales [n, k / group_size] float16/bfloat16, zeros [n, k / group_size] uint8 (0..16: GPTQ's
// historical offset can make a zero 16), or zeros of the scales' dtype: W = (q - 8) * scales +
// zeros (torchao's tinygemm form). group_size a multiple of 32 dividing k, so a 16-byte piece of
// a row (32 columns) never straddles two groups.
inline void check_linear_w4a16_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                                    const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size) {
  const int64_t k = check_quant_linear_x(x);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0, "pagedkv: group_size ",
              group_size, " must be a positive multiple of 32 that divides k = x.size(-1) = ", k);
  TORCH_CHECK(packed.scalar_type() == at::kInt, "pagedkv: packed has dtype ", packed.scalar_type(),
              "; it must be torch.int32 (8 int4 values a word)");
  check_same_device(packed, x, "packed", "x");
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) > 0 && packed.size(1) * 8 == k, "pagedkv: packed "
              "must be [n, k / 8] with k = x.size(-1) = ", k, ", got ", packed.sizes());
  check_contiguous(packed, "packed");
  const int64_t n = packed.size(0);
  const std::vector<int64_t> group_shape = {n, k / group_size};
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kBFloat16,
              "pagedkv: scales has dtype ", scales.scalar_type(), "; allowed: torch.float16, torch.bfloat16");
  check_quant_linear_param(scales, "scales", x, "[n, k / group_size]", group_shape);
  TORCH_CHECK(zeros.scalar_type() == at::kByte || zeros.scalar_type() == scales.scalar_type(),
              "pagedkv: zeros has dtype ", zeros.scalar_type(), "; allowed: torch.uint8 (zero points) or the "
              "scales' dtype ", scales.scalar_type(), " (float zeros, added after scaling)");
  check_quant_linear_param(zeros, "zeros", x, "[n, k / group_size]", group_shape);
  check_linear_out(out, x, n);
}

}  // namespace pagedkv
