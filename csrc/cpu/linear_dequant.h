// The CPU product shared by the quantized linears (linear_w4a16, linear_fp8, linear_nf4): the
// weight dequantized to fp32 by the format, one fp32 matrix product, rounded once to x's dtype,
// as the CUDA kernels accumulate.
#pragma once
#include <ATen/ATen.h>

namespace pagedkv {

// out [..., n] = x [..., k] @ w^T with w [n, k] float32 (arguments checked by the format).
inline void linear_dequantized_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  out.view({x2.size(0), w.size(0)}).copy_(at::mm(x2, w.t()));
}

}  // namespace pagedkv
