// Argument checks of pagedkv::linear, shared by the CPU and CUDA implementations.
#pragma once
#include <optional>
#include <vector>

#include "checks.h"

namespace pagedkv {

// x [..., k] (last dim contiguous), weight [n, k] contiguous, bias [n], out [..., n] contiguous.
inline void check_linear_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_float_dtype(x, "x");
  check_same_dtype(weight, x, "weight", "x");
  check_same_dtype(out, x, "out", "x");
  check_same_device(weight, x, "weight", "x");
  check_same_device(out, x, "out", "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.stride(-1) == 1, "pagedkv: x must be [..., k] "
              "with k > 0 and its last dimension contiguous, got shape ", x.sizes(), " strides ",
              x.strides());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "pagedkv: weight must be [n, k] "
              "with k = x.size(-1) = ", x.size(-1), ", got ", weight.sizes());
  check_contiguous(weight, "weight");
  std::vector<int64_t> expected(x.sizes().begin(), x.sizes().end());
  expected.back() = weight.size(0);
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "pagedkv: out must have shape ",
              at::IntArrayRef(expected), ", got ", out.sizes());
  check_contiguous(out, "out");
  if (bias) {
    check_same_dtype(*bias, x, "bias", "x");
    check_same_device(*bias, x, "bias", "x");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "pagedkv: bias must be [n] = [",
                weight.size(0), "], got ", bias->sizes());
  }
}

}  // namespace pagedkv
