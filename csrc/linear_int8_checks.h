// Argument checks of pagedkv::linear_int8, shared by the CPU and CUDA implementations so both
// reject a bad call with the same message.
#pragma once
#include <vector>

#include "quant_linear_checks.h"

namespace pagedkv {

// out [..., n] = x [..., k] @ W^T with W[j, c] = q[j, c] * scb[j] / 127 (bitsandbytes' LLM.int8
// weight): q [n, k] int8, scb [n] float32 (each row's absmax).
inline void check_linear_int8_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q,
                                   const at::Tensor& scb) {
  const int64_t k = check_quant_linear_x(x);
  TORCH_CHECK(q.scalar_type() == at::kChar, "pagedkv: q has dtype ", q.scalar_type(), "; it must be torch.int8");
  check_same_device(q, x, "q", "x");
  TORCH_CHECK(q.dim() == 2 && q.size(0) > 0 && q.size(1) == k, "pagedkv: q must be [n, k] with k = x.size(-1) = ",
              k, ", got ", q.sizes());
  check_contiguous(q, "q");
  const int64_t n = q.size(0);
  TORCH_CHECK(scb.scalar_type() == at::kFloat, "pagedkv: scb has dtype ", scb.scalar_type(),
              "; it must be torch.float32");
  check_quant_linear_param(scb, "scb", x, "[n]", std::vector<int64_t>{n});
  check_linear_out(out, x, n);
}

}  // namespace pagedkv
