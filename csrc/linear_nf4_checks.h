// Argument checks of pagedkv::linear_nf4, shared by the CPU and CUDA implementations so both
// reject a bad call with the same message.
#pragma once
#include <vector>

#include "quant_linear_checks.h"

namespace pagedkv {

// out [..., n] = x [..., k] @ W^T with W[j, c] = code[q[j, c]] * absmax[j, c / block_size]:
// packed [n, k / 2] uint8 holding q two a byte, column 2b in the high nibble of byte b and 2b + 1
// in the low one (bitsandbytes' order), absmax [n, k / block_size] float32, code [16] float32
// (the NF4 codebook). block_size a positive even divisor of k: a block never spans two rows.
inline void check_linear_nf4_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                                  const at::Tensor& absmax, const at::Tensor& code, int64_t block_size) {
  const int64_t k = check_quant_linear_x(x);
  TORCH_CHECK(block_size > 0 && block_size % 2 == 0 && k % block_size == 0, "pagedkv: block_size ", block_size,
              " must be a positive even number that divides k = x.size(-1) = ", k);
  TORCH_CHECK(packed.scalar_type() == at::kByte, "pagedkv: packed has dtype ", packed.scalar_type(),
              "; it must be torch.uint8 (two 4-bit codes a byte)");
  check_same_device(packed, x, "packed", "x");
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) > 0 && packed.size(1) * 2 == k, "pagedkv: packed must be "
              "[n, k / 2] with k = x.size(-1) = ", k, ", got ", packed.sizes());
  check_contiguous(packed, "packed");
  const int64_t n = packed.size(0);
  const std::vector<int64_t> block_shape = {n, k / block_size};
  TORCH_CHECK(absmax.scalar_type() == at::kFloat, "pagedkv: absmax has dtype ", absmax.scalar_type(),
              "; it must be torch.float32");
  check_quant_linear_param(absmax, "absmax", x, "[n, k / block_size]", block_shape);
  TORCH_CHECK(code.scalar_type() == at::kFloat && code.dim() == 1 && code.size(0) == 16, "pagedkv: code must "
              "be the [16] float32 codebook, got ", code.sizes(), " ", code.scalar_type());
  check_same_device(code, x, "code", "x");
  check_contiguous(code, "code");
  check_linear_out(out, x, n);
}

}  // namespace pagedkv
