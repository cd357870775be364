// CUDA launcher of moe_topk: check, guard the device, launch on the current stream. The kernel
// lives in csrc/kernels/moe_topk.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/moe_topk.h"
#include "moe_checks.h"

namespace pagedkv {

void moe_topk_cuda(at::Tensor& expert_ids, at::Tensor& weights, const at::Tensor& logits, bool normalize) {
  check_moe_topk_args(expert_ids, weights, logits);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  C10_CUDA_CHECK(kernels::moe_topk(expert_ids.data_ptr<int64_t>(), weights.data_ptr(),
                                   weights.scalar_type() == at::kFloat, logits.const_data_ptr(), logits.size(0),
                                   expert_ids.size(1), logits.size(1), normalize, kernel_dtype(logits),
                                   c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("moe_topk", &moe_topk_cuda); }

}  // namespace pagedkv
