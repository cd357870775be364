// CPU pagedkv::linear_int8 through ATen: the int8 weight dequantized to fp32 as bitsandbytes does
// (q * scb[row], then times 1 / 127), one fp32 matrix product, rounded once to x's dtype, as the
// CUDA kernel accumulates. dequantize_int8 also serves the CUDA launcher's cuBLAS path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/linear_dequant.h"
#include "linear_int8_checks.h"

namespace pagedkv {

// bitsandbytes' fp32 multiplier for 1 / 127 (int8_vectorwise_dequant)
constexpr double kInv127 = 7.874015718698502e-3;

// [n, k] float32 = q * scb[row] * (1 / 127), on the tensors' device.
at::Tensor dequantize_int8(const at::Tensor& q, const at::Tensor& scb) {
  return q.to(at::kFloat).mul(scb.unsqueeze(-1)).mul(at::scalar_tensor(kInv127, scb.options()));
}

void linear_int8_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scb) {
  check_linear_int8_args(out, x, q, scb);
  linear_dequantized_cpu(out, x, dequantize_int8(q, scb));
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("linear_int8", &linear_int8_cpu); }

}  // namespace pagedkv
