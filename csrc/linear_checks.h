// Argument checks of pagedkv::linear and pagedkv::gate_up_silu, shared by the CPU and CUDA
// implementations.
#pragma once
#include <optional>
#include <vector>

#include "checks.h"

namespace pagedkv {

// x [..., k] (last dim contiguous), weight [n, k] contiguous, bias [n].
inline void check_linear_inputs(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  check_float_dtype(x, "x");
  check_same_dtype(weight, x, "weight", "x");
  check_same_device(weight, x, "weight", "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.stride(-1) == 1, "pagedkv: x must be [..., k] "
              "with k > 0 and its last dimension contiguous, got shape ", x.sizes(), " strides ",
              x.strides());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "pagedkv: weight must be [n, k] "
              "with k = x.size(-1) = ", x.size(-1), ", got ", weight.sizes());
  check_contiguous(weight, "weight");
  if (bias) {
    check_same_dtype(*bias, x, "bias", "x");
    check_same_device(*bias, x, "bias", "x");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "pagedkv: bias must be [n] = [",
                weight.size(0), "], got ", bias->sizes());
  }
}

// out [..., n] contiguous, same dtype and device as x.
inline void check_linear_out(const at::Tensor& out, const at::Tensor& x, int64_t n) {
  check_same_dtype(out, x, "out", "x");
  check_same_device(out, x, "out", "x");
  std::vector<int64_t> expected(x.sizes().begin(), x.sizes().end());
  expected.back() = n;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "pagedkv: out must have shape ",
              at::IntArrayRef(expected), ", got ", out.sizes());
  check_contiguous(out, "out");
}

inline void check_linear_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  check_linear_inputs(x, weight, bias);
  check_linear_out(out, x, weight.size(0));
}

// gate_up [2 * i, k]: the gate rows, then the up rows; out [..., i].
inline void check_gate_up_silu_args(const at::Tensor& out, const at::Tensor& x,
                                    const at::Tensor& gate_up) {
  check_linear_inputs(x, gate_up, std::nullopt);
  TORCH_CHECK(gate_up.size(0) % 2 == 0, "pagedkv: gate_up must be [2 * intermediate, k] (gate "
              "rows, then up rows), got ", gate_up.sizes());
  check_linear_out(out, x, gate_up.size(0) / 2);
}

}  // namespace pagedkv
