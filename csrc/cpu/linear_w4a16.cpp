// CPU pagedkv::linear_w4a16 through ATen: the int4 weight dequantized to fp32 (exact: a small
// integer times a 16-bit scale), one fp32 matrix product, rounded once to x's dtype, as the CUDA
// kernel accumulates. dequantize_w4a16 also serves the CUDA launcher's cuBLAS path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/linear_dequant.h"
#include "linear_w4a16_checks.h"

namespace pagedkv {

// [n, k] float32 = (q - zeros) * scales from the checked packed/scales/zeros, on their device;
// float zeros (the scales' dtype): (q - 8) * scales + zeros, exact up to the one rounding of the add.
at::Tensor dequantize_w4a16(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                            int64_t group_size) {
  const int64_t n = packed.size(0);
  const int64_t k = packed.size(1) * 8;
  const at::Tensor shifts = at::arange(0, 32, 4, packed.options());                    // [8]
  const at::Tensor q = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(0xF);  // [n, k/8, 8]
  const at::Tensor q_groups = q.to(at::kFloat).view({n, k / group_size, group_size});
  const at::Tensor s = scales.to(at::kFloat).unsqueeze(-1);
  const at::Tensor z = zeros.to(at::kFloat).unsqueeze(-1);
  const at::Tensor w = zeros.scalar_type() == at::kByte ? (q_groups - z) * s : (q_groups - 8) * s + z;
  return w.view({n, k});
}

void linear_w4a16_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size) {
  check_linear_w4a16_args(out, x, packed, scales, zeros, group_size);
  linear_dequantized_cpu(out, x, dequantize_w4a16(packed, scales, zeros, group_size));
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("linear_w4a16", &linear_w4a16_cpu); }

}  // namespace pagedkv
