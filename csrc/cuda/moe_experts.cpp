// CUDA launchers of moe_gate_up_silu and moe_down_sum: check, guard the device, launch on the
// current stream. The kernels live in csrc/kernels/moe_experts.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "moe_checks.h"
#include "kernels/moe_experts.h"

namespace pagedkv {

void moe_gate_up_silu_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                           const at::Tensor& expert_ids) {
  check_moe_gate_up_silu_args(out, x, gate_up, expert_ids);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(kernels::moe_gate_up_silu(out.data_ptr(), x.const_data_ptr(), gate_up.const_data_ptr(),
                                           expert_ids.const_data_ptr<int64_t>(), x.size(0), expert_ids.size(1),
                                           gate_up.size(0), x.size(1), out.size(2), kernel_dtype(x),
                                           c10::cuda::getCurrentCUDAStream()));
}

void moe_down_sum_cuda(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                       const at::Tensor& expert_ids, const at::Tensor& weights) {
  check_moe_down_sum_args(out, act, down, expert_ids, weights);
  check_cuda(act, "act");
  const c10::cuda::CUDAGuard guard(act.device());
  C10_CUDA_CHECK(kernels::moe_down_sum(out.data_ptr(), act.const_data_ptr(), down.const_data_ptr(),
                                       expert_ids.const_data_ptr<int64_t>(), weights.const_data_ptr(),
                                       weights.scalar_type() == at::kFloat, act.size(0), act.size(1),
                                       down.size(0), down.size(1), act.size(2), kernel_dtype(act),
                                       c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("moe_gate_up_silu", &moe_gate_up_silu_cuda);
  m.impl("moe_down_sum", &moe_down_sum_cuda);
}

}  // namespace pagedkv
