// Argument checks shared by the quantized linears (linear_w4a16, linear_fp8_weight, linear_nf4):
// x, a scale-like tensor's device/shape/layout, and out (linear_checks.h's, as pagedkv::linear's).
#pragma once
#include <cstdint>

#include "checks.h"
#include "linear_checks.h"

namespace pagedkv {

// x [..., k], floating point, last dimension contiguous; returns k.
inline int64_t check_quant_linear_x(const at::Tensor& x) {
  check_float_dtype(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.stride(-1) == 1, "pagedkv: x must be [..., k] "
              "with k > 0 and its last dimension contiguous, got shape ", x.sizes(), " strides ",
              x.strides());
  return x.size(-1);
}

// t (dtype checked by the caller) on x's device, of `shape` (spelled `shape_text` for the user),
// contiguous.
inline void check_quant_linear_param(const at::Tensor& t, const char* name, const at::Tensor& x,
                                     const char* shape_text, at::IntArrayRef shape) {
  check_same_device(t, x, name, "x");
  TORCH_CHECK(t.sizes() == shape, "pagedkv: ", name, " must be ", shape_text, " = ", shape, ", got ", t.sizes());
  check_contiguous(t, name);
}

}  // namespace pagedkv
